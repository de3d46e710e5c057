// SHA-256 (FIPS 180-4), streaming: `lily pull` verifies every LFS file against the hub's sha256 before it
// enters the cache. Plain C++, no crypto library, so the static GPU build has it too.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace lily {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n_bytes);
  std::string hex_digest();  // lowercase hex; finishes the hash (call once)

 private:
  void compress(const uint8_t* block);
  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> block_{};
  size_t block_used_ = 0;
  uint64_t total_bytes_ = 0;
};

// sha256 of a whole file, hex; empty string when the file cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace lily
