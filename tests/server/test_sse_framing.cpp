// The SSE bytes of streamed chat and text completions, byte for byte against OpenAI's framing, and the
// non-streamed response objects, from crafted generations run through the real output parser.
#include <gtest/gtest.h>

#include "server/chat_response.h"

namespace lily {
namespace {

const Tokenizer& tokenizer() {
  static const Tokenizer t = [] {
    Result<Tokenizer> r =
        Tokenizer::load(std::string(LILY_FIXTURES_DIR) + "/qwen3-tokenizer/tokenizer.json");
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.value();
  }();
  return t;
}

const ResponseMeta kMeta{"chatcmpl-test", 1700000000, "tiny", "lily-cpu"};
const std::string kHead =
    R"(data: {"id":"chatcmpl-test","object":"chat.completion.chunk","created":1700000000,"model":"tiny",)"
    R"("system_fingerprint":"lily-cpu","choices":[{"index":0,"delta":)";

std::string chunk(const std::string& delta, const std::string& finish = "null", const std::string& usage = "",
                  const std::string& logprobs = "null") {
  return kHead + delta + R"(,"logprobs":)" + logprobs + R"(,"finish_reason":)" + finish + "}]" +
         (usage.empty() ? "" : R"(,"usage":)" + usage) + "}\n\n";
}

GenerationPiece piece(const std::string& text, int32_t token = 0) {
  GenerationPiece p;
  p.text = text;
  p.token = token;
  return p;
}

GenerationResult result(const std::string& finish, int prompt, int completion, int cached) {
  GenerationResult r;
  r.finish_reason = finish;
  r.prompt_tokens = prompt;
  r.completion_tokens = completion;
  r.cached_tokens = cached;
  return r;
}

ChatRequest request(bool include_usage = false) {
  ChatRequest r;
  r.stream.stream = true;
  r.stream.include_usage = include_usage;
  return r;
}

TEST(SseFraming, EventAndDone) {
  EXPECT_EQ(sse_event("{\"a\":1}"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(sse_done(), "data: [DONE]\n\n");
  EXPECT_EQ(sse_json(json{{"x", "\xff"}}),
            "data: {\"x\":\"\xef\xbf\xbd\"}\n\n");  // never throws on bad UTF-8
}

TEST(SseFraming, ReasoningThenContentByteForByte) {
  ChatRequest req = request();
  ChatPrompt prompt{"...<think>\n", "", true};
  ChatResponseBuilder b(req, prompt, tokenizer(), kMeta);
  std::string out = b.stream_start();
  out += b.stream_piece(piece("Let me think"));
  out += b.stream_piece(piece("."));
  out += b.stream_piece(piece("\n</thi"));  // held: could be </think>
  out += b.stream_piece(piece("nk>\n\nHi"));
  out += b.stream_piece(piece(" there"));
  out += b.stream_finish(result("stop", 10, 6, 0));
  std::string expected = chunk(R"({"role":"assistant","content":""})") +
                         chunk(R"({"reasoning_content":"Let me think"})") +
                         chunk(R"({"reasoning_content":"."})") + chunk(R"({"content":"Hi"})") +
                         chunk(R"({"content":" there"})") + chunk("{}", R"("stop")") + "data: [DONE]\n\n";
  EXPECT_EQ(out, expected);
  EXPECT_EQ(b.reasoning(), "Let me think.");
  EXPECT_EQ(b.content(), "Hi there");
}

TEST(SseFraming, ToolCallChunkAndUsage) {
  ChatRequest req = request(/*include_usage=*/true);
  req.tools =
      json::parse(R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
      "properties":{"city":{"type":"string"},"days":{"type":"integer"}}}}}])");
  ChatPrompt prompt{"...", "", false};
  ChatResponseBuilder b(req, prompt, tokenizer(), kMeta);
  std::string out = b.stream_start();
  out += b.stream_piece(piece("Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"));
  out += b.stream_piece(piece("</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"));
  out += b.stream_finish(result("stop", 50, 30, 40));
  size_t at = out.find("\"id\":\"call_");
  ASSERT_NE(at, std::string::npos) << out;
  std::string call_id = out.substr(at + 6, 29);  // call_ + 24 characters
  ASSERT_EQ(call_id.size(), 29u);
  const std::string u = R"(,"usage":null)";
  auto c = [&](const std::string& delta, const std::string& finish = "null") {
    return kHead + delta + R"(,"logprobs":null,"finish_reason":)" + finish + "}]" + u + "}\n\n";
  };
  std::string expected =
      c(R"({"role":"assistant","content":""})") + c(R"({"content":"Checking."})") +
      c(R"({"tool_calls":[{"index":0,"id":")" + call_id +
        R"(","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\", \"days\": 3}"}}]})") +
      c("{}", R"("tool_calls")") +
      R"(data: {"id":"chatcmpl-test","object":"chat.completion.chunk","created":1700000000,"model":"tiny",)"
      R"("system_fingerprint":"lily-cpu","choices":[],"usage":{"prompt_tokens":50,"completion_tokens":30,)"
      R"("total_tokens":80,"prompt_tokens_details":{"cached_tokens":40}}})"
      "\n\n"
      "data: [DONE]\n\n";
  EXPECT_EQ(out, expected);
}

