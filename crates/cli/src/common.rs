//! Flags shared by the commands that load a model, and the loading itself.

use anyhow::Context;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::kv_cache::{CacheType, FlashAttn};
use hmoe_model::{KvType, LanguageModel};

use hmoe_placement::{plan, DeviceId, ModelShape, Plan, TensorDesc};

use crate::engine_select::{
    choose_engine, gpu_executor_arch, load_device, plan_error, plan_flags, EngineChoice,
    EngineDevice, EngineInputs, MoeCacheBudget,
};
use crate::placement_args::{PlacementArgs, Probed, Selected};

/// Physical cores, the default of `-t` (as llama.cpp's).
pub use hmoe_pool::physical_cores;

/// `-t N`: a thread count of at most [`hmoe_pool::MAX_THREADS`] (llama.cpp's bound), so that a
/// typo such as `-t 100000` is an error instead of a hundred thousand threads.
pub fn parse_threads(s: &str) -> Result<usize, String> {
    let n: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a thread count"))?;
    check_threads(n)
}

/// The bound of [`parse_threads`] on an already parsed count.
pub fn check_threads(n: usize) -> Result<usize, String> {
    if n > hmoe_pool::MAX_THREADS {
        return Err(format!(
            "{n} threads is more than the {} allowed",
            hmoe_pool::MAX_THREADS
        ));
    }
    Ok(n)
}

/// Whether the CPU device may interleave MXFP4 expert rows for its kernel (without `-nr`):
/// never beside a heap buffer (--no-mmap) or locked pages (--mlock), which would then hold the
/// experts twice; a mapping's copied pages are given back.
pub fn interleaves_experts(no_repack: bool, no_mmap: bool, mlock: bool) -> bool {
    !(no_repack || no_mmap || mlock)
}

/// How to load the model and size its context.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model file (for a split model, any of its shards).
    #[arg(short = 'm', long = "model")]
    pub model: std::path::PathBuf,
    /// Threads for computation (default: physical cores; at most 512).
    #[arg(short = 't', long = "threads", value_parser = parse_threads)]
    pub threads: Option<usize>,
    /// Read the file into memory instead of mapping it.
    #[arg(long = "no-mmap")]
    pub no_mmap: bool,
    /// Lock the weights in RAM.
    #[arg(long = "mlock")]
    pub mlock: bool,
    /// Keep expert weights as the file has them (`-nr`, llama.cpp's flag): by default MXFP4
    /// experts are copied with their rows interleaved for the CPU's kernel where it has one
    /// (AVX-512 or AVX2) and the copy fits in the available memory (same results, faster
    /// products); never with --no-mmap or --mlock, whose buffers would then hold the experts
    /// twice.
    #[arg(long = "no-repack")]
    pub no_repack: bool,
    /// Flash attention (`-fa`): on, off or auto (= on, as llama.cpp resolves it on the CPU).
    /// A bare `-fa` means on. A quantized V cache (`-ctv q8_0`) requires it.
    #[arg(long = "flash-attn", value_name = "on|off|auto", num_args = 0..=1,
          default_missing_value = "on", default_value = "auto")]
    pub flash_attn: String,
    #[command(flatten)]
    pub placement: PlacementArgs,
    /// Fault the mapped file in at load (set by `hmoe bench`, see [`LoadOptions::populate`]).
    #[arg(skip)]
    pub populate: bool,
    /// The engine [`ModelArgs::load`] chose (set once it has loaded the model).
    #[arg(skip)]
    pub engine: std::sync::OnceLock<EngineUsed>,
}

/// The engine a model was loaded on, for reports (`hmoe bench`'s backend columns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineUsed {
    /// `CUDA`, `REF0` or `CPU`, as llama-bench's `backends`.
    pub backend: &'static str,
    /// The GPU's name (empty on the CPU).
    pub gpu_info: String,
    /// Layers whose dense part runs on the GPU.
    pub n_gpu_layers: usize,
}

impl Default for EngineUsed {
    fn default() -> Self {
        EngineUsed {
            backend: "CPU",
            gpu_info: String::new(),
            n_gpu_layers: 0,
        }
    }
}

impl ModelArgs {
    /// The KV cache types from `-ctk/-ctv` and the attention mode from `-fa`.
    pub fn kv_type(&self) -> anyhow::Result<KvType> {
        let a = &self.placement.args;
        let types = "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1";
        let k = CacheType::parse(&a.cache_type_k)
            .with_context(|| format!("unsupported K cache type '{}' ({types})", a.cache_type_k))?;
        let v = CacheType::parse(&a.cache_type_v)
            .with_context(|| format!("unsupported V cache type '{}' ({types})", a.cache_type_v))?;
        let fa = FlashAttn::parse(&self.flash_attn).with_context(|| {
            format!(
                "unknown value for --flash-attn: '{}' (on, off, auto)",
                self.flash_attn
            )
        })?;
        KvType::new(k, v, fa).map_err(|e| anyhow::anyhow!("{e}: use -fa on (or auto), or -ctv f16"))
    }

