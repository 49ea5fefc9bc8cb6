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
//! ([`KvCache::truncate`] refuses).
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

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use hmoe_chat::ChatDelta;
use hmoe_engine::{top_probs, Sampler, SamplerParams};
use hmoe_model::{KvCache, KvType, LanguageModel, ModelError, SeqBatch};
use hmoe_tokenizer::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::error::ApiError;
use crate::metrics::Stats;
use crate::output::{OutputKind, OutputState};
use crate::sampling::{log_softmax_at, log_sum_exp, LogitAdjust, PickerFactory, TokenPicker};

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
    /// Whether the server lacked a resource that may free up (the device had no memory for
    /// the request's K/V cache): 503 rather than 500.
    pub unavailable: bool,
}

impl JobFailure {
    /// A failure that is no lack of resources (500).
    pub fn internal(message: impl Into<String>) -> JobFailure {
        JobFailure {
            message: message.into(),
            unavailable: false,
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
            unavailable: oom,
        }
    }

    /// The HTTP error it becomes.
    pub fn api_error(&self) -> ApiError {
        match self.unavailable {
            true => ApiError::unavailable(self.message.clone()),
            false => ApiError::internal(self.message.clone()),
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
}

/// Which cached positions a new request may reuse without changing its results, as measured on
/// the model when the slots start ([`measure_reuse`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reuse {
    /// Every cached position: splitting a prompt and one-token passes change no bit.
    All,
    /// Positions computed in prompt chunks of two or more tokens: splitting a prompt changes
    /// nothing, one-token passes do.
    PromptChunks,
    /// Whole micro-batches counted from position 0 only (a token's result depends on the size
    /// of its pass).
    Aligned,
}

/// Measures which splits of a prompt leave `model`'s results unchanged, bit for bit, in caches
/// of the slots' geometry: one prefill of 40 tokens against the same tokens split in two at
/// three points (chunks of 2 to 38 tokens, across the kernels' tile sizes), and against a
/// prefill followed by four one-token passes. Any error or a context under 16 positions gives
/// [`Reuse::Aligned`], which never changes results.
pub fn measure_reuse(
    model: &dyn LanguageModel,
    kv_type: KvType,
    n_ctx: usize,
    n_ubatch: usize,
) -> Reuse {
    let n = 40.min(n_ctx.saturating_sub(1));
    if n < 16 || model.n_vocab() == 0 {
        return Reuse::Aligned;
    }
    let n_vocab = model.n_vocab() as u64;
    let tokens: Vec<u32> = (0..n as u64)
        .map(|i| ((i * 7919 + 13) % n_vocab) as u32)
        .collect();
    let last_logits = |parts: &[&[u32]]| -> Option<Vec<f32>> {
        let mut cache = model.new_cache(kv_type, n_ctx, n_ubatch);
        let mut logits = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let mut seq = [SeqBatch {
                cache: &mut cache,
                tokens: part,
                logits: i + 1 == parts.len(),
            }];
            logits = model.forward_multi(&mut seq).ok()?.pop()?;
        }
        Some(logits)
    };
    let Some(cold) = last_logits(&[&tokens]) else {
        return Reuse::Aligned;
    };
    let same = |l: Option<Vec<f32>>| {
        l.is_some_and(|l| {
            l.len() == cold.len() && l.iter().zip(&cold).all(|(a, b)| a.to_bits() == b.to_bits())
        })
    };
    let splits_free = [3, 17, n - 2]
        .into_iter()
        .all(|k| same(last_logits(&[&tokens[..k], &tokens[k..]])));
    if !splits_free {
        return Reuse::Aligned;
    }
    let m = n - 4;
    let mut parts: Vec<&[u32]> = vec![&tokens[..m]];
    parts.extend(tokens[m..].chunks(1));
    match same(last_logits(&parts)) {
        true => Reuse::All,
        false => Reuse::PromptChunks,
    }
}

struct Job {
    spec: JobSpec,
    events: UnboundedSender<JobEvent>,
    id: u64,
}

