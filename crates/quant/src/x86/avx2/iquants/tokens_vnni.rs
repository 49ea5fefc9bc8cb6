//! The batched IQ products (`super::tokens_rows`) with AVX-512 BW and VNNI: a weight
//! super-block is decoded once (the AVX2 [`IqSuper::part`]s, or for IQ2_XXS with VBMI
//! [`iq2_xxs_wide`]) and packed two 32-element blocks to a zmm (magnitudes, a sign mask, the
//! int16 scales), then for each token four steps of `vpmaddubsw` (magnitude times the
//! sign-applied activation byte) and `vpdpwssd` (pair sums times the scale, added to the int32
//! lanes) give the super-block's integer lanes. The sign is applied by a masked byte
//! subtraction from zero, which wraps -128 to itself as `_mm256_sign_epi8` does, and the two
//! halves of the zmm hold the same elements' lanes as the AVX2 kernel's two blocks, so folding
//! them gives its exact integers. Where no activation byte is -128 (as Q8_K quantization makes
//! them) and the values allow it, the signs go onto the weights once per super-block instead,
//! and the activations, biased by 128, are `vpmaddubsw`'s unsigned operand ([`sums_biased`]).
//! Tokens go in pairs: the two tokens' folded lanes share one zmm for the float steps, which
//! are [`Acc::fold`]'s lane by lane. Bit-identical to the AVX2 and scalar kernels.
//!
//! The single-token rows of IQ2_XXS on VBMI CPUs ([`rows_fns`]) use the same decode and sums,
//! a token alone: [`iq2_xxs_wide`] replaces 32 scalar grid-row and 32 sign-row loads per
//! super-block, which is most of the AVX2 row kernel's time.
//!
//! Safety: every `unsafe fn` here needs AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI (and VBMI for
//! `VBMI = true`), and pointers valid for the whole blocks it reads.

use core::arch::x86_64::*;

use super::{
    parts, q8k_block, Acc, Delta, Iq1M, Iq1S, Iq2S, Iq2Xs, Iq2Xxs, Iq3S, Iq3Xxs, Iq4Xs, IqSuper,
    Part,
};
use crate::kernel_fns::DotFns;
use crate::scalar::iq_grids::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use crate::scalar::kquants::{Q8_K_BSUMS, Q8_K_BYTES, Q8_K_QS, QK_K};
use crate::GgmlType;

/// A decoded super-block as four 64-element halves: magnitudes, negative-sign masks, int16
/// scales, and IQ1_M's delta sign masks.
struct Wide {
    m: [__m512i; 4],
    neg: [__mmask64; 4],
    ls: [__m512i; 4],
    dneg: [__mmask64; 4],
    /// IQ1_S's `±ls` per 32-element block.
    ls_delta: [i32; 8],
}

/// Two ymm as one zmm (`lo` in the low half).
#[inline(always)]
unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The parts of a super-block packed in pairs.
#[inline(always)]
unsafe fn widen(p: &[Part; 8]) -> Wide {
    let z = _mm512_setzero_si512();
    let mut w = Wide {
        m: [z; 4],
        neg: [0; 4],
        ls: [z; 4],
        dneg: [0; 4],
        ls_delta: [0; 8],
    };
    for j in 0..4 {
        let (a, b) = (&p[2 * j], &p[2 * j + 1]);
        w.m[j] = join(a.m, b.m);
        w.neg[j] = _mm512_movepi8_mask(join(a.sgn, b.sgn));
        w.ls[j] = join(a.ls, b.ls);
        w.dneg[j] = _mm512_movepi8_mask(join(a.dsgn, b.dsgn));
        w.ls_delta[2 * j] = a.ls_delta;
        w.ls_delta[2 * j + 1] = b.ls_delta;
    }
    w
}

/// A super-block type's decoding into [`Wide`] form.
trait WideSuper: IqSuper + Sized {
    /// Whether [`sums_biased`] can take the type: signed weight pairs times activations up
    /// to 255 stay within int16 (grid values up to 62; not IQ4_XS's 127).
    const BIASED: bool = true;
    /// The super-block at `b` decoded; `VBMI`: the CPU has AVX-512 VBMI.
    #[inline(always)]
    unsafe fn wide<const VBMI: bool>(b: *const u8) -> Wide {
        widen(&parts::<Self>(b))
    }
}

