// Sparse MoE with a shared expert, eqs 21-25: fp32 router softmax, top-k with renormalised weights, SwiGLU
// experts, the shared expert scaled by sigmoid(shared_expert_gate . b).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/blocks.h"
#include "cpu/ops.h"

namespace lily::cpu {

void route_top_k(const float* probs, int n_experts, int k, int* idx, float* weight) {
  std::vector<int> order(static_cast<size_t>(n_experts));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
    return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
  });
  float sum = 0;
  for (int i = 0; i < k; ++i) sum += probs[order[i]];
  for (int i = 0; i < k; ++i) {
    idx[i] = order[i];
    weight[i] = probs[order[i]] / sum;
  }
}

namespace {

// y[n, H] = down(silu(gate x) * (up x)) for n rows of x [n, H].
void swiglu(ThreadPool& pool, const Linear& gate, const Linear& up, const Linear& down, const float* x, int64_t n,
            float* y) {
  std::vector<float> g(n * gate.out), u(n * up.out);
  matmul(pool, gate, x, n, g.data());
  matmul(pool, up, x, n, u.data());
  for (size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
  matmul(pool, down, g.data(), n, y);
}

}  // namespace

void moe_block(const Context& ctx, const MoeWeights& w, const float* b, int64_t T, float* out) {
  const ModelConfig& c = ctx.cfg;
  const int64_t H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok;
  std::vector<float> logits(T * E);
  matmul(ctx.pool, w.router, b, T, logits.data());  // eq 21
  std::vector<int> idx(T * k);
  std::vector<float> wt(T * k);
  for (int64_t t = 0; t < T; ++t) {
    float* p = &logits[t * E];
    float mx = *std::max_element(p, p + E);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] = static_cast<float>(p[e] / sum);
    route_top_k(p, static_cast<int>(E), static_cast<int>(k), &idx[t * k], &wt[t * k]);  // eq 22
  }
  ctx.dump("moe.router_probs", logits.data(), {T, E});

  // Eq 23 grouped by expert: gather the rows routed to e, run the expert once over them, scatter-add.
  std::vector<std::vector<int64_t>> rows_of(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < k; ++i) rows_of[idx[t * k + i]].push_back(t * k + i);
  std::fill(out, out + T * H, 0.0f);
  std::vector<float> x, y;
  for (int64_t e = 0; e < E; ++e) {
    const auto& rows = rows_of[e];
    if (rows.empty()) continue;
    const int64_t n = static_cast<int64_t>(rows.size());
    x.resize(n * H);
    y.resize(n * H);
    for (int64_t r = 0; r < n; ++r) std::copy(b + (rows[r] / k) * H, b + (rows[r] / k + 1) * H, &x[r * H]);
    swiglu(ctx.pool, w.expert_gate[e], w.expert_up[e], w.expert_down[e], x.data(), n, y.data());
    for (int64_t r = 0; r < n; ++r) {
      float weight = wt[rows[r]];
      float* o = out + (rows[r] / k) * H;
      for (int64_t j = 0; j < H; ++j) o[j] += weight * y[r * H + j];
    }
  }
  // Eqs 24-25: shared expert with its sigmoid gate.
  std::vector<float> s(T * H), sg(T);
  swiglu(ctx.pool, w.shared_gate, w.shared_up, w.shared_down, b, T, s.data());
  matmul(ctx.pool, w.shared_expert_gate, b, T, sg.data());
  for (int64_t t = 0; t < T; ++t) {
    float g = sigmoid(sg[t]);
    for (int64_t j = 0; j < H; ++j) out[t * H + j] += g * s[t * H + j];
  }
}

}  // namespace lily::cpu
