// End to end: the CUDA backend against the CPU reference. Skipped without a GPU.
//  - greedy tokens identical for 64 steps on the tiny and small synthetic models;
//  - full width, 4 layers (3 Gated DeltaNet + 1 attention, 256 experts, full vocabulary), teacher-forced over 256
//    positions: top-1 agreement >= 99% and relative logit error <= 2e-2;
//  - checkpoint/restore and device sampling reproducibility; a saved sequence and checkpoint (the disk tier's
//    SequenceState::save / Backend::load_sequence) continue bit-identically, through a session file too, and with
//    the MTP head on draft as the original (a backend without the head reads past its part);
//  - the prefill path: chunked prompts against the CPU reference and against the token-by-token decode path,
//    decode after a chunked prefill equal to decode after a single prefill, a prompt longer than a chunk;
//  - several-row steps (forward_batch, decode_batch_on_device) equal to each row's one-row step, to the bit;
//  - the MTP head's arithmetic on the prefill kernels against the CPU reference's;
//  - speculative verification (forward_verify, accept_verified) equal to plain one-token forwards, to the bit;
//  - the MTP head's draft (enable_mtp, mtp_draft) against the CPU backend's after the same calls, greedy
//    speculative decoding (K = 1, 3) token for token the plain loop's, the head's state through checkpoints;
//  - the decode megakernel (--cuda-options megakernel=1) on full4: teacher-forced through its steps, logits
//    identical across runs, the device loop after it, other geometries refused;
//  - the kernel paths chosen at start (by the device code in the binary) and the context that fits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <cuda_runtime.h>
#include <random>

#include "cpu/blocks.h"
#include "cpu/cpu_backend.h"
#include "cpu/ops.h"
#include "cuda/cuda_bench.h"
#include "engine/sampler.h"
#include "engine/session_file.h"
#include "engine/speculative.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/trace.cuh"
#include "cuda/megakernel/step.cuh"
#include "model/synth.h"

