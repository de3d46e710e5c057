#include "model/config.h"

#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

namespace lily {

using nlohmann::json;

QuantSpec QuantConfig::for_path(const std::string& module_path) const {
  if (!enabled) return {};
  auto it = overrides.find(module_path);
  return it == overrides.end() ? base : it->second;
}

int ModelConfig::n_full_attention_layers() const {
  int n = 0;
  for (LayerType t : layer_types) n += t == LayerType::full_attention;
  return n;
}

namespace {

// Reads a required or optional field with a type check; errors name the field.
class FieldReader {
 public:
  FieldReader(const json& obj, std::string where) : obj_(obj), where_(std::move(where)) {}

  template <typename T>
  Status required(const char* name, T& out) {
    if (!obj_.contains(name) || obj_[name].is_null())
      return format_error("%s: missing required field `%s`", where_.c_str(), name);
    return optional(name, out);
  }

  template <typename T>
  Status optional(const char* name, T& out) {
    if (!obj_.contains(name) || obj_[name].is_null()) return ok_status();
    const json& v = obj_[name];
    if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) return type_error(name, "a boolean");
    } else if constexpr (std::is_integral_v<T>) {
      if (!v.is_number_integer()) return type_error(name, "an integer");
      // get<T> would silently wrap an out-of-range value (4294967297 -> 1).
      const bool fits = v.is_number_unsigned()
                            ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
                            : v.get<int64_t>() >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                                  v.get<int64_t>() <= static_cast<int64_t>(std::numeric_limits<T>::max());
      if (!fits) return type_error(name, "an integer in range");
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!v.is_number()) return type_error(name, "a number");
    } else {
      if (!v.is_string()) return type_error(name, "a string");
    }
    out = v.get<T>();
    return ok_status();
  }

 private:
  Status type_error(const char* name, const char* want) {
    return format_error("%s: field `%s` must be %s, got %s", where_.c_str(), name, want,
                        obj_[name].dump().substr(0, 60).c_str());
  }
  const json& obj_;
  std::string where_;
};

Status read_quantization(const json& root, QuantConfig& q) {
  const json* block = nullptr;
  if (root.contains("quantization")) block = &root["quantization"];
  else if (root.contains("quantization_config")) block = &root["quantization_config"];
  if (!block || block->is_null()) return ok_status();
  if (!block->is_object()) return format_error("config.json: `quantization` must be an object");
  q.enabled = true;
  FieldReader r(*block, "config.json quantization");
  RETURN_IF_ERROR(r.required("bits", q.base.bits));
  RETURN_IF_ERROR(r.required("group_size", q.base.group_size));
  RETURN_IF_ERROR(r.optional("mode", q.mode));
  if (q.mode != "affine") return format_error("config.json quantization: mode `%s` is not supported (affine only)",
                                              q.mode.c_str());
  for (auto& [key, value] : block->items()) {
    if (!value.is_object()) continue;  // bits, group_size, mode
    QuantSpec spec = q.base;
    FieldReader rr(value, "config.json quantization." + key);
    RETURN_IF_ERROR(rr.optional("bits", spec.bits));
    RETURN_IF_ERROR(rr.optional("group_size", spec.group_size));
    q.overrides[key] = spec;
  }
  for (const auto& [key, spec] : q.overrides)
    if ((spec.bits != 4 && spec.bits != 8) || spec.group_size != 64)
      return format_error("config.json quantization.%s: bits %d group_size %d not supported (4 or 8 bits, group 64)",
                          key.c_str(), spec.bits, spec.group_size);
  if ((q.base.bits != 4 && q.base.bits != 8) || q.base.group_size != 64)
    return format_error("config.json quantization: bits %d group_size %d not supported (4 or 8 bits, group 64)",
                        q.base.bits, q.base.group_size);
  return ok_status();
}

