#!/usr/bin/env python3
"""lily against transformers (and MLX-LM), side by side in one run, on the same synthetic full-geometry weights


The checkpoint is written once with `lily synth --preset full --layout mlx` (skipped when present). lily runs
it as is (4-bit); transformers runs the same weights dequantized to bf16 (bench/hf_reference.py), kept loaded in
this process for the whole run; MLX-LM (`--engines lily,transformers,mlx_lm`, bench/mlx_reference.py) runs the
very same 4-bit checkpoint bytes. Each round runs every engine, the order alternating (even rounds in the
--engines order, odd rounds reversed: lily first, then last) so that drift (clocks, temperature) does not favour
one side:

  lily:          one `lily bench --model DIR --mode ... --lengths ... --contexts ... --reps 1 --json F` per round
                 (prefill of random ids at each length, its own warm-up; decode: `--steps` graph-replayed steps at
                 each context);
  transformers:  for each length L ascending, one prefill of L random ids (timed with CUDA events, cache kept,
                 logits of the last row only), then `--hf-steps` greedy decode steps through that cache (timed):
                 the prefill figure at L and the decode figure at context L come from the same call. A warm-up
                 (prefill 256 + 2 steps) runs once after loading;
  mlx_lm:        one `python3 bench/mlx_reference.py --model DIR bench ...` per round (its own process: loads the
                 checkpoint with mlx_lm.utils.load_model, warms up, then per length L ascending mlx-lm's own
                 generate_step: prefill of L random ids in pieces of 2,048 until the first token, then
                 `--mlx-steps` greedy decode steps at context L), on mlx's default device (gpu with mlx-cuda).

Per length: median, min and max over the rounds. A transformers length whose estimated time (from the previous
length, or from the same length in the previous round) exceeds --hf-cap-s (mlx_lm: --mlx-cap-s, from the previous
length) is recorded as "not reached (cap)",
and so are the longer ones; an out-of-memory error is recorded as such. --budget-s bounds the whole run: a round
(or a length) that would not fit is skipped and the JSON says so. The JSON is rewritten after every engine run, so
a run killed by its time limit keeps what it measured.

  python3 bench/run_bench.py --work /tmp/lily_bench --out bench/results/bench.json --budget-s 500
  python3 bench/run_bench.py --merge a.json b.json --out merged.json   # combine runs over different lengths
"""

import argparse
import gc
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

STANDARD = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
ENGINES = ("lily", "transformers", "mlx_lm")
STICKY = ("not reached", "out of memory", "failed")  # an mlx_lm length with such a status is not tried again
MODES = ("prefill", "decode")
KEY = {"prefill": "length", "decode": "context"}


def parse_lengths(s):
    out = []
    for x in filter(None, s.split(",")):
        x = x.strip().lower()
        mult = 1024 if x.endswith("k") else 1
        out.append(int(x.rstrip("k")) * mult)
    return sorted(set(out))


class Results:
    """Samples (tok/s per round) and statuses per engine, mode and length."""

    def __init__(self):
        self.samples = {e: {m: {} for m in MODES} for e in ENGINES}
        self.status = {e: {m: {} for m in MODES} for e in ENGINES}

    def add(self, engine, mode, length, tps):
        self.samples[engine][mode].setdefault(length, []).append(tps)

    def mark(self, engine, mode, length, status):
        self.status[engine][mode].setdefault(length, status)

    def table(self, engine, mode, lengths):
        rows = []
        for n in lengths:
            v = self.samples[engine][mode].get(n, [])
            row = {KEY[mode]: n}
            if v:
                row.update(tok_per_s=statistics.median(v), tok_per_s_min=min(v), tok_per_s_max=max(v), reps=v,
                           status="ok")
            else:
                row.update(tok_per_s=None, reps=[], status=self.status[engine][mode].get(n, "not run"))
            if v and n in self.status[engine][mode]:
                row["note"] = self.status[engine][mode][n]
            rows.append(row)
        return rows


