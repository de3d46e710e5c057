// l2_prefetch (l2_prefetch.cuh): argument checks, ranges with unaligned or empty interiors, both policies; and a
// probe of what it buys: a 16 MiB device-to-device copy whose source was evicted from the L2 against one whose
// source was prefetched first (printed, not asserted). moe_prefetch_down (moe.cuh): argument checks, and a run
// over a full-geometry stacked down tensor.
#include <gtest/gtest.h>

#include <cstdio>

#include "cuda/kernels/l2_prefetch.cuh"
#include "cuda/kernels/moe.cuh"
#include "cuda_test_util.h"

namespace lily::cuda {
namespace {

using test::DeviceBuffer;

TEST(CudaL2Prefetch, RangesAndArguments) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer<char> buf(size_t{40} << 20);
  ASSERT_NE(buf.get(), nullptr);
  for (bool evict_last : {false, true}) {
    L2PrefetchParams p;
    p.evict_last = evict_last;
    EXPECT_TRUE(p.add(buf.get() + 3, 1000));        // unaligned at both ends
    EXPECT_TRUE(p.add(buf.get(), 0));               // empty
    EXPECT_TRUE(p.add(buf.get() + 17, 14));         // no aligned 16-byte interior
    EXPECT_TRUE(p.add(buf.get(), size_t{40} << 20));  // 1,280 pieces of 32 KiB over 512 threads
    EXPECT_EQ(p.total_bytes(), size_t{1000} + 14 + (size_t{40} << 20));
    ASSERT_CUDA(l2_prefetch(p, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
  }
  ASSERT_CUDA(l2_prefetch(L2PrefetchParams{}, nullptr));  // nothing to do
  L2PrefetchParams null_range;
  null_range.add(nullptr, 16);
  EXPECT_EQ(l2_prefetch(null_range, nullptr), cudaErrorInvalidValue);
  L2PrefetchParams too_many;
  too_many.n = L2PrefetchParams::kMaxRanges + 1;
  EXPECT_EQ(l2_prefetch(too_many, nullptr), cudaErrorInvalidValue);
  // Capacity: 24 ranges; a matrix takes 3 and is refused whole when they do not fit; an absent one takes none.
  L2PrefetchParams full;
  for (int i = 0; i < L2PrefetchParams::kMaxRanges - 2; ++i) EXPECT_TRUE(full.add(buf.get(), 16));
  QMatrix m;
  EXPECT_TRUE(full.add(m));  // m.w == nullptr
  m.w = reinterpret_cast<const uint32_t*>(buf.get());
  m.scales = m.biases = reinterpret_cast<const __nv_bfloat16*>(buf.get());
  m.rows = 64, m.cols = 64;
  EXPECT_FALSE(full.add(m));
  EXPECT_EQ(full.n, L2PrefetchParams::kMaxRanges - 2);
  EXPECT_TRUE(full.add(buf.get(), 16) && full.add(buf.get(), 16));
  EXPECT_FALSE(full.add(buf.get(), 16));
  ASSERT_CUDA(l2_prefetch(full, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
}

TEST(CudaL2PrefetchBench, CopyAfterPrefetch) {
  SKIP_WITHOUT_GPU();
  const size_t n = size_t{16} << 20, flush = size_t{256} << 20;
  DeviceBuffer<char> src(n), dst(n), junk(flush);
  ASSERT_TRUE(src.get() && dst.get() && junk.get());
  ASSERT_CUDA(src.zero());
  cudaEvent_t e0, e1;
  ASSERT_CUDA(cudaEventCreate(&e0));
  ASSERT_CUDA(cudaEventCreate(&e1));
  auto copy_us = [&](int mode) {  // 0: source evicted; 1: prefetched; 2: prefetched with evict_last
    float best = 1e9f;
    for (int rep = 0; rep < 5; ++rep) {
      cudaMemset(junk.get(), rep, flush);  // pushes src out of the 60 MB L2
      if (mode > 0) {
        L2PrefetchParams p;
        p.evict_last = mode == 2;
        p.add(src.get(), n);
        l2_prefetch(p, nullptr);
      }
      cudaDeviceSynchronize();
      cudaEventRecord(e0);
      cudaMemcpyAsync(dst.get(), src.get(), n, cudaMemcpyDeviceToDevice);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      best = std::min(best, ms * 1000);
    }
    return best;
  };
  const float cold = copy_us(0), warm = copy_us(1), warm_last = copy_us(2);
  std::printf("[l2_prefetch] 16 MiB device copy, best of 5: source evicted %.1f us, prefetched %.1f us, prefetched "
              "with evict_last %.1f us\n", cold, warm, warm_last);
  ASSERT_CUDA(cudaGetLastError());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

// Runs without a GPU: every check fails before a launch.
TEST(CudaMoePrefetchDown, RejectsBadArguments) {
  float logits[4] = {};
  uint32_t w[4] = {};
  __nv_bfloat16 sb[4] = {};
  MoePrefetchDownParams p{logits, 8, {}, 256};
  p.down.w = w, p.down.scales = p.down.biases = sb, p.down.rows = 2048, p.down.cols = 512, p.down.bits = 4;
  auto refused = [&](MoePrefetchDownParams q) { return moe_prefetch_down(q, nullptr) == cudaErrorInvalidValue; };
  MoePrefetchDownParams q = p;
  q.logits = nullptr;
  EXPECT_TRUE(refused(q));
  q = p, q.n_experts = 257;  // warp_route_top_k<8>: 256 at most
  EXPECT_TRUE(refused(q));
  q = p, q.top_k = 17;
  EXPECT_TRUE(refused(q));
  q = p, q.top_k = 0;
  EXPECT_TRUE(refused(q));
  q = p, q.down.bits = 8;
  EXPECT_TRUE(refused(q));
  q = p, q.down.cols = 96;  // groups of 64
  EXPECT_TRUE(refused(q));
  q = p, q.down.w = reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(w) + 4);  // not 16-byte aligned
  EXPECT_TRUE(refused(q));
}

TEST(CudaMoePrefetchDown, RunsOnFullGeometry) {
  SKIP_WITHOUT_GPU();
  const int E = 256, H = 2048, I = 512;
  DeviceBuffer<uint32_t> w(size_t{E} * H * I / 8);
  DeviceBuffer<__nv_bfloat16> s(size_t{E} * H * I / 64), b(size_t{E} * H * I / 64);
  std::vector<float> host(E);
  for (int e = 0; e < E; ++e) host[e] = static_cast<float>((e * 37) % E) / E;  // a permutation: no ties
  DeviceBuffer<float> logits(host);
  ASSERT_TRUE(w.get() && s.get() && b.get() && logits.get());
  MoePrefetchDownParams p{logits.get(), 8, {}, E};
  p.down.w = w.get(), p.down.scales = s.get(), p.down.biases = b.get(), p.down.rows = H, p.down.cols = I;
  ASSERT_CUDA(moe_prefetch_down(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace lily::cuda
