#!/usr/bin/env python3
"""Renders chat-completions requests with the official Qwen3.6 Jinja template exactly as transformers
does, and writes them as fixtures for lily's native renderer (tests/tokenizer/test_chat_format.cpp).

The rendering goes through `tokenizer.apply_chat_template(..., tokenize=False)` on a tokenizer built from
tests/fixtures/qwen3-tokenizer with `chat_template` set to tests/fixtures/chat-templates/qwen3.6.jinja,
so the Jinja environment (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, tojson =
json.dumps(ensure_ascii=False), raise_exception) and the message normalisation are transformers' own.

Request -> call, as an OpenAI-compatible server does it (and as lily's render_chat_request does):
  messages            -> conversation (a tool call's function.arguments given as a JSON string is
                         json.loads'ed first: the template iterates it with |items)
  tools               -> tools
  add_generation_prompt (default True), chat_template_kwargs -> keyword arguments

Output, per case NAME under tests/fixtures/chat/:
  NAME.json          the request, as lily reads it (the rendering below reads this file back)
  NAME.prompt.txt    the exact prompt text, or
  NAME.error.txt     the template's raise_exception message

Usage: python3 tools/reference/render_chat.py [--out tests/fixtures/chat]
"""
import argparse
import copy
import json
import os
import sys

import jinja2
import transformers
from transformers import AutoTokenizer

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
TEMPLATE_PATH = os.path.join(FIXTURES, "chat-templates", "qwen3.6.jinja")
TOKENIZER_DIR = os.path.join(FIXTURES, "qwen3-tokenizer")


