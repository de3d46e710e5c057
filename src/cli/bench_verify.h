// `lily bench --mode verify`: the cost of speculative verification on any backend. At each context it times a
// plain one-token decode step (forward of 1 row, on a sequence without the head's state), forward_verify of N rows
// (then accept_verified(1), as a step that rejects every draft would), and one MTP draft step (mtp_draft: the first
// call reads the pending rows, the others chain), so the table says what K drafts must win back:
// verifying 1+K rows costs `ratio` decode steps, plus K draft steps.
// Then, per K, what that implies (engine/speculative.h speculative_projection): the acceptance at which K drafts
// break even, and the speed-up at published acceptance rates - with the measured draft cost, or, where the backend
// has no head to time, an assumed one (printed as such).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "util/status.h"

namespace lily::cli {

struct VerifyBenchOptions {
  std::string model;              // checkpoint directory; empty: `synthetic` built in memory (mlx layout)
  std::string synthetic = "full";
  std::string backend = "auto";
  int threads = 0;                // CPU backend
  std::string cuda_options;
  std::vector<int64_t> contexts = {256};
  std::vector<int> rows = {1, 2, 3, 4};
  int reps = 5;                   // timed calls per measurement (median reported)
};

// Prints the table; `out` gets every measurement's median and raw ms.
Status run_verify_bench(const VerifyBenchOptions& o, nlohmann::json& out);

}  // namespace lily::cli
