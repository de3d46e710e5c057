"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe), standard library only.
Events (console messages, exceptions, CSP reports) are kept in `events` for the tests to check."""
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time


class Chromium:
    """The DevTools protocol over --remote-debugging-pipe: JSON messages separated by NUL bytes on fds 3 and 4."""

    def __init__(self, width=1200, height=860):
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        assert exe, "chromium is not installed (scripts/install_deps.sh installs it)"
        to_child_r, self.to_child = os.pipe()
        self.from_child, from_child_w = os.pipe()
        self.profile = tempfile.mkdtemp(prefix="lily_chromium_")

        def wire():  # in the child, before exec: the protocol pipes become fds 3 and 4
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--remote-debugging-pipe", "--user-data-dir=" + self.profile, "--no-first-run", "--window-size=%d,%d" % (width, height),
             "--hide-scrollbars", "about:blank"],
            pass_fds=(3, 4), preexec_fn=wire, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self.next_id, self.buf, self.session, self.events = 0, b"", None, []

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
            if "method" in reply:
                self.events.append(reply)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError("%s: %s" % (method, reply["error"]))
                return reply.get("result", {})

    def open(self, url):
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(domain + ".enable")
        self.send("Page.navigate", {"url": url})

    def grant_clipboard(self, origin):
        self.send("Browser.grantPermissions", {"origin": origin,
                                               "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
                  session=False)

    def eval(self, expression, await_promise=False):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": await_promise})
        if "exceptionDetails" in r:
            raise RuntimeError("%s: %s" % (expression[:80], r["exceptionDetails"].get("text")))
        return r["result"].get("value")

    def wait_for(self, expression, timeout=60, what=None):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if self.eval(expression):
                    return
            except RuntimeError:  # the page is navigating, or not ready yet
                pass
            time.sleep(0.05)
        raise AssertionError("timed out waiting for " + (what or expression))

    def reload(self):
        self.send("Page.reload", {"ignoreCache": True})

    def type_and_enter(self, selector, text):
        self.eval("document.querySelector(%s).focus()" % json.dumps(selector))
        self.send("Input.insertText", {"text": text})
        self.key("Enter", 13, "\r")

    def key(self, name, code, text=""):
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", {"type": kind, "key": name, "code": name,
                                                 "windowsVirtualKeyCode": code,
                                                 "text": text if kind == "keyDown" else ""})

    def click(self, selector):
        """A real mouse click at the middle of the element (the page's own handlers run, as for a person)."""
        box = self.eval("(() => { const r = document.querySelector(%s).getBoundingClientRect(); "
                        "return [r.x + r.width / 2, r.y + r.height / 2]; })()" % json.dumps(selector))
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})

    def problems(self):
        """Console errors, uncaught exceptions and policy violations seen so far."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                out.append("exception: " + json.dumps(p.get("exceptionDetails", {}))[:400])
            elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") == "error":
                out.append("console.error: " + json.dumps(p.get("args"))[:400])
            elif e["method"] == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append("log: " + p["entry"].get("text", "")[:400])
        return out

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
        shutil.rmtree(self.profile, ignore_errors=True)
