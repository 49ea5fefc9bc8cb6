//! Placeholder until the owning work lands.

/// Arguments (placeholder).
#[derive(clap::Args)]
pub struct FitArgs {}

/// Runs the command (placeholder).
pub fn run(_args: FitArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
