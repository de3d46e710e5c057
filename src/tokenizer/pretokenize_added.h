// Added tokens (<|im_start|>, <think>, <tool_call>, ...) are cut out of the text before it is
// normalized and pre-tokenized, as `tokenizers`' AddedVocabulary does: scanning left to right, the
// leftmost match wins, the longest one at that position; lstrip / rstrip widen a match over the
// Unicode whitespace next to it, single_word rejects a match touching a letter or digit.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lily {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;  // matched against normalized text (its content is normalized too)
  bool single_word = false;
};

struct TextSegment {
  std::string_view text;
  int32_t added_id;  // -1: plain text to normalize and pre-tokenize
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  explicit AddedTokenMatcher(std::vector<AddedToken> tokens);

  bool empty() const { return tokens_.empty(); }
  // Appends the segments of `text` (valid UTF-8) to *segments; plain segments are never empty.
  void split(std::string_view text, std::vector<TextSegment>* segments) const;

 private:
  struct Match {
    size_t start, end;
    const AddedToken* token;
  };
  bool find(std::string_view text, size_t from, Match* match) const;

  std::vector<AddedToken> tokens_;                  // longest content first
  std::array<std::vector<uint16_t>, 256> by_byte_;  // first byte -> indices into tokens_, longest first
  int single_first_byte_ = -1;                      // the one first byte of all tokens, if they share it
};

}  // namespace lily
