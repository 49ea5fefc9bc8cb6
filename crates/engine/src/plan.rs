//! The placement plan a choice is made from: the devices the run may use, the plan of the
//! model's tensors over them, and the device expert cache's budget.

use hmoe_gguf::GgufModel;
use hmoe_model::ExpertPlacement;
use hmoe_placement::{
    plan, DeviceId, PlacementError, PlacementFlags, Plan, TensorDesc, TensorRule,
};
use hmoe_quant::GgmlType;

use crate::config::{EngineConfig, MoeCacheFlag};
use crate::devices::{device_budget, selected_devices, Probed, Selected};
use crate::error::EngineError;
use crate::select::{choose_engine, gpu_executor_arch, EngineChoice, EngineDevice, EngineInputs};

/// `flags` with `-ot` rules that name a device by its name in `names` (the plan's GPU `i` is
/// `names[i]`, `REF0` for the reference device) renamed to the planner's `CUDA<i>`.
pub fn plan_flags(mut flags: PlacementFlags, names: &[String]) -> PlacementFlags {
    for rule in &mut flags.rules {
        if let TensorRule::Override { device, .. } = rule {
            if let Some(i) = names.iter().position(|n| n == device) {
                *device = DeviceId::Gpu(i).to_string();
            }
        }
    }
    flags
}

/// A planner error with the plan's GPUs called by `names` (`REF0` where the planner says
/// `CUDA<i>`): for a plan that does not fit, what each device lacks.
pub fn plan_error(e: PlacementError, names: &[String]) -> EngineError {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    match e {
        PlacementError::DoesNotFit(short) => {
            let parts: Vec<String> = short
                .iter()
                .map(|s| {
                    let name = match s.device {
                        DeviceId::Gpu(i) => names.get(i).cloned(),
                        DeviceId::Cpu => None,
                    };
                    format!(
                        "{} is {:.0} MiB short (plan {:.0} MiB + margin {:.0} MiB > {:.0} MiB \
                         free)",
                        name.unwrap_or_else(|| s.device.to_string()),
                        mib(s.missing()),
                        mib(s.projected),
                        mib(s.margin),
                        mib(s.free)
                    )
                })
                .collect();
            EngineError::DoesNotFit(format!(
                "the model does not fit, even with the smallest allowed context and every \
                 movable expert on the CPU: {} (raise --gpu-mem, lower --fit-target, or put \
                 fewer layers on the device)",
                parts.join("; ")
            ))
        }
        other => other.into(),
    }
}

/// The device expert cache's budget for a run (`--moe-cache`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeCacheBudget {
    /// No cache.
    Off,
    /// `--moe-cache MiB` in bytes: a budget too small for one expert is an error.
    Explicit(u64),
    /// `--moe-cache auto`, what the placement leaves beyond `--fit`'s margin, in bytes: a
    /// budget too small for one expert disables the cache with a note.
    Default(u64),
}

impl MoeCacheBudget {
    /// The budget for `--moe-cache` (`flag`): the MiB given; with `auto`, when some layer's
    /// experts stay on the host, the plan's room beyond `--fit`'s margin (`room`,
    /// [`hmoe_placement::DeviceUsage::room_beyond_margin`]); else off. Off by default until
    /// the cache has been measured on a GPU (one `moe` call per cached expert may cost more
    /// launches than it saves).
    pub fn choose(
        flag: Option<MoeCacheFlag>,
        placement: Option<&ExpertPlacement>,
        room: u64,
    ) -> MoeCacheBudget {
        let host_layers = placement.is_some_and(|p| p.device_layers() < p.layers.len());
        match flag {
            None | Some(MoeCacheFlag::Mib(0)) => MoeCacheBudget::Off,
            Some(MoeCacheFlag::Mib(mib)) => MoeCacheBudget::Explicit(mib.saturating_mul(1 << 20)),
            Some(MoeCacheFlag::Auto) if host_layers && room > 0 => MoeCacheBudget::Default(room),
            Some(MoeCacheFlag::Auto) => MoeCacheBudget::Off,
        }
    }
}

