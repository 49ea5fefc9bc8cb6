//! The worker thread of one model's slots: admits waiting requests, runs one forward pass per
//! step for every busy slot, samples, and sends each request its events.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use hmoe_chat::ChatDelta;
use hmoe_engine::{top_probs, Sampler, TOP_K_MAX};
use hmoe_model::{KvCache, LanguageModel, ModelError, SeqBatch, TokenLogits};
use hmoe_tokenizer::Tokenizer;

use crate::metrics::Stats;
use crate::output::OutputState;
use crate::sampling::{log_softmax_at, log_sum_exp, PickerFactory, TokenPicker};
use crate::scheduler::jobs::{Finish, JobEvent, JobFailure, JobSpec, Summary, TokenLogprob};
use crate::scheduler::prefix_reuse::{common_prefix, measure_reuse, Reuse};
use crate::scheduler::shared::{lock, Job, Queue, Shared, SlotConfig, SlotView};

mod slot_commands;

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

pub(super) struct Worker {
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
    /// Whether a request's sampler may take a token's best logits alone, ranked on the device
    /// ([`SlotConfig::device_top_k`]).
    device_top_k: bool,
}

/// What one slot runs in a pass.
struct Feed {
    slot: usize,
    tokens: Vec<u32>,
    prefill: bool,
    logits: bool,
}

impl Worker {
    /// Allocates the slots' caches; [`Worker::run`] then serves them on its own thread.
    pub(super) fn new(
        model: Arc<dyn LanguageModel>,
        tok: Arc<Tokenizer>,
        config: &SlotConfig,
        shared: Arc<Shared>,
        picker: Option<PickerFactory>,
    ) -> Worker {
        let slots = (0..config.n_slots.max(1))
            .map(|id| Slot {
                id,
                cache: model.new_cache(config.kv_type, config.n_ctx_slot, config.n_ubatch),
                tokens: Vec::new(),
                n_exact: 0,
                last_used: 0,
                active: None,
            })
            .collect();
        Worker {
            model,
            tok,
            slots,
            shared,
            picker,
            n_ubatch: config.n_ubatch.max(1),
            n_ctx_slot: config.n_ctx_slot,
            similarity: config.slot_prompt_similarity,
            reuse: Reuse::Aligned,
            clock: 0,
            device_top_k: config.device_top_k,
        }
    }

