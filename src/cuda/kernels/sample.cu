// Token sampling on the device for batch-1 decode (sample.cuh); semantics of engine/sampler.h where the paths
// overlap. Writes *out_token and ring[*step % ring_size]; the host never waits per token.
//
// Every token is ranked by a unique 64-bit key: the float's order-preserving bits in the high word and
// ~token_id in the low word, so a larger key is a larger value, ties -> the lower id.
//  greedy (temperature 0) and temperature-only (Gumbel-max: value = logit / T + G, G = -log(-log u), u from
//    Philox4x32-10 keyed by the seed, counter (token / 4, step): exact samples of softmax(logits / T)):
//    sample_argmax_kernel, each block's largest key into scratch, the last block (atomic ticket) reduces them.
//  top_k / top_p / min_p: sample_top_kernel. Each block selects the K = min(top_k or 64, 64) largest keys of
//    its slice of the vocabulary by a radix select (8 bits a round from the top, histograms in shared memory,
//    stopping once the threshold bin is taken whole), the last block selects the K largest of the candidates,
//    ranks them, applies temperature, top_p and min_p as engine/sampler.h steps 6-9 and draws one uniform
//    u = SplitMix64(seed) draw number *step (step 10: walk the kept tokens in ascending id order).
//  penalties: penalize_kernel before the choice rewrites the logits of the table's ids (engine/penalties.h, the
//    same float operations in the same order as Sampler, rounded as on the host: no FMA contraction), and
//    count_token_kernel after it adds the chosen id to the table (one index read, one count write).
// Memory-bound: moves vocab * 4 bytes (1 MB at 248,320 tokens; about 0.25 us at 4.27 TB/s, so the cost is
// launch + latency: a few microseconds).
#include "cuda/kernels/sample.cuh"
#include "cuda/kernels/quant_dot.cuh"  // launch_pdl, pdl_wait

#include <algorithm>
#include <cmath>

namespace lily::cuda {

namespace {

using u64 = unsigned long long;
constexpr int kMaxCandidates = 64;
constexpr int kMaxBlocks = 1024;
constexpr int kArgmaxThreads = 256;
constexpr int kTopThreads = 512;

__device__ __forceinline__ u64 make_key(float v, int id) {
  const uint32_t bits = __float_as_uint(v);
  const uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<u64>(ordered) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(id));
}
__device__ __forceinline__ int key_id(u64 key) { return static_cast<int>(~static_cast<uint32_t>(key)); }
__device__ __forceinline__ float key_value(u64 key) {
  const uint32_t ordered = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7FFFFFFFu) : ~ordered);
}

// Philox4x32-10 (Salmon et al. 2011, Random123 constants).
__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint2 key) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, ctr.x), lo0 = 0xD2511F53u * ctr.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, ctr.z), lo1 = 0xCD9E8D57u * ctr.z;
    ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
    key.x += 0x9E3779B9u;
    key.y += 0xBB67AE85u;
  }
  return ctr;
}

// Gumbel noise from 24 random bits: u in (0, 1) exactly representable, so log(u) < 0 and G is finite.
__device__ __forceinline__ float gumbel(uint32_t r) {
  const float u = (static_cast<float>(r >> 8) + 0.5f) * 0x1.0p-24f;
  return -logf(-logf(u));
}

// engine/sampler.h: draw n of SplitMix64 seeded with s, as a double in [0, 1).
__device__ __forceinline__ double splitmix_uniform(u64 seed, u64 n) {
  u64 z = seed + (n + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const u64 other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other > v ? other : v;
  }
  return v;
}

// The last block to arrive gets true (after every block's writes are visible); it resets the counter.
__device__ bool last_block_done(unsigned* counter) {
  __shared__ bool is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (is_last) *counter = 0;
  }
  __syncthreads();
  return is_last;
}

__device__ void emit_token(const SampleParams& p, int token) {
  *p.out_token = token;
  if (p.ring && p.ring_size > 0) p.ring[*p.step % p.ring_size] = token;
}

