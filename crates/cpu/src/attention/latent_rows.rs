//! The row kernel of [`super::attention_ext`]: heads whose keys and values differ in size, or
//! whose values live inside the keys (multi-head latent attention's K-only cache).

use std::cell::RefCell;

use half::f16;
use half::slice::HalfFloatSliceExt;
use hmoe_backend::numerics::{dot_vec, hsum16};

use super::attn_shape::AttnLayout;
use super::flash::flash_attention;
use super::kv_reads::{
    block_dot, block_kernel, dequantize_at, dot_lanes, dot_vec_f32, fit, heads_fit, needs_flash,
    round_weight, LANES,
};
use super::row_kernel::softmax_window;
use crate::kv_storage::{Cells, LayerCache};

/// [`attention_ext`] once the query is rotated like the stored keys.
pub(super) fn attention_ext_rotated(
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
    let n_tokens = q.len() / (shape.n_head * kd);
    let task = ExtTask {
        cache,
        k_kernel,
        group,
        k_width,
        v_width,
        kd,
        vd,
        heads: heads_per_task(
            group,
            n_tokens * shape.n_head,
            hmoe_pool::current_num_threads(),
        ),
        n_head: shape.n_head,
        v_in_k: shape.v_in_k,
        scale: shape.scale,
        lanes_ok: kd.is_multiple_of(LANES),
        single_token: n_tokens == 1,
        q,
        pos0,
    };
    hmoe_pool::global().for_each_chunk_mut(out, task.heads * vd, |i, dst| {
        EXT_SCRATCH.with_borrow_mut(|sc| task.run(i, sc, dst));
    });
}

/// Query heads per task: the most (up to [`MAX_TASK_HEADS`]) that share one KV head and still
/// leave four tasks per thread, so that the heads of a task convert each key and value row
/// once. Results do not depend on it.
fn heads_per_task(group: usize, rows: usize, threads: usize) -> usize {
    (1..=group.min(MAX_TASK_HEADS))
        .rev()
        .find(|&g| group.is_multiple_of(g) && rows / g >= 4 * threads)
        .unwrap_or(1)
}

/// Most query heads in one task: their lane accumulators (`v_dim · 16` floats each) stay
/// in the L2 cache.
const MAX_TASK_HEADS: usize = 8;

/// What every task of one [`attention_ext_rotated`] call shares.
struct ExtTask<'a> {
    cache: &'a LayerCache,
    k_kernel: Option<hmoe_quant::DotKernel>,
    /// Query heads per KV head.
    group: usize,
    k_width: usize,
    v_width: usize,
    kd: usize,
    vd: usize,
    /// Query heads per task ([`heads_per_task`]), all of one KV head.
    heads: usize,
    n_head: usize,
    v_in_k: bool,
    scale: f32,
    /// Keys a multiple of 16 long (tinyBLAS's scores for a batch).
    lanes_ok: bool,
    single_token: bool,
    q: &'a [f32],
    pos0: usize,
}