def run_lily(args, lily, model_dir, modes, work, rnd, timeout):
    """One `lily bench` call (reps 1); returns (JSON dict or None, error string or None, wall seconds)."""
    jpath = work / f"lily_bench_round{rnd}.json"
    jpath.unlink(missing_ok=True)
    mode = "all" if len(modes) == 2 else modes[0]
    cmd = [lily, "bench", "--model", str(model_dir), "--mode", mode, "--reps", "1", "--steps", str(args.lily_steps),
           "--json", str(jpath)]
    if "prefill" in modes:
        cmd += ["--lengths", ",".join(map(str, args.prefill_lengths))]
    if "decode" in modes:
        cmd += ["--contexts", ",".join(map(str, args.decode_contexts))]
    cmd += args.lily_extra
    common.log("lily: " + " ".join(cmd))
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True,
                           timeout=max(1.0, timeout) if math.isfinite(timeout) else None)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s (budget)", time.perf_counter() - t0
    wall = time.perf_counter() - t0
    if r.returncode != 0 or not jpath.exists():
        return None, f"lily bench failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}", wall
    log = work / f"lily_bench_round{rnd}.log"
    log.write_text(r.stdout + r.stderr)  # the per-kernel tables; kept out of the console
    return json.loads(jpath.read_text()), None, wall


def run_mlx(args, model_dir, lengths_p, lengths_d, work, rnd, timeout):
    """One `mlx_reference.py bench` subprocess; returns (its JSON dict or None, error string or None, wall s).
    Its JSON is rewritten after every length, so a run killed at the budget keeps what it measured."""
    jpath = work / f"mlx_bench_round{rnd}.json"
    jpath.unlink(missing_ok=True)
    cmd = [args.mlx_python, str(Path(__file__).resolve().parent / "mlx_reference.py"), "--model", str(model_dir),
           "--prefill-step", str(args.mlx_prefill_step), "bench", "--steps", str(args.mlx_steps),
           "--cap-s", str(args.mlx_cap_s), "--json", str(jpath)]
    if lengths_p:
        cmd += ["--prefill-lengths", ",".join(map(str, lengths_p))]
    if lengths_d:
        cmd += ["--decode-contexts", ",".join(map(str, lengths_d))]
    if math.isfinite(timeout):
        cmd += ["--budget-s", f"{max(1.0, timeout - 5):.0f}"]
    common.log("mlx_lm: " + " ".join(cmd))
    t0 = time.perf_counter()
    err = None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True,
                           timeout=max(1.0, timeout) if math.isfinite(timeout) else None)
        (work / f"mlx_bench_round{rnd}.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            err = f"mlx_reference.py failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}"
    except subprocess.TimeoutExpired:
        err = f"timed out after {timeout:.0f} s (budget)"
    wall = time.perf_counter() - t0
    j = json.loads(jpath.read_text()) if jpath.exists() else None
    return j, err, wall


class HFRunner:
    """transformers' side of a round, with the per-length cap and the global budget."""

    def __init__(self, ref, args):
        self.ref, self.args = ref, args
        self.last_call = {}  # length -> (prefill s, decode s) of the latest round
        self.unreachable = {}  # length -> status, for every later round

    def estimate(self, n, prev):
        """Seconds a call at n should take: the same length's last time, else scaled from the previous length
        (prefill ~ n^1.3 to cover attention's growth, decode per step ~ flat)."""
        if n in self.last_call:
            p, d = self.last_call[n]
            return p + (d or 0)
        if prev is None:
            return 0.0
        n0, p0, d0 = prev
        return p0 * (n / n0) ** 1.3 + (d0 or 0) * 1.2

    def round(self, res, lengths, modes, deadline):
        args = self.args
        prev = None
        for n in lengths:
            want_p = "prefill" in modes and n in args.prefill_lengths
            want_d = "decode" in modes and n in args.decode_contexts
            if not (want_p or want_d):
                continue
            if n in self.unreachable:
                for m, w in (("prefill", want_p), ("decode", want_d)):
                    if w:
                        res.mark("transformers", m, n, self.unreachable[n])
                continue
            est = self.estimate(n, prev)
            if n not in self.last_call and est > args.hf_cap_s:  # the cap applies to lengths not yet measured
                status = f"not reached (cap: estimated {est:.3g} s > {args.hf_cap_s:g} s per call)"
                for m in lengths:
                    if m >= n:
                        self.unreachable[m] = status
                common.log(f"transformers: {n} and longer {status}")
                for m, w in (("prefill", want_p), ("decode", want_d)):
                    if w:
                        res.mark("transformers", m, n, status)
                continue
            if time.monotonic() + est > deadline:
                common.log(f"transformers: {n} skipped this round (budget: estimated {est:.0f} s)")
                for m, w in (("prefill", want_p), ("decode", want_d)):
                    if w:
                        res.mark("transformers", m, n, "skipped (budget)")
                return False
            steps = args.hf_steps if want_d else 0
            try:
                p_s, d_s = self.ref.prefill_and_decode(n, steps, seed=n)
            except Exception as e:  # torch.cuda.OutOfMemoryError and friends: record, stop growing
                import torch

                oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()
                status = "out of memory" if oom else f"failed: {type(e).__name__}: {str(e)[:300]}"
                common.log(f"transformers at {n}: {status}")
                for m in lengths:
                    if m >= n:
                        self.unreachable[m] = status
                for m, w in (("prefill", want_p), ("decode", want_d)):
                    if w:
                        res.mark("transformers", m, n, status)
                gc.collect()
                self.ref.release()
                continue
            self.last_call[n] = (p_s, d_s)
            prev = (n, p_s, d_s)
            msg = f"transformers {n}: prefill {n / p_s:.1f} tok/s ({p_s:.2f} s)"
            if want_p:
                res.add("transformers", "prefill", n, n / p_s)
            if want_d:
                res.add("transformers", "decode", n, steps / d_s)
                msg += f", decode {steps / d_s:.2f} tok/s ({steps} steps)"
            common.log(msg)
        return True


