//! Tool calls of a non-harmony template through the server: the Qwen3-MoE fixture served with
//! Qwen3's chat template (`--chat-template-file`), its output scripted to the text Qwen3 is
//! taught (`<think>` reasoning, content, `<tool_call>` JSON), read back as `tool_calls` on the
//! OpenAI chat route (whole and streamed, over HTTP and through the official `openai` package),
//! as `tool_use` blocks on /v1/messages and `function_call` items on /v1/responses;
//! `parallel_tool_calls: false` stops at the first call, `tool_choice: "none"` and requests
//! without tools read no calls. Llama 3.x and Mistral calls (small templates of those formats on
//! the same fixture) are read the same way on every API; forced calls on random weights come back
//! as calls in every format, whole and streamed through the `openai` package.

mod common;

use std::process::Command;

use common::*;
use hmoe_server::{ModelSource, ServerConfig};
use serde_json::{json, Value};

const TWO_CALLS: &str = "<think>\nThe user wants weather and time.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n</tool_call><|endoftext|>";
const BROKEN: &str =
    "Hmm <tool_call>\n{\"name\": \"get_weather\", oops}\n</tool_call><|endoftext|>";

const QWEN3: (&str, &str) = ("qwen3moe/qwen3moe-tiny.gguf", "Qwen-Qwen3-0.6B.jinja");
const DEEPSEEK: (&str, &str) = (
    "deepseek2/deepseek2-tiny.gguf",
    "deepseek-ai-DeepSeek-V3.1.jinja",
);
const LLAMA3: (&str, &str) = ("qwen3moe/qwen3moe-tiny.gguf", "llama3");
const MISTRAL: (&str, &str) = ("qwen3moe/qwen3moe-tiny.gguf", "mistral");

/// A small template in the Llama 3.x tool-call format (llama-server tells it by the `ipython`
/// header): calls are `{"name", "parameters"}` objects.
const LLAMA3_TEMPLATE: &str = "{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nAnswer with a JSON function call: {{ tools | tojson }}<|eot_id|>{%- endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{%- endfor %}<|eom_id|>{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}";

/// A small template in Mistral Nemo's tool-call format: `[TOOL_CALLS]` and a JSON array; like
/// Nemo's own, it refuses tool-call ids that are not 9 characters long.
const MISTRAL_TEMPLATE: &str = "{{- bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[INST]{{ m.content }}[/INST]{%- elif m.role == 'tool' %}{%- if m.tool_call_id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}[TOOL_RESULTS]{\"call_id\": \"{{ m.tool_call_id }}\", \"content\": {{ m.content | tojson }}}[/TOOL_RESULTS]{%- elif m.tool_calls %}[TOOL_CALLS][{%- for c in m.tool_calls %}{%- if c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}{%- if not loop.last %}, {% endif %}{%- endfor %}]{{ eos_token }}{%- else %}{{ m.content }}{{ eos_token }}{%- endif %}{%- endfor %}";

/// Fixture chat template `name`, or the small Llama 3.x / Mistral ones (no fixture has those).
fn template_text(name: &str) -> String {
    match name {
        "llama3" => LLAMA3_TEMPLATE.to_string(),
        "mistral" => MISTRAL_TEMPLATE.to_string(),
        file => std::fs::read_to_string(fixtures().join("chat").join(file)).expect("template"),
    }
}

/// A server for fixture `model` with fixture chat template `template`.
fn config((model, template): (&str, &str)) -> ServerConfig {
    let mut c = ServerConfig::new(ModelSource::File(fixtures().join(model)));
    c.port = 0;
    c.engine.n_ctx = 4096;
    c.engine.n_parallel = 2;
    c.engine.n_ubatch = 64;
    c.chat.template = Some(template_text(template));
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
    check_anthropic_and_responses(s.local_addr(), "Let me check.");
}