struct Queue {
    jobs: VecDeque<Job>,
    free_slots: usize,
    next_id: u64,
    shutdown: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    views: Mutex<Vec<SlotView>>,
    stats: Arc<Stats>,
    max_queue: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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
        let slots: Vec<Slot> = (0..n_slots)
            .map(|id| Slot {
                id,
                cache: model.new_cache(config.kv_type, config.n_ctx_slot, config.n_ubatch),
                tokens: Vec::new(),
                n_exact: 0,
                last_used: 0,
                active: None,
            })
            .collect();
        stats
            .kv_capacity
            .store((n_slots * config.n_ctx_slot) as u64, Relaxed);
        let views = slots
            .iter()
            .map(|s| SlotView {
                id: s.id,
                n_ctx: config.n_ctx_slot,
                ..SlotView::default()
            })
            .collect();
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                free_slots: n_slots,
                next_id: 0,
                shutdown: false,
            }),
            wake: Condvar::new(),
            views: Mutex::new(views),
            stats,
            max_queue: config.max_queue,
        });
        let worker = Worker {
            model,
            tok: tokenizer,
            slots,
            shared: shared.clone(),
            picker,
            n_ubatch: config.n_ubatch.max(1),
            n_ctx_slot: config.n_ctx_slot,
            similarity: config.slot_prompt_similarity,
            reuse: Reuse::Aligned,
            clock: 0,
        };
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

struct Slot {
    id: usize,
    cache: KvCache,
    /// The tokens whose keys and values are in `cache`.
    tokens: Vec<u32>,
    /// Leading cached positions that a cold prefill of a longer prompt computes the same way
    /// (see [`Reuse`]).
    n_exact: usize,
    last_used: u64,
    active: Option<Active>,
}

struct Active {
    job: Job,
    /// Next prompt index to run.
    prompt_pos: usize,
    n_cached: usize,
    /// The token to run next once the prompt is done.
    next: Option<u32>,
    picker: Box<dyn TokenPicker>,
    constraint: Option<hmoe_grammar::Constraint>,
    output: OutputState,
    generated: Vec<u32>,
    counts: HashMap<u32, usize>,
    started: Instant,
    first_token: Option<Instant>,
}

struct Worker {
    model: Arc<dyn LanguageModel>,
    tok: Arc<Tokenizer>,
    slots: Vec<Slot>,
    shared: Arc<Shared>,
    picker: Option<PickerFactory>,
    n_ubatch: usize,
    n_ctx_slot: usize,
    similarity: f32,
    reuse: Reuse,
    clock: u64,
}

/// What one slot runs in a pass.
struct Feed {
    slot: usize,
    tokens: Vec<u32>,
    prefill: bool,
    logits: bool,
}

