#include "model/weights.h"

#include "model/quant.h"
#include "util/bf16.h"
#include "util/unaligned.h"

namespace lily {

// ---------------------------------------------------------------------------------------------- Linear

void Linear::dequant_row(int64_t r, float* out_row) const {
  if (quantized()) {
    mlx_dequantize_row(static_cast<const uint32_t*>(w) + r * packed_words(in, bits), scales + r * (in / kQuantGroup),
                       biases + r * (in / kQuantGroup), in, bits, out_row);
    return;
  }
  switch (dtype) {
    case DType::bf16:
      for (int64_t j = 0; j < in; ++j) out_row[j] = bf16_to_float(load_unaligned<uint16_t>(w, r * in + j));
      break;
    case DType::f16:
      for (int64_t j = 0; j < in; ++j) out_row[j] = f16_to_float(load_unaligned<uint16_t>(w, r * in + j));
      break;
    case DType::f32:
      for (int64_t j = 0; j < in; ++j) out_row[j] = load_unaligned<float>(w, r * in + j);
      break;
    default: CHECK(false, "Linear with dtype %s", dtype_name(dtype));
  }
}

float Linear::dot_row(int64_t r, const float* x) const {
  if (quantized())
    return mlx_dot_row(static_cast<const uint32_t*>(w) + r * packed_words(in, bits), scales + r * (in / kQuantGroup),
                       biases + r * (in / kQuantGroup), in, bits, x);
  float acc = 0;
  if (dtype == DType::bf16) {
    for (int64_t j = 0; j < in; ++j) acc += bf16_to_float(load_unaligned<uint16_t>(w, r * in + j)) * x[j];
  } else if (dtype == DType::f32) {
    for (int64_t j = 0; j < in; ++j) acc += load_unaligned<float>(w, r * in + j) * x[j];
  } else {
    for (int64_t j = 0; j < in; ++j) acc += f16_to_float(load_unaligned<uint16_t>(w, r * in + j)) * x[j];
  }
  return acc;
}

Linear Linear::rows(int64_t begin, int64_t count) const {
  CHECK(begin >= 0 && begin + count <= out, "rows [%lld, +%lld) of %lld", (long long)begin, (long long)count,
        (long long)out);
  Linear s = *this;
  s.out = count;
  if (quantized()) {
    s.w = static_cast<const uint32_t*>(w) + begin * packed_words(in, bits);
    s.scales = scales + begin * (in / kQuantGroup);
    s.biases = biases + begin * (in / kQuantGroup);
  } else {
    s.w = static_cast<const uint8_t*>(w) + begin * in * static_cast<int64_t>(dtype_size(dtype));
  }
  return s;
}

size_t Linear::bytes() const {
  if (!quantized()) return static_cast<size_t>(out * in) * dtype_size(dtype);
  return static_cast<size_t>(out * packed_words(in, bits)) * 4 + 2 * static_cast<size_t>(out * (in / kQuantGroup)) * 2;
}

// ---------------------------------------------------------------------------------------------- binding

namespace {

// Name prefixes of one checkpoint, found by probing for the embedding.
struct Prefixes {
  std::string text;  // e.g. "model.language_model." or "language_model.model." or "model."
  std::string head;  // "lm_head." or "language_model.lm_head."
};

class Binder {
 public:
  Binder(const ModelConfig& c, const TensorStore& s, CheckpointLayout layout, ModelWeights& m)
      : cfg_(c), store_(s), layout_(layout), m_(m) {}

  Result<const TensorInfo*> tensor(const std::string& name, const Shape& shape, std::initializer_list<DType> dtypes) {
    const TensorInfo* t = store_.find(name);
    if (!t) return format_error("tensor `%s` is missing (expected %s)", name.c_str(), shape.str().c_str());
    bool dtype_ok = false;
    std::string allowed;
    for (DType d : dtypes) {
      dtype_ok |= t->dtype == d;
      allowed += (allowed.empty() ? "" : "|") + std::string(dtype_name(d));
    }
    if (!(t->shape == shape) || !dtype_ok)
      return format_error("tensor `%s`: expected %s %s, got %s %s (in %s)", name.c_str(), shape.str().c_str(),
                          allowed.c_str(), t->shape.str().c_str(), dtype_name(t->dtype), t->file.c_str());
    ++m_.n_tensors;
    m_.tensor_bytes += t->nbytes;
    return t;
  }

