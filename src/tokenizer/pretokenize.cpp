#include "tokenizer/pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>

#include "tokenizer/pretokenize_utf8.h"
#include "util/check.h"

namespace lily {
namespace {

using json = nlohmann::json;

// GPT-2's pre-tokenizer regex: what ByteLevel{use_regex: true} applies.
constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string json_type(const json& j) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) return "";
  return j["type"].get<std::string>();
}

bool json_bool(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return it == j.end() || !it->is_boolean() ? fallback : it->get<bool>();
}

Status check_byte_level(const json& j, bool want_regex) {
  if (json_bool(j, "add_prefix_space", false)) {
    return error(ErrorCode::unsupported, "pre_tokenizer: ByteLevel add_prefix_space=true is unsupported");
  }
  if (json_bool(j, "use_regex", true) != want_regex) {
    return error(ErrorCode::unsupported, "pre_tokenizer: ByteLevel use_regex=%s is unsupported here (expected %s)",
                 want_regex ? "false" : "true", want_regex ? "true" : "false");
  }
  return ok_status();
}

Result<std::string> split_pattern(const json& split) {
  const json& pattern = split.value("pattern", json());
  if (!pattern.is_object() || !pattern.contains("Regex") || !pattern["Regex"].is_string()) {
    return error(ErrorCode::unsupported, "pre_tokenizer: Split needs pattern {\"Regex\": \"...\"} (String patterns "
                 "are unsupported)");
  }
  std::string behavior = split.value("behavior", std::string());
  if (behavior != "Isolated") {
    return error(ErrorCode::unsupported, "pre_tokenizer: Split behavior \"%s\" is unsupported (expected Isolated)",
                 behavior.c_str());
  }
  if (json_bool(split, "invert", false)) {
    return error(ErrorCode::unsupported, "pre_tokenizer: Split invert=true is unsupported");
  }
  return pattern["Regex"].get<std::string>();
}

// Unicode White_Space: Oniguruma's \s. PCRE2's UCP \s differs (it has U+180E MONGOLIAN VOWEL SEPARATOR,
// which Oniguruma treats as a non-space), so the pattern spells the set out.
constexpr std::string_view kWhiteSpace =
    R"(\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};

// One ovector pair is all split() reads; match data is per thread so that const split() is thread-safe.
pcre2_match_data* thread_match_data() {
  thread_local std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(pcre2_match_data_create(1, nullptr));
  CHECK(data != nullptr, "pcre2_match_data_create failed");
  return data.get();
}

// Copies `\p{...}`-style escapes verbatim; translates \s and \S. Returns the pattern index after it.
Result<size_t> translate_escape(std::string_view p, size_t i, bool in_class, std::string* out) {
  if (i + 1 >= p.size()) return invalid_argument("pre_tokenizer regex ends with a lone backslash");
  const char c = p[i + 1];
  if (c == 's') {
    *out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
    return i + 2;
  }
  if (c == 'S') {
    if (in_class) return error(ErrorCode::unsupported, "pre_tokenizer regex: \\S inside [...] is unsupported");
    *out += "[^" + std::string(kWhiteSpace) + "]";
    return i + 2;
  }
  size_t end = i + 2;
  if ((c == 'p' || c == 'P' || c == 'x' || c == 'o') && end < p.size() && p[end] == '{') {
    size_t close = p.find('}', end);
    if (close == std::string_view::npos) return invalid_argument("pre_tokenizer regex: unterminated \\%c{", c);
    end = close + 1;
  }
  out->append(p.substr(i, end - i));
  return end;
}

bool is_ascii_letter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

}  // namespace

