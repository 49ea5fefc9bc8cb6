//! The gpt-oss chat template renders each fixture conversation exactly as transformers does.

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use hmoe_chat::{ChatError, ChatTemplate};
use serde_json::Value;

use hmoe_testdata::fixtures;

/// The template with `strftime_now` frozen at 2025-06-28 (as the fixtures were rendered).
fn gpt_oss() -> ChatTemplate {
    let src = std::fs::read_to_string(fixtures().join("chat/openai-gpt-oss-120b.jinja"))
        .expect("template");
    let frozen = UNIX_EPOCH + Duration::from_secs(1_751_068_800 + 12 * 3600); // 2025-06-28 12:00 UTC
    ChatTemplate::with_clock(&src, Arc::new(move || frozen)).expect("compile")
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join("chat/gpt-oss-template-cases.json"))
        .expect("cases");
    let v: Value = serde_json::from_str(&text).expect("json");
    v["cases"].as_array().expect("cases array").clone()
}

/// Renders a fixture case with its kwargs.
pub fn render_case(t: &ChatTemplate, case: &Value) -> Result<String, ChatError> {
    let mut kwargs = case["kwargs"].as_object().cloned().unwrap_or_default();
    let add_generation_prompt = kwargs
        .remove("add_generation_prompt")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    kwargs.remove("strftime_now"); // documentation of the frozen clock, not a variable
    let tools = case.get("tools").filter(|t| !t.is_null());
    t.render(
        &case["messages"],
        tools,
        add_generation_prompt,
        &Value::Object(kwargs),
    )
}

#[test]
fn renders_every_case_exactly() {
    let t = gpt_oss();
    let cases = cases();
    assert_eq!(cases.len(), 9);
    let mut failed = Vec::new();
    for case in &cases {
        let name = case["name"].as_str().unwrap_or("?");
        let want = case["expected_text"].as_str().expect("expected_text");
        match render_case(&t, case) {
            Ok(got) if got == want => {}
            Ok(got) => {
                let at = got
                    .bytes()
                    .zip(want.bytes())
                    .position(|(a, b)| a != b)
                    .unwrap_or(got.len().min(want.len()));
                eprintln!(
                    "{name}: differs at byte {at}\n  want …{:?}\n  got  …{:?}",
                    &want[at.saturating_sub(40)..(at + 80).min(want.len())],
                    &got[at.saturating_sub(40)..(at + 80).min(got.len())]
                );
                failed.push(name.to_string());
            }
            Err(e) => {
                eprintln!("{name}: {e}");
                failed.push(name.to_string());
            }
        }
    }
    assert!(failed.is_empty(), "cases not identical: {failed:?}");
}

#[test]
fn raise_exception_is_reported() {
    let t = gpt_oss();
    let msgs = serde_json::json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<|channel|>final<|message|>x"}
    ]);
    match t.render(&msgs, None, true, &Value::Null) {
        Err(ChatError::Raised(m)) => assert!(m.contains("<|channel|> tags"), "{m}"),
        other => panic!("expected a raised error, got {other:?}"),
    }
    // A tool message without a preceding tool call.
    let msgs =
        serde_json::json!([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]);
    assert!(matches!(
        t.render(&msgs, None, true, &Value::Null),
        Err(ChatError::Raised(_))
    ));
    // Syntax errors are template errors.
    assert!(matches!(
        ChatTemplate::new("{% if %}"),
        Err(ChatError::Template(_))
    ));
    assert!(matches!(
        t.render(&msgs, None, true, &serde_json::json!(3)),
        Err(ChatError::Input(_))
    ));
}
