//! Causal multi-head attention over the KV cache with grouped KV heads, an optional sliding
//! window and optional per-head sink logits (gpt-oss).
//!
//! Summation orders follow ggml's CPU backend so that results match llama.cpp bit for bit
//! where it matters (a last-bit change can flip a Q8_0 rounding downstream): scores as
//! 16-lane FMA chains (tinyBLAS) — except for f32 keys in multi-token batches, where ggml's
//! `vec_dot_f32` runs —, exponentials with ggml's vectorised `expf`, the softmax sum in chunks
//! of 16 positions, and the value sum as 16-lane FMA chains over positions (for one token with
//! f32/f16 values, `vec_dot`'s four chains taking 16 positions in turn).
//!
//! Caches with block-quantized values, and with flash attention on
//! ([`hmoe_backend::KvType::flash_attn`]: `-fa on` or `auto`, the default) every cache (but
//! DeepSeek's latent cache, whose values live inside the keys), go through
//! [`flash_attention`] instead: an online softmax over the keys with no score matrix.
//! Over block-quantized values it is ggml's CPU flash-attention kernel (llama.cpp reads a
//! quantized V cache only that way). Over f32/f16/bf16 values the keys go in chunks of
//! [`FLASH_CHUNK`] positions fixed by position, each its own softmax stepped a block of
//! [`FLASH_BLOCK`] positions at a time (one rescale per block, so the value sums run without a
//! branch per key), folded in position order: one decode token then spreads over every thread
//! (split-K), and results still depend neither on the thread count nor on the rest of the
//! batch. Its results differ from the row kernel's in the last bits (another summation order,
//! f32 probabilities), and from llama.cpp's flash kernel too (which sums f16 values in f16);
//! the goldens hold within the fixture tolerances (`tests/kv_quant_fixtures.rs`).
//!
//! `-fa off` keeps the row kernel (one query row at a time, so memory is one score row per
//! (query, head) task and never a queries × keys matrix), whose numerics meet the non-flash
//! goldens exactly. [`attention_ext`] over a latent cache (values inside the keys) takes the
//! row kernel for f32/f16/bf16 values whatever `-fa` says.

use std::cell::RefCell;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use hmoe_quant::{
    expf_ggml_slice, expf_slice, f16_bytes, prefetch, Dequantizer, DotKernel, GgmlType,
};

use hmoe_backend::numerics::{
    dot_vec, fwht, merge_softmax_chunk, online_softmax_step, rotate_chunks, softmax_block,
    FLASH_BLOCK, FLASH_CHUNK,
};

use crate::kv_storage::{Cells, LayerCache};
use hmoe_backend::numerics::hsum16;

mod f16_rows;
mod lane_kernels;
mod lanes;
mod q8_0_scores;
use f16_rows::{f16_head_scores, f16_value_lanes};
use lane_kernels::{lane_scores, lane_values, Ahead, LaneHeads};
use lanes::{LaneSoftmax, ROW_LANES};
use q8_0_scores::Q8_0Queries;

/// Shape of one attention call.
pub struct AttnShape {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (GQA: each serves `n_head / n_head_kv` query heads).
    pub n_head_kv: usize,
    /// Elements of each head.
    pub head_dim: usize,
    /// Score scale.
    pub scale: f32,
}

const LANES: usize = 16;

/// `out[t][h] = Σ_j softmax_j(q[t][h]·k_j · scale ⊕ sink[h]) v_j` over the keys visible from
/// position `pos0 + t`. The cache must already hold the batch's own keys and values.
pub fn attention(
    cache: &LayerCache,
    shape: &AttnShape,
    q: &[f32],
    pos0: usize,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let (rot_q, rot_out) = (cache.k.rotation(), cache.v.rotation());
    if rot_q == 0 && rot_out == 0 {
        return attention_rotated(cache, shape, q, pos0, sinks, out);
    }
    let rotated;
    let q = if rot_q > 0 {
        rotated = rotate_chunks(q, rot_q);
        &rotated[..]
    } else {
        q
    };
    attention_rotated(cache, shape, q, pos0, sinks, out);
    rotate_back(out, rot_out);
}

/// [`attention`] once the query is rotated like the stored keys (the output is still in the
/// rotated basis of the stored values).
fn attention_rotated(
    cache: &LayerCache,
    shape: &AttnShape,
    q: &[f32],
    pos0: usize,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let hd = shape.head_dim;
    if cache.flash || needs_flash(&cache.v) {
        let layout = AttnLayout {
            n_head: shape.n_head,
            n_head_kv: shape.n_head_kv,
            k_dim: hd,
            v_dim: hd,
            v_in_k: false,
            scale: shape.scale,
        };
        return flash_attention(cache, &layout, q, pos0, sinks, out);
    }
    if !heads_fit(cache, hd, hd, false) {
        cache.refuse();
        out.fill(0.0);
        return;
    }
    let n_tokens = q.len() / (shape.n_head * hd);
    let ctx = RowTask {
        cache,
        k_kernel: block_kernel(&cache.k),
        group: shape.n_head / shape.n_head_kv,
        n_head_kv: shape.n_head_kv,
        kv_per_task: row_kv_per_task(n_tokens, shape.n_head_kv, hmoe_pool::current_num_threads()),
        hd,
        scale: shape.scale,
        single_token: n_tokens == 1,
        q,
        pos0,
        sinks,
    };
    // One task per (token, run of KV heads): the query heads sharing a KV head read each key
    // and value row once.
    let chunk = ctx.kv_per_task * ctx.group * hd;
    hmoe_pool::global().for_each_chunk_mut(out, chunk, |task, dst| {
        ROW_SCRATCH.with_borrow_mut(|sc| ctx.run(task, sc, dst, true));
    });
}

/// KV heads per row-kernel task: as many as still leave a task for every thread, so that a
/// task reads a longer run of each cache row (the heads of a position lie side by side, and
/// runs a whole KV head apart defeat the hardware prefetchers). Results do not depend on it.
fn row_kv_per_task(n_tokens: usize, n_head_kv: usize, threads: usize) -> usize {
    (1..=n_head_kv)
        .rev()
        .find(|&k| n_head_kv.is_multiple_of(k) && n_tokens * (n_head_kv / k) >= threads)
        .unwrap_or(1)
}

/// Positions a row-kernel task scores (and sums) for all its KV heads before the next ones,
/// asking for the next block's rows meanwhile.
const ROW_BLOCK: usize = 64;

/// What every task of one row-kernel call ([`attention_rotated`]) shares.
struct RowTask<'a> {
    cache: &'a LayerCache,
    /// K's `vec_dot` kernel for block-typed keys.
    k_kernel: Option<DotKernel>,
    /// Query heads per KV head.
    group: usize,
    n_head_kv: usize,
    /// KV heads per task ([`row_kv_per_task`]).
    kv_per_task: usize,
    hd: usize,
    scale: f32,
    single_token: bool,
    q: &'a [f32],
    pos0: usize,
    sinks: Option<&'a [f32]>,
}

/// One row-kernel task's buffers, kept per thread between calls so that a token allocates
/// nothing once they have grown to the shapes in use (a score row of 4096 positions for eight
/// heads is 128 KiB, which the allocator would otherwise hand back to the system every token).
#[derive(Default)]
struct RowScratch {
    q_half: Vec<f16>,
    q16: Vec<f32>,
    q_blocks: Vec<u8>,
    probs: Vec<f32>,
    row_scores: Vec<f32>,
    k_row: Vec<f32>,
    v_row: Vec<f32>,
    acc: Vec<f32>,
}

thread_local! {
    static ROW_SCRATCH: RefCell<RowScratch> = RefCell::default();
}

/// The runs of consecutive cells that positions `first..=last` occupy in a ring of `cells`:
/// `(position, length)` pairs in position order.
fn cell_runs(first: usize, last: usize, cells: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut p = first;
    std::iter::from_fn(move || {
        if p > last {
            return None;
        }
        let len = (last + 1 - p).min(cells - p % cells);
        let run = (p, len);
        p += len;
        Some(run)
    })
}

