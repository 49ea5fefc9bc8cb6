//! The batched IQ products (`super::tokens_rows`) with AVX-512 BW and VNNI: a weight
//! super-block is decoded once (the AVX2 [`IqSuper::part`]s) and packed two 32-element blocks
//! to a zmm (magnitudes, a sign mask, the int16 scales), then for each token four steps of
//! `vpmaddubsw` (magnitude times the sign-applied activation byte) and `vpdpwssd` (pair sums
//! times the scale, added to the int32 lanes) give the super-block's integer lanes. The sign is
//! applied by a masked byte subtraction from zero, which wraps -128 to itself as
//! `_mm256_sign_epi8` does, and the two halves of the zmm hold the same elements' lanes as the
//! AVX2 kernel's two blocks, so folding them gives its exact integers; the float steps are
//! [`Acc::fold`]'s. Bit-identical to the AVX2 and scalar kernels.
//!
//! Safety: every `unsafe fn` here needs AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI, and pointers
//! valid for the whole blocks it reads.

use core::arch::x86_64::*;

use super::{
    parts, q8k_block, Acc, Delta, Iq1M, Iq1S, Iq2S, Iq2Xs, Iq2Xxs, Iq3S, Iq3Xxs, Iq4Xs, IqSuper,
    Part,
};
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

/// `y` with the bytes where `neg` is set negated (wrapping: -128 stays -128).
#[inline(always)]
unsafe fn signed(y: __m512i, neg: __mmask64) -> __m512i {
    _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y)
}

/// The sum of the two 8-lane halves of `v`.
#[inline(always)]
unsafe fn fold_halves(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// Adds the decoded super-block `w` (scale `dw`) times the Q8_K super-block at `ab` (scale
/// `da`) to `acc`: the integers of [`Acc::add`], then its float steps.
#[inline(always)]
unsafe fn add<T: IqSuper>(acc: &mut Acc, w: &Wide, dw: f32, ab: *const u8, da: f32) {
    let (mut s, mut s2) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    let mut sumi1 = 0i32;
    for j in 0..4 {
        let y = _mm512_loadu_si512(ab.add(Q8_K_QS + 64 * j).cast());
        let p = _mm512_maddubs_epi16(w.m[j], signed(y, w.neg[j]));
        s = _mm512_dpwssd_epi32(s, p, w.ls[j]);
        match T::DELTA {
            Delta::None => {}
            Delta::Lanes => {
                let p = _mm512_maddubs_epi16(_mm512_set1_epi8(1), signed(y, w.dneg[j]));
                s2 = _mm512_dpwssd_epi32(s2, p, w.ls[j]);
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
    acc.fold::<T>(dw * da, fold_halves(s), fold_halves(s2), sumi1);
}

/// [`super::super_tokens`] with the VNNI steps.
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
            let (dec, dw) = (widen(&parts::<T>(b)), T::d(b));
            for (t, acc) in accs.iter_mut().enumerate() {
                let (ab, da) = q8k_block(a.add(t * a_row), i);
                add::<T>(acc, &dec, dw, ab, da);
            }
        }
        for (o, acc) in dst.iter_mut().zip(&accs) {
            *o = acc.result::<T>();
        }
    }
}

/// [`super::tokens_rows`] with AVX-512 VNNI for the Q8_K types; `false` (nothing written) for
/// IQ4_NL and the types that are not IQ types.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; `w` holds `out.len() / n_tokens`
/// rows and `a` `n_tokens` rows of `n` elements (a multiple of the block size).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
        GgmlType::IQ4_XS => super_tokens::<Iq4Xs>(n, w, a, n_tokens, out),
        _ => return false,
    }
    true
}
