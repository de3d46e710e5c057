// parse_json_body (src/server/json_body.cpp): the same tree as json::parse (key order, duplicates: last
// wins), linear time on objects of many keys, a 400 naming an overflowing number instead of an exception,
// nesting refused while parsing, and a parse that stops once the client has gone.
#include <chrono>
#include <string>

#include <gtest/gtest.h>

#include "server/chat_request.h"

namespace lily {
namespace {

TEST(JsonBodyParser, SameTreeAsJsonParse) {
  const char* bodies[] = {
      R"({"model":"m","messages":[{"role":"user","content":"hi"}],"x":[1,-2,3.5,1e300,true,null,{}],"y":{}})",
      R"({"b":1,"a":2,"c":{"z":[[],[{}]],"e":"\u00e9\ud83d\ude00"},"n":18446744073709551615,"i":-9223372036854775808})",
  };
  for (const char* b : bodies) {
    json out;
    ASSERT_FALSE(parse_json_body(b, out)) << b;
    EXPECT_EQ(out.dump(), json::parse(b).dump()) << b;
  }
}

TEST(JsonBodyParser, DuplicateKeysLastWinsInFirstPositionSmallAndLarge) {
  for (int n : {3, 40}) {  // below and above the size where an object gets its key index
    std::string b = "{";
    for (int i = 0; i < n; ++i) b += "\"k" + std::to_string(i) + "\":" + std::to_string(i) + ",";
    b += "\"k1\":\"again\",\"k0\":{\"k0\":1,\"k0\":2}}";
    json out;
    ASSERT_FALSE(parse_json_body(b, out));
    EXPECT_EQ(out.dump(), json::parse(b).dump());
    EXPECT_EQ(out.size(), static_cast<size_t>(n));
    EXPECT_EQ(out["k1"], "again");
    EXPECT_EQ(out["k0"]["k0"], 2);
  }
}

TEST(JsonBodyParser, NumbersBeyondADoubleAreA400NamingThem) {
  for (const char* lit : {"1e400", "-1e309", "123456789e999"}) {
    for (std::string b : {std::string("{\"temperature\":") + lit + "}",
                          std::string("{\"messages\":[{\"content\":[") + lit + "]}]}"}) {
      json out;
      MaybeError e;
      ASSERT_NO_THROW(e = parse_json_body(b, out)) << b;  // before: json::parse threw out_of_range.406
      ASSERT_TRUE(e) << b;
      EXPECT_EQ(e->status, 400);
      EXPECT_EQ(e->code, "invalid_json");
      EXPECT_NE(e->message.find(std::string("`") + lit + "`"), std::string::npos) << e->message;
      EXPECT_NE(e->message.find("overflows a double"), std::string::npos) << e->message;
    }
  }
  json out;
  EXPECT_FALSE(
      parse_json_body(R"({"t": 1e-400, "u": 1.7e308})", out));  // underflow is 0; the largest is fine
}

TEST(JsonBodyParser, NestingIsLimitedWhileParsing) {
  json out;
  std::string ok = std::string(63, '[') + std::string(63, ']');
  EXPECT_FALSE(parse_json_body("{\"a\":" + ok + "}", out));
  std::string deep = "{\"a\":" + std::string(64, '[') + std::string(64, ']') + "}";
  MaybeError e = parse_json_body(deep, out);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("nests deeper than 64"), std::string::npos) << e->message;
  // A million open brackets: refused at the 65th, not after building them.
  e = parse_json_body("{\"a\":" + std::string(1000000, '['), out);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("nests deeper"), std::string::npos) << e->message;
}

// Before: nlohmann's DOM parser inserted each key with a linear search (ordered_map::operator[]): 150,000
// keys cost ~29 s. A complexity bug, so the bound is generous: linear is ~0.1 s here.
double parse_and_validate_seconds(const std::string& body, ChatRequest& chat) {
  auto t0 = std::chrono::steady_clock::now();
  json out;
  EXPECT_FALSE(parse_json_body(body, out));
  EXPECT_FALSE(parse_chat_request(out, ServedModel{"tiny", 151936, 2048}, chat));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(JsonBodyParser, ManyKeysParseAndValidateInLinearTime) {
  std::string head = R"({"model":"tiny","messages":[{"role":"user","content":"hi"}])";
  std::string keys = head, bias = head + ",\"logit_bias\":{";
  for (int i = 0; i < 150000; ++i) keys += ",\"k" + std::to_string(i) + "\":" + std::to_string(i);
  for (int i = 0; i < 150000; ++i) bias += (i ? ",\"" : "\"") + std::to_string(i % 1000) + "\":1";
  keys += "}", bias += "}}";
  // The quadratic key search this replaced took ~29 s on these bodies, the linear parser ~0.3 s: the bound tells
  // the two apart with room for a loaded 2-core machine (0.52 s was seen under a parallel build).
  constexpr double kBoundSeconds = 5.0;
  ChatRequest chat;
  double s = parse_and_validate_seconds(keys, chat);
  EXPECT_LT(s, kBoundSeconds) << keys.size() << " bytes";  // 150,000 unknown fields
  s = parse_and_validate_seconds(bias, chat);  // 150,000 entries of one field, duplicates among them
  EXPECT_LT(s, kBoundSeconds) << bias.size() << " bytes";
  EXPECT_EQ(chat.sampling.params.logit_bias.size(), 1000u);
}

TEST(JsonBodyParser, StopsOnceTheClientHasGone) {
  std::string b = "{\"a\":[";
  for (int i = 0; i < 1000000; ++i) b += "1,";
  b += "1]}";
  int asked = 0;
  json out;
  MaybeError e = parse_json_body(b, out, [&] { return ++asked >= 2; });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->status, 499);
  EXPECT_EQ(e->code, "client_gone");
  EXPECT_EQ(asked, 2);  // asked every 16384 values: it stopped at the second, not after a million
}

}  // namespace
}  // namespace lily
