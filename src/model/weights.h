// ModelWeights: every tensor the forward needs, bound from either real checkpoint layout (docs/MODEL.md 1.2 and
// 2.3) into one structure. Linear weights stay where they are (mmap); norms and small vectors are copied to fp32
// with the zero-centred (1+w) shift already applied, so every backend sees plain multipliers.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/safetensors.h"
#include "util/tensor.h"

namespace lily {

enum class CheckpointLayout { hf, mlx };
inline const char* layout_name(CheckpointLayout l) { return l == CheckpointLayout::hf ? "hf" : "mlx"; }

// A weight matrix [out, in]: dense (BF16/F16/F32) or MLX-quantized (U32 packed + bf16 scales/biases, group 64).
struct Linear {
  int64_t out = 0, in = 0;
  DType dtype = DType::bf16;  // dense element type, or U32 when quantized
  int bits = 0;               // 0: dense; 4 or 8: quantized
  const void* w = nullptr;
  const uint16_t* scales = nullptr;  // [out, in/64] bf16
  const uint16_t* biases = nullptr;

  bool quantized() const { return bits != 0; }
  void dequant_row(int64_t r, float* out_row) const;
  float dot_row(int64_t r, const float* x) const;
  Linear rows(int64_t begin, int64_t count) const;  // a contiguous slice of output rows
  size_t bytes() const;                             // weight + scales + biases
};

struct AttentionWeights {  // eqs 7-12
  Linear q_proj, k_proj, v_proj, o_proj;
  std::vector<float> q_norm, k_norm;  // [head_dim], multipliers
};

struct DeltaNetWeights {  // eqs 13-20
  Linear in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj;
  std::vector<float> conv1d;  // [conv_dim, kernel]
  std::vector<float> dt_bias, A_log;  // [n_v_heads]
  std::vector<float> norm;            // [d_v], used as is (not zero-centred)
};

struct MoeWeights {  // eqs 21-25
  Linear router;                                          // mlp.gate [E, H]
  std::vector<Linear> expert_gate, expert_up, expert_down;  // E each: [I, H], [I, H], [H, I]
  Linear shared_gate, shared_up, shared_down;               // [Is, H], [Is, H], [H, Is]
  Linear shared_expert_gate;                                // [1, H]
};

struct LayerWeights {
  LayerType type = LayerType::linear_attention;
  std::vector<float> input_norm, post_attention_norm;  // [H], multipliers
  AttentionWeights attn;                               // full-attention layers
  DeltaNetWeights gdn;                                 // linear-attention layers
  MoeWeights moe;
};

struct MtpWeights {  // eq 26 (optional speculative head; `mtp.*` in either layout)
  Linear fc;
  std::vector<float> pre_fc_norm_embedding, pre_fc_norm_hidden, norm;
  LayerWeights layer;
};

struct ModelWeights {
  ModelConfig config;
  CheckpointLayout layout = CheckpointLayout::hf;
  std::string dir;
  Linear embed_tokens;  // [V, H]: row lookup
  Linear lm_head;       // [V, H]
  std::vector<float> final_norm;
  std::vector<LayerWeights> layers;
  std::optional<MtpWeights> mtp;
  size_t n_tensors = 0;       // tensors bound
  size_t tensor_bytes = 0;    // bytes of the bound tensors
  size_t mtp_tensors = 0, mtp_tensor_bytes = 0;  // of those, the MTP head's
  std::shared_ptr<TensorStore> store;  // owns the mappings
  std::shared_ptr<TensorStore> mtp_store;  // the head's, when it came from another directory (attach_mtp)

  static Result<ModelWeights> load(const std::string& dir);
  // Binds the MTP head from another checkpoint of the same model (e.g. the Hugging Face bf16 one beside an
  // mlx-lm 4-bit directory, which has none): its config must have the same geometry.
  Status attach_mtp(const std::string& mtp_dir);
  // The error of a backend asked for the head (enable_mtp) when the checkpoint has none: says how to get one.
  Status missing_mtp_error() const;
  static Result<ModelWeights> bind(const ModelConfig& config, std::shared_ptr<TensorStore> store,
                                   const std::string& dir);
};

}  // namespace lily
