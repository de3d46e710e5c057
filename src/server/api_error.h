// OpenAI error objects: every failed request gets {"error": {"message", "type", "param", "code"}} with the
// HTTP status that goes with it. Types follow OpenAI's: invalid_request_error (400, 401, 404, 413),
// rate_limit_error (429), server_error (500, 503).
#pragma once
#include <string>

#include "util/status.h"

namespace lily {

struct ApiError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  std::string param;  // the request field at fault ("messages[2].role"); empty -> null
  std::string code;   // machine-readable ("context_length_exceeded"); empty -> null
};

// {"error": {...}} as compact JSON (invalid UTF-8 in the message is replaced, never thrown on).
std::string error_body(const ApiError& e);

ApiError bad_request(std::string message, std::string param = "", std::string code = "");
ApiError server_error(int status, std::string message, std::string code = "");
// A Status from a lower layer (chat template, tokenizer, engine): invalid_argument, out_of_range, format and
// unsupported -> 400; everything else -> 500.
ApiError from_status(const Status& st, std::string param = "");

}  // namespace lily
