//! AVX-512 F/BW/VL dot products for Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants, bit-identical to
//! the scalar references (and so to ggml's AVX2 kernels).
//!
//! * Q4_0/Q4_1/Q5_0/Q5_1: two blocks per zmm (lanes 0..8 the first block, 8..16 the second),
//!   VNNI `vpdpbusd` when present; the two halves are fused-multiply-added into the 8-lane
//!   accumulator one after the other, keeping ggml's block order. An odd last block uses AVX2.
//! * K-quants: two 32-byte runs per zmm for the integer products (`vpmaddubsw` + `vpmaddwd`
//!   with per-run scales picked by `vpermw`); the int32 halves are added into ggml's 8 lanes,
//!   which is exact, then the float steps are those of the AVX2 kernels. VNNI would need an
//!   extra multiply per run for the scales, so these kernels do not use it.
//!
//! Safety: every `unsafe fn` here needs AVX-512 F/BW/VL plus AVX2, FMA and F16C (and VNNI for
//! the `VNNI = true` kernels), and pointers valid for the whole blocks it reads.

use core::arch::x86_64::*;

use crate::kernels::{DotFn, DotFns, DotRowsFn};
use crate::kquants::{
    Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BSUMS, Q8_K_BYTES, Q8_K_QS,
    QK_K,
};
use crate::legacy::{Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q8_1_BYTES};
use crate::scalar::{Q8_0_BYTES, QK};
use crate::x86_avx2::{f16_at, hsum8, q8_q8_lanes};
use crate::x86_avx2_lowbit::{
    bits32, hsum_i32_4, k4_min_prod, k4_scales_mins, nibbles32, q6_k_offset, u8i8_lanes,
};
use crate::x86_avx512::{dot_u8i8, hi256, lo256, load_2x256, neg_where};
use crate::GgmlType;

/// The nibbles of two 16-byte runs as 64 bytes: [low of `p0`, high of `p0`, low of `p1`, high
/// of `p1`], i.e. the element order of two consecutive blocks.
#[inline(always)]
unsafe fn nibbles_2x32(p0: *const u8, p1: *const u8) -> __m512i {
    let q = _mm512_mask_blend_epi64(
        0xf0,
        _mm512_broadcast_i32x4(_mm_loadu_si128(p0.cast())),
        _mm512_broadcast_i32x4(_mm_loadu_si128(p1.cast())),
    );
    let shifts = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
    _mm512_and_si512(_mm512_srlv_epi32(q, shifts), _mm512_set1_epi8(0x0f))
}

/// The fifth bits of two blocks (little-endian u32s at `p0`, `p1`) as a byte mask.
#[inline(always)]
unsafe fn bits_2x32(p0: *const u8, p1: *const u8) -> __mmask64 {
    let lo = p0.cast::<u32>().read_unaligned() as u64;
    let hi = p1.cast::<u32>().read_unaligned() as u64;
    lo | (hi << 32)
}

