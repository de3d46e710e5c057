#!/usr/bin/env bash
# Builds the libFuzzer targets (clang; ASan + UBSan) in build-fuzz and runs each for N seconds, one after another
# on one core, on a seed corpus written first:
#   fuzz_safetensors         the safetensors parser (seeds: a valid file from write_safetensors plus broken ones)
#   fuzz_http_request        the HTTP/1.1 request parser (src/server/http_parse.h)
#   fuzz_request_validation  the request validation of every POST endpoint (first byte: the endpoint)
# Usage: scripts/fuzz.sh [SECONDS=60] [BUILD_DIR=build-fuzz] [TARGET...] (default: all three). Exit status non-zero
# on a finding; the crashing input is left in BUILD_DIR/fuzz/ (crash-*, leak-*, timeout-*): rerun it with
# BUILD_DIR/fuzz/TARGET FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
build=${2:-build-fuzz}
shift $(( $# < 2 ? $# : 2 ))
targets=("$@")
((${#targets[@]} > 0)) || targets=(fuzz_safetensors fuzz_http_request fuzz_request_validation)
jobs=${JOBS:-2}

command -v clang++ >/dev/null || bash scripts/install_deps.sh --fuzz
cmake -S . -B "$build" -DLILY_FUZZ=ON -DLILY_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$build" -j "$jobs" --target "${targets[@]}" fuzz_safetensors_seeds

out="$build/fuzz"
mkdir -p "$out"

seed_safetensors() {
  "$out/fuzz_safetensors_seeds" "$1"
  # Tokens of the format, so that mutations reach past the JSON parser.
  printf '%s\n' '"dtype"' '"shape"' '"data_offsets"' '"__metadata__"' '"BF16"' '"F16"' '"F32"' '"U32"' '"I32"' \
    '"I8"' '"U8"' '"I64"' '"{"' '"}"' '"["' '"]"' '":"' '","' '"18446744073709551615"' '"4294967296"' \
    > "$out/fuzz_safetensors.dict"
}

seed_http_request() {
  printf 'GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n' > "$1/get"
  printf 'POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}GET / HTTP/1.0\r\n\r\n' > "$1/pipelined"
  printf 'POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;e=1\r\nabc\r\n0\r\nT: 1\r\n\r\n' > "$1/chunked"
  printf 'GET /a%%20b?q=1 HTTP/1.1\nHost: [::1]:8080\nContent-Length: 1\nContent-Length: 1, 1\n\nx' > "$1/bare_lf"
  # libFuzzer dictionaries escape bytes as \xAB only.
  printf '%s\n' '"HTTP/1.1"' '"HTTP/1.0"' '"\x0D\x0A"' '"\x0A\x0A"' '"Content-Length: "' \
    '"Transfer-Encoding: chunked"' '"Host: "' '"Expect: 100-continue"' '"Connection: close"' '";"' \
    '"0\x0D\x0A\x0D\x0A"' '"POST "' '"HEAD "' > "$out/fuzz_http_request.dict"
}

seed_request_validation() {
  # First byte: 0 chat, 1 completions, 2 apply-template, 3 messages, 4 count_tokens, 5 responses, 6 tokenize,
  # 7 detokenize (fuzz/fuzz_request_validation.cpp, kEndpoints).
  printf '\0{"model":"tiny","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi JSON"}]}],"temperature":0.7,"top_p":0.9,"top_k":20,"stop":["x"],"logit_bias":{"5":-100},"logprobs":true,"top_logprobs":2,"stream":true,"stream_options":{"include_usage":true},"response_format":{"type":"json_object"},"chat_template_kwargs":{"enable_thinking":false}}' > "$1/chat"
  printf '\0{"model":"tiny","messages":[{"role":"user","content":"w"},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\\"a\\":1}"}}]},{"role":"tool","tool_call_id":"c","content":"r"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"integer"}}}}}],"tool_choice":{"type":"function","function":{"name":"f"}}}' > "$1/chat_tools"
  printf '\1{"model":"tiny","prompt":[1,2,3],"max_tokens":4,"logprobs":2,"seed":18446744073709551615,"echo":false}' > "$1/completion_ids"
  printf '\1{"model":"tiny","prompt":"once","n":1,"best_of":1,"stop":"x","max_tokens":1e400}' > "$1/completion_text"
  printf '\2{"messages":[{"role":"developer","content":"d"},{"role":"user","content":"u"}]}' > "$1/apply_template"
  printf '\3{"model":"tiny","max_tokens":64,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"tool_result","tool_use_id":"t","content":"r","is_error":true}]},{"role":"assistant","content":[{"type":"thinking","thinking":"x","signature":"s"},{"type":"tool_use","id":"t","name":"f","input":{"a":1}}]}],"tools":[{"name":"f","input_schema":{"type":"object"}}],"tool_choice":{"type":"any"},"thinking":{"type":"enabled","budget_tokens":1024},"stop_sequences":["x"],"stream":true}' > "$1/messages"
  printf '\4{"model":"tiny","messages":[{"role":"user","content":"hi"}]}' > "$1/count_tokens"
  printf '\5{"model":"tiny","instructions":"i","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":"o"}],"tools":[{"type":"function","name":"f","parameters":{"type":"object"}}],"max_output_tokens":16,"reasoning":{"effort":"low"},"text":{"format":{"type":"json_object"}},"stream":true}' > "$1/responses"
  printf '\6{"content":"hello <|im_end|>","add_special":true,"with_pieces":true}' > "$1/tokenize"
  printf '\7{"tokens":[1,2,151643]}' > "$1/detokenize"
  printf '%s\n' '"model"' '"messages"' '"role"' '"content"' '"user"' '"assistant"' '"tool"' '"system"' \
    '"tools"' '"tool_choice"' '"function"' '"arguments"' '"prompt"' '"max_tokens"' '"logprobs"' '"stream"' \
    '"stream_options"' '"logit_bias"' '"response_format"' '"json_object"' '"chat_template_kwargs"' '"1e400"' \
    '"-1e309"' '"null"' '"true"' '"tiny"' > "$out/fuzz_request_validation.dict"
}

status=0
for target in "${targets[@]}"; do
  corpus="$out/corpus_${target#fuzz_}"
  mkdir -p "$corpus"
  "seed_${target#fuzz_}" "$corpus"
  echo "fuzz.sh: running $target for ${seconds}s"
  "$out/$target" -max_total_time="$seconds" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
    -dict="$out/$target.dict" -artifact_prefix="$out/" -print_final_stats=1 "$corpus" || status=1
done
exit $status
