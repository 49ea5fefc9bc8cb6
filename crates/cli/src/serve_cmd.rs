//! `hmoe serve`: the OpenAI-compatible server, with llama-server's flags.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use hmoe_chat::ReasoningFormat;
use hmoe_engine::Probed;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::KvType;
use hmoe_placement::Plan;
use hmoe_server::embeddings::Pooling;
use hmoe_server::{
    DevicePlacement, Limits, LoadedModel, ModelLoader, ModelSource, Placement, RunningServer,
    ServerConfig,
};

use crate::common::{check_threads, kv_type, physical_cores};
use crate::placement_args::{PlacementArgs, SERVE_DEFAULT_PARALLEL};

/// The bounds on what clients can make the server hold, for `hmoe serve --help`.
pub const LIMITS_HELP: &str = "\
Limits (every resource a client controls is bounded):
  threads            -t at most 512
  connections        --max-connections (512, lowered to fit the open-file limit); beyond it a
                     reserve that answers only /health, then the oldest reserve one is closed
  request headers    --header-timeout seconds (10), also the keep-alive idle time
  request body       64 MiB (413), sent within --timeout seconds (600; else 408)
  parsing bodies     bodies over 1 MiB share --parse-budget MiB (64) while parsed and held
                     (~40x their size in memory), smaller ones as much again; beyond it a
                     body waits, at most --timeout, then 503. Parsing, tokenizing and
                     template rendering run off the connection threads, so /health
                     answers whatever the bodies
  stopping           SIGINT/SIGTERM: generations stop at once, open responses get 1 s, the
                     process exits within about 2 s whatever the load
  response           a client that reads nothing for --timeout seconds is dropped (its
                     generation cancelled)
  queued requests    --max-queue per model (256; then 503); router mode waits at most
                     --timeout for a busy model, at most --max-queue requests at once
  prompt + output    the slot's context (-c / -np); n_predict stops there
  n_probs            at most 100
  stop strings       at most 64, each at most 1024 bytes
  grammars, schemas  1 MiB, 32768 rules, 20000 terminals, 20000 alternatives, groups
                     nested 30 deep (GBNF), 512 forced-call tools; compiled within 10 s on
                     a 256 MiB stack, as many at once as CPUs (at least 4); beyond any: 400
                     naming it
  /tokenize pieces   streamed, a few bytes per token";

