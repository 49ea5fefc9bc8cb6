//! AVX2 + FMA + F16C dot products of the IQ types (× Q8_K; IQ4_NL × Q8_0). They compute the
//! scalar references' integers (`scalar/iquants.rs`) 32 elements at a time: the grid rows of a
//! 32-element block are gathered from the tables into one register of magnitudes, the signs are
//! applied to the activation bytes (wrapping, as `_mm256_sign_epi8` does, so -128 stays -128),
//! `vpmaddubsw` pairs the products and `vpmaddwd` multiplies each pair sum by its 16 elements'
//! integer scale, which leaves element `e` in int32 lane `(e % 32) / 4`, the scalar lane. The
//! float steps (one fused multiply-add per super-block with `d_w·d_a`, the halving sum, the
//! type's constant, the IQ1 delta terms) are the scalar kernels' in the same order, so the
//! results are bit-identical. No 16-bit sum saturates: magnitudes are at most 127 and
//! activations at most 128 in absolute value, so a pair sum is at most 32512.
//!
//! Safety: every `unsafe fn` here needs AVX2, FMA and F16C, and pointers valid for the whole
//! blocks it reads (the contract in `kernel_fns.rs`).

use core::arch::x86_64::*;

use crate::kernel_fns::DotFns;
use crate::scalar::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
    KVALUES_IQ4NL,
};
use crate::scalar::iquants::{iq1_m_d, iq4_nl_last_block, IQ4_NL_BYTES};
use crate::scalar::kquants::{Q8_K_BSUMS, Q8_K_BYTES, Q8_K_QS, QK_K};
use crate::scalar::shared::{Q8_0_BYTES, QK};
use crate::x86::avx2::dot::{f16_at, hsum8};
use crate::x86::avx2::lowbit::{bits_mask, nibbles32};
use crate::GgmlType;

/// The IQ1 grid shift (ggml's `IQ1S_DELTA`, `IQ1M_DELTA`).
const IQ1_DELTA: f32 = 0.125;

/// Byte at offset `o`.
#[inline(always)]
unsafe fn byte(b: *const u8, o: usize) -> usize {
    *b.add(o) as usize
}

/// Little-endian u16 at offset `o`.
#[inline(always)]
unsafe fn u16_at(b: *const u8, o: usize) -> usize {
    b.add(o).cast::<u16>().read_unaligned() as usize
}

/// Little-endian u32 at offset `o`.
#[inline(always)]
unsafe fn u32_at(b: *const u8, o: usize) -> u32 {
    b.add(o).cast::<u32>().read_unaligned()
}

/// `y` negated (wrapping) in the bytes where `neg` is 0xff, as a sign vector for
/// `_mm256_sign_epi8`: 1 where `neg` is 0, -1 where it is 0xff.
#[inline(always)]
unsafe fn signs_of(neg: __m256i) -> __m256i {
    _mm256_or_si256(neg, _mm256_set1_epi8(1))
}

/// Unsigned magnitudes `m` times signed activations `ys`, each pair sum times the int16 scale
/// in the same position of `ls`: element `e` of the 32 lands in int32 lane `e / 4`.
#[inline(always)]
unsafe fn scaled(m: __m256i, ys: __m256i, ls: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(m, ys), ls)
}

/// The int16 scales of a 32-element block: `lo` for its first 16 elements, `hi` for the rest.
#[inline(always)]
unsafe fn ls_pair(lo: usize, hi: usize) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
}

/// The two nibble scales `2s+1` of a byte.
#[inline(always)]
unsafe fn nibble_scales(s: usize) -> __m256i {
    ls_pair(2 * (s & 15) + 1, 2 * (s >> 4) + 1)
}

/// The sign vectors of the 128 7-bit sign codes: byte `j` is -1 where bit `j` of the code's
/// sign byte (`KSIGNS_IQ2XS`) is set, else 1 (ggml's `keven_signs_q2xs`).
static SIGN_VECTORS: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut c = 0;
    while c < 128 {
        let mut j = 0;
        while j < 8 {
            let byte = if KSIGNS_IQ2XS[c] >> j & 1 == 1 {
                0xff
            } else {
                0x01
            };
            t[c] |= (byte as u64) << (8 * j);
            j += 1;
        }
        c += 1;
    }
    t
};

