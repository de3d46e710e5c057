#!/usr/bin/env bash
# Builds the libFuzzer target for the safetensors parser (clang; ASan + UBSan) in build-fuzz and runs it for N
# seconds on a seed corpus it writes first: a valid file from write_safetensors plus broken ones.
# Usage: scripts/fuzz.sh [SECONDS=60] [BUILD_DIR=build-fuzz]. Exit status non-zero on a finding; the crashing
# input is left in BUILD_DIR/fuzz/ (crash-*, leak-*, timeout-*): rerun it with BUILD_DIR/fuzz/fuzz_safetensors FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
build=${2:-build-fuzz}
jobs=${JOBS:-2}

command -v clang++ >/dev/null || bash scripts/install_deps.sh --fuzz
cmake -S . -B "$build" -DLILY_FUZZ=ON -DLILY_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$build" -j "$jobs" --target fuzz_safetensors fuzz_safetensors_seeds

out="$build/fuzz"
corpus="$out/corpus_safetensors"
mkdir -p "$corpus"
"$out/fuzz_safetensors_seeds" "$corpus"
# Tokens of the format, so that mutations reach past the JSON parser.
cat > "$out/safetensors.dict" <<'DICT'
"dtype"
"shape"
"data_offsets"
"__metadata__"
"BF16"
"F16"
"F32"
"U32"
"I32"
"I8"
"U8"
"I64"
"{"
"}"
"["
"]"
":"
","
"18446744073709551615"
"4294967296"
DICT
echo "fuzz.sh: running fuzz_safetensors for ${seconds}s"
"$out/fuzz_safetensors" -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -dict="$out/safetensors.dict" -artifact_prefix="$out/" -print_final_stats=1 "$corpus"
