//! One loaded model: weights, tokenizer, chat format and its slots.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use hmoe_gguf::GgufModel;
use hmoe_model::{LanguageModel, LogitsWanted};
use hmoe_tokenizer::Tokenizer;

use crate::chat_format::ChatSetup;
use crate::config::ServerConfig;
use crate::error::{ApiError, ServerError};
use crate::loader::{LoadedModel, Placement};
use crate::metrics::Stats;
use crate::scheduler::{JobEvent, JobSpec, Scheduler, SlotConfig, SubmitError};

/// A model ready to serve.
pub struct ModelHost {
    /// Its id in `/v1/models` and the `model` field.
    pub id: String,
    /// The file (first shard) it was loaded from.
    pub path: PathBuf,
    /// The weights.
    pub model: Arc<dyn LanguageModel>,
    /// Its vocabulary.
    pub tokenizer: Arc<Tokenizer>,
    /// Its chat format (`None` when it has no usable template; see `chat_error`).
    pub chat: Option<ChatSetup>,
    /// Why chat is unavailable.
    pub chat_error: Option<String>,
    /// Its slots.
    pub scheduler: Scheduler,
    /// Its counters.
    pub stats: Arc<Stats>,
    /// Where it runs (the engine, and memory per device).
    pub placement: Placement,
    /// Unix time it was loaded.
    pub created: u64,
    /// The vocabulary grammars are compiled against, built on first use (by the request
    /// parameters' `compile_constraint`).
    pub(crate) vocab: OnceLock<Result<Arc<hmoe_grammar::Vocab>, hmoe_grammar::GrammarError>>,
}

impl std::fmt::Debug for ModelHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelHost")
            .field("id", &self.id)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl ModelHost {
    /// Loads `path` and starts its slots.
    pub fn load(id: String, path: &Path, config: &ServerConfig) -> Result<ModelHost, ServerError> {
        Prepared::new(open_gguf(path, config)?, path, config)?.start(id, config)
    }
}

/// Opens a model file (its header and tensor table, checked against the file's size): what
/// [`crate::RunningServer::start`] does before listening, so that a wrong `-m` fails at once.
pub fn open_gguf(path: &Path, config: &ServerConfig) -> Result<GgufModel, ServerError> {
    let fail = |message: String| ServerError::Load {
        path: path.display().to_string(),
        message,
    };
    // Opening a FIFO blocks until a writer comes, and a device is no model: only regular files
    // (or links to them) are opened.
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => {
            return Err(fail(
                "not a regular file (a model must be a file, not a FIFO, socket or device)".into(),
            ))
        }
        Err(e) => return Err(fail(e.to_string())),
        Ok(_) => {}
    }
    GgufModel::open(path, config.engine.load).map_err(|e| fail(e.to_string()))
}

/// A model whose file, tokenizer, chat template and cache types have been checked, before its
/// slots (and their KV caches) exist: router mode prepares a model before unloading another
/// for it, so that a broken file evicts nothing.
pub struct Prepared {
    path: PathBuf,
    model: Arc<dyn LanguageModel>,
    tokenizer: Arc<Tokenizer>,
    chat: Option<ChatSetup>,
    chat_error: Option<String>,
    placement: Placement,
    n_parallel: usize,
    n_ctx_slot: usize,
}

impl Prepared {
    /// Builds the model from an opened file and checks everything but memory for its slots.
    pub fn new(
        gguf: GgufModel,
        path: &Path,
        config: &ServerConfig,
    ) -> Result<Prepared, ServerError> {
        let err = |message: String| ServerError::Load {
            path: path.display().to_string(),
            message,
        };
        let LoadedModel { model, placement } = (config.loader)(gguf, path).map_err(err)?;
        let tokenizer = Arc::new(
            Tokenizer::from_metadata(model.gguf().metadata())
                .map_err(|e| err(format!("tokenizer: {e}")))?,
        );
        let (chat, chat_error) = match &config.chat.template {
            Some(src) => (
                Some(
                    ChatSetup::new(src.clone(), &tokenizer)
                        .map_err(|e| err(format!("--chat-template-file: {e}")))?,
                ),
                None,
            ),
            None => match model.gguf().metadata().get_str("tokenizer.chat_template") {
                Some(src) => match ChatSetup::new(src.to_string(), &tokenizer) {
                    Ok(c) => (Some(c), None),
                    Err(e) => {
                        tracing::warn!(
                            "{}: the model's chat template does not compile: {e}",
                            path.display()
                        );
                        (
                            None,
                            Some(format!("the model's chat template does not compile: {e}")),
                        )
                    }
                },
                // As llama-server: a model without a template is served with ChatML.
                None => {
                    tracing::info!("{}: the model has no chat template; using chatml (--chat-template-file to choose another)", path.display());
                    let chatml = hmoe_chat::builtin_template("chatml")
                        .ok_or_else(|| err("no built-in chatml".into()))?;
                    (
                        Some(
                            ChatSetup::new(chatml, &tokenizer)
                                .map_err(|e| err(format!("chatml: {e}")))?,
                        ),
                        None,
                    )
                }
            },
        };
        let e = &config.engine;
        let n_parallel = e.n_parallel.max(1);
        let n_ctx = match (placement.n_ctx, e.n_ctx) {
            (Some(n), _) => n,
            (None, 0) => model.n_ctx_train(),
            (None, n) => n,
        };
        let n_ctx_slot = n_ctx / n_parallel;
        if n_ctx_slot < 2 {
            return Err(err(format!("a context of {n_ctx} split over {n_parallel} slots leaves {n_ctx_slot} positions per slot")));
        }
        // The cache types must suit the model (e.g. quantized caches need heads of whole
        // blocks): an empty forward pass checks that now rather than at the first request.
        let mut probe = model.new_cache(e.kv_type, 1, 1);
        model
            .forward(&mut probe, &[], LogitsWanted::Last)
            .map_err(|x| err(format!("KV cache: {x}")))?;
        drop(probe);
        Ok(Prepared {
            path: path.to_path_buf(),
            model,
            tokenizer,
            chat,
            chat_error,
            placement,
            n_parallel,
            n_ctx_slot,
        })
    }

