// Gated full attention prefill (eqs 7-12 of docs/MODEL.md) for T new rows at positions pos0 .. pos0+T-1.
//
// attn_prefill_prep (eqs 9-10 + KV append): grid (T, nq + nkv), one thread per dim: the same arithmetic as
//   attention.cu's attn_prep_kernel (block sum of x^2 in fp32, y = x * inv * w with separately rounded products,
//   rope_element at pos0 + t), so q and the K/V rows are bit-identical to the decode prep's for the same row.
//   q goes to the scratch as bf16 [T, nq, D] (the scratch's first T*nq*D*2 bytes); k and v (bf16) to cache row
//   pos0 + t. Moves T * (nq*2*D + 2*nkv*D) * 4 bytes in and T * (nq + 2*nkv) * D * 2 bytes out.
//
// attn_prefill_flash (eqs 11-12): causal flash attention on the tensor cores (mma.sync m16n8k16 bf16, fp32
//   accumulate, online softmax in fp32, log2 units). Block = (query tile, kv head m), 8 warps, kBlockM = 128 rows
//   of the M dimension packed as (query head h of the group, query row): with group g = nq/nkv, a block covers
//   128/g query rows x g heads (full geometry: 16 rows x 8 heads), so each K/V tile is loaded once for all the
//   query heads that share it (GQA). Warp w owns 16 consecutive query rows of one head. The block walks cache
//   tiles of 64 rows from 0 to its last query position (tiles past it are never loaded; a warp skips tiles that
//   are entirely above its diagonal and masks only the tiles that cross it), K/V double-buffered with cp.async
//   (rows >= pos0+T are zero-filled, never read). Per tile and warp: S = Q K^T (A = Q from shared memory,
//   B = K tile via ldmatrix), online-softmax update, O += P V with P taken straight from the S accumulators
//   (rounded to bf16) and B = V via ldmatrix.trans; O is 16 x D fp32 in registers. Epilogue: O / l * sigmoid(gate)
//   -> fp16 out [T, nq*D]. Query tiles are issued heaviest (latest) first.
//   FLOPs: 4 * nq * D * sum_t (pos0 + t + 1); the cache is read once per query tile: nkv * ceil(T / (128/g))
//   tiles x (pos0 + t_last + 1) rows x D x 4 bytes (K and V; from L2 after the first tile reads them).
//   Shared memory: Q 128 x (D+8) + 2 stages x (K, V) 64 x (D+8) bf16 = 202,752 B at D = 256 (one block per SM).
//   KV split (flash-decoding style) only for short chunks: T rows give nkv * ceil(T / (128/g)) blocks (512 at
//   T = 4096, full geometry), which fill the 132 SMs from T ~ 1K on; below that each block's tile range is split
//   n_splits = min(132 / blocks, tiles / 4, 64) ways (e.g. T = 100 after a 100K-row cache: 14 blocks x 9 splits
//   instead of 14 blocks walking 1,600 tiles each), the splits write unnormalised O and (max, sum) to the scratch,
//   and attn_prefill_combine merges them (weights exp2(m_s - M)), divides, gates and rounds to bf16.
//   Measured (H200, graph replay, prep included, full geometry; TFLOP/s of the useful causal FLOPs): T 4096 at
//   pos0 0 0.87 ms (158), pos0 28672 8.2 ms (252), pos0 126976 33.3 ms (260 = 33% of 790); T 512 at pos0 0
//   0.072 ms (30); T 64 at pos0 65536 0.29 ms (235; 4.37 ms unsplit); T 1 at pos0 131000 0.16 ms (8.6 ms unsplit).
//   255 registers, no spills. Tried and dropped: splitting the P V phase by dims over warp quads (P through shared
//   memory) halves that phase's ldmatrix traffic but measured 4% slower (an extra barrier a tile), so the kernel
//   is bound by latency and synchronisation more than by shared-memory bandwidth; the next step is wgmma.
// AttnPrefillParams::variant 1 replaces the flash kernel by the wgmma one (attn_prefill_wgmma.cu: head_dim 256,
//   sm_90a) with the same blocks, splits, partials and epilogue; flash_only (tests) skips the prep.
// Scratch: q bf16 [T, nq, D], then room for the partials: n_splits * T <= min(64 T, 132 * 128 / nq) rows of
//   nq * (D + 2) floats (17.4 MB at the full geometry); non-decreasing in T.
#include <algorithm>
#include <cmath>

