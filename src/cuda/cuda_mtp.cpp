// The multi-token-prediction head (eq 26 of docs/MODEL.md) on the CUDA backend. Over R rows: up to kMaxBatchRows on
// the decode step's kernels (mtp_rows_decode, below: a draft and the head's catch-up after a decode step), more on
// the prefill kernels (a prefill chunk's rows):
// x = W_fc [ZN(E[token]); ZN(hidden)] (the two norms written side by side into one fp16 [R, 2H] operand), one
// full-attention MoE decoder layer (cuda_prefill.cpp prefill_layer / prefill_attention) against the head's own KV
// cache at positions pos0 .., ZN(mtp.norm) of every row in fp32 (a chained draft reads its row back as `hidden`),
// and the lm_head of the last row.
//
// The per-sequence state and the draft (engine/backend.h has_mtp / enable_mtp / mtp_draft), with the CPU backend's
// semantics (cpu_backend.cpp MtpState): every main forward keeps the final-norm rows of all its rows for the head;
// a plain forward (prefill chunk or decode step) then has the head read every pending row but the last, whose next
// token is not known yet (mtp_read_rows: one norm launch, the head's rows, two row copies); a verification only
// appends its rows (one norm launch after its graph), and accept_verified cuts the rejected ones. A draft reads
// the pending rows with the token after the last, or the previous draft's output row. The decode graphs are the
// same with the head on or off: its work is launched after them. Without the head nothing here runs.
#include <algorithm>

#include "cuda/cuda_backend_impl.h"
#include "cuda/kernels/dispatch.cuh"
#include "cuda/kernels/embed.cuh"
#include "cuda/kernels/qgemm.cuh"
#include "engine/context_fit.h"

