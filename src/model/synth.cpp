#include "model/synth.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "model/quant.h"
#include "util/bf16.h"
#include "util/thread_pool.h"

namespace lily {

namespace fs = std::filesystem;

Result<ModelConfig> synth_config(const std::string& preset, CheckpointLayout layout) {
  ModelConfig c;
  c.model_type = "qwen3_5_moe";
  auto set_layers = [&](int n) {
    c.num_hidden_layers = n;
    c.layer_types.clear();
    for (int i = 0; i < n; ++i)
      c.layer_types.push_back((i + 1) % 4 == 0 ? LayerType::full_attention : LayerType::linear_attention);
  };
  c.linear_conv_kernel_dim = 4;
  c.rms_norm_eps = 1e-6f;
  c.partial_rotary_factor = 0.25f;
  c.rope_theta = 1e7;
  c.eos_token_ids = {151645, 151643};  // <|im_end|>, <|endoftext|> of the tokenizer fixture
  c.mtp_num_hidden_layers = 1;         // every preset writes the multi-token-prediction head (eq 26)
  if (preset == "tiny") {
    set_layers(4);
    c.hidden_size = 128;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 64;
    c.linear_num_key_heads = 2, c.linear_num_value_heads = 4, c.linear_key_head_dim = 64, c.linear_value_head_dim = 64;
    c.num_experts = 16, c.num_experts_per_tok = 4, c.moe_intermediate_size = 64, c.shared_expert_intermediate_size = 64;
    c.vocab_size = 151936;
    c.max_position_embeddings = 32768;
  } else if (preset == "small") {
    set_layers(8);
    c.hidden_size = 1024;
    c.num_attention_heads = 8, c.num_key_value_heads = 1, c.head_dim = 256;
    c.linear_num_key_heads = 8, c.linear_num_value_heads = 16, c.linear_key_head_dim = 128,
    c.linear_value_head_dim = 128;
    c.num_experts = 32, c.num_experts_per_tok = 8, c.moe_intermediate_size = 256, c.shared_expert_intermediate_size = 256;
    c.vocab_size = 151936;
    c.max_position_embeddings = 262144;
  } else if (preset == "full" || preset == "full4") {
    set_layers(preset == "full" ? 40 : 4);  // full4: full width, 3 Gated DeltaNet + 1 attention layer
    c.hidden_size = 2048;
    c.num_attention_heads = 16, c.num_key_value_heads = 2, c.head_dim = 256;
    c.linear_num_key_heads = 16, c.linear_num_value_heads = 32, c.linear_key_head_dim = 128,
    c.linear_value_head_dim = 128;
    c.num_experts = 256, c.num_experts_per_tok = 8, c.moe_intermediate_size = 512, c.shared_expert_intermediate_size = 512;
    c.vocab_size = 248320;
    c.max_position_embeddings = 262144;
  } else {
    return invalid_argument("unknown preset `%s` (tiny, small, full, full4)", preset.c_str());
  }
  if (layout == CheckpointLayout::mlx) {
    c.quantization.enabled = true;
    c.quantization.base = {4, 64};
    for (int i = 0; i < c.num_hidden_layers; ++i) {
      std::string p = "language_model.model.layers." + std::to_string(i) + ".mlp.";
      c.quantization.overrides[p + "gate"] = {8, 64};
      c.quantization.overrides[p + "shared_expert_gate"] = {8, 64};
    }
    c.quantization.overrides["mtp.layers.0.mlp.gate"] = {8, 64};
    c.quantization.overrides["mtp.layers.0.mlp.shared_expert_gate"] = {8, 64};
  }
  return c;
}

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t name_stream(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

float uniform01(uint64_t bits) { return static_cast<float>((bits >> 40) + 0.5) * (1.0f / 16777216.0f); }

float gaussian(uint64_t stream, uint64_t i) {  // Box-Muller on two hashed uniforms
  uint64_t a = splitmix64(stream ^ splitmix64(2 * i)), b = splitmix64(stream ^ splitmix64(2 * i + 1));
  return std::sqrt(-2.0f * std::log(uniform01(a))) * std::cos(6.2831853f * uniform01(b));
}

// Standard deviation and mean of a uniform code q in [0, 2^bits - 1].
float code_std(int bits) { return std::sqrt((std::pow(2.0f, 2.0f * bits) - 1.0f) / 12.0f); }
float code_mid(int bits) { return ((1 << bits) - 1) / 2.0f; }

float group_scale(const SynthTensor& t, uint64_t seed, uint64_t g) {
  uint64_t h = splitmix64(seed ^ t.scale_stream ^ splitmix64(g));
  float jitter = 0.8f + 0.4f * uniform01(h);
  float sign = (h & 1) ? -1.0f : 1.0f;
  return sign * jitter * t.std / code_std(t.bits);
}

struct Planner {
  const ModelConfig& c;
  CheckpointLayout layout;
  std::vector<SynthTensor> out;

  void dense(const std::string& name, Shape shape, float std, float mean = 0) {
    out.push_back({{name, DType::bf16, shape}, SynthKind::gaussian, mean, std, 0, 0});
  }
  void vec(const std::string& name, int64_t n, float mean, float std, SynthKind kind = SynthKind::gaussian,
           DType dt = DType::bf16) {
    out.push_back({{name, dt, {n}}, kind, mean, std, 0, 0});
  }
  // A linear [stack..., out, in] with weight std `std`: bf16 for HF, a quantized triple for MLX.
  void linear(const std::string& module, int64_t E, int64_t o, int64_t in, float std, bool hf_packed_name = false) {
    if (layout == CheckpointLayout::hf) {
      Shape s = E ? Shape{E, o, in} : Shape{o, in};
      dense(hf_packed_name ? module : module + ".weight", s, std);
      return;
    }
    int bits = c.quantization.for_path(module).bits;
    auto shape = [&](int64_t cols) { return E ? Shape{E, o, cols} : Shape{o, cols}; };
    uint64_t stream = name_stream(module + ".scales");
    out.push_back({{module + ".weight", DType::u32, shape(packed_words(in, bits))}, SynthKind::quant_words, 0, std, bits, 0});
    out.push_back({{module + ".scales", DType::bf16, shape(in / kQuantGroup)}, SynthKind::quant_scales, 0, std, bits, stream});
    out.push_back({{module + ".biases", DType::bf16, shape(in / kQuantGroup)}, SynthKind::quant_biases, 0, std, bits, stream});
  }
  // Zero-centred norm: stored as w ~ N(0, 0.05) (HF) or 1 + w (MLX, shift baked in).
  void znorm(const std::string& name, int64_t n) {
    vec(name, n, layout == CheckpointLayout::hf ? 0.0f : 1.0f, 0.05f);
  }

  // One decoder layer at prefix p (a main layer, or the MTP head's `mtp.layers.0.`).
  void layer(const std::string& p, LayerType type) {
    const bool hf = layout == CheckpointLayout::hf;
    const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size,
                  Is = c.shared_expert_intermediate_size, L = c.num_hidden_layers;
    const float in_std = 1.0f / std::sqrt(static_cast<float>(H));
    const float resid = 1.0f / std::sqrt(2.0f * L);  // output projections: keep the residual stream O(1)
    znorm(p + "input_layernorm.weight", H);
    znorm(p + "post_attention_layernorm.weight", H);
    if (type == LayerType::full_attention) {
      const int64_t D = c.head_dim, nq = c.num_attention_heads, nkv = c.num_key_value_heads;
      linear(p + "self_attn.q_proj", 0, nq * D * 2, H, in_std);
      linear(p + "self_attn.k_proj", 0, nkv * D, H, in_std);
      linear(p + "self_attn.v_proj", 0, nkv * D, H, in_std);
      linear(p + "self_attn.o_proj", 0, H, nq * D, resid / std::sqrt(static_cast<float>(nq * D)) * 2);
      znorm(p + "self_attn.q_norm.weight", D);
      znorm(p + "self_attn.k_norm.weight", D);
    } else {
      const int64_t C = c.linear_conv_dim(), Vd = c.linear_value_dim(), nv = c.linear_num_value_heads,
                    K = c.linear_conv_kernel_dim;
      std::string la = p + "linear_attn.";
      linear(la + "in_proj_qkv", 0, C, H, in_std);
      linear(la + "in_proj_z", 0, Vd, H, in_std);
      linear(la + "in_proj_b", 0, nv, H, in_std);
      linear(la + "in_proj_a", 0, nv, H, in_std);
      out.push_back({{la + "conv1d.weight", DType::bf16, hf ? Shape{C, 1, K} : Shape{C, K, 1}}, SynthKind::gaussian, 0, 0.5f, 0, 0});
      vec(la + "dt_bias", nv, 0.0f, 0.5f);
      vec(la + "A_log", nv, 0, 0, SynthKind::a_log, DType::f32);
      vec(la + "norm.weight", c.linear_value_head_dim, 1.0f, 0.05f);
      linear(la + "out_proj", 0, H, Vd, resid / std::sqrt(static_cast<float>(Vd)) * 4);
    }
    std::string mlp = p + "mlp.";
    linear(mlp + "gate", 0, E, H, 2.0f * in_std);  // router logits std ~2: decisive routing
    if (hf) {
      dense(mlp + "experts.gate_up_proj", {E, 2 * I, H}, in_std);
      dense(mlp + "experts.down_proj", {E, H, I}, resid * 2 / std::sqrt(static_cast<float>(I)));
    } else {
      linear(mlp + "switch_mlp.gate_proj", E, I, H, in_std);
      linear(mlp + "switch_mlp.up_proj", E, I, H, in_std);
      linear(mlp + "switch_mlp.down_proj", E, H, I, resid * 2 / std::sqrt(static_cast<float>(I)));
    }
    linear(mlp + "shared_expert.gate_proj", 0, Is, H, in_std);
    linear(mlp + "shared_expert.up_proj", 0, Is, H, in_std);
    linear(mlp + "shared_expert.down_proj", 0, H, Is, resid * 2 / std::sqrt(static_cast<float>(Is)));
    linear(mlp + "shared_expert_gate", 0, 1, H, in_std);
  }

  void plan() {
    const bool hf = layout == CheckpointLayout::hf;
    const std::string text = hf ? "model.language_model." : "language_model.model.";
    const int64_t H = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers;
    const float in_std = 1.0f / std::sqrt(static_cast<float>(H));
    linear(text + "embed_tokens", 0, V, H, 1.0f);
    for (int64_t i = 0; i < L; ++i) layer(text + "layers." + std::to_string(i) + ".", c.layer_types[i]);
    znorm(text + "norm.weight", H);
    linear(hf ? "lm_head" : "language_model.lm_head", 0, V, H, 3.0f * in_std);
    if (c.mtp_num_hidden_layers > 0) {  // eq 26, `mtp.*` in both layouts (mlx: quantized, norms with +1)
      linear("mtp.fc", 0, H, 2 * H, 1.0f / std::sqrt(2.0f * H));
      znorm("mtp.pre_fc_norm_embedding.weight", H);
      znorm("mtp.pre_fc_norm_hidden.weight", H);
      znorm("mtp.norm.weight", H);
      layer("mtp.layers.0.", LayerType::full_attention);
    }
  }
};

}  // namespace

std::vector<SynthTensor> synth_plan(const ModelConfig& config, CheckpointLayout layout) {
  Planner p{config, layout, {}};
  p.plan();
  return std::move(p.out);
}

void synth_fill(const SynthTensor& t, uint64_t seed, uint8_t* dst) {
  const uint64_t stream = splitmix64(seed ^ name_stream(t.spec.name));
  const int64_t n = t.spec.shape.numel();
  ThreadPool* pool = nullptr;
  static thread_local std::unique_ptr<ThreadPool> local_pool;
  if (n > (1 << 20)) {
    if (!local_pool) local_pool = std::make_unique<ThreadPool>();
    pool = local_pool.get();
  }
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      switch (t.kind) {
        case SynthKind::gaussian: {
          float v = t.mean + t.std * gaussian(stream, static_cast<uint64_t>(i));
          if (t.spec.dtype == DType::f32) reinterpret_cast<float*>(dst)[i] = v;
          else reinterpret_cast<uint16_t*>(dst)[i] = float_to_bf16_bits(v);
          break;
        }
        case SynthKind::a_log: {
          float v = std::log(1.0f + 15.0f * uniform01(splitmix64(stream ^ static_cast<uint64_t>(i))));
          if (t.spec.dtype == DType::f32) reinterpret_cast<float*>(dst)[i] = v;
          else reinterpret_cast<uint16_t*>(dst)[i] = float_to_bf16_bits(v);
          break;
        }
        case SynthKind::quant_words:
          reinterpret_cast<uint32_t*>(dst)[i] = static_cast<uint32_t>(splitmix64(stream ^ static_cast<uint64_t>(i)));
          break;
        case SynthKind::quant_scales:
          reinterpret_cast<uint16_t*>(dst)[i] = float_to_bf16_bits(group_scale(t, seed, static_cast<uint64_t>(i)));
          break;
        case SynthKind::quant_biases: {
          float s = bf16_to_float(float_to_bf16_bits(group_scale(t, seed, static_cast<uint64_t>(i))));
          reinterpret_cast<uint16_t*>(dst)[i] = float_to_bf16_bits(-code_mid(t.bits) * s);
          break;
        }
      }
    }
  };
  if (pool) pool->parallel_for(n, 1 << 16, body);
  else body(0, n);
}

