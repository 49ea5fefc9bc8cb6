//! The online softmax of flash attention for eight query rows at once, one row per vector lane
//! ([`softmax_lanes`]): per key in order, each lane that sees the key steps its running maximum
//! and sum exactly as the row-at-a-time kernel does, and the key's factors for the value
//! accumulators are kept. Every ISA gives the bits of the scalar code.
//!
//! Around it, the products of the same eight rows with a block of f32/f16 key and value heads
//! read in place from the cache: [`lane_scores`] (one FMA chain per score, in element order)
//! and [`lane_values`] (per key in order, the accumulators rescaled where a maximum rose, then
//! one FMA per element).

use half::f16;

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

/// Key or value heads of a cache in a float type the lane kernels read in place: head `i` of
/// a call starts at element `at[i]`.
#[derive(Clone, Copy, Debug)]
pub enum LaneHeads<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl LaneHeads<'_> {
    /// Elements in the heads.
    fn len(&self) -> usize {
        match self {
            LaneHeads::F32(h) => h.len(),
            LaneHeads::F16(h) => h.len(),
        }
    }

    /// Bytes of one element.
    fn elem_bytes(&self) -> usize {
        match self {
            LaneHeads::F32(_) => 4,
            LaneHeads::F16(_) => 2,
        }
    }

    /// Asks the CPU to load elements `range` ([`crate::prefetch`]).
    #[inline(always)]
    fn prefetch(&self, range: std::ops::Range<usize>) {
        match self {
            LaneHeads::F32(h) => crate::prefetch(&h[range]),
            LaneHeads::F16(h) => crate::prefetch(&h[range]),
        }
    }

    /// Whether `n` elements from each offset of `at` lie inside the heads.
    fn holds(&self, at: &[usize], n: usize) -> bool {
        let len = self.len();
        at.iter()
            .all(|&a| a.checked_add(n).is_some_and(|end| end <= len))
    }

    /// Element `e` of the head at `at`, as f32.
    #[inline(always)]
    fn get(&self, at: usize, e: usize) -> f32 {
        match self {
            LaneHeads::F32(h) => h[at + e],
            LaneHeads::F16(h) => h[at + e].to_f32(),
        }
    }
}

/// Memory a lane kernel asks the CPU to load while it computes, spread evenly over its keys
/// (a few cache lines per key): the next block of the cache arrives while this one is
/// computed. The kernels read one head of many positions at a time, a pattern the hardware
/// prefetcher does not follow, and a burst of prefetches stalls the core, so the stream is
/// paced by the work. A hint only: results never depend on it.
#[derive(Clone, Copy, Debug)]
pub struct Ahead<'a> {
    heads: LaneHeads<'a>,
}

impl Default for Ahead<'_> {
    fn default() -> Self {
        Ahead {
            heads: LaneHeads::F32(&[]),
        }
    }
}

impl<'a> Ahead<'a> {
    /// The heads `heads[range]` (out-of-range parts dropped).
    pub fn of(heads: LaneHeads<'a>, range: std::ops::Range<usize>) -> Ahead<'a> {
        let clip = |len: usize| range.start.min(len)..range.end.min(len);
        let heads = match heads {
            LaneHeads::F32(h) => LaneHeads::F32(&h[clip(h.len())]),
            LaneHeads::F16(h) => LaneHeads::F16(&h[clip(h.len())]),
        };
        Ahead { heads }
    }

    /// This memory read in `steps` equal steps of whole cache lines.
    fn paced(self, steps: usize) -> Paced<'a> {
        let (len, line) = (self.heads.len(), 64 / self.heads.elem_bytes());
        let per = match steps {
            0 => len,
            n => len.div_ceil(n).next_multiple_of(line),
        };
        Paced {
            heads: self.heads,
            per,
            line,
        }
    }
}

/// [`Ahead`] in steps of `per` elements, `line` elements to a cache line.
struct Paced<'a> {
    heads: LaneHeads<'a>,
    per: usize,
    line: usize,
}

