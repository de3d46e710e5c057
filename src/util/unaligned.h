// Loads from possibly unaligned addresses. MLX's safetensors writer does not pad the header, so tensors of real
// mlx-community files start at any byte; reading them through typed pointers would be undefined behaviour.
// memcpy compiles to a plain (unaligned-capable) load on x86-64 and arm64.
#pragma once
#include <cstddef>
#include <cstring>

namespace lily {

template <typename T>
inline T load_unaligned(const void* base, size_t index) {
  T v;
  std::memcpy(&v, static_cast<const unsigned char*>(base) + index * sizeof(T), sizeof(T));
  return v;
}

}  // namespace lily
