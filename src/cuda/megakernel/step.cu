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
constexpr int kMaxVecs = 4096 / kVecElems4;  // 32-element vectors of x
// pages | x (fp32, padded) | block sums | x as int8 (32 B a vector) | its scale | its sum | mbarriers
constexpr size_t kSmemBytes =
    size_t{kPages} * kPageBytes + kXFloats * 4 + 32 * 4 + kMaxVecs * 32 + kMaxVecs * 8 + 2 * kPages * 8;


#if defined(LILY_MK_DEVICE)

constexpr int kConsumerThreads = 32 * kConsumerWarps;
// Page layout (both widths): 32 KB of packed weights, then 2 KB of scales, then 2 KB of biases.
constexpr int kScalesAt = 32768;
constexpr int kBiasesAt = 34816;
constexpr int kMoeOutWeightsAt = 9 * kMoeOutRowsPerPage * 256;  // after moe_out's 9 slots of 8 down rows
__device__ constexpr int rows_per_page(int cols, int bits) { return bits == 4 && cols == 2048 ? 32 : 16; }

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

// x quantized for dp4a (OpFlags::kInt8X): per 32-element vector v, q[2v], q[2v + 1] hold its int8 values in the
// order of the 4-bit weight words' low and high nibbles (lo_k = elements 8k + 0, 2, 4, 6; hi_k = 8k + 1, 3, 5, 7:
// q[2v] = {lo0, hi0, lo1, hi1}, q[2v + 1] = {lo2, hi2, lo3, hi3}), with x ~ scale[v] * q and sum[v] = sum of x.
struct XInt8 {
  uint4* q;
  float* scale;
  float* sum;
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

// The loader warp: every page of every instruction of the block, in order, as soon as its ring slot is free; lane 0
// issues the copies. It waits for no dependency but the router of a MoE op whose pages hold routed experts' weights
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
    if (code == Opcode::gdn_head) {  // each head's state: rows 0-63, then 64-127 (32 KB each)
      const float* S = pv.ops[in.op].gdn.S;
      for (int h = in.row_begin; h < in.row_end; ++h) {
        for (int half = 0; half < 2; ++half, ++k) {
          if (!leader) continue;
          char* page = free_page(ring, k, full);
          constexpr uint32_t kHalfBytes = kGdnDim * kGdnDim * 2;
          mbar_expect_tx(full, kHalfBytes);
          bulk_copy(page, S + (static_cast<size_t>(h) * kGdnDim + half * (kGdnDim / 2)) * kGdnDim, kHalfBytes, full);
        }
      }
    } else if (code == Opcode::moe_in) {  // 16 (slot, row) pairs a page: gate rows at 0, up rows at 16 KB
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

// Elements 4i..4i+3 of x (thread i % 8 of the 8 consecutive lanes that hold vector i / 8) into the int8 layout.
__device__ __forceinline__ void quantize_x4(const float4 x, int i, const XInt8& xi) {
  float amax = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
  float sum = (x.x + x.y) + (x.z + x.w);
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  const int q0 = __float2int_rn(x.x * inv), q1 = __float2int_rn(x.y * inv);
  const int q2 = __float2int_rn(x.z * inv), q3 = __float2int_rn(x.w * inv);
  // This thread has elements 8k + 4h + 0..3 (k = (i % 8) / 2, h = i % 2): bytes 2h, 2h+1 of lo_k and of hi_k.
  const uint32_t lo = (q0 & 0xFF) | ((q2 & 0xFF) << 8), hi = (q1 & 0xFF) | ((q3 & 0xFF) << 8);
  const uint32_t lo_up = __shfl_xor_sync(0xffffffffu, lo, 1), hi_up = __shfl_xor_sync(0xffffffffu, hi, 1);
  const int vec = i / 8, k = (i % 8) / 2;
  if ((i & 1) == 0) {
    uint32_t* q = reinterpret_cast<uint32_t*>(xi.q + 2 * vec);
    *reinterpret_cast<uint2*>(q + 2 * k) = make_uint2(lo | (lo_up << 16), hi | (hi_up << 16));
  }
  if (i % 8 == 0) xi.scale[vec] = amax / 127.0f, xi.sum[vec] = sum;
}

// sum q_e x_e over one 16-byte vector of 4-bit weights against its int8 x (two uint4 of XInt8::q): 8 dp4a.
__device__ __forceinline__ int dot_q4_i8(uint4 w, uint4 xa, uint4 xb) {
  constexpr uint32_t kLow = 0x0F0F0F0Fu;
  int acc = __dp4a(static_cast<int>(w.x & kLow), static_cast<int>(xa.x), 0);
  acc = __dp4a(static_cast<int>((w.x >> 4) & kLow), static_cast<int>(xa.y), acc);
  acc = __dp4a(static_cast<int>(w.y & kLow), static_cast<int>(xa.z), acc);
  acc = __dp4a(static_cast<int>((w.y >> 4) & kLow), static_cast<int>(xa.w), acc);
  acc = __dp4a(static_cast<int>(w.z & kLow), static_cast<int>(xb.x), acc);
  acc = __dp4a(static_cast<int>((w.z >> 4) & kLow), static_cast<int>(xb.y), acc);
  acc = __dp4a(static_cast<int>(w.w & kLow), static_cast<int>(xb.z), acc);
  return __dp4a(static_cast<int>((w.w >> 4) & kLow), static_cast<int>(xb.w), acc);
}

// x_s (padded) = in, or in / RMS(in) * norm_w. Activations are read through the L2 (__ldcg): other SMs wrote them
// in this step, and this SM's L1 may hold last step's lines.
__device__ void load_x(const Op& op, int cols, float* x_s, float* red_s, const XInt8& xi) {
  constexpr int kPerThread = kXFloats / 4 / kConsumerThreads + 1;  // float4s: moe_out's 4608 floats at most
  const int n4 = cols / 4, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float4* in4 = reinterpret_cast<const float4*>(op.in);
  float4 v[kPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    const int i = threadIdx.x + t * kConsumerThreads;
    v[t] = i < n4 ? __ldcg(in4 + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    ss += (v[t].x * v[t].x + v[t].y * v[t].y) + (v[t].z * v[t].z + v[t].w * v[t].w);
  }
  float inv_rms = 1.0f;
  const bool norm = op.flags & kRmsNorm;
  if (norm) {
    ss = warp_sum(ss);
    if (lane == 0) red_s[warp] = ss;
    consumer_sync();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) total += red_s[w];
    inv_rms = rsqrtf(total / static_cast<float>(cols) + op.eps);
  }
  const float4* w4 = reinterpret_cast<const float4*>(op.norm_w);
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    const int i = threadIdx.x + t * kConsumerThreads;
    if (i < n4) {
      const float4 w = norm ? __ldg(w4 + i) : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
      v[t] = make_float4(v[t].x * inv_rms * w.x, v[t].y * inv_rms * w.y, v[t].z * inv_rms * w.z, v[t].w * inv_rms * w.w);
      *reinterpret_cast<float4*>(x_s + xpad(4 * i)) = v[t];
    }
  }
  if (op.flags & kInt8X) {
#pragma unroll
    for (int t = 0; t < kPerThread; ++t) {
      const int i = threadIdx.x + t * kConsumerThreads;
      if (t * kConsumerThreads >= n4) break;  // warp-uniform: n4 is a multiple of the consumer threads
      quantize_x4(v[t], i, xi);
    }
  }
  consumer_sync();
}

// The pages of one gemv instruction: warp w takes rows 2w, 2w + 1 (4-bit, 2048 columns) or row w (4096 columns,
// or 8-bit) of each page; lane j reads the 16-byte vectors v * 32 + j of those rows, so its slices of x are loaded
// once per page. GATE_UP (moe_in): warp w takes the page's gate row w and up row w (page rows w and 16 + w) and
// writes silu(gate) * up for its (slot, row) pair.
template <int COLS, int BITS, bool INT8, bool GATE_UP>
__device__ void gemv_pages(const Op& op, const Instr& in, const float* x_s, const XInt8& xi, const Ring& ring,
                           uint32_t& k, unsigned long long* wait_ns) {
  static_assert(!(INT8 && BITS == 8) && !(GATE_UP && (COLS != 2048 || BITS != 4)), "the combinations step.cu runs");
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
  // int8: this lane's vectors of x stay in registers for all the instruction's pages.
  uint4 xq[INT8 ? kV : 1][2];
  float x_scale[INT8 ? kV : 1], x_sums[INT8 ? kV : 1];
  if constexpr (INT8) {
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      const int vec = v * 32 + lane;
      xq[v][0] = xi.q[2 * vec], xq[v][1] = xi.q[2 * vec + 1];
      x_scale[v] = xi.scale[vec], x_sums[v] = xi.sum[vec];
    }
  }
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
        if constexpr (INT8) {
#pragma unroll
          for (int r = 0; r < kRpw; ++r) {
            const uint4 w = *reinterpret_cast<const uint4*>(page + (page_row(r) * kVecsPerRow + vec) * 16);
            const int g = page_row(r) * kGroupsPerRow + vec / kVecsPerGroup;
            const float qx = x_scale[v] * static_cast<float>(dot_q4_i8(w, xq[v][0], xq[v][1]));
            part[r] += fmaf(bf16_bits_to_float(s_s[g]), qx, bf16_bits_to_float(b_s[g]) * x_sums[v]);
          }
        } else if constexpr (BITS == 8) {
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

// The Gated DeltaNet step of value heads [row_begin, row_end) (Opcode::gdn_head), the chain's gdn_step arithmetic
// (gdn.cu) on 512 threads: thread (quarter, j) holds rows 32 quarter .. +31 of column j of the head's state, which
// arrives as two pages (rows 0-63: quarters 0-1, rows 64-127: quarters 2-3).
//   eq 14  conv + SiLU of the 384 channels the head reads (q, k of its key head, its v), ring slot pos % 4 updated
//   eq 16  q_hat = q / |q| / sqrt(d_k), k_hat = k / |k|;  eq 17  beta, decay
//   eq 18  S' = decay S; e = (v - S'^T k_hat) beta; S = S' + k_hat e^T; o = S'^T q_hat + e (k_hat . q_hat)
//   eq 19  out = norm_w * o / RMS(o) * silu(z)
__device__ void gdn_heads(const Op& op, const Instr& in, float* scratch, float* red_s, const Ring& ring, uint32_t& k) {
  constexpr int D = kGdnDim, K = 4, kRows = D / 4;
  static_assert(kConsumerThreads == 4 * D, "a consumer thread per (row quarter, column) of a head's state");
  const GdnArgs& g = op.gdn;
  const int key_dim = g.n_k * D, value_dim = g.n_v * D, conv_dim = 2 * key_dim + value_dim;
  float* q_s = scratch;
  float* k_s = q_s + D;
  float* v_s = k_s + D;
  float* part_s = v_s + D;       // [2][4][D]: partial S'^T k_hat, S'^T q_hat per quarter
  float* norm_s = part_s + 8 * D;  // 1/|q|, 1/|k|, raw q.k
  const int tid = threadIdx.x, j = tid % D, quarter = tid / D, warp = tid >> 5, lane = tid & 31;
  const int pos = __ldcg(g.pos);
  for (int h = in.row_begin; h < in.row_end; ++h, k += 2) {
    const int kh = h / (g.n_v / g.n_k);
    if (tid < 3 * D) {
      const int ch = tid < D ? kh * D + tid : tid < 2 * D ? key_dim + kh * D + (tid - D) : 2 * key_dim + h * D + (tid - 2 * D);
      float x[K];
#pragma unroll
      for (int t = 0; t < K - 1; ++t) x[t] = __ldcg(g.conv_ring + static_cast<size_t>((pos + 1 + t) % K) * conv_dim + ch);
      x[K - 1] = __ldcg(g.proj + ch);
      float acc = 0.0f;
#pragma unroll
      for (int t = 0; t < K; ++t) acc += __ldg(g.conv_w + static_cast<size_t>(ch) * K + t) * x[t];
      g.conv_ring[static_cast<size_t>(pos % K) * conv_dim + ch] = x[K - 1];
      const float y = gdn_silu(acc);
      (tid < D ? q_s : tid < 2 * D ? k_s : v_s)[tid % D] = y;
    }
    const float z = quarter == 0 ? __ldcg(g.proj + conv_dim + h * D + j) : 0.0f;
    const float b_logit = __ldcg(g.proj + conv_dim + value_dim + h);
    const float a_in = __ldcg(g.proj + conv_dim + value_dim + g.n_v + h) + __ldg(g.dt_bias + h);
    consumer_sync();
    if (warp < 3) {
      float acc = 0.0f;
      for (int i = lane; i < D; i += 32) acc += warp == 0 ? q_s[i] * q_s[i] : warp == 1 ? k_s[i] * k_s[i] : q_s[i] * k_s[i];
      acc = warp_sum(acc);
      if (lane == 0) norm_s[warp] = warp == 2 ? acc : 1.0f / sqrtf(acc + 1e-6f);
    }
    float beta, decay;
    gdn_gates(b_logit, a_in, __ldg(g.A_log + h), beta, decay);
    consumer_sync();
    const float q_inv = norm_s[0] * (1.0f / sqrtf(static_cast<float>(D))), k_inv = norm_s[1];
    const float kq = norm_s[2] * q_inv * k_inv;
    if (tid < D) {  // q_s, k_s are not read again before the barrier below (the norms were taken before the last)
      q_s[tid] *= q_inv;
      k_s[tid] *= k_inv;
    }
    consumer_sync();
    const int p = static_cast<int>((k + quarter / 2) % kPages);
    mbar_wait(&ring.full[p], ((k + quarter / 2) / kPages) & 1);
    const float* page = reinterpret_cast<const float*>(ring.pages + p * kPageBytes) + (quarter % 2) * kRows * D;
    float s_reg[kRows];
    float sk = 0.0f, sq = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = quarter * kRows + r;
      s_reg[r] = page[r * D + j] * decay;
      sk += s_reg[r] * k_s[i];
      sq += s_reg[r] * q_s[i];
    }
    __syncwarp();
    if (lane == 0) {  // each warp has read its page; the other page it never reads
      mbar_arrive(&ring.empty[k % kPages]);
      mbar_arrive(&ring.empty[(k + 1) % kPages]);
    }
    part_s[quarter * D + j] = sk;
    part_s[4 * D + quarter * D + j] = sq;
    consumer_sync();
    float kv = 0.0f, sqv = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) kv += part_s[q * D + j], sqv += part_s[4 * D + q * D + j];
    const float e = (v_s[j] - kv) * beta;
    float* S = g.S + (static_cast<size_t>(h) * D + quarter * kRows) * D + j;
#pragma unroll
    for (int r = 0; r < kRows; ++r) S[static_cast<size_t>(r) * D] = s_reg[r] + k_s[quarter * kRows + r] * e;
    const float o = sqv + e * kq;
    if (quarter == 0) {
      const float ss = warp_sum(o * o);
      if (lane == 0) red_s[warp] = ss;
    }
    consumer_sync();
    const float total = (red_s[0] + red_s[1]) + (red_s[2] + red_s[3]);
    const float inv_rms = rsqrtf(total / static_cast<float>(D) + op.eps);
    if (quarter == 0) op.out[h * D + j] = __ldg(g.norm_w + j) * (o * inv_rms) * siluf_(z);
    consumer_sync();  // scratch and red_s free for the next head
  }
}