// The knobs a kernel samples with: from device memory when the launch gave them, else from the parameters.
__device__ __forceinline__ SampleKnobs knobs_of(const SampleParams& p) {
  if (p.knobs) return *p.knobs;
  return SampleKnobs{p.temperature,      p.top_k,           p.top_p,
                     p.min_p,            p.seed,            p.presence_penalty,
                     p.frequency_penalty, p.repetition_penalty};
}

// ---- penalties (engine/sampler.h steps 2-3 over the table of distinct history ids) ---------------------------

constexpr int kPenaltyThreads = 256;

// Sampler::apply_bias_and_penalties per listed id: repetition (l > 0 ? l / r : l * r), then l -= f * count + p for
// generated ids; explicit round-to-nearest operations so nvcc does not fuse f * count + p into an FMA.
__global__ void __launch_bounds__(kPenaltyThreads) penalize_kernel(const __grid_constant__ SampleParams p) {
  pdl_launch_dependents();
  pdl_wait();  // the logits come from the previous kernel, the table from the previous step's count
  const SampleKnobs kn = knobs_of(p);
  const float rep = kn.repetition_penalty, presence = kn.presence_penalty, frequency = kn.frequency_penalty;
  const bool by_rep = rep != 1.0f, by_count = presence != 0.0f || frequency != 0.0f;
  if (!by_rep && !by_count) return;
  const PenaltyState& st = p.penalties;
  const int n = min(*st.n, st.capacity);
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
    const int id = st.ids[j];
    if (id < 0 || id >= p.vocab) continue;
    float l = p.logits[id];
    if (by_rep) l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
    const int count = st.counts[j];
    if (by_count && count > 0) l = __fsub_rn(l, __fadd_rn(__fmul_rn(frequency, __int2float_rn(count)), presence));
    p.logits[id] = l;
  }
}

// The chosen id (*out_token) into the table: its count + 1, appended with count 1 when new (the tests' host
// reference: tests/engine/penalty_reference.h add_generated).
__global__ void count_token_kernel(const __grid_constant__ SampleParams p) {
  pdl_launch_dependents();
  pdl_wait();  // the token comes from the sample kernel
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const PenaltyState& st = p.penalties;
  const int token = *p.out_token;
  if (token < 0 || token >= p.vocab) return;
  int j = st.slot[token];
  if (j < 0) {
    j = *st.n;
    if (j >= st.capacity) return;  // not reached: the table holds every id the context can (PenaltyState)
    st.ids[j] = token;
    st.counts[j] = 0;
    st.slot[token] = j;
    *st.n = j + 1;
  }
  st.counts[j] += 1;
}

// penalty_state_load: the index entries of the table held so far back to -1 (one block) ...
__global__ void penalty_clear_kernel(const PenaltyState st) {
  const int n = min(*st.n, st.capacity);
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const int id = st.ids[j];
    if (id >= 0 && id < st.vocab) st.slot[id] = -1;
  }
}

// ... and, after the new ids and counts are copied in, their index and count.
__global__ void penalty_index_kernel(const PenaltyState st, int n) {
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
    const int id = st.ids[j];
    if (id >= 0 && id < st.vocab) st.slot[id] = j;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *st.n = n;
}

// ---- greedy and Gumbel-max -----------------------------------------------------------------------------------

