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
/// [`super::row_kernel::RowScratch`]), so that a token allocates nothing once they have grown.
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
