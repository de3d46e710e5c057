// XXH64 as specified by xxHash (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md).
#include <bit>

#include "util/byte_io.h"

namespace lily {

namespace {

constexpr uint64_t P1 = 11400714785074694791ull, P2 = 14029467366897019727ull, P3 = 1609587929392839161ull,
                   P4 = 9650029242287828579ull, P5 = 2870177450012600261ull;

uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
uint32_t read32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t round(uint64_t acc, uint64_t input) {
  acc += input * P2;
  return std::rotl(acc, 31) * P1;
}
uint64_t merge(uint64_t acc, uint64_t v) {
  acc ^= round(0, v);
  return acc * P1 + P4;
}

}  // namespace

uint64_t xxhash64(const void* data, size_t n, uint64_t seed) {
  static_assert(std::endian::native == std::endian::little, "XXH64 reads little-endian words");
  const auto* p = static_cast<const uint8_t*>(data);
  const uint8_t* end = p + n;
  uint64_t h;
  if (n >= 32) {
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    for (; end - p >= 32; p += 32) {
      v1 = round(v1, read64(p));
      v2 = round(v2, read64(p + 8));
      v3 = round(v3, read64(p + 16));
      v4 = round(v4, read64(p + 24));
    }
    h = std::rotl(v1, 1) + std::rotl(v2, 7) + std::rotl(v3, 12) + std::rotl(v4, 18);
    h = merge(merge(merge(merge(h, v1), v2), v3), v4);
  } else {
    h = seed + P5;
  }
  h += n;
  for (; end - p >= 8; p += 8) h = std::rotl(h ^ round(0, read64(p)), 27) * P1 + P4;
  if (end - p >= 4) {
    h = std::rotl(h ^ (uint64_t{read32(p)} * P1), 23) * P2 + P3;
    p += 4;
  }
  for (; p < end; ++p) h = std::rotl(h ^ (uint64_t{*p} * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

}  // namespace lily