template <bool kGumbel>
__global__ void __launch_bounds__(kArgmaxThreads) sample_argmax_kernel(const __grid_constant__ SampleParams p) {
  const trace::BlockTrace trace_block(trace::kSample);
  __shared__ u64 warp_best[kArgmaxThreads / 32];
  u64* block_best = reinterpret_cast<u64*>(p.scratch);
  pdl_launch_dependents();
  pdl_wait();  // the logits come from the previous kernel
  const SampleKnobs kn = knobs_of(p);
  const float inv_t = kGumbel ? 1.0f / kn.temperature : 1.0f;
  const uint2 key = make_uint2(static_cast<uint32_t>(kn.seed), static_cast<uint32_t>(kn.seed >> 32));
  const uint32_t step = kGumbel ? static_cast<uint32_t>(*p.step) : 0u;
  const int n_quads = (p.vocab + 3) / 4;
  u64 best = 0;
  for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < n_quads; q += gridDim.x * blockDim.x) {
    uint4 r = make_uint4(0, 0, 0, 0);
    if constexpr (kGumbel) r = philox4x32_10(make_uint4(q, step, 0x5A3D1E5Bu, 0), key);
    const uint32_t rand[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int id = 4 * q + i;
      if (id < p.vocab) {
        const float v = kGumbel ? p.logits[id] * inv_t + gumbel(rand[i]) : p.logits[id];
        const u64 k = make_key(v, id);
        best = k > best ? k : best;
      }
    }
  }
  best = warp_max_u64(best);
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
    block_best[blockIdx.x] = best;
  }
  if (!last_block_done(p.counter)) return;
  if (threadIdx.x >= 32) return;
  best = 0;
  for (int b = threadIdx.x; b < gridDim.x; b += 32) {
    const u64 k = __ldcg(block_best + b);
    best = k > best ? k : best;
  }
  best = warp_max_u64(best);
  if (threadIdx.x == 0) emit_token(p, key_id(best));
}

// ---- top_k / top_p / min_p -----------------------------------------------------------------------------------

struct SelectShared {
  unsigned hist[256];
  unsigned count;
  int digit, need, done;
  u64 keys[kMaxCandidates];
};

// Warp 0: the digit d whose bin holds the need-th largest key (bins above d hold fewer than `need` keys).
__device__ void find_digit(SelectShared& sh, int need) {
  const int lane = threadIdx.x;
  unsigned c[8], lane_total = 0;
#pragma unroll
  for (int b = 0; b < 8; ++b) lane_total += (c[b] = sh.hist[8 * lane + b]);
  unsigned suffix = lane_total;  // keys in the bins of lanes >= lane
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned t = __shfl_down_sync(0xffffffffu, suffix, o);
    if (lane + o < 32) suffix += t;
  }
  unsigned above = suffix - lane_total;
#pragma unroll
  for (int b = 7; b >= 0; --b) {
    if (above < static_cast<unsigned>(need) && above + c[b] >= static_cast<unsigned>(need)) {
      sh.digit = 8 * lane + b;
      sh.need = need - static_cast<int>(above);
      sh.done = c[b] == static_cast<unsigned>(sh.need);
    }
    above += c[b];
  }
}

// The min(k, n) largest of n unique keys key_of(0..n-1) into sh.keys (unordered); returns how many. Up to
// kCached keys per thread are read once into registers; larger inputs are re-read every round.
template <class KeyOf>
__device__ int block_select_top(int n, int k, KeyOf key_of, SelectShared& sh) {
  constexpr int kCached = 8;
  const bool cached = n <= kCached * static_cast<int>(blockDim.x);
  u64 cache[kCached];
#pragma unroll
  for (int t = 0; t < kCached; ++t) {
    const int i = threadIdx.x + t * blockDim.x;
    cache[t] = cached && i < n ? key_of(i) : 0ull;
  }
  // Calls f(key) for every key this thread holds.
  auto for_my_keys = [&](auto f) {
    if (cached) {
#pragma unroll
      for (int t = 0; t < kCached; ++t) {
        if (threadIdx.x + t * blockDim.x < n) f(cache[t]);
      }
    } else {
      for (int i = threadIdx.x; i < n; i += blockDim.x) f(key_of(i));
    }
  };
  k = min(k, n);
  u64 prefix = 0, mask = 0;
  int need = k;
  for (int shift = 56; shift >= 0 && k > 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) sh.hist[b] = 0;
    __syncthreads();
    for_my_keys([&](u64 key) {
      if ((key & mask) == prefix) atomicAdd(&sh.hist[(key >> shift) & 0xFF], 1u);
    });
    __syncthreads();
    if (threadIdx.x < 32) find_digit(sh, need);
    __syncthreads();
    prefix |= static_cast<u64>(sh.digit) << shift;
    mask |= 0xFFull << shift;
    need = sh.need;
    if (sh.done) break;  // uniform: every thread read the same flag
  }
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  if (k > 0) {
    for_my_keys([&](u64 key) {
      if ((key & mask) >= prefix) sh.keys[atomicAdd(&sh.count, 1u)] = key;
    });
  }
  __syncthreads();
  return k;
}

