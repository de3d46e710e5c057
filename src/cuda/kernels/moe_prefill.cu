// The MoE block for the T rows of a prefill chunk (moe_prefill.cuh; eqs 20-25 of docs/MODEL.md), in one stream and
// with no host synchronisation:
//  1 rms_norm_rows: x = fp16(RMSNorm(h) * norm_w)                                  (eq 5's ZN, eqs 1-2)
//  2 qgemm: router logits [T, E] fp32 (8-bit), K split in S parts so the small grid fills the SMs (eq 21)
//  3 moe_route_rows, one warp a row: logits = the S partials summed in order z = 0..S-1; fp32 softmax, top-k
//    (ties -> lower index), weights renormalised in
//    rank order (as lily::cpu::route_top_k), the shared-expert gate sg = sigmoid(w_seg . x), the histogram
//    of rows per expert                                                                  (eqs 21, 22, 24)
//  4 moe_tile_map: prefix scan of the histogram to offsets, the tile list: the shared expert's tiles (rows
//    T k .. T k + T - 1, list expert E) first, then every routed expert's rows
//  5 moe_scatter: (row, slot) pairs into expert order (the order within an expert is arbitrary: a GEMM
//    row's result does not depend on the other rows of its tile, so the output stays deterministic); the
//    shared expert's rows T k + t gather token t
//  6 grouped swiglu over the routed and shared rows -> act [T k + T, I] fp16; 7 grouped down -> y
//    [T k + T, H] fp32 (on qgemm.cu's mma.sync tiles; for 4-bit experts on moe_prefill_few.cu's few-row tiles
//    at short prompts and moe_prefill_rs.cu's register-sourced wgmma tiles from 40 rows an expert on sm_90a:
//    same tile list, operands and epilogues): the routed experts (eq 23)
//    and the shared expert (eq 24) in the same two launches, so the shared expert's full tiles share the
//    grid with the routed ones' partial tiles
//  8 (only where the shared expert's shapes or bits differ from the routed experts') shared expert as dense
//    launches: swiglu -> [T, Is] fp16, down -> [T, H] fp32                                         (eq 24)
//  9 moe_combine: h[t] += sum_s w_s y[t, s] + sg[t] y_shared[t] in slot order (deterministic)     (eq 25)
#include <cuda_fp16.h>

#include "cuda/kernels/moe_prefill.cuh"
#include "cuda/kernels/qgemm_util.cuh"
#include "cuda/kernels/quant_dot.cuh"

