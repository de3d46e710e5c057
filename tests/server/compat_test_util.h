// Shared by the Anthropic and Responses API tests: a chat request with one tool, pieces through a builder,
// and the named SSE events of a stream.
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "server/chat_response.h"

namespace lily::test {

inline const ServedModel kCompatModel{"tiny", 151936, 4096};

inline json weather_tool_schema() {
  return {{"type", "object"},
          {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}},
          {"required", {"city"}}};
}

// The generated text of a reply that reasons, answers and calls the tool.
inline std::vector<std::string> reasoning_answer_call_pieces() {
  return {"Let me",
          " think.",
          "\n</think>\n\n",
          "Checking",
          " now.",
          "\n\n<tool_call>\n<function=get_weather>\n",
          "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n",
          "</function>\n</tool_call>"};
}

// A body translated by another API (translated: the translation's error) -> validated chat request and
// rendered prompt; fails the test on any error.
inline std::pair<ChatRequest, ChatPrompt> chat_of(const MaybeError& translated, const json& chat_body) {
  ChatRequest chat;
  EXPECT_FALSE(translated) << (translated ? translated->message : "");
  MaybeError e = parse_chat_request(chat_body, kCompatModel, chat);
  EXPECT_FALSE(e) << (e ? e->message : "") << " for " << chat_body.dump();
  Result<ChatPrompt> prompt = build_chat_prompt(chat);
  EXPECT_TRUE(prompt.ok()) << prompt.status().message();
  return {chat, prompt.ok() ? *prompt : ChatPrompt{}};
}

// The first error of translation, then of validation.
inline MaybeError first_error(const MaybeError& translated, const json& chat_body) {
  if (translated) return translated;
  ChatRequest chat;
  return parse_chat_request(chat_body, kCompatModel, chat);
}

inline GenerationResult finished(const char* reason, int prompt_tokens = 20, int completion_tokens = 8) {
  GenerationResult r;
  r.finish_reason = reason;
  r.prompt_tokens = prompt_tokens;
  r.completion_tokens = completion_tokens;
  r.cached_tokens = 5;
  return r;
}

// (event name, data JSON) of each event of a named-event SSE stream; fails on anything else.
inline std::vector<std::pair<std::string, json>> named_events(const std::string& sse) {
  std::vector<std::pair<std::string, json>> out;
  size_t pos = 0;
  while (pos < sse.size()) {
    size_t end = sse.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << sse.substr(pos);
    if (end == std::string::npos) break;
    std::string e = sse.substr(pos, end - pos);
    pos = end + 2;
    size_t nl = e.find('\n');
    EXPECT_TRUE(e.starts_with("event: ") && nl != std::string::npos && e.compare(nl + 1, 6, "data: ") == 0)
        << e;
    if (nl == std::string::npos) continue;
    json data = json::parse(e.substr(nl + 7), nullptr, false);
    EXPECT_FALSE(data.is_discarded()) << e;
    out.emplace_back(e.substr(7, nl - 7), std::move(data));
  }
  return out;
}

inline std::vector<std::string> names_of(const std::vector<std::pair<std::string, json>>& events) {
  std::vector<std::string> names;
  for (const auto& [name, data] : events) names.push_back(name);
  return names;
}

}  // namespace lily::test