impl RowTask<'_> {
    /// Runs task `task` (token `t`, KV heads `kvh0..kvh0 + kv_per_task`), writing their query
    /// heads' outputs to `dst`. `kernels`: f16 keys of one token and f16 values go through the
    /// attention kernels ([`f16_head_scores`], [`f16_value_lanes`]), a block of positions at a time for all the task's KV
    /// heads (the same bits as the element-by-element loops, which `false` runs instead, for
    /// the tests).
    fn run(&self, task: usize, sc: &mut RowScratch, dst: &mut [f32], kernels: bool) {
        let (cache, hd, group) = (self.cache, self.hd, self.group);
        let n_kv = self.kv_per_task;
        let width = self.n_head_kv * hd;
        let runs_per_token = self.n_head_kv / n_kv;
        let t = task / runs_per_token;
        let kvh0 = task % runs_per_token * n_kv;
        let pos = self.pos0 + t;
        let first = cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let rows = n_kv * group;
        let heads = &self.q[(t * self.n_head_kv + kvh0) * group * hd..][..rows * hd];
        // Element offset of KV head `kvh0 + j` at position `p`.
        let cell = |p: usize, j: usize| (p % cache.cells) * width + (kvh0 + j) * hd;
        // Probabilities for positions chunk_start..=pos per query head (row `j · group + g`),
        // zero outside the window.
        let chunk_start = first / LANES * LANES;
        let span = pos + 1 - chunk_start;
        let probs = fit(&mut sc.probs, rows * span);
        // The blocks of `first..=pos` the kernels take in turn, each after asking for the
        // task's heads of the next one.
        let blocks = || {
            (first..=pos)
                .step_by(ROW_BLOCK)
                .map(move |b| b..(b + ROW_BLOCK).min(pos + 1))
        };
        let ask = |data: &[f16], block: std::ops::Range<usize>| {
            for p in block {
                hmoe_quant::prefetch(f16_bytes(&data[cell(p, 0)..cell(p, 0) + n_kv * hd]));
            }
        };
        let next = |b: &std::ops::Range<usize>| b.end..(b.end + ROW_BLOCK).min(pos + 1);
        match &cache.k {
            // `vec_dot_f16` for one token's f16 keys (ggml rounds the query to f16 first).
            Cells::F16(k) if self.single_token => {
                sc.q_half.clear();
                sc.q_half.extend(heads.iter().map(|&v| f16::from_f32(v)));
                if kernels {
                    ask(k, first..(first + ROW_BLOCK).min(pos + 1));
                    for block in blocks() {
                        ask(k, next(&block));
                        for (a, len) in cell_runs(block.start, block.end - 1, cache.cells) {
                            for (j, q) in sc.q_half.chunks_exact(group * hd).enumerate() {
                                f16_head_scores(
                                    hd,
                                    q,
                                    &k[cell(a, j)..],
                                    width,
                                    len,
                                    self.scale,
                                    &mut probs[j * group * span + a - chunk_start..],
                                    span,
                                );
                            }
                        }
                    }
                } else {
                    // Symmetric, so the group's query heads go through one `dot_rows` call
                    // per key as the "weight rows".
                    let kernel = DotKernel::best(GgmlType::F16).expect("f16 has a dot kernel");
                    let row_scores = fit(&mut sc.row_scores, group);
                    for (j, q) in sc.q_half.chunks_exact(group * hd).enumerate() {
                        for p in first..=pos {
                            let key = f16_bytes(&k[cell(p, j)..cell(p, j) + hd]);
                            kernel.dot_rows(hd, f16_bytes(q), key, row_scores);
                            for (g, &s) in row_scores.iter().enumerate() {
                                probs[(j * group + g) * span + p - chunk_start] = s * self.scale;
                            }
                        }
                    }
                }
            }
            _ => {
                // A batch of f16 keys goes through tinyBLAS, with the query rounded to f16.
                sc.q16.clear();
                if let Cells::F16(_) = &cache.k {
                    sc.q16
                        .extend(heads.iter().map(|&v| f16::from_f32(v).to_f32()));
                }
                let q_bytes = self.k_kernel.as_ref().map_or(0, |k| k.act_row_bytes(hd));
                let q_blocks = fit(&mut sc.q_blocks, rows * q_bytes);
                if let Some(kernel) = &self.k_kernel {
                    for (qh, dst) in heads
                        .chunks_exact(hd)
                        .zip(q_blocks.chunks_exact_mut(q_bytes))
                    {
                        hmoe_quant::quantize_row(kernel.act_type(), qh, dst)
                            .expect("heads are whole blocks (checked)");
                    }
                }
                let k_row = fit(&mut sc.k_row, hd);
                for j in 0..n_kv {
                    for p in first..=pos {
                        let at = cell(p, j);
                        if let Cells::F16(k) = &cache.k {
                            k[at..at + hd].convert_to_f32_slice(k_row);
                        }
                        for r in j * group..(j + 1) * group {
                            let qh = &heads[r * hd..(r + 1) * hd];
                            let s = match &cache.k {
                                Cells::F32(k) => dot_vec_f32(qh, &k[at..at + hd]),
                                Cells::F16(_) => dot_lanes(&sc.q16[r * hd..(r + 1) * hd], k_row),
                                Cells::Blocks { ty, data, .. } => block_dot(
                                    self.k_kernel.as_ref(),
                                    *ty,
                                    data,
                                    at,
                                    hd,
                                    &q_blocks[r * q_bytes..(r + 1) * q_bytes],
                                ),
                            };
                            probs[r * span + p - chunk_start] = s * self.scale;
                        }
                    }
                }
            }
        }
        for (r, probs) in probs.chunks_exact_mut(span).enumerate() {
            softmax_window(
                probs,
                first - chunk_start,
                self.sinks.map(|s| s[kvh0 * group + r]),
            );
        }
        // Per head, one 16-lane accumulator per output element, lane = position mod 16
        // (ggml's order), stored lane-major so that a position updates one contiguous row of
        // `hd` values.
        let acc = fit(&mut sc.acc, rows * LANES * hd);
        acc.fill(0.0);
        match &cache.v {
            Cells::F16(v) if kernels => {
                ask(v, first..(first + ROW_BLOCK).min(pos + 1));
                for block in blocks() {
                    ask(v, next(&block));
                    for (a, len) in cell_runs(block.start, block.end - 1, cache.cells) {
                        for (j, acc) in acc.chunks_exact_mut(group * LANES * hd).enumerate() {
                            f16_value_lanes(
                                hd,
                                &v[cell(a, j)..],
                                width,
                                len,
                                a - chunk_start,
                                &probs[j * group * span + a - chunk_start..],
                                span,
                                acc,
                            );
                        }
                    }
                }
            }
            _ => {
                let v_row = fit(&mut sc.v_row, hd);
                for j in 0..n_kv {
                    for p in first..=pos {
                        let lane = (p - chunk_start) % LANES;
                        let at = cell(p, j);
                        match &cache.v {
                            Cells::F32(v) => v_row.copy_from_slice(&v[at..at + hd]),
                            Cells::F16(v) => v[at..at + hd].convert_to_f32_slice(v_row),
                            Cells::Blocks { ty, data, .. } => dequantize_at(*ty, data, at, v_row),
                        }
                        for r in j * group..(j + 1) * group {
                            let acc = &mut acc[r * LANES * hd..(r + 1) * LANES * hd];
                            let w = probs[r * span + p - chunk_start];
                            // The probability in the activation type of V's matmul.
                            let w = match &cache.v {
                                Cells::F32(_) => w,
                                Cells::F16(_) => f16::from_f32(w).to_f32(),
                                Cells::Blocks { ty, .. } => round_weight(*ty, w),
                            };
                            for (a, &x) in acc[lane * hd..(lane + 1) * hd].iter_mut().zip(&*v_row) {
                                *a = x.mul_add(w, *a);
                            }
                        }
                    }
                }
            }
        }
        // Each output element: its 16 lanes summed by halving (`hsum16`), all elements of a
        // head at once.
        for (dst, acc) in dst
            .chunks_exact_mut(hd)
            .zip(acc.chunks_exact_mut(LANES * hd))
        {
            for step in [8, 4, 2, 1] {
                let (lo, hi) = acc.split_at_mut(step * hd);
                for (a, &b) in lo.iter_mut().zip(&hi[..step * hd]) {
                    *a += b;
                }
            }
            dst.copy_from_slice(&acc[..hd]);
        }
    }
}

/// Softmax in place over `probs[skip..]` (ggml's `soft_max`: the maximum including the sink,
/// `expf_ggml` in 16-lane chunks summed in f64, the sink's term added last, one multiply by
/// the f32 inverse), leaving `probs[..skip]` (positions before the window) at zero.
fn softmax_window(probs: &mut [f32], skip: usize, sink: Option<f32>) {
    // The maximum by lanes: `max` ignores NaN as the sequential fold does, and the order can
    // only change the sign of a zero maximum, which no difference or exponential below sees.
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = probs[skip..].chunks_exact(LANES);
    for chunk in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = m.max(v);
        }
    }
    let mut max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if let Some(s) = sink {
        max = max.max(s);
    }
    probs[..skip].fill(0.0);
    for v in probs[skip..].iter_mut() {
        *v -= max;
    }
    expf_ggml_slice(&mut probs[skip..]);
    let mut sum = 0f64;
    for chunk in probs.chunks(LANES) {
        let mut lanes = [0f32; LANES];
        lanes[..chunk.len()].copy_from_slice(chunk);
        sum += hsum16(&lanes) as f64;
    }
    if let Some(s) = sink {
        sum += (s - max).exp() as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in probs.iter_mut() {
        *v *= inv;
    }
}

/// A score as tinyBLAS sums it (one 16-lane FMA accumulator, then halving), for f16 keys
/// converted to f32 and a query already rounded to f16 (as ggml converts it).
fn dot_lanes(q16: &[f32], k: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let (mut qc, mut kc) = (q16.chunks_exact(LANES), k.chunks_exact(LANES));
    for (cq, ck) in (&mut qc).zip(&mut kc) {
        for i in 0..LANES {
            lanes[i] = cq[i].mul_add(ck[i], lanes[i]);
        }
    }
    for (i, (&a, &b)) in qc.remainder().iter().zip(kc.remainder()).enumerate() {
        lanes[i] = a.mul_add(b, lanes[i]);
    }
    hsum16(&lanes)
}

fn dot_vec_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_vec(a, b, |v| v, false)
}

/// Shape of an attention call whose key and value heads may differ in size.
pub struct AttnLayout {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Elements of each query/key head.
    pub k_dim: usize,
    /// Elements of each value head.
    pub v_dim: usize,
    /// Values are the first `v_dim` elements of each key head (multi-head latent attention's
    /// K-only cache) instead of a separate V store.
    pub v_in_k: bool,
    /// Score scale.
    pub scale: f32,
}

/// `out[t][h] = Σ_j softmax_j(q[t][h]·k_j · scale) v_j` over the keys visible from position
/// `pos0 + t`, for heads of `k_dim` (query, key) and `v_dim` (value) elements; `out` holds
/// `v_dim` values per head. The cache must already hold the batch's own keys and values.
///
/// Numerics as [`attention`], plus what ggml does when an f16 key head is not a multiple of 16
/// long (tinyBLAS declines it): the scores of a batch then come from `vec_dot_f16` too.
pub fn attention_ext(
    cache: &LayerCache,
    shape: &AttnLayout,
    q: &[f32],
    pos0: usize,
    out: &mut [f32],
) {
    // Values stored inside the keys were rotated with them.
    let rot_q = cache.k.rotation();
    let rot_out = if shape.v_in_k {
        rot_q
    } else {
        cache.v.rotation()
    };
    if rot_q == 0 && rot_out == 0 {
        return attention_ext_rotated(cache, shape, q, pos0, out);
    }
    let rotated;
    let q = if rot_q > 0 {
        rotated = rotate_chunks(q, rot_q);
        &rotated[..]
    } else {
        q
    };
    attention_ext_rotated(cache, shape, q, pos0, out);
    rotate_back(out, rot_out);
}

