// Prefill matrix path (issue 6): fused-dequant GEMM on tensor cores and the MoE block for many rows.
//
// qgemm:        C[M, N] = A[M, K] . W[N, K]^T with A fp16 row-major activations and W an MLX affine QMatrix (4- or
//               8-bit, group 64): each weight tile is expanded to fp16 in shared memory once and multiplied against
//               the activation rows with mma.sync (fp32 accumulation). The fp16 weight array never exists in device
//               memory. Does 2*M*N*K FLOPs; moves N*K*bits/8 weight bytes (+ scales/biases) and M*K*2 + M*N*4 bytes.
// qgemm_swiglu: act[M, I] = silu(A W_gate^T) * (A W_up^T), fp16 out (eq 23/25's expert input), one kernel.
// moe_prefill:  the whole MoE block (eqs 20-25) for T rows with routing on the GPU and no host synchronisation:
//               x = RMSNorm(h) (fp16), router GEMM (8-bit), fp32 softmax / top-k (ties: lower index) /
//               renormalise, histogram of rows per expert, prefix scan to offsets, scatter of (row, slot) into expert
//               order, block map of the tiles the grouped GEMM runs; grouped qgemm_swiglu over the routed rows
//               and the shared expert's (one more expert of the tile list), grouped down projection; then
//               h[t] += sum_s w_s * y[t, s] + sg[t] * y_shared[t] in a fixed order (deterministic).
// Shapes: K a multiple of 64; any M >= 1 and N >= 1 (tails handled). Launchers return cudaErrorInvalidValue for
// shapes they do not take, never crash.
#pragma once
#include <cuda_fp16.h>

#include "cuda/kernels/common.cuh"