namespace lily::cuda {

using namespace qgemm_util;

namespace {

constexpr int kGroup = 64;  // K step = one quantisation group
constexpr int kMaxExperts = 256;
constexpr int kMaxTopK = 16;
constexpr int kMinTileRows = kFewRows;
static_assert(kMoeRsTileRows == kRsRows);  // smallest grouped tile (sizes the tile list in the scratch)

struct RouteArgs {
  const float* logits;     // [splits, T, E]: partial sums over equal parts of H
  const __half* x;  // [T, H]
  QMatrix shared_gate;     // 8-bit [1, H]
  int T, E, k, H, splits;
  int* topk_idx;  // [T, k]
  float* topk_w;  // [T, k]
  float* sg;      // [T]
  int* counts;    // [E], zeroed before
};

// Eqs 21-22 and 24's gate for one row per warp: p = softmax(logits) in fp32, the k largest p (key = bits of p
// above ~index: unique and ordered like (p, -index)), weights p / (sum of the k p in rank order) like
// cpu::route_top_k; sg = sigmoid(w_seg . x); the histogram of rows per expert.
__global__ void __launch_bounds__(256) moe_route_rows_kernel(const RouteArgs p) {
  using u64 = unsigned long long;
  const int lane = threadIdx.x & 31, t = blockIdx.x * 8 + (threadIdx.x >> 5);
  pdl_wait();
  if (t >= p.T) return;
  constexpr int kPer = kMaxExperts / 32;
  const float* lg = p.logits + static_cast<size_t>(t) * p.E;
  float v[kPer];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane * kPer + i;
    float l = -INFINITY;
    if (e < p.E) {
      l = lg[e];
      for (int z = 1; z < p.splits; ++z) l += lg[static_cast<size_t>(z) * p.T * p.E + e];  // fixed order
    }
    v[i] = l;
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    v[i] = lane * kPer + i < p.E ? expf(v[i] - mx) : 0.0f;
    sum += v[i];
  }
  const float inv = 1.0f / warp_sum(sum);
  u64 key[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane * kPer + i;
    key[i] = e < p.E ? (u64{__float_as_uint(v[i] * inv)} << 32) | ~static_cast<uint32_t>(e) : 0ull;
  }
  int my_idx = 0;
  float my_p = 0.0f, psum = 0.0f;
  for (int r = 0; r < p.k; ++r) {
    u64 best = key[0];
#pragma unroll
    for (int i = 1; i < kPer; ++i) best = key[i] > best ? key[i] : best;
    const uint32_t hi = __reduce_max_sync(0xffffffffu, static_cast<uint32_t>(best >> 32));
    const uint32_t lo = __reduce_max_sync(
        0xffffffffu, static_cast<uint32_t>(best >> 32) == hi ? static_cast<uint32_t>(best) : 0u);
    const u64 win = (u64{hi} << 32) | lo;
#pragma unroll
    for (int i = 0; i < kPer; ++i) key[i] = key[i] == win ? 0ull : key[i];
    const float prob = __uint_as_float(hi);
    psum += prob;
    if (lane == r) my_idx = static_cast<int>(~lo), my_p = prob;
  }
  if (lane < p.k) {
    p.topk_idx[t * p.k + lane] = my_idx;
    p.topk_w[t * p.k + lane] = my_p / psum;
    atomicAdd(p.counts + my_idx, 1);
  }
  // Shared-expert gate logit: lane takes words lane, lane + 32, ... (4 elements each).
  const __half* x = p.x + static_cast<size_t>(t) * p.H;
  const int words = p.H / 4;
  float dot = 0.0f;
  for (int j = lane; j < words; j += 32) {
    const uint32_t wv = __ldg(p.shared_gate.w + j);
    const int g = j / 16;
    const float s = bf16_bits_to_float(ld_bf16_bits(p.shared_gate.scales + g));
    const float b = bf16_bits_to_float(ld_bf16_bits(p.shared_gate.biases + g));
    const uint2 xv = *reinterpret_cast<const uint2*>(x + 4 * j);
    const __half2 x01 = *reinterpret_cast<const __half2*>(&xv.x);
    const __half2 x23 = *reinterpret_cast<const __half2*>(&xv.y);
    const float xs[4] = {__low2float(x01), __high2float(x01), __low2float(x23), __high2float(x23)};
#pragma unroll
    for (int q = 0; q < 4; ++q)
      dot = fmaf(fmaf(s, static_cast<float>((wv >> (8 * q)) & 0xFFu), b), xs[q], dot);
  }
  dot = warp_sum(dot);
  if (lane == 0) p.sg[t] = sigmoidf_(dot);
}

struct MapArgs {
  const int* counts;  // [E]
  int E, tile_rows;
  int shared_rows;    // T where the shared expert runs in the grouped launches (tile-list expert E), else 0
  int shared_row0;    // its first row (T k)
  int* cursor;       // out [E]: offsets (the scatter's running positions)
  int* tile_count;   // out [1]
  int* tile_expert;  // out [max_tiles]
  int* tile_row0;
  int* tile_rows_out;
};

// One block of 256 threads (thread e = expert e): exclusive scans of the counts and of the tiles per expert.
// The shared expert's tiles (if any) come first in the list: full tiles, started before the routed tails.
__global__ void __launch_bounds__(kMaxExperts) moe_tile_map_kernel(const MapArgs p) {
  __shared__ int warp_rows[8], warp_tiles[8];
  pdl_wait();
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
  const int shared_tiles = (p.shared_rows + p.tile_rows - 1) / p.tile_rows;
  for (int i = e; i < shared_tiles; i += kMaxExperts) {
    p.tile_expert[i] = p.E;
    p.tile_row0[i] = p.shared_row0 + i * p.tile_rows;
    p.tile_rows_out[i] = min(p.tile_rows, p.shared_rows - i * p.tile_rows);
  }
  const int n = e < p.E ? p.counts[e] : 0, tiles = (n + p.tile_rows - 1) / p.tile_rows;
  int inc_rows = n, inc_tiles = tiles;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int r = __shfl_up_sync(0xffffffffu, inc_rows, o), t = __shfl_up_sync(0xffffffffu, inc_tiles, o);
    if (lane >= o) inc_rows += r, inc_tiles += t;
  }
  if (lane == 31) warp_rows[warp] = inc_rows, warp_tiles[warp] = inc_tiles;
  __syncthreads();
  int base_rows = 0, base_tiles = 0;
  for (int w = 0; w < warp; ++w) base_rows += warp_rows[w], base_tiles += warp_tiles[w];
  const int row_off = base_rows + inc_rows - n, tile_off = shared_tiles + base_tiles + inc_tiles - tiles;
  if (e < p.E) p.cursor[e] = row_off;
  for (int i = 0; i < tiles; ++i) {
    p.tile_expert[tile_off + i] = e;
    p.tile_row0[tile_off + i] = row_off + i * p.tile_rows;
    p.tile_rows_out[tile_off + i] = min(p.tile_rows, n - i * p.tile_rows);
  }
  if (e == kMaxExperts - 1) {
    int total = shared_tiles;
    for (int w = 0; w < 8; ++w) total += warp_tiles[w];
    *p.tile_count = total;
  }
  pdl_launch_dependents();
}