namespace lily::cuda {

Status CudaBackend::mtp_rows(const int* tokens, const float* hidden, int R, __nv_bfloat16* k, __nv_bfloat16* v,
                             int pos0, float* out_hidden, float* logits, Profiler* prof) {
  const ModelConfig& c = config();
  const DeviceModel& model = *model_;
  const int H = c.hidden_size;
  const float eps = c.rms_norm_eps;
  if (R <= kMaxBatchRows) {
    RETURN_IF_ERROR(mtp_rows_decode(tokens, hidden, R, k, v, pos0, out_hidden, prof));
  } else {
    const DeviceMtp& m = *model.mtp;
    const double rows = R;
    RETURN_IF_ERROR(mtp_cat_.reserve(static_cast<size_t>(R) * 2 * H));
    STEP_OP("embed", rows * model.embed.bytes() / model.embed.rows,
            embed_rows(model.embed, tokens, R, ph_.ptr, stream_));
    STEP_OP("rms_norm", rows * H * 6,
            rms_norm_rows(ph_.ptr, m.pre_fc_norm_embedding, R, H, eps, mtp_cat_.ptr, stream_, 2 * H));
    STEP_OP("rms_norm", rows * H * 6,
            rms_norm_rows(hidden, m.pre_fc_norm_hidden, R, H, eps, mtp_cat_.ptr + H, stream_, 2 * H));
    QGemmParams fc{m.fc, mtp_cat_.ptr, R, GemmOut::f32, ph_.ptr, 0, paths_.wgmma, pscratch_.ptr, pscratch_.bytes()};
    STEP_OP("qgemm mtp_fc", m.fc.bytes(), qgemm(fc, stream_), 2.0 * rows * m.fc.rows * m.fc.cols);
    RETURN_IF_ERROR(prefill_layer(m.layer, R, [&] { return prefill_attention(m.layer, k, v, R, pos0, prof); }, prof));
    STEP_OP("rms_norm", rows * H * 8, rms_norm_rows_f32(ph_.ptr, m.norm, R, H, eps, out_hidden, stream_));
  }
  if (!logits) return ok_status();
  GemvParams head{model.lm_head, out_hidden + static_cast<size_t>(R - 1) * H, GemvPrologue::none, nullptr, nullptr,
                  0, eps, nullptr, logits};
  STEP_OP("gemv lm_head", model.lm_head.bytes(), dispatch::gemv_rows(head, stream_));
  return ok_status();
}

// Up to kMaxBatchRows rows on the decode step's kernels (cuda_decode.cpp): the fc as a several-row GEMV on the two
// norms written side by side in fp32, the head's layer as a decode layer against its own KV cache (several rows
// chained through it as a verification's rows are: row r at pos0 + r sees the entries the rows before it wrote),
// its norm (mtp_rows adds the lm_head of the last row). A draft step or the head's catch-up after a decode step is
// then one decode layer (~40 us at 4K) and the lm_head, where the prefill kernels at T = 1 took ~170 us besides the
// lm_head (a draft at 4K: 0.348 ms on the prefill kernels, 0.276 on these, 2026-12-03). Scratch: the decode step's
// (one step runs at a time).
Status CudaBackend::mtp_rows_decode(const int* tokens, const float* hidden, int R, __nv_bfloat16* k,
                                    __nv_bfloat16* v, int pos0, float* out_hidden, Profiler* prof) {
  const ModelConfig& c = config();
  const DeviceModel& model = *model_;
  const DeviceMtp& m = *model.mtp;
  const int H = c.hidden_size;
  const float eps = c.rms_norm_eps;
  const double rows = R;
  RETURN_IF_ERROR(mtp_cat32_.reserve(static_cast<size_t>(kMaxBatchRows) * 2 * H));
  RETURN_IF_ERROR(mtp_pos_.reserve(kMaxBatchRows));
  int pos[kMaxBatchRows];
  for (int r = 0; r < R; ++r) pos[r] = pos0 + r;
  CUDA_RETURN(cudaMemcpyAsync(mtp_pos_.ptr, pos, R * sizeof(int), cudaMemcpyHostToDevice, stream_), "MTP positions");
  float* cat = mtp_cat32_.ptr;
  STEP_OP("embed", rows * model.embed.bytes() / model.embed.rows, embed_rows(model.embed, tokens, R, h_.ptr, stream_));
  STEP_OP("rms_norm", rows * H * 8, rms_norm_rows_f32(h_.ptr, m.pre_fc_norm_embedding, R, H, eps, cat, stream_, 2 * H));
  STEP_OP("rms_norm", rows * H * 8, rms_norm_rows_f32(hidden, m.pre_fc_norm_hidden, R, H, eps, cat + H, stream_, 2 * H));
  GemvParams fc{m.fc, cat, GemvPrologue::none, nullptr, nullptr, 0, eps, nullptr, h_.ptr};
  fc.n_rows = R, fc.in_stride = 2 * H, fc.out_stride = static_cast<int>(strides_.h);
  STEP_OP("gemv mtp_fc", m.fc.bytes(), dispatch::gemv_rows(fc, stream_));
  AttnRow kv[kMaxBatchRows];
  for (int r = 0; r < R; ++r) kv[r] = AttnRow{k, v, mtp_pos_.ptr + r};
  RETURN_IF_ERROR(enqueue_attention(m.layer, std::span<const AttnRow>(kv, static_cast<size_t>(R)), pos0,
                                    attention_splits(pos0 + R), /*chained=*/R > 1, prof));
  RETURN_IF_ERROR(enqueue_moe(m.layer, R, prof));
  STEP_OP("rms_norm", rows * H * 8, rms_norm_rows_f32(h_.ptr, m.norm, R, H, eps, out_hidden, stream_));
  return ok_status();
}

Status CudaBackend::mtp_head_for_test(std::span<const int32_t> tokens, const std::vector<float>& hidden,
                                      std::vector<float>* logits, std::vector<float>* out_hidden) {
  const ModelConfig& c = config();
  const int R = static_cast<int>(tokens.size()), H = c.hidden_size;
  if (!weights_->mtp) return error(ErrorCode::unsupported, "the checkpoint has no MTP head (no mtp.* tensors)");
  if (!prefill_supported()) return error(ErrorCode::unsupported, "the MTP head runs on the prefill kernels");
  if (R < 1 || R > options_.prefill_chunk || hidden.size() != static_cast<size_t>(R) * H)
    return invalid_argument("mtp_head_for_test: %d rows (1 to %d) with %zu hidden values (%d a row)", R,
                            options_.prefill_chunk, hidden.size(), H);
  RETURN_IF_ERROR(check_tokens(tokens));
  RETURN_IF_ERROR(model_->upload_mtp(*weights_->mtp));
  RETURN_IF_ERROR(ensure_prefill_scratch());
  RETURN_IF_ERROR(upload_tokens(tokens));
  const size_t kv = static_cast<size_t>(R) * c.num_key_value_heads * c.head_dim;
  DeviceArray<__nv_bfloat16> k, v;
  DeviceArray<float> hid, out, lg;
  RETURN_IF_ERROR(k.alloc(kv));
  RETURN_IF_ERROR(v.alloc(kv));
  RETURN_IF_ERROR(hid.alloc(hidden.size()));
  RETURN_IF_ERROR(out.alloc(hidden.size()));
  RETURN_IF_ERROR(lg.alloc(static_cast<size_t>(c.vocab_size)));
  CUDA_RETURN(cudaMemcpy(hid.ptr, hidden.data(), hid.bytes(), cudaMemcpyHostToDevice), "hidden rows");
  RETURN_IF_ERROR(mtp_rows(tokens_.ptr, hid.ptr, R, k.ptr, v.ptr, 0, out.ptr, lg.ptr, nullptr));
  CUDA_RETURN(cudaStreamSynchronize(stream_), "MTP head");
  logits->resize(static_cast<size_t>(c.vocab_size));
  out_hidden->resize(hidden.size());
  CUDA_RETURN(cudaMemcpy(logits->data(), lg.ptr, lg.bytes(), cudaMemcpyDeviceToHost), "logits");
  CUDA_RETURN(cudaMemcpy(out_hidden->data(), out.ptr, out.bytes(), cudaMemcpyDeviceToHost), "head output");
  return ok_status();
}

bool CudaBackend::has_mtp() const {
  return weights_->mtp.has_value() && prefill_supported() && options_.prefill_chunk >= SequenceLayout::kMtpPendingRows;
}

// The head's weights, its scratch (the prefill scratch, the fc operand and the rows of one plain forward chunk) and
// the context again: a sequence now also holds the head's KV cache (one more attention layer) and pending rows.
Status CudaBackend::enable_mtp() {
  if (!weights_->mtp) return weights_->missing_mtp_error();
  if (!prefill_supported())
    return error(ErrorCode::unsupported,
                 "the CUDA backend's MTP head runs on the prefill kernels, which %s",
                 options_.prefill_chunk == 0 ? "prefill_chunk=0 turns off" : "do not take this model's geometry");
  if (options_.prefill_chunk < SequenceLayout::kMtpPendingRows)
    return error(ErrorCode::unsupported, "the CUDA backend's MTP head reads up to %d rows in one call: "
                 "prefill_chunk=%d is too small", SequenceLayout::kMtpPendingRows, options_.prefill_chunk);
  if (mtp_on_) return ok_status();
  const ModelConfig& c = config();
  const size_t H = c.hidden_size, C = options_.prefill_chunk;
  RETURN_IF_ERROR(model_->upload_mtp(*weights_->mtp));
  RETURN_IF_ERROR(ensure_prefill_scratch());
  RETURN_IF_ERROR(mtp_cat_.reserve(C * 2 * H));
  RETURN_IF_ERROR(mtp_hidden_.reserve((C + 1) * H));
  RETURN_IF_ERROR(mtp_tokens_.reserve(SequenceLayout::kMtpPendingRows));
  size_t free_b = 0, total_b = 0;
  CUDA_RETURN(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const SequenceLayout with = SequenceLayout::of(c, 1, true), without = SequenceLayout::of(c, 1, false);
  ContextFit f;
  f.free_bytes = free_b;
  f.reserve_bytes = kRuntimeReserve;
  f.sequence = sequence_bytes(c);
  f.sequence.per_token += 2 * static_cast<size_t>(c.num_key_value_heads) * c.head_dim * sizeof(__nv_bfloat16);
  f.sequence.fixed += with.total_bytes - without.total_bytes;
  const int64_t model_max = c.max_position_embeddings;
  if (context_auto_) {
    options_.max_context = std::min(options_.max_context, max_context_that_fits(f, model_max));
    if (options_.max_context < 1) return check_context_fits(f, 1, model_max, device_name_);
  } else {
    RETURN_IF_ERROR(check_context_fits(f, options_.max_context, model_max, device_name_));
  }
  mtp_on_ = true;
  return ok_status();
}

// Before a main forward: the draft entries (positions >= n) and the chained row go; with more than max_pending
// rows pending (a verification after verifications without a draft between), the head reads all but the last
// first - their next tokens are known, and the CPU backend reads them with its next plain forward just the same.
Status CudaBackend::mtp_prepare(CudaSequence& s, int max_pending) {
  s.mtp_n = std::min(s.mtp_n, s.n);
  s.mtp_chained = false;
  if (s.mtp_rows <= std::max(max_pending, 1)) return ok_status();
  const int R = s.mtp_rows - 1, H = config().hidden_size;
  CUDA_RETURN(cudaMemcpyAsync(mtp_tokens_.ptr, s.mtp_tokens.data(), R * sizeof(int), cudaMemcpyHostToDevice, stream_),
              "MTP tokens");
  RETURN_IF_ERROR(mtp_rows(mtp_tokens_.ptr, s.mtp_pending.ptr, R, s.mtp_k.ptr, s.mtp_v.ptr, static_cast<int>(s.mtp_n),
                           s.mtp_pending.ptr, nullptr, nullptr));
  CUDA_RETURN(cudaMemcpyAsync(s.mtp_pending.ptr, s.mtp_pending.ptr + static_cast<size_t>(R) * H, H * sizeof(float),
                              cudaMemcpyDeviceToDevice, stream_),
              "MTP pending row");
  s.mtp_n += R, s.mtp_rows = 1;
  s.mtp_tokens.clear();
  return ok_status();
}

// After T rows of a plain forward (their residual rows `residual` [T, H], their tokens on the device): the pending
// row (at most one, mtp_prepare) and the T final-norm rows side by side in mtp_hidden_, the head over all but the
// last (each with the token after it: the first row's is tokens[0] when a row was pending, else tokens[1]), the last
// kept as the sequence's one pending row. With cp, the final-norm row cp_row of these T is the checkpoint's pending
// row (forward_with_checkpoint: the state after the split, as a forward of the rows up to it leaves it).
Status CudaBackend::mtp_read_rows(CudaSequence& s, const float* residual, int T, const int* tokens, Profiler* prof,
                                  CudaCheckpoint* cp, int cp_row) {
  const ModelConfig& c = config();
  const int H = c.hidden_size, P = s.mtp_rows;
  if (P > 1 || T < 1 || T > options_.prefill_chunk)
    return error(ErrorCode::internal, "MTP head: %d rows after %d pending (at most one; chunk %d)", T, P,
                 options_.prefill_chunk);
  float* rows = mtp_hidden_.ptr;
  if (P == 1)
    CUDA_RETURN(cudaMemcpyAsync(rows, s.mtp_pending.ptr, H * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
                "MTP pending row");
  float* fresh = rows + static_cast<size_t>(P) * H;
  STEP_OP("rms_norm", T * H * 8.0, rms_norm_rows_f32(residual, model_->final_norm, T, H, c.rms_norm_eps, fresh, stream_));
  if (cp && cp_row >= 0) {
    CUDA_RETURN(cudaMemcpyAsync(cp->mtp_pending.ptr, fresh + static_cast<size_t>(cp_row) * H, H * sizeof(float),
                                cudaMemcpyDeviceToDevice, stream_),
                "checkpoint MTP row");
    cp->mtp_on = true, cp->mtp_n = cp->n - 1, cp->mtp_rows = 1;
    cp->mtp_tokens.clear();
  }
  const int R = P + T - 1;  // the rows whose next token is known; the head writes its output over them
  if (R > 0)
    RETURN_IF_ERROR(mtp_rows(tokens + (1 - P), rows, R, s.mtp_k.ptr, s.mtp_v.ptr, static_cast<int>(s.mtp_n), rows,
                             nullptr, prof));
  CUDA_RETURN(cudaMemcpyAsync(s.mtp_pending.ptr, rows + static_cast<size_t>(R) * H, H * sizeof(float),
                              cudaMemcpyDeviceToDevice, stream_),
              "MTP pending row");
  s.mtp_n += R, s.mtp_rows = 1;
  s.mtp_tokens.clear();
  s.mtp_chained = false;
  return ok_status();
}

// After a verification's graph: its R rows' final norm (h_, rows H apart) appended to the pending rows, their
// tokens to the pending tokens (the first is the token after the last pending row, or, with none pending, the one a
// draft already read); accept_verified cuts the rejected ones.
Status CudaBackend::mtp_append_verified(CudaSequence& s, std::span<const int32_t> tokens) {
  const ModelConfig& c = config();
  const int H = c.hidden_size, R = static_cast<int>(tokens.size()), P = s.mtp_rows;
  if (P + R > SequenceLayout::kMtpPendingRows)
    return error(ErrorCode::internal, "MTP head: %d verified rows after %d pending", R, P);
  Profiler* prof = nullptr;
  STEP_OP("rms_norm", R * H * 8.0,
          rms_norm_rows_f32(h_.ptr, model_->final_norm, R, H, c.rms_norm_eps,
                            s.mtp_pending.ptr + static_cast<size_t>(P) * H, stream_));
  s.mtp_tokens.insert(s.mtp_tokens.end(), tokens.begin() + (P > 0 ? 0 : 1), tokens.end());
  s.mtp_rows = P + R;
  return ok_status();
}

// One draft step (engine/backend.h): the pending rows with their tokens and `token` (the last row's next), or the
// previous draft's output row with `token`; the logits of the last row to the host (mtp_draft) or their argmax
// (mtp_draft_argmax). The entries it writes at positions >= n are dropped by the next forward (mtp_prepare).
Status CudaBackend::mtp_draft(SequenceState& base, int32_t token, std::vector<float>* logits) {
  const size_t V = static_cast<size_t>(config().vocab_size);
  logits->resize(V);
  return mtp_draft_then(base, token, [&]() -> Status {
    CUDA_RETURN(cudaMemcpyAsync(logits->data(), logits_.ptr, V * sizeof(float), cudaMemcpyDeviceToHost, stream_),
                "draft logits");
    return ok_status();
  });
}

Status CudaBackend::mtp_draft_argmax(SequenceState& base, int32_t token, int32_t* id) {
  return mtp_draft_then(base, token, [&] { return enqueue_argmax(1, id); });
}

Status CudaBackend::mtp_draft_then(SequenceState& base, int32_t token, const std::function<Status()>& read_out) {
  auto* s = dynamic_cast<CudaSequence*>(&base);
  if (!s || s->owner != this) return invalid_argument("sequence state is not from this CUDA backend");
  if (!s->mtp_on) return invalid_argument("mtp_draft: the MTP head is not enabled (enable_mtp)");
  if (s->verify_base >= 0) return invalid_argument("mtp_draft between forward_verify and accept_verified");
  RETURN_IF_ERROR(check_tokens(std::span<const int32_t>(&token, 1)));
  const int H = config().hidden_size;
  const bool from_pending = s->mtp_rows > 0;
  if (!from_pending && !s->mtp_chained)
    return invalid_argument("mtp_draft: the sequence has no hidden state to draft from (forward a token first)");
  const int R = from_pending ? s->mtp_rows : 1;
  if (s->mtp_n + R > s->capacity)
    return error(ErrorCode::out_of_range, "mtp_draft: the head's KV would hold %lld entries, its capacity is %lld",
                 (long long)(s->mtp_n + R), (long long)s->capacity);
  std::vector<int32_t> ids = s->mtp_tokens;
  ids.push_back(token);
  float* hidden = from_pending ? s->mtp_pending.ptr : s->mtp_chain.ptr;
  CUDA_RETURN(cudaMemcpyAsync(mtp_tokens_.ptr, ids.data(), R * sizeof(int), cudaMemcpyHostToDevice, stream_),
              "MTP tokens");
  RETURN_IF_ERROR(mtp_rows(mtp_tokens_.ptr, hidden, R, s->mtp_k.ptr, s->mtp_v.ptr, static_cast<int>(s->mtp_n), hidden,
                           logits_.ptr, nullptr));
  if (from_pending)
    CUDA_RETURN(cudaMemcpyAsync(s->mtp_chain.ptr, hidden + static_cast<size_t>(R - 1) * H, H * sizeof(float),
                                cudaMemcpyDeviceToDevice, stream_),
                "MTP chained row");
  RETURN_IF_ERROR(read_out());
  CUDA_RETURN(cudaStreamSynchronize(stream_), "MTP draft");
  s->mtp_n += R, s->mtp_rows = 0;
  s->mtp_tokens.clear();
  s->mtp_chained = true;
  return ok_status();
}

}  // namespace lily::cuda
