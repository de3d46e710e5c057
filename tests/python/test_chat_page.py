"""The chat page of `lily serve` (tiny model) in headless Chromium, driven over the DevTools protocol:
- the page and its files come with their types and a Content-Security-Policy, and the page loads without an
  error or a policy violation;
- a real round trip: a typed message streams its answer (seen at several lengths) with the reasoning in a
  collapsible block; a second turn with thinking off resumes from the session cache;
- a reload keeps the conversation (localStorage), "New chat" clears the log and lists the old one, which
  opens again from the list, and can be deleted;
- rendering, on an assistant message put into the page's storage (the tiny model writes random text): markdown
  becomes elements, code is highlighted and has a working Copy button, and `<img onerror>`, `<script>` and a
  javascript: link are shown as text or dropped, never run (checked with the page's CSP bypassed, so the
  sanitiser alone is tested);
- the store drops the oldest conversations when the storage is full and skips unreadable ones.

usage: LILY_BIN=build/lily python3 tests/python/test_chat_page.py [--screenshot docs/chat_page.png]
"""
import argparse
import http.client
import json
import os
import tempfile
import time

from chromium import Chromium
from lily_harness import LilyServer, Runner, main_guard, make_tiny_model

LAST = "[...document.querySelectorAll('.msg.assistant')].pop()"
STORE = "lily.conversations.v1"

CODE = 'def greet(name: str) -> str:\n    """Say hello."""\n    return f"Hello, {name}!"\n'
DEMO_ANSWER = (
    "Here is a **bold** claim, some `inline code`, and the two steps:\n\n"
    "1. parse the request\n2. stream the answer\n\n"
    "```python\n" + CODE + "```\n\n"
    "| backend | decode tok/s |\n|---|---|\n| cpu | 12 |\n| cuda | 140 |\n\n"
    "Raw HTML stays text: <img src=x onerror=\"window.__xss = 'img'\"> and "
    "<script>window.__xss = 'script'</script>, a [bad link](javascript:window.__xss='link') "
    "and a [good one](https://example.org/docs).")
DEMO = {"id": "demo", "title": "", "updated": int(time.time() * 1000), "messages": [
    {"role": "user", "content": "Show me <b>markdown</b> & code"},
    {"role": "assistant", "content": DEMO_ANSWER,
     "reasoning_content": "The user wants <b>markup</b>; <script>window.__xss = 'reasoning'</script> keep it short.",
     "stats": "stop · 80 tokens · 61.2 tok/s · prompt 21 (0 cached) · first token 35 ms"}]}


def check_headers(server):
    status, body = server.request("GET", "/")
    assert status == 200 and b'src="chat.js"' in body, (status, body[:200])
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for path, kind in (("/", "text/html"), ("/chat.js", "text/javascript"), ("/render.js", "text/javascript"),
                       ("/store.js", "text/javascript"), ("/chat.css", "text/css"),
                       ("/vendor/marked.js", "text/javascript"), ("/vendor/highlight.js", "text/javascript"),
                       ("/vendor/highlight.css", "text/css")):
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        headers = dict((k.lower(), v) for k, v in r.getheaders())
        assert r.status == 200 and headers["content-type"].startswith(kind), (path, r.status, headers)
        assert len(body) > 100, (path, body)
        csp = headers.get("content-security-policy", "")
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe" not in csp, (path, csp)
        assert headers.get("x-content-type-options") == "nosniff", headers
    conn.close()
    status, _ = server.request("GET", "/vendor/other.js")
    assert status == 404, status


def load(b, port):
    b.open("http://127.0.0.1:%d/" % port)
    b.wait_for("document.getElementById('status').className === 'ok'", what="the page to connect")
    assert b.eval("typeof marked === 'object' && typeof hljs === 'object'"), \
        "the page has no marked/highlight.js: lily was built without libjs-marked or libjs-highlight.js"
    assert not b.problems(), b.problems()


