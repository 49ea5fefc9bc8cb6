//! The best logits ranked on the device (`EngineConfig::device_top_k`, `HMOE_DEVICE_TOPK=0`
//! turns it off) end to end: a server with it on and one with it off answer the same requests
//! with the same tokens and the same reported probabilities, for greedy sampling, llama-server's
//! default chain, top-k 40 with top-p, min-p and a temperature, the sampler's own probabilities
//! (`post_sampling_probs`), two requests decoded together, and requests that need the whole
//! row (penalties, logit bias, a grammar, probabilities before sampling).

mod common;

use std::net::SocketAddr;

use common::{post, start, tiny_config};
use serde_json::{json, Value};

fn server(on: bool) -> hmoe_server::RunningServer {
    let mut c = tiny_config();
    c.engine.device_top_k = on;
    start(c)
}

/// What must not depend on where the best logits were ranked.
fn answer(a: SocketAddr, body: &Value) -> Value {
    let r = post(a, "/completion", body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    json!({
        "content": v["content"],
        "probs": v["completion_probabilities"],
        "n": v["tokens_predicted"],
    })
}

#[test]
fn the_same_answers_with_the_device_ranking_on_and_off() {
    let (on, off) = (server(true), server(false));
    let base = json!({"prompt": "The quick brown fox", "n_predict": 24, "ignore_eos": true});
    let with = |extra: Value| {
        let mut b = base.clone();
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let mut bodies = vec![
        with(json!({"temperature": 0})),
        with(json!({"temperature": 0, "n_probs": 3, "post_sampling_probs": true})),
        with(json!({"top_k": 1, "temperature": 3.0, "seed": 4})),
        with(json!({"repeat_penalty": 1.3, "seed": 5})),
        with(json!({"presence_penalty": 0.7, "seed": 6})),
        with(json!({"logit_bias": [[5, 2.0]], "seed": 7, "temperature": 0})),
        with(json!({"grammar": "root ::= [a-z ]+", "seed": 8})),
        with(json!({"n_probs": 2, "seed": 9})),
    ];
    for seed in 0..6 {
        bodies.push(with(json!({"seed": seed})));
        bodies.push(with(
            json!({"seed": seed, "top_k": 40, "top_p": 0.9, "min_p": 0.02,
                                "temperature": 1.4}),
        ));
        bodies.push(with(
            json!({"seed": seed, "n_probs": 4, "post_sampling_probs": true}),
        ));
    }
    for body in &bodies {
        let (a, b) = (
            answer(on.local_addr(), body),
            answer(off.local_addr(), body),
        );
        assert_eq!(a, b, "{body}");
        assert!(a["n"].as_u64().unwrap() > 0, "{body}");
    }
    // Two requests decoded together (two slots): each gets what it gets alone.
    for body in bodies.iter().take(4) {
        let other = with(json!({"seed": 77, "top_k": 40, "temperature": 1.0}));
        let both = |a: SocketAddr| {
            let t = {
                let other = other.clone();
                std::thread::spawn(move || answer(a, &other))
            };
            (answer(a, body), t.join().unwrap())
        };
        assert_eq!(both(on.local_addr()), both(off.local_addr()), "{body}");
    }
}
