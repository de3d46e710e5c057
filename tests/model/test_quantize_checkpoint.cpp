// `lily quantize` (quantize_checkpoint): a tiny synthetic HF bf16 checkpoint -> the mlx-lm 4-bit layout. The result
// has exactly the tensors synth would plan for the mlx layout, loads as layout mlx with 8-bit router gates, and
// its dequantized weights are within the quantization error of the bf16 originals (experts split correctly, conv
// reshaped, zero-centred norms +1, the gated-delta norm untouched). The logits comparison of the two models lives
// in tests/cpu/test_decode_vs_prefill.cpp (it needs the CPU backend).
#include "model/quantize_checkpoint.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "model/synth.h"
#include "model/weights.h"
#include "util/bf16.h"
#include "common/temp_dir.h"

#include <unistd.h>

namespace lily {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;

// Compares a quantized Linear with its bf16 original row by row. Per element, the error is at most |s| (|s|/2 from
// rounding, up to |s| for far-edge values clamped after the edge snap, see test_quant.cpp) plus the bf16 rounding
// of scale and bias. Returns the relative RMS error.
double expect_within_quant_error(const Linear& q, const Linear& ref, const std::string& what, int64_t row_step = 1) {
  EXPECT_EQ(q.out, ref.out) << what;
  EXPECT_EQ(q.in, ref.in) << what;
  EXPECT_TRUE(q.quantized()) << what;
  EXPECT_FALSE(ref.quantized()) << what;
  const float n_bins = static_cast<float>((1 << q.bits) - 1);
  std::vector<float> a(q.in), b(q.in);
  double err2 = 0, ref2 = 0;
  int64_t bad = 0;
  for (int64_t r = 0; r < q.out; r += row_step) {
    q.dequant_row(r, a.data());
    ref.dequant_row(r, b.data());
    for (int64_t j = 0; j < q.in; ++j) {
      const float s = std::fabs(bf16_to_float(q.scales[r * (q.in / 64) + j / 64]));
      const float bias = std::fabs(bf16_to_float(q.biases[r * (q.in / 64) + j / 64]));
      const float bound = s * 1.0001f + (s * n_bins + bias) / 256.0f + 1e-7f;
      const float e = std::fabs(a[j] - b[j]);
      if (e > bound && bad++ < 3) ADD_FAILURE() << what << " row " << r << " col " << j << ": " << a[j] << " vs " << b[j];
      err2 += static_cast<double>(e) * e;
      ref2 += static_cast<double>(b[j]) * b[j];
    }
  }
  const double rel = std::sqrt(err2 / ref2);
  std::printf("[quantize] %-40s %d-bit relative RMS error %.4f\n", what.c_str(), q.bits, rel);
  EXPECT_LT(rel, q.bits == 4 ? 0.12 : 0.01) << what;
  return rel;
}

void expect_vectors_near(const std::vector<float>& got, const std::vector<float>& want, float rel_tol,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], rel_tol * std::fabs(want[i]) + 1e-30f) << what << " [" << i << "]";
}

