//! The official `openai` Python package against the server (tests/openai_client.py): chat and
//! completions, whole and streamed, reasoning per --reasoning-format, a tool-call round trip,
//! 401 without the key, 400 on bad JSON, and curl for /health, /metrics and /tokenize.
//!
//! Needs `$HMOE_PYTHON` (the venv `.ci/run` makes; else `python3`) with the `openai` package;
//! without it the test prints `SKIPPED:` and installs nothing.

mod common;

use std::process::Command;

use common::*;
use hmoe_chat::ReasoningFormat;

fn run_client(py: &str, server: &hmoe_server::RunningServer, format: &str) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    common::python::run_checks(
        Command::new(py)
            .arg(script)
            .args(["--base-url", &format!("http://{}/v1", server.local_addr())])
            .args([
                "--api-key",
                "sk-test",
                "--model",
                "gptoss-tiny",
                "--scripted",
                "--reasoning-format",
                format,
            ]),
    );
}

fn server(format: ReasoningFormat) -> hmoe_server::RunningServer {
    let tok = tokenizer(&tiny_model());
    let mut c = tiny_config();
    c.api_keys = vec!["sk-test".into()];
    c.metrics = true;
    c.chat.reasoning_format = format;
    c.picker = Some(scripted(
        &tok,
        &[
            (1001, "<|channel|>analysis<|message|>The user says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"),
            (1002, "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>"),
            (1004, "<|channel|>final<|message|>It is sunny in Paris.<|return|>"),
        ],
    ));
    start(c)
}

#[test]
fn official_openai_client() {
    let Some(py) = common::python::python_with(&["openai"]) else {
        return;
    };
    run_client(&py, &server(ReasoningFormat::Auto), "auto");
    run_client(&py, &server(ReasoningFormat::None), "none");
}
