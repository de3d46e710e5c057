// `lily tokenize --tokenizer FILE`: stdin text -> token ids as a JSON array on stdout.
// `--decode`: stdin JSON array of ids -> text. `--bench N`: encode stdin N times, print MB/s.
#include <chrono>
#include <ctime>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands.h"
#include "tokenizer/tokenizer.h"

namespace lily::cli {
namespace {

struct TokenizeArgs {
  std::string tokenizer_path;
  bool decode = false;
  int bench_reps = 0;
};

Result<std::vector<int32_t>> parse_ids(const std::string& text, int32_t vocab_size) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_array()) return invalid_argument("--decode: stdin must be a JSON array of token ids");
  std::vector<int32_t> ids;
  for (size_t i = 0; i < j.size(); ++i) {
    if (!j[i].is_number_integer() || j[i].get<int64_t>() < 0 || j[i].get<int64_t>() >= vocab_size) {
      return invalid_argument("--decode: element %zu (%s) is not a token id in [0, %d)", i, j[i].dump().c_str(),
                              vocab_size);
    }
    ids.push_back(static_cast<int32_t>(j[i].get<int64_t>()));
  }
  return ids;
}

void run_bench(const Tokenizer& tokenizer, const std::string& text, int reps) {
  size_t n_tokens = 0;
  const std::clock_t cpu0 = std::clock();  // CPU time too: the wall clock suffers on a shared machine
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) n_tokens += tokenizer.encode(text).size();
  std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
  const double cpu_s = static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
  const double mb = static_cast<double>(text.size()) * reps / 1e6;
  std::printf("{\"bytes\": %zu, \"reps\": %d, \"tokens\": %zu, \"seconds\": %.4f, \"mb_per_s\": %.2f, "
              "\"cpu_seconds\": %.4f, \"mb_per_cpu_s\": %.2f}\n",
              text.size(), reps, n_tokens, dt.count(), mb / dt.count(), cpu_s, mb / cpu_s);
}

int run_tokenize(const TokenizeArgs& args) {
  Result<Tokenizer> tokenizer = Tokenizer::load(args.tokenizer_path);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "lily tokenize: %s\n", tokenizer.status().message().c_str());
    return 1;
  }
  std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  if (args.bench_reps > 0) {
    run_bench(*tokenizer, input, args.bench_reps);
    return 0;
  }
  if (args.decode) {
    Result<std::vector<int32_t>> ids = parse_ids(input, tokenizer->vocab_size());
    if (!ids.ok()) {
      std::fprintf(stderr, "lily tokenize: %s\n", ids.status().message().c_str());
      return 1;
    }
    std::string text = tokenizer->decode(*ids);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  std::printf("%s\n", nlohmann::json(tokenizer->encode(input)).dump().c_str());
  return 0;
}

void setup(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Text on stdin -> token ids (JSON array) on stdout, or --decode");
  cmd->add_option("--tokenizer", args->tokenizer_path, "tokenizer.json")->required();
  cmd->add_flag("--decode", args->decode, "read a JSON array of ids from stdin and print the text");
  cmd->add_option("--bench", args->bench_reps, "encode stdin this many times and print one-thread MB/s as JSON");
  cmd->callback([args] { set_exit_code(run_tokenize(*args)); });
}

}  // namespace

LILY_COMMAND(setup);

}  // namespace lily::cli
