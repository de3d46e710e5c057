"""Contract tests of `lily serve` with the official openai client, on the tiny random-weight model (CPU backend):
streaming and not, reasoning fields, tools, logprobs, usage, error types, the bad-input matrix, multi-turn prefix
reuse, disconnects, queue limits, metrics and SIGTERM. Prints 'N passed, M failed'; exits non-zero on failure."""
import http.client
import json
import socket
import time

import openai
from lily_harness import LilyServer, Runner, main_guard, make_tiny_model, sse_events

KEY = "sk-lily-test"
CTX = 1024
SYSTEM = ("You are a careful assistant. Answer briefly, show your reasoning when asked, and keep the conversation "
          "friendly. " * 6).strip()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def extra(obj, name):
    """A field outside OpenAI's schema (reasoning_content, ...), as the client keeps it."""
    if hasattr(obj, name):
        return getattr(obj, name)
    return (obj.model_extra or {}).get(name)


class Contract:
    def __init__(self, server):
        self.s = server
        self.model = "tiny"
        self.client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % server.port, api_key=KEY, max_retries=0,
                                    timeout=120)

    def auth(self):
        return {"Authorization": "Bearer " + KEY}

    def chat(self, **kw):
        kw.setdefault("model", self.model)
        kw.setdefault("messages", [{"role": "user", "content": "Hello there"}])
        kw.setdefault("max_tokens", 6)
        return self.client.chat.completions.create(**kw)

    # --- endpoints -------------------------------------------------------------------------------------------
    def test_health_models_page(self):
        # The server listens before the model is loaded (the tokenizer alone takes about a second).
        assert self.s.first_health == (503, {"status": "loading", "model": "tiny"}), self.s.first_health
        assert any("5/5 ready" in line for line in self.s.lines), self.s.lines[:8]  # the progress bar's end
        status, body = self.s.request("GET", "/health")
        assert status == 200 and json.loads(body)["status"] == "ok", body
        models = self.client.models.list()
        assert [m.id for m in models.data] == ["tiny"], models
        assert self.client.models.retrieve("tiny").id == "tiny"
        status, body = self.s.request("GET", "/")
        assert status == 200 and b"<html" in body and b"chat.js" in body, body[:200]
        status, body = self.s.request("GET", "/chat.js")
        assert status == 200 and b"/v1/chat/completions" in body

    def test_chat_non_streaming(self):
        r = self.chat(max_tokens=5, seed=7, temperature=0.8)
        assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "tiny", r
        c = r.choices[0]
        assert c.index == 0 and c.message.role == "assistant"
        assert c.finish_reason in ("stop", "length"), c.finish_reason
        assert "reasoning_content" in c.message.model_dump(), c.message  # present, thinking is on by default
        text = (extra(c.message, "reasoning_content") or "") + (c.message.content or "")
        assert text, c.message
        u = r.usage
        assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 5, u
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert isinstance(u.prompt_tokens_details.cached_tokens, int)

    def test_json_object_is_reported(self):
        # response_format json_object is validated, not enforced (src/server/README.md): a header says which.
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=[{"role": "user", "content": "Reply in JSON"}], max_tokens=4,
            response_format={"type": "json_object"})
        assert raw.headers.get("x-lily-json-object") in ("valid", "invalid"), dict(raw.headers)
        assert raw.parse().choices[0].finish_reason in ("stop", "length")
        plain = self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=[{"role": "user", "content": "Reply"}], max_tokens=2)
        assert "x-lily-json-object" not in plain.headers, dict(plain.headers)

    def test_chat_streaming_matches_non_streaming(self):
        args = dict(max_tokens=6, seed=1234, temperature=0.9, top_p=0.95,
                    messages=[{"role": "user", "content": "Stream this"}])
        whole = self.chat(**args)
        chunks = list(self.chat(stream=True, stream_options={"include_usage": True}, **args))
        first = chunks[0].choices[0].delta
        assert first.role == "assistant" and first.content == "", first
        reasoning = "".join(extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks if c.choices)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        m = whole.choices[0].message
        assert reasoning == (extra(m, "reasoning_content") or ""), (reasoning, m)
        assert content == (m.content or ""), (content, m)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [whole.choices[0].finish_reason], finishes
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert all(c.usage is None for c in chunks[:-1])
        assert len({c.id for c in chunks}) == 1

    def test_raw_sse_framing(self):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "raw"}], "max_tokens": 3, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json", **self.auth()})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream", r.getheaders()
        assert r.getheader("Transfer-Encoding") == "chunked"
        events = sse_events(r.read())
        conn.close()
        assert events[-1] == "[DONE]", events[-1]
        objs = [json.loads(e) for e in events[:-1]]
        for e, o in zip(events, objs):
            assert e == json.dumps(o, separators=(",", ":"), ensure_ascii=False), e  # compact, as OpenAI's
            assert list(o)[:6] == ["id", "object", "created", "model", "system_fingerprint", "choices"]
        assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert objs[-1]["choices"][0]["delta"] == {} and objs[-1]["choices"][0]["finish_reason"] == "length"
        assert "usage" not in objs[0]  # only with stream_options.include_usage

    def test_thinking_off_gives_content(self):
        r = self.chat(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, max_tokens=4)
        m = r.choices[0].message
        assert m.content and extra(m, "reasoning_content") is None, m
        status, body = self.s.request("POST", "/apply-template", {
            "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False}},
            self.auth())
        assert status == 200 and json.loads(body)["prompt"].endswith("<think>\n\n</think>\n\n"), body

    def test_tools_accepted_and_rendered(self):
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        plain = self.chat(messages=msgs, max_tokens=2)
        with_tools = self.chat(messages=msgs, tools=[WEATHER], tool_choice="auto", max_tokens=2)
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 30, (with_tools.usage, plain.usage)
        status, body = self.s.request("POST", "/apply-template", {"messages": msgs, "tools": [WEATHER]}, self.auth())
        prompt = json.loads(body)["prompt"]
        assert status == 200 and "<tools>" in prompt and '"name": "get_weather"' in prompt, prompt
        none = self.chat(messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=2)
        assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # tools left out of the prompt
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = self.chat(messages=msgs, tools=[WEATHER], tool_choice=named, max_tokens=4)
        assert r.choices[0].finish_reason in ("tool_calls", "stop", "length")
        status, body = self.s.request("POST", "/apply-template",
                                      {"messages": msgs, "tools": [WEATHER], "tool_choice": named}, self.auth())
        assert json.loads(body)["prompt"].endswith("<tool_call>\n<function=get_weather>\n"), body
        r = self.chat(messages=msgs, tools=[WEATHER], tool_choice="required", max_tokens=4, stream=True)
        assert any(c.choices and c.choices[0].finish_reason for c in r)
        # A conversation that carries a tool call and its result renders and runs.
        history = msgs + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
        r = self.chat(messages=history, tools=[WEATHER], max_tokens=2)
        assert r.usage.prompt_tokens > with_tools.usage.prompt_tokens

    def test_logprobs(self):
        r = self.chat(logprobs=True, top_logprobs=3, max_tokens=4, temperature=0)
        lp = r.choices[0].logprobs.content
        assert len(lp) == r.usage.completion_tokens, (len(lp), r.usage)
        for t in lp:
            assert t.logprob <= 0 and len(t.top_logprobs) == 3 and bytes(t.bytes).decode("utf-8", "replace")
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
            assert abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5  # greedy picks the most likely token
        s = list(self.chat(logprobs=True, top_logprobs=1, max_tokens=3, stream=True, temperature=0))
        streamed = [t for c in s if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert [t.token for t in streamed] == [t.token for t in lp[:3]], (streamed, lp)

    def test_completions(self):
        r = self.client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0,
                                           logprobs=2)
        assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens == 4, r
        assert len(r.choices[0].logprobs.tokens) == 4 and len(r.choices[0].logprobs.top_logprobs[0]) == 2
        ids = self.client.completions.create(model="tiny", prompt=[9707, 11, 1879], max_tokens=3, temperature=0)
        assert ids.usage.prompt_tokens == 3
        s = list(self.client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text
        default = self.client.completions.create(model="tiny", prompt="a b c", temperature=0)
        assert default.usage.completion_tokens <= 16

    def test_stop_and_max_completion_tokens(self):
        r = self.chat(max_completion_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
        full = self.chat(max_tokens=6, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        text = full.choices[0].message.content
        if len(text) > 2:  # stop on a piece of what greedy decoding will produce
            cut = self.chat(max_tokens=6, temperature=0, stop=[text[1:3]],
                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert cut.choices[0].message.content == text[:text.index(text[1:3])], (cut, text)
            assert cut.choices[0].finish_reason == "stop"

    def test_error_types_with_the_client(self):
        def expect(exc, status, code=None, param=None, **kw):
            try:
                self.chat(**kw)
            except exc as e:
                assert e.status_code == status, (e.status_code, e)
                err = e.body if isinstance(e.body, dict) else {}
                assert set(err) >= {"message", "type", "param", "code"}, e.body
                if code:
                    assert err["code"] == code, err
                if param:
                    assert err["param"] == param, err
                return
            raise AssertionError("no %s for %s" % (exc.__name__, kw))
        expect(openai.BadRequestError, 400, "invalid_value", "temperature", temperature=3)
        expect(openai.BadRequestError, 400, "unsupported_value", "n", n=2)
        expect(openai.NotFoundError, 404, "model_not_found", "model", model="gpt-4o")
        bad = openai.OpenAI(base_url=self.client.base_url, api_key="wrong", max_retries=0)
        try:
            bad.models.list()
            raise AssertionError("wrong key accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401 and e.body["code"] == "invalid_api_key", e.body

    # --- the bad-input matrix ----------------------------------------------------------------------------------
    def test_bad_input_matrix(self):
        good = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        def with_(**kw):
            b = dict(good)
            b.update(kw)
            return b
        long_prompt = "hello " * (CTX * 2)
        cases = [  # (name, body, headers, status, code or None, param or None)
            ("malformed JSON", b'{"model": "tiny", "messages": [', None, 400, "invalid_json", None),
            ("not an object", b"[1, 2]", None, 400, "invalid_json", None),
            ("messages wrong type", with_(messages="hi"), None, 400, "invalid_type", "messages"),
            ("temperature wrong type", with_(temperature="hot"), None, 400, "invalid_type", "temperature"),
            ("missing messages", {"model": "tiny"}, None, 400, "missing_required_parameter", "messages"),
            ("empty messages", with_(messages=[]), None, 400, "empty_array", "messages"),
            ("unknown role", with_(messages=[{"role": "robot", "content": "x"}]), None, 400, "invalid_value",
             "messages[0].role"),
            ("bad tool schema", with_(tools=[{"type": "function", "function": {
                "name": "f", "parameters": {"type": "string"}}}]), None, 400, "invalid_function_parameters",
             "tools[0].function.parameters.type"),
            ("tool without name", with_(tools=[{"type": "function", "function": {}}]), None, 400, "invalid_value",
             "tools[0].function.name"),
            ("negative max_tokens", with_(max_tokens=-1), None, 400, "invalid_value", "max_tokens"),
            ("temperature out of range", with_(temperature=2.5), None, 400, "invalid_value", "temperature"),
            ("unknown model", with_(model="nope"), None, 404, "model_not_found", "model"),
            ("oversized body", with_(messages=[{"role": "user", "content": "x" * (1536 * 1024)}]), None, 413, None,
             None),
            ("prompt over context", with_(messages=[{"role": "user", "content": long_prompt}]), None, 400,
             "context_length_exceeded", "messages"),
            ("completion over context", with_(max_tokens=CTX), None, 400, "context_length_exceeded", "max_tokens"),
            ("invalid UTF-8", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None,
             400, "invalid_utf8", None),
            ("missing API key", good, {"Authorization": ""}, 401, "invalid_api_key", None),
            ("wrong API key", good, {"Authorization": "Bearer nope"}, 401, "invalid_api_key", None),
            ("n > 1", with_(n=3), None, 400, "unsupported_value", "n"),
            ("image content", with_(messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), None, 400,
             "unsupported_content_type", "messages[0].content[0].type"),
        ]
        for name, body, headers, status, code, param in cases:
            h = dict(self.auth())
            h.update(headers or {})
            got, raw = self.s.request("POST", "/v1/chat/completions", body, h)
            assert got == status, (name, got, raw[:300])
            err = json.loads(raw)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (name, err)
            assert err["type"] in ("invalid_request_error",), (name, err)
            if code:
                assert err["code"] == code, (name, err)
            assert err["param"] == param, (name, err)
            ok, raw = self.s.request("POST", "/v1/chat/completions", good, self.auth())
            assert ok == 200, ("the good request after", name, ok, raw[:200])
        for method, path, status in (("GET", "/v1/chat/completions", 405), ("GET", "/nope", 404),
                                     ("POST", "/v1/models", 405)):
            got, raw = self.s.request(method, path, None, self.auth())
            assert got == status and "error" in json.loads(raw), (method, path, got, raw)

    # --- sessions ----------------------------------------------------------------------------------------------
    def test_multi_turn_prefix_reuse(self):
        messages = [{"role": "system", "content": SYSTEM}]
        previous = None
        for turn in range(5):
            messages.append({"role": "user", "content": "Question number %d: what comes next?" % (turn + 1)})
            args = dict(messages=messages, max_tokens=6, temperature=0)
            r = self.chat(**args)
            fresh = self.chat(extra_body={"cache_prompt": False}, **args)
            u = r.usage
            if previous is not None:
                cached = u.prompt_tokens_details.cached_tokens
                assert cached >= 0.9 * previous, (turn + 1, cached, previous)
            assert fresh.usage.prompt_tokens_details.cached_tokens == 0, fresh.usage
            m, f = r.choices[0].message, fresh.choices[0].message
            assert (m.content, extra(m, "reasoning_content")) == (f.content, extra(f, "reasoning_content")), \
                (turn + 1, m, f)
            previous = u.prompt_tokens
            messages.append({"role": "assistant", "content": m.content or "",
                             "reasoning_content": extra(m, "reasoning_content")})

    # --- scheduling --------------------------------------------------------------------------------------------
    def open_stream(self, max_tokens, content="long"):
        """A streaming request on a raw socket; returns the socket once the response headers have arrived."""
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}], "stream": True,
                           "max_tokens": max_tokens}).encode()
        sock = socket.create_connection(("127.0.0.1", self.s.port), timeout=60)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        return sock

    @staticmethod
    def read_events(sock, n):
        buf = b""
        while buf.count(b"data: ") < n:  # events arrive inside chunked framing
            part = sock.recv(65536)
            assert part, "stream ended early"
            buf += part
        return buf

    def wait_idle(self, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = self.s.metrics()
            if m["lily_requests_running"] == 0 and m["lily_queue_depth"] == 0:
                return m
            time.sleep(0.02)
        raise AssertionError("server still busy")

    def test_disconnect_cancels_within_a_token(self):
        before = self.wait_idle()
        sock = self.open_stream(400)
        buf = self.read_events(sock, 4)  # the role chunk and at least 3 token chunks
        sock.close()
        received = buf.count(b"reasoning_content")
        after = self.wait_idle()
        generated = after["lily_completion_tokens_total"] - before["lily_completion_tokens_total"]
        # Tokens produced after the client left: the one in flight when the server noticed, and at most one more
        # before the engine checks the cancel flag; plus what was in socket buffers unread.
        print("  disconnect: %d token chunks received, %d tokens generated in all" % (received, generated))
        assert generated <= received + 3, (generated, received)
        status, _ = self.s.request("GET", "/health")
        assert status == 200

    def test_queued_request_of_a_departed_client_is_dropped(self):
        before = self.wait_idle()
        runner = self.open_stream(400)
        self.read_events(runner, 2)
        queued = self.open_stream(50, "queued")
        deadline = time.time() + 10
        while self.s.metrics()["lily_queue_depth"] < 1:
            assert time.time() < deadline, "never queued"
            time.sleep(0.01)
        queued.close()
        while self.s.metrics()["lily_queue_depth"] > 0:
            assert time.time() < deadline + 10, "still queued"
            time.sleep(0.01)
        runner.close()
        after = self.wait_idle()
        assert after["lily_dropped_requests_total"] == before["lily_dropped_requests_total"] + 1, after
        done = after.get('lily_requests_total{endpoint="/v1/chat/completions",status="499"}', 0)
        assert done >= 2, after  # both recorded as client-closed

    def test_queue_limit_gives_429(self):
        self.wait_idle()
        socks = [self.open_stream(400)]
        self.read_events(socks[0], 2)
        socks += [self.open_stream(20, "q%d" % i) for i in range(2)]  # --max-queue 2
        deadline = time.time() + 10
        while self.s.metrics()["lily_queue_depth"] < 2:
            assert time.time() < deadline, "queue never filled"
            time.sleep(0.01)
        try:
            self.chat(max_tokens=1)
            raise AssertionError("no 429 with a full queue")
        except openai.RateLimitError as e:
            assert e.status_code == 429 and e.body["code"] == "queue_full", e.body
        finally:
            for s in socks:
                s.close()
        self.wait_idle()
        assert self.chat(max_tokens=1).choices[0].finish_reason == "length"

    def test_metrics(self):
        m = self.s.metrics()
        for name in ("lily_prompt_tokens_total", "lily_completion_tokens_total", "lily_queue_depth",
                     "lily_time_to_first_token_seconds_count", "lily_time_per_output_token_seconds_count",
                     "lily_prefill_tokens_per_second", "lily_decode_tokens_per_second",
                     "lily_session_cache_hits_total", "lily_session_cache_bytes"):
            assert name in m, name
        assert m['lily_requests_total{endpoint="/v1/chat/completions",status="200"}'] > 5
        assert m['lily_requests_total{endpoint="/v1/chat/completions",status="400"}'] > 5
        assert m["lily_session_cache_hits_total"] >= 4 and m["lily_session_cache_bytes"] > 0


def sigterm_finishes_in_flight_work(model):
    s = LilyServer(model, "--api-key", KEY).start()
    c = Contract(s)
    sock = c.open_stream(12)
    buf = c.read_events(sock, 2)
    code = None
    try:
        s.proc.send_signal(15)
        while not buf.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            part = sock.recv(65536)
            if not part:
                break
            buf += part
        code = s.proc.wait(timeout=30)
    finally:
        s.kill()
        sock.close()
    assert b'"finish_reason":"length"' in buf and b"data: [DONE]" in buf, buf[-300:]
    assert code == 0, code
    assert any("shutting down" in line for line in s.lines), s.lines[-5:]


def main():
    model = make_tiny_model()
    runner = Runner()
    # One slot: the queue tests hold it with one long stream (several slots: tests/python/test_parallel.py).
    server = LilyServer(model, "--api-key", KEY, "--ctx-size", str(CTX), "--parallel", "1", "--max-queue", "2",
                        "--max-body-mb", "1", "--served-model-name", "tiny")
    try:
        server.start()
        c = Contract(server)
        for name in [n for n in dir(Contract) if n.startswith("test_") and n != "test_metrics"]:
            runner.run(name, getattr(c, name))
        runner.run("test_metrics", c.test_metrics)  # last: it checks what the others did

        def clean_exit():
            code = server.stop()
            assert code == 0, "exit code %s" % code
        runner.run("clean_exit_on_sigterm", clean_exit)
    finally:
        server.kill()
    runner.run("sigterm_finishes_in_flight_work", lambda: sigterm_finishes_in_flight_work(model))
    return runner.finish()


if __name__ == "__main__":
    main_guard(main)
