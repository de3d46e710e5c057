// The decode step (eqs 4-6 with every block) as the chain of launches one CUDA graph captures (cuda_graph.cpp):
// embed; per Gated DeltaNet layer gemv in, gdn_step, gemv out; per attention layer gemv in, attn_prep, attn_decode,
// attn_combine, gemv out; per MoE block moe_route, moe_expert_in, moe_expert_out; lm_head, sample, advance. Each
// kernel is the fast one where its launcher takes the geometry, else the generic one (kernels/dispatch.cuh). With
// the decode megakernel (paths_.megakernel, cuda_megakernel.cpp) a batch-1 step is embed, one persistent launch
// for the layers and the lm_head, sample, advance.
//
// The step takes 1 to kMaxBatchRows rows, one token of a different sequence each (continuous batching): the GEMVs
// read their weights once for all rows (gemv_rows), the per-sequence kernels and the MoE kernels run every row in
// one launch (grid z = row), and each row's arithmetic is that of the one-row step, so a row's logits do not
// depend on the other rows. Row r uses scratch row r (RowStrides); one row is exactly the batch-1 step.
#include <cmath>

#include "cuda/cuda_backend_impl.h"
#include "cuda/kernels/dispatch.cuh"
#include "cuda/kernels/embed.cuh"

namespace lily::cuda {

namespace {

// gemv_rows parameters for `rows` rows whose input and output rows are in_stride / out_stride floats apart.
GemvParams gemv_of(const QMatrix& m, const float* in, GemvPrologue prologue, const float* norm_w, float eps,
                   const float* residual, float* y, int rows, size_t in_stride, size_t out_stride) {
  GemvParams p{m, in, prologue, norm_w, nullptr, 0, eps, residual, y};
  p.n_rows = rows;
  p.in_stride = static_cast<int>(in_stride), p.out_stride = static_cast<int>(out_stride);
  return p;
}

}  // namespace

Status CudaBackend::enqueue_gdn_layer(std::span<CudaSequence* const> rows, size_t l, bool chained, Profiler* prof) {
  const ModelConfig& c = config();
  const DeviceLayer& L = model_->layers[l];
  const RowStrides& st = strides_;
  const int R = static_cast<int>(rows.size());
  const float eps = c.rms_norm_eps;
  const GemvParams in = gemv_of(L.gdn_in, h_.ptr, GemvPrologue::rms_norm, L.input_norm, eps, nullptr, proj_.ptr, R,
                                st.h, st.proj);
  STEP_OP("gemv gdn_in", L.gdn_in.bytes(), dispatch::gemv_rows(in, stream_));
  const bool fused_norm = paths_.gdn_norm_in_step;
  GdnStepParams g[kMaxBatchRows];
  for (int r = 0; r < R; ++r) {
    CudaSequence& s = *rows[r];
    float* proj = proj_.ptr + r * st.proj;
    g[r] = GdnStepParams{proj, s.conv[l]->ptr, L.conv_w, L.A_log, L.dt_bias, s.S[l]->ptr, s.pos.ptr,
                         c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                         c.linear_value_head_dim, c.linear_conv_kernel_dim, gdn_o_.ptr + r * st.gdn_o};
    // S, the conv ring and pos are written by no kernel before it in a step (chained: the row before writes them)
    g[r].prefetch_state = !chained;
    if (fused_norm) g[r].gate_z = proj + c.linear_conv_dim(), g[r].norm_w = L.gdn_norm, g[r].eps = eps;
  }
  if (!chained) {
    STEP_OP("gdn_step", 2.0 * rows[0]->S[l]->bytes(), dispatch::gdn_step_rows(g, R, stream_));
  } else {
    for (int r = 0; r < R; ++r) {  // row r from the state row r - 1 left into its own; row 0 from the sequence's
      const CudaSequence& src = *rows[(r + R - 1) % R];  // (which rows[R - 1] holds, and writes last)
      if (&src != rows[r]) {
        g[r].S = src.S[l]->ptr, g[r].conv_ring = src.conv[l]->ptr;
        g[r].S_out = rows[r]->S[l]->ptr, g[r].ring_out = rows[r]->conv[l]->ptr;
      }
      STEP_OP("gdn_step", 2.0 * rows[r]->S[l]->bytes(), dispatch::gdn_step_rows(&g[r], 1, stream_));
    }
  }
  const GemvPrologue out_prologue = fused_norm ? GemvPrologue::none : GemvPrologue::gated_rms_norm;
  GemvParams out = gemv_of(L.gdn_out, gdn_o_.ptr, out_prologue, L.gdn_norm, eps, h_.ptr, h_.ptr, R, st.gdn_o, st.h);
  out.gate_z = proj_.ptr + c.linear_conv_dim(), out.head_dim = c.linear_value_head_dim;
  out.z_stride = static_cast<int>(st.proj);
  STEP_OP("gemv gdn_out", L.gdn_out.bytes(), dispatch::gemv_rows(out, stream_));
  return ok_status();
}

Status CudaBackend::enqueue_attention_layer(std::span<CudaSequence* const> rows, size_t l, int n_splits,
                                            bool chained, Profiler* prof) {
  AttnRow kv[kMaxBatchRows];
  for (size_t r = 0; r < rows.size(); ++r) kv[r] = AttnRow{rows[r]->k[l]->ptr, rows[r]->v[l]->ptr, rows[r]->pos.ptr};
  return enqueue_attention(model_->layers[l], std::span<const AttnRow>(kv, rows.size()), rows[0]->n, n_splits, chained,
                           prof);
}

Status CudaBackend::enqueue_attention(const DeviceLayer& L, std::span<const AttnRow> rows, int64_t n, int n_splits,
                                      bool chained, Profiler* prof) {
  const ModelConfig& c = config();
  const RowStrides& st = strides_;
  const int R = static_cast<int>(rows.size());
  const float eps = c.rms_norm_eps;
  const double kv_bytes = 2.0 * (n + 1) * c.num_key_value_heads * c.head_dim * 2;
  const GemvParams in = gemv_of(L.attn_in, h_.ptr, GemvPrologue::rms_norm, L.input_norm, eps, nullptr, proj_.ptr,
                                R, st.h, st.proj);
  STEP_OP("gemv attn_in", L.attn_in.bytes(), dispatch::gemv_rows(in, stream_));
  AttnPrepParams prep[kMaxBatchRows];
  AttnDecodeParams dec[kMaxBatchRows];
  AttnCombineParams comb[kMaxBatchRows];
  for (int r = 0; r < R; ++r) {
    const AttnRow& s = rows[r];
    float* proj = proj_.ptr + r * st.proj;
    float* q = q_.ptr + r * st.q;
    float* part_o = part_o_.ptr + r * st.part_o;
    float* part_ml = part_ml_.ptr + r * st.part_ml;
    prep[r] = AttnPrepParams{proj, L.q_norm, L.k_norm, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                             c.rotary_dim(), static_cast<float>(c.rope_theta), eps, s.pos, q, s.k, s.v};
    dec[r] = AttnDecodeParams{q, s.k, s.v, c.num_attention_heads, c.num_key_value_heads,
                              c.head_dim, s.pos, n_splits, 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                              part_o, part_ml};
    // rows < pos and pos itself are written by no kernel before attn_prep in a step (chained: attn_prep writes the
    // rows of the rows before r)
    dec[r].prefetch_cache = !chained;
    comb[r] = AttnCombineParams{part_o, part_ml, n_splits, c.num_attention_heads, c.head_dim, proj,
                                attn_out_.ptr + r * st.attn_out};
  }
  STEP_OP("attn_prep", 0, dispatch::attn_prep_rows(prep, R, stream_));
  STEP_OP("attn_decode", kv_bytes, dispatch::attn_decode_rows(dec, R, stream_));
  STEP_OP("attn_combine", 0, dispatch::attn_combine_rows(comb, R, stream_));
  const GemvParams out = gemv_of(L.attn_out, attn_out_.ptr, GemvPrologue::none, nullptr, eps, h_.ptr, h_.ptr, R,
                                 st.attn_out, st.h);
  STEP_OP("gemv attn_out", L.attn_out.bytes(), dispatch::gemv_rows(out, stream_));
  return ok_status();
}

// Where the expert kernels take the geometry, moe_expert_in selects the experts from the router logits and writes
// its selection, which moe_expert_out reads after its wait (moe.cuh; 2026-11-30 on the H200: 4K step 1.587 ->
// 1.548 ms against moe_expert_out selecting itself, the same to the bit as moe_route selecting); else, and for
// several rows, moe_route selects (2026-12-02, 8 rows at 4K: moe_expert_in 2.32 -> 1.46 ms a step, route 0.31 ->
// 0.43, the step 6.74 -> 5.99 ms: its 4,608 blocks each selecting put the selection on every block's path).
Status CudaBackend::enqueue_moe_block(int R, size_t l, Profiler* prof) {
  return enqueue_moe(model_->layers[l], R, prof);
}

Status CudaBackend::enqueue_moe(const DeviceLayer& L, int R, Profiler* prof) {
  const ModelConfig& c = config();
  const RowStrides& st = strides_;
  const int k = c.num_experts_per_tok;
  const bool in_experts = paths_.moe_select_in_experts && R == 1;
  MoeRouteParams route[kMaxBatchRows];
  MoeExpertInParams ein[kMaxBatchRows];
  MoeExpertOutParams eout[kMaxBatchRows];
  for (int r = 0; r < R; ++r) {
    float* h = h_.ptr + r * st.h;
    float* x = moe_x_.ptr + r * st.h;
    float* logits = moe_logits_.ptr + r * st.moe_logits;
    int* idx = topk_idx_.ptr + r * st.topk;
    float* w = topk_w_.ptr + r * st.topk;
    float* sg = shared_gate_.ptr + r * st.shared_gate;
    float* act = act_.ptr + r * st.act;
    route[r] = MoeRouteParams{L.router, L.shared_gate_row, h, L.post_norm, c.rms_norm_eps, k, x, logits,
                              counters_.ptr + kRouteCounter + r, idx, w, sg};
    route[r].select_top_k = !in_experts;
    ein[r] = MoeExpertInParams{L.expert_gate, L.expert_up, L.shared_gate, L.shared_up, x, idx, k, act};
    if (in_experts) {
      ein[r].router_logits = logits, ein[r].n_experts = c.num_experts;
      ein[r].topk_idx_out = idx, ein[r].topk_w_out = w;
    }
    eout[r] = MoeExpertOutParams{L.expert_down, L.shared_down, act, idx, w, sg, k, h};
  }
  STEP_OP("moe_route", L.router.bytes() + L.shared_gate_row.bytes(), dispatch::moe_route_rows(route, R, stream_));
  STEP_OP("moe_expert_in", k * (L.expert_gate.bytes() + L.expert_up.bytes()) + L.shared_gate.bytes() + L.shared_up.bytes(),
          dispatch::moe_expert_in_rows(ein, R, stream_));
  STEP_OP("moe_expert_out", k * L.expert_down.bytes() + L.shared_down.bytes(),
          dispatch::moe_expert_out_rows(eout, R, stream_));
  return ok_status();
}

// One decode step for every row, reading row r's input token from token_in_[r] and its position from its
// sequence's pos. sampling: empty (the logits stay in logits_) or one per row (row r's next token goes to
// token_in_[r] and its ring).
Status CudaBackend::enqueue_step(std::span<CudaSequence* const> rows, int n_splits,
                                 std::span<const DeviceSampling> sampling, Profiler* prof, bool chained) {
  const ModelConfig& c = config();
  const DeviceModel& m = *model_;
  const RowStrides& st = strides_;
  const int R = static_cast<int>(rows.size());
  if (R < 1 || R > kMaxBatchRows || (!sampling.empty() && sampling.size() != rows.size()))
    return invalid_argument("decode step of %d rows (%zu samplings)", R, sampling.size());
  if (R == 1) {
    STEP_OP("embed", m.embed.bytes() / m.embed.rows, embed_lookup({m.embed, token_in_.ptr, h_.ptr}, stream_));
  } else {
    STEP_OP("embed", R * m.embed.bytes() / m.embed.rows, embed_rows(m.embed, token_in_.ptr, R, h_.ptr, stream_));
  }
  if (paths_.megakernel && R == 1 && !chained) {  // the layers and the lm_head in one persistent launch
    RETURN_IF_ERROR(ensure_step_program(*rows[0]));  // graph_for builds it before the capture
    const mk::DeviceProgram& program = *rows[0]->step_program;
    STEP_OP("megakernel", m.decode_weight_bytes() - m.embed.bytes() / m.embed.rows, program.launch(stream_));
  } else {
    for (size_t l = 0; l < m.layers.size(); ++l) {
      if (m.layers[l].type == LayerType::linear_attention) RETURN_IF_ERROR(enqueue_gdn_layer(rows, l, chained, prof));
      else RETURN_IF_ERROR(enqueue_attention_layer(rows, l, n_splits, chained, prof));
      RETURN_IF_ERROR(enqueue_moe_block(R, l, prof));
    }
    const GemvParams head = gemv_of(m.lm_head, h_.ptr, GemvPrologue::rms_norm, m.final_norm, c.rms_norm_eps, nullptr,
                                    logits_.ptr, R, st.h, st.logits);
    STEP_OP("gemv lm_head", m.lm_head.bytes(), dispatch::gemv_rows(head, stream_));
  }
  for (size_t r = 0; r < sampling.size(); ++r) {
    const DeviceSampling& sp = sampling[r];
    SampleParams p{logits_.ptr + r * st.logits, c.vocab_size, sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                   sp.seed, rows[r]->pos.ptr, sample_scratch_.ptr + r * kSampleScratch,
                   counters_.ptr + kSampleCounter + r, token_in_.ptr + r, ring_dev_ + r * kRingSize, kRingSize,
                   sample_knobs_.ptr + r};
    double sample_bytes = 4.0 * c.vocab_size;
    if (sp.has_penalties()) {  // the table prepare_penalties loaded (its pointers are baked into the graph)
      if (!rows[r]->penalties.ids) return error(ErrorCode::internal, "row %d: penalties without a table", r);
      p.presence_penalty = sp.presence_penalty;
      p.frequency_penalty = sp.frequency_penalty;
      p.repetition_penalty = sp.repetition_penalty;
      p.penalties = rows[r]->penalties;
      sample_bytes += 16.0 * static_cast<double>(sp.history.size());  // about: ids, counts, logits read + written
    }
    STEP_OP("sample", sample_bytes, sample_token(p, stream_));
  }
  if (R == 1) {
    STEP_OP("advance", 0, advance_position(rows[0]->pos.ptr, stream_));
  } else {
    PositionList list{};
    for (int r = 0; r < R; ++r) list.pos[r] = rows[r]->pos.ptr;
    list.n = R;
    STEP_OP("advance", 0, advance_positions(list, stream_));
  }
  return ok_status();
}

}  // namespace lily::cuda
