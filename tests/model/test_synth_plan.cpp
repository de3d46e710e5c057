// `lily synth --preset full` plans exactly the tensors of the real checkpoints (checked on the plan, nothing is
// written): the mlx-lm 4-bit layout of docs/MODEL.md 2.3 and the Hugging Face bf16 layout of 1.2. The expected
// names and shapes below are transcribed from the tables of MODEL.md, not derived from the config.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>

#include "model/synth.h"

namespace lily {
namespace {

struct Want {
  Shape shape;
  std::set<DType> dtypes;
};
using WantMap = std::map<std::string, Want>;

const std::set<DType> kBf16 = {DType::bf16};
const std::set<DType> kU32 = {DType::u32};
const std::set<DType> kBf16OrF32 = {DType::bf16, DType::f32};

bool full_attention(int layer) { return layer % 4 == 3; }  // MODEL.md 1.1: layers 3, 7, ..., 39

// A quantized triple of MODEL.md 2.3: `.weight` U32 packed, `.scales` / `.biases` BF16.
void add_quantized(WantMap& m, const std::string& module, Shape weight, Shape scales) {
  m[module + ".weight"] = {weight, kU32};
  m[module + ".scales"] = {scales, kBf16};
  m[module + ".biases"] = {scales, kBf16};
}

// MODEL.md 2.3, row by row.
WantMap mlx_table() {
  WantMap m;
  add_quantized(m, "language_model.model.embed_tokens", {248320, 256}, {248320, 32});
  add_quantized(m, "language_model.lm_head", {248320, 256}, {248320, 32});
  m["language_model.model.norm.weight"] = {{2048}, kBf16};
  for (int L = 0; L < 40; ++L) {
    const std::string p = "language_model.model.layers." + std::to_string(L) + ".";
    if (full_attention(L)) {
      add_quantized(m, p + "self_attn.q_proj", {8192, 256}, {8192, 32});
      add_quantized(m, p + "self_attn.k_proj", {512, 256}, {512, 32});
      add_quantized(m, p + "self_attn.v_proj", {512, 256}, {512, 32});
      add_quantized(m, p + "self_attn.o_proj", {2048, 512}, {2048, 64});
      m[p + "self_attn.q_norm.weight"] = {{256}, kBf16};
      m[p + "self_attn.k_norm.weight"] = {{256}, kBf16};
    } else {
      add_quantized(m, p + "linear_attn.in_proj_qkv", {8192, 256}, {8192, 32});
      add_quantized(m, p + "linear_attn.in_proj_z", {4096, 256}, {4096, 32});
      add_quantized(m, p + "linear_attn.in_proj_b", {32, 256}, {32, 32});
      add_quantized(m, p + "linear_attn.in_proj_a", {32, 256}, {32, 32});
      add_quantized(m, p + "linear_attn.out_proj", {2048, 512}, {2048, 64});
      m[p + "linear_attn.conv1d.weight"] = {{8192, 4, 1}, kBf16};
      m[p + "linear_attn.dt_bias"] = {{32}, kBf16};
      m[p + "linear_attn.A_log"] = {{32}, kBf16OrF32};  // keeps the source dtype
      m[p + "linear_attn.norm.weight"] = {{128}, kBf16};
    }
    add_quantized(m, p + "mlp.gate", {256, 512}, {256, 32});                    // 8-bit
    add_quantized(m, p + "mlp.shared_expert_gate", {1, 512}, {1, 32});          // 8-bit
    add_quantized(m, p + "mlp.switch_mlp.gate_proj", {256, 512, 256}, {256, 512, 32});
    add_quantized(m, p + "mlp.switch_mlp.up_proj", {256, 512, 256}, {256, 512, 32});
    add_quantized(m, p + "mlp.switch_mlp.down_proj", {256, 2048, 64}, {256, 2048, 8});
    add_quantized(m, p + "mlp.shared_expert.gate_proj", {512, 256}, {512, 32});
    add_quantized(m, p + "mlp.shared_expert.up_proj", {512, 256}, {512, 32});
    add_quantized(m, p + "mlp.shared_expert.down_proj", {2048, 64}, {2048, 8});
    m[p + "input_layernorm.weight"] = {{2048}, kBf16};
    m[p + "post_attention_layernorm.weight"] = {{2048}, kBf16};
  }
  return m;
}

// MODEL.md 1.2 (text tensors; mtp.* and model.visual.* are not part of the synthetic plan's 693).
WantMap hf_table() {
  WantMap m;
  m["model.language_model.embed_tokens.weight"] = {{248320, 2048}, kBf16};
  m["model.language_model.norm.weight"] = {{2048}, kBf16};
  m["lm_head.weight"] = {{248320, 2048}, kBf16};
  for (int L = 0; L < 40; ++L) {
    const std::string p = "model.language_model.layers." + std::to_string(L) + ".";
    m[p + "input_layernorm.weight"] = {{2048}, kBf16};
    m[p + "post_attention_layernorm.weight"] = {{2048}, kBf16};
    m[p + "mlp.gate.weight"] = {{256, 2048}, kBf16};
    m[p + "mlp.experts.gate_up_proj"] = {{256, 1024, 2048}, kBf16};  // packed, no `.weight`
    m[p + "mlp.experts.down_proj"] = {{256, 2048, 512}, kBf16};
    m[p + "mlp.shared_expert.gate_proj.weight"] = {{512, 2048}, kBf16};
    m[p + "mlp.shared_expert.up_proj.weight"] = {{512, 2048}, kBf16};
    m[p + "mlp.shared_expert.down_proj.weight"] = {{2048, 512}, kBf16};
    m[p + "mlp.shared_expert_gate.weight"] = {{1, 2048}, kBf16};
    if (full_attention(L)) {
      m[p + "self_attn.q_proj.weight"] = {{8192, 2048}, kBf16};
      m[p + "self_attn.k_proj.weight"] = {{512, 2048}, kBf16};
      m[p + "self_attn.v_proj.weight"] = {{512, 2048}, kBf16};
      m[p + "self_attn.o_proj.weight"] = {{2048, 4096}, kBf16};
      m[p + "self_attn.q_norm.weight"] = {{256}, kBf16};
      m[p + "self_attn.k_norm.weight"] = {{256}, kBf16};
    } else {
      m[p + "linear_attn.in_proj_qkv.weight"] = {{8192, 2048}, kBf16};
      m[p + "linear_attn.in_proj_z.weight"] = {{4096, 2048}, kBf16};
      m[p + "linear_attn.in_proj_b.weight"] = {{32, 2048}, kBf16};
      m[p + "linear_attn.in_proj_a.weight"] = {{32, 2048}, kBf16};
      m[p + "linear_attn.conv1d.weight"] = {{8192, 1, 4}, kBf16};
      m[p + "linear_attn.dt_bias"] = {{32}, kBf16};
      m[p + "linear_attn.A_log"] = {{32}, kBf16OrF32};
      m[p + "linear_attn.norm.weight"] = {{128}, kBf16OrF32};
      m[p + "linear_attn.out_proj.weight"] = {{2048, 4096}, kBf16};
    }
  }
  return m;
}

// The plan holds exactly the names of `want`, each with its shape and an allowed dtype; returns total bytes.
size_t expect_plan_matches(const std::vector<SynthTensor>& plan, const WantMap& want) {
  std::set<std::string> seen;
  size_t bytes = 0;
  for (const SynthTensor& t : plan) {
    const std::string& name = t.spec.name;
    EXPECT_TRUE(seen.insert(name).second) << "duplicate tensor " << name;
    bytes += t.spec.nbytes();
    auto it = want.find(name);
    if (it == want.end()) {
      ADD_FAILURE() << "unexpected tensor " << name << " " << t.spec.shape.str();
      continue;
    }
    EXPECT_EQ(t.spec.shape, it->second.shape) << name << ": got " << t.spec.shape.str() << ", want "
                                              << it->second.shape.str();
    EXPECT_TRUE(it->second.dtypes.count(t.spec.dtype)) << name << ": dtype " << dtype_name(t.spec.dtype);
  }
  for (const auto& [name, w] : want) EXPECT_TRUE(seen.count(name)) << "missing tensor " << name;
  return bytes;
}

TEST(SynthPlan, FullPresetMlxLayoutIsModelMd23) {
  auto config = synth_config("full", CheckpointLayout::mlx);
  ASSERT_TRUE(config.ok()) << config.status().message();
  ASSERT_EQ(config->num_hidden_layers, 40);
  for (int L = 0; L < 40; ++L)
    EXPECT_EQ(config->layer_types[L], full_attention(L) ? LayerType::full_attention : LayerType::linear_attention);
  std::vector<SynthTensor> plan, head;
  for (const auto& t : synth_plan(*config, CheckpointLayout::mlx))
    (t.spec.name.rfind("mtp.", 0) == 0 ? head : plan).push_back(t);
  // The MTP head: fc and 12 more matrices as quantized triples, 7 norms.
  EXPECT_EQ(head.size(), 13u * 3 + 7);
  WantMap want = mlx_table();
  EXPECT_EQ(plan.size(), want.size());
  EXPECT_EQ(plan.size(), 30u * 45 + 10u * 40 + 7);  // per layer: 8 quantized triples + mixer; globals 2 triples + norm
  size_t bytes = expect_plan_matches(plan, want);
  std::printf("[synth plan] full preset, mlx layout: %zu tensors, %zu bytes = %.2f GB (%.2f GiB)\n", plan.size(), bytes,
              bytes / 1e9, bytes / double(1ull << 30));
  EXPECT_GE(bytes, 18.5e9);
  EXPECT_LE(bytes, 20.5e9);

  // The quantization block the config would carry: 4-bit base, 8-bit router and shared-expert gate per layer.
  const QuantConfig& q = config->quantization;
  EXPECT_TRUE(q.enabled);
  EXPECT_EQ(q.base.bits, 4);
  EXPECT_EQ(q.base.group_size, 64);
  EXPECT_EQ(q.overrides.size(), 82u);  // and the MTP layer's router and shared-expert gate
  EXPECT_EQ(q.for_path("mtp.layers.0.mlp.gate").bits, 8);
  for (int L = 0; L < 40; ++L) {
    const std::string p = "language_model.model.layers." + std::to_string(L) + ".mlp.";
    EXPECT_EQ(q.for_path(p + "gate").bits, 8) << L;
    EXPECT_EQ(q.for_path(p + "shared_expert_gate").bits, 8) << L;
    EXPECT_EQ(q.for_path(p + "switch_mlp.down_proj").bits, 4) << L;
  }
  // And the config text round-trips with those overrides.
  auto back = ModelConfig::from_json_text(config->to_json_text(true));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->quantization.for_path("language_model.model.layers.39.mlp.gate").bits, 8);
  EXPECT_EQ(back->vocab_size, 248320);
}

TEST(SynthPlan, FullPresetHfLayoutIsModelMd12) {
  auto config = synth_config("full", CheckpointLayout::hf);
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_FALSE(config->quantization.enabled);
  auto plan = synth_plan(*config, CheckpointLayout::hf);
  std::vector<SynthTensor> text;
  for (const auto& t : plan)
    if (t.spec.name.rfind("mtp.", 0) != 0) text.push_back(t);
  EXPECT_EQ(text.size(), 30u * 18 + 10u * 15 + 3);  // 693, MODEL.md 1.2 "Counts"
  size_t bytes = expect_plan_matches(text, hf_table());
  std::printf("[synth plan] full preset, hf layout: %zu text tensors, %.2f GB\n", text.size(), bytes / 1e9);
}

TEST(SynthPlan, UnknownPreset) {
  auto r = synth_config("huge", CheckpointLayout::mlx);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("huge"), std::string::npos);
}

