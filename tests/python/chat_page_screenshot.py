"""Drives the chat page of `lily serve` (tiny model) in headless Chromium: types a message, sends it with Enter,
checks that the answer arrives in pieces (streamed) with its reasoning in a collapsible block, sends a second turn
with thinking off, and saves a screenshot to docs/chat_page.png. Chromium is driven over the DevTools protocol on
a pipe (--remote-debugging-pipe), so nothing beyond the standard library is needed. Not part of `make test`.

usage: LILY_BIN=build/lily python3 tests/python/chat_page_screenshot.py [--out docs/chat_page.png]
"""
import argparse
import base64
import json
import os
import shutil
import subprocess
import time

from lily_harness import LilyServer, Runner, main_guard, make_tiny_model


class Chromium:
    """The DevTools protocol over --remote-debugging-pipe: JSON messages separated by NUL bytes on fds 3 and 4."""

    def __init__(self, width=1200, height=860):
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        assert exe, "chromium is not installed (apt-get install chromium)"
        to_child_r, self.to_child = os.pipe()
        self.from_child, from_child_w = os.pipe()

        def wire():  # in the child, before exec: the protocol pipes become fds 3 and 4
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             "--window-size=%d,%d" % (width, height), "--hide-scrollbars", "about:blank"],
            pass_fds=(3, 4), preexec_fn=wire, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self.next_id, self.buf, self.session = 0, b"", None

    def send(self, method, params=None, session=True, timeout=30):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            while b"\0" not in self.buf:
                assert time.time() < deadline, "no answer to " + method
                chunk = os.read(self.from_child, 1 << 20)
                assert chunk, "chromium exited"
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                assert "error" not in reply, (method, reply["error"])
                return reply.get("result", {})

    def open(self, url):
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        self.send("Page.enable")
        self.send("Page.navigate", {"url": url})

    def eval(self, expression):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        return r["result"].get("value")

    def wait_for(self, expression, timeout=60, what=None):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.eval(expression):
                return
            time.sleep(0.05)
        raise AssertionError("timed out waiting for " + (what or expression))

    def type_and_enter(self, selector, text):
        self.eval("document.querySelector(%s).focus()" % json.dumps(selector))
        self.send("Input.insertText", {"text": text})
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", {"type": kind, "key": "Enter", "code": "Enter",
                                                 "windowsVirtualKeyCode": 13, "text": "\r" if kind == "keyDown" else ""})

    def screenshot(self, path):
        png = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            f.write(png)
        return len(png)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


LAST = "[...document.querySelectorAll('.msg.assistant')].pop()"


def drive(port, out):
    b = Chromium()
    try:
        b.open("http://127.0.0.1:%d/" % port)
        b.wait_for("document.getElementById('status').className === 'ok'", what="the page to connect")
        b.eval("document.getElementById('max-tokens').value = '40'")
        b.type_and_enter("#input", "Hello lily! What can you do?")
        # Watch the answer grow: a streamed answer is seen at several lengths before it is complete.
        lengths, deadline = set(), time.time() + 120
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
        reasoning = b.eval("%s.querySelector('details.think .text').textContent" % LAST)
        assert reasoning, "no reasoning shown"
        assert b.eval("%s.querySelector('details.think').tagName === 'DETAILS'" % LAST)
        # Second turn with thinking off: a plain answer, and the first turn's prefix comes from the session cache.
        b.eval("document.getElementById('thinking').value = 'off'")
        b.type_and_enter("#input", "Now answer without thinking, please.")
        b.wait_for("document.querySelectorAll('.msg.assistant').length === 2 && %s.querySelector('.stats')"
                   ".textContent !== ''" % LAST, timeout=120, what="the second answer")
        answer = b.eval("%s.querySelector('.answer').textContent" % LAST)
        stats = b.eval("%s.querySelector('.stats').textContent" % LAST)
        assert answer, "no answer text"
        assert "cached" in stats, stats
        size = b.screenshot(out)
        print("  screenshot %s (%d bytes); stats of the second answer: %s" % (out, size, stats))
    finally:
        b.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/chat_page.png")
    a = ap.parse_args()
    model = make_tiny_model()
    server = LilyServer(model, "--ctx-size", "4096", "--quiet", "--served-model-name", "qwen3.6-tiny-random")
    runner = Runner()
    try:
        server.start()
        runner.run("chat page in headless chromium", lambda: drive(server.port, a.out))
    finally:
        server.stop()
        server.kill()
    return runner.finish()


if __name__ == "__main__":
    main_guard(main)
