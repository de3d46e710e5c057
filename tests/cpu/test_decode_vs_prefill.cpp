// The CPU engine's sequence state on the tiny synthetic model (both layouts): decoding N tokens one at a time gives
// the logits of prefilling them at once; two prefill chunks equal one; checkpoint / restore / clone reproduce the
// logits of re-fed tokens. And `lily quantize` output against its bf16 source (4 and 8 bits).
// Each TEST synthesises its checkpoint once (ctest runs every TEST in its own process).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <span>

#include "cpu/cpu_backend.h"
#include "model/quantize_checkpoint.h"
#include "model/synth.h"
#include "common/temp_dir.h"

#include <unistd.h>

namespace lily {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;

std::shared_ptr<const ModelWeights> synth_and_load(const TempDir& dir, CheckpointLayout layout, uint64_t seed) {
  SynthOptions o;
  o.preset = "tiny";
  o.layout = layout;
  o.out_dir = dir.str();
  o.seed = seed;
  Status st = synth_write(o);
  if (!st.ok()) ADD_FAILURE() << st.message();
  auto w = ModelWeights::load(dir.str());
  if (!w.ok()) {
    ADD_FAILURE() << w.status().message();
    return nullptr;
  }
  return std::make_shared<const ModelWeights>(std::move(*w));
}

// Token ids spread over the vocabulary (deterministic).
std::vector<int32_t> test_tokens(int n, int32_t vocab) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((17 + 9973ll * i * i + 31 * i) % vocab));
  return t;
}

double stddev(const std::vector<float>& v) {
  double m = 0, s = 0;
  for (float x : v) m += x;
  m /= static_cast<double>(v.size());
  for (float x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size()));
}

// max |a[i] - b[i]| over n values.
double max_abs_diff(const float* a, const float* b, size_t n) {
  double d = 0;
  for (size_t i = 0; i < n; ++i) d = std::max(d, static_cast<double>(std::fabs(a[i] - b[i])));
  return d;
}

std::vector<float> forward(Backend& be, SequenceState& seq, std::span<const int32_t> tokens, LogitsRows rows) {
  std::vector<float> logits;
  Status st = be.forward(seq, tokens, rows, &logits);
  EXPECT_TRUE(st.ok()) << st.message();
  return logits;
}

void check_sequence_consistency(CheckpointLayout layout) {
  TempDir dir(layout_name(layout));
  auto w = synth_and_load(dir, layout, 5);
  ASSERT_TRUE(w);
  ASSERT_EQ(w->layout, layout);
  CpuBackend be(w);
  const int64_t V = w->config.vocab_size;
  const int N = 12, split = 5;
  const auto tokens = test_tokens(N, static_cast<int32_t>(V));
  const std::span<const int32_t> all(tokens), head = all.first(split), tail = all.subspan(split);

  auto seq = be.new_sequence();
  const std::vector<float> prefill = forward(be, *seq, all, LogitsRows::all);
  ASSERT_EQ(prefill.size(), static_cast<size_t>(N * V));
  EXPECT_EQ(seq->n_tokens(), N);
  const double sd = stddev(prefill), tol = 1e-4 * sd;
  ASSERT_GT(sd, 0.5) << "logits must not be flat for the comparison to mean anything";

  // 1. Decode one token at a time.
  auto dec = be.new_sequence();
  double worst = 0;
  for (int t = 0; t < N; ++t) {
    auto row = forward(be, *dec, all.subspan(t, 1), LogitsRows::last);
    ASSERT_EQ(row.size(), static_cast<size_t>(V));
    worst = std::max(worst, max_abs_diff(row.data(), &prefill[t * V], V));
  }
  std::printf("[%s] decode vs prefill of %d tokens: max |dlogit| %.3g (tolerance %.3g = 1e-4 * std %.3f)\n",
              layout_name(layout), N, worst, tol, sd);
  EXPECT_LE(worst, tol);

  // 2. Two prefill chunks (5 + 7) equal one prefill; LogitsRows::last is the last row of LogitsRows::all.
  auto chunked = be.new_sequence();
  auto a = forward(be, *chunked, head, LogitsRows::all);
  auto b = forward(be, *chunked, tail, LogitsRows::all);
  ASSERT_EQ(a.size() + b.size(), prefill.size());
  const double d_head = max_abs_diff(a.data(), prefill.data(), a.size());
  const double d_tail = max_abs_diff(b.data(), &prefill[split * V], b.size());
  std::printf("[%s] chunks %d + %d vs one prefill: max |dlogit| %.3g / %.3g\n", layout_name(layout), split, N - split,
              d_head, d_tail);
  EXPECT_LE(d_head, tol);
  EXPECT_LE(d_tail, tol);
  auto last_only = be.new_sequence();
  auto last = forward(be, *last_only, all, LogitsRows::last);
  ASSERT_EQ(last.size(), static_cast<size_t>(V));
  EXPECT_LE(max_abs_diff(last.data(), &prefill[(N - 1) * V], V), tol);

  // 3. checkpoint() after 5 tokens; feed 7; restore(); re-feed the 7: the same logits (KV cache truncated, conv
  //    and recurrent state restored). Re-fed one at a time after a second restore, too. clone() likewise.
  auto cp_seq = be.new_sequence();
  EXPECT_TRUE(forward(be, *cp_seq, head, LogitsRows::none).empty());
  auto cp = cp_seq->checkpoint();
  EXPECT_EQ(cp->n_tokens(), split);
  EXPECT_GT(cp->bytes(), 0u);
  auto fork = cp_seq->clone();
  auto first = forward(be, *cp_seq, tail, LogitsRows::all);
  EXPECT_EQ(cp_seq->n_tokens(), N);
  ASSERT_TRUE(cp_seq->restore(*cp).ok());
  EXPECT_EQ(cp_seq->n_tokens(), split);
  auto again = forward(be, *cp_seq, tail, LogitsRows::all);
  ASSERT_EQ(again.size(), first.size());
  const double d_restore = max_abs_diff(again.data(), first.data(), first.size());
  std::printf("[%s] restore at %d and re-feed: max |dlogit| %.3g\n", layout_name(layout), split, d_restore);
  EXPECT_LE(d_restore, tol);
  EXPECT_LE(max_abs_diff(again.data(), &prefill[split * V], again.size()), tol);
  ASSERT_TRUE(cp_seq->restore(*cp).ok());
  for (int t = split; t < N; ++t) {
    auto row = forward(be, *cp_seq, all.subspan(t, 1), LogitsRows::last);
    EXPECT_LE(max_abs_diff(row.data(), &prefill[t * V], V), tol) << "re-decoded token " << t;
  }
  auto forked = forward(be, *fork, tail, LogitsRows::all);
  EXPECT_LE(max_abs_diff(forked.data(), first.data(), first.size()), tol) << "clone()";

  // A checkpoint ahead of the sequence, bad ids and empty input are errors, not crashes.
  auto fresh = be.new_sequence();
  EXPECT_FALSE(fresh->restore(*cp).ok());
  std::vector<float> out;
  const int32_t bad_ids[2] = {1, static_cast<int32_t>(V)};
  EXPECT_FALSE(be.forward(*fresh, bad_ids, LogitsRows::all, &out).ok());
  EXPECT_FALSE(be.forward(*fresh, std::span<const int32_t>(), LogitsRows::all, &out).ok());
  EXPECT_EQ(fresh->n_tokens(), 0);
}

