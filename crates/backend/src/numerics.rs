//! Scalar numerics shared by the CPU device and the reference device, so that both compute
//! the same bits.

/// e^x as computed by ggml's vectorised exponential (a polynomial after range reduction,
/// ≤ 1.5 ulp from the true value); the one the CPU device's kernels use (hmoe-quant's).
pub use hmoe_quant::expf_ggml;

/// ggml's fast Walsh–Hadamard transform of one chunk (what llama.cpp's rotation of
/// block-quantized K/V heads computes): scale by `1/√n`, then butterflies `(u + v, u − v)`
/// over strides 1, 2, 4, … `n/2`. The transform is its own inverse. `x.len()` must be a
/// power of two.
#[inline]
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    let scale = 1.0 / (n as f32).sqrt();
    for v in x.iter_mut() {
        *v *= scale;
    }
    let mut len = 1;
    while len < n {
        for i in (0..n).step_by(2 * len) {
            for j in i..i + len {
                let (u, v) = (x[j], x[j + len]);
                x[j] = u + v;
                x[j + len] = u - v;
            }
        }
        len <<= 1;
    }
}

/// `src` with every chunk of `rot` values transformed by [`fwht`].
pub fn rotate_chunks(src: &[f32], rot: usize) -> Vec<f32> {
    let mut out = src.to_vec();
    for chunk in out.chunks_exact_mut(rot) {
        fwht(chunk);
    }
    out
}

/// Lanes of ggml's AVX-512 accumulators.
const LANES: usize = 16;

/// The horizontal sum of 16 lanes by halving (lanes `i` and `i + 8`, then `+ 4`, `+ 2`,
/// `+ 1`), as `_mm512_reduce_add_ps` sums them.
#[inline]
pub fn hsum16(a: &[f32; LANES]) -> f32 {
    let mut h = *a;
    for step in [8, 4, 2, 1] {
        for i in 0..step {
            h[i] += h[i + step];
        }
    }
    h[0]
}

/// Accumulator chains of ggml's `vec_dot_f32` / `vec_dot_f16` on an AVX-512 build (64
/// elements per step, 16 per chain).
pub const VEC_DOT_CHAINS: usize = 4;

/// The sum of `chains` (1 or [`VEC_DOT_CHAINS`]) 16-lane accumulators: one chain summed by
/// halving, or four folded lane by lane as `vec_dot` folds them, `(c0 + c2) + (c1 + c3)`,
/// then summed by halving.
#[inline]
pub fn sum_chains(a: &[[f32; LANES]; VEC_DOT_CHAINS], chains: usize) -> f32 {
    if chains == 1 {
        return hsum16(&a[0]);
    }
    let folded: [f32; LANES] = std::array::from_fn(|l| (a[0][l] + a[2][l]) + (a[1][l] + a[3][l]));
    hsum16(&folded)
}

