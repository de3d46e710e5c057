// config.json tests: the real Qwen3.6-35B-A3B file (docs/MODEL.md 1.1) in its nested `qwen3_5_moe` form and the
// flat `qwen3_5_moe_text` form parse to the same values; each kind of bad input gives an error naming the field;
// the mlx-lm `quantization` block with per-path overrides.
#include "model/config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <unistd.h>

namespace lily {
namespace {

using nlohmann::json;

// docs/MODEL.md 1.1, transcribed (layer_types written out: [linear x3, full] x10).
const char* kRealConfig = R"({
  "architectures": ["Qwen3_5MoeForConditionalGeneration"],
  "model_type": "qwen3_5_moe",
  "image_token_id": 248056, "video_token_id": 248057,
  "vision_start_token_id": 248053, "vision_end_token_id": 248054,
  "tie_word_embeddings": false,
  "transformers_version": "4.57.1",
  "text_config": {
    "model_type": "qwen3_5_moe_text", "dtype": "bfloat16",
    "attention_bias": false, "attention_dropout": 0.0, "attn_output_gate": true,
    "bos_token_id": 248044, "eos_token_id": 248044, "pad_token_id": null,
    "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "layer_types": [
      "linear_attention","linear_attention","linear_attention","full_attention",
      "linear_attention","linear_attention","linear_attention","full_attention",
      "linear_attention","linear_attention","linear_attention","full_attention",
      "linear_attention","linear_attention","linear_attention","full_attention",
      "linear_attention","linear_attention","linear_attention","full_attention",
      "linear_attention","linear_attention","linear_attention","full_attention",
      "linear_attention","linear_attention","linear_attention","full_attention",
      "linear_attention","linear_attention","linear_attention","full_attention",
      "linear_attention","linear_attention","linear_attention","full_attention",
      "linear_attention","linear_attention","linear_attention","full_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts": 256, "num_experts_per_tok": 8,
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": false,
    "num_attention_heads": 16, "num_hidden_layers": 40, "num_key_value_heads": 2,
    "output_router_logits": false, "router_aux_loss_coef": 0.001,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                        "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                        "rope_type": "default"},
    "tie_word_embeddings": false, "use_cache": true, "vocab_size": 248320
  },
  "vision_config": {
    "deepstack_visual_indexes": [], "depth": 27,
    "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
    "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_5_moe_vision",
    "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2
  }
})";

json nested() { return json::parse(kRealConfig); }

// The flat `qwen3_5_moe_text` form: text_config as the root.
json flat() {
  json tc = nested()["text_config"];
  tc["model_type"] = "qwen3_5_moe_text";
  tc["architectures"] = {"Qwen3_5MoeForCausalLM"};
  return tc;
}

// Parses j and expects an error whose message contains every one of `needles`.
void expect_error(const json& j, std::initializer_list<const char*> needles) {
  auto r = ModelConfig::from_json_text(j.dump());
  ASSERT_FALSE(r.ok()) << "expected an error for " << j.dump().substr(0, 200);
  for (const char* n : needles) EXPECT_NE(r.status().message().find(n), std::string::npos)
      << "message `" << r.status().message() << "` should contain `" << n << "`";
}

void expect_real_values(const ModelConfig& c) {
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 40);
  ASSERT_EQ(c.layer_types.size(), 40u);
  for (int i = 0; i < 40; ++i)
    EXPECT_EQ(c.layer_types[i], i % 4 == 3 ? LayerType::full_attention : LayerType::linear_attention) << "layer " << i;
  EXPECT_EQ(c.layer_types[3], LayerType::full_attention);
  EXPECT_EQ(c.n_full_attention_layers(), 10);
  EXPECT_EQ(c.n_linear_attention_layers(), 30);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.linear_key_dim(), 2048);
  EXPECT_EQ(c.linear_value_dim(), 4096);
  EXPECT_EQ(c.linear_conv_dim(), 8192);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-6f);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.mtp_num_hidden_layers, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{248044});
  EXPECT_FALSE(c.quantization.enabled);
}

TEST(Config, RealNestedForm) {
  auto r = ModelConfig::from_json_text(kRealConfig);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->model_type, "qwen3_5_moe");
  expect_real_values(*r);
}

TEST(Config, FlatFormParsesToTheSameValues) {
  auto r = ModelConfig::from_json_text(flat().dump());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->model_type, "qwen3_5_moe_text");
  expect_real_values(*r);
}

TEST(Config, LayerTypesFromIntervalWhenAbsent) {
  json j = flat();
  j.erase("layer_types");
  auto r = ModelConfig::from_json_text(j.dump());
  ASSERT_TRUE(r.ok()) << r.status().message();
  expect_real_values(*r);
}

TEST(Config, EosListAtTheRoot) {
  json j = nested();
  j["text_config"].erase("eos_token_id");
  j["eos_token_id"] = {248046, 248044};
  auto r = ModelConfig::from_json_text(j.dump());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->eos_token_ids, (std::vector<int>{248046, 248044}));
}