  // A vector of n floats from BF16/F16/F32, optionally +1 (zero-centred norms of the HF layout).
  Result<std::vector<float>> vec(const std::string& name, const Shape& shape, bool add_one = false) {
    ASSIGN_OR_RETURN(const TensorInfo* t, tensor(name, shape, {DType::bf16, DType::f16, DType::f32}));
    std::vector<float> v(static_cast<size_t>(shape.numel()));
    for (size_t i = 0; i < v.size(); ++i) {
      if (t->dtype == DType::f32) v[i] = load_unaligned<float>(t->data, i);
      else if (t->dtype == DType::bf16) v[i] = bf16_to_float(load_unaligned<uint16_t>(t->data, i));
      else v[i] = f16_to_float(load_unaligned<uint16_t>(t->data, i));
      if (add_one) v[i] += 1.0f;
    }
    return v;
  }

  // A norm that HF stores zero-centred and MLX stores with +1 baked in.
  Result<std::vector<float>> norm(const std::string& name, int64_t n) {
    return vec(name, {n}, layout_ == CheckpointLayout::hf);
  }

  // A dense or quantized linear `module` (path without `.weight`) of logical shape [out, in].
  Result<Linear> linear(const std::string& module, int64_t out, int64_t in) {
    Linear l;
    l.out = out;
    l.in = in;
    QuantSpec q = cfg_.quantization.for_path(module);
    if (layout_ == CheckpointLayout::mlx && stored_quantized(module, q)) {
      l.bits = q.bits;
      l.dtype = DType::u32;
      int64_t groups = in / kQuantGroup;
      if (in % kQuantGroup) return format_error("module `%s`: in %lld is not a multiple of 64", module.c_str(), (long long)in);
      ASSIGN_OR_RETURN(auto* w, tensor(module + ".weight", {out, packed_words(in, q.bits)}, {DType::u32}));
      ASSIGN_OR_RETURN(auto* s, tensor(module + ".scales", {out, groups}, {DType::bf16}));
      ASSIGN_OR_RETURN(auto* b, tensor(module + ".biases", {out, groups}, {DType::bf16}));
      l.w = w->data;
      l.scales = reinterpret_cast<const uint16_t*>(s->data);
      l.biases = reinterpret_cast<const uint16_t*>(b->data);
      return l;
    }
    ASSIGN_OR_RETURN(auto* w, tensor(module + ".weight", {out, in}, {DType::bf16, DType::f16, DType::f32}));
    l.dtype = w->dtype;
    l.w = w->data;
    return l;
  }

  // Experts: HF packed gate_up_proj [E, 2I, H] / down_proj [E, H, I] (or per-expert keys); MLX switch_mlp.
  Status experts(const std::string& mlp, MoeWeights& moe) {
    const int64_t E = cfg_.num_experts, I = cfg_.moe_intermediate_size, H = cfg_.hidden_size;
    if (layout_ == CheckpointLayout::mlx) {
      for (auto [name, out, in, dst] : {std::tuple{"gate_proj", I, H, &moe.expert_gate},
                                        std::tuple{"up_proj", I, H, &moe.expert_up},
                                        std::tuple{"down_proj", H, I, &moe.expert_down}}) {
        ASSIGN_OR_RETURN(Linear all, stacked(mlp + "switch_mlp." + name, E, out, in));
        for (int64_t e = 0; e < E; ++e) dst->push_back(all.rows(e * out, out));
      }
      return ok_status();
    }
    if (store_.find(mlp + "experts.gate_up_proj")) {
      ASSIGN_OR_RETURN(auto* gu, tensor(mlp + "experts.gate_up_proj", {E, 2 * I, H}, {DType::bf16, DType::f16, DType::f32}));
      ASSIGN_OR_RETURN(auto* dn, tensor(mlp + "experts.down_proj", {E, H, I}, {DType::bf16, DType::f16, DType::f32}));
      Linear gate_up{E * 2 * I, H, gu->dtype, 0, gu->data, nullptr, nullptr};
      Linear down{E * H, I, dn->dtype, 0, dn->data, nullptr, nullptr};
      for (int64_t e = 0; e < E; ++e) {
        moe.expert_gate.push_back(gate_up.rows(e * 2 * I, I));  // rows 0..I-1 of expert e: gate
        moe.expert_up.push_back(gate_up.rows(e * 2 * I + I, I));
        moe.expert_down.push_back(down.rows(e * H, H));
      }
      return ok_status();
    }
    for (int64_t e = 0; e < E; ++e) {  // per-expert keys
      std::string p = mlp + "experts." + std::to_string(e) + ".";
      ASSIGN_OR_RETURN(Linear g, linear(p + "gate_proj", I, H));
      ASSIGN_OR_RETURN(Linear u, linear(p + "up_proj", I, H));
      ASSIGN_OR_RETURN(Linear d, linear(p + "down_proj", H, I));
      moe.expert_gate.push_back(g);
      moe.expert_up.push_back(u);
      moe.expert_down.push_back(d);
    }
    return ok_status();
  }

