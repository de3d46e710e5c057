// Prints the time of the generic kernels on the small and tiny synthetic geometries, next to the fast kernels
// where they take the shape (CUDA-graph replay, random weights, asserts nothing about speed). For deciding
// whether the generic path is good enough for the synthetic presets, not a target.
#include <cstdio>
#include <vector>

#include "cuda/kernels/generic.cuh"
#include "generic_refs.h"

namespace lily::cuda::test {
namespace {

TEST(CudaGenericTiming, SmallAndTinyGeometry) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer<uint16_t> pool = bench_pool(size_t{192} << 20);
  constexpr size_t kSlot = size_t{1} << 20;
  DeviceBuffer<float> f(16 * kSlot);  // zeroed activations; positions, expert ids and the counter are 0
  ASSERT_CUDA(f.zero());
  auto slot = [&](int i) { return f.get() + i * kSlot; };
  auto islot = [&](int i) { return reinterpret_cast<int*>(slot(i)); };
  auto q = [&](int rows, int cols, int bits, size_t copy) { return bench_qmatrix(pool, rows, cols, bits, copy); };
  auto line = [](const char* what, double us, double bytes) {
    if (us > 0) print_bandwidth(what, us, bytes);
    else ADD_FAILURE() << what << ": launch failed";
  };
  printf("[generic timing] name, time per launch, bytes of weights/state, bandwidth\n");

  for (const Geometry& g : {kSmall, kTiny}) {
    printf("-- %s\n", g.name);
    GemvParams gp;
    gp.m = q(151936, g.hidden, 4, 0);
    gp.in = slot(0), gp.prologue = GemvPrologue::rms_norm, gp.norm_w = slot(1), gp.y = slot(2);
    const double lm_bytes = static_cast<double>(gp.m.bytes());
    line("gemv_generic lm_head", graph_time_us([&](int, cudaStream_t s) { return gemv_generic(gp, s); }, 20), lm_bytes);
    if (gemv_fast_supported(gp)) line("gemv (fast) lm_head", graph_time_us([&](int, cudaStream_t s) { return gemv(gp, s); }, 20), lm_bytes);
    gp.m = q(g.gdn_proj(), g.hidden, 4, 0);
    line("gemv_generic gdn in_proj", graph_time_us([&](int i, cudaStream_t s) { gp.m = q(g.gdn_proj(), g.hidden, 4, i); return gemv_generic(gp, s); }, 40),
         static_cast<double>(gp.m.bytes()));

    MoeRouteParams rp;
    rp.router = q(g.n_experts, g.hidden, 8, 0), rp.shared_gate = q(1, g.hidden, 8, 1), rp.h = slot(0);
    rp.norm_w = slot(1), rp.top_k = g.top_k, rp.x = slot(3), rp.logits = slot(4);
    rp.counter = reinterpret_cast<unsigned*>(slot(5)), rp.topk_idx = islot(6), rp.topk_w = slot(7);
    rp.shared_gate_value = slot(8);
    const double route_bytes = static_cast<double>(rp.router.bytes() + rp.shared_gate.bytes());
    line("moe_route_generic", graph_time_us([&](int, cudaStream_t s) { return moe_route_generic(rp, s); }, 40), route_bytes);
    if (moe_fast_supported(rp)) line("moe_route (fast)", graph_time_us([&](int, cudaStream_t s) { return moe_route(rp, s); }, 40), route_bytes);
    MoeExpertInParams ip;  // expert ids 0 (zeroed): one stacked expert
    ip.gate = q(g.inter, g.hidden, 4, 0), ip.up = q(g.inter, g.hidden, 4, 1), ip.shared_gate = q(g.inter, g.hidden, 4, 2);
    ip.shared_up = q(g.inter, g.hidden, 4, 3), ip.x = slot(3), ip.topk_idx = islot(9), ip.top_k = g.top_k, ip.act = slot(10);
    const double in_bytes = (g.top_k + 1) * 2.0 * ip.gate.bytes();
    line("moe_expert_in_generic", graph_time_us([&](int, cudaStream_t s) { return moe_expert_in_generic(ip, s); }, 40), in_bytes);
    if (moe_fast_supported(ip)) line("moe_expert_in (fast)", graph_time_us([&](int, cudaStream_t s) { return moe_expert_in(ip, s); }, 40), in_bytes);
    MoeExpertOutParams op;
    op.down = q(g.hidden, g.inter, 4, 0), op.shared_down = q(g.hidden, g.inter, 4, 1), op.act = slot(10);
    op.topk_idx = islot(9), op.topk_w = slot(1), op.shared_gate_value = slot(1), op.top_k = g.top_k, op.h = slot(11);
    const double out_bytes = (g.top_k + 1) * static_cast<double>(op.down.bytes());
    line("moe_expert_out_generic", graph_time_us([&](int, cudaStream_t s) { return moe_expert_out_generic(op, s); }, 40), out_bytes);

    // Attention at 4096 cached rows (zeros: the time depends only on the row count), 66 splits as the backend.
    DeviceBuffer<uint16_t> kv(size_t{2} * 4096 * g.nkv * g.head_dim);
    ASSERT_CUDA(kv.zero());
    DeviceBuffer<int> pos(std::vector<int>{4095});
    const auto* k_cache = reinterpret_cast<const __nv_bfloat16*>(kv.get());
    const AttnDecodeParams dp{slot(12), k_cache, k_cache + size_t{4096} * g.nkv * g.head_dim, g.nq, g.nkv, g.head_dim,
                              pos.get(), 66, 0.0625f, slot(13), slot(14)};
    const AttnCombineParams cp{slot(13), slot(14), 66, g.nq, g.head_dim, slot(0), slot(15)};
    const double kv_bytes = 4096.0 * g.nkv * g.head_dim * 4;
    line("attn_decode+combine_generic n 4096", graph_time_us([&](int, cudaStream_t s) {
      const cudaError_t e = attn_decode_generic(dp, s);
      return e != cudaSuccess ? e : attn_combine_generic(cp, s);
    }, 20), kv_bytes);
    if (attn_fast_supported(dp)) {
      line("attn_decode+combine (fast) n 4096", graph_time_us([&](int, cudaStream_t s) {
        const cudaError_t e = attn_decode(dp, s);
        return e != cudaSuccess ? e : attn_combine(cp, s);
      }, 20), kv_bytes);
    }

    DeviceBuffer<float> ring(size_t{4} * g.conv_dim()), S(static_cast<size_t>(g.n_v) * g.d_k * g.d_v);
    ASSERT_CUDA(ring.zero());
    ASSERT_CUDA(S.zero());
    const GdnStepParams sp{slot(0), ring.get(), slot(1), slot(1), slot(1), S.get(), islot(9), g.n_k, g.n_v, g.d_k,
                           g.d_v, kConvKernel, slot(15)};
    const double s_bytes = 8.0 * S.size();
    line("gdn_step_generic", graph_time_us([&](int, cudaStream_t s) { return gdn_step_generic(sp, s); }, 40), s_bytes);
    if (gdn_fast_supported(sp)) line("gdn_step (fast)", graph_time_us([&](int, cudaStream_t s) { return gdn_step(sp, s); }, 40), s_bytes);
  }
}

}  // namespace
}  // namespace lily::cuda::test
