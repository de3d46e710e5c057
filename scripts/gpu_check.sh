#!/usr/bin/env bash
# Runs on a machine with an NVIDIA H200 (sm_90a): every CUDA test (kernel op tests and end-to-end against the CPU reference) and the
# benchmark (prefill and decode, `lily bench`), then prints a summary table. Build first with:
#   cmake --preset cuda && cmake --build build-cuda -j
# Usage: scripts/gpu_check.sh [build-dir] [out-dir]
# env: TRACE_BUILD=dir of a -DLILY_TRACE=ON build (cmake -S . -B build-cuda-trace -DLILY_TRACE=ON): also runs the
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
"$build/lily" bench --json "$out/bench.json" ${LILY_BENCH_ARGS:-} >"$out/bench.log" 2>&1
b_rc=$?

echo
echo "== lily GPU check ($git_sha, $(cut -d, -f1 "$out/gpu.txt"))"
printf '%-28s %s\n' "kernel op tests" "$(status $k_rc) ($(grep -c '^\[       OK' "$out/kernel_tests.log" 2>/dev/null || true) ok; $(grep -E '^\[  (PASSED|FAILED)' "$out/kernel_tests.log" | tr '\n' ' '))"
printf '%-28s %s\n' "end-to-end vs CPU" "$(status $e_rc) ($(grep -E '^\[  (PASSED|FAILED)' "$out/e2e_tests.log" | tr '\n' ' '))"
grep -h -E '^\[(tiny|small|full4)\]' "$out/e2e_tests.log" | sed 's/^/  /'
grep -h -E 'FAILED|Failure|Expected|Which is' "$out/kernel_tests.log" "$out/e2e_tests.log" | head -20 | sed 's/^/  /'
printf '%-28s %s\n' "benchmark (prefill, decode)" "$(status $b_rc)"
cat "$out/bench.log"
t_rc=0
if [ -n "${TRACE_BUILD:-}" ]; then
  { "$TRACE_BUILD/tests/test_cuda" --gtest_filter='CudaBackend.DecodeTraceTimeline' --gtest_brief=1 &&
    "$TRACE_BUILD/lily" bench --mode decode --contexts 4096 --reps 1 --steps 16 --trace 3 --json "$out/trace.json"
  } >"$out/trace.log" 2>&1
  t_rc=$?
  printf '%-28s %s\n' "decode block timeline" "$(status $t_rc)"
  grep -A16 '^op ' "$out/trace.log"
fi
exit $((k_rc | e_rc | b_rc | t_rc))