    /// Sets up the global thread pool and loads the model: on the GPU executor when
    /// [`crate::engine_select::choose_engine`] picks it (a GPU, gpt-oss, K/V types the device
    /// keeps, and a plan with every layer's dense part on one GPU), else on the CPU engine,
    /// saying why once.
    pub fn load(&self) -> anyhow::Result<Box<dyn LanguageModel>> {
        self.start_pools()?;
        let gguf = self.open()?;
        let planned = plan_engine(&self.placement, self.kv_type()?, &gguf)?;
        let loaded = load_chosen(
            gguf,
            planned.choice,
            planned.moe_cache,
            || self.open(),
            self.placement.asks_for_gpu(),
        )?;
        if let Some(used) = loaded.used {
            let _ = self.engine.set(used);
        }
        Ok(loaded.model)
    }

    /// Whether the CPU device may interleave MXFP4 expert rows ([`interleaves_experts`]).
    pub fn interleaves_experts(&self) -> bool {
        interleaves_experts(self.no_repack, self.no_mmap, self.mlock)
    }

    /// Starts the global thread pools with `-t` threads (the physical cores by default).
    fn start_pools(&self) -> anyhow::Result<()> {
        let threads = self.threads.unwrap_or_else(physical_cores).max(1);
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
            .context("starting the thread pool")?;
        hmoe_pool::init_global(threads).context("starting the per-token thread pool")?;
        hmoe_cpu::set_expert_interleaving(self.interleaves_experts());
        Ok(())
    }

    fn open(&self) -> anyhow::Result<GgufModel> {
        let opts = LoadOptions {
            use_mmap: !self.no_mmap,
            mlock: self.mlock,
            populate: self.populate,
        };
        GgufModel::open(&self.model, opts)
            .with_context(|| format!("loading {}", self.model.display()))
    }

    /// The context size: `-c N`, or the model's trained context for `-c 0` or no `-c`.
    pub fn n_ctx(&self, model: &dyn LanguageModel) -> usize {
        match self.placement.args.ctx_size {
            Some(n) if n > 0 => n as usize,
            _ => model.n_ctx_train(),
        }
    }

    /// Tokens computed together: `-ub`, at most `-b`.
    pub fn n_ubatch(&self) -> usize {
        let a = &self.placement.args;
        a.ubatch_size.min(a.batch_size).max(1) as usize
    }

