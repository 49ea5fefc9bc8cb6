//! Flags shared by the commands that load a model, and the loading itself.

use anyhow::{bail, Context};
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{KvType, LanguageModel};

use crate::placement_args::PlacementArgs;

/// How to load the model and size its context.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model file (for a split model, any of its shards).
    #[arg(short = 'm', long = "model")]
    pub model: std::path::PathBuf,
    /// Threads for computation (default: physical cores).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Read the file into memory instead of mapping it.
    #[arg(long = "no-mmap")]
    pub no_mmap: bool,
    /// Lock the weights in RAM.
    #[arg(long = "mlock")]
    pub mlock: bool,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

impl ModelArgs {
    /// The KV cache type from `-ctk/-ctv`.
    pub fn kv_type(&self) -> anyhow::Result<KvType> {
        let a = &self.placement.args;
        let k = KvType::parse(&a.cache_type_k)
            .with_context(|| format!("unsupported K cache type '{}' (f32, f16)", a.cache_type_k))?;
        let v = KvType::parse(&a.cache_type_v)
            .with_context(|| format!("unsupported V cache type '{}' (f32, f16)", a.cache_type_v))?;
        if k != v {
            bail!("different K and V cache types are not supported yet");
        }
        Ok(k)
    }

    /// Sets up the global thread pool and loads the model.
    pub fn load(&self) -> anyhow::Result<Box<dyn LanguageModel>> {
        let threads = self.threads.unwrap_or_else(physical_cores).max(1);
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
            .context("starting the thread pool")?;
        let opts = LoadOptions {
            use_mmap: !self.no_mmap,
            mlock: self.mlock,
        };
        let gguf = GgufModel::open(&self.model, opts)
            .with_context(|| format!("loading {}", self.model.display()))?;
        Ok(hmoe_model::load(gguf)?)
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

    /// Checks the placement flags (an unknown device or a bad regex is an error even on a
    /// CPU-only run) and says where tensors go: this build computes everything on the CPU.
    pub fn check_placement(&self) -> anyhow::Result<()> {
        self.placement.to_flags()?;
        if !self.placement.args.gpu_mem.is_empty() || self.placement.args.n_gpu_layers != "auto" {
            tracing::warn!("no GPU backend in this build: every tensor stays on the CPU");
        }
        Ok(())
    }
}

/// Physical cores (hyper-threads share execution units, so llama.cpp defaults to these).
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return logical;
    };
    let mut cores = std::collections::HashSet::new();
    let mut physical = "";
    for line in info.lines() {
        if let Some((key, value)) = line.split_once(':') {
            match key.trim() {
                "physical id" => physical = value.trim(),
                "core id" => {
                    cores.insert((physical.to_string(), value.trim().to_string()));
                }
                _ => {}
            }
        }
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}

/// Parses `1,2,3` into token ids.
pub fn parse_ids(s: &str) -> anyhow::Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().with_context(|| format!("bad token id '{p}'")))
        .collect()
}
