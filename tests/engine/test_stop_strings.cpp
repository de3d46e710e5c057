// StopMatcher tests: hand-written cases for splitting, holding back and overlaps, plus a property test: any
// split of a text into pieces gives the output of a direct reference scan of the whole text.
#include "engine/stop_strings.h"

#include <gtest/gtest.h>

#include <random>

namespace lily {
namespace {

// Feeds pieces, then flush(); returns everything emitted. `outputs` gets each push's return value.
std::string run(StopMatcher& m, const std::vector<std::string>& pieces,
                std::vector<std::string>* outputs = nullptr) {
  std::string all;
  for (const auto& p : pieces) {
    std::string out = m.push(p);
    if (outputs) outputs->push_back(out);
    all += out;
  }
  all += m.flush();
  return all;
}

// The reference: cut the whole text before the stop that ends first (ties: starts first).
std::string reference(const std::string& text, const std::vector<std::string>& stops) {
  size_t best_start = std::string::npos, best_end = std::string::npos;
  for (const auto& s : stops) {
    const size_t pos = text.find(s);
    if (pos == std::string::npos) continue;
    if (pos + s.size() < best_end || (pos + s.size() == best_end && pos < best_start)) {
      best_start = pos;
      best_end = pos + s.size();
    }
  }
  return best_start == std::string::npos ? text : text.substr(0, best_start);
}

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const size_t n = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

TEST(StopMatcher, PassesTextThroughWithoutStops) {
  StopMatcher none({});
  EXPECT_EQ(none.push("Hello"), "Hello");
  EXPECT_EQ(none.push(", world"), ", world");
  EXPECT_EQ(none.flush(), "");
  EXPECT_FALSE(none.stopped());
}

TEST(StopMatcher, IncludeStopKeepsTheMatchedStringAndDropsTheRest) {
  StopMatcher m({"</answer>", "END"}, /*include_stop=*/true);
  EXPECT_EQ(m.push("text </ans"), "text ");
  EXPECT_EQ(m.push("wer> after"), "</answer>");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched_stop(), 0u);
  EXPECT_EQ(m.push("more"), "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, StopSplitOverThreePiecesIsNeverEmitted) {
  StopMatcher m({"</answer>"});
  std::vector<std::string> outputs;
  const std::string all = run(m, {"The result is 42</an", "sw", "er> and more", " text"}, &outputs);
  EXPECT_EQ(all, "The result is 42");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched_stop(), 0u);
  ASSERT_EQ(outputs.size(), 4u);
  EXPECT_EQ(outputs[0], "The result is 42");  // the text before the stop goes out at once...
  EXPECT_EQ(outputs[1], "");                  // ...the partial stop is held...
  EXPECT_EQ(outputs[2], "");                  // ...and never released; what follows is dropped
  EXPECT_EQ(outputs[3], "");
  EXPECT_EQ(m.push("again"), "");
}

TEST(StopMatcher, HeldPrefixIsReleasedWhenItCannotMatch) {
  StopMatcher m({"abc"});
  EXPECT_EQ(m.push("xa"), "x");
  EXPECT_EQ(m.held(), "a");
  EXPECT_EQ(m.push("b"), "");
  EXPECT_EQ(m.push("d"), "abd");
  EXPECT_EQ(m.push("ab"), "");
  EXPECT_EQ(m.flush(), "ab");  // end of generation: a held prefix is real text
  EXPECT_FALSE(m.stopped());
}

TEST(StopMatcher, StopAtTheVeryStart) {
  StopMatcher m({"STOP"});
  EXPECT_EQ(m.push("STOP"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.flush(), "");
  StopMatcher split({"STOP"});
  EXPECT_EQ(run(split, {"S", "TO", "Pafter"}), "");
  EXPECT_TRUE(split.stopped());
}

TEST(StopMatcher, OverlappingStopsCutAtTheFirstToComplete) {
  // "bc" completes (at byte 4) before "abcd" could (byte 5): cut before "bc".
  StopMatcher a({"abcd", "bc"});
  EXPECT_EQ(run(a, {"xabcd"}), "xa");
  EXPECT_EQ(a.matched_stop(), 1u);
  // Same answer however the text is split.
  StopMatcher b({"abcd", "bc"});
  EXPECT_EQ(run(b, {"x", "a", "b", "c", "d"}), "xa");
  // Both complete at the same byte: the longer one (earlier start) cuts.
  StopMatcher c({"bc", "abc"});
  EXPECT_EQ(run(c, {"xab", "c"}), "x");
  EXPECT_EQ(c.matched_stop(), 1u);
  // A stop that overlaps itself: "aab" inside "aaab".
  StopMatcher d({"aab"});
  EXPECT_EQ(run(d, {"a", "a", "a", "b"}), "a");
  // One stop is a prefix of another: the shorter completes first.
  StopMatcher e({"end of text", "end"});
  EXPECT_EQ(run(e, {"the en", "d of text"}), "the ");
  EXPECT_EQ(e.matched_stop(), 1u);
}

TEST(StopMatcher, MultiByteTextIsNeverCut) {
  // Stop "é!" (C3 A9 21); "é" alone is held, then released whole when "?" follows.
  StopMatcher m({"\xC3\xA9!"});
  EXPECT_EQ(m.push("caf\xC3\xA9"), "caf");
  EXPECT_EQ(m.push("?"), "\xC3\xA9?");
  EXPECT_EQ(m.push("\xC3\xA9"), "");
  EXPECT_EQ(m.push("!"), "");
  EXPECT_TRUE(m.stopped());

  // Byte-level pieces (a code point split over pushes) come out only as whole code points.
  const std::string text = "naïve 日本語 text 🙂 done 日本!";
  StopMatcher bytes({"本!", "xyz"});
  std::string all;
  for (char byte : text) {
    const std::string out = bytes.push(std::string(1, byte));
    EXPECT_TRUE(valid_utf8(out)) << "split code point in output";
    all += out;
  }
  all += bytes.flush();
  EXPECT_EQ(all, "naïve 日本語 text 🙂 done 日");
}

TEST(StopMatcher, AnySplitGivesTheReferenceOutput) {
  const std::vector<std::string> stops = {"<|im_end|>", "\n\nUser:", "ab", "bca", "Ü", "<tool_call>", "tool"};
  const std::vector<std::string> texts = {
      "plain text with no stop at all",
      "answer: 42<|im_end|> trailing",
      "first line\n\nUser: second",
      "xxbcab",  // "bca" ends at 5, "ab" at 6 (its first match starts at 4)
      "<|im_end",
      "grüße Übermorgen",
      "\n\nUser",
      "call <tool_call> now",  // "tool" completes first: output "call <", whatever the split
  };
  std::mt19937_64 gen(9);
  for (const auto& text : texts) {
    const std::string want = reference(text, stops);
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<std::string> pieces;  // random cut points, on code-point boundaries
      std::string current;
      for (size_t i = 0; i < text.size(); ++i) {
        current += text[i];
        const bool boundary =
            i + 1 == text.size() || (static_cast<unsigned char>(text[i + 1]) & 0xC0) != 0x80;
        if (boundary && gen() % 3 == 0) pieces.push_back(std::exchange(current, std::string()));
      }
      if (!current.empty()) pieces.push_back(current);
      StopMatcher m(stops);
      std::vector<std::string> outputs;
      ASSERT_EQ(run(m, pieces, &outputs), want) << "text: " << text << ", trial " << trial;
      for (const auto& out : outputs) EXPECT_TRUE(valid_utf8(out));
    }
  }
}

}  // namespace
}  // namespace lily
