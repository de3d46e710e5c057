// CudaBackendOptions from text: the `key=value,...` specs of `lily bench --variants` and `--cuda-options`.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <iterator>
#include <string>

#include "cuda/cuda_backend.h"

namespace lily::cuda {

namespace {

// The options a spec may set: a name and the bool or int member it sets.
struct OptionKey {
  const char* name;
  bool CudaBackendOptions::*flag = nullptr;
  int CudaBackendOptions::*number = nullptr;
};

constexpr OptionKey kOptionKeys[] = {
    {"gdn_scan", nullptr, &CudaBackendOptions::gdn_scan_variant},
    {"wgmma", &CudaBackendOptions::dense_wgmma, nullptr},
    {"moe_wgmma", &CudaBackendOptions::moe_wgmma, nullptr},
    {"moe_wgmma_min_rows", nullptr, &CudaBackendOptions::moe_wgmma_min_rows},
    {"attn_wgmma", &CudaBackendOptions::attn_wgmma, nullptr},
    {"moe_fused", &CudaBackendOptions::moe_fused, nullptr},
    {"gdn_fused", &CudaBackendOptions::gdn_fused, nullptr},
    {"attn_fused", &CudaBackendOptions::attn_fused, nullptr},
    {"moe_select_in_experts", &CudaBackendOptions::moe_select_in_experts, nullptr},
    {"moe_out_reads_selection", &CudaBackendOptions::moe_out_reads_selection, nullptr},
    {"decode_rows_max", nullptr, &CudaBackendOptions::decode_rows_max},
    {"sequence_pool", nullptr, &CudaBackendOptions::sequence_pool},
    {"decode_prefetch", nullptr, &CudaBackendOptions::decode_prefetch},
    {"anchor_from_chunk_states", &CudaBackendOptions::anchor_from_chunk_states, nullptr},
};

Status set_option(const OptionKey& k, const std::string& v, CudaBackendOptions& o, const char* what) {
  if (k.flag) {
    if (v == "1" || v == "on" || v == "true") return o.*k.flag = true, ok_status();
    if (v == "0" || v == "off" || v == "false") return o.*k.flag = false, ok_status();
    return invalid_argument("%s: %s=%s is not on/off", what, k.name, v.c_str());
  }
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < INT_MIN || x > INT_MAX)
    return invalid_argument("%s: %s=%s is not an integer", what, k.name, v.c_str());
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