TEST(DecodeVsPrefill, HfLayout) { check_sequence_consistency(CheckpointLayout::hf); }
TEST(DecodeVsPrefill, MlxLayout) { check_sequence_consistency(CheckpointLayout::mlx); }

// ------------------------------------------------------------------------------------ quantized vs bf16 logits

// A dense F32 copy of a quantized Linear (the exact values the 4-bit weights define); storage keeps the buffers.
Linear densify(const Linear& l, std::vector<std::vector<float>>& storage) {
  if (!l.quantized()) return l;
  std::vector<float>& buf = storage.emplace_back(static_cast<size_t>(l.out * l.in));
  for (int64_t r = 0; r < l.out; ++r) l.dequant_row(r, &buf[r * l.in]);
  return Linear{l.out, l.in, DType::f32, 0, buf.data(), nullptr, nullptr};
}

// The model with every quantized matrix replaced by its dequantized F32 copy.
std::shared_ptr<const ModelWeights> dense_twin(const ModelWeights& q, std::vector<std::vector<float>>& storage) {
  auto d = std::make_shared<ModelWeights>(q);
  auto dz = [&](Linear& l) { l = densify(l, storage); };
  dz(d->embed_tokens);
  dz(d->lm_head);
  for (LayerWeights& lw : d->layers) {
    for (Linear* l : {&lw.attn.q_proj, &lw.attn.k_proj, &lw.attn.v_proj, &lw.attn.o_proj, &lw.gdn.in_proj_qkv,
                      &lw.gdn.in_proj_z, &lw.gdn.in_proj_b, &lw.gdn.in_proj_a, &lw.gdn.out_proj, &lw.moe.router,
                      &lw.moe.shared_gate, &lw.moe.shared_up, &lw.moe.shared_down, &lw.moe.shared_expert_gate})
      if (l->w) dz(*l);
    for (auto* experts : {&lw.moe.expert_gate, &lw.moe.expert_up, &lw.moe.expert_down})
      for (Linear& l : *experts) dz(l);
  }
  return d;
}

struct LogitsDiff {
  double rel_l2 = 0;     // ||a - b|| / ||a - mean(a)|| over all rows
  double between = 0;    // the same measure between consecutive positions of a: the signal
  double max_abs = 0;
  int top1_agree = 0;
};

