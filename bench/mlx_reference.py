#!/usr/bin/env python3
"""MLX-LM (the published engine's own baseline) on the very 4-bit checkpoint bytes lily reads: the third engine
of bench/run_bench.py.

lily's mlx layout is mlx-lm's own `convert` format (config.json's "quantization": 4 bits, group 64, 8 bits for
mlp.gate and shared_expert_gate), so mlx-lm loads a lily checkpoint directory as is:
`mlx_lm.utils.load_model(dir)` (no tokenizer needed; `lily synth --no-tokenizer` writes none), which quantizes the
modules the config names and reads the uint32/bf16 triples unchanged. Activations run in the checkpoint's dtype
(bf16) unless --dtype float32.

Timing follows mlx-lm's own generate loop, `mlx_lm.generate.generate_step` (greedy sampler):
  - prefill of n random ids: the prompt goes through the model in pieces of `prefill_step_size` (mlx-lm's default
    2,048) with the cache states evaluated after each, then the last id gives the first token; the prefill time is
    from the call until that token is evaluated (what mlx-lm reports as prompt tok/s);
  - decode at context n: the next `steps` greedy tokens through the same cache, each step's graph built and
    dispatched (mx.async_eval) while the previous one runs, as mlx-lm does; timed from the first token until the
    `steps`-th further token is evaluated.
Both run on mlx's default device (`mx.default_device()`: gpu with the CUDA build, cpu with mlx[cpu]); the stream
is drained (mx.synchronize) before each timed region.

Use as a module (`load_reference(dir)` -> MLXReference with prefill / decode / prefill_and_decode / logits /
release, as bench/hf_reference.py's HFReference), or as a program:
  mlx_reference.py --model DIR [--dtype float32] smoke [--golden DIR]   # device, prefill + decode, logits
  mlx_reference.py --model DIR bench --prefill-lengths 256,1k --decode-contexts 256,1k --steps 32 --json F
  mlx_reference.py --model DIR --dtype float32 check --lily build/lily --positions 192   # logits vs lily score
run_bench.py runs `bench` in a subprocess once per round (its own process: the model's memory is returned when it
exits, and neither torch nor lily shares its address space).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _mlx():
    import mlx.core as mx

    return mx


def device_info():
    """mlx's version, default device and its name (mx.device_info()), and whether the CUDA backend is there."""
    mx = _mlx()
    import mlx_lm

    info = {"mlx_version": mx.__version__, "mlx_lm_version": mlx_lm.__version__,
            "device": str(mx.default_device())}
    try:
        info["device_info"] = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                               for k, v in mx.device_info().items()}
    except Exception as e:  # older mlx: no device_info
        info["device_info"] = f"unavailable: {e}"
    cuda = getattr(mx, "cuda", None)
    info["cuda_available"] = bool(cuda.is_available()) if cuda is not None else False
    # mlx_lm.models.gated_delta.gated_delta_update: its fused kernel is an mx.fast.metal_kernel, so off Metal
    # (CUDA, CPU) every Gated DeltaNet layer runs gated_delta_ops, a Python loop of per-token ops.
    metal = getattr(mx, "metal", None)
    info["gated_delta_path"] = ("metal kernel (gated_delta_kernel)" if metal is not None and metal.is_available()
                                and mx.default_device() == mx.gpu else
                                "gated_delta_ops: per-token ops loop (mlx-lm's fused kernel is Metal-only)")
    return info


def gpu_memory_guard(model_dir, margin=8 << 30):
    """On mlx's GPU device: mlx's CUDA backend puts arrays made on the host (the loaded weights) in managed
    memory when the device supports it, and managed memory must never exceed what the card has free (a GPU
    shared with the transformers process of run_bench.py can hang otherwise). Refuse to load unless the free
    memory (nvidia-smi) holds the checkpoint plus `margin`; then cap mlx's memory limit (the point where its
    allocator gives cached buffers back) at the free memory less the margin. Returns a dict for `info`."""
    mx = _mlx()
    if mx.default_device() != mx.gpu:
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits",
                              "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split(",")
        free, total = int(out[0]) << 20, int(out[1]) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise RuntimeError(f"cannot read the GPU's free memory with nvidia-smi ({e}): not loading") from e
    need = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    if free < need + margin:
        raise RuntimeError(f"GPU memory: {free / 2**30:.1f} GiB free < {need / 2**30:.1f} GiB of weights + "
                           f"{margin / 2**30:.0f} GiB: not loading (mlx allocates them in managed memory)")
    limit = min(mx.get_memory_limit() if hasattr(mx, "get_memory_limit") else free, free - margin)
    mx.set_memory_limit(limit)
    return {"gpu_free_at_start_bytes": free, "gpu_total_bytes": total, "mlx_memory_limit_bytes": limit}