impl WideSuper for Iq1S {}
impl WideSuper for Iq1M {}
impl WideSuper for Iq2Xs {}
impl WideSuper for Iq2S {}
impl WideSuper for Iq3Xxs {}
impl WideSuper for Iq3S {}
impl WideSuper for Iq4Xs {
    const BIASED: bool = false;
}

impl WideSuper for Iq2Xxs {
    #[inline(always)]
    unsafe fn wide<const VBMI: bool>(b: *const u8) -> Wide {
        if VBMI {
            iq2_xxs_wide(b)
        } else {
            widen(&parts::<Self>(b))
        }
    }
}

// ----------------------------------------------------------------------------------------------
// IQ2_XXS with VBMI: the whole super-block with byte permutes, no scalar table loads.

/// The IQ2_XXS grid's byte values, at index `c & 3` for the 2-bit code `c` (`vpermb` reads six
/// index bits, so the table repeats).
static IQ2XXS_VALUES: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = [0x08, 0x19, 0x2b, 0][i & 3];
        i += 1;
    }
    t
};

/// The IQ2_XXS grid rows as 2-bit codes (bits `2k..2k+2` of row `i`'s code: which of
/// [`IQ2XXS_VALUES`] byte `k` of the row is), low bytes (elements 0..4) then high bytes
/// (elements 4..8), 256 of each.
static IQ2XXS_CODES: [u8; 512] = {
    let mut t = [0u8; 512];
    let mut i = 0;
    while i < 256 {
        let row = IQ2XXS_GRID[i];
        let mut code = 0u16;
        let mut k = 0;
        while k < 8 {
            let c = match (row >> (8 * k)) as u8 {
                0x08 => 0,
                0x19 => 1,
                0x2b => 2,
                _ => panic!("IQ2_XXS grid value outside 8, 25, 43"),
            };
            code |= c << (2 * k);
            k += 1;
        }
        t[i] = code as u8;
        t[256 + i] = (code >> 8) as u8;
        i += 1;
    }
    t
};

/// The byte permutes of [`iq2_xxs_wide`], 64 bytes each: the grid indices of the super-block
/// (index `p = 4·block + group` at bytes `p` and `32 + p`); for each half `j`, grid row `8j + q`'s
/// code bytes to bytes 0 and 1 of qword `q`; for each half, block `2j` (`2j + 1`)'s scale byte
/// to the even bytes of the low (high) 256 bits; and the bit offsets of `vpmultishiftqb`:
/// the four 7-bit sign codes of a block's `aux` word, and the eight 2-bit element codes.
struct Iq2XxsCtrl {
    idx: [u8; 64],
    codes: [[u8; 64]; 4],
    scales: [[u8; 64]; 4],
    sign_shifts: [u8; 64],
    code_shifts: [u8; 64],
}

static IQ2XXS_CTRL: Iq2XxsCtrl = {
    let mut c = Iq2XxsCtrl {
        idx: [0; 64],
        codes: [[0; 64]; 4],
        scales: [[0; 64]; 4],
        sign_shifts: [0; 64],
        code_shifts: [0; 64],
    };
    let mut i = 0;
    while i < 64 {
        let p = i % 32;
        c.idx[i] = (8 * (p / 4) + p % 4) as u8;
        let (q, k) = (i / 8, i % 8);
        c.sign_shifts[i] = if k < 4 { 32 + 7 * k as u8 } else { 0 };
        c.code_shifts[i] = 2 * k as u8;
        let mut j = 0;
        while j < 4 {
            let row = (8 * j + q) as u8;
            c.codes[j][i] = if k == 1 { 32 + row } else { row };
            c.scales[j][i] = (8 * (2 * j + i / 32) + 7) as u8;
            j += 1;
        }
        i += 1;
    }
    c
};