TEST(SynthPlan, TinyPresetsAreConsistent) {
  // Every preset's plan binds names the loader knows: here, its config is valid and each quantized module has the
  // triple with matching leading dims.
  for (const char* preset : {"tiny", "small"}) {
    auto c = synth_config(preset, CheckpointLayout::mlx);
    ASSERT_TRUE(c.ok());
    auto again = ModelConfig::from_json_text(c->to_json_text(true));
    ASSERT_TRUE(again.ok()) << preset << ": " << again.status().message();
    std::map<std::string, Shape> shapes;
    for (const auto& t : synth_plan(*c, CheckpointLayout::mlx)) shapes[t.spec.name] = t.spec.shape;
    for (const auto& [name, shape] : shapes) {
      const std::string suffix = ".weight";
      if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
      const std::string module = name.substr(0, name.size() - suffix.size());
      if (!shapes.count(module + ".scales")) continue;
      const Shape& s = shapes[module + ".scales"];
      ASSERT_EQ(s.n, shape.n) << module;
      for (int i = 0; i + 1 < s.n; ++i) EXPECT_EQ(s[i], shape[i]) << module;
      const int bits = c->quantization.for_path(module).bits;
      EXPECT_EQ(shape[shape.n - 1] * 32 / bits, s[s.n - 1] * 64) << module << " (" << bits << " bits)";
    }
  }
}

}  // namespace
}  // namespace lily
