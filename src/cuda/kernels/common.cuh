// Shared helpers of the CUDA kernels: error checks, the MLX quantized matrix view, warp reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/trace.cuh"

namespace lily::cuda {

// LILY_SM90_PASS: this device pass targets sm_90 or later (thread block clusters, distributed shared memory,
// programmatic dependent launch). Code using those instructions sits inside it; the host asks sm90_code_built()
// before it launches such code, so a build whose only device code is compute_80 PTX (JIT-compiled on any newer GPU)
// runs without them.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LILY_SM90_PASS 1
#endif

// Whether the device code the runtime loaded for the current GPU was compiled for sm_90 or later (a probe kernel's
// attributes, cached per device; device_code.cu). False on an older GPU, and on a newer one when this binary
// carries only older code (e.g. compute_80 PTX).
bool sm90_code_built();
// Whether it is the sm_90a pass (so the wgmma kernels have a body); the same kind of probe, in qgemm_wgmma.cu.
bool wgmma_built();
// The probes' test: whether the code loaded for the current device gave `probe` 64 ints or more of static shared
// memory (only the pass being probed declares them); cache[device]: 0 unknown, 1 yes, 2 no.
bool probe_marked(const void* probe, int (&cache)[64]);

#define CUDA_TRY(expr)                            \
  do {                                            \
    cudaError_t _e = (expr);                      \
    if (_e != cudaSuccess) return _e;             \
  } while (0)

// An MLX affine-quantized matrix [rows, cols] in device memory, exactly the checkpoint layout (docs/MODEL.md
// 2.4): w packed uint32 [rows, cols*bits/32] (element j of a row in word j*bits/32, LSB first), scales and biases
// bf16 [rows, cols/64]; value = scale * q + bias. A stacked expert tensor [E, rows, cols] is `n_mats` of these
// back to back (matrix e starts at row e*rows).
struct QMatrix {
  const uint32_t* w = nullptr;
  const __nv_bfloat16* scales = nullptr;
  const __nv_bfloat16* biases = nullptr;
  int rows = 0;
  int cols = 0;
  int bits = 4;
  __host__ __device__ size_t words_per_row() const { return static_cast<size_t>(cols) * bits / 32; }
  __host__ __device__ size_t groups_per_row() const { return static_cast<size_t>(cols) / 64; }
  // Matrix e of a stacked tensor.
  __host__ __device__ QMatrix expert(int e) const {
    QMatrix m = *this;
    m.w = w + static_cast<size_t>(e) * rows * words_per_row();
    m.scales = scales + static_cast<size_t>(e) * rows * groups_per_row();
    m.biases = biases + static_cast<size_t>(e) * rows * groups_per_row();
    return m;
  }
  __host__ __device__ size_t bytes() const {
    return static_cast<size_t>(rows) * (words_per_row() * 4 + groups_per_row() * 4);
  }
};

// Several decode rows of one per-sequence kernel (gdn_step, attention, the MoE kernels) in one launch: row r of the
// batch is the grid's z index r and reads its own parameters (its sequence's state, position and scratch row).
// A batched launch runs, per row, exactly the code of the single-row launch, so a row's results do not depend
// on the other rows (batch invariance).
inline constexpr int kMaxBatchRows = 8;
template <class P>
struct RowBatch {
  P row[kMaxBatchRows];
};
template <class P>
RowBatch<P> make_row_batch(const P* rows, int n) {
  RowBatch<P> b{};
  for (int r = 0; r < n && r < kMaxBatchRows; ++r) b.row[r] = rows[r];
  return b;
}
// One launch for n rows of P: each row checked as a single launch checks it (`check`), all rows of one shape
// (`same_shape`: one geometry, the same weights); then launch(rows[0], src) with src = rows[0] for one row (the
// single-row instance) or the RowBatch of all n.
template <class P, class Launch>
cudaError_t launch_row_batch(const P* rows, int n, cudaError_t (*check)(const P&),
                             bool (*same_shape)(const P&, const P&), Launch&& launch) {
  if (!rows || n < 1 || n > kMaxBatchRows) return cudaErrorInvalidValue;
  for (int r = 0; r < n; ++r) {
    const cudaError_t e = check(rows[r]);
    if (e != cudaSuccess) return e;
    if (!same_shape(rows[0], rows[r])) return cudaErrorInvalidValue;
  }
  if (n == 1) return launch(rows[0], rows[0]);
  return launch(rows[0], make_row_batch(rows, n));
}

// Device-only helpers; host-compiled code (the .cpp op tests) includes this header for QMatrix alone.
#if defined(__CUDACC__)
// A kernel's parameters: the launch's own, or row blockIdx.z of a batch.
template <class P>
__device__ __forceinline__ const P& row_of(const P& p) {
  return p;
}
template <class P>
__device__ __forceinline__ const P& row_of(const RowBatch<P>& b) {
  return b.row[blockIdx.z];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Eq 10 for element d of a normalised head y_s (shared memory): NeoX half split on the first rotary_dim dims,
// inv_freq in fp32 from a double power and products rounded separately, exactly as the CPU reference.
__device__ __forceinline__ float rope_element(const float* y_s, int d, int rotary_dim, float rope_theta, int pos) {
  if (d >= rotary_dim) return y_s[d];
  const int half = rotary_dim / 2, i = d < half ? d : d - half;
  const float inv_freq = static_cast<float>(1.0 / pow(static_cast<double>(rope_theta), (2.0 * i) / rotary_dim));
  float s, c;
  sincosf(static_cast<float>(pos) * inv_freq, &s, &c);
  return d < half ? __fsub_rn(__fmul_rn(y_s[d], c), __fmul_rn(y_s[d + half], s))
                  : __fadd_rn(__fmul_rn(y_s[d], c), __fmul_rn(y_s[d - half], s));
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }

// Programmatic dependent launch (sm_90): a kernel lets the next one in the stream start early and waits for
// the previous one before it reads anything that kernel may have written, and before it writes anything.
// Weights are never written by kernels, so they may be fetched before pdl_wait(). Every kernel launched with
// launch_pdl calls pdl_wait() (keeps completion transitive). A kernel that signals its dependents before its own
// wait can have them running while its predecessor still runs: before their wait they may read only what no
// kernel in flight writes.
// Without sm_90 code both are no-ops and launch_pdl launches in plain stream order.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(LILY_SM90_PASS)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(LILY_SM90_PASS)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  trace::mark_wait();  // the block timeline (trace.cuh), when a buffer is set
}

// Launches kernel<<<grid, block, smem, stream>>>(p) allowing programmatic dependent launch (see pdl_wait()), in
// thread block clusters of cluster_x blocks when cluster_x > 1 (grid.x must be a multiple). Without sm_90 code
// (sm90_code_built): plain stream order, and clusters are refused (cudaErrorInvalidDeviceFunction).
template <class Params>
cudaError_t launch_pdl(void (*kernel)(Params), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       const Params& p, int cluster_x = 1) {
  const bool sm90 = sm90_code_built();
  if (cluster_x > 1 && !sm90) return cudaErrorInvalidDeviceFunction;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster_x);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = cluster_x > 1 ? attr : attr + 1;
  cfg.numAttrs = (cluster_x > 1 ? 2 : 1) - (sm90 ? 0 : 1);
  const cudaError_t launched = cudaLaunchKernelEx(&cfg, kernel, p);
  if (launched != cudaSuccess && !sm90) return launched;  // no attribute to drop: the launch itself failed
  if (launched != cudaSuccess) {  // PDL refused: stream order (clusters stay)
    (void)cudaGetLastError();
    cfg.numAttrs -= 1;
    CUDA_TRY(cudaLaunchKernelEx(&cfg, kernel, p));
  }
  return cudaGetLastError();
}

#endif  // __CUDACC__

}  // namespace lily::cuda
