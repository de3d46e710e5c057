"""Continuous batching in `lily serve --parallel N` (the real binary, the tiny model, the CPU backend): requests
streamed at once get exactly the tokens and logprobs they get alone (greedy and seeded), concurrent streams all
start before any ends, a short request behind a long stream is answered while the long one goes on, a stream
cancelled midway leaves the others untouched, --request-timeout ends each batched stream, a full queue still
answers 429, and bad --parallel values are refused. LILY_BACKEND=cuda runs it on the GPU (tests/python/lily_harness.py). Prints the time to first token of four concurrent streams with --parallel 1 and 4.
Run: LILY_BIN=build/lily python3 tests/python/test_parallel.py [TEST_NAME...]"""
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time

from lily_harness import LILY_BIN, LilyServer, main_guard, run_model_tests


def prompt(i, n=6):
    # Distinct first tokens: no two prompts share a cached prefix.
    return [1000 + 97 * i + 7 * k for k in range(n + i)]


def wait_until(cond, what, timeout=60):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.01)


def long_body(i):
    """A stream that cannot end early (min_tokens): a stop token would end a greedy one at any step."""
    return body(i, 2000, min_tokens=2000)


def body(i, max_tokens, seed=None, **extra):
    b = {"model": "tiny", "prompt": prompt(i), "max_tokens": max_tokens, "stream": True, "logprobs": 0}
    if seed is None:
        b["temperature"] = 0
    else:
        b.update({"temperature": 0.9, "top_p": 0.95, "seed": seed})
    b.update(extra)
    return b


