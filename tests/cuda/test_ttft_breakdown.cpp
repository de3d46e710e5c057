// Per-request costs of the CUDA backend, and the storage behind them. Skipped without a GPU.
//  - CudaSequenceStorage (small synthetic model): checkpoint -> advance -> restore gives bit-identical logits
//    (the recurrent region copied as one block), a clone and a checkpoint restored into the clone continue as the
//    original; forward_with_checkpoint against forward + checkpoint + forward;
//  - TtftBreakdown.FullModel (synthetic full geometry, 32K capacity): first the anchor checkpoint taken inside one
//    1,025-row prefill against the one taken between two forwards, then a table of wall times
//    (cudaDeviceSynchronize around each step) for every step of a request as Engine::generate runs it, and last
//    the engine's TTFT (GenerationResult) for a 1,026-token prompt. The engine part needs a tokenizer.json:
//    $LILY_TOKENIZER_DIR, else tests/fixtures/qwen3-tokenizer; without one it prints a note and skips only that part.
// Timings assert nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_bench.h"
#include "cuda/cuda_sequence.h"
#include "cuda/kernels/cuda_test_util.h"
#include "engine/engine.h"
#include "model/synth.h"

namespace lily {
namespace {

using Clock = std::chrono::steady_clock;

std::shared_ptr<const ModelWeights> synth_model(const std::string& preset) {
  auto w = synth_in_memory(preset, CheckpointLayout::mlx, preset == "full" ? 0 : 7);
  EXPECT_TRUE(w.ok()) << w.status().message();
  return w.ok() ? std::make_shared<const ModelWeights>(std::move(*w)) : nullptr;
}

std::vector<int32_t> random_tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, 150999);  // below the Qwen3 special tokens (<|im_start|> is 151644)
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = d(rng);
  return t;
}

std::span<const int32_t> part(const std::vector<int32_t>& t, size_t from, size_t n) {
  return std::span<const int32_t>(t.data() + from, n);
}

// Relative L2 error of b against a, and the rows ([*, V]) whose argmax agrees.
struct Diff {
  double rel = 0;
  int top1 = 0, rows = 0;
};
Diff diff(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  Diff d;
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(a[i]) * a[i];
  }
  d.rel = std::sqrt(num / std::max(den, 1e-30));
  d.rows = static_cast<int>(std::min(a.size(), b.size()) / V);
  for (int r = 0; r < d.rows; ++r) {
    auto ra = a.begin() + r * V, rb = b.begin() + r * V;
    d.top1 += (std::max_element(ra, ra + V) - ra) == (std::max_element(rb, rb + V) - rb);
  }
  return d;
}

// The same logits up to 4 ULP per value (gtest's FLOAT_EQ, as the end-to-end checkpoint test), with the count
// of bit-identical values printed: restoring must reproduce the run exactly; 4 ULP leaves room for a
// reduction whose order is not fixed.
void expect_same(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  size_t identical = 0, off = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    identical += a[i] == b[i];
    off += !::testing::internal::FloatingPoint<float>(a[i]).AlmostEquals(
        ::testing::internal::FloatingPoint<float>(b[i]));
  }
  std::printf("%s: %zu of %zu values bit-identical, %zu beyond 4 ULP\n", what, identical, a.size(), off);
  EXPECT_EQ(off, 0u) << what;
}

Result<std::unique_ptr<cuda::CudaBench>> backend(std::shared_ptr<const ModelWeights> w, int64_t ctx) {
  cuda::CudaBackendOptions o;
  o.max_context = ctx;
  return cuda::make_cuda_bench(std::move(w), o);
}

std::vector<int32_t> generate(Backend& b, SequenceState& s, int32_t first, const DeviceSampling& sp, int n) {
  std::vector<int32_t> out;
  Status st = b.generate_on_device(s, first, sp, n, [&](int32_t t) { return out.push_back(t), true; });
  EXPECT_TRUE(st.ok()) << st.message();
  return out;
}

// ---- correctness of the storage layout and the anchor checkpoint (small model) ----------------------------

