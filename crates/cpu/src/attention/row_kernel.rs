//! The row kernel (`-fa off`): one query row at a time over f32/f16/bf16 values, ggml's
//! non-flash numerics, one task per (token, run of KV heads).

use std::cell::RefCell;
use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;
use hmoe_backend::numerics::hsum16;
use hmoe_quant::{expf_ggml_slice, f16_bytes, DotKernel, GgmlType};

use super::attn_shape::{AttnLayout, AttnShape};
use super::f16_rows::{f16_head_scores, f16_value_lanes};
use super::flash::flash_attention;
use super::kv_reads::{
    block_dot, block_kernel, dequantize_at, dot_lanes, dot_vec_f32, fit, heads_fit, needs_flash,
    round_weight, LANES,
};
use crate::kv_storage::{Cells, LayerCache};

/// [`attention`] once the query is rotated like the stored keys (the output is still in the
/// rotated basis of the stored values).
pub(super) fn attention_rotated(
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
pub(super) struct RowTask<'a> {
    pub(super) cache: &'a LayerCache,
    /// K's `vec_dot` kernel for block-typed keys.
    pub(super) k_kernel: Option<DotKernel>,
    /// Query heads per KV head.
    pub(super) group: usize,
    pub(super) n_head_kv: usize,
    /// KV heads per task ([`row_kv_per_task`]).
    pub(super) kv_per_task: usize,
    pub(super) hd: usize,
    pub(super) scale: f32,
    pub(super) single_token: bool,
    pub(super) q: &'a [f32],
    pub(super) pos0: usize,
    pub(super) sinks: Option<&'a [f32]>,
}

/// One row-kernel task's buffers, kept per thread between calls so that a token allocates
/// nothing once they have grown to the shapes in use (a score row of 4096 positions for eight
/// heads is 128 KiB, which the allocator would otherwise hand back to the system every token).
#[derive(Default)]
pub(super) struct RowScratch {
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

/// Where one row-kernel task looks: its token's position and window, its KV heads, and the
/// positions its probability rows cover.
struct RowPlace<'q> {
    /// The task's first KV head (it has `kv_per_task`).
    kvh0: usize,
    /// KV heads of the task.
    n_kv: usize,
    /// The token's position and the first position its window sees.
    pos: usize,
    first: usize,
    /// Probability rows cover `chunk_start..=pos` (`span` positions).
    chunk_start: usize,
    span: usize,
    /// Elements of a head and of a cache cell.
    hd: usize,
    width: usize,
    cells: usize,
    /// The task's query heads.
    heads: &'q [f32],
}

impl RowPlace<'_> {
    /// Element offset of KV head `kvh0 + j` at position `p`.
    fn cell(&self, p: usize, j: usize) -> usize {
        (p % self.cells) * self.width + (self.kvh0 + j) * self.hd
    }

    /// The blocks of `first..=pos` the kernels take in turn, each after asking for the
    /// task's heads of the next one.
    fn blocks(&self) -> impl Iterator<Item = Range<usize>> {
        let pos = self.pos;
        (self.first..=pos)
            .step_by(ROW_BLOCK)
            .map(move |b| b..(b + ROW_BLOCK).min(pos + 1))
    }

    /// The block after `b`.
    fn next(&self, b: &Range<usize>) -> Range<usize> {
        b.end..(b.end + ROW_BLOCK).min(self.pos + 1)
    }

    /// Asks the CPU for the task's heads at the positions of `block`.
    fn ask(&self, data: &[f16], block: Range<usize>) {
        for p in block {
            let at = self.cell(p, 0);
            hmoe_quant::prefetch(f16_bytes(&data[at..at + self.n_kv * self.hd]));
        }
    }
}

