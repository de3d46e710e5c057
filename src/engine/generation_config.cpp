// generation_config.json reading; see generation_config.h.
#include "engine/generation_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace lily {
namespace {

using nlohmann::json;

// Field access with type and range checks; every error names `where` and the field.
class Fields {
 public:
  Fields(const json& root, const std::string& where) : root_(root), where_(where) {}

  // A present, non-null number into out (ints allowed); range [lo, hi], lo excluded when lo_open.
  Status number(const char* name, float& out, double lo, double hi, bool lo_open = false) const {
    const json* v = find(name);
    if (!v) return ok_status();
    if (!v->is_number()) return wrong_type(name, "a number", *v);
    const double x = v->get<double>();
    if (!std::isfinite(x) || x < lo || x > hi || (lo_open && x == lo)) {
      return format_error("%s: field `%s` = %g is out of range %s%g, %g]", where_.c_str(), name, x,
                          lo_open ? "(" : "[", lo, hi);
    }
    out = static_cast<float>(x);
    return ok_status();
  }

  // A present, non-null integer >= lo.
  Status integer(const char* name, std::optional<int64_t>& out, int64_t lo) const {
    const json* v = find(name);
    if (!v) return ok_status();
    if (!v->is_number_integer()) return wrong_type(name, "an integer", *v);
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > INT32_MAX) {
      return format_error("%s: field `%s` = %lld is out of range [%lld, %d]", where_.c_str(), name,
                          static_cast<long long>(x), static_cast<long long>(lo), INT32_MAX);
    }
    out = x;
    return ok_status();
  }

  // `eos_token_id`: an integer or a list of integers (each >= 0).
  Status id_list(const char* name, std::vector<int32_t>& out) const {
    const json* v = find(name);
    if (!v) return ok_status();
    if (!v->is_array() && !v->is_number_integer())
      return wrong_type(name, "an integer or a list of integers", *v);
    const json list = v->is_array() ? *v : json::array({*v});
    out.clear();
    for (size_t i = 0; i < list.size(); ++i) {
      const json& x = list[i];
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX) {
        return format_error("%s: field `%s`[%zu] must be a token id (an integer >= 0), got %s",
                            where_.c_str(), name, i, x.dump().substr(0, 60).c_str());
      }
      out.push_back(static_cast<int32_t>(x.get<int64_t>()));
    }
    return ok_status();
  }

 private:
  const json* find(const char* name) const {
    auto it = root_.find(name);
    return it == root_.end() || it->is_null() ? nullptr : &*it;
  }
  Status wrong_type(const char* name, const char* want, const json& v) const {
    return format_error("%s: field `%s` must be %s, got %s", where_.c_str(), name, want,
                        v.dump().substr(0, 60).c_str());
  }

  const json& root_;
  const std::string& where_;
};

Status read_ids(const Fields& f, SamplingDefaults& d) {
  RETURN_IF_ERROR(f.id_list("eos_token_id", d.eos_token_ids));
  std::optional<int64_t> bos, pad, max_new;
  RETURN_IF_ERROR(f.integer("bos_token_id", bos, 0));
  RETURN_IF_ERROR(f.integer("pad_token_id", pad, 0));
  RETURN_IF_ERROR(f.integer("max_new_tokens", max_new, 1));
  if (bos) d.bos_token_id = static_cast<int32_t>(*bos);
  if (pad) d.pad_token_id = static_cast<int32_t>(*pad);
  if (max_new) d.max_new_tokens = static_cast<int>(*max_new);
  return ok_status();
}

}  // namespace

Result<SamplingDefaults> parse_generation_config(std::string_view json_text, const std::string& where) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    return format_error("%s: invalid JSON: %s", where.c_str(), e.what());
  }
  if (!root.is_object()) return format_error("%s: expected a JSON object at the top level", where.c_str());

  SamplingDefaults d;
  d.from_file = true;
  const Fields f(root, where);
  RETURN_IF_ERROR(f.number("temperature", d.temperature, 0.0, 1e6));
  RETURN_IF_ERROR(f.number("top_p", d.top_p, 0.0, 1.0, /*lo_open=*/true));
  RETURN_IF_ERROR(f.number("min_p", d.min_p, 0.0, 1.0));
  RETURN_IF_ERROR(f.number("repetition_penalty", d.repetition_penalty, 0.0, 1e6, /*lo_open=*/true));
  std::optional<int64_t> top_k;
  RETURN_IF_ERROR(f.integer("top_k", top_k, -1));
  if (top_k) d.top_k = *top_k < 0 ? 0 : static_cast<int>(*top_k);
  RETURN_IF_ERROR(read_ids(f, d));
  return d;
}

Result<SamplingDefaults> load_generation_config(const std::string& model_dir) {
  const std::filesystem::path path = std::filesystem::path(model_dir) / "generation_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return SamplingDefaults{};
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("%s: cannot open for reading", path.c_str());
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return io_error("%s: read failed", path.c_str());
  return parse_generation_config(text.str(), path.string());
}

void apply_defaults(SamplingParams& params, const SamplingDefaults& defaults,
                    const RequestOverrides& request) {
  params.temperature = request.temperature.value_or(defaults.temperature);
  params.top_k = request.top_k.value_or(defaults.top_k);
  params.top_p = request.top_p.value_or(defaults.top_p);
  params.min_p = request.min_p.value_or(defaults.min_p);
  params.repetition_penalty = request.repetition_penalty.value_or(defaults.repetition_penalty);
  params.max_tokens = request.max_tokens.value_or(defaults.max_new_tokens.value_or(-1));
}

}  // namespace lily