TEST(CudaSequenceStorage, CheckpointAdvanceRestoreCloneSameLogits) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("small");
  auto made = backend(w, 2048);
  ASSERT_TRUE(made.ok()) << made.status().message();
  Backend& b = **made;
  const auto tokens = random_tokens(80, 31);
  auto seq = b.new_sequence();
  ASSERT_TRUE(seq);
  ASSERT_TRUE(b.forward(*seq, part(tokens, 0, 37), LogitsRows::none, nullptr).ok());
  auto cp = seq->checkpoint();
  ASSERT_TRUE(cp);
  EXPECT_EQ(cp->n_tokens(), 37);
  auto fork = seq->clone();
  ASSERT_TRUE(fork);
  EXPECT_EQ(fork->n_tokens(), 37);
  EXPECT_EQ(fork->bytes(), seq->bytes());

  std::vector<float> first, again, forked, restored_fork, step1, step2;
  ASSERT_TRUE(b.forward(*seq, part(tokens, 37, 20), LogitsRows::all, &first).ok());  // prefill path
  ASSERT_TRUE(b.forward(*seq, part(tokens, 57, 1), LogitsRows::last, &step1).ok());  // and a decode step
  ASSERT_TRUE(seq->restore(*cp).ok());
  EXPECT_EQ(seq->n_tokens(), 37);
  ASSERT_TRUE(b.forward(*seq, part(tokens, 37, 20), LogitsRows::all, &again).ok());
  ASSERT_TRUE(b.forward(*seq, part(tokens, 57, 1), LogitsRows::last, &step2).ok());
  expect_same(first, again, "restore, 20 tokens through the prefill path");
  expect_same(step1, step2, "restore, then a decode step");

  ASSERT_TRUE(b.forward(*fork, part(tokens, 37, 20), LogitsRows::all, &forked).ok());
  expect_same(first, forked, "the clone");
  ASSERT_TRUE(fork->restore(*cp).ok());  // a checkpoint of the original restored into its clone (a fork)
  ASSERT_TRUE(b.forward(*fork, part(tokens, 37, 20), LogitsRows::all, &restored_fork).ok());
  expect_same(first, restored_fork, "the original's checkpoint restored into the clone");

  // A checkpoint past the end and one from another geometry are refused.
  auto early = b.new_sequence();
  EXPECT_FALSE(early->restore(*cp).ok());
  auto other = backend(synth_model("tiny"), 2048);
  ASSERT_TRUE(other.ok());
  auto tiny_seq = (*other)->new_sequence();
  ASSERT_TRUE((*other)->forward(*tiny_seq, part(tokens, 0, 40), LogitsRows::none, nullptr).ok());
  EXPECT_FALSE(tiny_seq->restore(*cp).ok());
}

