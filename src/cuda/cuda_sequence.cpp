#include "cuda/cuda_sequence.h"

#include <type_traits>

namespace lily::cuda {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ok_status();
  return error(ErrorCode::internal, "CUDA %s: %s", what, cudaGetErrorString(e));
}

Status CudaSequence::allocate(const ModelConfig& c, int64_t cap) {
  capacity = cap;
  RETURN_IF_ERROR(pos.alloc(1));
  for (LayerType t : c.layer_types) {
    k.emplace_back();
    v.emplace_back();
    conv.emplace_back();
    S.emplace_back();
    if (t == LayerType::full_attention) {
      k.back().reset(new DeviceArray<__nv_bfloat16>());
      v.back().reset(new DeviceArray<__nv_bfloat16>());
      size_t row = static_cast<size_t>(c.num_key_value_heads) * c.head_dim;
      RETURN_IF_ERROR(k.back()->alloc(cap * row));
      RETURN_IF_ERROR(v.back()->alloc(cap * row));
    } else {
      conv.back().reset(new DeviceArray<float>());
      S.back().reset(new DeviceArray<float>());
      RETURN_IF_ERROR(conv.back()->alloc(static_cast<size_t>(c.linear_conv_kernel_dim) * c.linear_conv_dim()));
      RETURN_IF_ERROR(S.back()->alloc(static_cast<size_t>(c.linear_num_value_heads) * c.linear_key_head_dim *
                                       c.linear_value_head_dim));
    }
  }
  return ok_status();
}

std::unique_ptr<SequenceState> CudaSequence::clone() const {
  auto s = std::make_unique<CudaSequence>();
  s->owner = owner;
  s->n = n;
  s->capacity = capacity;
  if (!s->pos.alloc(1).ok()) return nullptr;
  cudaMemcpy(s->pos.ptr, pos.ptr, sizeof(int), cudaMemcpyDeviceToDevice);
  auto copy = [](const auto& src, auto& dst, size_t count) {
    using T = std::remove_pointer_t<decltype(src->ptr)>;
    dst.reset(new DeviceArray<T>());
    if (!dst->alloc(src->n).ok()) return false;
    return cudaMemcpy(dst->ptr, src->ptr, count * sizeof(T), cudaMemcpyDeviceToDevice) == cudaSuccess;
  };
  for (size_t l = 0; l < k.size(); ++l) {
    s->k.emplace_back(), s->v.emplace_back(), s->conv.emplace_back(), s->S.emplace_back();
    if (k[l]) {
      size_t used = k[l]->n / capacity * n;
      if (!copy(k[l], s->k[l], used) || !copy(v[l], s->v[l], used)) return nullptr;
    } else {
      if (!copy(conv[l], s->conv[l], conv[l]->n) || !copy(S[l], s->S[l], S[l]->n)) return nullptr;
    }
  }
  return s;
}

}  // namespace lily::cuda
