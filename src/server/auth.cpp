#include "server/auth.h"

#include <cctype>

namespace lily {

bool bearer_token_matches(std::string_view authorization, std::string_view key) {
  constexpr std::string_view kScheme = "bearer ";
  bool scheme_ok = authorization.size() >= kScheme.size();
  for (size_t i = 0; scheme_ok && i < kScheme.size(); ++i) {
    scheme_ok = std::tolower(static_cast<unsigned char>(authorization[i])) == kScheme[i];
  }
  std::string_view given = scheme_ok ? authorization.substr(kScheme.size()) : std::string_view();
  volatile unsigned char diff = given.size() != key.size() ? 1 : 0;
  for (size_t i = 0; i < key.size(); ++i) {
    unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff = diff | (g ^ static_cast<unsigned char>(key[i]));
  }
  return scheme_ok && !key.empty() && diff == 0;
}

}  // namespace lily
