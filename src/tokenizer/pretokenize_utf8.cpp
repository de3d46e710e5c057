#include "tokenizer/pretokenize_utf8.h"

#include <cstdint>

#include "util/check.h"

namespace lily {
namespace {

struct Utf8Step {
  size_t length;   // bytes of the sequence (valid) or of the maximal invalid subpart
  bool valid;
  bool truncated;  // invalid only because the input ended: more bytes could complete it
};

// Well-formed sequences per Unicode Table 3-7: the lead byte fixes the length and the range of the
// second byte (which excludes overlongs, surrogates and code points above U+10FFFF).
Utf8Step utf8_step(const unsigned char* p, size_t n) {
  const unsigned char b0 = p[0];
  if (b0 < 0x80) return {1, true, false};
  size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {1, false, false};
  }
  for (size_t i = 1; i <= need; ++i) {
    if (i >= n) return {i, false, true};
    if (p[i] < lo || p[i] > hi) return {i, false, false};
    lo = 0x80;
    hi = 0xBF;
  }
  return {need + 1, true, false};
}

}  // namespace

bool is_valid_utf8(std::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    Utf8Step step = utf8_step(p + i, n - i);
    if (!step.valid) return false;
    i += step.length;
  }
  return true;
}

void append_utf8_lossy(std::string& out, std::string_view bytes) {
  size_t consumed = append_utf8_complete(out, bytes);
  if (consumed < bytes.size()) out += kReplacementChar;  // a cut-short tail is one maximal subpart
}

size_t append_utf8_complete(std::string& out, std::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0, run_start = 0;  // [run_start, i) is valid and not yet copied
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    Utf8Step step = utf8_step(p + i, n - i);
    if (step.valid) {
      i += step.length;
      continue;
    }
    out.append(bytes.substr(run_start, i - run_start));
    if (step.truncated) return i;
    out += kReplacementChar;
    i += step.length;
    run_start = i;
  }
  out.append(bytes.substr(run_start, n - run_start));
  return n;
}

void append_code_point(std::string& out, char32_t cp) {
  CHECK(cp <= 0x10FFFF && (cp < 0xD800 || cp > 0xDFFF), "cp=0x%X", static_cast<unsigned>(cp));
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

char32_t next_code_point(std::string_view bytes, size_t* pos) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t i = *pos;
  const unsigned char b0 = p[i];
  size_t len = b0 < 0x80 ? 1 : b0 < 0xE0 ? 2 : b0 < 0xF0 ? 3 : 4;
  CHECK(i + len <= bytes.size(), "truncated UTF-8 at %zu", i);
  char32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1F) : len == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (p[i + k] & 0x3F);
  *pos = i + len;
  return cp;
}

char32_t prev_code_point(std::string_view bytes, size_t end, size_t* start) {
  CHECK(end > 0);
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(bytes[i]) & 0xC0) == 0x80) --i;
  *start = i;
  return next_code_point(bytes, &i);
}

}  // namespace lily
