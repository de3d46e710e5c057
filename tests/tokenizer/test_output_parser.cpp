// OutputParser: reasoning/content split, XML tool calls at every chunk boundary, schema typing,
// malformed input kept as text, and random streams that must never change the result.
#include "tokenizer/output_parser.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <random>
#include <set>

#include "tokenizer/chat_format.h"

namespace lily {
namespace {

using json = nlohmann::ordered_json;

struct Parsed {
  std::string reasoning, content;
  std::vector<ToolCall> tool_calls;
};

void add(Parsed& total, ParsedDelta delta) {
  total.reasoning += delta.reasoning;
  total.content += delta.content;
  for (auto& call : delta.tool_calls) total.tool_calls.push_back(std::move(call));
}

Parsed parse_chunks(const std::vector<std::string>& chunks, bool in_reasoning, const json& tools = nullptr) {
  OutputParser parser(in_reasoning, tools);
  Parsed total;
  for (const auto& chunk : chunks) add(total, parser.push(chunk));
  add(total, parser.finish());
  return total;
}

Parsed parse_all(const std::string& text, bool in_reasoning, const json& tools = nullptr) {
  return parse_chunks({text}, in_reasoning, tools);
}

// Same reasoning, content, names and arguments (ids are random).
void expect_same(const Parsed& a, const Parsed& b, const std::string& context) {
  EXPECT_EQ(a.reasoning, b.reasoning) << context;
  EXPECT_EQ(a.content, b.content) << context;
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size()) << context;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name) << context;
    EXPECT_EQ(a.tool_calls[i].arguments_json, b.tool_calls[i].arguments_json) << context;
  }
}

std::vector<std::string> split_every(const std::string& text, size_t n) {
  std::vector<std::string> chunks;
  for (size_t pos = 0; pos < text.size(); pos += n) chunks.push_back(text.substr(pos, n));
  return chunks;
}

const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
    "nothing": {"type": "null"}, "zip": {"type": "string"}, "maybe": {"type": ["integer", "null"]},
    "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "unit": {"enum": ["c", "f"]}}}}},
  {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
])");

const std::string kTwoCalls =
    "I will check both.\n</think>\n\nLet me look that up.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>";

void expect_two_calls(const Parsed& p, const std::string& context) {
  EXPECT_EQ(p.reasoning, "I will check both.") << context;
  EXPECT_EQ(p.content, "Let me look that up.") << context;
  ASSERT_EQ(p.tool_calls.size(), 2u) << context;
  EXPECT_EQ(p.tool_calls[0].name, "get_weather");
  EXPECT_EQ(p.tool_calls[0].arguments_json, R"({"city": "Paris", "days": 3})");
  EXPECT_EQ(p.tool_calls[1].name, "get_time");
  EXPECT_EQ(p.tool_calls[1].arguments_json, R"({"zone": "Europe/Paris"})");
}

TEST(OutputParser, ReasoningContentAndTwoCallsInOnePiece) {
  expect_two_calls(parse_all(kTwoCalls, true, kTools), "one piece");
}

TEST(OutputParser, EverySplitPointOfTwoCalls) {
  for (size_t i = 0; i <= kTwoCalls.size(); ++i) {
    expect_two_calls(parse_chunks({kTwoCalls.substr(0, i), kTwoCalls.substr(i)}, true, kTools),
                     "split at " + std::to_string(i));
  }
}

TEST(OutputParser, EveryPairOfSplitPoints) {
  for (size_t i = 0; i <= kTwoCalls.size(); i += 3) {
    for (size_t j = i; j <= kTwoCalls.size(); ++j) {
      expect_two_calls(
          parse_chunks({kTwoCalls.substr(0, i), kTwoCalls.substr(i, j - i), kTwoCalls.substr(j)}, true, kTools),
          "split at " + std::to_string(i) + "," + std::to_string(j));
    }
  }
}

TEST(OutputParser, ByteByByte) {
  std::vector<std::string> bytes;
  for (char c : kTwoCalls) bytes.emplace_back(1, c);
  expect_two_calls(parse_chunks(bytes, true, kTools), "byte by byte");
}

TEST(OutputParser, StreamingDeltasArriveEarly) {
  OutputParser parser(true, nullptr);
  EXPECT_EQ(parser.push("Think").reasoning, "Think");
  EXPECT_EQ(parser.push("ing\n").reasoning, "ing");  // the '\n' is held: it may precede </think>
  EXPECT_EQ(parser.push("more</thi").reasoning, "\nmore");
  ParsedDelta d = parser.push("nk>\n\nAnswer <");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "Answer ");
  EXPECT_EQ(parser.push("b>").content, "<b>");
  EXPECT_EQ(parser.finish().content, "");
}

