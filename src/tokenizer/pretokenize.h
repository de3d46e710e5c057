// Text -> pieces, before BPE: the normalizer (NFC) and the Split pre-tokenizer regex of a
// tokenizer.json, matched with PCRE2 exactly as `tokenizers` matches it with Oniguruma.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

struct pcre2_real_code_8;  // PCRE2's compiled pattern (pcre2_code_8); pcre2.h stays out of headers

namespace lily {

// tokenizer.json "normalizer": null, {"type": "NFC"} or a Sequence of those.
class Normalizer {
 public:
  static Result<Normalizer> from_json(const nlohmann::json& normalizer);
  // Normalizes valid UTF-8. Returns `text` itself when already normalized, else a view of *storage.
  std::string_view apply(std::string_view text, std::string* storage) const;
  bool nfc() const { return nfc_; }

 private:
  bool nfc_ = false;
};

// NFC of valid UTF-8 (utf8proc). Embedded NULs are kept.
std::string nfc_normalize(std::string_view text);
// True when NFC leaves `cp` unchanged in any context (see pretokenize.cpp); a fast path for apply().
bool nfc_inert(char32_t cp);
bool is_nfc_inert(std::string_view text);

// The regex of the Split pre-tokenizer, "Isolated" behaviour: every non-overlapping match, left to
// right, is a piece, and so is the text between two matches. Thread-safe (per-thread match data).
class SplitRegex {
 public:
  // tokenizer.json "pre_tokenizer": Sequence[Split{Regex, Isolated, invert: false}, ByteLevel{
  // add_prefix_space: false, use_regex: false}], or a lone ByteLevel with use_regex true (the GPT-2
  // regex). Anything else is an unsupported-component error.
  static Result<SplitRegex> from_json(const nlohmann::json& pre_tokenizer);
  static Result<SplitRegex> compile(std::string_view hf_pattern);

  // Appends the pieces of valid UTF-8 `text` to *pieces (views into `text`).
  void split(std::string_view text, std::vector<std::string_view>* pieces) const;
  const std::string& pcre2_pattern() const { return pattern_; }

 private:
  std::shared_ptr<pcre2_real_code_8> code_;
  std::string pattern_;
  bool jit_ = false;
};

// Rewrites an Oniguruma pattern from tokenizer.json into a PCRE2 pattern (UTF + UCP) that matches
// the same strings:
//   - \s / \S: Oniguruma's \s is exactly Unicode White_Space; PCRE2's UCP \s also takes U+180E
//     MONGOLIAN VOWEL SEPARATOR, so the White_Space set is spelled out (\S inside [...] is unsupported);
//   - (?i:...): PCRE2 folds ASCII letters with non-ASCII ones ('s' with U+017F LONG S), Oniguruma
//     as `tokenizers` runs it does not (`'ſ` is no contraction there), so ASCII letters in a caseless
//     group become [xX]; a character class in one keeps PCRE2's folding.
Result<std::string> pcre2_pattern_from_hf(std::string_view hf_pattern);

}  // namespace lily