namespace lily {
namespace {

bool has_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device"

std::shared_ptr<const ModelWeights> synth_model(const std::string& preset) {
  auto w = synth_in_memory(preset, CheckpointLayout::mlx, 7);
  EXPECT_TRUE(w.ok()) << w.status().message();
  return std::make_shared<const ModelWeights>(std::move(*w));
}

std::vector<int32_t> random_tokens(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, std::min(vocab, 151000) - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(rng);
  return t;
}

int32_t argmax(const float* p, int64_t n) { return static_cast<int32_t>(std::max_element(p, p + n) - p); }

struct Agreement {
  double top1 = 0, rel = 0;
};

// Top-1 agreement and relative L2 logit error of `got` against `ref` ([T, V] each).
Agreement compare_logits(const std::vector<float>& ref, const std::vector<float>& got, int64_t V) {
  EXPECT_EQ(ref.size(), got.size());
  const int64_t T = static_cast<int64_t>(std::min(ref.size(), got.size())) / V;
  int agree = 0;
  double num = 0, den = 0;
  for (int64_t t = 0; t < T; ++t) {
    agree += argmax(&ref[t * V], V) == argmax(&got[t * V], V);
    for (int64_t i = 0; i < V; ++i) {
      const double d = got[t * V + i] - ref[t * V + i];
      num += d * d;
      den += static_cast<double>(ref[t * V + i]) * ref[t * V + i];
    }
  }
  return {static_cast<double>(agree) / std::max<int64_t>(T, 1), std::sqrt(num / den)};
}

// A forward of `tokens` with every row's logits on a fresh sequence of `b`, against `ref` by the end-to-end bar
// (top-1 agreement >= 99%, relative logit error <= 2e-2); prints "what: ...".
void expect_teacher_forced(Backend& b, const std::vector<int32_t>& tokens, const std::vector<float>& ref, int64_t V,
                           const std::string& what) {
  std::vector<float> got;
  auto seq = b.new_sequence();
  ASSERT_TRUE(b.forward(*seq, tokens, LogitsRows::all, &got).ok()) << what;
  const Agreement a = compare_logits(ref, got, V);
  std::printf("%s: top-1 agreement %.2f%%, relative logit error %.3g\n", what.c_str(), 100 * a.top1, a.rel);
  EXPECT_GE(a.top1, 0.99) << what;
  EXPECT_LE(a.rel, 2e-2) << what;
}

std::vector<int32_t> greedy(Backend& b, const std::vector<int32_t>& prompt, int steps) {
  auto seq = b.new_sequence();
  std::vector<float> logits;
  EXPECT_TRUE(b.forward(*seq, prompt, LogitsRows::last, &logits).ok());
  std::vector<int32_t> out;
  for (int i = 0; i < steps; ++i) {
    int32_t next = argmax(logits.data(), static_cast<int64_t>(logits.size()));
    out.push_back(next);
    EXPECT_TRUE(b.forward(*seq, std::span<const int32_t>(&next, 1), LogitsRows::last, &logits).ok());
  }
  return out;
}

void expect_same_greedy(const std::string& preset, const cuda::CudaBackendOptions& options = {4096}) {
  auto w = synth_model(preset);
  CpuBackend cpu(w);
  auto cuda = cuda::make_cuda_backend(w, options);
  ASSERT_TRUE(cuda.ok()) << cuda.status().message();
  auto prompt = random_tokens(16, w->config.vocab_size, 11);
  auto a = greedy(cpu, prompt, 64), b = greedy(**cuda, prompt, 64);
  int first_diff = -1;
  for (size_t i = 0; i < a.size() && first_diff < 0; ++i)
    if (a[i] != b[i]) first_diff = static_cast<int>(i);
  std::printf("[%s] greedy 64 steps: first difference at %d (-1 = none)\n", preset.c_str(), first_diff);
  EXPECT_EQ(a, b);
}

TEST(CudaBackend, GreedyMatchesCpuTiny) {
  SKIP_WITHOUT_GPU();
  expect_same_greedy("tiny");
}

TEST(CudaBackend, GreedyMatchesCpuSmall) {
  SKIP_WITHOUT_GPU();
  expect_same_greedy("small");
}

// full4, 256 random tokens and the CPU reference's logits at every position (the end-to-end bar's reference).
struct Full4Reference {
  std::shared_ptr<const ModelWeights> w;
  int64_t V = 0;
  std::vector<int32_t> tokens;
  std::vector<float> ref;
};
Full4Reference full4_reference() {
  Full4Reference r;
  r.w = synth_model("full4");
  r.V = r.w->config.vocab_size;
  r.tokens = random_tokens(256, static_cast<int>(r.V), 5);
  CpuBackend cpu(r.w);
  auto s = cpu.new_sequence();
  EXPECT_TRUE(cpu.forward(*s, r.tokens, LogitsRows::all, &r.ref).ok());
  return r;
}

TEST(CudaBackend, TeacherForcedFullWidthFourLayers) {
  SKIP_WITHOUT_GPU();
  const Full4Reference r = full4_reference();
  const auto& [w, V, tokens, ref] = r;
  const int T = static_cast<int>(tokens.size());
  auto cuda = cuda::make_cuda_backend(w, {1024});
  ASSERT_TRUE(cuda.ok()) << cuda.status().message();
  expect_teacher_forced(**cuda, tokens, ref, V, format("[full4] teacher-forced %d positions (prefill)", T));
  // The same positions through the decode step, one token at a time.
  auto step = cuda::make_cuda_backend(w, {1024, 0});
  ASSERT_TRUE(step.ok()) << step.status().message();
  expect_teacher_forced(**step, tokens, ref, V, format("[full4] teacher-forced %d positions (decode steps)", T));
}

// The decode megakernel (--cuda-options megakernel=1) on full4: every position through
// its step, teacher-forced against the CPU reference by the end-to-end bar; the logits of two runs identical to the
// bit; the device loop (the sample kernel after the megakernel, greedy and seeded) equal to the host's argmax of
// the step's logits and reproducible; a model of another geometry refused at start with the reason.
TEST(CudaBackend, MegakernelDecodeMatchesCpuFull) {
  SKIP_WITHOUT_GPU();
  if (!cuda::mk::step_supported()) GTEST_SKIP() << "the megakernel needs an sm_90a build on a Hopper GPU";
  const Full4Reference r = full4_reference();
  const auto& [w, V, tokens, ref] = r;
  const int T = static_cast<int>(tokens.size());
  cuda::CudaBackendOptions step_opts{1024, 0};
  step_opts.megakernel = 1;
  auto step = cuda::make_cuda_bench(w, step_opts);
  ASSERT_TRUE(step.ok()) << step.status().message();
  EXPECT_NE((*step)->kernel_paths().find("decode: megakernel"), std::string::npos) << (*step)->kernel_paths();
  const std::string what = format("[full4] teacher-forced %d positions (megakernel=1 decode steps)", T);
  expect_teacher_forced(**step, tokens, ref, V, what);
  auto logits_of = [&](Backend& b) {
    std::vector<float> l;
    auto seq = b.new_sequence();
    EXPECT_TRUE(b.forward(*seq, std::span<const int32_t>(tokens.data(), 40), LogitsRows::all, &l).ok());
    return l;
  };
  const std::vector<float> a = logits_of(**step), b = logits_of(**step);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  // Prefill on the prefill kernels, then the device loop on the megakernel's steps.
  cuda::CudaBackendOptions loop_opts{1024};
  loop_opts.megakernel = 1;
  auto loop = cuda::make_cuda_backend(w, loop_opts);
  ASSERT_TRUE(loop.ok()) << loop.status().message();
  auto run = [&](const DeviceSampling& sp) {
    auto seq = (*loop)->new_sequence();
    EXPECT_TRUE((*loop)->forward(*seq, std::span<const int32_t>(tokens.data(), 19), LogitsRows::none, nullptr).ok());
    std::vector<int32_t> out;
    EXPECT_TRUE((*loop)->generate_on_device(*seq, tokens[19], sp, 24, [&](int32_t t) {
      out.push_back(t);
      return true;
    }).ok());
    return out;
  };
  EXPECT_EQ(run({}), greedy(**loop, std::vector<int32_t>(tokens.begin(), tokens.begin() + 20), 24));
  const DeviceSampling hot{1.0f, 0, 1.0f, 0.0f, 42};
  EXPECT_EQ(run(hot), run(hot));
  cuda::CudaBackendOptions tiny_opts{1024};
  tiny_opts.megakernel = 1;
  auto tiny = cuda::make_cuda_backend(synth_model("tiny"), tiny_opts);
  ASSERT_FALSE(tiny.ok());
  EXPECT_EQ(tiny.status().code(), ErrorCode::unsupported);
  EXPECT_NE(tiny.status().message().find("megakernel=1: the decode megakernel runs Qwen3.6-35B-A3B's geometry"),
            std::string::npos)
      << tiny.status().message();
}

// The block timeline (trace_decode, kernels/trace.cuh) on full4: every op of every step is one launch, named in
// launch order, with the kernel kind that op launches; every block started before it waited and waited before it
// ended; each launch ends after its predecessor (PDL: its blocks wait for it). In a build without LILY_TRACE:
// refused with the reason.
TEST(CudaBackend, DecodeTraceTimeline) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("full4");
  cuda::CudaBackendOptions o;
  o.max_context = 1024, o.prefill_chunk = 0;
  auto b = cuda::make_cuda_bench(w, o);
  ASSERT_TRUE(b.ok()) << b.status().message();
  auto seq = (*b)->new_sequence();
  if (!cuda::trace::kEnabled) {  // the normal build: refused with the reason
    auto tr = (*b)->trace_decode(*seq, 1);
    ASSERT_FALSE(tr.ok());
    EXPECT_EQ(tr.status().code(), ErrorCode::unsupported);
    EXPECT_NE(tr.status().message().find("LILY_TRACE"), std::string::npos);
    GTEST_SKIP() << "built without LILY_TRACE";
  }
  const std::map<std::string, uint32_t> kind_of = {
      {"embed", 1}, {"gemv gdn_in", 2}, {"gdn_step", 3}, {"gemv gdn_out", 2}, {"moe_route", 4},
      {"moe_expert_in", 5}, {"moe_expert_out", 6}, {"gemv attn_in", 2}, {"attn_prep", 7}, {"attn_decode", 8},
      {"attn_combine", 9}, {"gemv attn_out", 2}, {"gemv lm_head", 2}, {"sample", 10}, {"advance", 11}};
  ASSERT_TRUE((*b)->set_context_for_bench(*seq, 300).ok());
  auto tr = (*b)->trace_decode(*seq, 3);
  ASSERT_TRUE(tr.ok()) << tr.status().message();
  int launches = 0, embeds = 0;
  const cuda::TraceLaunch* prev = nullptr;
  for (const auto& l : *tr) {
    EXPECT_GT(l.blocks, 0) << l.name;
    EXPECT_LE(l.start_first, l.end_last) << l.name;
    if (l.wait_first > 0) {
      EXPECT_LE(l.start_first, l.wait_first) << l.name;
      EXPECT_LE(l.wait_last, l.end_last) << l.name;
    }
    ++launches;
    embeds += l.name == "embed";
    auto k = kind_of.find(l.name);
    ASSERT_NE(k, kind_of.end()) << "unexpected op " << l.name;
    EXPECT_EQ(l.kind, k->second) << l.name;
    if (prev && l.name != "embed") {
      EXPECT_GE(l.end_last, prev->end_last) << l.name << " after " << prev->name;
    }
    prev = &l;
  }
  // full4: embed, 3 x (gdn_in, gdn_step, gdn_out, route, in, out), attention (in, prep, decode, combine, out,
  // route, in, out), lm_head, sample, advance.
  EXPECT_EQ(embeds, 3);
  EXPECT_EQ(launches, 3 * (1 + 3 * 6 + 8 + 3));
}

// The kernel paths (printed at start) follow the device code the runtime loaded for this GPU, not only its compute
// capability: wgmma only with sm_90a code on a compute 9.0 GPU, clusters and PDL only with sm_90 code. On an H200,
// a -DCMAKE_CUDA_ARCHITECTURES=80-virtual build reports "pre-sm_90 code, prefill: mma.sync".
TEST(CudaBackend, KernelPathsFollowTheDeviceCode) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("full4");
  auto b = cuda::make_cuda_bench(w, {1024});
  ASSERT_TRUE(b.ok()) << b.status().message();
  const std::string paths = (*b)->kernel_paths();
  std::printf("%s\n", paths.c_str());
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  const bool wgmma = prop.major == 9 && prop.minor == 0 && cuda::wgmma_built();
  EXPECT_NE(paths.find(wgmma ? "prefill: wgmma" : "prefill: mma.sync"), std::string::npos) << paths;
  EXPECT_NE(paths.find(cuda::sm90_code_built() ? "decode: PDL chain" : "decode: stream order"), std::string::npos)
      << paths;
  EXPECT_NE(paths.find(format("sm_%d%d", prop.major, prop.minor)), std::string::npos) << paths;
  // Greedy decode after a prefill on whatever paths were chosen (the 80-virtual build runs its own).
  expect_same_greedy("small");
}

// The context against the GPU's free memory: auto takes the largest that fits (at most the model's maximum) and
// the backend reports it.
TEST(CudaBackend, ContextAutoTakesWhatFits) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("tiny");
  auto autob = cuda::make_cuda_bench(w, {cuda::CudaBackendOptions::kContextAuto});
  ASSERT_TRUE(autob.ok()) << autob.status().message();
  EXPECT_GT((*autob)->max_context(), 0);
  EXPECT_LE((*autob)->max_context(), w->config.max_position_embeddings);
  auto full = synth_model("full4");
  auto fit = cuda::make_cuda_bench(full, {cuda::CudaBackendOptions::kContextAuto});
  ASSERT_TRUE(fit.ok()) << fit.status().message();
  std::printf("[full4] auto context: %lld tokens (model maximum %d)\n", (long long)(*fit)->max_context(),
              full->config.max_position_embeddings);
  EXPECT_GT((*fit)->max_context(), 4096);
}

// Prompts across chunk boundaries (chunk 64: 1, 63, 64, 65 and 200 tokens) against the CPU reference.
TEST(CudaBackend, ChunkedPrefillMatchesCpuSmall) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("small");
  CpuBackend cpu(w);
  auto cuda = cuda::make_cuda_backend(w, {1024, 64});
  ASSERT_TRUE(cuda.ok()) << cuda.status().message();
  const int64_t V = w->config.vocab_size;
  for (int T : {1, 63, 64, 65, 200}) {
    auto tokens = random_tokens(T, static_cast<int>(V), 100 + T);
    std::vector<float> ref;
    auto s1 = cpu.new_sequence();
    ASSERT_TRUE(cpu.forward(*s1, tokens, LogitsRows::all, &ref).ok());
    expect_teacher_forced(**cuda, tokens, ref, V, format("[small] prompt %d, chunk 64", T));
  }
}

