#include "cpu/cpu_backend.h"

#include <algorithm>
#include <vector>

#include "cpu/ops.h"

namespace lily {

namespace {

// The saved form (Checkpoint::save / SequenceState::save): n, the layer count, then per layer its arrays, each
// as a float count and the floats (k, v for a sequence; conv, S for both); then the MTP head's part: a byte (1:
// the sequence carries the head's state), and when 1 the head's KV length m, its k and v rows [0, m) (a
// sequence only), its pending rows [n - m, H] and their tokens (n - m - 1 of them, none when n == m).
void put(ByteWriter& out, const float* a, size_t count) {
  out.pod<uint64_t>(count);
  out.bytes(a, count * sizeof(float));
}
void put(ByteWriter& out, const std::vector<float>& a) { put(out, a.data(), a.size()); }
void put(ByteWriter& out, const std::vector<int32_t>& ids) {
  out.pod<uint64_t>(ids.size());
  out.bytes(ids.data(), ids.size() * sizeof(int32_t));
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

// An array of exactly `expect` values (floats, or token ids), named `what` in the error.
template <typename T>
Status get_exact(ByteReader& in, std::vector<T>& a, size_t expect, const char* what) {
  uint64_t count = 0;
  RETURN_IF_ERROR(in.pod(&count, what));
  if (count != expect)
    return format_error("%s: %llu values, expected %zu", what, (unsigned long long)count, expect);
  a.resize(count);
  return in.bytes(a.data(), count * sizeof(T), what);
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
  // The MTP head's part (mtp_on: taken from a sequence with the head): its KV length and the hidden rows and
  // tokens it has not read yet.
  bool mtp_on = false;
  int64_t mtp_n = 0;
  std::vector<float> mtp_hidden;
  std::vector<int32_t> mtp_tokens;
  int64_t n_tokens() const override { return n; }
  size_t bytes() const override {
    size_t b = (mtp_hidden.size() + mtp_tokens.size()) * sizeof(float);
    for (size_t i = 0; i < conv.size(); ++i) b += (conv[i].size() + S[i].size()) * sizeof(float);
    return b;
  }
  Status save(ByteWriter& out) const override {
    out.pod<int64_t>(n);
    out.pod<uint32_t>(static_cast<uint32_t>(conv.size()));
    for (size_t i = 0; i < conv.size(); ++i) put(out, conv[i]), put(out, S[i]);
    out.pod<uint8_t>(mtp_on ? 1 : 0);
    if (mtp_on) {  // no KV: a restore truncates the sequence's
      out.pod<int64_t>(mtp_n);
      put(out, mtp_hidden);
      put(out, mtp_tokens);
    }
    return ok_status();
  }
};

// The MTP head's state of one sequence (docs/MODEL.md eq 26). Its KV entry at position i is computed from the
// token at i+1 and the main model's hidden state at i, so the head runs one position behind the main model:
// the hidden rows of positions n..n+P-1 wait in `pending_hidden` until the token after each is known.
struct MtpState {
  cpu::LayerState kv;                 // entries for positions 0..n-1
  int64_t n = 0;
  std::vector<float> pending_hidden;  // [P, H]: the main model's final-norm output at positions n..n+P-1
  std::vector<int32_t> pending_tokens;  // the tokens at positions n+1..n+P-1 (P-1 of them)
  std::vector<float> chain_hidden;    // [H]: the head's output of the last draft step (empty: none)
};

void truncate_kv(cpu::LayerState& l, int64_t n, int64_t kv_row) {
  l.k.resize(static_cast<size_t>(n * kv_row));
  l.v.resize(static_cast<size_t>(n * kv_row));
}

class CpuSequence final : public SequenceState {
 public:
  int64_t n = 0;
  std::vector<cpu::LayerState> layers;
  int64_t kv_row = 0;  // floats per token per layer (n_kv_heads * head_dim)
  int64_t hidden = 0;
  bool mtp_on = false;
  MtpState mtp;
  // Between forward_verify and accept_verified: where the verified rows start, how many, and per Gated
  // DeltaNet layer the state after each row.
  int64_t verify_base = -1, verify_rows = 0;
  std::vector<std::vector<cpu::LayerState>> verify_after;

  int64_t n_tokens() const override { return n; }
  size_t bytes() const override {
    size_t b = 0;
    for (const auto& l : layers) b += (l.k.size() + l.v.size() + l.conv.size() + l.S.size()) * sizeof(float);
    b += (mtp.kv.k.size() + mtp.kv.v.size() + mtp.pending_hidden.size() + mtp.pending_tokens.size() +
          mtp.chain_hidden.size()) * sizeof(float);
    for (const auto& rows : verify_after)
      for (const auto& r : rows) b += (r.conv.size() + r.S.size()) * sizeof(float);
    return b;
  }
  std::unique_ptr<Checkpoint> checkpoint() const override {
    auto cp = std::make_unique<CpuCheckpoint>();
    cp->n = n;
    for (const auto& l : layers) {
      cp->conv.push_back(l.conv);
      cp->S.push_back(l.S);
    }
    if (mtp_on) {
      cp->mtp_on = true;
      cp->mtp_n = std::min(mtp.n, n);  // draft entries (positions >= n) are not part of the sequence
      if (mtp.n <= n) {
        cp->mtp_hidden = mtp.pending_hidden;
        cp->mtp_tokens = mtp.pending_tokens;
      }
    }
    return cp;
  }
  Status restore(const Checkpoint& base) override {
    auto* cp = dynamic_cast<const CpuCheckpoint*>(&base);
    if (!cp || cp->conv.size() != layers.size()) return invalid_argument("checkpoint is not from this backend/model");
    if (cp->n > n) return invalid_argument("checkpoint at %lld is past the sequence end %lld", (long long)cp->n, (long long)n);
    if (mtp_on && !cp->mtp_on) return invalid_argument("checkpoint without the MTP head's state");
    if (mtp_on && cp->mtp_n > mtp.n)
      return invalid_argument("checkpoint's MTP head state (%lld positions) is past the sequence's (%lld)",
                              (long long)cp->mtp_n, (long long)mtp.n);
    n = cp->n;
    for (size_t i = 0; i < layers.size(); ++i) {
      layers[i].conv = cp->conv[i];
      layers[i].S = cp->S[i];
      if (!layers[i].k.empty()) truncate_kv(layers[i], n, kv_row);
    }
    if (mtp_on) {
      truncate_kv(mtp.kv, cp->mtp_n, kv_row);
      mtp.n = cp->mtp_n;
      mtp.pending_hidden = cp->mtp_hidden;
      mtp.pending_tokens = cp->mtp_tokens;
      mtp.chain_hidden.clear();
    }
    verify_base = -1, verify_rows = 0;
    verify_after.clear();
    return ok_status();
  }
  std::unique_ptr<SequenceState> clone() const override { return std::make_unique<CpuSequence>(*this); }

  // Draft steps wrote KV entries at positions >= n from the head's own hidden states: a main forward drops them.
  void drop_drafts() {
    if (mtp.n > n) {
      truncate_kv(mtp.kv, n, kv_row);
      mtp.n = n;
    }
    mtp.chain_hidden.clear();
  }

  // The head's state as the next forward finds it (drop_drafts): the entries a draft wrote at positions >= n
  // and the chained row are left out, as checkpoint() leaves them out; a draft from the pending rows has read
  // them all (none pending then, the head at n).
  Status save(ByteWriter& out) const override {
    out.pod<int64_t>(n);
    out.pod<uint32_t>(static_cast<uint32_t>(layers.size()));
    for (const auto& l : layers) put(out, l.k), put(out, l.v), put(out, l.conv), put(out, l.S);
    out.pod<uint8_t>(mtp_on ? 1 : 0);
    if (mtp_on) {
      const int64_t m = std::min(mtp.n, n);
      const auto kv = static_cast<size_t>(m * kv_row);
      out.pod<int64_t>(m);
      put(out, mtp.kv.k.data(), kv);
      put(out, mtp.kv.v.data(), kv);
      put(out, mtp.n <= n ? mtp.pending_hidden : std::vector<float>{});
      put(out, mtp.n <= n ? mtp.pending_tokens : std::vector<int32_t>{});
    }
    return ok_status();
  }
};

// The MTP head's part of a saved sequence or checkpoint at position n (after the layers): into `m` when
// `keep` (the backend has the head on; `kv`: a sequence's, with its KV rows), else read past. The pending rows
// are the positions m->n .. n-1, always: every path that leaves the head behind the main model leaves exactly
// those rows for it.
Status read_mtp(ByteReader& in, int64_t n, int64_t kv_row, int64_t H, bool keep, bool kv, MtpState* m) {
  uint8_t has = 0;
  RETURN_IF_ERROR(in.pod(&has, "MTP head flag"));
  if (has > 1) return format_error("MTP head flag %u", static_cast<unsigned>(has));
  if (!has) {
    if (keep)
      return error(ErrorCode::unsupported,
                   "saved without the MTP head's state, which this backend's sequences carry (enable_mtp)");
    return ok_status();
  }
  MtpState read;
  int64_t at = 0;
  RETURN_IF_ERROR(in.pod(&at, "MTP head position"));
  if (at < 0 || at > n) return format_error("the MTP head at %lld, the sequence at %lld", (long long)at, (long long)n);
  const int64_t P = n - at;
  if (kv) {
    RETURN_IF_ERROR(get_exact(in, read.kv.k, static_cast<size_t>(at * kv_row), "MTP k"));
    RETURN_IF_ERROR(get_exact(in, read.kv.v, static_cast<size_t>(at * kv_row), "MTP v"));
  }
  RETURN_IF_ERROR(get_exact(in, read.pending_hidden, static_cast<size_t>(P * H), "MTP pending rows"));
  RETURN_IF_ERROR(get_exact(in, read.pending_tokens, static_cast<size_t>(std::max<int64_t>(P - 1, 0)),
                            "MTP pending tokens"));
  read.n = at;
  if (keep) *m = std::move(read);
  return ok_status();
}

Status check_tokens(std::span<const int32_t> tokens, int64_t V) {
  if (tokens.empty()) return invalid_argument("forward: no tokens");
  for (int32_t id : tokens)
    if (id < 0 || id >= V) return invalid_argument("token id %d is outside the vocabulary [0, %lld)", id, (long long)V);
  return ok_status();
}

}  // namespace

CpuBackend::CpuBackend(std::shared_ptr<const ModelWeights> weights, CpuBackendOptions options)
    : weights_(std::move(weights)), options_(std::move(options)),
      pool_(std::make_unique<ThreadPool>(options_.n_threads)) {}

std::unique_ptr<SequenceState> CpuBackend::new_sequence() {
  auto s = std::make_unique<CpuSequence>();
  s->layers.resize(weights_->layers.size());
  s->kv_row = static_cast<int64_t>(config().num_key_value_heads) * config().head_dim;
  s->hidden = config().hidden_size;
  s->mtp_on = mtp_on_;
  return s;
}

Status CpuBackend::enable_mtp() {
  if (!weights_->mtp) return weights_->missing_mtp_error();
  mtp_on_ = true;
  return ok_status();
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
  RETURN_IF_ERROR(read_mtp(in, s->n, s->kv_row, s->hidden, mtp_on_, /*kv=*/true, &s->mtp));
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
  MtpState m;
  const int64_t kv_row = static_cast<int64_t>(c.num_key_value_heads) * c.head_dim;
  RETURN_IF_ERROR(read_mtp(in, cp->n, kv_row, c.hidden_size, mtp_on_, /*kv=*/false, &m));
  if (mtp_on_) {
    cp->mtp_on = true;
    cp->mtp_n = m.n;
    cp->mtp_hidden = std::move(m.pending_hidden);
    cp->mtp_tokens = std::move(m.pending_tokens);
  }
  return std::unique_ptr<Checkpoint>(std::move(cp));
}

// Eqs 4-6: embed, then per layer h' = h + Mixer(ZN(h)), h = h' + MoE(ZN(h')), then final norm and lm_head.
// With the MTP head enabled the final-norm output of every row is kept for it (eq 26); `verify` keeps the
// recurrent state after each row and leaves the head's pending rows for accept_verified to cut.
Status CpuBackend::run(SequenceState& base, std::span<const int32_t> tokens, bool verify, LogitsRows rows,
                       std::vector<float>* logits) {
  auto* seq = dynamic_cast<CpuSequence*>(&base);
  if (!seq) return invalid_argument("sequence state is not from the CPU backend");
  const ModelConfig& c = config();
  const int64_t T = static_cast<int64_t>(tokens.size()), H = c.hidden_size, V = c.vocab_size;
  RETURN_IF_ERROR(check_tokens(tokens, V));
  if (seq->verify_base >= 0)
    return invalid_argument("forward after forward_verify: accept_verified must say which rows to keep first");
  if (seq->n + T > c.max_position_embeddings)
    return error(ErrorCode::out_of_range, "%lld tokens exceed the context of %d", (long long)(seq->n + T),
                 c.max_position_embeddings);
  if (seq->mtp_on) seq->drop_drafts();

  const ModelWeights& w = *weights_;
  std::vector<float> h(T * H), x(T * H), y(T * H);
  if (verify) seq->verify_after.assign(w.layers.size(), {});
  cpu::embed(w.embed_tokens, tokens.data(), T, h.data());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& lw = w.layers[l];
    cpu::Context ctx{*pool_, c, options_.trace, static_cast<int>(l)};
    cpu::rms_norm(h.data(), lw.input_norm.data(), T, H, c.rms_norm_eps, x.data());
    if (lw.type == LayerType::full_attention)
      cpu::attention_block(ctx, lw.attn, x.data(), T, seq->n, seq->layers[l], y.data());
    else
      cpu::delta_net_block(ctx, lw.gdn, x.data(), T, seq->layers[l], y.data(),
                           verify ? &seq->verify_after[l] : nullptr);
    for (int64_t i = 0; i < T * H; ++i) h[i] += y[i];
    cpu::rms_norm(h.data(), lw.post_attention_norm.data(), T, H, c.rms_norm_eps, x.data());
    cpu::moe_block(ctx, lw.moe, x.data(), T, y.data());
    for (int64_t i = 0; i < T * H; ++i) h[i] += y[i];
    ctx.dump("hidden", h.data(), {T, H});
  }
  const int64_t n0 = seq->n;
  seq->n += T;
  if (verify) seq->verify_base = n0, seq->verify_rows = T;
  const int64_t first = seq->mtp_on || rows == LogitsRows::all ? 0 : rows == LogitsRows::last ? T - 1 : T;
  cpu::rms_norm(h.data() + first * H, w.final_norm.data(), T - first, H, c.rms_norm_eps, x.data() + first * H);
  if (seq->mtp_on) {
    MtpState& m = seq->mtp;
    const bool had_pending = !m.pending_hidden.empty();
    m.pending_hidden.insert(m.pending_hidden.end(), x.begin(), x.end());
    m.pending_tokens.insert(m.pending_tokens.end(), tokens.begin() + (had_pending ? 0 : 1), tokens.end());
    if (!verify) {
      // Every pending row but the last has its next token now: the head reads them (its KV stays complete).
      const int64_t ready = static_cast<int64_t>(m.pending_hidden.size()) / H - 1;
      if (ready > 0) {
        RETURN_IF_ERROR(mtp_run(*seq, std::span<const int32_t>(m.pending_tokens).first(static_cast<size_t>(ready)),
                                m.pending_hidden.data(), nullptr));
        m.pending_hidden.erase(m.pending_hidden.begin(), m.pending_hidden.begin() + ready * H);
        m.pending_tokens.erase(m.pending_tokens.begin(), m.pending_tokens.begin() + ready);
      }
      m.chain_hidden.clear();
    }
  }
  if (rows == LogitsRows::none) return ok_status();
  const int64_t from = rows == LogitsRows::last ? T - 1 : 0, n_rows = T - from;
  logits->resize(static_cast<size_t>(n_rows * V));
  cpu::matmul(*pool_, w.lm_head, x.data() + from * H, n_rows, logits->data());
  return ok_status();
}

Status CpuBackend::forward(SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows,
                           std::vector<float>* logits) {
  return run(seq, tokens, /*verify=*/false, rows, logits);
}

Status CpuBackend::forward_verify(SequenceState& seq, std::span<const int32_t> tokens, std::vector<float>* logits) {
  return run(seq, tokens, /*verify=*/true, LogitsRows::all, logits);
}

Status CpuBackend::accept_verified(SequenceState& base, int64_t n_keep) {
  auto* seq = dynamic_cast<CpuSequence*>(&base);
  if (!seq) return invalid_argument("sequence state is not from the CPU backend");
  if (seq->verify_base < 0) return invalid_argument("accept_verified without a forward_verify before it");
  if (n_keep < 1 || n_keep > seq->verify_rows)
    return invalid_argument("accept_verified: %lld rows kept of %lld verified", (long long)n_keep,
                            (long long)seq->verify_rows);
  seq->n = seq->verify_base + n_keep;
  for (size_t l = 0; l < seq->layers.size(); ++l) {
    cpu::LayerState& st = seq->layers[l];
    if (weights_->layers[l].type == LayerType::full_attention) {
      truncate_kv(st, seq->n, seq->kv_row);
    } else {
      cpu::LayerState& kept = seq->verify_after[l][static_cast<size_t>(n_keep - 1)];
      st.conv = std::move(kept.conv);
      st.S = std::move(kept.S);
    }
  }
  if (seq->mtp_on) {  // the pending rows of the rejected positions go too
    MtpState& m = seq->mtp;
    const int64_t P = seq->n - m.n;
    m.pending_hidden.resize(static_cast<size_t>(P * seq->hidden));
    m.pending_tokens.resize(static_cast<size_t>(P - 1));
  }
  seq->verify_base = -1, seq->verify_rows = 0;
  seq->verify_after.clear();
  return ok_status();
}

Status CpuBackend::mtp_draft(SequenceState& base, int32_t token, std::vector<float>* logits) {
  auto* seq = dynamic_cast<CpuSequence*>(&base);
  if (!seq) return invalid_argument("sequence state is not from the CPU backend");
  if (!seq->mtp_on) return invalid_argument("mtp_draft: the MTP head is not enabled (enable_mtp)");
  if (seq->verify_base >= 0) return invalid_argument("mtp_draft between forward_verify and accept_verified");
  RETURN_IF_ERROR(check_tokens(std::span<const int32_t>(&token, 1), config().vocab_size));
  MtpState& m = seq->mtp;
  if (!m.pending_hidden.empty()) {  // the main model's rows (the last one pairs with `token`)
    std::vector<int32_t> ids = std::move(m.pending_tokens);
    ids.push_back(token);
    std::vector<float> hidden = std::move(m.pending_hidden);
    m.pending_tokens.clear(), m.pending_hidden.clear();
    return mtp_run(*seq, ids, hidden.data(), logits);
  }
  if (m.chain_hidden.empty())
    return invalid_argument("mtp_draft: the sequence has no hidden state to draft from (forward a token first)");
  std::vector<float> hidden = m.chain_hidden;  // the head's previous output
  return mtp_run(*seq, std::span<const int32_t>(&token, 1), hidden.data(), logits);
}

// Eq 26 over R rows at the head's next positions: x = W_fc [ZN(E[tok]); ZN(hidden)], one full-attention MoE
// decoder layer with the head's KV, ZN(mtp.norm); the last row's output is kept for a chained step and its
// logits written when asked.
Status CpuBackend::mtp_run(SequenceState& base, std::span<const int32_t> tokens, const float* hidden,
                           std::vector<float>* logits) {
  auto& seq = static_cast<CpuSequence&>(base);
  const ModelConfig& c = config();
  const MtpWeights& m = *weights_->mtp;
  const int64_t R = static_cast<int64_t>(tokens.size()), H = c.hidden_size;
  std::vector<float> e(R * H), cat(R * 2 * H), h(R * H), x(R * H), y(R * H);
  cpu::embed(weights_->embed_tokens, tokens.data(), R, e.data());
  for (int64_t r = 0; r < R; ++r) {
    cpu::rms_norm(&e[r * H], m.pre_fc_norm_embedding.data(), 1, H, c.rms_norm_eps, &cat[r * 2 * H]);
    cpu::rms_norm(hidden + r * H, m.pre_fc_norm_hidden.data(), 1, H, c.rms_norm_eps, &cat[r * 2 * H + H]);
  }
  cpu::matmul(*pool_, m.fc, cat.data(), R, h.data());
  cpu::Context ctx{*pool_, c, options_.trace, c.num_hidden_layers};
  const LayerWeights& lw = m.layer;
  cpu::rms_norm(h.data(), lw.input_norm.data(), R, H, c.rms_norm_eps, x.data());
  cpu::attention_block(ctx, lw.attn, x.data(), R, seq.mtp.n, seq.mtp.kv, y.data());
  for (int64_t i = 0; i < R * H; ++i) h[i] += y[i];
  cpu::rms_norm(h.data(), lw.post_attention_norm.data(), R, H, c.rms_norm_eps, x.data());
  cpu::moe_block(ctx, lw.moe, x.data(), R, y.data());
  for (int64_t i = 0; i < R * H; ++i) h[i] += y[i];
  cpu::rms_norm(h.data() + (R - 1) * H, m.norm.data(), 1, H, c.rms_norm_eps, x.data());
  seq.mtp.n += R;
  seq.mtp.chain_hidden.assign(x.begin(), x.begin() + H);
  if (!logits) return ok_status();
  logits->resize(static_cast<size_t>(c.vocab_size));
  cpu::matmul(*pool_, weights_->lm_head, x.data(), 1, logits->data());
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
    if (seq->verify_base >= 0)
      return invalid_argument("forward_batch row %zu: the sequence waits for accept_verified", i);
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size)
      return invalid_argument("forward_batch row %zu: token id %d is outside the vocabulary [0, %d)", i,
                              tokens[i], c.vocab_size);
    if (seq->n + 1 > c.max_position_embeddings)
      return error(ErrorCode::out_of_range, "forward_batch row %zu: %lld tokens exceed the context of %d", i,
                   (long long)(seq->n + 1), c.max_position_embeddings);
  }
  return Backend::forward_batch(seqs, tokens, logits);  // every row checked: each row's own forward
}

}  // namespace lily