#include "cuda/kernels/attn_prefill.cuh"
#include "cuda/kernels/attention_util.cuh"
#include "cuda/kernels/attn_prefill_util.cuh"

namespace lily::cuda {

namespace {

using namespace attn_util;
using namespace attn_prefill_util;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockM = kWarps * 16;  // (query head, query row) pairs per block
constexpr int kBlockN = 64;           // cache rows per tile
constexpr int kStages = 2;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kTargetBlocks = 132;  // the H200's SMs (one flash block each): below this many blocks, split the KV
constexpr int kMinSplitTiles = 4;   // a KV split covers at least 4 tiles (256 cache rows)
constexpr int kMaxSplits = 64;

// The flash kernel's arguments: the caller's parameters and, with n_splits > 1, the partials in the scratch.
struct FlashArgs {
  AttnPrefillParams p;
  int n_splits = 1;
  float* part_o = nullptr;   // [n_splits, T, nq, D]: unnormalised O of each split
  float* part_ml = nullptr;  // [n_splits, T, nq, 2]: running max (log2 units) and sum of each split
};

// Splits of the KV range: only when the (query tile, kv head) blocks leave SMs idle, never below kMinSplitTiles
// tiles a split. n_splits * T <= min(kMaxSplits * T, kTargetBlocks * 128 / nq) (T / ceil(T / rows) <= rows).
int n_splits_for(int T, int pos0, int nq, int nkv) {
  const int blocks = ceil_div(T, kBlockM / (nq / nkv)) * nkv;
  const int by_sms = kTargetBlocks / blocks, by_len = ceil_div(pos0 + T, kBlockN) / kMinSplitTiles;
  return std::max(1, std::min(std::min(by_sms, by_len), kMaxSplits));
}

template <int D>
struct Layout {
  static constexpr int kPitch = D + 8;  // bf16 per shared-memory row; the extra 16 B make ldmatrix conflict-free
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr size_t kQElems = size_t{kBlockM} * kPitch;
  static constexpr size_t kTileElems = size_t{kBlockN} * kPitch;
  static constexpr size_t kSmemBytes = (kQElems + size_t{kStages} * 2 * kTileElems) * sizeof(__nv_bfloat16);
};

// ---- sizes ---------------------------------------------------------------------------------------------------

size_t q_scratch_bytes(int T, int nq, int head_dim) {
  return (static_cast<size_t>(T) * nq * head_dim * sizeof(__nv_bfloat16) + 255) / 256 * 256;
}

// The bound on n_splits * T above: non-decreasing in T, so a scratch sized for the largest chunk serves every
// smaller one.
size_t partial_bytes(int T, int nq, int head_dim) {
  const size_t rows = std::min<size_t>(static_cast<size_t>(T) * kMaxSplits, size_t{kTargetBlocks} * kBlockM / nq);
  return rows * nq * (head_dim + 2) * sizeof(float);
}

// ---- prep ----------------------------------------------------------------------------------------------------

__global__ void attn_prefill_prep_kernel(const __grid_constant__ AttnPrefillParams p) {
  __shared__ float y_s[1024];
  __shared__ float scratch[32];
  const int D = p.head_dim, d = threadIdx.x, t = blockIdx.x, b = blockIdx.y;
  const bool is_q = b < p.nq;
  const int m = b - p.nq;  // kv head for the k/v blocks
  const float* row = p.proj + static_cast<size_t>(t) * (static_cast<size_t>(p.nq) * 2 * D + size_t{2} * p.nkv * D);
  const float* src = is_q ? row + static_cast<size_t>(b) * 2 * D : row + static_cast<size_t>(p.nq) * 2 * D + m * D;
  const float* w = is_q ? p.q_norm : p.k_norm;
  pdl_launch_dependents();
  const float w_d = w[d];  // a weight: before waiting for the projection GEMM
  pdl_wait();
  const int pos = p.pos0 + t;

  // Eq 9 (multiplier form, as cpu::rms_norm and attn_prep): y = x * (1 / sqrt(mean x^2 + eps)) * w.
  const float x = src[d];
  const float ss = block_sum(x * x, scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + p.eps);
  float y = __fmul_rn(__fmul_rn(x, inv), w_d);
  y_s[d] = y;
  __syncthreads();

  y = rope_element(y_s, d, p.rotary_dim, p.rope_theta, pos);  // eq 10

  if (is_q) {
    __nv_bfloat16* q = static_cast<__nv_bfloat16*>(p.scratch);
    q[(static_cast<size_t>(t) * p.nq + b) * D + d] = __float2bfloat16_rn(y);
  } else {
    const size_t dst = (static_cast<size_t>(pos) * p.nkv + m) * D + d;
    p.k_cache[dst] = __float2bfloat16_rn(y);
    p.v_cache[dst] = __float2bfloat16_rn(row[static_cast<size_t>(p.nq) * 2 * D + static_cast<size_t>(p.nkv + m) * D + d]);
  }
}

// ---- flash attention -----------------------------------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(kThreads, 1) attn_prefill_flash_kernel(const __grid_constant__ FlashArgs args) {
  const AttnPrefillParams& p = args.p;
  using L = Layout<D>;
  constexpr int kPitch = L::kPitch, kChunks = L::kChunks;
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);  // [kBlockM][kPitch]: row = h * rows_t + query row
  __nv_bfloat16* kv_s = q_s + L::kQElems;                        // [kStages][K, V][kBlockN][kPitch]
  const int group = p.nq / p.nkv, rows_t = kBlockM / group;      // query rows per block
  // Block = (query tile, kv head m, split); in order of decreasing work: the latest query tile of every kv head
  // first. Split s takes tiles [s*chunk, (s+1)*chunk) of the block's range.
  const int split = static_cast<int>(blockIdx.x) % args.n_splits, bm = static_cast<int>(blockIdx.x) / args.n_splits;
  const int m = bm % p.nkv, n_qtiles = gridDim.x / (p.nkv * args.n_splits);
  const int tq0 = (n_qtiles - 1 - bm / p.nkv) * rows_t;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_total = p.pos0 + p.T;  // valid cache rows
  const int kv_end = min(p.pos0 + tq0 + rows_t, n_total);
  const int n_tiles = (kv_end + kBlockN - 1) / kBlockN, chunk = (n_tiles + args.n_splits - 1) / args.n_splits;
  const int tile_begin = min(split * chunk, n_tiles), tile_end = min(tile_begin + chunk, n_tiles);
  const size_t kv_row_stride = static_cast<size_t>(p.nkv) * D;
  pdl_launch_dependents();
  pdl_wait();  // q and the new cache rows come from the prep

