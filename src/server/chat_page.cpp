#include "server/chat_page.h"

namespace lily {

const ChatPageAsset* find_chat_page_asset(std::string_view path) {
  if (path == "/index.html") path = "/";
  for (size_t i = 0; i < kChatPageAssetCount; ++i) {
    if (kChatPageAssets[i].path == path) return &kChatPageAssets[i];
  }
  return nullptr;
}

const HttpHeaders& chat_page_headers() {
  // connect-src 'self': the page talks to this server only. img-src allows data: URLs (the favicon) and no
  // remote images, so a markdown image in an answer cannot call out.
  static const HttpHeaders headers = {
      {"Content-Security-Policy",
       "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"},
      {"X-Content-Type-Options", "nosniff"},
      {"X-Frame-Options", "DENY"},
      {"Referrer-Policy", "no-referrer"},
      {"Cache-Control", "no-cache"},
  };
  return headers;
}

}  // namespace lily
