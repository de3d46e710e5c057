// Synthetic checkpoints (`lily synth`): config.json, sharded safetensors with index, tokenizer files, in the
// Hugging Face bf16 layout or the mlx-lm 4-bit layout, deterministic from a seed. Weights are scaled so that
// activations stay O(1) through all layers and logits have a std of about 3 (top-1 comparisons mean something).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace lily {

// Presets: tiny (fast CPU tests), small (end-to-end GPU checks), full (the exact Qwen3.6-35B-A3B geometry).
// Each has the multi-token-prediction head (mtp_num_hidden_layers 1; SynthOptions::mtp = false drops it).
Result<ModelConfig> synth_config(const std::string& preset, CheckpointLayout layout);

// How one synthetic tensor is generated.
enum class SynthKind : uint8_t {
  gaussian,     // N(mean, std)
  a_log,        // log(U(1, 16))
  quant_words,  // uniform random codes
  quant_scales, // +-std/std(q) with jitter, random sign (negative scales occur, as in MLX files)
  quant_biases, // -mid(q) * scale of the same group
};

struct SynthTensor {
  TensorSpec spec;
  SynthKind kind = SynthKind::gaussian;
  float mean = 0, std = 1;
  int bits = 0;               // for quant_*
  uint64_t scale_stream = 0;  // for quant_scales/biases: the stream their scales come from
};

// Every tensor the preset writes, in file order (names and shapes of docs/MODEL.md 1.2 or 2.3).
std::vector<SynthTensor> synth_plan(const ModelConfig& config, CheckpointLayout layout);

struct SynthOptions {
  std::string preset = "tiny";
  CheckpointLayout layout = CheckpointLayout::mlx;
  std::string out_dir;
  uint64_t seed = 0;
  std::string tokenizer_dir;  // holds tokenizer.json (+ tokenizer_config.json); empty: write no tokenizer
  size_t shard_bytes = 5ull << 30;
  bool mtp = true;  // write the multi-token-prediction head (`mtp.*`, config mtp_num_hidden_layers 1)
};

Status synth_write(const SynthOptions& options);

// A synthetic model built in memory (no files): for benchmarks of the full geometry.
Result<ModelWeights> synth_in_memory(const std::string& preset, CheckpointLayout layout, uint64_t seed);

// Fills one tensor's bytes (exposed for tests and for generating weights directly in memory).
void synth_fill(const SynthTensor& t, uint64_t seed, uint8_t* dst);

}  // namespace lily
