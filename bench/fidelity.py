#!/usr/bin/env python3
"""Teacher-forced fidelity of lily against transformers on the same weights.

On a full-width reduced-depth synthetic model (`lily synth --preset full4`: full Qwen3.6-35B-A3B width, 3 Gated
DeltaNet + 1 attention layer, 256 experts, the full vocabulary), over N >= 192 positions of random but fixed ids
(numpy seed), two comparisons:

  4-bit:  lily on the mlx 4-bit checkpoint (`lily score --backend cuda`)  vs  transformers on the same weights
          dequantized (w = scale*q + bias) and cast to bf16 (and, with --hf-dtypes, fp32);
  bf16:   lily on the hf bf16 checkpoint (`lily score --backend cpu`: the CPU backend runs bf16 weights as they
          are; the CUDA backend would quantize them)  vs  transformers on the same bf16 checkpoint.

For each pair: the perplexity of the next id under each (exp of the mean negative log-probability; random ids
make it large, close to the vocabulary size, but the relative difference is what is compared), the difference
in %, top-1 agreement (argmax equal), the mean |difference| of the target log-probs, the mean KL(ref || lily) of
the next-token distributions and the relative logit error ||lily - ref|| / ||ref||.

Usage (GPU machine):  python3 bench/fidelity.py --work /tmp/lily_bench --out bench/results/fidelity.json
Local CPU check:      python3 bench/fidelity.py --preset tiny --positions 192 --out /tmp/f.json  (no GPU: all on CPU)
"""

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import hf_reference  # noqa: E402


def lily_score(lily, model_dir, ids_file, backend, work, tag, threads=0):
    """Runs `lily score`; returns (its JSON, logits [T, V] float32)."""
    jpath, lpath = work / f"lily_{tag}.json", work / f"lily_{tag}.f32"
    cmd = [lily, "score", "--model", str(model_dir), "--ids-file", str(ids_file), "--backend", backend,
           "--json", str(jpath), "--logits", str(lpath)]
    if threads:
        cmd += ["--threads", str(threads)]
    common.log(" ".join(cmd))
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"lily score failed ({r.returncode}): {r.stderr.strip()}")
    common.log(r.stdout.strip() + f" ({time.perf_counter() - t0:.1f} s)")
    j = json.loads(jpath.read_text())
    logits = np.fromfile(lpath, dtype="<f4").reshape(j["n_ids"], j["vocab_size"])
    lpath.unlink()  # large; the JSON keeps the per-position figures
    return j, logits