/// Arguments of `hmoe serve` (llama-server's spelling).
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Model file (for a split model, any shard). Leave out with --models-dir.
    #[arg(help_heading = "Server", short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Router mode: serve every GGUF in this directory, loading each on first use.
    #[arg(help_heading = "Server", long = "models-dir", value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
    /// Router mode: most models loaded at once (0 = no limit); the least recently used idle
    /// one is unloaded to make room.
    #[arg(
        help_heading = "Server",
        long = "models-max",
        value_name = "N",
        default_value_t = 4
    )]
    pub models_max: usize,
    /// Router mode: per-model flags in llama-server's INI format (`[NAME]` sections, `[*]`
    /// for all, `n-cpu-moe = 12`); the command line's flags win, as in llama-server.
    #[arg(help_heading = "Server", long = "models-preset", value_name = "FILE")]
    pub models_preset: Option<PathBuf>,
    /// Router mode: a request for a model that is not loaded is a 400 instead of loading it
    /// (load models with `POST /models/load`).
    #[arg(help_heading = "Server", long = "no-models-autoload")]
    pub no_models_autoload: bool,
    /// Address to listen on.
    #[arg(help_heading = "Server", long = "host", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port, printed at start).
    #[arg(
        help_heading = "Server",
        long = "port",
        default_value_t = 8080,
        allow_negative_numbers = true
    )]
    pub port: u16,
    /// API key clients must send (`Authorization: Bearer KEY` or `X-Api-Key: KEY`); repeatable,
    /// or several separated by commas. An empty key is an error.
    #[arg(
        help_heading = "Server",
        long = "api-key",
        value_name = "KEY",
        value_delimiter = ','
    )]
    pub api_key: Vec<String>,
    /// File with one API key per line (blank lines and `#` comments are skipped, as in
    /// llama-server; a file with no key is an error).
    #[arg(help_heading = "Server", long = "api-key-file", value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// The model's names (comma separated), listed in /v1/models as its `aliases`; the
    /// alphabetically first is its id, as in llama-server.
    #[arg(
        help_heading = "Server",
        short = 'a',
        long = "alias",
        value_delimiter = ','
    )]
    pub alias: Vec<String>,
    /// The model's tags (comma separated), listed in /v1/models.
    #[arg(help_heading = "Server", long = "tags", value_delimiter = ',')]
    pub tags: Vec<String>,
    /// Threads for computation (default, or any negative value: physical cores; at most 512).
    #[arg(help_heading = "Loading", short = 't', long = "threads", allow_negative_numbers = true, value_parser = parse_threads_or_default)]
    pub threads: Option<i64>,
    /// Read the file into memory instead of mapping it.
    #[arg(help_heading = "Loading", long = "no-mmap")]
    pub no_mmap: bool,
    /// Lock the weights in RAM.
    #[arg(help_heading = "Loading", long = "mlock")]
    pub mlock: bool,
    /// How the file is loaded (`-lm`, llama.cpp's): mmap (the default), none or dio (read into
    /// memory, as --no-mmap), mlock (read and locked), mmap+mlock (mapped and locked, as
    /// --mlock).
    #[arg(help_heading = "Loading", long = "load-mode", value_name = "MODE",
          value_parser = ["none", "mmap", "mlock", "mmap+mlock", "dio"])]
    pub load_mode: Option<String>,
    /// Keep expert weights as the file has them (`-nr`, llama.cpp's flag): by default MXFP4
    /// experts are copied with their rows interleaved for the CPU's kernel where it has one
    /// (AVX-512 or AVX2) and the copy fits in the available memory (same results, faster
    /// products); never with --no-mmap or --mlock, whose buffers would then hold the experts
    /// twice.
    #[arg(help_heading = "Loading", long = "no-repack")]
    pub no_repack: bool,
    /// Jinja chat template file replacing the model's.
    #[arg(
        help_heading = "Chat templates and reasoning",
        long = "chat-template-file",
        value_name = "FILE"
    )]
    pub chat_template_file: Option<PathBuf>,
    /// Chat template replacing the model's: a built-in name (chatml, qwen3, llama3, gpt-oss,
    /// deepseek3, deepseek2, phi3, zephyr, gemma, mistral-v7, command-r) or Jinja text.
    #[arg(
        help_heading = "Chat templates and reasoning",
        long = "chat-template",
        value_name = "NAME|JINJA"
    )]
    pub chat_template: Option<String>,
    /// Extra template variables as a JSON object, e.g. '{"reasoning_effort": "high"}'.
    #[arg(
        help_heading = "Chat templates and reasoning",
        long = "chat-template-kwargs",
        value_name = "JSON"
    )]
    pub chat_template_kwargs: Option<String>,
    /// Thinking: on, off (the template is told `enable_thinking: false`) or auto (the model's
    /// default).
    #[arg(help_heading = "Chat templates and reasoning", long = "reasoning", value_parser = ["on", "off", "auto"], default_value = "auto")]
    pub reasoning: String,
    /// Thinking budget in tokens: -1 = unlimited, 0 = no thinking (as --reasoning off); a
    /// budget N > 0 is accepted with a note and thinking stays unlimited (hmoe does not cut it).
    #[arg(help_heading = "Chat templates and reasoning", long = "reasoning-budget", value_name = "N", default_value_t = -1, allow_negative_numbers = true)]
    pub reasoning_budget: i64,
    /// A conversation ending with an assistant message renders it as a closed turn; by
    /// default it is continued (the answer starts with its content), as llama-server does.
    #[arg(
        help_heading = "Chat templates and reasoning",
        long = "no-prefill-assistant"
    )]
    pub no_prefill_assistant: bool,
    /// Where reasoning goes: none (left in content); auto, deepseek or deepseek-legacy
    /// (reasoning_content). Requests may say `reasoning_format`.
    #[arg(help_heading = "Chat templates and reasoning", long = "reasoning-format", value_parser = ["none", "auto", "deepseek", "deepseek-legacy"], default_value = "auto")]
    pub reasoning_format: String,
    /// Serve Prometheus metrics on /metrics.
    #[arg(help_heading = "Server", long = "metrics")]
    pub metrics: bool,
    /// Serve embeddings: /embedding, /embeddings and /v1/embeddings (each token's final
    /// hidden state after the output norm, pooled as --pooling says).
    #[arg(help_heading = "Server", long = "embeddings")]
    pub embeddings: bool,
    /// How embeddings pool a prompt's token vectors: none (every token's; the native routes
    /// only), mean, cls (the first token's), last, rank (as --reranking). Default: the model's
    /// `pooling_type`, else none.
    #[arg(help_heading = "Server", long = "pooling", value_name = "TYPE",
          value_parser = ["none", "mean", "cls", "last", "rank"])]
    pub pooling: Option<String>,
    /// Serve /rerank, /reranking, /v1/rerank and /v1/reranking (as --embeddings --pooling
    /// rank; a model without a classification head scores with the first value of the first
    /// token's hidden state, as llama-server does).
    #[arg(help_heading = "Server", long = "reranking")]
    pub reranking: bool,
    /// Unload the model after N seconds without a request and load it again for the next one
    /// (-1: never). /props says is_sleeping meanwhile. Single-model mode (-m) only.
    #[arg(help_heading = "Server", long = "sleep-idle-seconds", value_name = "N",
          default_value_t = -1, allow_negative_numbers = true)]
    pub sleep_idle_seconds: i64,
    /// Do not serve /slots.
    #[arg(help_heading = "Server", long = "no-slots")]
    pub no_slots: bool,
    /// Directory of slot files: POST /slots/{id}?action=save|restore writes and reads a
    /// slot's tokens and K/V cache there (an existing directory; without it those routes
    /// answer 501).
    #[arg(help_heading = "Server", long = "slot-save-path", value_name = "PATH")]
    pub slot_save_path: Option<PathBuf>,
    /// Flash attention (`-fa` = on, `-fa on|off|auto`); auto is on, as llama.cpp resolves it on
    /// the CPU. A quantized V cache needs it.
    #[arg(help_heading = "Loading", long = "flash-attn", value_name = "on|off|auto", num_args = 0..=1, default_missing_value = "on",
          default_value = "auto", allow_negative_numbers = true, overrides_with = "flash_attn")]
    pub flash_attn: String,
    /// Seconds a client has to send a request body, the longest a response waits for a
    /// client that reads nothing (then the connection is closed), and the longest a
    /// router-mode request waits for a busy model (llama-server's read/write timeout).
    #[arg(help_heading = "Limits", long = "timeout", value_name = "SECONDS", default_value_t = 600,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    /// Seconds a client has to send a request's headers; also how long a kept-alive
    /// connection may sit idle.
    #[arg(help_heading = "Limits", long = "header-timeout", value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout: u64,
    /// Open connections served at once (lowered to fit the open-file limit). Beyond it a few
    /// more are accepted that answer only /health (others get 503); the rest are closed.
    #[arg(help_heading = "Limits", long = "max-connections", value_name = "N", default_value_t = 512,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_connections: u64,
    /// MiB of request bodies over 1 MiB parsed and held as JSON at once, and as much again
    /// for smaller ones: a parsed body takes up to about 40 times its size. A body beyond it
    /// waits (at most --timeout, then 503); one larger than the budget takes all of it.
    #[arg(help_heading = "Limits", long = "parse-budget", value_name = "MiB", default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(1..=1 << 22))]
    pub parse_budget: u64,
    /// Origins other than the server's own that browsers may call from, comma separated:
    /// `http://host:port` (with credentials), `localhost` (any loopback origin) or `*` (any,
    /// without credentials). Default: none, only the chat page the server serves.
    #[arg(
        help_heading = "Server",
        long = "cors-origins",
        value_name = "ORIGIN,...",
        value_delimiter = ','
    )]
    pub cors_origins: Vec<String>,
    /// Do not serve the chat page at `/`.
    #[arg(help_heading = "Server", long = "no-webui")]
    pub no_webui: bool,
    /// Log debug messages (as RUST_LOG=debug; read before parsing, see main), and answer
    /// non-streamed completions with llama-server's `__verbose` object (the prompt as its
    /// tokens read back, and the generated text).
    #[arg(help_heading = "Logging", short = 'v', long = "verbose")]
    pub verbose: bool,
    /// No log messages.
    #[arg(help_heading = "Logging", long = "log-disable")]
    pub log_disable: bool,
    /// Log threshold (`-lv`, llama.cpp's levels): 0-1 errors, 2 warnings, 3 warnings and the
    /// request log (the default), 4-5 debug (read before parsing, see main).
    #[arg(
        help_heading = "Logging",
        long = "log-verbosity",
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub log_verbosity: Option<i64>,
    /// Keep the KV cache off the GPU (`-nkvo`): the model then runs on the CPU device (the
    /// device executor keeps K/V on the device).
    #[arg(help_heading = "Loading", long = "no-kv-offload")]
    pub no_kv_offload: bool,
    /// A model of the local Hugging Face cache (`-hf OWNER/NAME[:QUANT]`, as llama.cpp's
    /// `$LLAMA_CACHE` or `hf download` leave it; without a quant Q4_K_M, then Q8_0, then the
    /// first). hmoe downloads nothing: a model not in the cache is an error that says so.
    #[arg(help_heading = "Server", long = "hf-repo", value_name = "REPO")]
    pub hf_repo: Option<String>,
    /// A request goes to the slot whose cached prompt shares the longest prefix with it when
    /// that is more than this fraction of the prompt (0: the least recently used slot).
    #[arg(
        help_heading = "Limits",
        long = "slot-prompt-similarity",
        value_name = "F",
        default_value_t = 0.1
    )]
    pub slot_prompt_similarity: f32,
    /// Requests that may wait for a free slot; beyond that the server answers 503.
    #[arg(
        help_heading = "Limits",
        long = "max-queue",
        value_name = "N",
        default_value_t = 256
    )]
    pub max_queue: usize,
    /// Default temperature (0 = greedy).
    #[arg(
        help_heading = "Sampling defaults",
        long = "temp",
        default_value_t = 0.8
    )]
    pub temp: f32,
    /// Default top-k (0 = off).
    #[arg(
        help_heading = "Sampling defaults",
        long = "top-k",
        default_value_t = 40.0
    )]
    pub top_k: f64,
    /// Default top-p (1 = off).
    #[arg(
        help_heading = "Sampling defaults",
        long = "top-p",
        default_value_t = 0.95
    )]
    pub top_p: f32,
    /// Default min-p (0 = off).
    #[arg(
        help_heading = "Sampling defaults",
        long = "min-p",
        default_value_t = 0.05
    )]
    pub min_p: f32,
    /// Default repetition penalty (1 = off).
    #[arg(
        help_heading = "Sampling defaults",
        long = "repeat-penalty",
        default_value_t = 1.0
    )]
    pub repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(
        help_heading = "Sampling defaults",
        long = "repeat-last-n",
        default_value_t = 64
    )]
    pub repeat_last_n: usize,
    /// Default presence penalty, subtracted once from each token already generated (0 = off).
    #[arg(
        help_heading = "Sampling defaults",
        long = "presence-penalty",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub presence_penalty: f32,
    /// Default frequency penalty, subtracted per occurrence of a generated token (0 = off).
    #[arg(
        help_heading = "Sampling defaults",
        long = "frequency-penalty",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub frequency_penalty: f32,
    /// Default seed (-1 = a random seed per request).
    #[arg(help_heading = "Sampling defaults", short = 's', long = "seed", default_value_t = -1, allow_negative_numbers = true)]
    pub seed: i64,
    /// Default number of tokens to generate (-1 = until the context is full).
    #[arg(help_heading = "Sampling defaults", short = 'n', long = "n-predict", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    #[command(flatten, next_help_heading = "Sampling defaults")]
    pub samplers: crate::serve_sampler_flags::SamplerFlags,
    #[command(flatten, next_help_heading = "Model placement and cache")]
    pub placement: PlacementArgs,
    /// What the llama-server flags that do not apply say at start, one line each (set by
    /// `main` from [`crate::llama_flags::rewrite_serve`]).
    #[arg(skip)]
    pub llama_notes: Vec<String>,
    /// The words of the command line after `serve`, as clap read them (set by `main`): each
    /// model of a preset is configured from its section's flags followed by these.
    #[arg(skip)]
    pub argv: Vec<String>,
}

