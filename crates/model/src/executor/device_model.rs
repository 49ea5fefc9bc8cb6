//! [`DeviceModel`]: a model loaded onto a device, and how it runs a step: the sequences'
//! device caches made ready, the token ids and positions up, every layer, the logits down.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use hmoe_backend::KvType;
use hmoe_backend::{Backend, BackendError, KvLayout, RowCopy};
use hmoe_gguf::GgufModel;

use super::device_kv::{
    device_kv_layouts, handle_of, kv_action, rings_bytes, DeviceKv, Geometry, KvAction, LayerKv,
};
use super::device_weights::{buf_bytes, upload_f32, upload_matrix, DevMat};
use super::layer_experts::LayerExperts;
use super::micro_batches::{micro_batches_requested, split_point, StepState, Turns};
use super::moe_cache::MoeCache;
use super::scratch_arena::{Scratch, ScratchArena};
use super::segments::{step_shape, SegmentEpoch, Segments, SeqShape};
use super::state::State;
use super::step::{packed_rows, wanted_rows, DeviceLayers, Member, Step};
use crate::error::ModelError;
use crate::expert_placement::{ExpertHome, ExpertPlacement};
use crate::kv_snapshot::KvSnapshot;
use crate::language_model::{
    DeviceMemory, ExecStats, LanguageModel, LogitsWanted, MoeCacheStats, SeqBatch, TokenLogits,
};
use crate::sequence::KvCache;

mod snapshot;
mod top_logits;

/// A model with its dense part on a device `B` and each layer's routed experts where an
/// [`ExpertPlacement`] puts them (see the module docs for the data flow and the limits).
pub struct DeviceModel<B: Backend> {
    arch: Box<dyn DeviceLayers<B>>,
    dev: B,
    tok_embd: DevMat<B>,
    output_norm: B::Buf<f32>,
    output: DevMat<B>,
    /// Each layer's routed experts, where the placement put them.
    experts: LayerExperts<B>,
    op_offload_min_batch: Option<usize>,
    weight_bytes: u64,
    state: Mutex<State<B>>,
    /// The steps' temporaries, reused from step to step (`scratch_arena.rs`).
    scratch: ScratchArena<B>,
    /// Whether a step of several sequences may run as two micro-batches in flight
    /// (`micro_batches.rs`).
    micro_batches: AtomicBool,
}

impl<B: Backend> DeviceModel<B> {
    /// The model of the layers `arch` on `dev`: the routed experts where `placement` puts
    /// them, the embedding, the output norm and the head.
    pub(crate) fn with_layers(
        arch: Box<dyn DeviceLayers<B>>,
        dev: B,
        placement: &ExpertPlacement,
    ) -> Result<DeviceModel<B>, ModelError> {
        let dims = arch.dims();
        if placement.layers.len() != dims.n_layer {
            return Err(ModelError::Placement(format!(
                "{} layer homes for a {}-layer model",
                placement.layers.len(),
                dims.n_layer
            )));
        }
        let g = arch.gguf();
        let experts = LayerExperts::load(&dev, g, placement, |l| arch.layer_experts(l))?;
        let (d, n_vocab) = (dims.n_embd as u64, dims.n_vocab as u64);
        let tok_embd = upload_matrix(&dev, g, "token_embd.weight", &[d, n_vocab])?;
        // Tied embeddings: the head is the embedding.
        let head = match g.tensor_info("output.weight") {
            Some(_) => "output.weight",
            None => "token_embd.weight",
        };
        let output = upload_matrix(&dev, g, head, &[d, n_vocab])?;
        let output_norm = upload_f32(&dev, g, "output_norm.weight", &[d])?;
        let weight_bytes = arch.weight_bytes()
            + experts.bytes
            + tok_embd.bytes()
            + output.bytes()
            + buf_bytes::<B>(&output_norm);
        dev.synchronize()?;
        Ok(DeviceModel {
            arch,
            dev,
            tok_embd,
            output_norm,
            output,
            experts,
            op_offload_min_batch: placement.op_offload_min_batch,
            weight_bytes,
            state: Mutex::new(State::default()),
            scratch: ScratchArena::default(),
            micro_batches: AtomicBool::new(micro_batches_requested()),
        })
    }

    /// The device.
    pub fn device(&self) -> &B {
        &self.dev
    }

