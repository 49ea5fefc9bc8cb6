"""Forced tool calls (tool_choice "required" and a named function) through the official `openai`
package, against a server on random weights at temperature 1 whose output a grammar forces into
its chat template's tool-call format (argv[2] names it: Qwen3 <tool_call>, DeepSeek's markup...).
Streamed: the deltas must be OpenAI's (index, id and type and name on a call's first delta,
argument fragments after) and add up to arguments valid for the tool's schema. Used by
tests/tool_calls.rs. Prints 'N passed, M failed'; exit status 0 when all passed."""

import json
import sys

from openai import OpenAI

from checks import check, report

client = OpenAI(base_url=sys.argv[1], api_key="none")
LABEL = sys.argv[2]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop", "description": "Nothing", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def valid(name, args, choice):
    if name == "get_weather":
        return args.get("city") in ("Paris", "Oslo") and args.get("days") in range(1, 10)
    return name == "noop" and choice == "required" and args == {}


def stream(choice, seed):
    """One streamed request: (calls by index, content, finish reason, the raw call deltas)."""
    acc, content, finish, deltas = {}, "", None, []
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                                tool_choice=choice, temperature=1.0, seed=seed,
                                                max_tokens=150, stream=True):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            deltas.append(d)
            slot = acc.setdefault(d.index, {"id": None, "type": None, "name": "", "arguments": ""})
            if d.id is not None:
                check(f"{LABEL}: one id per call: {d}", slot["id"] is None)
                slot["id"] = d.id
                slot["type"] = d.type
            if d.function is not None:
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    return acc, content, finish, deltas


for seed in range(3):
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        what = f"{LABEL} seed {seed} {choice}"
        r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                           tool_choice=choice, temperature=1.0, seed=seed,
                                           max_tokens=150)
        m = r.choices[0].message
        check(f"{what}: whole finish {r.choices[0].finish_reason}: {m}",
              r.choices[0].finish_reason == "tool_calls")
        whole = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        check(f"{what}: one whole call {m}", len(whole) == 1 and valid(*whole[0], choice))
        check(f"{what}: no markup in content {m.content!r}", not (m.content or "").strip())

        acc, content, finish, deltas = stream(choice, seed)
        check(f"{what}: streamed finish {finish}", finish == "tool_calls")
        check(f"{what}: streamed content {content!r}", not content.strip())
        check(f"{what}: one streamed call {acc}", sorted(acc) == [0])
        first = deltas[0] if deltas else None
        check(f"{what}: first delta carries id, type and name: {first}",
              first is not None and (first.id or "").startswith("call_")
              and first.type == "function" and first.function.name in ("get_weather", "noop"))
        check(f"{what}: later deltas only add arguments: {deltas[1:]}",
              all(d.id is None and (d.function is None or not d.function.name) for d in deltas[1:]))
        streamed = [(s["name"], json.loads(s["arguments"])) for s in acc.values()]
        check(f"{what}: streamed call valid {acc}", len(streamed) == 1 and valid(*streamed[0], choice))
        check(f"{what}: streamed equals whole", streamed == whole)

# The call goes back into the conversation: the template renders the assistant turn and the
# tool's answer, and a forced call follows again.
r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                   temperature=1.0, seed=5, max_tokens=150)
m = r.choices[0].message
history = MESSAGES + [m.model_dump(exclude_none=True)] + [
    {"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in m.tool_calls or []]
r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="required",
                                   temperature=1.0, seed=6, max_tokens=150)
check(f"{LABEL}: round trip {r.choices[0]}", r.choices[0].finish_reason == "tool_calls")

report()