/// `-t`: any negative count means the default (physical cores); positive ones are bounded.
/// The file of `-hf OWNER/NAME[:QUANT]` in the local Hugging Face cache.
pub(crate) fn cached_model(reference: &str) -> anyhow::Result<PathBuf> {
    let cache = hmoe_server::model_files::hf_cache_dir()
        .context("-hf: no Hugging Face cache folder ($LLAMA_CACHE, $HF_HOME or $HOME unset)")?;
    hmoe_server::model_files::resolve_hf_repo(&cache, reference)
        .map_err(|e| anyhow::anyhow!("-hf: {e}"))
}

fn parse_threads_or_default(s: &str) -> Result<i64, String> {
    let n: i64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a thread count"))?;
    if n > 0 {
        check_threads(n as usize)?;
    }
    Ok(n)
}

impl ServeArgs {
    /// The API keys of `--api-key` (which `LLAMA_API_KEY` sets, see [`crate::llama_flags`]) and
    /// `--api-key-file`. An empty key, or a key file with none, is an error: it never means "no
    /// authentication".
    fn api_keys(&self) -> anyhow::Result<Vec<String>> {
        let mut keys = Vec::new();
        for k in &self.api_key {
            if k.trim().is_empty() {
                bail!("--api-key: an empty key would let anyone in; leave --api-key out for no authentication");
            }
            keys.push(k.trim().to_string());
        }
        if let Some(f) = &self.api_key_file {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            let before = keys.len();
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from),
            );
            if keys.len() == before {
                bail!("--api-key-file {}: the file holds no key", f.display());
            }
        }
        Ok(keys)
    }

    /// The slots: `-np`, or llama-server's default of 4.
    pub(crate) fn n_parallel(&self) -> u32 {
        self.placement.parallel(SERVE_DEFAULT_PARALLEL)
    }

    /// The start-up notes: the llama-server flags that do not apply, a thinking budget that
    /// hmoe does not enforce, and what `--reasoning-format none` does to gpt-oss's tool calls.
    fn notes(&self) -> Vec<String> {
        let mut notes = self.llama_notes.clone();
        if self.reasoning_format == "none" {
            notes.push(
                "--reasoning-format none: the reasoning stays in `content`, and a gpt-oss \
                 model's tool calls stay raw harmony text there (no `tool_calls`); leave it \
                 out (auto) for parsed tool calls"
                    .into(),
            );
        }
        if self.reasoning_budget > 0 {
            notes.push(format!(
                "--reasoning-budget {}: hmoe does not cut thinking at a budget; thinking is \
                 unlimited (as -1)",
                self.reasoning_budget
            ));
        }
        notes
    }

    /// How the file is loaded: `--load-mode`, with `--no-mmap` and `--mlock` added to it.
    pub(crate) fn load_options(&self) -> LoadOptions {
        let mode = self.load_mode.as_deref().unwrap_or("mmap");
        LoadOptions {
            use_mmap: !self.no_mmap && matches!(mode, "mmap" | "mmap+mlock"),
            mlock: self.mlock || matches!(mode, "mlock" | "mmap+mlock"),
            populate: false,
        }
    }

    /// The sampling defaults must be numbers in range (`--temp nan` is an error, not `null`).
    fn check_sampling(&self) -> anyhow::Result<()> {
        let finite = [
            ("--temp", self.temp as f64),
            ("--top-k", self.top_k),
            ("--repeat-penalty", self.repeat_penalty as f64),
            ("--presence-penalty", self.presence_penalty as f64),
            ("--frequency-penalty", self.frequency_penalty as f64),
        ];
        for (flag, v) in finite {
            if !v.is_finite() {
                bail!("{flag} must be a finite number (got {v})");
            }
        }
        for (flag, v) in [("--top-p", self.top_p), ("--min-p", self.min_p)] {
            if !(0.0..=1.0).contains(&v) {
                bail!("{flag} must be between 0 and 1 (got {v})");
            }
        }
        if self.repeat_penalty < 0.0 {
            bail!(
                "--repeat-penalty must not be negative (got {})",
                self.repeat_penalty
            );
        }
        Ok(())
    }

    /// The server configuration these flags describe.
    pub fn config(&self) -> anyhow::Result<ServerConfig> {
        let cached = match &self.hf_repo {
            Some(_) if self.model.is_some() => bail!("give either -m MODEL or -hf REPO, not both"),
            Some(repo) => Some(cached_model(repo)?),
            None => None,
        };
        let models = match (cached.as_ref().or(self.model.as_ref()), &self.models_dir) {
            (Some(m), None) => ModelSource::File(m.clone()),
            (None, Some(d)) => ModelSource::Dir(d.clone()),
            (Some(_), Some(_)) => bail!("give either -m MODEL or --models-dir DIR, not both"),
            (None, None) => {
                bail!("give a model with -m MODEL, or a directory of models with --models-dir DIR")
            }
        };
        self.placement.to_flags()?;
        let a = &self.placement.args;
        if a.device.is_some() {
            // A device that does not exist is an error before anything starts.
            self.placement.selected_devices(&Probed::now())?;
        }
        self.check_sampling()?;
        if !(0.0..=1.0).contains(&self.slot_prompt_similarity) {
            bail!(
                "--slot-prompt-similarity must be between 0 and 1 (got {})",
                self.slot_prompt_similarity
            );
        }
        let kv_type = kv_type(&a.cache_type_k, &a.cache_type_v, &self.flash_attn)?;
        let mut config = ServerConfig::new(models);
        config.host = self.host.clone();
        config.port = self.port;
        config.alias = self
            .alias
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect();
        config.tags = (self.tags.iter())
            .map(|t| t.trim())
            .filter(|t| !t.is_empty())
            .map(String::from)
            .collect();
        config.api_keys = self.api_keys()?;
        config.cors_origins = self.cors_origins.clone();
        config.limits = Limits {
            max_connections: self.max_connections as usize,
            header_timeout: Duration::from_secs(self.header_timeout),
            timeout: Duration::from_secs(self.timeout),
            parse_budget: (self.parse_budget as usize) << 20,
            ..Limits::default()
        };
        config.engine.n_parallel = self.n_parallel() as usize;
        config.engine.n_ctx = a.ctx_size.unwrap_or(0) as usize;
        config.engine.n_ubatch = a.ubatch_size.min(a.batch_size).max(1) as usize;
        config.engine.kv_type = kv_type;
        config.engine.max_queue = self.max_queue;
        config.engine.slot_prompt_similarity = self.slot_prompt_similarity;
        config.engine.load = self.load_options();
        config.loader = self.loader(kv_type, config.engine.load);
        config.chat.template = match (&self.chat_template_file, &self.chat_template) {
            (Some(f), _) => Some(
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
            ),
            (None, Some(t)) => Some(hmoe_chat::resolve_chat_template(t)),
            (None, None) => None,
        };
        config.chat.no_prefill_assistant = self.no_prefill_assistant;
        config.verbose = self.verbose;
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
        match (self.reasoning.as_str(), self.reasoning_budget) {
            (_, b) if b < -1 => bail!(
                "--reasoning-budget {b}: -1 (unlimited), 0 (no thinking) or a number of tokens"
            ),
            ("on", 0) => bail!("--reasoning on contradicts --reasoning-budget 0"),
            // An `enable_thinking` of --chat-template-kwargs wins, as in llama-server.
            ("off", _) | (_, 0) => {
                config
                    .chat
                    .template_kwargs
                    .entry("enable_thinking")
                    .or_insert(false.into());
            }
            _ => {}
        }
        let s = &mut config.sampling;
        s.params.temperature = self.temp;
        s.params.top_k = self.top_k.max(0.0) as usize;
        s.params.top_p = self.top_p;
        s.params.min_p = self.min_p;
        s.params.repeat_penalty = self.repeat_penalty;
        s.params.repeat_last_n = self.repeat_last_n;
        s.presence_penalty = self.presence_penalty;
        s.frequency_penalty = self.frequency_penalty;
        self.samplers.apply(s)?;
        s.random_seed = self.seed < 0;
        s.params.seed = self.seed.max(0) as u64;
        s.n_predict = (self.n_predict >= 0).then_some(self.n_predict as usize);
        config.metrics = self.metrics;
        config.pooling = self.pooling.as_deref().and_then(Pooling::named);
        if self.reranking {
            if config.pooling.is_some_and(|p| p != Pooling::Rank) {
                bail!("--reranking pools with rank: leave out --pooling, or give --pooling rank");
            }
            config.pooling = Some(Pooling::Rank);
        }
        config.embeddings = self.embeddings || self.reranking;
        config.sleep_idle = match self.sleep_idle_seconds {
            -1 => None,
            n if n < 1 => bail!("--sleep-idle-seconds {n}: -1 (never) or a number of seconds"),
            _ if self.models_dir.is_some() => bail!(
                "--sleep-idle-seconds applies to a single model (-m); router mode unloads the \
                 least recently used model beyond --models-max"
            ),
            n => Some(Duration::from_secs(n as u64)),
        };
        config.slots_endpoint = !self.no_slots;
        config.slot_save_path = self.slot_save_path.clone();
        config.models_max = self.models_max;
        config.models_autoload = !self.no_models_autoload;
        config.webui = !self.no_webui;
        if let Some(file) = &self.models_preset {
            if self.models_dir.is_none() {
                bail!("--models-preset needs router mode (--models-dir DIR)");
            }
            crate::models_preset::apply(file, &self.argv, &mut config)?;
        }
        Ok(config)
    }
}