TEST(Config, ToJsonRoundTrip) {
  auto r = ModelConfig::from_json_text(kRealConfig);
  ASSERT_TRUE(r.ok());
  for (bool nest : {true, false}) {
    auto back = ModelConfig::from_json_text(r->to_json_text(nest));
    ASSERT_TRUE(back.ok()) << back.status().message();
    expect_real_values(*back);
  }
}

TEST(Config, LoadNamesThePath) {
  auto dir = std::filesystem::temp_directory_path() / ("lily_test_config_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "config.json") << kRealConfig;
  }
  auto ok = ModelConfig::load(dir.string());
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  expect_real_values(*ok);
  json bad = nested();
  bad["text_config"].erase("vocab_size");
  {
    std::ofstream(dir / "config.json") << bad.dump();
  }
  auto r = ModelConfig::load(dir.string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find((dir / "config.json").string()), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("vocab_size"), std::string::npos) << r.status().message();
  auto missing = ModelConfig::load((dir / "nope").string());
  EXPECT_FALSE(missing.ok());
  std::filesystem::remove_all(dir);
}

TEST(ConfigErrors, NotJson) {
  EXPECT_FALSE(ModelConfig::from_json_text("{\"model_type\": ").ok());
  EXPECT_FALSE(ModelConfig::from_json_text("[1, 2]").ok());
}

TEST(ConfigErrors, UnknownModelType) {
  json j = nested();
  j["model_type"] = "qwen3_moe";
  expect_error(j, {"model_type", "qwen3_moe"});
  json f = flat();
  f["model_type"] = "llama";
  expect_error(f, {"model_type", "llama"});
  json none = flat();
  none.erase("model_type");
  expect_error(none, {"model_type"});
}

TEST(ConfigErrors, NestedWithoutTextConfig) {
  json j = nested();
  j.erase("text_config");
  expect_error(j, {"text_config"});
}

TEST(ConfigErrors, MissingFieldIsNamed) {
  for (const char* field : {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                            "head_dim", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
                            "moe_intermediate_size", "vocab_size", "rms_norm_eps"}) {
    SCOPED_TRACE(field);
    json j = nested();
    j["text_config"].erase(field);
    expect_error(j, {field, "missing"});
    json f = flat();
    f[field] = nullptr;  // null counts as missing
    expect_error(f, {field, "missing"});
  }
}

TEST(ConfigErrors, HeadsThatDoNotDivide) {
  json j = nested();
  j["text_config"]["num_key_value_heads"] = 3;
  expect_error(j, {"num_attention_heads", "num_key_value_heads", "16", "3"});
  json g = nested();
  g["text_config"]["linear_num_key_heads"] = 12;
  expect_error(g, {"linear_num_value_heads", "linear_num_key_heads", "32", "12"});
  json z = nested();
  z["text_config"]["num_key_value_heads"] = 0;
  expect_error(z, {"num_key_value_heads"});
  json k = nested();
  k["text_config"]["num_experts_per_tok"] = 300;
  expect_error(k, {"num_experts_per_tok", "num_experts"});
}

TEST(ConfigErrors, LayerTypesOfTheWrongLength) {
  json j = nested();
  j["text_config"]["layer_types"].erase(39);
  expect_error(j, {"layer_types", "39", "40"});
  json f = flat();
  f["num_hidden_layers"] = 48;
  expect_error(f, {"layer_types", "48"});
}

TEST(ConfigErrors, LayerCountOutOfRange) {
  // Without layer_types the list is built from full_attention_interval: an absurd count must be an error, not an
  // allocation of billions of entries.
  for (int n : {2000000000, 0, -4}) {
    SCOPED_TRACE(n);
    json f = flat();
    f.erase("layer_types");
    f["num_hidden_layers"] = n;
    expect_error(f, {"num_hidden_layers"});
  }
}

TEST(ConfigErrors, BadLayerTypeString) {
  json j = nested();
  j["text_config"]["layer_types"][5] = "sliding_attention";
  expect_error(j, {"layer_types[5]", "sliding_attention"});
  json n = nested();
  n["text_config"]["layer_types"][7] = 3;
  expect_error(n, {"layer_types[7]"});
  json a = nested();
  a["text_config"]["layer_types"] = "full_attention";
  expect_error(a, {"layer_types", "array"});
}

