//! The softmax of flash attention for eight query rows at once, one row per vector lane, a
//! block of keys at a time ([`softmax_lanes`]): each lane steps its running maximum and sum
//! through the block exactly as the row-at-a-time kernel does (hmoe-backend's
//! `softmax_block`), and the block's factors are kept. Every ISA gives the bits of the
//! scalar code.
//!
//! Around it, the products of the same eight rows with a block of f32/f16 key and value heads
//! read in place from the cache: [`lane_scores`] (one FMA chain per score, in element order)
//! and [`lane_values`] (the accumulators rescaled once for the block, then one FMA per key and
//! element, in key order).

use half::f16;

use hmoe_quant::Isa;

/// Query rows [`softmax_lanes`] steps together, one per lane.
pub const SOFTMAX_LANES: usize = 8;

/// The factors of one block of keys for every lane: what [`softmax_lanes`] leaves for
/// [`lane_values`]. Its buffers are reused from block to block.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaneBlock {
    /// Per lane, the factor of the value accumulator before the block: `e^(m_old − m)` where
    /// the block raises the lane's maximum, else 1.
    pub ms: [f32; SOFTMAX_LANES],
    /// Per key, each lane's probability `e^(score − m)` (0 where the lane does not see it).
    pub p: Vec<[f32; SOFTMAX_LANES]>,
    /// Per key, bit `l`: lane `l` sees the key.
    pub seen: Vec<u8>,
    /// Every lane sees every key of the block (the value sums need no mask).
    pub every: bool,
}

impl LaneBlock {
    /// Keys in the block.
    pub fn len(&self) -> usize {
        self.p.len()
    }
}

/// Steps the softmax of eight rows (running maxima `m`, sums `s`) through one block of keys
/// (`raw[i][l]`: lane `l`'s unscaled score of key `i`), lane `l` seeing the keys `from[l] ≤ i <
/// to[l]`, and leaves the block's factors in `out`.
///
/// Per lane, as hmoe-backend's `softmax_block` over the lane's visible scores `raw · scale`:
/// the block's maximum `M` (a score replaces it only where it is greater), `ms = e^(m − M)`
/// where `M > m` (else 1), `s = s·ms`, then per seen key in order `p = e^(score − M)` and
/// `s = s + p`; libm's `expf` ([`hmoe_quant::expf`]). Lanes that see no key keep `m` and `s`.
pub fn softmax_lanes(
    m: &mut [f32; SOFTMAX_LANES],
    s: &mut [f32; SOFTMAX_LANES],
    raw: &[[f32; SOFTMAX_LANES]],
    scale: f32,
    (from, to): ([i32; SOFTMAX_LANES], [i32; SOFTMAX_LANES]),
    out: &mut LaneBlock,
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
    lanes: ([i32; SOFTMAX_LANES], [i32; SOFTMAX_LANES]),
    out: &mut LaneBlock,
) {
    let n = raw.len();
    out.p.resize(n, [0.0; SOFTMAX_LANES]);
    out.seen.resize(n, 0);
    // The block's maxima, the arguments of the exponentials (`e^(m − M)` in `out.ms`, a key's
    // `score − M` in `out.p`, 0 where unseen) and which lanes see each key.
    let big = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers pass only ISAs this CPU has, and both vector ISAs include AVX2 and
        // FMA; `out` holds a slot per key of `raw` (resized above).
        Isa::Avx2 | Isa::Avx512 => unsafe { x86::maxima(m, raw, scale, lanes, out) },
        _ => scalar_maxima(m, raw, scale, lanes, out),
    };
    out.every = out.seen.iter().all(|&b| b == u8::MAX);
    hmoe_quant::expf_slice(&mut out.ms);
    hmoe_quant::expf_slice(out.p.as_flattened_mut());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 => unsafe { x86::sums(s, out) },
        _ => scalar_sums(s, out),
    }
    *m = big;
}

