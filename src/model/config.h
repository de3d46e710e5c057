// ModelConfig: config.json of Qwen3.6-35B-A3B, both the nested `qwen3_5_moe` form (fields under text_config) and
// the flat `qwen3_5_moe_text` form, plus the mlx-lm `quantization` block. Every field of docs/MODEL.md 1.1 that
// the forward needs is read and validated; a problem names the field.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "util/status.h"

namespace lily {

enum class LayerType { linear_attention, full_attention };

struct QuantSpec {
  int bits = 0;  // 0: not quantized
  int group_size = 64;
};

struct QuantConfig {
  bool enabled = false;
  QuantSpec base;                              // {bits 4, group 64} for mlx-lm 4-bit
  std::string mode = "affine";
  std::map<std::string, QuantSpec> overrides;  // module path (no `.weight`) -> spec, e.g. `...mlp.gate` -> 8 bits
  // The spec for a module path, honouring per-path overrides.
  QuantSpec for_path(const std::string& module_path) const;
};

struct ModelConfig {
  std::string model_type;  // of the file: qwen3_5_moe or qwen3_5_moe_text
  int hidden_size = 0;
  int num_hidden_layers = 0;
  std::vector<LayerType> layer_types;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  bool attn_output_gate = true;
  int linear_conv_kernel_dim = 0;
  int linear_key_head_dim = 0;
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_value_head_dim = 0;
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int moe_intermediate_size = 0;
  int shared_expert_intermediate_size = 0;
  int vocab_size = 0;
  int max_position_embeddings = 262144;
  float rms_norm_eps = 1e-6f;
  float partial_rotary_factor = 0.25f;
  double rope_theta = 1e7;
  bool tie_word_embeddings = false;
  int mtp_num_hidden_layers = 0;
  std::vector<int> eos_token_ids;
  QuantConfig quantization;

  // Derived sizes (docs/MODEL.md eqs 7-20).
  int rotary_dim() const { return static_cast<int>(head_dim * partial_rotary_factor); }
  int linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }        // 2048
  int linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }  // 4096
  int linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }         // 8192
  int n_full_attention_layers() const;
  int n_linear_attention_layers() const { return num_hidden_layers - n_full_attention_layers(); }

  static Result<ModelConfig> from_json_text(const std::string& text);
  static Result<ModelConfig> load(const std::string& model_dir);  // reads model_dir/config.json
  // The flat `qwen3_5_moe_text` form (plus `quantization` if set), as `lily synth` writes it.
  std::string to_json_text(bool nested) const;
  std::string summary() const;
};

}  // namespace lily
