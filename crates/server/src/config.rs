//! Server configuration (what `hmoe serve`'s flags turn into).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hmoe_chat::ReasoningFormat;
use hmoe_engine::SamplerParams;
use hmoe_gguf::LoadOptions;
use hmoe_model::kv_cache::{CacheType, FlashAttn};
use hmoe_model::KvType;

use crate::loader::{cpu_loader, ModelLoader};
use crate::sampling::PickerFactory;

/// Where the models come from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// One model file (for a split model, any shard), served under [`ServerConfig::alias`] or
    /// its file name.
    File(PathBuf),
    /// Router mode: every GGUF in the directory (split sets and sub-directories as one model),
    /// loaded on first use, at most [`ServerConfig::models_max`] at a time.
    Dir(PathBuf),
}

/// How each model runs.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Slots (`-np`): sequences decoded together.
    pub n_parallel: usize,
    /// Total context (`-c`); 0 = the model's trained context. Each slot gets
    /// `n_ctx / n_parallel` positions.
    pub n_ctx: usize,
    /// Micro-batch (`-ub`, at most `-b`): prompt tokens run per step, and the most a new
    /// prompt delays the running streams by.
    pub n_ubatch: usize,
    /// KV cache element types (`-ctk/-ctv`) and flash attention (`-fa`).
    pub kv_type: KvType,
    /// Requests that may wait for a slot; beyond that the server answers 503.
    pub max_queue: usize,
    /// `--slot-prompt-similarity`: a request goes to the slot whose cache shares the longest
    /// prefix with it when that is more than this fraction of the prompt (0 = least recently
    /// used slot always).
    pub slot_prompt_similarity: f32,
    /// How to open the files.
    pub load: LoadOptions,
    /// Whether a request whose sampler chain needs no more than a token's best logits
    /// (greedy, or top-k first with k ≤ `hmoe_backend::TOP_K_MAX` and nothing before it
    /// that changes a logit; no logit bias, penalties, grammar or pre-sampling
    /// probabilities) gets only those, ranked on the device, so that the row does not cross
    /// the bus; the tokens and probabilities are the same either way. On unless the
    /// environment sets `HMOE_DEVICE_TOPK=0`.
    pub device_top_k: bool,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            n_parallel: 1,
            n_ctx: 4096,
            n_ubatch: 512,
            // f16 K and V with flash attention: llama-server's defaults (-fa auto is on).
            kv_type: KvType::new(CacheType::F16, CacheType::F16, FlashAttn::Auto)
                .unwrap_or(KvType::F16),
            max_queue: 256,
            slot_prompt_similarity: 0.1,
            load: LoadOptions::default(),
            device_top_k: !std::env::var("HMOE_DEVICE_TOPK").is_ok_and(|v| v == "0"),
        }
    }
}

/// Chat formatting.
#[derive(Clone, Debug, Default)]
pub struct ChatConfig {
    /// A Jinja chat template replacing the model's (`--chat-template-file`).
    pub template: Option<String>,
    /// Where reasoning goes (`--reasoning-format`); requests may override it.
    pub reasoning_format: ReasoningFormat,
    /// Extra template variables for every request (`--chat-template-kwargs`), a JSON object.
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// A conversation ending with an assistant message renders that message as a closed turn
    /// (`--no-prefill-assistant`) instead of continuing it (llama-server's default).
    pub no_prefill_assistant: bool,
}

/// Sampling defaults for requests that leave a field out (`--temp`, `--top-k`, ...).
#[derive(Clone, Debug)]
pub struct SamplingDefaults {
    /// Sampler chain settings; `seed` is used only when `random_seed` is false.
    pub params: SamplerParams,
    /// Draw a fresh seed per request (llama.cpp's default seed -1).
    pub random_seed: bool,
    /// Tokens to generate when a request does not say (`-n`); `None` = until the context ends.
    pub n_predict: Option<usize>,
    /// `presence_penalty` when a request does not say (`--presence-penalty`; 0 = off).
    pub presence_penalty: f32,
    /// `frequency_penalty` when a request does not say (`--frequency-penalty`; 0 = off).
    pub frequency_penalty: f32,
    /// DRY's sequence breakers when a request does not say (`--dry-sequence-breaker`).
    pub dry_sequence_breakers: Vec<String>,
}

impl Default for SamplingDefaults {
    fn default() -> SamplingDefaults {
        SamplingDefaults {
            params: SamplerParams::default(),
            random_seed: true,
            n_predict: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            dry_sequence_breakers: hmoe_engine::DryParams::DEFAULT_BREAKERS
                .map(String::from)
                .to_vec(),
        }
    }
}

