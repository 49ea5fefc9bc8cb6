//! `hmoe`: run, inspect and serve Mixture-of-Experts GGUF models.

mod fit_cmd;
mod placement_args;
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
    /// Tokenize text with a model's vocabulary.
    Tokenize(tokenize_cmd::TokenizeArgs),
    /// Plan tensor placement and print the memory estimate per device.
    Fit(fit_cmd::FitArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Tokenize(args) => tokenize_cmd::run(args),
        Command::Fit(args) => fit_cmd::run(args),
    }
}
