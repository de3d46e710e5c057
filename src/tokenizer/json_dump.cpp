// Python-compatible dumps of JSON values (see json_dump.h for the exact Python equivalents).
#include "tokenizer/json_dump.h"

#include <utf8proc.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

namespace lily {

namespace {

using json = nlohmann::ordered_json;

void append_hex(std::string& out, const char* prefix, unsigned value, int digits) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%s%0*x", prefix, digits, value);
  out += buf;
}

// json.dumps(s, ensure_ascii=False): escapes only '"', '\\' and control characters below 0x20;
// everything else (DEL, non-ASCII, U+2028) is copied as is.
void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          append_hex(out, "\\u", c, 4);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

// Python's str.isprintable() for one code point: false for categories Cc Cf Cs Co Cn Zl Zp Zs,
// except the ASCII space.
bool python_printable(int32_t cp) {
  if (cp == ' ') return true;
  switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_CC: case UTF8PROC_CATEGORY_CF: case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO: case UTF8PROC_CATEGORY_CN: case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP: case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

// repr(str): single quotes unless the text holds a ' and no "; non-printables escaped.
void append_python_string_repr(std::string& out, const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  out += quote;
  const auto* bytes = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    utf8proc_int32_t cp = 0;
    utf8proc_ssize_t n = utf8proc_iterate(bytes + i, static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n <= 0) {  // invalid UTF-8 cannot come from a parsed document; show the byte as Python would a surrogate escape
      append_hex(out, "\\x", static_cast<unsigned char>(s[i]), 2);
      ++i;
      continue;
    }
    if (cp == quote || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp < 0x80 && cp >= 0x20 && cp != 0x7f) {
      out += static_cast<char>(cp);
    } else if (cp >= 0x80 && python_printable(cp)) {
      out.append(s, i, static_cast<size_t>(n));
    } else if (cp <= 0xff) {
      append_hex(out, "\\x", static_cast<unsigned>(cp), 2);
    } else if (cp <= 0xffff) {
      append_hex(out, "\\u", static_cast<unsigned>(cp), 4);
    } else {
      append_hex(out, "\\U", static_cast<unsigned>(cp), 8);
    }
    i += static_cast<size_t>(n);
  }
  out += quote;
}

// style: true for json.dumps, false for Python repr (the form str() uses inside containers).
void append_value(std::string& out, const json& v, bool json_style) {
  switch (v.type()) {
    case json::value_t::null: out += json_style ? "null" : "None"; break;
    case json::value_t::boolean:
      out += v.get<bool>() ? (json_style ? "true" : "True") : (json_style ? "false" : "False");
      break;
    case json::value_t::number_integer: out += std::to_string(v.get<int64_t>()); break;
    case json::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); break;
    case json::value_t::number_float: {
      const double d = v.get<double>();
      if (json_style && std::isnan(d)) {
        out += "NaN";
      } else if (json_style && std::isinf(d)) {
        out += d > 0 ? "Infinity" : "-Infinity";
      } else {
        out += python_float_repr(d);
      }
      break;
    }
    case json::value_t::string:
      if (json_style) {
        append_json_string(out, v.get_ref<const std::string&>());
      } else {
        append_python_string_repr(out, v.get_ref<const std::string&>());
      }
      break;
    case json::value_t::array: {
      out += '[';
      bool first = true;
      for (const auto& item : v) {
        if (!first) out += ", ";
        first = false;
        append_value(out, item, json_style);
      }
      out += ']';
      break;
    }
    case json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, item] : v.items()) {
        if (!first) out += ", ";
        first = false;
        if (json_style) {
          append_json_string(out, key);
        } else {
          append_python_string_repr(out, key);
        }
        out += ": ";
        append_value(out, item, json_style);
      }
      out += '}';
      break;
    }
    case json::value_t::binary:
    case json::value_t::discarded:
      out += json_style ? "null" : "None";
      break;
  }
}

}  // namespace

std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  // Shortest round-trip digits, as Python's repr uses; to_chars gives "d.ddde[+-]XX".
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  const bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  const size_t e_pos = sci.find('e');
  std::string digits = sci.substr(0, e_pos);
  if (digits.size() > 1) digits.erase(1, 1);  // drop the '.'
  const int exponent = std::stoi(sci.substr(e_pos + 1));
  const int decpt = exponent + 1;  // value = 0.DIGITS * 10^decpt
  std::string out = negative ? "-" : "";
  if (decpt <= -4 || decpt > 16) {
    out += digits[0];
    if (digits.size() > 1) out.append(".").append(digits, 1);
    char exp_buf[16];
    std::snprintf(exp_buf, sizeof(exp_buf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += exp_buf;
  } else if (decpt <= 0) {
    out.append("0.").append(static_cast<size_t>(-decpt), '0').append(digits);
  } else if (static_cast<size_t>(decpt) >= digits.size()) {
    out.append(digits).append(static_cast<size_t>(decpt) - digits.size(), '0').append(".0");
  } else {
    out.append(digits, 0, static_cast<size_t>(decpt)).append(".").append(digits, static_cast<size_t>(decpt));
  }
  return out;
}

std::string hf_tojson(const nlohmann::ordered_json& v) {
  std::string out;
  append_value(out, v, /*json_style=*/true);
  return out;
}

std::string python_str(const nlohmann::ordered_json& v) {
  if (v.is_string()) return v.get<std::string>();
  std::string out;
  append_value(out, v, /*json_style=*/false);
  return out;
}

bool json_depth_within(const nlohmann::ordered_json& v, size_t max_depth) {
  std::vector<std::pair<const json*, size_t>> stack = {{&v, 0}};
  while (!stack.empty()) {
    auto [node, depth] = stack.back();
    stack.pop_back();
    if (!node->is_structured()) continue;
    if (depth + 1 > max_depth) return false;
    for (const auto& child : *node) stack.emplace_back(&child, depth + 1);
  }
  return true;
}

}  // namespace lily