/// Bounds on what clients can make the server hold (connections, time, bytes). The other
/// input-controlled bounds live where they apply: threads (`hmoe_pool::MAX_THREADS`, via the
/// CLI), queued requests ([`EngineConfig::max_queue`]), tokens to generate and prompt length
/// (the slot's context), parsed bodies ([`Limits::parse_budget`]), `n_probs` and stop strings (`MAX_PROBS` and `MAX_STOP` of the
/// request parameters), pieces of `/tokenize` (streamed).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Open connections served normally (`--max-connections`; lowered to fit the process's
    /// file descriptor limit). Beyond it a few more are accepted that answer only `/health`
    /// (others get 503), with a one-second header timeout; beyond those, connections are
    /// closed at once.
    pub max_connections: usize,
    /// Time a client has to send a request's head (and the most a kept-alive connection may
    /// sit idle) before the connection is closed (`--header-timeout`).
    pub header_timeout: Duration,
    /// Time a client has to send a request's body (`--timeout`, llama-server's read/write
    /// timeout, default 600 s), the longest a response may wait for a client that reads
    /// nothing, and the longest a router-mode request waits for a model to be free.
    pub timeout: Duration,
    /// Largest request body in bytes; larger ones get 413.
    pub max_body: usize,
    /// Bytes of request bodies over [`crate::parsed_body::SMALL_BODY`] parsed and held as JSON
    /// at once, and as much again for smaller ones (`--parse-budget`): a parsed body takes up
    /// to about 40 times its size, so this bounds that memory. A body beyond it waits, at most
    /// [`Limits::timeout`], then gets 503. A body larger than the budget takes all of it.
    pub parse_budget: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 512,
            header_timeout: Duration::from_secs(10),
            timeout: Duration::from_secs(600),
            max_body: 64 << 20,
            parse_budget: 64 << 20,
        }
    }
}

