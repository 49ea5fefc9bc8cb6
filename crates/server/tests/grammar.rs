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

/// `{"$defs": {d0: {$ref: d1}, …, dn: {type: string}}, "$ref": "#/$defs/d0"}`.
fn ref_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(
            format!("d{i}"),
            json!({"$ref": format!("#/$defs/d{}", i + 1)}),
        );
    }
    defs.insert(format!("d{n}"), json!({"type": "string"}));
    json!({"$defs": defs, "$ref": "#/$defs/d0"})
}

/// A 400 whose message is one short line: no parser state, backtrace or source path.
fn assert_short_400(r: &Resp, what: &str) {
    assert_eq!(
        r.status,
        400,
        "{what}: {}",
        &r.body[..r.body.len().min(2000)]
    );
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: {}", r.body))
        .to_string();
    assert!(
        message.len() < 400 && !message.contains('\n'),
        "{what}: {message}"
    );
    assert!(
        !r.body.contains(".rs:") && !r.body.contains("backtrace") && r.body.len() < 1000,
        "{what}: {}",
        r.body
    );
}

/// Issue rows: deep `$ref` and rule chains, deep nesting, huge alternations and grammars that
/// allow nothing are answered (200 or a short 400 naming the limit), never a crash, and
/// quickly; the server answers `/health` after each.
#[test]
fn hostile_grammars_are_answered_and_the_server_lives() {
    let s = start(tiny_config());
    let a = s.local_addr();
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        post(a, "/v1/chat/completions", &body)
    };
    for n in [1000, 30_000] {
        let chain = ref_chain(n);
        let format = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": chain}});
        for r in [
            post(
                a,
                "/completion",
                &json!({"prompt": "x", "n_predict": 4, "json_schema": chain}),
            ),
            chat(json!({"response_format": format})),
            chat(
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": chain}}],
                        "tool_choice": "required"}),
            ),
            post(
                a,
                "/v1/responses",
                &json!({"input": "x", "max_output_tokens": 4,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": chain}}}),
            ),
            post(
                a,
                "/v1/messages",
                &json!({"messages": [{"role": "user", "content": "x"}],
                "max_tokens": 4, "tools": [{"name": "f", "input_schema": chain}],
                "tool_choice": {"type": "any"}}),
            ),
        ] {
            assert_eq!(r.status, 200, "{n}: {}", &r.body[..r.body.len().min(2000)]);
        }
        let mut rules = String::from("root ::= r0\n");
        for i in 0..n {
            rules += &format!("r{i} ::= r{}\n", i + 1);
        }
        rules += &format!("r{n} ::= \"x\"\n");
        let r = post(
            a,
            "/completion",
            &json!({"prompt": "x", "n_predict": 4, "grammar": rules}),
        );
        assert_eq!(r.status, 200, "{n}: {}", r.body);
        let lark = format!(
            "%llguidance {{}}\n{}",
            rules.replace(" ::= ", ": ").replace("root", "start")
        );
        let r = post(
            a,
            "/completion",
            &json!({"prompt": "x", "n_predict": 4, "grammar": lark}),
        );
        assert_eq!(r.status, 200, "{n}: {}", r.body);
        assert_eq!(get(a, "/health").status, 200);
    }

    let parens = format!("root ::= {}\"a\"{}", "(".repeat(5000), ")".repeat(5000));
    let r = post(a, "/completion", &json!({"prompt": "x", "grammar": parens}));
    assert_short_400(&r, "5000 parentheses");
    assert!(r.body.contains("30 levels"), "{}", r.body);

    for n in [30_000, 100_000, 500_000] {
        let alts: Vec<String> = (0..n).map(|i| format!("\"w{i}\"")).collect();
        let grammar = format!("root ::= {}", alts.join(" | "));
        let t0 = std::time::Instant::now();
        let r = post(
            a,
            "/completion",
            &json!({"prompt": "x", "grammar": grammar}),
        );
        assert!(t0.elapsed().as_secs() < 5, "{n}: {:?}", t0.elapsed());
        assert_short_400(&r, &format!("{n} alternatives"));
        assert!(r.body.contains("limit"), "{}", r.body);
    }

    for (what, body) in [
        (
            "$ref #",
            json!({"prompt": "x", "json_schema": {"$ref": "#"}}),
        ),
        (
            "$defs cycle",
            json!({"prompt": "x", "json_schema":
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}),
        ),
        (
            "rule only naming itself",
            json!({"prompt": "x", "grammar": "root ::= root \"a\""}),
        ),
    ] {
        let r = post(a, "/completion", &body);
        assert_short_400(&r, what);
    }
    for (what, body) in [
        (
            "5000-way anyOf",
            json!({"prompt": "x", "n_predict": 2, "json_schema":
            {"anyOf": (0..5000).map(|i| json!({"type": "object", "properties": {format!("p{i}"): {"type": "integer"}}, "required": [format!("p{i}")]})).collect::<Vec<_>>()}}),
        ),
        (
            "a{1000000}",
            json!({"prompt": "x", "n_predict": 2, "grammar": "root ::= \"a\"{1000000}"}),
        ),
    ] {
        let r = post(a, "/completion", &body);
        match r.status {
            200 => {}
            _ => assert_short_400(&r, what),
        }
    }
    let t0 = std::time::Instant::now();
    assert_eq!(get(a, "/health").status, 200);
    assert!(t0.elapsed().as_millis() < 500, "{:?}", t0.elapsed());
}