TEST(OutputParser, ReasoningNewlinesFollowTheTemplateSplit) {
  Parsed p = parse_all("\n\nstep 1\n\nstep 2\n\n</think>\n\n\nThe answer\n", true);
  EXPECT_EQ(p.reasoning, "step 1\n\nstep 2");
  EXPECT_EQ(p.content, "The answer\n");
  p = parse_all("</think>only content", true);
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, "only content");
}

TEST(OutputParser, UnfinishedReasoningStaysReasoning) {
  Parsed p = parse_all("still thinking <tool_call>\n<function=f>\n</function>\n</tool_call>\n", true);
  EXPECT_EQ(p.reasoning, "still thinking <tool_call>\n<function=f>\n</function>\n</tool_call>\n");
  EXPECT_EQ(p.content, "");
  EXPECT_TRUE(p.tool_calls.empty());
  EXPECT_EQ(parse_all("ends on a partial </thi", true).reasoning, "ends on a partial </thi");
}

TEST(OutputParser, ThinkingOffIsContentFromTheStart) {
  const std::string text = "\n\nPlain </think> text with <b>tags</b> and <tool_c";
  Parsed p = parse_all(text, false);
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, text);
  p = parse_all("Sure.\n\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>", false, kTools);
  EXPECT_EQ(p.content, "Sure.");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments_json, "{}");
}

TEST(OutputParser, PartialTagHeldOnlyWhileItCouldBeATag) {
  OutputParser parser(false, nullptr);
  EXPECT_EQ(parser.push("a <too").content, "a ");
  EXPECT_EQ(parser.push("ls are").content, "<tools are");
  EXPECT_EQ(parser.push(" <tool_call").content, " ");
  EXPECT_EQ(parser.finish().content, "<tool_call");
}

TEST(OutputParser, CallIdsAreUniqueAndOpenAIShaped) {
  std::string text;
  for (int i = 0; i < 50; ++i) text += "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n";
  Parsed p = parse_all(text, false, kTools);
  ASSERT_EQ(p.tool_calls.size(), 50u);
  EXPECT_EQ(p.content, "");
  std::set<std::string> ids;
  for (const auto& call : p.tool_calls) {
    const bool alnum = std::all_of(call.id.begin() + 5, call.id.end(), [](char c) { return std::isalnum(c) != 0; });
    EXPECT_TRUE(call.id.size() == 29 && call.id.starts_with("call_") && alnum) << call.id;
    ids.insert(call.id);
  }
  EXPECT_EQ(ids.size(), 50u);
}

std::string weather_call(const std::string& param, const std::string& value) {
  return "<tool_call>\n<function=get_weather>\n<parameter=" + param + ">\n" + value +
         "\n</parameter>\n</function>\n</tool_call>";
}

std::string typed(const std::string& param, const std::string& value, const json& tools = kTools) {
  Parsed p = parse_all(weather_call(param, value), false, tools);
  EXPECT_EQ(p.tool_calls.size(), 1u) << param << "=" << value << " content: " << p.content;
  return p.tool_calls.empty() ? "" : p.tool_calls[0].arguments_json;
}

TEST(OutputParser, SchemaTypesParameters) {
  EXPECT_EQ(typed("city", "Paris"), R"({"city": "Paris"})");
  EXPECT_EQ(typed("zip", "02134"), R"({"zip": "02134"})");
  EXPECT_EQ(typed("zip", "42"), R"({"zip": "42"})");               // string schema: never parsed
  EXPECT_EQ(typed("city", "null"), R"({"city": "null"})");
  EXPECT_EQ(typed("days", "7"), R"({"days": 7})");
  EXPECT_EQ(typed("days", "seven"), R"({"days": "seven"})");       // does not parse: falls back to text
  EXPECT_EQ(typed("metric", "true"), R"({"metric": true})");
  EXPECT_EQ(typed("ratio", "0.1"), R"({"ratio": 0.1})");
  EXPECT_EQ(typed("ratio", "1e-06"), R"({"ratio": 1e-06})");
  EXPECT_EQ(typed("tags", "[\"a\", 1]"), R"({"tags": ["a", 1]})");
  EXPECT_EQ(typed("opts", "{\"deep\": {\"x\": null}}"), R"({"opts": {"deep": {"x": null}}})");
  EXPECT_EQ(typed("nothing", "null"), R"({"nothing": null})");
  EXPECT_EQ(typed("maybe", "null"), R"({"maybe": null})");
  EXPECT_EQ(typed("maybe", "5"), R"({"maybe": 5})");
  EXPECT_EQ(typed("either", "5"), R"({"either": 5})");
  EXPECT_EQ(typed("either", "[5]"), R"({"either": "[5]"})");      // array not allowed, string is
  EXPECT_EQ(typed("unit", "c"), R"({"unit": "c"})");
  EXPECT_EQ(typed("days", "\"7\""), R"({"days": "\"7\""})");       // a JSON string stays raw text
  EXPECT_EQ(typed("city", "line 1\nline 2\n"), R"({"city": "line 1\nline 2\n"})");
}

