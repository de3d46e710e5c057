// DType and TensorView: a non-owning view {data, shape, dtype} so that ops can state and check shapes
// in one line. Shapes are written in PyTorch order (outermost first), as in docs/MODEL.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "util/check.h"

namespace lily {

enum class DType : uint8_t { f32, f16, bf16, u32, i32, i8, u8, i64 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: case DType::u32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::i8: case DType::u8: return 1;
    case DType::i64: return 8;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::u32: return "U32";
    case DType::i32: return "I32";
    case DType::i8: return "I8";
    case DType::u8: return "U8";
    case DType::i64: return "I64";
  }
  return "?";
}

constexpr int kMaxDims = 6;

struct Shape {
  int n = 0;
  int64_t d[kMaxDims] = {};
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) {
    CHECK(dims.size() <= kMaxDims, "rank %zu", dims.size());
    for (int64_t x : dims) d[n++] = x;
  }
  int64_t operator[](int i) const { return d[i]; }
  int64_t numel() const {
    int64_t p = 1;
    for (int i = 0; i < n; ++i) p *= d[i];
    return p;
  }
  bool operator==(const Shape& o) const {
    if (n != o.n) return false;
    for (int i = 0; i < n; ++i)
      if (d[i] != o.d[i]) return false;
    return true;
  }
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(d[i]);
    return s + "]";
  }
};

struct TensorView {
  void* data = nullptr;
  Shape shape;
  DType dtype = DType::f32;

  int64_t numel() const { return shape.numel(); }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
  float* f32() const {
    CHECK(dtype == DType::f32, "expected F32, got %s", dtype_name(dtype));
    return static_cast<float*>(data);
  }
};

// Assert a view's shape on entry to an op: `expect_shape(x, {T, 2048}, "moe.x")`.
inline void expect_shape(const TensorView& t, const Shape& want, const char* what) {
  CHECK(t.shape == want, "%s: expected shape %s, got %s", what, want.str().c_str(), t.shape.str().c_str());
}

}  // namespace lily
