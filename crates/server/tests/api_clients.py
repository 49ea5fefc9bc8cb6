"""Drives a running `hmoe serve` with the official `openai` and `anthropic` Python packages:
any model name, log-probability shapes (chat, legacy completions, /completion), the Responses
API (create, stream, a function-call round trip), the Anthropic Messages API (create, stream, a
tool_use round trip, count_tokens), reasoning streamed as it is generated, chat-template edge
cases.

Run by tests/api_clients.rs. With --scripted the server (the tiny gpt-oss fixture) replays
fixed harmony outputs for the seeds below, so reasoning and tool checks are exact; without it
(a real model) only shapes and consistency are checked.

Exit status 0 when every check passed; prints 'N passed, M failed'.
"""

import argparse
import datetime
import json
import urllib.error
import urllib.request

import anthropic
import openai
from openai import OpenAI

from openai_client import TOOLS, extra, run_checks  # the same directory

# Seeds the Rust test scripts (see api_clients.rs).
REASONING, TOOL, FINAL, LONG = 1001, 1002, 1004, 1005

# openai_client.py's function, without its description.
FUNCTION = {k: v for k, v in TOOLS[0]["function"].items() if k != "description"}
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def scripted(fn):
    fn.scripted_only = True
    return check(fn)


def post(ctx, path, body):
    req = urllib.request.Request(ctx.root + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@check
def any_model_name(ctx):
    r = ctx.oa.chat.completions.create(model="gpt-4o-some-name-the-server-never-heard-of",
                                       messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == ctx.model, r.model
    assert [m.id for m in ctx.oa.models.list()] == [ctx.model]


@check
def chat_logprobs_shape(ctx):
    r = ctx.oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "Count to five"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
    for t in content:
        assert t.logprob <= 0 and isinstance(t.bytes, list) and len(t.top_logprobs) == 3
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True), lps
        # Greedy: the chosen token is the most likely one.
        assert t.token == t.top_logprobs[0].token and abs(t.logprob - lps[0]) < 1e-5, t
    # Streamed: the same tokens, chunk by chunk.
    streamed = []
    for c in ctx.oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "Count to five"}],
                                            max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True):
        if c.choices and c.choices[0].logprobs:
            streamed += [t.token for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content], (streamed, content)


@check
def completion_logprobs_shape(ctx):
    r = ctx.oa.completions.create(model="x", prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and abs(chosen - max(top.values())) < 1e-5, (tok, chosen, top)
    assert lp.text_offset == sorted(lp.text_offset)


@check
def native_n_probs(ctx):
    status, r = post(ctx, "/completion", {"prompt": "The capital of France is", "n_predict": 4,
                                          "temperature": 0, "n_probs": 3})
    assert status == 200, r
    probs = r["completion_probabilities"]
    assert len(probs) == r["tokens_predicted"]
    for p in probs:
        assert set(p) >= {"id", "token", "logprob", "bytes", "top_logprobs"}, p
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]
    status, r = post(ctx, "/completion", {"prompt": "The capital of France is", "n_predict": 4,
                                          "temperature": 0, "n_probs": 3, "post_sampling_probs": True})
    assert status == 200, r
    for p in r["completion_probabilities"]:
        assert set(p) >= {"id", "token", "prob", "bytes", "top_probs"} and "logprob" not in p, p
        assert 0 < p["prob"] <= 1 and 1 <= len(p["top_probs"]) <= 3
        # Greedy keeps one candidate: all the probability is on it.
        assert abs(p["top_probs"][0]["prob"] - 1.0) < 1e-6, p


