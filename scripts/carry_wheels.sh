#!/usr/bin/env bash
# MLX-LM's CUDA build for the GPU machine, which has no internet: the wheels travel in the carried tree (at most
# 64 MiB a device call, the repository's own files included), so a wheel too large for one call is split into
# parts carried by back-to-back calls (the machine stays warm 30 s after a call; /tmp persists while it is warm).
#
#   scripts/carry_wheels.sh prepare [--dir .whl_mlx] [--part-mib N] [--reserve-mib N]    # here, with internet
#       downloads mlx, mlx-cuda-13 and mlx-lm for CPython 3.12 manylinux x86_64 into DIR/dl (kept; DIR is added
#       to .git/info/exclude, wheels are never committed), splits every file larger than one call can hold
#       (split -b), spreads the pieces over DIR/call1, DIR/call2, ... (each fits one call beside the tracked
#       tree and --reserve-mib of other carried files), writes DIR/call<last>/SHA256SUMS and prints the exact
#       device calls.
#   scripts/carry_wheels.sh install [--from /tmp/whl] [--target /tmp/site]               # there
#       joins the parts, checks the SHA-256 sums, `pip install --no-index --no-deps --target`, links the image's
#       nvidia/ package folder beside mlx (libmlx.so's RPATH is $ORIGIN/../../nvidia/{cu13,cublas,...}/lib) and
#       lists any library libmlx.so cannot resolve.
#   scripts/carry_wheels.sh smoke [--target /tmp/site]                                   # there
#       bench/mlx_reference.py smoke on tests/fixtures/golden/mlx_small (mlx-lm's own convert, fp32): the mlx
#       device, one prefill + decode, and the logits against that fixture's logits.f32 (mlx-lm on a CPU).
#
# What the CUDA build needs (from the wheels' METADATA and libmlx.so): mlx 0.32.4 (the Python extension; on
# Linux it holds no libmlx.so), mlx-cuda-13 0.32.4 (libmlx.so built with CUDA 13.0 V13.0.88, PTX ISA 9.0, SASS
# for sm_75/80/90a/100a/120a; bundled lapack/blas), which requires nvidia-cudnn-cu13 9.*, nvidia-nccl-cu13,
# nvidia-cublas 13.*, nvidia-cufft 12.*, nvidia-cuda-nvrtc 13.*, nvidia-cuda-runtime 13.*, nvidia-cusolver 12.*
# and libcuda.so.1: the GPU image's PyTorch (2.11.0+cu130) brings every one of those packages, and its driver
# 580 is CUDA 13.0, the version mlx-cuda-13 was built with. mlx-lm 0.32.2 needs numpy, transformers >= 5.7,
# sentencepiece, protobuf, pyyaml, jinja2: all in the image (transformers 5.17). So three wheels travel.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS=(mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2)
LIMIT_MIB=64     # the device tool's limit on what travels in one call
MARGIN_MIB=3     # slack under it (files added to the tree after prepare, rounding)

cmd="${1:-}"
[[ -n "$cmd" ]] && shift
DIR="$REPO/.whl_mlx"; PART_MIB=""; RESERVE_MIB=0; FROM=/tmp/whl; TARGET=/tmp/site
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) DIR="$(cd "$REPO" && realpath -m "$2")"; shift 2 ;;
    --part-mib) PART_MIB="$2"; shift 2 ;;
    --reserve-mib) RESERVE_MIB="$2"; shift 2 ;;
    --from) FROM="$2"; shift 2 ;;
    --target) TARGET="$2"; shift 2 ;;
    *) echo "carry_wheels.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

