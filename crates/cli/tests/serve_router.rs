//! `hmoe serve --models-dir DIR --models-preset FILE.ini` on the reference device REF0 (no GPU
//! needed): each model is placed as its own section says (a preset's `n-cpu-moe` shows in
//! `/props`' placement and in the model's load lines), `--models-max 1` unloads one model to
//! load the other and loads it again on request, aliases answer, and the official `openai`
//! package lists and uses the models (from `$HMOE_PYTHON`; without it `SKIPPED:`). Hostile
//! preset files stop the start with a message naming what is wrong.

#[allow(dead_code)]
#[path = "../../server/tests/common/python.rs"]
mod python;

#[path = "common/serve.rs"]
mod server;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use hmoe_testdata::fixtures;
use server::{http, serve, serve_with_env};

/// A fresh directory with alpha.gguf and beta.gguf (the tiny fixture).
fn models_dir(name: &str) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-router-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("models")).unwrap();
    let tiny = fixtures().join("gpt-oss/gptoss-tiny.gguf");
    for m in ["alpha", "beta"] {
        std::fs::copy(&tiny, dir.join(format!("models/{m}.gguf"))).unwrap();
    }
    dir
}

fn get_json(addr: &str, path: &str) -> Value {
    let (status, body) = http(addr, "GET", path, "k", "");
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

fn post_ok(addr: &str, path: &str, body: &Value) -> Value {
    let (status, text) = http(addr, "POST", path, "k", &body.to_string());
    assert_eq!(status, 200, "{path} {body}: {text}");
    serde_json::from_str(&text).unwrap()
}

fn model<'a>(models: &'a Value, id: &str) -> &'a Value {
    (models["data"].as_array().unwrap().iter())
        .find(|m| m["id"] == id)
        .unwrap_or_else(|| panic!("no {id} in {models}"))
}

/// The experts layers `/props?model=NAME` places on `device` (0 when it is not listed).
fn expert_layers(addr: &str, name: &str, device: &str) -> u64 {
    let props = get_json(addr, &format!("/props?model={name}"));
    let p = &props["placement"];
    assert_eq!(p["engine"], "REF0", "{name}: {p}");
    (p["devices"].as_array().unwrap().iter())
        .find(|d| d["name"] == device)
        .map_or(0, |d| d["expert_layers"].as_u64().unwrap())
}