// Decode after a chunked prefill equals decode after a single prefill (and after the token-by-token path).
TEST(CudaBackend, DecodeAfterChunkedPrefillEqualsSinglePrefill) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("small");
  auto one = cuda::make_cuda_backend(w, {2048, 4096});
  auto chunked = cuda::make_cuda_backend(w, {2048, 64});
  auto steps = cuda::make_cuda_backend(w, {2048, 0});
  ASSERT_TRUE(one.ok() && chunked.ok() && steps.ok());
  auto prompt = random_tokens(300, w->config.vocab_size, 21);
  const auto a = greedy(**one, prompt, 32), b = greedy(**chunked, prompt, 32), c = greedy(**steps, prompt, 32);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
}

// The experts' fp16 copies (CudaBackendOptions::expert_copies, Hopper) change no bit: a 2,000-token prompt on
// full4 (the copies' tiles from 1,280 rows) gives the same logits of every row with and without them, and the
// paths line says which ran.
TEST(CudaBackend, ExpertCopiesChangeNoLogit) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("full4");
  cuda::CudaBackendOptions with{4096, 4096}, without{4096, 4096};
  without.expert_copies = 0;
  auto a = cuda::make_cuda_bench(w, with), b = cuda::make_cuda_bench(w, without);
  ASSERT_TRUE(a.ok() && b.ok());
  const bool copies = (*a)->kernel_paths().find("fp16 expert copies") != std::string::npos;
  std::printf("expert copies %s: %s\n", copies ? "on" : "off (not a Hopper build / GPU)", (*a)->kernel_paths().c_str());
  EXPECT_EQ((*b)->kernel_paths().find("fp16 expert copies"), std::string::npos);
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  EXPECT_EQ(copies, prop.major == 9 && prop.minor == 0 && cuda::wgmma_built());
  const auto prompt = random_tokens(2000, w->config.vocab_size, 31);
  std::vector<float> la, lb;
  auto sa = (*a)->new_sequence(), sb = (*b)->new_sequence();
  ASSERT_TRUE((*a)->forward(*sa, prompt, LogitsRows::all, &la).ok());
  ASSERT_TRUE((*b)->forward(*sb, prompt, LogitsRows::all, &lb).ok());
  ASSERT_EQ(la.size(), lb.size());
  size_t differ = 0;
  for (size_t i = 0; i < la.size(); ++i) differ += la[i] != lb[i];
  EXPECT_EQ(differ, 0u) << "of " << la.size() << " logits";
}

// A prompt longer than one chunk (4097 rows: a full chunk and one row) on the tiny model against the CPU.
TEST(CudaBackend, PromptLongerThanAChunkTiny) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("tiny");
  CpuBackend cpu(w);
  auto cuda = cuda::make_cuda_bench(w, {8192, 4096});
  ASSERT_TRUE(cuda.ok()) << cuda.status().message();
  auto prompt = random_tokens(4097, w->config.vocab_size, 8);
  const auto a = greedy(cpu, prompt, 16), b = greedy(**cuda, prompt, 16);
  EXPECT_EQ(a, b);
  EXPECT_GT((*cuda)->prefill_scratch_bytes(), 0u);
}

TEST(CudaBackend, CheckpointRestoreAndDeviceSampling) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("tiny");
  auto cuda = cuda::make_cuda_backend(w, {2048});
  ASSERT_TRUE(cuda.ok());
  Backend& b = **cuda;
  auto prompt = random_tokens(20, w->config.vocab_size, 3);
  auto seq = b.new_sequence();
  std::vector<float> l1, l2;
  ASSERT_TRUE(b.forward(*seq, std::span<const int32_t>(prompt.data(), 10), LogitsRows::none, nullptr).ok());
  auto cp = seq->checkpoint();
  ASSERT_TRUE(b.forward(*seq, std::span<const int32_t>(prompt.data() + 10, 10), LogitsRows::all, &l1).ok());
  ASSERT_TRUE(seq->restore(*cp).ok());
  ASSERT_TRUE(b.forward(*seq, std::span<const int32_t>(prompt.data() + 10, 10), LogitsRows::all, &l2).ok());
  ASSERT_EQ(l1.size(), l2.size());
  for (size_t i = 0; i < l1.size(); ++i) ASSERT_FLOAT_EQ(l1[i], l2[i]) << i;

  // Device sampling: greedy on the device equals host argmax; a seed reproduces a sampled run.
  auto run = [&](DeviceSampling sp) {
    auto s = b.new_sequence();
    EXPECT_TRUE(b.forward(*s, std::span<const int32_t>(prompt.data(), 19), LogitsRows::none, nullptr).ok());
    std::vector<int32_t> out;
    EXPECT_TRUE(b.generate_on_device(*s, prompt[19], sp, 24, [&](int32_t t) { out.push_back(t); return true; }).ok());
    return out;
  };
  EXPECT_EQ(run({}), greedy(b, prompt, 24));
  DeviceSampling hot{1.0f, 0, 1.0f, 0.0f, 42};
  EXPECT_EQ(run(hot), run(hot));
  DeviceSampling topk{0.8f, 20, 0.9f, 0.0f, 42};
  EXPECT_EQ(run(topk), run(topk));
}

// Several-row steps (continuous batching): forward_batch and decode_batch_on_device give every row exactly what
// the one-row step gives it alone - logits to the bit, device-sampled tokens (greedy, temperature, top-k/top-p) -
// for rows at different contexts, n rows in one step (n <= 8) and more rows than one step takes (split).
void expect_rows_equal_alone(const std::string& preset, int n_rows) {
  auto w = synth_model(preset);
  auto made = cuda::make_cuda_backend(w, {4096});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Backend& b = **made;
  const int64_t V = w->config.vocab_size;
  const int kSteps = 6;
  std::vector<std::vector<int32_t>> prompts, inputs;  // per row: its prompt, then the tokens it is fed
  for (int r = 0; r < n_rows; ++r) {
    prompts.push_back(random_tokens(1 + 37 * r % 300, static_cast<int>(V), 100 + r));
    inputs.push_back(random_tokens(kSteps, static_cast<int>(V), 200 + r));
  }
  auto prefilled = [&](int r) {
    auto s = b.new_sequence();
    EXPECT_TRUE(b.forward(*s, prompts[r], LogitsRows::none, nullptr).ok());
    return s;
  };
  // Alone: one row at a time through forward (the one-row graph).
  std::vector<std::vector<float>> alone(n_rows);
  for (int r = 0; r < n_rows; ++r) {
    auto s = prefilled(r);
    std::vector<float> l;
    for (int t = 0; t < kSteps; ++t) {
      ASSERT_TRUE(b.forward(*s, std::span<const int32_t>(&inputs[r][t], 1), LogitsRows::last, &l).ok());
      alone[r].insert(alone[r].end(), l.begin(), l.end());
    }
  }
  // Together: every step one forward_batch of all rows.
  std::vector<std::unique_ptr<SequenceState>> seqs;
  std::vector<SequenceState*> ptrs;
  for (int r = 0; r < n_rows; ++r) seqs.push_back(prefilled(r)), ptrs.push_back(seqs.back().get());
  size_t differing = 0;
  for (int t = 0; t < kSteps; ++t) {
    std::vector<int32_t> tokens;
    for (int r = 0; r < n_rows; ++r) tokens.push_back(inputs[r][t]);
    std::vector<float> l;
    Status st = b.forward_batch(ptrs, tokens, &l);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_EQ(l.size(), static_cast<size_t>(n_rows * V));
    for (int r = 0; r < n_rows; ++r)
      differing += std::memcmp(&l[r * V], &alone[r][t * V], V * sizeof(float)) != 0;
  }
  std::printf("[%s] %d rows x %d steps: %zu row-steps differ from the row alone\n", preset.c_str(), n_rows, kSteps,
              differing);
  EXPECT_EQ(differing, 0u);
  for (int r = 0; r < n_rows; ++r) EXPECT_EQ(seqs[r]->n_tokens(), static_cast<int64_t>(prompts[r].size() + kSteps));

  // Device sampling: rows of three modes, each against generate_on_device alone.
  const DeviceSampling modes[] = {{}, {1.0f, 0, 1.0f, 0.0f, 42}, {0.8f, 20, 0.9f, 0.0f, 7}};
  std::vector<std::vector<int32_t>> alone_tokens(n_rows), together(n_rows);
  for (int r = 0; r < n_rows; ++r) {
    auto s = prefilled(r);
    EXPECT_TRUE(b.generate_on_device(*s, inputs[r][0], modes[r % 3], kSteps, [&](int32_t id) {
      alone_tokens[r].push_back(id);
      return true;
    }).ok());
  }
  seqs.clear(), ptrs.clear();
  for (int r = 0; r < n_rows; ++r) seqs.push_back(prefilled(r)), ptrs.push_back(seqs.back().get());
  std::vector<int32_t> tokens;
  std::vector<DeviceSampling> sampling;
  for (int r = 0; r < n_rows; ++r) tokens.push_back(inputs[r][0]), sampling.push_back(modes[r % 3]);
  for (int t = 0; t < kSteps; ++t) {
    std::vector<int32_t> next;
    Status st = b.decode_batch_on_device(ptrs, tokens, sampling, &next);
    ASSERT_TRUE(st.ok()) << st.message();
    for (int r = 0; r < n_rows; ++r) together[r].push_back(next[r]);
    tokens = next;
  }
  for (int r = 0; r < n_rows; ++r) EXPECT_EQ(together[r], alone_tokens[r]) << "row " << r;

  // Refusals before any row runs: a sequence twice, a token outside the vocabulary.
  std::vector<SequenceState*> twice = {ptrs[0], ptrs[0]};
  std::vector<int32_t> two = {1, 2};
  std::vector<float> l;
  EXPECT_FALSE(b.forward_batch(twice, two, &l).ok());
  std::vector<SequenceState*> pair = {ptrs[0], ptrs[1]};
  std::vector<int32_t> bad = {1, static_cast<int32_t>(V)};
  const int64_t before = ptrs[0]->n_tokens();
  EXPECT_FALSE(b.forward_batch(pair, bad, &l).ok());
  EXPECT_EQ(ptrs[0]->n_tokens(), before);
}