class MLXReference:
    def __init__(self, model_dir, dtype=None, prefill_step=2048):
        mx = _mlx()
        from mlx_lm.utils import load_model

        guard = gpu_memory_guard(model_dir)
        t0 = time.perf_counter()
        self.model, self.config = load_model(Path(model_dir))
        if dtype == "float32":
            self.model.set_dtype(mx.float32)
        mx.eval(self.model.parameters())
        mx.synchronize()
        load_s = time.perf_counter() - t0
        text = self.config.get("text_config", self.config)
        self.vocab = int(text["vocab_size"])
        self.prefill_step = prefill_step
        n_bytes = sum(v.nbytes for _, v in _flatten(self.model.parameters()))
        quant = self.config.get("quantization")
        self.info = dict(device_info(), **{
            "weights": (f"mlx {quant.get('bits')}-bit affine checkpoint as is (mlx_lm.utils.load_model)"
                        if quant else "checkpoint tensors as stored (mlx_lm.utils.load_model)"),
            "activations": dtype or "checkpoint dtype",
            "prefill_step_size": prefill_step,
            "generate": "mlx_lm.generate.generate_step, greedy, async_eval pipelined decode (mlx-lm's own loop)",
            "weight_bytes": n_bytes,
            "load_s": load_s,
            "layers": int(text["num_hidden_layers"]),
        }, **guard)

    def _ids(self, n, seed):
        mx = _mlx()
        return mx.array(np.random.default_rng(seed).integers(0, self.vocab, n).astype(np.int32))

    def _drain(self):
        mx = _mlx()
        from mlx_lm.generate import generation_stream

        mx.synchronize()
        mx.synchronize(generation_stream)

    def prefill(self, n, seed=0, max_steps=1 << 20):
        """One prefill of n random ids through mlx-lm's generate_step, timed until the first token is evaluated;
        returns (seconds, the running generator (it holds the cache), first token). The generator may go on for
        `max_steps` decode steps (`decode`)."""
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        prompt = self._ids(n, seed)
        cache = make_prompt_cache(self.model)
        self._drain()
        t0 = time.perf_counter()
        gen = generate_step(prompt, self.model, max_tokens=max_steps + 1, prompt_cache=cache,
                            prefill_step_size=self.prefill_step)
        first, _ = next(gen)
        return time.perf_counter() - t0, gen, first

    def decode(self, gen, last_token, steps):
        """`steps` greedy decode steps of a generator from `prefill` (mlx-lm's pipelined loop: each step is
        dispatched while the previous one runs); returns seconds until the last of them is evaluated."""
        t0 = time.perf_counter()
        for _ in range(steps):
            next(gen)
        return time.perf_counter() - t0

    def prefill_and_decode(self, n, steps, seed=0):
        """Prefill n random ids (timed), then `steps` greedy decode steps at context n (timed): (prefill s,
        decode s or None)."""
        p_s, gen, first = self.prefill(n, seed, max_steps=steps)
        d_s = self.decode(gen, first, steps) if steps > 0 else None
        gen.close()
        self._drain()
        del gen
        self.release()
        return p_s, d_s

    def logits(self, ids):
        """Teacher-forced fp32 logits [T, V] of one uncached forward over `ids`."""
        mx = _mlx()
        out = self.model(mx.array([list(ids)], dtype=mx.int32))[0].astype(mx.float32)
        mx.eval(out)
        return np.array(out)

    def release(self):
        _mlx().clear_cache()


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def load_reference(model_dir, dtype=None, prefill_step=2048):
    return MLXReference(model_dir, dtype, prefill_step)


