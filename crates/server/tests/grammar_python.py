"""Structured output through the official `openai` package against a random-weight model:
json_schema responses and forced tool calls are valid for every seed. Used by tests/grammar.rs.
Prints 'N passed, M failed'; exit status 0 when all passed."""

import json
import sys

from openai import OpenAI

from checks import check, report

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="none")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "ok"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}}]


for seed in range(3):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Who are you?"}],
        temperature=1.0, seed=seed, max_tokens=120,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "who", "schema": SCHEMA, "strict": True}})
    content = r.choices[0].message.content
    try:
        v = json.loads(content)
        check(f"schema seed {seed}: {content}", set(v) == {"name", "ok"} and isinstance(v["ok"], bool)
              and len(v["name"]) <= 8)
    except (TypeError, ValueError) as e:
        check(f"schema seed {seed}: {content!r} ({e})", False)
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        tool_choice="required", temperature=1.0, seed=seed, max_tokens=120)
    calls = r.choices[0].message.tool_calls or []
    check(f"tool call seed {seed}: {r.choices[0].message}", len(calls) == 1
          and calls[0].function.name == "get_weather"
          and json.loads(calls[0].function.arguments).get("city") in ("Paris", "Oslo"))
    check(f"finish reason seed {seed}: {r.choices[0].finish_reason}", r.choices[0].finish_reason == "tool_calls")

report()
