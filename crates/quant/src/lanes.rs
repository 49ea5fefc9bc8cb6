//! The online softmax of flash attention for eight query rows at once, one row per vector lane
//! ([`softmax_lanes`]): per key in order, each lane that sees the key steps its running maximum
//! and sum exactly as the row-at-a-time kernel does, and the key's factors for the value
//! accumulators are kept. Every ISA gives the bits of the scalar code.

use crate::Isa;

/// Query rows [`softmax_lanes`] steps together, one per lane.
pub const SOFTMAX_LANES: usize = 8;

/// Keys whose exponentials are computed together.
const KEYS_PER_PASS: usize = 32;

/// One key's factors for every lane.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LaneFactors {
    /// Per lane, the factor of the value accumulator before this key: `e^(m_old − m)` where
    /// the key raises the lane's maximum, else 1.
    pub ms: [f32; SOFTMAX_LANES],
    /// Per lane, the factor of the key's value: 1 where the key raises the maximum, else
    /// `e^(score − m)`.
    pub vs: [f32; SOFTMAX_LANES],
    /// Bit `l`: lane `l` sees the key (lanes that do not keep their state).
    pub seen: u8,
    /// Bit `l`: the key raises lane `l`'s maximum.
    pub raise: u8,
}

/// Steps the online softmax of eight rows (running maxima `m`, sums `s`) through the keys of
/// `raw` in order (`raw[i][l]`: lane `l`'s unscaled score of key `i`), lane `l` seeing the keys
/// `from[l] ≤ i < to[l]`; `out[i]` gets key `i`'s factors.
///
/// Per lane and seen key, as the row kernel's step (`online_softmax_step` of hmoe-backend's
/// numerics) with the score `raw · scale`: a score above
/// `m` becomes the maximum with `ms = e^(m_old − score)`, `vs = 1`; otherwise `ms = 1`,
/// `vs = e^(score − m)`; `s = s·ms + vs` in one rounding; libm's `expf` ([`crate::expf`]).
/// Lanes that do not see a key get `ms = 1` and keep `m` and `s`.
///
/// # Panics
/// If `out` is shorter than `raw`.
pub fn softmax_lanes(
    m: &mut [f32; SOFTMAX_LANES],
    s: &mut [f32; SOFTMAX_LANES],
    raw: &[[f32; SOFTMAX_LANES]],
    scale: f32,
    (from, to): ([i32; SOFTMAX_LANES], [i32; SOFTMAX_LANES]),
    out: &mut [LaneFactors],
) {
    softmax_lanes_on(Isa::best(), m, s, raw, scale, (from, to), out);
}

/// [`softmax_lanes`] on `isa`, one this CPU has.
fn softmax_lanes_on(
    isa: Isa,
    m: &mut [f32; SOFTMAX_LANES],
    s: &mut [f32; SOFTMAX_LANES],
    raw: &[[f32; SOFTMAX_LANES]],
    scale: f32,
    (from, to): ([i32; SOFTMAX_LANES], [i32; SOFTMAX_LANES]),
    out: &mut [LaneFactors],
) {
    assert!(out.len() >= raw.len(), "one factor per key");
    let mut e = [[0f32; SOFTMAX_LANES]; KEYS_PER_PASS];
    for (pass, (raw, out)) in raw
        .chunks(KEYS_PER_PASS)
        .zip(out.chunks_mut(KEYS_PER_PASS))
        .enumerate()
    {
        let i0 = (pass * KEYS_PER_PASS) as i32;
        let lanes = (from.map(|f| f - i0), to.map(|t| t - i0));
        let e = &mut e[..raw.len()];
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: callers pass only ISAs this CPU has, and both vector ISAs include
            // AVX2 and FMA; `e` and `out` hold a slot per key of `raw`.
            Isa::Avx2 | Isa::Avx512 => unsafe { x86::maxima(m, raw, scale, lanes, e, out) },
            _ => scalar_maxima(m, raw, scale, lanes, e, out),
        }
        crate::expf_slice(e.as_flattened_mut());
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 | Isa::Avx512 => unsafe { x86::factors(s, e, out) },
            _ => scalar_factors(s, e, out),
        }
    }
}

