//! Property test of request-body handling on stable Rust: thousands of random and mutated
//! chat/completion bodies (messages, tools with JSON schemas, sampling fields, grammars, token
//! arrays) go through what the routes run (body parsing, message normalisation, the gpt-oss
//! chat template with tools, prompt tokenization, generation settings for each route flavour);
//! none may panic. A second part sends mutated bodies over HTTP to the real server, whose every
//! answer must be a complete HTTP response (a panic would drop the connection).
//!
//! `HMOE_FUZZ_ITERS` sets the in-process count (default 20000), `HMOE_FUZZ_SEED` the seed.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use common::*;
use hmoe_grammar::Vocab;
use hmoe_server::chat_format::ChatSetup;
use hmoe_server::chat_messages::normalize_messages;
use hmoe_server::params::{gen_params, prompt_tokens, Fields, Flavor};
use hmoe_server::parsed_body::parse_body;
use hmoe_server::SamplingDefaults;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};

/// Valid bodies the mutations start from.
fn seeds() -> Vec<Value> {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1}, "units": {"enum": ["c", "f"]}},
            "required": ["city"]}}},
        {"type": "function", "function": {"name": "noargs"}}]);
    vec![
        json!({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.7,
            "top_p": 0.9, "stop": ["\n", "END"], "seed": 3, "stream": true,
            "stream_options": {"include_usage": true}}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "tools": tools, "tool_choice": "auto", "reasoning_effort": "low",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true,
                "schema": {"type": "object", "properties": {"a": {"type": "number"}}}}}}),
        json!({"prompt": "Once upon", "n_predict": 16, "top_k": 40, "min_p": 0.05,
            "repeat_penalty": 1.1, "n_probs": 3, "grammar": "root ::= \"yes\" | \"no\"",
            "logit_bias": [[5, -1.0]], "cache_prompt": true}),
        json!({"prompt": [1, 2, 3, 4], "max_tokens": 4, "logprobs": 2, "echo": false,
            "json_schema": {"type": "array", "items": {"type": "string"}}}),
        json!({"prompt": ["a", "b"], "stop": "x", "ignore_eos": true, "tokens": [7, 8],
            "content": "tokenize me", "with_pieces": true, "chat_template_kwargs": {"k": 1}}),
    ]
}

/// A random JSON value, nested at most `depth` deep.
fn random_value(r: &mut StdRng, depth: u32) -> Value {
    let strings = [
        "",
        "user",
        "assistant",
        "tool",
        "system",
        "function",
        "auto",
        "none",
        "required",
        "json_object",
        "json_schema",
        "text",
        "<|start|>",
        "<|channel|>",
        "<|end|>",
        "{{",
        "}}",
        "{% if %}",
        "\u{0}",
        "é\u{301}",
        "🦀",
        "root ::= (",
        "\\",
        "NaN",
        "-1",
    ];
    match r.random_range(0..if depth == 0 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => Value::Bool(r.random()),
        2 => {
            json!([0i64, -1, 1, i64::MAX, i64::MIN, u32::MAX as i64, 1 << 40][r.random_range(0..7)])
        }
        3 => json!([0.0, -0.5, 1e308, -1e308, 1e-308, 2.5, 100.0][r.random_range(0..7)]),
        4 => Value::String(strings[r.random_range(0..strings.len())].to_string()),
        5 => Value::String(
            (0..r.random_range(0..40))
                .map(|_| r.random_range(' '..='~'))
                .collect(),
        ),
        6 => Value::Array(
            (0..r.random_range(0..5))
                .map(|_| random_value(r, depth - 1))
                .collect(),
        ),
        _ => {
            let keys = [
                "role",
                "content",
                "type",
                "text",
                "name",
                "function",
                "arguments",
                "tool_calls",
                "id",
                "parameters",
                "properties",
                "required",
                "items",
                "enum",
                "schema",
                "description",
                "reasoning_content",
                "thinking",
            ];
            Value::Object(
                (0..r.random_range(0..5))
                    .map(|_| {
                        (
                            keys[r.random_range(0..keys.len())].to_string(),
                            random_value(r, depth - 1),
                        )
                    })
                    .collect(),
            )
        }
    }
}

