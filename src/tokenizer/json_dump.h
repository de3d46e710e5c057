// Python-compatible text forms of JSON values, as the Hugging Face chat-template environment
// produces them, so that a natively rendered prompt is byte-identical to the Jinja one.
//
//   hf_tojson(v)       == json.dumps(v, ensure_ascii=False)   (transformers' `tojson` filter:
//                         separators ", " and ": ", keys in insertion order, floats as Python repr)
//   python_str(v)      == str(v) for the Python value json.loads would give (what `{{ v }}` prints:
//                         None, True, 1.5, {'a': [1, 'x']})
//   python_float_repr  == repr(float): shortest round-trip digits; exponent form when the
//                         decimal exponent is < -4 or >= 16 ("1e-05", "1e+16", "0.0001", "1.0")
//
// Known gap: integers outside int64/uint64 are stored by nlohmann as doubles, so they print
// as floats ("1e+30") where Python keeps the exact integer.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace lily {

std::string hf_tojson(const nlohmann::ordered_json& v);
std::string python_str(const nlohmann::ordered_json& v);
std::string python_float_repr(double d);

// True when no array/object in v nests deeper than max_depth (a scalar has depth 0). Iterative, so
// it is safe on any input; check it before handing untrusted JSON to recursive code (hf_tojson,
// copies of nlohmann values), which a 100k-deep document would overflow.
bool json_depth_within(const nlohmann::ordered_json& v, size_t max_depth);

}  // namespace lily
