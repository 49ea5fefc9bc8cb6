//! `hmoe fit`: plan tensor placement for a model and print the flags and memory per device.

use std::path::PathBuf;

use anyhow::Context;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_placement::{plan, DeviceBudget, DeviceId, DeviceUsage, Plan, TensorDesc, TensorRule};
use serde_json::{json, Value};

use hmoe_engine::{plan_error, plan_flags, MoeCacheFlag, Probed, Selected};

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
    let shape = hmoe_model::model_shape(&model)?;
    let tensors: Vec<TensorDesc> = model.tensors().iter().map(TensorDesc::from).collect();
    let a = &args.placement.args;
    // Host RAM is reported, not enforced: weights are memory-mapped, so a model larger than
    // RAM still runs (paging), as with llama.cpp.
    let budget = args.placement.gpu_budget()?;
    // The devices --device names (the driver is asked again only then).
    let probed = if a.device.is_some() {
        Probed::now()
    } else {
        Probed::default()
    };
    let selected = args.placement.selected_devices(&probed)?;
    // The plan's GPU i is the i-th device of --device (else CUDA<i>).
    let names: Vec<String> = selected
        .iter()
        .flatten()
        .map(|&d| probed.name_of(d))
        .collect();
    if !budget.gpus.is_empty() {
        let sources = budget_sources(&budget, selected.as_deref(), &names, !a.gpu_mem.is_empty());
        eprintln!("fit: device budget: {}", sources.join(", "));
    }
    let flags = plan_flags(args.placement.to_flags()?, &names);
    let mut plan = plan(&tensors, &shape, &budget, &flags).map_err(|e| plan_error(e, &names))?;
    // Rules that named a device by its own name say it again in the printed flags.
    for rule in &mut plan.flags.rules {
        if let TensorRule::Override { device, .. } = rule {
            let named = (0..names.len()).find(|&i| *device == DeviceId::Gpu(i).to_string());
            if let Some(i) = named {
                *device = names[i].clone();
            }
        }
    }
    let moe_cache = moe_cache_bytes(&plan, a.moe_cache);
    if args.json {
        let mut v = to_json(&plan, &names);
        v["moe_cache_bytes"] = json!(moe_cache);
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", render(&plan, &names));
        let gpu = names.first().map_or("GPU0", String::as_str);
        match a.moe_cache {
            _ if moe_cache == 0 => {}
            Some(MoeCacheFlag::Mib(_)) => println!(
                "expert cache (--moe-cache): {} MiB on {gpu}, in its compute column",
                moe_cache >> 20
            ),
            _ => println!(
                "expert cache (--moe-cache): up to {} MiB more on {gpu}, out of what the plan leaves beyond --fit-target",
                moe_cache >> 20
            ),
        }
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

/// The most the device expert cache takes on the first GPU under `--moe-cache`: the MiB given
/// as the plan counts them (`--fit` may shrink them), or with `auto` the plan's room beyond
/// `--fit-target`; 0 when off or when every layer's experts are on the GPU already (nothing
/// to cache).
fn moe_cache_bytes(plan: &Plan, flag: Option<MoeCacheFlag>) -> u64 {
    let host_experts = plan
        .device(DeviceId::Cpu)
        .is_some_and(|cpu| cpu.expert_layers > 0);
    match flag {
        Some(MoeCacheFlag::Mib(_)) if host_experts => plan.flags.moe_cache,
        Some(MoeCacheFlag::Auto) if host_experts => plan
            .device(DeviceId::Gpu(0))
            .map_or(0, DeviceUsage::room_beyond_margin),
        _ => 0,
    }
}

/// Where each GPU's budget comes from, named as the plan's report names it: `--gpu-mem`, the
/// free memory the driver reports, or the reference device's default.
fn budget_sources(
    budget: &DeviceBudget,
    selected: Option<&[Selected]>,
    names: &[String],
    gpu_mem_given: bool,
) -> Vec<String> {
    (budget.gpus.iter().enumerate())
        .map(|(i, g)| {
            let dev = selected.and_then(|s| s.get(i)).copied();
            let from = match dev {
                _ if gpu_mem_given => "--gpu-mem".to_string(),
                Some(Selected::Ref0) => {
                    "the reference device's default; --gpu-mem sets it".to_string()
                }
                _ => "free memory the driver reports".to_string(),
            };
            format!(
                "{} {} MiB ({from})",
                DeviceId::Gpu(i).name_in(names),
                g.free >> 20
            )
        })
        .collect()
}

/// The text report: the command line, the table (GPU `i` called `names[i]` where given) and
/// what fit did.
fn render(p: &Plan, names: &[String]) -> String {
    let mut out = format!("{}\n\n{}", p.command_line(), p.table_named(names));
    for d in p.devices.iter().filter(|d| d.ring > 0) {
        out.push_str(&format!(
            "op-offload ring on {}: {} slices of {} experts, {} MiB (in its compute column)\n",
            d.device.name_in(names),
            hmoe_placement::RING_SLOTS,
            p.ring_slice_experts,
            d.ring >> 20
        ));
    }
    for n in &p.notes {
        out.push_str(&format!("fit: {n}\n"));
    }
    if !p.fits() {
        out.push_str("warning: some GPU keeps less than its --fit-target free (--fit off)\n");
    }
    out
}

fn device_json(d: &DeviceUsage, names: &[String]) -> Value {
    json!({
        "device": d.device.name_in(names),
        "weights": d.weights,
        "kv": d.kv,
        "compute": d.compute,
        "overhead": d.overhead,
        "total": d.total(),
        "free": d.free,
        "margin": d.margin,
        "layers": d.layers,
        "expert_layers": d.expert_layers,
        "ring": d.ring,
        "moe_cache": d.moe_cache,
    })
}

/// The JSON report: flags, context, and per device weights, kv, compute, total and free bytes.
fn to_json(p: &Plan, names: &[String]) -> Value {
    json!({
        "flags": p.command_line(),
        "n_ctx": p.n_ctx,
        "n_ubatch": p.n_ubatch,
        "n_gpu_layers": p.n_gpu_layers,
        "kv_cells_full": p.kv_cells_full,
        "kv_cells_swa": p.kv_cells_swa,
        "fit_cpu_expert_layers": p.fit_cpu_expert_layers,
        "ring_slice_experts": p.ring_slice_experts,
        "fits": p.fits(),
        "notes": p.notes,
        "devices": p.devices.iter().map(|d| device_json(d, names)).collect::<Vec<_>>(),
    })
}

/// `MemAvailable`, for the report only (the host is not a constraint).
fn host_available() -> Option<u64> {
    hmoe_cpu::host_memory().map(|m| m.available)
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
        let v = to_json(&p, &[]);
        assert!(v["flags"].as_str().unwrap().starts_with("-c "));
        let devs = v["devices"].as_array().unwrap();
        assert_eq!(devs.len(), 2);
        assert_eq!(devs[1]["device"], "CUDA0");
        for k in ["weights", "kv", "compute", "total", "free"] {
            assert!(devs[1][k].as_u64().is_some(), "{k}");
        }
        assert_eq!(devs[1]["total"].as_u64().unwrap(), p.devices[1].total());
        let text = render(&p, &[]);
        assert!(text.contains("CUDA0") && text.contains("weights"), "{text}");
        // The plan's GPU 0 selected as REF0 is called so in both reports.
        let names = ["REF0".to_string()];
        assert_eq!(to_json(&p, &names)["devices"][1]["device"], "REF0");
        let text = render(&p, &names);
        assert!(
            text.contains("\nREF0 ") && !text.contains("CUDA0"),
            "{text}"
        );
    }

    #[test]
    fn budget_sources_name_the_device_and_where_its_budget_comes_from() {
        let b = DeviceBudget::with_gpus(&[2 << 30, 8 << 30]);
        let names = ["REF0".to_string(), "CUDA1".to_string()];
        let sel = [Selected::Ref0, Selected::Cuda(1)];
        assert_eq!(
            budget_sources(&b, Some(&sel), &names, true),
            ["REF0 2048 MiB (--gpu-mem)", "CUDA1 8192 MiB (--gpu-mem)"]
        );
        assert_eq!(
            budget_sources(&b, Some(&sel), &names, false),
            [
                "REF0 2048 MiB (the reference device's default; --gpu-mem sets it)",
                "CUDA1 8192 MiB (free memory the driver reports)"
            ]
        );
        assert_eq!(
            budget_sources(&b, None, &[], false),
            [
                "CUDA0 2048 MiB (free memory the driver reports)",
                "CUDA1 8192 MiB (free memory the driver reports)"
            ]
        );
    }
}
