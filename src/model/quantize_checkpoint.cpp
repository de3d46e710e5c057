#include "model/quantize_checkpoint.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "model/quant.h"
#include "model/weights.h"
#include "util/bf16.h"

namespace lily {

namespace fs = std::filesystem;

namespace {

// One output tensor and where its values come from.
struct OutTensor {
  TensorSpec spec;
  enum Kind { copy, norm_plus_one, quant_weight, quant_scales, quant_biases } kind = copy;
  Linear src;       // source rows (dense) for quantized outputs and copies of matrices
  int bits = 4;
  const TensorInfo* info = nullptr;  // source for copies / norms
};

std::string mlx_name(const std::string& hf_text_name) { return "language_model.model." + hf_text_name; }

bool is_zero_centred_norm(const std::string& n) {
  for (const char* s : {"input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight"})
    if (n.size() >= std::strlen(s) && n.compare(n.size() - std::strlen(s), std::string::npos, s) == 0) return true;
  return n == "norm.weight";
}

class Planner {
 public:
  Planner(const ModelConfig& c, int bits) : cfg_(c), bits_(bits) {}
  std::vector<OutTensor> out;
  ModelConfig out_cfg;

  void quantized(const std::string& module, const Linear& src, int64_t E, int64_t o, int64_t in) {
    int bits = out_cfg.quantization.for_path(module).bits;
    auto shape = [&](int64_t cols) { return E ? Shape{E, o, cols} : Shape{o, cols}; };
    out.push_back({{module + ".weight", DType::u32, shape(packed_words(in, bits))}, OutTensor::quant_weight, src, bits});
    out.push_back({{module + ".scales", DType::bf16, shape(in / kQuantGroup)}, OutTensor::quant_scales, src, bits});
    out.push_back({{module + ".biases", DType::bf16, shape(in / kQuantGroup)}, OutTensor::quant_biases, src, bits});
  }

  // One decoder layer's matrices under the output prefix p (a main layer, or the head's `mtp.layers.0.`).
  void layer(const std::string& p, const LayerWeights& lw) {
    const int64_t H = cfg_.hidden_size, E = cfg_.num_experts, I = cfg_.moe_intermediate_size;
    auto lin = [&](const std::string& n, const Linear& l) { quantized(p + n, l, 0, l.out, l.in); };
    if (lw.type == LayerType::full_attention) {
      lin("self_attn.q_proj", lw.attn.q_proj);
      lin("self_attn.k_proj", lw.attn.k_proj);
      lin("self_attn.v_proj", lw.attn.v_proj);
      lin("self_attn.o_proj", lw.attn.o_proj);
    } else {
      lin("linear_attn.in_proj_qkv", lw.gdn.in_proj_qkv);
      lin("linear_attn.in_proj_z", lw.gdn.in_proj_z);
      lin("linear_attn.in_proj_b", lw.gdn.in_proj_b);
      lin("linear_attn.in_proj_a", lw.gdn.in_proj_a);
      lin("linear_attn.out_proj", lw.gdn.out_proj);
    }
    lin("mlp.gate", lw.moe.router);
    // Experts as one stacked [E*out, in] source: expert e's rows are contiguous in its own slice.
    auto stacked = [&](const std::vector<Linear>& ex, const char* name, int64_t o, int64_t in) {
      quantized(p + "mlp.switch_mlp." + name, ex[0], E, o, in);  // rows come from `ex`
      experts_[out.size() - 3] = experts_[out.size() - 2] = experts_[out.size() - 1] = &ex;
    };
    stacked(lw.moe.expert_gate, "gate_proj", I, H);
    stacked(lw.moe.expert_up, "up_proj", I, H);
    stacked(lw.moe.expert_down, "down_proj", H, I);
    lin("mlp.shared_expert.gate_proj", lw.moe.shared_gate);
    lin("mlp.shared_expert.up_proj", lw.moe.shared_up);
    lin("mlp.shared_expert.down_proj", lw.moe.shared_down);
    lin("mlp.shared_expert_gate", lw.moe.shared_expert_gate);
  }

