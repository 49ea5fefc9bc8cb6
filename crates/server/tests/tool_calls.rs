//! Tool calls of a non-harmony template through the server: the Qwen3-MoE fixture served with
//! Qwen3's chat template (`--chat-template-file`), its output scripted to the text Qwen3 is
//! taught (`<think>` reasoning, content, `<tool_call>` JSON), read back as `tool_calls` on the
//! OpenAI chat route (whole and streamed, over HTTP and through the official `openai` package),
//! as `tool_use` blocks on /v1/messages and `function_call` items on /v1/responses;
//! `parallel_tool_calls: false` stops at the first call, `tool_choice: "none"` and requests
//! without tools read no calls.

mod common;

use std::process::Command;

use common::*;
use hmoe_server::{ModelSource, ServerConfig};
use serde_json::{json, Value};

const TWO_CALLS: &str = "<think>\nThe user wants weather and time.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n</tool_call><|endoftext|>";
const BROKEN: &str =
    "Hmm <tool_call>\n{\"name\": \"get_weather\", oops}\n</tool_call><|endoftext|>";

const QWEN3: (&str, &str) = ("qwen3moe/qwen3moe-tiny.gguf", "Qwen-Qwen3-0.6B.jinja");

/// A server for fixture `model` with fixture chat template `template`.
fn config((model, template): (&str, &str)) -> ServerConfig {
    let mut c = ServerConfig::new(ModelSource::File(fixtures().join(model)));
    c.port = 0;
    c.engine.n_ctx = 4096;
    c.engine.n_parallel = 2;
    c.engine.n_ubatch = 64;
    c.chat.template =
        Some(std::fs::read_to_string(fixtures().join("chat").join(template)).expect("template"));
    c
}

/// Qwen3 with scripted output: seed 1 two calls, seed 2 a broken one.
fn server() -> hmoe_server::RunningServer {
    let mut c = config(QWEN3);
    let tok = tokenizer(&fixtures().join(QWEN3.0));
    c.picker = Some(scripted(&tok, &[(1, TWO_CALLS), (2, BROKEN)]));
    start(c)
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "description": "Time",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
    ])
}

fn chat(seed: u64, extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Weather and time in Paris?"}],
                          "seed": seed, "max_tokens": 200, "tools": tools()});
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            body.as_object_mut().unwrap().remove(k);
        } else {
            body[k] = v.clone();
        }
    }
    body
}

