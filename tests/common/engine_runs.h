// Test helper shared by the engine tests and the CUDA end-to-end tests: several requests through one engine's
// incremental API side by side, as the server's continuous batching runs them.
#pragma once
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "engine/engine.h"

namespace lily::test {

// Begins every request, prefills them all, then decode_step()s the unfinished ones together until all are done.
inline std::vector<std::unique_ptr<Generation>> run_together(Engine& engine,
                                                             const std::vector<GenerationRequest>& reqs) {
  std::vector<std::unique_ptr<Generation>> gens;
  for (const GenerationRequest& r : reqs) {
    auto g = engine.begin(r, {});
    EXPECT_TRUE(g.ok());
    if (!g.ok()) return {};
    while ((*g)->prefilling()) engine.prefill_step(**g);
    gens.push_back(std::move(*g));
  }
  for (bool any = true; any;) {
    std::vector<Generation*> decoding;
    for (auto& g : gens)
      if (!g->done()) decoding.push_back(g.get());
    any = !decoding.empty();
    if (any) engine.decode_step(decoding);
  }
  return gens;
}

}  // namespace lily::test