/// [`attention_ext`] once the query is rotated like the stored keys.
fn attention_ext_rotated(
    cache: &LayerCache,
    shape: &AttnLayout,
    q: &[f32],
    pos0: usize,
    out: &mut [f32],
) {
    let (kd, vd) = (shape.k_dim, shape.v_dim);
    if !shape.v_in_k && (cache.flash || needs_flash(&cache.v)) {
        return flash_attention(cache, shape, q, pos0, None, out);
    }
    if !heads_fit(cache, kd, vd, shape.v_in_k) {
        cache.refuse();
        out.fill(0.0);
        return;
    }
    let k_kernel = block_kernel(&cache.k);
    let group = shape.n_head / shape.n_head_kv;
    let k_width = shape.n_head_kv * kd;
    let v_width = if shape.v_in_k {
        k_width
    } else {
        shape.n_head_kv * vd
    };
    let lanes_ok = kd.is_multiple_of(LANES);
    let single_token = q.len() == shape.n_head * kd;
    hmoe_pool::global().for_each_chunk_mut(out, vd, |task, dst| {
        EXT_SCRATCH.with_borrow_mut(|sc| {
            let t = task / shape.n_head;
            let h = task % shape.n_head;
            let pos = pos0 + t;
            let first = cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let qh = &q[task * kd..(task + 1) * kd];
            // ggml rounds the query to f16 before dotting it with f16 keys.
            sc.q16.clear();
            if let Cells::F16(_) = &cache.k {
                sc.q16.extend(qh.iter().map(|&v| f16::from_f32(v).to_f32()));
            }
            let q16 = &sc.q16[..];
            let q_blocks = match &k_kernel {
                Some(kernel) => {
                    let q_blocks = fit(&mut sc.q_blocks, kernel.act_row_bytes(kd));
                    hmoe_quant::quantize_row(kernel.act_type(), qh, q_blocks)
                        .expect("heads are whole blocks (checked)");
                    &q_blocks[..]
                }
                None => &[][..],
            };
            let kv_head = h / group;
            let k_at = |p: usize| (p % cache.cells) * k_width + kv_head * kd;
            let v_at = |p: usize| {
                if shape.v_in_k {
                    k_at(p)
                } else {
                    (p % cache.cells) * v_width + kv_head * vd
                }
            };
            let v_cells = if shape.v_in_k { &cache.k } else { &cache.v };
            let chunk_start = first / LANES * LANES;
            let probs = fit(&mut sc.probs, pos + 1 - chunk_start);
            // Positions before the window are never written; the softmax zeroes them.
            let k_row = fit(&mut sc.k_row, kd);
            for p in first..=pos {
                let at = k_at(p);
                let s = match &cache.k {
                    Cells::F32(k) => dot_vec_f32(qh, &k[at..at + kd]),
                    // A batch goes through tinyBLAS when the head is a multiple of 16 long; one
                    // token, or a head tinyBLAS declines, through `vec_dot_f16`.
                    Cells::F16(k) if lanes_ok && !single_token => {
                        k[at..at + kd].convert_to_f32_slice(k_row);
                        dot_lanes(q16, k_row)
                    }
                    Cells::F16(k) => dot_vec(q16, &k[at..at + kd], f16::to_f32, true),
                    Cells::Blocks { ty, data, .. } => {
                        block_dot(k_kernel.as_ref(), *ty, data, at, kd, q_blocks)
                    }
                } * shape.scale;
                probs[p - chunk_start] = s;
            }
            softmax_window(probs, first - chunk_start, None);
            // A batch sums the values in one 16-lane chain over positions (tinyBLAS); one token
            // with f32/f16 values goes through `vec_dot_f32`/`vec_dot_f16`, whose four chains take
            // 16 positions in turn.
            let chains = match v_cells {
                Cells::F32(_) | Cells::F16(_) if single_token => VEC_DOT_CHAINS,
                _ => 1,
            };
            let acc = fit(&mut sc.acc, vd);
            acc.fill([[0f32; LANES]; VEC_DOT_CHAINS]);
            let v_row = fit(&mut sc.v_row, vd);
            for (c, chunk) in probs.chunks(LANES).enumerate() {
                let chain = (chunk_start / LANES + c) % chains;
                for (i, &w) in chunk.iter().enumerate() {
                    let p = chunk_start + c * LANES + i;
                    if p < first {
                        continue;
                    }
                    let at = v_at(p);
                    match v_cells {
                        Cells::F32(v) => {
                            for (a, &x) in acc.iter_mut().zip(&v[at..at + vd]) {
                                a[chain][i] = x.mul_add(w, a[chain][i]);
                            }
                        }
                        Cells::F16(v) => {
                            let w = f16::from_f32(w).to_f32();
                            for (a, &x) in acc.iter_mut().zip(&v[at..at + vd]) {
                                a[chain][i] = x.to_f32().mul_add(w, a[chain][i]);
                            }
                        }
                        Cells::Blocks { ty, data, .. } => {
                            dequantize_at(*ty, data, at, v_row);
                            let w = round_weight(*ty, w);
                            for (a, &x) in acc.iter_mut().zip(&*v_row) {
                                a[chain][i] = x.mul_add(w, a[chain][i]);
                            }
                        }
                    }
                }
            }
            for (d, a) in dst.iter_mut().zip(&*acc) {
                *d = if chains == 1 {
                    hsum16(&a[0])
                } else {
                    reduce_chains(a)
                };
            }
        });
    });
}

/// One [`attention_ext`] row task's buffers, kept per thread between calls (as
/// [`RowScratch`]), so that a token allocates nothing once they have grown.
#[derive(Default)]
struct ExtScratch {
    q16: Vec<f32>,
    q_blocks: Vec<u8>,
    probs: Vec<f32>,
    k_row: Vec<f32>,
    v_row: Vec<f32>,
    acc: Vec<[[f32; LANES]; VEC_DOT_CHAINS]>,
}

thread_local! {
    static EXT_SCRATCH: RefCell<ExtScratch> = RefCell::default();
}

/// Accumulator chains of ggml's `vec_dot_f32`/`vec_dot_f16` on an AVX-512 build (64 elements
/// per step, 16 per chain).
const VEC_DOT_CHAINS: usize = 4;

/// Folds the chains as `vec_dot` does, `(c0 + c2) + (c1 + c3)` lane by lane, then sums the lanes.
fn reduce_chains(a: &[[f32; LANES]; VEC_DOT_CHAINS]) -> f32 {
    let mut folded = [0f32; LANES];
    for (l, f) in folded.iter_mut().enumerate() {
        *f = (a[0][l] + a[2][l]) + (a[1][l] + a[3][l]);
    }
    hsum16(&folded)
}

/// Undoes the rotation of the stored values on the attention output (the Walsh–Hadamard
/// transform is its own inverse); `rot` 0: not rotated.
fn rotate_back(out: &mut [f32], rot: usize) {
    if rot > 0 {
        hmoe_pool::global().for_each_chunk_mut(out, rot, |_, chunk| fwht(chunk));
    }
}

/// Whether V cells can only be read by flash attention: block-quantized values, which ggml
/// cannot store transposed for the non-flash product.
fn needs_flash(v: &Cells) -> bool {
    matches!(v, Cells::Blocks { ty, .. } if *ty != GgmlType::BF16)
}

/// Whether key heads of `kd` and value heads of `vd` elements are whole blocks of the cache
/// types (values stored in the keys when `v_in_k`).
fn heads_fit(cache: &LayerCache, kd: usize, vd: usize, v_in_k: bool) -> bool {
    let v_block = if v_in_k {
        cache.k.block_elems()
    } else {
        cache.v.block_elems()
    };
    kd.is_multiple_of(cache.k.block_elems()) && vd.is_multiple_of(v_block)
}

/// K's `vec_dot` kernel for block-typed keys; `None` for f32/f16 keys.
fn block_kernel(k: &Cells) -> Option<DotKernel> {
    match k {
        Cells::Blocks { ty, .. } => {
            Some(DotKernel::best(*ty).expect("every cache type has a dot kernel"))
        }
        _ => None,
    }
}

/// Bytes of the `n` elements from element `at` of block-typed cells.
fn block_range(ty: GgmlType, at: usize, n: usize) -> std::ops::Range<usize> {
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    at / be * bb..(at + n) / be * bb
}

/// K's `vec_dot` of the `n` keys from element `at` with a converted query.
fn block_dot(
    kernel: Option<&DotKernel>,
    ty: GgmlType,
    data: &[u8],
    at: usize,
    n: usize,
    q: &[u8],
) -> f32 {
    kernel.map_or(0.0, |k| k.dot(n, &data[block_range(ty, at, n)], q))
}

/// Dequantizes `out.len()` values from element `at` (ggml's `to_float`).
fn dequantize_at(ty: GgmlType, data: &[u8], at: usize, out: &mut [f32]) {
    hmoe_quant::dequantize_row(ty, &data[block_range(ty, at, out.len())], out)
        .expect("heads are whole blocks (checked)");
}

/// A probability as ggml's non-flash product sees it against values of type `ty`: rounded
/// to bf16 for bf16 values (the activation type of a bf16 matmul).
fn round_weight(ty: GgmlType, w: f32) -> f32 {
    if ty == GgmlType::BF16 {
        bf16::from_f32(w).to_f32()
    } else {
        w
    }
}

/// Queries per flash-attention task: each key and value row is read once for this many
/// queries (times the query heads sharing a KV head).
const Q_TILE: usize = 16;

/// Positions whose key and value heads flash attention converts together before the rows
/// consume them: the chunked kernel's softmax blocks, so blocks start at multiples of it.
const POS_BLOCK: usize = FLASH_BLOCK;

/// How many positions ahead flash attention asks for quantized key and value heads (one block
/// measured best: 22% faster than none at depth 4096 with the cache out of L3, 64 and 128
/// no better).
const PREFETCH_AHEAD: usize = POS_BLOCK;