/// 64 bytes at `p` as a vector.
#[inline(always)]
unsafe fn load64(p: &[u8]) -> __m512i {
    debug_assert!(p.len() >= 64);
    _mm512_loadu_si512(p.as_ptr().cast())
}

/// An IQ2_XXS super-block decoded with VBMI byte permutes into what [`widen`] makes of its
/// [`IqSuper::part`]s. The 32 grid indices look up their rows' 2-bit codes in four 128-byte
/// tables (`vpermi2b`, bit 7 choosing the table), `vpmultishiftqb` spreads each row's 16 code
/// bits over its 8 bytes and `vpermb` maps codes to values; the sign codes' bytes come from
/// `vpmultishiftqb` and one 128-byte `KSIGNS_IQ2XS` lookup; the scales `2·(aux >> 28) + 1`
/// from the top nibble of each `aux` word.
#[inline(always)]
unsafe fn iq2_xxs_wide(b: *const u8) -> Wide {
    let c = &IQ2XXS_CTRL;
    let qs = _mm512_loadu_si512(b.add(2).cast());
    let idx = _mm512_permutexvar_epi8(load64(&c.idx), qs);
    let high = _mm512_movepi8_mask(idx);
    let lookup = |o: usize| {
        let t = &IQ2XXS_CODES[o..];
        _mm512_permutex2var_epi8(load64(t), idx, load64(&t[64..]))
    };
    const LOW: __mmask64 = 0x0000_0000_ffff_ffff;
    let mut codes = lookup(0);
    codes = _mm512_mask_mov_epi8(codes, high & LOW, lookup(128));
    codes = _mm512_mask_mov_epi8(codes, !high & !LOW, lookup(256));
    codes = _mm512_mask_mov_epi8(codes, high & !LOW, lookup(384));
    let values = load64(&IQ2XXS_VALUES);
    let code_shifts = load64(&c.code_shifts);
    let m = core::array::from_fn(|j| {
        let row_codes = _mm512_permutexvar_epi8(load64(&c.codes[j]), codes);
        _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(code_shifts, row_codes), values)
    });
    // Sign codes: bytes 0..4 of qword `ib` are block `ib`'s four 7-bit codes.
    let sign_codes = _mm512_and_si512(
        _mm512_multishift_epi64_epi8(load64(&c.sign_shifts), qs),
        _mm512_set1_epi8(0x7f),
    );
    let signs = _mm512_permutex2var_epi8(
        load64(&KSIGNS_IQ2XS),
        sign_codes,
        load64(&KSIGNS_IQ2XS[64..]),
    );
    let packed = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0),
        signs,
    );
    let mut neg = [0u64; 8];
    _mm512_storeu_si512(neg.as_mut_ptr().cast(), packed);
    // `(aux >> 28) · 2 + 1` in the top byte of each `aux`: the byte shifted right by 3, bits
    // 1..5 kept, bit 0 set.
    let scale_bytes = _mm512_ternarylogic_epi32::<0xea>(
        _mm512_srli_epi16::<3>(qs),
        _mm512_set1_epi8(0x1e),
        _mm512_set1_epi8(1),
    );
    let ls = core::array::from_fn(|j| {
        _mm512_maskz_permutexvar_epi8(0x5555_5555_5555_5555, load64(&c.scales[j]), scale_bytes)
    });
    Wide {
        m,
        neg: [neg[0], neg[1], neg[2], neg[3]],
        ls,
        dneg: [0; 4],
        ls_delta: [0; 8],
    }
}

// ----------------------------------------------------------------------------------------------
// The products.

/// `y` with the bytes where `neg` is set negated (wrapping: -128 stays -128).
#[inline(always)]
unsafe fn signed(y: __m512i, neg: __mmask64) -> __m512i {
    _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y)
}

/// `acc + Σ a·b` over each int32 lane's two int16 pairs: `vpdpwssd`, written out because
/// LLVM splits the intrinsic into `vpmaddwd` + `vpaddd` for CPUs it does not tune for VNNI,
/// one more instruction on the busiest ports.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut r = acc;
    // SAFETY: the callers run with AVX-512 VNNI (this module's contract); registers only.
    core::arch::asm!(
        "vpdpwssd {r}, {a}, {b}",
        r = inout(zmm_reg) r,
        a = in(zmm_reg) a,
        b = in(zmm_reg) b,
        options(pure, nomem, nostack, preserves_flags),
    );
    r
}