/// Replaces one randomly chosen node of `v` (or adds a key) with a random value.
fn mutate_tree(r: &mut StdRng, v: &mut Value) {
    match v {
        Value::Object(m) if !m.is_empty() && r.random_bool(0.8) => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = &keys[r.random_range(0..keys.len())];
            if r.random_bool(0.1) {
                m.remove(k);
            } else if r.random_bool(0.5) {
                mutate_tree(r, m.get_mut(k).unwrap());
            } else {
                m.insert(k.clone(), random_value(r, 3));
            }
        }
        Value::Array(a) if !a.is_empty() && r.random_bool(0.8) => {
            let i = r.random_range(0..a.len());
            if r.random_bool(0.5) {
                mutate_tree(r, &mut a[i]);
            } else {
                a[i] = random_value(r, 3);
            }
        }
        Value::Object(m) => {
            let fields = [
                "messages",
                "tools",
                "tool_choice",
                "prompt",
                "max_tokens",
                "n_predict",
                "stop",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "n_probs",
                "logprobs",
                "top_logprobs",
                "logit_bias",
                "response_format",
                "grammar",
                "json_schema",
                "stream",
                "chat_template_kwargs",
                "reasoning_format",
                "tokens",
                "content",
            ];
            m.insert(
                fields[r.random_range(0..fields.len())].to_string(),
                random_value(r, 3),
            );
        }
        other => *other = random_value(r, 3),
    }
}

/// Byte-level damage: flips, insertions, deletions, truncation, splices.
fn mutate_bytes(r: &mut StdRng, b: &mut Vec<u8>) {
    for _ in 0..r.random_range(1..4) {
        if b.is_empty() {
            b.push(r.random());
            continue;
        }
        let i = r.random_range(0..b.len());
        match r.random_range(0..5) {
            0 => b[i] ^= 1 << r.random_range(0..8),
            1 => b.insert(i, b"{}[]\",:\\0e-9"[r.random_range(0..12)]),
            2 => {
                b.remove(i);
            }
            3 => b.truncate(i),
            _ => {
                let j = r.random_range(0..b.len());
                let piece = b[j..(j + 16).min(b.len())].to_vec();
                b.splice(i..i, piece);
            }
        }
    }
}

/// One input.
fn input(r: &mut StdRng, seeds: &[Value]) -> Vec<u8> {
    let mut v = seeds[r.random_range(0..seeds.len())].clone();
    for _ in 0..r.random_range(0..4) {
        mutate_tree(r, &mut v);
    }
    let mut bytes = serde_json::to_vec(&v).unwrap();
    if r.random_bool(0.3) {
        mutate_bytes(r, &mut bytes);
    }
    bytes
}

/// How far inputs got: parsed as a JSON object, rendered through the chat template.
#[derive(Default)]
struct Reached {
    parsed: usize,
    rendered: usize,
}

/// What the routes run on a body, short of generating.
fn handle(
    bytes: &[u8],
    chat: &ChatSetup,
    tok: &std::sync::Arc<hmoe_tokenizer::Tokenizer>,
    vocab: &Vocab,
    defaults: &SamplingDefaults,
    reached: &mut Reached,
) {
    let Ok(body) = parse_body(bytes) else { return };
    let req = body.map;
    reached.parsed += 1;
    let f = Fields(&req);
    for flavor in [Flavor::Chat, Flavor::Completion, Flavor::Native] {
        if let Ok(Some((grammar, frame))) =
            gen_params(&f, defaults, flavor, tok, chat.forced_tool_format(tok)).map(|g| g.grammar)
        {
            let _ = vocab.compile(&grammar, frame);
        }
    }
    let _ = prompt_tokens(req.get("prompt"), tok);
    if let Ok(messages) = normalize_messages(req.get("messages")) {
        let tools = req.get("tools").filter(|t| t.is_array());
        let extra = match req.get("chat_template_kwargs") {
            Some(Value::Object(m)) => m.clone(),
            _ => Map::new(),
        };
        if let Ok(text) = chat.render(&messages, tools, true, extra) {
            reached.rendered += 1;
            let _ = chat.tokenize(tok, &text);
        }
    }
}