def log_softmax64(logits):
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(lily_logits, ref_logits, ids):
    """Figures over positions t < T-1 (the next id ids[t+1] is the target)."""
    n = len(ids) - 1
    a, b = lily_logits[:n], ref_logits[:n]
    tgt = np.asarray(ids[1:])
    la, lb = log_softmax64(a), log_softmax64(b)
    lpa, lpb = la[np.arange(n), tgt], lb[np.arange(n), tgt]
    ppl_a, ppl_b = float(np.exp(-lpa.mean())), float(np.exp(-lpb.mean()))
    top_a, top_b = a.argmax(-1), b.argmax(-1)
    kl = (np.exp(lb) * (lb - la)).sum(-1)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    # Top-1 margins of the reference: where lily disagrees, how close the reference's own top-2 were.
    top2 = np.sort(b, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    disagree = top_a != top_b
    return {
        "positions": n,
        "perplexity_lily": ppl_a,
        "perplexity_reference": ppl_b,
        "perplexity_diff_pct": 100.0 * (ppl_a / ppl_b - 1.0),
        "top1_agreement_pct": 100.0 * float((~disagree).mean()),
        "top1_disagreements": int(disagree.sum()),
        "reference_top1_margin_at_disagreements_max": float(margin[disagree].max()) if disagree.any() else None,
        "reference_top1_margin_median": float(np.median(margin)),
        "mean_abs_target_logprob_diff": float(np.abs(lpa - lpb).mean()),
        "mean_kl_ref_to_lily": float(kl.mean()),
        "max_kl_ref_to_lily": float(kl.max()),
        "relative_logit_error": float(np.linalg.norm(a64 - b64) / np.linalg.norm(b64)),
        "max_abs_logit_diff": float(np.abs(a64 - b64).max()),
        "logit_std_reference": float(b64.std()),
    }


def reference_logits(model_dir, ids, dtype, device, experts):
    common.log(f"transformers ({dtype}, experts {experts}) on {model_dir}")
    ref = hf_reference.load_reference(model_dir, device, getattr(torch, dtype), experts_implementation=experts)
    t0 = time.perf_counter()
    logits = ref.logits(ids).numpy()
    info = dict(ref.info, forward_s=time.perf_counter() - t0)
    del ref
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    common.log(f"transformers ({dtype}): loaded in {info['load_s']:.1f} s, forward {info['forward_s']:.1f} s")
    return logits, info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lily", help="lily binary (default build-cuda/lily, else build/lily)")
    ap.add_argument("--work", default="/tmp/lily_bench", help="directory for the checkpoints and scratch files")
    ap.add_argument("--preset", default="full4", help="synthetic preset (full4 on the GPU; tiny for a CPU check)")
    ap.add_argument("--positions", type=int, default=256, help="scored positions (>= 192)")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the ids")
    ap.add_argument("--ids", default="random,sampled",
                    help="id sequences, comma-separated: random (uniform ids) and/or sampled (drawn from the "
                         "reference model at temperature 1, so that perplexity is meaningful)")
    ap.add_argument("--mlx-backend", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="lily backend for the 4-bit checkpoint (default cuda when a GPU is visible, else cpu)")
    ap.add_argument("--bf16-backend", default="cpu", help="lily backend for the bf16 checkpoint (cpu: unquantized)")
    ap.add_argument("--hf-dtypes", default="bfloat16,float32",
                    help="transformers compute dtypes, comma-separated (the first is the headline)")
    ap.add_argument("--device", default=None, help="torch device (default cuda when available)")
    ap.add_argument("--hf-experts", default="eager",
                    help="transformers experts_implementation (eager: one F.linear per expert, any dtype)")
    ap.add_argument("--threads", type=int, default=0, help="lily CPU threads (0: all)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: 4bit, bf16")
    ap.add_argument("--sha", help="git SHA to stamp when git is not available")
    ap.add_argument("--out", required=True, help="output JSON")
    args = ap.parse_args()
    if args.positions < 192:
        common.log(f"note: {args.positions} positions is below the 192 the report asks for")

    lily = common.find_lily(args.lily)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    device = hf_reference.pick_device(args.device)
    dtypes = [d for d in args.hf_dtypes.split(",") if d]
    skip = set(filter(None, args.skip.split(",")))
    result = {"stamp": common.stamp(args.sha), "preset": args.preset, "seed": args.seed, "device": str(device),
              "lily": lily, "by_ids": {}}
    mlx_dir = common.ensure_checkpoint(lily, args.preset, "mlx", work / f"{args.preset}_mlx")
    text, _ = hf_reference.read_checkpoint_config(mlx_dir)
    vocab = text["vocab_size"]
    parts = []
    if "4bit" not in skip:
        parts.append(("4bit", "mlx", args.mlx_backend))
    if "bf16" not in skip:
        parts.append(("bf16", "hf", args.bf16_backend))
    for mode in filter(None, args.ids.split(",")):
        if mode not in ("random", "sampled"):
            sys.exit(f"--ids: unknown mode {mode} (random, sampled)")
        res = result["by_ids"].setdefault(mode, {"comparisons": {}})
        for part, layout, backend in parts:
            model_dir = common.ensure_checkpoint(lily, args.preset, layout, work / f"{args.preset}_{layout}")
            if mode == "random":
                ids = np.random.RandomState(args.seed).randint(0, vocab, size=args.positions + 1).tolist()
                how = f"numpy RandomState({args.seed}).randint(0, {vocab})"
            else:
                # Each checkpoint samples its own sequence: the mlx and hf synthetic weights are different.
                common.log(f"sampling {args.positions + 1} ids from transformers ({dtypes[0]}) on {model_dir}")
                ref = hf_reference.load_reference(model_dir, device, getattr(torch, dtypes[0]),
                                                  experts_implementation=args.hf_experts)
                ids = ref.sample(args.positions + 1, args.seed)
                how = (f"sampled at temperature 1 from transformers {dtypes[0]} on this checkpoint "
                       f"(torch.Generator seed {args.seed})")
                del ref
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            ids_file = work / f"ids_{args.preset}_{layout}_{mode}_{args.seed}_{len(ids)}.txt"
            ids_file.write_text(" ".join(map(str, ids)) + "\n")
            lily_json, lily_logits = lily_score(lily, model_dir, ids_file, backend, work, f"{part}_{backend}",
                                                args.threads)
            entry = {"checkpoint": str(model_dir), "layout": layout, "lily_backend": lily_json["backend"],
                     "lily_forward_s": lily_json["forward_s"], "lily_perplexity_reported": lily_json["perplexity"],
                     "ids": {"n": len(ids), "how": how, "ids": ids}, "vs": {}}
            for dtype in dtypes:
                ref_logits, info = reference_logits(model_dir, ids, dtype, device, args.hf_experts)
                c = compare(lily_logits, ref_logits, ids)
                c["reference"] = info
                entry["vs"][f"transformers_{dtype}"] = c
                common.log(f"{mode} ids, {part}: lily/{lily_json['backend']} vs transformers {dtype}: perplexity "
                           f"{c['perplexity_lily']:.4f} vs {c['perplexity_reference']:.4f} "
                           f"({c['perplexity_diff_pct']:+.3f}%), top-1 agreement {c['top1_agreement_pct']:.2f}% "
                           f"({c['top1_disagreements']} of {c['positions']}), KL {c['mean_kl_ref_to_lily']:.2e}, "
                           f"rel. logit error {c['relative_logit_error']:.2e}")
                del ref_logits
            res["comparisons"][part] = entry
            del lily_logits
            common.write_json(args.out, result)
    common.write_json(args.out, result)
    print(summary_table(result))


def summary_table(result):
    lines = ["| ids | comparison | lily | reference | positions | ppl lily | ppl ref | ppl diff | top-1 agreement | "
             "mean KL | rel. logit err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, res in result["by_ids"].items():
        for part, e in res["comparisons"].items():
            for ref, c in e["vs"].items():
                lines.append(f"| {mode} | {part} | {e['layout']} ckpt, {e['lily_backend']} | {ref} | {c['positions']} | "
                             f"{c['perplexity_lily']:.4g} | {c['perplexity_reference']:.4g} | "
                             f"{c['perplexity_diff_pct']:+.3f}% | {c['top1_agreement_pct']:.2f}% | "
                             f"{c['mean_kl_ref_to_lily']:.2e} | {c['relative_logit_error']:.2e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
