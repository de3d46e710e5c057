#!/usr/bin/env bash
# Runs on a machine with an NVIDIA H200 (sm_90a): every CUDA test (kernel op tests, the decode megakernel's op tests and
# end-to-end against the CPU reference), the benchmark (prefill and decode, `lily bench`) and the megakernel's stage
# benchmarks, then prints a summary table. Build first with:
#   cmake --preset cuda && cmake --build build-cuda -j
# Usage: scripts/gpu_check.sh [build-dir] [out-dir]
# env: SERVE=1: also what `lily serve` streams (writes the full synthetic checkpoint, ~20 GB, to $out/full; ~3
#      minutes): plain decode and the host-sampling loop after a 4K prompt, 1 / 2 / 4 / 8 / 16 concurrent streams,
#      the first token of a 1K prompt alone and while 7 streams decode (docs/BENCH_HARNESS.md, --mode ttft), and
#      tests/python/test_parallel.py on the GPU
#      TRACE_BUILD=dir of a -DLILY_TRACE=ON build (cmake -S . -B build-cuda-trace -DLILY_TRACE=ON): also runs the
#      block timeline test there and prints the 4K decode step's timeline by op (docs/BENCH_HARNESS.md)
set -uo pipefail
build=${1:-build-cuda}
out=${2:-/tmp/lily-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
git_sha=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

status() { [ "$1" -eq 0 ] && echo PASS || echo FAIL; }

"$build/tests/test_cuda_kernels" --gtest_brief=1 >"$out/kernel_tests.log" 2>&1
k_rc=$?
"$build/tests/test_cuda" --gtest_brief=1 >"$out/e2e_tests.log" 2>&1
e_rc=$?
"$build/tests/test_cuda_megakernel" --gtest_brief=1 --gtest_filter='-*Bench*' >"$out/megakernel_tests.log" 2>&1
m_rc=$?
"$build/lily" bench --json "$out/bench.json" ${LILY_BENCH_ARGS:-} >"$out/bench.log" 2>&1
b_rc=$?
"$build/lily" bench --mode decode --contexts 4096,32768 --decode-rows 1,2,4,8 --steps 32 --reps 1 \
  --json "$out/bench_rows.json" >"$out/bench_rows.log" 2>&1
r_rc=$?
"$build/tests/test_cuda_megakernel" --gtest_filter='*Bench*' >"$out/megakernel_bench.log" 2>&1
s_rc=0
if [ -n "${SERVE:-}" ]; then
  T="$build/lily bench --mode ttft --model $out/full --backend cuda --ctx-size 8192"
  { "$build/lily" synth --preset full --layout mlx --out "$out/full" --tokenizer tests/fixtures/qwen3-tokenizer &&
    $T --prompt-tokens 4096 --reps 1 --decode-tokens 256 --streams 1,2,4,8,16 --parallel 16 --json "$out/serve_streams.json" &&
    $T --prompt-tokens 4096 --reps 1 --decode-tokens 128 --decode-field min_tokens=1 --json "$out/serve_host.json" &&
    $T --prompt-tokens 1024 --reps 3 --decode-tokens 128 --busy-streams 7 --parallel 8 --json "$out/serve_busy.json" &&
    LILY_BIN="$build/lily" LILY_BACKEND=cuda python3 tests/python/test_parallel.py
  } >"$out/serve.log" 2>&1
  s_rc=$?
fi

echo
echo "== lily GPU check ($git_sha, $(cut -d, -f1 "$out/gpu.txt"))"
printf '%-28s %s\n' "kernel op tests" "$(status $k_rc) ($(grep -c '^\[       OK' "$out/kernel_tests.log" 2>/dev/null || true) ok; $(grep -E '^\[  (PASSED|FAILED)' "$out/kernel_tests.log" | tr '\n' ' '))"
printf '%-28s %s\n' "end-to-end vs CPU" "$(status $e_rc) ($(grep -E '^\[  (PASSED|FAILED)' "$out/e2e_tests.log" | tr '\n' ' '))"
grep -h -E '^\[(tiny|small|full4)\]' "$out/e2e_tests.log" | sed 's/^/  /'
grep -h -E 'FAILED|Failure|Expected|Which is' "$out/kernel_tests.log" "$out/e2e_tests.log" | head -20 | sed 's/^/  /'
printf '%-28s %s\n' "megakernel op tests" "$(status $m_rc) ($(grep -E '^\[  (PASSED|FAILED)' "$out/megakernel_tests.log" | tr '\n' ' '))"
printf '%-28s %s\n' "benchmark (prefill, decode)" "$(status $b_rc)"
cat "$out/bench.log"
printf '%-28s %s\n' "several-row decode steps" "$(status $r_rc)"
grep -A6 '^  rows' "$out/bench_rows.log" | sed 's/^/  /'
echo "megakernel stages (us a step; the chain beside each):"
grep -E ' us .* MB ' "$out/megakernel_bench.log" | sed 's/^/  /'
grep -E 'dependent ops' "$out/megakernel_bench.log" | sed 's/^/  /'
if [ -n "${SERVE:-}" ]; then
  printf '%-28s %s\n' "through lily serve" "$(status $s_rc)"
  grep -E 'through the server|concurrent streams|while [0-9]+ streams|passed, [0-9]+ failed' "$out/serve.log" | sed 's/^/  /'
fi
t_rc=0
if [ -n "${TRACE_BUILD:-}" ]; then
  { "$TRACE_BUILD/tests/test_cuda" --gtest_filter='CudaBackend.DecodeTraceTimeline' --gtest_brief=1 &&
    "$TRACE_BUILD/lily" bench --mode decode --contexts 4096 --reps 1 --steps 16 --trace 3 --json "$out/trace.json"
  } >"$out/trace.log" 2>&1
  t_rc=$?
  printf '%-28s %s\n' "decode block timeline" "$(status $t_rc)"
  grep -A16 '^op ' "$out/trace.log"
fi
exit $((k_rc | e_rc | m_rc | b_rc | r_rc | s_rc | t_rc))
