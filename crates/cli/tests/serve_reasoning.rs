//! `hmoe serve`'s reasoning flags on the real binary, read back through `/apply-template` with
//! the Qwen3 template (expected prompts as llama-server renders them): `--reasoning off` and
//! `--reasoning-budget 0` close an empty think block, `--chat-template-kwargs` wins over them,
//! and a request's `chat_template_kwargs` wins over both.

#[path = "common/serve.rs"]
mod server;

use hmoe_testdata::fixtures;
use server::{http, serve};

const ON: &str = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";

/// The prompt of a one-message chat on a server started with `flags`, per request kwargs.
fn prompts(flags: &[&str], requests: &[&str]) -> Vec<String> {
    let model = fixtures().join("qwen3moe/qwen3moe-tiny.gguf");
    let template = fixtures().join("chat/Qwen-Qwen3-0.6B.jinja");
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--chat-template-file",
        template.to_str().unwrap(),
        "-c",
        "256",
        "-np",
        "1",
    ];
    args.extend_from_slice(flags);
    let s = serve(&args);
    requests
        .iter()
        .map(|kw| {
            let body = format!(
                r#"{{"messages": [{{"role": "user", "content": "hi"}}], "chat_template_kwargs": {kw}}}"#
            );
            let (status, text) = http(&s.addr, "POST", "/apply-template", "", &body);
            assert_eq!(status, 200, "{flags:?} {kw}: {text}");
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            v["prompt"].as_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn reasoning_flags_reach_the_template() {
    let off = format!("{ON}<think>\n\n</think>\n\n");
    let per_request = [r#"{}"#, r#"{"enable_thinking": true}"#];
    assert_eq!(prompts(&[], &per_request), [ON, ON]);
    assert_eq!(
        prompts(&["--reasoning", "off"], &per_request),
        [off.as_str(), ON]
    );
    assert_eq!(
        prompts(
            &["--reasoning-budget", "0"],
            &[r#"{}"#, r#"{"enable_thinking": false}"#]
        ),
        [off.as_str(), off.as_str()]
    );
    // The kwargs of the command line win over --reasoning off (as in llama-server).
    assert_eq!(
        prompts(
            &[
                "--reasoning",
                "off",
                "--chat-template-kwargs",
                r#"{"enable_thinking": true}"#
            ],
            &[r#"{}"#, r#"{"enable_thinking": false}"#]
        ),
        [ON, off.as_str()]
    );
}
