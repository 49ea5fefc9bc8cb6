//! Flash attention: an online softmax over the keys with no score matrix, in chunks of
//! positions fixed by position (the chunked kernel) over values of every type.

use std::cell::RefCell;

use half::f16;
use half::slice::HalfFloatSliceExt;
use hmoe_backend::numerics::{
    dot_vec, merge_softmax_chunk, softmax_block, FLASH_BLOCK, FLASH_CHUNK,
};
use hmoe_quant::{prefetch, Dequantizer, DotKernel, GgmlType};

use super::attn_shape::AttnLayout;
use super::kv_reads::{block_kernel, block_range, dot_vec_f32, fit, heads_fit};
use super::lane_kernels::{lane_scores, lane_values, Ahead, LaneHeads};
use super::lanes::{LaneSoftmax, ROW_LANES};
use super::q8_0_scores::Q8_0Queries;
use crate::kv_storage::{Cells, LayerCache};

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
    /// The lane path's queries (f32/f16 keys): per KV head, groups of [`ROW_LANES`] query rows
    /// transposed (element-major, one row per lane; missing rows zero).
    qt: Vec<f32>,
    k_block: Vec<f32>,
    v_block: Vec<f32>,
    scores: Vec<f32>,
    k_off: Vec<usize>,
    /// The lane path's online softmax of one group of rows.
    lanes: LaneSoftmax,
}

thread_local! {
    static FLASH_SCRATCH: RefCell<FlashScratch> = RefCell::default();
    /// The states tasks hand back: per task and row `[m, s, acc…]`.
    static FLASH_STATES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Flash attention over the cache, with ggml's CPU kernel's (`flash_attn_ext_f16`) query and
/// key numerics: the query converted to K's `vec_dot_type` (f16 for f16 keys, Q8_0 for
/// Q8_0/Q4_0/Q5_0 keys, Q8_1 for Q4_1/Q5_1, bf16 for bf16) and, for block-typed keys, dotted
/// with K's `vec_dot`; values accumulated in f32 (f16 values converted exactly, bf16 and block
/// values dequantized to f32 first); the sink logit of the head folded in last; and `acc / S`.
///
/// The keys go in chunks of [`FLASH_CHUNK`] positions fixed by position (chunk `c` holds
/// `c·FLASH_CHUNK ..`): each chunk is a softmax from an empty state stepped a block of
/// [`FLASH_BLOCK`] positions at a time ([`softmax_block`]: libm's `expf`, one rescale per
/// block, then the values key by key as `acc = v·p + acc` with FMA) and the chunks are folded
/// in position order ([`merge_softmax_chunk`]), so that one decode token can spread its keys
/// over every thread and the result still depends neither on the threads nor on the rest of
/// the batch. This differs from ggml's kernel, which runs one online softmax over all visible
/// keys (a rescale per new maximum), in the last bits.
///
/// f32/f16 keys are scored by [`hmoe_backend::numerics::dot_chain`] (one FMA chain per score,
/// the query heads sharing a KV head in the lanes of one vector, [`lane_scores`]) instead of
/// `vec_dot`'s four 16-lane chains.
///
/// Unlike llama.cpp, f32 keys and values are not rounded to f16 first (llama.cpp casts an
/// f32 cache to f16 for flash attention), and f16 values are summed in f32, not f16.
///
/// Work is split into tiles of [`Q_TILE`] queries × one KV head (× the query heads sharing
/// it), so each key and value row is converted once per tile, and, for one tile, into one task
/// per chunk; nothing of size queries × keys is allocated. Results do not depend on the split.
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
    let n_tiles = n_tokens.div_ceil(Q_TILE);
    // One tile: one task per chunk the tile's rows see.
    let (first_chunk, n_chunks) = if n_tiles == 1 {
        let lo = cache.window.map_or(0, |w| (pos0 + 1).saturating_sub(w));
        let hi = pos0 + n_tokens - 1;
        (lo / FLASH_CHUNK, hi / FLASH_CHUNK - lo / FLASH_CHUNK + 1)
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
    /// The chunk of task chunk index 0, and how many chunk indices there are (1 unless one
    /// tile is split by chunk).
    first_chunk: usize,
    n_chunks: usize,
    kv_per_task: usize,
    heads_per_task: usize,
    splits: usize,
    kv_runs: usize,
}

/// What one flash-attention task works on: its KV heads and rows, and how its cache reads.
struct FlashPlace<'a> {
    cache: &'a LayerCache,
    shape: &'a AttnLayout,
    /// Elements of a key and of a value head; query heads per KV head.
    kd: usize,
    vd: usize,
    group: usize,
    /// The task's KV heads: `kvh0..kvh0 + kv_per_task`.
    kvh0: usize,
    kv_per_task: usize,
    /// Elements per cell of K and of V (the keys' when values live in them).
    k_width: usize,
    v_width: usize,
    v_cells: &'a Cells,
    k_kernel: Option<DotKernel>,
    v_dequant: Option<Dequantizer>,
    /// Bytes of a row's query in K's activation blocks (block-typed keys), of a key head and
    /// of a key cell.
    q_bytes: usize,
    k_row_bytes: usize,
    k_cell_bytes: usize,
    /// The task's rows, and those per KV head (KV head major).
    n_rows: usize,
    per_kv: usize,
    /// Groups of [`ROW_LANES`] rows per KV head (the lane path).
    n_groups: usize,
    /// f32/f16 keys, read in place and scored in lanes.
    chain: bool,
    /// Floats of one row's state in `dst`: `[m, s, acc…]`.
    state: usize,
    /// One past the last position of the task's tile.
    q_end: usize,
}

