// StopMatcher: applies OpenAI `stop` strings to streamed text. Pieces of decoded text go in as they are
// produced; what comes back is the text that is safe to emit now.
//
// Semantics (independent of how the text is split into pieces):
// - The output is the generated text up to, not including, the first stop string to COMPLETE when the text is
//   read left to right; if several complete at the same byte, the one starting earliest (the longest) cuts.
//   This is what a byte-by-byte scan would do, so splitting the same text differently never changes the
//   output.
// - With include_stop, the output ends with the stop string that matched instead (vLLM's
//   include_stop_str_in_output); what is held back while a match may still come is the same.
// - A stop string is never emitted (unless include_stop), even when it arrives split over several pieces: a
// tail of the text
//   that is a proper prefix of some stop string is held back until it can no longer start a match, then
//   released.
// - Once a stop string has matched, stopped() is true and everything after it (in that piece and later) is
//   dropped.
// - Returned text never ends inside a UTF-8 code point: an incomplete trailing sequence is held back too (so
//   byte-level pieces are safe), and a cut never lands on a continuation byte.
// - flush() at the end of generation (EOS, max_tokens) releases whatever is still held, unless stopped.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lily {

class StopMatcher {
 public:
  // Empty strings in `stops` are ignored (SamplingParams::validate() rejects them).
  explicit StopMatcher(std::vector<std::string> stops, bool include_stop = false);

  std::string push(std::string_view piece);
  std::string flush();
  bool stopped() const { return matched_.has_value(); }
  // Index into the stops given to the constructor of the string that matched (for finish/stop reasons).
  std::optional<size_t> matched_stop() const { return matched_; }
  // Bytes currently held back (tests, and for the caller to know nothing is lost).
  const std::string& held() const { return pending_; }

 private:
  size_t longest_held_prefix() const;

  std::vector<std::string> stops_;
  bool include_stop_;
  std::string pending_;
  std::optional<size_t> matched_;
};

}  // namespace lily
