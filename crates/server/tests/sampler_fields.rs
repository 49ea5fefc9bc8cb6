//! llama-server's sampler and slot fields: each is read (typical_p, top_n_sigma, XTC, DRY,
//! mirostat, samplers, t_max_predict_ms, id_slot, n_keep, response_fields) or refused with a
//! 400 that says hmoe lacks it (n_indent, lora beyond their neutral values); none is silently
//! dropped.

mod common;

use std::sync::Arc;

use common::{get, post, scripted, start, tiny_config, tiny_model, tokenizer};
use hmoe_engine::{Mirostat, SamplerStage};
use hmoe_server::params::{gen_params, Fields, Flavor, GenParams};
use hmoe_server::SamplingDefaults;
use serde_json::{json, Map, Value};

fn gen(body: Value) -> Result<GenParams, String> {
    let tok = Arc::new(tokenizer(&tiny_model()));
    let req: Map<String, Value> = serde_json::from_value(body).unwrap();
    gen_params(
        &Fields(&req),
        &SamplingDefaults::default(),
        Flavor::Native,
        &tok,
        None,
    )
    .map_err(|e| format!("{e:?}"))
}

#[test]
fn sampler_fields_reach_the_sampler() {
    let g = gen(json!({
        "typical_p": 0.9, "top_n_sigma": 1.5, "xtc_probability": 0.5, "xtc_threshold": 0.2,
        "dry_multiplier": 0.8, "dry_base": 2.0, "dry_allowed_length": 3,
        "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\n"],
        "mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2,
        "samplers": ["top_k", "temperature"], "t_max_predict_ms": 500, "id_slot": 1,
        "min_keep": 3,
        "n_keep": -1,
    }))
    .unwrap();
    let s = &g.sampling;
    assert_eq!((s.typical_p, s.top_n_sigma), (0.9, 1.5));
    assert_eq!((s.xtc_probability, s.xtc_threshold), (0.5, 0.2));
    assert_eq!(
        (s.dry.multiplier, s.dry.base, s.dry.allowed_length),
        (0.8, 2.0, 3)
    );
    assert_eq!(s.dry.penalty_last_n, Some(64));
    assert!(
        !s.dry.breakers.is_empty(),
        "the newline's tokens break DRY's repeats"
    );
    assert_eq!(
        (s.mirostat, s.mirostat_tau, s.mirostat_eta),
        (Mirostat::V2, 4.0, 0.2)
    );
    assert_eq!(s.order, vec![SamplerStage::TopK, SamplerStage::Temperature]);
    assert_eq!(s.min_keep, 3);
    assert_eq!(g.t_max_predict, Some(std::time::Duration::from_millis(500)));
    assert_eq!(g.id_slot, Some(1));
    // The letter form, and llama-server's defaults when left out.
    let g = gen(json!({"samplers": "kt", "id_slot": -1})).unwrap();
    assert_eq!(
        g.sampling.order,
        vec![SamplerStage::TopK, SamplerStage::Temperature]
    );
    assert_eq!(g.id_slot, None);
    let d = gen(json!({})).unwrap().sampling;
    assert_eq!(d.order, SamplerStage::DEFAULT_ORDER.to_vec());
    assert_eq!(
        (d.typical_p, d.xtc_probability, d.dry.multiplier),
        (1.0, 0.0, 0.0)
    );
    assert_eq!(
        (d.mirostat, d.mirostat_tau, d.mirostat_eta),
        (Mirostat::Off, 5.0, 0.1)
    );
    assert!(d.dry.breakers.is_empty(), "DRY off: no vocabulary scan");
}

#[test]
fn what_hmoe_lacks_is_a_400_that_says_so() {
    for (body, says) in [
        (
            json!({"samplers": ["top_k", "infill"]}),
            "no sampler 'infill'",
        ),
        (json!({"samplers": "kix"}), "no sampler letter 'i'"),
        (json!({"samplers": 5}), "'samplers' must be"),
        (json!({"mirostat": 3}), "'mirostat' must be"),
        (json!({"dry_sequence_breakers": []}), "non-empty"),
        (json!({"dry_penalty_last_n": -2}), "'dry_penalty_last_n'"),
        (json!({"n_indent": 4}), "does not support 'n_indent'"),
        (
            json!({"lora": [{"id": 0, "scale": 1.0}]}),
            "does not support 'lora'",
        ),
        (
            json!({"response_fields": ["content"], "stream": true}),
            "whole /completion answers",
        ),
        (
            json!({"response_fields": "content"}),
            "must be an array of strings",
        ),
        (json!({"id_slot": -2}), "'id_slot'"),
        (json!({"n_keep": -5}), "'n_keep'"),
    ] {
        let e = gen(body.clone())
            .err()
            .unwrap_or_else(|| panic!("{body} accepted"));
        assert!(
            e.contains("400") || e.contains("BAD_REQUEST") || e.contains("bad"),
            "{e}"
        );
        assert!(e.contains(says), "{body}: {e}");
    }
    // Neutral values change nothing and are accepted.
    for body in [
        json!({"n_indent": 0}),
        json!({"lora": []}),
        json!({"response_fields": []}),
        json!({"n_keep": 0}),
        json!({"n_keep": 100}),
    ] {
        assert!(gen(body.clone()).is_ok(), "{body}");
    }
}

