"""Shared by the server's Python tests: write the tiny model, start `lily serve` on a free port, always stop it,
raw HTTP helpers, and a small runner that prints 'N passed, M failed'."""
import atexit
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

LILY_BIN = os.environ.get("LILY_BIN", "build/lily")
LILY_BACKEND = os.environ.get("LILY_BACKEND", "cpu")  # the servers' --backend (cuda: the same tests on the GPU)
_live = []  # servers to kill if the script dies


@atexit.register
def _kill_leftovers():
    for s in list(_live):
        s.kill()


def make_tiny_model():
    """A random-weight tiny checkpoint in a temporary directory (removed at exit)."""
    d = tempfile.mkdtemp(prefix="lily_tiny_")
    atexit.register(shutil.rmtree, d, True)
    out = os.path.join(d, "tiny")
    subprocess.run([LILY_BIN, "synth", "--preset", "tiny", "--layout", "mlx", "--out", out], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    return out


class LilyServer:
    def __init__(self, model, *args):
        self.model, self.args = model, list(args)
        self.proc, self.port, self.lines = None, None, []
        self.first_health = None  # (status, body) of the first /health answer: 503 "loading" while it loads
        self._reader = None

    def start(self, timeout=90):
        cmd = [LILY_BIN, "serve", "--model", self.model, "--port", "0", "--backend", LILY_BACKEND] + self.args
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _live.append(self)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.time() + timeout
        while self.port is None:
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("lily serve did not start:\n" + "\n".join(self.lines))
            time.sleep(0.02)
        while True:
            status, body = self.request("GET", "/health")
            if self.first_health is None and status is not None:
                self.first_health = (status, json.loads(body))
            if status == 200:
                return self
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("lily serve did not become ready:\n" + "\n".join(self.lines))
            time.sleep(0.05)

    def _read(self):
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            m = re.search(r"listening on http://[^:]+:(\d+)/", line)
            if m:
                self.port = int(m.group(1))

    def request(self, method, path, body=None, headers=None, timeout=60):
        """(status, bytes) of one request on a fresh connection; body may be bytes, str or a JSON value."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if body is not None and not isinstance(body, (bytes, str)):
                body = json.dumps(body)
            if isinstance(body, str):
                body = body.encode()
            h = {"Content-Type": "application/json"}
            h.update(headers or {})
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            return r.status, r.read()
        except ConnectionError:
            return None, b""
        finally:
            conn.close()

    def metrics(self):
        status, body = self.request("GET", "/metrics")
        assert status == 200, status
        values = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stop(self, sig=signal.SIGTERM, timeout=30):
        """Signals the server and waits for it; returns its exit code (kills it after `timeout`)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError("lily serve did not exit within %d s of the signal" % timeout)

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self in _live:
            _live.remove(self)

    def rss_kib(self):
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0


class Runner:
    def __init__(self):
        self.passed, self.failed = 0, 0

    def run(self, name, fn):
        t0 = time.time()
        try:
            fn()
            self.passed += 1
            print("PASS %s (%.1f s)" % (name, time.time() - t0), flush=True)
        except Exception:  # noqa: BLE001 - any failure is reported and counted
            self.failed += 1
            print("FAIL %s (%.1f s)" % (name, time.time() - t0), flush=True)
            traceback.print_exc()

    def finish(self):
        print("%d passed, %d failed" % (self.passed, self.failed), flush=True)
        return 0 if self.failed == 0 else 1


def sse_events(raw):
    """Splits an SSE body into its `data:` payloads, checking that nothing but well-formed events is there."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), repr(text[-50:])
    events = text[:-2].split("\n\n")
    out = []
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, repr(e)
        out.append(e[len("data: "):])
    return out


def run_model_tests(tests):
    """Runs tests[name](tiny model) for the names on the command line (all by default); returns the exit status."""
    model = make_tiny_model()
    runner = Runner()
    for name in sys.argv[1:] or list(tests):
        runner.run(name, lambda: tests[name](model))
    return runner.finish()


def main_guard(fn):
    try:
        rc = fn()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print("0 passed, 1 failed")
        rc = 1
    _kill_leftovers()
    sys.exit(rc)
