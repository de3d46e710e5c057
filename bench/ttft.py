#!/usr/bin/env python3
"""Time to first token through the server: starts `lily serve` on a model directory, sends streaming chat
completions whose prompt is about --prompt-tokens tokens (each one different, so the session cache cannot reuse a
prefix), and measures on the client the time from sending the request to the first chunk that carries content
(tokenization, chat formatting, prefill, the first sampled token and the HTTP/SSE path all included).

  bench/ttft.py --lily build-cuda/lily --model /tmp/full-mlx --prompt-tokens 1024 --reps 5 [--json out.json]

Standard library only. Prints one line per request and the median; exits non-zero on any error.
"""
import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import time

WORDS = ("time people year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact water river mountain garden window kitchen music paper "
         "story history market engine kernel memory token layer matrix vector tensor signal orbit planet").split()


MODEL = {"id": ""}


def request(port, body, timeout=600):
    body = dict(body, model=MODEL["id"])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def prompt_text(n_words, seed):
    rng = random.Random(seed)
    return f"Request {seed}: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def prompt_tokens(port, text):
    """Prompt tokens the server counts for one user message (a non-streamed request of one token)."""
    conn, resp = request(port, {"messages": [{"role": "user", "content": text}], "max_tokens": 1})
    data = json.loads(resp.read())
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"calibration request failed: {resp.status} {data}")
    return data["usage"]["prompt_tokens"]


def time_to_first_token(port, text):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    conn, resp = request(port, body)
    if resp.status != 200:
        raise RuntimeError(f"request failed: {resp.status} {resp.read()[:500]}")
    first = None
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        delta = json.loads(line[5:])["choices"][0].get("delta", {})
        if delta.get("content") or delta.get("reasoning_content"):
            first = time.perf_counter() - t0
            break
    conn.close()
    if first is None:
        raise RuntimeError("the stream ended without a content chunk")
    return first


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lily", default="build-cuda/lily")
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--json")
    a = ap.parse_args()

    server = subprocess.Popen([a.lily, "serve", "--model", a.model, "--port", str(a.port), "--backend", a.backend,
                               "--quiet", "--ctx-size", "8192"])
    try:
        deadline = time.time() + 600
        while True:
            if server.poll() is not None:
                sys.exit(f"lily serve exited with {server.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                sys.exit("lily serve did not become healthy in 600 s")
            time.sleep(0.5)

        conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=5)
        conn.request("GET", "/v1/models")
        MODEL["id"] = json.loads(conn.getresponse().read())["data"][0]["id"]
        # Words per token of this vocabulary, from one calibration prompt, then prompts of the asked length.
        words = a.prompt_tokens
        n = prompt_tokens(a.port, prompt_text(words, 0))
        words = max(1, round(words * a.prompt_tokens / n))
        time_to_first_token(a.port, prompt_text(words, 1))  # warm-up (graph capture, first prefill)
        times, counts = [], []
        for r in range(a.reps):
            text = prompt_text(words, 100 + r)
            times.append(time_to_first_token(a.port, text))
            counts.append(prompt_tokens(a.port, text))  # after the timed request: it cannot reuse this prefill
            print(f"request {r}: ~{counts[-1]} prompt tokens, time to first token {1000 * times[-1]:.1f} ms",
                  flush=True)
        med = statistics.median(times)
        print(f"time to first token, ~{statistics.median(counts)}-token prompt: median {1000 * med:.1f} ms "
              f"(min {1000 * min(times):.1f}, max {1000 * max(times):.1f}) over {a.reps} requests")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"prompt_tokens": statistics.median(counts), "ttft_ms_median": 1000 * med,
                           "ttft_ms_min": 1000 * min(times), "ttft_ms_max": 1000 * max(times),
                           "ttft_ms": [1000 * t for t in times]}, f, indent=2)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
