// UTF-8 helpers shared by the encoder (repairing input before NFC) and the decoders.
//
// One rule everywhere: a maximal invalid subpart (the longest prefix of a well-formed sequence that
// is cut short, or else a single bad byte) becomes one U+FFFD. This is the Unicode "best practice"
// that Python's bytes.decode("utf-8", "replace") and Rust's String::from_utf8_lossy follow, so lily's
// output matches what `tokenizers` sees for the same bytes.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace lily {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

bool is_valid_utf8(std::string_view bytes);

// Appends `bytes` to `out` with every maximal invalid subpart replaced by U+FFFD.
void append_utf8_lossy(std::string& out, std::string_view bytes);

// Streaming form of append_utf8_lossy: appends what is already decided and returns how many bytes of
// `bytes` it consumed. The unconsumed rest (at most 3 bytes) is an incomplete sequence that more
// bytes could still complete.
size_t append_utf8_complete(std::string& out, std::string_view bytes);

// Appends the UTF-8 encoding of a code point (<= U+10FFFF, not a surrogate).
void append_code_point(std::string& out, char32_t cp);

// Decodes the code point at bytes[*pos] of valid UTF-8 and advances *pos.
char32_t next_code_point(std::string_view bytes, size_t* pos);
// Decodes the code point that ends at bytes[end - 1] of valid UTF-8; *start receives its offset.
char32_t prev_code_point(std::string_view bytes, size_t end, size_t* start);

}  // namespace lily