    /// Serves the slots until the scheduler shuts down.
    pub(super) fn run(mut self) {
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
            let commands = {
                let shared = self.shared.clone();
                let mut q = lock(&shared.queue);
                loop {
                    if q.shutdown {
                        drop(q);
                        self.fail_all("the model was unloaded or the server is stopping");
                        return;
                    }
                    // Slot actions first, outside the queue's lock (they copy K/V).
                    if !q.commands.is_empty() {
                        break std::mem::take(&mut q.commands);
                    }
                    self.admit(&mut q);
                    if self.slots.iter().any(|s| s.active.is_some()) {
                        break Default::default();
                    }
                    q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            if !commands.is_empty() {
                for c in commands {
                    self.run_command(c);
                }
                continue;
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
        // Dropping their answer channels tells slot actions the model is going.
        q.commands.clear();
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
            // The first job that can start: a job pinned to a busy slot (`id_slot`) waits
            // without holding back the others.
            let idle = |id: usize| self.slots.get(id).is_some_and(|s| s.active.is_none());
            let Some(i) = (q.jobs.iter()).position(|j| j.spec.id_slot.is_none_or(idle)) else {
                break;
            };
            let Some(job) = q.jobs.remove(i) else { break };
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

    /// The slot the job pins (`id_slot`, idle when admitted), else the idle slot sharing the
    /// longest reusable prefix with the prompt when that is more
    /// than `similarity` of it, else the least recently used idle slot.
    fn pick_slot(&self, spec: &JobSpec) -> usize {
        if let Some(id) = spec.id_slot {
            return id;
        }
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
        let top: Vec<Option<usize>> = (feeds.iter()).map(|f| self.top_request(f)).collect();
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
            self.model.forward_multi_top(&mut seqs, &top)
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
                for ((f, n_past), top) in feeds.into_iter().zip(n_past).zip(top) {
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
                    match self.model.forward_multi_top(&mut seq, &[top]) {
                        Ok(mut logits) => {
                            let logits = logits.pop().unwrap_or(TokenLogits::Full(Vec::new()));
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

    fn after_pass(&mut self, feed: Feed, logits: TokenLogits) {
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

    /// How many of its best logits alone a feed's request samples from (`None`: the whole
    /// row): with [`Worker::device_top_k`] on, when the feed wants logits and the request
    /// changes none before its sampler (no logit bias, presence or frequency penalty, no
    /// grammar), reports no probabilities but the sampler's own (`post_sampling_probs`), and
    /// its sampler's chain needs no more ([`Sampler::top_needed`]).
    fn top_request(&mut self, feed: &Feed) -> Option<usize> {
        let a = self.slots[feed.slot].active.as_mut()?;
        let spec = &a.job.spec;
        let want_probs = spec.logprobs || spec.n_probs > 0;
        let allowed = self.device_top_k
            && feed.logits
            && spec.adjust.is_noop()
            && a.constraint.is_none()
            && (!want_probs || spec.post_sampling_probs);
        match allowed {
            true => a.picker.as_sampler()?.top_needed(TOP_K_MAX),
            false => None,
        }
    }

    /// Picks the next token of a slot from its logits and reports it.
    fn on_logits(&mut self, slot: usize, logits: TokenLogits) {
        let Some(a) = &mut self.slots[slot].active else {
            return;
        };
        if a.first_token.is_none() {
            a.first_token = Some(Instant::now());
        }
        if a.job.spec.n_predict == Some(0) {
            let deltas = a.output.finish();
            self.finish(slot, Finish::Length, deltas, Vec::new());
            return;
        }
        let spec = &a.job.spec;
        let want_probs = spec.logprobs || spec.n_probs > 0;
        let mut logits = match logits {
            TokenLogits::Full(logits) => logits,
            // Asked for by `top_request` only: the picker is a sampler, and the probabilities
            // reported are its own.
            TokenLogits::Top(top) => match a.picker.as_sampler() {
                Some(s) => {
                    let post = want_probs.then(|| s.distribution_top(&top));
                    let token = s.sample_top(&top);
                    self.on_token(slot, token, post, Vec::new(), 0.0);
                    return;
                }
                None => {
                    let failure = JobFailure::internal("best logits alone for a scripted picker");
                    let _ = a.job.events.send(JobEvent::Failed(failure));
                    self.release(slot);
                    return;
                }
            },
        };
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
                let _ = (a.job.events).send(JobEvent::Failed(JobFailure::grammar(&e)));
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
        self.on_token(slot, token, post, logits, lse);
    }

    /// Reports the token a slot's picker chose (with the distribution it chose from, when
    /// the request reports those probabilities, else the `logits` it reports them from, of
    /// log-sum-exp `lse`) and ends the request or queues the token.
    fn on_token(
        &mut self,
        slot: usize,
        token: u32,
        post: Option<Vec<(u32, f64)>>,
        logits: Vec<f32>,
        lse: f64,
    ) {
        let tok = self.tok.clone();
        let n_ctx = self.n_ctx_slot;
        let s = &mut self.slots[slot];
        let n_past = s.cache.n_past();
        let Some(a) = &mut s.active else { return };
        let now = Instant::now();
        let spec = &a.job.spec;
        let want_probs = spec.logprobs || spec.n_probs > 0;
        // The grammar is complete once it allows nothing more (its end-of-generation token).
        let mut grammar_done = false;
        if let Some(c) = &mut a.constraint {
            if let Err(e) = c.accept(token) {
                let _ = (a.job.events).send(JobEvent::Failed(JobFailure::grammar(&e)));
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
        // llama-server's `t_max_predict_ms`: a token holding a newline ends generation once
        // it has run that long since the prompt was processed.
        let out_of_time = spec.t_max_predict.is_some_and(|limit| {
            a.first_token
                .is_some_and(|t0| now.duration_since(t0) > limit)
                && tok.decode(&[token]).contains(&b'\n')
        });
        let finish = if eog || grammar_done || a.output.ended() {
            Some(Finish::Eog)
        } else if let Some(w) = a.output.stop_hit() {
            Some(Finish::StopWord(w.to_string()))
        } else if spec.n_predict.is_some_and(|n| a.generated.len() >= n)
            || n_past + 1 > n_ctx
            || out_of_time
        {
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
        let n_ctx = self.n_ctx_slot;
        let s = &mut self.slots[slot];
        let Some(a) = &s.active else { return };
        let truncated = finish == Finish::Length
            && s.cache.n_past() + 1 > n_ctx
            && a.job.spec.n_predict.is_none_or(|n| a.generated.len() < n);
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
            truncated,
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
