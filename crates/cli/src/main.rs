//! `hmoe`: run, inspect and serve Mixture-of-Experts GGUF models.

mod bench_cmd;
mod chat_cmd;
mod common;
mod demo_cmd;
mod fit_cmd;
mod inspect_cmd;
mod make_model_cmd;
mod perplexity_cmd;
mod placement_args;
mod run_cmd;
mod serve_cmd;
mod tokenize_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "hmoe", version, about = "Mixture-of-Experts inference engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt.
    Run(run_cmd::RunArgs),
    /// Print a model's metadata and tensor table.
    Inspect(inspect_cmd::InspectArgs),
    /// Write a random-weight model with a real architecture.
    MakeTestModel(make_model_cmd::MakeModelArgs),
    /// Perplexity of a model on a text file (like llama-perplexity).
    Perplexity(perplexity_cmd::PerplexityArgs),
    /// Make a small model and generate from it: a first run on a fresh machine.
    Demo(demo_cmd::DemoArgs),
    /// Chat with a model in the terminal (uses its chat template).
    Chat(chat_cmd::ChatArgs),
    /// Tokenize text with a model's vocabulary.
    Tokenize(tokenize_cmd::TokenizeArgs),
    /// Plan tensor placement and print the memory estimate per device.
    Fit(fit_cmd::FitArgs),
    /// Measure prompt and generation speed as llama-bench does (its table and JSON fields).
    Bench(bench_cmd::BenchArgs),
    /// Serve models over an OpenAI-compatible HTTP API (llama-server's routes and flags).
    Serve(Box<serve_cmd::ServeArgs>),
}

/// llama.cpp's multi-letter single-dash flags, rewritten to their long forms before parsing.
const SHORT_ALIASES: [(&str, &str); 18] = [
    ("-ngl", "--n-gpu-layers"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-ub", "--ubatch-size"),
    ("-cmoe", "--cpu-moe"),
    ("-ncmoe", "--n-cpu-moe"),
    ("-ot", "--override-tensor"),
    ("-np", "--parallel"),
    ("-fa", "--flash-attn"),
    ("-dev", "--device"),
    ("-ts", "--tensor-split"),
    ("-mg", "--main-gpu"),
    ("-cb", "--cont-batching"),
    ("-tb", "--threads-batch"),
    ("-kvu", "--kv-unified"),
    ("-hf", "--hf-repo"),
    ("-fitt", "--fit-target"),
    ("-fitc", "--fit-ctx"),
];

fn normalise_args(args: impl Iterator<Item = String>) -> Vec<String> {
    args.map(|a| {
        SHORT_ALIASES
            .iter()
            .find(|(short, _)| *short == a)
            .map_or(a, |(_, long)| long.to_string())
    })
    .collect()
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse_from(normalise_args(std::env::args()));
    if let Err(e) = run(cli.command) {
        // The cause chain on one line; no backtrace even when RUST_BACKTRACE is set.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run(args) => run_cmd::run(args),
        Command::Inspect(args) => inspect_cmd::run(args),
        Command::MakeTestModel(args) => make_model_cmd::run(args),
        Command::Perplexity(args) => perplexity_cmd::run(args),
        Command::Demo(args) => demo_cmd::run(args),
        Command::Chat(args) => chat_cmd::run(args),
        Command::Tokenize(args) => tokenize_cmd::run(args),
        Command::Fit(args) => fit_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Serve(args) => serve_cmd::run(*args),
    }
}