/// Q4_0 / Q5_0 × Q8_0: per row one 8-lane FMA chain over the blocks in order.
#[inline(always)]
unsafe fn signed_rows<const R: usize, const VNNI: bool, const Q5: bool>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let (bytes, qs) = if Q5 { (Q5_0_BYTES, 6) } else { (Q4_0_BYTES, 2) };
    let nb = n / QK;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut ib = 0;
    while ib + 1 < nb {
        let a0 = a.add(ib * Q8_0_BYTES);
        let a1 = a0.add(Q8_0_BYTES);
        let y = load_2x256(a0.add(2), a1.add(2));
        let (da0, da1) = (f16_at(a0), f16_at(a1));
        for (r, acc) in acc.iter_mut().enumerate() {
            let w0 = w.add(r * stride + ib * bytes);
            let w1 = w0.add(bytes);
            let nib = nibbles_2x32(w0.add(qs), w1.add(qs));
            let x = if Q5 {
                // Byte | 0xf0 (= q - 16 as int8) where the fifth bit is clear.
                let clear = !bits_2x32(w0.add(2), w1.add(2));
                _mm512_or_si512(nib, _mm512_maskz_mov_epi8(clear, _mm512_set1_epi8(-16)))
            } else {
                _mm512_sub_epi8(nib, _mm512_set1_epi8(8))
            };
            // |x| and sign(y, x), ggml's sign trick (where x == 0 the product is 0 anyway).
            let sy = neg_where(y, _mm512_movepi8_mask(x));
            let q = _mm512_cvtepi32_ps(dot_u8i8::<VNNI>(_mm512_abs_epi8(x), sy));
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(w0) * da0), lo256(q), *acc);
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(w1) * da1), hi256(q), *acc);
        }
        ib += 2;
    }
    if ib < nb {
        let ab = a.add(ib * Q8_0_BYTES);
        let y = _mm256_loadu_si256(ab.add(2).cast());
        let da = f16_at(ab);
        for (r, acc) in acc.iter_mut().enumerate() {
            let wb = w.add(r * stride + ib * bytes);
            let x = if Q5 {
                let hi = _mm256_andnot_si256(bits32(wb.add(2)), _mm256_set1_epi8(-16));
                _mm256_or_si256(nibbles32(wb.add(qs)), hi)
            } else {
                _mm256_sub_epi8(nibbles32(wb.add(qs)), _mm256_set1_epi8(8))
            };
            let q = q8_q8_lanes(x, y);
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(wb) * da), q, *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// Q4_1 / Q5_1 × Q8_1: the 8-lane chain of `d_w·d_a·lanes` and the scalar chain of `m·s`, both
/// in block order.
#[inline(always)]
unsafe fn min_rows<const R: usize, const VNNI: bool, const Q5: bool>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let (bytes, qs) = if Q5 { (Q5_1_BYTES, 8) } else { (Q4_1_BYTES, 4) };
    let nb = n / QK;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [0.0f32; R];
    let mut ib = 0;
    while ib + 1 < nb {
        let a0 = a.add(ib * Q8_1_BYTES);
        let a1 = a0.add(Q8_1_BYTES);
        let y = load_2x256(a0.add(4), a1.add(4));
        let (da0, da1) = (f16_at(a0), f16_at(a1));
        let (sa0, sa1) = (f16_at(a0.add(2)), f16_at(a1.add(2)));
        for r in 0..R {
            let w0 = w.add(r * stride + ib * bytes);
            let w1 = w0.add(bytes);
            summs[r] = f16_at(w0.add(2)).mul_add(sa0, summs[r]);
            summs[r] = f16_at(w1.add(2)).mul_add(sa1, summs[r]);
            let mut x = nibbles_2x32(w0.add(qs), w1.add(qs));
            if Q5 {
                let set = bits_2x32(w0.add(4), w1.add(4));
                x = _mm512_or_si512(x, _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10)));
            }
            let q = _mm512_cvtepi32_ps(dot_u8i8::<VNNI>(x, y));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(w0) * da0), lo256(q), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(w1) * da1), hi256(q), acc[r]);
        }
        ib += 2;
    }
    if ib < nb {
        let ab = a.add(ib * Q8_1_BYTES);
        let y = _mm256_loadu_si256(ab.add(4).cast());
        let (da, sa) = (f16_at(ab), f16_at(ab.add(2)));
        for r in 0..R {
            let wb = w.add(r * stride + ib * bytes);
            summs[r] = f16_at(wb.add(2)).mul_add(sa, summs[r]);
            let mut x = nibbles32(wb.add(qs));
            if Q5 {
                let hi = _mm256_and_si256(bits32(wb.add(4)), _mm256_set1_epi8(0x10));
                x = _mm256_or_si256(x, hi);
            }
            let q = u8i8_lanes(x, y);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(wb) * da), q, acc[r]);
        }
    }
    for r in 0..R {
        *out.add(r) = hsum8(acc[r]) + summs[r];
    }
}

// ----------------------------------------------------------------------------------------------
// K-quants