TEST(SseFraming, ForcedToolCallPrefixIsParsed) {
  ChatRequest req = request();
  req.tools = json::parse(R"([{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}])");
  req.tool_choice = ToolChoice::named;
  req.tool_name = "f";
  ChatPrompt prompt{"...<tool_call>\n<function=f>\n", "<tool_call>\n<function=f>\n", false};
  ChatResponseBuilder b(req, prompt, tokenizer(), kMeta);
  b.add_piece(piece("<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"));
  json r = b.response(result("stop", 5, 9, 0));
  const json& msg = r["choices"][0]["message"];
  EXPECT_TRUE(msg["content"].is_null());
  ASSERT_EQ(msg["tool_calls"].size(), 1u);
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "f");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["arguments"], "{\"x\": 1}");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");
}

TEST(SseFraming, LogprobsRideOnTheirPiece) {
  const int32_t hello = tokenizer().token_id("Hello");
  const int32_t hi = tokenizer().token_id("Hi");
  ASSERT_GE(hello, 0);
  ASSERT_GE(hi, 0);
  ChatRequest req = request();
  req.logprobs = true;
  req.top_logprobs = 2;
  ChatResponseBuilder b(req, ChatPrompt{"", "", false}, tokenizer(), kMeta);
  GenerationPiece p = piece("Hello", hello);
  p.logprob = -0.5f;
  p.top = {{hello, -0.5f}, {hi, -1.25f}};
  GenerationPiece held = piece("", hi);  // text held back: the logprobs still go out, on an empty delta
  held.logprob = -2.0f;
  std::string out = b.stream_piece(p) + b.stream_piece(held);
  std::string top = R"([{"token":"Hello","logprob":-0.5,"bytes":[72,101,108,108,111]},)"
                    R"({"token":"Hi","logprob":-1.25,"bytes":[72,105]}])";
  std::string expected =
      chunk(R"({"content":"Hello"})", "null", "",
            R"({"content":[{"token":"Hello","logprob":-0.5,"bytes":[72,101,108,108,111],"top_logprobs":)" +
                top + "}]}") +
      chunk("{}", "null", "",
            R"({"content":[{"token":"Hi","logprob":-2.0,"bytes":[72,105],"top_logprobs":[]}]})");
  EXPECT_EQ(out, expected);
}

TEST(ChatResponse, NonStreamedObject) {
  ChatRequest req;
  req.logprobs = true;
  ChatResponseBuilder b(req, ChatPrompt{"", "", true}, tokenizer(), kMeta);
  GenerationPiece p = piece("mull it over\n</think>\n\nFour.", tokenizer().token_id("Four"));
  p.logprob = -0.25f;
  b.add_piece(p);
  GenerationPiece tail = piece("", -1);  // the engine's last piece carries held text only
  b.add_piece(tail);
  json r = b.response(result("length", 12, 2, 3));
  EXPECT_EQ(dump_json(r),
            R"({"id":"chatcmpl-test","object":"chat.completion","created":1700000000,"model":"tiny",)"
            R"("system_fingerprint":"lily-cpu","choices":[{"index":0,"message":{"role":"assistant",)"
            R"("content":"Four.","reasoning_content":"mull it over"},"logprobs":{"content":[{"token":"Four",)"
            R"("logprob":-0.25,"bytes":[70,111,117,114],"top_logprobs":[]}]},"finish_reason":"length"}],)"
            R"("usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14,)"
            R"("prompt_tokens_details":{"cached_tokens":3}}})");
}

TEST(CompletionResponse, StreamAndWhole) {
  CompletionRequest req;
  req.stream.stream = true;
  req.stream.include_usage = true;
  ResponseMeta meta{"cmpl-test", 1700000000, "tiny", "lily-cpu"};
  CompletionResponseBuilder b(req, tokenizer(), meta);
  std::string out =
      b.stream_piece(piece("Once")) + b.stream_piece(piece("")) + b.stream_finish(result("length", 3, 1, 0));
  const std::string head =
      R"(data: {"id":"cmpl-test","object":"text_completion","created":1700000000,"model":"tiny",)"
      R"("system_fingerprint":"lily-cpu","choices":)";
  EXPECT_EQ(out, head +
                     R"([{"index":0,"text":"Once","logprobs":null,"finish_reason":null}],"usage":null})"
                     "\n\n" +
                     head +
                     R"([{"index":0,"text":"","logprobs":null,"finish_reason":"length"}],"usage":null})"
                     "\n\n" +
                     head +
                     R"([],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,)"
                     R"("prompt_tokens_details":{"cached_tokens":0}}})"
                     "\n\n"
                     "data: [DONE]\n\n");

  CompletionRequest whole;
  whole.logprobs = 1;
  CompletionResponseBuilder w(whole, tokenizer(), meta);
  GenerationPiece p = piece("Hi", tokenizer().token_id("Hi"));
  p.logprob = -0.5f;
  p.top = {{tokenizer().token_id("Hi"), -0.5f}};
  w.add_piece(p);
  json r = w.response(result("stop", 3, 1, 0));
  EXPECT_EQ(r["choices"][0]["text"], "Hi");
  EXPECT_EQ(dump_json(r["choices"][0]["logprobs"]),
            R"({"tokens":["Hi"],"token_logprobs":[-0.5],"top_logprobs":[{"Hi":-0.5}],"text_offset":[0]})");
  EXPECT_FALSE(r.contains("usage") && r["usage"].is_null());
}

}  // namespace
}  // namespace lily
