#include "server/api_error.h"

#include <nlohmann/json.hpp>

namespace lily {

std::string error_body(const ApiError& e) {
  nlohmann::ordered_json j;
  auto& err = j["error"];
  err["message"] = e.message;
  err["type"] = e.type;
  err["param"] = e.param.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.param);
  err["code"] = e.code.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.code);
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

ApiError bad_request(std::string message, std::string param, std::string code) {
  return ApiError{400, "invalid_request_error", std::move(message), std::move(param), std::move(code)};
}

ApiError server_error(int status, std::string message, std::string code) {
  return ApiError{status, "server_error", std::move(message), "", std::move(code)};
}

ApiError from_status(const Status& st, std::string param) {
  switch (st.code()) {
    case ErrorCode::invalid_argument:
    case ErrorCode::out_of_range:
    case ErrorCode::format:
      return bad_request(st.message(), std::move(param));
    case ErrorCode::unsupported:
      return bad_request(st.message(), std::move(param), "unsupported");
    default:
      return server_error(500, st.message());
  }
}

}  // namespace lily
