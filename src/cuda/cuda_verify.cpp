// Speculative verification on the CUDA backend (engine/backend.h forward_verify / accept_verified): the 1+K rows of
// one sequence as one several-row decode step (cuda_decode.cpp, `chained`). Row r is a view of the sequence at
// position n + r: it shares the sequence's KV cache (attn_prep writes every row's K / V before attn_decode reads,
// so row r sees the rows before it) and has its own recurrent state, which the Gated DeltaNet layers fill row after
// row from the state the row before left (gdn_step reads it and writes the row's own: GdnStepParams S_out /
// ring_out, no copies). Rows 0 .. R - 2 keep theirs in verify_states_ until accept_verified; the last row writes
// the sequence's own state (read by no row of the step after row 0). The GEMVs and the MoE read their weights once for all rows, and every
// row's arithmetic is the one-row step's (the several-row kernels' batch invariance), so row r's logits are those
// the plain decode of the same tokens gives at that position, bit for bit.
// accept_verified(n) keeps rows [0, n): the position goes back to base + n and, for n < R, the state of row n - 1
// is copied over the sequence's (one copy of its recurrent region); the KV rows past it are dead (attention reads
// up to the position). The backend has one set of state buffers: a verification of another sequence before the
// accept takes them over, and then only all rows can be kept (refused otherwise; the engine verifies one sequence
// at a time).
#include "cuda/cuda_backend_impl.h"

namespace lily::cuda {

Status CudaBackend::bind_verify_views(CudaSequence& s, int R) {
  const SequenceLayout& L = s.layout;
  if (!verify_pos_.ptr) RETURN_IF_ERROR(verify_pos_.alloc(kMaxBatchRows));
  // R - 1 states (3 at first: speculation verifies up to 1 + 3 rows); a larger R reallocates, and the graphs
  // that baked the old buffer go (none is in flight: every caller synchronised).
  const size_t need = static_cast<size_t>(std::max(R - 1, 3)) * L.recurrent_bytes;
  if (verify_states_.bytes < need) {
    verify_states_ = DeviceBlock();
    row_graphs_.remove_if([](const auto& g) { return g.first.rfind("verify/", 0) == 0; });
    if (!verify_states_.alloc(need).ok()) {
      verify_states_ = DeviceBlock();
      cudaGetLastError();  // the failed allocation is not sticky: clear it
      return error(ErrorCode::out_of_range, "no device memory for the recurrent state of %d verified rows (%zu MB)",
                   R, need >> 20);
    }
  }
  while (verify_views_.size() < static_cast<size_t>(kMaxBatchRows)) verify_views_.push_back(std::make_unique<CudaSequence>());
  for (int r = 0; r < R; ++r) {
    CudaSequence& v = *verify_views_[static_cast<size_t>(r)];
    v.owner = this;
    v.n = s.n + r, v.capacity = s.capacity;
    v.k = s.k, v.v = s.v;
    v.pos = DeviceSpan<int>{verify_pos_.ptr + r, 1};
    if (r == R - 1) {  // the last row steps on the sequence's own state
      v.conv = s.conv, v.S = s.S;
      continue;
    }
    unsigned char* base = static_cast<unsigned char*>(verify_states_.ptr) + static_cast<size_t>(r) * L.recurrent_bytes;
    v.conv.assign(L.attention.size(), std::nullopt), v.S.assign(L.attention.size(), std::nullopt);
    for (size_t l = 0; l < L.attention.size(); ++l) {
      if (L.attention[l]) continue;
      v.conv[l] = DeviceSpan<float>{reinterpret_cast<float*>(base + L.off_a[l]), L.conv_n};
      v.S[l] = DeviceSpan<float>{reinterpret_cast<float*>(base + L.off_b[l]), L.S_n};
    }
  }
  return ok_status();
}

Status CudaBackend::forward_verify(SequenceState& base, std::span<const int32_t> tokens, std::vector<float>* logits) {
  const size_t V = static_cast<size_t>(config().vocab_size);
  return forward_verify_then(base, tokens, [&](int R) -> Status {
    logits->resize(static_cast<size_t>(R) * V);
    CUDA_RETURN(cudaMemcpy2DAsync(logits->data(), V * sizeof(float), logits_.ptr, strides_.logits * sizeof(float),
                                  V * sizeof(float), R, cudaMemcpyDeviceToHost, stream_),
                "logits");
    return ok_status();
  });
}

Status CudaBackend::forward_verify_argmax(SequenceState& base, std::span<const int32_t> tokens,
                                          std::vector<int32_t>* ids) {
  return forward_verify_then(base, tokens, [&](int R) {
    ids->assign(static_cast<size_t>(R), -1);
    return enqueue_argmax(R, ids->data());
  });
}

Status CudaBackend::forward_verify_then(SequenceState& base, std::span<const int32_t> tokens,
                                        const std::function<Status(int rows)>& read_out) {
  const int R = static_cast<int>(tokens.size());
  if (R < 1 || R > kMaxBatchRows)
    return invalid_argument("forward_verify: %zu rows; the CUDA backend verifies 1 to %d", tokens.size(), kMaxBatchRows);
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, R));
  RETURN_IF_ERROR(check_tokens(tokens));
  static_assert(SequenceLayout::kMtpPendingRows >= 1 + kMaxBatchRows, "one verification after a pending row");
  if (s->mtp_on) RETURN_IF_ERROR(mtp_prepare(*s, SequenceLayout::kMtpPendingRows - R));
  RETURN_IF_ERROR(bind_verify_views(*s, R));
  std::vector<CudaSequence*> rows;
  for (int r = 0; r < R; ++r) rows.push_back(verify_views_[static_cast<size_t>(r)].get());
  int pos[kMaxBatchRows];
  for (int r = 0; r < R; ++r) pos[r] = static_cast<int>(s->n + r);
  CUDA_RETURN(cudaMemcpyAsync(verify_pos_.ptr, pos, R * sizeof(int), cudaMemcpyHostToDevice, stream_), "positions");
  CUDA_RETURN(cudaMemcpyAsync(token_in_.ptr, tokens.data(), R * sizeof(int), cudaMemcpyHostToDevice, stream_),
              "tokens");
  // The graph bakes the views' pointers: this sequence's, and the state buffers by row count.
  const int n_splits = attention_splits(s->n + R);
  const std::string key = "verify/" + std::to_string(n_splits) + "/" + std::to_string(R) + "|" + std::to_string(s->id);
  ASSIGN_OR_RETURN(cudaGraphExec_t g, row_graph(key, [&]() -> Status {
                     RETURN_IF_ERROR(enqueue_step(rows, n_splits, {}, nullptr, /*chained=*/true));
                     // the sequence's position after its last row (advanced with that row's view)
                     CUDA_RETURN(cudaMemcpyAsync(s->pos.ptr, verify_pos_.ptr + R - 1, sizeof(int),
                                                 cudaMemcpyDeviceToDevice, stream_),
                                 "position");
                     return ok_status();
                   }));
  CUDA_RETURN(cudaGraphLaunch(g, stream_), "graph launch");
  if (s->mtp_on) RETURN_IF_ERROR(mtp_append_verified(*s, tokens));  // after the graph: the same graph either way
  RETURN_IF_ERROR(read_out(R));
  CUDA_RETURN(cudaStreamSynchronize(stream_), "verification step");
  s->verify_base = s->n, s->verify_rows = R;
  s->n += R;
  verify_owner_ = s->id;
  return ok_status();
}

