// SHA-256 against the FIPS 180-4 / NIST example vectors, across block boundaries and in uneven pieces.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "common/temp_dir.h"
#include "util/sha256.h"

namespace lily {
namespace {

std::string sha_of(const std::string& s) {
  Sha256 h;
  h.update(s.data(), s.size());
  return h.hex_digest();
}

TEST(Sha256, NistVectors) {
  EXPECT_EQ(sha_of(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha_of("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha_of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha_of(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, PiecesEqualWhole) {
  std::string text;
  for (int i = 0; i < 300; ++i) text += static_cast<char>(i * 7 + 3);
  for (size_t len : {55u, 56u, 63u, 64u, 65u, 119u, 128u, 300u}) {
    const std::string s = text.substr(0, len);
    Sha256 h;
    for (size_t i = 0; i < s.size(); i += 13) h.update(s.data() + i, std::min<size_t>(13, s.size() - i));
    EXPECT_EQ(h.hex_digest(), sha_of(s)) << len;
  }
}

TEST(Sha256, File) {
  testing::TempDir dir("sha256");
  std::ofstream(dir / "f", std::ios::binary) << "abc";
  EXPECT_EQ(sha256_file(dir / "f"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_file(dir / "missing"), "");
}

}  // namespace
}  // namespace lily
