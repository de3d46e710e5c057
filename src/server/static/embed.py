#!/usr/bin/env python3
"""Writes src/server/chat_page.cpp from index.html and chat.js (run after editing either; no build step needed:
the C++ file is committed). tests/server/test_chat_page.cpp fails when the two are out of step."""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = [("kChatPageHtml", "index.html", "lily_html"), ("kChatPageJs", "chat.js", "lily_js")]

out = ["// Generated from src/server/static/ by src/server/static/embed.py; do not edit by hand.",
       '#include "server/server.h"', "", "namespace lily {", ""]
for name, filename, delim in PARTS:
    text = open(os.path.join(HERE, filename), encoding="utf-8").read()
    assert ")" + delim + '"' not in text, filename
    out.append('const char* const %s = R"%s(%s)%s";' % (name, delim, text, delim))
    out.append("")
out.append("}  // namespace lily")
with open(os.path.join(HERE, "..", "chat_page.cpp"), "w", encoding="utf-8") as f:
    f.write("\n".join(out) + "\n")