    /// Where each layer's routed experts run.
    pub fn expert_homes(&self) -> &[ExpertHome] {
        &self.experts.homes
    }

    /// The op offload threshold of the placement: micro-batches of at least this many tokens
    /// run host layers on the device with their routed experts uploaded (`None`: never).
    pub fn op_offload_min_batch(&self) -> Option<usize> {
        self.op_offload_min_batch
    }

    /// Bytes of weights uploaded at load.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Transfers at the expert boundary so far.
    pub fn stats(&self) -> ExecStats {
        ExecStats {
            transfers: self.dev.transfers(),
            ..self.lock().stats
        }
    }

    /// Sets the device expert cache of the host layers to `budget_bytes` (0 disables it),
    /// dropping what the previous cache held; see the `moe_cache` module docs. Layers whose
    /// experts are on the device are not cached. A budget too small for one expert of a host
    /// layer, or a placement with no host layer, is an error (the cache is then disabled).
    pub fn set_moe_cache(&self, budget_bytes: u64) -> Result<MoeCacheStats, ModelError> {
        let mut st = self.lock();
        st.moe_cache = MoeCache::default();
        let arch = self.arch.as_ref();
        let cache = MoeCache::new(|l| arch.layer_experts(l), &self.experts.homes, budget_bytes)?;
        st.moe_cache = cache;
        Ok(st.moe_cache.stats())
    }

    /// Sets the op-offload ring to `bytes` (`None`: the largest ring,
    /// [`hmoe_placement::ring_max_slice`] experts per slice): the device memory that the
    /// experts of host layers stream through for micro-batches that op offload runs on the
    /// device, in [`hmoe_placement::RING_SLOTS`] slices of as many experts as fit
    /// ([`hmoe_placement::ring_slice_for`], at least one). The results do not depend on it.
    pub fn set_op_offload_ring(&self, bytes: Option<u64>) {
        self.lock().ring = bytes;
    }

    /// Lets a step of two sequences or more run as two micro-batches in flight where the
    /// model has host-expert layers (`on`, the default unless `HMOE_MICRO_BATCHES=0`), or
    /// every step as one micro-batch: while the CPU runs one group's experts of a layer, the
    /// device runs the other group's attention (see the `micro_batches` module docs). The
    /// results do not depend on it.
    pub fn set_micro_batches(&self, on: bool) {
        self.micro_batches.store(on, Ordering::Relaxed);
    }

