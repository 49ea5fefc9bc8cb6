//! Loading the model on the chosen engine: the device executor on a CUDA GPU or `REF0`, or
//! the executor on the CPU, and the one entry point that plans, chooses and loads
//! ([`load`], [`load_opened`]).

use hmoe_backend::{Backend, Ref0, REF0_NAME};
use hmoe_gguf::GgufModel;
use hmoe_model::{DeviceModel, ExpertPlacement, LanguageModel};
use hmoe_placement::Plan;

use crate::config::EngineConfig;
use crate::error::{error_chain, EngineError};
use crate::plan::{plan_engine, MoeCacheBudget};
use crate::select::{device_name, EngineChoice, EngineDevice};

/// The device a model was loaded on, for reports (`hmoe bench`'s backend columns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineUsed {
    /// `CUDA`, `REF0` or `CPU`, as llama-bench's `backends`.
    pub backend: &'static str,
    /// The device's name (`CUDA0`, `REF0`, `CPU`).
    pub device: String,
    /// The GPU's name (empty on the CPU).
    pub gpu_info: String,
    /// Layers whose dense part runs on the GPU.
    pub n_gpu_layers: usize,
}

impl Default for EngineUsed {
    fn default() -> Self {
        EngineUsed {
            backend: "CPU",
            device: "CPU".into(),
            gpu_info: String::new(),
            n_gpu_layers: 0,
        }
    }
}

/// A loaded model and what was chosen for it, and why.
pub struct LoadedEngine {
    /// The model.
    pub model: Box<dyn LanguageModel>,
    /// The device it runs on (`None`: the executor on the CPU).
    pub used: Option<EngineUsed>,
    /// Why it runs on the CPU (`None` on a device).
    pub why_cpu: Option<String>,
    /// The placement plan the choice was made from, when one was made.
    pub plan: Option<Plan>,
    /// The plan's GPUs by name (`CUDA0`, `REF0`): its `Gpu(i)` is `names[i]`.
    pub names: Vec<String>,
    /// What the load did, a line each, for the caller to show (where the weights went, the
    /// expert cache).
    pub notes: Vec<String>,
}

/// Whether the CPU device may interleave MXFP4 expert rows for its kernel (without `-nr`):
/// never beside a heap buffer (--no-mmap) or locked pages (--mlock), which would then hold the
/// experts twice; a mapping's copied pages are given back.
pub fn interleaves_experts(no_repack: bool, no_mmap: bool, mlock: bool) -> bool {
    !(no_repack || no_mmap || mlock)
}

/// Starts the process's thread pools with `threads` threads (at least one) and sets whether
/// the CPU device interleaves MXFP4 expert rows ([`interleaves_experts`]).
pub fn start_threads(threads: usize, interleave_experts: bool) -> Result<(), EngineError> {
    let threads = threads.max(1);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .map_err(EngineError::ThreadPool)?;
    hmoe_pool::init_global(threads).map_err(EngineError::TokenPool)?;
    hmoe_cpu::set_expert_interleaving(interleave_experts);
    Ok(())
}

/// Opens `config.model`, then [`load_opened`]: the one entry point of `hmoe run`, `bench`,
/// `chat`, `perplexity` and a library user.
pub fn load(config: &EngineConfig) -> Result<LoadedEngine, EngineError> {
    load_opened(config, open(config)?)
}

/// Plans the placement of `gguf` (opened from `config.model`), chooses the engine
/// ([`crate::choose_engine`]) and loads the model there: the device executor, or the executor
/// on the CPU with the reason logged (a warning when `config.asks_for_gpu`). A CUDA device
/// that fails to load falls back to the CPU over the file opened again; a failure on the
/// reference device is the answer.
pub fn load_opened(config: &EngineConfig, gguf: GgufModel) -> Result<LoadedEngine, EngineError> {
    let planned = plan_engine(config, &gguf)?;
    let (model, used, why_cpu, notes) = match planned.choice {
        EngineChoice::Device { device, placement } => {
            match load_device(gguf, device, &placement, planned.moe_cache, planned.ring) {
                Ok((model, used, notes)) => (model, Some(used), None, notes),
                // The reference device is for testing: a failure there is the answer.
                Err(e) if matches!(device, EngineDevice::Ref0 { .. }) => return Err(e),
                Err(e) => {
                    let e = error_chain(&e);
                    tracing::warn!("GPU executor failed to load ({e}); running on the CPU");
                    let model = hmoe_model::load(open(config)?)?;
                    let why = format!("the GPU executor failed to load ({e})");
                    (model, None, Some(why), Vec::new())
                }
            }
        }
        EngineChoice::Cpu { why } => {
            if config.asks_for_gpu {
                tracing::warn!("running on the CPU: {why}");
            } else {
                tracing::info!("running on the CPU: {why}");
            }
            (hmoe_model::load(gguf)?, None, Some(why), Vec::new())
        }
    };
    Ok(LoadedEngine {
        model,
        used,
        why_cpu,
        plan: planned.plan,
        names: planned.names,
        notes,
    })
}