@check
def responses_create_and_stream(ctx):
    kw = dict(model="any", input="Say hi", max_output_tokens=ctx.n, temperature=0)
    if ctx.scripted:
        kw.update(instructions="Be brief.", extra_body={"seed": REASONING})
    r = ctx.oa.responses.create(**kw)
    assert r.object == "response" and r.model == ctx.model
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= ctx.n
    assert r.status == ("incomplete" if r.usage.output_tokens == ctx.n else "completed"), r
    if ctx.scripted:
        assert r.status == "completed", r.status
        assert [o.type for o in r.output] == ["reasoning", "message"], r.output
        assert r.output[0].content[0].text == "The user says hi."
        assert r.output_text == "Hello there!"
        assert r.usage.output_tokens_details.reasoning_tokens > 0
    with ctx.oa.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # The last event carries the whole response: response.completed, or response.incomplete
    # when the token limit cut it.
    assert events[0].type == "response.created" and events[-1].type == "response." + r.status, events[-1]
    final = events[-1].response
    assert "".join(deltas) == final.output_text == r.output_text, (deltas, final.output_text, r.output_text)
    if ctx.scripted:
        assert len(deltas) > 1, deltas
        assert [o.type for o in final.output] == ["reasoning", "message"]


@scripted
def responses_function_call_round_trip(ctx):
    tools = [dict(type="function", **FUNCTION)]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = ctx.oa.responses.create(model="x", input=question, tools=tools, extra_body={"seed": TOOL})
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", r.output
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    with ctx.oa.responses.stream(model="x", input=question, tools=tools, extra_body={"seed": TOOL}) as stream:
        args = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert json.loads(args) == {"city": "Paris"}
    assert [o.name for o in final.output if o.type == "function_call"] == ["get_weather"]
    history = question + [o.model_dump(exclude_none=True) for o in r.output] + [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"temp_c": 21})}]
    r2 = ctx.oa.responses.create(model="x", input=history, tools=tools, extra_body={"seed": FINAL})
    assert r2.output_text == "It is sunny in Paris.", r2.output
    # The call and its result reached the prompt in harmony form.
    status, t = post(ctx, "/apply-template", {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "21"}]})
    assert status == 200 and "<|start|>functions.get_weather to=assistant" in t["prompt"], t


def claude(ctx):
    return anthropic.Anthropic(base_url=ctx.root, api_key="none", max_retries=0, timeout=60)


@check
def messages_create_and_stream(ctx):
    kw = dict(model="claude-whatever", max_tokens=ctx.n, system="Be brief.",
              messages=[{"role": "user", "content": "Say hi"}],
              extra_body={"temperature": 0, "seed": REASONING} if ctx.scripted else {"temperature": 0})
    m = claude(ctx).messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == ctx.model
    assert m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason
    assert 0 < m.usage.output_tokens <= ctx.n
    if ctx.scripted:
        assert [b.type for b in m.content] == ["thinking", "text"], m.content
        assert m.content[0].thinking == "The user says hi." and m.content[1].text == "Hello there!"
        assert m.stop_reason == "end_turn"
    with claude(ctx).messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    texts = [b.text for b in m.content if b.type == "text"]
    assert text == "".join(texts) == "".join(b.text for b in final.content if b.type == "text"), (text, texts)
    assert final.stop_reason == m.stop_reason
    n = claude(ctx).messages.count_tokens(model="x", system="Be brief.", messages=kw["messages"]).input_tokens
    longer = claude(ctx).messages.count_tokens(
        model="x", system="Be brief.", messages=[{"role": "user", "content": "Say hi " * 20}]).input_tokens
    assert 0 < n < longer and n == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), (n, longer, m.usage)


@scripted
def messages_tool_use_round_trip(ctx):
    tools = [{"name": FUNCTION["name"], "input_schema": FUNCTION["parameters"]}]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    c = claude(ctx)
    m = c.messages.create(model="x", max_tokens=64, tools=tools, messages=question, extra_body={"seed": TOOL})
    assert m.stop_reason == "tool_use", m
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].input == {"city": "Paris"}, m.content
    assert use[0].id.startswith("toolu_")
    with c.messages.stream(model="x", max_tokens=64, tools=tools, messages=question, extra_body={"seed": TOOL}) as s:
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("get_weather", {"city": "Paris"})]
    assert final.stop_reason == "tool_use"
    history = question + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "21 C, sunny"}]},
    ]
    m2 = c.messages.create(model="x", max_tokens=64, tools=tools, messages=history, extra_body={"seed": FINAL})
    assert [b.text for b in m2.content if b.type == "text"] == ["It is sunny in Paris."], m2.content
    assert m2.stop_reason == "end_turn"


