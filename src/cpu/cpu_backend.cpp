#include "cpu/cpu_backend.h"

#include <algorithm>
#include <vector>

#include "cpu/ops.h"

namespace lily {

namespace {

// The saved form (Checkpoint::save / SequenceState::save): n, the layer count, then per layer its arrays, each
// as a float count and the floats (k, v for a sequence; conv, S for both).
void put(ByteWriter& out, const std::vector<float>& a) {
  out.pod<uint64_t>(a.size());
  out.bytes(a.data(), a.size() * sizeof(float));
}

// An array of `expect` floats, or of none when `may_be_empty` (a Gated DeltaNet state before its first token).
Status get(ByteReader& in, std::vector<float>& a, size_t expect, bool may_be_empty, const char* what,
           size_t layer) {
  uint64_t count = 0;
  RETURN_IF_ERROR(in.pod(&count, what));
  if (count != expect && !(may_be_empty && count == 0))
    return format_error("layer %zu: %s of %llu floats, expected %zu", layer, what, (unsigned long long)count,
                        expect);
  a.resize(count);
  return in.bytes(a.data(), count * sizeof(float), what);
}

struct StateSizes {
  size_t conv = 0, S = 0;
  explicit StateSizes(const ModelConfig& c)
      : conv(static_cast<size_t>(c.linear_conv_kernel_dim - 1) * c.linear_conv_dim()),
        S(static_cast<size_t>(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim) {}
};

Status read_header(ByteReader& in, const ModelConfig& c, int64_t* n) {
  uint32_t n_layers = 0;
  RETURN_IF_ERROR(in.pod(n, "position"));
  RETURN_IF_ERROR(in.pod(&n_layers, "layer count"));
  if (*n < 0 || *n > c.max_position_embeddings)
    return format_error("position %lld outside [0, %d]", (long long)*n, c.max_position_embeddings);
  if (n_layers != c.layer_types.size())
    return format_error("%u layers, the model has %zu", n_layers, c.layer_types.size());
  return ok_status();
}

class CpuCheckpoint final : public Checkpoint {
 public:
  int64_t n = 0;
  std::vector<std::vector<float>> conv, S;  // per layer (empty for attention layers)
  int64_t n_tokens() const override { return n; }
  size_t bytes() const override {
    size_t b = 0;
    for (size_t i = 0; i < conv.size(); ++i) b += (conv[i].size() + S[i].size()) * sizeof(float);
    return b;
  }
  Status save(ByteWriter& out) const override {
    out.pod<int64_t>(n);
    out.pod<uint32_t>(static_cast<uint32_t>(conv.size()));
    for (size_t i = 0; i < conv.size(); ++i) put(out, conv[i]), put(out, S[i]);
    return ok_status();
  }
};

class CpuSequence final : public SequenceState {
 public:
  int64_t n = 0;
  std::vector<cpu::LayerState> layers;
  int64_t kv_row = 0;  // floats per token per layer (n_kv_heads * head_dim)

