// CHECK: always-on internal invariants. A failure is a bug in lily, not bad input: it prints the
// condition, the location and the values given, then aborts. Input errors use Status instead.
#pragma once
#include <cstdio>
#include <cstdlib>

namespace lily::detail {
[[noreturn]] inline void check_failed(const char* cond, const char* file, int line, const char* msg) {
  std::fprintf(stderr, "lily: CHECK failed: %s at %s:%d %s\n", cond, file, line, msg ? msg : "");
  std::abort();
}
}  // namespace lily::detail

#define CHECK(cond, ...)                                                                     \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      char _msg[512] = "";                                                                  \
      __VA_OPT__(std::snprintf(_msg, sizeof(_msg), __VA_ARGS__);)                           \
      ::lily::detail::check_failed(#cond, __FILE__, __LINE__, _msg);                        \
    }                                                                                       \
  } while (0)
