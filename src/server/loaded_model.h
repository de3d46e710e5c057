// What the background loader produces for the request handlers (private to src/server).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "server/server.h"
#include "tokenizer/tokenizer.h"

namespace lily {

struct Server::Loaded {
  std::unique_ptr<Engine> engine;  // used by the scheduler's worker only
  Tokenizer tokenizer;             // thread-safe; handlers tokenize on their own threads
  SamplingDefaults defaults;       // generation_config.json
  ServedModel served;
  std::vector<int32_t> stop_token_ids;  // engine/model_loader.h stop_token_ids (the CLI's too)
  int32_t tool_call_token = -1;         // <tool_call>, banned when tool_choice is none
  std::string fingerprint;              // system_fingerprint: "lily-<backend>"
};

}  // namespace lily
