// The persistent decode kernel (step.cuh): a loader lane streams pages of weights ahead, eight consumer warps
// wait for their inputs through counters and compute from shared memory.
#include "cuda/kernels/gdn.cuh"
#include "cuda/kernels/moe.cuh"
#include "cuda/kernels/quant_dot.cuh"
#include "cuda/megakernel/step.cuh"

#include <cstring>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LILY_MK_DEVICE 1
#endif

namespace lily::cuda::mk {

namespace {

constexpr int kXFloats = xpad_floats(9 * 512);  // the widest x: moe_out's act, 9 slots of 512
// pages | x (fp32, padded) | block sums | mbarriers
constexpr size_t kSmemBytes = size_t{kPages} * kPageBytes + kXFloats * 4 + 32 * 4 + 2 * kPages * 8;
static_assert((size_t{kPages} * kPageBytes + kXFloats * 4 + 32 * 4) % 8 == 0, "the mbarriers are 8-byte aligned");


#if defined(LILY_MK_DEVICE)

constexpr int kConsumerThreads = 32 * kConsumerWarps;
// Page layout (both widths): 32 KB of packed weights, then 2 KB of scales, then 2 KB of biases.
constexpr int kScalesAt = 32768;
constexpr int kBiasesAt = 34816;
constexpr int kMoeOutWeightsAt = 9 * kMoeOutRowsPerPage * 256;  // after moe_out's 9 slots of 8 down rows
__device__ constexpr int rows_per_page(int cols, int bits) { return bits == 4 && cols == 2048 ? 32 : 16; }
// An attn_part page: 32 cache rows of one kv head, K rows at 0 and V rows at kAttnVAt, each row at a pitch of
// kAttnPitch bytes (512 bytes of bf16 and 16 of padding, so that the score loads' 8-lane phases hit distinct banks).
constexpr int kAttnRowsPerPage = 32;
constexpr int kAttnPitch = 2 * kAttnDim + 16;
constexpr int kAttnVAt = kAttnRowsPerPage * kAttnPitch;
static_assert(2 * kAttnVAt <= kPageBytes, "an attention page fits a ring slot");
constexpr int kAttnGroup = kAttnQHeads / kAttnKvHeads;  // query heads of a kv head
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// Unit u = (kv head m, split s) of attn_part: its cache rows [begin, end) of n = pos + 1, as attn_decode's.
struct AttnRange {
  int m, s, begin, end;
};
__device__ __forceinline__ AttnRange attn_range(const AttnArgs& a, int unit, int pos) {
  AttnRange r;
  r.m = unit / a.n_splits, r.s = unit % a.n_splits;
  const int n = pos + 1;
  const int chunk = ((n + a.n_splits - 1) / a.n_splits + 15) / 16 * 16;
  r.begin = min(r.s * chunk, n);
  r.end = min(r.begin + chunk, n);
  return r;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Returns once the phase of parity `parity` has completed (a fresh barrier counts parity 1 as completed).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_copy(void* dst_s, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst_s)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// The consumer warps' own barrier (the loader warp never joins it).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory"); }

struct Ring {
  char* pages;
  uint64_t* full;   // [kPages]: the bulk copies of a page landed (1 arrival + transaction bytes)
  uint64_t* empty;  // [kPages]: every consumer warp is done reading it (kConsumerWarps arrivals)
};

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The selection of the router the loader last took (moe.cuh warp_route_top_k, as every block takes it): the experts
// in rank order and the slots' weights (slot 0: the shared expert's sigmoid gate, slot r + 1: the renormalised p of
// rank r), which moe_out's pages carry to the consumers.
struct LoaderRoute {
  int router_op = -1;
  int ids[8];
  float w[9];
};

// Waits for the router of `moe` (lane 0 polls) and takes its selection (the whole warp), unless already taken.
__device__ void take_route(const ProgramView& pv, const MoeArgs& moe, unsigned long long epoch, LoaderRoute& r) {
  if (r.router_op == moe.router_op) return;
  if ((threadIdx.x & 31) == 0) {
    const unsigned long long target = (epoch + 1) * moe.router_signals;
    while (ld_acquire(pv.counters + moe.router_op) < target) __nanosleep(32);
  }
  __syncwarp();
  const RouteChoice c = warp_route_top_k<8>(moe.logits, moe.n_experts, moe.top_k);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    r.ids[i] = __shfl_sync(0xffffffffu, c.idx, i);
    r.w[i + 1] = __shfl_sync(0xffffffffu, c.weight, i);
  }
  r.w[0] = sigmoidf_(__ldcg(moe.logits + moe.n_experts));
  r.router_op = moe.router_op;
}

// Rows [row, row + n) of m: weights to page + w_at, scales and biases to page + kScalesAt / kBiasesAt + sb_at.
__device__ __forceinline__ void copy_rows(const QMatrix& m, int row, int n, char* page, uint32_t w_at, uint32_t sb_at,
                                          uint64_t* bar) {
  const size_t w_row = m.words_per_row() * 4, sb_row = m.groups_per_row() * 2;
  const uint32_t w_bytes = static_cast<uint32_t>(n * w_row), sb_bytes = static_cast<uint32_t>(n * sb_row);
  bulk_copy(page + w_at, reinterpret_cast<const char*>(m.w) + row * w_row, w_bytes, bar);
  bulk_copy(page + kScalesAt + sb_at, reinterpret_cast<const char*>(m.scales) + row * sb_row, sb_bytes, bar);
  bulk_copy(page + kBiasesAt + sb_at, reinterpret_cast<const char*>(m.biases) + row * sb_row, sb_bytes, bar);
}
__device__ __forceinline__ uint32_t rows_bytes(const QMatrix& m, int n) {
  return static_cast<uint32_t>(n * (m.words_per_row() * 4 + m.groups_per_row() * 4));
}

// The ring slot of page k once the consumers have released it (lane 0).
__device__ __forceinline__ char* free_page(const Ring& ring, uint32_t k, uint64_t*& full) {
  const int p = static_cast<int>(k % kPages);
  mbar_wait(&ring.empty[p], ((k / kPages) & 1) ^ 1);
  full = &ring.full[p];
  return ring.pages + p * kPageBytes;
}

// The loader warp: every page of every gemv / MoE instruction of the block, in order, as soon as its ring slot is
// free; lane 0 issues the copies. It waits for no dependency but the router of a MoE op whose pages hold routed experts' weights
// (the whole warp then takes the selection); the shared expert's pages go first. (Issuing later instructions' pages
// while a router runs was measured slower: their copies queue ahead of the routed pages, PERF_NOTES.)
__device__ void run_loader(const ProgramView& pv, int begin, int end, unsigned long long epoch, const Ring& ring) {
  const bool leader = (threadIdx.x & 31) == 0;
  uint32_t k = 0;
  LoaderRoute route;
  for (int i = begin; i < end; ++i) {
    const Instr in = pv.instrs[i];
    const Opcode code = pv.ops[in.op].code;
    uint64_t* full;
    if (code == Opcode::gdn_head || code == Opcode::attn_merge) continue;  // no pages (the heads read their state)
    if (code == Opcode::attn_part) {  // the cached rows < pos of each unit, 32 a page, one bulk copy a row
      const AttnArgs a = pv.ops[in.op].attn;
      const int pos = __ldcg(a.pos);
      for (int u = in.row_begin; u < in.row_end; ++u) {
        const AttnRange r = attn_range(a, u, pos);
        for (int b = r.begin; b < r.end; b += kAttnRowsPerPage, ++k) {
          if (!leader) continue;
          const int copied = max(0, min(min(b + kAttnRowsPerPage, r.end), pos) - b);
          char* page = free_page(ring, k, full);
          mbar_expect_tx(full, static_cast<uint32_t>(copied) * 4 * kAttnDim);
          for (int i = 0; i < copied; ++i) {
            const size_t row = (static_cast<size_t>(b + i) * kAttnKvHeads + r.m) * kAttnDim;
            bulk_copy(page + i * kAttnPitch, a.k_cache + row, 2 * kAttnDim, full);
            bulk_copy(page + kAttnVAt + i * kAttnPitch, a.v_cache + row, 2 * kAttnDim, full);
          }
        }
      }
      continue;
    }
    if (code == Opcode::moe_in) {  // 16 (slot, row) pairs a page: gate rows at 0, up rows at 16 KB
      const MoeArgs moe = pv.ops[in.op].moe;
      for (int r0 = in.row_begin; r0 < in.row_end; r0 += kMoeInRowsPerPage, ++k) {
        const int slot = r0 / moe.inter, row = r0 % moe.inter, n = min(kMoeInRowsPerPage, in.row_end - r0);
        if (slot > 0) take_route(pv, moe, epoch, route);
        if (!leader) continue;
        const QMatrix g = slot == 0 ? moe.s_gate : moe.gate.expert(route.ids[slot - 1]);
        const QMatrix u = slot == 0 ? moe.s_up : moe.up.expert(route.ids[slot - 1]);
        char* page = free_page(ring, k, full);
        mbar_expect_tx(full, 2 * rows_bytes(g, n));
        copy_rows(g, row, n, page, 0, 0, full);
        copy_rows(u, row, n, page, kMoeInRowsPerPage * 1024, kMoeInRowsPerPage * 64, full);
      }
    } else if (code == Opcode::moe_out) {  // 8 rows of every slot's down matrix (slot s at 2 KB * s), the weights
      const MoeArgs moe = pv.ops[in.op].moe;
      take_route(pv, moe, epoch, route);
      for (int r0 = in.row_begin; r0 < in.row_end; r0 += kMoeOutRowsPerPage, ++k) {
        if (!leader) continue;
        const int n = min(kMoeOutRowsPerPage, in.row_end - r0);
        char* page = free_page(ring, k, full);
        float* w = reinterpret_cast<float*>(page + kMoeOutWeightsAt);
        for (int s = 0; s <= moe.top_k; ++s) w[s] = route.w[s];
        mbar_expect_tx(full, (moe.top_k + 1) * rows_bytes(moe.s_down, n));
        for (int s = 0; s <= moe.top_k; ++s) {
          const QMatrix d = s == 0 ? moe.s_down : moe.down.expert(route.ids[s - 1]);
          copy_rows(d, r0, n, page, s * kMoeOutRowsPerPage * 256, s * kMoeOutRowsPerPage * 16, full);
        }
      }
    } else {
      const QMatrix m = pv.ops[in.op].m;
      const int rpp = rows_per_page(m.cols, m.bits);
      for (int r0 = in.row_begin; r0 < in.row_end; r0 += rpp, ++k) {
        if (!leader) continue;
        const int n = min(rpp, in.row_end - r0);
        char* page = free_page(ring, k, full);
        mbar_expect_tx(full, rows_bytes(m, n));
        copy_rows(m, r0, n, page, 0, 0, full);
      }
    }
  }
}

// Adds 1 to counter c once this block's stores are visible gpu-wide: the consumer barrier orders every consumer
// thread's stores before thread 0's release, which is cumulative over them. (A fence.sc or fence.acq_rel before it
// cost ~1.5 us more an instruction, measured.)
__device__ __forceinline__ void signal(const ProgramView& pv, int c) { red_release_add(pv.counters + c, 1); }

// Waits until every counter op reads has reached its target for this step.
__device__ __forceinline__ void wait_inputs(const ProgramView& pv, const Op& op, unsigned long long epoch) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 0; w < kMaxWaits; ++w) {
      if (op.wait[w] < 0) continue;
      const unsigned long long target = (epoch + 1) * op.wait_count[w];
      while (ld_acquire(pv.counters + op.wait[w]) < target) __nanosleep(32);
    }
  }
  consumer_sync();
}