def warm_lengths(lengths, prefill_step):
    """One short length per distinct prefill piece shape the run will use (pieces of prefill_step_size and a
    remainder): mlx compiles kernels per shape on first use, which must not land in a timed call."""
    return sorted({min(n, 2 * prefill_step) for n in lengths})


def run_bench(ref, prefill_lengths, decode_contexts, steps, cap_s, deadline, json_path, warmup=True):
    """Each length L ascending: one prefill of L ids, then `steps` decode steps at context L when L is a decode
    context. A length whose estimated time (scaled from the previous: prefill ~ L^1.3, decode ~ flat) exceeds
    cap_s is "not reached (cap)", with every longer one; an out-of-memory error stops growth; `deadline`
    (time.monotonic) bounds the run. The JSON is rewritten after every length."""
    result = {"info": ref.info, "prefill": [], "decode": [], "status": {}}
    lengths = sorted(set(prefill_lengths) | set(decode_contexts))
    if warmup:
        t0 = time.perf_counter()
        for n in warm_lengths(lengths, ref.prefill_step):
            ref.prefill_and_decode(n, 2, seed=1)
        result["info"]["warmup_s"] = time.perf_counter() - t0
    prev, stop = None, None
    for n in lengths:
        want_p, want_d = n in prefill_lengths, n in decode_contexts
        if stop is None:
            est = 0.0 if prev is None else prev[1] * (n / prev[0]) ** 1.3 + (prev[2] or 0) * 1.2
            if est > cap_s:
                stop = f"not reached (cap: estimated {est:.3g} s > {cap_s:g} s per call)"
            elif time.monotonic() + est > deadline:
                stop = "skipped (budget)"
        if stop is not None:
            result["status"][str(n)] = stop
            continue
        try:
            p_s, d_s = ref.prefill_and_decode(n, steps if want_d else 0, seed=n)
        except Exception as e:  # mlx raises RuntimeError / MemoryError when an allocation fails
            oom = isinstance(e, MemoryError) or "memory" in str(e).lower()
            stop = "out of memory" if oom else f"failed: {type(e).__name__}: {str(e)[:300]}"
            result["status"][str(n)] = stop
            ref.release()
            continue
        prev = (n, p_s, d_s)
        msg = f"mlx_lm {n}: prefill {n / p_s:.1f} tok/s ({p_s:.2f} s)"
        if want_p:
            result["prefill"].append({"length": n, "tok_per_s": n / p_s, "seconds": p_s})
        if want_d:
            result["decode"].append({"context": n, "tok_per_s": steps / d_s, "seconds": d_s, "steps": steps})
            msg += f", decode {steps / d_s:.2f} tok/s ({steps} steps)"
        common.log(msg)
        result["info"]["peak_memory_bytes"] = _mlx().get_peak_memory()
        if json_path:
            common.write_json(json_path, result)
    if json_path:
        common.write_json(json_path, result)
    return result


def check_against_lily(ref, model_dir, lily, positions, seed, backend, work):
    """Teacher-forced logits of mlx-lm and of `lily score` on the same random ids: the weights must be read the
    same (figures of bench/fidelity.py's compare)."""
    import fidelity  # bench/fidelity.py: lily_score and compare

    ids = np.random.default_rng(seed).integers(0, ref.vocab, positions + 1).tolist()
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    ids_file = work / f"mlx_check_ids_{seed}_{len(ids)}.txt"
    ids_file.write_text(" ".join(map(str, ids)) + "\n")
    t0 = time.perf_counter()
    mlx_logits = ref.logits(ids)
    mlx_s = time.perf_counter() - t0
    _, lily_logits = fidelity.lily_score(lily, model_dir, ids_file, backend, work, "mlx_check")
    figures = fidelity.compare(lily_logits, mlx_logits, ids)
    figures["mlx_forward_s"] = mlx_s
    figures["lily_backend"] = backend
    return figures