/// Runs `hmoe serve` until SIGINT/SIGTERM (or until the model fails to load).
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = args.config()?;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let ready_tx = std::sync::Mutex::new(ready_tx);
    config.on_ready = Some(Arc::new(move || {
        let _ = ready_tx.lock().map(|tx| tx.send(()));
    }));
    for note in args.notes() {
        eprintln!("note: {note}");
    }
    let threads = match args.threads {
        Some(n) if n > 0 => n as usize,
        _ => physical_cores(),
    };
    let load = args.load_options();
    let interleave = hmoe_engine::interleaves_experts(args.no_repack, !load.use_mmap, load.mlock);
    hmoe_engine::start_threads(threads, interleave)?;
    let summary = startup_summary(&config, threads);
    let server = RunningServer::start_with_signals(config.clone())?;
    for line in summary {
        eprintln!("hmoe serve: {line}");
    }
    let url = format!("http://{}", server.local_addr());
    if config.webui {
        eprintln!("hmoe serve: chat page {url}/ (API {url}/v1)");
    }
    eprintln!("hmoe serve: listening on {url}");
    match &config.models {
        ModelSource::File(_) => {
            // The model loads in the background after the socket listens: say when it serves.
            std::thread::Builder::new()
                .name("hmoe-ready".into())
                .spawn(move || {
                    if ready_rx.recv().is_ok() {
                        eprintln!("hmoe serve: ready: the model is loaded, serving on {url}");
                    }
                })?;
        }
        ModelSource::Dir(_) => {
            eprintln!(
                "hmoe serve: ready: serving on {url} (each model loads on its first request)"
            );
        }
    }
    server.wait()?;
    Ok(())
}

