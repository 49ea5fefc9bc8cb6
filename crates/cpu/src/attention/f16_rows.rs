//! Kernels of attention's row path over f16 keys and values (ggml's non-flash CPU numerics)
//! for the query heads that share one KV head: their scores against a run of keys, their
//! probability-weighted sums of a run of values.
//!
//! Each returns the bits of the scalar arithmetic it replaces:
//! * [`f16_head_scores`]: per (query head, key) the F16 [`DotKernel::dot`] times the scale.
//!   The AVX-512 path dots one key with a head as `vec_dot_f16` does (four 16-lane FMA chains
//!   over 64-element steps, folded `(c0 + c2) + (c1 + c3)`), then finishes sixteen keys' halving
//!   sums together: each step of the halving adds the same pairs of lanes, only the lanes of
//!   sixteen vectors are first interleaved so that one vector add serves them all.
//! * [`f16_value_lanes`]: `acc[head][lane][e] = fma(v[e], f16(w), acc[head][lane][e])` over the
//!   rows in order, lane = position mod 16 (tinyBLAS's lanes over positions), with the
//!   accumulators of one head, lane range and 16 elements held in registers across many rows.

use half::f16;

use hmoe_quant::{DotKernel, GgmlType};

/// Lanes of [`f16_value_lanes`]' accumulators: row `i` of a call goes to lane
/// `(lane0 + i) % VALUE_LANES`.
pub const VALUE_LANES: usize = 16;

/// Largest head the vector kernels take (longer heads take the scalar path).
#[cfg(target_arch = "x86_64")]
const MAX_HEAD: usize = 256;

/// `out[h · out_stride + i] = dot(query h, key i) · scale` for the query heads in `queries`
/// (`n` elements each) and `n_keys` keys of `n` elements, key `i` starting at element
/// `i · key_stride` of `keys`: each dot the bits of the F16 [`DotKernel::dot`] on
/// [`hmoe_quant::Isa::best`], then one rounding for the scale.
///
/// # Panics
/// If `n` is zero, `queries` is not whole heads, a key runs past `keys`, `out_stride < n_keys`
/// or `out` is too short.
#[allow(clippy::too_many_arguments)]
pub fn f16_head_scores(
    n: usize,
    queries: &[f16],
    keys: &[f16],
    key_stride: usize,
    n_keys: usize,
    scale: f32,
    out: &mut [f32],
    out_stride: usize,
) {
    assert!(
        n > 0 && queries.len().is_multiple_of(n),
        "queries are not whole heads"
    );
    let heads = queries.len() / n;
    if heads == 0 || n_keys == 0 {
        return;
    }
    assert!(out_stride >= n_keys, "score rows overlap");
    assert!(
        (n_keys - 1)
            .checked_mul(key_stride)
            .and_then(|at| at.checked_add(n))
            .is_some_and(|end| end <= keys.len()),
        "a key runs past the cache"
    );
    assert!(
        out.len() >= (heads - 1) * out_stride + n_keys,
        "score buffer too short"
    );
    #[cfg(target_arch = "x86_64")]
    if hmoe_quant::Isa::best() == hmoe_quant::Isa::Avx512 && n.is_multiple_of(64) && n <= MAX_HEAD {
        // SAFETY: `Isa::Avx512` means AVX-512 F/BW/VL, AVX2, FMA and F16C are present; every
        // key and score written lies inside `keys` and `out` (asserted above), and `n` is a
        // multiple of 64 of at most `MAX_HEAD`.
        unsafe { x86::scores(n, queries, keys, key_stride, n_keys, scale, out, out_stride) };
        return;
    }
    let kernel = DotKernel::best(GgmlType::F16).expect("f16 has a dot kernel");
    for (q, out) in queries.chunks_exact(n).zip(out.chunks_mut(out_stride)) {
        for (i, o) in out[..n_keys].iter_mut().enumerate() {
            let key = &keys[i * key_stride..i * key_stride + n];
            *o = kernel.dot(n, hmoe_quant::f16_bytes(q), hmoe_quant::f16_bytes(key)) * scale;
        }
    }
}