impl Worker {
    fn run(mut self) {
        self.reuse = measure_reuse(
            self.model.as_ref(),
            self.slots[0].cache.kv_type(),
            self.n_ctx_slot,
            self.n_ubatch,
        );
        tracing::debug!("prompt cache reuse: {:?}", self.reuse);
        // Frees what the probes left on a device.
        self.retain_caches();
        loop {
            {
                let shared = self.shared.clone();
                let mut q = lock(&shared.queue);
                loop {
                    if q.shutdown {
                        drop(q);
                        self.fail_all("the model was unloaded or the server is stopping");
                        return;
                    }
                    self.admit(&mut q);
                    if self.slots.iter().any(|s| s.active.is_some()) {
                        break;
                    }
                    q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            }
            // Show admitted requests before any of their output can reach a client.
            self.publish();
            let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step()));
            if stepped.is_err() {
                // A bug must not take the model down: fail what was running and start clean.
                tracing::error!("a forward step panicked; failing the running requests");
                for i in 0..self.slots.len() {
                    let s = &mut self.slots[i];
                    s.cache.clear();
                    s.tokens.clear();
                    s.n_exact = 0;
                    if let Some(a) = &s.active {
                        let _ = a.job.events.send(JobEvent::Failed(JobFailure::internal(
                            "internal error while generating",
                        )));
                    }
                    self.release(i);
                }
            }
            self.publish();
        }
    }

    fn fail_all(&mut self, why: &str) {
        let mut q = lock(&self.shared.queue);
        for job in q.jobs.drain(..) {
            let _ = job.events.send(JobEvent::Failed(JobFailure::internal(why)));
        }
        drop(q);
        for i in 0..self.slots.len() {
            if let Some(a) = self.slots[i].active.take() {
                let _ = a
                    .job
                    .events
                    .send(JobEvent::Failed(JobFailure::internal(why)));
            }
        }
        self.shared.stats.requests_processing.store(0, Relaxed);
        self.shared.stats.requests_deferred.store(0, Relaxed);
    }

    /// Moves queued jobs into free slots.
    fn admit(&mut self, q: &mut Queue) {
        while self.slots.iter().any(|s| s.active.is_none()) {
            let Some(job) = q.jobs.pop_front() else { break };
            if job.events.is_closed() {
                Stats::add(&self.shared.stats.requests_cancelled, 1);
                continue;
            }
            if job.spec.prompt.is_empty() || job.spec.prompt.len() >= self.n_ctx_slot {
                let _ = job
                    .events
                    .send(JobEvent::Failed(JobFailure::internal(format!(
                        "the prompt ({} tokens) does not fit in a slot's context ({})",
                        job.spec.prompt.len(),
                        self.n_ctx_slot
                    ))));
                continue;
            }
            let slot = self.pick_slot(&job.spec);
            self.start_job(slot, job);
            q.free_slots -= 1;
        }
        self.shared
            .stats
            .requests_deferred
            .store(q.jobs.len() as u64, Relaxed);
        let busy = self.slots.iter().filter(|s| s.active.is_some()).count();
        self.shared
            .stats
            .requests_processing
            .store(busy as u64, Relaxed);
    }

    /// The idle slot sharing the longest reusable prefix with the prompt when that is more
    /// than `similarity` of it, else the least recently used idle slot.
    fn pick_slot(&self, spec: &JobSpec) -> usize {
        let idle = self.slots.iter().filter(|s| s.active.is_none());
        let best = idle
            .clone()
            .filter(|_| spec.cache_prompt && self.similarity > 0.0)
            .map(|s| (self.reusable(s, &spec.prompt), s))
            .filter(|(n, _)| {
                *n > 0 && *n as f64 > self.similarity as f64 * spec.prompt.len() as f64
            })
            .max_by_key(|(n, s)| (*n, std::cmp::Reverse(s.id)));
        match best {
            Some((_, s)) => s.id,
            None => idle.min_by_key(|s| (s.last_used, s.id)).map_or(0, |s| s.id),
        }
    }

    /// Leading positions of `prompt` that slot `s` can serve from its cache without changing
    /// results (at least one prompt token is always left to run, for its logits).
    fn reusable(&self, s: &Slot, prompt: &[u32]) -> usize {
        // A device cache freed to make room for another sequence holds nothing.
        if !self.model.cache_held(&s.cache) {
            return 0;
        }
        let ub = self.n_ubatch;
        let mut keep = common_prefix(&s.tokens, prompt)
            .min(s.n_exact)
            .min(prompt.len().saturating_sub(1));
        match self.reuse {
            // The rest of the prompt is chunked as from scratch only from a chunk boundary.
            Reuse::Aligned => keep -= keep % ub,
            // A resumed prompt must not start with a lone token where a cold run has more.
            Reuse::PromptChunks
                if !keep.is_multiple_of(ub)
                    && ((keep / ub + 1) * ub).min(prompt.len()) - keep == 1 =>
            {
                keep -= 1
            }
            Reuse::PromptChunks | Reuse::All => {}
        }
        keep
    }

    fn start_job(&mut self, slot: usize, mut job: Job) {
        let mut keep = match job.spec.cache_prompt {
            true => self.reusable(&self.slots[slot], &job.spec.prompt),
            false => 0,
        };
        let s = &mut self.slots[slot];
        let prompt = &job.spec.prompt;
        if !s.cache.truncate(keep) {
            keep = 0;
        }
        if keep == 0 {
            s.cache.clear();
        }
        s.tokens.truncate(keep);
        s.n_exact = s.n_exact.min(keep);
        let mut picker: Box<dyn TokenPicker> = match &self.picker {
            Some(f) => f(&job.spec.sampling),
            None => Box::new(Sampler::new(job.spec.sampling.clone())),
        };
        for &t in prompt {
            picker.accept(t);
        }
        let output = OutputState::new(job.spec.output.clone(), job.spec.stop.clone());
        s.active = Some(Active {
            constraint: job.spec.constraint.take(),
            prompt_pos: keep,
            n_cached: keep,
            next: None,
            picker,
            output,
            generated: Vec::new(),
            counts: HashMap::new(),
            started: Instant::now(),
            first_token: None,
            job,
        });
    }

    /// Plans and runs one forward pass, then handles its logits.
    fn step(&mut self) {
        self.clock += 1;
        for i in 0..self.slots.len() {
            let closed = self.slots[i]
                .active
                .as_ref()
                .is_some_and(|a| a.job.events.is_closed());
            if closed {
                Stats::add(&self.shared.stats.requests_cancelled, 1);
                self.release(i);
            }
        }
        let mut feeds = self.plan();
        if feeds.is_empty() {
            return;
        }
        self.retain_caches();
        // The batch lists sequences in slot order; results come back in that order.
        feeds.sort_unstable_by_key(|f| f.slot);
        let n_tokens: usize = feeds.iter().map(|f| f.tokens.len()).sum();
        let n_past: Vec<usize> = (feeds.iter())
            .map(|f| self.slots[f.slot].cache.n_past())
            .collect();
        let result = {
            let mut by_slot: Vec<Option<&Feed>> = vec![None; self.slots.len()];
            for f in &feeds {
                by_slot[f.slot] = Some(f);
            }
            let mut seqs: Vec<SeqBatch<'_, '_>> = self
                .slots
                .iter_mut()
                .zip(&by_slot)
                .filter_map(|(s, f)| {
                    f.map(|f| SeqBatch {
                        cache: &mut s.cache,
                        tokens: &f.tokens,
                        logits: f.logits,
                    })
                })
                .collect();
            self.model.forward_multi(&mut seqs)
        };
        let stats = &self.shared.stats;
        Stats::add(&stats.n_decode, 1);
        Stats::add(&stats.n_busy_slots, feeds.len() as u64);
        stats.n_tokens_max.fetch_max(n_tokens as u64, Relaxed);
        match result {
            Err(e) if feeds.len() > 1 => {
                // A sequence's result does not depend on the others in its pass, so each runs
                // alone from where it was, and only those that fail alone fail (one the
                // device has no K/V memory for gets 503; the others go on).
                tracing::warn!("a batched pass failed ({e}); running its sequences one by one");
                for (f, n_past) in feeds.into_iter().zip(n_past) {
                    let cache = &mut self.slots[f.slot].cache;
                    if cache.n_past() != n_past && !cache.truncate(n_past) {
                        self.fail_feed(f.slot, &e);
                        continue;
                    }
                    let mut seq = [SeqBatch {
                        cache,
                        tokens: &f.tokens,
                        logits: f.logits,
                    }];
                    match self.model.forward_multi(&mut seq) {
                        Ok(mut logits) => {
                            let logits = logits.pop().unwrap_or_default();
                            self.after_pass(f, logits);
                        }
                        Err(e) => self.fail_feed(f.slot, &e),
                    }
                }
            }
            Err(e) => {
                for f in &feeds {
                    self.fail_feed(f.slot, &e);
                }
            }
            Ok(all_logits) => {
                for (f, logits) in feeds.into_iter().zip(all_logits) {
                    self.after_pass(f, logits);
                }
            }
        }
    }

    /// Fails the request of `slot` after a failed pass, and empties its cache.
    fn fail_feed(&mut self, slot: usize, e: &ModelError) {
        let failure = JobFailure::of_model_error(e);
        tracing::error!("slot {slot}: {}", failure.message);
        let s = &mut self.slots[slot];
        s.cache.clear();
        s.tokens.clear();
        s.n_exact = 0;
        if let Some(a) = &s.active {
            let _ = a.job.events.send(JobEvent::Failed(failure));
        }
        self.release(slot);
    }

    /// Tells the model which caches are alive (every slot's) and which run a request, so that
    /// a device executor frees the others and never frees a running one to make room.
    fn retain_caches(&self) {
        let caches = |busy: bool| -> Vec<&KvCache> {
            (self.slots.iter())
                .filter(|s| s.active.is_some() == busy)
                .map(|s| &s.cache)
                .collect()
        };
        self.model.retain_caches(&caches(true), &caches(false));
    }

    /// Decode tokens of generating slots, then prompt chunks in arrival order within one
    /// micro-batch of prompt tokens (the first chunk is always taken).
    fn plan(&self) -> Vec<Feed> {
        let mut feeds = Vec::new();
        let mut prefills: Vec<(u64, usize)> = Vec::new();
        for s in &self.slots {
            let Some(a) = &s.active else { continue };
            match a.next {
                Some(t) => feeds.push(Feed {
                    slot: s.id,
                    tokens: vec![t],
                    prefill: false,
                    logits: true,
                }),
                None => prefills.push((a.job.id, s.id)),
            }
        }
        prefills.sort_unstable();
        let mut budget = self.n_ubatch;
        for (_, slot) in prefills {
            let Some(a) = &self.slots[slot].active else {
                continue;
            };
            let prompt = &a.job.spec.prompt;
            // Chunks end at multiples of n_ubatch counted from position 0, as in a cold run.
            let chunk_end = ((a.prompt_pos / self.n_ubatch + 1) * self.n_ubatch).min(prompt.len());
            let n = chunk_end - a.prompt_pos;
            if n > budget && budget < self.n_ubatch {
                break;
            }
            budget = budget.saturating_sub(n);
            feeds.push(Feed {
                slot,
                tokens: prompt[a.prompt_pos..chunk_end].to_vec(),
                prefill: true,
                logits: chunk_end == prompt.len(),
            });
            if budget == 0 {
                break;
            }
        }
        feeds
    }

    fn after_pass(&mut self, feed: Feed, logits: Vec<f32>) {
        let stats = self.shared.stats.clone();
        let s = &mut self.slots[feed.slot];
        // Which positions a cold prefill of a longer prompt computes the same way: with
        // one-token micro-batches every one; else prompt chunks of several tokens, and one-token
        // passes too where the model was measured not to care (see `Reuse`).
        let exact = self.n_ubatch == 1
            || self.reuse == Reuse::All
            || (feed.prefill && feed.tokens.len() > 1);
        if exact && s.n_exact == s.tokens.len() {
            s.n_exact += feed.tokens.len();
        }
        s.tokens.extend_from_slice(&feed.tokens);
        let Some(a) = &mut s.active else { return };
        if feed.prefill {
            a.prompt_pos += feed.tokens.len();
            Stats::add(&stats.prompt_tokens, feed.tokens.len() as u64);
            if a.prompt_pos < a.job.spec.prompt.len() {
                return;
            }
        }
        self.on_logits(feed.slot, logits);
    }

    /// Picks the next token of a slot from its logits and reports it.
    fn on_logits(&mut self, slot: usize, mut logits: Vec<f32>) {
        let tok = self.tok.clone();
        let n_ctx = self.n_ctx_slot;
        let s = &mut self.slots[slot];
        let n_past = s.cache.n_past();
        let Some(a) = &mut s.active else { return };
        let now = Instant::now();
        if a.first_token.is_none() {
            a.first_token = Some(now);
        }
        if a.job.spec.n_predict == Some(0) {
            let deltas = a.output.finish();
            self.finish(slot, Finish::Length, deltas, Vec::new());
            return;
        }
        let spec = &a.job.spec;
        let want_probs = spec.logprobs || spec.n_probs > 0;
        let lse = if want_probs {
            log_sum_exp(&logits)
        } else {
            0.0
        };
        let raw = if want_probs && (!spec.adjust.is_noop() || a.constraint.is_some()) {
            Some(logits.clone())
        } else {
            None
        };
        if !spec.adjust.is_noop() {
            spec.adjust.apply(&mut logits, &a.counts);
        }
        if let Some(c) = &mut a.constraint {
            if let Err(e) = c.mask(&mut logits) {
                let _ = (a.job.events).send(JobEvent::Failed(JobFailure::internal(e.to_string())));
                self.release(slot);
                return;
            }
        }
        let post = if want_probs && spec.post_sampling_probs {
            a.picker.distribution(&logits)
        } else {
            None
        };
        let token = a.picker.pick(&logits);
        if let Some(r) = raw {
            logits = r;
        }
        // The grammar is complete once it allows nothing more (its end-of-generation token).
        let mut grammar_done = false;
        if let Some(c) = &mut a.constraint {
            if let Err(e) = c.accept(token) {
                let _ = (a.job.events).send(JobEvent::Failed(JobFailure::internal(e.to_string())));
                self.release(slot);
                return;
            }
            grammar_done = c.is_finished();
        }
        a.picker.accept(token);
        a.generated.push(token);
        *a.counts.entry(token).or_default() += 1;
        let probs = match post {
            _ if !want_probs => Vec::new(),
            Some(dist) => vec![TokenLogprob {
                id: token,
                logprob: dist
                    .iter()
                    .find(|c| c.0 == token)
                    .map_or(f32::NEG_INFINITY, |c| c.1.ln() as f32),
                top: dist
                    .iter()
                    .take(spec.n_probs)
                    .map(|&(id, p)| (id, p.ln() as f32))
                    .collect(),
            }],
            None => vec![TokenLogprob {
                id: token,
                logprob: log_softmax_at(&logits, token, lse),
                top: if spec.n_probs > 0 {
                    top_probs(&logits, spec.n_probs)
                        .into_iter()
                        .map(|(id, p)| (id, (p as f64).ln() as f32))
                        .collect()
                } else {
                    Vec::new()
                },
            }],
        };
        let eog = tok.is_eog(token) && !spec.ignore_eos;
        let deltas = if eog && !a.output.reads_eog() {
            Vec::new()
        } else {
            a.output.push(&tok, token)
        };
        let finish = if eog || grammar_done || a.output.ended() {
            Some(Finish::Eog)
        } else if let Some(w) = a.output.stop_hit() {
            Some(Finish::StopWord(w.to_string()))
        } else if spec.n_predict.is_some_and(|n| a.generated.len() >= n) || n_past + 1 > n_ctx {
            Some(Finish::Length)
        } else {
            None
        };
        match finish {
            Some(f) => {
                let mut deltas = deltas;
                deltas.extend(a.output.finish());
                self.finish(slot, f, deltas, probs);
            }
            None => {
                let sent = if deltas.is_empty() && probs.is_empty() {
                    true
                } else {
                    a.job
                        .events
                        .send(JobEvent::Output { deltas, probs })
                        .is_ok()
                };
                if sent {
                    a.next = Some(token);
                } else {
                    Stats::add(&self.shared.stats.requests_cancelled, 1);
                    self.release(slot);
                }
            }
        }
    }

    fn finish(
        &mut self,
        slot: usize,
        finish: Finish,
        deltas: Vec<ChatDelta>,
        probs: Vec<TokenLogprob>,
    ) {
        let s = &mut self.slots[slot];
        let Some(a) = &s.active else { return };
        let now = Instant::now();
        let first = a.first_token.unwrap_or(now);
        let prompt_ms = first.duration_since(a.started).as_secs_f64() * 1e3;
        let decode_ms = now.duration_since(first).as_secs_f64() * 1e3;
        let summary = Summary {
            finish,
            n_prompt: a.job.spec.prompt.len(),
            n_cached: a.n_cached,
            n_generated: a.generated.len(),
            prompt_ms,
            decode_ms,
            slot,
            tokens: a.generated.clone(),
        };
        if !deltas.is_empty() || !probs.is_empty() {
            let _ = a.job.events.send(JobEvent::Output { deltas, probs });
        }
        let _ = a.job.events.send(JobEvent::Done(summary));
        self.release(slot);
    }

    /// Frees a slot, whatever ended its request, and accounts for the request's work.
    fn release(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        if let Some(a) = s.active.take() {
            s.last_used = self.clock;
            lock(&self.shared.queue).free_slots += 1;
            let now = Instant::now();
            let stats = &self.shared.stats;
            match a.first_token {
                Some(first) => {
                    Stats::add(
                        &stats.prompt_us,
                        first.duration_since(a.started).as_micros() as u64,
                    );
                    Stats::add(
                        &stats.predicted_us,
                        now.duration_since(first).as_micros() as u64,
                    );
                }
                None => Stats::add(
                    &stats.prompt_us,
                    now.duration_since(a.started).as_micros() as u64,
                ),
            }
            Stats::add(&stats.predicted_tokens, a.generated.len() as u64);
        }
    }

    /// Publishes the slot views and KV usage.
    fn publish(&self) {
        let views: Vec<SlotView> = self
            .slots
            .iter()
            .map(|s| SlotView {
                id: s.id,
                n_ctx: self.n_ctx_slot,
                is_processing: s.active.is_some(),
                id_task: s.active.as_ref().map(|a| a.job.id),
                n_past: s.cache.n_past(),
                n_prompt: s.active.as_ref().map_or(0, |a| a.job.spec.prompt.len()),
                n_decoded: s.active.as_ref().map_or(0, |a| a.generated.len()),
            })
            .collect();
        let kv: usize = views.iter().map(|v| v.n_past).sum();
        self.shared.stats.kv_tokens.store(kv as u64, Relaxed);
        let busy = views.iter().filter(|v| v.is_processing).count();
        self.shared
            .stats
            .requests_processing
            .store(busy as u64, Relaxed);
        *lock(&self.shared.views) = views;
    }
}

/// Length of the common prefix of two token sequences.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefixes() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
    }
}