/// One token's integer sums of a super-block: the main lanes and IQ1_M's delta lanes (both
/// with the two 8-lane halves not yet folded), IQ1_S's delta sum.
struct Sums {
    s: __m512i,
    s2: __m512i,
    sumi1: i32,
}

/// The decoded super-block `w` times the Q8_K super-block at `ab`: the integers of
/// [`Acc::add`] (its lanes in both halves of `s`, `s2`).
#[inline(always)]
unsafe fn sums<T: IqSuper>(w: &Wide, ab: *const u8) -> Sums {
    let (mut s, mut s2) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    let mut sumi1 = 0i32;
    for j in 0..4 {
        let y = _mm512_loadu_si512(ab.add(Q8_K_QS + 64 * j).cast());
        let p = _mm512_maddubs_epi16(w.m[j], signed(y, w.neg[j]));
        s = dpwssd(s, p, w.ls[j]);
        match T::DELTA {
            Delta::None => {}
            Delta::Lanes => {
                let p = _mm512_maddubs_epi16(_mm512_set1_epi8(1), signed(y, w.dneg[j]));
                s2 = dpwssd(s2, p, w.ls[j]);
            }
            Delta::BlockSums => {
                for ib in [2 * j, 2 * j + 1] {
                    let bsum = |k: usize| ab.add(Q8_K_BSUMS + 2 * k).cast::<i16>().read_unaligned();
                    let bs = bsum(2 * ib) as i32 + bsum(2 * ib + 1) as i32;
                    sumi1 += bs * w.ls_delta[ib];
                }
            }
        }
    }
    Sums { s, s2, sumi1 }
}

/// The folded halves of two tokens' lanes: lanes 0..8 are `a`'s (its low half plus its high
/// half, the AVX2 kernel's integers), lanes 8..16 `b`'s.
#[inline(always)]
unsafe fn fold_pair(a: __m512i, b: __m512i) -> __m512i {
    let lo = _mm512_shuffle_i64x2::<0b01_00_01_00>(a, b);
    let hi = _mm512_shuffle_i64x2::<0b11_10_11_10>(a, b);
    _mm512_add_epi32(lo, hi)
}

/// Two tokens' accumulators: [`Acc`]'s `acc` and `acc2` of the first token in lanes 0..8, of
/// the second in lanes 8..16, and their `acc1`.
#[derive(Clone, Copy)]
struct PairAcc {
    acc: __m512,
    acc2: __m512,
    acc1: [f32; 2],
}

impl PairAcc {
    #[inline(always)]
    unsafe fn new() -> PairAcc {
        PairAcc {
            acc: _mm512_setzero_ps(),
            acc2: _mm512_setzero_ps(),
            acc1: [0.0; 2],
        }
    }

    /// Adds the two tokens' super-block sums with scales `dv` (`dw·da` of the first token in
    /// lanes 0..8, of the second in lanes 8..16; `d()` the two as scalars): per token and
    /// lane the operations of [`Acc::fold`].
    #[inline(always)]
    unsafe fn fold<T: IqSuper>(
        &mut self,
        dv: __m512,
        d: impl Fn() -> [f32; 2],
        x: &Sums,
        y: &Sums,
    ) {
        let s = fold_pair(x.s, y.s);
        self.acc = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(s), self.acc);
        match T::DELTA {
            Delta::None => {}
            Delta::Lanes => {
                let s2 = fold_pair(x.s2, y.s2);
                self.acc2 = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(s2), self.acc2);
            }
            Delta::BlockSums => {
                let d = d();
                self.acc1[0] = d[0].mul_add(x.sumi1 as f32, self.acc1[0]);
                self.acc1[1] = d[1].mul_add(y.sumi1 as f32, self.acc1[1]);
            }
        }
    }

    /// Token `k`'s (0 or 1) accumulators.
    #[inline(always)]
    unsafe fn token(&self, k: usize) -> Acc {
        let half = |v: __m512| {
            if k == 0 {
                _mm512_castps512_ps256(v)
            } else {
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
            }
        };
        Acc {
            acc: half(self.acc),
            acc2: half(self.acc2),
            acc1: self.acc1[k],
        }
    }
}

