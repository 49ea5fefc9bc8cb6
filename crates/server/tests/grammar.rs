//! Constrained sampling through the server: GBNF `grammar` and `json_schema` on `/completion`,
//! `response_format` and forced `tool_choice` on chat, on a random-weight model at
//! temperature 1 (only the sampler can make the output valid), over plain HTTP and through the
//! official `openai` package; invalid grammars and schemas are 400s with the parser's message.

mod common;

use std::process::Command;

use common::*;
use serde_json::{json, Value};

fn schema() -> Value {
    json!({"type": "object",
           "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                          "tag": {"enum": ["a", "b"]}},
           "required": ["n", "tag"], "additionalProperties": false})
}

fn valid(v: &Value) -> bool {
    v.as_object().is_some_and(|o| o.len() == 2)
        && v["n"].as_u64().is_some_and(|n| n <= 99)
        && ["a", "b"].contains(&v["tag"].as_str().unwrap_or(""))
}

#[test]
fn completion_grammars_and_schemas_constrain_random_weights() {
    let s = start(tiny_config());
    let a = s.local_addr();
    for seed in 0..4 {
        let r = post(
            a,
            "/completion",
            &json!({"prompt": "Say:", "n_predict": 60, "temperature": 1.0,
            "seed": seed, "grammar": "root ::= (\"yes\" | \"no\") \"!\" [0-9]{1,2}"}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let text = v["content"].as_str().unwrap();
        let (word, digits) = text.split_once('!').unwrap_or_else(|| panic!("{text:?}"));
        assert!(
            ["yes", "no"].contains(&word) && (1..=2).contains(&digits.len()),
            "{text:?}"
        );
        assert!(digits.chars().all(|c| c.is_ascii_digit()), "{text:?}");
        assert_eq!(v["stop_type"], "eos", "{v}");

        let r = post(
            a,
            "/completion",
            &json!({"prompt": "JSON:", "n_predict": 80, "temperature": 1.0,
            "seed": seed, "json_schema": schema()}),
        );
        let v = r.json();
        let text = v["content"].as_str().unwrap();
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(valid(&parsed), "{text}");
    }
}

#[test]
fn invalid_grammars_and_schemas_are_400s_with_the_parser_s_message() {
    let s = start(tiny_config());
    let a = s.local_addr();
    let r = post(
        a,
        "/completion",
        &json!({"prompt": "x", "grammar": "root ::= ("}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("expecting ')'"), "{}", r.body);
    let r = post(
        a,
        "/completion",
        &json!({"prompt": "x", "grammar": "root ::= undefined-rule"}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body.contains("undefined rule 'undefined-rule'"),
        "{}",
        r.body
    );
    let r = post(
        a,
        "/completion",
        &json!({"prompt": "x", "json_schema": {"type": 5}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "xml"}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "F"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("'g'"), "{}", r.body);
    let r = post(
        a,
        "/completion",
        &json!({"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
}

#[test]
fn chat_response_formats_and_forced_tool_calls_are_valid_over_http() {
    let s = start(tiny_config());
    let a = s.local_addr();
    let tools = json!([{"type": "function", "function": {"name": "lookup", "description": "Look up", "parameters": schema()}},
                       {"type": "function", "function": {"name": "noop", "description": "Nothing"}}]);
    for seed in 0..4 {
        let r = post(
            a,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}],
            "temperature": 1.0, "seed": seed, "max_tokens": 100,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema(), "strict": true}}}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let m = &r.json()["choices"][0]["message"];
        let content = m["content"].as_str().unwrap_or_else(|| panic!("{m}"));
        assert!(
            valid(&serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {m}"))),
            "{m}"
        );

        let r = post(
            a,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}],
            "temperature": 1.0, "seed": seed, "max_tokens": 100, "response_format": {"type": "json_object"}}),
        );
        let m = &r.json()["choices"][0]["message"];
        let parsed: Value =
            serde_json::from_str(m["content"].as_str().unwrap_or("")).unwrap_or(Value::Null);
        // An open object may run past max_tokens on random weights; whatever ends is an object.
        let finish = &r.json()["choices"][0]["finish_reason"];
        assert!(parsed.is_object() || finish == "length", "{m}");

        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "lookup"}}),
        ] {
            let r = post(
                a,
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": "Hi"}],
                "temperature": 1.0, "seed": seed, "max_tokens": 100, "tools": tools, "tool_choice": choice}),
            );
            assert_eq!(r.status, 200, "{}", r.body);
            let c = &r.json()["choices"][0];
            assert_eq!(c["finish_reason"], "tool_calls", "{c}");
            let call = &c["message"]["tool_calls"][0]["function"];
            let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
            match call["name"].as_str().unwrap() {
                "lookup" => assert!(valid(&args), "{c}"),
                "noop" => assert!(args.is_object() && choice == "required", "{c}"),
                other => panic!("unknown tool {other}: {c}"),
            }
        }
    }
}

#[test]
fn the_openai_package_gets_valid_structured_output() {
    let Some(py) = common::python::python_with(&["openai"]) else {
        return;
    };
    let s = start(tiny_config());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/grammar_python.py");
    common::python::run_checks(Command::new(&py).args([
        script,
        &format!("http://{}/v1", s.local_addr()),
        "gptoss-tiny",
    ]));
}
