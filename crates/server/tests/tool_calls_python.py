"""Qwen3-format tool calls through the official `openai` package, whole and streamed, against a
server whose output is scripted (seed 1: reasoning, "Let me check." and two <tool_call> blocks).
Used by tests/tool_calls.rs. Prints 'N passed, M failed'; exit status 0 when all passed."""

import json
import sys

from openai import OpenAI

from checks import check, report

client = OpenAI(base_url=sys.argv[1], api_key="none")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]
WANT = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
MESSAGES = [{"role": "user", "content": "Weather and time in Paris?"}]


r = client.chat.completions.create(model="qwen3moe-tiny", messages=MESSAGES, tools=TOOLS, seed=1,
                                   max_tokens=200)
m = r.choices[0].message
got = [(c.function.name, json.loads(c.function.arguments)) for c in (m.tool_calls or [])]
check(f"whole calls: {m}", got == WANT)
check(f"whole ids: {m}", all(c.id.startswith("call_") and c.type == "function" for c in m.tool_calls or []))
check(f"whole content: {m.content!r}", m.content == "Let me check.")
check(f"whole finish: {r.choices[0].finish_reason}", r.choices[0].finish_reason == "tool_calls")

# Streamed: accumulate the deltas the way SDK users do.
content, finish, acc = "", None, {}
for chunk in client.chat.completions.create(model="qwen3moe-tiny", messages=MESSAGES, tools=TOOLS,
                                            seed=1, max_tokens=200, stream=True):
    if not chunk.choices:
        continue
    ch = chunk.choices[0]
    content += ch.delta.content or ""
    for d in ch.delta.tool_calls or []:
        slot = acc.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
        slot["id"] = slot["id"] or d.id
        slot["name"] += (d.function.name or "") if d.function else ""
        slot["arguments"] += (d.function.arguments or "") if d.function else ""
    finish = ch.finish_reason or finish
streamed = [(acc[i]["name"], json.loads(acc[i]["arguments"])) for i in sorted(acc)]
check(f"streamed calls: {acc}", streamed == WANT)
check(f"streamed ids: {acc}", all((s["id"] or "").startswith("call_") for s in acc.values()))
check(f"streamed content: {content!r}", content == "Let me check.")
check(f"streamed finish: {finish}", finish == "tool_calls")

# The calls go back into the conversation as the next request's history.
history = MESSAGES + [m.model_dump(exclude_none=True)] + [
    {"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in m.tool_calls or []]
r = client.chat.completions.create(model="qwen3moe-tiny", messages=history, tools=TOOLS, seed=1,
                                   max_tokens=200)
check(f"round trip: {r.choices[0]}", r.choices[0].finish_reason == "tool_calls")

report()
