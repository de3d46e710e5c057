#include "tokenizer/pretokenize_added.h"

#include <algorithm>
#include <cstring>
#include <utf8proc.h>

#include "tokenizer/pretokenize_utf8.h"
#include "util/check.h"

namespace lily {
namespace {

// Rust's char::is_whitespace (Unicode White_Space), which `tokenizers` uses for lstrip / rstrip.
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Rust's char::is_alphanumeric, approximated by the general categories L* and N* (it also counts the
// marks with Other_Alphabetic, which only matters for single_word tokens; Qwen has none).
bool is_alphanumeric(char32_t c) {
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens) : tokens_(std::move(tokens)) {
  std::erase_if(tokens_, [](const AddedToken& t) { return t.content.empty(); });
  CHECK(tokens_.size() < 65536, "%zu added tokens", tokens_.size());
  std::stable_sort(tokens_.begin(), tokens_.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  for (size_t i = 0; i < tokens_.size(); ++i) {
    by_byte_[static_cast<unsigned char>(tokens_[i].content[0])].push_back(static_cast<uint16_t>(i));
  }
  int n_first_bytes = 0;
  for (int b = 0; b < 256; ++b) {
    if (!by_byte_[b].empty()) {
      ++n_first_bytes;
      single_first_byte_ = b;
    }
  }
  if (n_first_bytes != 1) single_first_byte_ = -1;
}

// The leftmost-longest match starting at or after `from` that passes the single_word rule.
bool AddedTokenMatcher::find(std::string_view text, size_t from, Match* match) const {
  for (size_t pos = from; pos < text.size(); ++pos) {
    if (single_first_byte_ >= 0) {  // the usual case (every Qwen added token starts with '<'): memchr
      const void* hit = std::memchr(text.data() + pos, single_first_byte_, text.size() - pos);
      if (hit == nullptr) return false;
      pos = static_cast<size_t>(static_cast<const char*>(hit) - text.data());
    }
    const auto& candidates = by_byte_[static_cast<unsigned char>(text[pos])];
    for (uint16_t index : candidates) {
      const AddedToken& token = tokens_[index];
      if (text.compare(pos, token.content.size(), token.content) != 0) continue;
      const size_t end = pos + token.content.size();
      if (token.single_word) {
        size_t unused = 0;
        bool word_before = pos > 0 && is_alphanumeric(prev_code_point(text, pos, &unused));
        size_t after = end;
        bool word_after = end < text.size() && is_alphanumeric(next_code_point(text, &after));
        if (word_before || word_after) continue;
      }
      *match = {pos, end, &token};
      return true;
    }
  }
  return false;
}

void AddedTokenMatcher::split(std::string_view text, std::vector<TextSegment>* segments) const {
  size_t plain_start = 0;  // start of the text not yet emitted
  size_t from = 0;         // where the next search starts
  Match match{};
  while (!tokens_.empty() && find(text, from, &match)) {
    size_t start = match.start, end = match.end;
    from = match.end;
    if (match.token->lstrip) {
      size_t s = start;
      while (s > plain_start) {
        size_t prev = 0;
        if (!is_white_space(prev_code_point(text, s, &prev))) break;
        s = prev;
      }
      start = s;
    }
    // `tokenizers` resumes its search at the token's end even when rstrip ate whitespace after it
    // (and may then emit overlapping pieces); lily resumes after the stripped whitespace.
    if (match.token->rstrip) {
      while (end < text.size()) {
        size_t next = end;
        if (!is_white_space(next_code_point(text, &next))) break;
        end = next;
      }
      from = end;
    }
    if (start > plain_start) segments->push_back({text.substr(plain_start, start - plain_start), -1});
    segments->push_back({text.substr(start, end - start), match.token->id});
    plain_start = end;
  }
  if (plain_start < text.size()) segments->push_back({text.substr(plain_start), -1});
}

}  // namespace lily