    /// Checks the placement flags: an unknown device or a bad regex is an error even on a
    /// CPU-only run.
    pub fn check_placement(&self) -> anyhow::Result<()> {
        self.placement.to_flags()?;
        if self.placement.args.device.is_some() {
            let probed = Probed::now();
            self.placement.selected_devices(&probed)?;
        }
        Ok(())
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
}

/// Probes the GPUs and, for an architecture with a GPU executor, plans the placement of
/// `gguf` under `placement` with the K/V cache `kv`; then [`choose_engine`]. A plan that does
/// not fit is an error naming each device and what it lacks ([`plan_error`]).
pub fn plan_engine(
    placement: &PlacementArgs,
    kv: KvType,
    gguf: &GgufModel,
) -> anyhow::Result<PlannedEngine> {
    let probed = Probed::now();
    let selected = placement
        .selected_devices(&probed)?
        .unwrap_or_else(|| (0..probed.gpus.len()).map(Selected::Cuda).collect());
    let budget = placement.gpu_budget_with(&probed)?;
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
    let mut n_layer = 0;
    let mut made = None;
    if !devices.is_empty() && gpu_executor_arch(arch) {
        let shape = ModelShape::from_metadata(gguf.metadata())?;
        let tensors: Vec<TensorDesc> = gguf.tensors().iter().map(TensorDesc::from).collect();
        let flags = plan_flags(placement.to_flags()?, &names);
        let p = plan(&tensors, &shape, &budget, &flags).map_err(|e| plan_error(e, &names))?;
        n_layer = shape.n_layer as usize;
        planned = gguf
            .tensors()
            .iter()
            .map(|t| t.name.as_str())
            .zip(p.tensor_devices.iter().copied())
            .collect();
        made = Some(p);
    }
    let choice = choose_engine(&EngineInputs {
        devices: &devices,
        why_no_gpu: probed.why_none.as_deref(),
        arch,
        kv,
        n_layer,
        tensors: &planned,
        op_offload: placement.op_offload(),
    });
    let expert_placement = match &choice {
        EngineChoice::Device { placement, .. } => Some(placement),
        EngineChoice::Cpu { .. } => None,
    };
    let room = (made.as_ref())
        .and_then(|p| p.device(DeviceId::Gpu(0)))
        .map_or(0, |u| u.room_beyond_margin());
    let moe_cache = MoeCacheBudget::choose(placement.args.moe_cache, expert_placement, room);
    Ok(PlannedEngine {
        choice,
        plan: made,
        names,
        moe_cache,
    })
}

/// What [`load_chosen`] loaded.
pub struct LoadedEngine {
    /// The model.
    pub model: Box<dyn LanguageModel>,
    /// The device it runs on (`None`: the CPU engine).
    pub used: Option<EngineUsed>,
    /// Why the CPU engine runs it (`None` on a device).
    pub why_cpu: Option<String>,
}

/// Loads `gguf` on the engine of `choice`: the device executor, or the CPU engine with the
/// reason logged (a warning when `asks_for_gpu`). A CUDA device that fails to load falls back
/// to the CPU engine over a file opened again by `reopen`; a failure on the reference device
/// is the answer.
pub fn load_chosen(
    gguf: GgufModel,
    choice: EngineChoice,
    moe_cache: MoeCacheBudget,
    reopen: impl FnOnce() -> anyhow::Result<GgufModel>,
    asks_for_gpu: bool,
) -> anyhow::Result<LoadedEngine> {
    let why = match choice {
        EngineChoice::Device { device, placement } => {
            match load_device(gguf, device, &placement, moe_cache) {
                Ok((model, used)) => {
                    return Ok(LoadedEngine {
                        model,
                        used: Some(used),
                        why_cpu: None,
                    })
                }
                // The reference device is for testing: a failure there is the answer.
                Err(e) if matches!(device, EngineDevice::Ref0 { .. }) => return Err(e),
                Err(e) => {
                    tracing::warn!("GPU executor failed to load ({e:#}); running on the CPU");
                    let model = hmoe_model::load(reopen()?)?;
                    return Ok(LoadedEngine {
                        model,
                        used: None,
                        why_cpu: Some(format!("the GPU executor failed to load ({e:#})")),
                    });
                }
            }
        }
        EngineChoice::Cpu { why } => why,
    };
    if asks_for_gpu {
        tracing::warn!("running on the CPU: {why}");
    } else {
        tracing::info!("running on the CPU: {why}");
    }
    Ok(LoadedEngine {
        model: hmoe_model::load(gguf)?,
        used: None,
        why_cpu: Some(why),
    })
}

/// Parses `1,2,3` into token ids.
pub fn parse_ids(s: &str) -> anyhow::Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<u32>()
                .with_context(|| format!("bad token id '{p}'"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use hmoe_model::kv_cache::CacheType;

    use super::ModelArgs;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        model: ModelArgs,
    }

    fn kv(args: &[&str]) -> anyhow::Result<hmoe_model::KvType> {
        let argv = ["hmoe", "-m", "x.gguf"].iter().chain(args).copied();
        Cli::try_parse_from(argv).unwrap().model.kv_type()
    }

    #[test]
    fn cache_types_and_flash_attention() {
        let default = kv(&[]).unwrap();
        assert_eq!(
            (default.k(), default.v(), default.flash_attn()),
            (CacheType::F16, CacheType::F16, true)
        );
        let t = kv(&[
            "--cache-type-k",
            "q8_0",
            "--cache-type-v",
            "q4_0",
            "--flash-attn",
            "on",
        ])
        .unwrap();
        assert_eq!(
            (t.k(), t.v(), t.flash_attn()),
            (CacheType::Q8_0, CacheType::Q4_0, true)
        );
        assert!(
            kv(&["--flash-attn"]).unwrap().flash_attn(),
            "a bare -fa means on"
        );
        assert!(!kv(&["--flash-attn", "off"]).unwrap().flash_attn());
        assert!(
            kv(&["--cache-type-k", "q8_0", "--flash-attn", "off"]).is_ok(),
            "a quantized K alone works without"
        );
        let err = kv(&["--cache-type-v", "q8_0", "--flash-attn", "off"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("requires flash attention"), "{err}");
        assert!(kv(&["--cache-type-k", "q4_k"]).is_err());
        assert!(kv(&["--flash-attn", "sometimes"]).is_err());
    }
}