TEST(CudaBackend, SeveralRowStepsEqualOneRowStepsFull) {
  SKIP_WITHOUT_GPU();
  expect_rows_equal_alone("full4", 5);
  expect_rows_equal_alone("full4", 8);
  expect_rows_equal_alone("full4", 11);
}

TEST(CudaBackend, SeveralRowStepsEqualOneRowStepsTiny) {
  SKIP_WITHOUT_GPU();
  expect_rows_equal_alone("tiny", 3);
}

// The MTP head (eq 26) on the CUDA prefill kernels against the CPU reference's arithmetic (cpu_backend.cpp
// mtp_run over a fresh head KV): R rows of tokens and random final-norm hidden rows; the head's normalised output
// rows and the last row's logits within the prefill path's bound (fp16 GEMM operands).
void expect_mtp_head_matches_cpu(const std::string& preset, int R) {
  auto w = synth_model(preset);
  ASSERT_TRUE(w->mtp.has_value()) << preset << " has no MTP head";
  auto made = cuda::make_cuda_bench(w, {4096});
  ASSERT_TRUE(made.ok()) << made.status().message();
  const ModelConfig& c = w->config;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const std::vector<int32_t> tokens = random_tokens(R, static_cast<int>(V), 500 + R);
  std::vector<float> hidden(static_cast<size_t>(R * H));
  std::mt19937 rng(600 + R);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& x : hidden) x = nd(rng);
  std::vector<float> logits, out;
  Status st = (*made)->mtp_head_for_test(tokens, hidden, &logits, &out);
  ASSERT_TRUE(st.ok()) << st.message();
  // The CPU reference: mtp_run's steps.
  const MtpWeights& m = *w->mtp;
  ThreadPool pool(2);
  const cpu::TraceFn no_trace;
  std::vector<float> e(R * H), cat(R * 2 * H), h(R * H), x(R * H), y(R * H), ref_out(R * H), ref_logits(V);
  cpu::embed(w->embed_tokens, tokens.data(), R, e.data());
  for (int r = 0; r < R; ++r) {
    cpu::rms_norm(&e[r * H], m.pre_fc_norm_embedding.data(), 1, H, c.rms_norm_eps, &cat[r * 2 * H]);
    cpu::rms_norm(&hidden[r * H], m.pre_fc_norm_hidden.data(), 1, H, c.rms_norm_eps, &cat[r * 2 * H + H]);
  }
  cpu::matmul(pool, m.fc, cat.data(), R, h.data());
  cpu::Context ctx{pool, c, no_trace, c.num_hidden_layers};
  cpu::LayerState kv;
  cpu::rms_norm(h.data(), m.layer.input_norm.data(), R, H, c.rms_norm_eps, x.data());
  cpu::attention_block(ctx, m.layer.attn, x.data(), R, 0, kv, y.data());
  for (int64_t i = 0; i < R * H; ++i) h[i] += y[i];
  cpu::rms_norm(h.data(), m.layer.post_attention_norm.data(), R, H, c.rms_norm_eps, x.data());
  cpu::moe_block(ctx, m.layer.moe, x.data(), R, y.data());
  for (int64_t i = 0; i < R * H; ++i) h[i] += y[i];
  cpu::rms_norm(h.data(), m.norm.data(), R, H, c.rms_norm_eps, ref_out.data());
  cpu::matmul(pool, w->lm_head, &ref_out[(R - 1) * H], 1, ref_logits.data());
  auto rel = [](const std::vector<float>& ref, const std::vector<float>& got) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double d = double(got[i]) - ref[i];
      num += d * d, den += double(ref[i]) * ref[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
  };
  const double e_out = rel(ref_out, out), e_logits = rel(ref_logits, logits);
  std::printf("[%s] MTP head, %d rows: output rel error %.2e, last-row logits %.2e, top-1 %s\n", preset.c_str(), R,
              e_out, e_logits, argmax(logits.data(), V) == argmax(ref_logits.data(), V) ? "equal" : "differs");
  EXPECT_LE(e_out, 2e-2);
  EXPECT_LE(e_logits, 2e-2);
  // Refusals: hidden rows of the wrong size, a token outside the vocabulary.
  std::vector<float> short_hidden(hidden.begin(), hidden.end() - 1);
  EXPECT_FALSE((*made)->mtp_head_for_test(tokens, short_hidden, &logits, &out).ok());
  std::vector<int32_t> bad = tokens;
  bad[0] = static_cast<int32_t>(V);
  EXPECT_FALSE((*made)->mtp_head_for_test(bad, hidden, &logits, &out).ok());
}

TEST(CudaBackend, MtpHeadMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (int R : {1, 3}) expect_mtp_head_matches_cpu("tiny", R);
  for (int R : {1, 4, 65}) expect_mtp_head_matches_cpu("full4", R);
}

