// The multi-token-prediction head (eq 26 of docs/MODEL.md) on the CUDA backend, on the prefill kernels: over R rows,
// x = W_fc [ZN(E[token]); ZN(hidden)] (the two norms written side by side into one fp16 [R, 2H] operand), one
// full-attention MoE decoder layer (cuda_prefill.cpp prefill_layer / prefill_attention) against the head's own KV
// cache at positions pos0 .., ZN(mtp.norm) of every row in fp32 (a chained draft reads its row back as `hidden`),
// and the lm_head of the last row. The head's weights are uploaded on first use (DeviceModel::upload_mtp).
// What is here: the head's arithmetic and its op test against the CPU reference (mtp_head_for_test). Not yet:
// mtp_draft / enable_mtp (the head's per-sequence KV, the main model's final-norm rows kept on the device for it,
// checkpoints carrying them), so has_mtp() stays false and speculative decoding stays on the CPU backend.
#include <algorithm>

#include "cuda/cuda_backend_impl.h"
#include "cuda/kernels/dispatch.cuh"
#include "cuda/kernels/embed.cuh"
#include "cuda/kernels/qgemm.cuh"

namespace lily::cuda {

Status CudaBackend::mtp_rows(const int* tokens, const float* hidden, int R, __nv_bfloat16* k, __nv_bfloat16* v,
                             int pos0, float* out_hidden, float* logits, Profiler* prof) {
  const ModelConfig& c = config();
  const DeviceModel& model = *model_;
  const DeviceMtp& m = *model.mtp;
  const int H = c.hidden_size;
  const float eps = c.rms_norm_eps;
  const double rows = R;
  if (mtp_cat_.n < static_cast<size_t>(R) * 2 * H) RETURN_IF_ERROR(mtp_cat_.alloc(static_cast<size_t>(R) * 2 * H));
  STEP_OP("embed", rows * model.embed.bytes() / model.embed.rows, embed_rows(model.embed, tokens, R, ph_.ptr, stream_));
  STEP_OP("rms_norm", rows * H * 6,
          rms_norm_rows(ph_.ptr, m.pre_fc_norm_embedding, R, H, eps, mtp_cat_.ptr, stream_, 2 * H));
  STEP_OP("rms_norm", rows * H * 6,
          rms_norm_rows(hidden, m.pre_fc_norm_hidden, R, H, eps, mtp_cat_.ptr + H, stream_, 2 * H));
  QGemmParams fc{m.fc, mtp_cat_.ptr, R, GemmOut::f32, ph_.ptr, 0, paths_.wgmma, pscratch_.ptr, pscratch_.bytes()};
  STEP_OP("qgemm mtp_fc", m.fc.bytes(), qgemm(fc, stream_), 2.0 * rows * m.fc.rows * m.fc.cols);
  RETURN_IF_ERROR(prefill_layer(m.layer, R, [&] { return prefill_attention(m.layer, k, v, R, pos0, prof); }, prof));
  STEP_OP("rms_norm", rows * H * 8, rms_norm_rows_f32(ph_.ptr, m.norm, R, H, eps, out_hidden, stream_));
  if (!logits) return ok_status();
  GemvParams head{model.lm_head, out_hidden + static_cast<size_t>(R - 1) * H, GemvPrologue::none, nullptr, nullptr,
                  0, eps, nullptr, logits};
  STEP_OP("gemv lm_head", model.lm_head.bytes(), dispatch::gemv_rows(head, stream_));
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

Result<double> CudaBackend::time_mtp_draft(int64_t context, int reps) {
  const ModelConfig& c = config();
  const int H = c.hidden_size;
  if (!weights_->mtp) return error(ErrorCode::unsupported, "the checkpoint has no MTP head (no mtp.* tensors)");
  if (!prefill_supported()) return error(ErrorCode::unsupported, "the MTP head runs on the prefill kernels");
  if (context < 0 || context + 1 > options_.max_context || reps < 1)
    return invalid_argument("time_mtp_draft: context %lld (0 to %lld), reps %d", (long long)context,
                            (long long)options_.max_context - 1, reps);
  RETURN_IF_ERROR(model_->upload_mtp(*weights_->mtp));
  RETURN_IF_ERROR(ensure_prefill_scratch());
  const int32_t token = 17;
  RETURN_IF_ERROR(upload_tokens(std::span<const int32_t>(&token, 1)));
  // The KV rows' values do not change the time (zeros); the row at `context` is written by each call.
  const size_t kv = static_cast<size_t>(context + 1) * c.num_key_value_heads * c.head_dim;
  DeviceArray<__nv_bfloat16> k, v;
  DeviceArray<float> hid, out, lg;
  RETURN_IF_ERROR(k.alloc(kv));
  RETURN_IF_ERROR(v.alloc(kv));
  RETURN_IF_ERROR(hid.alloc(H));
  RETURN_IF_ERROR(out.alloc(H));
  RETURN_IF_ERROR(lg.alloc(static_cast<size_t>(c.vocab_size)));
  std::vector<float> ones(static_cast<size_t>(H), 1.0f);
  CUDA_RETURN(cudaMemcpy(hid.ptr, ones.data(), hid.bytes(), cudaMemcpyHostToDevice), "hidden row");
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  CUDA_RETURN(cudaEventCreate(&e0), "event");
  CUDA_RETURN(cudaEventCreate(&e1), "event");
  std::vector<double> ms;
  Status st = ok_status();
  for (int i = 0; i <= reps && st.ok(); ++i) {  // the first call warms up
    cudaEventRecord(e0, stream_);
    st = mtp_rows(tokens_.ptr, hid.ptr, 1, k.ptr, v.ptr, static_cast<int>(context), out.ptr, lg.ptr, nullptr);
    cudaEventRecord(e1, stream_);
    float t = 0;
    if (st.ok()) st = cuda_status(cudaEventSynchronize(e1), "MTP draft step");
    if (st.ok()) st = cuda_status(cudaEventElapsedTime(&t, e0, e1), "event time");
    if (i > 0) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  RETURN_IF_ERROR(st);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace lily::cuda
