//! Several completions in one request (llama-server's forms): arrays of prompts on
//! `/completion` and `/v1/completions`, prompt objects (`prompt_string`), `n` choices on the
//! chat and completion routes, and the 400s for what hmoe answers one at a time; and
//! `/chat/completions/input_tokens`, the prompt's size without a completion.

mod common;

use common::*;
use serde_json::{json, Value};

fn greedy(extra: Value) -> Value {
    let mut b = json!({"temperature": 0.0, "n_predict": 6, "max_tokens": 6});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[test]
fn arrays_of_prompts_answer_each_in_order() {
    let s = start(tiny_config());
    let a = s.local_addr();
    let text = "I believe the meaning of life is";
    let tokens = post(
        a,
        "/tokenize",
        &json!({"content": text, "add_special": true}),
    )
    .json()["tokens"]
        .clone();
    let single = post(a, "/completion", &greedy(json!({"prompt": tokens})));
    assert_eq!(single.status, 200, "{}", single.body);
    let want = single.json()["content"].clone();
    assert!(want.is_string());

    // Ids twice, ids and the same text, ids and a prompt object: one answer each, in order.
    for prompt in [
        json!([tokens, tokens]),
        json!([tokens, text]),
        json!([tokens, {"prompt_string": text}]),
    ] {
        let r = post(a, "/completion", &greedy(json!({"prompt": prompt})));
        assert_eq!(r.status, 200, "{prompt}: {}", r.body);
        let body = r.json();
        let answers = body.as_array().expect("an array of answers");
        assert_eq!(answers.len(), 2);
        for (i, answer) in answers.iter().enumerate() {
            assert_eq!(answer["index"], i);
            assert_eq!(answer["content"], want, "{prompt}");
            assert!(answer["timings"]["predicted_n"].as_u64().unwrap() > 0);
        }
    }

    // Ids and text mixed in one array are one prompt.
    let r = post(
        a,
        "/completion",
        &greedy(json!({"prompt": [1, 2, 3, text, 7, 8]})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["content"].is_string());

    // A prompt object alone is one prompt; media is refused (text-only models).
    let r = post(
        a,
        "/completion",
        &greedy(json!({"prompt": {"prompt_string": text}})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["content"], want);
    let r = post(
        a,
        "/completion",
        &greedy(json!({"prompt": {"prompt_string": text, "multimodal_data": ["iVBORw0KGgo="]}})),
    );
    assert_eq!(r.status, 400, "{}", r.body);

    // response_fields apply to each answer.
    let r = post(
        a,
        "/completion",
        &greedy(json!({"prompt": [text, text], "response_fields": ["content"]})),
    );
    assert_eq!(r.json(), json!([{"content": want}, {"content": want}]));

    // OpenAI's completions: one answer, a choice per prompt, usage summed.
    let one = post(a, "/v1/completions", &greedy(json!({"prompt": text}))).json();
    let r = post(
        a,
        "/v1/completions",
        &greedy(json!({"prompt": [text, text]})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], one["choices"][0]["text"]);
    }
    let prompt_tokens = one["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(body["usage"]["prompt_tokens"], 2 * prompt_tokens);
}

#[test]
fn n_choices_and_the_limits() {
    let s = start(tiny_config());
    let a = s.local_addr();
    let messages = json!([{"role": "user", "content": "What is the best book"}]);
    // Twice, pinned to one slot: the jobs queue on it and all end.
    for _ in 0..2 {
        let r = post(
            a,
            "/v1/chat/completions",
            &greedy(json!({"messages": messages, "n": 2, "id_slot": 0})),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let body = r.json();
        let choices = body["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i);
            assert_eq!(c["message"]["role"], "assistant");
            assert_eq!(c["finish_reason"], "length");
        }
    }
    let r = post(
        a,
        "/v1/completions",
        &greedy(json!({"prompt": "x", "n": 3})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"].as_array().unwrap().len(), 3);

    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": messages, "n": 0}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "n": 17}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "n": 2, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "n": 2, "response_format": {"type": "json_object"}}),
        ),
        ("/completion", json!({"prompt": ["a", "b"], "stream": true})),
        ("/completion", json!({"prompt": vec!["a"; 17]})),
        ("/completion", json!({"prompt": [{"text": "a"}]})),
        ("/v1/completions", json!({"prompt": ["a", "b"], "n": 9})),
    ] {
        let r = post(a, path, &greedy(body.clone()));
        assert_eq!(r.status, 400, "{path} {body}: {}", r.body);
        assert!(r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    // Still serving after the refusals.
    assert_eq!(
        post(a, "/completion", &greedy(json!({"prompt": "x"}))).status,
        200
    );
}

#[test]
fn chat_input_tokens_is_the_rendered_prompts_size() {
    let s = start(tiny_config());
    let a = s.local_addr();
    let messages = json!([{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]);
    let r = post(
        a,
        "/chat/completions/input_tokens",
        &json!({"messages": messages}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let n = r.json()["input_tokens"].as_u64().unwrap();
    // The same prompt a chat completion evaluates.
    let done = post(
        a,
        "/v1/chat/completions",
        &greedy(json!({"messages": messages, "max_tokens": 1})),
    );
    assert_eq!(done.json()["usage"]["prompt_tokens"].as_u64(), Some(n));
    let v1 = post(
        a,
        "/v1/chat/completions/input_tokens",
        &json!({"messages": messages}),
    );
    assert_eq!(v1.json()["input_tokens"].as_u64(), Some(n));
    let bad = post(
        a,
        "/chat/completions/input_tokens",
        &json!({"messages": "hi"}),
    );
    assert_eq!(bad.status, 400, "{}", bad.body);
}