# ---- cases -------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_flights",
        "description": "Recherche de vols — 航班搜索 ✈️ (prices in €)",
        "parameters": {
            "type": "object",
            "properties": {
                "route": {
                    "type": "object",
                    "properties": {
                        "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "to": {"type": "string"},
                        "stops": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                    },
                    "required": ["from", "to"],
                },
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9, "default": 1},
                "max_price": {"type": "number", "minimum": 0.5, "multipleOf": 0.01},
                "flexible": {"type": "boolean", "default": False},
                "tolerance": {"type": "number", "default": 1e-06, "exclusiveMaximum": 1e16},
                "cabin": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            },
            "required": ["route"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an expression.\nUse \"quotes\" and back\\slashes;\ttabs too. Control:\u0001 del:\u007f",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
NO_PARAMS_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time."}}


def user(content):
    return {"role": "user", "content": content}


def system(content):
    return {"role": "system", "content": content}


def assistant(content, **extra):
    return {"role": "assistant", "content": content, **extra}


def tool(content, tool_call_id="call_1"):
    return {"role": "tool", "tool_call_id": tool_call_id, "content": content}


def call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def req(messages, tools=None, **extra):
    r = {"model": "qwen3.6", "messages": messages}
    if tools is not None:
        r["tools"] = tools
    r.update(extra)
    return r


NO_THINK = {"enable_thinking": False}
PRESERVE = {"preserve_thinking": True}

WEATHER_LOOP = [
    user("What's the weather in Paris and in Tokyo?"),
    assistant(None, reasoning_content="I should call the tool twice.",
              tool_calls=[call("get_weather", {"city": "Paris"}, "call_a"),
                          call("get_weather", {"city": "Tokyo", "unit": "celsius"}, "call_b")]),
    tool('{"temp": 18, "sky": "cloudy"}', "call_a"),
    tool('{"temp": 24, "sky": "clear"}', "call_b"),
]

CASES = [
    ("basic_user", req([user("Hello!")])),
    ("system_user", req([system("You are a helpful assistant."), user("Hi")])),
    ("no_generation_prompt", req([user("Hi")], add_generation_prompt=False)),
    ("thinking_off", req([user("Hi")], chat_template_kwargs=NO_THINK)),
    ("thinking_on_explicit", req([user("Hi")], chat_template_kwargs={"enable_thinking": True})),
    ("thinking_kwarg_not_bool", req([user("Hi")], chat_template_kwargs={"enable_thinking": "false"})),
    ("system_whitespace_trimmed", req([system("  \n You are terse.\t\n"), user("  Hi there \n\n")])),
    ("empty_contents", req([system(""), user(""), assistant(""), user("")])),
    ("multi_turn_reasoning_dropped", req([
        user("What is 2+2?"),
        assistant("4", reasoning_content="Simple arithmetic."),
        user("And 3+3?"),
        assistant("6", reasoning_content="Also simple."),
        user("Thanks!"),
    ])),
    ("last_turn_reasoning_kept", req([
        user("What is 2+2?"),
        assistant("The answer is 4.", reasoning_content="\n  2 plus 2 is 4.  \n"),
    ], add_generation_prompt=False)),
    ("reasoning_in_content", req([
        user("Plan a trip."),
        assistant("<think>\nLet me plan.\n</think>\n\nHere is the plan."),
    ], add_generation_prompt=False)),
    ("reasoning_in_content_history", req([
        user("Plan a trip."),
        assistant("<think>\nLet me plan.\n</think>\n\nHere is the plan."),
        user("Shorter please."),
    ])),
    ("reasoning_in_content_no_open_tag", req([
        user("q"), assistant("just thinking\n\n</think>\n\n\nanswer text"),
    ], add_generation_prompt=False)),
    ("reasoning_in_content_many_tags", req([
        user("q"), assistant("<think>a</think>b<think>\nc\n</think>\nd</think>\n\n  e"),
    ], add_generation_prompt=False)),
    ("reasoning_content_beats_think_in_content", req([
        user("q"), assistant("<think>inner</think>visible", reasoning_content="outer"),
    ], add_generation_prompt=False)),
    ("reasoning_field_alias", req([
        user("q"), assistant("answer", reasoning="from the reasoning field"),
    ], add_generation_prompt=False)),
    ("reasoning_null_alias", req([
        user("q"), assistant("answer", reasoning_content=None, reasoning="fallback reasoning"),
    ], add_generation_prompt=False)),
    ("reasoning_not_string", req([
        user("q"), assistant("answer", reasoning_content=42),
    ], add_generation_prompt=False)),
    ("assistant_only_reasoning", req([
        user("q"), assistant(None, reasoning_content="thought only"),
    ], add_generation_prompt=False)),
    ("preserve_thinking", req([
        user("What is 2+2?"),
        assistant("4", reasoning_content="Simple arithmetic."),
        user("And 3+3?"),
        assistant("<think>Add three.</think>6"),
        user("Thanks!"),
    ], chat_template_kwargs=PRESERVE)),
    ("preserve_thinking_false", req([
        user("a"), assistant("b", reasoning_content="r"), user("c"),
    ], chat_template_kwargs={"preserve_thinking": False})),
    ("preserve_thinking_thinking_off", req([
        user("a"), assistant("b", reasoning_content="r"), user("c"),
    ], chat_template_kwargs={"preserve_thinking": True, "enable_thinking": False})),
    ("tools_single", req([user("Weather in Paris?")], [WEATHER_TOOL])),
    ("tools_several_nested_unicode", req([user("Find me a flight and the weather.")],
                                         [WEATHER_TOOL, SEARCH_TOOL, CALC_TOOL, NO_PARAMS_TOOL])),
    ("tools_with_system", req([system("You are a travel agent."), user("Book it.")], [WEATHER_TOOL, SEARCH_TOOL])),
    ("tools_with_blank_system", req([system(" \n "), user("Book it.")], [WEATHER_TOOL])),
    ("tools_empty_list", req([system("sys"), user("hi")], [])),
    ("tools_thinking_off", req([user("hi")], [NO_PARAMS_TOOL], chat_template_kwargs=NO_THINK)),
    ("tool_call_null_content", req([
        user("Weather in Paris?"),
        assistant(None, tool_calls=[call("get_weather", {"city": "Paris"})]),
        tool("18 degrees, cloudy"),
    ], [WEATHER_TOOL])),
    ("tool_call_with_content", req([
        user("Weather in Paris?"),
        assistant("Let me check.", tool_calls=[call("get_weather", {"city": "Paris", "unit": "celsius"})]),
        tool("18"),
        assistant("It is 18 °C."),
        user("Thanks"),
    ], [WEATHER_TOOL])),
    ("tool_call_whitespace_content", req([
        user("Weather?"),
        assistant("  \n ", tool_calls=[call("get_weather", {"city": "Oslo"})]),
        tool("-3"),
    ], [WEATHER_TOOL])),
    ("parallel_tool_calls", req(WEATHER_LOOP, [WEATHER_TOOL])),
    ("parallel_tool_calls_then_answer", req(WEATHER_LOOP + [
        assistant("Paris: 18 °C cloudy; Tokyo: 24 °C clear.", reasoning_content="Summarise both."),
        user("Which is warmer?"),
    ], [WEATHER_TOOL])),
    ("tool_responses_three", req([
        user("Check three cities."),
        assistant("", tool_calls=[call("get_weather", {"city": c}, f"call_{i}") for i, c in
                                  enumerate(["Rome", "Lima", "Cairo"])]),
        tool("20", "call_0"), tool("15", "call_1"), tool("  30  \n", "call_2"),
        assistant("Done."),
    ], [WEATHER_TOOL], add_generation_prompt=False)),
    ("tool_response_then_user", req([
        user("Weather?"),
        assistant(None, tool_calls=[call("get_weather", {"city": "Bern"})]),
        tool("12"),
        user("Also tell me a joke."),
    ], [WEATHER_TOOL])),
    ("multi_step_tool_loop", req([
        user("Plan my day."),
        assistant("Checking the weather.", reasoning_content="Step 1: weather.",
                  tool_calls=[call("get_weather", {"city": "Paris"})]),
        tool("sunny"),
        assistant(None, reasoning_content="Step 2: time.", tool_calls=[call("get_time", {}, "call_2")]),
        tool("09:00", "call_2"),
    ], [WEATHER_TOOL, NO_PARAMS_TOOL])),
    ("multi_step_then_new_query", req([
        user("Plan my day."),
        assistant(None, reasoning_content="Weather first.", tool_calls=[call("get_weather", {"city": "Paris"})]),
        tool("sunny"),
        assistant("Go for a walk.", reasoning_content="It is sunny."),
        user("And tomorrow?"),
        assistant(None, reasoning_content="Check again.", tool_calls=[call("get_weather", {"city": "Paris"})]),
        tool("rain"),
    ], [WEATHER_TOOL])),
    ("user_text_like_tool_response", req([
        user("Real question"),
        assistant("first", reasoning_content="r1"),
        user("<tool_response>\nmanual\n</tool_response>"),
        assistant("second", reasoning_content="r2"),
    ], add_generation_prompt=False)),
    ("arguments_as_json_string", req([
        user("Weather?"),
        assistant(None, tool_calls=[call("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                                    call("search_flights", '{"route":{"from":"CDG","to":"NRT"},"passengers":2}',
                                         "call_2")]),
        tool("ok"),
    ], [WEATHER_TOOL, SEARCH_TOOL])),
    ("parameter_value_types", req([
        user("Search."),
        assistant("Searching.", tool_calls=[call("search_flights", {
            "route": {"from": "CDG", "to": "東京", "stops": ["HEL", "ICN"]},
            "passengers": 2, "max_price": 1234.5, "flexible": True, "cabin": None,
            "tolerance": 1e-06, "ratio": 0.1, "big": 1e16, "whole_float": 1.0, "neg": -0.0,
            "huge_int": 12345678901234567890, "neg_int": -42, "empty_obj": {}, "empty_list": [],
            "text_number": "42", "multiline": "line 1\nline 2\n", "quote": "say \"hi\" \\ bye",
            "nested": {"a": [1, 2.5, {"b": None, "c": False}], "ü": "ß😀"},
        })]),
        tool("[]"),
    ], [SEARCH_TOOL])),
    ("parameter_floats_from_strings", req([
        user("x"),
        assistant(None, tool_calls=[call("calculate", '{"a": 1e2, "b": 1.50, "c": 0.00001, "d": 123456789012345678.0,'
                                                      ' "e": 2.5e-300, "f": 1E+22, "g": 3.14159265358979}')]),
    ], add_generation_prompt=False)),
    ("tool_call_flat_no_function_wrapper", req([
        user("x"), assistant(None, tool_calls=[{"name": "get_time", "arguments": {"tz": "UTC"}}]),
    ], add_generation_prompt=False)),
    ("tool_call_without_arguments", req([
        user("x"), assistant(None, tool_calls=[{"type": "function", "function": {"name": "get_time"}}]),
    ], add_generation_prompt=False)),
    ("tool_call_reasoning_in_content", req([
        user("time?"),
        assistant("<think>\nneed the clock\n</think>\n\nOne moment.", tool_calls=[call("get_time", "{}")]),
        tool("noon"),
    ], [NO_PARAMS_TOOL])),
    ("tool_message_first", req([tool("orphan result"), user("hi")])),
    ("content_text_parts", req([
        system([{"type": "text", "text": "Be brief. "}, {"type": "text", "text": " Be kind."}]),
        user([{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]),
        assistant([{"type": "text", "text": "Reply."}]),
        user([{"type": "text", "text": "  again  "}]),
    ])),
    ("content_vision_parts", req([
        user([{"type": "text", "text": "Compare "},
              {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
              {"type": "image", "image": "file.png"},
              {"type": "video", "video": "clip.mp4"},
              {"type": "text", "text": " please."}]),
        assistant("They differ."),
        user([{"type": "image"}, {"type": "text", "text": "and this?"}]),
    ])),
    ("content_vision_ids", req([
        user([{"type": "image_url", "image_url": {"url": "a"}}, {"type": "video", "video": "v"},
              {"type": "text", "text": "two things"}]),
        assistant([{"type": "text", "text": "ok"}]),
        user([{"type": "image", "image": "b"}, {"type": "video", "video": "w"}, {"type": "image"}]),
    ], chat_template_kwargs={"add_vision_id": True})),
    ("content_odd_parts", req([
        user(["a text item", ["text"], {"type": "text", "text": 5}, {"text": None},
              {"text": {"k": "v'q", "n": [1, 2.5, True]}}, "has image inside"]),
    ])),
    ("unicode_emoji", req([
        system("Tu es un assistant 🤖. Réponds en français."),
        user("こんにちは 👋🏽 — how are you? עברית, ελληνικά, e\u0301"),
        assistant("Très bien 😀! 你好", reasoning_content="用户在打招呼 🙂"),
        user("Encore 🎉"),
    ])),
    ("unicode_whitespace_trim", req([
        user("\u3000\u00a0 wide space \u2003\u2028"),
        assistant("\u205f answer \u0085", reasoning_content="\u2009 thin \u202f"),
    ], add_generation_prompt=False)),
    ("special_tokens_in_text", req([
        user("Explain <|im_start|> and <tool_call> tags."),
        assistant("They are <|im_end|> markers."),
        user("ok"),
    ])),
    ("long_conversation_mixed", req([
        system("Mixed."),
        user("1"), assistant("a", reasoning_content="ra"),
        user("2"), assistant(None, reasoning_content="rb", tool_calls=[call("get_time", {})]), tool("t"),
        assistant("b"), user("3"), assistant("<think>rc</think>c"),
        user([{"type": "text", "text": "4"}]),
    ], [NO_PARAMS_TOOL], chat_template_kwargs={"enable_thinking": False})),
    # Errors the template raises.
    ("error_system_not_first", req([user("hi"), system("late system")])),
    ("error_no_user_query", req([system("sys"), assistant("hello")])),
    ("error_only_tool_responses", req([user("<tool_response>\nx\n</tool_response>"), tool("y")])),
    ("error_unknown_role", req([user("hi"), {"role": "developer", "content": "dev note"}])),
    ("error_unexpected_content_type", req([user({"text": "a mapping"})])),
    ("error_unexpected_item_type", req([user([{"type": "input_audio", "input_audio": {"data": ""}}])])),
    ("error_system_image", req([system([{"type": "image_url", "image_url": {"url": "x"}}]), user("hi")])),
    ("error_system_video", req([system([{"type": "video"}]), user("hi")], [NO_PARAMS_TOOL])),
]


def random_cases(n, seed=1234):
    """Seeded random conversations: role orders, whitespace, </think> placement, tool calls, parts."""
    import random
    rng = random.Random(seed)
    pieces = ["hi", " ", "\n", "\n\n", "<think>", "</think>", "<tool_response>", "</tool_response>", "é", "😀",
              "\u3000", "\t", "x y", "{}", "\"q\""]

    def text():
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))

    def content():
        r = rng.random()
        if r < 0.6:
            return text()
        if r < 0.7:
            return None
        return [{"type": "text", "text": text()} for _ in range(rng.randint(0, 3))]

    def value():
        return rng.choice([text(), rng.randint(-5, 99), rng.random() * 10 ** rng.randint(-8, 18), True, None,
                           [1, "a"], {"k": text()}])

    def message(role):
        m = {"role": role, "content": content()}
        if role == "assistant":
            if rng.random() < 0.4:
                m["reasoning_content"] = text()
            if rng.random() < 0.4:
                calls = []
                for i in range(rng.randint(1, 3)):
                    args = {f"p{j}": value() for j in range(rng.randint(0, 3))}
                    if rng.random() < 0.5:
                        args = json.dumps(args)
                    calls.append({"id": f"c{i}", "type": "function", "function": {"name": f"fn_{i}", "arguments": args}})
                m["tool_calls"] = calls
        return m

    cases = []
    for k in range(n):
        roles = ["system"] if rng.random() < 0.5 else []
        roles += [rng.choice(["user", "user", "assistant", "tool", "tool"]) for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.85:  # most conversations hold a real query
            roles.insert(rng.randint(1 if roles[0] == "system" else 0, len(roles)), "user")
        if rng.random() < 0.1:
            roles.insert(rng.randrange(len(roles) + 1), "system")
        extra = {}
        if rng.random() < 0.3:
            extra["tools"] = [WEATHER_TOOL, NO_PARAMS_TOOL][: rng.randint(1, 2)]
        if rng.random() < 0.5:
            extra["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5,
                                             "preserve_thinking": rng.random() < 0.3}
        if rng.random() < 0.2:
            extra["add_generation_prompt"] = False
        cases.append((f"random_{k:02d}", req([message(r) for r in roles], **extra)))
    return cases


CASES += random_cases(40)


def parse_string_arguments(messages):
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(calls, list):
            continue
        for call in calls:
            if not isinstance(call, dict):
                continue
            function = call["function"] if "function" in call else call
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                function["arguments"] = json.loads(function["arguments"])
    return messages


def render_request(tokenizer, template, request):
    messages = parse_string_arguments(copy.deepcopy(request["messages"]))
    kwargs = dict(request.get("chat_template_kwargs") or {})
    return tokenizer.apply_chat_template(
        messages,
        tools=request.get("tools"),
        chat_template=template,
        tokenize=False,
        add_generation_prompt=request.get("add_generation_prompt", True),
        **kwargs,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures", "chat"))
    args = parser.parse_args()
    with open(TEMPLATE_PATH, encoding="utf-8") as f:
        template = f.read()
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):
        if name.endswith((".json", ".prompt.txt", ".error.txt")):
            os.remove(os.path.join(args.out, name))

    names = set()
    n_prompts = n_errors = 0
    for name, request in CASES:
        assert name not in names, f"duplicate case name {name}"
        names.add(name)
        request_path = os.path.join(args.out, name + ".json")
        with open(request_path, "w", encoding="utf-8") as f:
            f.write(json.dumps(request, ensure_ascii=False, indent=1) + "\n")
        with open(request_path, encoding="utf-8") as f:
            request = json.load(f)  # render exactly what lily will read
        try:
            text, suffix = render_request(tokenizer, template, request), ".prompt.txt"
            n_prompts += 1
        except jinja2.exceptions.TemplateError as e:
            # Only the template's own raise_exception (a bare TemplateError) is a fixture; anything
            # else (UndefinedError, TypeError) means the case is wrong.
            if type(e) is not jinja2.exceptions.TemplateError:
                raise
            text, suffix = str(e), ".error.txt"
            n_errors += 1
        with open(os.path.join(args.out, name + suffix), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    print(f"wrote {n_prompts} prompts and {n_errors} errors to {args.out} "
          f"(transformers {transformers.__version__}, jinja2 {jinja2.__version__})")


if __name__ == "__main__":
    main()
