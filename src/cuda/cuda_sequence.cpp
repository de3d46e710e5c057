#include "cuda/cuda_sequence.h"

#include <atomic>
#include <cstdint>

namespace lily::cuda {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ok_status();
  return error(ErrorCode::internal, "CUDA %s: %s", what, cudaGetErrorString(e));
}

namespace {

size_t align_up(size_t b) {
  return (b + SequenceLayout::kAlign - 1) / SequenceLayout::kAlign * SequenceLayout::kAlign;
}

template <typename T>
DeviceSpan<T> span_at(const DeviceBlock& block, size_t off, size_t n) {
  return {reinterpret_cast<T*>(static_cast<unsigned char*>(block.ptr) + off), n};
}

}  // namespace

SequenceLayout SequenceLayout::of(const ModelConfig& c, int64_t capacity, bool mtp) {
  SequenceLayout L;
  L.conv_n = static_cast<size_t>(c.linear_conv_kernel_dim) * c.linear_conv_dim();
  L.S_n = static_cast<size_t>(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim;
  L.kv_n = static_cast<size_t>(capacity) * c.num_key_value_heads * c.head_dim;
  const size_t n_layers = c.layer_types.size();
  L.attention.resize(n_layers);
  L.off_a.assign(n_layers, 0);
  L.off_b.assign(n_layers, 0);
  size_t at = 0;
  for (size_t l = 0; l < n_layers; ++l) {  // the recurrent region first: a checkpoint copies [0, at)
    L.attention[l] = c.layer_types[l] == LayerType::full_attention;
    if (L.attention[l]) continue;
    L.off_a[l] = at, at += align_up(L.conv_n * sizeof(float));
    L.off_b[l] = at, at += align_up(L.S_n * sizeof(float));
  }
  L.recurrent_bytes = at;
  L.pos_off = at, at += align_up(sizeof(int));
  for (size_t l = 0; l < n_layers; ++l) {
    if (!L.attention[l]) continue;
    L.off_a[l] = at, at += align_up(L.kv_n * sizeof(__nv_bfloat16));
    L.off_b[l] = at, at += align_up(L.kv_n * sizeof(__nv_bfloat16));
  }
  L.hidden = static_cast<size_t>(c.hidden_size);
  if (mtp) {
    L.mtp = true;
    L.mtp_k_off = at, at += align_up(L.kv_n * sizeof(__nv_bfloat16));
    L.mtp_v_off = at, at += align_up(L.kv_n * sizeof(__nv_bfloat16));
    L.mtp_pending_off = at, at += align_up(L.mtp_pending_bytes());
    L.mtp_chain_off = at, at += align_up(L.hidden * sizeof(float));
  }
  L.total_bytes = at;
  return L;
}

void CudaSequence::bind_views() {
  const SequenceLayout& L = layout;
  const size_t n_layers = L.attention.size();
  k.assign(n_layers, std::nullopt), v.assign(n_layers, std::nullopt);
  conv.assign(n_layers, std::nullopt), S.assign(n_layers, std::nullopt);
  for (size_t l = 0; l < n_layers; ++l) {
    if (L.attention[l]) {
      k[l] = span_at<__nv_bfloat16>(storage, L.off_a[l], L.kv_n);
      v[l] = span_at<__nv_bfloat16>(storage, L.off_b[l], L.kv_n);
    } else {
      conv[l] = span_at<float>(storage, L.off_a[l], L.conv_n);
      S[l] = span_at<float>(storage, L.off_b[l], L.S_n);
    }
  }
  pos = span_at<int>(storage, L.pos_off, 1);
  mtp_on = L.mtp;
  if (!L.mtp) return;
  mtp_k = span_at<__nv_bfloat16>(storage, L.mtp_k_off, L.kv_n);
  mtp_v = span_at<__nv_bfloat16>(storage, L.mtp_v_off, L.kv_n);
  mtp_pending = span_at<float>(storage, L.mtp_pending_off, SequenceLayout::kMtpPendingRows * L.hidden);
  mtp_chain = span_at<float>(storage, L.mtp_chain_off, L.hidden);
}

Status CudaSequence::allocate(const ModelConfig& c, int64_t cap, bool mtp) {
  capacity = cap;
  n = 0;
  layout = SequenceLayout::of(c, cap, mtp);
  RETURN_IF_ERROR(storage.alloc(layout.total_bytes));
  bind_views();
  // Everything zero (the KV rows past the position included).
  CUDA_RETURN(cudaMemsetAsync(storage.ptr, 0, storage.bytes, 0), "cudaMemset");
  CUDA_RETURN(cudaStreamSynchronize(0), "cudaMemset");
  return ok_status();
}

std::unique_ptr<CudaCheckpoint> CudaCheckpoint::allocate(const SequenceLayout& L, int64_t at) {
  auto cp = std::make_unique<CudaCheckpoint>();
  cp->n = at;
  cp->recurrent_bytes = L.recurrent_bytes;
  cp->hidden = L.hidden;
  if (!cp->storage.alloc(L.recurrent_bytes + L.mtp_pending_bytes()).ok()) return nullptr;
  if (L.mtp)  // the recurrent region's size is a multiple of kAlign
    cp->mtp_pending = span_at<float>(cp->storage, L.recurrent_bytes, L.mtp_pending_bytes() / sizeof(float));
  cp->conv.assign(L.attention.size(), std::nullopt);
  cp->S.assign(L.attention.size(), std::nullopt);
  for (size_t l = 0; l < L.attention.size(); ++l) {
    if (L.attention[l]) continue;
    cp->conv[l] = span_at<float>(cp->storage, L.off_a[l], L.conv_n);
    cp->S[l] = span_at<float>(cp->storage, L.off_b[l], L.S_n);
  }
  return cp;
}

std::unique_ptr<CudaCheckpoint> CudaSequence::empty_checkpoint(int64_t at) const {
  return CudaCheckpoint::allocate(layout, at);
}

std::unique_ptr<Checkpoint> CudaSequence::checkpoint() const {
  auto cp = empty_checkpoint(n);  // every byte used is written by the copies: no clearing
  if (!cp) return nullptr;
  bool ok = layout.recurrent_bytes == 0 || cudaMemcpyAsync(cp->storage.ptr, storage.ptr, layout.recurrent_bytes,
                                                           cudaMemcpyDeviceToDevice, 0) == cudaSuccess;
  if (mtp_on) {  // as the CPU backend: draft entries (positions >= n) are not part of the sequence
    cp->mtp_on = true;
    cp->mtp_n = std::min(mtp_n, n);
    if (mtp_n <= n) {
      cp->mtp_rows = mtp_rows;
      cp->mtp_tokens = mtp_tokens;
      if (mtp_rows > 0)
        ok = ok && cudaMemcpyAsync(cp->mtp_pending.ptr, mtp_pending.ptr, mtp_rows * layout.hidden * sizeof(float),
                                   cudaMemcpyDeviceToDevice, 0) == cudaSuccess;
    }
  }
  if (!ok || cudaStreamSynchronize(0) != cudaSuccess) return nullptr;
  return cp;
}

Status CudaSequence::restore(const Checkpoint& base) {
  auto* cp = dynamic_cast<const CudaCheckpoint*>(&base);
  if (!cp || cp->conv.size() != conv.size() || cp->recurrent_bytes != layout.recurrent_bytes)
    return invalid_argument("checkpoint is not from this backend/model");
  if (cp->n > n)
    return invalid_argument("checkpoint at %lld is past the sequence end %lld", (long long)cp->n,
                            (long long)n);
  // A checkpoint without the head's part (from a sequence without the head: a backend with the head on takes
  // and loads none such) restarts the head at the checkpoint's position with no pending rows: its drafts are
  // poor until it has read a few rows, but the position invariant mtp_n + P = n holds (accept_verified relies
  // on it).
  const bool cp_mtp = mtp_on && cp->mtp_on && cp->mtp_pending.ptr;
  const int64_t cp_mtp_n = cp_mtp ? cp->mtp_n : cp->n;
  if (mtp_on && cp_mtp && cp_mtp_n > mtp_n)
    return invalid_argument("checkpoint's MTP head state (%lld positions) is past the sequence's (%lld)",
                            (long long)cp_mtp_n, (long long)mtp_n);
  if (layout.recurrent_bytes > 0)
    CUDA_RETURN(
        cudaMemcpyAsync(storage.ptr, cp->storage.ptr, layout.recurrent_bytes, cudaMemcpyDeviceToDevice, 0),
        "restore");
  if (cp_mtp && cp->mtp_rows > 0)
    CUDA_RETURN(cudaMemcpyAsync(mtp_pending.ptr, cp->mtp_pending.ptr, cp->mtp_rows * layout.hidden * sizeof(float),
                                cudaMemcpyDeviceToDevice, 0),
                "restore");
  const int host_pos = static_cast<int>(cp->n);  // the KV cache is truncated by the position alone
  CUDA_RETURN(cudaMemcpyAsync(pos.ptr, &host_pos, sizeof(int), cudaMemcpyHostToDevice, 0), "restore");
  CUDA_RETURN(cudaStreamSynchronize(0), "restore");
  n = cp->n;
  verify_base = -1, verify_rows = 0;
  penalty_sync.clear();  // the next penalised request rebuilds its table
  if (mtp_on) {  // the head's KV is truncated by its length alone
    mtp_n = cp_mtp_n;
    mtp_rows = cp_mtp ? cp->mtp_rows : 0;
    mtp_tokens = cp_mtp ? cp->mtp_tokens : std::vector<int32_t>{};
    mtp_chained = false;
  }
  return ok_status();
}

uint64_t CudaSequence::next_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

std::unique_ptr<SequenceState> CudaSequence::clone() const {
  auto s = std::make_unique<CudaSequence>();
  s->owner = owner;
  s->n = n;
  s->capacity = capacity;
  s->layout = layout;
  if (!s->storage.alloc(layout.total_bytes).ok()) return nullptr;
  s->bind_views();
  s->mtp_n = mtp_n, s->mtp_rows = mtp_rows, s->mtp_tokens = mtp_tokens, s->mtp_chained = mtp_chained;
  // The KV rows past n stay zero as in a fresh sequence; the recurrent region, pos and the used rows are
  // copied.
  auto* dst = static_cast<unsigned char*>(s->storage.ptr);
  const auto* src = static_cast<const unsigned char*>(storage.ptr);
  bool ok =
      cudaMemsetAsync(dst, 0, layout.total_bytes, 0) == cudaSuccess &&
      cudaMemcpyAsync(dst, src, layout.pos_off + sizeof(int), cudaMemcpyDeviceToDevice, 0) == cudaSuccess;
  const size_t row_bytes = layout.kv_n / static_cast<size_t>(capacity) * sizeof(__nv_bfloat16);
  const size_t used = row_bytes * static_cast<size_t>(n);
  auto copy = [&](size_t off, size_t bytes) {
    ok = ok &&
         (bytes == 0 || cudaMemcpyAsync(dst + off, src + off, bytes, cudaMemcpyDeviceToDevice, 0) == cudaSuccess);
  };
  for (size_t l = 0; l < k.size(); ++l) {
    if (!layout.attention[l]) continue;
    copy(layout.off_a[l], used);
    copy(layout.off_b[l], used);
  }
  if (mtp_on) {  // the head's entries (a draft's too), its pending rows and chained row, as the CPU's clone
    copy(layout.mtp_k_off, row_bytes * static_cast<size_t>(mtp_n));
    copy(layout.mtp_v_off, row_bytes * static_cast<size_t>(mtp_n));
    copy(layout.mtp_pending_off, mtp_rows * layout.hidden * sizeof(float));
    copy(layout.mtp_chain_off, mtp_chained ? layout.hidden * sizeof(float) : 0);
  }
  if (!ok || cudaStreamSynchronize(0) != cudaSuccess) return nullptr;
  return s;
}

}  // namespace lily::cuda