TEST(QuantizeCheckpoint, TinyHfToMlx) {
  TempDir hf_dir("hf"), out_dir("mlx");
  SynthOptions so;
  so.preset = "tiny";
  so.layout = CheckpointLayout::hf;
  so.out_dir = hf_dir.str();
  so.seed = 11;
  ASSERT_TRUE(synth_write(so).ok());
  QuantizeOptions qo;
  qo.in_dir = hf_dir.str();
  qo.out_dir = out_dir.str();
  qo.shard_bytes = 8u << 20;  // several shards + index, as a real conversion
  Status st = quantize_checkpoint(qo);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(fs::exists(fs::path(out_dir.str()) / "model.safetensors.index.json"));

  auto hf = ModelWeights::load(hf_dir.str());
  ASSERT_TRUE(hf.ok()) << hf.status().message();
  auto q = ModelWeights::load(out_dir.str());
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_EQ(q->layout, CheckpointLayout::mlx);
  EXPECT_EQ(q->n_tensors, q->store->tensors().size()) << "every written tensor is bound";

  // The same names, shapes and dtypes synth plans for the mlx layout (MODEL.md 2.3).
  auto mlx_cfg = synth_config("tiny", CheckpointLayout::mlx);
  ASSERT_TRUE(mlx_cfg.ok());
  auto plan = synth_plan(*mlx_cfg, CheckpointLayout::mlx);
  EXPECT_EQ(q->store->tensors().size(), plan.size());
  for (const auto& t : plan) {
    const TensorInfo* got = q->store->find(t.spec.name);
    ASSERT_NE(got, nullptr) << "quantize did not write " << t.spec.name;
    EXPECT_EQ(got->shape, t.spec.shape) << t.spec.name;
    EXPECT_EQ(got->dtype, t.spec.dtype) << t.spec.name;
  }

  // The config: the quantization block with 8-bit overrides for the router and the shared-expert gate.
  const QuantConfig& qc = q->config.quantization;
  EXPECT_TRUE(qc.enabled);
  EXPECT_EQ(qc.base.bits, 4);
  EXPECT_EQ(qc.for_path("language_model.model.layers.1.mlp.gate").bits, 8);
  EXPECT_EQ(qc.for_path("language_model.model.layers.1.mlp.shared_expert_gate").bits, 8);
  EXPECT_EQ(q->layers[1].moe.router.bits, 8);
  EXPECT_EQ(q->layers[1].moe.shared_expert_gate.bits, 8);
  EXPECT_EQ(q->layers[1].moe.expert_down[0].bits, 4);
  EXPECT_EQ(q->config.num_hidden_layers, hf->config.num_hidden_layers);
  EXPECT_EQ(q->config.vocab_size, hf->config.vocab_size);

  // Dequantized weights against the bf16 originals.
  expect_within_quant_error(q->embed_tokens, hf->embed_tokens, "embed_tokens (every 97th row)", 97);
  expect_within_quant_error(q->lm_head, hf->lm_head, "lm_head (every 97th row)", 97);
  const LayerWeights &q0 = q->layers[0], &h0 = hf->layers[0], &q3 = q->layers[3], &h3 = hf->layers[3];
  expect_within_quant_error(q0.gdn.in_proj_qkv, h0.gdn.in_proj_qkv, "layers.0.linear_attn.in_proj_qkv");
  expect_within_quant_error(q0.gdn.in_proj_b, h0.gdn.in_proj_b, "layers.0.linear_attn.in_proj_b");
  expect_within_quant_error(q0.gdn.out_proj, h0.gdn.out_proj, "layers.0.linear_attn.out_proj");
  expect_within_quant_error(q3.attn.q_proj, h3.attn.q_proj, "layers.3.self_attn.q_proj");
  expect_within_quant_error(q3.attn.o_proj, h3.attn.o_proj, "layers.3.self_attn.o_proj");
  expect_within_quant_error(q3.moe.router, h3.moe.router, "layers.3.mlp.gate (8-bit)");
  expect_within_quant_error(q3.moe.shared_expert_gate, h3.moe.shared_expert_gate, "layers.3.shared_expert_gate (8-bit)");
  expect_within_quant_error(q0.moe.shared_down, h0.moe.shared_down, "layers.0.shared_expert.down_proj");
  // Experts: gate_up_proj [E, 2I, H] split into switch_mlp gate (rows 0..I-1) and up (rows I..2I-1) per expert.
  for (int e : {0, 5, 15}) {
    const std::string ex = "layers.2 expert " + std::to_string(e);
    expect_within_quant_error(q->layers[2].moe.expert_gate[e], hf->layers[2].moe.expert_gate[e], ex + " gate");
    expect_within_quant_error(q->layers[2].moe.expert_up[e], hf->layers[2].moe.expert_up[e], ex + " up");
    expect_within_quant_error(q->layers[2].moe.expert_down[e], hf->layers[2].moe.expert_down[e], ex + " down");
  }

  // Unquantized tensors: conv1d [C,1,K] -> [C,K,1] (same values), A_log / dt_bias copied, norms as multipliers:
  // HF's zero-centred w is bound as 1+w, the mlx file stores bf16(1+w); the gated-delta norm is not shifted.
  for (int l = 0; l < 4; ++l) {
    const LayerWeights &a = q->layers[l], &b = hf->layers[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    expect_vectors_near(a.input_norm, b.input_norm, 1.0f / 256, p + "input_layernorm");
    expect_vectors_near(a.post_attention_norm, b.post_attention_norm, 1.0f / 256, p + "post_attention_layernorm");
    if (b.type == LayerType::full_attention) {
      expect_vectors_near(a.attn.q_norm, b.attn.q_norm, 1.0f / 256, p + "q_norm");
      expect_vectors_near(a.attn.k_norm, b.attn.k_norm, 1.0f / 256, p + "k_norm");
    } else {
      EXPECT_EQ(a.gdn.conv1d, b.gdn.conv1d) << p;
      EXPECT_EQ(a.gdn.A_log, b.gdn.A_log) << p;
      EXPECT_EQ(a.gdn.dt_bias, b.gdn.dt_bias) << p;
      EXPECT_EQ(a.gdn.norm, b.gdn.norm) << p << " linear_attn.norm must not get +1";
    }
  }
  expect_vectors_near(q->final_norm, hf->final_norm, 1.0f / 256, "final norm");
  // The MTP head is kept (mlx-lm drops it): quantized matrices, norms with +1.
  ASSERT_TRUE(hf->mtp.has_value());
  ASSERT_TRUE(q->mtp.has_value()) << "quantize must keep mtp.*";
  expect_within_quant_error(q->mtp->fc, hf->mtp->fc, "mtp.fc");
  expect_within_quant_error(q->mtp->layer.attn.q_proj, hf->mtp->layer.attn.q_proj, "mtp.layers.0.self_attn.q_proj");
  expect_within_quant_error(q->mtp->layer.moe.expert_down[3], hf->mtp->layer.moe.expert_down[3], "mtp expert 3 down");
  EXPECT_EQ(q->mtp->layer.moe.router.bits, 8);
  expect_vectors_near(q->mtp->pre_fc_norm_embedding, hf->mtp->pre_fc_norm_embedding, 1.0f / 256, "mtp.pre_fc_norm_embedding");
  expect_vectors_near(q->mtp->pre_fc_norm_hidden, hf->mtp->pre_fc_norm_hidden, 1.0f / 256, "mtp.pre_fc_norm_hidden");
  expect_vectors_near(q->mtp->norm, hf->mtp->norm, 1.0f / 256, "mtp.norm");
  expect_vectors_near(q->mtp->layer.attn.k_norm, hf->mtp->layer.attn.k_norm, 1.0f / 256, "mtp k_norm");
  float mean_norm = 0;
  for (float v : q->final_norm) mean_norm += v / static_cast<float>(q->final_norm.size());
  EXPECT_NEAR(mean_norm, 1.0f, 0.05f) << "zero-centred norms carry +1 in the mlx file";

  // Quantizing an mlx checkpoint again is refused; so are unsupported bit widths.
  QuantizeOptions again{out_dir.str(), out_dir.str() + "_again"};
  Status st2 = quantize_checkpoint(again);
  EXPECT_FALSE(st2.ok());
  EXPECT_NE(st2.message().find("mlx"), std::string::npos) << st2.message();
  QuantizeOptions bad_bits{hf_dir.str(), out_dir.str() + "_3bit", 3};
  EXPECT_FALSE(quantize_checkpoint(bad_bits).ok());
  fs::remove_all(out_dir.str() + "_again");
}

}  // namespace
}  // namespace lily