Status read_layer_types(const json& tc, ModelConfig& c) {
  // Bounded before the list is built from full_attention_interval (an absurd count used to end in bad_alloc).
  constexpr int kMaxLayers = 1024;
  if (c.num_hidden_layers <= 0 || c.num_hidden_layers > kMaxLayers)
    return format_error("config.json: field `num_hidden_layers` = %d is out of range [1, %d]", c.num_hidden_layers,
                        kMaxLayers);
  if (tc.contains("layer_types") && !tc["layer_types"].is_null()) {
    const json& lt = tc["layer_types"];
    if (!lt.is_array()) return format_error("config.json: field `layer_types` must be an array");
    if (static_cast<int>(lt.size()) != c.num_hidden_layers)
      return format_error("config.json: field `layer_types` has %zu entries, expected num_hidden_layers = %d",
                          lt.size(), c.num_hidden_layers);
    for (size_t i = 0; i < lt.size(); ++i) {
      std::string s = lt[i].is_string() ? lt[i].get<std::string>() : lt[i].dump();
      if (s == "linear_attention") c.layer_types.push_back(LayerType::linear_attention);
      else if (s == "full_attention") c.layer_types.push_back(LayerType::full_attention);
      else return format_error("config.json: layer_types[%zu] = `%s` (expected linear_attention or full_attention)",
                               i, s.c_str());
    }
    return ok_status();
  }
  int interval = 0;
  RETURN_IF_ERROR(FieldReader(tc, "config.json").optional("full_attention_interval", interval));
  if (interval <= 0) return format_error("config.json: missing required field `layer_types` (and no full_attention_interval)");
  for (int i = 0; i < c.num_hidden_layers; ++i)
    c.layer_types.push_back((i + 1) % interval == 0 ? LayerType::full_attention : LayerType::linear_attention);
  return ok_status();
}

Status read_rope(const json& tc, ModelConfig& c) {
  FieldReader r(tc, "config.json");
  RETURN_IF_ERROR(r.optional("partial_rotary_factor", c.partial_rotary_factor));
  RETURN_IF_ERROR(r.optional("rope_theta", c.rope_theta));
  if (tc.contains("rope_parameters") && tc["rope_parameters"].is_object()) {
    FieldReader rp(tc["rope_parameters"], "config.json rope_parameters");
    RETURN_IF_ERROR(rp.optional("rope_theta", c.rope_theta));
    RETURN_IF_ERROR(rp.optional("partial_rotary_factor", c.partial_rotary_factor));
    std::string rope_type = "default";
    RETURN_IF_ERROR(rp.optional("rope_type", rope_type));
    if (rope_type != "default" && rope_type != "mrope")
      return format_error("config.json rope_parameters: rope_type `%s` is not supported", rope_type.c_str());
  }
  return ok_status();
}

Status read_eos(const json& root, const json& tc, ModelConfig& c) {
  for (const json* obj : {&tc, &root}) {
    if (!obj->contains("eos_token_id") || (*obj)["eos_token_id"].is_null()) continue;
    const json& e = (*obj)["eos_token_id"];
    if (e.is_number_integer()) c.eos_token_ids = {e.get<int>()};
    else if (e.is_array())
      for (const json& x : e) {
        if (!x.is_number_integer()) return format_error("config.json: field `eos_token_id` must hold integers");
        c.eos_token_ids.push_back(x.get<int>());
      }
    else return format_error("config.json: field `eos_token_id` must be an integer or a list");
    return ok_status();
  }
  return ok_status();
}

Status validate(const ModelConfig& c) {
  auto positive = [](const char* name, int v) -> Status {
    return v > 0 ? ok_status() : format_error("config.json: field `%s` must be positive, got %d", name, v);
  };
  RETURN_IF_ERROR(positive("hidden_size", c.hidden_size));
  RETURN_IF_ERROR(positive("num_hidden_layers", c.num_hidden_layers));
  RETURN_IF_ERROR(positive("num_attention_heads", c.num_attention_heads));
  RETURN_IF_ERROR(positive("num_key_value_heads", c.num_key_value_heads));
  RETURN_IF_ERROR(positive("head_dim", c.head_dim));
  RETURN_IF_ERROR(positive("linear_num_key_heads", c.linear_num_key_heads));
  RETURN_IF_ERROR(positive("linear_num_value_heads", c.linear_num_value_heads));
  RETURN_IF_ERROR(positive("linear_key_head_dim", c.linear_key_head_dim));
  RETURN_IF_ERROR(positive("linear_value_head_dim", c.linear_value_head_dim));
  RETURN_IF_ERROR(positive("linear_conv_kernel_dim", c.linear_conv_kernel_dim));
  RETURN_IF_ERROR(positive("num_experts", c.num_experts));
  RETURN_IF_ERROR(positive("num_experts_per_tok", c.num_experts_per_tok));
  RETURN_IF_ERROR(positive("moe_intermediate_size", c.moe_intermediate_size));
  RETURN_IF_ERROR(positive("shared_expert_intermediate_size", c.shared_expert_intermediate_size));
  RETURN_IF_ERROR(positive("vocab_size", c.vocab_size));
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    return format_error("config.json: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)",
                        c.num_attention_heads, c.num_key_value_heads);
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
    return format_error("config.json: linear_num_value_heads (%d) is not a multiple of linear_num_key_heads (%d)",
                        c.linear_num_value_heads, c.linear_num_key_heads);
  if (c.num_experts_per_tok > c.num_experts)
    return format_error("config.json: num_experts_per_tok (%d) exceeds num_experts (%d)", c.num_experts_per_tok,
                        c.num_experts);
  int rot = c.rotary_dim();
  if (rot <= 0 || rot % 2 != 0 || rot > c.head_dim)
    return format_error("config.json: partial_rotary_factor %g gives %d rotary dims of head_dim %d (need even, > 0)",
                        c.partial_rotary_factor, rot, c.head_dim);
  if (!(c.rms_norm_eps > 0)) return format_error("config.json: field `rms_norm_eps` must be positive");
  if (c.linear_key_head_dim != c.linear_value_head_dim)
    return format_error("config.json: linear_key_head_dim (%d) != linear_value_head_dim (%d) is not supported",
                        c.linear_key_head_dim, c.linear_value_head_dim);
  return ok_status();
}

}  // namespace