impl ExtTask<'_> {
    /// Task `i`: query heads `i·heads..(i+1)·heads` (counting tokens' heads in order), their
    /// outputs in `dst`. Each key and value row is read and converted once for the task's heads.
    fn run(&self, i: usize, sc: &mut ExtScratch, dst: &mut [f32]) {
        let (kd, nh) = (self.kd, self.heads);
        let cache = self.cache;
        let row0 = i * nh;
        let t = row0 / self.n_head;
        let kv_head = row0 % self.n_head / self.group;
        let pos = self.pos0 + t;
        let first = cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let qs = &self.q[row0 * kd..(row0 + nh) * kd];
        // ggml rounds the query to f16 before dotting it with f16 keys.
        sc.q16.clear();
        if let Cells::F16(_) = &cache.k {
            sc.q16.extend(qs.iter().map(|&v| f16::from_f32(v).to_f32()));
        }
        if let Some(kernel) = &self.k_kernel {
            let qb = kernel.act_row_bytes(kd);
            let q_blocks = fit(&mut sc.q_blocks, nh * qb);
            for (qh, dst) in qs.chunks_exact(kd).zip(q_blocks.chunks_exact_mut(qb)) {
                hmoe_quant::quantize_row(kernel.act_type(), qh, dst)
                    .expect("heads are whole blocks (checked)");
            }
        }
        let k_at = |p: usize| (p % cache.cells) * self.k_width + kv_head * kd;
        let chunk_start = first / LANES * LANES;
        let n_pos = pos + 1 - chunk_start;
        // Head h's probabilities at `h · n_pos`; positions before the window are never
        // written, the softmax zeroes them.
        let probs = fit(&mut sc.probs, nh * n_pos);
        let k_row = fit(&mut sc.k_row, kd);
        for p in first..=pos {
            let at = k_at(p);
            let key = match &cache.k {
                Cells::F32(k) => Some(&k[at..at + kd]),
                Cells::F16(k) => {
                    k[at..at + kd].convert_to_f32_slice(k_row);
                    Some(&k_row[..])
                }
                Cells::Blocks { .. } => None,
            };
            // tinyBLAS's batch scores, four heads at a time (independent FMA chains).
            let mut h0 = 0;
            if let (Cells::F16(_), Some(key)) = (&cache.k, key) {
                if self.lanes_ok && !self.single_token {
                    while h0 + 4 <= nh {
                        let q: [&[f32]; 4] =
                            std::array::from_fn(|j| &sc.q16[(h0 + j) * kd..(h0 + j + 1) * kd]);
                        for (j, s) in dot_lanes4(q, key).into_iter().enumerate() {
                            probs[(h0 + j) * n_pos + p - chunk_start] = s * self.scale;
                        }
                        h0 += 4;
                    }
                }
            }
            for h in h0..nh {
                let s = match (&cache.k, key) {
                    (Cells::F32(_), Some(key)) => dot_vec_f32(&qs[h * kd..(h + 1) * kd], key),
                    // A batch goes through tinyBLAS when the head is a multiple of 16 long; one
                    // token, or a head tinyBLAS declines, through `vec_dot_f16` (the f16 key
                    // converted exactly beforehand).
                    (Cells::F16(_), Some(key)) if self.lanes_ok && !self.single_token => {
                        dot_lanes(&sc.q16[h * kd..(h + 1) * kd], key)
                    }
                    (Cells::F16(_), Some(key)) => {
                        dot_vec(&sc.q16[h * kd..(h + 1) * kd], key, |v| v, true)
                    }
                    (Cells::Blocks { ty, data, .. }, _) => {
                        let qb = self.k_kernel.as_ref().map_or(0, |k| k.act_row_bytes(kd));
                        let q_blocks = &sc.q_blocks[h * qb..(h + 1) * qb];
                        block_dot(self.k_kernel.as_ref(), *ty, data, at, kd, q_blocks)
                    }
                    _ => unreachable!("f32/f16 keys have a converted row"),
                } * self.scale;
                probs[h * n_pos + p - chunk_start] = s;
            }
        }
        for h in 0..nh {
            softmax_window(
                &mut probs[h * n_pos..(h + 1) * n_pos],
                first - chunk_start,
                None,
            );
        }
        self.values(sc, (first, pos, chunk_start, n_pos), kv_head, dst);
    }

    /// The probability-weighted value sums of the task's heads from `sc.probs` into `dst`.
    /// A batch sums the values in one 16-lane chain over positions (tinyBLAS); one token with
    /// f32/f16 values goes through `vec_dot_f32`/`vec_dot_f16`, whose four chains take 16
    /// positions in turn ([`ExtTask::values_lanes`] takes the one-chain case). Each 16
    /// positions' value rows are converted once, transposed to `[element][lane]`, so every
    /// head's lane update is a vector FMA per element.
    fn values(
        &self,
        sc: &mut ExtScratch,
        (first, pos, chunk_start, n_pos): (usize, usize, usize, usize),
        kv_head: usize,
        dst: &mut [f32],
    ) {
        let (vd, nh) = (self.vd, self.heads);
        let cache = self.cache;
        let v_at = |p: usize| {
            if self.v_in_k {
                (p % cache.cells) * self.k_width + kv_head * self.kd
            } else {
                (p % cache.cells) * self.v_width + kv_head * vd
            }
        };
        let v_cells = if self.v_in_k { &cache.k } else { &cache.v };
        if !(self.single_token && matches!(v_cells, Cells::F32(_) | Cells::F16(_))) {
            return self.values_lanes(sc, (first, pos, chunk_start, n_pos), v_cells, v_at, dst);
        }
        let chains = VEC_DOT_CHAINS;
        // Head h, chain c, element d: `acc[(h · chains + c) · vd + d]`.
        let acc = fit(&mut sc.acc, nh * chains * vd);
        acc.fill([0.0; LANES]);
        let vt = fit(&mut sc.vt, vd);
        let v_row = fit(&mut sc.v_row, vd);
        let probs = &sc.probs[..nh * n_pos];
        for (c, c0) in (chunk_start..=pos).step_by(LANES).enumerate() {
            let chain = (chunk_start / LANES + c) % chains;
            // Lanes of positions outside `first..=pos` hold zero values and weights: the FMA
            // then adds +0 to an accumulator that started at +0, which leaves it as it is.
            vt.fill([0.0; LANES]);
            let live = (c0.max(first)..=pos.min(c0 + LANES - 1)).map(|p| p - c0);
            for l in live.clone() {
                let at = v_at(c0 + l);
                match v_cells {
                    Cells::F32(v) => v_row.copy_from_slice(&v[at..at + vd]),
                    Cells::F16(v) => v[at..at + vd].convert_to_f32_slice(v_row),
                    Cells::Blocks { ty, data, .. } => dequantize_at(*ty, data, at, v_row),
                }
                for (t, &x) in vt.iter_mut().zip(v_row.iter()) {
                    t[l] = x;
                }
            }
            for h in 0..nh {
                let mut w = [0f32; LANES];
                for l in live.clone() {
                    let p = probs[h * n_pos + c0 + l - chunk_start];
                    w[l] = match v_cells {
                        Cells::F16(_) => f16::from_f32(p).to_f32(),
                        Cells::Blocks { ty, .. } => round_weight(*ty, p),
                        Cells::F32(_) => p,
                    };
                }
                let acc = &mut acc[(h * chains + chain) * vd..][..vd];
                for (a, x) in acc.iter_mut().zip(vt.iter()) {
                    for l in 0..LANES {
                        a[l] = x[l].mul_add(w[l], a[l]);
                    }
                }
            }
        }
        for (h, out) in dst.chunks_exact_mut(vd).enumerate() {
            let acc = &acc[h * chains * vd..(h + 1) * chains * vd];
            for (d, o) in out.iter_mut().enumerate() {
                let a: [[f32; LANES]; VEC_DOT_CHAINS] = std::array::from_fn(|c| acc[c * vd + d]);
                *o = reduce_chains(&a);
            }
        }
    }
}