prepare() {
  local rel="${DIR#"$REPO"/}"
  local exclude
  exclude="$(git -C "$REPO" rev-parse --git-path info/exclude)"
  [[ "$exclude" = /* ]] || exclude="$REPO/$exclude"
  mkdir -p "$(dirname "$exclude")"
  grep -qxF "/$rel/" "$exclude" 2>/dev/null || echo "/$rel/" >> "$exclude"
  if [[ -n "$(git -C "$REPO" status --porcelain --untracked-files=all -- "$rel" 2>/dev/null)" ]]; then
    echo "carry_wheels.sh: $rel is not ignored by git" >&2; exit 1
  fi
  mkdir -p "$DIR/dl"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR/dl" "${WHEELS[@]}"
  echo "wheels in $rel/dl:"
  local w
  for w in "$DIR"/dl/*.whl; do
    echo "  $(basename "$w"): $(stat -c %s "$w") bytes ($(mib "$(stat -c %s "$w")") MiB)"
    unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^/      /' || true
  done

  # What travels anyway: tracked files and untracked files git does not ignore.
  local tree
  tree=$( (cd "$REPO" && { git ls-files -z; git ls-files -z --others --exclude-standard; } |
           xargs -0 -r stat -c %s 2>/dev/null) | awk '{ s += $1 } END { print s + 0 }')
  local cap_mib=$((LIMIT_MIB - MARGIN_MIB - RESERVE_MIB - (tree + 1048575) / 1048576))
  [[ -n "$PART_MIB" ]] || PART_MIB=$cap_mib
  if (( PART_MIB > cap_mib || PART_MIB < 1 )); then
    echo "carry_wheels.sh: --part-mib $PART_MIB does not fit: tree $(mib "$tree") MiB leaves $cap_mib MiB a call" >&2
    exit 1
  fi
  echo "tree that travels with every call: $(mib "$tree") MiB; room for wheels a call: $cap_mib MiB" \
       "(limit $LIMIT_MIB, margin $MARGIN_MIB, reserve $RESERVE_MIB); parts of at most $PART_MIB MiB"

  rm -rf "$DIR"/call* "$DIR/parts"
  mkdir -p "$DIR/parts"
  for w in "$DIR"/dl/*.whl; do
    if (( $(stat -c %s "$w") > PART_MIB * 1048576 )); then
      split -b "${PART_MIB}M" -d -a 2 "$w" "$DIR/parts/$(basename "$w").part"
    else
      cp "$w" "$DIR/parts/"
    fi
  done
  # First fit, largest first: calls 1..K, each under cap_mib.
  local -a load=()
  local p s k
  while read -r s p; do
    for ((k = 0; ; k++)); do
      [[ -n "${load[k]:-}" ]] || load[k]=0
      if (( load[k] + s <= cap_mib * 1048576 )); then
        mkdir -p "$DIR/call$((k + 1))"
        mv "$p" "$DIR/call$((k + 1))/"
        load[k]=$((load[k] + s))
        break
      fi
    done
  done < <(find "$DIR/parts" -type f -printf '%s %p\n' | sort -rn)
  rmdir "$DIR/parts"
  local n=${#load[@]}
  (cd "$DIR/dl" && sha256sum -- *.whl) > "$DIR/call$n/SHA256SUMS"
  echo
  for ((k = 1; k <= n; k++)); do
    echo "$rel/call$k: $(mib "${load[k - 1]}") MiB: $(find "$DIR/call$k" -type f -printf '%f ')"
  done
  echo
  echo "Device calls, back to back (each as soon as the previous one answers: the machine is given back 30 s"
  echo "after a call, and /tmp lives only while it is held):"
  for ((k = 1; k <= n; k++)); do
    local c="mkdir -p /tmp/whl && cp $rel/call$k/* /tmp/whl/ && ls -l /tmp/whl"
    if (( k == n )); then
      c="mkdir -p /tmp/whl && cp $rel/call$k/* /tmp/whl/ && scripts/carry_wheels.sh install --from /tmp/whl"
      c+=" --target /tmp/site && scripts/carry_wheels.sh smoke --target /tmp/site 2>&1"
    fi
    echo "  run $k: carry=[\"$rel/call$k\"], timeout_s=$((k == n ? 420 : 120))"
    echo "         command: $c"
  done
  echo "Then, in every later call while the machine is still held: export PYTHONPATH=/tmp/site (and CUDA_HOME"
  echo "as install printed, if it did); e.g. run 3: carry=[\"build-cuda/lily\"], command: export PYTHONPATH=/tmp/site;"
  echo "  bench/reproduce.sh --mlx --steps synth,bench --budget-s 500 --out \$OUT (docs/BENCH_HARNESS.md, MLX-LM)"
}

install() {
  cd "$FROM"
  local part w
  for part in *.part00; do
    [[ -e "$part" ]] || continue
    w="${part%.part00}"
    cat "$w".part?? > "$w.tmp" && mv "$w.tmp" "$w" && rm -f "$w".part??
  done
  [[ -f SHA256SUMS ]] || { echo "carry_wheels.sh: no SHA256SUMS in $FROM (the last call's folder has it)" >&2; exit 1; }
  sha256sum -c SHA256SUMS
  local py="${PY:-python3}"
  local -a wheels
  mapfile -t wheels < <(awk '{ print $2 }' SHA256SUMS)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "${wheels[@]}"
  # libmlx.so finds its CUDA libraries through RPATH $ORIGIN/../../nvidia/...: the image's nvidia/ packages.
  local site
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [[ -d "$site/nvidia" && ! -e "$TARGET/nvidia" ]]; then ln -s "$site/nvidia" "$TARGET/nvidia"; fi
  [[ -d "$site/nvidia" ]] || echo "no $site/nvidia: libmlx.so will look for its CUDA libraries elsewhere"
  echo "nvidia packages of the image ($site/nvidia):"
  "$py" -m pip list 2>/dev/null | grep -iE '^nvidia-(cublas|cuda-nvrtc|cuda-runtime|cudnn|cufft|cusolver|nccl)' | \
    sed 's/^/  /' || true
  local missing
  missing=$(ldd "$TARGET/mlx/lib/libmlx.so" | grep 'not found' || true)
  if [[ -n "$missing" ]]; then
    echo "libmlx.so cannot resolve:"; echo "$missing"
  else
    echo "libmlx.so: every library found"
  fi
  # NVRTC needs the CUDA runtime headers: mlx looks in nvidia/cuda_runtime/include beside it, else $CUDA_HOME,
  # else /usr/local/cuda.
  if [[ ! -d "$TARGET/nvidia/cuda_runtime/include" && ! -d /usr/local/cuda/include && -z "${CUDA_HOME:-}" ]] &&
     command -v nvcc >/dev/null; then
    echo "export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")   # for mlx's NVRTC headers"
  fi
  echo "installed into $TARGET: export PYTHONPATH=$TARGET"
}

smoke() {
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
  if [[ -z "${CUDA_HOME:-}" && ! -d /usr/local/cuda/include ]] && command -v nvcc >/dev/null; then
    CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"; export CUDA_HOME
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import mlx.core as mx, mlx_lm, shutil, sys
print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, "default device", mx.default_device(),
      "cuda", mx.cuda.is_available())
if shutil.which("nvidia-smi") and not mx.cuda.is_available():
    sys.exit("mlx does not see the GPU: its CUDA backend did not load")'
  python3 "$REPO/bench/mlx_reference.py" --model "$REPO/tests/fixtures/golden/mlx_small" --dtype float32 smoke \
    --golden "$REPO/tests/fixtures/golden/mlx_small"
}

case "$cmd" in
  prepare) prepare ;;
  install) install ;;
  smoke) smoke ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