/// Everything the server needs to start.
#[derive(Clone)]
pub struct ServerConfig {
    /// Address to listen on (`--host`).
    pub host: String,
    /// Port (`--port`); 0 picks a free one (see [`crate::RunningServer::local_addr`]).
    pub port: u16,
    /// Model(s) to serve.
    pub models: ModelSource,
    /// Names of the single model (`--alias`): `/v1/models` lists them as its `aliases`, and
    /// the alphabetically first is its id (llama-server keeps them in a sorted set).
    pub alias: Vec<String>,
    /// Tags of the single model (`--tags`), listed in `/v1/models`.
    pub tags: Vec<String>,
    /// Accepted API keys (`--api-key`); empty = no authentication. An empty key is a
    /// configuration error ([`crate::RunningServer::start`] refuses it), never "no auth".
    pub api_keys: Vec<String>,
    /// Origins other than the server's own that browsers may call from (`--cors-origins`):
    /// exact origins (reflected, with credentials), `localhost` (any loopback origin, likewise)
    /// or `*` (any, without credentials). Empty (the default): the server's own origin only.
    pub cors_origins: Vec<String>,
    /// Connection, time and size bounds.
    pub limits: Limits,
    /// Engine settings per model.
    pub engine: EngineConfig,
    /// Chat settings.
    pub chat: ChatConfig,
    /// Sampling defaults.
    pub sampling: SamplingDefaults,
    /// Serve `/metrics` (`--metrics`).
    pub metrics: bool,
    /// Serve the embedding routes (`--embedding`; `--reranking` too, with rank pooling); see
    /// [`crate::embeddings`].
    pub embeddings: bool,
    /// How embeddings pool token vectors (`--pooling`); `None`: each model's metadata, else
    /// none. [`crate::pooling::Pooling::Rank`] (with `embeddings`) serves the rerank routes.
    pub pooling: Option<crate::pooling::Pooling>,
    /// Serve `/slots` (on unless `--no-slots`).
    pub slots_endpoint: bool,
    /// The directory of slot files (`--slot-save-path`): `POST /slots/{id}?action=save|
    /// restore` read and write files there; `None` (the default) answers those routes 501.
    pub slot_save_path: Option<std::path::PathBuf>,
    /// Single-model mode: unload the model after this long with no request, and load it
    /// again for the next one (`--sleep-idle-seconds`; `None`: never). `/props` says
    /// `is_sleeping` meanwhile.
    pub sleep_idle: Option<Duration>,
    /// Router mode: models loaded at once (`--models-max`, 0 = no limit).
    pub models_max: usize,
    /// Router mode: a request for a model that is not loaded loads it (on unless
    /// `--no-models-autoload`, which makes it a 400 until `POST /models/load`).
    pub models_autoload: bool,
    /// Router mode: each model's own settings (`--models-preset`, one INI section per model),
    /// by model name.
    pub presets: BTreeMap<String, ModelPreset>,
    /// Router mode: the settings of a model without a section of its own (the preset file's
    /// `[*]` section over the command line); `None`: the command line's.
    pub preset_default: Option<ModelPreset>,
    /// Non-streamed completions carry llama-server's `__verbose` object (`--verbose`): the
    /// prompt as its tokens read back, and the generated text.
    pub verbose: bool,
    /// Router mode: reads the preset file again for `GET /models?reload=1` (the CLI's
    /// `--models-preset` parser); `None`: there is no file to read again.
    pub preset_reader: Option<PresetReader>,
    /// Replaces the sampler of every request (an extension point; the tests use it to replay
    /// fixed token sequences). `None` = the engine's sampler.
    pub picker: Option<PickerFactory>,
    /// Serve the chat page at `/` (on unless `--no-webui`).
    pub webui: bool,
    /// Turns an opened model file into a model (in router mode, each model): the CLI plans
    /// the placement and picks the engine as `hmoe run` does. The default runs the executor on the
    /// CPU ([`cpu_loader`]).
    pub loader: ModelLoader,
    /// Called once when the single model serves (loaded, its slots started): the CLI prints
    /// its "ready" line. Not called in router mode, where models load on request.
    pub on_ready: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl ServerConfig {
    /// A configuration serving `models` on 127.0.0.1:8080 with llama-server's defaults.
    pub fn new(models: ModelSource) -> ServerConfig {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            models,
            alias: Vec::new(),
            tags: Vec::new(),
            api_keys: Vec::new(),
            cors_origins: Vec::new(),
            limits: Limits::default(),
            engine: EngineConfig::default(),
            chat: ChatConfig::default(),
            sampling: SamplingDefaults::default(),
            metrics: false,
            embeddings: false,
            pooling: None,
            slots_endpoint: true,
            slot_save_path: None,
            sleep_idle: None,
            models_max: 4,
            models_autoload: true,
            presets: BTreeMap::new(),
            preset_default: None,
            preset_reader: None,
            verbose: false,
            picker: None,
            webui: true,
            loader: cpu_loader(),
            on_ready: None,
        }
    }
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("models", &self.models)
            .field("alias", &self.alias)
            .field("tags", &self.tags)
            .field("api_keys", &self.api_keys.len())
            .field("cors_origins", &self.cors_origins)
            .field("limits", &self.limits)
            .field("engine", &self.engine)
            .field("chat", &self.chat)
            .field("sampling", &self.sampling)
            .field("metrics", &self.metrics)
            .field("embeddings", &self.embeddings)
            .field("pooling", &self.pooling)
            .field("slot_save_path", &self.slot_save_path)
            .field("sleep_idle", &self.sleep_idle)
            .field("models_max", &self.models_max)
            .field("models_autoload", &self.models_autoload)
            .field("presets", &self.presets.keys().collect::<Vec<_>>())
            .field("preset_reader", &self.preset_reader.is_some())
            .field("verbose", &self.verbose)
            .field("picker", &self.picker.is_some())
            .field("webui", &self.webui)
            .field("on_ready", &self.on_ready.is_some())
            .finish()
    }
}

/// A preset file read again: each section's settings by model name (as
/// [`ServerConfig::presets`]) and the `[*]` section's (as [`ServerConfig::preset_default`]), or
/// why the file is not usable (the server then keeps the presets it has).
pub type PresetReader = Arc<
    dyn Fn() -> Result<(BTreeMap<String, ModelPreset>, Option<ModelPreset>), String> + Send + Sync,
>;

/// One model's settings in router mode: a `--models-preset` section, turned by the CLI into
/// what the model loads with. Only what a model is loaded with can differ per model (its
/// placement, context, slots, K/V types, load mode, chat template); the rest is the server's.
#[derive(Clone)]
pub struct ModelPreset {
    /// The model file (the section's `model` key) when the model is not one of
    /// `--models-dir`'s; `None`: the directory's file of the section's name.
    pub path: Option<PathBuf>,
    /// Other names the model answers to (the section's `alias`).
    pub aliases: Vec<String>,
    /// The flags the preset gives the model (hmoe's spelling), for `/models`' `status.args`.
    pub args: Vec<String>,
    /// Its engine settings.
    pub engine: EngineConfig,
    /// Its chat settings (a preset's chat template).
    pub chat: ChatConfig,
    /// Its loader (its placement flags).
    pub loader: ModelLoader,
}

impl std::fmt::Debug for ModelPreset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelPreset")
            .field("path", &self.path)
            .field("aliases", &self.aliases)
            .field("args", &self.args)
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

/// Shared handle to the configuration.
pub type SharedConfig = Arc<ServerConfig>;
