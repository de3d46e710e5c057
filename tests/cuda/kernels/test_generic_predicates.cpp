// The *_fast_supported predicates (generic.cuh) against what the fast launchers really accept, on the tiny, small
// and full geometries and shapes just outside the fast kernels' range: predicate(p) must equal
// (fast(p) == cudaSuccess), and every shape the fast launcher takes must be taken by the generic one too. Inputs
// are zeroed scratch memory (position 0, expert 0, counter 0) and random quantized weights: only acceptance and
// clean completion are checked here (the numbers are in test_generic.cpp and test_generic_fast.cpp).
#include <string>
#include <vector>

#include "cuda/kernels/generic.cuh"
#include "cuda_test_util.h"

namespace lily::cuda::test {
namespace {

constexpr size_t kSlotFloats = size_t{2} << 20;  // 8 MiB a slot: the largest buffer is a full GDN state (2 MiB)
constexpr int kSlots = 20;

struct Scratch {
  DeviceBuffer<float> f{kSlots * kSlotFloats};
  DeviceBuffer<uint16_t> pool = bench_pool(size_t{32} << 20);
  float* slot(int i) const { return f.get() + static_cast<size_t>(i) * kSlotFloats; }
  int* islot(int i) const { return reinterpret_cast<int*>(slot(i)); }
  __nv_bfloat16* bslot(int i) const { return reinterpret_cast<__nv_bfloat16*>(slot(i)); }
  QMatrix q(int rows, int cols, int bits, size_t copy = 0) const { return bench_qmatrix(pool, rows, cols, bits, copy); }
};
// Read-only slots: 0 (activations in), 1 (norm weights), 5 (positions and expert ids: zero). Each output has its
// own slot, so no launch changes another's inputs.

template <class P>
void check(const std::string& what, const P& p, bool (*supported)(const P&), cudaError_t (*fast)(const P&, cudaStream_t),
           cudaError_t (*generic)(const P&, cudaStream_t)) {
  SCOPED_TRACE(what);
  const bool pred = supported(p);
  const cudaError_t err = fast(p, nullptr);
  EXPECT_TRUE(err == cudaSuccess || err == cudaErrorInvalidValue) << cudaGetErrorString(err);
  EXPECT_EQ(pred, err == cudaSuccess) << "predicate " << pred << ", fast launcher: " << cudaGetErrorString(err);
  if (err == cudaSuccess) {
    EXPECT_EQ(generic(p, nullptr), cudaSuccess) << "the generic path must cover the fast one";
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(CudaGenericPredicates, MirrorFastLaunchers) {
  SKIP_WITHOUT_GPU();
  Scratch s;
  ASSERT_NE(s.f.get(), nullptr);
  ASSERT_CUDA(s.f.zero());

  struct GemvShape {
    int cols, bits;
    GemvPrologue prologue;
    int head_dim;
    bool misaligned;
  };
  for (const GemvShape& g : std::vector<GemvShape>{{128, 4, GemvPrologue::rms_norm, 0, false},
                                                   {256, 4, GemvPrologue::gated_rms_norm, 64, false},
                                                   {512, 4, GemvPrologue::none, 0, false},
                                                   {1024, 4, GemvPrologue::rms_norm, 0, false},
                                                   {1536, 4, GemvPrologue::none, 0, false},
                                                   {2048, 8, GemvPrologue::rms_norm, 0, false},
                                                   {4096, 4, GemvPrologue::gated_rms_norm, 128, false},
                                                   {4096, 4, GemvPrologue::gated_rms_norm, 96, false},
                                                   {2048, 4, GemvPrologue::none, 0, true},
                                                   {24576, 4, GemvPrologue::none, 0, false}}) {
    GemvParams p;
    p.m = s.q(300, g.cols, g.bits);
    if (g.misaligned) p.m.w += 1;  // 4-byte aligned only
    p.in = s.slot(0), p.prologue = g.prologue, p.norm_w = s.slot(1), p.gate_z = s.slot(0), p.head_dim = g.head_dim;
    p.y = s.slot(3);
    check("gemv cols " + std::to_string(g.cols) + " bits " + std::to_string(g.bits) + " head_dim " +
              std::to_string(g.head_dim) + (g.misaligned ? " misaligned" : ""),
          p, gemv_fast_supported, gemv, gemv_generic);
  }

  struct MoeShape {
    int E, H, I, k;
  };
  for (const MoeShape& m : std::vector<MoeShape>{
           {16, 128, 64, 4}, {32, 1024, 256, 8}, {256, 2048, 512, 8}, {2000, 512, 768, 8}, {32, 1024, 256, 17},
           {16, 1536, 512, 4}, {16, 2048, 1024, 8}, {16, 4096, 512, 16}}) {
    const std::string shape = " E " + std::to_string(m.E) + " H " + std::to_string(m.H) + " I " + std::to_string(m.I) +
                              " k " + std::to_string(m.k);
    MoeRouteParams rp;
    rp.router = s.q(m.E, m.H, 8), rp.shared_gate = s.q(1, m.H, 8, 1), rp.h = s.slot(0), rp.norm_w = s.slot(1);
    rp.top_k = m.k, rp.x = s.slot(2), rp.logits = s.slot(3), rp.counter = reinterpret_cast<unsigned*>(s.slot(4));
    rp.topk_idx = s.islot(15), rp.topk_w = s.slot(6), rp.shared_gate_value = s.slot(7);
    check("moe_route" + shape, rp, moe_fast_supported, moe_route, moe_route_generic);
    MoeExpertInParams ip;  // a stack of one expert: the expert ids are all 0
    ip.gate = s.q(m.I, m.H, 4), ip.up = s.q(m.I, m.H, 4, 1), ip.shared_gate = s.q(m.I, m.H, 4, 2);
    ip.shared_up = s.q(m.I, m.H, 4, 3), ip.x = s.slot(0), ip.topk_idx = s.islot(5), ip.top_k = m.k, ip.act = s.slot(8);
    check("moe_expert_in" + shape, ip, moe_fast_supported, moe_expert_in, moe_expert_in_generic);
    ip.shared_gate.rows = m.I / 2;  // Is != I: neither kernel takes it
    check("moe_expert_in Is != I" + shape, ip, moe_fast_supported, moe_expert_in, moe_expert_in_generic);
    MoeExpertOutParams op;
    op.down = s.q(m.H, m.I, 4), op.shared_down = s.q(m.H, m.I, 4, 1), op.act = s.slot(8), op.topk_idx = s.islot(5);
    op.topk_w = s.slot(1), op.shared_gate_value = s.slot(1), op.top_k = m.k, op.h = s.slot(9);
    check("moe_expert_out" + shape, op, moe_fast_supported, moe_expert_out, moe_expert_out_generic);
  }

  struct AttnShape {
    int nq, nkv, D, rot, n_splits;
    bool misaligned_q;
  };
  for (const AttnShape& a : std::vector<AttnShape>{{4, 2, 64, 16, 66, false},
                                                   {8, 1, 256, 64, 66, false},
                                                   {16, 2, 256, 64, 66, false},
                                                   {16, 1, 256, 64, 3, false},
                                                   {4, 2, 80, 16, 3, false},
                                                   {4, 2, 2048, 64, 1, false},
                                                   {16, 2, 256, 64, 66, true},
                                                   {4, 2, 64, 15, 5000, false}}) {
    const std::string shape = " nq " + std::to_string(a.nq) + " nkv " + std::to_string(a.nkv) + " D " +
                              std::to_string(a.D) + " rot " + std::to_string(a.rot) + " splits " +
                              std::to_string(a.n_splits) + (a.misaligned_q ? " misaligned q" : "");
    const AttnPrepParams pp{s.slot(0), s.slot(1), s.slot(1), a.nq, a.nkv, a.D, a.rot, 1e7f, 1e-6f,
                            s.islot(5), s.slot(10), s.bslot(11), s.bslot(12)};
    check("attn_prep" + shape, pp, attn_fast_supported, attn_prep, attn_prep_generic);
    const AttnDecodeParams dp{s.slot(10) + (a.misaligned_q ? 1 : 0), s.bslot(11), s.bslot(12), a.nq, a.nkv, a.D,
                              s.islot(5), a.n_splits, 0.0625f, s.slot(13), s.slot(14)};
    check("attn_decode" + shape, dp, attn_fast_supported, attn_decode, attn_decode_generic);
    const AttnCombineParams cp{s.slot(13), s.slot(14), a.n_splits, a.nq, a.D, s.slot(0), s.slot(16)};
    check("attn_combine" + shape, cp, attn_fast_supported, attn_combine, attn_combine_generic);
  }

  struct GdnShape {
    int n_k, n_v, d_k, d_v, kernel;
  };
  for (const GdnShape& g : std::vector<GdnShape>{
           {2, 4, 64, 64, 4}, {8, 16, 128, 128, 4}, {16, 32, 128, 128, 4}, {16, 32, 128, 48, 4}, {16, 32, 128, 128, 3},
           {16, 24, 128, 128, 4}}) {
    const GdnStepParams p{s.slot(0), s.slot(17), s.slot(1), s.slot(1), s.slot(1), s.slot(18), s.islot(5),
                          g.n_k, g.n_v, g.d_k, g.d_v, g.kernel, s.slot(19)};
    check("gdn_step n_k " + std::to_string(g.n_k) + " n_v " + std::to_string(g.n_v) + " d_k " + std::to_string(g.d_k) +
              " d_v " + std::to_string(g.d_v) + " kernel " + std::to_string(g.kernel),
          p, gdn_fast_supported, gdn_step, gdn_step_generic);
  }
}

}  // namespace
}  // namespace lily::cuda::test