/// Where one (query, head) row of a flash-attention task looks.
#[derive(Clone, Copy)]
struct RowSpan {
    /// Index of the query in the batch.
    t: usize,
    /// Query head.
    h: usize,
    /// First and last visible positions.
    first: usize,
    last: usize,
}

/// One flash-attention task's buffers, kept per thread between calls so that a token
/// allocates nothing once they have grown to the shapes in use.
#[derive(Default)]
struct FlashScratch {
    rows: Vec<RowSpan>,
    /// Per row: the query converted for K (f32, rounded to f16 for f16 keys; empty for
    /// block-typed keys) and in K's activation blocks (block-typed keys).
    q: Vec<f32>,
    q_blocks: Vec<u8>,
    /// Per row: the online-softmax state of the chunk in progress (maximum, sum, values).
    m: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    /// The chunked kernel's f32/f16 keys: per KV head, groups of [`ROW_LANES`] query rows
    /// transposed (element-major, one row per lane; missing rows zero).
    qt: Vec<f32>,
    k_block: Vec<f32>,
    v_block: Vec<f32>,
    scores: Vec<f32>,
    k_off: Vec<usize>,
    /// The chunked kernel's online softmax of one group of rows.
    lanes: LaneSoftmax,
}

thread_local! {
    static FLASH_SCRATCH: RefCell<FlashScratch> = RefCell::default();
    /// The states tasks hand back: per task and row `[m, s, acc…]`.
    static FLASH_STATES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `v` resized to `n` elements (contents unspecified), its capacity kept.
fn fit<T: Copy + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}

/// Flash attention over the cache, as ggml's CPU kernel (`flash_attn_ext_f16`, one query
/// row at a time) computes it: the query converted to K's `vec_dot_type` (f16 for f16 keys,
/// Q8_0 for Q8_0/Q4_0/Q5_0 keys, Q8_1 for Q4_1/Q5_1, bf16 for bf16) and dotted with K's
/// `vec_dot`; an online softmax over the visible keys in position order with libm's `expf`
/// (a new maximum rescales the accumulator by `e^(m_old − m)`, the sum as `S·ms + vs` with
/// GCC's FMA contraction); values accumulated in f32 as `acc += v·e^(s − m)` with FMA (f16
/// values converted exactly, block values dequantized first); the sink logit of the head
/// folded in last; and `acc / S`.
///
/// Over block-quantized values this is ggml's order, one online softmax over all visible
/// keys. Over f32/f16/bf16 values (`-fa on`) the keys go in chunks of
/// [`FLASH_CHUNK`] positions fixed by position (chunk `c` holds `c·FLASH_CHUNK ..`): each
/// chunk is a softmax from an empty state stepped a block of [`FLASH_BLOCK`] positions at a
/// time ([`softmax_block`]: one rescale per block, then the values key by key) and the chunks
/// are folded in position order ([`merge_softmax_chunk`]), so that one decode token can spread
/// its keys over every thread and the result still depends neither on the threads nor on the
/// rest of the batch.
///
/// The chunked kernel scores f32/f16 keys by [`hmoe_backend::numerics::dot_chain`] (one FMA chain per score, the
/// query heads sharing a KV head in the lanes of one vector, [`lane_scores`]) instead of
/// `vec_dot`'s four 16-lane chains.
///
/// Unlike llama.cpp, f32 keys and values are not rounded to f16 first (llama.cpp casts an
/// f32 cache to f16 for flash attention), and f16 values are summed in f32, not f16.
///
/// Work is split into tiles of [`Q_TILE`] queries × one KV head (× the query heads sharing
/// it), so each key and value row is converted once per tile, and, for one tile of chunked
/// keys, into one task per chunk; nothing of size queries × keys is allocated. Results do not
/// depend on the split.
pub(crate) fn flash_attention(
    cache: &LayerCache,
    shape: &AttnLayout,
    q: &[f32],
    pos0: usize,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let (kd, vd) = (shape.k_dim, shape.v_dim);
    if !heads_fit(cache, kd, vd, shape.v_in_k) {
        cache.refuse();
        out.fill(0.0);
        return;
    }
    let (n_head, n_head_kv) = (shape.n_head, shape.n_head_kv);
    let group = n_head / n_head_kv;
    let n_tokens = q.len() / (n_head * kd);
    if n_tokens == 0 {
        return;
    }
    let v_cells = if shape.v_in_k { &cache.k } else { &cache.v };
    // Chunk length: ggml's single online softmax (no chunks) for block-quantized values.
    let chunk = if needs_flash(v_cells) {
        usize::MAX
    } else {
        FLASH_CHUNK
    };
    let n_tiles = n_tokens.div_ceil(Q_TILE);
    // One tile of chunked keys: one task per chunk the tile's rows see.
    let (first_chunk, n_chunks) = if chunk != usize::MAX && n_tiles == 1 {
        let lo = cache.window.map_or(0, |w| (pos0 + 1).saturating_sub(w));
        let hi = pos0 + n_tokens - 1;
        (lo / chunk, hi / chunk - lo / chunk + 1)
    } else {
        (0, 1)
    };
    // Tasks: a tile of queries × a run of KV heads (with their query heads) × a chunk. Whole
    // head groups unless that leaves threads idle (one decode token over few chunks); several
    // KV heads per task when there are tasks to spare, so a task reads each position's keys
    // and values as one longer run.
    let threads = hmoe_pool::current_num_threads();
    let par = n_tiles * n_chunks;
    let (kv_per_task, heads_per_task) = if par * n_head_kv >= 2 * threads {
        let want = (par * n_head_kv / threads).clamp(1, n_head_kv);
        let kv = (1..=want)
            .rev()
            .find(|d| n_head_kv.is_multiple_of(*d))
            .unwrap_or(1);
        (kv, group)
    } else {
        (1, 1)
    };
    let splits = group / heads_per_task;
    let kv_runs = n_head_kv / kv_per_task;
    let n_tasks = n_tiles * kv_runs * splits * n_chunks;
    let rows_max = kv_per_task * Q_TILE.min(n_tokens) * heads_per_task;
    let state = vd + 2;
    let ctx = FlashTask {
        cache,
        shape,
        q,
        pos0,
        n_tokens,
        chunk,
        first_chunk,
        n_chunks,
        kv_per_task,
        heads_per_task,
        splits,
        kv_runs,
    };
    FLASH_STATES.with_borrow_mut(|states| {
        let states = fit(states, n_tasks * rows_max * state);
        hmoe_pool::global().for_each_chunk_mut(states, rows_max * state, |task, dst| {
            FLASH_SCRATCH.with_borrow_mut(|scratch| ctx.run(task, scratch, dst));
        });
        // Each output row: its chunks folded in position order, the sink, then `acc / S`.
        let states = &*states;
        hmoe_pool::global().for_each_chunk_mut(out, vd, |row, dst| {
            let (t, h) = (row / n_head, row % n_head);
            let (tile, kvh) = (t / Q_TILE, h / group);
            let (run, j) = (kvh / kv_per_task, kvh % kv_per_task);
            let (split, hh) = (h % group / heads_per_task, h % group % heads_per_task);
            let t0 = tile * Q_TILE;
            let tile_len = (t0 + Q_TILE).min(n_tokens) - t0;
            let idx = (j * tile_len + t - t0) * heads_per_task + hh;
            let task0 = ((tile * kv_runs + run) * splits + split) * n_chunks;
            let at = |c: usize| ((task0 + c) * rows_max + idx) * state;
            let (mut m, mut s) = (f32::NEG_INFINITY, 0f32);
            dst.fill(0.0);
            for c in 0..n_chunks {
                let st = &states[at(c)..at(c) + state];
                merge_softmax_chunk(&mut m, &mut s, dst, (st[0], st[1], &st[2..]));
            }
            if let Some(sinks) = sinks {
                let sink = sinks[h];
                if sink > m {
                    let ms = (m - sink).exp();
                    scale_f32(dst, ms);
                    s = s.mul_add(ms, 1.0);
                } else {
                    s += (sink - m).exp();
                }
            }
            let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
            scale_f32(dst, inv);
        });
    });
}

/// What every task of one [`flash_attention`] call shares.
struct FlashTask<'a> {
    cache: &'a LayerCache,
    shape: &'a AttnLayout,
    q: &'a [f32],
    pos0: usize,
    n_tokens: usize,
    /// Positions per chunk (`usize::MAX`: one chunk).
    chunk: usize,
    /// The chunk of task chunk index 0, and how many chunk indices there are (1 unless one
    /// tile is split by chunk).
    first_chunk: usize,
    n_chunks: usize,
    kv_per_task: usize,
    heads_per_task: usize,
    splits: usize,
    kv_runs: usize,
}