struct ScatterArgs {
  const int* topk_idx;  // [T k]
  int n;                // T k
  int k;
  int shared_rows;  // T where the shared expert's rows follow the routed ones (token_of[n + t] = t), else 0
  int* cursor;    // [E]
  int* token_of;  // out [T k (+ T)]: the token of each expert-ordered row
  int* pos_of;    // out [T k]: the expert-ordered row of (t, s)
};

__global__ void __launch_bounds__(256) moe_scatter_kernel(const ScatterArgs p) {
  pdl_wait();
  const int i = blockIdx.x * 256 + threadIdx.x;
  if (i >= p.n) {
    if (i < p.n + p.shared_rows) p.token_of[i] = i - p.n;
    return;
  }
  const int pos = atomicAdd(p.cursor + p.topk_idx[i], 1);
  p.token_of[pos] = i / p.k;
  p.pos_of[i] = pos;
}

struct CombineArgs {
  float* h;             // [T, H]
  const float* y;       // [T k, H] expert order
  const float* ys;      // [T, H]
  const float* topk_w;  // [T k]
  const int* pos_of;    // [T k]
  const float* sg;      // [T]
  int H, k;
};

// Eq 25 plus the residual: h[t] += sum_s w_s y[pos(t, s)] + sg[t] ys[t], slots in rank order, 4 columns
// a thread.
__global__ void __launch_bounds__(256) moe_combine_kernel(const CombineArgs p) {
  __shared__ int pos_s[kMaxTopK];
  __shared__ float w_s[kMaxTopK];
  pdl_wait();
  const int t = blockIdx.x;
  if (threadIdx.x < p.k) {
    pos_s[threadIdx.x] = p.pos_of[t * p.k + threadIdx.x];
    w_s[threadIdx.x] = p.topk_w[t * p.k + threadIdx.x];
  }
  __syncthreads();
  const float g = p.sg[t];
  for (int c = threadIdx.x * 4; c < p.H; c += 256 * 4) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < p.k; ++s) {
      const float4 v = *reinterpret_cast<const float4*>(p.y + static_cast<size_t>(pos_s[s]) * p.H + c);
      acc.x = fmaf(w_s[s], v.x, acc.x), acc.y = fmaf(w_s[s], v.y, acc.y);
      acc.z = fmaf(w_s[s], v.z, acc.z), acc.w = fmaf(w_s[s], v.w, acc.w);
    }
    const float4 v = *reinterpret_cast<const float4*>(p.ys + static_cast<size_t>(t) * p.H + c);
    acc.x = fmaf(g, v.x, acc.x), acc.y = fmaf(g, v.y, acc.y), acc.z = fmaf(g, v.z, acc.z),
    acc.w = fmaf(g, v.w, acc.w);
    float4* hp = reinterpret_cast<float4*>(p.h + static_cast<size_t>(t) * p.H + c);
    float4 hv = *hp;
    hv.x += acc.x, hv.y += acc.y, hv.z += acc.z, hv.w += acc.w;
    *hp = hv;
  }
}

// Scratch layout of moe_prefill (each array 256-byte aligned).

