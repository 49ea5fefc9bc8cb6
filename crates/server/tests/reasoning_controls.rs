//! Reasoning controls as llama-server has them: `enable_thinking` (request
//! `chat_template_kwargs`, `--chat-template-kwargs`, `--reasoning off`) in the prompt of the real
//! Qwen3 and DeepSeek templates, gpt-oss's `reasoning_effort`, `reasoning_format` per request,
//! and one BOS however the template writes it. The expected prompts are llama-server's own
//! (d32676d77, same templates and fixture vocabularies).
//!
//! The `openai` Python package drives one server per family (tests/reasoning_client.py) with
//! scripted outputs; without `$HMOE_PYTHON` and the package those tests print `SKIPPED:`.

mod common;

use std::process::Command;

use common::*;
use hmoe_server::chat_format::ChatSetup;
use hmoe_server::{ModelSource, RunningServer, ServerConfig};
use serde_json::{json, Value};

/// The seed tests/reasoning_client.py asks for.
const SCRIPTED: u64 = 3001;

fn chat_fixture(name: &str) -> String {
    std::fs::read_to_string(fixtures().join("chat").join(name)).expect("template fixture")
}

/// A server on `model` (a fixture path) with `template` (a fixture name) whose seed
/// [`SCRIPTED`] replays `output`.
fn family(model: &str, template: Option<&str>, output: &str) -> RunningServer {
    let path = fixtures().join(model);
    let tok = tokenizer(&path);
    let mut c = tiny_config();
    c.models = ModelSource::File(path);
    c.chat.template = template.map(chat_fixture);
    c.picker = Some(scripted(&tok, &[(SCRIPTED, output)]));
    start(c)
}

fn apply(s: &RunningServer, body: Value) -> Resp {
    let mut b = json!({"messages": [{"role": "user", "content": "hi"}]});
    b.as_object_mut()
        .unwrap()
        .extend(body.as_object().unwrap().clone());
    post(s.local_addr(), "/apply-template", &b)
}

fn prompt(s: &RunningServer, body: Value) -> String {
    let r = apply(s, body);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["prompt"].as_str().unwrap().to_string()
}

const QWEN3: (&str, &str) = ("qwen3moe/qwen3moe-tiny.gguf", "Qwen-Qwen3-0.6B.jinja");
const QWEN3_OUT: &str = "<think>\nabc\n</think>\n\nxyz<|endoftext|>";
const R1: (&str, &str) = (
    "deepseek2/deepseek2-tiny.gguf",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
);
const R1_OUT: &str = "abc</think>xyz<|endoftext|>";

#[test]
fn qwen3_enable_thinking_per_request_and_server_wide() {
    let s = family(QWEN3.0, Some(QWEN3.1), QWEN3_OUT);
    let on = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    let off = format!("{on}<think>\n\n</think>\n\n");
    assert_eq!(prompt(&s, json!({})), on);
    let kw = |v: Value| json!({"chat_template_kwargs": {"enable_thinking": v}});
    assert_eq!(prompt(&s, kw(json!(false))), off);
    assert_eq!(prompt(&s, kw(json!(true))), on);
    // Another type than a boolean is ignored; a string is an error, as in llama-server.
    assert_eq!(prompt(&s, kw(json!(0))), on);
    let r = apply(&s, kw(json!("false")));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body.contains("expected boolean, got string"),
        "{}",
        r.body
    );
    let r = apply(&s, json!({"chat_template_kwargs": [1]}));
    assert_eq!(r.status, 400, "{}", r.body);

    // Server-wide off (as `--reasoning off` / `--reasoning-budget 0` set it); a request turns
    // it back on.
    let path = fixtures().join(QWEN3.0);
    let mut c: ServerConfig = tiny_config();
    c.models = ModelSource::File(path);
    c.chat.template = Some(chat_fixture(QWEN3.1));
    c.chat
        .template_kwargs
        .insert("enable_thinking".into(), false.into());
    let s = start(c);
    assert_eq!(prompt(&s, json!({})), off);
    assert_eq!(prompt(&s, kw(json!(true))), on);
    assert_eq!(prompt(&s, kw(json!(1))), off);
}