/// `vpermw` indices for scales per 16 elements: int16 lane `i` of a zmm holding 32-byte runs
/// `2g`, `2g+1` of 128-element half `h` takes scale `8h + 4g + i/8`; `[h][g]`.
#[inline(always)]
unsafe fn sixteen_scale_idx() -> [[__m512i; 2]; 2] {
    let mut idx = [[_mm512_setzero_si512(); 2]; 2];
    for (h, idx) in idx.iter_mut().enumerate() {
        for (g, idx) in idx.iter_mut().enumerate() {
            let base = (8 * h + 4 * g) as i16;
            let mut lanes = [0i16; 32];
            for (i, l) in lanes.iter_mut().enumerate() {
                *l = base + (i / 8) as i16;
            }
            *idx = _mm512_loadu_si512(lanes.as_ptr().cast());
        }
    }
    idx
}

/// Sixteen int16 scales in the low 256 bits of a zmm (for `vpermw`).
#[inline(always)]
unsafe fn widen16(v: __m128i) -> __m512i {
    _mm512_castsi256_si512(_mm256_cvtepi8_epi16(v))
}

/// 32 bytes at `p` in both halves of a zmm.
#[inline(always)]
unsafe fn broadcast256(p: *const u8) -> __m512i {
    _mm512_broadcast_i64x4(_mm256_loadu_si256(p.cast()))
}

/// Per-half 16-bit shift counts: `lo` for bytes 0..32, `hi` for bytes 32..64.
#[inline(always)]
unsafe fn shifts(lo: i16, hi: i16) -> __m512i {
    _mm512_mask_blend_epi16(0xffff_0000, _mm512_set1_epi16(lo), _mm512_set1_epi16(hi))
}

/// Adds the two int32 halves of `v` into ggml's 8 lanes.
#[inline(always)]
unsafe fn fold(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// The Q8_K quants of 32-byte runs `2p`, `2p+1` of a super-block.
#[inline(always)]
unsafe fn q8k_pair(ab: *const u8, p: usize) -> __m512i {
    _mm512_loadu_si512(ab.add(Q8_K_QS + 64 * p).cast())
}

#[inline(always)]
unsafe fn q2_k_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let idx = sixteen_scale_idx();
    let (sh01, sh23) = (shifts(0, 2), shifts(4, 6));
    let m3 = _mm512_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..n / QK_K {
        let ab = a.add(i * Q8_K_BYTES);
        let bsums = _mm256_loadu_si256(ab.add(Q8_K_BSUMS).cast());
        for (r, acc) in acc.iter_mut().enumerate() {
            let wb = w.add(r * stride + i * Q2_K_BYTES);
            let yd = ab.cast::<f32>().read_unaligned();
            let (d, dmin) = (yd * f16_at(wb.add(80)), -yd * f16_at(wb.add(82)));
            let packed = _mm_loadu_si128(wb.cast());
            let mins = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), m4));
            let prod = _mm256_madd_epi16(mins, bsums);
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), *acc);
            let scales = widen16(_mm_and_si128(packed, m4));
            let mut sumi = _mm512_setzero_si512();
            for (h, idx) in idx.iter().enumerate() {
                let q2 = broadcast256(wb.add(16 + 32 * h));
                for (g, sh) in [sh01, sh23].into_iter().enumerate() {
                    let x = _mm512_and_si512(_mm512_srlv_epi16(q2, sh), m3);
                    let p = _mm512_maddubs_epi16(x, q8k_pair(ab, 2 * h + g));
                    let sc = _mm512_permutexvar_epi16(idx[g], scales);
                    sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(sc, p));
                }
            }
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(fold(sumi)), *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// The 16 Q3_K scales minus 32 (the bytewise form of ggml's 32-bit unpacking).
#[inline(always)]
unsafe fn q3_k_scales(wb: *const u8) -> __m128i {
    let p = wb.add(96).cast::<u32>();
    let (a0, a1, a2) = (
        p.read_unaligned(),
        p.add(1).read_unaligned(),
        p.add(2).read_unaligned(),
    );
    let (m2, m4) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let v = _mm_setr_epi32(
        ((a0 & m4) | ((a2 & m2) << 4)) as i32,
        ((a1 & m4) | (((a2 >> 2) & m2) << 4)) as i32,
        (((a0 >> 4) & m4) | (((a2 >> 4) & m2) << 4)) as i32,
        (((a1 >> 4) & m4) | (((a2 >> 6) & m2) << 4)) as i32,
    );
    _mm_sub_epi8(v, _mm_set1_epi8(32))
}

