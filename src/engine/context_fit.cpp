#include "engine/context_fit.h"

#include <algorithm>

namespace lily {

SequenceBytes sequence_bytes(const ModelConfig& c) {
  SequenceBytes b;
  const size_t conv = static_cast<size_t>(c.linear_conv_kernel_dim) * c.linear_conv_dim() * sizeof(float);
  const size_t state = static_cast<size_t>(c.linear_num_value_heads) * c.linear_key_head_dim *
                       c.linear_value_head_dim * sizeof(float);
  const size_t kv_row = 2 * static_cast<size_t>(c.num_key_value_heads) * c.head_dim * 2;  // K and V, bf16
  constexpr size_t kAlign = 256;  // each array of the sequence's block starts aligned (cuda/cuda_sequence.h)
  for (LayerType t : c.layer_types) {
    if (t == LayerType::full_attention) {
      b.per_token += kv_row;
      b.fixed += 2 * kAlign;
    } else {
      b.fixed += conv + state + 2 * kAlign;
    }
  }
  b.fixed += kAlign;  // the position
  return b;
}

int64_t max_context_that_fits(const ContextFit& f, int64_t model_max) {
  const size_t needed = f.scratch_bytes + f.reserve_bytes + f.sequence.fixed;
  if (f.free_bytes <= needed) return 0;
  const size_t left = f.free_bytes - needed;
  if (f.sequence.per_token == 0) return model_max;
  const int64_t n = static_cast<int64_t>(std::min<size_t>(left / f.sequence.per_token, INT64_MAX));
  return std::min(n, model_max);
}

Status check_context_fits(const ContextFit& f, int64_t context, int64_t model_max, const std::string& device) {
  const int64_t fits = max_context_that_fits(f, model_max);
  if (context <= fits) return ok_status();
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double need = static_cast<double>(f.sequence.fixed + f.sequence.per_token * static_cast<size_t>(context) +
                                          f.scratch_bytes + f.reserve_bytes);
  if (fits == 0)
    return error(ErrorCode::out_of_range,
                 "%s: after the weights %.2f GiB are free, too little for any context (a %lld-token one needs "
                 "%.2f GiB with scratch and reserve)",
                 device.c_str(), f.free_bytes / gib, (long long)context, need / gib);
  return error(ErrorCode::out_of_range,
               "%s: a %lld-token context needs %.2f GiB (KV %.2f GiB, state, scratch and reserve) but %.2f GiB are "
               "free after the weights; the largest context that fits is %lld tokens (--ctx-size %lld, or "
               "--ctx-size auto to take it)",
               device.c_str(), (long long)context, need / gib,
               static_cast<double>(f.sequence.per_token * static_cast<size_t>(context)) / gib, f.free_bytes / gib,
               (long long)fits, (long long)fits);
}

bool optional_fits(const ContextFit& f, size_t extra, int64_t context, int64_t model_max, int streams,
                   size_t headroom) {
  if (context < 1 || context > model_max || streams < 1) return false;
  ContextFit room = f;
  room.scratch_bytes += extra;
  room.reserve_bytes += headroom + static_cast<size_t>(streams - 1) *
                                       (f.sequence.fixed + f.sequence.per_token * static_cast<size_t>(context));
  return context <= max_context_that_fits(room, model_max);
}

}  // namespace lily
