"""Reasoning controls through the official `openai` Python package, one model family per run.

Run by tests/reasoning_controls.rs against in-process servers whose outputs are scripted per
seed (see there): gpt-oss (`reasoning_effort` reaching the harmony system message), Qwen3
(`enable_thinking` closing an empty think block) and DeepSeek R1 (the prompt leaves `<think>`
open). Each toggle is checked twice: in the prompt the server renders (`/apply-template`, and
the prompt's token count in `usage`) and in where the reasoning text lands
(`reasoning_content` or the content), whole and streamed, per `reasoning_format`.

Exit status 0 when every check passed; prints 'N passed, M failed'.
"""

import argparse
import datetime
import json
import urllib.error
import urllib.request

from openai import OpenAI

from openai_client import extra, run_checks

# The seed the Rust test scripts for each family's output.
SCRIPTED = 3001

USER = [{"role": "user", "content": "hi"}]


def apply_template(ctx, body):
    """POST /apply-template; returns (status, parsed body)."""
    req = urllib.request.Request(
        ctx.url + "/apply-template",
        data=json.dumps({"messages": USER, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def prompt(ctx, **body):
    status, j = apply_template(ctx, body)
    assert status == 200, j
    return j["prompt"]


def chat(ctx, **kw):
    """A scripted chat completion: (message, usage)."""
    r = ctx.client.chat.completions.create(
        model=ctx.model, messages=USER, seed=SCRIPTED, max_tokens=64, temperature=0, **kw
    )
    return r.choices[0].message, r.usage


def stream(ctx, **kw):
    """The same, streamed: (reasoning, content) joined from the deltas."""
    reasoning, content = [], []
    for ch in ctx.client.chat.completions.create(
        model=ctx.model, messages=USER, seed=SCRIPTED, max_tokens=64, temperature=0,
        stream=True, **kw
    ):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        reasoning.append(extra(d, "reasoning_content") or "")
        content.append(d.content or "")
    return "".join(reasoning), "".join(content)


def kwargs(**kw):
    return {"extra_body": {"chat_template_kwargs": kw}}


# --- gpt-oss --------------------------------------------------------------------------------

def gptoss_effort_in_system_message(ctx):
    assert "\nReasoning: medium\n" in prompt(ctx)
    assert "\nReasoning: high\n" in prompt(ctx, reasoning_effort="high")
    assert "\nReasoning: low\n" in prompt(ctx, chat_template_kwargs={"reasoning_effort": "low"})
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert f"Current date: {today}\n" in prompt(ctx)


def gptoss_reasoning_lands_per_format(ctx):
    m, _ = chat(ctx, reasoning_effort="high")
    assert extra(m, "reasoning_content") == "The user says hi.", m
    assert m.content == "Hello there!", m
    assert stream(ctx) == ("The user says hi.", "Hello there!")
    m, _ = chat(ctx, extra_body={"reasoning_format": "none"})
    assert extra(m, "reasoning_content") is None, m
    assert m.content.startswith("<|channel|>analysis<|message|>The user says hi.<|end|>"), m
    m, _ = chat(ctx, extra_body={"reasoning_format": "deepseek-legacy"})
    assert extra(m, "reasoning_content") == "The user says hi.", m


# --- Qwen3 ----------------------------------------------------------------------------------

QWEN_OUT = "<think>\nabc\n</think>\n\nxyz"


def qwen3_enable_thinking_in_prompt(ctx):
    on = prompt(ctx)
    off = prompt(ctx, chat_template_kwargs={"enable_thinking": False})
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", repr(on)
    assert off == on + "<think>\n\n</think>\n\n", repr(off)
    # The closed think block is in what the model read.
    _, u_on = chat(ctx)
    _, u_off = chat(ctx, **kwargs(enable_thinking=False))
    assert u_off.prompt_tokens > u_on.prompt_tokens, (u_on, u_off)
    status, j = apply_template(ctx, {"chat_template_kwargs": {"enable_thinking": "false"}})
    assert status == 400 and "expected boolean" in j["error"]["message"], j


def qwen3_reasoning_lands_per_format(ctx):
    m, _ = chat(ctx)
    assert extra(m, "reasoning_content").strip() == "abc", m
    assert m.content == "xyz", m
    r, c = stream(ctx)
    assert (r.strip(), c) == ("abc", "xyz"), (r, c)
    m, _ = chat(ctx, extra_body={"reasoning_format": "none"})
    assert extra(m, "reasoning_content") is None and m.content == QWEN_OUT, m
    # Thinking off: llama-server reads no reasoning out of the text.
    m, _ = chat(ctx, **kwargs(enable_thinking=False))
    assert extra(m, "reasoning_content") is None and m.content == QWEN_OUT, m


# --- DeepSeek R1 ----------------------------------------------------------------------------

def deepseek_open_think_in_prompt(ctx):
    on = prompt(ctx)
    # llama-server's prompt for this template and vocabulary (its BOS is not added by the
    # tokenizer, so the template's stays).
    assert on == "<|endoftext|><｜User｜>hi<｜Assistant｜><think>\n", repr(on)
    off = prompt(ctx, chat_template_kwargs={"enable_thinking": False})
    assert off == on + "</think>", repr(off)


def deepseek_reasoning_lands_per_format(ctx):
    # The output "abc</think>xyz" follows the prompt's "<think>\n": llama-server's answers.
    m, _ = chat(ctx)
    assert (extra(m, "reasoning_content"), m.content) == ("\nabc", "xyz"), m
    assert stream(ctx) == ("\nabc", "xyz")
    m, _ = chat(ctx, extra_body={"reasoning_format": "none"})
    assert extra(m, "reasoning_content") is None and m.content == "<think>\nabc</think>xyz", m
    r, c = stream(ctx, extra_body={"reasoning_format": "none"})
    assert (r, c) == ("", "<think>\nabc</think>xyz"), (r, c)
    m, _ = chat(ctx, **kwargs(enable_thinking=False))
    assert extra(m, "reasoning_content") is None and m.content == "abc</think>xyz", m


FAMILIES = {
    "gpt-oss": [gptoss_effort_in_system_message, gptoss_reasoning_lands_per_format],
    "qwen3": [qwen3_enable_thinking_in_prompt, qwen3_reasoning_lands_per_format],
    "deepseek": [deepseek_open_think_in_prompt, deepseek_reasoning_lands_per_format],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True, help="http://HOST:PORT")
    p.add_argument("--model", required=True)
    p.add_argument("--family", required=True, choices=sorted(FAMILIES))
    ctx = p.parse_args()
    ctx.client = OpenAI(base_url=ctx.url + "/v1", api_key="none", max_retries=0, timeout=60)
    run_checks(FAMILIES[ctx.family], ctx)


if __name__ == "__main__":
    main()