// Speculative verification (forward_verify / accept_verified): the 1+K rows of one sequence in one several-row step
// give each row, to the bit, the logits the plain one-token forwards of the same tokens give; accept_verified(n)
// leaves the sequence where n plain forwards leave it (the next forwards equal the plain ones', to the bit), for
// every n; misuse is refused and changes nothing.
void expect_verify_equals_plain(const std::string& preset, int rows) {
  auto w = synth_model(preset);
  auto made = cuda::make_cuda_backend(w, {4096});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Backend& b = **made;
  const int64_t V = w->config.vocab_size;
  const std::vector<int32_t> prompt = random_tokens(45, static_cast<int>(V), 300 + rows);
  const std::vector<int32_t> fed = random_tokens(rows + 3, static_cast<int>(V), 400 + rows);
  auto prefilled = [&] {
    auto s = b.new_sequence();
    EXPECT_TRUE(b.forward(*s, prompt, LogitsRows::none, nullptr).ok());
    return s;
  };
  // Plain: one token a forward, every fed token.
  std::vector<float> plain, l;
  {
    auto s = prefilled();
    for (int32_t t : fed) {
      ASSERT_TRUE(b.forward(*s, std::span<const int32_t>(&t, 1), LogitsRows::last, &l).ok());
      plain.insert(plain.end(), l.begin(), l.end());
    }
  }
  const std::span<const int32_t> verified(fed.data(), static_cast<size_t>(rows));
  for (int keep = 1; keep <= rows; ++keep) {
    auto s = prefilled();
    Status st = b.forward_verify(*s, verified, &l);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_EQ(l.size(), static_cast<size_t>(rows * V));
    EXPECT_EQ(s->n_tokens(), static_cast<int64_t>(prompt.size()) + rows);
    size_t differing = 0;
    for (int r = 0; r < rows; ++r) differing += std::memcmp(&l[r * V], &plain[r * V], V * sizeof(float)) != 0;
    EXPECT_EQ(differing, 0u) << preset << ": " << rows << " verified rows";
    // Pending rows: every other call is refused, the sequence unchanged.
    EXPECT_FALSE(b.forward(*s, std::span<const int32_t>(&fed[0], 1), LogitsRows::last, &l).ok());
    EXPECT_FALSE(b.forward_verify(*s, verified, &l).ok());
    EXPECT_FALSE(b.accept_verified(*s, 0).ok());
    EXPECT_FALSE(b.accept_verified(*s, rows + 1).ok());
    ASSERT_TRUE(b.accept_verified(*s, keep).ok());
    EXPECT_EQ(s->n_tokens(), static_cast<int64_t>(prompt.size()) + keep);
    EXPECT_FALSE(b.accept_verified(*s, 1).ok());  // nothing pending any more
    // Continue from the kept rows: the plain logits of the tokens after them.
    differing = 0;
    for (size_t t = static_cast<size_t>(keep); t < fed.size(); ++t) {
      ASSERT_TRUE(b.forward(*s, std::span<const int32_t>(&fed[t], 1), LogitsRows::last, &l).ok());
      differing += std::memcmp(l.data(), &plain[t * V], V * sizeof(float)) != 0;
    }
    EXPECT_EQ(differing, 0u) << preset << ": after keeping " << keep << " of " << rows;
  }
  std::printf("[%s] verify %d rows: each row and the continuation after keeping 1..%d equal the plain forwards\n",
              preset.c_str(), rows, rows);
  // Two sequences' verifications interleaved: the first's kept states are gone, so only all its rows can be kept.
  {
    auto a = prefilled(), c = prefilled();
    ASSERT_TRUE(b.forward_verify(*a, verified, &l).ok());
    ASSERT_TRUE(b.forward_verify(*c, verified, &l).ok());
    if (rows > 1) {
      EXPECT_FALSE(b.accept_verified(*a, 1).ok());
    }
    EXPECT_TRUE(b.accept_verified(*a, rows).ok());
    EXPECT_TRUE(b.accept_verified(*c, 1).ok());
  }
  auto s = prefilled();
  std::vector<int32_t> too_many(static_cast<size_t>(cuda::kMaxBatchRows + 1), 1);
  EXPECT_FALSE(b.forward_verify(*s, too_many, &l).ok());
  EXPECT_FALSE(b.forward_verify(*s, {}, &l).ok());
  std::vector<int32_t> bad = {1, static_cast<int32_t>(V)};
  EXPECT_FALSE(b.forward_verify(*s, bad, &l).ok());
  EXPECT_EQ(s->n_tokens(), static_cast<int64_t>(prompt.size()));
}

TEST(CudaBackend, VerifyRowsEqualPlainForwardsTiny) {
  SKIP_WITHOUT_GPU();
  for (int rows : {1, 2, 4}) expect_verify_equals_plain("tiny", rows);
}

TEST(CudaBackend, VerifyRowsEqualPlainForwardsFull) {
  SKIP_WITHOUT_GPU();
  for (int rows : {2, 4}) expect_verify_equals_plain("full4", rows);
}

// The MTP head's state and draft (enable_mtp / mtp_draft) against the CPU backend's: the same calls on both - a
// prompt (in chunks of 64 rows on CUDA: the head reads each chunk's rows), a first draft from the pending row, a
// chained draft, a verification of the token and the drafts with two rows kept, a draft from the two pending rows
// a plain forward after a verification (the head reads the pending rows), a draft again - and each draft's logits
// within the prefill path's bound (relative error <= 2e-2) with the same top-1. Misuse is refused.
void expect_mtp_draft_matches_cpu(const std::string& preset) {
  auto w = synth_model(preset);
  ASSERT_TRUE(w->mtp.has_value()) << preset << " has no MTP head";
  CpuBackend cpu(w);
  ASSERT_TRUE(cpu.enable_mtp().ok());
  auto made = cuda::make_cuda_backend(w, {4096, 64});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Backend& gpu = **made;
  ASSERT_TRUE(gpu.has_mtp());
  {  // before enable_mtp: a sequence without the head's state
    auto s = gpu.new_sequence();
    std::vector<float> l;
    EXPECT_EQ(gpu.mtp_draft(*s, 1, &l).code(), ErrorCode::invalid_argument);
  }
  Status enabled = gpu.enable_mtp();
  ASSERT_TRUE(enabled.ok()) << enabled.message();
  const int64_t V = w->config.vocab_size;
  const std::vector<int32_t> prompt = random_tokens(150, static_cast<int>(V), 700);
  auto cs = cpu.new_sequence(), gs = gpu.new_sequence();
  std::vector<float> cl, gl;
  EXPECT_EQ(gpu.mtp_draft(*gs, 1, &gl).code(), ErrorCode::invalid_argument) << "nothing forwarded yet";
  int drafts = 0;
  // One draft on both from `token`; returns the CPU's argmax (the next token both are fed).
  // The argmax calls (on a clone: the same step) give the argmax of the logits calls' rows.
  auto draft = [&](int32_t token, const char* what) {
    auto gc = gs->clone();
    int32_t id = -1;
    Status c = gpu.mtp_draft_argmax(*gc, token, &id);
    EXPECT_TRUE(c.ok()) << c.message();
    Status a = cpu.mtp_draft(*cs, token, &cl), b = gpu.mtp_draft(*gs, token, &gl);
    EXPECT_TRUE(a.ok()) << a.message();
    EXPECT_TRUE(b.ok()) << b.message();
    EXPECT_EQ(id, argmax(gl.data(), V)) << what << ": mtp_draft_argmax";
    const Agreement ag = compare_logits(cl, gl, V);
    std::printf("[%s] mtp_draft (%s): relative logit error %.3g, top-1 %s\n", preset.c_str(), what, ag.rel,
                ag.top1 == 1.0 ? "equal" : "differs");
    EXPECT_LE(ag.rel, 2e-2) << what;
    EXPECT_EQ(ag.top1, 1.0) << what;
    ++drafts;
    return argmax(cl.data(), V);
  };
  ASSERT_TRUE(cpu.forward(*cs, prompt, LogitsRows::last, &cl).ok());
  ASSERT_TRUE(gpu.forward(*gs, prompt, LogitsRows::last, &gl).ok());
  const int32_t t0 = argmax(cl.data(), V);
  const int32_t d1 = draft(t0, "first, from the prompt's last row");
  const int32_t d2 = draft(d1, "chained");
  // Verify [t0, d1, d2] and keep two rows: the head then drafts from the two pending rows after t0's position.
  const std::vector<int32_t> rows = {t0, d1, d2};
  {
    auto gc = gs->clone();
    std::vector<int32_t> ids;
    Status c = gpu.forward_verify_argmax(*gc, rows, &ids);
    ASSERT_TRUE(c.ok()) << c.message();
    ASSERT_TRUE(gpu.forward_verify(*gs, rows, &gl).ok());
    ASSERT_EQ(ids.size(), rows.size());
    for (size_t r = 0; r < rows.size(); ++r)
      EXPECT_EQ(ids[r], argmax(gl.data() + r * V, V)) << "forward_verify_argmax row " << r;
    std::printf("[%s] forward_verify_argmax: %zu rows equal to the argmax of forward_verify's\n", preset.c_str(),
                rows.size());
  }
  ASSERT_TRUE(cpu.forward_verify(*cs, rows, &cl).ok());
  EXPECT_EQ(gpu.mtp_draft(*gs, 1, &gl).code(), ErrorCode::invalid_argument) << "between verify and accept";
  ASSERT_TRUE(cpu.accept_verified(*cs, 2).ok());
  ASSERT_TRUE(gpu.accept_verified(*gs, 2).ok());
  const int32_t x = (d2 + 1) % static_cast<int32_t>(V);  // the token sampled after the two kept rows
  const int32_t d3 = draft(x, "from two pending rows after a verification");
  draft(d3, "chained after that");
  // A verification without drafts, then a plain forward: the head reads the pending rows first.
  const std::vector<int32_t> rows2 = {x, d3};
  ASSERT_TRUE(cpu.forward_verify(*cs, rows2, &cl).ok());
  ASSERT_TRUE(gpu.forward_verify(*gs, rows2, &gl).ok());
  ASSERT_TRUE(cpu.accept_verified(*cs, 2).ok());
  ASSERT_TRUE(gpu.accept_verified(*gs, 2).ok());
  const int32_t y = (d3 + 7) % static_cast<int32_t>(V);
  ASSERT_TRUE(cpu.forward(*cs, std::span<const int32_t>(&y, 1), LogitsRows::last, &cl).ok());
  ASSERT_TRUE(gpu.forward(*gs, std::span<const int32_t>(&y, 1), LogitsRows::last, &gl).ok());
  draft(argmax(cl.data(), V), "after a plain forward");
  EXPECT_EQ(drafts, 5);
  EXPECT_EQ(gs->n_tokens(), cs->n_tokens());
  EXPECT_EQ(gpu.mtp_draft(*gs, static_cast<int32_t>(V), &gl).code(), ErrorCode::invalid_argument);
  // A sequence with the head samples on the host only.
  EXPECT_EQ(gpu.generate_on_device(*gs, 1, {}, 1, [](int32_t) { return true; }).code(), ErrorCode::unsupported);
}