constexpr int kXPerThread = kXFloats / 4 / kConsumerThreads + 1;  // float4s of x a thread: moe_out's 4608 floats

// The x prologue's multipliers, which no op writes: loaded before the input wait, so that their latency overlaps it.
// RMSNorm: norm_w[4i .. 4i + 3] for float4 i of x; the gated norm: the head's norm_w[4i % kGdnDim ..]; else ones.
__device__ __forceinline__ void load_norm_w(const Op& op, int cols, float4 (&w)[kXPerThread]) {
  const int n4 = cols / 4;
  const float4* w4 = reinterpret_cast<const float4*>(op.norm_w);
#pragma unroll
  for (int t = 0; t < kXPerThread; ++t) {
    const int i = threadIdx.x + t * kConsumerThreads;
    w[t] = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    if (i < n4 && (op.flags & kRmsNorm)) w[t] = __ldg(w4 + i);
    if (i < n4 && (op.flags & kGatedNorm)) w[t] = __ldg(w4 + i % (kGdnDim / 4));
  }
}

// x_s (padded) = in; in / RMS(in) * norm_w; or eq 19, norm_w * in / RMS(in over its head) * silu(gate), where
// warp w's lanes hold head w + 16 t of float4s t (kGdnDim = 128 columns: 32 float4s, one a lane), so a head's sum
// of squares is one warp sum. `w`: load_norm_w's multipliers. Activations are read through the L2 (__ldcg): other
// SMs wrote them in this step, and this SM's L1 may hold last step's lines.
__device__ void load_x(const Op& op, int cols, const float4 (&w)[kXPerThread], float* x_s, float* red_s) {
  static_assert(kGdnDim / 4 == 32 && kConsumerThreads % kGdnDim == 0, "a head of the gated norm is one warp's float4s");
  const int n4 = cols / 4, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float4* in4 = reinterpret_cast<const float4*>(op.in);
  const bool gated = op.flags & kGatedNorm;
  float4 v[kXPerThread], z[kXPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int t = 0; t < kXPerThread; ++t) {
    const int i = threadIdx.x + t * kConsumerThreads;
    v[t] = i < n4 ? __ldcg(in4 + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    z[t] = gated && i < n4 ? __ldcg(reinterpret_cast<const float4*>(op.gate) + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    ss += (v[t].x * v[t].x + v[t].y * v[t].y) + (v[t].z * v[t].z + v[t].w * v[t].w);
  }
  if (gated) {
#pragma unroll
    for (int t = 0; t < kXPerThread; ++t) {
      if (t * kConsumerThreads >= n4) break;  // warp-uniform: n4 is a multiple of the consumer threads
      const float hs = warp_sum((v[t].x * v[t].x + v[t].y * v[t].y) + (v[t].z * v[t].z + v[t].w * v[t].w));
      v[t] = x4_gated(v[t], rsqrtf(hs / static_cast<float>(kGdnDim) + op.eps), w[t], z[t]);
      *reinterpret_cast<float4*>(x_s + xpad(4 * (threadIdx.x + t * kConsumerThreads))) = v[t];
    }
  } else {
    float inv_rms = 1.0f;
    if (op.flags & kRmsNorm) {
      ss = warp_sum(ss);
      if (lane == 0) red_s[warp] = ss;
      consumer_sync();
      float total = 0.0f;
#pragma unroll
      for (int r = 0; r < kConsumerWarps; ++r) total += red_s[r];
      inv_rms = rsqrtf(total / static_cast<float>(cols) + op.eps);
    }
#pragma unroll
    for (int t = 0; t < kXPerThread; ++t) {
      const int i = threadIdx.x + t * kConsumerThreads;
      if (i < n4) {
        v[t] = make_float4(v[t].x * inv_rms * w[t].x, v[t].y * inv_rms * w[t].y, v[t].z * inv_rms * w[t].z,
                           v[t].w * inv_rms * w[t].w);
        *reinterpret_cast<float4*>(x_s + xpad(4 * i)) = v[t];
      }
    }
  }
  consumer_sync();
}

// The pages of one gemv instruction: warp w takes rows 2w, 2w + 1 (4-bit, 2048 columns) or row w (4096 columns,
// or 8-bit) of each page; lane j reads the 16-byte vectors v * 32 + j of those rows, so its slices of x are loaded
// once per page. GATE_UP (moe_in): warp w takes the page's gate row w and up row w (page rows w and 16 + w) and
// writes silu(gate) * up for its (slot, row) pair.
template <int COLS, int BITS, bool GATE_UP>
__device__ void gemv_pages(const Op& op, const Instr& in, const float* x_s, const Ring& ring, uint32_t& k,
                           unsigned long long* wait_ns) {
  static_assert(!(GATE_UP && (COLS != 2048 || BITS != 4)), "the combinations step.cu runs");
  constexpr int kRpp = rows_per_page(COLS, BITS);
  constexpr int kRpw = kRpp / kConsumerWarps;
  constexpr int kVecElems = BITS == 4 ? kVecElems4 : kVecElems8;
  constexpr int kVecsPerRow = COLS / kVecElems;
  constexpr int kV = kVecsPerRow / 32;
  constexpr int kLanesPerRow = 32 / kRpw;  // after the reduce-scatter: lane j holds row j / kLanesPerRow
  constexpr int kGroupsPerRow = COLS / 64, kVecsPerGroup = 64 / kVecElems;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = GATE_UP ? warp : warp * kRpw;
  // The page row of this warp's r-th row.
  auto page_row = [&](int r) { return GATE_UP ? warp + r * kMoeInRowsPerPage : row0 + r; };
  constexpr int kStep = GATE_UP ? kMoeInRowsPerPage : kRpp;
  for (int r0 = in.row_begin; r0 < in.row_end; r0 += kStep, ++k) {
    const int p = static_cast<int>(k % kPages), n = min(kStep, in.row_end - r0);
    const bool active = row0 < n;  // n is a multiple of kRpw (slices are whole quanta)
    const bool writes = active && (GATE_UP ? lane == 0 : lane % kLanesPerRow == 0);
    const int row = GATE_UP ? r0 + warp : r0 + row0 + lane / kLanesPerRow;
    // The residual is loaded before the page wait: its L2 round trip overlaps the wait and the dot products.
    const float residual = writes && (op.flags & kResidual) ? __ldcg(op.residual + row) : 0.0f;
    const unsigned long long t_wait = wait_ns ? globaltimer() : 0;
    mbar_wait(&ring.full[p], (k / kPages) & 1);
    if (wait_ns) *wait_ns += globaltimer() - t_wait;
    const char* page = ring.pages + p * kPageBytes;
    const unsigned short* s_s = reinterpret_cast<const unsigned short*>(page + kScalesAt);
    const unsigned short* b_s = reinterpret_cast<const unsigned short*>(page + kBiasesAt);
    float part[kRpw];
#pragma unroll
    for (int r = 0; r < kRpw; ++r) part[r] = 0.0f;
    if (active) {
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        const int vec = v * 32 + lane;
        if constexpr (BITS == 8) {
#pragma unroll
          for (int r = 0; r < kRpw; ++r) {  // the router's dot product (moe.cuh)
            const uint4 w = *reinterpret_cast<const uint4*>(page + (page_row(r) * kVecsPerRow + vec) * 16);
            const int g = page_row(r) * kGroupsPerRow + vec / kVecsPerGroup;
            part[r] += router_vec(w, s_s[g], b_s[g], x_s, vec);
          }
        } else {
          float x[32];
          const float x_sum = load_x_vec(x_s, vec, x);
#pragma unroll
          for (int r = 0; r < kRpw; ++r) {
            const uint4 w = *reinterpret_cast<const uint4*>(page + (page_row(r) * kVecsPerRow + vec) * 16);
            const int g = page_row(r) * kGroupsPerRow + vec / kVecsPerGroup;
            part[r] += q4_group_term(dot_q4_vec(w, x), x_sum, s_s[g], b_s[g]);
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&ring.empty[p]);  // the page is free once every lane has read it
    if (active) {
      group_reduce_scatter<kRpw, 32>(part, lane);
      if constexpr (GATE_UP) {
        const float up = __shfl_sync(0xffffffffu, part[0], 16);  // lane 16 holds the up row's dot
        if (writes) op.out[row] = siluf_(part[0]) * up;
      } else if (writes) {
        op.out[row] = part[0] + residual;
      }
    }
  }
}

// The pages of one moe_out instruction (8 rows a page, every slot's down rows; x_s = act [(top_k + 1) * 512],
// w_s = the slots' weights): warp w < 8 takes row w; lane j vector j % 16 of slots j / 16, j / 16 + 2, ...
// (512 columns: 16 vectors a row), weighted and summed in a fixed order.
__device__ void moe_out_pages(const Op& op, const Instr& in, const float* x_s, const Ring& ring, uint32_t& k,
                              unsigned long long* wait_ns) {
  constexpr int kVecs = 512 / kVecElems4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, v = lane % kVecs;
  const int slots = op.moe.top_k + 1;
  for (int r0 = in.row_begin; r0 < in.row_end; r0 += kMoeOutRowsPerPage, ++k) {
    const int p = static_cast<int>(k % kPages), n = min(kMoeOutRowsPerPage, in.row_end - r0);
    const bool active = warp < n;
    const float residual = active && lane == 0 ? __ldcg(op.residual + r0 + warp) : 0.0f;
    const unsigned long long t_wait = wait_ns ? globaltimer() : 0;
    mbar_wait(&ring.full[p], (k / kPages) & 1);
    if (wait_ns) *wait_ns += globaltimer() - t_wait;
    const char* page = ring.pages + p * kPageBytes;
    const float* w_s = reinterpret_cast<const float*>(page + kMoeOutWeightsAt);  // written by the loader
    float acc = 0.0f;
    if (active) {
      const unsigned short* s_s = reinterpret_cast<const unsigned short*>(page + kScalesAt);
      const unsigned short* b_s = reinterpret_cast<const unsigned short*>(page + kBiasesAt);
      for (int s = lane / kVecs; s < slots; s += 32 / kVecs) {
        const int row = s * kMoeOutRowsPerPage + warp;  // page row of slot s
        const uint4 w = *reinterpret_cast<const uint4*>(page + (row * kVecs + v) * 16);
        float x[32];
        const float x_sum = load_x_vec(x_s, s * kVecs + v, x);
        const int g = row * 8 + v / 2;
        acc = fmaf(w_s[s], q4_group_term(dot_q4_vec(w, x), x_sum, s_s[g], b_s[g]), acc);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&ring.empty[p]);
    if (active) {
      acc = warp_sum(acc);
      if (lane == 0) op.out[r0 + warp] = residual + acc;
    }
  }
}

// The Gated DeltaNet step of one unit (Opcode::gdn_head): columns j0 .. j0 + 31 of value head h, the chain's
// gdn_step arithmetic (gdn.cu) on 512 threads: thread (warp r, lane j) holds rows 8r .. 8r + 7 of column j0 + j of
// the head's state (each warp's loads and stores are coalesced 128-byte row pieces).
//   eq 14  conv + SiLU of the 288 channels the unit reads (q, k of its key head, its 32 v columns; thread tid <
//          288 one each), ring slot pos % 4 updated (q / k channels by the key head's first unit only: every unit of
//          the key head computes the same values)
//   eq 16  q_hat = q / |q| / sqrt(d_k), k_hat = k / |k|;  eq 17  beta, decay
//   eq 18  S' = decay S; e = (v - S'^T k_hat) beta; S = S' + k_hat e^T; o = S'^T q_hat + e (k_hat . q_hat)
// Eq 19 (the gated norm over the head's 128 columns) is the out-projection's prologue (OpFlags::kGatedNorm).
constexpr int kGdnBlocks = kGdnDim / kGdnCols;        // units a head
constexpr int kGdnRows = kGdnDim / kConsumerWarps;    // state rows a thread
constexpr int kGdnChannels = 2 * kGdnDim + kGdnCols;  // eq 14's channels a unit
static_assert(kGdnCols == 32 && kConsumerThreads >= kGdnChannels, "a lane a column, a thread a conv channel");

// What a unit reads that no op of the step writes (the state slice, eq 14's history and weights, the gate
// constants): gdn_unit_load issues it before the input wait for the instruction's first unit.
struct GdnUnitIn {
  float s[kGdnRows];
  float hist[3], conv_w[4];  // threads < kGdnChannels
  float A_log, dt_bias;
  int pos;
};

// Thread tid's eq 14 channel of unit (h, j0) (q, k of key head kh, then the unit's v columns), or -1.
__device__ __forceinline__ int gdn_channel(const GdnArgs& g, int h, int kh, int j0, int tid) {
  const int key_dim = g.n_k * kGdnDim;
  if (tid < kGdnDim) return kh * kGdnDim + tid;
  if (tid < 2 * kGdnDim) return key_dim + kh * kGdnDim + (tid - kGdnDim);
  if (tid < kGdnChannels) return 2 * key_dim + h * kGdnDim + j0 + (tid - 2 * kGdnDim);
  return -1;
}

__device__ __forceinline__ void gdn_unit_load(const GdnArgs& g, int unit, GdnUnitIn& u) {
  constexpr int D = kGdnDim, K = 4;
  const int h = unit / kGdnBlocks, j0 = (unit % kGdnBlocks) * kGdnCols, kh = h / (g.n_v / g.n_k);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int conv_dim = (2 * g.n_k + g.n_v) * D;
  const float* S = g.S + (static_cast<size_t>(h) * D + warp * kGdnRows) * D + j0 + lane;
#pragma unroll
  for (int r = 0; r < kGdnRows; ++r) u.s[r] = __ldcg(S + static_cast<size_t>(r) * D);
  u.A_log = __ldg(g.A_log + h);
  u.dt_bias = __ldg(g.dt_bias + h);
  u.pos = __ldcg(g.pos);
  const int ch = gdn_channel(g, h, kh, j0, threadIdx.x);
  if (ch >= 0) {
#pragma unroll
    for (int t = 0; t < K; ++t) u.conv_w[t] = __ldg(g.conv_w + static_cast<size_t>(ch) * K + t);
#pragma unroll
    for (int t = 0; t < K - 1; ++t) u.hist[t] = __ldcg(g.conv_ring + static_cast<size_t>((u.pos + 1 + t) % K) * conv_dim + ch);
  }
}

__device__ void gdn_unit(const Op& op, int unit, const GdnUnitIn& u, float* scratch) {
  constexpr int D = kGdnDim, K = 4;
  const GdnArgs& g = op.gdn;
  const int key_dim = g.n_k * D, value_dim = g.n_v * D, conv_dim = 2 * key_dim + value_dim;
  const int h = unit / kGdnBlocks, cb = unit % kGdnBlocks, j0 = cb * kGdnCols, kh = h / (g.n_v / g.n_k);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  float* q_s = scratch;
  float* k_s = q_s + D;
  float* v_s = k_s + D;                                     // [kGdnCols]
  float* part_s = v_s + kGdnCols;                           // [2][kConsumerWarps][kGdnCols]: S'^T k_hat, S'^T q_hat
  float* norm_s = part_s + 2 * kConsumerWarps * kGdnCols;  // 1/|q|, 1/|k|, raw q.k
  const int ch = gdn_channel(g, h, kh, j0, tid);
  if (ch >= 0) {
    const float x_now = __ldcg(g.proj + ch);
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < K - 1; ++t) acc += u.conv_w[t] * u.hist[t];
    acc += u.conv_w[K - 1] * x_now;
    if (tid >= 2 * D || (h % (g.n_v / g.n_k) == 0 && cb == 0))
      g.conv_ring[static_cast<size_t>(u.pos % K) * conv_dim + ch] = x_now;
    const float y = gdn_silu(acc);
    if (tid < D) q_s[tid] = y;
    else if (tid < 2 * D) k_s[tid - D] = y;
    else v_s[tid - 2 * D] = y;
  }
  const float b_logit = __ldcg(g.proj + conv_dim + value_dim + h);
  const float a_in = __ldcg(g.proj + conv_dim + value_dim + g.n_v + h) + u.dt_bias;
  consumer_sync();
  if (warp < 3) {
    float acc = 0.0f;
    for (int i = lane; i < D; i += 32) acc += warp == 0 ? q_s[i] * q_s[i] : warp == 1 ? k_s[i] * k_s[i] : q_s[i] * k_s[i];
    acc = warp_sum(acc);
    if (lane == 0) norm_s[warp] = warp == 2 ? acc : 1.0f / sqrtf(acc + 1e-6f);
  }
  float beta, decay;
  gdn_gates(b_logit, a_in, u.A_log, beta, decay);
  consumer_sync();
  const float q_inv = norm_s[0] * (1.0f / sqrtf(static_cast<float>(D))), k_inv = norm_s[1];
  const float kq = norm_s[2] * q_inv * k_inv;
  float s_reg[kGdnRows];
  float sk = 0.0f, sq = 0.0f;
#pragma unroll
  for (int r = 0; r < kGdnRows; ++r) {
    const int i = warp * kGdnRows + r;
    s_reg[r] = u.s[r] * decay;
    sk += s_reg[r] * (k_s[i] * k_inv);
    sq += s_reg[r] * (q_s[i] * q_inv);
  }
  part_s[warp * kGdnCols + lane] = sk;
  part_s[(kConsumerWarps + warp) * kGdnCols + lane] = sq;
  consumer_sync();
  float kv = 0.0f, sqv = 0.0f;
#pragma unroll
  for (int w = 0; w < kConsumerWarps; ++w) {
    kv += part_s[w * kGdnCols + lane];
    sqv += part_s[(kConsumerWarps + w) * kGdnCols + lane];
  }
  const float e = (v_s[lane] - kv) * beta;
  float* S = g.S + (static_cast<size_t>(h) * D + warp * kGdnRows) * D + j0 + lane;
#pragma unroll
  for (int r = 0; r < kGdnRows; ++r) S[static_cast<size_t>(r) * D] = s_reg[r] + (k_s[warp * kGdnRows + r] * k_inv) * e;
  if (warp == 0) op.out[h * D + j0 + lane] = sqv + e * kq;
  consumer_sync();  // scratch free for the next unit
}

// attn_part (eqs 9-11) for the units [row_begin, row_end) of an instruction, on 512 threads, fp32 on the CUDA cores
// (K and V exact bf16, as cached; scores in log2 units with q pre-scaled by scale * log2(e), as attn_decode).
//   prologue: warp w < 8 takes query head 8 m + w (lane l: dimensions 8 l .. 8 l + 7), warp 8 the kv head's k, warp 9
//     its v: RMSNorm (multiplier form, as attn_prep), RoPE (rope_element), q into q_s, k and v rounded to bf16
//     into kv_s (unit s = 0 appends them at row pos of the caches);
//   per page (32 rows): scores, thread (warp w, lane l): head w / 2, row 16 (w % 2) + l % 16, dimensions
//     128 (l / 16) ..+127 (the two halves summed by one shuffle); the online softmax, warp h < 8 for head h, lane
//     = row; then O += P V, thread t: head t / 64, dimensions 4 (t % 64) ..+3, rows in order.
// Row pos (this step's) is not in the cache yet: the page that holds it gets it from kv_s.
// Returns the page counter after the instruction's pages.
__device__ __noinline__ uint32_t attn_part_units(const AttnArgs* ap, Instr in, float* scratch, Ring ring, uint32_t k) {
  constexpr int D = kAttnDim, G = kAttnGroup;
  const AttnArgs a = *ap;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  float* q_s = scratch;                 // [G][D], pre-scaled
  float* y_s = q_s + G * D;             // [G + 2][D]: the prologue's RMSNorm outputs (RoPE reads pairs)
  float* sc_s = y_s;                    // [G][32] scores (after the prologue)
  float* p_s = sc_s + G * 32;           // [G][32]
  float* alpha_s = p_s + G * 32;        // [G]
  __nv_bfloat16* kv_s = reinterpret_cast<__nv_bfloat16*>(y_s + (G + 2) * D);  // [2][D]: k, v of row pos
  const int pos = __ldcg(a.pos);
  const float q_mul = kLog2e / sqrtf(static_cast<float>(D));
  for (int u = in.row_begin; u < in.row_end; ++u) {
    const AttnRange r = attn_range(a, u, pos);
    if (warp < G + 2) {  // eqs 9-10 (attn_prep's arithmetic)
      const bool is_q = warp < G, is_v = warp == G + 1;
      const int j = r.m * G + warp;
      const float* src = is_q ? a.proj + static_cast<size_t>(j) * 2 * D
                              : a.proj + static_cast<size_t>(kAttnQHeads) * 2 * D + ((is_v ? kAttnKvHeads : 0) + r.m) * D;
      float x[8];
      const float4 x0 = __ldcg(reinterpret_cast<const float4*>(src + 8 * lane));
      const float4 x1 = __ldcg(reinterpret_cast<const float4*>(src + 8 * lane + 4));
      x[0] = x0.x, x[1] = x0.y, x[2] = x0.z, x[3] = x0.w, x[4] = x1.x, x[5] = x1.y, x[6] = x1.z, x[7] = x1.w;
      if (is_v) {
#pragma unroll
        for (int i = 0; i < 8; ++i) kv_s[D + 8 * lane + i] = __float2bfloat16_rn(x[i]);
      } else {
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += x[i] * x[i];
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + a.eps);
        const float* w = is_q ? a.q_norm : a.k_norm;
        float* y = y_s + warp * D;
#pragma unroll
        for (int i = 0; i < 8; ++i) y[8 * lane + i] = __fmul_rn(__fmul_rn(x[i], inv), __ldg(w + 8 * lane + i));
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float v = rope_element(y, 8 * lane + i, kAttnRotary, a.rope_theta, pos);
          if (is_q) q_s[warp * D + 8 * lane + i] = v * q_mul;
          else kv_s[8 * lane + i] = __float2bfloat16_rn(v);
        }
      }
    }
    consumer_sync();
    if (r.s == 0 && tid < 2 * D / 8) {  // append row pos (16 bytes a thread: k, then v)
      const int half = tid / (D / 8), e = 8 * (tid % (D / 8));
      __nv_bfloat16* cache = half ? a.v_cache : a.k_cache;
      *reinterpret_cast<uint4*>(cache + (static_cast<size_t>(pos) * kAttnKvHeads + r.m) * D + e) =
          *reinterpret_cast<const uint4*>(kv_s + half * D + e);
    }
    // Running softmax state: warp h < G keeps head h's (m_run, l_run) in every lane; thread t's O part o[4].
    float m_run = -INFINITY, l_run = 0.0f;
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int ph = tid / 64, pd = 4 * (tid % 64);
    const int sh = warp / 2, srow = 16 * (warp % 2) + lane % 16, shalf = lane / 16;
    for (int b = r.begin; b < r.end; b += kAttnRowsPerPage, ++k) {
      const int p = static_cast<int>(k % kPages), valid = min(kAttnRowsPerPage, r.end - b);
      mbar_wait(&ring.full[p], (k / kPages) & 1);
      char* page = ring.pages + p * kPageBytes;
      if (pos >= b && pos < b + valid) {  // block-uniform: this page holds row pos
        if (tid < 2 * D / 8) {
          const int half = tid / (D / 8), e = 8 * (tid % (D / 8));
          *reinterpret_cast<uint4*>(page + half * kAttnVAt + (pos - b) * kAttnPitch + 2 * e) =
              *reinterpret_cast<const uint4*>(kv_s + half * D + e);
        }
        consumer_sync();
      }
      // Scores.
      {
        float acc = 0.0f;
        if (srow < valid) {
          const char* krow = page + srow * kAttnPitch + shalf * D;  // bytes: dimension 128 shalf
          const float* q = q_s + sh * D + shalf * (D / 2);
#pragma unroll 1
          for (int c = 0; c < D / 2 / 8; ++c) {
            const uint4 kw = *reinterpret_cast<const uint4*>(krow + 16 * c);
            const float4 qa = *reinterpret_cast<const float4*>(q + 8 * c);
            const float4 qb = *reinterpret_cast<const float4*>(q + 8 * c + 4);
            acc = fmaf(qa.x, bf16_bits_to_float(static_cast<unsigned short>(kw.x & 0xFFFF)), acc);
            acc = fmaf(qa.y, bf16_bits_to_float(static_cast<unsigned short>(kw.x >> 16)), acc);
            acc = fmaf(qa.z, bf16_bits_to_float(static_cast<unsigned short>(kw.y & 0xFFFF)), acc);
            acc = fmaf(qa.w, bf16_bits_to_float(static_cast<unsigned short>(kw.y >> 16)), acc);
            acc = fmaf(qb.x, bf16_bits_to_float(static_cast<unsigned short>(kw.z & 0xFFFF)), acc);
            acc = fmaf(qb.y, bf16_bits_to_float(static_cast<unsigned short>(kw.z >> 16)), acc);
            acc = fmaf(qb.z, bf16_bits_to_float(static_cast<unsigned short>(kw.w & 0xFFFF)), acc);
            acc = fmaf(qb.w, bf16_bits_to_float(static_cast<unsigned short>(kw.w >> 16)), acc);
          }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 16);
        if (shalf == 0) sc_s[sh * 32 + srow] = acc;
      }
      consumer_sync();
      if (warp < G) {  // the online softmax of head `warp` over the page's rows
        const float sv = lane < valid ? sc_s[warp * 32 + lane] : -INFINITY;
        const float m_new = fmaxf(m_run, warp_max(sv));  // finite: valid >= 1
        const float alpha = exp2f(m_run - m_new);         // 0 on the first page (m_run = -inf)
        const float pr = lane < valid ? exp2f(sv - m_new) : 0.0f;
        l_run = l_run * alpha + warp_sum(pr);
        m_run = m_new;
        p_s[warp * 32 + lane] = pr;
        if (lane == 0) alpha_s[warp] = alpha;
      }
      consumer_sync();
      {
        const float alpha = alpha_s[ph];
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] *= alpha;
        const char* vcol = page + kAttnVAt + 2 * pd;
        for (int row = 0; row < valid; ++row) {
          const uint2 vw = *reinterpret_cast<const uint2*>(vcol + row * kAttnPitch);
          const float pr = p_s[ph * 32 + row];
          o[0] = fmaf(pr, bf16_bits_to_float(static_cast<unsigned short>(vw.x & 0xFFFF)), o[0]);
          o[1] = fmaf(pr, bf16_bits_to_float(static_cast<unsigned short>(vw.x >> 16)), o[1]);
          o[2] = fmaf(pr, bf16_bits_to_float(static_cast<unsigned short>(vw.y & 0xFFFF)), o[2]);
          o[3] = fmaf(pr, bf16_bits_to_float(static_cast<unsigned short>(vw.y >> 16)), o[3]);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&ring.empty[p]);
      consumer_sync();  // sc_s / p_s / alpha_s free for the next page
    }
    const size_t head = static_cast<size_t>(r.s) * kAttnQHeads + r.m * G + ph;
    *reinterpret_cast<float4*>(a.part_o + head * D + pd) = make_float4(o[0], o[1], o[2], o[3]);
    if (warp < G && lane == 0) {
      const size_t hh = static_cast<size_t>(r.s) * kAttnQHeads + r.m * G + warp;
      a.part_ml[hh * 2] = m_run * kLn2;  // -inf stays -inf
      a.part_ml[hh * 2 + 1] = l_run;
    }
    consumer_sync();  // scratch free for the next unit
  }
  return k;
}

// attn_merge for units [row_begin, row_end) = (query head j, dimensions 32 c .. +31): warp w sums the splits s = w,
// w + 16, ... with weights exp(m_s - M) (every warp takes M itself), lane = dimension; warp 0 adds the 16 warps'
// sums in order, divides by the sum of the weighted l_s and multiplies by sigmoid(gate).
__device__ __noinline__ void attn_merge_units(const AttnArgs* ap, float* out, Instr in, float* scratch) {
  constexpr int D = kAttnDim;
  const AttnArgs a = *ap;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, S = a.n_splits;
  float* acc_s = scratch;                        // [kConsumerWarps][32]
  float* l_s = acc_s + kConsumerWarps * 32;      // [kConsumerWarps]
  for (int u = in.row_begin; u < in.row_end; ++u) {
    const int j = u / (D / 32), d = 32 * (u % (D / 32)) + lane;
    float mx = -INFINITY;
    for (int s = lane; s < S; s += 32) mx = fmaxf(mx, __ldcg(a.part_ml + (static_cast<size_t>(s) * kAttnQHeads + j) * 2));
    mx = warp_max(mx);
    float acc = 0.0f, l = 0.0f;
    for (int s = warp; s < S; s += kConsumerWarps) {
      const size_t head = static_cast<size_t>(s) * kAttnQHeads + j;
      const float ms = __ldcg(a.part_ml + head * 2);
      const float w = ms == -INFINITY ? 0.0f : expf(ms - mx);  // empty splits weigh nothing
      l = fmaf(w, __ldcg(a.part_ml + head * 2 + 1), l);
      acc = fmaf(w, __ldcg(a.part_o + head * D + d), acc);
    }
    acc_s[warp * 32 + lane] = acc;
    if (lane == 0) l_s[warp] = l;
    consumer_sync();
    if (warp == 0) {
      float o = 0.0f, lt = 0.0f;
      for (int w = 0; w < kConsumerWarps; ++w) o += acc_s[w * 32 + lane], lt += l_s[w];
      const float gate = __ldcg(a.proj + static_cast<size_t>(j) * 2 * D + D + d);
      out[static_cast<size_t>(j) * D + d] = o / lt * (1.0f / (1.0f + expf(-gate)));
    }
    consumer_sync();
  }
}

__device__ void run_consumers(const ProgramView& pv, int begin, int end, unsigned long long epoch, const Ring& ring,
                              float* x_s, float* red_s) {
  uint32_t k = 0;
  const bool trace = pv.trace != nullptr && threadIdx.x == 0;
  for (int i = begin; i < end; ++i) {
    unsigned long long* marks = trace ? pv.trace + static_cast<size_t>(i) * kTraceMarks : nullptr;
    if (marks) marks[0] = globaltimer();
    const Instr in = pv.instrs[i];
    const Op op = pv.ops[in.op];
    if (op.code == Opcode::gdn_head) {
      GdnUnitIn u;
      gdn_unit_load(op.gdn, in.row_begin, u);  // before the wait: nothing in the step writes it
      wait_inputs(pv, op, epoch);
      if (marks) marks[1] = marks[2] = globaltimer();
      for (int unit = in.row_begin; unit < in.row_end; ++unit) {
        if (unit > in.row_begin) gdn_unit_load(op.gdn, unit, u);
        gdn_unit(op, unit, u, x_s);
      }
      if (marks) marks[3] = marks[4] = globaltimer();
      if (threadIdx.x == 0) signal(pv, op.signal);
      if (marks) marks[5] = globaltimer(), marks[6] = 0;
      continue;
    }
    if (op.code == Opcode::attn_part || op.code == Opcode::attn_merge) {
      wait_inputs(pv, op, epoch);
      if (marks) marks[1] = marks[2] = globaltimer();
      // Out of line (their own register allocation; the calls cost once an instruction), reading the program's
      // copy of the operands (global, read-only) rather than a local copy of op.
      if (op.code == Opcode::attn_part) k = attn_part_units(&pv.ops[in.op].attn, in, x_s, ring, k);
      else attn_merge_units(&pv.ops[in.op].attn, op.out, in, x_s);
      if (marks) marks[3] = marks[4] = globaltimer();
      if (threadIdx.x == 0) signal(pv, op.signal);
      if (marks) marks[5] = globaltimer(), marks[6] = 0;
      continue;
    }
    const int cols = op.code == Opcode::moe_out ? (op.moe.top_k + 1) * op.moe.inter : op.m.cols;
    float4 norm_w[kXPerThread];
    load_norm_w(op, cols, norm_w);  // before the wait: no op writes it
    wait_inputs(pv, op, epoch);
    if (marks) marks[1] = globaltimer();
    unsigned long long page_wait = 0;
    unsigned long long* wait_ns = marks ? &page_wait : nullptr;
    load_x(op, cols, norm_w, x_s, red_s);
    if (marks) marks[2] = globaltimer();
    if (op.code == Opcode::moe_out) {
      moe_out_pages(op, in, x_s, ring, k, wait_ns);
    } else if (op.code == Opcode::moe_in) {
      gemv_pages<2048, 4, true>(op, in, x_s, ring, k, wait_ns);
    } else if (op.m.bits == 8) {
      gemv_pages<2048, 8, false>(op, in, x_s, ring, k, wait_ns);
    } else if (op.m.cols == 2048) {
      gemv_pages<2048, 4, false>(op, in, x_s, ring, k, wait_ns);
    } else {
      gemv_pages<4096, 4, false>(op, in, x_s, ring, k, wait_ns);
    }
    if (marks) marks[3] = globaltimer();
    consumer_sync();  // every store of the instruction issued (and x_s free for the next one)
    if (marks) marks[4] = globaltimer();
    if (threadIdx.x == 0) signal(pv, op.signal);
    if (marks) marks[5] = globaltimer(), marks[6] = page_wait;
  }
}

#endif  // LILY_MK_DEVICE

__global__ void __launch_bounds__(kThreads, 1) step_kernel(const __grid_constant__ ProgramView pv) {
#if defined(LILY_MK_DEVICE)
  extern __shared__ __align__(128) char smem[];
  Ring ring;
  ring.pages = smem;
  float* x_s = reinterpret_cast<float*>(smem + kPages * kPageBytes);
  float* red_s = x_s + kXFloats;
  ring.full = reinterpret_cast<uint64_t*>(red_s + 32);
  ring.empty = ring.full + kPages;
  const int b = blockIdx.x, begin = pv.list_begin[b], end = pv.list_begin[b + 1];
  const unsigned long long epoch = pv.epochs[b];  // read by every thread before thread 0 advances it
  if (threadIdx.x == 0) {
    for (int p = 0; p < kPages; ++p) {
      mbar_init(&ring.full[p], 1);
      mbar_init(&ring.empty[p], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  if (warp == kConsumerWarps) {
    run_loader(pv, begin, end, epoch, ring);
    return;
  }
  run_consumers(pv, begin, end, epoch, ring, x_s, red_s);
  if (threadIdx.x == 0) pv.epochs[b] = epoch + 1;
#endif
}

}  // namespace

size_t step_smem_bytes() { return kSmemBytes; }

bool step_supported() {
  int dev = 0;
  cudaDeviceProp prop{};
  cudaFuncAttributes attr{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) return false;
  if (cudaFuncGetAttributes(&attr, step_kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // ptxVersion: the virtual architecture the kernel was compiled for; below 90 its body is empty.
  return prop.major >= 9 && attr.ptxVersion >= 90 && prop.sharedMemPerBlockOptin >= kSmemBytes &&
         prop.cooperativeLaunch;
}

Result<std::unique_ptr<DeviceProgram>> DeviceProgram::upload(const Program& p) {
  if (p.list_begin().size() < 2) return invalid_argument("megakernel: the program has no schedule");
  std::unique_ptr<DeviceProgram> d(new DeviceProgram());
  auto copy = [&](const void* src, size_t bytes, void** dst) -> Status {
    if (cudaMalloc(dst, bytes > 0 ? bytes : 16) != cudaSuccess)
      return error(ErrorCode::internal, "megakernel: cudaMalloc of %zu bytes failed", bytes);
    d->allocations_.push_back(*dst);
    if (src && bytes > 0 && cudaMemcpy(*dst, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
      return error(ErrorCode::internal, "megakernel: upload failed");
    if (!src && cudaMemset(*dst, 0, bytes) != cudaSuccess) return error(ErrorCode::internal, "megakernel: memset");
    return ok_status();
  };
  void *ops, *instrs, *list, *counters, *epochs;
  const int n_blocks = static_cast<int>(p.list_begin().size()) - 1;
  d->n_counters_ = static_cast<int>(p.ops().size());
  d->n_instrs_ = static_cast<int>(p.instrs().size());
  RETURN_IF_ERROR(copy(p.ops().data(), p.ops().size() * sizeof(Op), &ops));
  RETURN_IF_ERROR(copy(p.instrs().data(), p.instrs().size() * sizeof(Instr), &instrs));
  RETURN_IF_ERROR(copy(p.list_begin().data(), p.list_begin().size() * sizeof(int), &list));
  RETURN_IF_ERROR(copy(nullptr, d->n_counters_ * sizeof(unsigned long long), &counters));
  RETURN_IF_ERROR(copy(nullptr, n_blocks * sizeof(unsigned long long), &epochs));
  d->view_.ops = static_cast<const Op*>(ops);
  d->view_.instrs = static_cast<const Instr*>(instrs);
  d->view_.list_begin = static_cast<const int*>(list);
  d->view_.counters = static_cast<unsigned long long*>(counters);
  d->view_.epochs = static_cast<unsigned long long*>(epochs);
  d->view_.n_blocks = n_blocks;
  if (cudaFuncSetAttribute(step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) != cudaSuccess)
    return error(ErrorCode::unsupported, "megakernel: %zu bytes of shared memory per block not available", kSmemBytes);
  // The copies and memsets above run on the legacy stream, asynchronously: done before a launch on any stream.
  if (cudaDeviceSynchronize() != cudaSuccess) return error(ErrorCode::internal, "megakernel: upload failed");
  Result<std::unique_ptr<DeviceProgram>> done(std::move(d));
  return done;
}

DeviceProgram::~DeviceProgram() {
  for (void* a : allocations_) cudaFree(a);
}

cudaError_t DeviceProgram::launch(cudaStream_t stream) const {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // every block resident at once: the counter waits need it
  attr[0].val.cooperative = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(view_.n_blocks));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CUDA_TRY(cudaLaunchKernelEx(&cfg, step_kernel, view_));
  return cudaGetLastError();
}

Status DeviceProgram::enable_trace() {
  if (!trace_) {
    void* t = nullptr;
    const size_t bytes = static_cast<size_t>(n_instrs_) * kTraceMarks * sizeof(unsigned long long);
    if (cudaMalloc(&t, bytes) != cudaSuccess || cudaMemset(t, 0, bytes) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess)
      return error(ErrorCode::internal, "megakernel: no memory for the timeline");
    allocations_.push_back(t);
    trace_ = static_cast<unsigned long long*>(t);
  }
  view_.trace = trace_;
  return ok_status();
}

Result<std::vector<unsigned long long>> DeviceProgram::trace() const {
  if (!trace_) return error(ErrorCode::invalid_argument, "megakernel: the timeline was never on");
  std::vector<unsigned long long> v(static_cast<size_t>(n_instrs_) * kTraceMarks);
  if (cudaMemcpy(v.data(), trace_, v.size() * sizeof(v[0]), cudaMemcpyDeviceToHost) != cudaSuccess)
    return error(ErrorCode::internal, "megakernel: reading the timeline failed");
  return v;
}

Result<std::vector<unsigned long long>> DeviceProgram::counters() const {
  std::vector<unsigned long long> v(static_cast<size_t>(n_counters_));
  if (cudaMemcpy(v.data(), view_.counters, v.size() * sizeof(v[0]), cudaMemcpyDeviceToHost) != cudaSuccess)
    return error(ErrorCode::internal, "megakernel: reading the counters failed");
  return v;
}

}  // namespace lily::cuda::mk
