// Shared by the chat request tests: the served model and a minimal chat body with extra fields.
#pragma once
#include "server/chat_request.h"

namespace lily::test {

inline const ServedModel kChatModel{"tiny", 151936, 2048};

// {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]} with `extra`'s fields set.
inline json chat_body(const json& extra = json::object()) {
  json body = {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "Hello"}}}}};
  for (auto& [k, v] : extra.items()) body[k] = v;
  return body;
}

}  // namespace lily::test