/// The first pass: per key in order, which lanes see it, which maxima it raises, and the
/// argument of its exponential in `e` (0 for lanes that do not see it).
fn scalar_maxima(
    m: &mut [f32; SOFTMAX_LANES],
    raw: &[[f32; SOFTMAX_LANES]],
    scale: f32,
    (from, to): ([i32; SOFTMAX_LANES], [i32; SOFTMAX_LANES]),
    e: &mut [[f32; SOFTMAX_LANES]],
    out: &mut [LaneFactors],
) {
    for (i, ((sc, e), f)) in raw.iter().zip(e).zip(out).enumerate() {
        let i = i as i32;
        let (mut seen, mut raise) = (0u8, 0u8);
        for l in 0..SOFTMAX_LANES {
            let x = sc[l] * scale;
            e[l] = 0.0;
            if from[l] <= i && i < to[l] {
                seen |= 1 << l;
                if x > m[l] {
                    raise |= 1 << l;
                    e[l] = m[l] - x;
                    m[l] = x;
                } else {
                    e[l] = x - m[l];
                }
            }
        }
        (f.seen, f.raise) = (seen, raise);
    }
}

/// The second pass: each key's factors from its exponentials, and the lanes' sums.
fn scalar_factors(
    s: &mut [f32; SOFTMAX_LANES],
    e: &[[f32; SOFTMAX_LANES]],
    out: &mut [LaneFactors],
) {
    for (e, f) in e.iter().zip(out) {
        for l in 0..SOFTMAX_LANES {
            let raise = f.raise >> l & 1 == 1;
            let (ms, vs) = if raise { (e[l], 1.0) } else { (1.0, e[l]) };
            if f.seen >> l & 1 == 1 {
                s[l] = s[l].mul_add(ms, vs);
            }
            (f.ms[l], f.vs[l]) = (ms, vs);
        }
    }
}