  int64_t n_tokens() const override { return n; }
  size_t bytes() const override {
    size_t b = 0;
    for (const auto& l : layers) b += (l.k.size() + l.v.size() + l.conv.size() + l.S.size()) * sizeof(float);
    return b;
  }
  std::unique_ptr<Checkpoint> checkpoint() const override {
    auto cp = std::make_unique<CpuCheckpoint>();
    cp->n = n;
    for (const auto& l : layers) {
      cp->conv.push_back(l.conv);
      cp->S.push_back(l.S);
    }
    return cp;
  }
  Status restore(const Checkpoint& base) override {
    auto* cp = dynamic_cast<const CpuCheckpoint*>(&base);
    if (!cp || cp->conv.size() != layers.size()) return invalid_argument("checkpoint is not from this backend/model");
    if (cp->n > n) return invalid_argument("checkpoint at %lld is past the sequence end %lld", (long long)cp->n, (long long)n);
    n = cp->n;
    for (size_t i = 0; i < layers.size(); ++i) {
      layers[i].conv = cp->conv[i];
      layers[i].S = cp->S[i];
      if (!layers[i].k.empty()) {
        layers[i].k.resize(static_cast<size_t>(n * kv_row));
        layers[i].v.resize(static_cast<size_t>(n * kv_row));
      }
    }
    return ok_status();
  }
  std::unique_ptr<SequenceState> clone() const override { return std::make_unique<CpuSequence>(*this); }
  Status save(ByteWriter& out) const override {
    out.pod<int64_t>(n);
    out.pod<uint32_t>(static_cast<uint32_t>(layers.size()));
    for (const auto& l : layers) put(out, l.k), put(out, l.v), put(out, l.conv), put(out, l.S);
    return ok_status();
  }
};

}  // namespace

CpuBackend::CpuBackend(std::shared_ptr<const ModelWeights> weights, CpuBackendOptions options)
    : weights_(std::move(weights)), options_(std::move(options)),
      pool_(std::make_unique<ThreadPool>(options_.n_threads)) {}

std::unique_ptr<SequenceState> CpuBackend::new_sequence() {
  auto s = std::make_unique<CpuSequence>();
  s->layers.resize(weights_->layers.size());
  s->kv_row = static_cast<int64_t>(config().num_key_value_heads) * config().head_dim;
  return s;
}

Result<std::unique_ptr<SequenceState>> CpuBackend::load_sequence(ByteReader& in) {
  const ModelConfig& c = config();
  auto s = std::unique_ptr<CpuSequence>(static_cast<CpuSequence*>(new_sequence().release()));
  RETURN_IF_ERROR(read_header(in, c, &s->n));
  const StateSizes sz(c);
  const auto kv = static_cast<size_t>(s->n * s->kv_row);
  for (size_t i = 0; i < s->layers.size(); ++i) {
    const bool attn = c.layer_types[i] == LayerType::full_attention;
    cpu::LayerState& l = s->layers[i];
    RETURN_IF_ERROR(get(in, l.k, attn ? kv : 0, false, "k", i));
    RETURN_IF_ERROR(get(in, l.v, attn ? kv : 0, false, "v", i));
    RETURN_IF_ERROR(get(in, l.conv, attn ? 0 : sz.conv, s->n == 0, "conv state", i));
    RETURN_IF_ERROR(get(in, l.S, attn ? 0 : sz.S, s->n == 0, "recurrent state", i));
  }
  return std::unique_ptr<SequenceState>(std::move(s));
}

Result<std::unique_ptr<Checkpoint>> CpuBackend::load_checkpoint(ByteReader& in) {
  const ModelConfig& c = config();
  auto cp = std::make_unique<CpuCheckpoint>();
  RETURN_IF_ERROR(read_header(in, c, &cp->n));
  const StateSizes sz(c);
  cp->conv.resize(c.layer_types.size());
  cp->S.resize(c.layer_types.size());
  for (size_t i = 0; i < c.layer_types.size(); ++i) {
    const bool attn = c.layer_types[i] == LayerType::full_attention;
    RETURN_IF_ERROR(get(in, cp->conv[i], attn ? 0 : sz.conv, cp->n == 0, "conv state", i));
    RETURN_IF_ERROR(get(in, cp->S[i], attn ? 0 : sz.S, cp->n == 0, "recurrent state", i));
  }
  return std::unique_ptr<Checkpoint>(std::move(cp));
}

// Eqs 4-6: embed, then per layer h' = h + Mixer(ZN(h)), h = h' + MoE(ZN(h')), then final norm and lm_head.
Status CpuBackend::forward(SequenceState& base, std::span<const int32_t> tokens, LogitsRows rows,
                           std::vector<float>* logits) {
  auto* seq = dynamic_cast<CpuSequence*>(&base);
  if (!seq) return invalid_argument("sequence state is not from the CPU backend");
  const ModelConfig& c = config();
  const int64_t T = static_cast<int64_t>(tokens.size()), H = c.hidden_size, V = c.vocab_size;
  if (T == 0) return invalid_argument("forward: no tokens");
  for (int32_t id : tokens)
    if (id < 0 || id >= V) return invalid_argument("token id %d is outside the vocabulary [0, %lld)", id, (long long)V);
  if (seq->n + T > c.max_position_embeddings)
    return error(ErrorCode::out_of_range, "%lld tokens exceed the context of %d", (long long)(seq->n + T),
                 c.max_position_embeddings);

  const ModelWeights& w = *weights_;
  std::vector<float> h(T * H), x(T * H), y(T * H);
  cpu::embed(w.embed_tokens, tokens.data(), T, h.data());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& lw = w.layers[l];
    cpu::Context ctx{*pool_, c, options_.trace, static_cast<int>(l)};
    cpu::rms_norm(h.data(), lw.input_norm.data(), T, H, c.rms_norm_eps, x.data());
    if (lw.type == LayerType::full_attention) cpu::attention_block(ctx, lw.attn, x.data(), T, seq->n, seq->layers[l], y.data());
    else cpu::delta_net_block(ctx, lw.gdn, x.data(), T, seq->layers[l], y.data());
    for (int64_t i = 0; i < T * H; ++i) h[i] += y[i];
    cpu::rms_norm(h.data(), lw.post_attention_norm.data(), T, H, c.rms_norm_eps, x.data());
    cpu::moe_block(ctx, lw.moe, x.data(), T, y.data());
    for (int64_t i = 0; i < T * H; ++i) h[i] += y[i];
    ctx.dump("hidden", h.data(), {T, H});
  }
  seq->n += T;
  if (rows == LogitsRows::none) return ok_status();
  const int64_t first = rows == LogitsRows::last ? T - 1 : 0, n_rows = T - first;
  cpu::rms_norm(h.data() + first * H, w.final_norm.data(), n_rows, H, c.rms_norm_eps, x.data());
  logits->resize(static_cast<size_t>(n_rows * V));
  cpu::matmul(*pool_, w.lm_head, x.data(), n_rows, logits->data());
  return ok_status();
}

Status CpuBackend::forward_batch(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                                 std::vector<float>* logits) {
  const ModelConfig& c = config();
  if (seqs.size() != tokens.size())
    return invalid_argument("forward_batch: %zu sequences, %zu tokens", seqs.size(), tokens.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    auto* seq = dynamic_cast<CpuSequence*>(seqs[i]);
    if (!seq)
      return invalid_argument("forward_batch row %zu: the sequence state is not from the CPU backend", i);
    if (std::find(seqs.begin(), seqs.begin() + static_cast<std::ptrdiff_t>(i), seqs[i]) !=
        seqs.begin() + static_cast<std::ptrdiff_t>(i))
      return invalid_argument("forward_batch row %zu: the sequence is already in the batch", i);
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size)
      return invalid_argument("forward_batch row %zu: token id %d is outside the vocabulary [0, %d)", i,
                              tokens[i], c.vocab_size);
    if (seq->n + 1 > c.max_position_embeddings)
      return error(ErrorCode::out_of_range, "forward_batch row %zu: %lld tokens exceed the context of %d", i,
                   (long long)(seq->n + 1), c.max_position_embeddings);
  }
  const size_t V = static_cast<size_t>(c.vocab_size);
  logits->resize(seqs.size() * V);
  std::vector<float> row;
  for (size_t i = 0; i < seqs.size(); ++i) {
    RETURN_IF_ERROR(forward(*seqs[i], tokens.subspan(i, 1), LogitsRows::last, &row));
    std::copy(row.begin(), row.end(), logits->begin() + static_cast<std::ptrdiff_t>(i * V));
  }
  return ok_status();
}

}  // namespace lily
