// Incremental parser for Qwen3.6 generations: splits streamed text into reasoning and content and
// turns XML tool calls into OpenAI tool_calls. It is the inverse of the chat template's assistant
// turn (src/tokenizer/chat_format.h): `<think>\nREASONING\n</think>\n\nCONTENT\n\n<tool_call>...`.
//
// Reasoning. With thinking on, the prompt ends in "<think>\n", so the stream starts inside reasoning
// (starts_in_reasoning = true) and reasoning ends at the first "</think>". As the template's split
// does, reasoning loses its leading and trailing '\n's and the content after "</think>" its leading
// '\n's. Inside reasoning nothing else is recognised. A stream that ends without "</think>" was
// all reasoning (its trailing newlines are kept then). With starts_in_reasoning = false the stream
// is content from the first byte and "</think>" is ordinary text.
//
// Tool calls. In content, `<tool_call>BODY</tool_call>` with BODY
//   <function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>
// (whitespace between elements is free; one '\n' on each side of VALUE belongs to the format; a
// missing </parameter> ends the value at the next <parameter= or </function>, as vLLM's
// qwen3_coder parser does). The older Hermes body {"name": ..., "arguments": {...}} is accepted too.
// A complete call becomes {id "call_" + 24 random alphanumerics, name, arguments_json} with the
// arguments as json.dumps writes them (", " and ": ", parameter order). The '\n's the template puts
// before a call and between calls are dropped. A malformed call (and one still open when the stream
// finishes) is returned as content, byte for byte.
//
// Parameter typing. With the tool's JSON schema (parameters.properties[ARG]: "type" as a string or
// list, or the types of anyOf/oneOf members, or of enum values):
//   only "string"            -> the raw text;
//   otherwise                -> the text parsed as JSON when it parses to a non-string of an allowed
//                               type; else the raw text if "string" is allowed; else the parsed JSON
//                               if it parsed at all; else the raw text.
// Without a schema (no tools, unknown tool or parameter, no type info) a value is parsed as JSON when
// it parses to a non-string (42, true, null, [..], {..}) and is the raw text otherwise. This is the
// exact inverse of the template, which writes strings raw and everything else as tojson; the one
// ambiguity is a string argument that itself reads as JSON ("42"), which a schema resolves.
//
// Text that could still be the start of a marker ("</thi", "<too") is held back until it can no
// longer be one, then released; finish() releases everything. No input makes the parser fail.
#pragma once
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace lily {

struct ToolCall {
  std::string id, name, arguments_json;
};

struct ParsedDelta {
  std::string reasoning, content;
  std::vector<ToolCall> tool_calls;
};

class OutputParser {
 public:
  // tools: the request's tools array (null when none), for parameter types.
  OutputParser(bool starts_in_reasoning, const nlohmann::ordered_json& tools);

  ParsedDelta push(std::string_view text);  // a piece of generated text; returns what it completed
  ParsedDelta finish();                     // end of generation: releases everything held back

 private:
  enum class Mode { reasoning, content, tool_call };

  void step_reasoning(ParsedDelta& out, bool at_end);
  void step_content(ParsedDelta& out, bool at_end);
  bool step_tool_call(ParsedDelta& out);  // false while the call is still open
  void emit(std::string_view text, std::string& sink);
  void release_pending_newlines(ParsedDelta& out);
  bool parse_call(std::string_view body, ToolCall& call);
  nlohmann::ordered_json typed_value(const std::string& function, const std::string& param,
                                     const std::string& text) const;
  std::string new_call_id();

  Mode mode_;
  std::string buf_;            // text not yet classified (a held partial marker, or an open call body)
  size_t call_scan_from_ = 0;  // in tool_call mode: where to resume looking for </tool_call>
  bool strip_leading_newlines_ = false;  // at the start of reasoning, after </think>, after a call
  size_t pending_newlines_ = 0;          // trailing '\n's held: dropped before </think> or a call
  std::unordered_map<std::string, nlohmann::ordered_json> param_schemas_;  // function -> properties
  std::mt19937_64 rng_;
};

}  // namespace lily