/// What the server will run, in a few plain lines: router mode's models, the KV cache type and
/// the threads. Each model's own lines (engine, memory per device, context and slots) come
/// when it loads ([`ServeArgs::loader`]).
fn startup_summary(config: &ServerConfig, threads: usize) -> Vec<String> {
    let e = &config.engine;
    let mut out = Vec::new();
    if let ModelSource::Dir(dir) = &config.models {
        let n = hmoe_server::model_files::scan_models_dir(dir).map_or(0, |m| m.len());
        let max = match config.models_max {
            0 => "no limit".to_string(),
            m => format!("at most {m} loaded"),
        };
        out.push(format!(
            "router mode: {n} model(s) in {} ({max}; each loads on its first request, placed \
             as -m would be)",
            dir.display()
        ));
        out.extend(crate::models_preset::summary(config));
    }
    out.push(format!(
        "KV cache K {} / V {}, flash attention {}",
        e.kv_type.k(),
        e.kv_type.v(),
        if e.kv_type.flash_attn() { "on" } else { "off" }
    ));
    out.push(format!("threads: {threads}"));
    if !config.api_keys.is_empty() {
        out.push(format!(
            "API key required ({} key(s)): clients send `Authorization: Bearer KEY` or \
             `X-Api-Key: KEY`; /health, /v1/models and the chat page stay open",
            config.api_keys.len()
        ));
    }
    out
}

