//! `hmoe serve`: the OpenAI-compatible server, with llama-server's flags.

use std::path::PathBuf;

use anyhow::{bail, Context};
use hmoe_chat::ReasoningFormat;
use hmoe_gguf::LoadOptions;
use hmoe_model::kv_cache::{CacheType, FlashAttn};
use hmoe_model::KvType;
use hmoe_server::{ModelSource, RunningServer, ServerConfig};

use crate::common::physical_cores;
use crate::placement_args::PlacementArgs;

/// Arguments of `hmoe serve` (llama-server's spelling).
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Model file (for a split model, any shard). Leave out with --models-dir.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Router mode: serve every GGUF in this directory, loading each on first use.
    #[arg(long = "models-dir", value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
    /// Router mode: most models loaded at once (0 = no limit); the least recently used idle
    /// one is unloaded to make room.
    #[arg(long = "models-max", value_name = "N", default_value_t = 4)]
    pub models_max: usize,
    /// Address to listen on.
    #[arg(long = "host", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port, printed at start).
    #[arg(long = "port", default_value_t = 8080)]
    pub port: u16,
    /// API key clients must send (`Authorization: Bearer KEY` or `X-Api-Key: KEY`); repeatable,
    /// or several separated by commas.
    #[arg(long = "api-key", value_name = "KEY", value_delimiter = ',')]
    pub api_key: Vec<String>,
    /// File with one API key per line.
    #[arg(long = "api-key-file", value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Names the model answers to in the `model` field (comma separated); the first is listed.
    #[arg(short = 'a', long = "alias", value_delimiter = ',')]
    pub alias: Vec<String>,
    /// Threads for computation (default, or any negative value: physical cores).
    #[arg(short = 't', long = "threads", allow_negative_numbers = true)]
    pub threads: Option<i64>,
    /// Read the file into memory instead of mapping it.
    #[arg(long = "no-mmap")]
    pub no_mmap: bool,
    /// Lock the weights in RAM.
    #[arg(long = "mlock")]
    pub mlock: bool,
    /// Use the Jinja chat template (always on; accepted for llama-server compatibility).
    #[arg(long = "jinja")]
    pub jinja: bool,
    /// Accepted for compatibility; the Jinja template is used anyway.
    #[arg(long = "no-jinja")]
    pub no_jinja: bool,
    /// Jinja chat template file replacing the model's.
    #[arg(long = "chat-template-file", value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// Jinja chat template text replacing the model's.
    #[arg(long = "chat-template", value_name = "JINJA")]
    pub chat_template: Option<String>,
    /// Extra template variables as a JSON object, e.g. '{"reasoning_effort": "high"}'.
    #[arg(long = "chat-template-kwargs", value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
    /// Where reasoning goes: none (left in content), auto or deepseek (reasoning_content).
    #[arg(long = "reasoning-format", value_parser = ["none", "auto", "deepseek", "deepseek-legacy"], default_value = "auto")]
    pub reasoning_format: String,
    /// Serve Prometheus metrics on /metrics.
    #[arg(long = "metrics")]
    pub metrics: bool,
    /// Serve /slots (the default; accepted for compatibility).
    #[arg(long = "slots")]
    pub slots: bool,
    /// Do not serve /slots.
    #[arg(long = "no-slots")]
    pub no_slots: bool,
    /// Flash attention (`-fa` = on, `-fa on|off|auto`); auto is on, as llama.cpp resolves it on
    /// the CPU. A quantized V cache needs it.
    #[arg(long = "flash-attn", value_name = "on|off|auto", num_args = 0..=1, default_missing_value = "on",
          default_value = "auto", allow_negative_numbers = true)]
    pub flash_attn: String,
    /// Continuous batching (always on; accepted for compatibility).
    #[arg(long = "cont-batching")]
    pub cont_batching: bool,
    /// Accepted for compatibility (slots have separate caches of `-c / -np` positions each).
    #[arg(long = "kv-unified")]
    pub kv_unified: bool,
    /// Accepted for compatibility.
    #[arg(long = "no-kv-unified")]
    pub no_kv_unified: bool,
    /// Accepted for compatibility (prompt prefixes are reused per slot).
    #[arg(long = "cache-reuse", value_name = "N")]
    pub cache_reuse: Option<usize>,
    /// Accepted for compatibility (computation uses -t threads).
    #[arg(
        long = "threads-batch",
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub threads_batch: Option<i64>,
    /// Accepted for compatibility (no read/write timeout is applied).
    #[arg(long = "timeout", value_name = "SECONDS")]
    pub timeout: Option<u64>,
    /// Accepted for compatibility (there is no web UI).
    #[arg(long = "no-webui")]
    pub no_webui: bool,
    /// Download a model from Hugging Face (`-hf`): not supported, an error that says so.
    #[arg(long = "hf-repo", value_name = "REPO")]
    pub hf_repo: Option<String>,
    /// A request goes to the slot whose cached prompt shares the longest prefix with it when
    /// that is more than this fraction of the prompt (0: the least recently used slot).
    #[arg(
        long = "slot-prompt-similarity",
        value_name = "F",
        default_value_t = 0.1
    )]
    pub slot_prompt_similarity: f32,
    /// Requests that may wait for a free slot; beyond that the server answers 503.
    #[arg(long = "max-queue", value_name = "N", default_value_t = 256)]
    pub max_queue: usize,
    /// Default temperature (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Default top-k (0 = off).
    #[arg(long = "top-k", default_value_t = 40.0)]
    pub top_k: f64,
    /// Default top-p (1 = off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Default min-p (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Default repetition penalty (1 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Default seed (-1 = a random seed per request).
    #[arg(short = 's', long = "seed", default_value_t = -1, allow_negative_numbers = true)]
    pub seed: i64,
    /// Default number of tokens to generate (-1 = until the context is full).
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