impl FlashTask<'_> {
    /// Runs task `task`, leaving each of its rows' state (`[m, s, acc…]`, the chunks it saw
    /// folded in position order) in `dst`.
    fn run(&self, task: usize, sc: &mut FlashScratch, dst: &mut [f32]) {
        let (cache, shape, q, pos0) = (self.cache, self.shape, self.q, self.pos0);
        let (kd, vd) = (shape.k_dim, shape.v_dim);
        let (n_head, n_head_kv) = (shape.n_head, shape.n_head_kv);
        let group = n_head / n_head_kv;
        let (kv_per_task, heads_per_task) = (self.kv_per_task, self.heads_per_task);
        let k_width = n_head_kv * kd;
        let v_width = if shape.v_in_k {
            k_width
        } else {
            n_head_kv * vd
        };
        let v_cells = if shape.v_in_k { &cache.k } else { &cache.v };
        let k_kernel = block_kernel(&cache.k);
        let v_dequant = match v_cells {
            Cells::Blocks { ty, .. } => {
                Some(Dequantizer::new(*ty).expect("every cache type dequantizes"))
            }
            _ => None,
        };
        let c_idx = task % self.n_chunks;
        let rest = task / self.n_chunks;
        let tile = rest / (self.kv_runs * self.splits);
        let kvh0 = rest % (self.kv_runs * self.splits) / self.splits * kv_per_task;
        let split = rest % self.splits;
        let t_end = ((tile + 1) * Q_TILE).min(self.n_tokens);
        // KV head major, so the rows of one KV head are one run.
        sc.rows.clear();
        for kvh in kvh0..kvh0 + kv_per_task {
            let h0 = kvh * group + split * heads_per_task;
            for t in tile * Q_TILE..t_end {
                for h in h0..h0 + heads_per_task {
                    let pos = pos0 + t;
                    let first = cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    sc.rows.push(RowSpan {
                        t,
                        h,
                        first,
                        last: pos,
                    });
                }
            }
        }
        let n_rows = sc.rows.len();
        let q_bytes = k_kernel.as_ref().map_or(0, |k| k.act_row_bytes(kd));
        let q_floats = if k_kernel.is_some() { 0 } else { kd };
        fit(&mut sc.q, n_rows * q_floats);
        fit(&mut sc.q_blocks, n_rows * q_bytes);
        for (r, span) in sc.rows.iter().enumerate() {
            let qh = &q[(span.t * n_head + span.h) * kd..][..kd];
            match (&cache.k, &k_kernel) {
                (_, Some(k)) => hmoe_quant::quantize_row(
                    k.act_type(),
                    qh,
                    &mut sc.q_blocks[r * q_bytes..(r + 1) * q_bytes],
                )
                .expect("heads are whole blocks (checked)"),
                (Cells::F16(_), None) => {
                    for (d, &v) in sc.q[r * kd..(r + 1) * kd].iter_mut().zip(qh) {
                        *d = f16::from_f32(v).to_f32();
                    }
                }
                _ => sc.q[r * kd..(r + 1) * kd].copy_from_slice(qh),
            }
        }
        // The chunked kernel scores f32/f16 keys by `dot_chain`, eight rows per vector.
        let k_in_place = match &cache.k {
            Cells::F32(k) => Some(LaneHeads::F32(k)),
            Cells::F16(k) => Some(LaneHeads::F16(k)),
            Cells::Blocks { .. } => None,
        };
        let chain = self.chunk != usize::MAX && k_in_place.is_some();
        let per_kv = n_rows / kv_per_task;
        let n_groups = per_kv.div_ceil(ROW_LANES);
        if chain {
            let qt = fit(&mut sc.qt, kv_per_task * n_groups * kd * ROW_LANES);
            for (jg, qt) in qt.chunks_exact_mut(kd * ROW_LANES).enumerate() {
                let (j, g) = (jg / n_groups, jg % n_groups);
                for l in 0..ROW_LANES {
                    let r = g * ROW_LANES + l;
                    for e in 0..kd {
                        qt[e * ROW_LANES + l] = if r < per_kv {
                            sc.q[(j * per_kv + r) * kd + e]
                        } else {
                            0.0
                        };
                    }
                }
            }
        }
        let state = vd + 2;
        // The task's running state per row starts empty in `dst`, the chunk's in the scratch.
        for st in dst.chunks_exact_mut(state).take(n_rows) {
            st[0] = f32::NEG_INFINITY;
            st[1] = 0.0;
        }
        fit(&mut sc.m, n_rows).fill(f32::NEG_INFINITY);
        fit(&mut sc.s, n_rows).fill(0.0);
        fit(&mut sc.acc, n_rows * vd).fill(0.0);
        let lo = sc.rows.iter().map(|r| r.first).min().unwrap_or(0);
        let hi = pos0 + t_end - 1;
        // A task of a split tile sees one chunk.
        let (lo, hi) = if self.n_chunks > 1 {
            let c = self.first_chunk + c_idx;
            (lo.max(c * self.chunk), hi.min((c + 1) * self.chunk - 1))
        } else {
            (lo, hi)
        };
        // Positions go in blocks (never across a chunk boundary): outside the chunked kernel,
        // the block's key and value heads are converted to f32 once for all rows and its
        // scores computed together, then each row runs its online softmax over the block in
        // position order (the order ggml's kernel uses). Block slot `(j, i)` holds KV head
        // `kvh0 + j` at position `b0 + i`.
        let slot = |j: usize, i: usize| j * POS_BLOCK + i;
        // Value slots are position-major, so one call converts a position's value heads
        // (adjacent in the cache) for every KV head of the task.
        let v_slot = |j: usize, i: usize| i * kv_per_task + j;
        let v_heads_adjacent = !shape.v_in_k;
        // f32/f16 keys are converted per block; block-typed keys are read in place, and so
        // are f32/f16 keys and values by the chunked kernel.
        let k_floats = match (&cache.k, chain) {
            (Cells::Blocks { .. }, _) | (_, true) => 0,
            _ => kv_per_task * POS_BLOCK * kd,
        };
        let k_block = fit(&mut sc.k_block, k_floats);
        // f32/f16 values are read in place by the chunked kernel, block-typed ones (bf16)
        // converted one KV head's block at a time.
        let v_in_place = match v_cells {
            Cells::F32(v) => Some(LaneHeads::F32(v)),
            Cells::F16(v) => Some(LaneHeads::F16(v)),
            Cells::Blocks { .. } => None,
        };
        let v_floats = match (chain, v_in_place) {
            (false, _) => kv_per_task * POS_BLOCK * vd,
            (true, None) => POS_BLOCK * vd,
            (true, Some(_)) => 0,
        };
        let v_block = fit(&mut sc.v_block, v_floats);
        let scores = fit(&mut sc.scores, n_rows * POS_BLOCK);
        let k_off = fit(&mut sc.k_off, kv_per_task * POS_BLOCK);
        let (rows, q_f, q_blocks, qt) = (&sc.rows, &sc.q, &sc.q_blocks, &sc.qt);
        let (row_m, row_s, row_acc) = (&mut sc.m, &mut sc.s, &mut sc.acc);
        let (k_be, k_bb) = match &cache.k {
            Cells::Blocks { ty, .. } => (ty.block_elems(), ty.block_bytes()),
            _ => (1, 0),
        };
        // Bytes of a key head and of a cache cell (block-typed keys).
        let k_row_bytes = kd / k_be * k_bb;
        let k_cell_bytes = k_width / k_be * k_bb;
        // Q8_0 keys: the rows of each KV head score a block of keys in one call.
        let q8_queries: Vec<Q8_0Queries> = match &cache.k {
            Cells::Blocks {
                ty: GgmlType::Q8_0, ..
            } => q_blocks[..n_rows * q_bytes]
                .chunks(per_kv * q_bytes)
                .map(|run| Q8_0Queries::new(kd, run))
                .collect(),
            _ => Vec::new(),
        };
        // Folds each row's chunk state into its running state in `dst` and empties it.
        let close_chunk = |m: &mut [f32], s: &mut [f32], acc: &mut [f32], dst: &mut [f32]| {
            for (r, st) in dst.chunks_exact_mut(state).take(n_rows).enumerate() {
                let (head, run) = st.split_at_mut(2);
                let (tm, ts) = head.split_at_mut(1);
                let a = &mut acc[r * vd..(r + 1) * vd];
                merge_softmax_chunk(&mut tm[0], &mut ts[0], run, (m[r], s[r], a));
                m[r] = f32::NEG_INFINITY;
                s[r] = 0.0;
                a.fill(0.0);
            }
        };
        // Value heads `kvh0 + j ..` of the position in `cell`, as many as `dst` holds.
        let values_at = |cell: usize, j: usize, dst: &mut [f32]| {
            let v_at = if shape.v_in_k {
                cell * k_width + (kvh0 + j) * kd
            } else {
                cell * v_width + (kvh0 + j) * vd
            };
            let n = dst.len();
            match v_cells {
                Cells::F32(v) => dst.copy_from_slice(&v[v_at..v_at + n]),
                Cells::F16(v) => v[v_at..v_at + n].convert_to_f32_slice(dst),
                Cells::Blocks { ty, data, .. } => v_dequant
                    .as_ref()
                    .expect("block values have a dequantizer")
                    .row(&data[block_range(*ty, v_at, n)], dst),
            }
        };
        let lane_sm = &mut sc.lanes;
        let mut b0 = lo;
        while b0 <= hi {
            // Blocks start at multiples of `POS_BLOCK` (the chunked kernel's softmax blocks,
            // fixed by position; chunks are whole blocks).
            let b1 = ((b0 / POS_BLOCK + 1) * POS_BLOCK).min(hi + 1);
            if b0 != lo && self.chunk != usize::MAX && b0.is_multiple_of(self.chunk) {
                close_chunk(row_m, row_s, row_acc, dst);
            }
            if let (true, Some(k_heads)) = (chain, k_in_place) {
                // Each group of rows of a KV head scores the block's keys, steps its softmax
                // and sums the values, in lanes.
                let n = b1 - b0;
                let mut lanes = [[0f32; ROW_LANES]; POS_BLOCK];
                let (mut k_at, mut v_at) = ([0usize; POS_BLOCK], [0usize; POS_BLOCK]);
                // The next block of the task's heads, one part per head, read while this
                // block's head computes (cut where it would wrap around the ring). After the
                // task's last block, the next chunk's first: the pool gives each thread a
                // contiguous run of tasks, so it is usually this thread's next.
                let next = b1..(b1 + POS_BLOCK).min(pos0 + t_end);
                let next_part = |width: usize, d: usize, j: usize| {
                    if next.is_empty() {
                        return 0..0;
                    }
                    let (c0, c1) = (next.start % cache.cells, (next.end - 1) % cache.cells);
                    let c1 = if c1 < c0 { cache.cells - 1 } else { c1 };
                    let (from, to) = (c0 * width + kvh0 * d, c1 * width + (kvh0 + kv_per_task) * d);
                    let part = (to - from).div_ceil(kv_per_task);
                    from + j * part..from + (j + 1) * part
                };
                // The block's cells, counted on around the ring (no division per position).
                let mut cells = [0usize; POS_BLOCK];
                let mut cell = b0 % cache.cells;
                for c in &mut cells[..n] {
                    *c = cell;
                    cell = if cell + 1 == cache.cells { 0 } else { cell + 1 };
                }
                for j in 0..kv_per_task {
                    let k_ahead = Ahead::of(k_heads, next_part(k_width, kd, j));
                    let v_ahead = match (v_in_place, shape.v_in_k) {
                        (Some(v), false) => Ahead::of(v, next_part(v_width, vd, j)),
                        _ => Ahead::default(),
                    };
                    for (i, &cell) in cells[..n].iter().enumerate() {
                        k_at[i] = cell * k_width + (kvh0 + j) * kd;
                        v_at[i] = match (v_in_place, shape.v_in_k) {
                            (_, true) => k_at[i],
                            (Some(_), false) => cell * v_width + (kvh0 + j) * vd,
                            (None, false) => {
                                values_at(cell, j, &mut v_block[i * vd..(i + 1) * vd]);
                                i * vd
                            }
                        };
                    }
                    let v_heads = v_in_place.unwrap_or(LaneHeads::F32(v_block));
                    for g in 0..n_groups {
                        let jg = j * n_groups + g;
                        let qt = &qt[jg * kd * ROW_LANES..(jg + 1) * kd * ROW_LANES];
                        let k_ahead = if g == 0 { k_ahead } else { Ahead::default() };
                        lane_scores(qt, k_heads, &k_at[..n], kd, &mut lanes[..n], k_ahead);
                        let r0 = j * per_kv + g * ROW_LANES;
                        let here = ROW_LANES.min(per_kv - g * ROW_LANES);
                        for l in 0..ROW_LANES {
                            match rows.get(r0 + l).filter(|_| l < here) {
                                Some(span) => lane_sm.set_row(
                                    l,
                                    (row_m[r0 + l], row_s[r0 + l]),
                                    (span.first, span.last),
                                ),
                                None => lane_sm.clear_row(l),
                            }
                        }
                        lane_sm.step_block(&lanes[..n], shape.scale, b0);
                        lane_values(
                            lane_sm.block(),
                            v_heads,
                            &v_at[..n],
                            vd,
                            &mut row_acc[r0 * vd..],
                            here,
                            if g == 0 { v_ahead } else { Ahead::default() },
                        );
                        for l in 0..here {
                            (row_m[r0 + l], row_s[r0 + l]) = lane_sm.row_state(l);
                        }
                    }
                }
                b0 = b1;
                continue;
            }
            // Every position of `lo..=hi` is seen by some row: the tile's queries are
            // consecutive, so their windows overlap or touch.
            for p in b0..b1 {
                let i = p - b0;
                // Quantized key and value heads come from a cache far larger than the CPU's,
                // in rows too short for the hardware prefetcher: ask for the heads
                // [`PREFETCH_AHEAD`] positions on, one position at a time while this block
                // computes.
                if p + PREFETCH_AHEAD <= hi {
                    let cell = (p + PREFETCH_AHEAD) % cache.cells;
                    if let Cells::Blocks { data, .. } = &cache.k {
                        let at = cell * k_cell_bytes + kvh0 * k_row_bytes;
                        prefetch(&data[at..at + kv_per_task * k_row_bytes]);
                    }
                    if let (Cells::Blocks { ty, data, .. }, false) = (v_cells, shape.v_in_k) {
                        let at = cell * v_width + kvh0 * vd;
                        prefetch(&data[block_range(*ty, at, kv_per_task * vd)]);
                    }
                }
                let cell = p % cache.cells;
                for j in 0..kv_per_task {
                    let k_at = cell * k_width + (kvh0 + j) * kd;
                    k_off[slot(j, i)] = cell * k_cell_bytes + (kvh0 + j) * k_row_bytes;
                    let kb = slot(j, i) * kd..(slot(j, i) + 1) * kd;
                    match &cache.k {
                        Cells::F32(k) => k_block[kb].copy_from_slice(&k[k_at..k_at + kd]),
                        Cells::F16(k) => k[k_at..k_at + kd].convert_to_f32_slice(&mut k_block[kb]),
                        Cells::Blocks { .. } => {}
                    }
                }
                let v_at = |j: usize| v_slot(j, i) * vd;
                if v_heads_adjacent {
                    values_at(cell, 0, &mut v_block[v_at(0)..v_at(0) + kv_per_task * vd]);
                } else {
                    (0..kv_per_task)
                        .for_each(|j| values_at(cell, j, &mut v_block[v_at(j)..v_at(j) + vd]));
                }
            }
            if let (false, Cells::Blocks { data, .. }) = (q8_queries.is_empty(), &cache.k) {
                for (j, queries) in q8_queries.iter().enumerate() {
                    let key_at = &k_off[slot(j, 0)..slot(j, b1 - b0)];
                    let out = &mut scores[j * per_kv * POS_BLOCK..(j + 1) * per_kv * POS_BLOCK];
                    queries.scores(data, key_at, shape.scale, out, POS_BLOCK);
                }
            } else {
                for (r, (span, sc_row)) in rows
                    .iter()
                    .zip(scores.chunks_exact_mut(POS_BLOCK))
                    .enumerate()
                {
                    let j = span.h / group - kvh0;
                    for p in span.first.max(b0)..=span.last.min(b1 - 1) {
                        let at = slot(j, p - b0);
                        let kb = at * kd..(at + 1) * kd;
                        let qf = || &q_f[r * kd..(r + 1) * kd];
                        sc_row[p - b0] = match &cache.k {
                            Cells::F32(_) => dot_vec_f32(qf(), &k_block[kb]),
                            // `vec_dot_f16` of the f16-rounded query (exact in f32).
                            Cells::F16(_) => dot_vec(qf(), &k_block[kb], |x| x, true),
                            Cells::Blocks { data, .. } => {
                                let off = k_off[at];
                                k_kernel.as_ref().map_or(0.0, |kk| {
                                    kk.dot(
                                        kd,
                                        &data[off..off + k_row_bytes],
                                        &q_blocks[r * q_bytes..(r + 1) * q_bytes],
                                    )
                                })
                            }
                        } * shape.scale;
                    }
                }
            }
            for (r, (span, sc_row)) in rows.iter().zip(scores.chunks_exact(POS_BLOCK)).enumerate() {
                let j = span.h / group - kvh0;
                let (from, to) = (span.first.max(b0), span.last.min(b1 - 1));
                if from > to {
                    continue;
                }
                let scores = &sc_row[from - b0..=to - b0];
                let values = &v_block[v_slot(j, from - b0) * vd..v_slot(j, to - b0) * vd + vd];
                let stride = kv_per_task * vd;
                let (m, s) = (&mut row_m[r], &mut row_s[r]);
                let acc = &mut row_acc[r * vd..(r + 1) * vd];
                match (self.chunk == usize::MAX, vd) {
                    (true, 64) => online_softmax::<64>(m, s, acc, scores, values, stride),
                    (true, 128) => online_softmax::<128>(m, s, acc, scores, values, stride),
                    (true, _) => online_softmax_any(m, s, acc, scores, values, stride),
                    (false, _) => block_softmax(m, s, acc, scores, values, stride),
                }
            }
            b0 = b1;
        }
        close_chunk(row_m, row_s, row_acc, dst);
        // Rows a short last tile does not have stay empty.
        for st in dst.chunks_exact_mut(state).skip(n_rows) {
            st[0] = f32::NEG_INFINITY;
            st[1] = 0.0;
        }
    }
}

