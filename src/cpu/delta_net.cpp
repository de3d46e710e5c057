// Gated DeltaNet, eqs 13-20: projections, causal depthwise conv (kernel 4) + SiLU with the carried conv state,
// l2-normalised q and k, the gated delta rule with the fp32 state S [n_v, d_k, d_v], the gated RMSNorm with z.
#include <cmath>
#include <vector>

#include "cpu/blocks.h"
#include "cpu/ops.h"

namespace lily::cpu {

namespace {

// Eq 16: x / sqrt(||x||^2 + 1e-6) * extra_scale.
void l2_normalize(float* x, int64_t n, float extra_scale) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  float inv = 1.0f / std::sqrt(static_cast<float>(ss) + 1e-6f) * extra_scale;
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Eq 14: cc_t[ch] = silu(sum_k Wc[ch, k] * c_{t-K+1+k}[ch]); history = the K-1 previous pre-conv rows.
void causal_conv(const float* Wc, int64_t C, int64_t K, const float* c, int64_t T, std::vector<float>& conv_state,
                 float* cc, std::vector<LayerState>* after) {
  // window = [K-1 carried rows | T new rows]
  std::vector<float> window((K - 1 + T) * C);
  std::copy(conv_state.begin(), conv_state.end(), window.begin());
  std::copy(c, c + T * C, window.begin() + (K - 1) * C);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t ch = 0; ch < C; ++ch) {
      float acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += Wc[ch * K + k] * window[(t + k) * C + ch];
      cc[t * C + ch] = silu(acc);
    }
  if (after)
    for (int64_t t = 0; t < T; ++t)  // after row t: the pre-conv rows t-K+2..t, i.e. window rows t+1..t+K-1
      (*after)[t].conv.assign(window.begin() + (t + 1) * C, window.begin() + (t + K) * C);
  std::copy(window.end() - (K - 1) * C, window.end(), conv_state.begin());
}

}  // namespace

void delta_net_block(const Context& ctx, const DeltaNetWeights& w, const float* a, int64_t T, LayerState& st,
                     float* out, std::vector<LayerState>* after) {
  const ModelConfig& c = ctx.cfg;
  const int64_t C = c.linear_conv_dim(), K = c.linear_conv_kernel_dim, nk = c.linear_num_key_heads,
                nv = c.linear_num_value_heads, dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t key_dim = nk * dk, value_dim = nv * dv, heads_per_k = nv / nk;
  if (st.conv.empty()) st.conv.assign((K - 1) * C, 0.0f);
  if (st.S.empty()) st.S.assign(nv * dk * dv, 0.0f);
  if (after) {
    after->resize(static_cast<size_t>(T));
    for (auto& r : *after) r.S.resize(st.S.size());
  }

  std::vector<float> qkv(T * C), z(T * value_dim), bl(T * nv), al(T * nv);
  matmul(ctx.pool, w.in_proj_qkv, a, T, qkv.data());  // eq 13
  matmul(ctx.pool, w.in_proj_z, a, T, z.data());
  matmul(ctx.pool, w.in_proj_b, a, T, bl.data());
  matmul(ctx.pool, w.in_proj_a, a, T, al.data());
  std::vector<float> cc(T * C);
  causal_conv(w.conv1d.data(), C, K, qkv.data(), T, st.conv, cc.data(), after);  // eq 14
  ctx.dump("gdn.conv_out", cc.data(), {T, C});

  // Eq 15-17 per token: split, normalise, gates.
  std::vector<float> beta(T * nv), decay(T * nv);
  for (int64_t t = 0; t < T; ++t) {
    float* row = &cc[t * C];
    for (int64_t h = 0; h < nk; ++h) {
      l2_normalize(row + h * dk, dk, 1.0f / std::sqrt(static_cast<float>(dk)));  // q_hat
      l2_normalize(row + key_dim + h * dk, dk, 1.0f);                            // k_hat
    }
    for (int64_t h = 0; h < nv; ++h) {
      beta[t * nv + h] = sigmoid(bl[t * nv + h]);
      float g = -std::exp(w.A_log[h]) * softplus(al[t * nv + h] + w.dt_bias[h]);
      decay[t * nv + h] = std::exp(g);
    }
  }
  ctx.dump("gdn.beta", beta.data(), {T, nv});
  ctx.dump("gdn.decay", decay.data(), {T, nv});

  // Eq 18: the gated delta rule, one value head per task (heads are independent).
  std::vector<float> o(T * value_dim);
  ctx.pool.parallel_for(nv, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> e(dv);
    for (int64_t h = h0; h < h1; ++h) {
      float* S = &st.S[h * dk * dv];  // [d_k, d_v]
      const int64_t kh = h / heads_per_k;
      for (int64_t t = 0; t < T; ++t) {
        const float* row = &cc[t * C];
        const float* q = row + kh * dk;
        const float* k = row + key_dim + kh * dk;
        const float* v = row + 2 * key_dim + h * dv;
        const float g = decay[t * nv + h], b = beta[t * nv + h];
        for (int64_t i = 0; i < dk * dv; ++i) S[i] *= g;
        for (int64_t j = 0; j < dv; ++j) {
          float kv = 0;
          for (int64_t i = 0; i < dk; ++i) kv += S[i * dv + j] * k[i];
          e[j] = (v[j] - kv) * b;
        }
        float* oh = &o[t * value_dim + h * dv];
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += k[i] * e[j];
        if (after) std::copy(S, S + dk * dv, (*after)[t].S.begin() + h * dk * dv);
        for (int64_t j = 0; j < dv; ++j) {
          float acc = 0;
          for (int64_t i = 0; i < dk; ++i) acc += S[i * dv + j] * q[i];
          oh[j] = acc;
        }
      }
    }
  });
  ctx.dump("gdn.core_out", o.data(), {T, nv, dv});

  // Eq 19: y = w * o / RMS(o) * silu(z), per value head.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nv; ++h) {
      float* oh = &o[t * value_dim + h * dv];
      const float* zh = &z[t * value_dim + h * dv];
      rms_norm(oh, w.norm.data(), 1, dv, c.rms_norm_eps, oh);
      for (int64_t j = 0; j < dv; ++j) oh[j] *= silu(zh[j]);
    }
  matmul(ctx.pool, w.out_proj, o.data(), T, out);  // eq 20
}

}  // namespace lily::cpu