#[test]
fn deepseek_templates_leave_think_open_unless_thinking_is_off() {
    let s = family(R1.0, Some(R1.1), R1_OUT);
    let on = "<|endoftext|><｜User｜>hi<｜Assistant｜><think>\n";
    assert_eq!(prompt(&s, json!({})), on);
    let off = json!({"chat_template_kwargs": {"enable_thinking": false}});
    assert_eq!(prompt(&s, off), format!("{on}</think>"));
    // V3.1 reads `enable_thinking` too (its `thinking` is set from it).
    let s = family(R1.0, Some("deepseek-ai-DeepSeek-V3.1.jinja"), R1_OUT);
    let on = "<|endoftext|><｜User｜>hi<｜Assistant｜><think>";
    assert_eq!(prompt(&s, json!({})), on);
    let off = json!({"chat_template_kwargs": {"enable_thinking": false}});
    assert_eq!(prompt(&s, off), format!("{on}</think>"));
    // llama.cpp's R1 template always opens it.
    let s = family(R1.0, Some("llama-cpp-deepseek-r1.jinja"), R1_OUT);
    let off = json!({"chat_template_kwargs": {"enable_thinking": false}});
    assert!(prompt(&s, off).ends_with("<｜Assistant｜><think>\n"));
}

#[test]
fn reasoning_format_per_request() {
    let s = family(R1.0, Some(R1.1), R1_OUT);
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "seed": SCRIPTED,
                           "max_tokens": 32});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = post(s.local_addr(), "/v1/chat/completions", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["message"].clone()
    };
    for f in ["auto", "deepseek", "deepseek-legacy"] {
        let m = chat(json!({"reasoning_format": f}));
        assert_eq!(m["reasoning_content"], "\nabc", "{f}: {m}");
        assert_eq!(m["content"], "xyz", "{f}: {m}");
    }
    let m = chat(json!({"reasoning_format": "none"}));
    assert_eq!(m["content"], "<think>\nabc</think>xyz", "{m}");
    assert!(m.get("reasoning_content").is_none(), "{m}");
    let r = post(
        s.local_addr(),
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_format": "x"}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
}

/// A template that writes `bos_token` for a vocabulary whose tokenizer adds BOS: the rendered
/// prompt has no BOS text (llama-server's `/apply-template`), the tokens one BOS.
#[test]
fn one_bos_whether_or_not_the_template_writes_it() {
    let tok = tokenizer(&fixtures().join("tokenizer/ggml-vocab-deepseek-llm.gguf"));
    assert!(tok.add_bos());
    let bos = tok.bos().unwrap();
    let bos_text = tok.token_text(bos).unwrap().to_string();
    let messages = json!([{"role": "user", "content": "hi"}]);
    for template in [
        chat_fixture("llama-cpp-deepseek-r1.jinja"),
        chat_fixture(QWEN3.1),
    ] {
        let chat = ChatSetup::new(template, &tok).unwrap();
        let p = chat
            .render(&messages, None, true, Default::default())
            .unwrap();
        assert!(!p.text.starts_with(&bos_text), "{}", p.text);
        let ids = chat.tokenize(&tok, &p).unwrap();
        assert_eq!(ids[0], bos, "{ids:?}");
        assert_eq!(ids.iter().filter(|&&t| t == bos).count(), 1, "{ids:?}");
    }
    // A message that starts with the BOS text is text: it is not taken off.
    let chat = ChatSetup::new("{{ messages[0].content }}".into(), &tok).unwrap();
    let typed = json!([{"role": "user", "content": format!("{bos_text}hi")}]);
    let p = chat
        .render(&typed, None, false, Default::default())
        .unwrap();
    assert_eq!(p.text, format!("{bos_text}hi"));
}

