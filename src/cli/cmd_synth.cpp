// lily synth: write a synthetic checkpoint directory (tiny | small | full, hf | mlx layout).
#include <cstdio>

#include "cli/commands.h"
#include "model/synth.h"

namespace lily::cli {

static void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("synth", "Write a synthetic checkpoint (deterministic from a seed)");
  struct Args {
    std::string preset = "tiny", layout = "mlx", out;
    uint64_t seed = 0;
    std::string tokenizer = LILY_DEFAULT_TOKENIZER_DIR;
    bool no_tokenizer = false, no_mtp = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--preset", args->preset, "tiny | small | full | full4 (full width, 4 layers)")->check(CLI::IsMember({"tiny", "small", "full", "full4"}));
  cmd->add_option("--layout", args->layout, "hf (bf16) | mlx (4-bit)")->check(CLI::IsMember({"hf", "mlx"}));
  cmd->add_option("--out", args->out, "output directory")->required();
  cmd->add_option("--seed", args->seed, "random seed");
  cmd->add_option("--tokenizer", args->tokenizer, "directory holding tokenizer.json to copy");
  cmd->add_flag("--no-tokenizer", args->no_tokenizer, "write no tokenizer files");
  cmd->add_flag("--no-mtp", args->no_mtp, "write no multi-token-prediction head (as mlx-lm conversions have none)");
  cmd->callback([args] {
    SynthOptions o;
    o.preset = args->preset;
    o.layout = args->layout == "hf" ? CheckpointLayout::hf : CheckpointLayout::mlx;
    o.out_dir = args->out;
    o.seed = args->seed;
    o.tokenizer_dir = args->no_tokenizer ? "" : args->tokenizer;
    o.mtp = !args->no_mtp;
    Status st = synth_write(o);
    if (!st.ok()) {
      std::fprintf(stderr, "lily synth: %s\n", st.message().c_str());
      return set_exit_code(1);
    }
    std::printf("wrote %s model (%s layout) to %s\n", o.preset.c_str(), args->layout.c_str(), o.out_dir.c_str());
  });
}
LILY_COMMAND(setup);

}  // namespace lily::cli
