// `lily render`: an OpenAI chat-completions request on stdin -> the exact prompt text on stdout
// (messages, tools, add_generation_prompt, chat_template_kwargs {enable_thinking, preserve_thinking}).
// The Qwen3.6 template is rendered natively (src/tokenizer/chat_format.h); --model is accepted so the
// command line matches the other subcommands. Nothing is added after the prompt (no newline).
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "tokenizer/chat_format.h"

static int run_render() {
  std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  const auto request = nlohmann::ordered_json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (request.is_discarded()) {
    std::fprintf(stderr, "lily render: stdin is not valid JSON (expected a chat-completions request)\n");
    return 1;
  }
  lily::Result<std::string> prompt = lily::render_chat_request(request);
  if (!prompt.ok()) {
    std::fprintf(stderr, "lily render: %s\n", prompt.status().message().c_str());
    return 1;
  }
  std::fwrite(prompt->data(), 1, prompt->size(), stdout);
  std::fflush(stdout);
  return 0;
}

static void setup(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("render", "Print the prompt text for a chat-completions request read on stdin");
  auto model_dir = std::make_shared<std::string>();
  cmd->add_option("--model", *model_dir, std::string(lily::cli::kModelHelp) + " (optional: the chat template is built in)")
      ->transform(lily::cli::model_location());
  cmd->callback([model_dir] {  // the capture keeps the option's storage alive
    lily::cli::set_exit_code(run_render());
  });
}

LILY_COMMAND(setup);
