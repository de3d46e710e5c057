// lily chat: interactive multi-turn chat in the terminal. Lines are read from stdin, edited with history on a
// terminal (cli/line_reader.h), plain from a pipe; the conversation is kept as OpenAI messages and rendered with
// the chat template each turn, so the session cache resumes from the previous turn. The answer streams as it
// is generated: reasoning dimmed (or hidden), then the content; usage follows, dimmed. Ctrl-C stops the
// current answer; at the prompt, a second Ctrl-C exits. --save FILE keeps the conversation as JSON messages.
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "cli/line_reader.h"
#include "tokenizer/chat_format.h"
#include "tokenizer/output_parser.h"

namespace lily::cli {
namespace {

using json = nlohmann::ordered_json;

// Set by SIGINT; a signal handler can reach nothing else. Passed to the engine as request.cancel.
std::atomic<bool> g_interrupted{false};

extern "C" void on_sigint(int) {
  g_interrupted.store(true);
}

void install_sigint_handler() {
  struct sigaction sa = {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a Ctrl-C at the prompt interrupts the read
  sigaction(SIGINT, &sa, nullptr);
}

struct ChatArgs {
  EngineArgs engine;
  SamplingArgs sampling;
  std::string system, save;
  bool hide_reasoning = false, no_thinking = false;
};

class ChatSession {
 public:
  ChatSession(LoadedEngine loaded, const ChatArgs& args)
      : loaded_(std::move(loaded)),
        args_(args),
        tty_out_(isatty(STDOUT_FILENO)),
        tty_in_(isatty(STDIN_FILENO)),
        input_(g_interrupted) {
    if (!args.system.empty()) system_ = args.system;
  }
  int run();

 private:
  void dim(const char* fmt, const std::string& text, FILE* f = stderr);
  void handle_command(const std::string& line);
  Status answer(const std::string& user_text);
  json messages_for_render() const;
  void print_delta(const ParsedDelta& d);
  void save() const;

  LoadedEngine loaded_;
  const ChatArgs& args_;
  const bool tty_out_, tty_in_;
  LineReader input_;
  std::optional<std::string> system_;
  json turns_ = json::array();  // user and assistant messages (no system)
  bool in_reasoning_ = false, printed_reasoning_ = false, printed_content_ = false;
  bool quit_ = false;
};

void ChatSession::dim(const char* fmt, const std::string& text, FILE* f) {
  std::fflush(stdout);
  if (tty_out_) std::fputs("\x1b[2m", f);
  std::fprintf(f, fmt, text.c_str());
  if (tty_out_) std::fputs("\x1b[0m", f);
  std::fflush(f);
}

// The conversation as OpenAI messages (system first), rewritten whole after each answer.
void ChatSession::save() const {
  std::ofstream f(args_.save, std::ios::binary | std::ios::trunc);
  f << messages_for_render().dump(2) << "\n";
  if (!f.good()) std::fprintf(stderr, "lily chat: cannot write the conversation to %s\n", args_.save.c_str());
}

json ChatSession::messages_for_render() const {
  json messages = json::array();
  if (system_) messages.push_back({{"role", "system"}, {"content", *system_}});
  for (const auto& m : turns_) messages.push_back(m);
  return messages;
}

void ChatSession::handle_command(const std::string& line) {
  if (line == "/exit" || line == "/quit") {
    quit_ = true;
  } else if (line == "/reset") {
    turns_ = json::array();
    dim("%s\n", "(conversation cleared)");
  } else if (line.rfind("/system", 0) == 0 && (line.size() == 7 || line[7] == ' ')) {
    std::string text = line.size() > 8 ? line.substr(8) : "";
    if (text.empty())
      system_.reset();
    else
      system_ = text;
    dim("%s\n", text.empty() ? "(system prompt removed)" : "(system prompt set)");
  } else {
    dim("%s\n", "commands: /reset  /system TEXT  /exit   (Ctrl-C stops an answer)");
  }
}

void ChatSession::print_delta(const ParsedDelta& d) {
  if (!d.reasoning.empty() && !args_.hide_reasoning) {
    if (tty_out_ && !in_reasoning_) std::fputs("\x1b[2m", stdout);
    in_reasoning_ = printed_reasoning_ = true;
    std::fputs(d.reasoning.c_str(), stdout);
  }
  if (!d.content.empty()) {
    if (in_reasoning_) {
      if (tty_out_) std::fputs("\x1b[0m", stdout);
      in_reasoning_ = false;
    }
    if (printed_reasoning_ && !printed_content_) std::fputs("\n\n", stdout);
    printed_content_ = true;
    std::fputs(d.content.c_str(), stdout);
  }
  std::fflush(stdout);
}

Status ChatSession::answer(const std::string& user_text) {
  turns_.push_back({{"role", "user"}, {"content", user_text}});
  ChatOptions options;
  options.enable_thinking = !args_.no_thinking;
  Engine& engine = *loaded_.engine;
  Result<std::string> prompt = render_chat(messages_for_render(), nullptr, options);
  if (!prompt.ok()) {
    turns_.erase(turns_.size() - 1);
    return prompt.status();
  }
  GenerationRequest request;
  request.prompt = engine.tokenizer().encode(*prompt);
  ASSIGN_OR_RETURN(request.sampling,
                   sampling_params(args_.sampling, loaded_.defaults, engine.config().vocab_size));
  request.stop_token_ids = loaded_.stop_token_ids;
  request.cancel = &g_interrupted;
  g_interrupted.store(false);

  OutputParser parser(options.enable_thinking, nullptr);
  std::string reasoning, content;
  in_reasoning_ = printed_reasoning_ = printed_content_ = false;
  auto take = [&](const ParsedDelta& d) {
    reasoning += d.reasoning;
    content += d.content;
    print_delta(d);
  };
  Result<GenerationResult> r = engine.generate(request, [&](const GenerationPiece& p) {
    take(parser.push(p.text));
    return true;
  });
  take(parser.finish());
  if (in_reasoning_ && tty_out_) std::fputs("\x1b[0m", stdout);
  std::fputs("\n", stdout);
  if (!r.ok()) {
    turns_.erase(turns_.size() - 1);
    return r.status();
  }
  json reply = {{"role", "assistant"}, {"content", content}};
  if (!reasoning.empty()) reply["reasoning_content"] = reasoning;
  turns_.push_back(reply);  // a stopped answer stays as far as it got

  const double tps = r->completion_tokens > 1 ? (r->completion_tokens - 1) / (r->decode_ms / 1e3) : 0.0;
  dim("%s\n", format("[%s%d tokens, %.1f tok/s | prompt %d tokens, %d cached, first token after %.0f ms]",
                     r->finish_reason == "cancelled" ? "stopped; " : "", r->completion_tokens, tps,
                     r->prompt_tokens, r->cached_tokens, r->time_to_first_token_ms));
  g_interrupted.store(false);
  return ok_status();
}

int ChatSession::run() {
  Engine& engine = *loaded_.engine;
  dim("%s\n",
      format("lily chat: %s on %s (loaded in %.1f s). /reset, /system TEXT, /exit; Ctrl-C stops an answer.",
             args_.engine.model.c_str(), engine.backend().name(), loaded_.load_s));
  if (!input_.note().empty()) dim("%s\n", input_.note());
  install_sigint_handler();
  bool exit_armed = false;  // a Ctrl-C at the prompt arms, a second one exits
  std::string line;
  while (!quit_) {
    ReadResult rr = input_.read(line);
    if (rr == ReadResult::eof) break;
    if (rr == ReadResult::interrupted) {
      g_interrupted.store(false);
      if (exit_armed) break;
      exit_armed = true;
      dim("%s\n", "\n(Ctrl-C again or /exit to quit)");
      continue;
    }
    exit_armed = false;
    if (line.empty()) continue;
    if (line[0] == '/') {
      handle_command(line);
      continue;
    }
    Status st = answer(line);
    if (!st.ok()) std::fprintf(stderr, "lily chat: %s\n", st.message().c_str());
    if (st.ok() && !args_.save.empty()) save();
  }
  if (tty_in_) std::fputs("\n", stdout);
  return 0;
}

void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("chat", "Chat with the model in the terminal (multi-turn, streamed)");
  auto a = std::make_shared<ChatArgs>();
  add_engine_options(cmd, a->engine);
  add_sampling_options(cmd, a->sampling);
  cmd->add_option("--system", a->system, "system prompt");
  cmd->add_option("--save", a->save, "write the conversation (OpenAI messages, JSON) to this file after each answer");
  cmd->add_flag("--hide-reasoning", a->hide_reasoning, "do not print the reasoning (it is shown dimmed)");
  cmd->add_flag("--no-thinking", a->no_thinking,
                "the template's enable_thinking=false: answer without reasoning");
  cmd->callback([a] {
    Result<LoadedEngine> loaded = load_engine(a->engine);
    if (!loaded.ok()) {
      std::fprintf(stderr, "lily chat: %s\n", loaded.status().message().c_str());
      return set_exit_code(1);
    }
    // Flag errors (temperature out of range, ...) before the first question rather than after it.
    auto params = sampling_params(a->sampling, loaded->defaults, loaded->engine->config().vocab_size);
    if (!params.ok()) {
      std::fprintf(stderr, "lily chat: %s\n", params.status().message().c_str());
      return set_exit_code(2);
    }
    ChatSession session(std::move(*loaded), *a);
    set_exit_code(session.run());
  });
}

}  // namespace

LILY_COMMAND(setup);

}  // namespace lily::cli