__device__ void run_consumers(const ProgramView& pv, int begin, int end, unsigned long long epoch, const Ring& ring,
                              float* x_s, float* red_s, const XInt8& xi) {
  uint32_t k = 0;
  const bool trace = pv.trace != nullptr && threadIdx.x == 0;
  for (int i = begin; i < end; ++i) {
    unsigned long long* marks = trace ? pv.trace + static_cast<size_t>(i) * kTraceMarks : nullptr;
    if (marks) marks[0] = globaltimer();
    const Instr in = pv.instrs[i];
    const Op op = pv.ops[in.op];
    wait_inputs(pv, op, epoch);
    if (marks) marks[1] = globaltimer();
    if (op.code == Opcode::gdn_head) {
      if (marks) marks[2] = globaltimer();
      gdn_heads(op, in, x_s, red_s, ring, k);
      if (marks) marks[3] = marks[4] = globaltimer();
      if (threadIdx.x == 0) signal(pv, op.signal);
      if (marks) marks[5] = globaltimer(), marks[6] = 0;
      continue;
    }
    unsigned long long page_wait = 0;
    unsigned long long* wait_ns = marks ? &page_wait : nullptr;
    const bool int8 = op.flags & kInt8X;
    if (op.code == Opcode::moe_out) {
      load_x(op, (op.moe.top_k + 1) * op.moe.inter, x_s, red_s, xi);
      if (marks) marks[2] = globaltimer();
      moe_out_pages(op, in, x_s, ring, k, wait_ns);
    } else {
      load_x(op, op.m.cols, x_s, red_s, xi);
      if (marks) marks[2] = globaltimer();
      if (op.code == Opcode::moe_in) {
        if (int8) {
          gemv_pages<2048, 4, true, true>(op, in, x_s, xi, ring, k, wait_ns);
        } else {
          gemv_pages<2048, 4, false, true>(op, in, x_s, xi, ring, k, wait_ns);
        }
      } else if (op.m.bits == 8) {
        gemv_pages<2048, 8, false, false>(op, in, x_s, xi, ring, k, wait_ns);
      } else if (op.m.cols == 2048) {
        if (int8) {
          gemv_pages<2048, 4, true, false>(op, in, x_s, xi, ring, k, wait_ns);
        } else {
          gemv_pages<2048, 4, false, false>(op, in, x_s, xi, ring, k, wait_ns);
        }
      } else if (int8) {
        gemv_pages<4096, 4, true, false>(op, in, x_s, xi, ring, k, wait_ns);
      } else {
        gemv_pages<4096, 4, false, false>(op, in, x_s, xi, ring, k, wait_ns);
      }
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
  XInt8 xi;
  xi.q = reinterpret_cast<uint4*>(red_s + 32);
  xi.scale = reinterpret_cast<float*>(xi.q + 2 * kMaxVecs);
  xi.sum = xi.scale + kMaxVecs;
  ring.full = reinterpret_cast<uint64_t*>(xi.sum + kMaxVecs);
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
  run_consumers(pv, begin, end, epoch, ring, x_s, red_s, xi);
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
  if (view_.trace) return ok_status();
  void* t = nullptr;
  const size_t bytes = static_cast<size_t>(n_instrs_) * kTraceMarks * sizeof(unsigned long long);
  if (cudaMalloc(&t, bytes) != cudaSuccess || cudaMemset(t, 0, bytes) != cudaSuccess)
    return error(ErrorCode::internal, "megakernel: no memory for the timeline");
  allocations_.push_back(t);
  view_.trace = static_cast<unsigned long long*>(t);
  return ok_status();
}

Result<std::vector<unsigned long long>> DeviceProgram::trace() const {
  if (!view_.trace) return error(ErrorCode::invalid_argument, "megakernel: the timeline is off");
  std::vector<unsigned long long> v(static_cast<size_t>(n_instrs_) * kTraceMarks);
  if (cudaMemcpy(v.data(), view_.trace, v.size() * sizeof(v[0]), cudaMemcpyDeviceToHost) != cudaSuccess)
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
