#!/usr/bin/env bash
# Reproduces the benchmark and fidelity report (docs/BENCHMARKS.md) on an H200 from a clean clone:
#   1. build   lily with CUDA (cmake preset `cuda`) unless build-cuda/lily exists;
#   2. synth   the synthetic checkpoints: full (mlx 4-bit, ~20 GB) for the benchmark, full4 (mlx 4-bit and hf
#              bf16) for the fidelity check; each is written once and reused while present;
#   3. bench   bench/run_bench.py: lily vs transformers side by side, alternating rounds -> $RESULTS/bench.json;
#   4. fidelity bench/fidelity.py: teacher-forced perplexity / top-1 agreement -> $RESULTS/fidelity.json;
#   5. plot    bench/plot.py -> $RESULTS/bench.png (from every $RESULTS/bench*.json).
# With --mlx, MLX-LM runs as the third engine of the bench step (the same 4-bit checkpoint bytes; its CUDA build
# must be importable: `pip install "mlx[cuda]" mlx-lm`, docs/BENCH_HARNESS.md), and
# step mlxcheck (bench/mlx_reference.py check) compares MLX-LM's logits with `lily score` on the fidelity preset
# -> $RESULTS/mlx_check.json (MLX-LM in the checkpoint's bf16) and $RESULTS/mlx_check_fp32.json (MLX-LM in fp32). Step smoke adds MLX-LM by itself when mlx_lm can be imported.
#
# Usage: bench/reproduce.sh [--out DIR] [--work DIR] [--steps build,synth,bench,fidelity,plot] [--budget-s N]
#                           [--sha SHA] [--bench-preset full] [--fidelity-preset full4] [--bench-name bench]
#                           [--mlx] [-- extra arguments for run_bench.py]
# Defaults: --out bench/results, --work /tmp/lily_bench, every step (with --mlx also mlxcheck), no budget.
# Environment: LILY (binary, default build-cuda/lily), PYTHON (default /opt/torch/.venv/bin/python3 if present),
# FIDELITY_ARGS (extra arguments for fidelity.py). A CPU-only check of the whole chain on the tiny model (with a
# CPU build, whose `lily bench` refuses to run, bench needs --engines transformers):
#   LILY=build/lily FIDELITY_ARGS="--mlx-backend cpu --positions 192" bench/reproduce.sh --steps synth,bench,\
#     fidelity,plot --bench-preset tiny --fidelity-preset tiny --out /tmp/r -- --engines transformers \
#     --prefill-lengths 256,1k --decode-contexts 256,1k
# Step `smoke` (not in the default list) runs the whole chain on the tiny model in about a minute, with the real
# binary, to catch an environment problem before the long steps: bench/reproduce.sh --steps smoke --out DIR
# The steps can also run one at a time (each reuses what the earlier ones left in --work and --out), e.g.
#   bench/reproduce.sh --steps build,synth
#   bench/reproduce.sh --steps fidelity
#   bench/reproduce.sh --steps bench --budget-s 500 --bench-name bench_short -- --prefill-lengths 256,512,1k,2k,4k,8k \
#     --decode-contexts 256,512,1k,2k,4k,8k
#   bench/reproduce.sh --steps bench,plot --budget-s 500 --bench-name bench_long -- --prefill-lengths 16k,32k,64k,128k \
#     --decode-contexts 16k,32k,64k,128k
# (plot draws every bench*.json of --out together; run_bench.py --merge a.json b.json --out c.json makes one file).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="$REPO/bench/results"
WORK="/tmp/lily_bench"
STEPS="build,synth,bench,fidelity,plot"
BUDGET=""
SHA=""
BENCH_PRESET=full
FID_PRESET=full4
BENCH_NAME=bench
EXTRA=()
MLX=0
STEPS_GIVEN=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) RESULTS="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --steps) STEPS="$2"; STEPS_GIVEN=1; shift 2 ;;
    --budget-s) BUDGET="$2"; shift 2 ;;
    --sha) SHA="$2"; shift 2 ;;
    --bench-preset) BENCH_PRESET="$2"; shift 2 ;;
    --fidelity-preset) FID_PRESET="$2"; shift 2 ;;
    --bench-name) BENCH_NAME="$2"; shift 2 ;;
    --mlx) MLX=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "reproduce.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

[[ $MLX == 1 && $STEPS_GIVEN == 0 ]] && STEPS="$STEPS,mlxcheck"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x /opt/torch/.venv/bin/python3 ]]; then PYTHON=/opt/torch/.venv/bin/python3; else PYTHON=python3; fi
fi
LILY="${LILY:-$REPO/build-cuda/lily}"
mkdir -p "$RESULTS" "$WORK"
SHA_ARGS=()
[[ -n "$SHA" ]] && SHA_ARGS=(--sha "$SHA")
has() { [[ ",$STEPS," == *",$1,"* ]]; }
say() { echo "== reproduce.sh [$(date -u +%H:%M:%S)] $*"; }

