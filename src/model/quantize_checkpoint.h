// `lily quantize`: a Hugging Face bf16 checkpoint -> an mlx-lm 4-bit directory (docs/MODEL.md 2.1-2.3):
// mlx names (`language_model.model.*`), experts split into switch_mlp.{gate,up,down}_proj, conv1d as [C, K, 1],
// zero-centred norms with +1 baked in, every Linear / embedding / lm_head / expert quantized affine 4-bit group 64,
// router gates 8-bit, and a config.json with the `quantization` block and its per-path overrides.
#pragma once
#include <string>

#include "util/status.h"

namespace lily {

struct QuantizeOptions {
  std::string in_dir, out_dir;
  int bits = 4;
  size_t shard_bytes = 5ull << 30;
};

Status quantize_checkpoint(const QuantizeOptions& options);

}  // namespace lily