  Status moe(const std::string& p, MoeWeights& moe) {
    const int64_t E = cfg_.num_experts, H = cfg_.hidden_size, Is = cfg_.shared_expert_intermediate_size;
    ASSIGN_OR_RETURN(moe.router, linear(p + "mlp.gate", E, H));
    RETURN_IF_ERROR(experts(p + "mlp.", moe));
    ASSIGN_OR_RETURN(moe.shared_gate, linear(p + "mlp.shared_expert.gate_proj", Is, H));
    ASSIGN_OR_RETURN(moe.shared_up, linear(p + "mlp.shared_expert.up_proj", Is, H));
    ASSIGN_OR_RETURN(moe.shared_down, linear(p + "mlp.shared_expert.down_proj", H, Is));
    ASSIGN_OR_RETURN(moe.shared_expert_gate, linear(p + "mlp.shared_expert_gate", 1, H));
    return ok_status();
  }

  Status attention(const std::string& p, AttentionWeights& a) {
    const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, nq = cfg_.num_attention_heads,
                  nkv = cfg_.num_key_value_heads;
    ASSIGN_OR_RETURN(a.q_proj, linear(p + "self_attn.q_proj", nq * D * 2, H));  // query and gate per head
    ASSIGN_OR_RETURN(a.k_proj, linear(p + "self_attn.k_proj", nkv * D, H));
    ASSIGN_OR_RETURN(a.v_proj, linear(p + "self_attn.v_proj", nkv * D, H));
    ASSIGN_OR_RETURN(a.o_proj, linear(p + "self_attn.o_proj", H, nq * D));
    ASSIGN_OR_RETURN(a.q_norm, norm(p + "self_attn.q_norm.weight", D));
    ASSIGN_OR_RETURN(a.k_norm, norm(p + "self_attn.k_norm.weight", D));
    return ok_status();
  }

  Status delta_net(const std::string& p, DeltaNetWeights& g) {
    const int64_t H = cfg_.hidden_size, C = cfg_.linear_conv_dim(), Vd = cfg_.linear_value_dim(),
                  nv = cfg_.linear_num_value_heads, K = cfg_.linear_conv_kernel_dim;
    std::string la = p + "linear_attn.";
    ASSIGN_OR_RETURN(g.in_proj_qkv, linear(la + "in_proj_qkv", C, H));
    ASSIGN_OR_RETURN(g.in_proj_z, linear(la + "in_proj_z", Vd, H));
    ASSIGN_OR_RETURN(g.in_proj_b, linear(la + "in_proj_b", nv, H));
    ASSIGN_OR_RETURN(g.in_proj_a, linear(la + "in_proj_a", nv, H));
    ASSIGN_OR_RETURN(g.out_proj, linear(la + "out_proj", H, Vd));
    // HF conv1d [C, 1, K], MLX [C, K, 1]: the same memory order c*K + k.
    Shape conv_shape = layout_ == CheckpointLayout::hf ? Shape{C, 1, K} : Shape{C, K, 1};
    ASSIGN_OR_RETURN(g.conv1d, vec(la + "conv1d.weight", conv_shape));
    ASSIGN_OR_RETURN(g.dt_bias, vec(la + "dt_bias", {nv}));
    ASSIGN_OR_RETURN(g.A_log, vec(la + "A_log", {nv}));
    ASSIGN_OR_RETURN(g.norm, vec(la + "norm.weight", {cfg_.linear_value_head_dim}));
    return ok_status();
  }

