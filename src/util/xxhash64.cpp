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

static_assert(std::endian::native == std::endian::little, "XXH64 reads little-endian words");

Xxh64::Xxh64(uint64_t seed) : v_{seed + P1 + P2, seed + P2, seed, seed - P1}, seed_(seed) {}

void Xxh64::stripe(const uint8_t* p) {
  for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], read64(p + 8 * i));
}

void Xxh64::update(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  total_ += n;
  if (held_ > 0) {
    const size_t take = std::min(n, sizeof buf_ - held_);
    std::memcpy(buf_ + held_, p, take);
    held_ += take, p += take, n -= take;
    if (held_ < sizeof buf_) return;
    stripe(buf_);
    held_ = 0;
  }
  for (; n >= 32; p += 32, n -= 32) stripe(p);
  std::memcpy(buf_, p, n);
  held_ = n;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = std::rotl(v_[0], 1) + std::rotl(v_[1], 7) + std::rotl(v_[2], 12) + std::rotl(v_[3], 18);
    for (uint64_t v : v_) h = merge(h, v);
  } else {
    h = seed_ + P5;
  }
  h += total_;
  const uint8_t *p = buf_, *end = buf_ + held_;
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

uint64_t xxhash64(const void* data, size_t n, uint64_t seed) {
  Xxh64 h(seed);
  h.update(data, n);
  return h.digest();
}

}  // namespace lily
