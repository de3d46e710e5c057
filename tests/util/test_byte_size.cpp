// --cache-disk-budget's sizes: units, case, and what is refused.
#include "util/byte_size.h"

#include <gtest/gtest.h>

namespace lily {
namespace {

TEST(ByteSize, ParsesBinaryUnits) {
  EXPECT_EQ(*parse_byte_size("4096"), 4096u);
  EXPECT_EQ(*parse_byte_size("20G"), 20ull << 30);
  EXPECT_EQ(*parse_byte_size("20g"), 20ull << 30);
  EXPECT_EQ(*parse_byte_size("512MiB"), 512ull << 20);
  EXPECT_EQ(*parse_byte_size("64kb"), 64ull << 10);
  EXPECT_EQ(*parse_byte_size("1.5T"), 3ull << 39);
  EXPECT_EQ(*parse_byte_size("10B"), 10u);
}

TEST(ByteSize, RefusesWhatIsNotASize) {
  for (const char* bad : {"", "G", "-1G", "20X", "20 G", "20GG", "1e30T", "abc"}) {
    Result<uint64_t> r = parse_byte_size(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("is not a size"), std::string::npos) << r.status().message();
  }
}

TEST(ByteSize, Formats) {
  EXPECT_EQ(format_byte_size(512), "512 B");
  EXPECT_EQ(format_byte_size(16ull << 30), "16.0 GiB");
}

}  // namespace
}  // namespace lily
