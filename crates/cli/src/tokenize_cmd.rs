//! Placeholder until the owning work lands.

/// Arguments (placeholder).
#[derive(clap::Args)]
pub struct TokenizeArgs {}

/// Runs the command (placeholder).
pub fn run(_args: TokenizeArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