/// The sign vector of four 7-bit sign codes (IQ2_XXS, IQ2_XS, IQ3_XXS), code `l` for the 8
/// elements from `8l`.
#[inline(always)]
unsafe fn ksigns(c: [usize; 4]) -> __m256i {
    let k = |l: usize| SIGN_VECTORS[c[l] & 127] as i64;
    _mm256_set_epi64x(k(3), k(2), k(1), k(0))
}

/// One decoded 32-element block: element `e` is `m[e]` with the sign of `sgn[e]` (the scalar
/// `signed_product(q, y)` is `m · sign(y, sgn)`), the int16 scale of each element in `ls`, and
/// for the IQ1 types the sign of its delta (`dsgn`, ±1 bytes; IQ1_M) or the block's
/// `±ls` (`ls_delta`; IQ1_S).
#[derive(Clone, Copy)]
struct Part {
    m: __m256i,
    sgn: __m256i,
    ls: __m256i,
    dsgn: __m256i,
    ls_delta: i32,
}

impl Part {
    /// A block without an IQ1 delta.
    #[inline(always)]
    unsafe fn plain(m: __m256i, sgn: __m256i, ls: __m256i) -> Part {
        let z = _mm256_setzero_si256();
        Part {
            m,
            sgn,
            ls,
            dsgn: z,
            ls_delta: 0,
        }
    }

    /// `Σ ls·q·y` of the block with activations `y` in the 8 int32 lanes.
    #[inline(always)]
    unsafe fn lanes(&self, y: __m256i) -> __m256i {
        scaled(self.m, _mm256_sign_epi8(y, self.sgn), self.ls)
    }

    /// IQ1_M's `Σ ls·(±y)` of the block in the 8 int32 lanes.
    #[inline(always)]
    unsafe fn delta_lanes(&self, y: __m256i) -> __m256i {
        scaled(_mm256_set1_epi8(1), _mm256_sign_epi8(y, self.dsgn), self.ls)
    }
}

/// Where an IQ type's ±1/8 shift goes in the dot product (the scalar `Delta`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Delta {
    None,
    BlockSums,
    Lanes,
}

/// An IQ super-block type.
trait IqSuper {
    /// Bytes of a super-block.
    const BYTES: usize;
    /// The constant ggml multiplies the dot product by at the end.
    const C: f32;
    /// Where the IQ1 delta goes.
    const DELTA: Delta = Delta::None;
    /// The super-block's scale.
    unsafe fn d(b: *const u8) -> f32 {
        f16_at(b)
    }
    /// 32-element block `ib` of the super-block at `b`, decoded.
    unsafe fn part(b: *const u8, ib: usize) -> Part;
}

struct Iq1S;
struct Iq1M;
struct Iq2Xxs;
struct Iq2Xs;
struct Iq2S;
struct Iq3Xxs;
struct Iq3S;
struct Iq4Xs;

impl IqSuper for Iq2Xxs {
    const BYTES: usize = 66;
    const C: f32 = 0.125;
    #[inline(always)]
    unsafe fn part(b: *const u8, ib: usize) -> Part {
        let o = 2 + 8 * ib;
        let aux = u32_at(b, o + 4) as usize;
        let g = |l: usize| IQ2XXS_GRID[byte(b, o + l)] as i64;
        let m = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
        let sgn = ksigns([aux, aux >> 7, aux >> 14, aux >> 21]);
        Part::plain(m, sgn, _mm256_set1_epi16(2 * (aux >> 28) as i16 + 1))
    }
}

impl IqSuper for Iq2Xs {
    const BYTES: usize = 74;
    const C: f32 = 0.125;
    #[inline(always)]
    unsafe fn part(b: *const u8, ib: usize) -> Part {
        let v = |l: usize| u16_at(b, 2 + 2 * (4 * ib + l));
        let (v0, v1, v2, v3) = (v(0), v(1), v(2), v(3));
        let g = |v: usize| IQ2XS_GRID[v & 511] as i64;
        let m = _mm256_set_epi64x(g(v3), g(v2), g(v1), g(v0));
        let sgn = ksigns([v0 >> 9, v1 >> 9, v2 >> 9, v3 >> 9]);
        Part::plain(m, sgn, nibble_scales(byte(b, 66 + ib)))
    }
}