impl ServeArgs {
    /// The server configuration these flags describe.
    pub fn config(&self) -> anyhow::Result<ServerConfig> {
        if let Some(repo) = &self.hf_repo {
            bail!("hmoe does not download models ({repo}): download the GGUF file(s) and pass -m FILE");
        }
        let models = match (&self.model, &self.models_dir) {
            (Some(m), None) => ModelSource::File(m.clone()),
            (None, Some(d)) => ModelSource::Dir(d.clone()),
            (Some(_), Some(_)) => bail!("give either -m MODEL or --models-dir DIR, not both"),
            (None, None) => {
                bail!("give a model with -m MODEL, or a directory of models with --models-dir DIR")
            }
        };
        self.placement.to_flags()?;
        let a = &self.placement.args;
        if !a.gpu_mem.is_empty() || !matches!(a.n_gpu_layers.as_str(), "auto" | "0") {
            tracing::warn!(
                "the server runs on the CPU engine (the GPU executor serves hmoe run, bench, chat \
                 and perplexity, one sequence at a time)"
            );
        }
        let types = "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1";
        let cache = |s: &str, which: &str| {
            CacheType::parse(s)
                .with_context(|| format!("unsupported {which} cache type '{s}' ({types})"))
        };
        let (k, v) = (cache(&a.cache_type_k, "K")?, cache(&a.cache_type_v, "V")?);
        let fa = FlashAttn::parse(&self.flash_attn).with_context(|| {
            format!(
                "unknown value for --flash-attn: '{}' (on, off, auto)",
                self.flash_attn
            )
        })?;
        let kv_type = KvType::new(k, v, fa)
            .map_err(|e| anyhow::anyhow!("{e}: use -fa on (or auto), or -ctv f16"))?;
        let mut config = ServerConfig::new(models);
        config.host = self.host.clone();
        config.port = self.port;
        config.alias = self
            .alias
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect();
        config.api_keys = self
            .api_key
            .iter()
            .filter(|k| !k.is_empty())
            .cloned()
            .collect();
        if config.api_keys.is_empty() {
            // llama-server reads its key from LLAMA_API_KEY too.
            if let Ok(k) = std::env::var("LLAMA_API_KEY") {
                config.api_keys.extend(
                    k.split(',')
                        .map(str::trim)
                        .filter(|k| !k.is_empty())
                        .map(String::from),
                );
            }
        }
        if let Some(f) = &self.api_key_file {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            config.api_keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(String::from),
            );
        }
        config.engine.n_parallel = a.parallel.max(1) as usize;
        config.engine.n_ctx = a.ctx_size.unwrap_or(0) as usize;
        config.engine.n_ubatch = a.ubatch_size.min(a.batch_size).max(1) as usize;
        config.engine.kv_type = kv_type;
        config.engine.max_queue = self.max_queue;
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.slot_prompt_similarity),
            "--slot-prompt-similarity must be between 0 and 1, got {}",
            self.slot_prompt_similarity
        );
        config.engine.slot_prompt_similarity = self.slot_prompt_similarity;
        config.engine.load = LoadOptions {
            use_mmap: !self.no_mmap,
            mlock: self.mlock,
            populate: false,
        };
        config.chat.template = match (&self.chat_template_file, &self.chat_template) {
            (Some(f), _) => Some(
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
            ),
            (None, Some(t)) => Some(t.clone()),
            (None, None) => None,
        };
        config.chat.reasoning_format = match self.reasoning_format.as_str() {
            "none" => ReasoningFormat::None,
            "auto" => ReasoningFormat::Auto,
            _ => ReasoningFormat::Deepseek,
        };
        if let Some(kw) = &self.chat_template_kwargs {
            match serde_json::from_str(kw)
                .context("--chat-template-kwargs must be a JSON object")?
            {
                serde_json::Value::Object(m) => config.chat.template_kwargs = m,
                _ => bail!("--chat-template-kwargs must be a JSON object"),
            }
        }
        let s = &mut config.sampling;
        s.params.temperature = self.temp;
        s.params.top_k = self.top_k.max(0.0) as usize;
        s.params.top_p = self.top_p;
        s.params.min_p = self.min_p;
        s.params.repeat_penalty = self.repeat_penalty;
        s.params.repeat_last_n = self.repeat_last_n;
        s.random_seed = self.seed < 0;
        s.params.seed = self.seed.max(0) as u64;
        s.n_predict = (self.n_predict >= 0).then_some(self.n_predict as usize);
        config.metrics = self.metrics;
        config.slots_endpoint = !self.no_slots;
        config.models_max = self.models_max;
        Ok(config)
    }
}