/// ggml's `vec_dot_f32` / `vec_dot_f16` on an AVX-512 build (`b` converted by `to_f32`):
/// four 16-lane FMA accumulators per 64 elements, folded pairwise `(0 + 2) + (1 + 3)`, summed
/// by halving, then the tail added one product at a time (in f32 for f32 data, in f64 for f16
/// data when `f64_tail`, as ggml does).
#[inline]
pub fn dot_vec<T: Copy>(a: &[f32], b: &[T], to_f32: impl Fn(T) -> f32, f64_tail: bool) -> f32 {
    let np = a.len() / 64 * 64;
    let mut acc = [[0f32; LANES]; 4];
    // Whole 64-element steps as fixed-size chunks, so the lanes vectorize.
    for (ca, cb) in a[..np].chunks_exact(64).zip(b[..np].chunks_exact(64)) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, lane) in lanes.iter_mut().enumerate() {
                *lane = ca[j * LANES + l].mul_add(to_f32(cb[j * LANES + l]), *lane);
            }
        }
    }
    let mut folded = [0f32; LANES];
    for l in 0..LANES {
        folded[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let head = hsum16(&folded);
    if f64_tail {
        let mut sum = head as f64;
        for k in np..a.len() {
            sum += (a[k] * to_f32(b[k])) as f64;
        }
        sum as f32
    } else {
        let mut sum = head;
        for k in np..a.len() {
            sum += a[k] * to_f32(b[k]);
        }
        sum
    }
}

/// The score of the chunked flash kernel for f32/f16 keys (the query rounded to f16 for f16
/// keys, the key converted exactly): one FMA chain in element order from 0, `s = q[e]·k[e] + s`.
/// The CPU device computes it for eight query heads at once, one head per lane.
#[inline]
pub fn dot_chain(q: &[f32], k: &[f32]) -> f32 {
    q.iter().zip(k).fold(0.0, |s, (&a, &b)| a.mul_add(b, s))
}

/// Positions per chunk of the split (chunked) flash attention over values of every type: chunk
/// `c` holds positions `c·FLASH_CHUNK .. (c + 1)·FLASH_CHUNK`, fixed by position so that
/// results depend neither on the thread count nor on the rest of the batch.
pub const FLASH_CHUNK: usize = 256;

/// Positions per block of the chunked flash kernel's softmax: block `b` of a chunk holds its
/// positions `b·FLASH_BLOCK .. (b + 1)·FLASH_BLOCK` (fixed by position, like the chunks).
pub const FLASH_BLOCK: usize = 32;

/// One block of the chunked flash kernel's softmax for one row (running maximum `m` and sum
/// `s`; `scores`: the row's visible keys of the block in position order, scaled): the block's
/// maximum `M` (the first score above the running one wins, so NaN never does) rescales what
/// came before by `ms = e^(m − M)` where it rose (else 1), `s = s·ms`, then each key's
/// probability `p = e^(score − M)` is added to `s` in key order and written to `probs`; libm's
/// `expf` (the probabilities by [`hmoe_quant::expf_slice`], its bits, several at a time). The
/// value accumulator is then `acc·ms` plus `v·p` key by key, one FMA each. Returns `ms`.
///
/// One rescale per block instead of one per new maximum: the value sums then run without a
/// branch per key.
pub fn softmax_block(m: &mut f32, s: &mut f32, scores: &[f32], probs: &mut [f32]) -> f32 {
    let big = scores
        .iter()
        .fold(*m, |big, &x| if x > big { x } else { big });
    let ms = if big > *m { (*m - big).exp() } else { 1.0 };
    for (p, &x) in probs.iter_mut().zip(scores) {
        *p = x - big;
    }
    hmoe_quant::expf_slice(&mut probs[..scores.len()]);
    *s *= ms;
    for &p in &probs[..scores.len()] {
        *s += p;
    }
    *m = big;
    ms
}

/// Folds the online-softmax state of a later chunk (`m2`, `s2`, `acc2`: maximum, sum of
/// `e^(score − m2)` and value accumulator) into the running state (`m`, `s`, `acc`) of the
/// chunks before it: with `M = max(m, m2)`, `a = e^(m − M)` and `b = e^(m2 − M)` (libm's
/// `expf`; the larger side's factor is exactly 1), `s = s2·b + s·a` and `acc = acc2·b + acc·a`
/// element by element, each in one rounding after the product `s·a` / `acc·a`. An empty
/// running state (`m = −∞`) takes the chunk's state as it is; an empty chunk changes nothing.
pub fn merge_softmax_chunk(
    m: &mut f32,
    s: &mut f32,
    acc: &mut [f32],
    (m2, s2, acc2): (f32, f32, &[f32]),
) {
    if m2 == f32::NEG_INFINITY {
        return;
    }
    if *m == f32::NEG_INFINITY {
        (*m, *s) = (m2, s2);
        acc.copy_from_slice(&acc2[..acc.len()]);
        return;
    }
    let big = m.max(m2);
    let (a, b) = ((*m - big).exp(), (m2 - big).exp());
    *s = s2.mul_add(b, *s * a);
    for (x, &y) in acc.iter_mut().zip(acc2) {
        *x = y.mul_add(b, *x * a);
    }
    *m = big;
}

/// SwiGLU of one row in place, `gate[i] = silu(gate[i]) · up[i]`, as ggml's AVX-512
/// `ggml_vec_swiglu_f32`: blocks of 16 use `x / (1 + e^−x)` with the vectorised exponential
/// ([`expf_ggml`]), the remainder of the row libm's `expf`.
pub fn swiglu_row(gate: &mut [f32], up: &[f32]) {
    let blocks = gate.len() / 16 * 16;
    // `e^−x` a chunk at a time with the vectorised `expf_ggml_slice` (the same bits).
    let mut e = [0f32; 256];
    for (g, u) in gate[..blocks].chunks_mut(256).zip(up[..blocks].chunks(256)) {
        let e = &mut e[..g.len()];
        for (e, &x) in e.iter_mut().zip(g.iter()) {
            *e = 0.0 - x;
        }
        hmoe_quant::expf_ggml_slice(e);
        for ((gv, &uv), &ev) in g.iter_mut().zip(u).zip(e.iter()) {
            *gv = *gv / (1.0 + ev) * uv;
        }
    }
    for (gv, &uv) in gate[blocks..].iter_mut().zip(&up[blocks..]) {
        let x = *gv;
        *gv = x / (1.0 + (-x).exp()) * uv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`swiglu_row`], whose exponentials run a chunk at a time, gives the bits of ggml's
    /// per-element definition (blocks of 16 with [`expf_ggml`], the rest libm's `expf`) for
    /// rows around the block and chunk sizes, with extreme inputs.
    #[test]
    fn swiglu_row_is_the_per_element_definition() {
        for len in [1usize, 15, 16, 17, 40, 256, 272, 300, 768, 1000] {
            let gate: Vec<f32> = (0..len)
                .map(|i| match i % 9 {
                    0 => -100.0,
                    1 => 100.0,
                    2 => -0.0,
                    3 => 1e-30,
                    4 => 88.5,
                    _ => ((i * 37) % 101) as f32 * 0.37 - 18.0,
                })
                .collect();
            let up: Vec<f32> = (0..len).map(|i| ((i * 13) % 17) as f32 - 8.5).collect();
            let mut got = gate.clone();
            swiglu_row(&mut got, &up);
            let blocks = len / 16 * 16;
            for (i, (&x, &u)) in gate.iter().zip(&up).enumerate() {
                let e = if i < blocks {
                    expf_ggml(0.0 - x)
                } else {
                    (-x).exp()
                };
                let want = x / (1.0 + e) * u;
                assert_eq!(got[i].to_bits(), want.to_bits(), "len {len} [{i}]: {x}");
            }
        }
    }
}