impl IqSuper for Iq2S {
    const BYTES: usize = 82;
    const C: f32 = 0.125;
    #[inline(always)]
    unsafe fn part(b: *const u8, ib: usize) -> Part {
        let qh = byte(b, 66 + ib);
        let g = |l: usize| {
            IQ2S_GRID[(byte(b, 2 + 4 * ib + l) | ((qh << (8 - 2 * l)) & 0x300)) & 1023] as i64
        };
        let m = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
        let sgn = signs_of(bits_mask(u32_at(b, 34 + 4 * ib)));
        Part::plain(m, sgn, nibble_scales(byte(b, 74 + ib)))
    }
}

/// The 8 grid index bytes of 32-element block `ib` of an IQ3 super-block as int32 lanes.
#[inline(always)]
unsafe fn iq3_indices(b: *const u8, ib: usize) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.add(2 + 8 * ib).cast()))
}

/// The rows `idx` (int32 lanes, each below `grid.len()`) of a grid of 4-byte rows.
#[inline(always)]
unsafe fn grid_gather<const N: usize>(grid: &[u32; N], idx: __m256i) -> __m256i {
    _mm256_i32gather_epi32::<4>(grid.as_ptr().cast(), idx)
}

impl IqSuper for Iq3Xxs {
    const BYTES: usize = 98;
    const C: f32 = 0.25;
    #[inline(always)]
    unsafe fn part(b: *const u8, ib: usize) -> Part {
        let aux = u32_at(b, 66 + 4 * ib) as usize;
        let m = grid_gather(&IQ3XXS_GRID, iq3_indices(b, ib));
        let sgn = ksigns([aux, aux >> 7, aux >> 14, aux >> 21]);
        Part::plain(m, sgn, _mm256_set1_epi16(2 * (aux >> 28) as i16 + 1))
    }
}

impl IqSuper for Iq3S {
    const BYTES: usize = 110;
    const C: f32 = 1.0;
    #[inline(always)]
    unsafe fn part(b: *const u8, ib: usize) -> Part {
        let raw = (byte(b, 106 + ib / 2) >> (4 * (ib % 2))) & 15;
        let qh = byte(b, 66 + ib);
        // Bit k of qh is the 9th bit of index k: (qh << (8 - k)) & 0x100.
        let high = _mm256_sllv_epi32(
            _mm256_set1_epi32(qh as i32),
            _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1),
        );
        let idx = _mm256_or_si256(
            iq3_indices(b, ib),
            _mm256_and_si256(high, _mm256_set1_epi32(0x100)),
        );
        let m = grid_gather(&IQ3S_GRID, idx);
        let sgn = signs_of(bits_mask(u32_at(b, 74 + 4 * ib)));
        Part::plain(m, sgn, _mm256_set1_epi16(1 + 2 * raw as i16))
    }
}

/// The 32 non-linear IQ4 values of the 16 nibble bytes at `p` (low nibbles first).
#[inline(always)]
unsafe fn iq4_values(p: *const u8) -> __m256i {
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()));
    _mm256_shuffle_epi8(table, nibbles32(p))
}

impl IqSuper for Iq4Xs {
    const BYTES: usize = 136;
    const C: f32 = 1.0;
    #[inline(always)]
    unsafe fn part(b: *const u8, ib: usize) -> Part {
        let lo = (byte(b, 4 + ib / 2) >> (4 * (ib % 2))) & 15;
        let hi = (u16_at(b, 2) >> (2 * ib)) & 3;
        let ls = (lo | hi << 4) as i16 - 32;
        let q = iq4_values(b.add(8 + 16 * ib));
        Part::plain(_mm256_abs_epi8(q), q, _mm256_set1_epi16(ls))
    }
}

/// The signed IQ1 grid rows (bytes -1, 0, 1) of four 11-bit indices.
#[inline(always)]
unsafe fn iq1_grid(idx: [usize; 4]) -> __m256i {
    let g = |l: usize| IQ1S_GRID[idx[l] & 2047] as i64;
    _mm256_set_epi64x(g(3), g(2), g(1), g(0))
}