TEST(CudaBackend, MtpDraftMatchesCpuTiny) {
  SKIP_WITHOUT_GPU();
  expect_mtp_draft_matches_cpu("tiny");
}

TEST(CudaBackend, MtpDraftMatchesCpuFull) {
  SKIP_WITHOUT_GPU();
  expect_mtp_draft_matches_cpu("full4");
}

// Greedy speculative decoding (engine/speculative.h's loop, K = 1 and 3) on CUDA gives token for token the plain
// greedy loop's tokens (the prompt but its last token prefilled, then one-token forwards): verification rows are
// the decode step's to the bit, and the head only proposes.
void expect_speculative_greedy_equals_plain(const std::string& preset, int n_tokens) {
  auto w = synth_model(preset);
  const int64_t V = w->config.vocab_size;
  const std::vector<int32_t> prompt = random_tokens(37, static_cast<int>(V), 800);
  std::vector<int32_t> plain;
  {
    auto made = cuda::make_cuda_backend(w, {4096});
    ASSERT_TRUE(made.ok()) << made.status().message();
    Backend& b = **made;
    auto s = b.new_sequence();
    ASSERT_TRUE(b.forward(*s, std::span<const int32_t>(prompt).first(prompt.size() - 1), LogitsRows::none,
                          nullptr).ok());
    int32_t next = prompt.back();
    std::vector<float> l;
    for (int i = 0; i < n_tokens; ++i) {
      ASSERT_TRUE(b.forward(*s, std::span<const int32_t>(&next, 1), LogitsRows::last, &l).ok());
      next = argmax(l.data(), V);
      plain.push_back(next);
    }
  }
  auto made = cuda::make_cuda_backend(w, {4096});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Backend& b = **made;
  ASSERT_TRUE(b.enable_mtp().ok());
  for (int k : {1, 3}) {
    auto s = b.new_sequence();
    ASSERT_TRUE(b.forward(*s, std::span<const int32_t>(prompt).first(prompt.size() - 1), LogitsRows::none,
                          nullptr).ok());
    SamplingParams p;
    p.temperature = 0;
    Sampler target(p);
    SplitMix64 rng(speculative_seed(target.seed()));
    std::vector<int32_t> history = prompt;
    SpeculativeRequest r{&history, prompt.size(), {}, 0, n_tokens, k, nullptr};
    SpeculativeCounts counts;
    Status st = speculative_decode(
        b, *s, target, rng, r,
        [&](int32_t id, float, std::vector<TokenLogprob>) {
          history.push_back(id);
          return static_cast<int>(history.size() - prompt.size()) < n_tokens;
        },
        counts);
    ASSERT_TRUE(st.ok()) << st.message();
    const std::vector<int32_t> spec(history.begin() + static_cast<std::ptrdiff_t>(prompt.size()), history.end());
    std::printf("[%s] speculative mtp:%d greedy, %d tokens: %s the plain loop's; %lld drafted, %lld accepted over "
                "%lld steps\n",
                preset.c_str(), k, n_tokens, spec == plain ? "equal to" : "DIFFERENT from",
                (long long)counts.drafted, (long long)counts.accepted, (long long)counts.steps);
    EXPECT_EQ(spec, plain) << "mtp:" << k;
    EXPECT_GT(counts.drafted, 0);
  }
}

TEST(CudaBackend, SpeculativeGreedyEqualsPlainTiny) {
  SKIP_WITHOUT_GPU();
  expect_speculative_greedy_equals_plain("tiny", 40);
}

TEST(CudaBackend, SpeculativeGreedyEqualsPlainFull) {
  SKIP_WITHOUT_GPU();
  expect_speculative_greedy_equals_plain("full4", 40);
}

// The head's state through checkpoint / restore / clone (as the CPU backend's): a checkpoint before a draft, one
// after a draft (its draft entries are not part of it: no draft chains from it), a clone with pending rows and
// forward_with_checkpoint's checkpoint (the state a forward up to the split leaves) all replay the same draft and
// verification logits; the sequence's bytes count the head's state.
TEST(CudaBackend, MtpStateThroughCheckpointRestoreClone) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("tiny");
  auto made = cuda::make_cuda_backend(w, {2048});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Backend& b = **made;
  auto plain_seq = b.new_sequence();
  ASSERT_TRUE(b.enable_mtp().ok());
  const int64_t V = w->config.vocab_size;
  const std::vector<int32_t> prompt = random_tokens(30, static_cast<int>(V), 900);
  auto s = b.new_sequence();
  EXPECT_GT(s->bytes(), plain_seq->bytes()) << "the head's KV and rows";
  std::vector<float> l;
  ASSERT_TRUE(b.forward(*s, prompt, LogitsRows::last, &l).ok());
  const int32_t t0 = argmax(l.data(), V);
  auto same = [&](const std::vector<float>& a, const std::vector<float>& c, const char* what) {
    ASSERT_EQ(a.size(), c.size()) << what;
    const Agreement ag = compare_logits(a, c, V);
    const bool bits = std::memcmp(a.data(), c.data(), a.size() * sizeof(float)) == 0;
    std::printf("[tiny] %s: %s (relative error %.3g)\n", what, bits ? "bit-identical" : "differs", ag.rel);
    EXPECT_LE(ag.rel, 1e-5) << what;
  };
  // draft(t0), draft(d1), verify [t0, d1, d2], keep 2, draft(x): the draft and verification logits.
  struct Run {
    std::vector<float> d1, d2, verified, d3;
  };
  // drafted: the first draft's logits when it was made already.
  auto run = [&](SequenceState& q, const std::vector<float>* drafted) {
    Run r;
    if (drafted) {
      r.d1 = *drafted;
    } else {
      EXPECT_TRUE(b.mtp_draft(q, t0, &r.d1).ok());
    }
    const int32_t d1 = argmax(r.d1.data(), V);
    EXPECT_TRUE(b.mtp_draft(q, d1, &r.d2).ok());
    const std::vector<int32_t> rows = {t0, d1, argmax(r.d2.data(), V)};
    EXPECT_TRUE(b.forward_verify(q, rows, &r.verified).ok());
    EXPECT_TRUE(b.accept_verified(q, 2).ok());
    EXPECT_TRUE(b.mtp_draft(q, (rows[2] + 3) % static_cast<int32_t>(V), &r.d3).ok());
    return r;
  };
  auto cp_before = s->checkpoint();
  ASSERT_TRUE(cp_before);
  const Run a = run(*s, nullptr);
  ASSERT_TRUE(s->restore(*cp_before).ok());
  const Run c = run(*s, nullptr);
  same(a.d1, c.d1, "restored before the drafts: first draft");
  same(a.d2, c.d2, "restored before the drafts: chained draft");
  same(a.verified, c.verified, "restored before the drafts: verification");
  same(a.d3, c.d3, "restored before the drafts: draft after the verification");
  // A checkpoint after the first draft: it keeps the entry the draft wrote at the last position (its token is the
  // next one the sequence consumes) but not the chained row, so no draft chains from it.
  ASSERT_TRUE(s->restore(*cp_before).ok());
  std::vector<float> d1;
  ASSERT_TRUE(b.mtp_draft(*s, t0, &d1).ok());
  auto cp_draft = s->checkpoint();
  ASSERT_TRUE(cp_draft);
  const Run e = run(*s, &d1);
  ASSERT_TRUE(s->restore(*cp_draft).ok());
  EXPECT_EQ(b.mtp_draft(*s, argmax(d1.data(), V), &l).code(), ErrorCode::invalid_argument);
  // Replays from the restored state: the verification and the draft after it.
  const std::vector<int32_t> rows = {t0, argmax(d1.data(), V), argmax(e.d2.data(), V)};
  std::vector<float> verified, d3;
  ASSERT_TRUE(b.forward_verify(*s, rows, &verified).ok());
  ASSERT_TRUE(b.accept_verified(*s, 2).ok());
  ASSERT_TRUE(b.mtp_draft(*s, (rows[2] + 3) % static_cast<int32_t>(V), &d3).ok());
  same(e.verified, verified, "restored after a draft: verification");
  same(e.d3, d3, "restored after a draft: draft after the verification");
  // A clone with two pending rows drafts as the original.
  ASSERT_TRUE(s->restore(*cp_before).ok());
  (void)run(*s, nullptr);
  const std::vector<int32_t> rows3 = {5, 6, 7};
  ASSERT_TRUE(b.forward_verify(*s, rows3, &l).ok());
  ASSERT_TRUE(b.accept_verified(*s, 2).ok());
  auto twin = s->clone();
  ASSERT_TRUE(twin);
  std::vector<float> x1, x2;
  ASSERT_TRUE(b.mtp_draft(*s, 9, &x1).ok());
  ASSERT_TRUE(b.mtp_draft(*twin, 9, &x2).ok());
  same(x1, x2, "clone with pending rows: draft");
  // forward_with_checkpoint's checkpoint at the split against a forward up to the split and a checkpoint.
  auto one = b.new_sequence(), two = b.new_sequence();
  auto fwc = b.forward_with_checkpoint(*one, prompt, 20, LogitsRows::none, nullptr);
  ASSERT_TRUE(fwc.ok() && *fwc) << fwc.status().message();
  ASSERT_TRUE(b.forward(*two, std::span<const int32_t>(prompt).first(20), LogitsRows::none, nullptr).ok());
  ASSERT_TRUE(one->restore(**fwc).ok());
  ASSERT_TRUE(b.mtp_draft(*one, prompt[20], &x1).ok());
  ASSERT_TRUE(b.mtp_draft(*two, prompt[20], &x2).ok());
  const Agreement ag = compare_logits(x2, x1, V);
  std::printf("[tiny] forward_with_checkpoint's checkpoint: draft relative error %.3g against a forward to the "
              "split\n", ag.rel);
  EXPECT_LE(ag.rel, 2e-2);  // the head read the rows in other groupings (one chunk against two)
  EXPECT_EQ(ag.top1, 1.0);
}

