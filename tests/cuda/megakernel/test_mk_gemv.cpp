// The decode megakernel's machinery (src/cuda/megakernel): the schedule (host, runs everywhere), then on a GPU the
// interpreter with counters and pages on chains of 4-bit GEMVs against a CPU reference on fresh random inputs,
// against the kernel-per-op chain, and timed against it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "mk_test_util.h"
#include "cuda/kernels/gemv.cuh"
#include "cuda/megakernel/step.cuh"

namespace lily::cuda::mk {
namespace {

using test::DeviceBuffer;
using test_util::Carver;
using test_util::device_sms;
using test::HostQMatrix;

// A QMatrix at a fake, aligned address (the schedule never dereferences it).
QMatrix fake_matrix(int rows, int cols, uintptr_t base) {
  QMatrix m;
  m.rows = rows, m.cols = cols, m.bits = 4;
  m.w = reinterpret_cast<const uint32_t*>(base);
  m.scales = reinterpret_cast<const __nv_bfloat16*>(base + (uintptr_t{1} << 32));
  m.biases = reinterpret_cast<const __nv_bfloat16*>(base + (uintptr_t{2} << 32));
  return m;
}

TEST(MkProgram, ScheduleCoversEveryRowOnceInOpOrder) {
  float* act = reinterpret_cast<float*>(uintptr_t{1} << 20);
  for (int n_blocks : {1, 7, 132}) {
    SCOPED_TRACE(n_blocks);
    Program p;
    int prev = -1;
    for (int l = 0; l < 3; ++l) {
      auto in = p.add_gemv(fake_matrix(12352, 2048, 0x10000), act, act, prev < 0 ? std::vector<int>{}
                                                                               : std::vector<int>{prev}, act);
      ASSERT_TRUE(in.ok()) << in.status().message();
      auto out = p.add_gemv(fake_matrix(2048, 4096, 0x20000), act, act, {*in}, nullptr, 1e-6f, act);
      ASSERT_TRUE(out.ok()) << out.status().message();
      prev = *out;
    }
    ASSERT_TRUE(p.schedule(n_blocks).ok());
    ASSERT_EQ(p.list_begin().size(), static_cast<size_t>(n_blocks) + 1);
    std::vector<std::vector<int>> covered(p.ops().size());
    for (size_t o = 0; o < p.ops().size(); ++o) covered[o].assign(p.ops()[o].m.rows, 0);
    std::vector<uint32_t> slices(p.ops().size(), 0);
    size_t total = 0, most = 0;
    for (int b = 0; b < n_blocks; ++b) {
      int last_op = -1;
      for (int i = p.list_begin()[b]; i < p.list_begin()[b + 1]; ++i) {
        const Instr& in = p.instrs()[i];
        EXPECT_GT(in.op, last_op) << "block " << b << ": one instruction per op, in op order";
        last_op = in.op;
        EXPECT_EQ(in.row_begin % gemv_row_quantum(p.ops()[in.op].m.cols), 0);
        EXPECT_EQ(in.row_end % gemv_row_quantum(p.ops()[in.op].m.cols), 0);
        for (int r = in.row_begin; r < in.row_end; ++r) ++covered[in.op][r];
        ++slices[in.op];
      }
      total += p.block_bytes(b);
      most = std::max(most, p.block_bytes(b));
    }
    for (size_t o = 0; o < p.ops().size(); ++o) {
      EXPECT_EQ(std::count(covered[o].begin(), covered[o].end(), 1), p.ops()[o].m.rows) << "op " << o;
      EXPECT_EQ(slices[o], p.signals_per_step(static_cast<int>(o)));
      const Op& op = p.ops()[o];
      EXPECT_EQ(op.signal, static_cast<int>(o));
      if (op.wait[0] >= 0) {
        EXPECT_EQ(op.wait_count[0], p.signals_per_step(op.wait[0]));
      }
    }
    // Balanced to within one slice quantum of each op (4 rows of 2048 or 2 of 4096 columns, ~5 KB each).
    const double mean = static_cast<double>(total) / n_blocks;
    EXPECT_LE(static_cast<double>(most), mean + 6 * 5000.0);
  }
}

// The timeline by label: made-up marks of two blocks over three ops (two labelled "in", one unlabelled gemv); the
// shares are the critical path op by op and add up to the span.
TEST(MkProgram, TimelineByLabelAddsUpToTheSpan) {
  float* act = reinterpret_cast<float*>(uintptr_t{1} << 20);
  Program p;
  auto a = p.add_gemv(fake_matrix(64, 2048, 0x10000), act, act, {}, act);
  auto b = p.add_gemv(fake_matrix(64, 2048, 0x10000), act, act, {*a});
  auto c = p.add_gemv(fake_matrix(64, 2048, 0x10000), act, act, {*b});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  p.label_op(*a, "in");
  p.label_op(*c, "in");
  EXPECT_EQ(p.label_of(*b), "gemv");
  ASSERT_TRUE(p.schedule(2).ok());
  EXPECT_EQ(p.summarize_trace_by_label({}), "no timeline\n");
  // Per instruction: start, ready, x built, pages done, synced, signalled (ns), page wait.
  std::vector<unsigned long long> marks(p.instrs().size() * kTraceMarks, 0);
  for (size_t i = 0; i < p.instrs().size(); ++i) {
    const int op = p.instrs()[i].op;
    const unsigned long long t = 1000 + 10000ull * op + 1000 * (i % 2);  // op o done by 1000 + 10,000 (o + 1) (+1,000)
    unsigned long long* m = &marks[i * kTraceMarks];
    m[0] = t, m[1] = t + 2000, m[2] = t + 3000, m[3] = t + 9000, m[4] = t + 9000, m[5] = t + 10000;
  }
  double span = 0;
  const std::string t = p.summarize_trace_by_label(marks, &span);
  // The last instruction signals at 1000 + 20,000 + 1,000 + 10,000 = 32,000 ns; the first starts at 1,000.
  EXPECT_DOUBLE_EQ(span, 31.0) << t;
  EXPECT_NE(t.find("in                2       4     2.00    1.00      6.00       21.0   67.7"), std::string::npos) << t;
  EXPECT_NE(t.find("gemv              1       2     2.00    1.00      6.00       10.0   32.3"), std::string::npos) << t;
  EXPECT_NE(t.find("step span 31.0 us"), std::string::npos) << t;
}

TEST(MkProgram, RefusesWhatTheKernelCannotRun) {
  float* act = reinterpret_cast<float*>(uintptr_t{1} << 20);
  Program p;
  EXPECT_FALSE(p.add_gemv(fake_matrix(64, 1024, 0x10000), act, act, {}).ok()) << "1024 columns";
  EXPECT_FALSE(p.add_gemv(fake_matrix(66, 2048, 0x10000), act, act, {}).ok()) << "rows not a multiple of 4";
  EXPECT_FALSE(p.add_gemv(fake_matrix(64, 2048, 0x10008), act, act, {}).ok()) << "misaligned weights";
  EXPECT_FALSE(p.add_gemv(fake_matrix(64, 2048, 0x10000), act, act, {0}).ok()) << "waits on itself";
  EXPECT_FALSE(p.add_gated_gemv(fake_matrix(64, 2048, 0x10000), act, act, act, act, {}).ok()) << "gated: 2048 columns";
  EXPECT_FALSE(p.add_gated_gemv(fake_matrix(64, 4096, 0x10000), act, nullptr, act, act, {}).ok()) << "gated: no z";
  EXPECT_FALSE(p.add_gated_gemv(fake_matrix(64, 4096, 0x10000), act, act + 1, act, act, {}).ok()) << "gated: z misaligned";
  EXPECT_FALSE(p.schedule(4).ok()) << "no ops";
  ASSERT_TRUE(p.add_gemv(fake_matrix(64, 2048, 0x10000), act, act, {}).ok());
  EXPECT_FALSE(p.schedule(0).ok());
  // A gated out-projection: the flag and the gate's address reach the op; its rows are cut like any gemv's.
  auto gated = p.add_gated_gemv(fake_matrix(2048, 4096, 0x20000), act, act + 4, act + 8, act, {0}, act);
  ASSERT_TRUE(gated.ok()) << gated.status().message();
  const Op& op = p.ops()[static_cast<size_t>(*gated)];
  EXPECT_EQ(op.flags, kGatedNorm | kResidual);
  EXPECT_EQ(op.gate, act + 4);
  EXPECT_EQ(op.norm_w, act + 8);
  ASSERT_TRUE(p.schedule(7).ok());
  EXPECT_EQ(p.signals_per_step(*gated), 7u);
}

// The Gated DeltaNet step's units are a head's 32-column blocks: 32 heads give 128 units, each in exactly one
// instruction, at most one instruction a block.
TEST(MkProgram, GdnHeadsAreColumnBlockUnits) {
  float* f = reinterpret_cast<float*>(uintptr_t{1} << 20);
  GdnArgs g;
  g.proj = g.conv_w = g.A_log = g.dt_bias = f;
  g.conv_ring = g.S = f;
  g.pos = reinterpret_cast<const int*>(f);
  for (int n_blocks : {7, 132}) {
    SCOPED_TRACE(n_blocks);
    Program p;
    auto op = p.add_gdn_heads(g, f, -1);
    ASSERT_TRUE(op.ok()) << op.status().message();
    ASSERT_TRUE(p.schedule(n_blocks).ok());
    EXPECT_EQ(p.ops()[0].m.rows, 32 * kGdnDim / kGdnCols);
    EXPECT_EQ(p.signals_per_step(0), static_cast<uint32_t>(std::min(n_blocks, 128)));
    std::vector<int> covered(128, 0);
    for (const Instr& in : p.instrs()) {
      for (int u = in.row_begin; u < in.row_end; ++u) ++covered[u];
      EXPECT_EQ(instr_weight_bytes(p.ops()[0], in), static_cast<size_t>(in.row_end - in.row_begin) * kGdnDim * kGdnCols * 4);
    }
    EXPECT_EQ(std::count(covered.begin(), covered.end(), 1), 128);
  }
  GdnArgs bad = g;
  bad.S = nullptr;
  EXPECT_FALSE(Program().add_gdn_heads(bad, f, -1).ok()) << "no state";
}

// ---- on the GPU ----------------------------------------------------------------------------------------------

// A layer of the projection chain: proj = W_in RMSNorm(h) * norm_w; h = h + W_out proj[0:4096].
struct ChainLayer {
  HostQMatrix w_in, w_out;
  std::vector<float> norm_w;
  QMatrix d_in, d_out;
  DeviceBuffer<float> d_norm, d_proj;
};

struct Chain {
  std::vector<std::unique_ptr<ChainLayer>> layers;
  DeviceBuffer<float> h;
  std::vector<float> h0;