Result<std::string> pcre2_pattern_from_hf(std::string_view p) {
  std::string out;
  std::vector<bool> caseless_stack;  // one entry per open group: is it a (?i:...) group?
  bool in_class = false;
  size_t class_start = 0;  // index just after "[" or "[^": a ']' there is a literal
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    const bool caseless = !caseless_stack.empty() && caseless_stack.back();
    if (c == '\\') {
      ASSIGN_OR_RETURN(i, translate_escape(p, i, in_class, &out));
    } else if (in_class) {
      out += c;
      if (c == ']' && i != class_start) {
        in_class = false;
        if (caseless) out += ')';
      }
      ++i;
    } else if (c == '[') {
      out += caseless ? "(?i:[" : "[";
      in_class = true;
      class_start = i + 1 < p.size() && p[i + 1] == '^' ? i + 2 : i + 1;
      if (class_start == i + 2) out += '^';
      i = class_start;
    } else if (c == '(') {
      if (p.substr(i, 4) == "(?i:") {
        caseless_stack.push_back(true);
        out += "(?:";
        i += 4;
        continue;
      }
      if (p.substr(i, 3) == "(?i" || p.substr(i, 4) == "(?-i") {
        return error(ErrorCode::unsupported, "pre_tokenizer regex: inline case flags other than (?i:...) are "
                     "unsupported");
      }
      caseless_stack.push_back(caseless);  // a group inside (?i:...) stays caseless
      out += c;
      ++i;
    } else if (c == ')') {
      if (caseless_stack.empty()) return invalid_argument("pre_tokenizer regex: unbalanced ')'");
      caseless_stack.pop_back();
      out += c;
      ++i;
    } else if (caseless && is_ascii_letter(c)) {
      const char lower = static_cast<char>(c | 0x20);
      out += '[';
      out += lower;
      out += static_cast<char>(lower & ~0x20);
      out += ']';
      ++i;
    } else {
      out += c;
      ++i;
    }
  }
  if (in_class) return invalid_argument("pre_tokenizer regex: unterminated character class");
  return out;
}

// ------------------------------------------------------------------------------------------------
// Normalizer
// ------------------------------------------------------------------------------------------------

Result<Normalizer> Normalizer::from_json(const json& j) {
  Normalizer n;
  if (j.is_null()) return n;
  const std::string type = json_type(j);
  if (type == "NFC") {
    n.nfc_ = true;
    return n;
  }
  if (type == "Sequence" && j.contains("normalizers") && j["normalizers"].is_array()) {
    for (const json& item : j["normalizers"]) {
      ASSIGN_OR_RETURN(Normalizer inner, from_json(item));
      n.nfc_ = n.nfc_ || inner.nfc_;
    }
    return n;
  }
  return error(ErrorCode::unsupported, "normalizer: type \"%s\" is unsupported (supported: null, NFC, Sequence of "
               "NFC)", type.c_str());
}

std::string nfc_normalize(std::string_view text) {
  utf8proc_uint8_t* mapped = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                    static_cast<utf8proc_ssize_t>(text.size()), &mapped,
                                    static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  CHECK(n >= 0, "utf8proc_map failed on valid UTF-8: %s", utf8proc_errmsg(n));
  std::string out(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
  std::free(mapped);
  return out;
}

// A code point that NFC leaves alone wherever it stands: a starter (combining class 0) without a
// canonical decomposition that never composes with a preceding character. Text made only of these
// is already NFC (nothing to reorder, decompose or compose). Below U+0300 every code point qualifies;
// CJK, Hangul syllables, most letters and emoji do; combining marks, Hangul jamo and precomposed
// letters such as U+1EA1 do not.
bool nfc_inert(char32_t cp) {
  if (cp < 0x300) return true;
  if (cp >= 0x1100 && cp <= 0x11FF) return false;  // conjoining jamo: composed algorithmically
  const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
  const bool canonical_decomposition = p->decomp_type == 0 && p->decomp_seqindex != UINT16_MAX;
  const bool composes_with_previous = p->comb_index != UINT16_MAX && (p->comb_index & 0x8000) != 0;
  return p->combining_class == 0 && !canonical_decomposition && !composes_with_previous;
}

bool is_nfc_inert(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    if (static_cast<unsigned char>(text[i]) < 0xCC) {  // ASCII, a continuation byte or a lead below U+0300
      ++i;
      continue;
    }
    if (!nfc_inert(next_code_point(text, &i))) return false;
  }
  return true;
}