#[inline(always)]
unsafe fn q3_k_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let idx = sixteen_scale_idx();
    let (sh01, sh23) = (shifts(0, 2), shifts(4, 6));
    let m3 = _mm512_set1_epi8(3);
    let one = _mm512_set1_epi8(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..n / QK_K {
        let ab = a.add(i * Q8_K_BYTES);
        for (r, acc) in acc.iter_mut().enumerate() {
            let wb = w.add(r * stride + i * Q3_K_BYTES);
            let d = ab.cast::<f32>().read_unaligned() * f16_at(wb.add(108));
            let scales = widen16(q3_k_scales(wb));
            let hbits = broadcast256(wb);
            let mut sumi = _mm512_setzero_si512();
            for (h, idx) in idx.iter().enumerate() {
                let q3 = broadcast256(wb.add(32 + 32 * h));
                for (g, sh) in [sh01, sh23].into_iter().enumerate() {
                    let low = _mm512_and_si512(_mm512_srlv_epi16(q3, sh), m3);
                    // Runs 4h + 2g, 4h + 2g + 1 use hmask bits 4h + 2g, 4h + 2g + 1.
                    let b = (4 * h + 2 * g) as i16;
                    let set = _mm512_and_si512(_mm512_srlv_epi16(hbits, shifts(b, b + 1)), one);
                    // 4 where the bit is clear: q = low - 4.
                    let high = _mm512_slli_epi16::<2>(_mm512_andnot_si512(set, one));
                    let y = q8k_pair(ab, 2 * h + g);
                    let p = _mm512_sub_epi16(
                        _mm512_maddubs_epi16(low, y),
                        _mm512_maddubs_epi16(high, y),
                    );
                    let sc = _mm512_permutexvar_epi16(idx[g], scales);
                    sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(sc, p));
                }
            }
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(fold(sumi)), *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// Q4_K (`Q5 = false`) and Q5_K: the integer lanes of one super-block, runs `2j`, `2j+1` (the
/// low and high nibbles of one 32-byte run, scales `2j`, `2j+1`) per zmm.
#[inline(always)]
unsafe fn k4_sumi<const Q5: bool>(
    wb: *const u8,
    ab: *const u8,
    scales_mins: __m256i,
    idx: &[__m512i; 4],
) -> __m256i {
    let qs = if Q5 { 48 } else { 16 };
    let scales = _mm512_castsi256_si512(scales_mins);
    let m4 = _mm512_set1_epi8(0x0f);
    let hbits = if Q5 {
        broadcast256(wb.add(16))
    } else {
        _mm512_setzero_si512()
    };
    let mut sumi = _mm512_setzero_si512();
    for (j, idx) in idx.iter().enumerate() {
        let q = broadcast256(wb.add(qs + 32 * j));
        let mut x = _mm512_and_si512(_mm512_mask_srli_epi16::<4>(q, 0xffff_0000, q), m4);
        if Q5 {
            let b = 2 * j as i16;
            let bit = _mm512_srlv_epi16(hbits, shifts(b, b + 1));
            let bit = _mm512_and_si512(bit, _mm512_set1_epi8(1));
            x = _mm512_or_si512(x, _mm512_slli_epi16::<4>(bit));
        }
        let p = _mm512_maddubs_epi16(x, q8k_pair(ab, j));
        let sc = _mm512_permutexvar_epi16(*idx, scales);
        sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(sc, p));
    }
    fold(sumi)
}

/// `vpermw` indices for Q4_K/Q5_K: int16 lane `i` of pair `j` takes scale `2j + i/16`.
#[inline(always)]
unsafe fn k4_scale_idx() -> [__m512i; 4] {
    let mut idx = [_mm512_setzero_si512(); 4];
    for (j, idx) in idx.iter_mut().enumerate() {
        *idx = shifts(2 * j as i16, 2 * j as i16 + 1);
    }
    idx
}

#[inline(always)]
unsafe fn q4_k_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let idx = k4_scale_idx();
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_m = [_mm_setzero_ps(); R];
    for i in 0..n / QK_K {
        let ab = a.add(i * Q8_K_BYTES);
        let yd = ab.cast::<f32>().read_unaligned();
        for r in 0..R {
            let wb = w.add(r * stride + i * Q4_K_BYTES);
            let (d, dmin) = (yd * f16_at(wb), -yd * f16_at(wb.add(2)));
            let sm = k4_scales_mins(wb);
            let prod = _mm_cvtepi32_ps(k4_min_prod(sm, ab));
            acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), prod, acc_m[r]);
            let sumi = k4_sumi::<false>(wb, ab, sm, &idx);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for r in 0..R {
        let m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
        let m = _mm_add_ss(m, _mm_movehdup_ps(m));
        *out.add(r) = hsum8(acc[r]) + _mm_cvtss_f32(m);
    }
}