impl ServeArgs {
    /// The server's loader: the engine's one entry point ([`hmoe_engine::load_opened`]) as
    /// `hmoe run` uses it, except that `--no-kv-offload` runs the executor on the CPU; it
    /// prints what it chose (see [`load_model`]).
    fn loader(&self, kv: KvType, opts: LoadOptions) -> ModelLoader {
        let mut placement = self.placement.clone();
        let np_default = placement.args.parallel == 0;
        placement.args.parallel = self.n_parallel();
        let kv_offload = !self.no_kv_offload;
        Arc::new(move |gguf: GgufModel, path: &Path| {
            load_model(&placement, np_default, kv, kv_offload, opts, gguf, path)
                .map_err(|e| format!("{e:#}"))
        })
    }
}

/// Plans and loads one model for the server, and says on stderr what was chosen: the model,
/// the engine (and why the CPU, when it is), memory per device (the `hmoe fit` table), the
/// context and why, and the slots.
fn load_model(
    placement: &PlacementArgs,
    np_default: bool,
    kv: KvType,
    kv_offload: bool,
    opts: LoadOptions,
    gguf: GgufModel,
    path: &Path,
) -> anyhow::Result<LoadedModel> {
    let mut config = placement.engine_config(path.to_path_buf(), opts, kv)?;
    config.kv_offload = kv_offload;
    // The engine line below says why the CPU runs; the engine's own warning would repeat it.
    config.asks_for_gpu = false;
    let model_line = model_line(path, &gguf);
    let progress =
        crate::common::LoadProgress::start(path.display().to_string(), gguf.total_tensor_bytes());
    let loaded = hmoe_engine::load_opened(&config, gguf);
    drop(progress);
    let loaded = loaded?;
    for note in &loaded.notes {
        eprintln!("hmoe: {note}");
    }
    let (plan, names, engine) = match (loaded.plan, &loaded.used) {
        (Some(p), Some(used)) => (Ok(p), loaded.names, used.device.clone()),
        // An architecture the planner cannot describe still runs on the CPU.
        _ => (
            cpu_plan(placement, loaded.model.gguf()),
            Vec::new(),
            "CPU".into(),
        ),
    };
    let n_ctx_train = loaded.model.n_ctx_train();
    let (n_ctx, n_ctx_why) = match placement.args.ctx_size {
        Some(c) if c > 0 => (c as usize, format!("-c {c}")),
        _ => {
            let notes = plan.as_ref().map_or(&[][..], |p| &p.notes[..]);
            let reduced = notes.iter().find(|n| n.starts_with("context reduced"));
            match (reduced, &plan) {
                (Some(note), Ok(plan)) if loaded.why_cpu.is_none() => (
                    (plan.n_ctx as usize).min(n_ctx_train),
                    format!("--fit: {note} to fit the device"),
                ),
                _ if placement.args.ctx_size.is_none() => (
                    n_ctx_train,
                    "the model's trained context, -c not given".into(),
                ),
                _ => (n_ctx_train, "-c 0: the model's trained context".into()),
            }
        }
    };
    let devices: Vec<DevicePlacement> = (plan.iter().flat_map(|p| &p.devices))
        .map(|d| DevicePlacement {
            name: d.device.name_in(&names),
            layers: d.layers,
            expert_layers: d.expert_layers,
            weight_bytes: d.weights,
            kv_bytes: d.kv,
            compute_bytes: d.compute,
        })
        .collect();
    let n_slots = placement.args.parallel.max(1) as usize;
    // A context --fit chose is what the device holds: split, never padded beyond it.
    let per_slot = if n_ctx_why.starts_with("--fit") {
        n_ctx / n_slots
    } else {
        slot_positions(n_ctx, n_slots, n_ctx_train)
    };
    let mut lines = vec![model_line];
    lines.push(match &loaded.why_cpu {
        None => format!("engine: the device executor on {engine}"),
        Some(why) => format!("engine: CPU ({why})"),
    });
    match &plan {
        Ok(plan) => {
            lines.push("memory per device (MiB):".into());
            lines.extend(plan.table_named(&names).lines().map(|l| format!("  {l}")));
        }
        Err(e) => lines.push(format!("memory per device: no estimate ({e:#})")),
    }
    let mut slots_line =
        format!("context {n_ctx} ({n_ctx_why}), {n_slots} slot(s) of {per_slot} positions");
    if per_slot * n_slots != n_ctx {
        slots_line.push_str(&format!(
            " ({} in all: as in llama-server, a slot's share is padded to a multiple of 256 \
             and at most the trained context, {n_ctx_train})",
            per_slot * n_slots
        ));
    }
    if np_default {
        slots_line.push_str(
            "; -np not given: 4 slots as llama-server serves (its slots share one cache of \
             the whole context, hmoe's each hold their share)",
        );
    }
    lines.push(slots_line);
    for line in lines {
        eprintln!("hmoe serve: {line}");
    }
    Ok(LoadedModel {
        model: Arc::from(loaded.model),
        placement: Placement {
            engine,
            why_cpu: loaded.why_cpu,
            devices,
            // The server gives each slot n_ctx / n_slots positions.
            n_ctx: Some(per_slot * n_slots),
            n_ctx_why: Some(n_ctx_why),
        },
    })
}