impl IqSuper for Iq1S {
    const BYTES: usize = 50;
    const C: f32 = 1.0;
    const DELTA: Delta = Delta::BlockSums;
    #[inline(always)]
    unsafe fn part(b: *const u8, ib: usize) -> Part {
        let qh = u16_at(b, 34 + 2 * ib);
        let ls = 2 * ((qh >> 12) & 7) + 1;
        let idx = |l: usize| byte(b, 2 + 4 * ib + l) | ((qh >> (3 * l)) & 7) << 8;
        let q = iq1_grid([idx(0), idx(1), idx(2), idx(3)]);
        let mut p = Part::plain(_mm256_abs_epi8(q), q, _mm256_set1_epi16(ls as i16));
        let sign = if qh & 0x8000 != 0 { -1 } else { 1 };
        p.ls_delta = sign * ls as i32;
        p
    }
}

impl IqSuper for Iq1M {
    const BYTES: usize = 56;
    const C: f32 = 1.0;
    const DELTA: Delta = Delta::Lanes;
    #[inline(always)]
    unsafe fn d(b: *const u8) -> f32 {
        iq1_m_d(core::slice::from_raw_parts(b, Self::BYTES))
    }
    #[inline(always)]
    unsafe fn part(b: *const u8, ib: usize) -> Part {
        let sc = u16_at(b, 48 + 2 * (ib / 2)) >> (6 * (ib % 2));
        let ls = ls_pair(2 * (sc & 7) + 1, 2 * ((sc >> 3) & 7) + 1);
        let nib = |l: usize| (byte(b, 32 + 2 * ib + l / 2) >> (4 * (l % 2))) & 15;
        let nibs = [nib(0), nib(1), nib(2), nib(3)];
        let idx = |l: usize| byte(b, 4 * ib + l) | (nibs[l] & 7) << 8;
        let q = iq1_grid([idx(0), idx(1), idx(2), idx(3)]);
        let dn = |l: usize| -((nibs[l] >> 3) as i64);
        let neg = _mm256_set_epi64x(dn(3), dn(2), dn(1), dn(0));
        let mut p = Part::plain(_mm256_abs_epi8(q), q, ls);
        p.dsgn = signs_of(neg);
        p
    }
}

/// The 32 activations of block `ib` of the Q8_K super-block at `ab`.
#[inline(always)]
unsafe fn q8k_y(ab: *const u8, ib: usize) -> __m256i {
    _mm256_loadu_si256(ab.add(Q8_K_QS + 32 * ib).cast())
}

/// The Q8_K super-block `i` of the activations and its scale.
#[inline(always)]
unsafe fn q8k_block(a: *const u8, i: usize) -> (*const u8, f32) {
    let ab = a.add(i * Q8_K_BYTES);
    (ab, ab.cast::<f32>().read_unaligned())
}

/// One token's accumulators of a row: the scalar kernel's 8-lane `acc`, and the IQ1 delta's
/// 8-lane `acc2` (IQ1_M) or scalar `acc1` (IQ1_S).
#[derive(Clone, Copy)]
struct Acc {
    acc: __m256,
    acc2: __m256,
    acc1: f32,
}

impl Acc {
    #[inline(always)]
    unsafe fn new() -> Acc {
        Acc {
            acc: _mm256_setzero_ps(),
            acc2: _mm256_setzero_ps(),
            acc1: 0.0,
        }
    }

    /// Adds the decoded super-block `parts` (scale `dw`) times the Q8_K super-block at `ab`
    /// (scale `da`), in the scalar kernel's order.
    #[inline(always)]
    unsafe fn add<T: IqSuper>(&mut self, parts: &[Part; 8], dw: f32, ab: *const u8, da: f32) {
        let d = dw * da;
        let mut s = _mm256_setzero_si256();
        let mut s2 = _mm256_setzero_si256();
        let mut sumi1 = 0i32;
        for (ib, p) in parts.iter().enumerate() {
            let y = q8k_y(ab, ib);
            s = _mm256_add_epi32(s, p.lanes(y));
            match T::DELTA {
                Delta::None => {}
                Delta::Lanes => s2 = _mm256_add_epi32(s2, p.delta_lanes(y)),
                Delta::BlockSums => {
                    let bsum = |k: usize| ab.add(Q8_K_BSUMS + 2 * k).cast::<i16>().read_unaligned();
                    let bs = bsum(2 * ib) as i32 + bsum(2 * ib + 1) as i32;
                    sumi1 += bs * p.ls_delta;
                }
            }
        }
        self.fold::<T>(d, s, s2, sumi1);
    }