struct MoeScratch {
  __half* x;
  float* logits;
  int* topk_idx;
  float* topk_w;
  float* sg;
  int* counts;
  int* cursor;
  int* tile_count;
  int* tile_expert;
  int* tile_row0;
  int* tile_rows;
  int* token_of;
  int* pos_of;
  __half* act;
  float* y;
  __half* act_s;
  float* ys;
  size_t bytes;
};

constexpr int kMaxRouterSplits = 8;

// Longest tile list: routed rows in the smallest tiles, a partial tile per expert, the shared expert's rows.
int max_tiles(int T, int E, int k) {
  return (T * k + kMinTileRows - 1) / kMinTileRows + E + (T + kMinTileRows - 1) / kMinTileRows;
}

MoeScratch carve(void* base, int T, int H, int I, int Is, int E, int k) {
  MoeScratch s{};
  size_t off = 0;
  char* b = static_cast<char*>(base);
  auto take = [&](size_t bytes) {
    void* ptr = b ? b + off : nullptr;
    off += (bytes + 255) / 256 * 256;
    return ptr;
  };
  const size_t Tz = T, rows = size_t{1} * T * k, tiles = max_tiles(T, E, k);
  s.x = static_cast<__half*>(take(Tz * H * 2));
  s.logits = static_cast<float*>(take(size_t{kMaxRouterSplits} * Tz * E * 4));
  s.topk_idx = static_cast<int*>(take(rows * 4));
  s.topk_w = static_cast<float*>(take(rows * 4));
  s.sg = static_cast<float*>(take(Tz * 4));
  s.counts = static_cast<int*>(take(size_t{1} * E * 4));
  s.cursor = static_cast<int*>(take(size_t{1} * E * 4));
  s.tile_count = static_cast<int*>(take(4));
  s.tile_expert = static_cast<int*>(take(tiles * 4));
  s.tile_row0 = static_cast<int*>(take(tiles * 4));
  s.tile_rows = static_cast<int*>(take(tiles * 4));
  s.token_of = static_cast<int*>(take((rows + Tz) * 4));
  s.pos_of = static_cast<int*>(take(rows * 4));
  if (I == Is) {  // the shared expert's act / y rows follow the routed ones (rows T k .. T k + T - 1)
    s.act = static_cast<__half*>(take((rows + Tz) * I * 2));
    s.y = static_cast<float*>(take((rows + Tz) * H * 4));
    s.act_s = s.act ? s.act + rows * I : nullptr;
    s.ys = s.y ? s.y + rows * H : nullptr;
  } else {
    s.act = static_cast<__half*>(take(rows * I * 2));
    s.y = static_cast<float*>(take(rows * H * 4));
    s.act_s = static_cast<__half*>(take(Tz * Is * 2));
    s.ys = static_cast<float*>(take(Tz * H * 4));
  }
  s.bytes = off;
  return s;
}

}  // namespace

size_t moe_prefill_scratch_bytes(int T, int H, int I, int Is, int n_experts, int top_k) {
  if (T < 1 || H < 1 || I < 1 || Is < 1 || n_experts < 1 || top_k < 1) return 0;
  return carve(nullptr, T, H, I, Is, n_experts, top_k).bytes;
}