fn run_client(py: &str, s: &RunningServer, model: &str, family: &str) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/reasoning_client.py");
    let text = common::python::run_checks(
        Command::new(py)
            .arg(script)
            .args(["--url", &format!("http://{}", s.local_addr())])
            .args(["--model", model, "--family", family]),
    );
    eprintln!("{family}:\n{text}");
}

#[test]
fn reasoning_toggles_through_the_openai_client() {
    let Some(py) = common::python::python_with(&["openai"]) else {
        return;
    };
    let gpt_oss = family(
        "gpt-oss/gptoss-tiny.gguf",
        None,
        "<|channel|>analysis<|message|>The user says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!<|return|>",
    );
    run_client(&py, &gpt_oss, "gptoss-tiny", "gpt-oss");
    let qwen3 = family(QWEN3.0, Some(QWEN3.1), QWEN3_OUT);
    run_client(&py, &qwen3, "qwen3moe-tiny", "qwen3");
    let r1 = family(R1.0, Some(R1.1), R1_OUT);
    run_client(&py, &r1, "deepseek2-tiny", "deepseek");
}

/// Llama 3.x templates (the `ipython` header) get today's `date_string`, where the template's
/// own fallback is a frozen "26 Jul 2024", and their tools in the system message
/// (`tools_in_user_message: false`), as llama-server gives them; a request's kwarg wins.
/// FireFunction v2 templates get `datetime` and the tools as `functions`, and no `tools`.
#[test]
fn llama3_and_firefunction_templates_get_their_variables() {
    let llama = "<|start_header_id|>ipython<|end_header_id|>\
        {%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}\
        {%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}\
        Today Date: {{ date_string }}|{% if tools_in_user_message %}user{% else %}system{% endif %}\
        |{{ tools | length if tools else 0 }}";
    let today = Command::new("date").args(["-u", "+%d %b %Y"]).output();
    let today = String::from_utf8(today.expect("date -u").stdout).unwrap();
    let mut c = tiny_config();
    c.chat.template = Some(llama.into());
    let s = start(c);
    let tool = json!({"type": "function", "function": {"name": "f", "parameters": {}}});
    let p = prompt(&s, json!({"tools": [tool]}));
    assert_eq!(
        p,
        format!(
            "<|start_header_id|>ipython<|end_header_id|>Today Date: {}|system|1",
            today.trim()
        )
    );
    let mine = json!({"chat_template_kwargs": {"date_string": "1 Jan 2000"}});
    assert!(prompt(&s, mine).ends_with("Today Date: 1 Jan 2000|system|0"));

    let fire = "{%- set suffix = 'Available functions as JSON spec:\\n' + functions -%}\
        {%- set suffix = suffix + '\\nToday is ' + datetime + '.' -%}\
        {{ suffix }}|{{ 'none' if tools is none else 'tools' }}{# functools[ #}";
    let mut c = tiny_config();
    c.chat.template = Some(fire.into());
    let s = start(c);
    let p = prompt(&s, json!({"tools": [tool]}));
    let functions = "[\n  {\n    \"type\": \"function\",\n    \"function\": {\n      \
        \"name\": \"f\",\n      \"parameters\": {},\n      \"description\": \"\"\n    }\n  }\n]";
    assert!(
        p.starts_with(&format!(
            "Available functions as JSON spec:\n{functions}\nToday is "
        )),
        "{p}"
    );
    assert!(p.ends_with(" GMT.|none"), "{p}");
    assert!(p.contains(&today.trim()[3..6]), "{p}");
    let p = prompt(&s, json!({}));
    assert!(
        p.starts_with("Available functions as JSON spec:\n\nToday is "),
        "{p}"
    );
}

