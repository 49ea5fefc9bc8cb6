//! What llama-server's clients read about the served models: `--alias a,b,c` and `--tags` in
//! `/v1/models` (`aliases`, `tags`; the id the first alias in sorted order), `/props`'
//! `build_info` shaped `b<number>-<hash>`, router mode's `/props` `max_instances`, and
//! `DELETE /models/{name}` unloading a model as `POST /models/unload` does.

mod common;

use std::time::Duration;

use common::*;
use hmoe_server::{ModelSource, ServerConfig};
use serde_json::json;

/// `b<digits>-<hex or "unknown">`.
fn is_build_info(s: &str) -> bool {
    let Some((n, hash)) = s.strip_prefix('b').and_then(|r| r.split_once('-')) else {
        return false;
    };
    !n.is_empty()
        && n.bytes().all(|b| b.is_ascii_digit())
        && (hash == "unknown" || (!hash.is_empty() && hash.bytes().all(|b| b.is_ascii_hexdigit())))
}

#[test]
fn aliases_tags_and_build_info_are_listed() {
    let mut c = tiny_config();
    c.alias = ["tinyllama-2", "fim", "code"].map(String::from).to_vec();
    c.tags = ["chat", "fim", "small"].map(String::from).to_vec();
    let s = start(c);
    let a = s.local_addr();
    for route in ["/models", "/v1/models"] {
        let r = get(a, route);
        assert_eq!(r.status, 200, "{}", r.body);
        let body = r.json();
        let data = body["data"].as_array().unwrap();
        assert_eq!(data.len(), 1);
        assert_eq!(data[0]["aliases"], json!(["code", "fim", "tinyllama-2"]));
        assert_eq!(data[0]["tags"], json!(["chat", "fim", "small"]));
        assert_eq!(data[0]["id"], "code", "the first alias in sorted order");
    }
    let props = get(a, "/props").json();
    assert_eq!(props["model_alias"], "code");
    let info = props["build_info"].as_str().unwrap();
    assert!(is_build_info(info), "{info}");
    assert!(is_build_info("b7285-d32676d") && !is_build_info("hmoe 0.1.0"));

    // No alias: the file's name, and empty lists.
    let s = start(tiny_config());
    let body = get(s.local_addr(), "/v1/models").json();
    assert_eq!(body["data"][0]["id"], "gptoss-tiny");
    assert_eq!(body["data"][0]["aliases"], json!([]));
    assert_eq!(body["data"][0]["tags"], json!([]));
}

#[test]
fn router_props_and_delete_unload() {
    let dir = scratch("model-listing-router");
    std::fs::copy(tiny_model(), dir.join("alpha.gguf")).unwrap();
    let mut c = ServerConfig::new(ModelSource::Dir(dir.clone()));
    c.port = 0;
    c.engine.n_ctx = 512;
    c.models_max = 3;
    c.limits.timeout = Duration::from_secs(30);
    let s = start(c);
    let a = s.local_addr();
    let props = get(a, "/props").json();
    assert_eq!(props["role"], "router");
    assert_eq!(props["max_instances"], 3);
    assert!(is_build_info(props["build_info"].as_str().unwrap()));

    let delete = |name: &str| request(a, "DELETE", &format!("/models/{name}"), &[], b"");
    let r = delete("alpha");
    assert_eq!(r.status, 400, "not loaded: {}", r.body);
    assert!(r.body.contains("not loaded"), "{}", r.body);
    let r = delete("nope");
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("not found"), "{}", r.body);

    let r = post(a, "/models/load", &json!({"model": "alpha"}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(get(a, "/props").json()["loaded_models"], json!(["alpha"]));
    let r = delete("alpha");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["success"], true);
    assert_eq!(get(a, "/props").json()["loaded_models"], json!([]));
    let models = get(a, "/v1/models").json();
    assert_eq!(models["data"][0]["status"]["value"], "unloaded");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
