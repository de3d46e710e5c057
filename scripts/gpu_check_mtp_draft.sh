#!/usr/bin/env bash
# Runs on one GPU machine (an H200: a few minutes; under 10 at the steps' time limits) with a build made elsewhere
# (the `cuda` preset): speculative decoding with the MTP head on the CUDA backend (`--speculative mtp:K`, #18 item 3).
#   1. tests/test_cuda: the head's draft against the CPU backend's (MtpDraftMatchesCpu*), greedy speculative decoding
#      token for token the plain loop's (SpeculativeGreedyEqualsPlain*), the head's state through checkpoints
#      (MtpStateThroughCheckpointRestoreClone), and what it builds on (MtpHead*, VerifyRows*, GreedyMatchesCpu*,
#      TeacherForced*);
#   2. `lily generate` on a synthetic tiny checkpoint written to /tmp: greedy text with --speculative off, mtp:1 and
#      mtp:3 on CUDA must be the same (and is shown beside the CPU backend's mtp:3);
#   3. `lily bench --mode verify` at 4K on the synthetic full model: decode, verify 1..4 rows and the real mtp_draft.
# Writes $OUT/summary.txt (and the logs beside it).
#   scripts/gpu_check_mtp_draft.sh [dir holding lily and tests/test_cuda]     (default build-cuda)
# Expected: every test passes; the draft lines print relative logit errors ~1e-3 (bound 2e-2) and "top-1 equal";
# the greedy lines "equal to the plain loop's"; the three CUDA generations identical; the bench prints an
# "mtp draft" row (a head step: one decoder layer on the prefill kernels and the lm_head, ~0.15-0.3 ms).
set -uo pipefail
bin=${1:-build-cuda}
out=${OUT:-/tmp/lily-gpu-mtpd}
mkdir -p "$out"
tiny=/tmp/lily-mtpd-tiny  # not under $OUT: it would come back with the logs
rm -rf "$tiny"
S=$out/summary.txt
: >"$S"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.free --format=csv,noheader >>"$S" 2>&1

filter='CudaBackend.MtpDraft*:CudaBackend.SpeculativeGreedy*:CudaBackend.MtpState*:CudaBackend.MtpHead*'
filter+=':CudaBackend.VerifyRows*:CudaBackend.GreedyMatchesCpu*:CudaBackend.TeacherForced*'
timeout 280 "$bin/tests/test_cuda" --gtest_brief=1 --gtest_filter="$filter" >"$out/tests.log" 2>&1
echo "== tests rc $?" >>"$S"
grep -E '^\[(tiny|small|full4)\]|^\[  (PASSED|FAILED|SKIPPED)|Failure|error' "$out/tests.log" >>"$S"

echo "== lily generate (synthetic tiny, greedy, 48 tokens)" >>"$S"
if timeout 30 "$bin/lily" synth --preset tiny --layout mlx --out "$tiny" \
     --tokenizer tests/fixtures/qwen3-tokenizer >"$out/synth.log" 2>&1; then
  failed=0
  gen() {  # name backend speculative
    timeout 40 "$bin/lily" generate --model "$tiny" --backend "$2" --ctx-size 4096 --temperature 0 \
      --max-tokens 48 --prompt "The quick brown fox jumps over the lazy dog" ${3:+--speculative $3} \
      >"$out/gen_$1.txt" 2>"$out/gen_$1.err"
    local rc=$?
    [ $rc -eq 0 ] || failed=1
    echo "$1: rc $rc $(tail -1 "$out/gen_$1.err")" >>"$S"
  }
  gen cuda_off cuda ""
  gen cuda_mtp1 cuda mtp:1
  gen cuda_mtp3 cuda mtp:3
  gen cpu_mtp3 cpu mtp:3
  if [ $failed -ne 0 ]; then
    echo "generate: a run failed, texts not compared" >>"$S"
  else
    for k in mtp1 mtp3; do
      if cmp -s "$out/gen_cuda_off.txt" "$out/gen_cuda_$k.txt"; then echo "cuda $k text: same as off" >>"$S"
      else echo "cuda $k text: DIFFERS from off" >>"$S"; fi
    done
    if cmp -s "$out/gen_cuda_off.txt" "$out/gen_cpu_mtp3.txt"; then echo "cpu mtp3 text: same as cuda's" >>"$S"
    else echo "cpu mtp3 text: differs from cuda's (reported only: the backends' numerics differ)" >>"$S"; fi
  fi
else
  echo "synth failed: $(tail -2 "$out/synth.log")" >>"$S"
fi

echo "== lily bench --mode verify (synthetic full, 4K)" >>"$S"
timeout 170 "$bin/lily" bench --mode verify --backend cuda --rows 1,2,3,4 --contexts 4096 --reps 5 --json "$out/verify.json" \
  >"$out/verify.log" 2>&1
echo "bench rc $?" >>"$S"
cat "$out/verify.log" >>"$S"
cat "$S"
