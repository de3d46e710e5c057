// The decode step (eqs 4-6 with every block) as the chain of launches one CUDA graph captures (cuda_graph.cpp):
// embed; per Gated DeltaNet layer gemv in, gdn_step, gemv out; per attention layer gemv in, attn_prep, attn_decode,
// attn_combine, gemv out; per MoE block moe_route, moe_expert_in, moe_expert_out; lm_head, sample, advance. Each
// kernel is the fast one where its launcher takes the geometry, else the generic one (kernels/dispatch.cuh).
#include <cmath>

#include "cuda/cuda_backend_impl.h"
#include "cuda/kernels/dispatch.cuh"
#include "cuda/kernels/embed.cuh"

namespace lily::cuda {

Status CudaBackend::enqueue_gdn_layer(CudaSequence& s, size_t l, Profiler* prof) {
  const ModelConfig& c = config();
  const DeviceLayer& L = model_->layers[l];
  const float eps = c.rms_norm_eps;
  GemvParams in{L.gdn_in, h_.ptr, GemvPrologue::rms_norm, L.input_norm, nullptr, 0, eps, nullptr, proj_.ptr};
  STEP_OP("gemv gdn_in", L.gdn_in.bytes(), dispatch::gemv(in, stream_));
  GdnStepParams g{proj_.ptr, s.conv[l]->ptr, L.conv_w, L.A_log, L.dt_bias, s.S[l]->ptr, s.pos.ptr,
                  c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                  c.linear_value_head_dim, c.linear_conv_kernel_dim, gdn_o_.ptr};
  g.prefetch_state = true;  // S, the conv ring and pos are written by no kernel before it in a step
  const bool fused_norm = paths_.gdn_norm_in_step;
  if (fused_norm) g.gate_z = proj_.ptr + c.linear_conv_dim(), g.norm_w = L.gdn_norm, g.eps = eps;
  STEP_OP("gdn_step", 2.0 * s.S[l]->bytes(), dispatch::gdn_step(g, stream_));
  const GemvPrologue out_prologue = fused_norm ? GemvPrologue::none : GemvPrologue::gated_rms_norm;
  GemvParams out{L.gdn_out, gdn_o_.ptr, out_prologue, L.gdn_norm, proj_.ptr + c.linear_conv_dim(),
                 c.linear_value_head_dim, eps, h_.ptr, h_.ptr};
  STEP_OP("gemv gdn_out", L.gdn_out.bytes(), dispatch::gemv(out, stream_));
  return ok_status();
}

Status CudaBackend::enqueue_attention_layer(CudaSequence& s, size_t l, int n_splits, Profiler* prof) {
  const ModelConfig& c = config();
  const DeviceLayer& L = model_->layers[l];
  const float eps = c.rms_norm_eps;
  const double kv_bytes = 2.0 * (s.n + 1) * c.num_key_value_heads * c.head_dim * 2;
  GemvParams in{L.attn_in, h_.ptr, GemvPrologue::rms_norm, L.input_norm, nullptr, 0, eps, nullptr, proj_.ptr};
  STEP_OP("gemv attn_in", L.attn_in.bytes(), dispatch::gemv(in, stream_));
  AttnPrepParams prep{proj_.ptr, L.q_norm, L.k_norm, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                      c.rotary_dim(), static_cast<float>(c.rope_theta), eps, s.pos.ptr, q_.ptr,
                      s.k[l]->ptr, s.v[l]->ptr};
  STEP_OP("attn_prep", 0, dispatch::attn_prep(prep, stream_));
  AttnDecodeParams dec{q_.ptr, s.k[l]->ptr, s.v[l]->ptr, c.num_attention_heads, c.num_key_value_heads,
                       c.head_dim, s.pos.ptr, n_splits, 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                       part_o_.ptr, part_ml_.ptr};
  dec.prefetch_cache = true;  // rows < pos and pos itself are written by no kernel before attn_prep in a step
  STEP_OP("attn_decode", kv_bytes, dispatch::attn_decode(dec, stream_));
  AttnCombineParams comb{part_o_.ptr, part_ml_.ptr, n_splits, c.num_attention_heads, c.head_dim, proj_.ptr,
                         attn_out_.ptr};
  STEP_OP("attn_combine", 0, dispatch::attn_combine(comb, stream_));
  GemvParams out{L.attn_out, attn_out_.ptr, GemvPrologue::none, nullptr, nullptr, 0, eps, h_.ptr, h_.ptr};
  STEP_OP("gemv attn_out", L.attn_out.bytes(), dispatch::gemv(out, stream_));
  return ok_status();
}

// Where the expert kernels take the geometry, moe_expert_in selects the experts from the router logits and writes
// its selection, which moe_expert_out reads after its wait (moe.cuh; 2026-11-30 on the H200: 4K step 1.587 ->
// 1.548 ms against moe_expert_out selecting itself, the same to the bit as moe_route selecting); else moe_route
// selects.
Status CudaBackend::enqueue_moe_block(size_t l, Profiler* prof) {
  const ModelConfig& c = config();
  const DeviceLayer& L = model_->layers[l];
  const int k = c.num_experts_per_tok;
  const bool in_experts = paths_.moe_select_in_experts;
  MoeRouteParams route{L.router, L.shared_gate_row, h_.ptr, L.post_norm, c.rms_norm_eps, k, moe_x_.ptr,
                       moe_logits_.ptr, counters_.ptr, topk_idx_.ptr, topk_w_.ptr, shared_gate_.ptr};
  route.select_top_k = !in_experts;
  STEP_OP("moe_route", L.router.bytes() + L.shared_gate_row.bytes(), dispatch::moe_route(route, stream_));
  MoeExpertInParams ein{L.expert_gate, L.expert_up, L.shared_gate, L.shared_up, moe_x_.ptr, topk_idx_.ptr, k,
                        act_.ptr};
  if (in_experts) {
    ein.router_logits = moe_logits_.ptr, ein.n_experts = c.num_experts;
    ein.topk_idx_out = topk_idx_.ptr, ein.topk_w_out = topk_w_.ptr;
  }
  STEP_OP("moe_expert_in", k * (L.expert_gate.bytes() + L.expert_up.bytes()) + L.shared_gate.bytes() + L.shared_up.bytes(),
          dispatch::moe_expert_in(ein, stream_));
  MoeExpertOutParams eout{L.expert_down, L.shared_down, act_.ptr, topk_idx_.ptr, topk_w_.ptr, shared_gate_.ptr, k,
                          h_.ptr};
  STEP_OP("moe_expert_out", k * L.expert_down.bytes() + L.shared_down.bytes(), dispatch::moe_expert_out(eout, stream_));
  return ok_status();
}

// One decode step, reading the input token from token_in_ and the position from s.pos.
Status CudaBackend::enqueue_step(CudaSequence& s, int n_splits, const DeviceSampling* sampling, Profiler* prof) {
  const ModelConfig& c = config();
  const DeviceModel& m = *model_;
  STEP_OP("embed", m.embed.bytes() / m.embed.rows, embed_lookup({m.embed, token_in_.ptr, h_.ptr}, stream_));
  for (size_t l = 0; l < m.layers.size(); ++l) {
    if (m.layers[l].type == LayerType::linear_attention) RETURN_IF_ERROR(enqueue_gdn_layer(s, l, prof));
    else RETURN_IF_ERROR(enqueue_attention_layer(s, l, n_splits, prof));
    RETURN_IF_ERROR(enqueue_moe_block(l, prof));
  }
  GemvParams head{m.lm_head, h_.ptr, GemvPrologue::rms_norm, m.final_norm, nullptr, 0, c.rms_norm_eps, nullptr,
                  logits_.ptr};
  STEP_OP("gemv lm_head", m.lm_head.bytes(), dispatch::gemv(head, stream_));
  if (sampling) {
    SampleParams sp{logits_.ptr, c.vocab_size, sampling->temperature, sampling->top_k, sampling->top_p,
                    sampling->min_p, sampling->seed, s.pos.ptr, sample_scratch_.ptr, counters_.ptr + 1,
                    token_in_.ptr, ring_dev_, kRingSize, sample_knobs_.ptr};
    STEP_OP("sample", 4.0 * c.vocab_size, sample_token(sp, stream_));
  }
  STEP_OP("advance", 0, advance_position(s.pos.ptr, stream_));
  return ok_status();
}

}  // namespace lily::cuda