  Status plan(const TensorStore& store, const ModelWeights& w) {
    out_cfg = cfg_;
    out_cfg.model_type = "qwen3_5_moe";
    out_cfg.quantization.enabled = true;
    out_cfg.quantization.base = {bits_, 64};
    for (int i = 0; i < cfg_.num_hidden_layers; ++i) {
      std::string p = mlx_name("layers." + std::to_string(i) + ".mlp.");
      out_cfg.quantization.overrides[p + "gate"] = {8, 64};
      out_cfg.quantization.overrides[p + "shared_expert_gate"] = {8, 64};
    }
    const int64_t H = cfg_.hidden_size;
    quantized(mlx_name("embed_tokens"), w.embed_tokens, 0, cfg_.vocab_size, H);
    for (int i = 0; i < cfg_.num_hidden_layers; ++i) layer(mlx_name("layers." + std::to_string(i) + "."), w.layers[i]);
    quantized("language_model.lm_head", w.lm_head, 0, cfg_.vocab_size, H);
    if (w.mtp) {  // mlx-lm drops the head; lily keeps it under its own names (docs/MODEL.md 2.1)
      out_cfg.quantization.overrides["mtp.layers.0.mlp.gate"] = {8, 64};
      out_cfg.quantization.overrides["mtp.layers.0.mlp.shared_expert_gate"] = {8, 64};
      quantized("mtp.fc", w.mtp->fc, 0, H, 2 * H);
      layer("mtp.layers.0.", w.mtp->layer);
    }
    // Everything unquantized, renamed (conv1d [C,1,K] -> [C,K,1]; zero-centred norms +1).
    for (const auto& [name, t] : store.tensors()) {
      std::string text;
      for (const char* pre : {"model.language_model.", "model."})
        if (name.rfind(pre, 0) == 0 && name.rfind("model.visual.", 0) != 0) {
          text = name.substr(std::strlen(pre));
          break;
        }
      const bool conv = text.find("conv1d") != std::string::npos;
      if (name.rfind("mtp.", 0) == 0 && t.shape.n == 1) {  // every vector of the head is a zero-centred norm
        if (!w.mtp) continue;
        out.push_back({{name, DType::bf16, t.shape}, OutTensor::norm_plus_one, {}, 0, &t});
        continue;
      }
      if (text.empty() || (t.shape.n != 1 && !conv)) continue;
      OutTensor o{{mlx_name(text), t.dtype, t.shape}, OutTensor::copy, {}, 0, &t};
      if (conv) o.spec.shape = {t.shape[0], t.shape[2], 1};
      if (is_zero_centred_norm(text)) {
        o.kind = OutTensor::norm_plus_one;
        o.spec.dtype = DType::bf16;
      }
      out.push_back(o);
    }
    return ok_status();
  }

  // Row r of the source matrix behind out[i] (experts: row r of the stacked [E*o, in] view).
  void source_row(size_t i, int64_t r, float* dst) const {
    auto it = experts_.find(i);
    if (it == experts_.end()) return out[i].src.dequant_row(r, dst);
    const auto& ex = *it->second;
    const int64_t o = ex[0].out;
    ex[r / o].dequant_row(r % o, dst);
  }

 private:
  const ModelConfig& cfg_;
  int bits_;
  std::map<size_t, const std::vector<Linear>*> experts_;
};

}  // namespace

Status quantize_checkpoint(const QuantizeOptions& o) {
  if (o.bits != 4 && o.bits != 8) return invalid_argument("--bits must be 4 or 8, got %d", o.bits);
  ASSIGN_OR_RETURN(ModelWeights w, ModelWeights::load(o.in_dir));
  if (w.layout != CheckpointLayout::hf)
    return invalid_argument("%s is already an mlx (quantized) checkpoint", o.in_dir.c_str());
  Planner planner(w.config, o.bits);
  RETURN_IF_ERROR(planner.plan(*w.store, w));
  std::vector<TensorSpec> specs;
  for (const auto& t : planner.out) specs.push_back(t.spec);

  // A quantized triple is computed once when its `.weight` is filled; scales and biases follow it.
  std::vector<uint16_t> last_scales, last_biases;
  auto fill = [&](size_t i, uint8_t* dst) {
    const OutTensor& t = planner.out[i];
    if (t.kind == OutTensor::copy) {
      std::memcpy(dst, t.info->data, t.info->nbytes);
    } else if (t.kind == OutTensor::norm_plus_one) {
      Linear v{1, t.info->shape[0], t.info->dtype, 0, t.info->data, nullptr, nullptr};
      std::vector<float> f(static_cast<size_t>(v.in));
      v.dequant_row(0, f.data());
      for (size_t j = 0; j < f.size(); ++j) reinterpret_cast<uint16_t*>(dst)[j] = float_to_bf16_bits(f[j] + 1.0f);
    } else if (t.kind == OutTensor::quant_weight) {
      const int64_t in = t.spec.shape[t.spec.shape.n - 1] * 32 / t.bits;
      const int64_t rows = t.spec.shape.numel() / t.spec.shape[t.spec.shape.n - 1];
      last_scales.assign(static_cast<size_t>(rows * (in / kQuantGroup)), 0);
      last_biases.assign(last_scales.size(), 0);
      std::vector<float> row(static_cast<size_t>(in));
      for (int64_t r = 0; r < rows; ++r) {
        planner.source_row(i, r, row.data());
        mlx_quantize(row.data(), 1, in, t.bits, reinterpret_cast<uint32_t*>(dst) + r * packed_words(in, t.bits),
                     &last_scales[r * (in / kQuantGroup)], &last_biases[r * (in / kQuantGroup)]);
      }
    } else {
      const auto& src = t.kind == OutTensor::quant_scales ? last_scales : last_biases;
      std::memcpy(dst, src.data(), src.size() * 2);
    }
  };
  RETURN_IF_ERROR(write_sharded(o.out_dir, specs, fill, o.shard_bytes, {{"format", "mlx"}}));
  std::ofstream(fs::path(o.out_dir) / "config.json") << planner.out_cfg.to_json_text(/*nested=*/true);
  std::error_code ec;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"})
    if (fs::exists(fs::path(o.in_dir) / f, ec))
      fs::copy_file(fs::path(o.in_dir) / f, fs::path(o.out_dir) / f, fs::copy_options::overwrite_existing, ec);
  return ok_status();
}

}  // namespace lily