/// A decoded super-block for activations biased by 128 ([`sums_biased`]): the weights with
/// their signs (IQ1_M: also the deltas' ±1), and the lanes' corrections `-128·Σ ls·w`.
struct SignedWide {
    w: [__m512i; 4],
    dw: [__m512i; 4],
    corr: __m512i,
    corr2: __m512i,
}

/// `w`'s signed weights and corrections for [`sums_biased`].
#[inline(always)]
unsafe fn signed_wide<T: IqSuper>(w: &Wide) -> SignedWide {
    let z = _mm512_setzero_si512();
    let (bias, one) = (_mm512_set1_epi8(i8::MIN), _mm512_set1_epi8(1));
    let mut sw = SignedWide {
        w: [z; 4],
        dw: [z; 4],
        corr: z,
        corr2: z,
    };
    let (mut c, mut c2) = (z, z);
    for j in 0..4 {
        sw.w[j] = _mm512_mask_sub_epi8(w.m[j], w.neg[j], z, w.m[j]);
        c = dpwssd(c, _mm512_maddubs_epi16(bias, sw.w[j]), w.ls[j]);
        if T::DELTA == Delta::Lanes {
            sw.dw[j] = _mm512_mask_sub_epi8(one, w.dneg[j], z, one);
            c2 = dpwssd(c2, _mm512_maddubs_epi16(bias, sw.dw[j]), w.ls[j]);
        }
    }
    sw.corr = _mm512_sub_epi32(z, c);
    sw.corr2 = _mm512_sub_epi32(z, c2);
    sw
}

/// [`sums`] for activations `yb` biased by 128 (unsigned, the four 64-byte quarters of the
/// super-block; `ab` the Q8_K block, for IQ1_S's block sums): `Σ (y + 128)·w − 128·Σ w`
/// per lane, the same integers where no activation byte is -128 (which the sign trick
/// leaves negative, [`biased_acts`] checks), with no sign step per token.
#[inline(always)]
unsafe fn sums_biased<T: IqSuper>(
    w: &Wide,
    sw: &SignedWide,
    yb: *const __m512i,
    ab: *const u8,
) -> Sums {
    let (mut s, mut s2) = (sw.corr, sw.corr2);
    let mut sumi1 = 0i32;
    for j in 0..4 {
        let y = *yb.add(j);
        s = dpwssd(s, _mm512_maddubs_epi16(y, sw.w[j]), w.ls[j]);
        match T::DELTA {
            Delta::None => {}
            Delta::Lanes => s2 = dpwssd(s2, _mm512_maddubs_epi16(y, sw.dw[j]), w.ls[j]),
            Delta::BlockSums => {
                for ib in [2 * j, 2 * j + 1] {
                    let bsum = |k: usize| ab.add(Q8_K_BSUMS + 2 * k).cast::<i16>().read_unaligned();
                    let bs = bsum(2 * ib) as i32 + bsum(2 * ib + 1) as i32;
                    sumi1 += bs * w.ls_delta[ib];
                }
            }
        }
    }
    Sums { s, s2, sumi1 }
}

/// The activation bytes of `n_tokens` Q8_K rows (`n_sb` super-blocks each) plus 128,
/// `[token][super-block][quarter]`; `None` where one is -128 (Q8_K quantization never makes
/// it: its scale maps the largest magnitude to ±127).
#[inline(always)]
unsafe fn biased_acts(a: *const u8, n_tokens: usize, n_sb: usize) -> Option<Vec<__m512i>> {
    let bias = _mm512_set1_epi8(i8::MIN);
    let mut v = Vec::with_capacity(n_tokens * n_sb * 4);
    let mut bad = 0u64;
    for k in 0..n_tokens * n_sb {
        let ab = a.add(k * Q8_K_BYTES);
        for j in 0..4 {
            let y = _mm512_loadu_si512(ab.add(Q8_K_QS + 64 * j).cast());
            bad |= _mm512_cmpeq_epi8_mask(y, bias);
            v.push(_mm512_xor_si512(y, bias));
        }
    }
    (bad == 0).then_some(v)
}