Result<ModelConfig> ModelConfig::from_json_text(const std::string& text) {
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) return format_error("config.json: not a valid JSON object");
  ModelConfig c;
  FieldReader rr(root, "config.json");
  RETURN_IF_ERROR(rr.required("model_type", c.model_type));
  const json* tc = &root;
  if (c.model_type == "qwen3_5_moe") {
    if (!root.contains("text_config") || !root["text_config"].is_object())
      return format_error("config.json: model_type qwen3_5_moe needs a `text_config` object");
    tc = &root["text_config"];
  } else if (c.model_type != "qwen3_5_moe_text") {
    return format_error("config.json: model_type `%s` is not supported (expected qwen3_5_moe or qwen3_5_moe_text)",
                        c.model_type.c_str());
  }
  FieldReader r(*tc, tc == &root ? "config.json" : "config.json text_config");
  RETURN_IF_ERROR(r.required("hidden_size", c.hidden_size));
  RETURN_IF_ERROR(r.required("num_hidden_layers", c.num_hidden_layers));
  RETURN_IF_ERROR(r.required("num_attention_heads", c.num_attention_heads));
  RETURN_IF_ERROR(r.required("num_key_value_heads", c.num_key_value_heads));
  RETURN_IF_ERROR(r.required("head_dim", c.head_dim));
  RETURN_IF_ERROR(r.optional("attn_output_gate", c.attn_output_gate));
  RETURN_IF_ERROR(r.required("linear_conv_kernel_dim", c.linear_conv_kernel_dim));
  RETURN_IF_ERROR(r.required("linear_key_head_dim", c.linear_key_head_dim));
  RETURN_IF_ERROR(r.required("linear_num_key_heads", c.linear_num_key_heads));
  RETURN_IF_ERROR(r.required("linear_num_value_heads", c.linear_num_value_heads));
  RETURN_IF_ERROR(r.required("linear_value_head_dim", c.linear_value_head_dim));
  RETURN_IF_ERROR(r.required("num_experts", c.num_experts));
  RETURN_IF_ERROR(r.required("num_experts_per_tok", c.num_experts_per_tok));
  RETURN_IF_ERROR(r.required("moe_intermediate_size", c.moe_intermediate_size));
  RETURN_IF_ERROR(r.required("shared_expert_intermediate_size", c.shared_expert_intermediate_size));
  RETURN_IF_ERROR(r.required("vocab_size", c.vocab_size));
  RETURN_IF_ERROR(r.required("rms_norm_eps", c.rms_norm_eps));
  RETURN_IF_ERROR(r.optional("max_position_embeddings", c.max_position_embeddings));
  RETURN_IF_ERROR(r.optional("mtp_num_hidden_layers", c.mtp_num_hidden_layers));
  c.tie_word_embeddings = false;
  RETURN_IF_ERROR(FieldReader(root, "config.json").optional("tie_word_embeddings", c.tie_word_embeddings));
  RETURN_IF_ERROR(r.optional("tie_word_embeddings", c.tie_word_embeddings));
  bool attention_bias = false;
  RETURN_IF_ERROR(r.optional("attention_bias", attention_bias));
  if (attention_bias) return format_error("config.json: attention_bias = true is not supported by this model");
  std::string act = "silu";
  RETURN_IF_ERROR(r.optional("hidden_act", act));
  if (act != "silu") return format_error("config.json: hidden_act `%s` is not supported (silu)", act.c_str());
  if (!c.attn_output_gate) return format_error("config.json: attn_output_gate = false is not supported");
  RETURN_IF_ERROR(read_layer_types(*tc, c));
  RETURN_IF_ERROR(read_rope(*tc, c));
  RETURN_IF_ERROR(read_eos(root, *tc, c));
  RETURN_IF_ERROR(read_quantization(root, c.quantization));
  RETURN_IF_ERROR(validate(c));
  return c;
}

