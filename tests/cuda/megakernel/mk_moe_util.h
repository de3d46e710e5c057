// A MoE block's weights carved from a benchmark pool (test::bench_qmatrix), its chain launches in the decode
// graph's mode (moe_route without top-k, the expert kernels select) and its megakernel ops: shared by the MoE and
// the whole-layer benchmarks.
#pragma once
#include <cuda_runtime.h>

#include "../kernels/cuda_test_util.h"
#include "cuda/kernels/moe.cuh"
#include "cuda/megakernel/program.h"

namespace lily::cuda::mk::test_util {

struct BenchMoe {
  static constexpr int E = 256, H = 2048, I = 512, K = 8;
  QMatrix router, gate, up, down, s_gate, s_up, s_down;  // router: 8-bit [E + 1, H] (the shared gate's row last)
  test::DeviceBuffer<float> logits{E + 1};

  BenchMoe(const test::DeviceBuffer<uint16_t>& pool, int layer) {
    router = test::bench_qmatrix(pool, E + 1, H, 8, 100 + layer);
    gate = test::bench_qmatrix(pool, E * I, H, 4, 3 * layer), up = test::bench_qmatrix(pool, E * I, H, 4, 3 * layer + 1);
    down = test::bench_qmatrix(pool, E * H, I, 4, 3 * layer + 2);
    gate.rows = up.rows = I, down.rows = H;
    s_gate = test::bench_qmatrix(pool, I, H, 4, 500 + 3 * layer), s_up = test::bench_qmatrix(pool, I, H, 4, 501 + 3 * layer);
    s_down = test::bench_qmatrix(pool, H, I, 4, 502 + 3 * layer);
  }
  double bytes() const { return static_cast<double>(router.bytes()) + (K + 1) * (2.0 * gate.bytes() + down.bytes()); }
  MoeArgs args() const {
    MoeArgs a;
    a.gate = gate, a.up = up, a.down = down, a.s_gate = s_gate, a.s_up = s_up, a.s_down = s_down;
    a.n_experts = E, a.top_k = K, a.inter = I;
    return a;
  }
  // Scratch of the chain's kernels, shared by every layer.
  struct Scratch {
    test::DeviceBuffer<float> x{H}, w{K}, sg{1}, act{(K + 1) * I};
    test::DeviceBuffer<int> idx{K};
    test::DeviceBuffer<unsigned> counter{1};
    Scratch() { (void)counter.zero(); }
  };
  cudaError_t chain(float* h, const float* norm_w, Scratch& s, cudaStream_t stream) const {
    QMatrix rows = router, sgate = router;
    rows.rows = E, sgate.rows = 1;
    sgate.w += static_cast<size_t>(E) * sgate.words_per_row();
    sgate.scales += static_cast<size_t>(E) * sgate.groups_per_row();
    sgate.biases += static_cast<size_t>(E) * sgate.groups_per_row();
    MoeRouteParams rp;
    rp.router = rows, rp.shared_gate = sgate, rp.h = h, rp.norm_w = norm_w, rp.top_k = K, rp.x = s.x.get();
    rp.logits = logits.get(), rp.counter = s.counter.get(), rp.shared_gate_value = s.sg.get();
    rp.select_top_k = false;
    MoeExpertInParams ip;
    ip.gate = gate, ip.up = up, ip.shared_gate = s_gate, ip.shared_up = s_up, ip.x = s.x.get();
    ip.topk_idx = s.idx.get(), ip.top_k = K, ip.act = s.act.get(), ip.router_logits = logits.get();
    ip.n_experts = E, ip.topk_idx_out = s.idx.get(), ip.topk_w_out = s.w.get();
    MoeExpertOutParams op;
    op.down = down, op.shared_down = s_down, op.act = s.act.get(), op.topk_idx = s.idx.get(), op.topk_w = s.w.get();
    op.shared_gate_value = s.sg.get(), op.top_k = K, op.h = h;
    CUDA_TRY(moe_route(rp, stream));
    CUDA_TRY(moe_expert_in(ip, stream));
    return moe_expert_out(op, stream);
  }
  Result<int> add_to(Program& p, float* h, const float* norm_w, float* act, int h_op) const {
    return p.add_moe(router, args(), h, norm_w, logits.get(), act, h_op);
  }
};

}  // namespace lily::cuda::mk::test_util