    /// Starts the slots: the model is then served as `id`.
    pub fn start(self, id: String, config: &ServerConfig) -> Result<ModelHost, ServerError> {
        let (n_parallel, n_ctx_slot) = (self.n_parallel, self.n_ctx_slot);
        let e = &config.engine;
        let stats = Arc::new(Stats::default());
        let slots = SlotConfig {
            n_slots: n_parallel,
            n_ctx_slot,
            n_ubatch: e.n_ubatch.max(1),
            kv_type: e.kv_type,
            max_queue: e.max_queue,
            slot_prompt_similarity: e.slot_prompt_similarity,
            device_top_k: e.device_top_k,
        };
        let scheduler = Scheduler::start(
            self.model.clone(),
            self.tokenizer.clone(),
            slots,
            config.picker.clone(),
            stats.clone(),
        )?;
        tracing::info!(
            "{id}: loaded {} ({n_parallel} slots of {n_ctx_slot} positions)",
            self.path.display()
        );
        Ok(ModelHost {
            id,
            path: self.path,
            model: self.model,
            tokenizer: self.tokenizer,
            chat: self.chat,
            chat_error: self.chat_error,
            scheduler,
            stats,
            placement: self.placement,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            vocab: OnceLock::new(),
        })
    }
}

impl ModelHost {
    /// Positions per slot.
    pub fn n_ctx_slot(&self) -> usize {
        self.scheduler.config().n_ctx_slot
    }

    /// The chat format, or the 400 a chat request gets without one.
    pub fn chat(&self) -> Result<&ChatSetup, ApiError> {
        self.chat.as_ref().ok_or_else(|| {
            ApiError::bad_request(
                self.chat_error
                    .clone()
                    .unwrap_or_else(|| "this model has no chat template".into()),
            )
        })
    }

    /// Checks the prompt fits, then queues the request.
    pub fn submit(
        &self,
        spec: JobSpec,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<JobEvent>, ApiError> {
        if spec.prompt.is_empty() {
            return Err(ApiError::bad_request("the prompt is empty"));
        }
        if let Some(&bad) = spec
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.model.n_vocab())
        {
            return Err(ApiError::bad_request(format!(
                "token id {bad} is outside the vocabulary (n_vocab {})",
                self.model.n_vocab()
            )));
        }
        let n_ctx = self.n_ctx_slot();
        if spec.prompt.len() >= n_ctx {
            return Err(ApiError::exceeds_context(spec.prompt.len(), n_ctx));
        }
        let n_slots = self.scheduler.config().n_slots.max(1);
        if let Some(id) = spec.id_slot.filter(|&id| id >= n_slots) {
            return Err(ApiError::bad_request(format!(
                "'id_slot' {id} names no slot: the server has {n_slots} (0 to {})",
                n_slots - 1
            )));
        }
        match self.scheduler.submit(spec) {
            Ok((_, rx)) => Ok(rx),
            Err(e @ SubmitError::QueueFull) | Err(e @ SubmitError::ShuttingDown) => {
                Err(ApiError::unavailable(e.to_string()))
            }
        }
    }

    /// Metadata for `/v1/models`.
    pub fn meta(&self) -> serde_json::Value {
        serde_json::json!({
            "n_vocab": self.model.n_vocab(),
            "n_ctx_train": self.model.n_ctx_train(),
            "n_ctx": self.n_ctx_slot(),
            "size": self.model.gguf().total_tensor_bytes(),
            "architecture": self.model.gguf().metadata().architecture(),
        })
    }
}