TEST(ConfigErrors, WrongJsonType) {
  json j = nested();
  j["text_config"]["hidden_size"] = "2048";
  expect_error(j, {"hidden_size", "integer", "\"2048\""});
  json e = flat();
  e["rms_norm_eps"] = "1e-6";
  expect_error(e, {"rms_norm_eps", "number"});
  json b = flat();
  b["attn_output_gate"] = 1;
  expect_error(b, {"attn_output_gate", "boolean"});
  json fl = flat();
  fl["num_experts"] = 256.5;
  expect_error(fl, {"num_experts", "integer"});
  json wrap = flat();
  wrap["hidden_size"] = 4294967297ull;  // would wrap to 1 in an int
  expect_error(wrap, {"hidden_size", "4294967297"});
  json neg = flat();
  neg["vocab_size"] = -3000000000ll;
  expect_error(neg, {"vocab_size"});
  json eos = flat();
  eos["eos_token_id"] = "</s>";
  expect_error(eos, {"eos_token_id"});
}

TEST(ConfigErrors, UnsupportedFeatures) {
  json j = flat();
  j["attention_bias"] = true;
  expect_error(j, {"attention_bias"});
  json act = flat();
  act["hidden_act"] = "gelu";
  expect_error(act, {"hidden_act", "gelu"});
  json rope = flat();
  rope["rope_parameters"]["rope_type"] = "yarn";
  expect_error(rope, {"rope_type", "yarn"});
  json rot = flat();
  rot["rope_parameters"]["partial_rotary_factor"] = 2.0;
  expect_error(rot, {"partial_rotary_factor"});
}

json quantized_config() {
  json j = nested();
  json q = {{"group_size", 64}, {"bits", 4}, {"mode", "affine"}};
  for (int i = 0; i < 40; ++i) {
    std::string p = "language_model.model.layers." + std::to_string(i) + ".mlp.";
    q[p + "gate"] = {{"group_size", 64}, {"bits", 8}};
    q[p + "shared_expert_gate"] = {{"group_size", 64}, {"bits", 8}};
  }
  j["quantization"] = q;
  j["quantization_config"] = q;
  return j;
}

TEST(ConfigQuantization, PerPathOverrides) {
  auto r = ModelConfig::from_json_text(quantized_config().dump());
  ASSERT_TRUE(r.ok()) << r.status().message();
  const QuantConfig& q = r->quantization;
  EXPECT_TRUE(q.enabled);
  EXPECT_EQ(q.base.bits, 4);
  EXPECT_EQ(q.base.group_size, 64);
  EXPECT_EQ(q.mode, "affine");
  EXPECT_EQ(q.overrides.size(), 80u);
  EXPECT_EQ(q.for_path("language_model.model.layers.0.mlp.gate").bits, 8);
  EXPECT_EQ(q.for_path("language_model.model.layers.39.mlp.shared_expert_gate").bits, 8);
  EXPECT_EQ(q.for_path("language_model.model.layers.0.mlp.gate").group_size, 64);
  EXPECT_EQ(q.for_path("language_model.model.layers.0.mlp.switch_mlp.gate_proj").bits, 4);
  EXPECT_EQ(q.for_path("language_model.model.layers.3.self_attn.q_proj").bits, 4);
  EXPECT_EQ(q.for_path("language_model.model.embed_tokens").bits, 4);
  expect_real_values([&] {  // the rest of the config is unaffected
    ModelConfig c = *r;
    c.quantization = {};
    return c;
  }());
  // Not quantized: for_path gives 0 bits.
  auto plain = ModelConfig::from_json_text(kRealConfig);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->quantization.for_path("language_model.model.layers.0.mlp.gate").bits, 0);
}

TEST(ConfigQuantization, OnlyQuantizationConfigKey) {
  json j = quantized_config();
  j.erase("quantization");
  auto r = ModelConfig::from_json_text(j.dump());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->quantization.for_path("language_model.model.layers.7.mlp.gate").bits, 8);
}

TEST(ConfigQuantization, RoundTripThroughToJson) {
  auto r = ModelConfig::from_json_text(quantized_config().dump());
  ASSERT_TRUE(r.ok());
  auto back = ModelConfig::from_json_text(r->to_json_text(true));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->quantization.overrides.size(), 80u);
  EXPECT_EQ(back->quantization.for_path("language_model.model.layers.5.mlp.gate").bits, 8);
  EXPECT_EQ(back->quantization.for_path("language_model.model.layers.5.mlp.shared_expert.up_proj").bits, 4);
}

TEST(ConfigQuantization, Errors) {
  json j = quantized_config();
  j["quantization"]["bits"] = 3;
  j.erase("quantization_config");
  expect_error(j, {"quantization", "bits 3"});
  json g = quantized_config();
  g["quantization"]["group_size"] = 32;
  expect_error(g, {"group_size 32"});
  json o = quantized_config();
  o["quantization"]["language_model.model.layers.2.mlp.gate"]["bits"] = 2;
  expect_error(o, {"language_model.model.layers.2.mlp.gate", "bits 2"});
  json m = quantized_config();
  m["quantization"]["mode"] = "mxfp4";
  expect_error(m, {"mode", "mxfp4"});
  json nb = quantized_config();
  nb["quantization"].erase("bits");
  expect_error(nb, {"bits", "missing"});
}

}  // namespace
}  // namespace lily