/// Folds consecutive keys (`scores`, one value head of `D` elements each in `values`,
/// `stride` apart) into a row's online-softmax state (maximum `m`, sum `s`, values `acc`),
/// with the accumulator held in registers for the whole run.
fn online_softmax<const D: usize>(
    m_row: &mut f32,
    s_row: &mut f32,
    acc_row: &mut [f32],
    scores: &[f32],
    values: &[f32],
    stride: usize,
) {
    // The running maximum first, then the one exponential each key needs (independent
    // calls, so they overlap), then the accumulator in key order: the same operations
    // on the same operands as `online_softmax_step` key by key.
    let n = scores.len().min(POS_BLOCK);
    let (mut arg, mut new_max) = ([0f32; POS_BLOCK], [false; POS_BLOCK]);
    let mut m = *m_row;
    // An OR of comparisons (not `any`, which stops early) so that it vectorizes.
    let raises = scores[..n].iter().fold(false, |r, &s| r | (s > m));
    if raises {
        for (i, &score) in scores[..n].iter().enumerate() {
            if score > m {
                (arg[i], new_max[i]) = (m - score, true);
                m = score;
            } else {
                arg[i] = score - m;
            }
        }
    } else {
        // No key raises the maximum (the common case once a few blocks are in).
        for (a, &score) in arg[..n].iter_mut().zip(&scores[..n]) {
            *a = score - m;
        }
    }
    *m_row = m;
    // libm's `expf`, sixteen lanes at a time.
    let mut e = arg;
    expf_slice(&mut e[..n]);
    let mut acc = [0f32; D];
    acc.copy_from_slice(acc_row);
    let mut s = *s_row;
    for (i, v) in values.chunks(stride).take(n).enumerate() {
        let v = &v[..D];
        let (ms, vs) = if new_max[i] { (e[i], 1.0) } else { (1.0, e[i]) };
        s = s.mul_add(ms, vs);
        if ms != 1.0 {
            for a in acc.iter_mut() {
                *a *= ms;
            }
        }
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = x.mul_add(vs, *a);
        }
    }
    *s_row = s;
    acc_row.copy_from_slice(&acc);
}

/// [`online_softmax`] for value heads of any size.
fn online_softmax_any(
    m: &mut f32,
    s: &mut f32,
    acc: &mut [f32],
    scores: &[f32],
    values: &[f32],
    stride: usize,
) {
    let vd = acc.len();
    for (&score, v) in scores.iter().zip(values.chunks(stride)) {
        let (ms, vs) = online_softmax_step(m, s, score);
        scale_f32(acc, ms);
        mad_f32(acc, &v[..vd], vs);
    }
}