/// The two calls of seed 1 as `tool_use` blocks (after a `content` text block) on /v1/messages
/// and `function_call` items on /v1/responses.
fn check_anthropic_and_responses(a: std::net::SocketAddr, content: &str) {
    let anthropic_tools = json!([
        {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
        {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}}
    ]);
    let messages = json!({"max_tokens": 200, "seed": 1, "tools": anthropic_tools,
                          "messages": [{"role": "user", "content": "Weather?"}]});
    let responses = json!({"input": "Weather?", "seed": 1, "max_output_tokens": 200,
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
                  {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]});
    check_streamed_anthropic_and_responses(a, &messages, &responses);
    let r = post(a, "/v1/messages", &messages);
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
    let texts: String = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .filter_map(|b| b["text"].as_str())
        .collect();
    assert_eq!(texts, content, "{v}");

    let r = post(a, "/v1/responses", &responses);
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

/// Streamed, the same calls are `tool_use` blocks whose `input_json_delta`s add up to the
/// arguments, and `function_call` items whose argument deltas do.
fn check_streamed_anthropic_and_responses(
    a: std::net::SocketAddr,
    messages: &Value,
    responses: &Value,
) {
    let stream = |path: &str, body: &Value| -> Vec<Value> {
        let mut body = body.clone();
        body["stream"] = json!(true);
        let mut sse = Sse::open(a, path, &body);
        sse.all()
            .iter()
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect()
    };
    let parsed = |calls: Vec<(String, String)>| -> Vec<(String, Value)> {
        calls
            .into_iter()
            .map(|(n, args)| (n, serde_json::from_str(&args).unwrap_or(Value::Null)))
            .collect()
    };
    let mut uses: Vec<(String, String)> = Vec::new();
    let mut at: Vec<Option<usize>> = Vec::new();
    for e in stream("/v1/messages", messages) {
        let n = e["index"].as_u64().unwrap_or(0) as usize;
        at.resize(at.len().max(n + 1), None);
        match e["type"].as_str() {
            Some("content_block_start") if e["content_block"]["type"] == "tool_use" => {
                at[n] = Some(uses.len());
                let name = e["content_block"]["name"].as_str().unwrap().to_string();
                uses.push((name, String::new()));
            }
            Some("content_block_delta") if e["delta"]["type"] == "input_json_delta" => {
                let i = at[n].expect("a delta of a started tool_use block");
                uses[i]
                    .1
                    .push_str(e["delta"]["partial_json"].as_str().unwrap());
            }
            _ => {}
        }
    }
    assert_eq!(parsed(uses), both_calls(), "streamed /v1/messages");

    let (mut items, mut deltas) = (Vec::new(), std::collections::BTreeMap::new());
    for e in stream("/v1/responses", responses) {
        let n = e["output_index"].as_u64().unwrap_or(0);
        match e["type"].as_str() {
            Some("response.function_call_arguments.delta") => deltas
                .entry(n)
                .or_insert_with(String::new)
                .push_str(e["delta"].as_str().unwrap()),
            Some("response.output_item.done") if e["item"]["type"] == "function_call" => {
                let args = e["item"]["arguments"].as_str().unwrap().to_string();
                assert_eq!(deltas.get(&n), Some(&args), "{e}");
                items.push((e["item"]["name"].as_str().unwrap().to_string(), args));
            }
            _ => {}
        }
    }
    assert_eq!(parsed(items), both_calls(), "streamed /v1/responses");
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
        DEEPSEEK,
        LLAMA3,
        MISTRAL,
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

/// Forced calls through the `openai` package, whole and streamed (tool_calls deltas with index,
/// id, type, name and arguments), for the Qwen3 `<tool_call>`, DeepSeek, Llama 3.x and Mistral
/// formats; the calls go back into the conversation.
#[test]
fn the_openai_package_streams_forced_calls_of_every_format() {
    let Some(py) = common::python::python_with(&["openai"]) else {
        return;
    };
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/tool_calls_forced_python.py"
    );
    for setup in [QWEN3, DEEPSEEK, LLAMA3, MISTRAL] {
        let s = start(config(setup));
        let out = common::python::run_checks(Command::new(&py).args([
            script,
            &format!("http://{}/v1", s.local_addr()),
            setup.1,
        ]));
        eprintln!("{}: {}", setup.1, out.trim());
    }
}

/// Llama 3.x: two JSON calls at the start of the answer. Mistral: content, then `[TOOL_CALLS]`
/// and an array of two calls (ids the model wrote).
const LLAMA3_TWO_CALLS: &str = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}\n{\"type\": \"function\", \"name\": \"get_time\", \"parameters\": {\"zone\": \"CET\"}}<|endoftext|>";
const MISTRAL_TWO_CALLS: &str = "Let me check.[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"a1b2c3d4e\"}, {\"name\": \"get_time\", \"arguments\": \"{\\\"zone\\\": \\\"CET\\\"}\", \"id\": \"f5g6h7i8j\"}]<|endoftext|>";

/// Parallel calls of the Llama 3.x and Mistral formats on chat completions (whole and streamed:
/// indices 0 and 1, markup never in content), /v1/messages and /v1/responses.
#[test]
fn llama3_and_mistral_calls_on_every_api() {
    for (setup, script, content) in [
        (LLAMA3, LLAMA3_TWO_CALLS, ""),
        (MISTRAL, MISTRAL_TWO_CALLS, "Let me check."),
    ] {
        let mut c = config(setup);
        c.picker = Some(scripted(
            &tokenizer(&fixtures().join(setup.0)),
            &[(1, script)],
        ));
        let s = start(c);
        let a = s.local_addr();
        let r = post(a, "/v1/chat/completions", &chat(1, json!({})));
        assert_eq!(r.status, 200, "{}", r.body);
        let ch = &r.json()["choices"][0];
        assert_eq!(ch["finish_reason"], "tool_calls", "{setup:?}: {ch}");
        assert_eq!(calls_of(&ch["message"]), both_calls(), "{setup:?}: {ch}");
        let shown = ch["message"]["content"].as_str().unwrap_or("");
        assert_eq!(shown, content, "{setup:?}: {ch}");

        let mut sse = Sse::open(a, "/v1/chat/completions", &chat(1, json!({"stream": true})));
        let (mut streamed, mut calls) = (String::new(), Vec::new());
        for data in sse.all().into_iter().take_while(|d| d != "[DONE]") {
            let v: Value = serde_json::from_str(&data).unwrap();
            let delta = &v["choices"][0]["delta"];
            if let Some(t) = delta["content"].as_str() {
                assert!(!t.contains('[') && !t.contains('{'), "{setup:?}: {t:?}");
                streamed.push_str(t);
            }
            calls.extend(
                delta["tool_calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .cloned(),
            );
        }
        assert_eq!(streamed, content, "{setup:?}");
        let got: Vec<(u64, String, Value)> = calls
            .iter()
            .map(|d| {
                let args = d["function"]["arguments"].as_str().unwrap();
                (
                    d["index"].as_u64().unwrap(),
                    d["function"]["name"].as_str().unwrap().to_string(),
                    serde_json::from_str(args).unwrap(),
                )
            })
            .collect();
        let want: Vec<(u64, String, Value)> = (0..)
            .zip(both_calls())
            .map(|(i, (n, v))| (i, n, v))
            .collect();
        assert_eq!(got, want, "{setup:?}: {calls:?}");
        check_anthropic_and_responses(a, content);
    }
}