// NFC(x + y) == NFC(x) + NFC(y) when y starts with an inert code point (it is a starter that blocks
// reordering and composition across it), so only the spans around non-inert code points go through
// utf8proc: from the inert code point before one up to the next inert code point.
std::string_view Normalizer::apply(std::string_view text, std::string* storage) const {
  if (!nfc_ || is_nfc_inert(text)) return text;
  storage->clear();
  size_t copied = 0;        // text[0, copied) is in *storage
  size_t last_inert = 0;    // start of the latest inert code point seen
  for (size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    if (b < 0xCC) {
      if (b < 0x80 || b >= 0xC0) last_inert = i;  // a code point below U+0300 starts here
      ++i;
      continue;
    }
    const size_t start = i;
    if (nfc_inert(next_code_point(text, &i))) {
      last_inert = start;
      continue;
    }
    const size_t span_start = std::max(last_inert, copied);
    size_t span_end = i;  // extend over code points up to the next inert one
    while (span_end < text.size()) {
      size_t next = span_end;
      if (nfc_inert(next_code_point(text, &next))) break;
      span_end = next;
    }
    storage->append(text.substr(copied, span_start - copied));
    *storage += nfc_normalize(text.substr(span_start, span_end - span_start));
    copied = i = span_end;
  }
  storage->append(text.substr(copied));
  return *storage;
}

// ------------------------------------------------------------------------------------------------
// SplitRegex
// ------------------------------------------------------------------------------------------------

Result<SplitRegex> SplitRegex::from_json(const json& j) {
  const std::string type = json_type(j);
  if (type == "ByteLevel") {
    RETURN_IF_ERROR(check_byte_level(j, /*want_regex=*/true));
    return compile(kGpt2Regex);
  }
  if (type != "Sequence" || !j.contains("pretokenizers") || !j["pretokenizers"].is_array() ||
      j["pretokenizers"].size() != 2) {
    return error(ErrorCode::unsupported, "pre_tokenizer: type \"%s\" is unsupported (expected Sequence[Split, "
                 "ByteLevel] or ByteLevel)", j.is_null() ? "null" : type.c_str());
  }
  const json& split = j["pretokenizers"][0];
  const json& byte_level = j["pretokenizers"][1];
  if (json_type(split) != "Split" || json_type(byte_level) != "ByteLevel") {
    return error(ErrorCode::unsupported, "pre_tokenizer: Sequence of [%s, %s] is unsupported (expected [Split, "
                 "ByteLevel])", json_type(split).c_str(), json_type(byte_level).c_str());
  }
  RETURN_IF_ERROR(check_byte_level(byte_level, /*want_regex=*/false));
  ASSIGN_OR_RETURN(std::string pattern, split_pattern(split));
  return compile(pattern);
}

Result<SplitRegex> SplitRegex::compile(std::string_view hf_pattern) {
  SplitRegex r;
  ASSIGN_OR_RETURN(r.pattern_, pcre2_pattern_from_hf(hf_pattern));
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(r.pattern_.data()), r.pattern_.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return invalid_argument("pre_tokenizer regex does not compile at offset %zu: %s (PCRE2 pattern: %s)",
                            static_cast<size_t>(error_offset), reinterpret_cast<const char*>(message),
                            r.pattern_.c_str());
  }
  r.code_.reset(code, pcre2_code_free);
  r.jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;  // no JIT on this CPU: the interpreter
  return r;
}

void SplitRegex::split(std::string_view text, std::vector<std::string_view>* pieces) const {
  pcre2_match_data* match = thread_match_data();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t prev_end = 0, start = 0;
  while (start < text.size()) {
    int rc = jit_ ? pcre2_jit_match(code_.get(), subject, text.size(), start, 0, match, nullptr) : -1;
    if (!jit_ || rc == PCRE2_ERROR_JIT_STACKLIMIT) {  // text is valid UTF-8: skip PCRE2's check
      rc = pcre2_match(code_.get(), subject, text.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, match, nullptr);
    }
    // No match, or a PCRE2 resource limit (not seen with the Qwen regexes, whose matching is linear):
    // either way the rest of the text becomes one piece.
    if (rc < 0) break;
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
    const size_t match_start = ovector[0], match_end = ovector[1];
    if (match_start > prev_end) pieces->push_back(text.substr(prev_end, match_start - prev_end));
    if (match_end > match_start) {
      pieces->push_back(text.substr(match_start, match_end - match_start));
      start = match_end;
    } else {  // an empty match yields no piece; step over one code point
      start = match_end;
      next_code_point(text, &start);
    }
    prev_end = match_end;
  }
  if (prev_end < text.size()) pieces->push_back(text.substr(prev_end));
}

}  // namespace lily