    /// Adds a super-block's integer sums with scale `d` (`dw·da`): the lanes `s`, IQ1_M's
    /// delta lanes `s2`, IQ1_S's delta sum `sumi1`.
    #[inline(always)]
    unsafe fn fold<T: IqSuper>(&mut self, d: f32, s: __m256i, s2: __m256i, sumi1: i32) {
        let dv = _mm256_set1_ps(d);
        self.acc = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(s), self.acc);
        match T::DELTA {
            Delta::None => {}
            Delta::Lanes => self.acc2 = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(s2), self.acc2),
            Delta::BlockSums => self.acc1 = d.mul_add(sumi1 as f32, self.acc1),
        }
    }

    /// The dot product: the scalar kernel's final sums.
    #[inline(always)]
    unsafe fn result<T: IqSuper>(&self) -> f32 {
        let main = T::C * hsum8(self.acc);
        match T::DELTA {
            Delta::None => main,
            Delta::BlockSums => main + IQ1_DELTA * self.acc1,
            Delta::Lanes => main + IQ1_DELTA * hsum8(self.acc2),
        }
    }
}

/// Super-block `b` of type `T` decoded.
#[inline(always)]
unsafe fn parts<T: IqSuper>(b: *const u8) -> [Part; 8] {
    core::array::from_fn(|ib| T::part(b, ib))
}

/// `R` rows of super-block type `T` (`stride` bytes apart) times the Q8_K row `a`.
#[inline(always)]
unsafe fn super_rows<T: IqSuper, const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    for r in 0..R {
        let w = w.add(r * stride);
        let mut acc = Acc::new();
        for i in 0..n / QK_K {
            let b = w.add(i * T::BYTES);
            let (ab, da) = q8k_block(a, i);
            acc.add::<T>(&parts::<T>(b), T::d(b), ab, da);
        }
        *out.add(r) = acc.result::<T>();
    }
}

/// `out[r · n_tokens + t]` = row `r` of `w` (type `T`, rows back to back) times token `t` of
/// `a` (Q8_K rows back to back): each super-block decoded once for all the tokens, each token
/// with the single-token kernel's float operations.
#[inline(always)]
unsafe fn super_tokens<T: IqSuper>(
    n: usize,
    w: *const u8,
    a: *const u8,
    n_tokens: usize,
    out: &mut [f32],
) {
    let n_sb = n / QK_K;
    let a_row = n_sb * Q8_K_BYTES;
    let mut accs = vec![Acc::new(); n_tokens];
    for (r, dst) in out.chunks_exact_mut(n_tokens).enumerate() {
        accs.fill(Acc::new());
        for i in 0..n_sb {
            let b = w.add((r * n_sb + i) * T::BYTES);
            let (dec, dw) = (parts::<T>(b), T::d(b));
            for (t, acc) in accs.iter_mut().enumerate() {
                let (ab, da) = q8k_block(a.add(t * a_row), i);
                acc.add::<T>(&dec, dw, ab, da);
            }
        }
        for (o, acc) in dst.iter_mut().zip(&accs) {
            *o = acc.result::<T>();
        }
    }
}

/// IQ4_NL × Q8_0 rows: block pairs into two 8-lane accumulators (even, odd), added and summed
/// by halving, an odd last block by the scalar tail.
#[inline(always)]
unsafe fn iq4_nl_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    for r in 0..R {
        let mut acc = [_mm256_setzero_ps(); 2];
        let w = w.add(r * stride);
        for ib in 0..n / QK / 2 * 2 {
            let xb = w.add(ib * IQ4_NL_BYTES);
            let q = iq4_values(xb.add(2));
            iq4_nl_add(&mut acc[ib % 2], xb, q, a.add(ib * Q8_0_BYTES));
        }
        *out.add(r) = iq4_nl_result(acc, n, w, a);
    }
}

/// Adds IQ4_NL block `xb` (values `q`) times the Q8_0 block `yb` to `acc`.
#[inline(always)]
unsafe fn iq4_nl_add(acc: &mut __m256, xb: *const u8, q: __m256i, yb: *const u8) {
    let d = f16_at(yb) * f16_at(xb);
    let y = _mm256_loadu_si256(yb.add(2).cast());
    let s = scaled(
        _mm256_abs_epi8(q),
        _mm256_sign_epi8(y, q),
        _mm256_set1_epi16(1),
    );
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s), *acc);
}