def merge(paths, out):
    """Combine run_bench JSONs (e.g. runs over different lengths): per engine, mode and length the entry with
    the most repetitions wins; the stamps and notes of every input are kept."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(runs[0])
    merged["merged_from"] = [{"file": str(p), "stamp": r.get("stamp"), "notes": r.get("notes")}
                             for p, r in zip(paths, runs)]
    for e in ENGINES:
        if not any(r.get("engines", {}).get(e) for r in runs):
            continue
        for m in MODES:
            best = {}
            for r in runs:
                for row in r.get("engines", {}).get(e, {}).get(m, []) or []:
                    n = row[KEY[m]]
                    if n not in best or len(row.get("reps", [])) > len(best[n].get("reps", [])):
                        best[n] = row
            merged.setdefault("engines", {}).setdefault(e, {})[m] = [best[n] for n in sorted(best)]
    common.write_json(out, merged)
    common.log(f"merged {len(paths)} runs into {out}")


def print_table(result):
    engines = [e for e in ENGINES if e in result["engines"]]
    others = [e for e in engines if e != "lily"] if "lily" in engines else []
    for m in MODES:
        print(f"\n{m}: tok/s, median [min, max] over rounds")
        print("| " + " | ".join([KEY[m]] + engines + [f"lily / {o}" for o in others]) + " |")
        print("|---" * (1 + len(engines) + len(others)) + "|")
        rows = {e: {r[KEY[m]]: r for r in result["engines"][e].get(m, [])} for e in engines}
        for n in sorted(set().union(*rows.values())):
            cells = []
            for e in engines:
                r = rows[e].get(n)
                if r and r.get("tok_per_s") is not None:
                    cells.append(f"{r['tok_per_s']:.1f} [{r['tok_per_s_min']:.1f}, {r['tok_per_s_max']:.1f}] "
                                 f"(n={len(r['reps'])})")
                else:
                    cells.append(r["status"] if r else "-")
            a = rows.get("lily", {}).get(n)
            for o in others:
                b = rows[o].get(n)
                cells.append(f"{a['tok_per_s'] / b['tok_per_s']:.1f}x" if a and b and a.get("tok_per_s")
                             and b.get("tok_per_s") else "")
            print(f"| {n} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lily", help="lily binary (default build-cuda/lily, else build/lily)")
    ap.add_argument("--work", default="/tmp/lily_bench", help="directory for the checkpoint and scratch files")
    ap.add_argument("--preset", default="full", help="synthetic preset written with lily synth (full)")
    ap.add_argument("--model", help="use this mlx checkpoint directory instead of writing a synthetic one")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, order alternating (>= 5 for the report)")
    ap.add_argument("--modes", default="prefill,decode")
    ap.add_argument("--prefill-lengths", type=parse_lengths, default=STANDARD, help="e.g. 256,1k,4k,128k")
    ap.add_argument("--decode-contexts", type=parse_lengths, default=STANDARD)
    ap.add_argument("--lily-steps", type=int, default=64, help="decode steps per context in lily bench")
    ap.add_argument("--lily-extra", default="", help="extra arguments for lily bench (space-separated)")
    ap.add_argument("--hf-steps", type=int, default=8, help="decode steps per context for transformers")
    ap.add_argument("--hf-cap-s", type=float, default=60.0, help="longest transformers call (prefill + decode)")
    ap.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hf-experts", default=None, help="transformers experts_implementation (default: its own)")
    ap.add_argument("--device", default=None, help="torch device (default cuda when available)")
    ap.add_argument("--mlx-steps", type=int, default=32, help="decode steps per context for mlx_lm")
    ap.add_argument("--mlx-cap-s", type=float, default=60.0, help="longest mlx_lm call (prefill + decode)")
    ap.add_argument("--mlx-prefill-step", type=int, default=2048, help="mlx-lm's prefill_step_size")
    ap.add_argument("--mlx-python", default=sys.executable,
                    help="python for bench/mlx_reference.py (default this one; mlx and mlx-lm on its path)")
    ap.add_argument("--engines", default="lily,transformers", help="comma-separated: lily, transformers, mlx_lm; "
                    "the order of even rounds (odd rounds reversed)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the whole run")
    ap.add_argument("--sha", help="git SHA to stamp when git is not available")
    ap.add_argument("--out", required=True, help="output JSON")
    ap.add_argument("--merge", nargs="+", help="merge these run_bench JSONs into --out and exit")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    args.lily_extra = args.lily_extra.split()
    t_start = time.monotonic()
    deadline = t_start + args.budget_s if args.budget_s else math.inf
    modes = [m for m in MODES if m in args.modes.split(",")]
    engines = [e for e in args.engines.split(",") if e]
    if not engines or len(set(engines)) != len(engines) or any(e not in ENGINES for e in engines):
        sys.exit(f"--engines: distinct names among {', '.join(ENGINES)}")
    if not args.prefill_lengths or "prefill" not in modes:
        args.prefill_lengths = [] if "prefill" not in modes else args.prefill_lengths
    if "decode" not in modes:
        args.decode_contexts = []
    lengths = sorted(set(args.prefill_lengths) | set(args.decode_contexts))
    lily = common.find_lily(args.lily)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    notes = []
    if args.rounds < 5:
        notes.append(f"{args.rounds} rounds requested (the report asks for >= 5)")

    result = {"stamp": common.stamp(args.sha), "config": {
        "rounds": args.rounds, "modes": modes, "prefill_lengths": args.prefill_lengths,
        "decode_contexts": args.decode_contexts, "lily_steps": args.lily_steps, "hf_steps": args.hf_steps,
        "hf_cap_s": args.hf_cap_s, "mlx_steps": args.mlx_steps, "mlx_cap_s": args.mlx_cap_s,
        "mlx_prefill_step": args.mlx_prefill_step, "budget_s": args.budget_s, "engines": engines,
        "order": f"even rounds {', '.join(engines)}; odd rounds {', '.join(engines[::-1])}"},
        "engines": {}, "notes": notes}
    res = Results()

    def save(rounds_done):
        result["rounds_done"] = rounds_done
        result["wall_s"] = time.monotonic() - t_start
        for e in engines:
            result["engines"].setdefault(e, {})
            for m in MODES:
                result["engines"][e][m] = res.table(e, m, args.prefill_lengths if m == "prefill"
                                                    else args.decode_contexts)
        common.write_json(args.out, result)

    if args.model:
        model_dir = Path(args.model)
    else:
        model_dir = common.ensure_checkpoint(lily, args.preset, "mlx", work / f"{args.preset}_mlx")
    result["model"] = {"dir": str(model_dir), "preset": None if args.model else args.preset,
                       "lily": "4-bit mlx checkpoint as is",
                       "transformers": f"same weights dequantized (w = scale*q + bias) to {args.hf_dtype}",
                       "mlx_lm": "the same 4-bit checkpoint bytes (mlx_lm.utils.load_model), checkpoint dtype"}

    hf = None
    if "transformers" in engines:
        import torch

        import hf_reference

        common.log(f"transformers: loading {model_dir} ({args.hf_dtype})")
        ref = hf_reference.load_reference(model_dir, args.device, getattr(torch, args.hf_dtype),
                                          experts_implementation=args.hf_experts)
        common.log(f"transformers: loaded in {ref.info['load_s']:.1f} s ({ref.info['weight_bytes'] / 1e9:.1f} GB); "
                   f"{ref.info['gated_delta_path']}")
        ref.prefill_and_decode(256, 2)  # warm-up
        result["engines"]["transformers"] = {"info": ref.info}
        hf = HFRunner(ref, args)

    round_wall = {}  # engine -> wall seconds of its latest round
    rounds_done = 0
    for rnd in range(args.rounds):
        order = engines if rnd % 2 == 0 else engines[::-1]
        est = sum(round_wall.get(e, 0) for e in engines)
        if rnd > 0 and time.monotonic() + est > deadline:
            notes.append(f"stopped after {rnd} rounds: the next would need ~{est:.0f} s, "
                         f"{max(0, deadline - time.monotonic()):.0f} s of the budget left")
            common.log(notes[-1])
            break
        complete, out_of_budget = True, False
        for e in order:
            t0 = time.monotonic()
            if e == "lily":
                j, err, wall = run_lily(args, lily, model_dir, modes, work, rnd, deadline - time.monotonic())
                if err:
                    for m in modes:
                        for n in (args.prefill_lengths if m == "prefill" else args.decode_contexts):
                            res.mark("lily", m, n, f"failed: {err[:300]}")
                    notes.append(f"round {rnd}: lily: {err}")
                    common.log(notes[-1])
                    complete = False
                    out_of_budget = out_of_budget or "budget" in err
                else:
                    info = {k: v for k, v in j.items() if k not in ("prefill", "decode", "kernels", "prefill_kernels")}
                    result["engines"].setdefault("lily", {})["info"] = info
                    result["engines"]["lily"].setdefault("kernels_by_round", []).append(
                        {k: j[k] for k in ("kernels", "prefill_kernels") if k in j})
                    for m in modes:
                        for row in j.get(m, []):
                            res.add("lily", m, row[KEY[m]], row["tok_per_s"])
                    common.log(f"lily round {rnd}: {wall:.1f} s wall (load included); output in "
                               f"{work / f'lily_bench_round{rnd}.log'}")
            elif e == "mlx_lm":
                mlx_unreachable = {}  # length -> sticky status from earlier rounds
                for m in modes:
                    for row in res.status["mlx_lm"][m].items():
                        if row[1].startswith(STICKY):
                            mlx_unreachable[row[0]] = row[1]
                want_p = [n for n in args.prefill_lengths if n not in mlx_unreachable]
                want_d = [n for n in args.decode_contexts if n not in mlx_unreachable]
                if want_p or want_d:
                    j, err, wall = run_mlx(args, model_dir, want_p, want_d, work, rnd, deadline - time.monotonic())
                    if j is None and err is None:
                        err = "mlx_reference.py wrote no JSON"
                else:
                    j, err, wall = {}, None, 0.0
                if j:
                    result["engines"].setdefault("mlx_lm", {})["info"] = j["info"]
                    result["stamp"].update(mlx=j["info"].get("mlx_version"), mlx_lm=j["info"].get("mlx_lm_version"),
                                           mlx_device=j["info"].get("device"))
                    for m in modes:
                        for row in j.get(m, []):
                            res.add("mlx_lm", m, row[KEY[m]], row["tok_per_s"])
                    for n, status in j.get("status", {}).items():
                        for m, lens in (("prefill", want_p), ("decode", want_d)):
                            if int(n) in lens:
                                res.mark("mlx_lm", m, int(n), status)
                        if status.startswith("skipped"):
                            complete, out_of_budget = False, True
                if err:
                    notes.append(f"round {rnd}: mlx_lm: {err}")
                    common.log(notes[-1])
                    complete = False
                    out_of_budget = out_of_budget or "budget" in err
                    measured = {(m, row[KEY[m]]) for m in modes for row in (j or {}).get(m, [])}
                    for m, lens in (("prefill", want_p), ("decode", want_d)):
                        for n in lens:
                            if (m, n) not in measured:
                                res.mark("mlx_lm", m, n, f"failed: {err[:300]}")
                common.log(f"mlx_lm round {rnd}: {wall:.1f} s wall (load included); output in "
                           f"{work / f'mlx_bench_round{rnd}.log'}")
                for m in modes:
                    for n, status in mlx_unreachable.items():
                        res.mark("mlx_lm", m, n, status)
            else:
                if hf.ref.device.type == "cuda":
                    import torch

                    torch.cuda.synchronize()
                if not hf.round(res, lengths, modes, deadline):
                    complete, out_of_budget = False, True
                    notes.append(f"round {rnd}: transformers stopped early (budget)")
                hf.ref.release()
            round_wall[e] = time.monotonic() - t0
            save(rounds_done)
        rounds_done += complete
        if out_of_budget:
            break
    if "transformers" in engines:
        by_status = {}
        for n, status in sorted(hf.unreachable.items()):
            by_status.setdefault(status, []).append(str(n))
        for status, ns in by_status.items():
            notes.append(f"transformers at {', '.join(ns)}: {status}")
    if "mlx_lm" in engines:
        by_status = {}
        for m in modes:
            for n, status in sorted(res.status["mlx_lm"][m].items()):
                if status.startswith(STICKY):
                    by_status.setdefault(status, set()).add(n)
        for status, ns in by_status.items():
            notes.append(f"mlx_lm at {', '.join(map(str, sorted(ns)))}: {status}")
    result["gpu_at_end"] = common.gpu_info()  # clocks after the run, against the stamp's before
    save(rounds_done)
    print_table(result)
    common.log(f"done: {rounds_done} complete rounds in {time.monotonic() - t_start:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