impl Paced<'_> {
    /// The address of line `k` of step `i`, or of the step's last line where it has fewer
    /// (a second request for a line is free), or of a constant when there is nothing ahead:
    /// an address to prefetch without a branch.
    #[inline(always)]
    fn line_at(&self, i: usize, k: usize) -> *const i8 {
        static NOTHING: u8 = 0;
        let len = self.heads.len();
        if len == 0 {
            return (&raw const NOTHING).cast();
        }
        let at = (i * self.per + (self.line * k).min(self.per - 1)).min(len - 1);
        let bytes = self.heads.elem_bytes();
        let base: *const u8 = match self.heads {
            LaneHeads::F32(h) => h.as_ptr().cast(),
            LaneHeads::F16(h) => h.as_ptr().cast(),
        };
        base.wrapping_add(at * bytes).cast()
    }

    /// Prefetches the lines of step `i`.
    #[inline(always)]
    fn step(&self, i: usize) {
        let len = self.heads.len();
        if len == 0 {
            return;
        }
        let from = (i * self.per).min(len);
        self.heads.prefetch(from..(from + self.per).min(len));
    }
}

/// Keys [`lane_scores`] scores at once (independent FMA chains).
const KEYS_AT_ONCE: usize = 8;

/// Longest head the vector lane kernels take (longer heads take the scalar code).
#[cfg(target_arch = "x86_64")]
const MAX_LANE_HEAD: usize = 256;

/// `out[i][l]`: the score of key `i` (`kd` elements from `keys` at `at[i]`) for row `l` of
/// `qt` (`qt[e·SOFTMAX_LANES + l]`: element `e` of row `l`), as one FMA chain in element
/// order from 0, `s = q[e]·k[e] + s` (`hmoe_backend::numerics::dot_chain`).
///
/// `ahead` is read while the keys are (see [`Ahead`]).
///
/// # Panics
/// If `qt` has fewer than `kd` elements per lane, `out` and `at` differ in length, or a key
/// runs past `keys`.
pub fn lane_scores(
    qt: &[f32],
    keys: LaneHeads,
    at: &[usize],
    kd: usize,
    out: &mut [[f32; SOFTMAX_LANES]],
    ahead: Ahead,
) {
    lane_scores_on(Isa::best(), qt, keys, at, kd, out, ahead)
}

/// [`lane_scores`] on `isa`, one this CPU has.
fn lane_scores_on(
    isa: Isa,
    qt: &[f32],
    keys: LaneHeads,
    at: &[usize],
    kd: usize,
    out: &mut [[f32; SOFTMAX_LANES]],
    ahead: Ahead,
) {
    assert!(qt.len() >= kd * SOFTMAX_LANES, "a query element per lane");
    assert_eq!(out.len(), at.len(), "a score row per key");
    assert!(keys.holds(at, kd), "keys inside the cache");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers pass only ISAs this CPU has; AVX-512 here means AVX2, FMA, F16C and
        // AVX-512 F/BW/VL; `kd` is in bounds, `qt` holds `kd` lanes' elements and every key
        // `kd` elements (checked).
        Isa::Avx512 if kd <= MAX_LANE_HEAD => unsafe {
            x86::scores_avx512(qt, keys, at, kd, out, ahead)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, AVX2 meaning AVX2, FMA and F16C.
        Isa::Avx2 if kd <= MAX_LANE_HEAD => unsafe { x86::scores(qt, keys, at, kd, out, ahead) },
        _ => scalar_scores(qt, keys, at, kd, out, ahead),
    }
}