/// [`super::super_tokens`] with the VNNI steps, tokens in pairs (an odd last token paired with
/// itself, its copy dropped).
#[inline(always)]
unsafe fn super_tokens<T: WideSuper, const VBMI: bool>(
    n: usize,
    w: *const u8,
    a: *const u8,
    n_tokens: usize,
    out: &mut [f32],
) {
    let n_sb = n / QK_K;
    let a_row = n_sb * Q8_K_BYTES;
    let n_pairs = n_tokens.div_ceil(2);
    let pair = |p: usize| (2 * p, (2 * p + 1).min(n_tokens - 1));
    // The pairs' activation scales per super-block, `das[p · n_sb + i]`, as `dv` wants them.
    let das: Vec<__m512> = (0..n_pairs * n_sb)
        .map(|k| {
            let ((t0, t1), i) = (pair(k / n_sb), k % n_sb);
            let da = |t: usize| q8k_block(a.add(t * a_row), i).1;
            _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(da(t0)), _mm512_set1_ps(da(t1)))
        })
        .collect();
    // Activations biased by 128 where the type and the bytes allow it.
    let yb = if T::BIASED {
        biased_acts(a, n_tokens, n_sb)
    } else {
        None
    };
    let mut accs = vec![PairAcc::new(); n_pairs];
    for (r, dst) in out.chunks_exact_mut(n_tokens).enumerate() {
        accs.fill(PairAcc::new());
        for i in 0..n_sb {
            let b = w.add((r * n_sb + i) * T::BYTES);
            // The next row's super-block, from memory while this one computes (a hint only:
            // past the last row it reads nothing).
            let next = b.wrapping_add(n_sb * T::BYTES);
            _mm_prefetch::<_MM_HINT_T0>(next.cast());
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64).cast());
            let (dec, dw) = (T::wide::<VBMI>(b), T::d(b));
            let sw = yb.as_ref().map(|_| signed_wide::<T>(&dec));
            let dwv = _mm512_set1_ps(dw);
            for (p, acc) in accs.iter_mut().enumerate() {
                let (t0, t1) = pair(p);
                let (ab0, da0) = q8k_block(a.add(t0 * a_row), i);
                let (ab1, da1) = q8k_block(a.add(t1 * a_row), i);
                let (x, y) = match (&yb, &sw) {
                    (Some(yb), Some(sw)) => {
                        let at = |t: usize| yb.as_ptr().add((t * n_sb + i) * 4);
                        (
                            sums_biased::<T>(&dec, sw, at(t0), ab0),
                            sums_biased::<T>(&dec, sw, at(t1), ab1),
                        )
                    }
                    _ => (sums::<T>(&dec, ab0), sums::<T>(&dec, ab1)),
                };
                // `dw·da` per lane, the scalar products' bits.
                let dv = _mm512_mul_ps(dwv, das[p * n_sb + i]);
                acc.fold::<T>(dv, || [dw * da0, dw * da1], &x, &y);
            }
        }
        for (t, o) in dst.iter_mut().enumerate() {
            *o = accs[t / 2].token(t % 2).result::<T>();
        }
    }
}