/// An engine choice and the plan it was made from.
#[derive(Clone, Debug)]
pub struct PlannedEngine {
    /// The engine.
    pub choice: EngineChoice,
    /// The placement plan, when one was made (a device to plan for and an architecture with a
    /// device executor).
    pub plan: Option<Plan>,
    /// The plan's GPUs by name (`CUDA0`, `REF0`): its `Gpu(i)` is `names[i]`.
    pub names: Vec<String>,
    /// The device expert cache's budget (`--moe-cache`, or the plan's room).
    pub moe_cache: MoeCacheBudget,
    /// Bytes of the op-offload ring the plan chose for the device (`None`: no plan, or no
    /// layer's experts offloaded in it; the executor's largest ring then).
    pub ring: Option<u64>,
}

/// Probes the GPUs and, for an architecture with a GPU executor, plans the placement of
/// `gguf` under `config`; then [`choose_engine`] (the CPU when `config.kv_offload` is off).
/// A plan that does not fit is an error naming each device and what it lacks
/// ([`plan_error`]).
pub fn plan_engine(config: &EngineConfig, gguf: &GgufModel) -> Result<PlannedEngine, EngineError> {
    let probed = Probed::now();
    let selected = selected_devices(config.devices.as_deref(), &probed)?;
    let budget = device_budget(selected.as_deref(), &config.gpu_mem, &probed);
    let selected = selected.unwrap_or_else(|| (0..probed.gpus.len()).map(Selected::Cuda).collect());
    let devices: Vec<EngineDevice> = selected
        .iter()
        .zip(&budget.gpus)
        .map(|(&d, b)| match d {
            Selected::Cuda(i) => EngineDevice::Cuda(probed.gpus[i].index),
            Selected::Ref0 => EngineDevice::Ref0 { budget: b.free },
        })
        .collect();
    let names: Vec<String> = selected.iter().map(|&d| probed.name_of(d)).collect();
    let arch = gguf.metadata().architecture();
    let mut planned: Vec<(&str, DeviceId)> = Vec::new();
    let mut gpu_types: Vec<GgmlType> = Vec::new();
    let mut n_layer = 0;
    let mut made = None;
    if !devices.is_empty() && gpu_executor_arch(arch) {
        let shape = hmoe_model::model_shape(gguf)?;
        let tensors: Vec<TensorDesc> = gguf.tensors().iter().map(TensorDesc::from).collect();
        let flags = plan_flags(config.flags.clone(), &names);
        let p = plan(&tensors, &shape, &budget, &flags).map_err(|e| plan_error(e, &names))?;
        n_layer = shape.n_layer as usize;
        planned = gguf
            .tensors()
            .iter()
            .map(|t| t.name.as_str())
            .zip(p.tensor_devices.iter().copied())
            .collect();
        for (t, d) in gguf.tensors().iter().zip(&p.tensor_devices) {
            if d.is_gpu() && !gpu_types.contains(&t.ty) {
                gpu_types.push(t.ty);
            }
        }
        made = Some(p);
    }
    let mut choice = choose_engine(&EngineInputs {
        devices: &devices,
        why_no_gpu: probed.why_none.as_deref(),
        arch,
        kv: config.kv,
        n_layer,
        tensors: &planned,
        gpu_types: &gpu_types,
        op_offload: config.op_offload,
    });
    if !config.kv_offload && matches!(choice, EngineChoice::Device { .. }) {
        choice = EngineChoice::Cpu {
            why: "--no-kv-offload keeps the K/V cache in RAM, and the device executor keeps it \
                  on the device"
                .into(),
        };
    }
    let mut moe_cache_flag = config.moe_cache;
    if let EngineChoice::Device { device, placement } = &mut choice {
        // Host experts of a type the device does not multiply (the IQ types on CUDA) are never
        // copied to it: no op offload, no expert cache.
        let caps = crate::select::device_capabilities(*device);
        let foreign = gguf.tensors().iter().zip(&planned).any(|(t, &(name, d))| {
            !d.is_gpu() && name.contains("_exps.") && !caps.multiplies(t.ty)
        });
        if foreign {
            placement.op_offload_min_batch = None;
            moe_cache_flag = None;
        }
    }
    let expert_placement = match &choice {
        EngineChoice::Device { placement, .. } => Some(placement),
        EngineChoice::Cpu { .. } => None,
    };
    let gpu0 = made.as_ref().and_then(|p| p.device(DeviceId::Gpu(0)));
    let room = gpu0.map_or(0, |u| u.room_beyond_margin());
    let ring = gpu0.map(|u| u.ring).filter(|&r| r > 0);
    // `--moe-cache MiB` as the plan counted it (for CPU layers), which `--fit` may have
    // shrunk.
    let moe_cache_flag = match (moe_cache_flag, made.as_ref()) {
        (Some(MoeCacheFlag::Mib(_)), Some(p))
            if p.device(DeviceId::Cpu).is_some_and(|c| c.expert_layers > 0) =>
        {
            Some(MoeCacheFlag::Mib(p.flags.moe_cache >> 20))
        }
        (flag, _) => flag,
    };
    let moe_cache = MoeCacheBudget::choose(moe_cache_flag, expert_placement, room);
    Ok(PlannedEngine {
        choice,
        plan: made,
        names,
        moe_cache,
        ring,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_model::ExpertHome;

    const G: DeviceId = DeviceId::Gpu(0);

    #[test]
    fn ref0_in_rules_and_errors() {
        let names = vec!["REF0".to_string()];
        let flags = PlacementFlags {
            rules: vec![
                TensorRule::Override {
                    pattern: "a".into(),
                    device: "REF0".into(),
                },
                TensorRule::Override {
                    pattern: "b".into(),
                    device: "CPU".into(),
                },
            ],
            ..PlacementFlags::default()
        };
        let f = plan_flags(flags, &names);
        assert!(matches!(&f.rules[0], TensorRule::Override { device, .. } if device == "CUDA0"));
        assert!(matches!(&f.rules[1], TensorRule::Override { device, .. } if device == "CPU"));
        let e = plan_error(
            PlacementError::DoesNotFit(vec![hmoe_placement::Shortfall {
                device: G,
                projected: 300 << 20,
                free: 100 << 20,
                margin: 1024 << 20,
            }]),
            &names,
        )
        .to_string();
        assert!(e.contains("REF0 is 1224 MiB short"), "{e}");
        assert!(!e.contains("CUDA0"), "{e}");
    }

    #[test]
    fn moe_cache_budget_is_off_unless_asked_for() {
        use crate::config::MoeCacheFlag::{Auto, Mib};
        use ExpertHome::{Device as D, Host as H};
        use MoeCacheBudget::*;
        let host = ExpertPlacement {
            layers: vec![H, D],
            op_offload_min_batch: None,
        };
        let all = ExpertPlacement {
            layers: vec![D, D],
            op_offload_min_batch: None,
        };
        let room = 300 << 20;
        let choose = MoeCacheBudget::choose;
        assert_eq!(choose(None, Some(&host), room), Off, "off by default");
        assert_eq!(choose(Some(Auto), Some(&host), room), Default(room));
        assert_eq!(choose(Some(Auto), Some(&host), 0), Off, "no room");
        assert_eq!(choose(Some(Auto), Some(&all), room), Off, "no host layer");
        assert_eq!(
            choose(Some(Auto), None, room),
            Off,
            "the executor on the CPU"
        );
        assert_eq!(choose(Some(Mib(0)), Some(&host), room), Off);
        assert_eq!(choose(Some(Mib(64)), Some(&host), 0), Explicit(64 << 20));
        // An explicit cache with nothing to cache is the model's error to report.
        assert_eq!(choose(Some(Mib(8)), Some(&all), 0), Explicit(8 << 20));
    }
}