    /// Where a step of the `members` splits into two micro-batches in flight (`None`: it runs
    /// as one): only on a device other than the CPU, with a host-expert layer, two sequences
    /// or more, no op offload for the step and the device expert cache off.
    fn split(&self, st: &State<B>, members: &[Member<'_>], offload: bool) -> Option<usize> {
        let on = self.micro_batches.load(Ordering::Relaxed) && !self.dev.is_host();
        if !on || offload || !self.experts.host.any() || st.moe_cache.enabled() {
            return None;
        }
        let tokens: Vec<usize> = members.iter().map(|m| m.tokens.len()).collect();
        split_point(&tokens)
    }

    /// The op-offload ring's size set by [`DeviceModel::set_op_offload_ring`].
    pub fn op_offload_ring(&self) -> Option<u64> {
        self.lock().ring
    }

    /// What the device expert cache counted and holds (a budget of 0: disabled).
    pub fn moe_cache_stats(&self) -> MoeCacheStats {
        self.lock().moe_cache.stats()
    }

    /// The device's name, the weights, the K/V caches held now and the free memory.
    pub fn device_memory(&self) -> Result<DeviceMemory, ModelError> {
        let kv_bytes = self.lock().kvs.iter().map(|kv| kv.bytes).sum();
        Ok(DeviceMemory {
            device: self.dev.name(),
            weight_bytes: self.weight_bytes,
            kv_bytes,
            free_bytes: self.dev.free_memory()?,
        })
    }

    /// Bytes of device memory the scratch buffers of the last step take between steps (kept
    /// for the next step; freed before a new sequence's cache is allocated).
    pub fn scratch_held_bytes(&self) -> u64 {
        self.scratch.bytes()
    }

    /// Keeps the device caches of `busy` and `idle` handles only (see
    /// [`LanguageModel::retain_caches`]); those of `busy` are not freed to make room.
    pub fn retain_caches(&self, busy: &[&KvCache], idle: &[&KvCache]) {
        let mut st = self.lock();
        st.busy = busy.iter().map(|c| handle_of(c)).collect();
        let idle: Vec<usize> = idle.iter().map(|c| handle_of(c)).collect();
        let State {
            kvs,
            busy,
            kv_generation,
            ..
        } = &mut *st;
        let before = kvs.len();
        kvs.retain(|kv| busy.contains(&kv.handle) || idle.contains(&kv.handle));
        *kv_generation += u64::from(kvs.len() != before);
    }

    /// Whether the device holds the positions of `cache` (a handle at position 0 always
    /// can start).
    pub fn cache_held(&self, cache: &KvCache) -> bool {
        let st = self.lock();
        let held = (st.kvs.iter().find(|kv| kv.handle == handle_of(cache)))
            .map(|kv| (kv.geometry, kv.held));
        cache.n_past() == 0
            || kv_action(held, Geometry::of(cache), cache.n_past()) == KvAction::Continue
    }

    fn lock(&self) -> MutexGuard<'_, State<B>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `tokens` at the next positions of `cache` (a handle from
    /// [`LanguageModel::new_cache`]) and returns `n_vocab` logits per wanted token, or
    /// `n_embd` hidden floats per token for [`LogitsWanted::Hidden`] (the batch split into
    /// the cache's micro-batches).
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError> {
        self.check_input(cache, tokens)?;
        let mut st = self.lock();
        let handle = handle_of(cache);
        self.prepare_kv(&mut st, cache, &[handle])?;
        let kv = st.slot_of(handle)?;
        let mut logits = Vec::new();
        let n_ubatch = cache.n_ubatch().max(1);
        let n_chunks = tokens.len().div_ceil(n_ubatch);
        for (i, chunk) in tokens.chunks(n_ubatch).enumerate() {
            let want = match wanted {
                LogitsWanted::All | LogitsWanted::Hidden => Some(wanted),
                LogitsWanted::Last if i + 1 == n_chunks => Some(LogitsWanted::Last),
                LogitsWanted::Last => None,
            };
            let member = Member {
                kv,
                pos0: cache.n_past(),
                tokens: chunk,
                want,
                top: None,
            };
            let out = self.step(&mut st, std::slice::from_ref(&member))?;
            logits.extend(out.into_iter().filter_map(TokenLogits::into_full).flatten());
            cache.advance(chunk.len());
            st.kvs[kv].held = cache.n_past();
        }
        Ok(logits)
    }

    /// Runs several sequences in one pass: every sequence's tokens in one micro-batch (one
    /// round trip per host-expert layer for all of them), or, where the model has host-expert
    /// layers, in two micro-batches in flight ([`DeviceModel::set_micro_batches`]), each at
    /// the next positions of its own cache; returns the last token's logits of the sequences that want them (empty vectors
    /// for the others). Each result equals [`DeviceModel::forward`] with
    /// [`LogitsWanted::Last`] on that sequence alone (see the module docs). As the executor on
    /// the CPU always did, a step with a sequence of no tokens or of more than its cache's micro-batch
    /// runs the sequences one after the other. Every input is checked before anything runs.
    pub fn forward_multi(
        &self,
        seqs: &mut [SeqBatch<'_, '_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let top = vec![None; seqs.len()];
        let out = self.forward_multi_top(seqs, &top)?;
        Ok((out.into_iter())
            .map(|l| l.into_full().unwrap_or_default())
            .collect())
    }

    /// [`DeviceModel::forward_multi`] where the sequences `top[i] = Some(k)` may get only their
    /// `k` best logits, ranked on the device ([`LanguageModel::forward_multi_top`]).
    pub fn forward_multi_top(
        &self,
        seqs: &mut [SeqBatch<'_, '_>],
        top: &[Option<usize>],
    ) -> Result<Vec<TokenLogits>, ModelError> {
        if top.len() != seqs.len() {
            return Err(ModelError::Cache(format!(
                "{} top-k requests for {} sequences",
                top.len(),
                seqs.len()
            )));
        }
        for s in seqs.iter() {
            self.check_input(s.cache, s.tokens)?;
        }
        // A sequence of no tokens or of more than one micro-batch runs alone (split as
        // `forward` splits it), and so do the others then.
        let one_ubatch = seqs
            .iter()
            .all(|s| (1..=s.cache.n_ubatch()).contains(&s.tokens.len()));
        if !one_ubatch {
            let mut out = Vec::with_capacity(seqs.len());
            for s in seqs.iter_mut() {
                let logits = self.forward(s.cache, s.tokens, LogitsWanted::Last)?;
                out.push(TokenLogits::Full(match s.logits {
                    true => logits,
                    false => Vec::new(),
                }));
            }
            return Ok(out);
        }
        let mut st = self.lock();
        let handles: Vec<usize> = seqs.iter().map(|s| handle_of(s.cache)).collect();
        for s in seqs.iter() {
            self.prepare_kv(&mut st, s.cache, &handles)?;
        }
        let members = seqs
            .iter()
            .zip(&handles)
            .zip(top)
            .map(|((s, &h), &top)| {
                Ok(Member {
                    kv: st.slot_of(h)?,
                    pos0: s.cache.n_past(),
                    tokens: s.tokens,
                    want: s.logits.then_some(LogitsWanted::Last),
                    top: top.filter(|_| s.logits),
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let out = self.step(&mut st, &members)?;
        for (s, m) in seqs.iter_mut().zip(&members) {
            s.cache.advance(s.tokens.len());
            st.kvs[m.kv].held = s.cache.n_past();
        }
        Ok(out)
    }

    /// Checks a sequence's tokens and cache before anything runs: token ids, room in the
    /// context, K/V types the device keeps ([`Backend::supports_kv`]) with heads of whole
    /// blocks (a K-only cache: its K type one of [`Backend::k_only_types`], `-ctv` unused).
    fn check_input(&self, cache: &KvCache, tokens: &[u32]) -> Result<(), ModelError> {
        let n_vocab = self.arch.dims().n_vocab;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(ModelError::BadToken { id, n_vocab });
        }
        if cache.n_past() + tokens.len() > cache.n_ctx() {
            return Err(ModelError::ContextFull {
                pos: cache.n_past(),
                n_tokens: tokens.len(),
                n_ctx: cache.n_ctx(),
            });
        }
        let ty = cache.kv_type();
        let widths = self.arch.kv_widths(0);
        let k_only = widths.v == 0 && widths.k > 0;
        if k_only && !self.dev.k_only_types().contains(&ty.k().ggml_type()) {
            return Err(ModelError::Cache(format!(
                "K {}: {} does not keep a K-only (latent) cache of this type",
                ty.k(),
                self.dev.name()
            )));
        }
        if !k_only && !self.dev.supports_kv(ty.k().ggml_type(), ty.v().ggml_type()) {
            return Err(ModelError::Cache(format!(
                "K {} / V {}: {} does not keep this K/V cache",
                ty.k(),
                ty.v(),
                self.dev.name()
            )));
        }
        let hd = self.arch.dims().kv_head_dim;
        // A K-only cache has no V (`-ctv` is not used).
        let checked = if k_only {
            &[("K", ty.k())][..]
        } else {
            &[("K", ty.k()), ("V", ty.v())]
        };
        for &(which, t) in checked {
            if !hd.is_multiple_of(t.block_elems()) {
                return Err(ModelError::BadParam {
                    key: format!("{which} cache type"),
                    value: format!("{t} (head size {hd}, block size {})", t.block_elems()),
                    why: "attention heads must be a whole number of blocks of the cache type \
                          (llama.cpp refuses this too)",
                });
            }
        }
        Ok(())
    }

    /// Bytes of the scratch buffers of a micro-batch of `n_tokens` tokens with every token's
    /// logits: what a new sequence's cache leaves free on the device (see the module docs).
    /// The per-sequence copies of a batch of several sequences take at most as much again,
    /// which the estimate counts too.
    pub fn scratch_bytes(&self, n_tokens: usize) -> u64 {
        let d = self.arch.dims();
        (4 * n_tokens * (2 * d.scratch_per_token + d.n_embd + d.n_vocab)) as u64
    }

    /// The K (and V) ring layouts of each layer of a cache of `cache`'s types and geometry:
    /// the handle's cells per layer.
    fn rings_of(&self, cache: &KvCache) -> Result<Vec<(KvLayout, Option<KvLayout>)>, ModelError> {
        let hd = self.arch.dims().kv_head_dim;
        (cache.layers().iter().enumerate())
            .map(|(l, layer)| {
                device_kv_layouts(cache.kv_type(), layer.cells, self.arch.kv_widths(l), hd)
            })
            .collect::<Result<_, _>>()
            .map_err(ModelError::from)
    }

    /// Bytes of the K/V a cache of `cache`'s types and geometry takes on the device (0 for
    /// types the device cannot keep).
    pub fn kv_bytes(&self, cache: &KvCache) -> u64 {
        self.rings_of(cache).map_or(0, |r| rings_bytes(&r))
    }

    /// Makes a device cache stand for `cache` (see [`kv_action`]); the caches of the handles
    /// in `keep` (the step's) are never freed to make room.
    fn prepare_kv(
        &self,
        st: &mut State<B>,
        cache: &KvCache,
        keep: &[usize],
    ) -> Result<(), ModelError> {
        let handle = handle_of(cache);
        let geometry = Geometry::of(cache);
        // The caches of dropped handles go first.
        let before = st.kvs.len();
        st.kvs.retain(|kv| kv.alive.strong_count() > 0);
        st.kv_generation += u64::from(st.kvs.len() != before);
        st.clock += 1;
        let clock = st.clock;
        let at = st.kvs.iter().position(|kv| kv.handle == handle);
        let ty = cache.kv_type();
        // A cache of other K/V types (a new handle at a freed one's address) is not this one.
        let held =
            (at.filter(|&i| st.kvs[i].ty == ty)).map(|i| (st.kvs[i].geometry, st.kvs[i].held));
        match kv_action(held, geometry, cache.n_past()) {
            KvAction::Continue => {
                if let Some(kv) = at.map(|i| &mut st.kvs[i]) {
                    kv.held = cache.n_past();
                    kv.last_used = clock;
                }
                Ok(())
            }
            KvAction::Allocate => {
                st.kv_generation += 1;
                // Free the old cache before the new one takes its memory.
                if let Some(i) = at {
                    st.kvs.swap_remove(i);
                }
                let rings = self.rings_of(cache)?;
                let kv_bytes = rings_bytes(&rings);
                // The free scratch buffers go first: `need` counts a micro-batch's own.
                self.scratch.clear();
                let need = kv_bytes + self.scratch_bytes(geometry.n_ubatch);
                // Idle sequences' caches first, then cached experts.
                while self.dev.free_memory()?.is_some_and(|free| free < need)
                    && (st.evict_idle(keep) || st.moe_cache.evict_one())
                {}
                let alloc = || {
                    rings
                        .iter()
                        .map(|(k, v)| {
                            Ok(LayerKv {
                                k: self.dev.kv_alloc(*k)?,
                                v: v.map(|v| self.dev.kv_alloc(v)).transpose()?,
                            })
                        })
                        .collect::<Result<Vec<_>, BackendError>>()
                };
                let layers = loop {
                    match alloc() {
                        Err(BackendError::OutOfMemory { .. })
                            if st.evict_idle(keep) || st.moe_cache.evict_one() => {}
                        other => break other?,
                    }
                };
                st.kvs.push(DeviceKv {
                    handle,
                    alive: cache.watch(),
                    geometry,
                    held: 0,
                    last_used: clock,
                    ty,
                    bytes: kv_bytes,
                    layers,
                });
                Ok(())
            }
            KvAction::Mismatch => {
                Err(ModelError::Cache(format!(
                "a cache at position {} (n_ctx {}, n_ubatch {}) is not a sequence on the device \
                 ({}); a new sequence, or one whose device cache was freed, starts at 0",
                cache.n_past(),
                geometry.n_ctx,
                geometry.n_ubatch,
                match held {
                    Some((Geometry { n_ctx: c, n_ubatch: u }, h)) =>
                        format!("its device cache: n_ctx {c}, n_ubatch {u}, {h} positions"),
                    None => "no device cache for it".into(),
                }
            )))
            }
        }
    }

    /// One micro-batch of the `members`' tokens (each at its positions, over its device
    /// cache): every layer, then the logits each member wants (empty for `None`).
    ///
    /// A step that repeats the last one records or replays its segments (`segments.rs`); if
    /// it fails then (a device that could not capture), it runs again as issued, and the
    /// recordings are dropped.
    fn step(
        &self,
        st: &mut State<B>,
        members: &[Member<'_>],
    ) -> Result<Vec<TokenLogits>, ModelError> {
        let epoch = |st: &State<B>| SegmentEpoch {
            arena: self.scratch.generation(),
            kvs: st.kv_generation,
        };
        let seqs: Vec<SeqShape> = (members.iter())
            .map(|m| SeqShape {
                kv: m.kv,
                handle: st.kvs.get(m.kv).map_or(usize::MAX, |kv| kv.handle),
                tokens: m.tokens.len(),
                want: m.want,
                top: m.top,
            })
            .collect();
        let offload = self
            .op_offload_min_batch
            .is_some_and(|m| m <= members.len());
        let shape = step_shape(&seqs).filter(|_| !offload && !st.moe_cache.enabled());
        let now = shape.map(|s| (s, epoch(st)));
        if st.segment_epoch != epoch(st) {
            // A buffer that a recording names may be gone.
            self.dev.forget_segments();
            st.segment_epoch = epoch(st);
        }
        let segments = match now {
            Some((s, e)) if st.last_shape == now => Segments::on(s, e),
            _ => Segments::off(),
        };
        let segmented = segments.is_on();
        let n: usize = members.iter().map(|m| m.tokens.len()).sum();
        let split = self.split(
            st,
            members,
            self.op_offload_min_batch.is_some_and(|m| n >= m),
        );
        let mut logits = self.step_groups(st, members, split, segments);
        if segmented && logits.is_err() {
            self.dev.forget_segments();
            tracing::warn!("a recorded decode step failed; it runs again as issued");
            logits = self.step_groups(st, members, split, Segments::off());
        }
        // Whether it ran or failed, the buffers it did not take are freed.
        self.scratch.end_step();
        st.last_shape = match &logits {
            Ok(_) => shape.map(|s| (s, epoch(st))),
            Err(_) => None,
        };
        logits
    }

    /// [`DeviceModel::step`] before its scratch buffers are sorted out: one micro-batch, or,
    /// split at `split`, two in flight, the members before `split` and those from it each
    /// run by a host thread of its own in turns (`micro_batches.rs`); the logits in the
    /// members' order.
    fn step_groups(
        &self,
        st: &mut State<B>,
        members: &[Member<'_>],
        split: Option<usize>,
        segments: Segments,
    ) -> Result<Vec<TokenLogits>, ModelError> {
        let Some(at) = split else {
            return self.step_layers(StepState::Alone(st), members, segments);
        };
        let (a, b) = members.split_at(at);
        let turns = Turns::new(std::mem::take(st));
        let (seg_a, seg_b) = (segments.of_group(0), segments.of_group(1));
        let (la, lb) = std::thread::scope(|s| {
            let turns = &turns;
            let second = s.spawn(move || {
                turns.run(1, |t| self.step_layers(StepState::InFlight(t), b, seg_b))
            });
            let la = turns.run(0, |t| self.step_layers(StepState::InFlight(t), a, seg_a));
            let lb = second
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (la, lb)
        });
        *st = turns.into_state();
        st.stats.split_steps += 1;
        let mut logits = la?;
        logits.extend(lb?);
        Ok(logits)
    }

    /// One micro-batch of the `members` over the state `st`.
    fn step_layers(
        &self,
        st: StepState<'_, B>,
        members: &[Member<'_>],
        mut segments: Segments,
    ) -> Result<Vec<TokenLogits>, ModelError> {
        let (dev, arena) = (&self.dev, &self.scratch);
        let dims = self.arch.dims();
        let mut groups = Vec::with_capacity(members.len());
        let mut n = 0;
        for m in members {
            groups.push(n..n + m.tokens.len());
            n += m.tokens.len();
        }
        let i32_of = |v: usize| {
            i32::try_from(v).map_err(|_| ModelError::Cache(format!("position {v} exceeds i32")))
        };
        let mut ids = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        for m in members {
            for (t, &tok) in m.tokens.iter().enumerate() {
                ids.push(i32_of(tok as usize)?);
                positions.push(i32_of(m.pos0 + t)?);
            }
        }
        // The ids and positions go into buffers of the arena (no allocation once it holds
        // buffers of this length).
        let mut ids_buf = arena.take::<i32>(dev, n)?;
        dev.upload_into::<i32>(&mut ids_buf, &ids)?;
        let mut pos = arena.take::<i32>(dev, n)?;
        dev.upload_into::<i32>(&mut pos, &positions)?;
        let mut x = arena.take::<f32>(dev, n * dims.n_embd)?;
        // The step's ops from here to the first copy down may be a recorded segment.
        segments.begin(dev)?;
        dev.get_rows(&self.tok_embd.m, &ids_buf, &mut x)?;
        drop(ids_buf);
        let offload_at = |rows: usize| self.op_offload_min_batch.is_some_and(|m| rows >= m);
        let mut cx = Step {
            dev,
            arch: self.arch.as_ref(),
            experts: &self.experts,
            st,
            members,
            wanted: wanted_rows(members, &groups),
            groups,
            pos,
            arena,
            offload: offload_at(n),
            offload_last: false,
            prefetched: None,
            segments,
            narrowed: None,
        };
        cx.offload_last = offload_at(cx.last_layer_rows());
        // Each layer's output is added by the next layer's first norm, the last one's here
        // (unless that layer narrowed to the wanted rows and added it to them).
        let mut pending = None;
        for l in 0..dims.n_layer {
            pending = self.arch.layer(&mut cx, l, &mut x, pending)?;
        }
        if let Some(out) = pending {
            dev.add_assign(&mut x, &out.0)?;
        }
        let Step {
            mut st,
            mut segments,
            narrowed,
            wanted,
            ..
        } = cx;
        st.stats.ubatches += 1;
        // The final hidden state of the wanted rows: gathered by the last layer, or rows of `x`.
        let (x, wanted) = match &narrowed {
            Some(rows) => (&**rows, packed_rows(&wanted)),
            None => (&*x, wanted),
        };
        let logits = self.logits(members, &wanted, x, &mut segments, &mut st)?;
        // After the token's logits: the experts that missed go up for the next micro-batch.
        let arch = self.arch.as_ref();
        st.moe_cache
            .upload_missed(&self.dev, |l| arch.layer_experts(l))?;
        Ok(logits)
    }

    /// The output norm and head over the rows of the final hidden state `x` each member wants
    /// (`wanted`, rows of `x`: every row of a member that wants [`LogitsWanted::All`], the
    /// last of one that wants [`LogitsWanted::Last`]), brought down in one copy (the turn handed to the other
    /// micro-batch in flight before the host waits for it) and split per member. A step whose
    /// members want [`LogitsWanted::Hidden`] brings down the normed rows instead (the head
    /// not run). A step whose rows are all last tokens that ask for their best logits alone
    /// ([`Member::top`]) brings those down instead (`top_logits.rs`).
    fn logits(
        &self,
        members: &[Member<'_>],
        wanted: &[Option<Range<usize>>],
        x: &B::Buf<f32>,
        segments: &mut Segments,
        st: &mut StepState<'_, B>,
    ) -> Result<Vec<TokenLogits>, ModelError> {
        let (dev, arena) = (&self.dev, &self.scratch);
        let p = self.arch.dims();
        let d = p.n_embd;
        // Only `forward` asks for hidden states, for the one member of its steps.
        let hidden = members.iter().any(|m| m.want == Some(LogitsWanted::Hidden));
        let mut out_groups = Vec::new();
        let mut n_rows = 0;
        for r in wanted.iter().flatten() {
            out_groups.push(n_rows..n_rows + r.len());
            n_rows += r.len();
        }
        if n_rows == 0 {
            segments.end(dev)?;
            st.hand_over();
            dev.synchronize()?;
            return Ok(vec![TokenLogits::Full(Vec::new()); members.len()]);
        }
        // Every row of `x`, or the wanted ones gathered into a buffer of the arena.
        let gathered: Scratch<'_, B, f32>;
        let rows: &B::Buf<f32> = match wanted {
            [Some(r)] if r.len() * d == B::buf_len(x) => x,
            _ => {
                let mut rows = arena.take::<f32>(dev, n_rows * d)?;
                for (r, og) in wanted.iter().flatten().zip(&out_groups) {
                    let copy = RowCopy {
                        n_rows: r.len(),
                        width: d,
                        src_stride: d,
                        src_offset: r.start * d,
                        dst_stride: d,
                        dst_offset: og.start * d,
                    };
                    dev.copy_rows(x, &mut rows, &copy)?;
                }
                gathered = rows;
                &gathered
            }
        };
        let mut normed = arena.take::<f32>(dev, n_rows * d)?;
        dev.rms_norm(rows, &self.output_norm, p.rms_eps, &mut normed)?;
        // Floats per row brought down.
        let width = if hidden { d } else { p.n_vocab };
        let all = if hidden {
            segments.end(dev)?;
            st.hand_over();
            dev.download::<f32>(&normed)?
        } else {
            let mut logits = arena.take::<f32>(dev, n_rows * p.n_vocab)?;
            self.output
                .mul(dev, arena, &normed, &out_groups, &mut logits)?;
            if let Some(k) = top_logits::top_k_of(members, p.n_vocab) {
                return self.top_logits(members, &logits, n_rows, k, segments, st);
            }
            segments.end(dev)?;
            // The other micro-batch in flight queues its work before the host waits.
            st.hand_over();
            dev.download::<f32>(&logits)?
        };
        // One member's logits (a decode step): the download itself, not a copy of it.
        if let [_] = out_groups.as_slice() {
            let mut all = Some(all);
            return Ok((wanted.iter())
                .map(|w| match w {
                    Some(_) => TokenLogits::Full(all.take().unwrap_or_default()),
                    None => TokenLogits::Full(Vec::new()),
                })
                .collect());
        }
        let mut og = out_groups.iter();
        Ok(wanted
            .iter()
            .map(|w| match w.as_ref().and_then(|_| og.next()) {
                Some(g) => TokenLogits::Full(all[g.start * width..g.end * width].to_vec()),
                None => TokenLogits::Full(Vec::new()),
            })
            .collect())
    }
}

impl<B: Backend> LanguageModel for DeviceModel<B> {
    fn n_vocab(&self) -> usize {
        self.arch.dims().n_vocab
    }
    fn n_embd(&self) -> usize {
        self.arch.dims().n_embd
    }
    fn n_ctx_train(&self) -> usize {
        self.arch.dims().n_ctx_train
    }
    /// A handle of the device cache: positions only (see the module docs).
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        self.arch.new_cache(ty, n_ctx, n_ubatch)
    }
    fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError> {
        DeviceModel::<B>::forward(self, cache, tokens, wanted)
    }
    fn gguf(&self) -> &GgufModel {
        self.arch.gguf()
    }
    fn kv_bytes(&self, cache: &KvCache) -> u64 {
        DeviceModel::<B>::kv_bytes(self, cache)
    }
    /// `None` on the CPU: nothing crosses a bus.
    fn device_stats(&self) -> Option<ExecStats> {
        (!self.dev.is_host()).then(|| self.stats())
    }
    /// `None` on the CPU, whose K/V and weights are RAM.
    fn device_memory(&self) -> Option<DeviceMemory> {
        (!self.dev.is_host())
            .then(|| DeviceModel::<B>::device_memory(self).ok())
            .flatten()
    }
    fn moe_cache_stats(&self) -> Option<MoeCacheStats> {
        Some(DeviceModel::<B>::moe_cache_stats(self)).filter(|s| s.budget_bytes > 0)
    }
    fn retain_caches(&self, busy: &[&KvCache], idle: &[&KvCache]) {
        DeviceModel::<B>::retain_caches(self, busy, idle)
    }
    fn cache_held(&self, cache: &KvCache) -> bool {
        DeviceModel::<B>::cache_held(self, cache)
    }
    fn export_kv(&self, cache: &KvCache) -> Result<KvSnapshot, ModelError> {
        DeviceModel::<B>::export_kv(self, cache)
    }
    fn import_kv(&self, cache: &mut KvCache, snap: &KvSnapshot) -> Result<(), ModelError> {
        DeviceModel::<B>::import_kv(self, cache, snap)
    }
    /// Every sequence's tokens in one micro-batch, each over its own device cache (see
    /// [`DeviceModel::forward_multi`]).
    fn forward_multi(&self, seqs: &mut [SeqBatch<'_, '_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        DeviceModel::<B>::forward_multi(self, seqs)
    }
    /// The best logits ranked on the device (see [`DeviceModel::forward_multi_top`]).
    fn forward_multi_top(
        &self,
        seqs: &mut [SeqBatch<'_, '_>],
        top: &[Option<usize>],
    ) -> Result<Vec<TokenLogits>, ModelError> {
        DeviceModel::<B>::forward_multi_top(self, seqs, top)
    }
}