// engine/sampler.h steps 6-10 on the k best keys (unordered in sh.keys), run by the last block.
__device__ void draw_from_candidates(const SampleParams& p, const SampleKnobs& kn, int k, SelectShared& sh) {
  __shared__ float w_s[kMaxCandidates];
  __shared__ int id_s[kMaxCandidates], order_s[kMaxCandidates];
  __shared__ bool keep_s[kMaxCandidates];
  __shared__ u64 ranked_s[kMaxCandidates];
  const int t = threadIdx.x;
  if (t < k) {  // rank by key: value descending, id ascending
    int rank = 0;
    for (int o = 0; o < k; ++o) rank += sh.keys[o] > sh.keys[t];
    ranked_s[rank] = sh.keys[t];
  }
  __syncthreads();
  if (t < k) {
    const float z = (key_value(ranked_s[t]) - key_value(ranked_s[0])) / kn.temperature;
    w_s[t] = expf(z);
    id_s[t] = key_id(ranked_s[t]);
  }
  __syncthreads();
  if (t == 0) {
    double total = 0.0;
    for (int i = 0; i < k; ++i) total += w_s[i];
    int kept = k;
    if (kn.top_p < 1.0f) {  // smallest prefix with cumulative weight >= top_p; the top token stays
      const double limit = static_cast<double>(kn.top_p) * total;
      double before = 0.0;
      kept = 0;
      while (kept < k && before < limit) before += w_s[kept++];
    }
    for (int i = 0; i < k; ++i) keep_s[i] = i < kept && w_s[i] > 0.0f && (kn.min_p <= 0.0f || w_s[i] >= kn.min_p);
  }
  __syncthreads();
  if (t < k && keep_s[t]) {  // ascending id order of the kept tokens
    int pos = 0;
    for (int o = 0; o < k; ++o) pos += keep_s[o] && id_s[o] < id_s[t];
    order_s[pos] = t;
  }
  __syncthreads();
  if (t == 0) {
    int n_kept = 0;
    double total = 0.0;
    for (int i = 0; i < k; ++i) n_kept += keep_s[i], total += keep_s[i] ? w_s[i] : 0.0;
    const double target = splitmix_uniform(kn.seed, static_cast<u64>(*p.step)) * total;
    double sum = 0.0;
    int token = id_s[0];  // the top token: kept whenever anything is
    for (int i = 0; i < n_kept; ++i) {
      token = id_s[order_s[i]];
      sum += w_s[order_s[i]];
      if (sum > target) break;
    }
    emit_token(p, token);
  }
}

__global__ void __launch_bounds__(kTopThreads) sample_top_kernel(const __grid_constant__ SampleParams p) {
  const trace::BlockTrace trace_block(trace::kSample);
  __shared__ SelectShared sh;
  u64* candidates = reinterpret_cast<u64*>(p.scratch);
  pdl_launch_dependents();
  pdl_wait();
  const SampleKnobs kn = knobs_of(p);
  const int k = min(kn.top_k > 0 ? kn.top_k : kMaxCandidates, kMaxCandidates);
  const int chunk = (p.vocab + gridDim.x - 1) / gridDim.x;
  const int begin = blockIdx.x * chunk, n = max(0, min(chunk, p.vocab - begin));
  const int found = block_select_top(n, k, [&](int i) { return make_key(p.logits[begin + i], begin + i); }, sh);
  if (threadIdx.x < kMaxCandidates) {  // key 0 is below every real key: padding never wins
    candidates[blockIdx.x * kMaxCandidates + threadIdx.x] = threadIdx.x < found ? sh.keys[threadIdx.x] : 0ull;
  }
  if (!last_block_done(p.counter)) return;
  const int n_candidates = gridDim.x * kMaxCandidates;
  const int k_all = block_select_top(n_candidates, min(k, p.vocab), [&](int i) { return __ldcg(candidates + i); }, sh);
  draw_from_candidates(p, kn, k_all, sh);
}

