//! Flags shared by the commands that load a model, and their conversion into the engine's
//! configuration.

use anyhow::Context;
use hmoe_engine::{EngineConfig, EngineUsed, Probed};
use hmoe_gguf::LoadOptions;
use hmoe_model::kv_cache::{CacheType, FlashAttn};
use hmoe_model::{KvType, LanguageModel};

use crate::placement_args::PlacementArgs;

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

/// The KV cache types of `-ctk k -ctv v` and the attention mode of `-fa flash_attn`.
pub fn kv_type(k: &str, v: &str, flash_attn: &str) -> anyhow::Result<KvType> {
    let types = CacheType::ALL.map(CacheType::name).join(", ");
    let cache = |s: &str, which: &str| {
        CacheType::parse(s)
            .with_context(|| format!("unsupported {which} cache type '{s}' ({types})"))
    };
    let (k, v) = (cache(k, "K")?, cache(v, "V")?);
    let fa = FlashAttn::parse(flash_attn).with_context(|| {
        format!("unknown value for --flash-attn: '{flash_attn}' (on, off, auto)")
    })?;
    KvType::new(k, v, fa).map_err(|e| anyhow::anyhow!("{e}: use -fa on (or auto), or -ctv f16"))
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

impl ModelArgs {
    /// The KV cache types from `-ctk/-ctv` and the attention mode from `-fa`.
    pub fn kv_type(&self) -> anyhow::Result<KvType> {
        let a = &self.placement.args;
        kv_type(&a.cache_type_k, &a.cache_type_v, &self.flash_attn)
    }

    /// Starts the thread pools and loads the model where [`hmoe_engine::load`] chooses (the
    /// device executor on a GPU when the model, the K/V types and the plan allow it, else on
    /// the CPU, saying why once), and says on stderr what the load did.
    pub fn load(&self) -> anyhow::Result<Box<dyn LanguageModel>> {
        let threads = self.threads.unwrap_or_else(physical_cores);
        hmoe_engine::start_threads(threads, self.interleaves_experts())?;
        let total = std::fs::metadata(&self.model).map_or(0, |m| m.len());
        let progress = LoadProgress::start(self.model.display().to_string(), total);
        let loaded = hmoe_engine::load(&self.engine_config()?);
        drop(progress);
        let loaded = loaded?;
        for note in &loaded.notes {
            eprintln!("hmoe: {note}");
        }
        if let Some(used) = loaded.used {
            let _ = self.engine.set(used);
        }
        Ok(loaded.model)
    }

    /// The engine's configuration from these flags.
    pub fn engine_config(&self) -> anyhow::Result<EngineConfig> {
        let load = LoadOptions {
            use_mmap: !self.no_mmap,
            mlock: self.mlock,
            populate: self.populate,
        };
        let kv = self.kv_type()?;
        self.placement.engine_config(self.model.clone(), load, kv)
    }

    /// Whether the CPU device may interleave MXFP4 expert rows
    /// ([`hmoe_engine::interleaves_experts`]).
    pub fn interleaves_experts(&self) -> bool {
        hmoe_engine::interleaves_experts(self.no_repack, self.no_mmap, self.mlock)
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

/// A line on a terminal that says how a model load is going, updated in place every quarter
/// second: the bytes the process has brought into memory since the load began (the file's
/// pages read or copied: `VmRSS` growth) against the model's size, and the seconds so far. It
/// shows only when stderr is a terminal, only after half a second (a fast load prints nothing),
/// and is erased when the load ends (dropped). `HMOE_PROGRESS_MS=N` (for the tests) writes it
/// at once and updates it every N ms.
pub struct LoadProgress {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LoadProgress {
    /// Starts the line for loading `what` (`total` bytes), when stderr is a terminal.
    pub fn start(what: String, total: u64) -> LoadProgress {
        use std::io::IsTerminal;
        if !std::io::stderr().is_terminal() || total == 0 {
            return LoadProgress {
                stop: None,
                thread: None,
            };
        }
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let start = std::time::Instant::now();
        let base = resident_bytes().unwrap_or(0);
        let (tick, after) = match std::env::var("HMOE_PROGRESS_MS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            Some(ms) => (ms, 0),
            None => (250, 500),
        };
        // With no delay (the tests), the first line is written before the load can end.
        let shown_at_start = after == 0;
        if shown_at_start {
            eprint!(
                "\r\x1b[2K{}",
                progress_line(&what, 0, total, start.elapsed())
            );
        }
        let thread = std::thread::Builder::new()
            .name("hmoe-progress".into())
            .spawn(move || {
                let mut shown = shown_at_start;
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    rx.recv_timeout(std::time::Duration::from_millis(tick))
                {
                    if start.elapsed().as_millis() < after {
                        continue;
                    }
                    let done = resident_bytes().unwrap_or(base).saturating_sub(base);
                    eprint!(
                        "\r\x1b[2K{}",
                        progress_line(&what, done, total, start.elapsed())
                    );
                    shown = true;
                }
                if shown {
                    eprint!("\r\x1b[2K");
                }
            })
            .ok();
        LoadProgress {
            stop: thread.as_ref().map(|_| tx),
            thread,
        }
    }
}

impl Drop for LoadProgress {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `loading FILE: 42% of 12345 MiB in memory, 7 s`.
pub fn progress_line(what: &str, done: u64, total: u64, elapsed: std::time::Duration) -> String {
    let pct = (done as f64 * 100.0 / total.max(1) as f64).min(100.0);
    format!(
        "loading {what}: {pct:.0}% of {} MiB in memory, {} s",
        total >> 20,
        elapsed.as_secs()
    )
}

/// The process's resident memory in bytes (`VmRSS` of /proc/self/status).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb << 10)
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
    fn load_progress_line() {
        let l = super::progress_line(
            "m.gguf",
            3 << 29,
            6 << 30,
            std::time::Duration::from_secs(7),
        );
        assert_eq!(l, "loading m.gguf: 25% of 6144 MiB in memory, 7 s");
        // Memory beyond the file's size (buffers, copies) never shows more than 100%.
        let l = super::progress_line("m", 9 << 30, 6 << 30, std::time::Duration::ZERO);
        assert!(l.contains(" 100% of"), "{l}");
        // Not a terminal (as under cargo test): nothing starts.
        let p = super::LoadProgress::start("m".into(), 1 << 30);
        assert!(p.thread.is_none());
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