def round_trip(b):
    b.eval("document.getElementById('max-tokens').value = '40'")
    b.type_and_enter("#input", "Hello lily! What can you do?")
    # Watch the answer grow: a streamed answer is seen at several lengths before it is complete.
    lengths, deadline, state = set(), time.time() + 120, None
    while time.time() < deadline:
        state = b.eval("(() => { const m = %s; if (!m) return null; return {n: m.querySelector('.body')"
                       ".textContent.length, done: m.querySelector('.stats').textContent}; })()" % LAST)
        if state:
            lengths.add(state["n"])
            if state["done"]:
                break
        time.sleep(0.01)
    assert state and state["done"], "the answer never finished"
    assert len([n for n in lengths if n > 0]) >= 3, "not streamed: lengths seen %s" % sorted(lengths)
    assert b.eval("%s.querySelector('details.think .text').textContent" % LAST), "no reasoning shown"
    b.eval("(e => { e.value = 'off'; e.dispatchEvent(new Event('change')); })(document.getElementById('thinking'))")
    b.type_and_enter("#input", "Now answer without thinking, please.")
    b.wait_for("document.querySelectorAll('.msg.assistant').length === 2 && %s.querySelector('.stats')"
               ".textContent !== ''" % LAST, timeout=120, what="the second answer")
    stats = b.eval("%s.querySelector('.stats').textContent" % LAST)
    assert b.eval("%s.querySelector('.answer').textContent" % LAST), "no answer text"
    assert "cached" in stats and "(0 cached)" not in stats, stats
    stored = json.loads(b.eval("localStorage.getItem('%s')" % STORE))
    assert len(stored) == 1 and [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"] * 2, stored
    assert stored[0]["messages"][0]["content"] == "Hello lily! What can you do?", stored


def texts(b):
    return b.eval("[...document.querySelectorAll('#log .msg')].map(m => m.querySelector('.body').textContent)")


def reload_and_new_chat(b):
    before = texts(b)
    assert len(before) == 4, before
    b.reload()
    b.wait_for("document.querySelectorAll('#log .msg').length === 4", what="the conversation after a reload")
    assert texts(b) == before, (texts(b), before)
    assert b.eval("document.getElementById('thinking').value") == "off", "settings not kept"
    assert b.eval("document.querySelector('#conversations li.active .title').textContent") == \
        "Hello lily! What can you do?"
    b.click("#new-chat")
    b.wait_for("document.querySelectorAll('#log .msg').length === 0 && !!document.getElementById('empty')",
               what="New chat to clear the log")
    assert b.eval("document.querySelectorAll('#conversations li').length") == 1
    assert b.eval("document.querySelectorAll('#conversations li.active').length") == 0
    b.reload()  # the new chat is empty, so the reload shows it, and the list still holds the old one
    b.wait_for("!!document.getElementById('empty') && document.querySelectorAll('#conversations li').length === 1")
    b.click("#conversations li .open")
    b.wait_for("document.querySelectorAll('#log .msg').length === 4", what="the old conversation from the list")
    assert texts(b) == before


def rendering(b):
    b.send("Page.setBypassCSP", {"enabled": True})  # so only the page's own sanitising stands between
    b.reload()
    b.wait_for("document.getElementById('status').className === 'ok'")
    b.eval("localStorage.setItem('%s', JSON.stringify([%s].concat(JSON.parse(localStorage.getItem('%s')))));"
           "localStorage.setItem('lily.current', 'demo')" % (STORE, json.dumps(DEMO), STORE))
    b.reload()
    b.wait_for("document.querySelectorAll('#log .msg').length === 2", what="the injected conversation")
    time.sleep(0.5)  # an onerror would have fired by now
    answer = "document.querySelector('.msg.assistant .answer')"
    assert b.eval("window.__xss === undefined"), "model output ran: " + str(b.eval("window.__xss"))
    found = b.eval("(() => { const a = %s; const q = (s) => a.querySelectorAll(s).length; return {"
                   "strong: q('strong'), li: q('ol > li'), code: q('p code'), table: q('table td'),"
                   "pre: q('.codeblock pre code.hljs.language-python'), spans: q('pre code span[class^=hljs-]'),"
                   "keyword: [...a.querySelectorAll('pre .hljs-keyword')].map(s => s.textContent),"
                   "label: a.querySelector('.codebar span').textContent, copy: q('.codebar button.copy'),"
                   "bad: q('#log img, #log script, #log [onerror]'),"
                   "links: [...a.querySelectorAll('a')].map(l => [l.textContent, l.getAttribute('href'), l.target]),"
                   "text: a.textContent}; })()" % answer)
    assert found["strong"] == 1 and found["li"] == 2 and found["code"] == 1 and found["table"] == 4, found
    assert found["pre"] == 1 and found["spans"] >= 3 and "def" in found["keyword"], found
    assert found["label"] == "python" and found["copy"] == 1, found
    assert found["bad"] == 0, found
    assert "<img src=x onerror=\"window.__xss = 'img'\">" in found["text"], found["text"]
    assert "<script>window.__xss = 'script'</script>" in found["text"], found["text"]
    assert found["links"] == [["good one", "https://example.org/docs", "_blank"]], found["links"]
    assert "bad link" in found["text"], found["text"]
    user = b.eval("document.querySelector('.msg.user .body').textContent")
    assert user == "Show me <b>markdown</b> & code", user
    assert b.eval("document.querySelectorAll('.msg.user b').length") == 0
    assert b.eval("!document.querySelector('details.think').open"), "the reasoning of a finished answer is open"
    assert "<script>" in b.eval("document.querySelector('details.think .text').textContent")
    b.click(".codeblock .copy")
    b.wait_for("document.querySelector('.codeblock .copy').textContent === 'Copied'", what="the Copy button")
    copied = b.eval("navigator.clipboard.readText()", await_promise=True)
    assert copied == CODE.rstrip("\n"), repr(copied)
    b.send("Page.setBypassCSP", {"enabled": False})


STORE_CHECK = """(async () => {
  const { Store } = await import('/store.js');
  const mem = new Map();
  const full = { getItem: (k) => mem.has(k) ? mem.get(k) : null,
                 setItem(k, v) { if (v.length > 3000) throw new DOMException('full', 'QuotaExceededError');
                                 mem.set(k, v); } };
  const store = new Store(full);
  const dropped = [];
  for (let i = 0; i < 10; ++i)
    dropped.push(store.save({ id: 'c' + i, messages: [{ role: 'user', content: 'x'.repeat(500) + i }] }));
  const kept = store.list().map((c) => c.id);
  store.save({ id: 'empty', messages: [] });
  mem.set('lily.conversations.v1', '{not json');
  const afterCorruption = store.list().length;
  mem.set('lily.conversations.v1', JSON.stringify([{ id: 'ok', messages: [] }, { id: 'bad', messages: [{}] }]));
  return { dropped, kept, afterCorruption, filtered: store.list().map((c) => c.id) };
})()"""


def storage_limits(b):
    r = b.eval(STORE_CHECK, await_promise=True)
    assert r["kept"][0] == "c9" and 3 <= len(r["kept"]) < 10, r  # newest first, the oldest dropped to fit
    assert r["kept"] == ["c%d" % i for i in range(9, 9 - len(r["kept"]), -1)], r
    assert sum(r["dropped"]) > 0 and r["dropped"][0] == 0, r
    assert r["afterCorruption"] == 0 and r["filtered"] == ["ok"], r


def no_problems(b):
    assert not b.problems(), b.problems()


def delete_conversation(b):
    n = b.eval("document.querySelectorAll('#conversations li').length")
    b.eval("document.querySelector('#conversations li.active .delete').click()")
    b.wait_for("document.querySelectorAll('#conversations li').length === %d && !!document.getElementById('empty')"
               % (n - 1), what="the conversation to be deleted")
    assert b.eval("JSON.parse(localStorage.getItem('%s')).every(c => c.id !== 'demo')" % STORE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--screenshot", help="also save a screenshot of the rendered conversation (docs/chat_page.png)")
    a = ap.parse_args()
    model = make_tiny_model()
    server = LilyServer(model, "--ctx-size", "4096", "--quiet", "--served-model-name", "qwen3.6-tiny-random")
    runner = Runner()
    b = None
    try:
        server.start()
        runner.run("chat page: files and security headers", lambda: check_headers(server))
        b = Chromium()
        b.grant_clipboard("http://127.0.0.1:%d" % server.port)
        steps = [("loads without errors", lambda: load(b, server.port)),
                 ("streams a real answer, second turn cached", lambda: round_trip(b)),
                 ("reload keeps the conversation, New chat clears it", lambda: reload_and_new_chat(b)),
                 ("markdown, highlighted code, Copy; model HTML never runs", lambda: rendering(b))]
        for name, fn in steps:
            runner.run("chat page: " + name, fn)
        out = a.screenshot or os.path.join(tempfile.mkdtemp(prefix="lily_page_"), "chat_page.png")
        runner.run("chat page: screenshot", lambda: print("  screenshot %s (%d bytes)" % (out, b.screenshot(out))))
        runner.run("chat page: delete a conversation", lambda: delete_conversation(b))
        runner.run("chat page: full or corrupt storage", lambda: storage_limits(b))
        runner.run("chat page: no errors or policy violations", lambda: no_problems(b))
    finally:
        if b:
            b.close()
        server.stop()
        server.kill()
    return runner.finish()


if __name__ == "__main__":
    main_guard(main)
