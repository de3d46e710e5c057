// Server-sent events as OpenAI streams them: each event is one line `data: <compact JSON>` followed by a
// blank line, and the stream ends with `data: [DONE]`. Named events (`event: NAME` before the data line) for
// the Anthropic Messages and OpenAI Responses streams.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace lily {

// Compact JSON ("," and ":" without spaces, as OpenAI sends it); invalid UTF-8 becomes U+FFFD, never a throw.
std::string dump_json(const nlohmann::ordered_json& j);

inline std::string sse_event(std::string_view payload) {
  std::string out;
  out.reserve(payload.size() + 8);
  out.append("data: ").append(payload).append("\n\n");
  return out;
}
inline std::string sse_json(const nlohmann::ordered_json& j) {
  return sse_event(dump_json(j));
}
// `event: NAME` then the data line: the framing of Anthropic's and the Responses API's streams.
inline std::string sse_named(std::string_view name, const nlohmann::ordered_json& j) {
  std::string out = "event: ";
  out.append(name).append("\n");
  return out + sse_json(j);
}
inline std::string sse_done() {
  return "data: [DONE]\n\n";
}

}  // namespace lily