LogitsDiff compare_logits(const std::vector<float>& ref, const std::vector<float>& got, int T, int64_t V) {
  LogitsDiff d;
  double err2 = 0, ref2 = 0, between2 = 0;
  for (int t = 0; t < T; ++t) {
    const float* a = &ref[t * V];
    const float* b = &got[t * V];
    const float* next = &ref[((t + 1) % T) * V];
    double m = 0;
    for (int64_t i = 0; i < V; ++i) m += a[i];
    m /= static_cast<double>(V);
    for (int64_t i = 0; i < V; ++i) {
      err2 += (a[i] - b[i]) * static_cast<double>(a[i] - b[i]);
      ref2 += (a[i] - m) * (a[i] - m);
      between2 += (a[i] - next[i]) * static_cast<double>(a[i] - next[i]);
      d.max_abs = std::max(d.max_abs, static_cast<double>(std::fabs(a[i] - b[i])));
    }
    d.top1_agree += std::max_element(a, a + V) - a == std::max_element(b, b + V) - b;
  }
  d.rel_l2 = std::sqrt(err2 / ref2);
  d.between = std::sqrt(between2 / ref2);
  return d;
}

std::shared_ptr<const ModelWeights> quantize_and_load(const std::string& in, const TempDir& out, int bits) {
  QuantizeOptions qo;
  qo.in_dir = in;
  qo.out_dir = out.str();
  qo.bits = bits;
  Status st = quantize_checkpoint(qo);
  if (!st.ok()) ADD_FAILURE() << st.message();
  auto w = ModelWeights::load(out.str());
  if (!w.ok()) {
    ADD_FAILURE() << w.status().message();
    return nullptr;
  }
  EXPECT_EQ(w->layout, CheckpointLayout::mlx);
  return std::make_shared<const ModelWeights>(std::move(*w));
}

std::vector<float> prefill_logits(std::shared_ptr<const ModelWeights> w, const std::vector<int32_t>& tokens) {
  CpuBackend be(std::move(w));
  auto seq = be.new_sequence();
  return forward(be, *seq, tokens, LogitsRows::all);
}

// `lily quantize` output against its bf16 source, 16 tokens. The tiny random model is chaotic: measured on this
// seed, 4-bit noise in layer 0's in_proj_qkv alone (9% relative RMS per weight, 9.5% at the conv output) moves the
// logits by 45% relative L2, because errors grow layer over layer and flip MoE routing (router probs 16% off after
// layer 0). The whole 4-bit model is 47% off with top-1 agreement 5/16 even though the conversion is exact, while
// deliberately broken conversions measured 67% (expert gate/up swapped), 94% (norm +1 shift missing), 110% (conv
// taps reversed). So 4-bit against bf16 only gets a sanity bound; the discriminating checks are:
//  1. 4-bit: the engine computes exactly the model the quantized file defines (a dense F32 twin holding the
//     dequantized weights: max |dlogit| <= 1e-4 std); test_quantize_checkpoint.cpp bounds every dequantized weight.
//  2. 8-bit (`lily quantize --bits 8`: the same conversion with 0.7% weight noise): relative L2 < 0.1 (measured
//     0.03) and top-1 >= 12 of 16 (measured 15), where each broken conversion above is off by >= 0.5.
TEST(QuantizedModel, LogitsAgainstBf16) {
  TempDir hf_dir("qhf"), q4_dir("q4"), q8_dir("q8");
  auto hf = synth_and_load(hf_dir, CheckpointLayout::hf, 8);
  ASSERT_TRUE(hf);
  auto q4 = quantize_and_load(hf_dir.str(), q4_dir, 4);
  auto q8 = quantize_and_load(hf_dir.str(), q8_dir, 8);
  ASSERT_TRUE(q4 && q8);
  EXPECT_EQ(q4->layers[0].moe.expert_gate[0].bits, 4);
  EXPECT_EQ(q8->layers[0].moe.expert_gate[0].bits, 8);

  const int T = 16;
  const int64_t V = hf->config.vocab_size;
  const auto tokens = test_tokens(T, static_cast<int32_t>(V));
  const auto lh = prefill_logits(hf, tokens), l4 = prefill_logits(q4, tokens), l8 = prefill_logits(q8, tokens);
  std::vector<std::vector<float>> storage;
  const auto l4_dense = prefill_logits(dense_twin(*q4, storage), tokens);

  const LogitsDiff exact = compare_logits(l4_dense, l4, T, V);
  const double tol = 1e-4 * stddev(l4_dense);
  std::printf("[quantized] 4-bit engine vs dense F32 twin: max |dlogit| %.3g (tolerance %.3g)\n", exact.max_abs, tol);
  EXPECT_LE(exact.max_abs, tol);

  const LogitsDiff d4 = compare_logits(lh, l4, T, V), d8 = compare_logits(lh, l8, T, V);
  std::printf("[quantized] vs bf16, %d tokens: 4-bit relative L2 %.4f top-1 %d/%d; 8-bit relative L2 %.4f top-1 "
              "%d/%d; positions differ by %.4f\n", T, d4.rel_l2, d4.top1_agree, T, d8.rel_l2, d8.top1_agree, T,
              d4.between);
  EXPECT_LT(d4.rel_l2, 0.75) << "4-bit: beyond quantization noise";
  EXPECT_LT(d4.rel_l2, 0.5 * d4.between) << "4-bit noise must stay below the signal";
  EXPECT_LT(d8.rel_l2, 0.1);
  EXPECT_GE(d8.top1_agree, T * 3 / 4);
}

}  // namespace
}  // namespace lily