cudaError_t moe_prefill(const MoePrefillParams& p, cudaStream_t stream) {
  const int T = p.T, k = p.top_k, E = p.router.rows, H = p.router.cols, I = p.gate.rows,
            Is = p.shared_up.rows;
  const bool shapes_ok =
      valid_qmatrix(p.router) && p.router.bits == 8 && E <= kMaxExperts && valid_qmatrix(p.shared_gate) &&
      p.shared_gate.bits == 8 && p.shared_gate.cols == H && valid_qmatrix(p.gate) && valid_qmatrix(p.up) &&
      valid_qmatrix(p.down) && p.gate.cols == H && p.up.cols == H && p.up.rows == I &&
      p.up.bits == p.gate.bits && p.down.rows == H && p.down.cols == I && valid_qmatrix(p.shared_gate_proj) &&
      valid_qmatrix(p.shared_up) && valid_qmatrix(p.shared_down) && p.shared_gate_proj.rows == Is &&
      p.shared_gate_proj.cols == H && p.shared_up.cols == H && p.shared_gate_proj.bits == p.shared_up.bits &&
      p.shared_down.rows == H && p.shared_down.cols == Is && H % 4 == 0;
  if (!shapes_ok || T < 1 || k < 1 || k > kMaxTopK || k > E || !p.h || !p.norm_w || !p.scratch ||
      p.scratch_bytes < moe_prefill_scratch_bytes(T, H, I, Is, E, k) || !aligned16(p.h) ||
      !aligned16(p.scratch) ||
      (p.tile_rows != 0 && p.tile_rows != kFewRows && p.tile_rows != 64 && p.tile_rows != 128 &&
       p.tile_rows != kRsRows)) {
    return cudaErrorInvalidValue;
  }
  const MoeScratch s = carve(p.scratch, T, H, I, Is, E, k);
  // The shared expert runs as tile-list expert E of the grouped launches (its tiles fill the grouped grid's
  // tail) where its matrices have the routed experts' shapes and bits; else as dense launches after them.
  const bool fold = Is == I && p.shared_gate_proj.bits == p.gate.bits &&
                    p.shared_down.bits == p.down.bits;
  // kFewRows-row tiles (launch_grouped_few) take 4-bit experts with the shared expert folded in.
  const bool few_ok = fold && p.gate.bits == 4 && p.down.bits == 4 && I % 64 == 0 && H % 128 == 0;
  if (p.tile_rows == kFewRows && !few_ok) return cudaErrorInvalidValue;
  // kRsRows-row tiles (launch_grouped_rs, sm_90a): the same, K of both GEMMs a multiple of 512 up to 4096.
  const bool rs_ok = few_ok && H % 512 == 0 && I % 512 == 0 && H <= 4096 && I <= 4096;
  if (p.tile_rows == kRsRows && !rs_ok) return cudaErrorInvalidValue;
  if (p.tile_rows == kRsRows && !wgmma_built()) return cudaErrorInvalidDeviceFunction;
  // Tile rows from the rows an expert gets on average (T k / E). Measured (H200, full geometry, cold
  // weights, us a layer; few-row 32 / 64-row / 128-row / register-sourced 192-row tiles): T = 1024 (32 rows an
  // expert) 544 / 728 / 895 / 587; T = 1280 (40) 642 / 808 / 947 / 624; T = 1536 (48) 738 / 871 / 981 / 656;
  // T = 2048 (64) 923 / 1040 / 1086 / 731; T = 4096 (128) 1613 / 1793 / 1602 / 1047; at T = 256 (8) the few-row
  // tiles take 322 (register-sourced ~557). Few-row tiles below 40 rows an expert; from 40 the register-sourced
  // tiles where they run (sm_90a), else few-row tiles to 64 rows, 128-row tiles from 96, 64-row ones between.
  const long routed = static_cast<long>(T) * k;
  // The fp16 copies where given take the 192-row tiles from kW16MinRowsPerExpert rows an expert, or on request
  // (tile_rows kRsRows); measured: docs/PERF_NOTES.md, 2026-12-04 (eleventh session).
  const bool w16_ok = p.w16 && few_ok && wgmma_built();
  const bool use_w16 = w16_ok && (p.tile_rows == kRsRows ||
                                  (p.tile_rows == 0 && routed >= static_cast<long>(kW16MinRowsPerExpert) * E));
  const bool rs_auto = rs_ok && routed >= 40L * E && wgmma_built();
  const int tile_rows = use_w16       ? kRsRows
                        : p.tile_rows ? p.tile_rows
                        : few_ok && routed < 40L * E ? kFewRows
                        : rs_auto                    ? kRsRows
                        : few_ok && routed <= 64L * E ? kFewRows
                        : routed >= 96L * E           ? 128
                                                      : 64;
  const int shared_rows = fold ? T : 0;

  CUDA_TRY(rms_norm_rows(p.h, p.norm_w, T, H, p.eps, s.x, stream));
  // Router: a few row tiles of a 2048-deep K loop would leave most SMs idle, so K is split into equal parts
  // (partial logits summed in a fixed order by moe_route_rows) until the grid covers the SMs twice.
  TileArgs r;
  r.w[0] = r.w[1] = p.router, r.a = s.x, r.M = T, r.N = E, r.K = H, r.out = GemmOut::f32, r.c = s.logits;
  r.ldc = E;
  const int r_rows = dense_tile_rows(T, E, 128);
  const long r_blocks = static_cast<long>((T + r_rows - 1) / r_rows) * ((E + 127) / 128);
  while (r.k_splits < kMaxRouterSplits && (H / kGroup) % (2 * r.k_splits) == 0 &&
         r_blocks * r.k_splits * 2 <= 2 * 132) {
    r.k_splits *= 2;
  }
  CUDA_TRY(launch_dense(r, 8, r_rows, stream));
  CUDA_TRY(cudaMemsetAsync(s.counts, 0, sizeof(int) * E, stream));
  RouteArgs ra{s.logits, s.x, p.shared_gate, T, E, k, H, r.k_splits, s.topk_idx, s.topk_w, s.sg, s.counts};
  CUDA_TRY(launch_pdl(moe_route_rows_kernel, dim3((T + 7) / 8), dim3(256), 0, stream, ra));
  MapArgs ma{s.counts,  E,           tile_rows,   shared_rows, T * k,
             s.cursor, s.tile_count, s.tile_expert, s.tile_row0, s.tile_rows};
  CUDA_TRY(launch_pdl(moe_tile_map_kernel, dim3(1), dim3(kMaxExperts), 0, stream, ma));
  ScatterArgs sa{s.topk_idx, T * k, k, shared_rows, s.cursor, s.token_of, s.pos_of};
  CUDA_TRY(launch_pdl(moe_scatter_kernel, dim3((T * k + shared_rows + 255) / 256), dim3(256), 0, stream, sa));

  const int tiles = (T * k + tile_rows - 1) / tile_rows + E + (shared_rows + tile_rows - 1) / tile_rows;
  TileArgs g;
  g.w[0] = p.gate, g.w[1] = p.up, g.a = s.x, g.N = I, g.K = H, g.c = s.act, g.ldc = I;
  g.tile_count = s.tile_count, g.tile_expert = s.tile_expert, g.tile_row0 = s.tile_row0,
  g.tile_rows = s.tile_rows;
  g.gather = s.token_of;
  g.ws[0] = p.shared_gate_proj, g.ws[1] = p.shared_up, g.shared_expert = fold ? E : -1;
  auto grouped = [&](const TileArgs& t, int bits, bool swiglu) {
    if (use_w16)
      return launch_grouped_w16(t, swiglu ? p.w16 : p.w16 + moe_w16_down_offset(E, H, I), tiles, swiglu, stream);
    if (tile_rows == kFewRows) return launch_grouped_few(t, tiles, swiglu, stream);
    if (tile_rows == kRsRows) return launch_grouped_rs(t, tiles, swiglu, stream);
    return launch_grouped(t, bits, tile_rows, tiles, swiglu, stream);
  };
  CUDA_TRY(grouped(g, p.gate.bits, true));
  TileArgs d = g;
  d.w[0] = d.w[1] = p.down, d.a = s.act, d.N = H, d.K = I, d.out = GemmOut::f32, d.c = s.y, d.ldc = H;
  d.gather = nullptr;
  d.ws[0] = d.ws[1] = p.shared_down;
  CUDA_TRY(grouped(d, p.down.bits, false));

  if (!fold) {
    TileArgs sh;
    sh.w[0] = p.shared_gate_proj, sh.w[1] = p.shared_up, sh.a = s.x, sh.M = T, sh.N = Is, sh.K = H;
    sh.out = GemmOut::f16, sh.c = s.act_s, sh.ldc = Is;
    CUDA_TRY(launch_dense_swiglu(sh, p.shared_up.bits, dense_tile_rows(T, Is, 64), stream));
    TileArgs sd;
    sd.w[0] = sd.w[1] = p.shared_down, sd.a = s.act_s, sd.M = T, sd.N = H, sd.K = Is, sd.out = GemmOut::f32;
    sd.c = s.ys, sd.ldc = H;
    CUDA_TRY(launch_dense(sd, p.shared_down.bits, dense_tile_rows(T, H, 128), stream));
  }

  CombineArgs ca{p.h, s.y, s.ys, s.topk_w, s.pos_of, s.sg, H, k};
  return launch_pdl(moe_combine_kernel, dim3(T), dim3(256), 0, stream, ca);
}

}  // namespace lily::cuda