/// Opens `config.model` as `config.load` says.
fn open(config: &EngineConfig) -> Result<GgufModel, EngineError> {
    GgufModel::open(&config.model, config.load).map_err(|source| EngineError::Open {
        path: config.model.clone(),
        source,
    })
}

/// A model on a device, the report of it and what the load did.
type OnDevice = (Box<dyn LanguageModel>, EngineUsed, Vec<String>);

/// Loads the model onto `device` with the experts where `placement` says, the expert
/// cache of `moe_cache` and the op-offload ring of `ring` bytes.
fn load_device(
    gguf: GgufModel,
    device: EngineDevice,
    placement: &ExpertPlacement,
    moe_cache: MoeCacheBudget,
    ring: Option<u64>,
) -> Result<OnDevice, EngineError> {
    let dev_cfg = Loading {
        placement,
        moe_cache,
        ring,
    };
    match device {
        EngineDevice::Cuda(ordinal) => {
            let dev = hmoe_cuda::CudaDevice::new(ordinal)?;
            let gpu_info = dev.info().name.clone();
            let on = OnBackend {
                device,
                name: format!("{} ({gpu_info})", device_name(device)),
                backend: "CUDA",
                gpu_info,
            };
            loaded(gguf, dev, on, &dev_cfg)
        }
        EngineDevice::Ref0 { budget } => {
            let on = OnBackend {
                device,
                name: format!(
                    "{REF0_NAME} (reference device, {:.0} MiB)",
                    budget as f64 / (1u64 << 20) as f64
                ),
                backend: REF0_NAME,
                gpu_info: "reference device".into(),
            };
            loaded(gguf, Ref0::with_budget(budget), on, &dev_cfg)
                .map_err(|e| EngineError::Ref0(Box::new(e)))
        }
    }
}

/// The device a model is loaded on, as reports name it.
struct OnBackend {
    /// The device.
    device: EngineDevice,
    /// Its name in the notes (`CUDA0 (NVIDIA H100)`).
    name: String,
    /// Its backend ([`EngineUsed::backend`]).
    backend: &'static str,
    /// [`EngineUsed::gpu_info`].
    gpu_info: String,
}

/// What a device executor is loaded with.
struct Loading<'a> {
    /// Where the experts go.
    placement: &'a ExpertPlacement,
    /// The device expert cache.
    moe_cache: MoeCacheBudget,
    /// Bytes of the op-offload ring (`None`: the executor's largest).
    ring: Option<u64>,
}

/// [`DeviceModel::load`] on `dev` and the report of it.
fn loaded<B: Backend + 'static>(
    gguf: GgufModel,
    dev: B,
    on: OnBackend,
    cfg: &Loading<'_>,
) -> Result<OnDevice, EngineError> {
    let (placement, moe_cache) = (cfg.placement, cfg.moe_cache);
    let arch = (gguf.metadata().architecture())
        .unwrap_or_default()
        .to_string();
    let has_experts = gguf.tensors().iter().any(|t| t.name.contains("_exps"));
    let model = DeviceModel::load(gguf, dev, placement)?;
    model.set_op_offload_ring(cfg.ring);
    let n_layer = placement.layers.len();
    let experts = match has_experts {
        true => format!(
            "experts of {} on the device, {} on the CPU",
            placement.device_layers(),
            n_layer - placement.device_layers()
        ),
        false => "no experts".into(),
    };
    let name = &on.name;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let mut notes = vec![format!(
        "{arch} on {name}: dense part of {n_layer} layers on the device, {experts}; {:.1} MiB \
         of weights on the device",
        mib(model.weight_bytes())
    )];
    let set = match moe_cache {
        MoeCacheBudget::Off => None,
        MoeCacheBudget::Explicit(b) => Some(model.set_moe_cache(b)?),
        MoeCacheBudget::Default(b) => match model.set_moe_cache(b) {
            Ok(s) => Some(s),
            Err(e) => {
                notes.push(format!("no expert cache: {e}"));
                None
            }
        },
    };
    if let Some(s) = set {
        notes.push(format!(
            "expert cache on {name}: {:.1} MiB, up to {} experts of the CPU layers",
            mib(s.budget_bytes),
            s.capacity
        ));
    }
    let used = EngineUsed {
        backend: on.backend,
        device: device_name(on.device),
        gpu_info: on.gpu_info,
        n_gpu_layers: n_layer,
    };
    Ok((Box::new(model), used, notes))
}
