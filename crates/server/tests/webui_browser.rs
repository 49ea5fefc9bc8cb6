//! The chat page driven in headless Chromium by tests/webui_browser.py (selenium): streaming,
//! reasoning, Markdown (answers and reasoning, highlighted code), timings, stop, regenerate, edit,
//! reload, a phone-sized window, router mode with `--models-max 1` and an API key (the key
//! dialog, picking, loading and unloading), and a message sent while a single model loads.
//!
//! Needs Chromium, chromedriver and a Python with `selenium` (`HMOE_PYTHON`, else `python3`;
//! `HMOE_CHROMIUM`, `HMOE_CHROMEDRIVER`, else /usr/bin/chromium and /usr/bin/chromedriver).
//! Without them it prints `SKIPPED: ...` and passes; `.ci/run` installs them. It writes its
//! screenshots to `$CARGO_TARGET_TMPDIR/webui.png` (and `webui-phone.png`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use hmoe_engine::{Sampler, SamplerParams};
use hmoe_server::{ModelSource, PickerFactory, RunningServer, ServerConfig, TokenPicker};
use hmoe_tokenizer::Tokenizer;

const KEY: &str = "sk-webui";

/// Replays fixed tokens, one every `delay`, so that a browser sees them arrive.
struct SlowScript {
    tokens: Vec<u32>,
    pos: usize,
    delay: Duration,
}

impl TokenPicker for SlowScript {
    fn accept(&mut self, _token: u32) {}
    fn pick(&mut self, _logits: &[f32]) -> u32 {
        std::thread::sleep(self.delay);
        let t = self.tokens[self.pos.min(self.tokens.len() - 1)];
        self.pos += 1;
        t
    }
}

/// The answers of tests/webui_browser.py, by seed.
fn slow_picker(tok: &Tokenizer) -> PickerFactory {
    let story =
        "Once upon a time there was a very small model that told very long stories. ".repeat(12);
    let scripts: Vec<(u64, String)> = vec![
        (
            11,
            "<|channel|>analysis<|message|>The user greets me. I will answer with **code**.<|end|>\
             <|start|>assistant<|channel|>final<|message|>**Hello!** Here is how, in <b>Python</b>:\n\n\
             ```python\nprint(\"hello\")\n```\n<|return|>"
                .into(),
        ),
        (
            12,
            format!("<|channel|>final<|message|>{story}<|return|>"),
        ),
        (
            13,
            "<|channel|>final<|message|>Answer from the router.<|return|>".into(),
        ),
    ];
    let map: Vec<(u64, Vec<u32>)> = scripts
        .into_iter()
        .map(|(seed, text)| {
            (
                seed,
                tok.encode(&text, false, true).expect("script encodes"),
            )
        })
        .collect();
    Arc::new(move |p: &SamplerParams| -> Box<dyn TokenPicker> {
        match map.iter().find(|(s, _)| *s == p.seed) {
            Some((_, tokens)) => Box::new(SlowScript {
                tokens: tokens.clone(),
                pos: 0,
                delay: Duration::from_millis(12),
            }),
            None => Box::new(Sampler::new(p.clone())),
        }
    })
}

/// The browser and driver to use, or why the test cannot run.
fn browser() -> Result<(String, PathBuf, PathBuf), String> {
    let path = |var: &str, default: &str| {
        std::env::var_os(var).map_or_else(|| PathBuf::from(default), PathBuf::from)
    };
    let chromium = path("HMOE_CHROMIUM", "/usr/bin/chromium");
    let driver = path("HMOE_CHROMEDRIVER", "/usr/bin/chromedriver");
    for p in [&chromium, &driver] {
        if !p.is_file() {
            return Err(format!(
                "{} not found (apt-get install chromium chromium-driver)",
                p.display()
            ));
        }
    }
    let py = common::python::python_or_why(&["selenium"])?;
    Ok((py, chromium, driver))
}

fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("{} -> {}: {e}", from.display(), to.display()));
}

#[test]
fn page_works_in_headless_chromium() {
    let (py, chromium, driver) = match browser() {
        Ok(b) => b,
        Err(why) => {
            eprintln!("SKIPPED: webui browser test: {why}");
            return;
        }
    };
    let tok = tokenizer(&tiny_model());
    let mut single = tiny_config();
    single.engine.n_parallel = 1;
    single.picker = Some(slow_picker(&tok));
    let one = start(single);

    let dir = scratch("webui-router");
    copy(&tiny_model(), &dir.join("alpha.gguf"));
    copy(&tiny_model(), &dir.join("beta.gguf"));
    let mut routed = ServerConfig::new(ModelSource::Dir(dir.clone()));
    routed.port = 0;
    routed.engine.n_ctx = 2048;
    routed.engine.n_ubatch = 64;
    routed.models_max = 1;
    routed.api_keys = vec![KEY.into()];
    routed.picker = Some(slow_picker(&tok));
    let many = start(routed);

    // A single model whose load waits for the script's signal (a file), as a big model would.
    let release = dir.join("release-load");
    let mut slow = tiny_config();
    slow.engine.n_parallel = 1;
    slow.picker = Some(slow_picker(&tok));
    let (inner, gate) = (slow.loader.clone(), release.clone());
    slow.loader = Arc::new(move |gguf, path| {
        let since = Instant::now();
        while !gate.exists() && since.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(50));
        }
        inner(gguf, path)
    });
    let loading = RunningServer::start(slow).expect("server starts");

    let profile = dir.join("chromium-profile");
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("webui.png");
    let out = Command::new(&py)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/webui_browser.py"
        ))
        .args(["--single", &format!("http://{}/", one.local_addr())])
        .args(["--router", &format!("http://{}/", many.local_addr())])
        .args(["--key", KEY])
        .args(["--loading", &format!("http://{}/", loading.local_addr())])
        .arg("--release")
        .arg(&release)
        .arg("--chromium")
        .arg(&chromium)
        .arg("--chromedriver")
        .arg(&driver)
        .arg("--profile")
        .arg(&profile)
        .arg("--shot")
        .arg(&shot)
        .output()
        .expect("python runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "the web UI checks failed:\n{text}");
    assert!(text.contains(" checks passed"), "{text}");
    assert!(shot.is_file(), "no screenshot at {}", shot.display());
    let summary = text
        .lines()
        .find(|l| l.contains(" checks passed"))
        .unwrap_or("");
    eprintln!("{summary}; screenshot: {}", shot.display());
}
