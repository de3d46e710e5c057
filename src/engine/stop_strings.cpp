// StopMatcher: see stop_strings.h for the semantics.
#include "engine/stop_strings.h"

#include <algorithm>
#include <utility>

namespace lily {
namespace {

bool is_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// Length of a UTF-8 sequence from its lead byte; 1 for ASCII and for invalid lead bytes (passed through).
size_t sequence_length(char lead) {
  const auto b = static_cast<unsigned char>(lead);
  if (b >= 0xF0 && b <= 0xF7) return 4;
  if (b >= 0xE0) return b <= 0xEF ? 3 : 1;
  if (b >= 0xC0) return 2;
  return 1;
}

// Start of an incomplete code point at the end of s, or s.size() when s ends on a boundary.
size_t incomplete_tail_start(const std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= std::min<size_t>(n, 4); ++back) {
    const size_t pos = n - back;
    if (is_continuation(s[pos])) continue;
    return pos + sequence_length(s[pos]) > n ? pos : n;
  }
  return n;  // only continuation bytes: invalid UTF-8, pass it through rather than hold it forever
}

// Moves a cut position back so that it never falls on a continuation byte.
size_t floor_to_boundary(const std::string& s, size_t cut) {
  while (cut > 0 && cut < s.size() && is_continuation(s[cut])) --cut;
  return cut;
}

}  // namespace

StopMatcher::StopMatcher(std::vector<std::string> stops, bool include_stop)
    : stops_(std::move(stops)), include_stop_(include_stop) {}

// Longest suffix of pending_ that is a proper prefix of some stop string: it could still become a match.
size_t StopMatcher::longest_held_prefix() const {
  const std::string_view text = pending_;
  size_t best = 0;
  for (const auto& stop : stops_) {
    if (stop.empty()) continue;
    for (size_t len = std::min(stop.size() - 1, text.size()); len > best; --len) {
      if (text.substr(text.size() - len) == std::string_view(stop).substr(0, len)) {
        best = len;
        break;
      }
    }
  }
  return best;
}

std::string StopMatcher::push(std::string_view piece) {
  if (stopped()) return {};
  pending_.append(piece);

  // Held text contains no complete stop (else we would have stopped), so every match ends in the new piece;
  // the earliest-ending one wins, ties to the earliest start.
  size_t best_start = std::string::npos, best_end = std::string::npos;
  for (size_t i = 0; i < stops_.size(); ++i) {
    if (stops_[i].empty()) continue;
    const size_t start = pending_.find(stops_[i]);
    if (start == std::string::npos) continue;
    const size_t end = start + stops_[i].size();
    if (end < best_end || (end == best_end && start < best_start)) {
      best_start = start;
      best_end = end;
      matched_ = i;
    }
  }
  if (matched_) {
    std::string out = pending_.substr(0, include_stop_ ? best_end : floor_to_boundary(pending_, best_start));
    pending_.clear();
    return out;
  }
  size_t cut = std::min(pending_.size() - longest_held_prefix(), incomplete_tail_start(pending_));
  cut = floor_to_boundary(pending_, cut);
  std::string out = pending_.substr(0, cut);
  pending_.erase(0, cut);
  return out;
}

std::string StopMatcher::flush() {
  if (stopped()) return {};
  return std::exchange(pending_, std::string());
}

}  // namespace lily
