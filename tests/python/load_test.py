"""Load test of `lily serve` on the tiny model (CPU backend); takes minutes, so it is not part of `make test`.

1. reference: every request spec is run alone (streaming, seeded sampling) and its text recorded;
2. load: N concurrent streaming clients (default 32) for D seconds (default 120) cycle through the specs; every
   stream must equal its reference exactly (no lost, duplicated or interleaved tokens) and no request may fail;
3. disconnect storm: many clients start streams and vanish (before, during, and while queued); afterwards the
   server must be healthy, idle, and still give the reference answers.
RSS is sampled throughout. Prints the figures and 'N passed, M failed'; exits non-zero on any failure.

usage: LILY_BIN=build/lily python3 tests/python/load_test.py [--clients 32] [--duration 120] [--storm 96]
"""
import argparse
import json
import random
import socket
import statistics
import threading
import time

import openai
from lily_harness import LilyServer, Runner, main_guard, make_tiny_model

N_SPECS = 48
MAX_TOKENS = 16


def spec(i):
    return dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=1000 + i,
                messages=[{"role": "system", "content": "You are terse."},
                          {"role": "user", "content": "Request %d: tell me about the number %d." % (i, i * 7)}])


def run_stream(client, args):
    """(text, ttft_s, total_s, usage) of one streamed chat completion."""
    t0 = time.time()
    ttft, parts, usage = None, [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage:
            usage = chunk.usage
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        piece = (getattr(d, "reasoning_content", None) or "") + (d.content or "")
        if piece and ttft is None:
            ttft = time.time() - t0
        parts.append(piece)
    return "".join(parts), ttft, time.time() - t0, usage


def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


class LoadTest:
    def __init__(self, server, clients, duration, storm):
        self.s, self.n_clients, self.duration, self.storm = server, clients, duration, storm
        self.base = "http://127.0.0.1:%d/v1" % server.port
        self.refs = {}
        self.figures = {}

    def client(self):
        return openai.OpenAI(base_url=self.base, api_key="none", max_retries=0, timeout=600)

    def reference(self):
        c = self.client()
        for i in range(N_SPECS):
            text, _, _, usage = run_stream(c, spec(i))
            assert text and usage.completion_tokens >= 1, (i, usage)
            self.refs[i] = text
        # Run alone twice: the second run resumes from the session cache and must not change a thing.
        for i in range(4):
            assert run_stream(c, spec(i))[0] == self.refs[i], i
        self.figures["rss_kib_after_reference"] = self.s.rss_kib()

    def load(self):
        lock = threading.Lock()
        latencies, ttfts, errors, mismatches, tokens = [], [], [], [], [0]
        rss_samples = []
        stop_at = time.time() + self.duration

        def worker(k):
            c = self.client()
            n = 0
            while time.time() < stop_at:
                i = (k + n * self.n_clients) % N_SPECS
                n += 1
                try:
                    text, ttft, total, usage = run_stream(c, spec(i))
                except Exception as e:  # noqa: BLE001 - every failure counts
                    with lock:
                        errors.append(repr(e))
                    continue
                with lock:
                    latencies.append(total)
                    ttfts.append(ttft if ttft is not None else total)
                    tokens[0] += usage.completion_tokens if usage else 0
                    if text != self.refs[i]:
                        mismatches.append((i, text[:80], self.refs[i][:80]))

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(self.n_clients)]
        t0 = time.time()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            rss_samples.append(self.s.rss_kib())
            for t in threads:
                t.join(timeout=5)
                break
        for t in threads:
            t.join()
        wall = time.time() - t0
        m = self.s.metrics()
        self.figures.update({
            "clients": self.n_clients, "duration_s": round(wall, 1), "requests": len(latencies),
            "errors": len(errors), "mismatches": len(mismatches), "completion_tokens": tokens[0],
            "tokens_per_s": round(tokens[0] / wall, 1),
            "latency_p50_s": round(percentile(latencies, 50), 3), "latency_p99_s": round(percentile(latencies, 99), 3),
            "ttft_p50_s": round(percentile(ttfts, 50), 3), "ttft_p99_s": round(percentile(ttfts, 99), 3),
            "rss_kib_during_min": min(rss_samples), "rss_kib_during_max": max(rss_samples),
            "rss_kib_after_load": self.s.rss_kib(),
            "server_decode_tok_s_last": m.get("lily_decode_tokens_per_second"),
            "session_cache_entries": m.get("lily_session_cache_entries"),
            "session_cache_bytes": m.get("lily_session_cache_bytes"),
        })
        if errors:
            print("first errors:", errors[:3])
        if mismatches:
            print("first mismatches:", mismatches[:3])
        assert not errors and not mismatches, (len(errors), len(mismatches))
        assert len(latencies) >= self.n_clients, len(latencies)

    def open_stream(self, i):
        body = json.dumps(dict(spec(i), stream=True)).encode()
        sock = socket.create_connection(("127.0.0.1", self.s.port), timeout=60)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return sock

    def disconnect_storm(self):
        before = self.s.metrics()
        rng = random.Random(7)
        socks = []
        for k in range(self.storm):
            sock = self.open_stream(k % N_SPECS)
            mode = rng.choice(["now", "soon", "after_some"])
            socks.append((sock, mode))
            if mode == "now":
                sock.close()
        time.sleep(0.5)
        for sock, mode in socks:
            if mode == "soon":
                sock.close()
        for sock, mode in socks:  # read a little of a few streams, then vanish
            if mode == "after_some":
                sock.settimeout(0.05)
                try:
                    sock.recv(4096)
                except OSError:
                    pass
                sock.close()
        deadline = time.time() + 120
        while True:
            m = self.s.metrics()
            if m["lily_queue_depth"] == 0 and m["lily_requests_running"] == 0:
                break
            assert time.time() < deadline, "the server did not drain after the storm"
            time.sleep(0.05)
        after = self.s.metrics()
        status, body = self.s.request("GET", "/health")
        assert status == 200, (status, body)
        c = self.client()
        for i in range(3):
            assert run_stream(c, spec(i))[0] == self.refs[i], i
        key = 'lily_requests_total{endpoint="/v1/chat/completions",status="499"}'
        self.figures.update({
            "storm_clients": self.storm,
            "storm_dropped_while_queued": after["lily_dropped_requests_total"] - before["lily_dropped_requests_total"],
            "storm_recorded_499": after.get(key, 0) - before.get(key, 0),
            "storm_tokens_generated": after["lily_completion_tokens_total"] - before["lily_completion_tokens_total"],
            "rss_kib_after_storm": self.s.rss_kib(),
        })


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=120)
    ap.add_argument("--storm", type=int, default=96)
    a = ap.parse_args()
    model = make_tiny_model()
    server = LilyServer(model, "--ctx-size", "2048", "--max-queue", "256", "--quiet", "--served-model-name", "tiny")
    runner = Runner()
    try:
        server.start()
        t = LoadTest(server, a.clients, a.duration, a.storm)
        t.figures["rss_kib_at_start"] = server.rss_kib()
        runner.run("reference (each request alone)", t.reference)
        if t.refs:
            runner.run("load (%d clients, %.0f s)" % (a.clients, a.duration), t.load)
            runner.run("disconnect storm (%d clients)" % a.storm, t.disconnect_storm)

        def clean_exit():
            code = server.stop()
            assert code == 0, code
        runner.run("clean exit on SIGTERM", clean_exit)
        print(json.dumps(t.figures, indent=1))
    finally:
        server.kill()
    return runner.finish()


if __name__ == "__main__":
    main_guard(main)