namespace lily::cuda {

namespace {

// The bytes of the first n KV rows of one attention layer's k (or v).
size_t kv_used_bytes(const SequenceLayout& L, int64_t capacity, int64_t n) {
  return L.kv_n / static_cast<size_t>(capacity) * static_cast<size_t>(n) * sizeof(__nv_bfloat16);
}

Status save_region(ByteWriter& out, const void* device, size_t bytes, const char* what) {
  out.pod<uint64_t>(bytes);
  if (bytes == 0) return ok_status();
  return cuda_status(cudaMemcpy(out.grow(bytes), device, bytes, cudaMemcpyDeviceToHost), what);
}

// `expect` bytes to `device`, or read past them when device is null (the MTP head's part in a backend without
// the head).
Status load_region(ByteReader& in, void* device, size_t expect, const char* what) {
  uint64_t bytes = 0;
  RETURN_IF_ERROR(in.pod(&bytes, what));
  if (bytes != expect)
    return format_error("%s of %llu bytes, this model's is %zu", what, (unsigned long long)bytes, expect);
  ASSIGN_OR_RETURN(std::span<const uint8_t> src, in.view(expect, what));
  if (expect == 0 || !device) return ok_status();
  return cuda_status(cudaMemcpy(device, src.data(), expect, cudaMemcpyHostToDevice), what);
}

void put_ids(ByteWriter& out, const std::vector<int32_t>& ids) {
  out.pod<uint64_t>(ids.size());
  out.bytes(ids.data(), ids.size() * sizeof(int32_t));
}

// The MTP head's part after the main state (the header's layout): its flag, length m and pending row count P.
// A saved head is m + P = n with at most kMtpPendingRows rows, as every path that leaves it behind leaves it.
struct MtpPart {
  bool has = false;
  int64_t m = 0;
  int32_t rows = 0;
};

void put_mtp_head(ByteWriter& out, bool on, int64_t m, int32_t rows) {
  out.pod<uint8_t>(on ? 1 : 0);
  if (!on) return;
  out.pod<int64_t>(m);
  out.pod<int32_t>(rows);
}

Result<MtpPart> read_mtp_head(ByteReader& in, int64_t n, bool keep) {
  uint8_t has = 0;
  RETURN_IF_ERROR(in.pod(&has, "MTP head flag"));
  if (has > 1) return format_error("MTP head flag %u", static_cast<unsigned>(has));
  MtpPart p;
  if (!has) {
    if (keep)
      return error(ErrorCode::unsupported,
                   "saved without the MTP head's state, which this backend's sequences carry (enable_mtp)");
    return p;
  }
  p.has = true;
  RETURN_IF_ERROR(in.pod(&p.m, "MTP head position"));
  RETURN_IF_ERROR(in.pod(&p.rows, "MTP pending row count"));
  if (p.m < 0 || p.m > n || p.rows < 0 || p.rows > SequenceLayout::kMtpPendingRows || p.m + p.rows != n)
    return format_error("the MTP head at %lld with %d pending rows, the sequence at %lld (at most %d rows)",
                        (long long)p.m, p.rows, (long long)n, SequenceLayout::kMtpPendingRows);
  return p;
}

// The pending rows' tokens: P-1 of them (none when no row is pending).
Status read_mtp_tokens(ByteReader& in, int32_t rows, std::vector<int32_t>* ids) {
  uint64_t count = 0;
  RETURN_IF_ERROR(in.pod(&count, "MTP pending tokens"));
  const size_t expect = rows > 0 ? static_cast<size_t>(rows - 1) : 0;
  if (count != expect)
    return format_error("MTP pending tokens: %llu, expected %zu", (unsigned long long)count, expect);
  ids->resize(expect);
  return in.bytes(ids->data(), expect * sizeof(int32_t), "MTP pending tokens");
}

}  // namespace

// cudaMemcpy (not the async form): it waits for the copy and orders after earlier legacy-stream work, and the
// backend's stream is idle between calls (see the header).
Status CudaCheckpoint::save(ByteWriter& out) const {
  out.pod<int64_t>(n);
  RETURN_IF_ERROR(save_region(out, storage.ptr, recurrent_bytes, "checkpoint recurrent state"));
  put_mtp_head(out, mtp_on, mtp_n, mtp_rows);
  if (!mtp_on) return ok_status();
  RETURN_IF_ERROR(save_region(out, mtp_pending.ptr, static_cast<size_t>(mtp_rows) * hidden * sizeof(float),
                              "checkpoint MTP pending rows"));
  put_ids(out, mtp_tokens);
  return ok_status();
}

// The head's state as the next forward finds it (mtp_prepare): a draft's entries at positions >= n and the
// chained row are left out, as checkpoint() leaves them out (a draft from the pending rows has read them all:
// none pending then, the head at n).
Status CudaSequence::save(ByteWriter& out) const {
  out.pod<int64_t>(n);
  RETURN_IF_ERROR(save_region(out, storage.ptr, layout.recurrent_bytes, "recurrent state"));
  const size_t used = kv_used_bytes(layout, capacity, n);
  const auto* base = static_cast<const unsigned char*>(storage.ptr);
  for (size_t l = 0; l < layout.attention.size(); ++l) {
    if (!layout.attention[l]) continue;
    RETURN_IF_ERROR(save_region(out, base + layout.off_a[l], used, "k cache"));
    RETURN_IF_ERROR(save_region(out, base + layout.off_b[l], used, "v cache"));
  }
  const int64_t m = std::min(mtp_n, n);
  const int32_t rows = mtp_n <= n ? mtp_rows : 0;
  put_mtp_head(out, mtp_on, m, rows);
  if (!mtp_on) return ok_status();
  const size_t head_used = kv_used_bytes(layout, capacity, m);
  RETURN_IF_ERROR(save_region(out, base + layout.mtp_k_off, head_used, "MTP k cache"));
  RETURN_IF_ERROR(save_region(out, base + layout.mtp_v_off, head_used, "MTP v cache"));
  RETURN_IF_ERROR(save_region(out, mtp_pending.ptr, static_cast<size_t>(rows) * layout.hidden * sizeof(float),
                              "MTP pending rows"));
  put_ids(out, rows > 0 ? mtp_tokens : std::vector<int32_t>{});
  return ok_status();
}

Status CudaSequence::load(ByteReader& in) {
  int64_t at = 0;
  RETURN_IF_ERROR(in.pod(&at, "position"));
  if (at < 0 || at > capacity)
    return error(at < 0 ? ErrorCode::format : ErrorCode::out_of_range,
                 "a saved sequence of %lld tokens; the KV capacity is %lld (--ctx-size)", (long long)at,
                 (long long)capacity);
  RETURN_IF_ERROR(load_region(in, storage.ptr, layout.recurrent_bytes, "recurrent state"));
  const size_t used = kv_used_bytes(layout, capacity, at);
  auto* base = static_cast<unsigned char*>(storage.ptr);
  for (size_t l = 0; l < layout.attention.size(); ++l) {
    if (!layout.attention[l]) continue;
    RETURN_IF_ERROR(load_region(in, base + layout.off_a[l], used, "k cache"));
    RETURN_IF_ERROR(load_region(in, base + layout.off_b[l], used, "v cache"));
  }
  ASSIGN_OR_RETURN(MtpPart head, read_mtp_head(in, at, layout.mtp));
  const bool keep = head.has && layout.mtp;  // else the head's part, if any, is read past
  std::vector<int32_t> ids;
  if (head.has) {
    const size_t head_used = kv_used_bytes(layout, capacity, head.m);
    RETURN_IF_ERROR(load_region(in, keep ? base + layout.mtp_k_off : nullptr, head_used, "MTP k cache"));
    RETURN_IF_ERROR(load_region(in, keep ? base + layout.mtp_v_off : nullptr, head_used, "MTP v cache"));
    RETURN_IF_ERROR(load_region(in, keep ? mtp_pending.ptr : nullptr,
                                static_cast<size_t>(head.rows) * layout.hidden * sizeof(float), "MTP pending rows"));
    RETURN_IF_ERROR(read_mtp_tokens(in, head.rows, &ids));
  }
  const int host_pos = static_cast<int>(at);
  CUDA_RETURN(cudaMemcpy(pos.ptr, &host_pos, sizeof(int), cudaMemcpyHostToDevice), "load position");
  // A copy from pageable memory may return before its DMA lands: wait for all of them (the backend's stream
  // does not wait for the legacy stream).
  CUDA_RETURN(cudaStreamSynchronize(cudaStreamLegacy), "load");
  n = at;
  mtp_n = keep ? head.m : at;
  mtp_rows = keep ? head.rows : 0;
  mtp_tokens = keep ? std::move(ids) : std::vector<int32_t>{};
  mtp_chained = false;
  return ok_status();
}

Status CudaCheckpoint::load(ByteReader& in) {
  int64_t at = 0;
  RETURN_IF_ERROR(in.pod(&at, "checkpoint position"));
  if (at < 0) return format_error("checkpoint position %lld", (long long)at);
  RETURN_IF_ERROR(load_region(in, storage.ptr, recurrent_bytes, "checkpoint recurrent state"));
  const bool with_head = mtp_pending.ptr != nullptr;  // allocated for a backend with the head on
  ASSIGN_OR_RETURN(MtpPart head, read_mtp_head(in, at, with_head));
  const bool keep = head.has && with_head;
  std::vector<int32_t> ids;
  if (head.has) {
    const size_t bytes = static_cast<size_t>(head.rows) * hidden * sizeof(float);
    RETURN_IF_ERROR(load_region(in, keep ? mtp_pending.ptr : nullptr, bytes, "checkpoint MTP pending rows"));
    RETURN_IF_ERROR(read_mtp_tokens(in, head.rows, &ids));
  }
  CUDA_RETURN(cudaStreamSynchronize(cudaStreamLegacy), "checkpoint load");  // its copies landed (as in load above)
  n = at;
  mtp_on = keep;
  mtp_n = keep ? head.m : 0;
  mtp_rows = keep ? head.rows : 0;
  mtp_tokens = std::move(ids);
  return ok_status();
}

}  // namespace lily::cuda
