//! Slots and continuous batching.
//!
//! One worker thread per model owns `n_parallel` slots (a KV cache each). Requests wait in a
//! bounded queue; each loop iteration admits waiting requests into free slots and then runs one
//! forward pass holding the next token of every generating slot plus prompt chunks of new
//! requests (at most one micro-batch of prompt tokens per pass, so a new prompt delays running
//! streams by at most one micro-batch). The model's batched forward returns for each sequence
//! exactly what it would return alone, so a request's tokens do not depend on what else runs
//! beside it.
//!
//! A slot keeps its cache after a request ends; the next request goes to the idle slot whose
//! cache shares the longest usable prefix with its prompt (when that prefix is more than
//! `slot_prompt_similarity` of the prompt, as llama-server's `--slot-prompt-similarity`; else
//! to the least recently used slot) and computes only the rest. Reuse must not change
//! results: a request served from a cached prefix gets exactly the tokens of a cold run. The
//! kernels follow ggml's numerics, in which a token's result can depend on how many tokens
//! share its pass (K-quant tiles, tinyBLAS for f32 weights, single-token GEMV), so at start
//! the worker measures which splits of a prompt leave the results unchanged (see [`Reuse`])
//! and reuses cached positions only where that holds:
//! - every cached position (prompt and generated tokens) when one-token passes and any split
//!   of a prompt give the same bits as one prefill (gpt-oss's MXFP4/Q8_0 kernels);
//! - the positions computed in prompt chunks of two or more tokens when only splits are free
//!   (generated tokens are computed again, in a batch);
//! - otherwise whole micro-batches counted from position 0, as a cold prefill cuts them.
//!
//! Prompts are always cut at multiples of the micro-batch counted from position 0 (as a cold
//! run cuts them), and a resumed prompt never starts with a lone token where a cold run would
//! not have one. A sliding-window layer's ring holds only `window + ubatch` positions; a cache
//! that would have to go back further than that is recomputed from position 0
//! ([`hmoe_model::KvCache::truncate`] refuses).
//!
//! Slot actions (save, restore, erase a slot's cache: `--slot-save-path`) wait in the same
//! queue and run on the worker between two passes, on idle slots only; a restored slot's
//! tokens then serve the next request's prefix as if it had computed them.
//!
//! A request whose receiver is gone (the client disconnected) is dropped before the next pass
//! and its slot freed.
//!
//! On the device executor the slots' K/V caches live on the device. Before each pass the
//! worker names the slots' caches, busy and idle ([`LanguageModel::retain_caches`]): a busy
//! slot's device cache is never freed to make room, an idle one's may be, and its prompt cache
//! then counts as empty ([`LanguageModel::cache_held`]). A pass of several sequences that fails
//! runs each sequence alone from where it was (results do not depend on the batch), so only
//! the request that cannot run fails; one the device has no K/V memory for gets 503.

mod jobs;
mod prefix_reuse;
mod shared;
mod slot_actions;
mod worker;

pub use jobs::{
    FailureKind, Finish, JobEvent, JobFailure, JobSpec, SlotActionError, SubmitError, Summary,
    TokenLogprob,
};
pub use prefix_reuse::{measure_reuse, Reuse};
pub use shared::{SlotConfig, SlotView};

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use hmoe_model::LanguageModel;
use hmoe_tokenizer::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::metrics::Stats;
use crate::sampling::PickerFactory;
use crate::scheduler::shared::{lock, Job, Queue, Shared};
use crate::scheduler::worker::Worker;

/// The slots of one model and the thread that runs them.
pub struct Scheduler {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    config: SlotConfig,
}

impl Scheduler {
    /// Allocates the slots' caches and starts the worker thread.
    pub fn start(
        model: Arc<dyn LanguageModel>,
        tokenizer: Arc<Tokenizer>,
        config: SlotConfig,
        picker: Option<PickerFactory>,
        stats: Arc<Stats>,
    ) -> std::io::Result<Scheduler> {
        let n_slots = config.n_slots.max(1);
        stats
            .kv_capacity
            .store((n_slots * config.n_ctx_slot) as u64, Relaxed);
        let views = (0..n_slots)
            .map(|id| SlotView {
                id,
                n_ctx: config.n_ctx_slot,
                ..SlotView::default()
            })
            .collect();
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                commands: VecDeque::new(),
                free_slots: n_slots,
                next_id: 0,
                shutdown: false,
            }),
            wake: Condvar::new(),
            views: Mutex::new(views),
            stats,
            max_queue: config.max_queue,
        });
        let worker = Worker::new(model, tokenizer, &config, shared.clone(), picker);
        let thread = std::thread::Builder::new()
            .name("hmoe-slots".into())
            .spawn(move || worker.run())?;
        Ok(Scheduler {
            shared,
            thread: Some(thread),
            config,
        })
    }

    /// The slot setup.
    pub fn config(&self) -> &SlotConfig {
        &self.config
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the request.
    pub fn submit(&self, spec: JobSpec) -> Result<(u64, UnboundedReceiver<JobEvent>), SubmitError> {
        let (tx, rx) = unbounded_channel();
        let mut q = lock(&self.shared.queue);
        if q.shutdown {
            return Err(SubmitError::ShuttingDown);
        }
        // Jobs that free slots will take at once do not count against the queue.
        if q.jobs.len() >= self.shared.max_queue + q.free_slots {
            Stats::add(&self.shared.stats.requests_rejected, 1);
            return Err(SubmitError::QueueFull);
        }
        let id = q.next_id;
        q.next_id += 1;
        q.jobs.push_back(Job {
            spec,
            events: tx,
            id,
        });
        Stats::add(&self.shared.stats.requests_total, 1);
        self.shared
            .stats
            .requests_deferred
            .store(q.jobs.len() as u64, Relaxed);
        drop(q);
        self.shared.wake.notify_one();
        Ok((id, rx))
    }

    /// The slots now.
    pub fn slots(&self) -> Vec<SlotView> {
        lock(&self.shared.views).clone()
    }

    /// Stops the worker: running and queued requests fail, new ones are refused.
    pub fn shutdown(&self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.wake.notify_all();
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
