// The batch-1 decode step on the persistent megakernel (megakernel/; --cuda-options megakernel=1): per
// sequence, one program of the 40 layers and the lm_head, built once from the model and the sequence's state
// (its pointers are baked in, as the chain's graph bakes them) and launched between the embedding lookup and the
// sample kernel of the step's graph (cuda_decode.cpp enqueue_step).
#include "cuda/cuda_backend_impl.h"
#include "cuda/megakernel/step.cuh"

namespace lily::cuda {

Status megakernel_geometry(const ModelConfig& c) {
  const bool ok = c.hidden_size == 2048 && c.linear_num_key_heads == 16 && c.linear_num_value_heads == 32 &&
                  c.linear_key_head_dim == mk::kGdnDim && c.linear_value_head_dim == mk::kGdnDim &&
                  c.linear_conv_kernel_dim == 4 && c.num_attention_heads == mk::kAttnQHeads &&
                  c.num_key_value_heads == mk::kAttnKvHeads && c.head_dim == mk::kAttnDim &&
                  c.rotary_dim() == mk::kAttnRotary && c.moe_intermediate_size == 512 &&
                  c.shared_expert_intermediate_size == 512 && c.num_experts > 0 && c.num_experts <= 256 &&
                  c.num_experts_per_tok > 0 && c.num_experts_per_tok <= 8;
  if (ok) return ok_status();
  return error(ErrorCode::unsupported,
               "the decode megakernel runs Qwen3.6-35B-A3B's geometry (hidden 2048; Gated DeltaNet 16 / 32 heads of "
               "128; attention 16 / 2 heads of 256, rotary 64; experts of 512, top-k <= 8 of <= 256); this model has "
               "hidden %d, Gated DeltaNet %d / %d heads of %d, attention %d / %d heads of %d, experts of %d, top-%d "
               "of %d",
               c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim,
               c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.moe_intermediate_size,
               c.num_experts_per_tok, c.num_experts);
}

Status CudaBackend::init_megakernel() {
  if (options_.megakernel == 0) return ok_status();
  if (!mk::step_supported())
    return error(ErrorCode::unsupported,
                 "--cuda-options megakernel=%d: the decode megakernel needs this binary's sm_90a code and a Hopper "
                 "GPU (compute 9.0; %s is %d.%d)",
                 options_.megakernel, device_name_.c_str(), paths_.cc_major, paths_.cc_minor);
  const Status geometry = megakernel_geometry(config());
  if (!geometry.ok())
    return error(ErrorCode::unsupported, "--cuda-options megakernel=%d: %s", options_.megakernel,
                 geometry.message().c_str());
  const ModelConfig& c = config();
  // The router op reads the router's rows and the shared expert gate's as one 8-bit [E + 1, H] matrix: uploaded
  // once more that way per layer (~0.6 MB a layer; the chain keeps reading the model's own two).
  mk_router_of_.clear();
  for (size_t l = 0; l < model_->layers.size(); ++l) {
    const QMatrix &r = model_->layers[l].router, &g = model_->layers[l].shared_gate_row;
    if (r.bits != 8 || g.bits != 8 || r.cols != g.cols || g.rows != 1 || r.rows != c.num_experts)
      return error(ErrorCode::unsupported,
                   "--cuda-options megakernel=%d: the router op takes an 8-bit router and shared expert gate; this "
                   "checkpoint has a %d-bit router [%d, %d] and a %d-bit gate [%d, %d]",
                   options_.megakernel, r.bits, r.rows, r.cols, g.bits, g.rows, g.cols);
    const MoeWeights& mw = weights_->layers[l].moe;
    ASSIGN_OR_RETURN(QMatrix all, model_->upload_rows({mw.router, mw.shared_expert_gate}, 8));
    mk_router_of_.push_back(all);
  }
  // The uploads ran on the legacy stream: done before any kernel of stream_ reads them.
  CUDA_RETURN(cudaDeviceSynchronize(), "router uploads");
  const size_t L = c.num_hidden_layers, E1 = static_cast<size_t>(c.num_experts) + 1;
  const size_t act = static_cast<size_t>(c.num_experts_per_tok + 1) * c.moe_intermediate_size;
  const size_t splits = static_cast<size_t>(attention_splits(options_.max_context));
  // Per layer: the router's logits (read by every block's loader while the layer's MoE runs) and the experts'
  // activations; one attention's partial outputs and their max / sum.
  mk_act_off_ = (L * E1 + 63) / 64 * 64;  // the logits at 0
  mk_part_o_off_ = mk_act_off_ + L * act;
  mk_part_ml_off_ = mk_part_o_off_ + splits * mk::kAttnQHeads * mk::kAttnDim;
  RETURN_IF_ERROR(mk_scratch_.alloc(mk_part_ml_off_ + splits * mk::kAttnQHeads * 2));
  CUDA_RETURN(cudaDeviceGetAttribute(&mk_blocks_, cudaDevAttrMultiProcessorCount, 0), "SM count");
  paths_.megakernel = true;
  // Every matrix checked now (bits, shapes, alignment) rather than at the first decode: a program built for a
  // one-token sequence, not uploaded.
  CudaSequence probe;
  RETURN_IF_ERROR(probe.allocate(c, 1));
  const Result<mk::Program> program = step_program(probe);
  if (!program.ok()) {
    paths_.megakernel = false;
    return error(ErrorCode::unsupported, "--cuda-options megakernel=%d: %s", options_.megakernel,
                 program.status().message().c_str());
  }
  return ok_status();
}

Result<mk::Program> CudaBackend::step_program(const CudaSequence& s) const {
  const ModelConfig& c = config();
  const DeviceModel& m = *model_;
  const float eps = c.rms_norm_eps;
  const size_t E1 = static_cast<size_t>(c.num_experts) + 1;
  const size_t act = static_cast<size_t>(c.num_experts_per_tok + 1) * c.moe_intermediate_size;
  float* h = h_.ptr;
  float* proj = proj_.ptr;
  mk::Program p;
  int prev = -1;  // the op that last wrote h
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const DeviceLayer& L = m.layers[l];
    std::vector<int> h_wait;
    if (prev >= 0) h_wait.push_back(prev);
    if (L.type == LayerType::linear_attention) {
      if (!s.conv[l] || !s.S[l]) return error(ErrorCode::internal, "layer %zu: the sequence has no recurrent state", l);
      ASSIGN_OR_RETURN(const int in, p.add_gemv(L.gdn_in, h, proj, h_wait, L.input_norm, eps));
      p.label_op(in, "gdn_in");
      mk::GdnArgs g;
      g.proj = proj, g.conv_ring = s.conv[l]->ptr, g.conv_w = L.conv_w, g.A_log = L.A_log, g.dt_bias = L.dt_bias;
      g.S = s.S[l]->ptr, g.pos = s.pos.ptr, g.n_k = c.linear_num_key_heads, g.n_v = c.linear_num_value_heads;
      ASSIGN_OR_RETURN(const int heads, p.add_gdn_heads(g, gdn_o_.ptr, in));
      ASSIGN_OR_RETURN(prev, p.add_gated_gemv(L.gdn_out, gdn_o_.ptr, proj + c.linear_conv_dim(), L.gdn_norm, h,
                                              {heads}, h, eps));
      p.label_op(prev, "gdn_out");
    } else {
      if (!s.k[l] || !s.v[l]) return error(ErrorCode::internal, "layer %zu: the sequence has no KV cache", l);
      ASSIGN_OR_RETURN(const int in, p.add_gemv(L.attn_in, h, proj, h_wait, L.input_norm, eps));
      p.label_op(in, "attn_in");
      mk::AttnArgs a;
      a.proj = proj, a.q_norm = L.q_norm, a.k_norm = L.k_norm, a.k_cache = s.k[l]->ptr, a.v_cache = s.v[l]->ptr;
      a.pos = s.pos.ptr, a.part_o = mk_scratch_.ptr + mk_part_o_off_, a.part_ml = mk_scratch_.ptr + mk_part_ml_off_;
      a.n_splits = attention_splits(s.capacity), a.rope_theta = static_cast<float>(c.rope_theta), a.eps = eps;
      ASSIGN_OR_RETURN(const int merge, p.add_attention(a, attn_out_.ptr, in));
      ASSIGN_OR_RETURN(prev, p.add_gemv(L.attn_out, attn_out_.ptr, h, {merge}, nullptr, eps, h));
      p.label_op(prev, "attn_out");
    }
    mk::MoeArgs moe;
    moe.gate = L.expert_gate, moe.up = L.expert_up, moe.down = L.expert_down;
    moe.s_gate = L.shared_gate, moe.s_up = L.shared_up, moe.s_down = L.shared_down;
    moe.n_experts = c.num_experts, moe.top_k = c.num_experts_per_tok, moe.inter = c.moe_intermediate_size;
    float* logits = mk_scratch_.ptr + l * E1;
    float* act_l = mk_scratch_.ptr + mk_act_off_ + l * act;
    ASSIGN_OR_RETURN(prev, p.add_moe(mk_router_of_[l], moe, h, L.post_norm, logits, act_l, prev, eps));
    p.label_op(prev - 2, "router");  // add_moe: router, moe_in, moe_out
  }
  ASSIGN_OR_RETURN(const int head, p.add_gemv(m.lm_head, h, logits_.ptr, {prev}, m.final_norm, eps));
  p.label_op(head, "lm_head");
  RETURN_IF_ERROR(p.schedule(mk_blocks_));
  return p;
}