#[inline(always)]
unsafe fn q5_k_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let idx = k4_scale_idx();
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [0.0f32; R];
    for i in 0..n / QK_K {
        let ab = a.add(i * Q8_K_BYTES);
        let yd = ab.cast::<f32>().read_unaligned();
        for r in 0..R {
            let wb = w.add(r * stride + i * Q5_K_BYTES);
            let (d, dmin) = (yd * f16_at(wb), -yd * f16_at(wb.add(2)));
            let sm = k4_scales_mins(wb);
            let psum = hsum_i32_4(k4_min_prod(sm, ab));
            summs[r] = dmin.mul_add(psum as f32, summs[r]);
            let sumi = k4_sumi::<true>(wb, ab, sm, &idx);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for r in 0..R {
        *out.add(r) = hsum8(acc[r]) + summs[r];
    }
}

#[inline(always)]
unsafe fn q6_k_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let idx = sixteen_scale_idx();
    let (sh01, sh23) = (shifts(0, 2), shifts(4, 6));
    let (m3, m15) = (_mm512_set1_epi8(3), _mm512_set1_epi8(15));
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..n / QK_K {
        let ab = a.add(i * Q8_K_BYTES);
        for (r, acc) in acc.iter_mut().enumerate() {
            let wb = w.add(r * stride + i * Q6_K_BYTES);
            let d = ab.cast::<f32>().read_unaligned() * f16_at(wb.add(208));
            let scales = widen16(_mm_loadu_si128(wb.add(192).cast()));
            let mut sumi = _mm512_setzero_si512();
            for (h, idx) in idx.iter().enumerate() {
                // Runs 4h, 4h+1: low nibbles of ql[64h..64h+64]; runs 4h+2, 4h+3: high nibbles.
                let ql = _mm512_loadu_si512(wb.add(64 * h).cast());
                let qh = broadcast256(wb.add(128 + 32 * h));
                let lows = [
                    _mm512_and_si512(ql, m15),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m15),
                ];
                for (g, (low, sh)) in lows.into_iter().zip([sh01, sh23]).enumerate() {
                    let high = _mm512_and_si512(_mm512_srlv_epi16(qh, sh), m3);
                    let x = _mm512_or_si512(low, _mm512_slli_epi16::<4>(high));
                    let p = _mm512_maddubs_epi16(x, q8k_pair(ab, 2 * h + g));
                    let sc = _mm512_permutexvar_epi16(idx[g], scales);
                    sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(sc, p));
                }
            }
            let sumi = _mm256_sub_epi32(fold(sumi), q6_k_offset(wb, ab));
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

#[inline(always)]
unsafe fn q4_0_rows<const R: usize, const V: bool>(
    n: usize,
    w: *const u8,
    s: usize,
    a: *const u8,
    o: *mut f32,
) {
    signed_rows::<R, V, false>(n, w, s, a, o)
}
#[inline(always)]
unsafe fn q5_0_rows<const R: usize, const V: bool>(
    n: usize,
    w: *const u8,
    s: usize,
    a: *const u8,
    o: *mut f32,
) {
    signed_rows::<R, V, true>(n, w, s, a, o)
}
#[inline(always)]
unsafe fn q4_1_rows<const R: usize, const V: bool>(
    n: usize,
    w: *const u8,
    s: usize,
    a: *const u8,
    o: *mut f32,
) {
    min_rows::<R, V, false>(n, w, s, a, o)
}
#[inline(always)]
unsafe fn q5_1_rows<const R: usize, const V: bool>(
    n: usize,
    w: *const u8,
    s: usize,
    a: *const u8,
    o: *mut f32,
) {
    min_rows::<R, V, true>(n, w, s, a, o)
}

entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q4_0,
    rows_q4_0,
    q4_0_rows,
    4,
    false
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q4_1,
    rows_q4_1,
    q4_1_rows,
    4,
    false
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q5_0,
    rows_q5_0,
    q5_0_rows,
    4,
    false
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q5_1,
    rows_q5_1,
    q5_1_rows,
    4,
    false
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    dot_q4_0_vnni,
    rows_q4_0_vnni,
    q4_0_rows,
    4,
    true
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    dot_q4_1_vnni,
    rows_q4_1_vnni,
    q4_1_rows,
    4,
    true
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    dot_q5_0_vnni,
    rows_q5_0_vnni,
    q5_0_rows,
    4,
    true
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    dot_q5_1_vnni,
    rows_q5_1_vnni,
    q5_1_rows,
    4,
    true
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q2_k,
    rows_q2_k,
    q2_k_rows,
    2
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q3_k,
    rows_q3_k,
    q3_k_rows,
    2
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q4_k,
    rows_q4_k,
    q4_k_rows,
    2
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q5_k,
    rows_q5_k,
    q5_k_rows,
    2
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q6_k,
    rows_q6_k,
    q6_k_rows,
    2
);

