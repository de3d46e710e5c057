// Status and Result<T>: the error tier for every boundary a user, a file or a socket can reach.
// Messages are actionable: they name the file, tensor or field and say expected vs found.
#pragma once
#include <cstdio>
#include <string>
#include <utility>
#include <variant>

namespace lily {

enum class ErrorCode { ok = 0, invalid_argument, not_found, io, format, unsupported, out_of_range, cancelled,
                       internal };

class Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok_status() { return {}; }
  bool ok() const { return code_ == ErrorCode::ok; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // Prefix context ("loading /x/config.json: " + message) while propagating.
  Status with_context(const std::string& context) const {
    return ok() ? *this : Status(code_, context + ": " + message_);
  }

 private:
  ErrorCode code_ = ErrorCode::ok;
  std::string message_;
};

inline Status ok_status() { return {}; }

template <typename... Args>
std::string format(const char* fmt, Args... args) {
  if constexpr (sizeof...(Args) == 0) {
    return fmt;
  } else {
    int n = std::snprintf(nullptr, 0, fmt, args...);
    std::string s(static_cast<size_t>(n), '\0');
    std::snprintf(s.data(), s.size() + 1, fmt, args...);
    return s;
  }
}

template <typename... Args>
Status error(ErrorCode code, const char* fmt, Args... args) {
  return Status(code, format(fmt, args...));
}
template <typename... Args>
Status invalid_argument(const char* fmt, Args... args) { return error(ErrorCode::invalid_argument, fmt, args...); }
template <typename... Args>
Status format_error(const char* fmt, Args... args) { return error(ErrorCode::format, fmt, args...); }
template <typename... Args>
Status io_error(const char* fmt, Args... args) { return error(ErrorCode::io, fmt, args...); }

template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}                       // NOLINT(implicit)
  Result(Status status) : v_(std::move(status)) {}                // NOLINT(implicit)
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace lily

#define LILY_CONCAT_INNER(a, b) a##b
#define LILY_CONCAT(a, b) LILY_CONCAT_INNER(a, b)

// Propagate a failed Status.
#define RETURN_IF_ERROR(expr)               \
  do {                                      \
    ::lily::Status _st = (expr);            \
    if (!_st.ok()) return _st;              \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, make_x());`
#define ASSIGN_OR_RETURN(lhs, expr) ASSIGN_OR_RETURN_IMPL(LILY_CONCAT(_res_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