impl ExtTask<'_> {
    /// [`ExtTask::values`] with one chain (a batch, or one token with quantized values):
    /// tinyBLAS's 16 lanes over positions, lane `l` of element `d` adding the positions
    /// `≡ l (mod 16)` in order. The lanes are kept lane-major, `acc[(h · 16 + l) · vd + d]`,
    /// so a position's value row is multiplied by its weight as it is stored (no transpose):
    /// the task's positions go in runs of [`VALUE_RUN`] chunks of 16, each run's rows
    /// converted once, and per block of [`VALUE_BLOCK`] elements each head's lane carries its
    /// accumulators through the run's chunks in registers. The same FMAs per lane and position
    /// as the chunk-by-chunk order, so the same bits.
    fn values_lanes(
        &self,
        sc: &mut ExtScratch,
        (first, pos, chunk_start, n_pos): (usize, usize, usize, usize),
        v_cells: &Cells,
        v_at: impl Fn(usize) -> usize,
        dst: &mut [f32],
    ) {
        let (vd, nh) = (self.vd, self.heads);
        let simd = LaneSimd::detect();
        let acc = fit(&mut sc.lane_acc, nh * LANES * vd);
        acc.fill(0.0);
        let probs = &sc.probs[..nh * n_pos];
        let n_chunks = (pos - chunk_start) / LANES + 1;
        for r0 in (0..n_chunks).step_by(VALUE_RUN) {
            let run = VALUE_RUN.min(n_chunks - r0);
            let (p0, np) = (chunk_start + r0 * LANES, run * LANES);
            let live = |i: usize| (first..=pos).contains(&(p0 + i));
            // The run's value rows, `rows[i · vd + d]` for position `p0 + i` (zero outside
            // `first..=pos`, where the weight is zero too: +0 added to an accumulator that is
            // never -0 leaves it as it is).
            let rows = fit(&mut sc.run_rows, np * vd);
            for (i, row) in rows.chunks_exact_mut(vd).enumerate() {
                if !live(i) {
                    row.fill(0.0);
                    continue;
                }
                let at = v_at(p0 + i);
                match v_cells {
                    Cells::F32(v) => row.copy_from_slice(&v[at..at + vd]),
                    Cells::F16(v) => v[at..at + vd].convert_to_f32_slice(row),
                    Cells::Blocks { ty, data, .. } => dequantize_at(*ty, data, at, row),
                }
            }
            // `w[h · np + i]`: head h's weight of position `p0 + i`.
            let w = fit(&mut sc.run_w, nh * np);
            for (h, w) in w.chunks_exact_mut(np).enumerate() {
                for (i, w) in w.iter_mut().enumerate() {
                    *w = if live(i) {
                        let p = probs[h * n_pos + p0 + i - chunk_start];
                        match v_cells {
                            Cells::F16(_) => f16::from_f32(p).to_f32(),
                            Cells::Blocks { ty, .. } => round_weight(*ty, p),
                            Cells::F32(_) => p,
                        }
                    } else {
                        0.0
                    };
                }
            }
            for d0 in (0..vd).step_by(VALUE_BLOCK) {
                let db = VALUE_BLOCK.min(vd - d0);
                // The block's elements of the run's rows, packed: `vb[i · VALUE_BLOCK + j]`.
                let vb = fit(&mut sc.run_block, np * VALUE_BLOCK);
                for (i, b) in vb.chunks_exact_mut(VALUE_BLOCK).enumerate() {
                    b[..db].copy_from_slice(&rows[i * vd + d0..][..db]);
                }
                for h in 0..nh {
                    let w = &w[h * np..(h + 1) * np];
                    for l in 0..LANES {
                        let a = &mut acc[(h * LANES + l) * vd + d0..][..db];
                        lane_run(a, vb, w, (l, run), simd);
                    }
                }
            }
        }
        for (h, out) in dst.chunks_exact_mut(vd).enumerate() {
            for (d, o) in out.iter_mut().enumerate() {
                let lanes: [f32; LANES] = std::array::from_fn(|l| acc[(h * LANES + l) * vd + d]);
                *o = hsum16(&lanes);
            }
        }
    }
}