std::vector<uint8_t> saved(const SequenceState& s) {
  std::vector<uint8_t> out;
  ByteWriter w(out);
  Status st = s.save(w);
  EXPECT_TRUE(st.ok()) << st.message();
  return out;
}

TEST(CudaBackend, SavedSequenceAndCheckpointContinueBitIdentically) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("tiny");
  auto cuda = cuda::make_cuda_backend(w, {2048});
  ASSERT_TRUE(cuda.ok());
  Backend& b = **cuda;
  auto prompt = random_tokens(40, w->config.vocab_size, 5), other = random_tokens(12, w->config.vocab_size, 6);
  auto seq = b.new_sequence();
  ASSERT_TRUE(b.forward(*seq, std::span<const int32_t>(prompt.data(), 10), LogitsRows::none, nullptr).ok());
  auto cp = seq->checkpoint();
  ASSERT_TRUE(b.forward(*seq, std::span<const int32_t>(prompt.data() + 10, 30), LogitsRows::none, nullptr).ok());
  std::vector<uint8_t> state = saved(*seq), cp_bytes;
  ByteWriter cw(cp_bytes);
  ASSERT_TRUE(cp->save(cw).ok());
  ByteReader sin(state), cin(cp_bytes);
  auto seq2 = b.load_sequence(sin);
  auto cp2 = b.load_checkpoint(cin);
  ASSERT_TRUE(seq2.ok()) << seq2.status().message();
  ASSERT_TRUE(cp2.ok()) << cp2.status().message();
  EXPECT_EQ(sin.left(), 0u);
  EXPECT_EQ((*seq2)->n_tokens(), 40);
  EXPECT_EQ((*cp2)->n_tokens(), 10);
  // The continuation from the end: prefill rows, then the device decode loop.
  auto continue_from = [&](SequenceState& s) {
    std::vector<float> logits;
    EXPECT_TRUE(b.forward(s, std::span<const int32_t>(other.data(), 11), LogitsRows::all, &logits).ok());
    std::vector<int32_t> out;
    EXPECT_TRUE(b.generate_on_device(s, other[11], {}, 16, [&](int32_t t) { out.push_back(t); return true; }).ok());
    return std::make_pair(logits, out);
  };
  auto a = continue_from(*seq), c = continue_from(**seq2);
  ASSERT_EQ(a.first.size(), c.first.size());
  EXPECT_EQ(0, std::memcmp(a.first.data(), c.first.data(), a.first.size() * sizeof(float)));
  EXPECT_EQ(a.second, c.second);
  // The loaded checkpoint restores like the original one.
  ASSERT_TRUE(seq->restore(*cp).ok());
  ASSERT_TRUE((*seq2)->restore(**cp2).ok());
  a = continue_from(*seq), c = continue_from(**seq2);
  EXPECT_EQ(0, std::memcmp(a.first.data(), c.first.data(), a.first.size() * sizeof(float)));
  EXPECT_EQ(a.second, c.second);

  // Short input is a format error; a sequence longer than this backend's KV capacity is out_of_range.
  ByteReader cut(std::span<const uint8_t>(state).first(state.size() - 1));
  auto bad = b.load_sequence(cut);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), ErrorCode::format) << bad.status().message();
  auto small = cuda::make_cuda_backend(w, {32});
  ASSERT_TRUE(small.ok());
  ByteReader again(state);
  auto too_long = (*small)->load_sequence(again);
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.status().code(), ErrorCode::out_of_range) << too_long.status().message();
}

TEST(CudaBackend, SessionFileRoundTrip) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("tiny");
  auto cuda = cuda::make_cuda_backend(w, {2048});
  ASSERT_TRUE(cuda.ok());
  Backend& b = **cuda;
  auto prompt = random_tokens(30, w->config.vocab_size, 9), next = random_tokens(8, w->config.vocab_size, 10);
  auto seq = b.new_sequence();
  ASSERT_TRUE(b.forward(*seq, std::span<const int32_t>(prompt.data(), 20), LogitsRows::none, nullptr).ok());
  SessionSnapshot snap;
  snap.checkpoints[20] = seq->checkpoint();
  ASSERT_TRUE(b.forward(*seq, std::span<const int32_t>(prompt.data() + 20, 10), LogitsRows::none, nullptr).ok());
  snap.tokens = prompt;
  snap.anchor = 20;
  snap.state = saved(*seq);
  const SessionFileOwner owner{model_fingerprint(*w), b.name(), ""};
  const std::string path = ::testing::TempDir() + "/lily_cuda_session.lsess";
  std::remove(path.c_str());
  auto bytes = write_session_file(path, owner, snap);
  ASSERT_TRUE(bytes.ok()) << bytes.status().message();
  auto loaded = read_session_file(path, owner, b);
  std::remove(path.c_str());
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  ASSERT_EQ((*loaded)->checkpoints.size(), 1u);
  ASSERT_TRUE((*loaded)->state->restore(*(*loaded)->checkpoints.at(20)).ok());
  ASSERT_TRUE(seq->restore(*snap.checkpoints.at(20)).ok());
  std::vector<float> l1, l2;
  ASSERT_TRUE(b.forward(*seq, next, LogitsRows::all, &l1).ok());
  ASSERT_TRUE(b.forward(*(*loaded)->state, next, LogitsRows::all, &l2).ok());
  ASSERT_EQ(l1.size(), l2.size());
  EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.size() * sizeof(float)));
}

