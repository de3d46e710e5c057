#!/usr/bin/env bash
# Validates, on the GPU machine, the kernel families written without a GPU in the sessions of 2026-11-29/30 (run
# and merged 2026-11-30: main ab69adc; docs/PERF_NOTES.md), and is the template for the next such batch: the
# probes and correctness tests of each kernel family first (each in its own log, under its own timeout, so a hang or a
# trap costs only that step), then the end-to-end tests against the CPU reference, then the timings: the kernel
# sweeps and `lily bench --variants` A/B runs (one model load for all variants). Prints a summary.
#
# Here (2 cores, no GPU):  cmake --build build-cuda --target lily test_cuda test_cuda_kernels -j2
#                          scripts/gpu_validate_next.sh pack      # xz the three binaries into build-carry/ and
#                                                                 # copy the tokenizer fixture to models/
# There (one device call): run(command="build-carry/gpu_validate_next.sh run",
#                              carry=["build-carry", "models/qwen3-tokenizer"])
#   (the device copies the main checkout's tree: copy build-carry/ and models/ there if packed in a worktree)
# STEPS (env) picks steps by name; STEPS=part1 (correctness: probes .. ttft) and STEPS=part2 (timings) split the
# run over two device calls if one 10-minute call cannot hold it; default: all.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"  # scripts/, or build-carry/ holding copies of the scripts
cd "$HERE/.."
B=build-cuda; C=build-carry; TOK=models/qwen3-tokenizer
BINS=(lily tests/test_cuda_kernels tests/test_cuda)

if [[ "${1:-}" == pack ]]; then
  mkdir -p "$C" "$TOK"
  for b in "${BINS[@]}"; do xz -T2 -6 -c "$B/$b" > "$C/$(basename "$b").xz" || exit 1; done
  cp tests/fixtures/qwen3-tokenizer/tokenizer.json tests/fixtures/qwen3-tokenizer/tokenizer_config.json "$TOK/"
  # the scripts too, so that a tree without them (main, before this branch lands) runs build-carry/gpu_validate_next.sh
  cp scripts/gpu_validate_next.sh scripts/profile_decode.sh scripts/ncu_summary.py "$C/"
  du -sh "$C" "$TOK"
  exit 0
fi
[[ "${1:-}" == run ]] || { echo "usage: $0 pack|run" >&2; exit 2; }

O=${OUT:-/tmp/lily-validate}
mkdir -p "$O" "$B/tests"
for b in "${BINS[@]}"; do
  x="$C/$(basename "$b").xz"  # unpack where the binary is missing or older than its pack (the device's copy)
  if [[ -f "$x" && ( ! -f "$B/$b" || "$x" -nt "$B/$b" ) ]]; then xz -dc "$x" > "$B/$b" && chmod +x "$B/$b"; fi
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$O/gpu.txt"
K=$B/tests/test_cuda_kernels
E=$B/tests/test_cuda
export LILY_TOKENIZER_DIR=$PWD/$TOK
case "${STEPS:-}" in
  part1) STEPS="probes qgemm_knobs attn_wgmma moe_wgmma moe_fused gdn_fused gdn_scan sample attn_fused prefetch anchor e2e ttft" ;;
  part2) STEPS="decode_ab prefill_ab ncu server_ttft" ;;
esac
want() { [[ -z "${STEPS:-}" || " $STEPS " == *" $1 "* || ( $1 == synth_full && " $STEPS " == *" server_ttft "* ) ||
           ( $1 == server_ttft_opts && " $STEPS " == *" server_ttft "* ) ||
           ( $1 == ncu_* && " $STEPS " == *" ncu "* ) ]]; }