bool valid_state(const PenaltyState& st, int vocab) {
  return st.ids && st.counts && st.n && st.slot && st.capacity > 0 && st.vocab == vocab;
}

bool valid_params(const SampleParams& p) {
  if (!p.logits || p.vocab <= 0 || !p.step || !p.scratch || !p.counter || !p.out_token) return false;
  if (p.ring && p.ring_size <= 0) return false;
  if (!(p.temperature >= 0.0f) || !(p.top_p > 0.0f && p.top_p <= 1.0f) || !(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    return false;  // also rejects NaN
  }
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty) || !std::isfinite(p.presence_penalty) ||
      !std::isfinite(p.frequency_penalty)) {
    return false;
  }
  if (p.penalties.ids && !valid_state(p.penalties, p.vocab)) return false;
  return p.top_k >= 0;
}

cudaError_t launch_choice(const SampleParams& p, cudaStream_t stream) {
  // Argmax paths: 2 float4 quads per thread (~120 blocks at the model's vocabulary).
  const int argmax_blocks = std::min(kMaxBlocks, (p.vocab + 8 * kArgmaxThreads - 1) / (8 * kArgmaxThreads));
  const int mode = sample_mode(p.temperature, p.top_k, p.top_p, p.min_p);
  if (mode == 0) return launch_pdl(sample_argmax_kernel<false>, dim3(argmax_blocks), dim3(kArgmaxThreads), 0, stream, p);
  if (mode == 1) return launch_pdl(sample_argmax_kernel<true>, dim3(argmax_blocks), dim3(kArgmaxThreads), 0, stream, p);
  // Slices of <= 4096 tokens (8 per thread, kept in registers), at most 64 blocks: the last block then ranks
  // <= 4096 candidates, also from registers.
  const int blocks = std::max(1, std::min(64, (p.vocab + 4095) / 4096));
  return launch_pdl(sample_top_kernel, dim3(blocks), dim3(kTopThreads), 0, stream, p);
}

}  // namespace

cudaError_t sample_token(const SampleParams& p, cudaStream_t stream) {
  if (!valid_params(p)) return cudaErrorInvalidValue;
  if (!p.penalties.ids) return launch_choice(p, stream);
  // One entry per thread up to 64 blocks (16K entries; a grid-stride loop past that): the table is read on the
  // device, so the grid is sized for its capacity.
  const int blocks = std::max(1, std::min(64, (p.penalties.capacity + kPenaltyThreads - 1) / kPenaltyThreads));
  cudaError_t e = launch_pdl(penalize_kernel, dim3(blocks), dim3(kPenaltyThreads), 0, stream, p);
  if (e == cudaSuccess) e = launch_choice(p, stream);
  if (e == cudaSuccess) e = launch_pdl(count_token_kernel, dim3(1), dim3(32), 0, stream, p);
  return e;
}

cudaError_t penalty_state_load(const PenaltyState& st, const int* ids, const int* counts, int n, cudaStream_t stream) {
  if (!valid_state(st, st.vocab) || st.vocab <= 0 || n < 0 || n > st.capacity || (n > 0 && (!ids || !counts)))
    return cudaErrorInvalidValue;
  for (int j = 0; j < n; ++j)
    if (ids[j] < 0 || ids[j] >= st.vocab) return cudaErrorInvalidValue;
  penalty_clear_kernel<<<1, 1024, 0, stream>>>(st);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess && n > 0) e = cudaMemcpyAsync(st.ids, ids, n * sizeof(int), cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess && n > 0)
    e = cudaMemcpyAsync(st.counts, counts, n * sizeof(int), cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) return e;
  penalty_index_kernel<<<std::max(1, std::min(64, (n + 255) / 256)), 256, 0, stream>>>(st, n);
  return cudaGetLastError();
}

}  // namespace lily::cuda
