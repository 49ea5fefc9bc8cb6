//! What a request gives the scheduler and what it gets back: the job, its events, its end and
//! why it failed or was refused; and the slot actions (`POST /slots/{id}`) and their errors.

use hmoe_chat::ChatDelta;
use hmoe_engine::SamplerParams;
use hmoe_model::ModelError;

use crate::error::ApiError;
use crate::output::OutputKind;
use crate::sampling::LogitAdjust;
use crate::slot_file::SlotState;
use tokio::sync::oneshot;

/// What a request asks the engine for.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// Prompt tokens (non-empty, shorter than a slot's context).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (`None`: until the context is full).
    pub n_predict: Option<usize>,
    /// Sampler settings.
    pub sampling: SamplerParams,
    /// Penalties and logit bias.
    pub adjust: LogitAdjust,
    /// Report the chosen token's log-probability.
    pub logprobs: bool,
    /// Report this many most likely alternatives per token.
    pub n_probs: usize,
    /// Report probabilities after the sampler chain (`post_sampling_probs`) instead of the
    /// softmax of the raw logits.
    pub post_sampling_probs: bool,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep going after end-of-generation tokens.
    pub ignore_eos: bool,
    /// How to read the output.
    pub output: OutputKind,
    /// Reuse the slot's cached prefix (`cache_prompt`, default on).
    pub cache_prompt: bool,
    /// The grammar the generated tokens must follow (compiled, at its start).
    pub constraint: Option<hmoe_grammar::Constraint>,
    /// End at a token holding a newline once generation (from the first token's logits) has
    /// run this long (`t_max_predict_ms`, llama-server's rule).
    pub t_max_predict: Option<std::time::Duration>,
    /// Run in this slot only, waiting for it (`id_slot`); checked against the slot count
    /// before submitting.
    pub id_slot: Option<usize>,
}

/// Log-probabilities of one generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub id: u32,
    /// Its log-probability (softmax of the raw logits).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Why generation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token.
    Eog,
    /// A stop string (given).
    StopWord(String),
    /// `n_predict` reached or the context is full.
    Length,
}

/// The end of a request.
#[derive(Clone, Debug)]
pub struct Summary {
    /// Why it ended.
    pub finish: Finish,
    /// Prompt tokens.
    pub n_prompt: usize,
    /// Prompt tokens taken from the slot's cache.
    pub n_cached: usize,
    /// Tokens generated.
    pub n_generated: usize,
    /// Milliseconds from admission to the first token.
    pub prompt_ms: f64,
    /// Milliseconds from the first to the last token.
    pub decode_ms: f64,
    /// The slot that ran it.
    pub slot: usize,
    /// The generated token ids.
    pub tokens: Vec<u32>,
    /// Generation stopped because the slot's context was full (before `n_predict`): the
    /// native route's `truncated`, as llama-server reports it.
    pub truncated: bool,
}

/// What the worker sends back for a request.
#[derive(Clone, Debug)]
pub enum JobEvent {
    /// New output (possibly only log-probabilities).
    Output {
        /// Response pieces.
        deltas: Vec<ChatDelta>,
        /// Log-probabilities of the tokens generated since the last event (when asked for).
        probs: Vec<TokenLogprob>,
    },
    /// The request is complete.
    Done(Summary),
    /// The request failed; no more events follow.
    Failed(JobFailure),
}

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobFailure {
    /// What went wrong.
    pub message: String,
    /// Whose fault it was, hence the HTTP status.
    pub kind: FailureKind,
}

/// Whose fault a failed request was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The server's (500).
    Internal,
    /// The server lacked a resource that may free up (the device had no memory for the
    /// request's K/V cache): 503.
    Unavailable,
    /// The request's: its grammar failed the grammar engine's limits while generating (400).
    Request,
}

impl JobFailure {
    /// A failure that is no lack of resources (500).
    pub fn internal(message: impl Into<String>) -> JobFailure {
        JobFailure {
            message: message.into(),
            kind: FailureKind::Internal,
        }
    }

    /// The request's grammar failed while generating (400): llguidance's per-step limits
    /// (e.g. a row of more than 2000 parser items), reached only once output has begun.
    pub fn grammar(e: &hmoe_grammar::GrammarError) -> JobFailure {
        JobFailure {
            message: e.to_string(),
            kind: FailureKind::Request,
        }
    }

    /// A failed forward pass: a device out of memory is a 503, anything else a 500.
    pub fn of_model_error(e: &ModelError) -> JobFailure {
        let oom = e.is_out_of_memory();
        JobFailure {
            message: match oom {
                true => format!(
                    "no device memory for this request's KV cache now ({e}); try again later"
                ),
                false => format!("inference failed: {e}"),
            },
            kind: match oom {
                true => FailureKind::Unavailable,
                false => FailureKind::Internal,
            },
        }
    }

    /// The HTTP error it becomes.
    pub fn api_error(&self) -> ApiError {
        match self.kind {
            FailureKind::Unavailable => ApiError::unavailable(self.message.clone()),
            FailureKind::Internal => ApiError::internal(self.message.clone()),
            FailureKind::Request => ApiError::bad_request(self.message.clone()),
        }
    }
}

/// Why a request was not queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The queue is full.
    #[error("the server is busy: all slots are in use and the queue is full, try again later")]
    QueueFull,
    /// The model is being unloaded or the server is stopping.
    #[error("the model is shutting down")]
    ShuttingDown,
}

/// What the worker does with a slot.
pub(super) enum SlotCommand {
    /// Its tokens and K/V.
    Save(oneshot::Sender<Result<SlotState, SlotActionError>>),
    /// Replace its cache with a saved one; answers the tokens restored.
    Restore(
        Box<SlotState>,
        oneshot::Sender<Result<usize, SlotActionError>>,
    ),
    /// Empty its cache; answers the tokens it held.
    Erase(oneshot::Sender<Result<usize, SlotActionError>>),
}

/// A command for slot `slot`.
pub(super) struct SlotRequest {
    pub(super) slot: usize,
    pub(super) command: SlotCommand,
}

/// Why a slot action failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotActionError {
    /// No slot of that id.
    #[error("Invalid slot ID: the server has {n_slots} slots (0 to {})", n_slots.saturating_sub(1))]
    NoSuchSlot {
        /// How many slots there are.
        n_slots: usize,
    },
    /// The slot runs a request.
    #[error("slot {0} is processing a request; try again once it is idle")]
    Busy(usize),
    /// The saved K/V does not fit this slot's cache (another context, micro-batch or K/V type).
    #[error("the saved K/V does not fit this slot: {0}")]
    Mismatch(String),
    /// The device has no memory for the K/V now.
    #[error("no device memory for the slot's K/V now ({0}); try again later")]
    OutOfMemory(String),
    /// The device failed.
    #[error("the slot action failed: {0}")]
    Device(String),
    /// The model is being unloaded or the server is stopping.
    #[error("the model is shutting down")]
    ShuttingDown,
}

impl SlotActionError {
    /// The HTTP error it becomes.
    pub fn api_error(&self) -> ApiError {
        match self {
            SlotActionError::NoSuchSlot { .. } | SlotActionError::Mismatch(_) => {
                ApiError::bad_request(self.to_string())
            }
            SlotActionError::Busy(_) => ApiError::conflict(self.to_string()),
            SlotActionError::OutOfMemory(_) | SlotActionError::ShuttingDown => {
                ApiError::unavailable(self.to_string())
            }
            SlotActionError::Device(_) => ApiError::internal(self.to_string()),
        }
    }
}
