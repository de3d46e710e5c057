// The chat page compiled into lily is the one in src/server/static/ (CMake generates chat_page.cpp from it).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "server/server.h"

namespace lily {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(ChatPage, EmbeddedMatchesStaticFiles) {
  const std::string dir = std::string(LILY_SOURCE_DIR) + "/src/server/static/";
  EXPECT_EQ(std::string(kChatPageHtml), read_file(dir + "index.html"))
      << "reconfigure (cmake) after editing the page";
  EXPECT_EQ(std::string(kChatPageJs), read_file(dir + "chat.js"))
      << "reconfigure (cmake) after editing the page";
}

TEST(ChatPage, UsesTheStreamingApi) {
  const std::string js = kChatPageJs;
  EXPECT_NE(js.find("v1/chat/completions"), std::string::npos);
  EXPECT_NE(js.find("stream: true"), std::string::npos);
  EXPECT_NE(js.find("reasoning_content"), std::string::npos);
  EXPECT_NE(std::string(kChatPageHtml).find("<script src=\"chat.js\">"), std::string::npos);
}

}  // namespace
}  // namespace lily