  Status layer(const std::string& p, LayerType type, LayerWeights& lw) {
    lw.type = type;
    ASSIGN_OR_RETURN(lw.input_norm, norm(p + "input_layernorm.weight", cfg_.hidden_size));
    ASSIGN_OR_RETURN(lw.post_attention_norm, norm(p + "post_attention_layernorm.weight", cfg_.hidden_size));
    if (type == LayerType::full_attention) RETURN_IF_ERROR(attention(p, lw.attn));
    else RETURN_IF_ERROR(delta_net(p, lw.gdn));
    return moe(p, lw.moe);
  }

  // The head's tensors are also counted apart (ModelWeights::mtp_tensors): the session files' model
  // fingerprint leaves them out, so that it does not depend on whether the head is there (--mtp-from).
  Status mtp(MtpWeights& w) {
    const size_t n0 = m_.n_tensors, b0 = m_.tensor_bytes;
    const int64_t H = cfg_.hidden_size;
    ASSIGN_OR_RETURN(w.fc, linear("mtp.fc", H, 2 * H));
    ASSIGN_OR_RETURN(w.pre_fc_norm_embedding, norm("mtp.pre_fc_norm_embedding.weight", H));
    ASSIGN_OR_RETURN(w.pre_fc_norm_hidden, norm("mtp.pre_fc_norm_hidden.weight", H));
    ASSIGN_OR_RETURN(w.norm, norm("mtp.norm.weight", H));
    RETURN_IF_ERROR(layer("mtp.layers.0.", LayerType::full_attention, w.layer));
    m_.mtp_tensors = m_.n_tensors - n0, m_.mtp_tensor_bytes = m_.tensor_bytes - b0;
    return ok_status();
  }

 private:
  // Quantized per the config and stored so: a `.scales` or a U32 `.weight` is present. (Testing `.scales` alone
  // reported a missing `.scales` as a dense-shape mismatch of `.weight`, without naming the missing tensor.)
  bool stored_quantized(const std::string& module, const QuantSpec& q) const {
    if (!q.bits) return false;
    const TensorInfo* w = store_.find(module + ".weight");
    return store_.find(module + ".scales") || (w && w->dtype == DType::u32);
  }

  // An MLX SwitchLinear [E, out, in] seen as one Linear [E*out, in].
  Result<Linear> stacked(const std::string& module, int64_t E, int64_t out, int64_t in) {
    QuantSpec q = cfg_.quantization.for_path(module);
    if (!stored_quantized(module, q)) {
      ASSIGN_OR_RETURN(auto* w, tensor(module + ".weight", {E, out, in}, {DType::bf16, DType::f16, DType::f32}));
      return Linear{E * out, in, w->dtype, 0, w->data, nullptr, nullptr};
    }
    int64_t groups = in / kQuantGroup;
    ASSIGN_OR_RETURN(auto* w, tensor(module + ".weight", {E, out, packed_words(in, q.bits)}, {DType::u32}));
    ASSIGN_OR_RETURN(auto* s, tensor(module + ".scales", {E, out, groups}, {DType::bf16}));
    ASSIGN_OR_RETURN(auto* b, tensor(module + ".biases", {E, out, groups}, {DType::bf16}));
    return Linear{E * out, in, DType::u32, q.bits, w->data, reinterpret_cast<const uint16_t*>(s->data),
                  reinterpret_cast<const uint16_t*>(b->data)};
  }