step() {
  local name=$1 limit=$2; shift 2
  want "$name" || return 0
  local s; s=$(date +%s)
  timeout "$limit" "$@" > "$O/$name.log" 2>&1
  local rc=$?
  printf '%-16s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - s ))" \
    "$(grep -E '^\[  (PASSED|FAILED) ' "$O/$name.log" | tr '\n' ' ')" | tee -a "$O/summary.txt"
}
# 1. probes, then correctness, one kernel family a step
step probes      60 $K --gtest_filter='CudaQgemmWgmma.LayoutProbes:CudaAttnPrefillWgmma.LayoutProbes'
step qgemm_knobs 120 $K --gtest_filter='CudaQgemmWgmma.KnobsMatchDefault:CudaQgemmWgmma.DirectCallAndBadShapes'
step attn_wgmma  150 $K --gtest_filter='CudaAttnPrefillWgmma.MatchesMmaSyncAndCpu:CudaAttnPrefillWgmma.Rejects*:CudaAttnPrefill.*'
step moe_wgmma   150 $K --gtest_filter='CudaMoePrefillWgmma.*:CudaMoePrefill.*'
step moe_fused   120 $K --gtest_filter='CudaMoeFused.*:CudaMoe.*'
step gdn_fused   120 $K --gtest_filter='CudaGdnFused.*:CudaGdn.*:CudaGemv.*'
step gdn_scan    150 $K --gtest_filter='CudaGdnPrefill.*'
step sample      60 $K --gtest_filter='CudaSample.*'
step attn_fused  120 $K --gtest_filter='CudaAttnFused.*:CudaAttention.*'
step prefetch    60 $K --gtest_filter='CudaL2Prefetch*:CudaMoePrefetchDown*'
step anchor      90 $K --gtest_filter='CudaGdnPrefill.CheckpointFromChunkStates*:CudaGdnPrefill.ChunkStatesPredicate*'
# 2. end to end against the CPU reference (every case, the new fused ones included), then the per-request costs
step e2e         300 $E --gtest_filter='-TtftBreakdown.*'
step ttft        200 $E --gtest_filter='TtftBreakdown.*'
# 3. timings
step sweeps      240 $K --gtest_filter='CudaGdnPrefillBench.*:CudaQgemmWgmmaBench.Sweep:CudaMoePrefillBench.WgmmaVsMmaSync:CudaAttnPrefillWgmmaBench.Timing:CudaMoeFusedBench.*:CudaGdnFusedBench.*:CudaAttnFusedBench.*'
step decode_ab   300 $B/lily bench --mode decode --contexts 4096,32768 --reps 3 \
  --variants ";decode_prefetch=1;decode_prefetch=2;decode_prefetch=3;gdn_fused=1;decode_prefetch=3,gdn_fused=1"
# the 1K chunk's breakdown (the time to first token's prefill), and where the wgmma expert GEMMs start to win
step prefill_ab  300 $B/lily bench --mode prefill --lengths 1025,2048 --profile-context 1024 --reps 3 \
  --variants ";moe_wgmma_min_rows=1024;moe_wgmma_min_rows=2048;anchor_from_chunk_states=on"
# one decode step under Nsight Compute, the chain and the prefetch branch (per-kernel time without event overhead,
# DRAM bytes, L2 hit rate)
if want ncu; then
  OUT="$O/ncu_chain" step ncu_chain 180 "$HERE/profile_decode.sh" "$B/lily"
  OUT="$O/ncu_prefetch" step ncu_prefetch 180 "$HERE/profile_decode.sh" "$B/lily" -- --variants "decode_prefetch=3"
  cat "$O"/ncu_chain/summary.txt "$O"/ncu_prefetch/summary.txt 2>/dev/null
fi
# time to first token through the server, with wip/next's per-request changes (needs a 20 GB model directory)
if want server_ttft; then
  step synth_full  180 $B/lily synth --preset full --layout mlx --out /tmp/lily_full --tokenizer "$TOK"
  step server_ttft 240 $B/lily bench --mode ttft --model /tmp/lily_full --prompt-tokens 1024 --reps 5
  step server_ttft_opts 240 $B/lily bench --mode ttft --model /tmp/lily_full --prompt-tokens 1024 --reps 5 \
    --cuda-options anchor_from_chunk_states=on,decode_prefetch=3
  grep -h "time to first token" "$O/server_ttft.log" "$O/server_ttft_opts.log"
fi
echo
echo "== summary ($(cut -d, -f1 "$O/gpu.txt"))"
cat "$O/summary.txt"
grep -h -E 'FAILED|Failure|Expected|Which is|trap|error' "$O"/*.log | head -30
grep -h -E '^== variant|^ +[0-9]+ +[0-9.]+ +[0-9.]+' "$O/decode_ab.log" "$O/prefill_ab.log" 2>/dev/null