/// A conversation ending with an assistant message is continued from that message, as
/// llama-server does (and vLLM's `continue_final_message: true`): the generation prompt, then
/// its content unclosed, which is tokenized as text; `continue_final_message: false` or
/// `--no-prefill-assistant` close it as a turn. `--verbose` answers carry `__verbose` with the
/// prompt read back from its tokens.
#[test]
fn a_final_assistant_message_is_continued() {
    let path = fixtures().join(QWEN3.0);
    let tok = tokenizer(&path);
    let mut c = tiny_config();
    c.models = ModelSource::File(path.clone());
    c.chat.template = Some(chat_fixture(QWEN3.1));
    c.picker = Some(scripted(&tok, &[(SCRIPTED, "ll be fine<|endoftext|>")]));
    c.verbose = true;
    let s = start(c);
    let conv = |last: &str, extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": last}]});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(prompt(&s, conv("I wi", json!({}))), format!("{head}I wi"));
    // Text parts: a user message's one per line, a continued message's by blank lines (as
    // llama-server writes both).
    let parts = json!([{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]);
    let p = prompt(
        &s,
        json!({"messages": [{"role": "user", "content": parts},
                            {"role": "assistant", "content": parts}]}),
    );
    assert_eq!(
        p,
        "<|im_start|>user\nWh\nill<|im_end|>\n<|im_start|>assistant\nWh\n\nill"
    );
    let explicit = json!({"continue_final_message": true, "add_generation_prompt": false});
    assert_eq!(prompt(&s, conv("I wi", explicit)), format!("{head}I wi"));
    let closed = prompt(&s, conv("I wi", json!({"continue_final_message": false})));
    // (Qwen3's template writes an empty think block into the last assistant turn.)
    assert!(closed.contains("I wi<|im_end|>\n"), "{closed}");
    assert!(closed.ends_with("<|im_start|>assistant\n"), "{closed}");
    let both = json!({"continue_final_message": true, "add_generation_prompt": true});
    assert_eq!(apply(&s, conv("I wi", both)).status, 400);
    let two = json!({"messages": [{"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]});
    let r = post(s.local_addr(), "/apply-template", &two);
    assert_eq!(r.status, 400, "{}", r.body);

    // The continued text is text: a control token typed in it is not one.
    let count = |last: &str| {
        let r = post(
            s.local_addr(),
            "/chat/completions/input_tokens",
            &conv(last, json!({})),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["input_tokens"].as_u64().unwrap()
    };
    let special = tok.encode("<|endoftext|>", false, true).unwrap();
    assert_eq!(special.len(), 1, "{special:?}");
    assert!(count("I wi<|endoftext|>") > count("I wi") + 1);

    let mut body = conv("I wi", json!({"seed": SCRIPTED, "max_tokens": 16}));
    body["stream"] = false.into();
    let r = post(s.local_addr(), "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], "ll be fine");
    assert_eq!(v["__verbose"]["content"], "ll be fine");
    let seen = v["__verbose"]["prompt"].as_str().unwrap();
    assert!(seen.ends_with(&format!("{head}I wi")), "{seen}");

    let mut c = tiny_config();
    c.models = ModelSource::File(path);
    c.chat.template = Some(chat_fixture(QWEN3.1));
    c.chat.no_prefill_assistant = true;
    let s = start(c);
    let closed = prompt(&s, conv("I wi", json!({})));
    assert!(
        closed.ends_with("I wi<|im_end|>\n<|im_start|>assistant\n"),
        "{closed}"
    );
    let r = post(
        s.local_addr(),
        "/v1/chat/completions",
        &conv("I wi", json!({"max_tokens": 1})),
    );
    assert!(r.json().get("__verbose").is_none(), "{}", r.body);
    // A request may ask for it.
    let ask = json!({"max_tokens": 1, "verbose": true});
    let r = post(s.local_addr(), "/v1/chat/completions", &conv("I wi", ask));
    let seen = r.json()["__verbose"]["prompt"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        seen.ends_with("I wi<|im_end|>\n<|im_start|>assistant\n"),
        "{seen}"
    );
}
