// ByteReader's bounds checks and XXH64 against the reference implementation's values.
#include "util/byte_io.h"

#include <gtest/gtest.h>

#include <string>

namespace lily {
namespace {

TEST(XxHash64, MatchesTheReferenceValues) {
  EXPECT_EQ(xxhash64("", 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(xxhash64("a", 1), 0xd24ec4f1a98c6e5bull);
  EXPECT_EQ(xxhash64("abc", 3), 0x44bc2cf5ad770999ull);
  std::string s;  // 772 bytes: the 32-byte stripes, then 8-, 4- and 1-byte tails
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 256; ++i) s.push_back(static_cast<char>(i));
  s += "lily";
  EXPECT_EQ(xxhash64(s.data(), s.size()), 0xeb239125493e5ea7ull);
}

TEST(XxHash64, PiecesInAnySplitGiveTheWholeHash) {
  std::string s;
  for (int i = 0; i < 1000; ++i) s.push_back(static_cast<char>(i * 37 + (i >> 3)));
  const uint64_t whole = xxhash64(s.data(), s.size());
  for (size_t step : {1, 3, 31, 32, 33, 100, 999}) {
    Xxh64 h;
    for (size_t at = 0; at < s.size(); at += step) h.update(s.data() + at, std::min(step, s.size() - at));
    EXPECT_EQ(h.digest(), whole) << step;
  }
}

TEST(ByteIo, RoundTripAndShortReads) {
  std::vector<uint8_t> buf;
  ByteWriter w(buf);
  w.pod<uint32_t>(7);
  w.pod<int64_t>(-3);
  w.bytes("xyz", 3);
  ByteReader r(buf);
  uint32_t a = 0;
  int64_t b = 0;
  ASSERT_TRUE(r.pod(&a, "a").ok());
  ASSERT_TRUE(r.pod(&b, "b").ok());
  EXPECT_EQ(a, 7u);
  EXPECT_EQ(b, -3);
  auto v = r.view(3, "tail");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(std::string(v->begin(), v->end()), "xyz");
  Status st = r.pod(&a, "past the end");
  EXPECT_EQ(st.code(), ErrorCode::format);
  EXPECT_NE(st.message().find("past the end: 4 bytes needed, 0 left"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace lily