/// Adds the `n_rows` value rows of `n` elements (row `i` starting at element `i · stride` of
/// `values`) weighted by each query head's probabilities into its lane accumulators: for head
/// `h` (`weights[h · w_stride + i]` the weight of row `i`) and row `i` in order, with lane
/// `l = (lane0 + i) % 16`, `acc[(h · 16 + l) · n + e] = fma(v[e], w', acc[…])` where `w'` is the
/// weight rounded to f16 (the activation type of ggml's f16 matmul). Every ISA gives the same
/// bits.
///
/// # Panics
/// If a row runs past `values`, a weight past `weights` or `acc` is not
/// `16 · n` floats per head of `weights`.
#[allow(clippy::too_many_arguments)]
pub fn f16_value_lanes(
    n: usize,
    values: &[f16],
    stride: usize,
    n_rows: usize,
    lane0: usize,
    weights: &[f32],
    w_stride: usize,
    acc: &mut [f32],
) {
    if n == 0 || n_rows == 0 {
        return;
    }
    assert!(
        acc.len().is_multiple_of(VALUE_LANES * n),
        "accumulators are not whole heads"
    );
    let heads = acc.len() / (VALUE_LANES * n);
    if heads == 0 {
        return;
    }
    assert!(w_stride >= n_rows, "weight rows overlap");
    assert!(
        weights.len() >= (heads - 1) * w_stride + n_rows,
        "weights too short"
    );
    assert!(
        (n_rows - 1)
            .checked_mul(stride)
            .and_then(|at| at.checked_add(n))
            .is_some_and(|end| end <= values.len()),
        "a value row runs past the cache"
    );
    let lane0 = lane0 % VALUE_LANES;
    #[cfg(target_arch = "x86_64")]
    if hmoe_quant::Isa::best() == hmoe_quant::Isa::Avx512 && n.is_multiple_of(16) && n <= MAX_HEAD {
        // SAFETY: `Isa::Avx512` means AVX-512 F/BW/VL, AVX2, FMA and F16C are present; every
        // row, weight and accumulator touched lies inside the slices (asserted above), and `n`
        // is a multiple of 16 of at most `MAX_HEAD`.
        unsafe { x86::value_lanes(n, values, stride, n_rows, lane0, weights, w_stride, acc) };
        return;
    }
    for i in 0..n_rows {
        let l = (lane0 + i) % VALUE_LANES;
        let row = &values[i * stride..i * stride + n];
        for (h, acc) in acc.chunks_exact_mut(VALUE_LANES * n).enumerate() {
            let w = f16::from_f32(weights[h * w_stride + i]).to_f32();
            for (a, x) in acc[l * n..(l + 1) * n].iter_mut().zip(row) {
                *a = x.to_f32().mul_add(w, *a);
            }
        }
    }
}

