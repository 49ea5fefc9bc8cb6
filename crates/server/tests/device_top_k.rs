//! The best logits ranked on the device (`EngineConfig::device_top_k`, `HMOE_DEVICE_TOPK=0`
//! turns it off) end to end: a server with it on and one with it off answer the same requests
//! with the same tokens and the same reported probabilities, for greedy sampling, llama-server's
//! default chain, top-k 40 with top-p, min-p and a temperature, the sampler's own probabilities
//! (`post_sampling_probs`), two requests decoded together, and requests that need the whole
//! row (penalties, logit bias, a grammar, probabilities before sampling); on the CPU device and
//! on REF0, whose counted transfers show fewer bytes coming down with it on.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use common::{post, start, tiny_config};
use hmoe_backend::Ref0;
use hmoe_model::{DeviceModel, LanguageModel};
use hmoe_server::{LoadedModel, Placement};
use serde_json::{json, Value};

/// The model a REF0 server loaded, to read its device's counts.
type Loaded = Arc<Mutex<Option<Arc<dyn LanguageModel>>>>;

/// A server with the device ranking `on`; on REF0 when `ref0` is given (the loaded model is
/// put there), else on the CPU.
fn server(on: bool, ref0: Option<&Loaded>) -> hmoe_server::RunningServer {
    let mut c = tiny_config();
    c.engine.device_top_k = on;
    if let Some(slot) = ref0 {
        let slot = slot.clone();
        c.loader = Arc::new(move |gguf, _path| {
            let m = DeviceModel::load_whole(gguf, Ref0::new()).map_err(|e| e.to_string())?;
            let m: Arc<dyn LanguageModel> = Arc::new(m);
            *slot.lock().unwrap() = Some(m.clone());
            Ok(LoadedModel {
                model: m,
                placement: Placement::default(),
            })
        });
    }
    start(c)
}

/// Bytes the REF0 model in `slot` brought down so far.
fn bytes_down(slot: &Loaded) -> u64 {
    let m = slot.lock().unwrap().clone().unwrap();
    m.device_stats().unwrap().transfers.unwrap().download_bytes
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
    for ref0 in [false, true] {
        let (slot_on, slot_off): (Loaded, Loaded) = Default::default();
        let (on, off) = match ref0 {
            true => (server(true, Some(&slot_on)), server(false, Some(&slot_off))),
            false => (server(true, None), server(false, None)),
        };
        same_answers(on.local_addr(), off.local_addr());
        if ref0 {
            let (a, b) = (bytes_down(&slot_on), bytes_down(&slot_off));
            assert!(a < b, "bytes down with the device ranking {a}, without {b}");
        }
    }
}

/// The requests of the comparison, answered by the server at `on` and the one at `off`.
fn same_answers(on: SocketAddr, off: SocketAddr) {
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
        let (a, b) = (answer(on, body), answer(off, body));
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
        assert_eq!(both(on), both(off), "{body}");
    }
}