/// The AVX2 passes: the scalar code's operations on all eight lanes, choices made by blends.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use super::{LaneFactors, SOFTMAX_LANES};

    /// The lanes whose bit is set in `bits`, as a vector mask.
    #[inline(always)]
    unsafe fn lanes_of(bits: u8) -> __m256 {
        let lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let set = _mm256_and_si256(_mm256_set1_epi32(bits as i32), lane_bits);
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(set, lane_bits))
    }

    /// [`super::scalar_maxima`].
    ///
    /// Safety: AVX2 and FMA present; `e` and `out` at least as long as `raw`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn maxima(
        m: &mut [f32; SOFTMAX_LANES],
        raw: &[[f32; SOFTMAX_LANES]],
        scale: f32,
        (from, to): ([i32; SOFTMAX_LANES], [i32; SOFTMAX_LANES]),
        e: &mut [[f32; SOFTMAX_LANES]],
        out: &mut [LaneFactors],
    ) {
        let from = _mm256_loadu_si256(from.as_ptr().cast());
        let to = _mm256_loadu_si256(to.as_ptr().cast());
        let scale = _mm256_set1_ps(scale);
        let mut mv = _mm256_loadu_ps(m.as_ptr());
        for (i, ((sc, e), f)) in raw.iter().zip(e).zip(out).enumerate() {
            let iv = _mm256_set1_epi32(i as i32);
            // from ≤ i < to.
            let seen = _mm256_castsi256_ps(_mm256_andnot_si256(
                _mm256_cmpgt_epi32(from, iv),
                _mm256_cmpgt_epi32(to, iv),
            ));
            let x = _mm256_mul_ps(_mm256_loadu_ps(sc.as_ptr()), scale);
            let raise = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(x, mv), seen);
            let arg = _mm256_blendv_ps(_mm256_sub_ps(x, mv), _mm256_sub_ps(mv, x), raise);
            _mm256_storeu_ps(e.as_mut_ptr(), _mm256_and_ps(arg, seen));
            mv = _mm256_blendv_ps(mv, x, raise);
            f.seen = _mm256_movemask_ps(seen) as u8;
            f.raise = _mm256_movemask_ps(raise) as u8;
        }
        _mm256_storeu_ps(m.as_mut_ptr(), mv);
    }

    /// [`super::scalar_factors`].
    ///
    /// Safety: AVX2 and FMA present.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn factors(
        s: &mut [f32; SOFTMAX_LANES],
        e: &[[f32; SOFTMAX_LANES]],
        out: &mut [LaneFactors],
    ) {
        let one = _mm256_set1_ps(1.0);
        let mut sv = _mm256_loadu_ps(s.as_ptr());
        for (e, f) in e.iter().zip(out) {
            let ev = _mm256_loadu_ps(e.as_ptr());
            let raise = lanes_of(f.raise);
            let ms = _mm256_blendv_ps(one, ev, raise);
            let vs = _mm256_blendv_ps(ev, one, raise);
            sv = _mm256_blendv_ps(sv, _mm256_fmadd_ps(sv, ms, vs), lanes_of(f.seen));
            _mm256_storeu_ps(f.ms.as_mut_ptr(), ms);
            _mm256_storeu_ps(f.vs.as_mut_ptr(), vs);
        }
        _mm256_storeu_ps(s.as_mut_ptr(), sv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-8, 8).
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 19) as f32 - 8.0
            })
            .collect()
    }

    /// The row-at-a-time step, lane by lane: the reference.
    fn reference(
        m: &mut [f32; SOFTMAX_LANES],
        s: &mut [f32; SOFTMAX_LANES],
        raw: &[[f32; SOFTMAX_LANES]],
        scale: f32,
        (from, to): ([i32; SOFTMAX_LANES], [i32; SOFTMAX_LANES]),
    ) -> Vec<LaneFactors> {
        let mut out = vec![LaneFactors::default(); raw.len()];
        for (i, (sc, f)) in raw.iter().zip(&mut out).enumerate() {
            for l in 0..SOFTMAX_LANES {
                let (i, x) = (i as i32, sc[l] * scale);
                (f.ms[l], f.vs[l]) = (1.0, 1.0);
                if !(from[l] <= i && i < to[l]) {
                    f.vs[l] = crate::expf(0.0);
                    continue;
                }
                f.seen |= 1 << l;
                if x > m[l] {
                    f.raise |= 1 << l;
                    f.ms[l] = crate::expf(m[l] - x);
                    m[l] = x;
                } else {
                    f.vs[l] = crate::expf(x - m[l]);
                }
                s[l] = s[l].mul_add(f.ms[l], f.vs[l]);
            }
        }
        out
    }

    #[test]
    fn softmax_lanes_are_the_row_step_lane_by_lane() {
        // Keys across several passes, a fresh state (−∞ maxima) and a running one, lanes that
        // see every key, a window, none, and scores with NaN and infinities.
        let n = 2 * KEYS_PER_PASS + 7;
        let mut scores = noise(1, n * SOFTMAX_LANES);
        scores[5] = f32::NAN;
        scores[77] = f32::INFINITY;
        scores[130] = f32::NEG_INFINITY;
        let raw: Vec<[f32; SOFTMAX_LANES]> = scores
            .chunks_exact(SOFTMAX_LANES)
            .map(|c| c.try_into().unwrap())
            .collect();
        let from = [0, 0, 3, 40, 0, 70, 0, 10];
        let to = [n as i32, 33, 50, 41, 0, 71, n as i32, 5];
        let isas = [Isa::Scalar, Isa::Avx2, Isa::Avx512].map(|isa| (isa, isa.is_available()));
        for (isa, _) in isas.into_iter().filter(|(_, have)| *have) {
            for (m0, s0) in [(f32::NEG_INFINITY, 0.0), (1.5, 2.25)] {
                let (mut m, mut s) = ([m0; SOFTMAX_LANES], [s0; SOFTMAX_LANES]);
                let (mut want_m, mut want_s) = (m, s);
                let want = reference(&mut want_m, &mut want_s, &raw, 0.125, (from, to));
                let mut out = vec![LaneFactors::default(); n];
                softmax_lanes_on(isa, &mut m, &mut s, &raw, 0.125, (from, to), &mut out);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&m), bits(&want_m), "{isa:?} maxima");
                assert_eq!(bits(&s), bits(&want_s), "sums");
                for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                    assert_eq!((got.seen, got.raise), (want.seen, want.raise), "key {i}");
                    assert_eq!(bits(&got.ms), bits(&want.ms), "key {i} ms");
                    // Lanes that do not see the key carry no value factor.
                    for l in (0..SOFTMAX_LANES).filter(|l| want.seen >> l & 1 == 1) {
                        assert_eq!(
                            got.vs[l].to_bits(),
                            want.vs[l].to_bits(),
                            "key {i} lane {l}"
                        );
                    }
                }
            }
        }
    }
}
