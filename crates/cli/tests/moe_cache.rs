//! `--moe-cache` end to end on the reference device: `hmoe bench -dev REF0 --cpu-moe
//! --moe-cache 64` prints the cache's hits and misses (after the table, and per record in JSON),
//! and the counts add up to the routed pairs; a cache with nothing to cache is an error; REF0
//! has no cache unless one is asked for. `hmoe run --json` on REF0 with `--cpu-moe` and a cache
//! gives the CPU's teacher-forced top-10 probabilities on every gpt-oss fixture and
//! reports the cache; `hmoe serve --metrics` on REF0 with a cache exposes its counts.

mod common;
#[allow(dead_code)]
#[path = "common/serve.rs"]
mod server;

use common::{fixture, fixtures, hmoe, run, FIXTURES};
use serde_json::Value;

fn tiny() -> String {
    fixtures()
        .join("gpt-oss/gptoss-tiny.gguf")
        .display()
        .to_string()
}

fn bench(extra: &[&str]) -> (bool, String, String) {
    let model = tiny();
    let mut args = vec![
        "bench",
        "-m",
        &model,
        "-t",
        "2",
        "-dev",
        "REF0",
        "--cpu-moe",
        "-p",
        "8",
        "-n",
        "8",
        "-r",
        "1",
    ];
    args.extend_from_slice(extra);
    let out = hmoe(&args);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `pp8 H hits / M misses` pairs of the "moe cache:" line.
fn counts(line: &str, test: &str) -> (u64, u64) {
    let rest = line
        .split(&format!("{test} "))
        .nth(1)
        .unwrap_or_else(|| panic!("no {test} in {line}"));
    let mut words = rest.split_whitespace();
    let hits = words.next().unwrap().parse().unwrap();
    assert_eq!(words.next(), Some("hits"));
    assert_eq!(words.next(), Some("/"));
    let misses = words.next().unwrap().parse().unwrap();
    (hits, misses)
}

/// Routed (token, expert) pairs of `bench`'s pp8 on gptoss-tiny (4 layers, 2 experts a token),
/// warm-up and timed run: 8 tokens in the first 3 layers, the last token alone in the last
/// (llama.cpp's `inp_out_ids`).
const PP8_ROUTES: u64 = 2 * 2 * (8 * 3 + 1);
/// The same for tg8: each decoded token in every layer.
const TG8_ROUTES: u64 = 2 * 2 * 8 * 4;

#[test]
fn bench_prints_the_expert_caches_hits_and_misses() {
    let (ok, out, err) = bench(&["--moe-cache", "64"]);
    assert!(ok, "{err}");
    assert!(err.contains("expert cache on REF0"), "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("moe cache:"))
        .unwrap_or_else(|| panic!("no moe cache line in\n{out}"));
    assert!(line.contains("64.0 MiB"), "{line}");
    // gptoss-tiny: 4 layers, 2 experts a token; each test runs once warm-up and once timed.
    // The prompt's last layer routes only its last token (the one whose logits are read).
    for (test, routes) in [("pp8", PP8_ROUTES), ("tg8", TG8_ROUTES)] {
        let (h, m) = counts(line, test);
        assert_eq!(h + m, routes, "{test}: {line}");
    }
    // 64 MiB hold every expert of the tiny model (8 a layer): after the prompt test, the
    // generation test mostly hits.
    let (h, m) = counts(line, "tg8");
    assert!(h > 3 * m, "{line}");
    let (ok, out, err) = bench(&["--moe-cache", "64", "-o", "json"]);
    assert!(ok, "{err}");
    let recs: Value = serde_json::from_str(&out).unwrap();
    for r in recs.as_array().unwrap() {
        let (h, m) = (r["moe_cache_hits"].as_u64(), r["moe_cache_misses"].as_u64());
        let routes = match r["n_prompt"].as_u64() {
            Some(0) => TG8_ROUTES,
            _ => PP8_ROUTES,
        };
        assert_eq!(h.unwrap() + m.unwrap(), routes, "{r}");
        assert!(r["moe_cache_hit_rate"].as_f64().is_some(), "{r}");
    }
    assert!(err.contains("moe cache:"), "{err}");
}

#[test]
fn no_cache_by_default_auto_takes_the_room_and_nothing_to_cache_is_an_error() {
    let (ok, out, err) = bench(&[]);
    assert!(ok, "{err}");
    assert!(!out.contains("moe cache:"), "{out}");
    assert!(!err.contains("expert cache on"), "{err}");
    let (ok, _, err) = bench(&["--moe-cache", "0"]);
    assert!(ok && !err.contains("expert cache on"), "{err}");
    // `auto`: what the plan leaves on REF0 beyond --fit-target, far more than the experts.
    let (ok, out, err) = bench(&["--moe-cache", "auto"]);
    assert!(ok && err.contains("expert cache on"), "{err}");
    assert!(out.contains("moe cache:"), "{out}");
    let (ok, _, err) = bench(&["--moe-cache", "lots"]);
    assert!(!ok && err.contains("`auto`"), "{err}");
    // With every layer's experts on the device there is nothing to cache. (A budget too
    // small for one expert is tested in hmoe-model's device_moe_cache: the tiny fixture's
    // experts are a few KiB, below the flag's MiB.)
    let model = tiny();
    let out = hmoe(&[
        "bench",
        "-m",
        &model,
        "-t",
        "2",
        "-dev",
        "REF0",
        "-ngl",
        "all",
        "-p",
        "8",
        "-n",
        "0",
        "-r",
        "1",
        "--moe-cache",
        "1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("nothing to cache"), "{err}");
}

#[test]
fn run_with_a_cache_gives_the_cpu_devices_probabilities() {
    for (stem, file) in FIXTURES {
        let f = fixture("gpt-oss", stem, file);
        let (cpu, _) = run(&f, &["-dev", "none"]);
        assert!(cpu.get("moe_cache").is_none());
        let extra = [
            "-dev",
            "REF0",
            "-ngl",
            "all",
            "--cpu-moe",
            "--moe-cache",
            "1",
        ];
        let (got, err) = run(&f, &extra);
        assert_eq!(got["engine"], "REF0", "{stem}: {err}");
        assert_eq!(got["top_probs"], cpu["top_probs"], "{stem}");
        let c = &got["moe_cache"];
        let pairs = c["hits"].as_u64().unwrap() + c["misses"].as_u64().unwrap();
        assert!(
            pairs > 0 && c["uploads"].as_u64().unwrap() > 0,
            "{stem}: {c}"
        );
        assert!(
            c["held_bytes"].as_u64().unwrap() <= 1 << 20,
            "{stem}: within the budget: {c}"
        );
    }
}

/// Summed values of the metric lines starting with `name`.
fn metric(text: &str, name: &str) -> u64 {
    (text.lines())
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[test]
fn serve_exposes_the_caches_counts_in_metrics() {
    let model = tiny();
    let srv = server::serve(&[
        "-m",
        &model,
        "-dev",
        "REF0",
        "-ngl",
        "all",
        "--cpu-moe",
        "--moe-cache",
        "1",
        "-c",
        "512",
        "--metrics",
    ]);
    let body = r#"{"prompt": "Hello there", "n_predict": 8, "temperature": 0}"#;
    let (status, reply) = server::http(&srv.addr, "POST", "/completion", "", body);
    assert_eq!(status, 200, "{reply}");
    let (status, text) = server::http(&srv.addr, "GET", "/metrics", "", "");
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("# TYPE hmoe:moe_cache_hits_total counter"),
        "{text}"
    );
    let (hits, misses) = (
        metric(&text, "hmoe:moe_cache_hits_total"),
        metric(&text, "hmoe:moe_cache_misses_total"),
    );
    // gptoss-tiny: 4 layers, 2 experts a token, and every prompt and generated token routed.
    assert!(hits + misses >= 8 * 2 * 4, "{hits} hits, {misses} misses");
    assert!(
        hits > 0 && metric(&text, "hmoe:moe_cache_uploads_total") > 0,
        "{text}"
    );
    assert!(metric(&text, "hmoe:moe_cache_bytes") <= 1 << 20, "{text}");
}

/// `hmoe fit` counts the cache `--moe-cache` asks for: the MiB given, `auto`'s room beyond
/// `--fit-target`, nothing when no layer's experts stay on the CPU.
#[test]
fn fit_reports_the_expert_cache() {
    let model = fixtures().join("gpt-oss/gptoss-small.gguf");
    let model = model.to_str().unwrap();
    let fit = |extra: &[&str]| -> Value {
        let mut args = vec![
            "fit",
            "-m",
            model,
            "-dev",
            "REF0",
            "--gpu-mem",
            "2GiB",
            "-ngl",
            "all",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = hmoe(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let cache = |v: &Value| v["moe_cache_bytes"].as_u64().unwrap();
    assert_eq!(cache(&fit(&["--cpu-moe"])), 0, "off unless asked for");
    assert_eq!(cache(&fit(&["--cpu-moe", "--moe-cache", "64"])), 64 << 20);
    let auto = fit(&["--cpu-moe", "--moe-cache", "auto"]);
    let dev = &auto["devices"].as_array().unwrap()[1];
    assert!(cache(&auto) > 0, "{auto}");
    assert!(cache(&auto) <= dev["free"].as_u64().unwrap(), "{auto}");
    assert_eq!(cache(&fit(&["--moe-cache", "64"])), 0, "nothing to cache");
}