/// Each sampler field changes what a seeded request generates, and an out-of-range slot is a
/// 400.
#[test]
fn each_sampler_changes_the_output_end_to_end() {
    let server = start(tiny_config());
    let a = server.local_addr();
    let run = |extra: Value| {
        let mut body = json!({
            "prompt": "hello", "n_predict": 24, "ignore_eos": true, "seed": 11,
            "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = post(a, "/completion", &body);
        assert_eq!(r.status, 200, "{extra}: {}", r.body);
        r.json()["tokens"].clone()
    };
    let base = run(json!({"return_tokens": true}));
    assert_eq!(
        base,
        run(json!({"return_tokens": true})),
        "seeded runs repeat"
    );
    for extra in [
        json!({"typical_p": 0.3}),
        json!({"top_n_sigma": 0.5}),
        json!({"xtc_probability": 1.0, "xtc_threshold": 0.001}),
        json!({"mirostat": 1, "mirostat_tau": 1.0}),
        json!({"mirostat": 2, "mirostat_tau": 1.0}),
        json!({"samplers": ["temperature", "min_p"], "min_p": 0.5}),
    ] {
        let mut e = extra.clone();
        e["return_tokens"] = true.into();
        assert_ne!(run(e), base, "{extra} changed nothing");
    }
    // DRY needs a repeat in the context to act on: a prompt that repeats itself, with the
    // token that would continue the repeat made the likeliest.
    let rep = json!({
        "prompt": "one two three one two three one two", "return_tokens": true,
        "logit_bias": [[" three", 20.0]],
    });
    let mut dry = rep.clone();
    dry["dry_multiplier"] = 50.0.into();
    assert_ne!(run(dry), run(rep), "DRY changed nothing");
    // /props reports the chain's defaults as llama-server names them.
    let props = get(a, "/props").json();
    let p = &props["default_generation_settings"]["params"];
    assert_eq!(p["samplers"][0], "penalties", "{p}");
    assert_eq!(p["samplers"][8], "temperature", "{p}");
    assert_eq!(
        (p["mirostat"].clone(), p["typical_p"].clone()),
        (json!(0), json!(1.0))
    );
    assert_eq!(p["dry_penalty_last_n"], -1, "{p}");
    // response_fields keeps the fields named, nested ones by path.
    let r = post(
        a,
        "/completion",
        &json!({"prompt": "hi", "n_predict": 2,
                "response_fields": ["content", "timings/predicted_n", "nothing/here"]}),
    );
    let j = r.json();
    let keys: Vec<&String> = j.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["content", "timings/predicted_n"], "{j}");
    assert_eq!(j["timings/predicted_n"], 2, "{j}");
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 2, "response_fields": ["content"]}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    // Pinned slots: one that exists runs there, one that does not is a 400.
    let r = post(
        a,
        "/completion",
        &json!({"prompt": "hi", "n_predict": 2, "id_slot": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["id_slot"], 1, "{}", r.body);
    let r = post(
        a,
        "/completion",
        &json!({"prompt": "hi", "n_predict": 2, "id_slot": 2}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("'id_slot' 2"), "{}", r.body);
}

/// llama-server's `t_max_predict_ms`: once generation has run that long, the next token
/// holding a newline ends it (`stop_type` limit); without it the text goes on.
#[test]
fn t_max_predict_ms_stops_at_a_newline_after_the_time() {
    let tok = tokenizer(&tiny_model());
    let script = format!("{}\nafter the newline\nmore", "word ".repeat(300));
    let n = tok.encode(&script, false, true).unwrap().len();
    let mut c = tiny_config();
    c.picker = Some(scripted(&tok, &[(7, script.as_str())]));
    let server = start(c);
    let a = server.local_addr();
    let body = |t: Option<u64>| {
        let mut b = json!({"prompt": "x", "n_predict": n, "ignore_eos": true, "seed": 7});
        if let Some(t) = t {
            b["t_max_predict_ms"] = t.into();
        }
        b
    };
    let r = post(a, "/completion", &body(Some(1))).json();
    let content = r["content"].as_str().unwrap();
    assert!(content.ends_with('\n'), "{r}");
    assert!(!content.contains("after"), "{r}");
    assert_eq!(r["stop_type"], "limit", "{r}");
    let r = post(a, "/completion", &body(None)).json();
    assert!(
        r["content"].as_str().unwrap().contains("after the newline"),
        "{r}"
    );
    // A generous limit is not reached.
    let r = post(a, "/completion", &body(Some(600_000))).json();
    assert!(r["content"].as_str().unwrap().contains("more"), "{r}");
}