/// Adds to `a` (one head's lane `l`, a block of elements) the run's positions of that lane:
/// chunk by chunk, `a[j] = fma(vb[i][j], w[i], a[j])` for position `i = 16·c + l` of the run
/// (`vb` rows [`VALUE_BLOCK`] long). A whole block stays in vector registers over the run
/// (AVX-512 or AVX2 where `simd` says the CPU has it).
#[inline(always)]
fn lane_run(a: &mut [f32], vb: &[f32], w: &[f32], (l, run): (usize, usize), simd: LaneSimd) {
    let last = (run - 1) * LANES + l;
    assert!(vb.len() >= (last + 1) * VALUE_BLOCK && w.len() > last);
    #[cfg(target_arch = "x86_64")]
    if let Ok(a) = <&mut [f32; VALUE_BLOCK]>::try_from(&mut *a) {
        match simd {
            // SAFETY: the CPU has the kernel's features (`LaneSimd::detect`); `vb` and `w`
            // hold the run's positions (asserted above).
            LaneSimd::Avx512 => return unsafe { lane_simd::run_avx512(a, vb, w, l, run) },
            // SAFETY: as above.
            LaneSimd::Avx2 => return unsafe { lane_simd::run_avx2(a, vb, w, l, run) },
            LaneSimd::None => {}
        }
    }
    for c in 0..run {
        let i = c * LANES + l;
        let (x, wv) = (&vb[i * VALUE_BLOCK..], w[i]);
        for (r, &x) in a.iter_mut().zip(x) {
            *r = x.mul_add(wv, *r);
        }
    }
}

/// The vector kernels [`lane_run`] can take.
#[derive(Clone, Copy)]
enum LaneSimd {
    Avx512,
    Avx2,
    None,
}

