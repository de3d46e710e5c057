#include "util/byte_size.h"

#include <cctype>
#include <cmath>
#include <cstdlib>

namespace lily {

Result<uint64_t> parse_byte_size(const std::string& text) {
  auto bad = [&](const char* why) {
    return invalid_argument(
        "'%s' is not a size (%s): a number with an optional unit K, M, G or T (binary: "
        "1K = 1024 bytes), e.g. 20G or 512MiB",
        text.c_str(), why);
  };
  const char* s = text.c_str();
  char* end = nullptr;
  if (text.empty() || !(std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.'))
    return bad("no number");
  const double value = std::strtod(s, &end);
  std::string unit;
  for (const char* p = end; *p; ++p) unit += static_cast<char>(std::toupper(static_cast<unsigned char>(*p)));
  double scale = 1;
  size_t at = 0;
  if (!unit.empty()) {
    const std::string units = "KMGT";
    const size_t k = units.find(unit[0]);
    if (k != std::string::npos) scale = std::pow(1024.0, static_cast<double>(k + 1)), at = 1;
    if (at == 1 && at < unit.size() && unit[at] == 'I') ++at;
    if (at < unit.size() && unit[at] == 'B') ++at;
    if (at != unit.size()) return bad("unknown unit");
  }
  const double bytes = value * scale;
  if (!std::isfinite(bytes) || bytes >= 18446744073709551616.0) return bad("too large");
  return static_cast<uint64_t>(bytes);
}

std::string format_byte_size(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  return u == 0 ? format("%llu B", (unsigned long long)bytes) : format("%.1f %s", v, units[u]);
}

}  // namespace lily