namespace lily::cuda {

enum class GemmOut : int {
  f32 = 0,      // c is float[M, ldc]: C = A W^T
  f16 = 1,      // c is fp16 [M, ldc]
  add_f32 = 2,  // c is float[M, ldc]: C += A W^T (the residual add)
};

// Knobs of the wgmma kernel (qgemm_wgmma.cu), for measurement. Each changes only when the kernel loads,
// dequantises and multiplies, never the fp16 weights or the k order of a sum: every combination computes the
// default's output bit for bit. Zero means the default; combinations that are not compiled are refused with
// cudaErrorInvalidValue (qgemm_wgmma.cu's launch_dense_knobs lists them).
struct WgmmaKnobs {
  int bn = 0;          // W tile columns: 128 or 256 (default: 256 unless its grid would not fill the SMs)
  int fp16_tiles = 0;  // dequantised W tiles in flight: 2 or 3 (default 2 at bn 256, 3 at bn 128)
  int ring = 0;        // A / packed-W ring depth; the loads run ring - fp16_tiles steps ahead (default: deepest
                       // that fits in shared memory: 6 at bn 256 and 2 tiles, 5 with 3)
  bool split_producer = false;  // two producer warpgroups (cp.async; dequantisation), setmaxnreg
};

struct QGemmParams {
  QMatrix w;                            // [N, K]
  const __half* a = nullptr;     // [M, K] row-major
  int M = 0;
  GemmOut out = GemmOut::f32;
  void* c = nullptr;
  int ldc = 0;                          // row stride of c in elements; 0 means N
  // true: the Hopper warpgroup-MMA kernel (qgemm_wgmma.cu; sm_90a builds only, else
  // cudaErrorInvalidDeviceFunction); false: the mma.sync kernel. Opt-in until measured on the H200.
  bool use_wgmma = false;
  WgmmaKnobs wgmma{};  // wgmma path only
};

struct QGemmSwigluParams {
  QMatrix gate, up;                     // [I, K] each
  const __half* a = nullptr;     // [M, K]
  int M = 0;
  __half* act = nullptr;         // out [M, I]
};

cudaError_t qgemm(const QGemmParams& p, cudaStream_t stream);
// qgemm on wgmma whatever p.use_wgmma says (qgemm routes here when it is set): 128 x 256 (or 128 x 128) tiles,
// a producer warpgroup that loads and dequantises, two consumer warpgroups on wgmma.mma_async.
cudaError_t qgemm_wgmma(const QGemmParams& p, cudaStream_t stream);
cudaError_t qgemm_swiglu(const QGemmSwigluParams& p, cudaStream_t stream);

// moe_prefill's grouped expert GEMM on wgmma (qgemm_wgmma.cu; moe_prefill calls it for 4-bit experts when
// MoePrefillParams::use_wgmma is set): blocks along x are the entries of the device-side tile list, A rows
// are gathered, W is matrix tile_expert of the stacked w (or ws for tile-list expert shared_expert).
// swiglu: c = fp16 act [rows, ldc] = silu(A gate^T) * (A up^T) (w[0] gate, w[1] up); else c = f32 [rows, ldc]
// = A w[0]^T. 128-row tiles (two consumer warpgroups of 64 rows) or 64-row (each consumer half the columns).
struct WgmmaGroupedParams {
  QMatrix w[2];  // stacked [E, N, K] (rows = N); both 4-bit
  QMatrix ws[2];
  int shared_expert = -1;
  const __half* a = nullptr;  // [rows, K]
  const int* gather = nullptr;
  const int* tile_count = nullptr;
  const int* tile_expert = nullptr;
  const int* tile_row0 = nullptr;
  const int* tile_rows = nullptr;
  int max_tiles = 0;       // grid size (the longest possible list)
  int tile_rows_max = 128;  // 64 or 128: the tile map's rows a tile
  bool swiglu = false;
  void* c = nullptr;
  int ldc = 0;
  bool split = false;  // WgmmaKnobs::split_producer (128-row tiles only; 64-row tiles ignore it)
};
cudaError_t qgemm_wgmma_grouped(const WgmmaGroupedParams& p, cudaStream_t stream);

// out[t, :] = fp16(in[t, :] / RMS(in[t, :]) * w) for T rows of n (eqs 1-2 multiplier form; the A operand of a
// prefill GEMM).
cudaError_t rms_norm_rows(const float* in, const float* w, int T, int n, float eps, __half* out,
                          cudaStream_t stream);

struct MoePrefillParams {
  QMatrix router;        // 8-bit [E, H]
  QMatrix shared_gate;   // 8-bit [1, H]  (shared_expert_gate)
  QMatrix gate, up;      // stacked [E, I, H]
  QMatrix down;          // stacked [E, H, I]
  QMatrix shared_gate_proj, shared_up, shared_down;  // [Is, H], [Is, H], [H, Is]
  float* h = nullptr;            // [T, H] fp32 residual stream, in/out
  const float* norm_w = nullptr; // [H] post_attention_layernorm multiplier
  float eps = 1e-6f;
  int T = 0;
  int top_k = 8;
  void* scratch = nullptr;       // moe_prefill_scratch_bytes(...) bytes of device memory
  size_t scratch_bytes = 0;
  int tile_rows = 0;             // rows of a grouped expert tile: 64 or 128; 0 picks from T * top_k / E
  // true: the shared expert runs inside the grouped launches (as one more expert, where its shapes and bits
  // match the routed experts'); false: as separate dense launches (kept to measure the difference)
  bool shared_in_grouped = true;
  // true: the grouped expert GEMMs on the Hopper wgmma kernel (qgemm_wgmma_grouped; 4-bit expert matrices,
  // sm_90a builds only, else cudaErrorInvalidDeviceFunction); other bits stay on mma.sync. Opt-in until
  // measured on the H200.
  bool use_wgmma = false;
  // with use_wgmma: false keeps the down projection (K = I, few K steps: a non-persistent wgmma grid pays its
  // prologue and epilogue per tile) on mma.sync, to measure the two GEMMs apart
  bool wgmma_down = true;
  // with use_wgmma: the consumers issue the loads, the producer only dequantises (WgmmaKnobs::split_producer;
  // 128-row tiles)
  bool wgmma_split = false;
};

// Scratch moe_prefill needs for T rows (linear in T; the caller bounds T by chunking).
size_t moe_prefill_scratch_bytes(int T, int H, int I, int Is, int n_experts, int top_k);
cudaError_t moe_prefill(const MoePrefillParams& p, cudaStream_t stream);

}  // namespace lily::cuda
