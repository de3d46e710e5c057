#!/usr/bin/env bash
# One decode step under Nsight Compute, on the GPU: every kernel of the step (graph nodes profiled one by
# one, caches NOT flushed between them, clocks left alone: docs/DESIGN.md section 5) with its duration, DRAM bytes, L2 hit
# rate and achieved bandwidth, summed per kernel name. What the event breakdown of `lily bench` cannot give:
# times without the ~8 us of event overhead per launch, and whether a kernel's bytes came from DRAM or the L2
# (e.g. with --variants decode_prefetch=2: the next layer's weights should be L2 hits).
#
#   scripts/profile_decode.sh [LILY] [-- extra lily bench arguments, e.g. --gdn-fused]
#   env: OUT (output folder, default /tmp/lily-ncu), CONTEXT (default 4096), COUNT (kernels profiled, default 200:
#        one step is ~131 launches, ~170 with decode_prefetch)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/.."
LILY=${1:-build-cuda/lily}
[[ $# -gt 0 ]] && shift
[[ "${1:-}" == -- ]] && shift
O=${OUT:-/tmp/lily-ncu}
mkdir -p "$O"
command -v ncu >/dev/null || { echo "profile_decode.sh: ncu not found (Nsight Compute)" >&2; exit 1; }
ncu --clock-control none --cache-control none --graph-profiling node \
  --kernel-name 'regex:gemv|gdn_step|gdn_fused|moe_route|moe_expert|moe_fused|attn_prep|attn_decode|attn_combine|attn_fused|embed_lookup|sample|advance|l2_prefetch' \
  --launch-count "${COUNT:-200}" \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,launch__grid_size \
  --csv --page raw --log-file "$O/ncu.log" \
  "$LILY" bench --mode decode --contexts "${CONTEXT:-4096}" --steps 4 --reps 1 "$@" > "$O/ncu.csv"
python3 "$HERE/ncu_summary.py" "$O/ncu.csv" | tee "$O/summary.txt"
