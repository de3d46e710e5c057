// lily quantize IN_DIR OUT_DIR: Hugging Face bf16 -> mlx-lm 4-bit layout.
#include <cstdio>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "model/quantize_checkpoint.h"

namespace lily::cli {

static void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("quantize", "Quantize a Hugging Face bf16 checkpoint into the mlx 4-bit layout");
  auto o = std::make_shared<QuantizeOptions>();
  cmd->add_option("in_dir", o->in_dir, "Hugging Face bf16 checkpoint: a directory or ORG/NAME[@REVISION] in the hub cache")
      ->required()
      ->transform(model_location());
  cmd->add_option("out_dir", o->out_dir, "output directory")->required();
  cmd->add_option("--bits", o->bits, "4 (default) or 8");
  cmd->callback([o] {
    Status st = quantize_checkpoint(*o);
    if (!st.ok()) {
      std::fprintf(stderr, "lily quantize: %s\n", st.message().c_str());
      return set_exit_code(1);
    }
    std::printf("wrote %s\n", o->out_dir.c_str());
  });
}
LILY_COMMAND(setup);

}  // namespace lily::cli
