//! The other fixture templates (Qwen3, Qwen3-Coder, DeepSeek V3.1 / R1) render real conversations
//! (tools, tool results, reasoning) with the functions and Python methods they call.

mod common;

use common::template;

use hmoe_chat::{render_template, ChatDelta, ReasoningFormat, ThinkSplitter};
use serde_json::{json, Value};

fn conversation() -> (Value, Value) {
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City"}}, "required": ["city"]}}}]);
    let messages = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, cloudy"},
        {"role": "assistant", "content": "18C and cloudy."},
        {"role": "user", "content": "Thanks! And tomorrow?"}
    ]);
    (messages, tools)
}

fn extra() -> Value {
    json!({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"})
}

#[test]
fn qwen3_templates() {
    let (messages, tools) = conversation();
    for name in ["Qwen-Qwen3-0.6B.jinja", "Qwen3-Coder.jinja"] {
        let out = render_template(&template(name), &messages, Some(&tools), true, &extra())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            out.starts_with("<|im_start|>system\nYou are terse."),
            "{name}: {out}"
        );
        assert!(out.contains("get_weather"), "{name}");
        assert!(out.contains("Paris"), "{name}");
        assert!(out.contains("18C, cloudy"), "{name}");
        assert!(
            out.contains("<|im_start|>user\nThanks! And tomorrow?<|im_end|>\n"),
            "{name}"
        );
        assert!(out.ends_with("<|im_start|>assistant\n"), "{name}: {out}");
    }
    // enable_thinking=false closes an empty think block in the prompt.
    let out = render_template(
        &template("Qwen-Qwen3-0.6B.jinja"),
        &json!([{"role": "user", "content": "hi"}]),
        None,
        true,
        &json!({"enable_thinking": false}),
    )
    .unwrap();
    assert!(
        out.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{out}"
    );
}

#[test]
fn deepseek_templates() {
    let (messages, tools) = conversation();
    for name in [
        "deepseek-ai-DeepSeek-V3.1.jinja",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        "llama-cpp-deepseek-r1.jinja",
    ] {
        let out = render_template(&template(name), &messages, Some(&tools), true, &extra())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(out.starts_with("<｜begin▁of▁sentence｜>"), "{name}: {out}");
        assert!(out.contains("Weather in Paris?"), "{name}");
        assert!(out.contains("Thanks! And tomorrow?"), "{name}");
        assert!(out.contains("<｜Assistant｜>"), "{name}");
    }
}

#[test]
fn r1_prompt_opens_thinking() {
    // R1 distill prompts end inside <think>: the output's reasoning has no opening tag.
    let out = render_template(
        &template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"),
        &json!([{"role": "user", "content": "hi"}]),
        None,
        true,
        &extra(),
    )
    .unwrap();
    let open = out.trim_end().ends_with("<think>");
    let mut s = ThinkSplitter::new(ReasoningFormat::Auto, open.then_some("<think>"));
    let mut d = s.push(if open {
        "Greet back.</think>\n\nHello!"
    } else {
        "<think>Greet back.</think>\n\nHello!"
    });
    d.extend(s.finish());
    assert_eq!(
        d,
        [
            ChatDelta::Reasoning("Greet back.".into()),
            ChatDelta::Content("Hello!".into())
        ]
    );
}