/// Positions per slot as llama-server gives them with its `-np N` (no unified cache): the
/// context padded to a multiple of 256, its share per slot padded again, and the server caps a
/// slot at the model's trained context (llama.cpp d32676d77, `llama_context` and
/// `load_model`: `-c 512 -np 4` gives 256 each, `-c 700 -np 2` 512, `-c 300 -np 1` 512).
fn slot_positions(n_ctx: usize, n_slots: usize, n_ctx_train: usize) -> usize {
    let pad = |n: usize| n.div_ceil(256) * 256;
    let per = pad(pad(n_ctx) / n_slots.max(1));
    if n_ctx_train > 0 {
        per.min(n_ctx_train)
    } else {
        per
    }
}

/// `model: PATH "NAME", architecture ARCH, N MiB`.
fn model_line(path: &Path, gguf: &GgufModel) -> String {
    let meta = gguf.metadata();
    let name = meta
        .get_str("general.name")
        .map_or_else(String::new, |n| format!(" \"{n}\""));
    format!(
        "model: {}{name}, architecture {}, {} MiB",
        path.display(),
        meta.architecture().unwrap_or("unknown"),
        gguf.total_tensor_bytes() >> 20
    )
}

/// The placement estimate of the executor on the CPU: every layer on the CPU, the server's context and
/// slots.
fn cpu_plan(placement: &PlacementArgs, gguf: &GgufModel) -> anyhow::Result<Plan> {
    let shape = hmoe_model::model_shape(gguf)?;
    let mut flags = placement.to_flags()?;
    flags.n_gpu_layers = hmoe_placement::GpuLayers::parse("0")?;
    flags.rules.clear();
    flags.fit = false;
    let tensors: Vec<hmoe_placement::TensorDesc> = gguf
        .tensors()
        .iter()
        .map(hmoe_placement::TensorDesc::from)
        .collect();
    Ok(hmoe_placement::plan(
        &tensors,
        &shape,
        &hmoe_placement::DeviceBudget::default(),
        &flags,
    )?)
}

#[cfg(test)]
mod tests;