  Chain(int n_layers, int in_rows, uint32_t seed) {
    h0 = test::random_vector(2048, seed);
    h = DeviceBuffer<float>(h0);
    for (int l = 0; l < n_layers; ++l) {
      auto L = std::make_unique<ChainLayer>();
      L->w_in = test::random_qmatrix(in_rows, 2048, 4, seed + 10 * l + 1);
      L->w_out = test::random_qmatrix(2048, 4096, 4, seed + 10 * l + 2);
      L->norm_w = test::random_vector(2048, seed + 10 * l + 3, 0.1f, 1.0f);
      L->d_in = L->w_in.upload();
      L->d_out = L->w_out.upload();
      L->d_norm = DeviceBuffer<float>(L->norm_w);
      L->d_proj = DeviceBuffer<float>(static_cast<size_t>(in_rows));
      layers.push_back(std::move(L));
    }
  }

  Result<Program> program(int n_blocks) {
    Program p;
    int prev = -1;
    for (auto& L : layers) {
      std::vector<int> waits;
      if (prev >= 0) waits.push_back(prev);
      ASSIGN_OR_RETURN(const int in, p.add_gemv(L->d_in, h.get(), L->d_proj.get(), waits, L->d_norm.get()));
      ASSIGN_OR_RETURN(prev, p.add_gemv(L->d_out, L->d_proj.get(), h.get(), {in}, nullptr, 1e-6f, h.get()));
    }
    RETURN_IF_ERROR(p.schedule(n_blocks));
    return p;
  }