/// The IQ4_NL dot of row `w` with token `a` from the pair accumulators: their halving sum and
/// an odd last block.
#[inline(always)]
unsafe fn iq4_nl_result(acc: [__m256; 2], n: usize, w: *const u8, a: *const u8) -> f32 {
    let nb = n / QK;
    let sumf = hsum8(_mm256_add_ps(acc[0], acc[1]));
    if nb.is_multiple_of(2) {
        return sumf;
    }
    let o = nb - 1;
    let xb = core::slice::from_raw_parts(w.add(o * IQ4_NL_BYTES), IQ4_NL_BYTES);
    let yb = core::slice::from_raw_parts(a.add(o * Q8_0_BYTES), Q8_0_BYTES);
    iq4_nl_last_block(xb, yb, sumf)
}

/// [`super_tokens`] for IQ4_NL × Q8_0: the paired blocks in runs of [`IQ4_NL_RUN`], decoded
/// once, then each token's two accumulators kept in registers over the run.
#[inline(always)]
unsafe fn iq4_nl_tokens(n: usize, w: *const u8, a: *const u8, n_tokens: usize, out: &mut [f32]) {
    let nb = n / QK;
    let paired = nb / 2 * 2;
    let (w_row, a_row) = (nb * IQ4_NL_BYTES, nb * Q8_0_BYTES);
    let mut accs = vec![[_mm256_setzero_ps(); 2]; n_tokens];
    for (r, dst) in out.chunks_exact_mut(n_tokens).enumerate() {
        let w = w.add(r * w_row);
        accs.fill([_mm256_setzero_ps(); 2]);
        for b0 in (0..paired).step_by(IQ4_NL_RUN) {
            let run = IQ4_NL_RUN.min(paired - b0);
            let q: [__m256i; IQ4_NL_RUN] = core::array::from_fn(|j| {
                let ib = b0 + j.min(run - 1);
                iq4_values(w.add(ib * IQ4_NL_BYTES + 2))
            });
            for (t, acc) in accs.iter_mut().enumerate() {
                let mut regs = *acc;
                for (j, &q) in q.iter().enumerate().take(run) {
                    let ib = b0 + j;
                    let yb = a.add(t * a_row + ib * Q8_0_BYTES);
                    iq4_nl_add(&mut regs[ib % 2], w.add(ib * IQ4_NL_BYTES), q, yb);
                }
                *acc = regs;
            }
        }
        for (t, (o, acc)) in dst.iter_mut().zip(&accs).enumerate() {
            *o = iq4_nl_result(*acc, n, w, a.add(t * a_row));
        }
    }
}

/// IQ4_NL blocks decoded at a time in a batch (even, so a run starts on an even block).
const IQ4_NL_RUN: usize = 8;

/// The batched IQ products with AVX-512 VNNI.
pub(crate) mod tokens_vnni;

/// `super_rows` of one type as a plain generic function, for `entry_points!`.
macro_rules! super_kernel {
    ($name:ident, $ty:ty) => {
        #[inline(always)]
        unsafe fn $name<const R: usize>(
            n: usize,
            w: *const u8,
            stride: usize,
            a: *const u8,
            out: *mut f32,
        ) {
            super_rows::<$ty, R>(n, w, stride, a, out)
        }
    };
}

super_kernel!(iq1_s_rows, Iq1S);
super_kernel!(iq1_m_rows, Iq1M);
super_kernel!(iq2_xxs_rows, Iq2Xxs);
super_kernel!(iq2_xs_rows, Iq2Xs);
super_kernel!(iq2_s_rows, Iq2S);
super_kernel!(iq3_xxs_rows, Iq3Xxs);
super_kernel!(iq3_s_rows, Iq3S);
super_kernel!(iq4_xs_rows, Iq4Xs);

