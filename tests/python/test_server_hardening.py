"""Attacks on `lily serve` (the real binary, the tiny model): bodies that used to kill or stall it, SIGTERM with
streams in flight, cross-site and DNS-rebinding requests, idle-connection floods, and the per-request limits.
Run: LILY_BIN=build/lily python3 tests/python/test_server_hardening.py [TEST_NAME...]"""
import json
import os
import socket
import sys
import time

from lily_harness import LilyServer, Runner, main_guard, make_tiny_model, sse_events

KEY = "sk-hardening"
SIGTERM_ROUNDS = int(os.environ.get("LILY_SIGTERM_ROUNDS", "100"))
GRACE_S = float(os.environ.get("LILY_SIGTERM_GRACE", "0.5"))


def raw(port, data, timeout=10, read=True):
    """Sends raw bytes on a fresh connection; returns everything the server sent until it closed (or timeout)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(data)
        out = b""
        if not read:
            return out
        while True:
            try:
                part = s.recv(65536)
            except socket.timeout:
                break
            if not part:
                break
            out += part
        return out
    finally:
        s.close()


def status_of(response):
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else None


def body_of(response):
    return response.split(b"\r\n\r\n", 1)[1]


def post(port, path, body, headers=None):
    h = {"Host": "127.0.0.1:%d" % port, "Content-Type": "application/json", "Connection": "close"}
    h.update(headers or {})
    data = body if isinstance(body, bytes) else body.encode()
    head = "POST %s HTTP/1.1\r\n" % path + "".join("%s: %s\r\n" % kv for kv in h.items())
    head += "Content-Length: %d\r\n\r\n" % len(data)
    return raw(port, head.encode() + data, timeout=60)


def chat_body(model, **extra):
    b = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    b.update(extra)
    return json.dumps(b)


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- 1: numbers that overflow a double --------------------------------------------------------------------------

def number_overflow_is_a_400(model):
    for args in ([], ["--api-key", KEY]):
        s = LilyServer(model, "--quiet", *args).start()
        try:
            auth = {"Authorization": "Bearer " + KEY} if args else {}
            name = "tiny"
            for path in ("/v1/chat/completions", "/v1/completions", "/apply-template"):
                for literal in ("1e400", "-1e309"):
                    body = '{"model": "%s", "prompt": "x", "messages": [{"role": "user", "content": "hi"}], ' \
                           '"temperature": %s}' % (name, literal)
                    r = post(s.port, path, body, auth)
                    assert status_of(r) == 400, (path, literal, r[:300])
                    err = json.loads(body_of(r))["error"]
                    assert literal in err["message"] and "overflows a double" in err["message"], err
                    assert err["code"] == "invalid_json", err
            assert s.proc.poll() is None, "the server died"
            assert s.request("GET", "/health")[0] == 200
        finally:
            s.kill()


# --- 2: SIGTERM with streams in flight or just finished --------------------------------------------------------

def open_stream(port, model, max_tokens):
    b = {"model": model, "messages": [{"role": "user", "content": "hello"}], "stream": True}
    if max_tokens:
        b["max_tokens"] = max_tokens
    body = json.dumps(b)
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  "Content-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
    return sock


def read_until(sock, marker):
    buf = b""
    while marker not in buf:
        part = sock.recv(65536)
        if not part:
            break
        buf += part
    return buf


def sigterm_round(model, in_flight, i):
    s = LilyServer(model, "--quiet", "--shutdown-grace", ("%g" % GRACE_S), "--served-model-name", "tiny").start()
    sock = None
    try:
        sock = open_stream(s.port, "tiny", None if in_flight else 2)
        read_until(sock, b"data: " if in_flight else b"data: [DONE]")
        t0 = time.time()
        s.proc.send_signal(15)
        try:
            code = s.proc.wait(timeout=GRACE_S + 1)
        except Exception:  # noqa: BLE001 - reported as the failure it is
            raise AssertionError("round %d: no exit %.1f s after SIGTERM (stream in flight: %s)" %
                                 (i, GRACE_S + 1, in_flight))
        assert code == 0, "round %d: exit status %s" % (i, code)
        return time.time() - t0
    finally:
        if sock:
            sock.close()
        s.kill()


def sigterm_with_streams_exits(model):
    worst = 0
    for i in range(SIGTERM_ROUNDS):
        worst = max(worst, sigterm_round(model, i % 2 == 0, i))
    print("  %d SIGTERMs, %d exits with status 0, slowest exit %.2f s" % (SIGTERM_ROUNDS, SIGTERM_ROUNDS, worst))


TESTS = {
    "number_overflow_is_a_400": number_overflow_is_a_400,
    "sigterm_with_streams_exits": sigterm_with_streams_exits,
}


def main():
    model = make_tiny_model()
    runner = Runner()
    names = sys.argv[1:] or list(TESTS)
    for name in names:
        runner.run(name, lambda: TESTS[name](model))
    return runner.finish()


if __name__ == "__main__":
    main_guard(main)