// Greedy sampling (sample.cuh: argmax, ties -> lowest id) of rows 0 .. R-1 of logits_, each with its own scratch
// and counter slot as in a several-row step; no ring. The ids land in `ids` after the caller's synchronisation.
Status CudaBackend::enqueue_argmax(int R, int32_t* ids) {
  RETURN_IF_ERROR(argmax_ids_.reserve(kMaxBatchRows + 1));
  const int V = config().vocab_size;
  for (int r = 0; r < R; ++r) {
    SampleParams p{logits_.ptr + r * strides_.logits, V, 0.0f, 0, 1.0f, 0.0f, 0, argmax_ids_.ptr + kMaxBatchRows,
                   sample_scratch_.ptr + r * kSampleScratch, counters_.ptr + kSampleCounter + r, argmax_ids_.ptr + r,
                   nullptr, 0};
    CUDA_RETURN(sample_token(p, stream_), "argmax");
  }
  CUDA_RETURN(cudaMemcpyAsync(ids, argmax_ids_.ptr, R * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_), "argmax ids");
  return ok_status();
}

Status CudaBackend::accept_verified(SequenceState& base, int64_t n_keep) {
  auto* s = dynamic_cast<CudaSequence*>(&base);
  if (!s || s->owner != this) return invalid_argument("sequence state is not from this CUDA backend");
  if (s->verify_base < 0) return invalid_argument("accept_verified without a forward_verify before it");
  if (n_keep < 1 || n_keep > s->verify_rows)
    return invalid_argument("accept_verified: %lld rows kept of %d verified", (long long)n_keep, s->verify_rows);
  // One set of state buffers serves the backend: a later verification of another sequence took them over.
  if (n_keep < s->verify_rows && s->id != verify_owner_)
    return invalid_argument("accept_verified: the states of this sequence's verified rows were overwritten by another "
                            "sequence's verification; only all %d rows can be kept", s->verify_rows);
  if (n_keep < s->verify_rows && s->layout.recurrent_bytes > 0) {
    const unsigned char* kept =
        static_cast<const unsigned char*>(verify_states_.ptr) + static_cast<size_t>(n_keep - 1) * s->layout.recurrent_bytes;
    CUDA_RETURN(cudaMemcpyAsync(s->storage.ptr, kept, s->layout.recurrent_bytes, cudaMemcpyDeviceToDevice, stream_),
                "kept state");
  }
  const int host_pos = static_cast<int>(s->verify_base + n_keep);
  CUDA_RETURN(cudaMemcpyAsync(s->pos.ptr, &host_pos, sizeof(int), cudaMemcpyHostToDevice, stream_), "position");
  CUDA_RETURN(cudaStreamSynchronize(stream_), "accept_verified");
  s->n = host_pos;
  s->verify_base = -1, s->verify_rows = 0;
  if (s->mtp_on) {  // the pending rows of the rejected positions go too (mtp_n + P = n before the verification)
    const int64_t P = s->n - s->mtp_n;
    if (P < 1 || P > s->mtp_rows)
      return error(ErrorCode::internal, "accept_verified: %lld MTP rows to keep of %d", (long long)P, s->mtp_rows);
    s->mtp_rows = static_cast<int>(P);
    s->mtp_tokens.resize(static_cast<size_t>(P - 1));
  }
  return ok_status();
}

}  // namespace lily::cuda