/// The types' [`super_tokens`] in one function of the caller's target features.
#[inline(always)]
unsafe fn by_type<const VBMI: bool>(
    ty: GgmlType,
    n: usize,
    w: *const u8,
    a: *const u8,
    n_tokens: usize,
    out: &mut [f32],
) -> bool {
    match ty {
        GgmlType::IQ1_S => super_tokens::<Iq1S, VBMI>(n, w, a, n_tokens, out),
        GgmlType::IQ1_M => super_tokens::<Iq1M, VBMI>(n, w, a, n_tokens, out),
        GgmlType::IQ2_XXS => super_tokens::<Iq2Xxs, VBMI>(n, w, a, n_tokens, out),
        GgmlType::IQ2_XS => super_tokens::<Iq2Xs, VBMI>(n, w, a, n_tokens, out),
        GgmlType::IQ2_S => super_tokens::<Iq2S, VBMI>(n, w, a, n_tokens, out),
        GgmlType::IQ3_XXS => super_tokens::<Iq3Xxs, VBMI>(n, w, a, n_tokens, out),
        GgmlType::IQ3_S => super_tokens::<Iq3S, VBMI>(n, w, a, n_tokens, out),
        GgmlType::IQ4_XS => super_tokens::<Iq4Xs, VBMI>(n, w, a, n_tokens, out),
        _ => return false,
    }
    true
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tokens_rows_vnni(
    ty: GgmlType,
    n: usize,
    w: *const u8,
    a: *const u8,
    n_tokens: usize,
    out: &mut [f32],
) -> bool {
    by_type::<false>(ty, n, w, a, n_tokens, out)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn tokens_rows_vbmi(
    ty: GgmlType,
    n: usize,
    w: *const u8,
    a: *const u8,
    n_tokens: usize,
    out: &mut [f32],
) -> bool {
    by_type::<true>(ty, n, w, a, n_tokens, out)
}

/// [`super::tokens_rows`] with AVX-512 VNNI for the Q8_K types (IQ2_XXS decoded with VBMI
/// when `vbmi`); `false` (nothing written) for IQ4_NL and the types that are not IQ types.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI, and VBMI if `vbmi`; `w` holds
/// `out.len() / n_tokens` rows and `a` `n_tokens` rows of `n` elements (a multiple of the
/// block size).
pub(crate) unsafe fn tokens_rows(
    ty: GgmlType,
    n: usize,
    w: &[u8],
    a: &[u8],
    n_tokens: usize,
    out: &mut [f32],
    vbmi: bool,
) -> bool {
    let (w, a) = (w.as_ptr(), a.as_ptr());
    if vbmi {
        tokens_rows_vbmi(ty, n, w, a, n_tokens, out)
    } else {
        tokens_rows_vnni(ty, n, w, a, n_tokens, out)
    }
}

/// `R` rows of type `T` (`stride` bytes apart) times the one Q8_K row `a`: each super-block
/// decoded as for a batch ([`WideSuper::wide`]) and multiplied by [`sums`], the halves folded
/// into the AVX2 kernel's eight lanes, then its float steps ([`Acc::fold`]).
#[inline(always)]
unsafe fn wide_rows<T: WideSuper, const VBMI: bool, const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let half_sum =
        |v: __m512i| _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
    for r in 0..R {
        let w = w.add(r * stride);
        let mut acc = Acc::new();
        for i in 0..n / QK_K {
            let b = w.add(i * T::BYTES);
            let (ab, da) = q8k_block(a, i);
            let x = sums::<T>(&T::wide::<VBMI>(b), ab);
            acc.fold::<T>(T::d(b) * da, half_sum(x.s), half_sum(x.s2), x.sumi1);
        }
        *out.add(r) = acc.result::<T>();
    }
}

/// [`wide_rows`] of IQ2_XXS with the VBMI decode, for `entry_points!`.
#[inline(always)]
unsafe fn iq2_xxs_vbmi_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    wide_rows::<Iq2Xxs, true, R>(n, w, stride, a, out)
}

entry_points!(
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi",
    dot_iq2_xxs_vbmi,
    rows_iq2_xxs_vbmi,
    iq2_xxs_vbmi_rows,
    1
);

/// The single-token kernels here for `ty` on a CPU with AVX-512 VNNI and VBMI (the caller
/// checked): IQ2_XXS; `None` for the other types, whose AVX2 rows decode as fast.
pub(crate) fn rows_fns(ty: GgmlType) -> Option<DotFns> {
    (ty == GgmlType::IQ2_XXS).then_some(DotFns {
        name: "iq2_xxs*q8_k/avx512vbmi",
        dot: dot_iq2_xxs_vbmi,
        rows: rows_iq2_xxs_vbmi,
    })
}