/// Folds one block of keys of the chunked kernel (`scores`, one value head of `acc.len()`
/// elements each in `values`, `stride` apart) into a row's chunk state (maximum `m`, sum `s`,
/// values `acc`) as [`softmax_block`] steps it: `acc·ms`, then `acc = v·p + acc` key by key.
fn block_softmax(
    m: &mut f32,
    s: &mut f32,
    acc: &mut [f32],
    scores: &[f32],
    values: &[f32],
    stride: usize,
) {
    let mut p = [0f32; POS_BLOCK];
    let n = scores.len().min(POS_BLOCK);
    let ms = softmax_block(m, s, &scores[..n], &mut p[..n]);
    acc.iter_mut().for_each(|a| *a *= ms);
    for (v, &p) in values.chunks(stride).zip(&p[..n]) {
        mad_f32(acc, &v[..acc.len()], p);
    }
}

/// `y *= s` (ggml's `vec_scale_f32`; skipped for `s == 1`, which changes nothing).
fn scale_f32(y: &mut [f32], s: f32) {
    if s != 1.0 {
        for v in y.iter_mut() {
            *v *= s;
        }
    }
}

/// `y += x·s` with one rounding per element (ggml's `vec_mad_f32`, FMA lanes).
fn mad_f32(y: &mut [f32], x: &[f32], s: f32) {
    for (a, &b) in y.iter_mut().zip(x) {
        *a = b.mul_add(s, *a);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use hmoe_backend::{CacheType, FlashAttn, KvType};

    /// Deterministic values in [-1, 1).
    pub(crate) fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    const N_HEAD: usize = 4;
    const N_KV: usize = 2;
    const HD: usize = 64;

    fn shape() -> AttnShape {
        AttnShape {
            n_head: N_HEAD,
            n_head_kv: N_KV,
            head_dim: HD,
            scale: 1.0 / (HD as f32).sqrt(),
        }
    }

    /// Keys and values for `n` positions (keys scaled up so the softmax is far from uniform).
    fn kv_rows(n: usize) -> (Vec<f32>, Vec<f32>) {
        let k: Vec<f32> = noise(1, n * N_KV * HD).iter().map(|x| 3.0 * x).collect();
        (k, noise(2, n * N_KV * HD))
    }

    /// f64 attention over exact keys and values: the reference.
    fn reference(
        k: &[f32],
        v: &[f32],
        q: &[f32],
        pos0: usize,
        window: Option<usize>,
        sinks: &[f32],
    ) -> Vec<f32> {
        let w = N_KV * HD;
        let n_tok = q.len() / (N_HEAD * HD);
        let mut out = vec![0f32; q.len()];
        for t in 0..n_tok {
            let pos = pos0 + t;
            let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for h in 0..N_HEAD {
                let kvh = h / (N_HEAD / N_KV);
                let qh = &q[(t * N_HEAD + h) * HD..][..HD];
                let scores: Vec<f64> = (first..=pos)
                    .map(|p| {
                        let kh = &k[p * w + kvh * HD..][..HD];
                        qh.iter()
                            .zip(kh)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            / (HD as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().copied().fold(sinks[h] as f64, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = e.iter().sum::<f64>() + (sinks[h] as f64 - m).exp();
                for d in 0..HD {
                    let acc: f64 = (first..=pos)
                        .zip(&e)
                        .map(|(p, &e)| e * v[p * w + kvh * HD + d] as f64)
                        .sum();
                    out[(t * N_HEAD + h) * HD + d] = (acc / sum) as f32;
                }
            }
        }
        out
    }

    /// Fills a one-layer cache with `n` positions (in micro-batches of `ub`) and runs attention
    /// for the last `n_q` of them in one call.
    fn run(
        ty: KvType,
        window: Option<usize>,
        n: usize,
        ub: usize,
        n_q: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let (k, v) = kv_rows(n);
        let w = N_KV * HD;
        let mut cache = LayerCache::for_context(ty, n, ub, w, window).with_head_dims(HD, HD);
        let layer = &mut cache;
        for start in (0..n).step_by(ub) {
            let end = (start + ub).min(n);
            layer.store(
                start,
                &k[start * w..end * w],
                &v[start * w..end * w],
                end - start,
            );
        }
        let q = noise(3, n_q * N_HEAD * HD);
        let sinks = [0.5, -1.0, 2.0, 0.0];
        let mut out = vec![0f32; q.len()];
        attention(layer, &shape(), &q, n - n_q, Some(&sinks), &mut out);
        (out, reference(&k, &v, &q, n - n_q, window, &sinks))
    }

    /// Largest |a − b| relative to the largest |b|.
    fn rel_err(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    #[test]
    fn flash_attention_matches_f64_for_every_cache_type() {
        // Bounds: 1.5-2× the measured conversion error of each type (max |error| over the
        // largest |output|); a wrong head or position gives errors of order 1.
        let cases = [
            (CacheType::F32, 1e-6),
            (CacheType::F16, 4e-3),
            (CacheType::BF16, 6e-3),
            (CacheType::Q8_0, 2.5e-2),
            (CacheType::Q5_0, 1.2e-1),
            (CacheType::Q5_1, 1.2e-1),
            (CacheType::Q4_0, 2.5e-1),
            (CacheType::Q4_1, 2.5e-1),
        ];
        for (t, tol) in cases {
            let ty = KvType::new(t, t, FlashAttn::On).unwrap();
            // A prefill of several query tiles, then one decode token; full and sliding layers.
            // Over f32/f16/bf16 values, also several flash chunks.
            for (window, n, n_q) in [
                (None, 70, 40),
                (Some(8), 70, 40),
                (None, 70, 1),
                (Some(8), 70, 1),
                (None, 2 * FLASH_CHUNK + 30, 1),
                (None, 2 * FLASH_CHUNK + 30, 20),
            ] {
                if n > 70 && t.is_quantized() {
                    continue;
                }
                let (out, want) = run(ty, window, n, 40, n_q);
                let err = rel_err(&out, &want);
                assert!(
                    err < tol,
                    "{t} window {window:?} queries {n_q}: relative error {err:.2e}"
                );
            }
        }
    }

    #[test]
    fn non_flash_attention_reads_block_keys_and_bf16_values() {
        for (k, v, tol) in [
            (CacheType::Q8_0, CacheType::F16, 2e-2),
            (CacheType::Q4_0, CacheType::F32, 2e-1),
            (CacheType::BF16, CacheType::BF16, 6e-3),
        ] {
            let ty = KvType::new(k, v, FlashAttn::Off).unwrap();
            assert!(!ty.flash_attn());
            for n_q in [1, 40] {
                let (out, want) = run(ty, Some(8), 70, 40, n_q);
                let err = rel_err(&out, &want);
                assert!(err < tol, "{k}/{v} queries {n_q}: relative error {err:.2e}");
            }
        }
    }

    #[test]
    fn flash_attention_rows_do_not_depend_on_the_batch() {
        // The same queries, all at once and one at a time, give identical bits: ggml's kernel
        // over quantized values, and the chunked kernel over f16 values (one token splits its
        // chunks over tasks, a batch folds them in one task), full and sliding.
        for (t, n, window) in [
            (CacheType::Q8_0, 50, Some(8)),
            (CacheType::F16, 50, Some(8)),
            (CacheType::F16, 3 * FLASH_CHUNK + 50, None),
            (CacheType::F32, 3 * FLASH_CHUNK + 50, Some(FLASH_CHUNK + 7)),
        ] {
            batch_invariance(t, n, window);
        }
    }

    fn batch_invariance(t: CacheType, n: usize, window: Option<usize>) {
        let ty = KvType::new(t, t, FlashAttn::On).unwrap();
        let n_q = 20;
        let (k, v) = kv_rows(n);
        let w = N_KV * HD;
        let mut cache = LayerCache::for_context(ty, n, n, w, window).with_head_dims(HD, HD);
        cache.store(0, &k, &v, n);
        let q = noise(3, n_q * N_HEAD * HD);
        let sinks = [0.5, -1.0, 2.0, 0.0];
        let mut all = vec![0f32; q.len()];
        attention(&cache, &shape(), &q, n - n_q, Some(&sinks), &mut all);
        for t in 0..n_q {
            let row = N_HEAD * HD;
            let mut one = vec![0f32; row];
            attention(
                &cache,
                &shape(),
                &q[t * row..(t + 1) * row],
                n - n_q + t,
                Some(&sinks),
                &mut one,
            );
            assert_eq!(
                one,
                all[t * row..(t + 1) * row],
                "{ty:?} {window:?} query {t}"
            );
        }
    }

    #[test]
    fn quantized_heads_are_rotated_like_llama_cpp() {
        let ty = KvType::new(CacheType::Q8_0, CacheType::Q4_0, FlashAttn::On).unwrap();
        let cache = LayerCache::for_context(ty, 8, 8, 2 * 128, None).with_head_dims(128, 128);
        // K: the largest power of two dividing the head; V: always 64.
        assert_eq!((cache.k.rotation(), cache.v.rotation()), (128, 64));
        let plain = LayerCache::for_context(KvType::F16, 8, 8, 128, None).with_head_dims(64, 64);
        assert_eq!(plain.k.rotation(), 0);
        // The transform is orthonormal and its own inverse.
        let x = noise(5, 64);
        let mut y = x.clone();
        fwht(&mut y);
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&y) - norm(&x)).abs() < 1e-4 * norm(&x));
        fwht(&mut y);
        assert!(rel_err(&y, &x) < 1e-6);
        // Head 0 of a rotated row is H·x: its first value is the scaled sum.
        let mut first = x.clone();
        fwht(&mut first);
        assert!((first[0] - x.iter().sum::<f32>() / 8.0).abs() < 1e-5);
    }

    /// `vec_dot_f32`'s order written out index by index: four 16-lane accumulators per
    /// 64 elements, folded (0+2)+(1+3), reduced, then the tail.
    fn dot_by_index(a: &[f32], b: &[f32]) -> f32 {
        let np = a.len() / 64 * 64;
        let mut acc = [[0f32; LANES]; 4];
        for i in (0..np).step_by(64) {
            for j in 0..4 {
                for l in 0..LANES {
                    acc[j][l] = a[i + j * LANES + l].mul_add(b[i + j * LANES + l], acc[j][l]);
                }
            }
        }
        let folded: [f32; LANES] =
            std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
        let mut sum = hsum16(&folded);
        for k in np..a.len() {
            sum += a[k] * b[k];
        }
        sum
    }

    #[test]
    fn dot_vec_keeps_ggml_order() {
        for n in [16, 64, 80, 128, 200, 576] {
            let (a, b) = (noise(7, n), noise(8, n));
            assert_eq!(
                dot_vec_f32(&a, &b).to_bits(),
                dot_by_index(&a, &b).to_bits(),
                "n {n}"
            );
        }
    }

    /// The row kernel's tasks run one at a time with `kv_per_task` KV heads each, through the
    /// vector kernels or (`kernels` false) the element-by-element loops.
    fn row_kernel_with(
        cache: &LayerCache,
        shape: &AttnShape,
        q: &[f32],
        pos0: usize,
        sinks: Option<&[f32]>,
        kv_per_task: usize,
        kernels: bool,
    ) -> Vec<f32> {
        let ctx = RowTask {
            cache,
            k_kernel: block_kernel(&cache.k),
            group: shape.n_head / shape.n_head_kv,
            n_head_kv: shape.n_head_kv,
            kv_per_task,
            hd: shape.head_dim,
            scale: shape.scale,
            single_token: q.len() == shape.n_head * shape.head_dim,
            q,
            pos0,
            sinks,
        };
        let mut out = vec![0f32; q.len()];
        let mut sc = RowScratch::default();
        let chunk = kv_per_task * ctx.group * shape.head_dim;
        for (task, dst) in out.chunks_exact_mut(chunk).enumerate() {
            ctx.run(task, &mut sc, dst, kernels);
        }
        out
    }

    #[test]
    fn row_kernel_f16_kernels_equal_the_element_loops() {
        // gpt-oss's group of 8 with heads of 64, other groups and head sizes (one the vector
        // kernels decline), full layers and windows whose positions wrap around the ring,
        // one token and a batch, with and without sinks.
        for (n_head, n_kv, hd, window, n, n_q) in [
            (32, 4, 64, None, 300, 1),
            (16, 2, 64, None, 300, 1),
            (16, 2, 64, Some(40), 300, 1),
            (16, 2, 64, Some(40), 300, 7),
            (8, 1, 128, None, 77, 1),
            (6, 3, 32, Some(17), 90, 1),
            (4, 2, 80, None, 50, 3),
        ] {
            let w = n_kv * hd;
            let ub = 8;
            let mut cache =
                LayerCache::for_context(KvType::F16, n, ub, w, window).with_head_dims(hd, hd);
            let (k, v) = (noise(1, n * w), noise(2, n * w));
            let k: Vec<f32> = k.iter().map(|x| 4.0 * x).collect();
            for start in (0..n).step_by(ub) {
                let end = (start + ub).min(n);
                cache.store(
                    start,
                    &k[start * w..end * w],
                    &v[start * w..end * w],
                    end - start,
                );
            }
            let shape = AttnShape {
                n_head,
                n_head_kv: n_kv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let sinks: Vec<f32> = noise(4, n_head);
            for sinks in [None, Some(&sinks[..])] {
                let q = noise(3, n_q * n_head * hd);
                let mut out = vec![0f32; q.len()];
                let layer = &cache;
                attention(layer, &shape, &q, n - n_q, sinks, &mut out);
                let want = row_kernel_with(layer, &shape, &q, n - n_q, sinks, 1, false);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&out),
                    bits(&want),
                    "heads {n_head}/{n_kv} of {hd}, window {window:?}, {n_q} queries, sinks {}",
                    sinks.is_some()
                );
                // Any run of KV heads per task, either way.
                for kv in (1..=n_kv).filter(|k| n_kv.is_multiple_of(*k)) {
                    for kernels in [false, true] {
                        let got = row_kernel_with(layer, &shape, &q, n - n_q, sinks, kv, kernels);
                        assert_eq!(bits(&got), bits(&want), "{kv} KV heads per task");
                    }
                }
            }
        }
    }

    /// The softmax as it was written element by element (ggml's order, scalar `expf_ggml`).
    fn softmax_by_element(probs: &mut [f32], skip: usize, sink: Option<f32>) {
        let mut max = probs[skip..]
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        if let Some(s) = sink {
            max = max.max(s);
        }
        let mut sum = 0f64;
        for (c, chunk) in probs.chunks_mut(LANES).enumerate() {
            let mut lanes = [0f32; LANES];
            for (i, v) in chunk.iter_mut().enumerate() {
                *v = if c * LANES + i < skip {
                    0.0
                } else {
                    hmoe_backend::numerics::expf_ggml(*v - max)
                };
                lanes[i] = *v;
            }
            sum += hsum16(&lanes) as f64;
        }
        if let Some(s) = sink {
            sum += (s - max).exp() as f64;
        }
        let inv = (1.0 / sum) as f32;
        for v in probs.iter_mut() {
            *v *= inv;
        }
    }

    #[test]
    fn softmax_window_keeps_the_element_order_bits() {
        for (n, skip, sink) in [
            (1, 0, None),
            (16, 3, Some(0.5)),
            (37, 16, None),
            (300, 5, Some(9.0)),
            (4097, 0, Some(-3.0)),
        ] {
            // Scores over a wide range, a repeated maximum and a zero among them.
            let mut scores: Vec<f32> = noise(9, n).iter().map(|x| 30.0 * x).collect();
            scores[n / 2] = 0.0;
            let top = scores.iter().copied().fold(f32::MIN, f32::max);
            scores[n - 1] = top;
            let mut want = scores.clone();
            softmax_by_element(&mut want, skip, sink);
            softmax_window(&mut scores, skip, sink);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&scores), bits(&want), "{n} scores, skip {skip}");
        }
    }

    #[test]
    fn heads_that_straddle_blocks_are_refused() {
        let ty = KvType::new(CacheType::Q8_0, CacheType::Q8_0, FlashAttn::On).unwrap();
        let cache = LayerCache::for_context(ty, 8, 8, 2 * 16, None);
        let shape = AttnShape {
            n_head: 2,
            n_head_kv: 2,
            head_dim: 16,
            scale: 0.25,
        };
        let mut out = vec![1f32; 32];
        attention(&cache, &shape, &[0.0; 32], 0, None, &mut out);
        assert!(cache.refused.load(std::sync::atomic::Ordering::Relaxed));
        assert!(out.iter().all(|&x| x == 0.0));
    }
}

