//! Router mode's model API as llama-server gives it: `POST /models/load` and `/models/unload`
//! (with their 400s), `--no-models-autoload`, a stream for a model that is loading (it waits,
//! then streams), aliases from a preset, a preset's own settings applied when its model loads,
//! `/models` fields, `/props?model=`, hostile model names, and the API key on every route.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use hmoe_server::{cpu_loader, ModelPreset, ModelSource, ServerConfig};
use serde_json::{json, Value};

fn entry(models: &Value, id: &str) -> Value {
    (models["data"].as_array().unwrap().iter())
        .find(|m| m["id"] == id)
        .unwrap_or_else(|| panic!("{id} not listed: {models}"))
        .clone()
}

fn status_of(a: std::net::SocketAddr, id: &str) -> String {
    let models = get(a, "/v1/models").json();
    entry(&models, id)["status"]["value"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A directory with alpha and beta (the tiny fixture), served with `models_max` 1; `edit`
/// changes the configuration first.
fn router(
    name: &str,
    edit: impl FnOnce(&mut ServerConfig),
) -> (std::path::PathBuf, hmoe_server::RunningServer) {
    let dir = scratch(name);
    std::fs::copy(tiny_model(), dir.join("alpha.gguf")).unwrap();
    std::fs::copy(tiny_model(), dir.join("beta.gguf")).unwrap();
    let mut c = ServerConfig::new(ModelSource::Dir(dir.clone()));
    c.port = 0;
    c.engine.n_ctx = 512;
    c.engine.n_parallel = 1;
    c.models_max = 1;
    c.limits.timeout = Duration::from_secs(30);
    edit(&mut c);
    (dir, start(c))
}

/// A preset with the server's settings but `n_ctx` and aliases of its own; `slow` makes its
/// loader take a second.
fn preset(c: &ServerConfig, n_ctx: usize, aliases: &[&str], slow: bool) -> ModelPreset {
    let mut engine = c.engine.clone();
    engine.n_ctx = n_ctx;
    let inner = cpu_loader();
    ModelPreset {
        path: None,
        aliases: aliases.iter().map(|s| s.to_string()).collect(),
        args: vec!["--ctx-size".into(), n_ctx.to_string()],
        engine,
        chat: c.chat.clone(),
        loader: if slow {
            Arc::new(move |g, p| {
                std::thread::sleep(Duration::from_millis(1500));
                inner(g, p)
            })
        } else {
            inner
        },
    }
}

#[test]
fn load_unload_and_their_errors() {
    let (dir, s) = router("router-api-load", |c| {
        let p = preset(c, 256, &["first", "uno"], false);
        c.presets.insert("alpha".into(), p);
    });
    let a = s.local_addr();
    // Unload of a model that is not loaded, of an unknown one, and with no name: 400.
    for (body, want) in [
        (json!({"model": "alpha"}), "not loaded"),
        (json!({"model": "nope"}), "not found"),
        (json!({}), "'model' is required"),
    ] {
        let r = post(a, "/models/unload", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert!(r.body.contains(want), "{body}: {}", r.body);
    }
    // Names that look like paths name no model.
    for name in [
        "../alpha",
        "alpha/../alpha",
        "/etc/passwd",
        "beta/",
        ".",
        "",
    ] {
        for path in ["/models/load", "/completion"] {
            let r = post(a, path, &json!({"model": name, "prompt": "x"}));
            assert_eq!(r.status, 400, "{path} {name:?}: {}", r.body);
        }
        let q = format!("/props?model={}", name.replace('/', "%2F"));
        assert_eq!(get(a, &q).status, 400, "{q}");
    }
    // Load, by an alias: the listing shows it loaded under its name, with its aliases and its
    // preset's flags.
    let r = post(a, "/models/load", &json!({"model": "uno"}));
    assert_eq!((r.status, r.json()), (200, json!({"success": true})));
    let models = get(a, "/v1/models").json();
    let alpha = entry(&models, "alpha");
    assert_eq!(alpha["status"]["value"], "loaded", "{alpha}");
    assert_eq!(alpha["aliases"], json!(["first", "uno"]));
    assert_eq!(alpha["status"]["args"], json!(["--ctx-size", "256"]));
    assert_eq!(alpha["source"], "models_dir");
    assert_eq!(entry(&models, "beta")["status"]["args"], json!([]));
    // The preset's context applied: 256 positions, not the server's 512.
    let props = get(a, "/props?model=first").json();
    assert_eq!(props["model_alias"], "alpha");
    assert_eq!(
        props["default_generation_settings"]["n_ctx"], 256,
        "{props}"
    );
    // Loading it again is a 400 (llama-server: "model is already running").
    let r = post(a, "/models/load", &json!({"model": "alpha"}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("already loaded"), "{}", r.body);
    // A request by alias answers as the model's name.
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "uno", "prompt": "Hello", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], "alpha");
    // --models-max 1: loading beta unloads alpha; beta runs with the server's context.
    assert_eq!(
        post(a, "/models/load", &json!({"model": "beta"})).status,
        200
    );
    assert_eq!(
        (status_of(a, "alpha"), status_of(a, "beta")),
        ("unloaded".into(), "loaded".into())
    );
    let props = get(a, "/props?model=beta").json();
    assert_eq!(
        props["default_generation_settings"]["n_ctx"], 512,
        "{props}"
    );
    // Unloaded, nothing is loaded.
    assert_eq!(
        post(a, "/models/unload", &json!({"model": "beta"})).status,
        200
    );
    assert_eq!(status_of(a, "beta"), "unloaded");
    let props = get(a, "/props").json();
    assert_eq!(props["role"], "router");
    assert_eq!(props["max_instances"], 1);
    assert_eq!(props["models_autoload"], true);
    assert_eq!(props["loaded_models"], json!([]));
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_autoload_a_model_must_be_loaded_first() {
    let (dir, s) = router("router-api-noauto", |c| c.models_autoload = false);
    let a = s.local_addr();
    let ask = json!({"model": "alpha", "prompt": "Hello", "n_predict": 2});
    let r = post(a, "/completion", &ask);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("--no-models-autoload"), "{}", r.body);
    assert_eq!(get(a, "/props?model=alpha").status, 400);
    assert_eq!(status_of(a, "alpha"), "unloaded");
    assert_eq!(get(a, "/props").json()["models_autoload"], false);
    assert_eq!(
        post(a, "/models/load", &json!({"model": "alpha"})).status,
        200
    );
    assert_eq!(post(a, "/completion", &ask).status, 200);
    // beta is not loaded: a request for it does not unload alpha.
    let r = post(
        a,
        "/completion",
        &json!({"model": "beta", "prompt": "x", "n_predict": 2}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(status_of(a, "alpha"), "loaded");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stream asked for while its model loads (by `POST /models/load`, autoload off) waits for
/// the load and then streams.
#[test]
fn a_stream_for_a_loading_model_waits_then_streams() {
    let (dir, s) = router("router-api-wait", |c| {
        c.models_autoload = false;
        let p = preset(c, 512, &[], true);
        c.presets.insert("alpha".into(), p);
    });
    let a = s.local_addr();
    let loader = std::thread::spawn(move || post(a, "/models/load", &json!({"model": "alpha"})));
    let t = Instant::now();
    while status_of(a, "alpha") != "loading" {
        assert!(t.elapsed() < Duration::from_secs(10), "never loading");
        std::thread::sleep(Duration::from_millis(10));
    }
    let asked = Instant::now();
    let mut sse = Sse::open(
        a,
        "/completion",
        &json!({"model": "alpha", "prompt": "Hello", "n_predict": 4, "stream": true}),
    );
    assert_eq!(sse.status, 200, "{}", sse.error_body);
    let events = sse.all();
    assert!(events.len() >= 2, "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["stop"], true, "{last}");
    assert_eq!(last["tokens_predicted"], 4, "{last}");
    // It waited for the load (1.5 s from its start).
    assert!(
        asked.elapsed() >= Duration::from_millis(500),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(loader.join().unwrap().status, 200);
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_api_key_guards_every_router_route() {
    let (dir, s) = router("router-api-key", |c| c.api_keys = vec!["secret".into()]);
    let a = s.local_addr();
    let body = json!({"model": "alpha"}).to_string();
    for (method, path) in [
        ("POST", "/models/load"),
        ("POST", "/models/unload"),
        ("GET", "/props"),
        ("GET", "/props?model=alpha"),
        ("GET", "/slots?model=alpha"),
        ("POST", "/completion"),
        ("POST", "/v1/chat/completions"),
    ] {
        let r = request(a, method, path, &[], body.as_bytes());
        assert_eq!(r.status, 401, "{method} {path}: {}", r.body);
    }
    assert_eq!(status_of(a, "alpha"), "unloaded", "a 401 loaded nothing");
    let auth = [("Authorization", "Bearer secret")];
    let r = request(a, "POST", "/models/load", &auth, body.as_bytes());
    assert_eq!(r.status, 200, "{}", r.body);
    // The public listing has names, aliases and status; no flags or paths.
    let public = get(a, "/v1/models").json();
    let alpha = entry(&public, "alpha");
    assert_eq!(alpha["status"], json!({"value": "loaded"}), "{alpha}");
    let full = request(a, "GET", "/v1/models", &auth, b"").json();
    assert!(entry(&full, "alpha")["status"]["args"].is_array());
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_presets_stop_the_start() {
    let dir = scratch("router-api-badpreset");
    std::fs::copy(tiny_model(), dir.join("alpha.gguf")).unwrap();
    let mut c = ServerConfig::new(ModelSource::Dir(dir.clone()));
    c.port = 0;
    let p = preset(&c, 256, &["beta"], false);
    // A section naming no model of the directory, without a file of its own.
    c.presets.insert("../alpha".into(), p.clone());
    let err = hmoe_server::RunningServer::start(c.clone()).err().unwrap();
    assert!(err.to_string().contains("[../alpha]"), "{err}");
    // A file that does not exist.
    c.presets.clear();
    let mut missing = p.clone();
    missing.path = Some(dir.join("nope.gguf"));
    c.presets.insert("gamma".into(), missing);
    let err = hmoe_server::RunningServer::start(c.clone()).err().unwrap();
    assert!(err.to_string().contains("nope.gguf"), "{err}");
    // An alias that is another model's name.
    c.presets.clear();
    let mut clash = p;
    clash.aliases = vec!["alpha".into()];
    clash.path = Some(dir.join("alpha.gguf"));
    c.presets.insert("gamma".into(), clash);
    let err = hmoe_server::RunningServer::start(c).err().unwrap();
    assert!(err.to_string().contains("alias 'alpha'"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
