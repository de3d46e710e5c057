// Subcommand registry: each src/cli/cmd_<name>.cpp registers itself with LILY_COMMAND(setup_fn);
// setup_fn adds a CLI11 subcommand whose callback stores its exit code with set_exit_code().
#pragma once
#include <CLI/CLI.hpp>
#include <vector>

namespace lily::cli {

using SetupFn = void (*)(CLI::App& app);

std::vector<SetupFn>& command_registry();
void set_exit_code(int code);

struct CommandRegistrar {
  explicit CommandRegistrar(SetupFn fn) { command_registry().push_back(fn); }
};

}  // namespace lily::cli

#define LILY_CLI_CONCAT_INNER(a, b) a##b
#define LILY_CLI_CONCAT(a, b) LILY_CLI_CONCAT_INNER(a, b)
#define LILY_COMMAND(fn) static ::lily::cli::CommandRegistrar LILY_CLI_CONCAT(lily_cmd_registrar_, __LINE__)(fn)