TEST(OutputParser, NoSchemaParsesNonStringJson) {
  EXPECT_EQ(typed("x", "42", nullptr), R"({"x": 42})");
  EXPECT_EQ(typed("x", "[1, {\"a\": false}]", nullptr), R"({"x": [1, {"a": false}]})");
  EXPECT_EQ(typed("x", "hello", nullptr), R"({"x": "hello"})");
  EXPECT_EQ(typed("x", "\"quoted\"", nullptr), R"({"x": "\"quoted\""})");
  EXPECT_EQ(typed("undeclared", "3", kTools), R"({"undeclared": 3})");  // known tool, unknown parameter
  EXPECT_EQ(typed("x", std::string(1000, '[') + std::string(1000, ']'), nullptr),
            "{\"x\": \"" + std::string(1000, '[') + std::string(1000, ']') + "\"}");  // too deep: text
}

TEST(OutputParser, LenientParameterEnds) {
  Parsed p = parse_all(
      "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\ntwo\n</function>\n</tool_call>", false);
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments_json, R"({"a": 1, "b": "two"})");
}

TEST(OutputParser, RepeatedParameterKeepsFirstPlaceLastValue) {
  Parsed p = parse_all("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                       "<parameter=a>\n3\n</parameter>\n</function>\n</tool_call>", false);
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments_json, R"({"a": 3, "b": 2})");
}

TEST(OutputParser, LargeCallParsesInLinearTime) {
  std::string text = "<tool_call>\n<function=f>\n";
  for (int i = 0; i < 20000; ++i) text += "<parameter=p" + std::to_string(i) + ">\nvalue\n";  // no </parameter>
  text += "</function>\n</tool_call>";
  const auto start = std::chrono::steady_clock::now();
  Parsed p = parse_chunks(split_every(text, 4096), false);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 2.0);  // a quadratic scan takes many seconds here
  ASSERT_EQ(p.tool_calls.size(), 1u);
  const std::string& args = p.tool_calls[0].arguments_json;
  EXPECT_TRUE(args.starts_with(R"({"p0": "value", "p1": "value")")) << args.substr(0, 100);
  EXPECT_TRUE(args.ends_with(R"("p19999": "value"})"));
  EXPECT_EQ(std::count(args.begin(), args.end(), ':'), 20000);
}

TEST(OutputParser, HermesJsonBody) {
  Parsed p = parse_all(
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n</tool_call>",
      false, kTools);
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].name, "get_weather");
  EXPECT_EQ(p.tool_calls[0].arguments_json, R"({"city": "Oslo", "days": 2})");
}

TEST(OutputParser, MalformedCallsStayText) {
  const std::vector<std::string> bad = {
      "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",          // no </function>
      "<tool_call>\nplain words\n</tool_call>",                                            // no <function=
      "<tool_call>\n<function=>\n</function>\n</tool_call>",                               // empty name
      "<tool_call>\n<function=f>\njunk\n</function>\n</tool_call>",                        // junk in the body
      "<tool_call>\n<function=f>\n</function>\ntrailing\n</tool_call>",                    // text after </function>
      "<tool_call>\n<function=f\n</function>\n</tool_call>",                               // name not closed
      "<tool_call>{\"arguments\": {}}</tool_call>",                                         // JSON without a name
  };
  for (const auto& call : bad) {
    const std::string text = "before\n\n" + call + "\nafter";
    Parsed p = parse_all(text, false);
    EXPECT_TRUE(p.tool_calls.empty()) << call;
    EXPECT_EQ(p.content, text) << call;
  }
}

TEST(OutputParser, UnterminatedCallIsContentAtTheEnd) {
  const std::string text = "Calling.\n\n<tool_call>\n<function=get_time>\n</function>\n";
  OutputParser parser(false, kTools);
  ParsedDelta d = parser.push(text);
  EXPECT_EQ(d.content, "Calling.");
  EXPECT_TRUE(d.tool_calls.empty());
  d = parser.finish();
  EXPECT_EQ(d.content, "\n\n<tool_call>\n<function=get_time>\n</function>\n");
  EXPECT_TRUE(d.tool_calls.empty());
}

TEST(OutputParser, TextAfterCallsIsContent) {
  Parsed p = parse_all("<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n\nDone.", false, kTools);
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.content, "Done.");
}