  const __nv_bfloat16* q_src = static_cast<const __nv_bfloat16*>(p.scratch);
  for (int c = threadIdx.x; c < kBlockM * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const int h = r / rows_t, t = tq0 + r % rows_t;
    const bool valid = t < p.T;  // rows past the chunk: zeros, never written out
    const __nv_bfloat16* src = q_src + (static_cast<size_t>(valid ? t : 0) * p.nq + m * group + h) * D + col;
    cp_async_16(smem_u32(q_s + r * kPitch + col), src, valid);
  }
  auto load_tile = [&](int tile, int stage) {
    __nv_bfloat16* k_dst = kv_s + static_cast<size_t>(stage) * 2 * L::kTileElems;
    __nv_bfloat16* v_dst = k_dst + L::kTileElems;
    for (int c = threadIdx.x; c < kBlockN * kChunks; c += kThreads) {
      const int r = c / kChunks, col = (c % kChunks) * 8, row = tile * kBlockN + r;
      const bool valid = row < n_total;
      const size_t off = static_cast<size_t>(valid ? row : 0) * kv_row_stride + static_cast<size_t>(m) * D + col;
      cp_async_16(smem_u32(k_dst + r * kPitch + col), p.k_cache + off, valid);
      cp_async_16(smem_u32(v_dst + r * kPitch + col), p.v_cache + off, valid);
    }
  };
  if (tile_begin < tile_end) load_tile(tile_begin, 0);
  cp_async_commit();

  // This warp: head h_w of the group, query rows tw0 .. tw0+15. Lane (g = lane/4, t4 = lane%4) holds rows g and
  // g+8; row r may attend cache rows 0 .. lim[r] (its position; rows past the chunk clamp to the last valid row).
  const int h_w = warp * 16 / rows_t, tw0 = tq0 + (warp * 16) % rows_t;
  const int g = lane / 4, t4 = lane % 4;
  const bool warp_active = tw0 < p.T;
  const int lim_first = min(p.pos0 + tw0, n_total - 1), lim_last = min(p.pos0 + tw0 + 15, n_total - 1);
  const int lim[2] = {min(p.pos0 + tw0 + g, n_total - 1), min(p.pos0 + tw0 + g + 8, n_total - 1)};

