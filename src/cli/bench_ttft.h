// `lily bench --mode ttft`: time to first token through the server. Starts `lily serve` (this binary) on a model
// directory as a child process, sends streaming chat completions whose single user message is about
// `prompt_tokens` tokens (each one different, so the session cache cannot reuse a prefix), and measures on the
// client the time from sending the request to the first SSE chunk that carries content or reasoning_content:
// tokenization, chat formatting, prefill, the first sampled token and the HTTP/SSE path all included.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "util/status.h"

namespace lily::cli {

struct TtftOptions {
  std::string model;            // checkpoint directory with its tokenizer
  std::string backend = "auto";
  int prompt_tokens = 1024;
  int reps = 5;                 // timed requests (one untimed warm-up first)
  int port = 18080;
  int ctx_size = 8192;
  int threads = 0;              // CPU backend threads (0: the server's default)
  std::string cuda_options;     // the server's --cuda-options (empty: none)
  int decode_tokens = 0;        // > 0: also stream one answer of this many tokens after a prompt_tokens prompt
  std::vector<int> streams;     // then, for each n, n such answers streamed at once (the server's --parallel)
  int parallel = 0;             // the server's --parallel (0: its default)
  int busy_streams = 0;         // > 0: a new prompt's first token while this many such answers stream
  std::vector<std::string> decode_fields;  // KEY=JSON added to the decode requests (e.g. min_tokens=1)
};

// With decode_tokens, the streamed decode rate a client sees: one greedy request of at most that many tokens timed
// from its first content chunk to its last, (tokens - 1) / that time (it may stop early at a stop token).
// With streams, for each n: n clients streaming such answers at once (each its own prompt), the per-stream and
// aggregate decode rates.
// Runs the measurement; `out` gets the prompt's token count, every request's ms and their median/min/max.
Status run_ttft_bench(const TtftOptions& o, nlohmann::json& out);

}  // namespace lily::cli