fn calls_of(msg: &Value) -> Vec<(String, Value)> {
    msg["tool_calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    assert_eq!(c["type"], "function", "{c}");
                    assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
                    let args = c["function"]["arguments"].as_str().unwrap();
                    (
                        c["function"]["name"].as_str().unwrap().to_string(),
                        serde_json::from_str(args).unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn both_calls() -> Vec<(String, Value)> {
    vec![
        ("get_weather".into(), json!({"city": "Paris"})),
        ("get_time".into(), json!({"zone": "CET"})),
    ]
}

#[test]
fn qwen3_tool_calls_whole_and_streamed() {
    let s = server();
    let a = s.local_addr();
    // The template was given the tools.
    let r = post(a, "/apply-template", &chat(1, json!({})));
    assert!(
        r.json()["prompt"].as_str().unwrap().contains("<tools>"),
        "{}",
        r.body
    );

    let r = post(a, "/v1/chat/completions", &chat(1, json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let c = &r.json()["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{c}");
    assert_eq!(c["message"]["content"], "Let me check.", "{c}");
    assert_eq!(
        c["message"]["reasoning_content"],
        "\nThe user wants weather and time.\n"
    );
    assert_eq!(calls_of(&c["message"]), both_calls(), "{c}");

    // Streamed: content deltas never show the markup; each call comes whole in one delta.
    let mut sse = Sse::open(a, "/v1/chat/completions", &chat(1, json!({"stream": true})));
    let (mut content, mut finish) = (String::new(), Value::Null);
    let mut calls: Vec<Value> = Vec::new();
    for data in sse.all() {
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        let ch = &v["choices"][0];
        if let Some(t) = ch["delta"]["content"].as_str() {
            assert!(!t.contains("<tool_call") && !t.contains('{'), "{t:?}");
            content.push_str(t);
        }
        for d in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
            calls.push(d.clone());
        }
        if !ch["finish_reason"].is_null() {
            finish = ch["finish_reason"].clone();
        }
    }
    assert_eq!(content, "Let me check.");
    assert_eq!(finish, "tool_calls");
    assert_eq!(calls.len(), 2, "{calls:?}");
    for (i, (d, (name, args))) in calls.iter().zip(both_calls()).enumerate() {
        assert_eq!(d["index"], i, "{d}");
        assert_eq!(d["function"]["name"], name.as_str(), "{d}");
        let got: Value =
            serde_json::from_str(d["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(got, args, "{d}");
    }
}

#[test]
fn parallel_off_none_and_no_tools_and_malformed() {
    let s = server();
    let a = s.local_addr();
    // One call only: generation stops after it.
    let r = post(
        a,
        "/v1/chat/completions",
        &chat(1, json!({"parallel_tool_calls": false})),
    );
    let v = r.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{c}");
    assert_eq!(calls_of(&c["message"]), both_calls()[..1].to_vec(), "{c}");
    let all = post(a, "/v1/chat/completions", &chat(1, json!({}))).json();
    assert!(
        v["usage"]["completion_tokens"].as_u64() < all["usage"]["completion_tokens"].as_u64(),
        "{v} vs {all}"
    );

    // tool_choice none and no tools: the text is the answer, markup and all.
    for extra in [json!({"tool_choice": "none"}), json!({"tools": null})] {
        let r = post(a, "/v1/chat/completions", &chat(1, extra.clone()));
        let c = &r.json()["choices"][0];
        assert_eq!(c["finish_reason"], "stop", "{extra}: {c}");
        assert!(c["message"].get("tool_calls").is_none(), "{c}");
        let content = c["message"]["content"].as_str().unwrap();
        assert!(
            content.starts_with("Let me check.\n<tool_call>\n{\"name\": \"get_weather\""),
            "{content:?}"
        );
        let r = post(a, "/apply-template", &chat(1, extra.clone()));
        assert!(
            !r.json()["prompt"].as_str().unwrap().contains("<tools>"),
            "{extra}"
        );
    }

    // A call that does not parse is content.
    let r = post(a, "/v1/chat/completions", &chat(2, json!({})));
    let c = &r.json()["choices"][0];
    assert_eq!(c["finish_reason"], "stop", "{c}");
    assert_eq!(
        c["message"]["content"],
        "Hmm<tool_call>\n{\"name\": \"get_weather\", oops}\n</tool_call>"
    );
}

#[test]
fn anthropic_and_responses_get_the_calls() {
    let s = server();
    let a = s.local_addr();
    let anthropic_tools = json!([
        {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
        {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}}
    ]);
    let r = post(
        a,
        "/v1/messages",
        &json!({"max_tokens": 200, "seed": 1, "tools": anthropic_tools,
                "messages": [{"role": "user", "content": "Weather?"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let uses: Vec<(String, Value)> = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| (b["name"].as_str().unwrap().to_string(), b["input"].clone()))
        .collect();
    assert_eq!(uses, both_calls(), "{v}");
    assert!(v["content"]
        .as_array()
        .unwrap()
        .iter()
        .any(|b| b["type"] == "text" && b["text"] == "Let me check."));

    let r = post(
        a,
        "/v1/responses",
        &json!({"input": "Weather?", "seed": 1, "max_output_tokens": 200,
                "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
                          {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let items: Vec<(String, Value)> = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["type"] == "function_call")
        .map(|o| {
            (
                o["name"].as_str().unwrap().to_string(),
                serde_json::from_str(o["arguments"].as_str().unwrap()).unwrap(),
            )
        })
        .collect();
    assert_eq!(items, both_calls(), "{v}");
}

/// Forced calls (`tool_choice` `"required"` or named) at temperature 1 on random weights: the
/// grammar writes the template's format, which is read back as a call valid for its schema.
#[test]
fn forced_calls_on_random_weights_come_back_as_tool_calls() {
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather",
         "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "noop", "description": "Nothing",
         "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}}
    ]);
    for setup in [
        QWEN3,
        ("qwen3moe/qwen3moe-tiny.gguf", "Qwen3-Coder.jinja"),
        (
            "deepseek2/deepseek2-tiny.gguf",
            "deepseek-ai-DeepSeek-V3.1.jinja",
        ),
    ] {
        let s = start(config(setup));
        let a = s.local_addr();
        for seed in 0..3 {
            for choice in [
                json!("required"),
                json!({"type": "function", "function": {"name": "get_weather"}}),
            ] {
                let body = json!({"messages": [{"role": "user", "content": "Weather?"}], "tools": tools,
                                  "tool_choice": choice, "temperature": 1.0, "seed": seed, "max_tokens": 150});
                let r = post(a, "/v1/chat/completions", &body);
                assert_eq!(r.status, 200, "{setup:?}: {}", r.body);
                let c = &r.json()["choices"][0];
                assert_eq!(c["finish_reason"], "tool_calls", "{setup:?} {choice}: {c}");
                let calls = calls_of(&c["message"]);
                assert_eq!(calls.len(), 1, "{setup:?}: {c}");
                let (name, args) = &calls[0];
                match name.as_str() {
                    "get_weather" => {
                        assert!(
                            ["Paris", "Oslo"].contains(&args["city"].as_str().unwrap_or("")),
                            "{c}"
                        );
                        assert!(
                            args["days"].as_u64().is_some_and(|d| (1..=9).contains(&d)),
                            "{c}"
                        );
                    }
                    "noop" => assert!(choice == "required" && args == &json!({}), "{c}"),
                    other => panic!("{setup:?}: unknown tool {other}: {c}"),
                }
            }
        }
    }
}

#[test]
fn the_openai_package_reads_qwen3_tool_calls() {
    let Some(py) = common::python::python_with(&["openai"]) else {
        return;
    };
    let s = server();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tool_calls_python.py");
    common::python::run_checks(
        Command::new(&py).args([script, &format!("http://{}/v1", s.local_addr())]),
    );
}
