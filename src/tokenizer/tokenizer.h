// The Hugging Face tokenizer.json byte-level BPE tokenizer of Qwen3 / Qwen3.5 / Qwen3.6
// (docs/MODEL.md section 3), id-exact with the `tokenizers` library.
//
// encode(text), as `tokenizers` does it (Tokenizer.encode(text, add_special_tokens=False)):
//   1. invalid UTF-8 is repaired first: each maximal invalid subpart becomes U+FFFD, exactly as
//      Python's bytes.decode("utf-8", "replace") (and Rust's from_utf8_lossy) do;
//   2. added tokens (special or not: <|im_start|>, <think>, <tool_call>, ...) are split out of the
//      raw text, leftmost match first, longest at a position; lstrip/rstrip/single_word are honoured;
//      tokens flagged "normalized" are matched after step 3 instead;
//   3. each remaining segment is normalized (NFC, via utf8proc);
//   4. pre-tokenized by the Split regex read from the file (PCRE2, JIT; matches and the text between
//      them are pieces, the "Isolated" behaviour);
//   5. each piece's bytes are BPE-merged by merge rank (ByteLevel: the GPT-2 byte <-> char map).
//   No BOS/EOS is ever added.
// decode(ids): regular tokens through the inverse byte map, added tokens as their content; the byte
//   string is then made valid UTF-8 with the same U+FFFD rule. decode(encode(x)) == NFC(x) for valid x.
//
// All const methods are thread-safe (one Tokenizer is shared by server threads). Tokenizer is a cheap
// handle (shared_ptr to immutable state), so copies and moves are O(1).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace lily {

class Tokenizer {
 public:
  // Reads a tokenizer.json. Unsupported component types (normalizer, pre_tokenizer, model, decoder,
  // post_processor) are a format error naming the component.
  static Result<Tokenizer> load(const std::string& tokenizer_json_path);
  static Result<Tokenizer> from_json_string(std::string_view tokenizer_json);

  std::vector<int32_t> encode(std::string_view text) const;  // added tokens split out, no BOS ever
  std::string decode(const std::vector<int32_t>& ids) const;  // ids out of range decode to nothing

  int32_t token_id(std::string_view token_text) const;  // -1 if absent (vocab or added token)
  std::string token_text(int32_t id) const;             // raw vocab string or added-token content; "" if absent
  int32_t vocab_size() const;                           // max id + 1
  bool is_special(int32_t id) const;                    // added token marked special

  // Bytes that token `id` decodes to (the inverse byte map applied; added tokens: their content).
  // Not necessarily valid UTF-8 on its own. Empty for an unknown id.
  std::string_view token_bytes(int32_t id) const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Incremental decoding for streaming: push() returns only complete code points; bytes of a code
// point that is still incomplete wait for the next push. Bytes that can no longer become valid are
// emitted as U+FFFD (same rule as decode()), so the concatenation of every push() and the final
// flush() equals decode(all ids). Holds a reference: the Tokenizer must outlive it.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  std::string push(int32_t id);
  std::string flush();  // the rest; an incomplete trailing sequence becomes U+FFFD

 private:
  const Tokenizer& tokenizer_;
  std::string pending_;  // bytes of an incomplete (so far valid) UTF-8 sequence, at most 3
};

}  // namespace lily
