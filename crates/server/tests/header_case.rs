//! Response header names go out Title-Case, as llama-server writes them: clients that compare
//! names exactly (llama.cpp's own server tests read `headers["Access-Control-Allow-Origin"]`
//! from a plain dict) find them.

mod common;

use common::*;

#[test]
fn header_names_are_title_case() {
    let mut c = tiny_config();
    c.cors_origins = vec!["localhost".into()];
    let s = start(c);
    let a = s.local_addr();
    let r = request(
        a,
        "OPTIONS",
        "/completions",
        &[
            ("Origin", "http://localhost:8080"),
            ("Access-Control-Request-Method", "POST"),
        ],
        b"",
    );
    assert_eq!(r.status, 200);
    let names: Vec<&str> = r.headers.iter().map(|(k, _)| k.as_str()).collect();
    for want in [
        "Access-Control-Allow-Origin",
        "Access-Control-Allow-Methods",
        "Access-Control-Allow-Credentials",
        "Content-Length",
    ] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    let r = get(a, "/health");
    assert!(
        r.headers.iter().any(|(k, _)| k == "Content-Type"),
        "{:?}",
        r.headers
    );
}
