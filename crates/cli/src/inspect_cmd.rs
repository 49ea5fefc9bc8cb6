//! `hmoe inspect`: metadata and tensor table of a GGUF model.

use std::collections::BTreeMap;

use std::io::Write;

use anyhow::Context;
use hmoe_gguf::{GgufModel, LoadOptions, MetaValue};

/// Arguments of `hmoe inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Model file (any shard of a split model), as `-m FILE` (like every other command) or
    /// as the one positional argument.
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    pub model_flag: Option<std::path::PathBuf>,
    /// Model file, positional (`hmoe inspect FILE`).
    #[arg(
        value_name = "FILE",
        conflicts_with = "model_flag",
        required_unless_present = "model_flag"
    )]
    pub model: Option<std::path::PathBuf>,
    /// Print only the metadata.
    #[arg(long)]
    pub no_tensors: bool,
}

/// Runs `hmoe inspect`. Output goes through a locked stdout whose errors are returned, so a
/// reader that stops early (`hmoe inspect M | head`) ends the command quietly (see `main`).
pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let Some(model) = args.model_flag.as_ref().or(args.model.as_ref()) else {
        anyhow::bail!("inspect: give the model file (-m FILE)");
    };
    let g = GgufModel::open(model, LoadOptions::default())
        .with_context(|| format!("loading {}", model.display()))?;
    writeln!(
        out,
        "GGUF v{} — {} shard(s), {} tensors, {} metadata keys",
        g.version(),
        g.shard_paths().len().max(1),
        g.tensors().len(),
        g.metadata().len()
    )?;
    for (key, value) in g.metadata().iter() {
        writeln!(out, "  {key} = {}", show(value))?;
    }
    if args.no_tensors {
        out.flush()?;
        return Ok(());
    }
    writeln!(
        out,
        "\n{:<40} {:>6} {:>24} {:>14}",
        "tensor", "type", "shape", "bytes"
    )?;
    let mut per_type: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for t in g.tensors() {
        let shape = format!("{:?}", t.dims);
        writeln!(
            out,
            "{:<40} {:>6} {:>24} {:>14}",
            t.name,
            t.ty.name(),
            shape,
            t.n_bytes
        )?;
        let e = per_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    writeln!(out, "\ntotals per type:")?;
    for (ty, (count, bytes)) in &per_type {
        writeln!(
            out,
            "  {ty:<6} {count:>5} tensors {:>16} bytes ({:.2} MiB)",
            bytes,
            *bytes as f64 / 1048576.0
        )?;
    }
    let total = g.total_tensor_bytes();
    writeln!(
        out,
        "  all    {:>5} tensors {total:>16} bytes ({:.2} GiB)",
        g.tensors().len(),
        total as f64 / 1073741824.0
    )?;
    out.flush()?;
    Ok(())
}

/// A value on one line; long arrays are summarised.
fn show(v: &MetaValue) -> String {
    match v {
        MetaValue::String(s) if s.len() > 80 => {
            format!("{:?}… ({} bytes)", &s[..s.floor_char_boundary(80)], s.len())
        }
        MetaValue::String(s) => format!("{s:?}"),
        MetaValue::Array(ty, items) => {
            let head: Vec<String> = items.iter().take(5).map(show).collect();
            let more = if items.len() > 5 { ", …" } else { "" };
            format!("[{ty:?} × {}] [{}{more}]", items.len(), head.join(", "))
        }
        MetaValue::U8(x) => x.to_string(),
        MetaValue::I8(x) => x.to_string(),
        MetaValue::U16(x) => x.to_string(),
        MetaValue::I16(x) => x.to_string(),
        MetaValue::U32(x) => x.to_string(),
        MetaValue::I32(x) => x.to_string(),
        MetaValue::U64(x) => x.to_string(),
        MetaValue::I64(x) => x.to_string(),
        MetaValue::F32(x) => x.to_string(),
        MetaValue::F64(x) => x.to_string(),
        MetaValue::Bool(x) => x.to_string(),
    }
}