  // One step on the CPU in double; returns for each row of h the sum of |terms| of its last update (the scale of
  // its rounding).
  std::vector<double> reference_step(std::vector<double>& href) const {
    std::vector<double> scale(2048, 0.0);
    for (const auto& L : layers) {
      double ss = 0;
      for (double v : href) ss += v * v;
      const double inv = 1.0 / std::sqrt(ss / 2048 + 1e-6);
      std::vector<double> x(2048), proj(L->w_in.rows);
      for (int c = 0; c < 2048; ++c) x[c] = href[c] * inv * L->norm_w[c];
      for (int r = 0; r < L->w_in.rows; ++r) {
        double acc = 0;
        for (int c = 0; c < 2048; ++c) acc += static_cast<double>(L->w_in.dequant(r, c)) * x[c];
        proj[r] = acc;
      }
      for (int r = 0; r < 2048; ++r) {
        double acc = 0, abs_sum = 0;
        for (int c = 0; c < 4096; ++c) {
          const double t = static_cast<double>(L->w_out.dequant(r, c)) * proj[c];
          acc += t, abs_sum += std::fabs(t);
        }
        href[r] += acc;
        scale[r] = abs_sum + std::fabs(href[r]);
      }
    }
    return scale;
  }
};

std::vector<std::vector<float>> run_steps(Chain& chain, int n_blocks, int steps) {
  auto program = chain.program(n_blocks);
  EXPECT_TRUE(program.ok()) << program.status().message();
  if (!program.ok()) return {};
  auto d = DeviceProgram::upload(*program);
  EXPECT_TRUE(d.ok()) << d.status().message();
  if (!d.ok()) return {};
  EXPECT_EQ(chain.h.upload(chain.h0), cudaSuccess);
  std::vector<std::vector<float>> out;
  for (int s = 0; s < steps; ++s) {
    EXPECT_EQ((*d)->launch(nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    out.push_back(chain.h.download());
  }
  auto counters = (*d)->counters();
  EXPECT_TRUE(counters.ok());
  for (size_t i = 0; counters.ok() && i < counters->size(); ++i) {
    EXPECT_EQ((*counters)[i], static_cast<unsigned long long>(steps) * program->signals_per_step(static_cast<int>(i)))
        << "counter " << i << " after " << steps << " steps";
  }
  return out;
}

// Three steps of a two-layer chain at the model's shapes (12352 x 2048 in, 2048 x 4096 out): every step against
// the CPU reference; the same bits on 1, 7 and all SMs (a row's arithmetic does not depend on the slicing; 1 and
// 7 blocks run ~300 and ~45 pages each through the 5-page ring) and on a second run.
TEST(MkStep, GemvChainMatchesCpuOnAnyGrid) {
  SKIP_WITHOUT_STEP();
  Chain chain(2, 12352, 7001);
  const int steps = 3;
  const auto full = run_steps(chain, device_sms(), steps);
  ASSERT_EQ(full.size(), static_cast<size_t>(steps));
  std::vector<double> href(chain.h0.begin(), chain.h0.end());
  for (int s = 0; s < steps; ++s) {
    const std::vector<double> scale = chain.reference_step(href);
    int bad = 0;
    for (int r = 0; r < 2048; ++r) {
      const double tol = 3e-5 * scale[r] * (s + 1) + 1e-5;
      if (!(std::fabs(full[s][r] - href[r]) <= tol) && bad++ < 5)
        ADD_FAILURE() << "step " << s << " row " << r << ": got " << full[s][r] << " want " << href[r];
    }
    EXPECT_EQ(bad, 0) << "step " << s;
  }
  for (int n_blocks : {1, 7, device_sms()}) {
    const auto again = run_steps(chain, n_blocks, steps);
    ASSERT_EQ(again.size(), full.size());
    for (int s = 0; s < steps; ++s) EXPECT_EQ(again[s], full[s]) << n_blocks << " blocks, step " << s;
  }
}

// The same chain through the kernel-per-op gemv: equal within rounding (the two sum in other orders).
TEST(MkStep, GemvChainMatchesKernelChain) {
  SKIP_WITHOUT_STEP();
  Chain chain(3, 4096 + 64, 7002);
  const auto mk_h = run_steps(chain, device_sms(), 1);
  ASSERT_EQ(mk_h.size(), 1u);
  ASSERT_EQ(chain.h.upload(chain.h0), cudaSuccess);
  for (auto& L : chain.layers) {
    GemvParams in{L->d_in, chain.h.get(), GemvPrologue::rms_norm, L->d_norm.get(), nullptr, 0, 1e-6f, nullptr,
                  L->d_proj.get()};
    ASSERT_EQ(gemv(in, nullptr), cudaSuccess);
    GemvParams out{L->d_out, L->d_proj.get(), GemvPrologue::none, nullptr, nullptr, 0, 1e-6f, chain.h.get(),
                   chain.h.get()};
    ASSERT_EQ(gemv(out, nullptr), cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> chain_h = chain.h.download();
  double worst = 0, norm = 0;
  for (int r = 0; r < 2048; ++r) worst = std::max(worst, std::fabs(double(chain_h[r]) - mk_h[0][r]));
  for (float v : chain_h) norm = std::max(norm, std::fabs(double(v)));
  std::printf("megakernel vs gemv chain: max |diff| %.3g of max |h| %.3g\n", worst, norm);
  EXPECT_LE(worst, test_util::kChainX16 * norm);
}

// ---- timing (prints, asserts nothing) ------------------------------------------------------------------------

// The 30 Gated DeltaNet layers' projections of one step (in 12352 x 2048 with RMSNorm, out 2048 x 4096 with the
// residual): 569 MB. The chain: 60 gemv launches in a graph (programmatic dependent launch); the megakernel: one
// launch. Floor at 4.27 TB/s: 133 us.
TEST(MkStepBench, GdnProjectionChain) {
  SKIP_WITHOUT_STEP();
  const int n_layers = 30;
  const DeviceBuffer<uint16_t> pool = test::bench_pool(size_t{600} << 20);
  Carver carve{pool};
  std::vector<QMatrix> w_in, w_out;
  for (int l = 0; l < n_layers; ++l) w_in.push_back(carve.next(12352, 2048)), w_out.push_back(carve.next(2048, 4096));
  ASSERT_LE(carve.offset, pool.size() * 2);
  DeviceBuffer<float> h(test::random_vector(2048, 3)), proj(12352), norm_w(test::random_vector(2048, 4, 0.1f, 1.0f));
  double bytes = 0;
  for (int l = 0; l < n_layers; ++l) bytes += static_cast<double>(w_in[l].bytes() + w_out[l].bytes());

  auto chain = [&](int, cudaStream_t stream) {
    for (int l = 0; l < n_layers; ++l) {
      GemvParams in{w_in[l], h.get(), GemvPrologue::rms_norm, norm_w.get(), nullptr, 0, 1e-6f, nullptr, proj.get()};
      CUDA_TRY(gemv(in, stream));
      GemvParams out{w_out[l], proj.get(), GemvPrologue::none, nullptr, nullptr, 0, 1e-6f, h.get(), h.get()};
      CUDA_TRY(gemv(out, stream));
    }
    return cudaSuccess;
  };
  std::printf("\n");
  test::print_bandwidth("gemv chain, 60 launches (graph)", test::graph_time_us(chain, 10), bytes);

  struct Variant {
    int n_blocks;
    bool hot;  // every layer reads layer 0's weights (19 MB: L2-resident): is the publication latency DRAM load?
  };
  const int sms = device_sms();
  const Variant variants[] = {{sms, false}, {sms - 4, false}, {sms, true}};
  for (const Variant& v : variants) {
    Program p;
    int prev = -1;
    for (int l = 0; l < n_layers; ++l) {
      const int wl = v.hot ? 0 : l;
      auto in = p.add_gemv(w_in[wl], h.get(), proj.get(), prev < 0 ? std::vector<int>{} : std::vector<int>{prev},
                           norm_w.get());
      ASSERT_TRUE(in.ok()) << in.status().message();
      auto out = p.add_gemv(w_out[wl], proj.get(), h.get(), {*in}, nullptr, 1e-6f, h.get());
      ASSERT_TRUE(out.ok());
      prev = *out;
    }
    ASSERT_TRUE(p.schedule(v.n_blocks).ok());
    auto d = DeviceProgram::upload(p);
    ASSERT_TRUE(d.ok()) << d.status().message();
    const DeviceProgram& prog = **d;
    auto mk = [&](int, cudaStream_t stream) { return prog.launch(stream); };
    char name[80];
    std::snprintf(name, sizeof name, "megakernel, 1 launch, %d blocks%s", v.n_blocks, v.hot ? ", L2-hot weights" : "");
    test::print_bandwidth(name, test::graph_time_us(mk, 10), bytes);
    if (v.n_blocks == sms && !v.hot) {  // the timeline of one more step (its first 6 ops and the last)
      ASSERT_TRUE((*d)->enable_trace().ok());
      ASSERT_EQ(prog.launch(nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto marks = (*d)->trace();
      ASSERT_TRUE(marks.ok());
      const std::string t = p.summarize_trace(*marks);
      size_t cut = 0;
      for (int line = 0; line < 7 && cut != std::string::npos; ++line) cut = t.find('\n', cut + 1);
      std::printf("%s...\n%s", t.substr(0, cut + 1).c_str(), t.substr(t.rfind('\n', t.size() - 2) + 1).c_str());
    }
  }
}

// The interpreter's cost of one dependency level without bytes: 100 dependent gemv ops of 528 x 2048 (4 rows an SM,
// 0.6 MB an op, L2-resident after the first step) with and without the RMSNorm prologue. Per op: the counter wait,
// the x prologue, one page's dot products and the publication; the whole step's ~250 levels multiply it.
TEST(MkStepBench, LevelLatency) {
  SKIP_WITHOUT_STEP();
  constexpr int kOps = 100, kRows = 528;
  const DeviceBuffer<uint16_t> pool = test::bench_pool(size_t{16} << 20, 31);
  Carver carve{pool};
  const QMatrix w = carve.next(kRows, 2048);
  DeviceBuffer<float> a(test::random_vector(2048, 32)), b(test::random_vector(2048, 33));
  DeviceBuffer<float> norm_w(test::random_vector(2048, 34, 0.1f, 1.0f));
  std::printf("\n");
  for (bool norm : {false, true}) {
    Program p;
    int prev = -1;
    for (int o = 0; o < kOps; ++o) {  // a -> b -> a ...: rows 0..527 of the 2048 inputs
      float* in = o % 2 ? b.get() : a.get();
      float* out = o % 2 ? a.get() : b.get();
      auto id = p.add_gemv(w, in, out, prev < 0 ? std::vector<int>{} : std::vector<int>{prev},
                           norm ? norm_w.get() : nullptr);
      ASSERT_TRUE(id.ok()) << id.status().message();
      prev = *id;
    }
    ASSERT_TRUE(p.schedule(device_sms()).ok());
    auto d = DeviceProgram::upload(p);
    ASSERT_TRUE(d.ok());
    const double us = test::graph_time_us([&](int, cudaStream_t s) { return (*d)->launch(s); }, 10);
    std::printf("%d dependent ops, 4 rows an SM, fp32 x%s: %.1f us a step, %.2f us an op\n", kOps,
                norm ? ", RMSNorm prologue" : "", us, us / kOps);
    if (norm) test_util::print_timeline(p, **d, 4);
  }
}

}  // namespace
}  // namespace lily::cuda::mk
