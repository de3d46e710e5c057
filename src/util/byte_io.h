// Bounds-checked little helpers for binary files (the session cache's disk tier, src/engine/session_file.h):
// ByteWriter appends plain values and byte runs to a buffer; ByteReader reads them back from a span and fails
// with a Status naming what was being read instead of reading past the end. Values are written in the host's
// byte order: the files are caches of one machine's state (a file of the other order fails its version
// check).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "util/status.h"

namespace lily {

class ByteWriter {
 public:
  explicit ByteWriter(std::vector<uint8_t>& out) : out_(out) {}
  void bytes(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    out_.insert(out_.end(), p, p + n);
  }
  template <typename T>
  void pod(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    bytes(&v, sizeof v);
  }
  // Room for n bytes at the end, for a caller that fills them itself (a device-to-host copy).
  uint8_t* grow(size_t n) {
    out_.resize(out_.size() + n);
    return out_.data() + out_.size() - n;
  }
  size_t size() const { return out_.size(); }

 private:
  std::vector<uint8_t>& out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> data) : data_(data) {}
  Status bytes(void* dst, size_t n, const char* what) {
    if (n > left()) return format_error("%s: %zu bytes needed, %zu left", what, n, left());
    std::memcpy(dst, data_.data() + at_, n);
    at_ += n;
    return ok_status();
  }
  template <typename T>
  Status pod(T* v, const char* what) {
    static_assert(std::is_trivially_copyable_v<T>);
    return bytes(v, sizeof *v, what);
  }
  // The next n bytes in place (no copy), or an error when fewer are left.
  Result<std::span<const uint8_t>> view(size_t n, const char* what) {
    if (n > left()) return format_error("%s: %zu bytes needed, %zu left", what, n, left());
    auto s = data_.subspan(at_, n);
    at_ += n;
    return s;
  }
  size_t left() const { return data_.size() - at_; }
  size_t offset() const { return at_; }

 private:
  std::span<const uint8_t> data_;
  size_t at_ = 0;
};

// XXH64 (xxHash's 64-bit hash): the checksum of the session files, fast enough (several GB/s) that checking a
// multi-GB KV cache costs less than reading it. Streaming: update() with the pieces in order, then digest().
class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t n);
  uint64_t digest() const;

 private:
  void stripe(const uint8_t* p);
  uint64_t v_[4];
  uint64_t seed_, total_ = 0;
  uint8_t buf_[32];
  size_t held_ = 0;
};

uint64_t xxhash64(const void* data, size_t n, uint64_t seed = 0);

}  // namespace lily
