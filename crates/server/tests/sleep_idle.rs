//! `--sleep-idle-seconds` as llama-server's: after that long without a request the model is
//! unloaded (`/props` says `is_sleeping`, and reading `/props`, `/health` or `/v1/models` does
//! not wake it), requests keep it awake, and the next generation loads it again and answers.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn sleeping(a: std::net::SocketAddr) -> bool {
    let r = get(a, "/props");
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["is_sleeping"].as_bool().expect("is_sleeping")
}

/// Waits up to `limit` for the server to say it sleeps.
fn wait_asleep(a: std::net::SocketAddr, limit: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if sleeping(a) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

#[test]
fn an_idle_model_sleeps_and_the_next_request_wakes_it() {
    let mut c = tiny_config();
    c.sleep_idle = Some(Duration::from_secs(1));
    let s = start(c);
    let a = s.local_addr();
    let body = json!({"prompt": "Hello", "n_predict": 2, "temperature": 0.0});
    let first = post(a, "/completion", &body);
    assert_eq!(first.status, 200, "{}", first.body);

    // Requests every 300 ms keep it awake for 2 s (reading /props is not one).
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) {
        assert!(!sleeping(a), "asleep {:?} after a request", t.elapsed());
        assert_eq!(post(a, "/tokenize", &json!({"content": "hi"})).status, 200);
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(!sleeping(a), "asleep while requests came");

    assert!(wait_asleep(a, Duration::from_secs(5)), "never slept");
    assert_eq!(get(a, "/health").status, 200);
    assert_eq!(get(a, "/v1/models").status, 200);
    let props = get(a, "/props").json();
    assert_eq!(props["is_sleeping"], true);
    assert_eq!(props["model_alias"], "gptoss-tiny");

    // The next generation loads it again and answers as before.
    let again = post(a, "/completion", &body);
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["content"], first.json()["content"]);
    assert!(!sleeping(a));
    // And it sleeps again.
    assert!(wait_asleep(a, Duration::from_secs(5)), "never slept again");
}