/// The AVX-512 kernel for one of the low-bit weight types; the VNNI variants when `vnni` (the
/// caller checked the CPU).
pub(crate) fn dot_fns(ty: GgmlType, vnni: bool) -> Option<DotFns> {
    let (name, dot, rows): (_, DotFn, DotRowsFn) = match (ty, vnni) {
        (GgmlType::Q4_0, false) => ("q4_0*q8_0/avx512", dot_q4_0, rows_q4_0),
        (GgmlType::Q4_0, true) => ("q4_0*q8_0/avx512vnni", dot_q4_0_vnni, rows_q4_0_vnni),
        (GgmlType::Q4_1, false) => ("q4_1*q8_1/avx512", dot_q4_1, rows_q4_1),
        (GgmlType::Q4_1, true) => ("q4_1*q8_1/avx512vnni", dot_q4_1_vnni, rows_q4_1_vnni),
        (GgmlType::Q5_0, false) => ("q5_0*q8_0/avx512", dot_q5_0, rows_q5_0),
        (GgmlType::Q5_0, true) => ("q5_0*q8_0/avx512vnni", dot_q5_0_vnni, rows_q5_0_vnni),
        (GgmlType::Q5_1, false) => ("q5_1*q8_1/avx512", dot_q5_1, rows_q5_1),
        (GgmlType::Q5_1, true) => ("q5_1*q8_1/avx512vnni", dot_q5_1_vnni, rows_q5_1_vnni),
        (GgmlType::Q2_K, _) => ("q2_k*q8_k/avx512", dot_q2_k, rows_q2_k),
        (GgmlType::Q3_K, _) => ("q3_k*q8_k/avx512", dot_q3_k, rows_q3_k),
        (GgmlType::Q4_K, _) => ("q4_k*q8_k/avx512", dot_q4_k, rows_q4_k),
        (GgmlType::Q5_K, _) => ("q5_k*q8_k/avx512", dot_q5_k, rows_q5_k),
        (GgmlType::Q6_K, _) => ("q6_k*q8_k/avx512", dot_q6_k, rows_q6_k),
        _ => return None,
    };
    Some(DotFns { name, dot, rows })
}