#[test]
fn each_model_is_placed_as_its_preset_says() {
    let dir = models_dir("preset");
    let ini = dir.join("presets.ini");
    std::fs::write(
        &ini,
        "version = 1\n\n[*]\nc = 512 ; every model\n\n[alpha]\nn-cpu-moe = 1\nalias = first\n",
    )
    .unwrap();
    let models = dir.join("models");
    let s = serve(&[
        "--models-dir",
        models.to_str().unwrap(),
        "--models-preset",
        ini.to_str().unwrap(),
        "--models-max",
        "1",
        "-dev",
        "REF0",
        "-ngl",
        "999",
        "-np",
        "1",
        "--api-key",
        "k",
    ]);
    let listed = get_json(&s.addr, "/v1/models");
    let alpha = model(&listed, "alpha");
    assert_eq!(alpha["aliases"], json!(["first"]), "{alpha}");
    assert_eq!(
        alpha["status"]["args"],
        json!(["--ctx-size", "512", "--n-cpu-moe", "1"])
    );
    assert_eq!(
        model(&listed, "beta")["status"]["args"],
        json!(["--ctx-size", "512"])
    );
    let err = s.stderr();
    assert!(
        err.contains("preset [alpha]: --ctx-size 512 --n-cpu-moe 1"),
        "{err}"
    );

    // Load alpha, use it by its alias: one layer's experts on the CPU.
    assert_eq!(
        post_ok(&s.addr, "/models/load", &json!({"model": "alpha"})),
        json!({"success": true})
    );
    assert_eq!(expert_layers(&s.addr, "alpha", "CPU"), 1);
    let ask = |name: &str| {
        let r = post_ok(
            &s.addr,
            "/completion",
            &json!({"model": name, "prompt": "Hello", "n_predict": 3, "temperature": 0}),
        );
        r["content"].as_str().unwrap().to_string()
    };
    let first = ask("first");
    // beta (no section of its own): every expert on REF0; --models-max 1 unloaded alpha.
    ask("beta");
    assert_eq!(expert_layers(&s.addr, "beta", "CPU"), 0);
    let listed = get_json(&s.addr, "/v1/models");
    assert_eq!(model(&listed, "alpha")["status"]["value"], "unloaded");
    assert_eq!(model(&listed, "beta")["status"]["value"], "loaded");
    // A request for alpha loads it again, placed as before, answering as before.
    assert_eq!(ask("alpha"), first);
    assert_eq!(expert_layers(&s.addr, "alpha", "CPU"), 1);
    let listed = get_json(&s.addr, "/v1/models");
    assert_eq!(model(&listed, "beta")["status"]["value"], "unloaded");
    // Each load printed its placement: alpha's twice, beta's once; the context is the [*]
    // section's.
    let err = s.stderr();
    let loads = err.matches("memory per device (MiB):").count();
    assert_eq!(loads, 3, "{err}");
    assert!(err.contains("context 512 (-c 512)"), "{err}");

    if let Some(py) = python::python_with(&["openai"]) {
        let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="k")
ids = sorted(m.id for m in c.models.list().data)
assert ids == ["alpha", "beta"], ids
r = c.completions.create(model="first", prompt="Hello", max_tokens=3, temperature=0)
assert r.model == "alpha", r.model
print("2 passed, 0 failed")
"#;
        python::run_checks(
            Command::new(py)
                .args(["-c", script])
                .arg(format!("http://{}/v1", s.addr)),
        );
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `curl` with the API key: (status, body).
fn curl(addr: &str, path: &str, key: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", "-H"])
        .arg(format!("Authorization: Bearer {key}"))
        .arg(format!("http://{addr}{path}"))
        .output()
        .expect("curl runs");
    let text = String::from_utf8(out.stdout).unwrap();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.trim().parse().unwrap(), body.to_string())
}

