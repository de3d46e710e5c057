// Gated full attention, eqs 7-12: q/k RMSNorm, partial RoPE (NeoX half split on the first rotary dims),
// causal GQA softmax attention over the KV cache, sigmoid output gate, o_proj.
#include <cmath>
#include <vector>

#include "cpu/blocks.h"
#include "cpu/ops.h"

namespace lily::cpu {

namespace {

// Eq 10 on one head vector x[head_dim] at position p.
void apply_rope(float* x, int rot, double theta, int64_t p) {
  const int half = rot / 2;
  for (int i = 0; i < half; ++i) {
    // Same order of operations as transformers: inv_freq in fp32, angle = p * inv_freq.
    float inv_freq = static_cast<float>(1.0 / std::pow(theta, (2.0 * i) / rot));
    float ang = static_cast<float>(p) * inv_freq;
    float c = std::cos(ang), s = std::sin(ang);
    float x0 = x[i], x1 = x[i + half];
    x[i] = x0 * c - x1 * s;
    x[i + half] = x1 * c + x0 * s;
  }
}

}  // namespace

void attention_block(const Context& ctx, const AttentionWeights& w, const float* a, int64_t T, int64_t pos0,
                     LayerState& st, float* out) {
  const ModelConfig& c = ctx.cfg;
  const int64_t D = c.head_dim, nq = c.num_attention_heads, nkv = c.num_key_value_heads;
  const int64_t group = nq / nkv;
  std::vector<float> Q(T * nq * 2 * D), K(T * nkv * D), V(T * nkv * D);
  matmul(ctx.pool, w.q_proj, a, T, Q.data());  // eq 7: [T, nq, 2*D]: query then gate per head
  matmul(ctx.pool, w.k_proj, a, T, K.data());  // eq 8: [T, nkv, D]
  matmul(ctx.pool, w.v_proj, a, T, V.data());
  std::vector<float> q(T * nq * D), gate(T * nq * D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < nq; ++j) {
      const float* src = &Q[(t * nq + j) * 2 * D];
      rms_norm(src, w.q_norm.data(), 1, D, c.rms_norm_eps, &q[(t * nq + j) * D]);  // eq 9
      std::copy(src + D, src + 2 * D, &gate[(t * nq + j) * D]);
      apply_rope(&q[(t * nq + j) * D], c.rotary_dim(), c.rope_theta, pos0 + t);
    }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t m = 0; m < nkv; ++m) {
      float* k = &K[(t * nkv + m) * D];
      rms_norm(k, w.k_norm.data(), 1, D, c.rms_norm_eps, k);
      apply_rope(k, c.rotary_dim(), c.rope_theta, pos0 + t);
    }
  st.k.insert(st.k.end(), K.begin(), K.end());  // KV append
  st.v.insert(st.v.end(), V.begin(), V.end());
  ctx.dump("attn.q", q.data(), {T, nq, D});
  ctx.dump("attn.k", K.data(), {T, nkv, D});

  // Eq 11: o_j = softmax(q_j K^T / sqrt(D)) V over positions 0..pos0+t, with kv head m = j / group.
  std::vector<float> o(T * nq * D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  ctx.pool.parallel_for(T * nq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      int64_t t = idx / nq, j = idx % nq, m = j / group, n_ctx = pos0 + t + 1;
      const float* qj = &q[idx * D];
      scores.assign(n_ctx, 0.0f);
      float mx = -INFINITY;
      for (int64_t p = 0; p < n_ctx; ++p) {
        const float* kp = &st.k[(p * nkv + m) * D];
        float s = 0;
        for (int64_t d = 0; d < D; ++d) s += qj[d] * kp[d];
        scores[p] = s * scale;
        mx = std::max(mx, scores[p]);
      }
      double sum = 0;
      for (auto& s : scores) sum += (s = std::exp(s - mx));
      float* oj = &o[idx * D];
      for (int64_t p = 0; p < n_ctx; ++p) {
        const float* vp = &st.v[(p * nkv + m) * D];
        float pw = static_cast<float>(scores[p] / sum);
        for (int64_t d = 0; d < D; ++d) oj[d] += pw * vp[d];
      }
      for (int64_t d = 0; d < D; ++d) oj[d] *= sigmoid(gate[idx * D + d]);  // eq 12 gate
    }
  });
  ctx.dump("attn.gated_out", o.data(), {T, nq * D});
  matmul(ctx.pool, w.o_proj, o.data(), T, out);  // eq 12
}

}  // namespace lily::cpu