if has build; then
  if [[ -x "$LILY" || "$LILY" != "$REPO/build-cuda/lily" ]]; then
    say "build: $LILY present"
  else
    say "build: cmake --preset cuda && cmake --build build-cuda --target lily"
    (cd "$REPO" && cmake --preset cuda >/dev/null && cmake --build build-cuda --target lily -j "$(nproc)")
  fi
fi
[[ -x "$LILY" ]] || { echo "reproduce.sh: no $LILY (run the build step)" >&2; exit 1; }
say "lily: $LILY; python: $PYTHON ($("$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'))"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
MLX_OK=0
if "$PYTHON" -c 'import mlx.core, mlx_lm' 2>/dev/null; then
  MLX_OK=1
  say "mlx: $("$PYTHON" -c 'import mlx.core as mx, mlx_lm
print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, "on", mx.default_device())')"
elif [[ $MLX == 1 ]]; then
  echo "reproduce.sh: --mlx, but $PYTHON cannot import mlx and mlx_lm (pip install "mlx[cuda]" mlx-lm; or set PYTHONPATH)" >&2; exit 1
fi
ENGINE_ARGS=()
[[ $MLX == 1 ]] && ENGINE_ARGS=(--engines "lily,transformers,mlx_lm")
SMOKE_ENGINES=lily,transformers
[[ $MLX_OK == 1 ]] && SMOKE_ENGINES=lily,transformers,mlx_lm

if has smoke; then
  say "smoke: the chain on the tiny model -> $RESULTS/smoke_*"
  "$PYTHON" "$REPO/bench/run_bench.py" --lily "$LILY" --work "$WORK" --preset tiny --rounds 2 \
    --prefill-lengths 256,1k --decode-contexts 256,1k --hf-steps 4 --mlx-steps 4 --engines "$SMOKE_ENGINES" \
    --out "$RESULTS/smoke_bench.json" "${SHA_ARGS[@]}"
  "$PYTHON" "$REPO/bench/fidelity.py" --lily "$LILY" --work "$WORK" --preset tiny --positions 192 \
    --out "$RESULTS/smoke_fidelity.json" "${SHA_ARGS[@]}"
  "$PYTHON" "$REPO/bench/plot.py" "$RESULTS/smoke_bench.json" --out "$RESULTS/smoke_bench.png"
fi

if has synth; then
  for spec in "$BENCH_PRESET:mlx" "$FID_PRESET:mlx" "$FID_PRESET:hf"; do
    say "synth: ${spec%%:*} (${spec##*:})"
    "$PYTHON" -c "import sys; sys.path.insert(0, '$REPO/bench'); import common; \
common.ensure_checkpoint('$LILY', '${spec%%:*}', '${spec##*:}', '$WORK/${spec%%:*}_${spec##*:}')"
  done
  df -h "$WORK" | tail -1
fi

if has bench; then
  say "bench: run_bench.py -> $RESULTS/$BENCH_NAME.json"
  BUDGET_ARGS=()
  [[ -n "$BUDGET" ]] && BUDGET_ARGS=(--budget-s "$BUDGET")
  "$PYTHON" "$REPO/bench/run_bench.py" --lily "$LILY" --work "$WORK" --preset "$BENCH_PRESET" --out "$RESULTS/$BENCH_NAME.json" \
    "${BUDGET_ARGS[@]}" "${SHA_ARGS[@]}" "${ENGINE_ARGS[@]}" "${EXTRA[@]}"
fi

if has fidelity; then
  say "fidelity: fidelity.py -> $RESULTS/fidelity.json"
  # shellcheck disable=SC2086
  "$PYTHON" "$REPO/bench/fidelity.py" --lily "$LILY" --work "$WORK" --preset "$FID_PRESET" \
    --out "$RESULTS/fidelity.json" "${SHA_ARGS[@]}" ${FIDELITY_ARGS:-}
fi

if has mlxcheck; then
  say "mlxcheck: mlx_reference.py check (MLX-LM vs lily score, $FID_PRESET mlx 4-bit) -> $RESULTS/mlx_check.json"
  BACKEND=cpu
  command -v nvidia-smi >/dev/null && BACKEND=cuda
  for dtype in checkpoint float32; do
    suffix=""
    [[ $dtype == float32 ]] && suffix=_fp32
    "$PYTHON" "$REPO/bench/mlx_reference.py" --model "$WORK/${FID_PRESET}_mlx" --dtype "$dtype" check --lily "$LILY" \
      --backend "$BACKEND" --positions 256 --work "$WORK" --json "$RESULTS/mlx_check$suffix.json"
  done
fi

if has plot; then
  shopt -s nullglob
  runs=("$RESULTS"/bench*.json)
  if [[ ${#runs[@]} -gt 0 ]]; then
    say "plot: ${runs[*]} -> $RESULTS/bench.png"
    "$PYTHON" "$REPO/bench/plot.py" "${runs[@]}" --out "$RESULTS/bench.png"
  else
    say "plot: no $RESULTS/bench*.json yet"
  fi
fi
say "done; results in $RESULTS"
