// The model's weights in GPU memory, in the layout the decode kernels read: MLX affine quantized matrices as they
// are in the checkpoint (no repack), with the projections that share an input concatenated by rows at upload:
//   Gated DeltaNet in:  [in_proj_qkv (8192) | in_proj_z (4096) | in_proj_b (32) | in_proj_a (32)] x 2048
//   attention in:       [q_proj (16 x (256 query + 256 gate)) | k_proj (512) | v_proj (512)] x 2048
// so one GEMV launch reads them all. A Hugging Face bf16 checkpoint is quantized at upload (4-bit, router and
// shared-expert gates 8-bit), with MLX's quantizer. Norms and small vectors are fp32.
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include "cuda/kernels/common.cuh"
#include "model/weights.h"

namespace lily::cuda {

struct DeviceLayer {
  LayerType type = LayerType::linear_attention;
  float* input_norm = nullptr;
  float* post_norm = nullptr;
  QMatrix gdn_in, gdn_out;
  float *conv_w = nullptr, *A_log = nullptr, *dt_bias = nullptr, *gdn_norm = nullptr;
  QMatrix attn_in, attn_out;
  float *q_norm = nullptr, *k_norm = nullptr;
  QMatrix router, shared_gate_row, expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down;
};

// The multi-token-prediction head (eq 26), uploaded by upload_mtp (enable_mtp): fc [H, 2H] over
// [ZN(embedding); ZN(hidden)], one full-attention MoE decoder layer, its final norm; embed and lm_head are shared.
struct DeviceMtp {
  QMatrix fc;
  float *pre_fc_norm_embedding = nullptr, *pre_fc_norm_hidden = nullptr, *norm = nullptr;
  DeviceLayer layer;
};

class DeviceModel {
 public:
  static Result<std::unique_ptr<DeviceModel>> upload(const ModelWeights& w);
  Status upload_mtp(const MtpWeights& m);  // once; fills `mtp`
  ~DeviceModel();
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  ModelConfig config;
  QMatrix embed, lm_head;
  float* final_norm = nullptr;
  std::vector<DeviceLayer> layers;
  std::optional<DeviceMtp> mtp;
  size_t bytes = 0;  // device memory held
  // Bytes one decode step must read for weights (active experts only) at this geometry.
  size_t decode_weight_bytes() const;
  // The rows of `parts` (same cols) concatenated into one device matrix the model owns (quantized parts as they
  // are, dense ones quantized at bits_if_dense); the parts must agree on bits.
  Result<QMatrix> upload_rows(const std::vector<Linear>& parts, int bits_if_dense);

 private:
  DeviceModel() = default;
  Result<float*> upload_floats(const std::vector<float>& v);
  Result<DeviceLayer> upload_layer(const LayerWeights& lw);
  std::vector<void*> allocations_;
};

}  // namespace lily::cuda