Result<ModelConfig> ModelConfig::load(const std::string& model_dir) {
  std::string path = model_dir + "/config.json";
  std::ifstream f(path, std::ios::binary);
  if (!f) return io_error("cannot open %s", path.c_str());
  std::stringstream ss;
  ss << f.rdbuf();
  auto r = from_json_text(ss.str());
  if (!r.ok()) return r.status().with_context(path);
  return r;
}

std::string ModelConfig::to_json_text(bool nested) const {
  json tc;
  tc["model_type"] = "qwen3_5_moe_text";
  tc["hidden_size"] = hidden_size;
  tc["num_hidden_layers"] = num_hidden_layers;
  json lt = json::array();
  for (LayerType t : layer_types) lt.push_back(t == LayerType::full_attention ? "full_attention" : "linear_attention");
  tc["layer_types"] = lt;
  tc["num_attention_heads"] = num_attention_heads;
  tc["num_key_value_heads"] = num_key_value_heads;
  tc["head_dim"] = head_dim;
  tc["attn_output_gate"] = true;
  tc["attention_bias"] = false;
  tc["hidden_act"] = "silu";
  tc["linear_conv_kernel_dim"] = linear_conv_kernel_dim;
  tc["linear_key_head_dim"] = linear_key_head_dim;
  tc["linear_num_key_heads"] = linear_num_key_heads;
  tc["linear_num_value_heads"] = linear_num_value_heads;
  tc["linear_value_head_dim"] = linear_value_head_dim;
  tc["num_experts"] = num_experts;
  tc["num_experts_per_tok"] = num_experts_per_tok;
  tc["moe_intermediate_size"] = moe_intermediate_size;
  tc["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
  tc["vocab_size"] = vocab_size;
  tc["max_position_embeddings"] = max_position_embeddings;
  tc["rms_norm_eps"] = rms_norm_eps;
  tc["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", rope_theta},
                           {"partial_rotary_factor", partial_rotary_factor}, {"mrope_interleaved", true},
                           {"mrope_section", {11, 11, 10}}};
  tc["partial_rotary_factor"] = partial_rotary_factor;
  tc["tie_word_embeddings"] = tie_word_embeddings;
  tc["mtp_num_hidden_layers"] = mtp_num_hidden_layers;
  tc["dtype"] = "bfloat16";
  if (!eos_token_ids.empty()) tc["eos_token_id"] = eos_token_ids.size() == 1 ? json(eos_token_ids[0]) : json(eos_token_ids);
  json root;
  if (nested) {
    root["architectures"] = {"Qwen3_5MoeForConditionalGeneration"};
    root["model_type"] = "qwen3_5_moe";
    root["tie_word_embeddings"] = tie_word_embeddings;
    root["text_config"] = tc;
  } else {
    root = tc;
    root["architectures"] = {"Qwen3_5MoeForCausalLM"};
  }
  if (quantization.enabled) {
    json q = {{"group_size", quantization.base.group_size}, {"bits", quantization.base.bits}, {"mode", quantization.mode}};
    for (const auto& [k, s] : quantization.overrides) q[k] = {{"group_size", s.group_size}, {"bits", s.bits}};
    root["quantization"] = q;
    root["quantization_config"] = q;
  }
  return root.dump(2);
}

std::string ModelConfig::summary() const {
  return format("qwen3_5_moe: %d layers (%d Gated DeltaNet + %d attention), hidden %d, vocab %d, "
                "attention %d q / %d kv heads x %d (rotary %d), delta-net %d k / %d v heads x %d, "
                "%d experts top-%d x %d + shared %d",
                num_hidden_layers, n_linear_attention_layers(), n_full_attention_layers(), hidden_size, vocab_size,
                num_attention_heads, num_key_value_heads, head_dim, rotary_dim(), linear_num_key_heads,
                linear_num_value_heads, linear_key_head_dim, num_experts, num_experts_per_tok, moe_intermediate_size,
                shared_expert_intermediate_size);
}

}  // namespace lily