// With the MTP head on, a saved sequence (with two pending rows after a verification) and checkpoint carry the
// head's state: after a load and restore the head drafts as the original does; a backend without the head reads
// past its part and continues as the original, one with the head refuses a saved form without it; a damaged
// head part is a format error.
TEST(CudaBackend, SavedMtpStateDraftsAsTheOriginal) {
  SKIP_WITHOUT_GPU();
  auto w = synth_model("tiny");
  auto made = cuda::make_cuda_backend(w, {2048});
  auto made_plain = cuda::make_cuda_backend(w, {2048});
  ASSERT_TRUE(made.ok() && made_plain.ok());
  Backend& b = **made;
  Backend& plain = **made_plain;
  ASSERT_TRUE(b.enable_mtp().ok());
  ASSERT_TRUE(b.mtp_enabled());
  EXPECT_FALSE(plain.mtp_enabled());
  const int64_t V = w->config.vocab_size;
  const std::vector<int32_t> prompt = random_tokens(30, static_cast<int>(V), 910);
  auto s = b.new_sequence();
  auto fwc = b.forward_with_checkpoint(*s, std::span<const int32_t>(prompt).first(24), 16, LogitsRows::none, nullptr);
  ASSERT_TRUE(fwc.ok() && *fwc) << fwc.status().message();
  std::unique_ptr<Checkpoint> cp = std::move(*fwc);
  std::vector<float> l, d1;
  ASSERT_TRUE(b.mtp_draft(*s, prompt[24], &d1).ok());
  ASSERT_TRUE(b.forward_verify(*s, std::vector<int32_t>{prompt[24], argmax(d1.data(), V), 5}, &l).ok());
  ASSERT_TRUE(b.accept_verified(*s, 2).ok());  // two pending rows
  const std::vector<uint8_t> state = saved(*s);
  auto original = s->clone();  // the reference for the plain backend's continuation below
  ASSERT_TRUE(original);
  std::vector<uint8_t> cp_bytes;
  ByteWriter cw(cp_bytes);
  ASSERT_TRUE(cp->save(cw).ok());
  ByteReader sin(state), cin(cp_bytes);
  auto s2 = b.load_sequence(sin);
  auto cp2 = b.load_checkpoint(cin);
  ASSERT_TRUE(s2.ok()) << s2.status().message();
  ASSERT_TRUE(cp2.ok()) << cp2.status().message();
  EXPECT_EQ(sin.left(), 0u);
  EXPECT_EQ(cin.left(), 0u);
  EXPECT_EQ(saved(**s2), state) << "saved again: the same bytes";
  // Two chained drafts, a plain forward and a draft after it: the same on the original and the loaded state.
  auto drafts = [&](SequenceState& q, int32_t t) {
    std::vector<float> a, c, e;
    EXPECT_TRUE(b.mtp_draft(q, t, &a).ok());
    EXPECT_TRUE(b.mtp_draft(q, argmax(a.data(), V), &c).ok());
    EXPECT_TRUE(b.forward(q, std::vector<int32_t>{7, 8, 9}, LogitsRows::none, nullptr).ok());
    EXPECT_TRUE(b.mtp_draft(q, 10, &e).ok());
    a.insert(a.end(), c.begin(), c.end());
    a.insert(a.end(), e.begin(), e.end());
    return a;
  };
  auto same = [&](const std::vector<float>& x, const std::vector<float>& y, const char* what) {
    const Agreement ag = compare_logits(x, y, V);
    const bool bits = x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
    std::printf("[tiny] saved MTP state, %s: %s (relative error %.3g)\n", what, bits ? "bit-identical" : "differs",
                ag.rel);
    EXPECT_LE(ag.rel, 1e-5) << what;
    EXPECT_EQ(ag.top1, 1.0) << what;
  };
  auto twin = s->clone();
  ASSERT_TRUE(twin);
  same(drafts(*twin, 6), drafts(**s2, 6), "the loaded sequence");
  ASSERT_TRUE(s->restore(*cp).ok());
  ASSERT_TRUE((*s2)->restore(**cp2).ok());
  same(drafts(*s, prompt[16]), drafts(**s2, prompt[16]), "the loaded checkpoint");

  // Without the head: its part read past, the main state continues as the original's.
  ByteReader pin(state);
  auto p2 = plain.load_sequence(pin);
  ASSERT_TRUE(p2.ok()) << p2.status().message();
  EXPECT_EQ(pin.left(), 0u);
  // The reference is the original sequence continuing on its own backend: the head changes nothing in the main
  // model's arithmetic, so the same kernels on the same state give the same bits. (A plain sequence that
  // re-forwards the same tokens is not a reference: its rows take other kernels than the split prefill and the
  // verification rows did, 6.7e-4 apart on the H100.)
  std::vector<float> la, lb;
  ASSERT_TRUE(plain.forward(**p2, std::vector<int32_t>{3, 4}, LogitsRows::all, &la).ok());
  ASSERT_TRUE(b.forward(*original, std::vector<int32_t>{3, 4}, LogitsRows::all, &lb).ok());
  ASSERT_EQ(la.size(), lb.size());
  EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), la.size() * sizeof(float))) << "relative error "
                                                                             << compare_logits(lb, la, V).rel;
  // With the head, a saved form without it is refused.
  // (q: the same 26 positions as the saved state, so that its saved form is the state's main part less the flag.)
  auto q = plain.new_sequence();
  ASSERT_TRUE(plain.forward(*q, std::span<const int32_t>(prompt).first(24), LogitsRows::none, nullptr).ok());
  ASSERT_TRUE(plain.forward(*q, std::vector<int32_t>{prompt[24], argmax(d1.data(), V)}, LogitsRows::none,
                            nullptr).ok());
  const std::vector<uint8_t> plain_state = saved(*q);
  ByteReader rin(plain_state);
  auto refused = b.load_sequence(rin);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::unsupported) << refused.status().message();
  // Cut anywhere in the head's part (after the main part, the plain state less its flag byte): a format error.
  for (size_t cut : {plain_state.size() - 1, plain_state.size() + 8, (plain_state.size() + state.size()) / 2,
                     state.size() - 1}) {
    ByteReader in(std::span<const uint8_t>(state).first(cut));
    auto r = b.load_sequence(in);
    ASSERT_FALSE(r.ok()) << cut;
    EXPECT_EQ(r.status().code(), ErrorCode::format) << r.status().message();
  }
}

// The option specs of `lily bench --variants` and `--cuda-options` (cuda::apply_option_spec; no GPU needed).
TEST(CudaOptions, SpecSetsOptionsAndNamesErrors) {
  cuda::CudaBackendOptions o;
  ASSERT_TRUE(cuda::apply_option_spec("", o, "--x").ok());
  ASSERT_TRUE(cuda::apply_option_spec("prefill_chunk=1024,,", o, "--x").ok());
  EXPECT_EQ(o.prefill_chunk, 1024);
  auto message = [&](const std::string& spec) {
    Status st = cuda::apply_option_spec(spec, o, "--cuda-options");
    EXPECT_EQ(st.code(), ErrorCode::invalid_argument) << spec;
    return st.message();
  };
  EXPECT_NE(
      message("nope=1").find("--cuda-options: unknown key `nope` (known: prefill_chunk, expert_copies, megakernel)"),
      std::string::npos);
  EXPECT_NE(message("moe_fused=on").find("unknown key `moe_fused`"), std::string::npos);  // gone with its kernel
  EXPECT_NE(message("prefill_chunk").find("`prefill_chunk` is not key=value"), std::string::npos);
  EXPECT_NE(message("prefill_chunk=13x").find("is not a non-negative integer"), std::string::npos);
  EXPECT_NE(message("prefill_chunk=99999999999").find("is not a non-negative integer"), std::string::npos);
  EXPECT_NE(message("prefill_chunk=-1").find("is not a non-negative integer"), std::string::npos);
  ASSERT_TRUE(cuda::apply_option_spec("expert_copies=0", o, "--x").ok());
  EXPECT_EQ(o.expert_copies, 0);
  EXPECT_NE(message("expert_copies=2").find("--cuda-options: expert_copies=2: must be 0 or 1"), std::string::npos);
  ASSERT_TRUE(cuda::apply_option_spec("megakernel=1", o, "--x").ok());
  EXPECT_EQ(o.megakernel, 1);
  EXPECT_NE(message("megakernel=2").find("--cuda-options: megakernel=2: must be 0 or 1"), std::string::npos);
  EXPECT_EQ(cuda::option_keys(), "prefill_chunk, expert_copies, megakernel");
}

}  // namespace
}  // namespace lily