entry_points!("avx2,fma,f16c", dot_iq1_s, rows_iq1_s, iq1_s_rows, 1);
entry_points!("avx2,fma,f16c", dot_iq1_m, rows_iq1_m, iq1_m_rows, 1);
entry_points!("avx2,fma,f16c", dot_iq2_xxs, rows_iq2_xxs, iq2_xxs_rows, 1);
entry_points!("avx2,fma,f16c", dot_iq2_xs, rows_iq2_xs, iq2_xs_rows, 1);
entry_points!("avx2,fma,f16c", dot_iq2_s, rows_iq2_s, iq2_s_rows, 1);
entry_points!("avx2,fma,f16c", dot_iq3_xxs, rows_iq3_xxs, iq3_xxs_rows, 1);
entry_points!("avx2,fma,f16c", dot_iq3_s, rows_iq3_s, iq3_s_rows, 1);
entry_points!("avx2,fma,f16c", dot_iq4_nl, rows_iq4_nl, iq4_nl_rows, 1);
entry_points!("avx2,fma,f16c", dot_iq4_xs, rows_iq4_xs, iq4_xs_rows, 1);

/// [`crate::DotKernel::dot_tokens_rows`] for IQ weights: `out[r · n_tokens + t]` is row `r`
/// of `w` (rows of `n` elements back to back) times token `t` of `a` (activation rows back to
/// back), each weight block decoded once for all the tokens, with the bits of the single-token
/// kernels. `false` (nothing written) for a type that is not an IQ type.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `w` holds `out.len() / n_tokens` rows and `a` `n_tokens`
/// rows of `n` elements (a multiple of the block size).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tokens_rows(
    ty: GgmlType,
    n: usize,
    w: &[u8],
    a: &[u8],
    n_tokens: usize,
    out: &mut [f32],
) -> bool {
    let (w, a) = (w.as_ptr(), a.as_ptr());
    match ty {
        GgmlType::IQ1_S => super_tokens::<Iq1S>(n, w, a, n_tokens, out),
        GgmlType::IQ1_M => super_tokens::<Iq1M>(n, w, a, n_tokens, out),
        GgmlType::IQ2_XXS => super_tokens::<Iq2Xxs>(n, w, a, n_tokens, out),
        GgmlType::IQ2_XS => super_tokens::<Iq2Xs>(n, w, a, n_tokens, out),
        GgmlType::IQ2_S => super_tokens::<Iq2S>(n, w, a, n_tokens, out),
        GgmlType::IQ3_XXS => super_tokens::<Iq3Xxs>(n, w, a, n_tokens, out),
        GgmlType::IQ3_S => super_tokens::<Iq3S>(n, w, a, n_tokens, out),
        GgmlType::IQ4_NL => iq4_nl_tokens(n, w, a, n_tokens, out),
        GgmlType::IQ4_XS => super_tokens::<Iq4Xs>(n, w, a, n_tokens, out),
        _ => return false,
    }
    true
}

/// The AVX2 kernel of an IQ type (`None` for other types); AVX-512 machines use it too.
pub(crate) fn dot_fns(ty: GgmlType) -> Option<DotFns> {
    let (name, dot, rows): (_, crate::kernel_fns::DotFn, crate::kernel_fns::DotRowsFn) = match ty {
        GgmlType::IQ1_S => ("iq1_s*q8_k/avx2", dot_iq1_s, rows_iq1_s),
        GgmlType::IQ1_M => ("iq1_m*q8_k/avx2", dot_iq1_m, rows_iq1_m),
        GgmlType::IQ2_XXS => ("iq2_xxs*q8_k/avx2", dot_iq2_xxs, rows_iq2_xxs),
        GgmlType::IQ2_XS => ("iq2_xs*q8_k/avx2", dot_iq2_xs, rows_iq2_xs),
        GgmlType::IQ2_S => ("iq2_s*q8_k/avx2", dot_iq2_s, rows_iq2_s),
        GgmlType::IQ3_XXS => ("iq3_xxs*q8_k/avx2", dot_iq3_xxs, rows_iq3_xxs),
        GgmlType::IQ3_S => ("iq3_s*q8_k/avx2", dot_iq3_s, rows_iq3_s),
        GgmlType::IQ4_NL => ("iq4_nl*q8_0/avx2", dot_iq4_nl, rows_iq4_nl),
        GgmlType::IQ4_XS => ("iq4_xs*q8_k/avx2", dot_iq4_xs, rows_iq4_xs),
        _ => return None,
    };
    Some(DotFns { name, dot, rows })
}
