#!/usr/bin/env bash
# Runs on one GPU machine (an H200: well within 9 minutes) with two builds made elsewhere and carried along: the
# sm_90a build (the `cuda` preset: build-cuda) and a build whose only device code is compute_80 PTX (build-cuda80:
# -DCMAKE_CUDA_ARCHITECTURES=80-virtual -DLILY_STATIC=ON), which the driver JIT-compiles and which must take the
# non-Hopper kernel paths on the same GPU. For each: the kernel op tests, the end-to-end tests (the full-geometry
# TTFT breakdown left out: it times, asserts little, and costs a minute), and `lily bench` decode at 4K and 32K
# and prefill at 1K and 4K on the in-memory synthetic full-geometry model (the model of docs/BENCHMARKS.md). Writes
# 8 files under $OUT and prints a table last. Each step has a time limit (330 / 110 / 90 s a build; the op tests of
# the compute_80 build take ~4.5 minutes on an H200, its JIT included): ~15 minutes for both builds.
#   scripts/gpu_check_prune.sh [sm90a-build] [compute80-build]     (defaults build-cuda, build-cuda80)
# Before pruning (docs/BENCHMARKS.md, H200, sm_90a): decode 646.1 tok/s at 4K, 579.0 at 32K; prefill 21,098 tok/s
# at 1K, 29,661 at 4K. The sm_90a build must match them within noise (~1%); the compute_80 build is slower
# (mma.sync prefill, no programmatic dependent launch in decode) and is reported, not judged.
set -uo pipefail
a=${1:-build-cuda}
b=${2:-build-cuda80}
out=${OUT:-/tmp/lily-gpu-prune}
mkdir -p "$out"
export CUDA_CACHE_MAXSIZE=4294967296  # the compute_80 build's JIT output is kept for its second process
nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.sm,clocks.mem,memory.free --format=csv,noheader \
  | tee "$out/gpu.txt"
bench_args=(--contexts 4096,32768 --lengths 1024,4096 --reps 3 --steps 64)
filter='-*Bench*:TtftBreakdown.*'

run_build() {  # name dir
  local name=$1 dir=$2 rc=0
  { echo "== $dir/tests/test_cuda_kernels"; timeout 330 "$dir/tests/test_cuda_kernels" --gtest_brief=1 --gtest_filter="$filter"
    r=$?; echo; echo "rc=$r"
    echo "== $dir/tests/test_cuda"; timeout 110 "$dir/tests/test_cuda" --gtest_brief=1 --gtest_filter="$filter"
    r=$?; echo; echo "rc=$r"; } >"$out/${name}_tests.log" 2>&1
  timeout 90 "$dir/lily" bench --mode all "${bench_args[@]}" --json "$out/${name}_bench.json" \
    >"$out/${name}_bench.log" 2>&1 || rc=$?
  echo "rc=$rc" >>"$out/${name}_bench.log"
}

run_build sm90a "$a"
run_build compute80 "$b"

python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, re, sys, os
out = sys.argv[1]
base = {"decode 4096": 646.1, "decode 32768": 579.0, "prefill 1024": 21098, "prefill 4096": 29661}
rows = {}
print("%-10s %-9s %-9s %s" % ("build", "kernels", "e2e", "kernel paths"))
for name in ("sm90a", "compute80"):
    log = open(os.path.join(out, name + "_tests.log"), errors="replace").read()
    rcs = re.findall(r"^rc=(\d+)", log, re.M) + ["?", "?"]
    ok = ["PASS" if r == "0" else "FAIL(%s)" % r for r in rcs[:2]]
    paths = re.search(r"^cuda: .*$", open(os.path.join(out, name + "_bench.log"), errors="replace").read(), re.M)
    print("%-10s %-9s %-9s %s" % (name, ok[0], ok[1], paths.group(0) if paths else "(no backend line)"))
    for line in re.findall(r"^\[  FAILED  \].*$", log, re.M)[:6]:
        print("    " + line)
    try:
        j = json.load(open(os.path.join(out, name + "_bench.json")))
    except Exception as e:
        print("    bench: no JSON (%s)" % e)
        continue
    for d in j.get("decode", []):
        rows.setdefault("decode %d" % d["context"], {})[name] = d["tok_per_s"]
    for p in j.get("prefill", []):
        rows.setdefault("prefill %d" % p["length"], {})[name] = p["tok_per_s"]
print()
print("%-14s %12s %12s %12s %10s" % ("tok/s", "before", "sm90a", "compute80", "sm90a/before"))
for k in ("decode 4096", "decode 32768", "prefill 1024", "prefill 4096"):
    r = rows.get(k, {})
    s, c = r.get("sm90a"), r.get("compute80")
    f = lambda v: "%12.1f" % v if v is not None else "%12s" % "-"
    print("%-14s %12.1f %s %s %10s" % (k, base[k], f(s), f(c), "%.3f" % (s / base[k]) if s else "-"))
PY