/// Speed of attention on gpt-oss-120b's shapes (64 query heads, 8 KV heads of 64), with the
/// cache warm in L3 and cold (64 MiB written first, as a generating model's weights evict it):
/// `cargo test --release -p hmoe-cpu --lib attention_speed -- --ignored --nocapture` (decode
/// and prefill; `attention_speed_decode` for decode alone).
#[cfg(test)]
mod speed {
    use super::*;
    use hmoe_backend::{CacheType, FlashAttn, KvType};

    /// Nanoseconds of CPU time this process's threads have run (Linux's per-thread
    /// `schedstat`; 0 where it is missing).
    fn cpu_ns() -> u64 {
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return 0;
        };
        tasks
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }

    #[test]
    #[ignore]
    fn attention_speed_decode() {
        speed(&[
            ("decode at depth 4096", 4096, 1),
            ("decode at depth 16384", 16384, 1),
        ]);
    }

    #[test]
    #[ignore]
    fn attention_speed_prefill() {
        speed(&[("prefill of 512", 0, 512)]);
    }

    /// Each `(what, depth, queries)` case for the q8_0 flash kernel, the chunked f16 flash
    /// kernel and the f16 row kernel.
    fn speed(cases: &[(&str, usize, usize)]) {
        let (nh, nkv, hd) = (64, 8, 64);
        let w = nkv * hd;
        for &(what, depth, n_q) in cases {
            for (k, v, fa) in [
                (CacheType::Q8_0, CacheType::Q8_0, FlashAttn::On),
                (CacheType::F16, CacheType::F16, FlashAttn::On),
                (CacheType::F16, CacheType::F16, FlashAttn::Off),
            ] {
                let n = depth + n_q;
                let ty = KvType::new(k, v, fa).unwrap();
                let mut cache = LayerCache::for_context(ty, n, n_q, w, None).with_head_dims(hd, hd);
                let rows: Vec<f32> = (0..n * w)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                cache.store(0, &rows, &rows, n);
                let q: Vec<f32> = (0..n_q * nh * hd)
                    .map(|i| ((i * 31) % 100) as f32 / 50.0 - 1.0)
                    .collect();
                let shape = AttnShape {
                    n_head: nh,
                    n_head_kv: nkv,
                    head_dim: hd,
                    scale: 0.125,
                };
                let mut out = vec![0f32; q.len()];
                let mut evict = vec![0u8; 64 << 20];
                // Per call: the best wall time of five, and the CPU time of all threads
                // averaged over them (steadier than wall time on a busy machine).
                let mut best = |cold: bool| {
                    let (mut wall, mut cpu) = (f64::MAX, 0.0);
                    for _ in 0..5 {
                        if cold {
                            evict.iter_mut().for_each(|b| *b = b.wrapping_add(1));
                            std::hint::black_box(&evict);
                        }
                        let (t, c) = (std::time::Instant::now(), cpu_ns());
                        attention(&cache, &shape, &q, depth, None, &mut out);
                        wall = wall.min(t.elapsed().as_secs_f64() * 1e3);
                        cpu += cpu_ns().saturating_sub(c) as f64 / 5e6;
                    }
                    (wall, cpu)
                };
                let ((warm, warm_cpu), (cold, cold_cpu)) = (best(false), best(true));
                eprintln!(
                    "{what}, {k}/{v}, flash {}: {warm:.2} ms warm, {cold:.2} ms cold per layer \
                     ({} threads, wall); CPU {warm_cpu:.2} ms warm, {cold_cpu:.2} ms cold",
                    ty.flash_attn(),
                    hmoe_pool::current_num_threads()
                );
            }
        }
    }
}
