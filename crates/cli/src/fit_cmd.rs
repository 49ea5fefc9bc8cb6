//! `hmoe fit`: plan tensor placement for a model and print the flags and memory per device.

use std::path::PathBuf;

use anyhow::Context;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_placement::{plan, DeviceId, DeviceUsage, ModelShape, Plan, TensorDesc};
use serde_json::{json, Value};

use crate::placement_args::PlacementArgs;

/// Arguments of `hmoe fit`.
#[derive(clap::Args)]
pub struct FitArgs {
    /// Model file (the first shard of a split model).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    #[command(flatten)]
    pub placement: PlacementArgs,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Plans the model under the flags and prints the result.
pub fn run(args: FitArgs) -> anyhow::Result<()> {
    let model = GgufModel::open(&args.model, LoadOptions::default())
        .with_context(|| format!("opening {}", args.model.display()))?;
    let shape = ModelShape::from_metadata(model.metadata())?;
    let tensors: Vec<TensorDesc> = model.tensors().iter().map(TensorDesc::from).collect();
    let flags = args.placement.to_flags()?;
    // Host RAM is reported, not enforced: weights are memory-mapped, so a model larger than
    // RAM still runs (paging), as with llama.cpp.
    let budget = args.placement.gpu_budget()?;
    if args.placement.args.gpu_mem.is_empty() && !budget.gpus.is_empty() {
        let free: Vec<String> = budget
            .gpus
            .iter()
            .map(|g| format!("{} MiB", g.free >> 20))
            .collect();
        eprintln!(
            "fit: GPU budget from the free memory the driver reports: {}",
            free.join(", ")
        );
    }
    let plan = plan(&tensors, &shape, &budget, &flags)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&plan))?);
    } else {
        print!("{}", render(&plan));
        let cpu = plan.device(DeviceId::Cpu).map_or(0, DeviceUsage::total);
        if let Some(avail) = host_available().filter(|&a| a < cpu) {
            println!(
                "note: the CPU part ({} MiB) exceeds available RAM ({} MiB); mapped weights will page",
                cpu >> 20,
                avail >> 20
            );
        }
    }
    Ok(())
}

/// The text report: the command line, the table and what fit did.
fn render(p: &Plan) -> String {
    let mut out = format!("{}\n\n{}", p.command_line(), p.table());
    for n in &p.notes {
        out.push_str(&format!("fit: {n}\n"));
    }
    if !p.fits() {
        out.push_str("warning: some GPU keeps less than its --fit-target free (--fit off)\n");
    }
    out
}

fn device_json(d: &DeviceUsage) -> Value {
    json!({
        "device": d.device.to_string(),
        "weights": d.weights,
        "kv": d.kv,
        "compute": d.compute,
        "overhead": d.overhead,
        "total": d.total(),
        "free": d.free,
        "margin": d.margin,
        "layers": d.layers,
        "expert_layers": d.expert_layers,
    })
}

/// The JSON report: flags, context, and per device weights, kv, compute, total and free bytes.
fn to_json(p: &Plan) -> Value {
    json!({
        "flags": p.command_line(),
        "n_ctx": p.n_ctx,
        "n_ubatch": p.n_ubatch,
        "n_gpu_layers": p.n_gpu_layers,
        "kv_cells_full": p.kv_cells_full,
        "kv_cells_swa": p.kv_cells_swa,
        "fit_cpu_expert_layers": p.fit_cpu_expert_layers,
        "fits": p.fits(),
        "notes": p.notes,
        "devices": p.devices.iter().map(device_json).collect::<Vec<_>>(),
    })
}

/// `MemAvailable` from /proc/meminfo, for the report only (the host is not a constraint).
fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_placement::{gpt_oss_tensor_table, DeviceBudget, GptOssDims, PlacementFlags};

    #[test]
    fn json_has_flags_and_per_device_bytes() {
        let d = GptOssDims::gpt_oss_20b();
        let t = gpt_oss_tensor_table(&d).unwrap();
        let p = plan(
            &t,
            &d.shape(),
            &DeviceBudget::with_gpus(&[8 << 30]),
            &PlacementFlags::default(),
        )
        .unwrap();
        let v = to_json(&p);
        assert!(v["flags"].as_str().unwrap().starts_with("-c "));
        let devs = v["devices"].as_array().unwrap();
        assert_eq!(devs.len(), 2);
        assert_eq!(devs[1]["device"], "CUDA0");
        for k in ["weights", "kv", "compute", "total", "free"] {
            assert!(devs[1][k].as_u64().is_some(), "{k}");
        }
        assert_eq!(devs[1]["total"].as_u64().unwrap(), p.devices[1].total());
        let text = render(&p);
        assert!(text.contains("CUDA0") && text.contains("weights"), "{text}");
    }
}