/// [`lane_scores`] element by element.
fn scalar_scores(
    qt: &[f32],
    keys: LaneHeads,
    at: &[usize],
    kd: usize,
    out: &mut [[f32; SOFTMAX_LANES]],
    ahead: Ahead,
) {
    let ahead = ahead.paced(at.len());
    for (i, (&a, dst)) in at.iter().zip(out).enumerate() {
        ahead.step(i);
        let mut acc = [0f32; SOFTMAX_LANES];
        for (e, q) in qt.chunks_exact(SOFTMAX_LANES).take(kd).enumerate() {
            let k = keys.get(a, e);
            for (x, &qv) in acc.iter_mut().zip(q) {
                *x = qv.mul_add(k, *x);
            }
        }
        *dst = acc;
    }
}

/// Adds the values of the keys whose factors are `factors` (key `i`'s value head: `vd`
/// elements of `values` at `at[i]`) into the accumulators of the first `rows` lanes
/// (`acc[l·vd..]`): per key in order, `acc *= ms` where some lane's maximum rose, then `acc =
/// fma(v, vs, acc)` in the lanes that see the key. `ahead` is read while the values are (see
/// [`Ahead`]).
///
/// # Panics
/// If `rows` exceeds the lanes, `acc` is shorter than `rows` heads, `factors` and `at` differ
/// in length, or a value runs past `values`.
pub fn lane_values(
    factors: &[LaneFactors],
    values: LaneHeads,
    at: &[usize],
    vd: usize,
    acc: &mut [f32],
    rows: usize,
    ahead: Ahead,
) {
    lane_values_on(Isa::best(), factors, values, at, vd, acc, rows, ahead)
}

/// [`lane_values`] on `isa`, one this CPU has.
#[allow(clippy::too_many_arguments)]
fn lane_values_on(
    isa: Isa,
    factors: &[LaneFactors],
    values: LaneHeads,
    at: &[usize],
    vd: usize,
    acc: &mut [f32],
    rows: usize,
    ahead: Ahead,
) {
    assert!(rows <= SOFTMAX_LANES, "a row per lane");
    assert!(acc.len() >= rows * vd, "an accumulator per row");
    assert_eq!(factors.len(), at.len(), "factors per key");
    assert!(values.holds(at, vd), "values inside the cache");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA as in `lane_scores_on`; `vd` is whole vectors, every value head holds
        // `vd` elements and `acc` `rows` heads (checked).
        Isa::Avx512 if vd.is_multiple_of(16) => unsafe {
            x86::values_avx512(factors, values, at, vd, acc, rows, ahead)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 if vd.is_multiple_of(8) => unsafe {
            x86::values(factors, values, at, vd, acc, rows, ahead)
        },
        _ => scalar_values(factors, values, at, vd, acc, rows, ahead),
    }
}