// forward_with_checkpoint against forward + checkpoint + forward, with the split inside a chunk, on a chunk
// boundary and inside a later chunk (chunk 64): the same final logits (the GEMMs see other row counts, so
// within the prefill's own tolerance, not bit for bit) and checkpoints that continue alike.
TEST(CudaSequenceStorage, ForwardWithCheckpointMatchesThreeCalls) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("small");
  cuda::CudaBackendOptions o;
  o.max_context = 2048;
  o.prefill_chunk = 64;
  auto made = cuda::make_cuda_backend(w, o);
  ASSERT_TRUE(made.ok());
  Backend& b = **made;
  const int64_t V = w->config.vocab_size;
  const auto tokens = random_tokens(160, 61);
  // From an empty sequence and after a 37-token prefix (the engine resumes mid-ring: pos0 % 4 != 0); splits
  // shorter than the conv kernel, inside a chunk, on the chunk boundary (64 rows into the call) and in the
  // second chunk.
  for (int prefix : {0, 37}) {
    for (int split : {2, 30, 64, 80, 99}) {
      std::vector<float> ref, got, ref_next, got_next;
      auto a = b.new_sequence(), c = b.new_sequence();
      if (prefix > 0) {
        ASSERT_TRUE(b.forward(*a, part(tokens, 0, prefix), LogitsRows::none, nullptr).ok());
        ASSERT_TRUE(b.forward(*c, part(tokens, 0, prefix), LogitsRows::none, nullptr).ok());
      }
      ASSERT_TRUE(b.forward(*a, part(tokens, prefix, split), LogitsRows::none, nullptr).ok());
      auto cp_ref = a->checkpoint();
      ASSERT_TRUE(cp_ref);
      ASSERT_TRUE(b.forward(*a, part(tokens, prefix + split, 100 - split), LogitsRows::last, &ref).ok());
      auto cp = b.forward_with_checkpoint(*c, part(tokens, prefix, 100), split, LogitsRows::last, &got);
      ASSERT_TRUE(cp.ok()) << cp.status().message();
      ASSERT_TRUE(*cp) << "no checkpoint (out of device memory?)";
      EXPECT_EQ((*cp)->n_tokens(), prefix + split);
      EXPECT_EQ(c->n_tokens(), prefix + 100);
      const Diff end = diff(ref, got, V);
      // Both checkpoints continue with the same 20 tokens.
      ASSERT_TRUE(a->restore(*cp_ref).ok());
      ASSERT_TRUE(c->restore(**cp).ok());
      ASSERT_TRUE(b.forward(*a, part(tokens, prefix + split, 20), LogitsRows::all, &ref_next).ok());
      ASSERT_TRUE(b.forward(*c, part(tokens, prefix + split, 20), LogitsRows::all, &got_next).ok());
      const Diff next = diff(ref_next, got_next, V);
      std::printf(
          "[small, chunk 64] prefix %d, split %d of 100: last logits rel. error %.3g (top-1 %d/%d), after "
          "restoring the checkpoint %.3g (top-1 %d/%d)\n",
          prefix, split, end.rel, end.top1, end.rows, next.rel, next.top1, next.rows);
      EXPECT_LE(end.rel, 2e-2);
      EXPECT_LE(next.rel, 2e-2);
      if (split == 64) {  // a chunk boundary: both routes run the very same kernels
        EXPECT_EQ(end.rel, 0.0) << "prefix " << prefix;
        EXPECT_EQ(next.rel, 0.0) << "prefix " << prefix;
      }
    }
  }
  {  // LogitsRows::all: the rows after the split only (engine/backend.h)
    auto d = b.new_sequence();
    std::vector<float> all;
    auto cp = b.forward_with_checkpoint(*d, part(tokens, 0, 100), 30, LogitsRows::all, &all);
    ASSERT_TRUE(cp.ok()) << cp.status().message();
    EXPECT_EQ(all.size(), static_cast<size_t>(70 * V));
  }
  auto s = b.new_sequence();
  EXPECT_FALSE(b.forward_with_checkpoint(*s, part(tokens, 0, 10), 10, LogitsRows::none, nullptr).ok());
  EXPECT_FALSE(b.forward_with_checkpoint(*s, part(tokens, 0, 10), 0, LogitsRows::none, nullptr).ok());
}

// ---- the per-request breakdown (full geometry)
// ---------------------------------------------------------------