impl LaneSimd {
    fn detect() -> LaneSimd {
        if hmoe_quant::Isa::Avx512.is_available() {
            LaneSimd::Avx512
        } else if hmoe_quant::Isa::Avx2.is_available() {
            LaneSimd::Avx2
        } else {
            LaneSimd::None
        }
    }
}

/// [`lane_run`]'s kernels for a whole block.
///
/// Safety: the CPU has the features enabled; `vb` holds [`VALUE_BLOCK`] floats for each of
/// the run's positions `16·c + l` (`c < run`) and `w` their weights.
#[cfg(target_arch = "x86_64")]
mod lane_simd {
    use core::arch::x86_64::*;

    use super::{LANES, VALUE_BLOCK};

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn run_avx512(
        a: &mut [f32; VALUE_BLOCK],
        vb: &[f32],
        w: &[f32],
        l: usize,
        run: usize,
    ) {
        let p = a.as_mut_ptr();
        let mut r: [__m512; 4] = core::array::from_fn(|k| _mm512_loadu_ps(p.add(16 * k)));
        for c in 0..run {
            let i = c * LANES + l;
            let (x, wv) = (
                vb.as_ptr().add(i * VALUE_BLOCK),
                _mm512_set1_ps(*w.get_unchecked(i)),
            );
            for (k, r) in r.iter_mut().enumerate() {
                *r = _mm512_fmadd_ps(_mm512_loadu_ps(x.add(16 * k)), wv, *r);
            }
        }
        for (k, r) in r.iter().enumerate() {
            _mm512_storeu_ps(p.add(16 * k), *r);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_avx2(
        a: &mut [f32; VALUE_BLOCK],
        vb: &[f32],
        w: &[f32],
        l: usize,
        run: usize,
    ) {
        let p = a.as_mut_ptr();
        let mut r: [__m256; 8] = core::array::from_fn(|k| _mm256_loadu_ps(p.add(8 * k)));
        for c in 0..run {
            let i = c * LANES + l;
            let (x, wv) = (
                vb.as_ptr().add(i * VALUE_BLOCK),
                _mm256_set1_ps(*w.get_unchecked(i)),
            );
            for (k, r) in r.iter_mut().enumerate() {
                *r = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8 * k)), wv, *r);
            }
        }
        for (k, r) in r.iter().enumerate() {
            _mm256_storeu_ps(p.add(8 * k), *r);
        }
    }
}

/// Chunks of 16 positions per run of [`ExtTask::values_lanes`] (128 positions: each lane's
/// accumulators are read and written once per run).
const VALUE_RUN: usize = 8;

/// Elements per block of [`ExtTask::values_lanes`]: a run's values of a block (128 × 64
/// floats, 32 KiB) stay in L1 over the heads and lanes, and one lane's 64 accumulators fit the
/// registers.
const VALUE_BLOCK: usize = 64;

/// [`dot_lanes`] of four query heads with one key a multiple of 16 long: the same chains,
/// interleaved so that they overlap.
fn dot_lanes4(q: [&[f32]; 4], k: &[f32]) -> [f32; 4] {
    debug_assert!(k.len().is_multiple_of(LANES));
    let mut lanes = [[0f32; LANES]; 4];
    for (j, ck) in k.chunks_exact(LANES).enumerate() {
        for (l, q) in lanes.iter_mut().zip(q) {
            let cq = &q[j * LANES..(j + 1) * LANES];
            for i in 0..LANES {
                l[i] = cq[i].mul_add(ck[i], l[i]);
            }
        }
    }
    lanes.map(|l| hsum16(&l))
}

/// One [`attention_ext`] row task's buffers, kept per thread between calls (as
/// [`super::row_kernel::RowScratch`]), so that a token allocates nothing once they have grown.
#[derive(Default)]
struct ExtScratch {
    q16: Vec<f32>,
    q_blocks: Vec<u8>,
    probs: Vec<f32>,
    k_row: Vec<f32>,
    v_row: Vec<f32>,
    /// A chunk's value rows transposed: `[element][lane]`.
    vt: Vec<[f32; LANES]>,
    acc: Vec<[f32; LANES]>,
    /// [`ExtTask::values_lanes`]: the lane-major accumulators, a run's value rows, their
    /// weights per head, and a block of the rows packed.
    lane_acc: Vec<f32>,
    run_rows: Vec<f32>,
    run_w: Vec<f32>,
    run_block: Vec<f32>,
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
