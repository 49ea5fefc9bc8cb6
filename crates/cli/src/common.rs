//! Flags shared by the commands that load a model, and the loading itself.

use anyhow::{bail, Context};
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{KvType, LanguageModel};

/// How to load the model and size its context.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model file (for a split model, any of its shards).
    #[arg(short = 'm', long = "model")]
    pub model: std::path::PathBuf,
    /// Threads for computation (default: physical cores).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Context size in tokens; 0 = the model's trained context.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Logical batch size (tokens handed to the model at once).
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048)]
    pub batch_size: usize,
    /// Physical batch size (tokens computed together).
    #[arg(long = "ubatch-size", default_value_t = 512)]
    pub ubatch_size: usize,
    /// KV cache type for K: f32 or f16.
    #[arg(long = "cache-type-k", default_value = "f16")]
    pub cache_type_k: String,
    /// KV cache type for V: f32 or f16.
    #[arg(long = "cache-type-v", default_value = "f16")]
    pub cache_type_v: String,
    /// Read the file into memory instead of mapping it.
    #[arg(long = "no-mmap")]
    pub no_mmap: bool,
    /// Lock the weights in RAM.
    #[arg(long = "mlock")]
    pub mlock: bool,
}

impl ModelArgs {
    /// The KV cache type from `-ctk/-ctv`.
    pub fn kv_type(&self) -> anyhow::Result<KvType> {
        let k = KvType::parse(&self.cache_type_k)
            .with_context(|| format!("unsupported K cache type '{}' (f32, f16)", self.cache_type_k))?;
        let v = KvType::parse(&self.cache_type_v)
            .with_context(|| format!("unsupported V cache type '{}' (f32, f16)", self.cache_type_v))?;
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

    /// The context size, resolving 0 to the model's trained context.
    pub fn n_ctx(&self, model: &dyn LanguageModel) -> usize {
        if self.ctx_size == 0 {
            model.n_ctx_train()
        } else {
            self.ctx_size
        }
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
