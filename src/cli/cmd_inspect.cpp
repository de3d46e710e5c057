// lily inspect DIR: layout, config summary, tensor count and bytes, quantization.
#include <cstdio>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "model/weights.h"

namespace lily::cli {

static void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("inspect", "Describe a checkpoint directory");
  auto dir = std::make_shared<std::string>();
  cmd->add_option("dir", *dir, kModelHelp)->required()->transform(model_location());
  cmd->callback([dir] {
    auto w = ModelWeights::load(*dir);
    if (!w.ok()) {
      std::fprintf(stderr, "lily inspect: %s\n", w.status().message().c_str());
      return set_exit_code(1);
    }
    const ModelConfig& c = w->config;
    std::printf("directory:     %s\n", dir->c_str());
    std::printf("layout:        %s (config model_type %s)\n",
                w->layout == CheckpointLayout::hf ? "Hugging Face (bf16)" : "mlx-lm (quantized)", c.model_type.c_str());
    std::printf("model:         %s\n", c.summary().c_str());
    std::printf("tensors:       %zu bound of %zu in files, %.2f GB bound, %.2f GB in files\n", w->n_tensors,
                w->store->tensors().size(), w->tensor_bytes / 1e9, w->store->total_bytes() / 1e9);
    if (c.quantization.enabled)
      std::printf("quantization:  affine %d-bit, group %d, %zu per-path overrides\n", c.quantization.base.bits,
                  c.quantization.base.group_size, c.quantization.overrides.size());
    else
      std::printf("quantization:  none\n");
    std::printf("mtp head:      %s\n", w->mtp ? "present" : "absent");
  });
}
LILY_COMMAND(setup);

}  // namespace lily::cli