def smoke(ref, golden_dir=None):
    """Device, one short prefill + decode, and (when a golden directory is given: tests/fixtures/golden/mlx_small,
    mlx-lm's own fp32 forward on the CPU over golden.json's token_ids) the logits against that logits file."""
    out = {"info": ref.info}
    ref.prefill_and_decode(256, 2)  # warm-up
    p, d = ref.prefill_and_decode(256, 16, seed=2)
    out["prefill_256_tok_per_s"], out["decode_16_at_256_tok_per_s"] = 256 / p, 16 / d
    if golden_dir:
        g = json.loads((Path(golden_dir) / "golden.json").read_text())
        ids = g["token_ids"]
        want = np.fromfile(Path(golden_dir) / g["logits_file"], dtype="<f4").reshape(g["n_positions"],
                                                                                     g["vocab_size"])
        got = ref.logits(ids)
        out["golden_relative_logit_error"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        out["golden_top1_agreement_pct"] = 100.0 * float((got.argmax(-1) == want.argmax(-1)).mean())
    return out


def main():
    from run_bench import parse_lengths

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="lily / mlx checkpoint directory")
    ap.add_argument("--dtype", default="checkpoint", choices=["checkpoint", "float32"],
                    help="activations: the checkpoint's (bf16, default) or float32")
    ap.add_argument("--prefill-step", type=int, default=2048, help="mlx-lm's prefill_step_size (its default 2048)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="prefill / decode timings (run_bench.py's mlx_lm engine)")
    b.add_argument("--prefill-lengths", type=parse_lengths, default=[])
    b.add_argument("--decode-contexts", type=parse_lengths, default=[])
    b.add_argument("--steps", type=int, default=32, help="decode steps per context")
    b.add_argument("--cap-s", type=float, default=60.0, help="longest call (prefill + decode) at one length")
    b.add_argument("--budget-s", type=float, default=None, help="wall-clock budget after loading")
    b.add_argument("--no-warmup", action="store_true")
    b.add_argument("--json", help="output JSON (rewritten after every length)")
    c = sub.add_parser("check", help="teacher-forced logits against lily score")
    c.add_argument("--lily", help="lily binary (default build-cuda/lily, else build/lily)")
    c.add_argument("--backend", default="cpu", help="lily score --backend")
    c.add_argument("--positions", type=int, default=192)
    c.add_argument("--seed", type=int, default=1234)
    c.add_argument("--work", default=tempfile.gettempdir())
    c.add_argument("--json")
    s = sub.add_parser("smoke", help="device, one prefill + decode, logits against a golden directory")
    s.add_argument("--golden", help="e.g. tests/fixtures/golden/mlx_small (run it with --dtype float32)")
    s.add_argument("--json")
    args = ap.parse_args()

    ref = load_reference(args.model, None if args.dtype == "checkpoint" else args.dtype, args.prefill_step)
    common.log(f"mlx_lm: loaded {args.model} in {ref.info['load_s']:.1f} s ({ref.info['weight_bytes'] / 1e9:.2f} GB) "
               f"on {ref.info['device']} ({ref.info['device_info']})")
    if args.cmd == "bench":
        deadline = time.monotonic() + args.budget_s if args.budget_s else math.inf
        r = run_bench(ref, args.prefill_lengths, args.decode_contexts, args.steps, args.cap_s, deadline, args.json,
                      not args.no_warmup)
        if not args.json:
            print(json.dumps(r, indent=1))
        return
    if args.cmd == "check":
        out = check_against_lily(ref, args.model, common.find_lily(args.lily), args.positions, args.seed,
                                 args.backend, args.work)
        out["mlx"] = ref.info
        common.log(f"mlx_lm ({ref.info['activations']}, {ref.info['device']}) against lily score --backend "
                   f"{args.backend}: {out['positions']} positions, perplexity diff {out['perplexity_diff_pct']:+.4f}%, "
                   f"top-1 agreement {out['top1_agreement_pct']:.2f}%, relative logit error "
                   f"{out['relative_logit_error']:.2e}")
    else:
        out = smoke(ref, args.golden)
    if args.json:
        common.write_json(args.json, out)
    if args.cmd == "smoke" or not args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
