#include "cuda/device_model.h"

#include <cstring>

#include "model/quant.h"
#include "util/bf16.h"

namespace lily::cuda {

namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ok_status();
  return error(ErrorCode::internal, "%s: %s", what, cudaGetErrorString(e));
}

}  // namespace

DeviceModel::~DeviceModel() {
  for (void* p : allocations_) cudaFree(p);
}

Result<float*> DeviceModel::upload_floats(const std::vector<float>& v) {
  void* d = nullptr;
  RETURN_IF_ERROR(cuda_status(cudaMalloc(&d, v.size() * sizeof(float)), "cudaMalloc"));
  allocations_.push_back(d);
  bytes += v.size() * sizeof(float);
  RETURN_IF_ERROR(cuda_status(cudaMemcpy(d, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice), "upload"));
  return static_cast<float*>(d);
}

// Concatenates the rows of `parts` (same cols) into one device QMatrix. Quantized parts are copied as they are;
// dense parts are quantized with MLX's quantizer at `bits_if_dense`. Parts must agree on bits.
Result<QMatrix> DeviceModel::upload_rows(const std::vector<Linear>& parts, int bits_if_dense) {
  const int64_t cols = parts[0].in;
  const int bits = parts[0].quantized() ? parts[0].bits : bits_if_dense;
  int64_t rows = 0;
  for (const Linear& l : parts) {
    if (l.in != cols || (l.quantized() && l.bits != bits))
      return error(ErrorCode::unsupported, "concatenated projections disagree on shape or bits (%lld vs %lld cols)",
                   (long long)l.in, (long long)cols);
    rows += l.out;
  }
  if (cols % kQuantGroup) return error(ErrorCode::unsupported, "cols %lld not a multiple of 64", (long long)cols);
  const int64_t words = packed_words(cols, bits), groups = cols / kQuantGroup;
  std::vector<uint32_t> w(static_cast<size_t>(rows * words));
  std::vector<uint16_t> s(static_cast<size_t>(rows * groups)), b(s.size());
  int64_t r0 = 0;
  std::vector<float> row(static_cast<size_t>(cols));
  for (const Linear& l : parts) {
    if (l.quantized()) {
      std::memcpy(&w[r0 * words], l.w, static_cast<size_t>(l.out * words) * 4);
      std::memcpy(&s[r0 * groups], l.scales, static_cast<size_t>(l.out * groups) * 2);
      std::memcpy(&b[r0 * groups], l.biases, static_cast<size_t>(l.out * groups) * 2);
    } else {
      for (int64_t r = 0; r < l.out; ++r) {
        l.dequant_row(r, row.data());
        mlx_quantize(row.data(), 1, cols, bits, &w[(r0 + r) * words], &s[(r0 + r) * groups], &b[(r0 + r) * groups]);
      }
    }
    r0 += l.out;
  }
  void *dw = nullptr, *ds = nullptr, *db = nullptr;
  RETURN_IF_ERROR(cuda_status(cudaMalloc(&dw, w.size() * 4), "cudaMalloc weights"));
  allocations_.push_back(dw);
  RETURN_IF_ERROR(cuda_status(cudaMalloc(&ds, s.size() * 2), "cudaMalloc scales"));
  allocations_.push_back(ds);
  RETURN_IF_ERROR(cuda_status(cudaMalloc(&db, b.size() * 2), "cudaMalloc biases"));
  allocations_.push_back(db);
  RETURN_IF_ERROR(cuda_status(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice), "upload"));
  RETURN_IF_ERROR(cuda_status(cudaMemcpy(ds, s.data(), s.size() * 2, cudaMemcpyHostToDevice), "upload"));
  RETURN_IF_ERROR(cuda_status(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice), "upload"));
  bytes += w.size() * 4 + s.size() * 4;
  QMatrix m;
  m.w = static_cast<const uint32_t*>(dw);
  m.scales = static_cast<const __nv_bfloat16*>(ds);
  m.biases = static_cast<const __nv_bfloat16*>(db);
  m.rows = static_cast<int>(rows);
  m.cols = static_cast<int>(cols);
  m.bits = bits;
  return m;
}

Result<std::unique_ptr<DeviceModel>> DeviceModel::upload(const ModelWeights& w) {
  std::unique_ptr<DeviceModel> d(new DeviceModel());
  d->config = w.config;
  ASSIGN_OR_RETURN(d->embed, d->upload_rows({w.embed_tokens}, 4));
  ASSIGN_OR_RETURN(d->lm_head, d->upload_rows({w.lm_head}, 4));
  ASSIGN_OR_RETURN(d->final_norm, d->upload_floats(w.final_norm));
  for (const LayerWeights& lw : w.layers) {
    ASSIGN_OR_RETURN(DeviceLayer dl, d->upload_layer(lw));
    d->layers.push_back(dl);
  }
  return d;
}

