"""Contract tests of the APIs beyond chat completions, with the vendors' official clients against `lily serve` on the
tiny random-weight model (CPU backend): the Anthropic Messages API (`anthropic`), the OpenAI Responses API
(`openai`), llama-server's /tokenize and /detokenize, and the vLLM fields of /v1/chat/completions (min_tokens,
stop_token_ids, include_stop_str_in_output, continue_final_message, reasoning_effort, refused guided_*).
The random model never writes a well-formed tool call, so output-side tool_use / function_call items are covered by
tests/server/test_anthropic_api.cpp and test_responses_api.cpp; here the input side of the round trip runs for real.
Prints 'N passed, M failed'; exits non-zero on failure."""
import json

import anthropic
import openai
from lily_harness import LilyServer, Runner, main_guard, make_tiny_model

KEY = "sk-lily-compat"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Current weather of a city", "input_schema": WEATHER_SCHEMA}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
                  "parameters": WEATHER_SCHEMA}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"temperature": 0}  # Anthropic's sampling fields: the current client takes them only as extra_body


def expect_status(fn, exc, status):
    try:
        fn()
    except exc as e:
        assert e.status_code == status, (e.status_code, e)
        return e
    raise AssertionError("no %s" % exc.__name__)


class Compat:
    def __init__(self, server):
        self.s = server
        base = "http://127.0.0.1:%d" % server.port
        self.claude = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=120)
        self.oai = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def auth(self):
        return {"Authorization": "Bearer " + KEY}

    def post(self, path, body):
        status, raw = self.s.request("POST", path, body, self.auth())
        return status, json.loads(raw)

    # --- Anthropic Messages ----------------------------------------------------------------------------------
    def test_messages_create(self):
        m = self.claude.messages.create(model="tiny", max_tokens=5, extra_body=GREEDY,
                                        system="You are terse.", messages=[{"role": "user", "content": "Hello"}])
        assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), m
        assert [b.type for b in m.content] == ["text"] and m.content[0].text, m.content  # thinking off by default
        assert m.stop_reason == "max_tokens" and m.stop_sequence is None, m
        u = m.usage
        assert u.output_tokens == 5 and u.input_tokens + u.cache_read_input_tokens > 5, u
        again = self.claude.messages.create(model="tiny", max_tokens=5, extra_body=GREEDY,
                                            system="You are terse.", messages=[{"role": "user", "content": "Hello"}])
        assert again.content[0].text == m.content[0].text
        assert again.usage.cache_read_input_tokens > 0, again.usage  # the repeated prompt resumes from the cache

    def test_messages_stream_text_and_raw_events(self):
        args = dict(model="tiny", max_tokens=6, extra_body=GREEDY, messages=[{"role": "user", "content": "Stream it"}])
        whole = self.claude.messages.create(**args)
        with self.claude.messages.stream(**args) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == whole.content[0].text == final.content[0].text, (text, whole, final)
        assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == 6, final
        events = list(self.claude.messages.create(stream=True, **args))
        types = [e.type for e in events]
        assert types[:2] == ["message_start", "content_block_start"], types  # the client drops pings
        assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"], types
        assert set(types[2:-3]) == {"content_block_delta"}, types
        assert events[0].message.usage.input_tokens > 0 and events[0].message.content == []
        assert events[1].content_block.type == "text" and events[1].index == 0
        assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
        assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6
        # The raw bytes: `event:` lines naming each event, as Anthropic frames them.
        body = dict(args, stream=True, temperature=0)
        del body["extra_body"]
        status, raw = self.s.request("POST", "/v1/messages", body, {"x-api-key": KEY})
        names = [line[len("event: "):] for line in raw.decode().split("\n") if line.startswith("event: ")]
        assert status == 200 and names == types[:2] + ["ping"] + types[2:], (names, types)

    def test_messages_thinking_blocks(self):
        m = self.claude.messages.create(model="tiny", max_tokens=1100, extra_body=GREEDY,
                                        thinking={"type": "enabled", "budget_tokens": 1024},
                                        stop_sequences=["\n"], messages=[{"role": "user", "content": "Think"}])
        assert m.content[0].type == "thinking", m.content
        assert m.content[0].signature.startswith("lily1:") and len(m.content[0].signature) == 22, m.content[0]
        assert m.stop_reason in ("stop_sequence", "max_tokens", "end_turn"), m
        if m.stop_reason == "stop_sequence":
            assert m.stop_sequence == "\n"
        events = list(self.claude.messages.create(model="tiny", max_tokens=4, thinking={"type": "adaptive"},
                                                  messages=[{"role": "user", "content": "Think"}], stream=True))
        assert events[1].content_block.type == "thinking", events[1]
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
        assert deltas[0] == "thinking_delta" and "signature_delta" in deltas, deltas
        # A thinking block sent back (as clients do on the next turn) is accepted.
        history = [{"role": "user", "content": "Think"},
                   {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "lily1:0"},
                                                     {"type": "text", "text": "Done."}]},
                   {"role": "user", "content": "Again"}]
        assert self.claude.messages.create(model="tiny", max_tokens=2, messages=history).usage.output_tokens == 2

    def test_messages_tool_round_trip(self):
        first = [{"role": "user", "content": "Weather in Paris?"}]
        r = self.claude.messages.create(model="tiny", max_tokens=8, tools=[ANTHROPIC_TOOL], messages=first,
                                        tool_choice={"type": "tool", "name": "get_weather"})
        assert r.stop_reason in ("tool_use", "max_tokens", "end_turn"), r  # the random model's call is malformed
        history = first + [
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
        r2 = self.claude.messages.create(model="tiny", max_tokens=3, tools=[ANTHROPIC_TOOL], messages=history)
        assert r2.usage.output_tokens == 3
        n_first = self.claude.messages.count_tokens(model="tiny", tools=[ANTHROPIC_TOOL], messages=first)
        n_history = self.claude.messages.count_tokens(model="tiny", tools=[ANTHROPIC_TOOL], messages=history)
        assert n_history.input_tokens > n_first.input_tokens + 10, (n_first, n_history)
        assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens == n_history.input_tokens, r2.usage

    def test_messages_count_tokens(self):
        msgs = [{"role": "user", "content": "How many tokens is this?"}]
        n = self.claude.messages.count_tokens(model="tiny", system="Be brief.", messages=msgs)
        m = self.claude.messages.create(model="tiny", max_tokens=1, system="Be brief.", messages=msgs)
        assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens, (n, m.usage)

    def test_messages_errors(self):
        e = expect_status(lambda: self.claude.messages.create(model="tiny", max_tokens=4, extra_body={
                                                              "temperature": 1.5},
                                                              messages=[{"role": "user", "content": "x"}]),
                          anthropic.BadRequestError, 400)
        assert e.body == {"type": "error", "error": {"type": "invalid_request_error", "message": e.body["error"][
            "message"]}}, e.body
        assert "temperature" in e.body["error"]["message"]
        e = expect_status(lambda: self.claude.messages.create(model="tiny", max_tokens=4, stop_sequences=["a", ""],
                                                              messages=[{"role": "user", "content": "x"}]),
                          anthropic.BadRequestError, 400)
        assert "'stop_sequences[1]'" in e.body["error"]["message"], e.body
        expect_status(lambda: self.claude.messages.create(model="claude-x", max_tokens=4,
                                                          messages=[{"role": "user", "content": "x"}]),
                      anthropic.NotFoundError, 404)
        expect_status(lambda: self.claude.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]}]),
                      anthropic.BadRequestError, 400)
        status, body = self.s.request("POST", "/v1/messages", {"model": "tiny", "messages": []}, {"x-api-key": KEY})
        assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error", body
        bad = anthropic.Anthropic(base_url=str(self.claude.base_url), api_key="wrong", max_retries=0)
        e = expect_status(lambda: bad.messages.create(model="tiny", max_tokens=1,
                                                      messages=[{"role": "user", "content": "x"}]),
                          anthropic.AuthenticationError, 401)
        assert e.body["error"]["type"] == "authentication_error", e.body
        bearer = anthropic.Anthropic(base_url=str(self.claude.base_url), auth_token=KEY, max_retries=0)
        assert bearer.messages.create(model="tiny", max_tokens=1,
                                      messages=[{"role": "user", "content": "x"}]).usage.output_tokens == 1

    # --- OpenAI Responses ------------------------------------------------------------------------------------
    def test_responses_create(self):
        r = self.oai.responses.create(model="tiny", input="Hello", instructions="Be terse.", max_output_tokens=5,
                                      temperature=0, reasoning={"effort": "none"})
        assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny", r
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
        assert [o.type for o in r.output] == ["message"], r.output
        assert r.output_text and r.output[0].content[0].type == "output_text", r.output
        assert r.instructions == "Be terse." and r.store is False, r
        u = r.usage
        assert u.output_tokens == 5 and u.total_tokens == u.input_tokens + 5, u
        assert u.output_tokens_details.reasoning_tokens == 0

    def test_responses_reasoning_items(self):
        r = self.oai.responses.create(model="tiny", input="Think first", max_output_tokens=4)
        assert r.output[0].type == "reasoning", r.output  # reasoning is on unless the effort says none
        assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text, r.output[0]
        assert r.usage.output_tokens_details.reasoning_tokens == 4, r.usage
        events = list(self.oai.responses.create(model="tiny", input="Think first", max_output_tokens=4, stream=True))
        types = [e.type for e in events]
        assert "response.reasoning_text.delta" in types and "response.reasoning_text.done" in types, types
        # A reasoning item sent back as input is accepted.
        again = self.oai.responses.create(model="tiny", max_output_tokens=2, input=[
            {"role": "user", "content": "Think first"}, r.output[0].model_dump(exclude_none=True),
            {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Again"}])
        assert again.usage.output_tokens == 2

    def test_responses_stream(self):
        args = dict(model="tiny", input="Stream it", max_output_tokens=6, temperature=0, reasoning={"effort": "none"})
        whole = self.oai.responses.create(**args)
        events = list(self.oai.responses.create(stream=True, **args))
        types = [e.type for e in events]
        assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", "response.output_text.delta"], types
        assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"], types
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == whole.output_text, (text, whole.output_text)
        assert events[-1].response.output[0].content[0].text == text
        # The client's stream helper accumulates the items; an incomplete response arrives as its own event.
        with self.oai.responses.stream(**args) as stream:
            last = list(stream)[-1]
        assert last.type == "response.incomplete" and last.response.output_text == whole.output_text, last

    def test_responses_function_round_trip(self):
        r = self.oai.responses.create(model="tiny", input="Weather in Paris?", tools=[RESPONSES_TOOL],
                                      tool_choice="required", max_output_tokens=8)
        assert r.tools[0].name == "get_weather" and r.tool_choice == "required", r
        follow = self.oai.responses.create(model="tiny", tools=[RESPONSES_TOOL], max_output_tokens=3, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}])
        assert follow.usage.output_tokens == 3 and follow.usage.input_tokens > r.usage.input_tokens, follow.usage
        status, body = self.s.request("POST", "/apply-template", {
            "messages": [{"role": "user", "content": "x"},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]}, self.auth())
        assert status == 200 and "<tool_response>\nsunny, 21 C" in json.loads(body)["prompt"]

    def test_responses_errors(self):
        e = expect_status(lambda: self.oai.responses.create(model="tiny", input="x", previous_response_id="resp_1"),
                          openai.BadRequestError, 400)
        assert e.body["param"] == "previous_response_id" and e.body["code"] == "unsupported_parameter", e.body
        e = expect_status(lambda: self.oai.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}]),
                          openai.BadRequestError, 400)
        assert e.body["param"] == "tools[0].type", e.body
        expect_status(lambda: self.oai.responses.create(model="nope", input="x"), openai.NotFoundError, 404)
        e = expect_status(lambda: self.oai.responses.create(model="tiny", input="x", max_output_tokens=10 ** 6),
                          openai.BadRequestError, 400)  # beyond the context: named as the client sent it
        assert e.body["param"] == "max_output_tokens" and e.body["code"] == "context_length_exceeded", e.body

    # --- tokenizer endpoints ---------------------------------------------------------------------------------
    def test_tokenize_detokenize(self):
        status, body = self.post("/tokenize", {"content": "Hello world<|im_end|>"})
        assert status == 200 and len(body["tokens"]) == 3 and all(isinstance(t, int) for t in body["tokens"]), body
        status, pieces = self.post("/tokenize", {"content": "Hello world", "with_pieces": True, "add_special": True})
        assert status == 200 and "".join(p["piece"] for p in pieces["tokens"]) == "Hello world", pieces
        status, back = self.post("/detokenize", {"tokens": body["tokens"][:2]})
        assert status == 200 and back == {"content": "Hello world"}, back
        status, pieces = self.post("/tokenize", {"content": "\u00e9", "with_pieces": True})
        assert status == 200 and pieces["tokens"], pieces
        for path, bad, param in [("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens[1]"),
                                 ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
                                 ("/detokenize", {"tokens": "1"}, "tokens"), ("/detokenize", {}, "tokens"),
                                 ("/tokenize", {"content": 5}, "content"), ("/tokenize", {}, "content"),
                                 ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces")]:
            status, err = self.post(path, bad)
            assert status == 400 and err["error"]["param"] == param, (path, bad, err)
        status, _ = self.s.request("POST", "/tokenize", {"content": "x"})
        assert status == 401

    # --- chat/completions fields -----------------------------------------------------------------------------
    def chat(self, **kw):
        kw.setdefault("model", "tiny")
        kw.setdefault("messages", [{"role": "user", "content": "Count with me"}])
        kw.setdefault("temperature", 0)
        return self.oai.chat.completions.create(**kw)

    def test_min_tokens_and_stop_token_ids(self):
        greedy = self.chat(max_tokens=8, logprobs=True, extra_body=NO_THINKING)
        seen, k, stop = set(), None, None  # the first greedy token that is whole text and new, as an id
        for i, t in enumerate(greedy.choices[0].logprobs.content):
            try:
                text = bytes(t.bytes).decode("utf-8")
            except UnicodeDecodeError:
                continue
            status, ids = self.post("/tokenize", {"content": text})
            if len(ids["tokens"]) == 1 and ids["tokens"][0] not in seen:
                k, stop = i, ids["tokens"]
                break
            seen.update(ids["tokens"])
        assert k is not None and k < 4, greedy.choices[0].logprobs.content
        r = self.chat(max_tokens=8, extra_body=dict(NO_THINKING, stop_token_ids=stop))
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1, (k, r)
        r = self.chat(max_tokens=8, extra_body=dict(NO_THINKING, stop_token_ids=stop, min_tokens=k + 3))
        assert r.usage.completion_tokens >= k + 3, (k, r)
        e = expect_status(lambda: self.chat(max_tokens=2, extra_body={"min_tokens": 3}), openai.BadRequestError, 400)
        assert e.body["param"] == "min_tokens", e.body
        e = expect_status(lambda: self.chat(extra_body={"stop_token_ids": [10 ** 9]}), openai.BadRequestError, 400)
        assert e.body["param"] == "stop_token_ids[0]", e.body
        c = self.oai.completions.create(model="tiny", prompt="a b c", max_tokens=3, temperature=0,
                                        extra_body={"min_tokens": 3})
        assert c.usage.completion_tokens == 3

    def test_include_stop_str_in_output(self):
        text = self.chat(max_tokens=8, extra_body=NO_THINKING).choices[0].message.content
        assert len(text) > 4, text
        stop = text[2:4]
        cut = self.chat(max_tokens=8, stop=[stop], extra_body=NO_THINKING).choices[0]
        kept = self.chat(max_tokens=8, stop=[stop], extra_body=dict(NO_THINKING, include_stop_str_in_output=True))
        at = text.index(stop)
        assert cut.message.content == text[:at] and cut.finish_reason == "stop", (cut, text)
        assert kept.choices[0].message.content == text[:at + 2] and kept.choices[0].finish_reason == "stop", kept

    def test_continue_final_message(self):
        msgs = [{"role": "user", "content": "Finish my sentence"}, {"role": "assistant", "content": "The sky is"}]
        extra = {"continue_final_message": True, "add_generation_prompt": False}
        status, body = self.s.request("POST", "/apply-template", dict(messages=msgs, **extra), self.auth())
        prompt = json.loads(body)
        assert status == 200 and prompt["prompt"].endswith("The sky is"), prompt
        r = self.chat(messages=msgs, max_tokens=3, extra_body=extra)
        assert r.usage.prompt_tokens == prompt["prompt_tokens"] and r.choices[0].message.content, r
        assert (r.choices[0].message.model_extra or {}).get("reasoning_content") is None
        e = expect_status(lambda: self.chat(messages=msgs, max_tokens=3, extra_body={
            "continue_final_message": True, "add_generation_prompt": True}), openai.BadRequestError, 400)
        assert e.body["param"] == "continue_final_message", e.body

    def test_reasoning_effort(self):
        off = self.chat(max_tokens=3, reasoning_effort="none").choices[0].message
        assert off.content and (off.model_extra or {}).get("reasoning_content") is None, off
        on = self.chat(max_tokens=3, reasoning_effort="high").choices[0].message
        assert (on.model_extra or {}).get("reasoning_content"), on
        e = expect_status(lambda: self.chat(max_tokens=3, extra_body={"reasoning_effort": "extreme"}),
                          openai.BadRequestError, 400)
        assert e.body["param"] == "reasoning_effort", e.body

    def test_refused_fields(self):
        for field, value in [("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("guided_choice", ["a"]),
                             ("guided_grammar", "root ::= x"), ("grammar", "root ::= x"), ("json_schema", {})]:
            e = expect_status(lambda: self.chat(max_tokens=2, extra_body={field: value}), openai.BadRequestError, 400)
            assert e.body["param"] == field and e.body["code"] == "unsupported_parameter", e.body
        e = expect_status(lambda: self.chat(max_tokens=2, extra_body={"chat_template_kwargs": {
            "enable_thinking": "no"}}), openai.BadRequestError, 400)
        assert e.body["param"] == "chat_template_kwargs.enable_thinking", e.body


def main():
    model = make_tiny_model()
    runner = Runner()
    server = LilyServer(model, "--api-key", KEY, "--ctx-size", "4096", "--served-model-name", "tiny")
    try:
        server.start()
        c = Compat(server)
        for name in [n for n in dir(Compat) if n.startswith("test_")]:
            runner.run(name, getattr(c, name))
    finally:
        server.kill()
    return runner.finish()


if __name__ == "__main__":
    main_guard(main)
