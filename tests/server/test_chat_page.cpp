// The chat page compiled into lily is the one in src/server/static/ plus Debian's marked and highlight.js
// (CMake generates chat_page.cpp from them), and it is served with a policy that allows no inline script.
// The page's behaviour (markdown, sanitising, storage) is tested in headless Chromium:
// tests/python/test_chat_page.py.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "server/chat_page.h"

namespace lily {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string asset(std::string_view path) {
  const ChatPageAsset* a = find_chat_page_asset(path);
  return a ? std::string(a->body) : "(none at " + std::string(path) + ")";
}

TEST(ChatPage, EmbeddedMatchesStaticFiles) {
  const std::string dir = std::string(LILY_SOURCE_DIR) + "/src/server/static/";
  for (const char* file : {"index.html", "chat.css", "chat.js", "render.js", "store.js"}) {
    const std::string path = std::string("/") + file;
    EXPECT_EQ(asset(path == "/index.html" ? "/" : path), read_file(dir + file))
        << file << ": reconfigure (cmake) after editing the page";
  }
  EXPECT_EQ(asset("/index.html"), asset("/"));
}

TEST(ChatPage, EveryFileTheHtmlLoadsIsServedWithItsType) {
  const std::string html = asset("/");
  for (const char* path :
       {"vendor/highlight.css", "chat.css", "vendor/marked.js", "vendor/highlight.js", "chat.js"}) {
    EXPECT_NE(html.find(std::string("\"") + path + "\""), std::string::npos) << path;
    const ChatPageAsset* a = find_chat_page_asset(std::string("/") + path);
    ASSERT_NE(a, nullptr) << path;
    EXPECT_EQ(a->content_type, std::string_view(path).ends_with(".css") ? "text/css; charset=utf-8"
                                                                        : "text/javascript; charset=utf-8");
  }
  EXPECT_EQ(find_chat_page_asset("/")->content_type, "text/html; charset=utf-8");
  EXPECT_EQ(find_chat_page_asset("/vendor/nope.js"), nullptr);
  EXPECT_EQ(find_chat_page_asset("/chat.js/"), nullptr);
}

TEST(ChatPage, HasNoInlineScriptOrStyle) {
  // The policy below forbids them: they would not run, so the page must not need them.
  const std::string html = asset("/");
  EXPECT_EQ(html.find("<style"), std::string::npos);
  EXPECT_EQ(html.find(" style="), std::string::npos);
  EXPECT_FALSE(std::regex_search(html, std::regex(R"(\son[a-z]+\s*=)"))) << "an inline event handler";
  size_t at = 0, scripts = 0;
  while ((at = html.find("<script", at)) != std::string::npos) {
    EXPECT_NE(html.substr(at, html.find('>', at) - at).find(" src=\""), std::string::npos)
        << html.substr(at, 60);
    EXPECT_EQ(html.find("></script>", at), html.find('>', at)) << "a script with a body";
    ++at, ++scripts;
  }
  EXPECT_EQ(scripts, 3u);  // marked, highlight.js, and chat.js (a module, which imports the rest)
}

TEST(ChatPage, ServedWithAPolicyThatAllowsOnlyItsOwnScripts) {
  std::string csp;
  for (const auto& [name, value] : chat_page_headers()) {
    if (name == "Content-Security-Policy") csp = value;
  }
  EXPECT_NE(csp.find("default-src 'none'"), std::string::npos) << csp;
  EXPECT_NE(csp.find("script-src 'self'"), std::string::npos) << csp;
  EXPECT_NE(csp.find("connect-src 'self'"), std::string::npos) << csp;
  EXPECT_NE(csp.find("frame-ancestors 'none'"), std::string::npos) << csp;
  EXPECT_EQ(csp.find("unsafe"), std::string::npos) << csp;
}

TEST(ChatPage, BundlesMarkedAndHighlightJs) {
  ASSERT_TRUE(kChatPageRendersMarkdown)
      << "lily was configured without libjs-marked / libjs-highlight.js (scripts/install_deps.sh)";
  EXPECT_NE(asset("/vendor/marked.js").find("marked"), std::string::npos);
  EXPECT_NE(asset("/vendor/highlight.js").find("hljs"), std::string::npos);
  EXPECT_NE(asset("/vendor/highlight.css").find(".hljs"), std::string::npos);
}

TEST(ChatPage, UsesTheStreamingApi) {
  const std::string js = asset("/chat.js");
  EXPECT_NE(js.find("v1/chat/completions"), std::string::npos);
  EXPECT_NE(js.find("stream: true"), std::string::npos);
  EXPECT_NE(js.find("reasoning_content"), std::string::npos);
}

}  // namespace
}  // namespace lily