/// Runs `hmoe serve` until SIGINT/SIGTERM (or until the model fails to load).
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    let threads = match args.threads {
        Some(n) if n > 0 => n as usize,
        _ => physical_cores(),
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build_global()
        .context("starting the thread pool")?;
    hmoe_pool::init_global(threads.max(1)).context("starting the per-token thread pool")?;
    let server = RunningServer::start_with_signals(config)?;
    eprintln!("hmoe serve: listening on http://{}", server.local_addr());
    server.wait()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        s: ServeArgs,
    }

    fn parse(args: &[&str]) -> ServeArgs {
        T::try_parse_from(std::iter::once("hmoe").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
            .s
    }

    #[test]
    fn llama_server_command_lines_parse() {
        // As main.rs rewrites -ngl/-fa/-np/-ub before parsing.
        let a = parse(&[
            "-m",
            "m.gguf",
            "-c",
            "0",
            "--flash-attn",
            "--jinja",
            "--reasoning-format",
            "none",
            "--n-gpu-layers",
            "99",
            "--n-cpu-moe",
            "24",
            "--host",
            "0.0.0.0",
            "--port",
            "8081",
            "--ubatch-size",
            "2048",
            "-b",
            "2048",
            "--temp",
            "1.0",
            "--top-p",
            "1.0",
            "--top-k",
            "0",
            "--min-p",
            "0",
            "--threads",
            "-1",
            "--parallel",
            "4",
            "--api-key",
            "k1,k2",
            "--api-key",
            "k3",
            "--metrics",
        ]);
        let c = a.config().unwrap();
        assert_eq!(a.flash_attn, "on");
        assert_eq!(c.engine.n_ctx, 0);
        assert_eq!(c.engine.n_parallel, 4);
        assert_eq!(c.engine.n_ubatch, 2048);
        assert_eq!(c.api_keys, vec!["k1", "k2", "k3"]);
        assert_eq!(c.chat.reasoning_format, ReasoningFormat::None);
        assert_eq!(
            (c.sampling.params.top_k, c.sampling.params.temperature),
            (0, 1.0)
        );
        assert!(c.sampling.random_seed && c.metrics);
        assert_eq!(a.threads, Some(-1));
        assert_eq!(parse(&["-m", "x", "--flash-attn", "off"]).flash_attn, "off");
        assert_eq!(parse(&["-m", "x"]).flash_attn, "auto");
        assert!(c.engine.kv_type.flash_attn());
        let off = parse(&["-m", "x", "--flash-attn", "off"]).config().unwrap();
        assert!(!off.engine.kv_type.flash_attn());
        let q = parse(&[
            "-m",
            "x",
            "--cache-type-k",
            "q8_0",
            "--cache-type-v",
            "q4_0",
        ])
        .config()
        .unwrap();
        assert_eq!(
            (q.engine.kv_type.k(), q.engine.kv_type.v()),
            (CacheType::Q8_0, CacheType::Q4_0)
        );
        assert!(
            parse(&["-m", "x", "--cache-type-v", "q8_0", "--flash-attn", "off"])
                .config()
                .is_err()
        );
        assert!(parse(&["-m", "x", "--flash-attn", "sometimes"])
            .config()
            .is_err());
    }

    #[test]
    fn model_source_is_required_and_exclusive() {
        assert!(parse(&[]).config().is_err());
        assert!(parse(&["-m", "a", "--models-dir", "d"]).config().is_err());
        assert!(matches!(
            parse(&["--models-dir", "d"]).config().unwrap().models,
            ModelSource::Dir(_)
        ));
        assert!(parse(&[
            "-m",
            "a",
            "--cache-type-k",
            "bogus",
            "--cache-type-v",
            "bogus"
        ])
        .config()
        .is_err());
        assert!(parse(&["-m", "a", "--chat-template-kwargs", "[1]"])
            .config()
            .is_err());
    }
}
