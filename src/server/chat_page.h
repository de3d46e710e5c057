// The chat page at `/`: its files (src/server/static/ and the markdown and highlighting libraries from
// Debian's libjs-marked and libjs-highlight.js), compiled in by CMake (build/generated/chat_page.cpp), and
// the headers they are served with. The Content-Security-Policy allows scripts, styles and requests from the
// server itself only, and no inline script or style: model output that slipped past the page's sanitiser
// still could not run.
#pragma once
#include <cstddef>
#include <string_view>

#include "server/http.h"

namespace lily {

struct ChatPageAsset {
  std::string_view path;          // "/", "/chat.js", "/vendor/marked.js", ...
  std::string_view content_type;  // with its charset
  std::string_view body;
};

// Generated: every file of the page, and whether the markdown libraries were found at build time (else the
// vendor files are comments and the page shows answers as plain text).
extern const ChatPageAsset kChatPageAssets[];
extern const size_t kChatPageAssetCount;
extern const bool kChatPageRendersMarkdown;

// The asset at a request path ("/index.html" is "/"); nullptr when the path is not one of the page's.
const ChatPageAsset* find_chat_page_asset(std::string_view path);

// Content-Security-Policy, nosniff, no framing, no referrer, and revalidation on each load.
const HttpHeaders& chat_page_headers();

}  // namespace lily