double sync_ms(const std::function<void()>& f) {
  cudaDeviceSynchronize();
  const auto t0 = Clock::now();
  f();
  cudaDeviceSynchronize();
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

std::optional<Tokenizer> find_tokenizer() {
  std::vector<std::filesystem::path> dirs;
  if (const char* env = std::getenv("LILY_TOKENIZER_DIR")) dirs.emplace_back(env);
  dirs.emplace_back(LILY_FIXTURES_DIR "/qwen3-tokenizer");
  dirs.emplace_back("tests/fixtures/qwen3-tokenizer");  // run from the repository root with the binary carried
  for (const auto& d : dirs) {
    std::error_code ec;
    if (!std::filesystem::exists(d / "tokenizer.json", ec)) continue;
    auto t = Tokenizer::load((d / "tokenizer.json").string());
    if (t.ok()) {
      std::printf("tokenizer: %s\n", d.c_str());
      return std::move(*t);
    }
  }
  return std::nullopt;
}

// A 1,026-token chat prompt as the engine splits it: forward [0, 1019) (up to the last <|im_start|>),
// checkpoint, forward [1019, 1025), checkpoint, then the device decode loop starts from token 1025.
constexpr int kAnchor = 1019, kTail = 6, kPrompt = kAnchor + kTail + 1;

struct Row {
  std::string what;
  std::vector<double> ms;  // [0]: the first request of the process, then the repetitions
};

void print_rows(const std::vector<Row>& rows) {
  std::printf("\n%-62s %10s %10s\n", "step (wall, cudaDeviceSynchronize around it)", "first ms", "median ms");
  for (const Row& r : rows)
    std::printf("%-62s %10.3f %10.3f\n", r.what.c_str(), r.ms.empty() ? 0.0 : r.ms[0],
                median(std::vector<double>(r.ms.begin() + (r.ms.size() > 1), r.ms.end())));
}

// 3. The engine's TTFT (GenerationResult) for a 1,026-token chat-shaped prompt, a fresh conversation each
// time as bench/ttft.py sends. The engine takes the backend.
void engine_ttft(std::unique_ptr<cuda::CudaBench> owned, const Tokenizer& tok) {
  const int32_t im_start = tok.token_id("<|im_start|>");
  ASSERT_GE(im_start, 0);
  EngineOptions eo;
  eo.max_context = 32768;  // the default 8 GB session cache: no eviction within these requests
  Engine engine(std::move(owned), tok, eo);
  std::printf("\n%-50s %11s %10s %11s\n", "engine, 1,026-token prompt, greedy", "first TTFT", "median",
              "prefill_ms");
  std::vector<double> ttft, prefill;
  for (int rep = 0; rep < 6; ++rep) {
    GenerationRequest r;
    r.prompt = random_tokens(kPrompt, 200 + rep);
    r.prompt[kAnchor] = im_start;
    r.sampling.temperature = 0;
    r.sampling.max_tokens = 2;
    auto res = engine.generate(r, [](const GenerationPiece&) { return true; });
    ASSERT_TRUE(res.ok()) << res.status().message();
    ttft.push_back(res->time_to_first_token_ms);
    prefill.push_back(res->prefill_ms);
  }
  std::printf("%-50s %11.2f %10.2f %11.2f\n", "fresh conversation", ttft[0],
              median(std::vector<double>(ttft.begin() + 1, ttft.end())),
              median(std::vector<double>(prefill.begin() + 1, prefill.end())));
}

TEST(TtftBreakdown, FullModel) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("full");
  ASSERT_TRUE(w);
  const int64_t V = w->config.vocab_size;
  auto made = backend(w, 32768);  // `lily serve`'s KV capacity by default
  ASSERT_TRUE(made.ok()) << made.status().message();
  cuda::CudaBench& b = **made;
  const DeviceSampling greedy{};

  // 1. Correctness first: the anchor checkpoint taken inside one 1,025-row prefill, against the one taken
  // between two forwards.
  const auto prompt = random_tokens(kPrompt, 7);
  {
    auto s = b.new_sequence();
    ASSERT_TRUE(s);
    ASSERT_TRUE(b.forward(*s, part(prompt, 0, kAnchor), LogitsRows::none, nullptr).ok());
    auto cp = s->checkpoint();
    ASSERT_TRUE(cp);
    auto s2 = b.new_sequence();
    auto cp2 =
        b.forward_with_checkpoint(*s2, part(prompt, 0, kAnchor + kTail), kAnchor, LogitsRows::none, nullptr);
    ASSERT_TRUE(cp2.ok()) << cp2.status().message();
    ASSERT_TRUE(*cp2);
    EXPECT_EQ((*cp2)->n_tokens(), kAnchor);
    std::vector<float> after_ref, after_split;
    ASSERT_TRUE(s2->restore(**cp2).ok());
    ASSERT_TRUE(b.forward(*s, part(prompt, kAnchor, kTail), LogitsRows::all, &after_ref).ok());
    ASSERT_TRUE(b.forward(*s2, part(prompt, kAnchor, kTail), LogitsRows::all, &after_split).ok());
    const Diff dc = diff(after_ref, after_split, V);
    std::printf(
        "[full] checkpoint at %d inside one %d-row prefill vs between two forwards: the next %d tokens' "
        "logits rel. error %.3g, top-1 %d/%d\n",
        kAnchor, kAnchor + kTail, kTail, dc.rel, dc.top1, dc.rows);
    EXPECT_LE(dc.rel, 2e-2);
  }

  // 2. Every step of one request as Engine::generate runs it (reuse_cache: checkpoints at the anchor and at
  // `to`); the first repetition is the process's first request (scratch allocations, cold caches), then 3 more.
  std::vector<Row> rows = {{"new_sequence (one cudaMalloc + memset, 32K KV)", {}},
                           {"forward 1019 tokens (prefill)", {}},
                           {"checkpoint at 1019 (recurrent region copy)", {}},
                           {"forward 6 tokens (prefill path)", {}},
                           {"checkpoint at 1025", {}},
                           {"generate_on_device 1 token, first (greedy graph capture)", {}},
                           {"restore to 1025", {}},
                           {"generate_on_device 1 token, again (replay)", {}},
                           {"destroy the sequence (cudaFree) + its checkpoints", {}},
                           {"forward_with_checkpoint 1025 rows, split 1019 (fresh seq)", {}}};
  for (int rep = 0; rep < 4; ++rep) {
    const auto p = random_tokens(kPrompt, 100 + rep);
    std::unique_ptr<SequenceState> s;
    std::unique_ptr<Checkpoint> cp_anchor, cp_to;
    int i = 0;
    rows[i++].ms.push_back(sync_ms([&] { s = b.new_sequence(); }));
    ASSERT_TRUE(s);
    rows[i++].ms.push_back(
        sync_ms([&] { EXPECT_TRUE(b.forward(*s, part(p, 0, kAnchor), LogitsRows::none, nullptr).ok()); }));
    rows[i++].ms.push_back(sync_ms([&] { cp_anchor = s->checkpoint(); }));
    rows[i++].ms.push_back(sync_ms(
        [&] { EXPECT_TRUE(b.forward(*s, part(p, kAnchor, kTail), LogitsRows::none, nullptr).ok()); }));
    rows[i++].ms.push_back(sync_ms([&] { cp_to = s->checkpoint(); }));
    ASSERT_TRUE(cp_anchor && cp_to);
    rows[i++].ms.push_back(sync_ms([&] { generate(b, *s, p.back(), greedy, 1); }));
    rows[i++].ms.push_back(sync_ms([&] { EXPECT_TRUE(s->restore(*cp_to).ok()); }));
    rows[i++].ms.push_back(sync_ms([&] { generate(b, *s, p.back(), greedy, 1); }));
    rows[i++].ms.push_back(sync_ms([&] { s.reset(), cp_anchor.reset(), cp_to.reset(); }));
    s = b.new_sequence();
    ASSERT_TRUE(s);
    rows[i++].ms.push_back(sync_ms([&] {
      auto cp =
          b.forward_with_checkpoint(*s, part(p, 0, kAnchor + kTail), kAnchor, LogitsRows::none, nullptr);
      EXPECT_TRUE(cp.ok()) << cp.status().message();
    }));
    s.reset();
  }
  print_rows(rows);
  auto med = [&](int r) { return median(std::vector<double>(rows[r].ms.begin() + 1, rows[r].ms.end())); };
  const double today = med(0) + med(1) + med(2) + med(3) + med(4) + med(5);
  std::printf("sum of the steps a request takes: %.2f ms, of which beyond the 1019-token prefill: %.2f ms\n", today,
              today - med(1));
  std::printf("  with forward_with_checkpoint (one prefill of 1025 rows, anchor checkpoint inside): %.2f ms\n",
              today - med(1) - med(2) - med(3) + med(9));
  const cuda::GraphCaptureStats gs = b.graph_capture_stats();
  std::printf("graph captures: %d, %.3f ms capture + %.3f ms instantiate each\n", gs.captures,
              gs.capture_ms / std::max(gs.captures, 1), gs.instantiate_ms / std::max(gs.captures, 1));

  std::optional<Tokenizer> tok = find_tokenizer();
  if (!tok) {
    std::printf(
        "\nengine TTFT: skipped, no tokenizer.json (set LILY_TOKENIZER_DIR to a directory holding one)\n");
    return;
  }
  engine_ttft(std::move(*made), *tok);
}

}  // namespace
}  // namespace lily