Result<ModelWeights> synth_in_memory(const std::string& preset, CheckpointLayout layout, uint64_t seed) {
  ASSIGN_OR_RETURN(ModelConfig config, synth_config(preset, layout));
  auto store = std::make_shared<TensorStore>();
  for (const SynthTensor& t : synth_plan(config, layout)) {
    auto bytes = std::make_shared<std::vector<uint8_t>>(t.spec.nbytes());
    synth_fill(t, seed, bytes->data());
    RETURN_IF_ERROR(store->add_buffer(t.spec, std::move(bytes)));
  }
  return ModelWeights::bind(config, store, "<synthetic " + preset + ">");
}

static Status copy_tokenizer(const std::string& from, const std::string& to) {
  std::error_code ec;
  if (!fs::exists(fs::path(from) / "tokenizer.json", ec))
    return io_error("tokenizer directory %s has no tokenizer.json", from.c_str());
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    if (!fs::exists(fs::path(from) / f, ec)) continue;
    fs::copy_file(fs::path(from) / f, fs::path(to) / f, fs::copy_options::overwrite_existing, ec);
    if (ec) return io_error("copying %s: %s", f, ec.message().c_str());
  }
  return ok_status();
}

Status synth_write(const SynthOptions& o) {
  ASSIGN_OR_RETURN(ModelConfig config, synth_config(o.preset, o.layout));
  if (!o.mtp) {
    config.mtp_num_hidden_layers = 0;
    config.quantization.overrides.erase("mtp.layers.0.mlp.gate");
    config.quantization.overrides.erase("mtp.layers.0.mlp.shared_expert_gate");
  }
  std::vector<SynthTensor> plan = synth_plan(config, o.layout);
  std::vector<TensorSpec> specs;
  for (const auto& t : plan) specs.push_back(t.spec);
  std::map<std::string, std::string> meta = {{"format", o.layout == CheckpointLayout::mlx ? "mlx" : "pt"}};
  RETURN_IF_ERROR(write_sharded(o.out_dir, specs, [&](size_t i, uint8_t* dst) { synth_fill(plan[i], o.seed, dst); },
                                o.shard_bytes, meta));
  std::ofstream(fs::path(o.out_dir) / "config.json") << config.to_json_text(/*nested=*/true);
  nlohmann::json gen = {{"bos_token_id", 151643}, {"eos_token_id", config.eos_token_ids}, {"pad_token_id", 151643},
                        {"temperature", 1.0}, {"top_k", 20}, {"top_p", 0.95}, {"do_sample", true}};
  std::ofstream(fs::path(o.out_dir) / "generation_config.json") << gen.dump(2);
  if (!o.tokenizer_dir.empty()) RETURN_IF_ERROR(copy_tokenizer(o.tokenizer_dir, o.out_dir));
  return ok_status();
}

}  // namespace lily