@scripted
def reasoning_streams_token_by_token(ctx):
    chunks = []
    for c in ctx.oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=64, stream=True, seed=LONG):
        if c.choices:
            d = c.choices[0].delta
            chunks.append((extra(d, "reasoning_content") or "", d.content or ""))
    reasoning = [r for r, _ in chunks if r]
    content = [t for _, t in chunks if t]
    assert len(reasoning) >= 6 and len(content) >= 4, chunks
    assert "".join(reasoning) == "one two three four five six" and "".join(content) == "alpha beta gamma delta"
    first_content = next(i for i, (_, t) in enumerate(chunks) if t)
    assert all(not r for r, _ in chunks[first_content:]), "reasoning comes before content"


@scripted
def non_harmony_output_streams(ctx):
    # The random-weight fixture does not write harmony: its text still streams as it comes.
    n_chunks, text, usage = 0, "", None
    for c in ctx.oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                                            temperature=1, seed=7, stream=True, stream_options={"include_usage": True}):
        if c.usage:
            usage = c.usage
        if c.choices and c.choices[0].delta.content:
            n_chunks += 1
            text += c.choices[0].delta.content
    assert usage.completion_tokens >= 8 and n_chunks >= usage.completion_tokens // 2, (n_chunks, usage, text)


@check
def template_edge_cases(ctx):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": FUNCTION["parameters"]}}]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Thanks"},
    ]
    # Null and empty assistant content, a tool message, a tool without description: 200.
    if not ctx.templates_only:
        r = ctx.oa.chat.completions.create(model="x", messages=history, tools=tools, max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    status, t = post(ctx, "/apply-template", {"messages": history, "tools": tools})
    assert status == 200 and "Thanks" in t["prompt"], t
    status, t2 = post(ctx, "/apply-template", {"messages": history, "tools": tools, "add_generation_prompt": False})
    assert status == 200 and t["prompt"].startswith(t2["prompt"]) and len(t2["prompt"]) < len(t["prompt"]), (t, t2)
    if ctx.scripted:
        today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        assert "Current date: " + today in t["prompt"], t["prompt"][:300]
        # Reasoning given back before a tool call (with no final answer after it yet) is
        # rendered as the analysis channel.
        status, t3 = post(ctx, "/apply-template", {"messages": history[:3], "tools": tools})
        assert status == 200 and "<|channel|>analysis<|message|>Use the tool.<|end|>" in t3["prompt"], t3
        # The template's own error is a 400 with its message.
        try:
            ctx.oa.chat.completions.create(model="x", messages=[{"role": "tool", "content": "x"}], max_tokens=2)
            raise AssertionError("accepted")
        except openai.BadRequestError as e:
            assert "no previous assistant message with a tool call" in str(e), e


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True, help="http://HOST:PORT")
    p.add_argument("--model", required=True, help="the served name")
    p.add_argument("--scripted", action="store_true")
    p.add_argument("--templates-only", action="store_true", help="only render templates (no generation)")
    ctx = p.parse_args()
    ctx.root = ctx.url.rstrip("/")
    # Token limit: room for the scripted outputs; little for real models (CPU time).
    ctx.n = 64 if ctx.scripted else 12
    ctx.oa = OpenAI(base_url=ctx.root + "/v1", api_key="none", max_retries=0, timeout=60)
    run_checks([fn for fn in CHECKS
                if (ctx.scripted or not getattr(fn, "scripted_only", False))
                and (not ctx.templates_only or fn is template_edge_cases)], ctx)

if __name__ == "__main__":
    main()