Result<DeviceLayer> DeviceModel::upload_layer(const LayerWeights& lw) {
  const ModelConfig& c = config;
  DeviceLayer dl;
  dl.type = lw.type;
  ASSIGN_OR_RETURN(dl.input_norm, upload_floats(lw.input_norm));
  ASSIGN_OR_RETURN(dl.post_norm, upload_floats(lw.post_attention_norm));
  if (lw.type == LayerType::linear_attention) {
    const DeltaNetWeights& g = lw.gdn;
    ASSIGN_OR_RETURN(dl.gdn_in, upload_rows({g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a}, 4));
    ASSIGN_OR_RETURN(dl.gdn_out, upload_rows({g.out_proj}, 4));
    ASSIGN_OR_RETURN(dl.conv_w, upload_floats(g.conv1d));
    ASSIGN_OR_RETURN(dl.A_log, upload_floats(g.A_log));
    ASSIGN_OR_RETURN(dl.dt_bias, upload_floats(g.dt_bias));
    ASSIGN_OR_RETURN(dl.gdn_norm, upload_floats(g.norm));
  } else {
    const AttentionWeights& a = lw.attn;
    ASSIGN_OR_RETURN(dl.attn_in, upload_rows({a.q_proj, a.k_proj, a.v_proj}, 4));
    ASSIGN_OR_RETURN(dl.attn_out, upload_rows({a.o_proj}, 4));
    ASSIGN_OR_RETURN(dl.q_norm, upload_floats(a.q_norm));
    ASSIGN_OR_RETURN(dl.k_norm, upload_floats(a.k_norm));
  }
  const MoeWeights& m = lw.moe;
  ASSIGN_OR_RETURN(dl.router, upload_rows({m.router}, 8));
  ASSIGN_OR_RETURN(dl.shared_gate_row, upload_rows({m.shared_expert_gate}, 8));
  ASSIGN_OR_RETURN(dl.expert_gate, upload_rows(m.expert_gate, 4));
  ASSIGN_OR_RETURN(dl.expert_up, upload_rows(m.expert_up, 4));
  ASSIGN_OR_RETURN(dl.expert_down, upload_rows(m.expert_down, 4));
  dl.expert_gate.rows = dl.expert_up.rows = c.moe_intermediate_size;  // stacked: per-expert rows
  dl.expert_down.rows = c.hidden_size;
  ASSIGN_OR_RETURN(dl.shared_gate, upload_rows({m.shared_gate}, 4));
  ASSIGN_OR_RETURN(dl.shared_up, upload_rows({m.shared_up}, 4));
  ASSIGN_OR_RETURN(dl.shared_down, upload_rows({m.shared_down}, 4));
  return dl;
}

Status DeviceModel::upload_mtp(const MtpWeights& m) {
  if (mtp) return ok_status();
  DeviceMtp h;
  ASSIGN_OR_RETURN(h.fc, upload_rows({m.fc}, 4));
  ASSIGN_OR_RETURN(h.pre_fc_norm_embedding, upload_floats(m.pre_fc_norm_embedding));
  ASSIGN_OR_RETURN(h.pre_fc_norm_hidden, upload_floats(m.pre_fc_norm_hidden));
  ASSIGN_OR_RETURN(h.norm, upload_floats(m.norm));
  ASSIGN_OR_RETURN(h.layer, upload_layer(m.layer));
  if (h.layer.type != LayerType::full_attention)
    return error(ErrorCode::format, "the MTP head's layer is not full attention");
  mtp = h;
  return ok_status();
}

size_t DeviceModel::decode_weight_bytes() const {
  const int k = config.num_experts_per_tok;
  size_t b = embed.bytes() / embed.rows + lm_head.bytes();
  for (const DeviceLayer& l : layers) {
    b += l.type == LayerType::linear_attention ? l.gdn_in.bytes() + l.gdn_out.bytes() : l.attn_in.bytes() + l.attn_out.bytes();
    b += l.router.bytes() + l.shared_gate_row.bytes() + k * (l.expert_gate.bytes() + l.expert_up.bytes() + l.expert_down.bytes());
    b += l.shared_gate.bytes() + l.shared_up.bytes() + l.shared_down.bytes();
  }
  return b;
}

}  // namespace lily::cuda