#[test]
fn random_and_mutated_bodies_never_panic() {
    let iters: usize = std::env::var("HMOE_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let seed: u64 = std::env::var("HMOE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    let tok = std::sync::Arc::new(tokenizer(&tiny_model()));
    let g = hmoe_gguf::GgufModel::open(tiny_model(), Default::default()).unwrap();
    let template = g
        .metadata()
        .get_str("tokenizer.chat_template")
        .expect("the fixture has a template")
        .to_string();
    let chat = ChatSetup::new(template, &tok).unwrap();
    let vocab = Vocab::new(&tok).unwrap();
    let defaults = SamplingDefaults::default();
    let seeds = seeds();
    // The seeds themselves are valid requests.
    for s in &seeds {
        assert!(parse_body(&serde_json::to_vec(s).unwrap()).is_ok());
    }
    let mut r = StdRng::seed_from_u64(seed);
    let t = Instant::now();
    let mut panics = Vec::new();
    let mut reached = Reached::default();
    // Panics are caught and counted; the default hook would print each one.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for i in 0..iters {
        let bytes = input(&mut r, &seeds);
        if catch_unwind(AssertUnwindSafe(|| {
            handle(&bytes, &chat, &tok, &vocab, &defaults, &mut reached)
        }))
        .is_err()
        {
            panics.push((i, String::from_utf8_lossy(&bytes).into_owned()));
        }
    }
    std::panic::set_hook(hook);
    eprintln!(
        "fuzz: {iters} bodies (seed {seed}) in {:.1} s: {} parsed, {} rendered with the template, {} panics",
        t.elapsed().as_secs_f64(),
        reached.parsed,
        reached.rendered,
        panics.len()
    );
    // The mutations must leave most bodies valid JSON and many renderable, or the test would
    // only exercise the JSON parser.
    assert!(
        reached.parsed * 2 > iters && reached.rendered * 20 > iters,
        "too few bodies got far"
    );
    assert!(
        panics.is_empty(),
        "{} panics, first: {:?}",
        panics.len(),
        &panics[..panics.len().min(3)]
    );
}

#[test]
fn mutated_bodies_over_http_always_get_an_answer() {
    let mut c = tiny_config();
    c.engine.n_ctx = 256;
    c.engine.n_parallel = 2;
    // Generation is capped so that a mutated max_tokens cannot make the test slow.
    c.sampling.n_predict = Some(2);
    let s = start(c);
    let a = s.local_addr();
    let seeds = seeds();
    let mut r = StdRng::seed_from_u64(7);
    let routes = [
        "/apply-template",
        "/tokenize",
        "/detokenize",
        "/v1/chat/completions",
        "/completion",
    ];
    for i in 0..600 {
        let route = routes[i % routes.len()];
        let mut bytes = input(&mut r, &seeds);
        // Keep generation short on the generating routes.
        if route != "/apply-template" {
            if let Ok(Value::Object(mut m)) = serde_json::from_slice::<Value>(&bytes) {
                for k in ["max_tokens", "n_predict", "max_completion_tokens"] {
                    m.insert(k.into(), json!(2));
                }
                m.remove("stream");
                bytes = serde_json::to_vec(&m).unwrap();
            }
        }
        let resp = request(a, "POST", route, &[], &bytes);
        assert!(
            (200..600).contains(&resp.status),
            "{route} {}: {}",
            resp.status,
            String::from_utf8_lossy(&bytes)
        );
        if resp.status != 200 {
            let e = resp.json();
            assert!(e["error"]["message"].is_string(), "{route}: {}", resp.body);
        }
    }
    assert_eq!(get(a, "/health").status, 200);
}
