//! Tests of `hmoe serve`'s argument handling and start-up summary.

use super::*;
use clap::Parser;
use hmoe_model::kv_cache::CacheType;

#[derive(Parser)]
struct T {
    #[command(flatten)]
    s: ServeArgs,
}

fn parse(args: &[&str]) -> ServeArgs {
    T::try_parse_from(std::iter::once("hmoe").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        .s
}

#[test]
fn llama_server_command_lines_parse() {
    // As main.rs rewrites llama.cpp's spellings (-ngl, -fa, -np, -ub) before parsing.
    let a = parse(&[
        "-m",
        "m.gguf",
        "-c",
        "0",
        "--flash-attn",
        "--reasoning-format",
        "none",
        "--n-gpu-layers",
        "99",
        "--n-cpu-moe",
        "24",
        "--host",
        "0.0.0.0",
        "--port",
        "8081",
        "--ubatch-size",
        "2048",
        "-b",
        "2048",
        "--temp",
        "1.0",
        "--top-p",
        "1.0",
        "--top-k",
        "0",
        "--min-p",
        "0",
        "--threads",
        "-1",
        "--parallel",
        "4",
        "--api-key",
        "k1,k2",
        "--api-key",
        "k3",
        "--metrics",
    ]);
    let c = a.config().unwrap();
    assert_eq!(a.flash_attn, "on");
    assert_eq!(c.engine.n_ctx, 0);
    assert_eq!(c.engine.n_parallel, 4);
    assert_eq!(c.engine.n_ubatch, 2048);
    assert_eq!(c.api_keys, vec!["k1", "k2", "k3"]);
    assert_eq!(c.chat.reasoning_format, ReasoningFormat::None);
    assert_eq!(
        (c.sampling.params.top_k, c.sampling.params.temperature),
        (0, 1.0)
    );
    assert!(c.sampling.random_seed && c.metrics);
    let p = parse(&[
        "-m",
        "x",
        "--presence-penalty",
        "1.5",
        "--frequency-penalty",
        "-0.5",
    ]);
    let p = p.config().unwrap().sampling;
    assert_eq!((p.presence_penalty, p.frequency_penalty), (1.5, -0.5));
    assert!(parse(&["-m", "x", "--presence-penalty", "nan"])
        .config()
        .is_err());
    assert_eq!(a.threads, Some(-1));
    assert_eq!(parse(&["-m", "x", "--flash-attn", "off"]).flash_attn, "off");
    assert_eq!(parse(&["-m", "x"]).flash_attn, "auto");
    assert!(c.engine.kv_type.flash_attn());
    let off = parse(&["-m", "x", "--flash-attn", "off"]).config().unwrap();
    assert!(!off.engine.kv_type.flash_attn());
    let q = parse(&[
        "-m",
        "x",
        "--cache-type-k",
        "q8_0",
        "--cache-type-v",
        "q4_0",
    ])
    .config()
    .unwrap();
    assert_eq!(
        (q.engine.kv_type.k(), q.engine.kv_type.v()),
        (CacheType::Q8_0, CacheType::Q4_0)
    );
    assert!(
        parse(&["-m", "x", "--cache-type-v", "q8_0", "--flash-attn", "off"])
            .config()
            .is_err()
    );
    assert!(parse(&["-m", "x", "--flash-attn", "sometimes"])
        .config()
        .is_err());
}

/// Positions per slot as llama-server (d32676d77, the CPU baseline build) reported them
/// (`n_ctx_slot` of its `load_model` line) on qwen3moe-tiny (trained context 4096).
#[test]
fn slots_split_the_context_as_llama_server_does() {
    for (c, np, want) in [
        (512, 4, 256),
        (300, 4, 256),
        (512, 1, 512),
        (700, 1, 768),
        (700, 2, 512),
        (4096, 4, 1024),
        (100_000, 2, 4096),
    ] {
        assert_eq!(slot_positions(c, np, 4096), want, "-c {c} -np {np}");
    }
    assert_eq!(slot_positions(131072, 4, 131072), 32768);
    assert_eq!(parse(&["-m", "x"]).config().unwrap().engine.n_parallel, 4);
    assert_eq!(
        parse(&["-m", "x", "--parallel", "1"])
            .config()
            .unwrap()
            .engine
            .n_parallel,
        1
    );
    assert_eq!(
        parse(&["-m", "x", "--parallel", "-1"])
            .config()
            .unwrap()
            .engine
            .n_parallel,
        4
    );
}

#[test]
fn a_thinking_budget_is_accepted_with_a_note() {
    let a = parse(&["-m", "x", "--reasoning-budget", "1024"]);
    assert!(a.config().is_ok());
    assert_eq!(a.notes().len(), 1);
    assert!(a.notes()[0].contains("--reasoning-budget 1024"));
    assert!(parse(&["-m", "x"]).notes().is_empty());
    let none = parse(&["-m", "x", "--reasoning-format", "none"]).notes();
    assert!(
        none.len() == 1 && none[0].contains("tool calls stay raw harmony text"),
        "{none:?}"
    );
    assert!(parse(&["-m", "x", "--reasoning-budget", "-2"])
        .config()
        .is_err());
}

#[test]
fn model_source_is_required_and_exclusive() {
    assert!(parse(&[]).config().is_err());
    assert!(parse(&["-m", "a", "--models-dir", "d"]).config().is_err());
    assert!(matches!(
        parse(&["--models-dir", "d"]).config().unwrap().models,
        ModelSource::Dir(_)
    ));
    assert!(parse(&[
        "-m",
        "a",
        "--cache-type-k",
        "bogus",
        "--cache-type-v",
        "bogus"
    ])
    .config()
    .is_err());
    assert!(parse(&["-m", "a", "--chat-template-kwargs", "[1]"])
        .config()
        .is_err());
    assert!(parse(&["-m", "a"]).config().unwrap().webui);
    assert!(!parse(&["-m", "a", "--no-webui"]).config().unwrap().webui);
}