Status CudaBackend::ensure_step_program(CudaSequence& s) {
  if (s.step_program) return ok_status();
  ASSIGN_OR_RETURN(mk::Program p, step_program(s));
  ASSIGN_OR_RETURN(s.step_program, mk::DeviceProgram::upload(p));
  return ok_status();
}

Result<std::string> CudaBackend::megakernel_timeline(SequenceState& base, double* span_us) {
  if (!paths_.megakernel)
    return error(ErrorCode::unsupported, "the instruction timeline is the megakernel's (--cuda-options megakernel=1)");
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, 2));
  RETURN_IF_ERROR(ensure_step_program(*s));
  mk::DeviceProgram& d = *s->step_program;
  RETURN_IF_ERROR(d.enable_trace());
  s->graphs.clear();  // a graph bakes the program's view: captured again with the timeline on, and after it off
  DeviceSampling greedy;
  Status run = run_step(*s, &greedy);  // the capture's step
  if (run.ok()) run = run_step(*s, &greedy);  // a replay, traced
  cudaError_t sync = cudaStreamSynchronize(stream_);
  d.disable_trace();
  s->graphs.clear();
  RETURN_IF_ERROR(run);
  CUDA_RETURN(sync, "timeline step");
  ASSIGN_OR_RETURN(std::vector<unsigned long long> marks, d.trace());
  ASSIGN_OR_RETURN(mk::Program p, step_program(*s));  // the same program, rebuilt on the host for its labels
  return p.summarize_trace_by_label(marks, span_us);
}

}  // namespace lily::cuda
