// CudaBackendOptions from text: the `key=value,...` specs of `lily bench --variants` and `--cuda-options`.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <iterator>
#include <string>

#include "cuda/cuda_backend.h"

namespace lily::cuda {

namespace {

// The options a spec may set: a name, the int member it sets and its largest value (1: a switch). The kernel paths
// are not options: the backend picks them from the binary's device code and the GPU (cuda_backend.cpp).
struct OptionKey {
  const char* name;
  int CudaBackendOptions::*number = nullptr;
  int max = INT_MAX;
};

constexpr OptionKey kOptionKeys[] = {
    {"prefill_chunk", &CudaBackendOptions::prefill_chunk},
    {"expert_copies", &CudaBackendOptions::expert_copies, 1},
    {"megakernel", &CudaBackendOptions::megakernel, 1},
};

Status set_option(const OptionKey& k, const std::string& v, CudaBackendOptions& o, const char* what) {
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < 0 || x > INT_MAX)
    return invalid_argument("%s: %s=%s is not a non-negative integer", what, k.name, v.c_str());
  if (x > k.max && k.max == 1) return invalid_argument("%s: %s=%s: must be 0 or 1", what, k.name, v.c_str());
  if (x > k.max) return invalid_argument("%s: %s=%s: must be at most %d", what, k.name, v.c_str(), k.max);
  o.*k.number = static_cast<int>(x);
  return ok_status();
}

}  // namespace

std::string option_keys() {
  std::string names;
  for (const OptionKey& o : kOptionKeys) names += std::string(names.empty() ? "" : ", ") + o.name;
  return names;
}

Status apply_option_spec(const std::string& spec, CudaBackendOptions& opt, const char* what) {
  size_t at = 0;
  while (at < spec.size()) {
    size_t comma = spec.find(',', at);
    if (comma == std::string::npos) comma = spec.size();
    const std::string kv = spec.substr(at, comma - at);
    at = comma + 1;
    if (kv.empty()) continue;
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) return invalid_argument("%s: `%s` is not key=value", what, kv.c_str());
    const std::string key = kv.substr(0, eq);
    const OptionKey* k = std::find_if(std::begin(kOptionKeys), std::end(kOptionKeys),
                                      [&](const OptionKey& o) { return key == o.name; });
    if (k == std::end(kOptionKeys))
      return invalid_argument("%s: unknown key `%s` (known: %s)", what, key.c_str(), option_keys().c_str());
    RETURN_IF_ERROR(set_option(*k, kv.substr(eq + 1), opt, what));
  }
  return ok_status();
}

}  // namespace lily::cuda