class Stream:
    """One streamed completion on its own connection: the token pieces with their logprobs, the finish
    reason, and when the first token and the end arrived. stop_after: close the connection after that many
    tokens (the client leaves)."""

    def __init__(self, port, b, stop_after=None):
        self.port, self.body, self.stop_after = port, b, stop_after
        self.tokens, self.texts, self.finish, self.status = [], [], None, None
        self.t_start = self.t_first = self.t_end = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self.t_start = time.monotonic()
        self.thread.start()
        return self

    def join(self, timeout=300):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "a stream did not end"
        return self

    def _run(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            conn.request("POST", "/v1/completions", json.dumps(self.body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            self.status = r.status
            if r.status != 200:
                r.read()
                return
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice["text"]:
                    self.texts.append(choice["text"])
                    if self.t_first is None:
                        self.t_first = time.monotonic()
                lp = choice.get("logprobs")
                if lp:
                    self.tokens += list(zip(lp["tokens"], lp["token_logprobs"]))
                if choice.get("finish_reason"):
                    self.finish = choice["finish_reason"]
                if self.stop_after is not None and len(self.tokens) >= self.stop_after:
                    return
        finally:
            self.t_end = time.monotonic()
            conn.close()

    def ttft(self):
        return self.t_first - self.t_start


def alone_then_together(model, seeded, logprobs=True):
    with_server = LilyServer(model, "--parallel", "4", "--quiet").start()
    try:
        budgets = [4, 9, 14, 6, 11, 2, 8]
        bodies = [body(i, n, seed=(50 + i) if seeded else None) for i, n in enumerate(budgets)]
        if not logprobs:  # what a device sampler may serve (top_k <= 64, no logprobs): compare the text
            for b in bodies:
                b.pop("logprobs")
                b["top_k"] = 40
        alone = [Stream(with_server.port, b).start().join() for b in bodies]
        together = [Stream(with_server.port, b) for b in bodies]
        for s in together:
            s.start()
        for s in together:
            s.join()
        for i, (a, t) in enumerate(zip(alone, together)):
            assert a.status == t.status == 200, (a.status, t.status)
            assert a.finish == "length" and a.texts, (i, a.finish)
            assert not logprobs or len(a.tokens) == budgets[i], (i, len(a.tokens))
            assert t.tokens == a.tokens, "request %d: together %r, alone %r" % (i, t.tokens, a.tokens)
            assert t.texts == a.texts, "request %d: together %r, alone %r" % (i, t.texts, a.texts)
            assert t.finish == a.finish, (i, t.finish, a.finish)
        if seeded:  # it did sample: another seed gives other tokens
            other = Stream(with_server.port, dict(bodies[2], seed=999)).start().join()
            assert other.texts != alone[2].texts
        m = with_server.metrics()
        assert m['lily_slots{state="idle"}'] == 4 and m["lily_requests_running"] == 0, m
    finally:
        with_server.kill()


def greedy_streams_together_equal_alone(model):
    alone_then_together(model, seeded=False)


def seeded_streams_together_equal_alone(model):
    alone_then_together(model, seeded=True)


def device_sampleable_streams_together_equal_alone(model):
    alone_then_together(model, seeded=True, logprobs=False)


def four_streams(port, max_tokens=30):
    streams = [Stream(port, body(i, max_tokens)) for i in range(4)]
    for s in streams:
        s.start()
    for s in streams:
        s.join()
    assert all(s.status == 200 and len(s.tokens) == max_tokens for s in streams), [s.status for s in streams]
    return streams


def concurrent_streams_all_start_before_any_ends(model):
    results = {}
    for parallel in ("1", "4"):
        s = LilyServer(model, "--parallel", parallel, "--quiet").start()
        try:
            streams = four_streams(s.port)
        finally:
            s.kill()
        first = [x.ttft() for x in streams]
        last_first = max(x.t_first for x in streams)
        first_end = min(x.t_end for x in streams)
        results[parallel] = (statistics.median(first), max(first), last_first < first_end)
        print("  --parallel %s: time to first token of 4 concurrent streams (30 tokens each): median %.2f s, "
              "max %.2f s; total %.2f s" % (parallel, statistics.median(first), max(first),
                                             max(x.t_end for x in streams) - min(x.t_start for x in streams)))
    assert results["4"][2], "with --parallel 4 a stream ended before another began"
    assert not results["1"][2], "with --parallel 1 the streams should run one after another"
    assert results["4"][1] < results["1"][1]


def short_request_behind_a_long_stream(model):
    s = LilyServer(model, "--parallel", "2", "--quiet").start()
    try:
        long = Stream(s.port, long_body(0), stop_after=60).start()
        wait_until(lambda: len(long.tokens) >= 3, "the long stream did not start")
        t0 = time.monotonic()
        status, raw = s.request("POST", "/v1/completions",
                                {"model": "tiny", "prompt": prompt(1), "max_tokens": 1, "temperature": 0})
        took = time.monotonic() - t0
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 1
        n_long = len(long.tokens)
        assert n_long < 60 and long.t_end is None, "the long stream had ended: %d tokens" % n_long
        print("  a 1-token request behind a streaming one: %.2f s (the long stream at token %d)" % (took, n_long))
        long.join()
    finally:
        s.kill()


def cancelled_stream_leaves_the_others(model):
    s = LilyServer(model, "--parallel", "4", "--quiet").start()
    try:
        budgets = [12, 10, 40, 8]
        alone = [Stream(s.port, body(i, n)).start().join() for i, n in enumerate(budgets)]
        together = [Stream(s.port, body(i, n), stop_after=4 if i == 2 else None) for i, n in enumerate(budgets)]
        for t in together:
            t.start()
        for t in together:
            t.join()
        assert together[2].tokens == alone[2].tokens[:len(together[2].tokens)]
        for i in (0, 1, 3):
            assert together[i].tokens == alone[i].tokens and together[i].finish == "length", i
        deadline = time.time() + 10
        while s.metrics()["lily_requests_running"] != 0:
            assert time.time() < deadline, "the cancelled request kept its slot"
            time.sleep(0.05)
        m = s.metrics()
        assert m['lily_requests_total{endpoint="/v1/completions",status="499"}'] == 1, m
    finally:
        s.kill()


def full_queue_is_429_and_props_report_parallel(model):
    s = LilyServer(model, "--parallel", "2", "--max-queue", "1", "--quiet").start()
    try:
        status, raw = s.request("GET", "/props")
        props = json.loads(raw)
        assert status == 200 and props["parallel"] == 2 and props["total_slots"] == 2, props
        assert props["limits"]["parallel"] == 2, props
        busy = [Stream(s.port, long_body(i), stop_after=40).start() for i in range(2)]
        wait_until(lambda: all(b.tokens for b in busy), "the busy streams did not start")
        m = s.metrics()
        assert m['lily_slots{state="decoding"}'] == 2 and m['lily_slots{state="idle"}'] == 0, m
        queued = Stream(s.port, body(3, 1)).start()
        deadline = time.time() + 10
        while s.metrics()["lily_queue_depth"] != 1:
            assert time.time() < deadline, "the third request was not queued"
            time.sleep(0.01)
        status, raw = s.request("POST", "/v1/completions", {"model": "tiny", "prompt": [5], "max_tokens": 1})
        assert status == 429 and json.loads(raw)["error"]["code"] == "queue_full", (status, raw)
        for b in busy:
            b.join()
        queued.join()
        assert queued.status == 200 and len(queued.tokens) == 1
    finally:
        s.kill()


def request_timeout_ends_each_batched_stream(model):
    s = LilyServer(model, "--parallel", "3", "--request-timeout", "1.5", "--quiet").start()
    try:
        streams = [Stream(s.port, long_body(i)).start() for i in range(3)]
        for x in streams:
            x.join(60)
        for x in streams:
            took = x.t_end - x.t_start
            assert x.status == 200 and x.finish == "length" and 0 < len(x.tokens) < 2000, (x.status, x.finish)
            assert 1.4 < took < 10, took
    finally:
        s.kill()


def bad_parallel_values_are_refused(model):
    for value in ("0", "17", "x", "-1"):
        p = subprocess.run([LILY_BIN, "serve", "--model", model, "--port", "0", "--parallel", value],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode != 0, (value, p.returncode)
        assert "--parallel" in p.stderr and "1 to 16" in p.stderr, (value, p.stderr)


TESTS = {
    "greedy_streams_together_equal_alone": greedy_streams_together_equal_alone,
    "seeded_streams_together_equal_alone": seeded_streams_together_equal_alone,
    "device_sampleable_streams_together_equal_alone": device_sampleable_streams_together_equal_alone,
    "concurrent_streams_all_start_before_any_ends": concurrent_streams_all_start_before_any_ends,
    "short_request_behind_a_long_stream": short_request_behind_a_long_stream,
    "cancelled_stream_leaves_the_others": cancelled_stream_leaves_the_others,
    "full_queue_is_429_and_props_report_parallel": full_queue_is_429_and_props_report_parallel,
    "request_timeout_ends_each_batched_stream": request_timeout_ends_each_batched_stream,
    "bad_parallel_values_are_refused": bad_parallel_values_are_refused,
}


if __name__ == "__main__":
    main_guard(lambda: run_model_tests(TESTS))
