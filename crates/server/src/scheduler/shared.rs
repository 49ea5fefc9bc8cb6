//! What the scheduler's handle and its worker thread share: the slot setup, the queue of
//! waiting requests and the slot views `/slots` shows.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use hmoe_model::KvType;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Stats;
use crate::scheduler::jobs::{JobEvent, JobSpec, SlotRequest};

/// A slot as shown by `/slots`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SlotView {
    /// Slot index.
    pub id: usize,
    /// Positions the slot can hold.
    pub n_ctx: usize,
    /// Whether a request runs in it.
    pub is_processing: bool,
    /// The request's task id.
    pub id_task: Option<u64>,
    /// Positions in its cache.
    pub n_past: usize,
    /// Prompt tokens of the request.
    pub n_prompt: usize,
    /// Tokens generated so far.
    pub n_decoded: usize,
}

/// How the slots are set up.
#[derive(Clone, Debug)]
pub struct SlotConfig {
    /// Number of slots.
    pub n_slots: usize,
    /// Context per slot.
    pub n_ctx_slot: usize,
    /// Micro-batch.
    pub n_ubatch: usize,
    /// KV element type.
    pub kv_type: KvType,
    /// Queue capacity.
    pub max_queue: usize,
    /// A request goes to the idle slot sharing the longest reusable prefix with its prompt only
    /// when that prefix is more than this fraction of the prompt (`--slot-prompt-similarity`,
    /// llama-server's default 0.1); else, and always with 0, to the least recently used slot.
    pub slot_prompt_similarity: f32,
    /// Whether a request whose sampler needs no more than a token's best logits gets only
    /// those, ranked on the device ([`crate::EngineConfig::device_top_k`]).
    pub device_top_k: bool,
}

pub(super) struct Job {
    pub(super) spec: JobSpec,
    pub(super) events: UnboundedSender<JobEvent>,
    pub(super) id: u64,
}

pub(super) struct Queue {
    pub(super) jobs: VecDeque<Job>,
    /// Slot actions waiting for the worker (run before the next admission).
    pub(super) commands: VecDeque<SlotRequest>,
    pub(super) free_slots: usize,
    pub(super) next_id: u64,
    pub(super) shutdown: bool,
}

pub(super) struct Shared {
    pub(super) queue: Mutex<Queue>,
    pub(super) wake: Condvar,
    pub(super) views: Mutex<Vec<SlotView>>,
    pub(super) stats: Arc<Stats>,
    pub(super) max_queue: usize,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