// What the template renders for an assistant turn parses back to the same message.
TEST(OutputParser, InvertsTheChatTemplate) {
  const json messages = json::parse(R"([
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Need data.\n\nTwo cities.",
     "tool_calls": [
       {"type": "function", "function": {"name": "get_weather",
        "arguments": {"city": "Paris", "days": 3, "metric": true, "tags": ["a", "b"], "opts": {"k": 1.5},
                      "zip": "007", "maybe": null}}},
       {"type": "function", "function": {"name": "get_time", "arguments": {}}}]}
  ])");
  ChatOptions options;
  options.add_generation_prompt = false;
  const std::string prompt = render_chat(messages, kTools, options).value();
  const std::string head = "<|im_start|>assistant\n<think>\n";
  const size_t start = prompt.find(head) + head.size();
  const std::string generated = prompt.substr(start, prompt.rfind("<|im_end|>") - start);
  Parsed p = parse_all(generated, true, kTools);
  EXPECT_EQ(p.reasoning, "Need data.\n\nTwo cities.");
  EXPECT_EQ(p.content, "Checking.");
  ASSERT_EQ(p.tool_calls.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const json& fn = messages[1]["tool_calls"][i]["function"];
    EXPECT_EQ(p.tool_calls[i].name, fn["name"].get<std::string>());
    EXPECT_EQ(p.tool_calls[i].arguments_json, hf_tojson(fn["arguments"]));
  }
}

TEST(OutputParser, DeepToolSchemaIsIgnoredNotACrash) {
  const std::string deep = std::string(5000, '[') + std::string(5000, ']');
  json tools = json::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
    "properties": {"a": {"type": "integer"}}, "x": 0}}}])");
  tools[0]["function"]["parameters"]["x"] = json::parse(deep);
  Parsed p = parse_all("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
                       false, tools);
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments_json, R"({"a": 1})");
}

// ---- Random streams ----------------------------------------------------------------------------

std::vector<std::string> random_split(const std::string& text, std::mt19937& rng) {
  std::vector<std::string> chunks;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t n = std::min(text.size() - pos, static_cast<size_t>(rng() % 7));
    chunks.push_back(text.substr(pos, n));
    pos += n;
  }
  return chunks;
}

TEST(OutputParser, RandomTextWithoutMarkersRoundTrips) {
  std::mt19937 rng(7);
  const std::string alphabet = "ab <>/\n\t{}\"=_\xc3\xa9";
  for (int iter = 0; iter < 2000; ++iter) {
    std::string text;
    const size_t len = rng() % 60;
    for (size_t i = 0; i < len; ++i) text += alphabet[rng() % alphabet.size()];
    Parsed p = parse_chunks(random_split(text, rng), false);
    if (text.find("<tool_call>") != std::string::npos) continue;  // rare, but then it is not plain text
    EXPECT_EQ(p.content, text);
    EXPECT_EQ(p.reasoning, "");
  }
}

TEST(OutputParser, RandomStreamsNeverDependOnChunking) {
  std::mt19937 rng(11);
  const std::vector<std::string> pieces = {
      "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=f>", "</function>",
      "<parameter=days>", "<parameter=city>", "</parameter>", "</think>", "<think>", "\n", "\n\n", " ",
      "3", "Paris", "{\"a\": [1]}", "<", "</", "<tool", "</think", "é", "x", "null", "{\"name\": \"g\"}"};
  for (int iter = 0; iter < 3000; ++iter) {
    std::string text;
    const size_t n = rng() % 25;
    for (size_t i = 0; i < n; ++i) text += pieces[rng() % pieces.size()];
    const bool in_reasoning = rng() % 2;
    const Parsed whole = parse_all(text, in_reasoning, kTools);
    expect_same(parse_chunks(random_split(text, rng), in_reasoning, kTools), whole, text);
    // Nothing is invented: every output byte comes from the input.
    EXPECT_LE(whole.reasoning.size() + whole.content.size(), text.size());
  }
}

TEST(OutputParser, ArbitraryBytesNeverCrash) {
  std::mt19937 rng(3);
  for (int iter = 0; iter < 500; ++iter) {
    std::string text;
    const size_t len = rng() % 200;
    for (size_t i = 0; i < len; ++i) text += static_cast<char>(rng() % 256);
    if (rng() % 3 == 0) text.insert(rng() % (text.size() + 1), "<tool_call>\n<function=f>\n<parameter=a>\n");
    Parsed p = parse_chunks(random_split(text, rng), rng() % 2, kTools);
    EXPECT_LE(p.reasoning.size() + p.content.size(), text.size());
  }
}

}  // namespace
}  // namespace lily