impl FlashPlace<'_> {
    /// Block slot `(j, i)`: KV head `kvh0 + j` at position `b0 + i` (keys and scores).
    fn slot(&self, j: usize, i: usize) -> usize {
        j * POS_BLOCK + i
    }

    /// Value slots are position-major, so one call converts a position's value heads
    /// (adjacent in the cache) for every KV head of the task.
    fn v_slot(&self, j: usize, i: usize) -> usize {
        i * self.kv_per_task + j
    }

    /// Value heads `kvh0 + j ..` of the position in `cell`, as many as `dst` holds.
    fn values_at(&self, cell: usize, j: usize, dst: &mut [f32]) {
        let v_at = if self.shape.v_in_k {
            cell * self.k_width + (self.kvh0 + j) * self.kd
        } else {
            cell * self.v_width + (self.kvh0 + j) * self.vd
        };
        let n = dst.len();
        match self.v_cells {
            Cells::F32(v) => dst.copy_from_slice(&v[v_at..v_at + n]),
            Cells::F16(v) => v[v_at..v_at + n].convert_to_f32_slice(dst),
            Cells::Blocks { ty, data, .. } => self
                .v_dequant
                .as_ref()
                .expect("block values have a dequantizer")
                .row(&data[block_range(*ty, v_at, n)], dst),
        }
    }

    /// Folds each row's chunk state into its running state in `dst` and empties it.
    fn close_chunk(&self, m: &mut [f32], s: &mut [f32], acc: &mut [f32], dst: &mut [f32]) {
        let vd = self.vd;
        for (r, st) in dst
            .chunks_exact_mut(self.state)
            .take(self.n_rows)
            .enumerate()
        {
            let (head, run) = st.split_at_mut(2);
            let (tm, ts) = head.split_at_mut(1);
            let a = &mut acc[r * vd..(r + 1) * vd];
            merge_softmax_chunk(&mut tm[0], &mut ts[0], run, (m[r], s[r], a));
            m[r] = f32::NEG_INFINITY;
            s[r] = 0.0;
            a.fill(0.0);
        }
    }

    /// Each row's query converted for K: in K's activation blocks (block-typed keys), rounded
    /// to f16 (f16 keys) or as it is (f32 keys).
    fn convert_queries(&self, q: &[f32], rows: &[RowSpan], q_f: &mut Vec<f32>, q_b: &mut Vec<u8>) {
        let (kd, q_bytes, n_head) = (self.kd, self.q_bytes, self.shape.n_head);
        let q_floats = if self.k_kernel.is_some() { 0 } else { kd };
        fit(q_f, rows.len() * q_floats);
        fit(q_b, rows.len() * q_bytes);
        for (r, span) in rows.iter().enumerate() {
            let qh = &q[(span.t * n_head + span.h) * kd..][..kd];
            match (&self.cache.k, &self.k_kernel) {
                (_, Some(k)) => hmoe_quant::quantize_row(
                    k.act_type(),
                    qh,
                    &mut q_b[r * q_bytes..(r + 1) * q_bytes],
                )
                .expect("heads are whole blocks (checked)"),
                (Cells::F16(_), None) => {
                    for (d, &v) in q_f[r * kd..(r + 1) * kd].iter_mut().zip(qh) {
                        *d = f16::from_f32(v).to_f32();
                    }
                }
                _ => q_f[r * kd..(r + 1) * kd].copy_from_slice(qh),
            }
        }
    }

    /// The lane path's queries: per KV head, groups of [`ROW_LANES`] rows transposed
    /// (element-major, one row per lane; missing rows zero).
    fn transpose_queries(&self, q_f: &[f32], qt: &mut Vec<f32>) {
        let (kd, per_kv, n_groups) = (self.kd, self.per_kv, self.n_groups);
        let qt = fit(qt, self.kv_per_task * n_groups * kd * ROW_LANES);
        for (jg, qt) in qt.chunks_exact_mut(kd * ROW_LANES).enumerate() {
            let (j, g) = (jg / n_groups, jg % n_groups);
            for l in 0..ROW_LANES {
                let r = g * ROW_LANES + l;
                for e in 0..kd {
                    qt[e * ROW_LANES + l] = if r < per_kv {
                        q_f[(j * per_kv + r) * kd + e]
                    } else {
                        0.0
                    };
                }
            }
        }
    }

    /// Q8_0 keys: the rows of each KV head score a block of keys in one call.
    fn q8_queries(&self, q_blocks: &[u8]) -> Vec<Q8_0Queries> {
        match &self.cache.k {
            Cells::Blocks {
                ty: GgmlType::Q8_0, ..
            } => q_blocks[..self.n_rows * self.q_bytes]
                .chunks(self.per_kv * self.q_bytes)
                .map(|run| Q8_0Queries::new(self.kd, run))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The lane path (f32/f16 keys) over positions `b0..b1`: each group of rows of a KV head
    /// scores the block's keys, steps its softmax and sums the values, in lanes.
    #[allow(clippy::too_many_arguments)]
    fn chained_block(
        &self,
        (b0, b1): (usize, usize),
        (k_heads, v_in_place): (LaneHeads, Option<LaneHeads>),
        qt: &[f32],
        rows: &[RowSpan],
        (row_m, row_s, row_acc): (&mut [f32], &mut [f32], &mut [f32]),
        lane_sm: &mut LaneSoftmax,
        v_block: &mut [f32],
    ) {
        let (cache, shape) = (self.cache, self.shape);
        let (kd, vd, kvh0, kv_per_task) = (self.kd, self.vd, self.kvh0, self.kv_per_task);
        let (k_width, v_width, per_kv, n_groups) =
            (self.k_width, self.v_width, self.per_kv, self.n_groups);
        let n = b1 - b0;
        let mut lanes = [[0f32; ROW_LANES]; POS_BLOCK];
        let (mut k_at, mut v_at) = ([0usize; POS_BLOCK], [0usize; POS_BLOCK]);
        // The next block of the task's heads, one part per head, read while this block's head
        // computes (cut where it would wrap around the ring). After the task's last block, the
        // next chunk's first: the pool gives each thread a contiguous run of tasks, so it is
        // usually this thread's next.
        let next = b1..(b1 + POS_BLOCK).min(self.q_end);
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
                        self.values_at(cell, j, &mut v_block[i * vd..(i + 1) * vd]);
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
    }

    /// Converts the key and value heads of positions `b0..b1` to f32 once for all rows
    /// (f32/f16 keys; block-typed keys are only located, in `k_off`), asking for the
    /// quantized heads [`PREFETCH_AHEAD`] positions on, up to the tile's last position (past
    /// the task's chunk: the pool gives each thread a contiguous run of tasks, so the next
    /// chunk is usually this thread's next). Every position of the task's range is seen by
    /// some row: the tile's queries are consecutive, so their windows overlap or touch.
    fn convert_block(
        &self,
        (b0, b1): (usize, usize),
        k_block: &mut [f32],
        v_block: &mut [f32],
        k_off: &mut [usize],
    ) {
        let (cache, kd, vd, kvh0) = (self.cache, self.kd, self.vd, self.kvh0);
        let (kv_per_task, k_row_bytes) = (self.kv_per_task, self.k_row_bytes);
        for p in b0..b1 {
            let i = p - b0;
            // Quantized key and value heads come from a cache far larger than the CPU's, in
            // rows too short for the hardware prefetcher: ask for the heads
            // [`PREFETCH_AHEAD`] positions on, one position at a time while this block
            // computes.
            if p + PREFETCH_AHEAD < self.q_end {
                let cell = (p + PREFETCH_AHEAD) % cache.cells;
                if let Cells::Blocks { data, .. } = &cache.k {
                    let at = cell * self.k_cell_bytes + kvh0 * k_row_bytes;
                    prefetch(&data[at..at + kv_per_task * k_row_bytes]);
                }
                if let (Cells::Blocks { ty, data, .. }, false) = (self.v_cells, self.shape.v_in_k) {
                    let at = cell * self.v_width + kvh0 * vd;
                    prefetch(&data[block_range(*ty, at, kv_per_task * vd)]);
                }
            }
            let cell = p % cache.cells;
            for j in 0..kv_per_task {
                let k_at = cell * self.k_width + (kvh0 + j) * kd;
                k_off[self.slot(j, i)] = cell * self.k_cell_bytes + (kvh0 + j) * k_row_bytes;
                let kb = self.slot(j, i) * kd..(self.slot(j, i) + 1) * kd;
                match &cache.k {
                    Cells::F32(k) => k_block[kb].copy_from_slice(&k[k_at..k_at + kd]),
                    Cells::F16(k) => k[k_at..k_at + kd].convert_to_f32_slice(&mut k_block[kb]),
                    Cells::Blocks { .. } => {}
                }
            }
            let v_at = |j: usize| self.v_slot(j, i) * vd;
            if !self.shape.v_in_k {
                self.values_at(cell, 0, &mut v_block[v_at(0)..v_at(0) + kv_per_task * vd]);
            } else {
                (0..kv_per_task)
                    .for_each(|j| self.values_at(cell, j, &mut v_block[v_at(j)..v_at(j) + vd]));
            }
        }
    }

    /// Each row's scores of positions `b0..b1` (the block as [`FlashPlace::convert_block`]
    /// left it), `POS_BLOCK` per row in `scores`.
    #[allow(clippy::too_many_arguments)]
    fn score_block(
        &self,
        (b0, b1): (usize, usize),
        rows: &[RowSpan],
        (q_f, q_blocks, q8_queries): (&[f32], &[u8], &[Q8_0Queries]),
        k_block: &[f32],
        k_off: &[usize],
        scores: &mut [f32],
    ) {
        let (kd, q_bytes, scale) = (self.kd, self.q_bytes, self.shape.scale);
        if let (false, Cells::Blocks { data, .. }) = (q8_queries.is_empty(), &self.cache.k) {
            let per_kv = self.per_kv;
            for (j, queries) in q8_queries.iter().enumerate() {
                let key_at = &k_off[self.slot(j, 0)..self.slot(j, b1 - b0)];
                let out = &mut scores[j * per_kv * POS_BLOCK..(j + 1) * per_kv * POS_BLOCK];
                queries.scores(data, key_at, scale, out, POS_BLOCK);
            }
            return;
        }
        for (r, (span, sc_row)) in rows
            .iter()
            .zip(scores.chunks_exact_mut(POS_BLOCK))
            .enumerate()
        {
            let j = span.h / self.group - self.kvh0;
            for p in span.first.max(b0)..=span.last.min(b1 - 1) {
                let at = self.slot(j, p - b0);
                let kb = at * kd..(at + 1) * kd;
                let qf = || &q_f[r * kd..(r + 1) * kd];
                sc_row[p - b0] = match &self.cache.k {
                    Cells::F32(_) => dot_vec_f32(qf(), &k_block[kb]),
                    // `vec_dot_f16` of the f16-rounded query (exact in f32).
                    Cells::F16(_) => dot_vec(qf(), &k_block[kb], |x| x, true),
                    Cells::Blocks { data, .. } => {
                        let off = k_off[at];
                        self.k_kernel.as_ref().map_or(0.0, |kk| {
                            kk.dot(
                                kd,
                                &data[off..off + self.k_row_bytes],
                                &q_blocks[r * q_bytes..(r + 1) * q_bytes],
                            )
                        })
                    }
                } * scale;
            }
        }
    }

    /// Each row's chunk state stepped over its visible positions of `b0..b1`
    /// ([`block_softmax`]).
    fn softmax_block_rows(
        &self,
        (b0, b1): (usize, usize),
        rows: &[RowSpan],
        scores: &[f32],
        v_block: &[f32],
        (row_m, row_s, row_acc): (&mut [f32], &mut [f32], &mut [f32]),
    ) {
        let vd = self.vd;
        for (r, (span, sc_row)) in rows.iter().zip(scores.chunks_exact(POS_BLOCK)).enumerate() {
            let j = span.h / self.group - self.kvh0;
            let (from, to) = (span.first.max(b0), span.last.min(b1 - 1));
            if from > to {
                continue;
            }
            let scores = &sc_row[from - b0..=to - b0];
            let values =
                &v_block[self.v_slot(j, from - b0) * vd..self.v_slot(j, to - b0) * vd + vd];
            let stride = self.kv_per_task * vd;
            let (m, s) = (&mut row_m[r], &mut row_s[r]);
            let acc = &mut row_acc[r * vd..(r + 1) * vd];
            block_softmax(m, s, acc, scores, values, stride);
        }
    }
}

/// f32/f16 cells as the lane kernels read them in place (`None` for block types).
fn lane_heads(cells: &Cells) -> Option<LaneHeads<'_>> {
    match cells {
        Cells::F32(k) => Some(LaneHeads::F32(k)),
        Cells::F16(k) => Some(LaneHeads::F16(k)),
        Cells::Blocks { .. } => None,
    }
}