  // ldmatrix lane addresses (matrix j = lane/8 of an x4 load): the A operand (Q) and V (B via .trans) take rows
  // (j&1)*8 + lane%8, cols (j>>1)*8; K (B, non-transposed) takes rows (j>>1)*8 + lane%8, cols (j&1)*8.
  const int a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * kPitch + (lane >> 4) * 8;
  const int k_off = ((lane & 7) + (lane >> 4) * 8) * kPitch + ((lane >> 3) & 1) * 8;
  const uint32_t q_addr = smem_u32(q_s + warp * 16 * kPitch + a_off);
  const float s_mul = p.scale * kLog2e;

  float o[D / 8][4];  // O [16 rows, D]: o[nt][0..1] row g, dims 8nt + 2t4 + {0,1}; o[nt][2..3] row g+8
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // l_run: this lane's part of the row sum
  auto o_at = [&o](int nt, int e) -> float& { return o[nt][e]; };

  for (int i = tile_begin; i < tile_end; ++i) {
    const int stage = (i - tile_begin) % kStages;
    if (i + 1 < tile_end) load_tile(i + 1, (stage + 1) % kStages);
    cp_async_commit();
    cp_async_wait<1>();  // tile i (and q) landed for this thread ...
    __syncthreads();     // ... and for all
    const int k0 = i * kBlockN;
    if (warp_active && k0 <= lim_last) {  // else every row of the warp is masked
      const __nv_bfloat16* k_tile = kv_s + static_cast<size_t>(stage) * 2 * L::kTileElems;
      const uint32_t k_addr = smem_u32(k_tile + k_off), v_addr = smem_u32(k_tile + L::kTileElems + a_off);

      // S = Q K^T: 16 rows x 64 cache rows (8 n-tiles).
      float s[kBlockN / 8][4];
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
      auto s_at = [&s](int nt, int e) -> float& { return s[nt][e]; };
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, q_addr + kk * 32);
#pragma unroll
        for (int np = 0; np < kBlockN / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, k_addr + (np * 16 * kPitch + kk * 16) * 2);
          mma_bf16(s[2 * np], a, b[0], b[1]);
          mma_bf16(s[2 * np + 1], a, b[2], b[3]);
        }
      }

      // Online softmax (log2 units); only tiles crossing the diagonal are masked.
      float mx[2] = {-INFINITY, -INFINITY};
      scale_mask_max<kBlockN>(s_at, k0, t4, k0 + kBlockN - 1 > lim_first, lim, s_mul, mx);
      float alpha[2], m_use[2];
      online_softmax_update(mx, m_run, l_run, alpha, m_use);
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pe = exp2f(s[nt][e] - m_use[e / 2]);
          s[nt][e] = pe;
          l_run[e / 2] += pe;
        }
      rescale_o<D>(o_at, alpha);

      // O += P V: the A fragment of k-step kk is the S accumulators of n-tiles 2kk, 2kk+1.
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint32_t a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                               pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_addr + (kk * 16 * kPitch + dp * 16) * 2);
          mma_bf16(o[2 * dp], a, b[0], b[1]);
          mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the stage is free for tile i + 2
  }
  cp_async_wait<0>();

  // Epilogue (eq 12's gate): out = O / l * sigmoid(gate) or, split, the partials.
  if (!warp_active) return;
  flash_epilogue<D>(args, split, m * group + h_w, tw0, g, t4, o_at, m_run, l_run);
}

// Merges the KV splits of one (query row t, head j) per block: weights exp2(m_s - M), o = sum w_s o_s / sum w_s l_s,
// times sigmoid(gate), bf16. Moves n_splits * T * nq * (D + 2) * 4 bytes of partials.
__global__ void attn_prefill_combine_kernel(const __grid_constant__ FlashArgs args) {
  const AttnPrefillParams& p = args.p;
  const int D = p.head_dim;
  const size_t tj = blockIdx.x, plane = static_cast<size_t>(p.T) * p.nq;  // tj = t * nq + j
  const int t = static_cast<int>(tj / p.nq), j = static_cast<int>(tj % p.nq);
  pdl_launch_dependents();
  pdl_wait();
  float mx = -INFINITY;
  for (int s = 0; s < args.n_splits; ++s) mx = fmaxf(mx, args.part_ml[(s * plane + tj) * 2]);
  const float* gate = p.proj + static_cast<size_t>(t) * (static_cast<size_t>(p.nq) * 2 * D + size_t{2} * p.nkv * D) +
                      static_cast<size_t>(j) * 2 * D + D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f, l = 0.0f;
    for (int s = 0; s < args.n_splits; ++s) {
      const float2 ml = *reinterpret_cast<const float2*>(args.part_ml + (s * plane + tj) * 2);
      const float w = ml.x == -INFINITY ? 0.0f : exp2f(ml.x - mx);  // a split without visible rows weighs nothing
      l += w * ml.y;
      o += w * args.part_o[(s * plane + tj) * D + d];
    }
    p.out[tj * D + d] = __float2half_rn(o / l * (1.0f / (1.0f + expf(-gate[d]))));
  }
}