impl RowTask<'_> {
    /// Runs task `task` (token `t`, KV heads `kvh0..kvh0 + kv_per_task`), writing their query
    /// heads' outputs to `dst`. `kernels`: f16 keys of one token and f16 values go through
    /// the attention kernels ([`f16_head_scores`], [`f16_value_lanes`]), a block of positions
    /// at a time for all the task's KV heads (the same bits as the element-by-element loops,
    /// which `false` runs instead, for the tests).
    pub(super) fn run(&self, task: usize, sc: &mut RowScratch, dst: &mut [f32], kernels: bool) {
        let pl = self.place(task);
        let RowScratch {
            q_half,
            q16,
            q_blocks,
            probs,
            row_scores,
            k_row,
            v_row,
            acc,
        } = sc;
        let rows = pl.n_kv * self.group;
        // Probabilities for positions chunk_start..=pos per query head (row `j · group + g`),
        // zero outside the window.
        let probs = fit(probs, rows * pl.span);
        match &self.cache.k {
            // `vec_dot_f16` for one token's f16 keys (ggml rounds the query to f16 first).
            Cells::F16(k) if self.single_token => {
                q_half.clear();
                q_half.extend(pl.heads.iter().map(|&v| f16::from_f32(v)));
                match kernels {
                    true => self.f16_scores(&pl, k, q_half, probs),
                    false => self.f16_scores_by_key(&pl, k, q_half, row_scores, probs),
                }
            }
            _ => self.batch_scores(&pl, q16, q_blocks, k_row, probs),
        }
        for (r, probs) in probs.chunks_exact_mut(pl.span).enumerate() {
            softmax_window(
                probs,
                pl.first - pl.chunk_start,
                self.sinks.map(|s| s[pl.kvh0 * self.group + r]),
            );
        }
        // Per head, one 16-lane accumulator per output element, lane = position mod 16
        // (ggml's order), stored lane-major so that a position updates one contiguous row of
        // `hd` values.
        let acc = fit(acc, rows * LANES * pl.hd);
        acc.fill(0.0);
        match &self.cache.v {
            Cells::F16(v) if kernels => self.f16_values(&pl, v, probs, acc),
            _ => self.values_by_position(&pl, probs, v_row, acc),
        }
        reduce_lanes(pl.hd, acc, dst);
    }

    /// Where task `task` looks (see [`RowPlace`]).
    fn place(&self, task: usize) -> RowPlace<'_> {
        let (hd, group, n_kv) = (self.hd, self.group, self.kv_per_task);
        let runs_per_token = self.n_head_kv / n_kv;
        let t = task / runs_per_token;
        let kvh0 = task % runs_per_token * n_kv;
        let pos = self.pos0 + t;
        let first = self.cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let chunk_start = first / LANES * LANES;
        RowPlace {
            kvh0,
            n_kv,
            pos,
            first,
            chunk_start,
            span: pos + 1 - chunk_start,
            hd,
            width: self.n_head_kv * hd,
            cells: self.cache.cells,
            heads: &self.q[(t * self.n_head_kv + kvh0) * group * hd..][..n_kv * group * hd],
        }
    }

    /// One token's scores against f16 keys through [`f16_head_scores`], a block of positions
    /// at a time for all the task's KV heads.
    fn f16_scores(&self, pl: &RowPlace, k: &[f16], q_half: &[f16], probs: &mut [f32]) {
        let (hd, group, span) = (pl.hd, self.group, pl.span);
        pl.ask(k, pl.first..(pl.first + ROW_BLOCK).min(pl.pos + 1));
        for block in pl.blocks() {
            pl.ask(k, pl.next(&block));
            for (a, len) in cell_runs(block.start, block.end - 1, pl.cells) {
                for (j, q) in q_half.chunks_exact(group * hd).enumerate() {
                    f16_head_scores(
                        hd,
                        q,
                        &k[pl.cell(a, j)..],
                        pl.width,
                        len,
                        self.scale,
                        &mut probs[j * group * span + a - pl.chunk_start..],
                        span,
                    );
                }
            }
        }
    }

    /// [`RowTask::f16_scores`] element by element: the group's query heads go through one
    /// `dot_rows` call per key as the "weight rows" (the product is symmetric).
    fn f16_scores_by_key(
        &self,
        pl: &RowPlace,
        k: &[f16],
        q_half: &[f16],
        row_scores: &mut Vec<f32>,
        probs: &mut [f32],
    ) {
        let (hd, group, span) = (pl.hd, self.group, pl.span);
        let kernel = DotKernel::best(GgmlType::F16).expect("f16 has a dot kernel");
        let row_scores = fit(row_scores, group);
        for (j, q) in q_half.chunks_exact(group * hd).enumerate() {
            for p in pl.first..=pl.pos {
                let key = f16_bytes(&k[pl.cell(p, j)..pl.cell(p, j) + hd]);
                kernel.dot_rows(hd, f16_bytes(q), key, row_scores);
                for (g, &s) in row_scores.iter().enumerate() {
                    probs[(j * group + g) * span + p - pl.chunk_start] = s * self.scale;
                }
            }
        }
    }

    /// Scores of f32, block-typed and (in a batch) f16 keys, position by position: a batch of
    /// f16 keys goes through tinyBLAS, with the query rounded to f16.
    fn batch_scores(
        &self,
        pl: &RowPlace,
        q16: &mut Vec<f32>,
        q_blocks: &mut Vec<u8>,
        k_row: &mut Vec<f32>,
        probs: &mut [f32],
    ) {
        let (hd, group, span, heads) = (pl.hd, self.group, pl.span, pl.heads);
        let cache = self.cache;
        q16.clear();
        if let Cells::F16(_) = &cache.k {
            q16.extend(heads.iter().map(|&v| f16::from_f32(v).to_f32()));
        }
        let q_bytes = self.k_kernel.as_ref().map_or(0, |k| k.act_row_bytes(hd));
        let q_blocks = fit(q_blocks, pl.n_kv * group * q_bytes);
        if let Some(kernel) = &self.k_kernel {
            for (qh, dst) in heads
                .chunks_exact(hd)
                .zip(q_blocks.chunks_exact_mut(q_bytes))
            {
                hmoe_quant::quantize_row(kernel.act_type(), qh, dst)
                    .expect("heads are whole blocks (checked)");
            }
        }
        let k_row = fit(k_row, hd);
        for j in 0..pl.n_kv {
            for p in pl.first..=pl.pos {
                let at = pl.cell(p, j);
                if let Cells::F16(k) = &cache.k {
                    k[at..at + hd].convert_to_f32_slice(k_row);
                }
                for r in j * group..(j + 1) * group {
                    let qh = &heads[r * hd..(r + 1) * hd];
                    let s = match &cache.k {
                        Cells::F32(k) => dot_vec_f32(qh, &k[at..at + hd]),
                        Cells::F16(_) => dot_lanes(&q16[r * hd..(r + 1) * hd], k_row),
                        Cells::Blocks { ty, data, .. } => block_dot(
                            self.k_kernel.as_ref(),
                            *ty,
                            data,
                            at,
                            hd,
                            &q_blocks[r * q_bytes..(r + 1) * q_bytes],
                        ),
                    };
                    probs[r * span + p - pl.chunk_start] = s * self.scale;
                }
            }
        }
    }

    /// The value sums over f16 values through [`f16_value_lanes`], a block of positions at a
    /// time for all the task's KV heads.
    fn f16_values(&self, pl: &RowPlace, v: &[f16], probs: &[f32], acc: &mut [f32]) {
        let (hd, group, span) = (pl.hd, self.group, pl.span);
        pl.ask(v, pl.first..(pl.first + ROW_BLOCK).min(pl.pos + 1));
        for block in pl.blocks() {
            pl.ask(v, pl.next(&block));
            for (a, len) in cell_runs(block.start, block.end - 1, pl.cells) {
                for (j, acc) in acc.chunks_exact_mut(group * LANES * hd).enumerate() {
                    f16_value_lanes(
                        hd,
                        &v[pl.cell(a, j)..],
                        pl.width,
                        len,
                        a - pl.chunk_start,
                        &probs[j * group * span + a - pl.chunk_start..],
                        span,
                        acc,
                    );
                }
            }
        }
    }

    /// The value sums position by position: each value row converted to f32 once, the
    /// probability rounded to the activation type of V's matmul.
    fn values_by_position(
        &self,
        pl: &RowPlace,
        probs: &[f32],
        v_row: &mut Vec<f32>,
        acc: &mut [f32],
    ) {
        let (hd, group, span) = (pl.hd, self.group, pl.span);
        let v_row = fit(v_row, hd);
        for j in 0..pl.n_kv {
            for p in pl.first..=pl.pos {
                let lane = (p - pl.chunk_start) % LANES;
                let at = pl.cell(p, j);
                match &self.cache.v {
                    Cells::F32(v) => v_row.copy_from_slice(&v[at..at + hd]),
                    Cells::F16(v) => v[at..at + hd].convert_to_f32_slice(v_row),
                    Cells::Blocks { ty, data, .. } => dequantize_at(*ty, data, at, v_row),
                }
                for r in j * group..(j + 1) * group {
                    let acc = &mut acc[r * LANES * hd..(r + 1) * LANES * hd];
                    let w = probs[r * span + p - pl.chunk_start];
                    // The probability in the activation type of V's matmul.
                    let w = match &self.cache.v {
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

/// Each output element: its 16 lanes summed by halving (`hsum16`), all elements of a head at
/// once; `acc` holds per head `LANES` rows of `hd` values.
fn reduce_lanes(hd: usize, acc: &mut [f32], dst: &mut [f32]) {
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

/// Softmax in place over `probs[skip..]` (ggml's `soft_max`: the maximum including the sink,
/// `expf_ggml` in 16-lane chunks summed in f64, the sink's term added last, one multiply by
/// the f32 inverse), leaving `probs[..skip]` (positions before the window) at zero.
pub(super) fn softmax_window(probs: &mut [f32], skip: usize, sink: Option<f32>) {
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
