// Parts of the tokenizer on their own: UTF-8 repair, the regex rewrite, the NFC fast path, the
// added-token flags on a tiny tokenizer.json (reference ids from `tokenizers`, see
// tools/reference/tokenizer_ids.py), the public accessors and StreamDecoder edge cases.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tokenizer/pretokenize.h"
#include "tokenizer/pretokenize_utf8.h"
#include "tokenizer/tokenizer.h"

namespace lily {
namespace {

using json = nlohmann::json;

const std::string kFixtureDir = std::string(LILY_SOURCE_DIR) + "/tests/fixtures/tokenizer/";
const std::string kQwen3Path = std::string(LILY_FIXTURES_DIR) + "/qwen3-tokenizer/tokenizer.json";

std::string lossy(std::string_view bytes) {
  std::string out;
  append_utf8_lossy(out, bytes);
  return out;
}

TEST(TokenizerUtf8, LossyReplacesMaximalSubparts) {
  // Same answers as Python's bytes.decode("utf-8", "replace").
  EXPECT_EQ(lossy("abc"), "abc");
  EXPECT_EQ(lossy("a\x80z"), "a\uFFFDz");
  EXPECT_EQ(lossy("\xE2\x82("), "\uFFFD(");             // truncated 3-byte sequence: one U+FFFD
  EXPECT_EQ(lossy("\xF0\x9F\x98"), "\uFFFD");           // truncated at the end: one U+FFFD
  EXPECT_EQ(lossy("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");  // surrogate: each byte
  EXPECT_EQ(lossy("\xC0\x80"), "\uFFFD\uFFFD");         // overlong
  EXPECT_EQ(lossy("\xF4\x90\x80\x80"), "\uFFFD\uFFFD\uFFFD\uFFFD");  // above U+10FFFF
  EXPECT_EQ(lossy("\xE1\x80\xE1\x80\x80"), "\uFFFD\xE1\x80\x80");
  EXPECT_TRUE(is_valid_utf8(std::string("a\0b", 3)));
  EXPECT_FALSE(is_valid_utf8("\xC3"));
}

TEST(TokenizerUtf8, CompletePrefixKeepsAnIncompleteTail) {
  std::string out;
  EXPECT_EQ(append_utf8_complete(out, "ab\xF0\x9F\x98"), 2u);
  EXPECT_EQ(out, "ab");
  out.clear();
  EXPECT_EQ(append_utf8_complete(out, "\xF0\x9F\x98\x80"), 4u);
  EXPECT_EQ(out, "\U0001F600");
  out.clear();
  EXPECT_EQ(append_utf8_complete(out, "\xC3(x"), 3u);  // the C3 can no longer complete
  EXPECT_EQ(out, "\uFFFD(x");
}

TEST(TokenizerRegex, RewritesWhiteSpaceAndCaselessGroups) {
  Result<std::string> p = pcre2_pattern_from_hf(R"((?i:'s|'t)|[^\s\p{L}]+|\s+(?!\S))");
  ASSERT_TRUE(p.ok()) << p.status().message();
  const std::string ws = R"(\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
  EXPECT_EQ(*p, "(?:'[sS]|'[tT])|[^" + ws + R"(\p{L}]+|[)" + ws + "]+(?![^" + ws + "])");
  EXPECT_FALSE(pcre2_pattern_from_hf(R"([^\S])").ok());
  EXPECT_FALSE(pcre2_pattern_from_hf("(?i)abc").ok());
  EXPECT_FALSE(pcre2_pattern_from_hf("[abc").ok());
}

TEST(TokenizerRegex, SplitIsolatedKeepsTheTextBetweenMatches) {
  Result<SplitRegex> r = SplitRegex::compile(R"(\d+)");
  ASSERT_TRUE(r.ok()) << r.status().message();
  std::vector<std::string_view> pieces;
  r->split("ab12cd345", &pieces);
  EXPECT_EQ(pieces, (std::vector<std::string_view>{"ab", "12", "cd", "345"}));
  pieces.clear();
  r->split("", &pieces);
  EXPECT_TRUE(pieces.empty());
}

TEST(TokenizerNfc, InertCodePointsAreUnchangedByNfc) {
  // Over every code point: the fast path may only skip code points that NFC leaves alone, also
  // after an 'a' (nothing composes onto them) and before an acute accent (no reordering past them).
  int n_inert = 0;
  for (char32_t cp = 0; cp <= 0x10FFFF; ++cp) {
    if ((cp >= 0xD800 && cp <= 0xDFFF) || !nfc_inert(cp)) continue;
    ++n_inert;
    std::string s;
    append_code_point(s, cp);
    ASSERT_EQ(nfc_normalize(s), s) << std::hex << static_cast<uint32_t>(cp);
    ASSERT_EQ(nfc_normalize("a" + s), "a" + s) << std::hex << static_cast<uint32_t>(cp);
  }
  EXPECT_GT(n_inert, 100000);
  EXPECT_FALSE(nfc_inert(0x0301));  // combining acute
  EXPECT_FALSE(nfc_inert(0x1161));  // Hangul vowel jamo (composes with a leading consonant)
  EXPECT_FALSE(nfc_inert(0x212A));  // KELVIN SIGN -> K
}

TEST(TokenizerNfc, NormalizerOnlyRewritesSpansAroundMarks) {
  Result<Normalizer> n = Normalizer::from_json(json{{"type", "NFC"}});
  ASSERT_TRUE(n.ok());
  std::string storage;
  const std::string text = "caf" "e\xCC\x81" " \xE4\xB8\xAD \xE1\x84\x92\xE1\x85\xA1 x\xE2\x84\xAA";
  EXPECT_EQ(n->apply(text, &storage), nfc_normalize(text));
  EXPECT_EQ(nfc_normalize(text), "caf\xC3\xA9 \xE4\xB8\xAD \xED\x95\x98 xK");
  const std::string plain = "plain \xE4\xB8\xAD text";
  EXPECT_EQ(n->apply(plain, &storage).data(), plain.data());  // untouched: no copy
}

class SyntheticTokenizer : public ::testing::Test {
 protected:
  static json fixture() {
    std::ifstream file(kFixtureDir + "synthetic.json");
    return json::parse(file);
  }
};

TEST_F(SyntheticTokenizer, AddedTokenFlagsMatchTokenizers) {
  json doc = fixture();
  Result<Tokenizer> t = Tokenizer::from_json_string(doc["tokenizer"].dump());
  ASSERT_TRUE(t.ok()) << t.status().message();
  ASSERT_GE(doc["cases"].size(), 15u);
  for (const json& c : doc["cases"]) {
    EXPECT_EQ(t->encode(c["text"].get<std::string>()), c["ids"].get<std::vector<int32_t>>()) << c["text"].dump();
  }
  EXPECT_TRUE(t->is_special(t->token_id("<A>")));
  EXPECT_FALSE(t->is_special(t->token_id("<AB>")));
  EXPECT_EQ(t->decode(t->encode("e\xCC\x81t\xC3\xA9 <A>")), "\xC3\xA9t\xC3\xA9<A>");  // <A> ate the space
}

TEST_F(SyntheticTokenizer, PairMergesEqualStringMerges) {
  json doc = fixture()["tokenizer"];
  json pairs = json::array();
  for (const json& m : doc["model"]["merges"]) {
    std::string s = m.get<std::string>();
    pairs.push_back({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  doc["model"]["merges"] = pairs;
  Result<Tokenizer> t = Tokenizer::from_json_string(doc.dump());
  ASSERT_TRUE(t.ok()) << t.status().message();
  for (const json& c : fixture()["cases"]) {
    EXPECT_EQ(t->encode(c["text"].get<std::string>()), c["ids"].get<std::vector<int32_t>>()) << c["text"].dump();
  }
}

TEST_F(SyntheticTokenizer, IgnoreMergesTakesWholeWordsFromTheVocab) {
  json doc = fixture()["tokenizer"];
  doc["model"]["vocab"]["hellx"] = 500;  // reachable by no merge
  Result<Tokenizer> plain = Tokenizer::from_json_string(doc.dump());
  doc["model"]["ignore_merges"] = true;
  Result<Tokenizer> ignoring = Tokenizer::from_json_string(doc.dump());
  ASSERT_TRUE(plain.ok() && ignoring.ok());
  EXPECT_EQ(plain->encode("hellx"), (std::vector<int32_t>{plain->token_id("hell"), 'x'}));
  EXPECT_EQ(ignoring->encode("hellx"), std::vector<int32_t>{500});
}

const Tokenizer& qwen3() {
  static const Tokenizer tokenizer = std::move(Tokenizer::load(kQwen3Path)).value();
  return tokenizer;
}

TEST(TokenizerApi, AccessorsOnQwen3) {
  const Tokenizer& t = qwen3();
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_EQ(t.token_id("<|im_start|>"), 151644);
  EXPECT_EQ(t.token_id("<think>"), 151667);
  EXPECT_EQ(t.token_id("hello"), 14990);
  EXPECT_EQ(t.token_id("Ġworld"), 1879);
  EXPECT_EQ(t.token_id("no-such-token-xyz"), -1);
  EXPECT_EQ(t.token_text(151645), "<|im_end|>");
  EXPECT_EQ(t.token_text(1879), "Ġworld");
  EXPECT_EQ(t.token_bytes(1879), " world");
  EXPECT_EQ(t.token_text(-1), "");
  EXPECT_EQ(t.token_text(10'000'000), "");
  EXPECT_TRUE(t.is_special(151643));
  EXPECT_FALSE(t.is_special(151667));  // <think> is an added token but not special
  EXPECT_FALSE(t.is_special(14990));
  EXPECT_EQ(t.encode("hello world"), (std::vector<int32_t>{14990, 1879}));
  EXPECT_TRUE(t.encode("").empty());
  EXPECT_EQ(t.decode({14990, -5, 99999999, 1879}), "hello world");  // unknown ids decode to nothing
  Tokenizer copy = t;  // a cheap handle
  Tokenizer moved = std::move(copy);
  EXPECT_EQ(moved.encode("<think>"), std::vector<int32_t>{151667});
}

// The token that decodes to exactly this one byte (every byte-level vocab has one per byte).
int32_t single_byte_token(const Tokenizer& t, unsigned char byte) {
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    if (t.token_bytes(id) == std::string(1, static_cast<char>(byte))) return id;
  }
  return -1;
}

TEST(TokenizerStream, HoldsBackPartialCodePoints) {
  const Tokenizer& t = qwen3();
  const std::string emoji = "\U0001F600";
  std::vector<int32_t> byte_ids;
  for (unsigned char b : emoji) byte_ids.push_back(single_byte_token(t, b));
  ASSERT_EQ(byte_ids.size(), 4u);
  StreamDecoder stream(t);
  EXPECT_EQ(stream.push(byte_ids[0]), "");
  EXPECT_EQ(stream.push(byte_ids[1]), "");
  EXPECT_EQ(stream.push(byte_ids[2]), "");
  EXPECT_EQ(stream.push(byte_ids[3]), emoji);
  EXPECT_EQ(stream.flush(), "");

  StreamDecoder cut(t);
  EXPECT_EQ(cut.push(byte_ids[0]), "");
  EXPECT_EQ(cut.push(byte_ids[1]), "");
  EXPECT_EQ(cut.push(t.token_id("<think>")), "\uFFFD<think>");  // the cut sequence can't complete
  EXPECT_EQ(cut.push(byte_ids[0]), "");
  EXPECT_EQ(cut.flush(), "\uFFFD");
  EXPECT_EQ(cut.flush(), "");
}

}  // namespace
}  // namespace lily