template <int D>
cudaError_t launch_flash(const AttnPrefillParams& p, cudaStream_t stream) {
  const size_t smem = Layout<D>::kSmemBytes;
  CUDA_TRY(cudaFuncSetAttribute(attn_prefill_flash_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(smem)));
  FlashArgs args;
  args.p = p;
  args.n_splits = n_splits_for(p.T, p.pos0, p.nq, p.nkv);
  if (args.n_splits > 1) {
    args.part_o = reinterpret_cast<float*>(static_cast<char*>(p.scratch) + q_scratch_bytes(p.T, p.nq, D));
    args.part_ml = args.part_o + static_cast<size_t>(args.n_splits) * p.T * p.nq * D;
  }
  if (p.variant == 1) {
    CUDA_TRY(attn_prefill_flash_wgmma(p, args.n_splits, args.part_o, args.part_ml, stream));
  } else {
    const int rows_t = kBlockM / (p.nq / p.nkv);
    const dim3 grid(ceil_div(p.T, rows_t) * p.nkv * args.n_splits);
    CUDA_TRY(launch_pdl(attn_prefill_flash_kernel<D>, grid, dim3(kThreads), smem, stream, args));
  }
  if (args.n_splits == 1) return cudaSuccess;
  return launch_pdl(attn_prefill_combine_kernel, dim3(p.T * p.nq), dim3(D), 0, stream, args);
}

}  // namespace

size_t attn_prefill_scratch_bytes(int T, int nq, int head_dim) {
  if (T <= 0 || nq <= 0 || head_dim <= 0) return 0;
  return q_scratch_bytes(T, nq, head_dim) + partial_bytes(T, nq, head_dim);
}

cudaError_t attn_prefill(const AttnPrefillParams& p, cudaStream_t stream) {
  if (!p.proj || !p.q_norm || !p.k_norm || !p.k_cache || !p.v_cache || !p.out || !p.scratch) return cudaErrorInvalidValue;
  if (p.T <= 0 || p.pos0 < 0 || p.pos0 > (1 << 30)) return cudaErrorInvalidValue;
  if (p.head_dim != 64 && p.head_dim != 256) return cudaErrorInvalidValue;
  if (p.nkv <= 0 || p.nq <= 0 || p.nq % p.nkv != 0) return cudaErrorInvalidValue;
  const int group = p.nq / p.nkv;
  if (group != 1 && group != 2 && group != 4 && group != 8) return cudaErrorInvalidValue;  // 128/group rows, x16
  if (p.rotary_dim < 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim) return cudaErrorInvalidValue;
  if (p.scratch_bytes < attn_prefill_scratch_bytes(p.T, p.nq, p.head_dim)) return cudaErrorInvalidValue;
  // 16-byte cp.async of q and cache rows, 8-byte gate loads, 4-byte output stores.
  auto misaligned = [](const void* ptr, uintptr_t a) { return reinterpret_cast<uintptr_t>(ptr) % a != 0; };
  if (misaligned(p.scratch, 16) || misaligned(p.k_cache, 16) || misaligned(p.v_cache, 16) || misaligned(p.proj, 8) ||
      misaligned(p.out, 4))
    return cudaErrorInvalidValue;
  if (p.variant != 0 && (p.variant != 1 || p.head_dim != 256)) return cudaErrorInvalidValue;
  if (p.variant != 0 && !attn_prefill_wgmma_built()) return cudaErrorInvalidDeviceFunction;
  if (!p.flash_only)
    CUDA_TRY(launch_pdl(attn_prefill_prep_kernel, dim3(p.T, p.nq + p.nkv), dim3(p.head_dim), 0, stream, p));
  return p.head_dim == 256 ? launch_flash<256>(p, stream) : launch_flash<64>(p, stream);
}

}  // namespace lily::cuda
