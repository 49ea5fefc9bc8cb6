"""Drives a running `hmoe serve` with the official `openai` Python package (and curl).

Run by tests/openai_python.rs (in-process server with scripted outputs) and by the CLI's
serve test (the real binary). Checks protocol behaviour, not content: the test models have
random weights. With --scripted, the server replays fixed harmony outputs for the seeds below,
which makes reasoning and tool-call checks deterministic.

Exit status 0 when every check passed; prints 'N passed, M failed'.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request

import openai
from openai import OpenAI

# Seeds the Rust test scripts (see openai_python.rs).
REASONING, TOOL, FINAL = 1001, 1002, 1004

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def extra(obj, key):
    """A field the SDK does not model (llama-server extensions such as reasoning_content)."""
    value = getattr(obj, key, None)
    if value is None and obj.model_extra:
        value = obj.model_extra.get(key)
    return value


@check
def models(ctx):
    ids = [m.id for m in ctx.client.models.list()]
    assert ctx.model in ids, ids


@check
def chat_non_stream(ctx):
    r = ctx.client.chat.completions.create(
        model=ctx.model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    assert 0 < r.usage.completion_tokens <= 8, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@check
def chat_stream(ctx):
    chunks = list(ctx.client.chat.completions.create(
        model=ctx.model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length"), finishes
    assert chunks[-1].usage is not None and 0 < chunks[-1].usage.completion_tokens <= 8
    assert all(c.object == "chat.completion.chunk" for c in chunks)


@check
def completions(ctx):
    r = ctx.client.completions.create(model=ctx.model, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str)
    assert 0 < r.usage.completion_tokens <= 6
    streamed = "".join(c.choices[0].text for c in ctx.client.completions.create(
        model=ctx.model, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text, (streamed, r.choices[0].text)


@check
def logprobs(ctx):
    r = ctx.client.chat.completions.create(
        model=ctx.model, messages=[{"role": "user", "content": "x"}], max_tokens=4, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


@check
def auth_and_errors(ctx):
    if ctx.api_key != "none":
        bad = OpenAI(base_url=ctx.base_url, api_key="wrong-key", max_retries=0)
        assert [m.id for m in bad.models.list()], "/v1/models is public"
        try:
            bad.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}], max_tokens=2)
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401
    req = urllib.request.Request(ctx.base_url + "/chat/completions", data=b'{"messages": [',
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer " + ctx.api_key})
    try:
        urllib.request.urlopen(req)
        raise AssertionError("malformed JSON was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400, e.code
        assert json.loads(e.read())["error"]["type"] == "invalid_request_error"
    # One model answers any name, under its own (as llama-server does).
    r = ctx.client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=1)
    assert r.model == ctx.model, r.model


@check
def curl_routes(ctx):
    root = ctx.base_url[: -len("/v1")]
    if shutil.which("curl"):
        def get(path, data=None):
            cmd = ["curl", "-s", "-H", "Authorization: Bearer " + ctx.api_key, root + path]
            if data is not None:
                cmd += ["-H", "Content-Type: application/json", "-d", data]
            return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout
    else:
        def get(path, data=None):
            req = urllib.request.Request(root + path, data=data.encode() if data else None,
                                         headers={"Authorization": "Bearer " + ctx.api_key,
                                                  "Content-Type": "application/json"})
            return urllib.request.urlopen(req, timeout=30).read().decode()
    assert json.loads(get("/health")) == {"status": "ok"}
    assert "llamacpp:prompt_tokens_total" in get("/metrics")
    tokens = json.loads(get("/tokenize", '{"content": "Hello world"}'))["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    assert json.loads(get("/detokenize", json.dumps({"tokens": tokens})))["content"] == "Hello world"


@check
def reasoning(ctx):
    if not ctx.scripted:
        return
    r = ctx.client.chat.completions.create(
        model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=64, seed=REASONING)
    m = r.choices[0].message
    if ctx.reasoning_format == "none":
        assert extra(m, "reasoning_content") is None
        assert "<|channel|>analysis<|message|>The user says hi." in m.content, m.content
    else:
        assert extra(m, "reasoning_content") == "The user says hi.", m
        assert m.content == "Hello there!"
        # Per-request override.
        r = ctx.client.chat.completions.create(
            model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=64, seed=REASONING,
            extra_body={"reasoning_format": "none"})
        assert extra(r.choices[0].message, "reasoning_content") is None
    # Streamed reasoning deltas.
    reasoning_text, content = "", ""
    for c in ctx.client.chat.completions.create(
            model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=64, seed=REASONING, stream=True):
        if c.choices:
            reasoning_text += extra(c.choices[0].delta, "reasoning_content") or ""
            content += c.choices[0].delta.content or ""
    if ctx.reasoning_format == "none":
        assert reasoning_text == "" and "The user says hi." in content
    else:
        assert (reasoning_text, content) == ("The user says hi.", "Hello there!")


@check
def tool_call_round_trip(ctx):
    if not ctx.scripted or ctx.reasoning_format == "none":
        return
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = ctx.client.chat.completions.create(
        model=ctx.model, messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=64, seed=TOOL)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.finish_reason
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # Streamed: the same call in deltas.
    name, args, finish = None, "", None
    for c in ctx.client.chat.completions.create(
            model=ctx.model, messages=messages, tools=TOOLS, max_tokens=64, seed=TOOL, stream=True):
        if not c.choices:
            continue
        for tc in c.choices[0].delta.tool_calls or []:
            name = tc.function.name or name
            args += tc.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")
    # The result goes back; the model answers.
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})})
    r = ctx.client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, max_tokens=64, seed=FINAL)
    assert r.choices[0].message.content == "It is sunny in Paris.", r
    assert r.choices[0].finish_reason == "stop"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True, help="http://HOST:PORT/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--model", required=True)
    p.add_argument("--scripted", action="store_true")
    p.add_argument("--reasoning-format", default="auto")
    ctx = p.parse_args()
    ctx.client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=60)
    run_checks(CHECKS, ctx)


def run_checks(checks, ctx):
    """Runs every check, reports each and the totals, exits 1 if any failed."""
    passed = failed = 0
    for fn in checks:
        t0 = time.monotonic()
        try:
            fn(ctx)
            passed += 1
            print(f"ok   {fn.__name__} ({time.monotonic() - t0:.1f} s)")
        except Exception:  # noqa: BLE001 - report every failing check
            failed += 1
            print(f"FAIL {fn.__name__}")
            traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