impl FlashTask<'_> {
    /// Runs task `task`, leaving each of its rows' state (`[m, s, acc…]`, the chunks it saw
    /// folded in position order) in `dst`.
    fn run(&self, task: usize, sc: &mut FlashScratch, dst: &mut [f32]) {
        let FlashScratch {
            rows,
            q: q_f,
            q_blocks,
            m: row_m,
            s: row_s,
            acc: row_acc,
            qt,
            k_block,
            v_block,
            scores,
            k_off,
            lanes: lane_sm,
        } = sc;
        let (kvh0, c_idx, t_end) = self.task_rows(task, rows);
        let pl = self.place(kvh0, rows.len(), t_end);
        let (n_rows, vd, state) = (pl.n_rows, pl.vd, pl.state);
        pl.convert_queries(self.q, rows, q_f, q_blocks);
        // The lane path scores f32/f16 keys by `dot_chain`, eight rows per vector.
        let k_in_place = lane_heads(&self.cache.k);
        if pl.chain {
            pl.transpose_queries(q_f, qt);
        }
        // The task's running state per row starts empty in `dst`, the chunk's in the scratch.
        for st in dst.chunks_exact_mut(state).take(n_rows) {
            st[0] = f32::NEG_INFINITY;
            st[1] = 0.0;
        }
        let row_m = fit(row_m, n_rows);
        row_m.fill(f32::NEG_INFINITY);
        let row_s = fit(row_s, n_rows);
        row_s.fill(0.0);
        let row_acc = fit(row_acc, n_rows * vd);
        row_acc.fill(0.0);
        let (lo, hi) = self.key_range(rows, c_idx, t_end);
        // Positions go in blocks (never across a chunk boundary). f32/f16 keys take the lane
        // path, which reads them in place and scores a group of rows in vector lanes. Other
        // keys are read in place and located per block (`k_off`), the block's value heads
        // converted to f32 once for all rows and its scores computed together, then each row
        // steps its softmax over the block.
        let k_floats = match (&self.cache.k, pl.chain) {
            (Cells::Blocks { .. }, _) | (_, true) => 0,
            _ => pl.kv_per_task * POS_BLOCK * pl.kd,
        };
        let k_block = fit(k_block, k_floats);
        // f32/f16 values are read in place by the lane path, block-typed ones (bf16 and the
        // quantized types) converted to f32 one KV head's block at a time.
        let v_in_place = lane_heads(pl.v_cells);
        let v_floats = match (pl.chain, v_in_place) {
            (false, _) => pl.kv_per_task * POS_BLOCK * vd,
            (true, None) => POS_BLOCK * vd,
            (true, Some(_)) => 0,
        };
        let v_block = fit(v_block, v_floats);
        let scores = fit(scores, n_rows * POS_BLOCK);
        let k_off = fit(k_off, pl.kv_per_task * POS_BLOCK);
        let q8_queries = pl.q8_queries(q_blocks);
        let mut b0 = lo;
        while b0 <= hi {
            // Blocks start at multiples of `POS_BLOCK` (the chunked kernel's softmax blocks,
            // fixed by position; chunks are whole blocks).
            let b1 = ((b0 / POS_BLOCK + 1) * POS_BLOCK).min(hi + 1);
            if b0 != lo && b0.is_multiple_of(FLASH_CHUNK) {
                pl.close_chunk(row_m, row_s, row_acc, dst);
            }
            let states = (&mut row_m[..], &mut row_s[..], &mut row_acc[..]);
            if let (true, Some(k_heads)) = (pl.chain, k_in_place) {
                let heads = (k_heads, v_in_place);
                pl.chained_block((b0, b1), heads, qt, rows, states, lane_sm, v_block);
            } else {
                pl.convert_block((b0, b1), k_block, v_block, k_off);
                let queries = (&q_f[..], &q_blocks[..], &q8_queries[..]);
                pl.score_block((b0, b1), rows, queries, k_block, k_off, scores);
                pl.softmax_block_rows((b0, b1), rows, scores, v_block, states);
            }
            b0 = b1;
        }
        pl.close_chunk(row_m, row_s, row_acc, dst);
        // Rows a short last tile does not have stay empty.
        for st in dst.chunks_exact_mut(state).skip(n_rows) {
            st[0] = f32::NEG_INFINITY;
            st[1] = 0.0;
        }
    }

    /// Fills `rows` with task `task`'s rows (KV head major, so the rows of one KV head are
    /// one run); returns its first KV head, its chunk index and the end of its tile.
    fn task_rows(&self, task: usize, rows: &mut Vec<RowSpan>) -> (usize, usize, usize) {
        let group = self.shape.n_head / self.shape.n_head_kv;
        let c_idx = task % self.n_chunks;
        let rest = task / self.n_chunks;
        let tile = rest / (self.kv_runs * self.splits);
        let kvh0 = rest % (self.kv_runs * self.splits) / self.splits * self.kv_per_task;
        let split = rest % self.splits;
        let t_end = ((tile + 1) * Q_TILE).min(self.n_tokens);
        rows.clear();
        for kvh in kvh0..kvh0 + self.kv_per_task {
            let h0 = kvh * group + split * self.heads_per_task;
            for t in tile * Q_TILE..t_end {
                for h in h0..h0 + self.heads_per_task {
                    let pos = self.pos0 + t;
                    let first = self.cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    rows.push(RowSpan {
                        t,
                        h,
                        first,
                        last: pos,
                    });
                }
            }
        }
        (kvh0, c_idx, t_end)
    }

    /// What the task with KV heads from `kvh0` and `n_rows` rows reads (see [`FlashPlace`]).
    fn place(&self, kvh0: usize, n_rows: usize, t_end: usize) -> FlashPlace<'_> {
        let (cache, shape) = (self.cache, self.shape);
        let (kd, vd) = (shape.k_dim, shape.v_dim);
        let k_width = shape.n_head_kv * kd;
        let v_cells = if shape.v_in_k { &cache.k } else { &cache.v };
        let k_kernel = block_kernel(&cache.k);
        let (k_be, k_bb) = match &cache.k {
            Cells::Blocks { ty, .. } => (ty.block_elems(), ty.block_bytes()),
            _ => (1, 0),
        };
        let per_kv = n_rows / self.kv_per_task;
        FlashPlace {
            cache,
            shape,
            kd,
            vd,
            group: shape.n_head / shape.n_head_kv,
            kvh0,
            kv_per_task: self.kv_per_task,
            k_width,
            v_width: if shape.v_in_k {
                k_width
            } else {
                shape.n_head_kv * vd
            },
            v_cells,
            q_bytes: k_kernel.as_ref().map_or(0, |k| k.act_row_bytes(kd)),
            k_kernel,
            v_dequant: match v_cells {
                Cells::Blocks { ty, .. } => {
                    Some(Dequantizer::new(*ty).expect("every cache type dequantizes"))
                }
                _ => None,
            },
            k_row_bytes: kd / k_be * k_bb,
            k_cell_bytes: k_width / k_be * k_bb,
            n_rows,
            per_kv,
            n_groups: per_kv.div_ceil(ROW_LANES),
            chain: lane_heads(&cache.k).is_some(),
            state: vd + 2,
            q_end: self.pos0 + t_end,
        }
    }

    /// The positions the task reads: from the first any row sees to the tile's last, within
    /// its chunk when a tile is split by chunk.
    fn key_range(&self, rows: &[RowSpan], c_idx: usize, t_end: usize) -> (usize, usize) {
        let lo = rows.iter().map(|r| r.first).min().unwrap_or(0);
        let hi = self.pos0 + t_end - 1;
        if self.n_chunks > 1 {
            let c = self.first_chunk + c_idx;
            (lo.max(c * FLASH_CHUNK), hi.min((c + 1) * FLASH_CHUNK - 1))
        } else {
            (lo, hi)
        }
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
    // Pieces of 64 elements, then of 16, then single ones: each held in registers across the
    // block's keys, element by element the same operations in the same order.
    let (n64, n16) = (acc.len() / 64 * 64, acc.len() / 16 * 16);
    let (a64, rest) = acc.split_at_mut(n64);
    let (a16, a1) = rest.split_at_mut(n16 - n64);
    let (p, values) = (&p[..n], (values, stride));
    sum_values::<64>(a64, 0, ms, p, values);
    sum_values::<16>(a16, n64, ms, p, values);
    sum_values::<1>(a1, n16, ms, p, values);
}

/// `acc·ms`, then `acc = v·p + acc` key by key for the accumulator elements `acc` (elements
/// `e0..` of the value heads, in pieces of `D`), one value head per probability in `values`
/// (`stride` apart), each piece held in registers across the keys.
fn sum_values<const D: usize>(
    acc: &mut [f32],
    e0: usize,
    ms: f32,
    p: &[f32],
    (values, stride): (&[f32], usize),
) {
    for (k, piece) in acc.chunks_exact_mut(D).enumerate() {
        let at = e0 + k * D;
        let mut reg = [0f32; D];
        reg.copy_from_slice(piece);
        reg.iter_mut().for_each(|a| *a *= ms);
        for (v, &p) in values.chunks(stride).zip(p) {
            for (a, &x) in reg.iter_mut().zip(&v[at..at + D]) {
                *a = x.mul_add(p, *a);
            }
        }
        piece.copy_from_slice(&reg);
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
