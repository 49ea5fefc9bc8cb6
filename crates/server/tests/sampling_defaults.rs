//! The server's sampling defaults (`--presence-penalty`, `--frequency-penalty`, `--temp`, ...)
//! fill what a request leaves out, and a request's own value wins.

mod common;

use std::sync::Arc;

use common::{tiny_model, tokenizer};
use hmoe_server::params::{gen_params, Fields, Flavor};
use hmoe_server::SamplingDefaults;
use serde_json::{Map, Value};

/// A request body as the routes hand it to `gen_params`.
fn parse_body(body: &[u8]) -> serde_json::Result<Map<String, Value>> {
    serde_json::from_slice(body)
}

#[test]
fn penalties_default_to_the_servers_and_requests_override_them() {
    let tok = Arc::new(tokenizer(&tiny_model()));
    let defaults = SamplingDefaults {
        presence_penalty: 1.5,
        frequency_penalty: 0.25,
        ..SamplingDefaults::default()
    };
    let gen = |body: &str| {
        let req = parse_body(body.as_bytes()).unwrap();
        gen_params(&Fields(&req), &defaults, Flavor::Chat, &tok, None).unwrap()
    };
    let left_out = gen("{}");
    assert_eq!(
        (left_out.adjust.presence, left_out.adjust.frequency),
        (1.5, 0.25)
    );
    let given = gen(r#"{"presence_penalty": 0, "frequency_penalty": 0.5}"#);
    assert_eq!((given.adjust.presence, given.adjust.frequency), (0.0, 0.5));
    let off = SamplingDefaults::default();
    let req = parse_body(b"{}").unwrap();
    let plain = gen_params(&Fields(&req), &off, Flavor::Chat, &tok, None).unwrap();
    assert!(plain.adjust.is_noop(), "no penalty unless asked for");
}