/// Key or value heads of a cache in a float type the lane kernels read in place: head `i` of
/// a call starts at element `at[i]`.
#[derive(Clone, Copy, Debug)]
pub enum LaneHeads<'a> {
    /// An f32 cache.
    F32(&'a [f32]),
    /// An f16 cache.
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

    /// Asks the CPU to load elements `range` ([`hmoe_quant::prefetch`]).
    #[inline(always)]
    fn prefetch(&self, range: std::ops::Range<usize>) {
        match self {
            LaneHeads::F32(h) => hmoe_quant::prefetch(&h[range]),
            LaneHeads::F16(h) => hmoe_quant::prefetch(&h[range]),
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
        self.column(k).at(i)
    }

    /// The lines of step `i` ([`Paced::line_at`] of each line), as one clamped address.
    #[inline(always)]
    fn lines_of(&self, i: usize) -> Column {
        let first = self.column(0);
        let start = first.at(i) as usize;
        Column {
            first: start,
            step: 64,
            last: (start + self.per.saturating_sub(1) * self.heads.elem_bytes()).min(first.last),
        }
    }

    /// Line `k` of every step ([`Paced::line_at`] of each step).
    #[inline(always)]
    fn column(&self, k: usize) -> Column {
        static NOTHING: u8 = 0;
        let len = self.heads.len();
        if len == 0 {
            let nothing = (&raw const NOTHING) as usize;
            return Column {
                first: nothing,
                step: 0,
                last: nothing,
            };
        }
        let bytes = self.heads.elem_bytes();
        let base = match self.heads {
            LaneHeads::F32(h) => h.as_ptr() as usize,
            LaneHeads::F16(h) => h.as_ptr() as usize,
        };
        Column {
            first: base + (self.line * k).min(self.per - 1) * bytes,
            step: self.per * bytes,
            last: base + (len - 1) * bytes,
        }
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

/// One line of every step of a [`Paced`] (addresses as integers, so that stepping past the
/// end is arithmetic, not pointer offsets).
#[derive(Clone, Copy)]
struct Column {
    first: usize,
    step: usize,
    last: usize,
}

impl Column {
    /// The line's address in step `i`, clamped to the memory's last element.
    #[inline(always)]
    fn at(&self, i: usize) -> *const i8 {
        (self.first + i * self.step).min(self.last) as *const i8
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

/// Adds the values of one block of keys (factors `block`, key `i`'s value head: `vd` elements
/// of `values` at `at[i]`) into the accumulators of the first `rows` lanes (`acc[l·vd..]`):
/// `acc *= ms`, then per key in order `acc = fma(v, p, acc)` in the lanes that see the key.
/// `ahead` is read while the values are (see [`Ahead`]).
///
/// # Panics
/// If `rows` exceeds the lanes, `acc` is shorter than `rows` heads, the block and `at` differ
/// in length, or a value runs past `values`.
pub fn lane_values(
    block: &LaneBlock,
    values: LaneHeads,
    at: &[usize],
    vd: usize,
    acc: &mut [f32],
    rows: usize,
    ahead: Ahead,
) {
    lane_values_on(Isa::best(), block, values, at, vd, acc, rows, ahead)
}

/// [`lane_values`] on `isa`, one this CPU has.
#[allow(clippy::too_many_arguments)]
fn lane_values_on(
    isa: Isa,
    block: &LaneBlock,
    values: LaneHeads,
    at: &[usize],
    vd: usize,
    acc: &mut [f32],
    rows: usize,
    ahead: Ahead,
) {
    assert!(rows <= SOFTMAX_LANES, "a row per lane");
    assert!(acc.len() >= rows * vd, "an accumulator per row");
    assert_eq!(block.len(), at.len(), "factors per key");
    assert_eq!(block.seen.len(), at.len(), "a mask per key");
    assert!(values.holds(at, vd), "values inside the cache");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA as in `lane_scores_on`; `vd` is whole vectors, every value head holds
        // `vd` elements and `acc` `rows` heads (checked).
        Isa::Avx512 if vd.is_multiple_of(16) => unsafe {
            x86::values_avx512(block, values, at, vd, acc, rows, ahead)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 if vd.is_multiple_of(8) => unsafe {
            x86::values(block, values, at, vd, acc, rows, ahead)
        },
        _ => scalar_values(block, values, at, vd, acc, rows, ahead),
    }
}

/// [`lane_values`] element by element.
fn scalar_values(
    block: &LaneBlock,
    values: LaneHeads,
    at: &[usize],
    vd: usize,
    acc: &mut [f32],
    rows: usize,
    ahead: Ahead,
) {
    let ahead = ahead.paced(at.len());
    for l in 0..rows {
        acc[l * vd..(l + 1) * vd]
            .iter_mut()
            .for_each(|x| *x *= block.ms[l]);
    }
    for (i, ((p, &seen), &a)) in block.p.iter().zip(&block.seen).zip(at).enumerate() {
        ahead.step(i);
        for l in (0..rows).filter(|l| seen >> l & 1 == 1) {
            for (e, x) in acc[l * vd..(l + 1) * vd].iter_mut().enumerate() {
                *x = values.get(a, e).mul_add(p[l], *x);
            }
        }
    }
}

/// The first pass: each lane's block maximum `M` (returned), which lanes see each key, and
/// the arguments of the exponentials: `m − M` in `out.ms` where `M > m` (else 0, so the factor
/// is 1), `score − M` in `out.p` (0 for lanes that do not see the key).
fn scalar_maxima(
    m: &[f32; SOFTMAX_LANES],
    raw: &[[f32; SOFTMAX_LANES]],
    scale: f32,
    (from, to): ([i32; SOFTMAX_LANES], [i32; SOFTMAX_LANES]),
    out: &mut LaneBlock,
) -> [f32; SOFTMAX_LANES] {
    let sees = |l: usize, i: usize| from[l] <= i as i32 && (i as i32) < to[l];
    let mut big = *m;
    for (i, sc) in raw.iter().enumerate() {
        let mut seen = 0u8;
        for l in 0..SOFTMAX_LANES {
            let x = sc[l] * scale;
            if sees(l, i) {
                seen |= 1 << l;
                if x > big[l] {
                    big[l] = x;
                }
            }
        }
        out.seen[i] = seen;
    }
    for l in 0..SOFTMAX_LANES {
        out.ms[l] = if big[l] > m[l] { m[l] - big[l] } else { 0.0 };
    }
    for (i, (sc, p)) in raw.iter().zip(&mut out.p).enumerate() {
        for l in 0..SOFTMAX_LANES {
            p[l] = if sees(l, i) {
                sc[l] * scale - big[l]
            } else {
                0.0
            };
        }
    }
    big
}

/// The second pass, over the exponentials: unseen lanes' probabilities zeroed, and each lane's
/// sum `s·ms` plus its probabilities in key order.
fn scalar_sums(s: &mut [f32; SOFTMAX_LANES], out: &mut LaneBlock) {
    for (l, s) in s.iter_mut().enumerate() {
        *s *= out.ms[l];
    }
    for (p, &seen) in out.p.iter_mut().zip(&out.seen) {
        for (l, (p, s)) in p.iter_mut().zip(s.iter_mut()).enumerate() {
            if seen >> l & 1 == 1 {
                *s += *p;
            } else {
                *p = 0.0;
            }
        }
    }
}

/// The AVX2 passes: the scalar code's operations on all eight lanes, choices made by blends.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use half::f16;

    use super::{Ahead, Column, LaneBlock, LaneHeads, KEYS_AT_ONCE, MAX_LANE_HEAD, SOFTMAX_LANES};

    /// The lanes whose bit is set in `bits`, as a vector mask.
    #[inline(always)]
    unsafe fn lanes_of(bits: u8) -> __m256 {
        let lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let set = _mm256_and_si256(_mm256_set1_epi32(bits as i32), lane_bits);
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(set, lane_bits))
    }

    /// [`super::scalar_maxima`].
    ///
    /// Safety: AVX2 and FMA present; `out.p` and `out.seen` at least as long as `raw`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn maxima(
        m: &[f32; SOFTMAX_LANES],
        raw: &[[f32; SOFTMAX_LANES]],
        scale: f32,
        (from, to): ([i32; SOFTMAX_LANES], [i32; SOFTMAX_LANES]),
        out: &mut LaneBlock,
    ) -> [f32; SOFTMAX_LANES] {
        let from = _mm256_loadu_si256(from.as_ptr().cast());
        let to = _mm256_loadu_si256(to.as_ptr().cast());
        let scale = _mm256_set1_ps(scale);
        // from ≤ i < to.
        let sees = |i: usize| {
            let iv = _mm256_set1_epi32(i as i32);
            _mm256_castsi256_ps(_mm256_andnot_si256(
                _mm256_cmpgt_epi32(from, iv),
                _mm256_cmpgt_epi32(to, iv),
            ))
        };
        let mv = _mm256_loadu_ps(m.as_ptr());
        let mut big = mv;
        for (i, (sc, seen)) in raw.iter().zip(&mut out.seen).enumerate() {
            let x = _mm256_mul_ps(_mm256_loadu_ps(sc.as_ptr()), scale);
            let mask = sees(i);
            let raise = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(x, big), mask);
            big = _mm256_blendv_ps(big, x, raise);
            *seen = _mm256_movemask_ps(mask) as u8;
        }
        let rose = _mm256_cmp_ps::<_CMP_GT_OQ>(big, mv);
        _mm256_storeu_ps(
            out.ms.as_mut_ptr(),
            _mm256_and_ps(_mm256_sub_ps(mv, big), rose),
        );
        for (i, (sc, p)) in raw.iter().zip(&mut out.p).enumerate() {
            let x = _mm256_mul_ps(_mm256_loadu_ps(sc.as_ptr()), scale);
            _mm256_storeu_ps(
                p.as_mut_ptr(),
                _mm256_and_ps(_mm256_sub_ps(x, big), sees(i)),
            );
        }
        let mut m = [0f32; SOFTMAX_LANES];
        _mm256_storeu_ps(m.as_mut_ptr(), big);
        m
    }

    /// [`super::scalar_sums`].
    ///
    /// Safety: AVX2 present.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sums(s: &mut [f32; SOFTMAX_LANES], out: &mut LaneBlock) {
        let mut sv = _mm256_mul_ps(
            _mm256_loadu_ps(s.as_ptr()),
            _mm256_loadu_ps(out.ms.as_ptr()),
        );
        for (p, &seen) in out.p.iter_mut().zip(&out.seen) {
            let mask = lanes_of(seen);
            let pv = _mm256_and_ps(_mm256_loadu_ps(p.as_ptr()), mask);
            sv = _mm256_blendv_ps(sv, _mm256_add_ps(sv, pv), mask);
            _mm256_storeu_ps(p.as_mut_ptr(), pv);
        }
        _mm256_storeu_ps(s.as_mut_ptr(), sv);
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
            let lines = ahead.lines_of(step);
            for e in 0..kd {
                // The step's memory ahead, a line per element (the rest after the loop),
                // without a branch that would cost the loop its accumulator registers.
                _mm_prefetch::<_MM_HINT_T0>(lines.at(e));
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
                _mm_prefetch::<_MM_HINT_T0>(lines.at(k));
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

    /// One slice of `W` elements from `d0` of every row's accumulator, held in registers
    /// (`V`, loaded by `load` and stored by `store`) across the block: rescaled by the block's
    /// `ms`, then one FMA per key in order in the lanes that see it (with no mask where every
    /// lane sees every key). Each key asks for its line of `ahead`.
    ///
    /// Lanes without a row (`rows ≤ l`) work on `spare` so that every lane's code is the same
    /// and the accumulators stay in registers; what they compute is dropped.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn values_slice<V: Copy, E: Elem>(
        block: &LaneBlock,
        values: &[E],
        at: &[usize],
        (acc, spare): (*mut f32, *mut f32),
        (vd, d0, rows): (usize, usize, usize),
        ahead: Column,
        (load, store): &(impl Fn(*const f32) -> V, impl Fn(*mut f32, V)),
        (load_v, mul, fma): &(
            impl Fn(*const E) -> V,
            impl Fn(V, f32) -> V,
            impl Fn(V, f32, V) -> V,
        ),
    ) {
        let row: [*mut f32; SOFTMAX_LANES] = std::array::from_fn(|l| {
            if l < rows {
                acc.add(l * vd + d0)
            } else {
                spare
            }
        });
        let mut a: [V; SOFTMAX_LANES] = std::array::from_fn(|l| mul(load(row[l]), block.ms[l]));
        let values = values.as_ptr().add(d0);
        if block.every {
            for (i, (p, &head)) in block.p.iter().zip(at).enumerate() {
                _mm_prefetch::<_MM_HINT_T0>(ahead.at(i));
                let v = load_v(values.add(head));
                for (a, &p) in a.iter_mut().zip(p) {
                    *a = fma(v, p, *a);
                }
            }
        } else {
            let keys = block.p.iter().zip(&block.seen).zip(at).enumerate();
            for (i, ((p, &seen), &head)) in keys {
                _mm_prefetch::<_MM_HINT_T0>(ahead.at(i));
                let v = load_v(values.add(head));
                for (l, (a, &p)) in a.iter_mut().zip(p).enumerate() {
                    if seen >> l & 1 == 1 {
                        *a = fma(v, p, *a);
                    }
                }
            }
        }
        for (&row, &a) in row.iter().zip(&a) {
            store(row, a);
        }
    }

    /// [`super::scalar_values`] in slices of `width` elements of each row (the vector `V`
    /// that `regs` loads and stores, and `ops` loads from the heads, scales and
    /// multiply-adds). Slice `k` asks for line `k` of each key's step of `ahead`, the lines
    /// beyond the slices after them.
    ///
    /// Safety: the ISA of `regs` and `ops` present; `vd` a multiple of `width`; every value
    /// head holds `vd` elements of `values` and `acc` `rows ≤ SOFTMAX_LANES` heads.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn values_in_slices<E: Elem, V: Copy>(
        block: &LaneBlock,
        values: &[E],
        at: &[usize],
        (vd, rows, width): (usize, usize, usize),
        acc: &mut [f32],
        ahead: Ahead,
        regs: (impl Fn(*const f32) -> V, impl Fn(*mut f32, V)),
        ops: (
            impl Fn(*const E) -> V,
            impl Fn(V, f32) -> V,
            impl Fn(V, f32, V) -> V,
        ),
    ) {
        let ahead = ahead.paced(at.len());
        let acc = acc.as_mut_ptr();
        // Where lanes without a row keep their accumulators (one vector).
        let mut spare = [0f32; 16];
        let slices = vd / width;
        for k in 0..slices {
            let shape = (vd, k * width, rows);
            let ptrs = (acc, spare.as_mut_ptr());
            values_slice(block, values, at, ptrs, shape, ahead.column(k), &regs, &ops);
        }
        for i in 0..at.len() {
            for k in slices..ahead.per.div_ceil(ahead.line) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.line_at(i, k));
            }
        }
    }

    /// A `#[target_feature]` entry over [`values_in_slices`] for one vector width: its
    /// vector type's load, store, multiply, FMA and broadcast, and [`Elem`]'s load.
    macro_rules! values_entry {
        ($(#[$doc:meta])* $name:ident, $features:literal, $width:literal,
         $load:ident, $store:ident, $mul:ident, $fma:ident, $set1:ident,
         $load_e:ident) => {
            $(#[$doc])*
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(
                block: &LaneBlock,
                values: LaneHeads,
                at: &[usize],
                vd: usize,
                acc: &mut [f32],
                rows: usize,
                ahead: Ahead,
            ) {
                let regs = (|p: *const f32| $load(p), |p: *mut f32, v| $store(p, v));
                let mul = |a, ms| $mul(a, $set1(ms));
                let fma = |v, vs, a| $fma(v, $set1(vs), a);
                let shape = (vd, rows, $width);
                match values {
                    LaneHeads::F32(h) => {
                        let ops = (|p| f32::$load_e(p), mul, fma);
                        values_in_slices(block, h, at, shape, acc, ahead, regs, ops)
                    }
                    LaneHeads::F16(h) => {
                        let ops = (|p| f16::$load_e(p), mul, fma);
                        values_in_slices(block, h, at, shape, acc, ahead, regs, ops)
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
        _mm256_loadu_ps, _mm256_storeu_ps, _mm256_mul_ps, _mm256_fmadd_ps,
        _mm256_set1_ps, load8
    );

    values_entry!(
        /// [`values_in_slices`] sixteen elements of each row at a time: one FMA per row and
        /// key then outlasts the FMA's latency.
        ///
        /// Safety: as [`values`], AVX-512 F present and `vd` a multiple of 16.
        values_avx512, "avx2,fma,f16c,avx512f", 16,
        _mm512_loadu_ps, _mm512_storeu_ps, _mm512_mul_ps, _mm512_fmadd_ps,
        _mm512_set1_ps, load16
    );
}

#[cfg(test)]
#[path = "lane_kernels_tests.rs"]
mod tests;