/// The AVX-512 kernels. Helpers are `#[inline(always)]` and only called from the
/// `#[target_feature]` entry points.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use half::f16;

    use super::{MAX_HEAD, VALUE_LANES};

    /// Sixteen vectors' halving sums (lanes `i` and `i + 8`, then `+ 4`, `+ 2`, `+ 1`, as
    /// `_mm512_reduce_add_ps`) in one vector, lane `i` the sum of `f[i]`: at each step the
    /// vectors' halves are interleaved so that one add does that step for two (then four,
    /// eight, sixteen) of them, adding the same pairs of lanes as the reduction of each alone.
    #[inline(always)]
    unsafe fn reduce16(f: &[__m512; 16]) -> __m512 {
        // Step 8: p[m] = [f[2m] lanes 0..8 summed with 8..16, f[2m + 1] likewise].
        let p: [__m512; 8] = core::array::from_fn(|m| {
            let (a, b) = (f[2 * m], f[2 * m + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xee>(a, b),
            )
        });
        // Step 4: r[m] = per 128-bit quad q, vector 4m + q's four partial sums.
        let r: [__m512; 4] = core::array::from_fn(|m| {
            let (a, b) = (p[2 * m], p[2 * m + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(a, b),
                _mm512_shuffle_f32x4::<0xdd>(a, b),
            )
        });
        // Step 2: quad q of t holds vectors q and q + 4 (two lanes each), of u q + 8, q + 12.
        let t = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(r[0], r[1]),
            _mm512_shuffle_ps::<0xee>(r[0], r[1]),
        );
        let u = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(r[2], r[3]),
            _mm512_shuffle_ps::<0xee>(r[2], r[3]),
        );
        // Step 1: lane 4q + k holds vector q + 4k; put lane i back in place.
        let s = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(t, u),
            _mm512_shuffle_ps::<0xdd>(t, u),
        );
        let back = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(back, s)
    }

    /// Mask of the first `m` (≤ 16) lanes.
    #[inline(always)]
    fn first_lanes(m: usize) -> __mmask16 {
        if m >= 16 {
            0xffff
        } else {
            (1u16 << m) - 1
        }
    }

    /// Sixteen f16 at `p` as f32.
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }

    /// [`super::f16_head_scores`] for `n` a multiple of 64, at most [`MAX_HEAD`].
    ///
    /// Safety: AVX-512 F/BW/VL, AVX2, FMA and F16C present; the slices as asserted by the
    /// caller.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn scores(
        n: usize,
        queries: &[f16],
        keys: &[f16],
        key_stride: usize,
        n_keys: usize,
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let heads = queries.len() / n;
        let steps = n / 64;
        let scale = _mm512_set1_ps(scale);
        // Sixteen keys and one query head as f32.
        let mut kf = [0f32; 16 * MAX_HEAD];
        let mut qf = [0f32; MAX_HEAD];
        for c in (0..n_keys).step_by(16) {
            let m = (n_keys - c).min(16);
            for i in 0..m {
                let src = keys.as_ptr().add((c + i) * key_stride);
                for e in (0..n).step_by(16) {
                    _mm512_storeu_ps(kf.as_mut_ptr().add(i * n + e), load_f16(src.add(e)));
                }
            }
            for h in 0..heads {
                let q = queries.as_ptr().add(h * n);
                for e in (0..n).step_by(16) {
                    _mm512_storeu_ps(qf.as_mut_ptr().add(e), load_f16(q.add(e)));
                }
                let mut f = [_mm512_setzero_ps(); 16];
                for (i, f) in f.iter_mut().enumerate().take(m) {
                    let k = kf.as_ptr().add(i * n);
                    let mut acc = [_mm512_setzero_ps(); 4];
                    for s in 0..steps {
                        for (j, acc) in acc.iter_mut().enumerate() {
                            let off = s * 64 + 16 * j;
                            *acc = _mm512_fmadd_ps(
                                _mm512_loadu_ps(qf.as_ptr().add(off)),
                                _mm512_loadu_ps(k.add(off)),
                                *acc,
                            );
                        }
                    }
                    *f =
                        _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
                }
                let s = _mm512_mul_ps(reduce16(&f), scale);
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(h * out_stride + c), first_lanes(m), s);
            }
        }
    }

    /// `$body` once for each lane `$l` in 0..16, written out (LLVM keeps a loop over vector
    /// registers rolled, which sends the accumulators through memory).
    macro_rules! each_lane {
        ($l:ident => $body:expr) => {{
            each_lane!(@ $l $body; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
        }};
        (@ $l:ident $body:expr; $($i:literal)*) => {{
            $({
                let $l: usize = $i;
                $body;
            })*
        }};
    }

    /// Row `base + l` (lane `l`, `l` in 0..16) of the converted block at `vf` (rows `n`
    /// floats apart) weighted by `w[base + l]` into `acc[l]`, for the rows in `lo..hi`
    /// (every row when `FULL`); the others leave their lane as it is.
    #[inline(always)]
    unsafe fn lane_group<const FULL: bool>(
        acc: &mut [__m512; 16],
        vf: *const f32,
        w: *const f32,
        n: usize,
        base: isize,
        lo: isize,
        hi: isize,
    ) {
        each_lane!(l => {
            let i = base.wrapping_add(l as isize);
            if FULL {
                let v = _mm512_loadu_ps(vf.add((i as usize).wrapping_mul(n)));
                acc[l] = _mm512_fmadd_ps(v, _mm512_set1_ps(*w.add(i as usize)), acc[l]);
            } else {
                // A row outside `lo..hi` reads row `lo` and keeps the lane (mask 0).
                let inside = lo <= i && i < hi;
                let row = if inside { i } else { lo } as usize;
                let keep: __mmask16 = if inside { 0xffff } else { 0 };
                let v = _mm512_loadu_ps(vf.add(row.wrapping_mul(n)));
                acc[l] = _mm512_mask3_fmadd_ps(v, _mm512_set1_ps(*w.add(row)), acc[l], keep);
            }
        })
    }

    /// [`super::f16_value_lanes`] for `n` a multiple of 16, at most [`MAX_HEAD`], `lane0 <
    /// 16`.
    ///
    /// Safety: AVX-512 F/BW/VL, AVX2, FMA and F16C present; the slices as asserted by the
    /// caller.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn value_lanes(
        n: usize,
        values: &[f16],
        stride: usize,
        n_rows: usize,
        lane0: usize,
        weights: &[f32],
        w_stride: usize,
        acc: &mut [f32],
    ) {
        const BLOCK_FLOATS: usize = 16 * MAX_HEAD;
        let heads = acc.len() / (VALUE_LANES * n);
        let per_block = BLOCK_FLOATS / n;
        let mut vf = [0f32; BLOCK_FLOATS];
        let mut wr = [0f32; BLOCK_FLOATS / 16];
        let row = |i: usize| values.as_ptr().add(i * stride);
        for b0 in (0..n_rows).step_by(per_block) {
            let m = (n_rows - b0).min(per_block);
            for i in 0..m {
                let src = row(b0 + i);
                for e in (0..n).step_by(16) {
                    _mm512_storeu_ps(vf.as_mut_ptr().add(i * n + e), load_f16(src.add(e)));
                }
            }
            // Row `i` of the block is in lane `(first + i) % 16`: the lane-0 rows are
            // `base + 16k` with `base = -first`.
            let first = (lane0 + b0) % VALUE_LANES;
            for h in 0..heads {
                let w = weights.as_ptr().add(h * w_stride + b0);
                for i in (0..m).step_by(16) {
                    let mask = first_lanes(m - i);
                    let x = _mm512_maskz_loadu_ps(mask, w.add(i));
                    let x = _mm512_cvtph_ps(_mm512_cvtps_ph::<
                        { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                    >(x));
                    _mm512_mask_storeu_ps(wr.as_mut_ptr().add(i), mask, x);
                }
                for e0 in (0..n).step_by(16) {
                    let a = acc.as_mut_ptr().add(h * VALUE_LANES * n + e0);
                    let mut r = [_mm512_setzero_ps(); 16];
                    each_lane!(l => r[l] = _mm512_loadu_ps(a.add(l * n)));
                    let (vp, wp) = (vf.as_ptr().add(e0), wr.as_ptr());
                    let (lo, hi) = (0isize, m as isize);
                    let mut base = -(first as isize);
                    while base < hi {
                        if base >= lo && base + 16 <= hi {
                            lane_group::<true>(&mut r, vp, wp, n, base, lo, hi);
                        } else {
                            lane_group::<false>(&mut r, vp, wp, n, base, lo, hi);
                        }
                        base += 16;
                    }
                    each_lane!(l => _mm512_storeu_ps(a.add(l * n), r[l]));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1) times `scale` (attention's test values, scaled).
    fn noise(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let values = crate::attention::tests::noise(seed, n);
        values.into_iter().map(|v| v * scale).collect()
    }

    fn halves(v: &[f32]) -> Vec<f16> {
        v.iter().map(|&x| f16::from_f32(x)).collect()
    }

    #[test]
    fn head_scores_equal_the_f16_dot_kernel() {
        let kernel = DotKernel::best(GgmlType::F16).unwrap();
        for (n, heads, n_keys, key_stride) in [
            (64, 8, 1, 512),
            (64, 8, 37, 512),
            (64, 1, 16, 64),
            (128, 4, 33, 256),
            (256, 3, 20, 256),
            (80, 2, 19, 80),
            (320, 2, 5, 320),
        ] {
            let q = halves(&noise(n as u64, n * heads, 4.0));
            let keys = halves(&noise(7, (n_keys - 1) * key_stride + n, 3.0));
            let out_stride = n_keys + 5;
            let mut out = vec![f32::NAN; heads * out_stride];
            f16_head_scores(
                n, &q, &keys, key_stride, n_keys, 0.125, &mut out, out_stride,
            );
            for h in 0..heads {
                let qh = hmoe_quant::f16_bytes(&q[h * n..(h + 1) * n]);
                for i in 0..n_keys {
                    let key = hmoe_quant::f16_bytes(&keys[i * key_stride..i * key_stride + n]);
                    let want = kernel.dot(n, qh, key) * 0.125;
                    let got = out[h * out_stride + i];
                    assert_eq!(got.to_bits(), want.to_bits(), "n {n} head {h} key {i}");
                }
                assert!(out[h * out_stride + n_keys..(h + 1) * out_stride]
                    .iter()
                    .all(|v| v.is_nan()));
            }
        }
    }

    /// The value sum written out as the scalar loop it replaces.
    #[allow(clippy::too_many_arguments)]
    fn value_lanes_by_row(
        n: usize,
        values: &[f16],
        stride: usize,
        n_rows: usize,
        lane0: usize,
        weights: &[f32],
        w_stride: usize,
        acc: &mut [f32],
    ) {
        for i in 0..n_rows {
            let l = (lane0 + i) % 16;
            for (h, acc) in acc.chunks_exact_mut(16 * n).enumerate() {
                let w = f16::from_f32(weights[h * w_stride + i]).to_f32();
                for e in 0..n {
                    let x = values[i * stride + e].to_f32();
                    acc[l * n + e] = x.mul_add(w, acc[l * n + e]);
                }
            }
        }
    }

    #[test]
    fn value_lanes_equal_the_row_by_row_sum() {
        for (n, heads, n_rows, lane0, stride) in [
            (64, 8, 1, 3, 512),
            (64, 8, 300, 5, 512),
            (64, 8, 16, 0, 64),
            (128, 2, 1000, 15, 128),
            (256, 3, 70, 9, 256),
            (48, 2, 40, 7, 48),
            (40, 2, 21, 2, 40),
        ] {
            let values = halves(&noise(3, (n_rows - 1) * stride + n, 2.0));
            let w_stride = n_rows + 2;
            // Probabilities over many magnitudes, f16 subnormals included.
            let weights: Vec<f32> = noise(5, heads * w_stride, 1.0)
                .iter()
                .enumerate()
                .map(|(i, x)| x.abs() * 2f32.powi(-((i % 29) as i32)))
                .collect();
            let init = noise(11, heads * 16 * n, 0.5);
            let (mut got, mut want) = (init.clone(), init);
            f16_value_lanes(
                n, &values, stride, n_rows, lane0, &weights, w_stride, &mut got,
            );
            value_lanes_by_row(
                n, &values, stride, n_rows, lane0, &weights, w_stride, &mut want,
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "n {n} rows {n_rows} lane0 {lane0}");
        }
    }
}