/// [`lane_values`] element by element.
fn scalar_values(
    factors: &[LaneFactors],
    values: LaneHeads,
    at: &[usize],
    vd: usize,
    acc: &mut [f32],
    rows: usize,
    ahead: Ahead,
) {
    let ahead = ahead.paced(at.len());
    for (i, (f, &a)) in factors.iter().zip(at).enumerate() {
        ahead.step(i);
        for l in 0..rows {
            let acc = &mut acc[l * vd..(l + 1) * vd];
            if f.raise != 0 {
                acc.iter_mut().for_each(|x| *x *= f.ms[l]);
            }
            if f.seen >> l & 1 == 1 {
                for (e, x) in acc.iter_mut().enumerate() {
                    *x = values.get(a, e).mul_add(f.vs[l], *x);
                }
            }
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

    use half::f16;

    use super::{Ahead, LaneFactors, LaneHeads, Paced, KEYS_AT_ONCE, MAX_LANE_HEAD, SOFTMAX_LANES};

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

    /// An element type of the heads, loaded as f32.
    trait Elem: Copy {
        /// Eight elements from `p`.
        unsafe fn load8(p: *const Self) -> __m256;
        /// Sixteen elements from `p` (AVX-512 F).
        unsafe fn load16(p: *const Self) -> __m512;
        /// One element at `p`.
        unsafe fn get(p: *const Self) -> f32;
    }

    impl Elem for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn get(p: *const f32) -> f32 {
            *p
        }
    }

    impl Elem for f16 {
        #[inline(always)]
        unsafe fn load8(p: *const f16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        }
        #[inline(always)]
        unsafe fn load16(p: *const f16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
        }
        #[inline(always)]
        unsafe fn get(p: *const f16) -> f32 {
            (*p).to_f32()
        }
    }

    /// [`super::scalar_scores`] with `N` keys in flight, each an FMA chain of its broadcast
    /// elements times the rows' query vector (keys first copied as f32 at a fixed stride,
    /// so that one pointer and constant offsets address all of them). A short last group
    /// repeats its first key in the missing slots and drops their scores.
    ///
    /// Safety: AVX2, FMA and F16C present; `N ≤ 2·KEYS_AT_ONCE`; `kd ≤ MAX_LANE_HEAD`; `qt`
    /// holds `kd` vectors and every key `kd` elements of `keys`.
    #[inline(always)]
    unsafe fn scores_n<const N: usize, E: Elem>(
        qt: &[f32],
        keys: &[E],
        at: &[usize],
        kd: usize,
        out: &mut [[f32; SOFTMAX_LANES]],
        ahead: Ahead,
    ) {
        let ahead = ahead.paced(at.len().div_ceil(N));
        // Written before they are read.
        let mut converted =
            std::mem::MaybeUninit::<[f32; 2 * KEYS_AT_ONCE * MAX_LANE_HEAD]>::uninit();
        let converted = converted.as_mut_ptr().cast::<f32>();
        for (step, (at, dst)) in at.chunks(N).zip(out.chunks_mut(N)).enumerate() {
            for u in 0..N {
                let head = at.get(u).copied().unwrap_or(at[0]);
                let (src, dst) = (keys.as_ptr().add(head), converted.add(u * MAX_LANE_HEAD));
                let mut e = 0;
                while e + 8 <= kd {
                    _mm256_storeu_ps(dst.add(e), E::load8(src.add(e)));
                    e += 8;
                }
                for e in e..kd {
                    *dst.add(e) = E::get(src.add(e));
                }
            }
            let mut acc = [_mm256_setzero_ps(); N];
            for e in 0..kd {
                // The step's memory ahead, a line per element (the rest after the loop),
                // without a branch that would cost the loop its accumulator registers.
                _mm_prefetch::<_MM_HINT_T0>(ahead.line_at(step, e));
                let q = _mm256_loadu_ps(qt.as_ptr().add(e * SOFTMAX_LANES));
                let k = converted.add(e);
                for (u, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(q, _mm256_broadcast_ss(&*k.add(u * MAX_LANE_HEAD)), *a);
                }
            }
            for (d, a) in dst.iter_mut().zip(&acc) {
                _mm256_storeu_ps(d.as_mut_ptr(), *a);
            }
            for k in kd..ahead.per.div_ceil(ahead.line) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.line_at(step, k));
            }
        }
    }

    /// [`scores_n`] with [`KEYS_AT_ONCE`] keys in flight (16 registers).
    ///
    /// Safety: as [`scores_n`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores(
        qt: &[f32],
        keys: LaneHeads,
        at: &[usize],
        kd: usize,
        out: &mut [[f32; SOFTMAX_LANES]],
        ahead: Ahead,
    ) {
        match keys {
            LaneHeads::F32(h) => scores_n::<KEYS_AT_ONCE, _>(qt, h, at, kd, out, ahead),
            LaneHeads::F16(h) => scores_n::<KEYS_AT_ONCE, _>(qt, h, at, kd, out, ahead),
        }
    }

    /// [`scores_n`] with twice [`KEYS_AT_ONCE`] keys in flight (AVX-512's 32 registers): each
    /// chain then waits less than an FMA's latency.
    ///
    /// Safety: as [`scores_n`], and AVX-512 F/VL present.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    pub(super) unsafe fn scores_avx512(
        qt: &[f32],
        keys: LaneHeads,
        at: &[usize],
        kd: usize,
        out: &mut [[f32; SOFTMAX_LANES]],
        ahead: Ahead,
    ) {
        const N: usize = 2 * KEYS_AT_ONCE;
        match keys {
            LaneHeads::F32(h) => scores_n::<N, _>(qt, h, at, kd, out, ahead),
            LaneHeads::F16(h) => scores_n::<N, _>(qt, h, at, kd, out, ahead),
        }
    }

    /// Per key in order: `a *= ms` where some lane's maximum rose, then `a = fma(v, vs, a)` in
    /// the lanes that see the key, over one slice of every row's accumulator (`a[l]`).
    #[inline(always)]
    unsafe fn step_rows<V: Copy>(
        a: &mut [V; SOFTMAX_LANES],
        f: &LaneFactors,
        v: V,
        mul: impl Fn(V, f32) -> V,
        fma: impl Fn(V, f32, V) -> V,
    ) {
        if f.raise != 0 {
            for (a, &ms) in a.iter_mut().zip(&f.ms) {
                *a = mul(*a, ms);
            }
        }
        if f.seen == u8::MAX {
            for (a, &vs) in a.iter_mut().zip(&f.vs) {
                *a = fma(v, vs, *a);
            }
        } else {
            for (l, (a, &vs)) in a.iter_mut().zip(&f.vs).enumerate() {
                if f.seen >> l & 1 == 1 {
                    *a = fma(v, vs, *a);
                }
            }
        }
    }

    /// One slice of `W` elements from `d0` of every row's accumulator, held in registers
    /// (`V`, loaded by `load` and stored by `store`) across all the keys; the first slice
    /// (`AHEAD`) paces the prefetch, a step per key.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn values_slice<V: Copy, E: Elem, const AHEAD: bool>(
        factors: &[LaneFactors],
        values: &[E],
        at: &[usize],
        acc: *mut f32,
        (vd, d0, rows): (usize, usize, usize),
        ahead: &Paced,
        &(zero, ref load, ref store): &(V, impl Fn(*const f32) -> V, impl Fn(*mut f32, V)),
        (load_v, mul, fma): &(
            impl Fn(*const E) -> V,
            impl Fn(V, f32) -> V,
            impl Fn(V, f32, V) -> V,
        ),
    ) {
        let mut a = [zero; SOFTMAX_LANES];
        for (l, a) in a.iter_mut().enumerate().take(rows) {
            *a = load(acc.add(l * vd + d0));
        }
        for (i, (f, &head)) in factors.iter().zip(at).enumerate() {
            if AHEAD {
                ahead.step(i);
            }
            let v = load_v(values.as_ptr().add(head + d0));
            step_rows(&mut a, f, v, mul, fma);
        }
        for (l, a) in a.iter().enumerate().take(rows) {
            store(acc.add(l * vd + d0), *a);
        }
    }

    /// [`super::scalar_values`] in slices of `width` elements of each row (the vector `V`
    /// that `regs` zeroes, loads and stores, and `ops` loads from the heads, scales and
    /// multiply-adds).
    ///
    /// Safety: the ISA of `regs` and `ops` present; `vd` a multiple of `width`; every value
    /// head holds `vd` elements of `values` and `acc` `rows ≤ SOFTMAX_LANES` heads.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn values_in_slices<E: Elem, V: Copy>(
        factors: &[LaneFactors],
        values: &[E],
        at: &[usize],
        (vd, rows, width): (usize, usize, usize),
        acc: &mut [f32],
        ahead: Ahead,
        regs: (V, impl Fn(*const f32) -> V, impl Fn(*mut f32, V)),
        ops: (
            impl Fn(*const E) -> V,
            impl Fn(V, f32) -> V,
            impl Fn(V, f32, V) -> V,
        ),
    ) {
        let ahead = ahead.paced(at.len());
        let acc = acc.as_mut_ptr();
        let (regs, ops) = (&regs, &ops);
        for d0 in (0..vd).step_by(width) {
            let shape = (vd, d0, rows);
            match d0 {
                0 => values_slice::<_, _, true>(factors, values, at, acc, shape, &ahead, regs, ops),
                _ => {
                    values_slice::<_, _, false>(factors, values, at, acc, shape, &ahead, regs, ops)
                }
            }
        }
    }

    /// A `#[target_feature]` entry over [`values_in_slices`] for one vector width: its
    /// vector type's zero, load, store, multiply, FMA and broadcast, and [`Elem`]'s load.
    macro_rules! values_entry {
        ($(#[$doc:meta])* $name:ident, $features:literal, $width:literal,
         $zero:ident, $load:ident, $store:ident, $mul:ident, $fma:ident, $set1:ident,
         $load_e:ident) => {
            $(#[$doc])*
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(
                factors: &[LaneFactors],
                values: LaneHeads,
                at: &[usize],
                vd: usize,
                acc: &mut [f32],
                rows: usize,
                ahead: Ahead,
            ) {
                let regs = ($zero(), |p: *const f32| $load(p), |p: *mut f32, v| $store(p, v));
                let mul = |a, ms| $mul(a, $set1(ms));
                let fma = |v, vs, a| $fma(v, $set1(vs), a);
                let shape = (vd, rows, $width);
                match values {
                    LaneHeads::F32(h) => {
                        let ops = (|p| f32::$load_e(p), mul, fma);
                        values_in_slices(factors, h, at, shape, acc, ahead, regs, ops)
                    }
                    LaneHeads::F16(h) => {
                        let ops = (|p| f16::$load_e(p), mul, fma);
                        values_in_slices(factors, h, at, shape, acc, ahead, regs, ops)
                    }
                }
            }
        };
    }

    values_entry!(
        /// [`values_in_slices`] eight elements of each row at a time.
        ///
        /// Safety: AVX2, FMA and F16C present; `vd` a multiple of 8; every value head holds
        /// `vd` elements and `acc` `rows ≤ SOFTMAX_LANES` heads.
        values, "avx2,fma,f16c", 8,
        _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_mul_ps, _mm256_fmadd_ps,
        _mm256_set1_ps, load8
    );

    values_entry!(
        /// [`values_in_slices`] sixteen elements of each row at a time: one FMA per row and
        /// key then outlasts the FMA's latency.
        ///
        /// Safety: as [`values`], AVX-512 F present and `vd` a multiple of 16.
        values_avx512, "avx2,fma,f16c,avx512f", 16,
        _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_mul_ps, _mm512_fmadd_ps,
        _mm512_set1_ps, load16
    );

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

    /// Every ISA this CPU has.
    fn isas() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|isa| isa.is_available())
            .collect()
    }

    /// `v` as f16 (and back, exactly), and the offsets of `n` heads of `d` elements spread
    /// over it out of order, `gap` elements apart.
    fn heads(v: &[f32], n: usize, d: usize, gap: usize) -> (Vec<f16>, Vec<usize>) {
        let h = v.iter().map(|&x| f16::from_f32(x)).collect();
        let at = (0..n).map(|i| (i * 7 % n) * (d + gap)).collect();
        (h, at)
    }

    #[test]
    fn lane_scores_are_one_fma_chain_per_key_and_row() {
        // Heads of 64 (gpt-oss), 80, 72 (a tail of 8 only), 20 (a tail shorter than 8) and
        // 300 (longer than the vector kernels take); whole groups, a short last group, one key.
        for kd in [64, 80, 72, 20, 300] {
            for n in [32, 13, 1] {
                let qt = noise(3, kd * SOFTMAX_LANES);
                let gap = 5;
                let cache = noise(4, n * (kd + gap));
                let (half, at) = heads(&cache, n, kd, gap);
                let half_f32: Vec<f32> = half.iter().map(|h| h.to_f32()).collect();
                for isa in isas() {
                    for (keys, exact) in [
                        (LaneHeads::F32(&cache), &cache),
                        (LaneHeads::F16(&half), &half_f32),
                    ] {
                        let mut out = vec![[0f32; SOFTMAX_LANES]; n];
                        let ahead = Ahead::of(keys, 0..kd * 3);
                        lane_scores_on(isa, &qt, keys, &at, kd, &mut out, ahead);
                        for (i, o) in out.iter().enumerate() {
                            for (l, &got) in o.iter().enumerate() {
                                let k = &exact[at[i]..at[i] + kd];
                                let want = (0..kd)
                                    .fold(0f32, |s, e| qt[e * SOFTMAX_LANES + l].mul_add(k[e], s));
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{isa:?} kd {kd} n {n} key {i} lane {l}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn lane_values_step_each_row_as_the_scalar_code() {
        // Heads of 64 (every kernel), 88 (AVX2's, not AVX-512's), 20 (the scalar code's); all
        // rows and fewer; keys that raise maxima, that some lanes do not see, and both.
        for vd in [64, 88, 20] {
            for rows in [SOFTMAX_LANES, 5] {
                let n = 37;
                let gap = 3;
                let cache = noise(5, n * (vd + gap));
                let (half, at) = heads(&cache, n, vd, gap);
                let factors: Vec<LaneFactors> = (0..n)
                    .map(|i| {
                        let w = noise(100 + i as u64, 2 * SOFTMAX_LANES);
                        LaneFactors {
                            ms: std::array::from_fn(|l| w[l].abs() / 8.0),
                            vs: std::array::from_fn(|l| w[SOFTMAX_LANES + l] / 8.0),
                            seen: [u8::MAX, 0b1011_0110, 0, u8::MAX][i % 4],
                            raise: [0, 0, 0b0100_0001, 0b1000_0000, 0, 0b0000_0100][i % 6],
                        }
                    })
                    .collect();
                let acc0 = noise(6, rows * vd);
                for values in [LaneHeads::F32(&cache), LaneHeads::F16(&half)] {
                    let mut want = acc0.clone();
                    scalar_values(&factors, values, &at, vd, &mut want, rows, Ahead::default());
                    // The scalar code itself: per key, row and element.
                    let mut naive = acc0.clone();
                    for (f, &a) in factors.iter().zip(&at) {
                        for l in 0..rows {
                            for e in 0..vd {
                                let x = &mut naive[l * vd + e];
                                if f.raise != 0 {
                                    *x *= f.ms[l];
                                }
                                if f.seen >> l & 1 == 1 {
                                    *x = values.get(a, e).mul_add(f.vs[l], *x);
                                }
                            }
                        }
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&want), bits(&naive), "scalar vd {vd}");
                    for isa in isas() {
                        let mut got = acc0.clone();
                        let ahead = Ahead::of(values, 0..vd * 5);
                        lane_values_on(isa, &factors, values, &at, vd, &mut got, rows, ahead);
                        assert_eq!(bits(&got), bits(&want), "{isa:?} vd {vd} rows {rows}");
                    }
                }
            }
        }
    }

    #[test]
    fn lane_kernels_refuse_heads_outside_the_cache() {
        let cache = vec![0f32; 100];
        let qt = vec![0f32; 64 * SOFTMAX_LANES];
        let mut out = vec![[0f32; SOFTMAX_LANES]; 1];
        let keys = LaneHeads::F32(&cache);
        let past_end = std::panic::catch_unwind(|| {
            lane_scores(&qt, keys, &[40], 64, &mut out.clone(), Ahead::default())
        });
        assert!(past_end.is_err(), "a key past the cache");
        lane_scores(&qt, keys, &[36], 64, &mut out, Ahead::of(keys, 90..1000));
        let mut acc = vec![0f32; 64];
        let f = [LaneFactors::default()];
        let past_end = std::panic::catch_unwind(move || {
            lane_values(&f, keys, &[usize::MAX], 64, &mut acc, 1, Ahead::default())
        });
        assert!(past_end.is_err(), "a value head past the cache");
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