  const ModelConfig& cfg_;
  const TensorStore& store_;
  CheckpointLayout layout_;
  ModelWeights& m_;
};

}  // namespace

Result<ModelWeights> ModelWeights::bind(const ModelConfig& config, std::shared_ptr<TensorStore> store,
                                        const std::string& dir) {
  ModelWeights m;
  m.config = config;
  m.dir = dir;
  m.store = store;
  Prefixes pre;
  const char* text_prefixes[] = {"model.language_model.", "language_model.model.", "model."};
  for (const char* p : text_prefixes)
    if (store->find(std::string(p) + "embed_tokens.weight")) {
      pre.text = p;
      break;
    }
  if (pre.text.empty())
    return format_error("%s: no embedding found (looked for model.language_model.embed_tokens.weight, "
                        "language_model.model.embed_tokens.weight, model.embed_tokens.weight)", dir.c_str());
  pre.head = pre.text == "language_model.model." ? "language_model.lm_head" : "lm_head";
  bool has_switch = store->find(pre.text + "layers.0.mlp.switch_mlp.gate_proj.weight") != nullptr;
  m.layout = (config.quantization.enabled || has_switch) ? CheckpointLayout::mlx : CheckpointLayout::hf;

  Binder b(m.config, *store, m.layout, m);
  const int64_t V = config.vocab_size, H = config.hidden_size;
  auto bind_all = [&]() -> Status {
    ASSIGN_OR_RETURN(m.embed_tokens, b.linear(pre.text + "embed_tokens", V, H));
    if (config.tie_word_embeddings && !store->find(pre.head + ".weight")) {
      m.lm_head = m.embed_tokens;
    } else {
      ASSIGN_OR_RETURN(m.lm_head, b.linear(pre.head, V, H));
    }
    ASSIGN_OR_RETURN(m.final_norm, b.norm(pre.text + "norm.weight", H));
    m.layers.resize(static_cast<size_t>(config.num_hidden_layers));
    for (int i = 0; i < config.num_hidden_layers; ++i)
      RETURN_IF_ERROR(b.layer(pre.text + "layers." + std::to_string(i) + ".", config.layer_types[i], m.layers[i]));
    if (store->find("mtp.fc.weight") || store->find("mtp.fc.scales")) {
      m.mtp.emplace();
      RETURN_IF_ERROR(b.mtp(*m.mtp));
    }
    return ok_status();
  };
  Status st = bind_all();
  if (!st.ok()) return st.with_context(format("%s (%s layout)", dir.c_str(), layout_name(m.layout)));
  return m;
}

Status ModelWeights::missing_mtp_error() const {
  return error(ErrorCode::not_found,
               "%s has no multi-token-prediction head (no mtp.* tensors), which --speculative mtp:K drafts with; "
               "an mlx-lm conversion drops it: convert the Hugging Face checkpoint with `lily quantize`, which keeps "
               "it, or load the head from the Hugging Face checkpoint with --mtp-from DIR",
               dir.c_str());
}

Status ModelWeights::attach_mtp(const std::string& mtp_dir) {
  if (mtp) return invalid_argument("%s has an MTP head of its own; --mtp-from %s is not needed", dir.c_str(), mtp_dir.c_str());
  ASSIGN_OR_RETURN(ModelConfig c, ModelConfig::load(mtp_dir));
  const ModelConfig& o = config;
  if (c.hidden_size != o.hidden_size || c.vocab_size != o.vocab_size || c.num_experts != o.num_experts ||
      c.moe_intermediate_size != o.moe_intermediate_size ||
      c.shared_expert_intermediate_size != o.shared_expert_intermediate_size ||
      c.num_attention_heads != o.num_attention_heads || c.num_key_value_heads != o.num_key_value_heads ||
      c.head_dim != o.head_dim)
    return invalid_argument("--mtp-from %s: its geometry (hidden %d, vocab %d, %d experts) is not the model's "
                            "(hidden %d, vocab %d, %d experts)", mtp_dir.c_str(), c.hidden_size, c.vocab_size,
                            c.num_experts, o.hidden_size, o.vocab_size, o.num_experts);
  ASSIGN_OR_RETURN(TensorStore opened, TensorStore::open_dir(mtp_dir));
  auto store = std::make_shared<TensorStore>(std::move(opened));
  if (!store->find("mtp.fc.weight"))
    return error(ErrorCode::not_found, "--mtp-from %s: no mtp.* tensors there (expected mtp.fc.weight)", mtp_dir.c_str());
  const bool has_switch = store->find("mtp.layers.0.mlp.switch_mlp.gate_proj.weight") != nullptr;
  const CheckpointLayout layout = (c.quantization.enabled || has_switch) ? CheckpointLayout::mlx : CheckpointLayout::hf;
  MtpWeights head;
  Binder b(c, *store, layout, *this);
  Status st = b.mtp(head);
  if (!st.ok()) return st.with_context(format("--mtp-from %s (%s layout)", mtp_dir.c_str(), layout_name(layout)));
  mtp = std::move(head);
  mtp_store = std::move(store);
  return ok_status();
}

Result<ModelWeights> ModelWeights::load(const std::string& dir) {
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::load(dir));
  ASSIGN_OR_RETURN(TensorStore store, TensorStore::open_dir(dir));
  return bind(config, std::make_shared<TensorStore>(std::move(store)), dir);
}

}  // namespace lily
