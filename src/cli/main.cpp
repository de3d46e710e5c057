// lily: one binary, subcommands registered by src/cli/cmd_*.cpp.
#include <cstdio>

#include "cli/commands.h"

namespace lily::cli {

std::vector<SetupFn>& command_registry() {
  static std::vector<SetupFn> registry;
  return registry;
}

static int g_exit_code = 0;
void set_exit_code(int code) { g_exit_code = code; }

}  // namespace lily::cli

int main(int argc, char** argv) {
  CLI::App app{"lily: a local inference engine for Qwen3.6-35B-A3B"};
  app.require_subcommand(1);
  for (auto fn : lily::cli::command_registry()) fn(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return lily::cli::g_exit_code;
}