fn ids(addr: &str, path: &str) -> Vec<String> {
    let (status, body) = curl(addr, path, "k");
    assert_eq!(status, 200, "{path}: {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let mut ids: Vec<String> = (v["data"].as_array().unwrap().iter())
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids
}

/// A Hugging Face hub cache (`models--OWNER--NAME/refs/main` + `snapshots/COMMIT/FILE`) in
/// `--models-dir` is listed as llama-server lists its download cache (`OWNER/NAME:QUANT`), a
/// preset's `hf-repo` takes its model from the cache of `$LLAMA_CACHE`, and `GET
/// /models?reload=1` (curl) reads the preset file again: a section removed leaves the list,
/// one added joins it, a loaded model whose section is unchanged stays loaded, one whose
/// flags changed is unloaded; a file that no longer reads is a 500 naming the fault and the
/// list stays; without the API key a reload is a 401.
#[test]
fn presets_reload_and_hub_cache_models() {
    let dir = models_dir("reload");
    let models = dir.join("models");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let repo = models.join("models--org--tiny-GGUF");
    let snap = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    std::fs::copy(
        fixtures().join("gpt-oss/gptoss-tiny.gguf"),
        snap.join("tiny-Q8_0.gguf"),
    )
    .unwrap();
    let ini = dir.join("presets.ini");
    std::fs::write(
        &ini,
        "[alpha]\nc = 512\n\n[beta]\nc = 512\n\n[gamma]\nhf-repo = org/tiny-GGUF:Q8_0\n",
    )
    .unwrap();
    let s = serve_with_env(
        &[
            "--models-dir",
            models.to_str().unwrap(),
            "--models-preset",
            ini.to_str().unwrap(),
            "-dev",
            "REF0",
            "-np",
            "1",
            "--api-key",
            "k",
        ],
        &[("LLAMA_CACHE", &models)],
    );
    assert_eq!(
        ids(&s.addr, "/models"),
        ["alpha", "beta", "gamma", "org/tiny-GGUF:Q8_0"]
    );
    let ask = |name: &str| {
        let r = post_ok(
            &s.addr,
            "/completion",
            &json!({"model": name, "prompt": "Hello", "n_predict": 3, "temperature": 0}),
        );
        r["content"].as_str().unwrap().to_string()
    };
    // The cache's model and the preset's (the same file) answer alike.
    assert_eq!(ask("org/tiny-GGUF:Q8_0"), ask("gamma"));
    ask("alpha");
    ask("beta");

    std::fs::write(
        &ini,
        "[alpha]\nc = 512\n\n[beta]\nc = 256\n\n[delta]\nhf-repo = org/tiny-GGUF\n",
    )
    .unwrap();
    let (status, _) = curl(&s.addr, "/models?reload=1", "wrong");
    assert_eq!(status, 401);
    assert_eq!(
        ids(&s.addr, "/models?reload=1"),
        ["alpha", "beta", "delta", "org/tiny-GGUF:Q8_0"]
    );
    let listed = get_json(&s.addr, "/models");
    assert_eq!(model(&listed, "alpha")["status"]["value"], "loaded");
    assert_eq!(model(&listed, "beta")["status"]["value"], "unloaded");
    assert_eq!(
        model(&listed, "beta")["status"]["args"],
        json!(["--ctx-size", "256"])
    );
    assert_eq!(
        model(&listed, "org/tiny-GGUF:Q8_0")["status"]["value"],
        "loaded"
    );
    ask("delta");

    std::fs::write(&ini, "[alpha]\nbogus-key = 1\n").unwrap();
    let (status, body) = curl(&s.addr, "/models?reload=1", "k");
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("bogus-key"), "{body}");
    assert_eq!(
        ids(&s.addr, "/models"),
        ["alpha", "beta", "delta", "org/tiny-GGUF:Q8_0"]
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `hmoe serve --models-dir D --models-preset INI` that must fail at start (within 30 s);
/// returns its stderr.
fn failed_start(dir: &Path, ini_text: &[u8]) -> String {
    let ini = dir.join("bad.ini");
    std::fs::write(&ini, ini_text).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .arg("serve")
        .arg("--models-dir")
        .arg(dir.join("models"))
        .arg("--models-preset")
        .arg(&ini)
        .args(["--port", "0", "-dev", "REF0"])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if t.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("hmoe serve started with a bad preset");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn hostile_presets_fail_at_start_naming_the_fault() {
    let dir = models_dir("hostile");
    let mut huge = b"[alpha]\n".to_vec();
    while huge.len() <= 2 << 20 {
        huge.extend_from_slice(b"; padding padding padding padding padding padding\n");
    }
    let cases: Vec<(&[u8], &str)> = vec![
        (
            b"[alpha]\nbogus-key = 3\n",
            "option 'bogus-key' not recognized in preset 'alpha'",
        ),
        (b"[alpha]\nn-cpu-moe = abc\n", "[alpha]"),
        (b"[alpha]\nn-cpu-moe = abc\n", "abc"),
        (b"[alpha]\nctx-size = -5\n", "[alpha]"),
        (b"[alpha]\nno-mmap = perhaps\n", "expected true or false"),
        (b"[alpha]\n\n= 3\n", "line 3"),
        (b"[alpha\n", "line 1"),
        (b"c = 512\n", "before any [section]"),
        (
            b"[../../etc/passwd]\nc = 512\n",
            "[../../etc/passwd]: no model of that name",
        ),
        (
            b"[*]\nmodel = /etc/passwd\n",
            "[*] cannot name a model file",
        ),
        (
            b"[gamma]\nmodel = /nonexistent/gamma.gguf\n",
            "/nonexistent/gamma.gguf",
        ),
        (
            b"[gamma]\nmodel = models/alpha.gguf\nalias = beta\n",
            "alias 'beta'",
        ),
        (b"[alpha]\nc = 1\n\xff\xfe\n", "not UTF-8"),
        (&huge, "larger than 1024 KiB"),
    ];
    for (text, want) in cases {
        let err = failed_start(&dir, text);
        assert!(
            err.contains(want),
            "{:?}: no `{want}` in {err}",
            String::from_utf8_lossy(&text[..text.len().min(80)])
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
