//! AVX-512 kernels for the low-bit formats, where they measured faster than AVX2 (2-core
//! AVX-512 VM: one 512-bit multiply port, so zmm registers pay only where they save shuffles):
//!
//! * Q4_0/Q4_1/Q5_0/Q5_1 with VNNI: the AVX2 kernels with `vpmaddubsw` + `vpmaddwd` replaced by
//!   256-bit `vpdpbusd` (AVX-512 VL), which is what ggml's x86 build compiles to; ~10-15 %
//!   faster. Without VNNI the AVX2 kernels are used. Q5_0's rows with VNNI (decode) take the
//!   kernel of `q5_0_rows.rs`, which prepares the activation row once and feeds the unsigned
//!   quants to `vpdpbusd` directly (the same integer lanes).
//! * Q3_K and Q6_K: two 32-byte runs per zmm for the integer products (`vpmaddubsw` +
//!   `vpmaddwd` with per-run scales picked by `vpermw`); the int32 halves are added into ggml's
//!   8 lanes, which is exact, then the float steps are those of the AVX2 kernels (~10-20 %
//!   faster). Q2_K, Q4_K and Q5_K were no faster this way and use the AVX2 kernels. With
//!   VNNI, Q6_K adds the scaled pair products with `vpdpwssd` (the same int32 lanes).
//!
//! All are bit-identical to the scalar references (and so to ggml's AVX2 kernels).
//!
//! Safety: every `unsafe fn` here needs AVX-512 F/BW/VL plus AVX2, FMA and F16C (and VNNI for
//! the VNNI kernels), and pointers valid for the whole blocks it reads.

use core::arch::x86_64::*;

use crate::kernel_fns::{DotFn, DotFns, DotRowsFn};
use crate::scalar::kquants::{Q3_K_BYTES, Q6_K_BYTES, Q8_K_BYTES, Q8_K_QS, QK_K};
use crate::x86::avx2::dot::{f16_at, hsum8};
use crate::x86::avx2::lowbit::{
    q3_k_scales, q4_0_rows, q4_1_rows, q5_0_rows, q5_1_rows, q6_k_offset,
};
use crate::GgmlType;

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

/// Q6_K rows; `VNNI` adds each scaled pair product with `vpdpwssd` instead of `vpmaddwd` +
/// `vpaddd` (the same int32 lanes).
#[inline(always)]
unsafe fn q6_k_rows<const R: usize, const VNNI: bool>(
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
                    sumi = if VNNI {
                        _mm512_dpwssd_epi32(sumi, sc, p)
                    } else {
                        _mm512_add_epi32(sumi, _mm512_madd_epi16(sc, p))
                    };
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
/// Q5_0 rows with VNNI: the prepared kernel of `q5_0_rows.rs`, [`rows_q5_0_vnni`] where the
/// activation row cannot be prepared (the same bits either way).
///
/// # Safety
/// The CPU has the enabled features; `w` holds `out.len()` rows `stride` bytes apart and `a`
/// the blocks of `n` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_q5_0_vnni_prepared(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
    super::q5_0_rows::rows_prepared(n, w, stride, a, out, rows_q5_0_vnni)
}
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
    dot_q3_k,
    rows_q3_k,
    q3_k_rows,
    1
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q6_k,
    rows_q6_k,
    q6_k_rows,
    1,
    false
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    dot_q6_k_vnni,
    rows_q6_k_vnni,
    q6_k_rows,
    1,
    true
);

/// The AVX-512 kernel for one of the low-bit weight types; the VNNI variants when `vnni` (the
/// caller checked the CPU).
pub(crate) fn dot_fns(ty: GgmlType, vnni: bool) -> Option<DotFns> {
    let (name, dot, rows): (_, DotFn, DotRowsFn) = match (ty, vnni) {
        (GgmlType::Q4_0, true) => ("q4_0*q8_0/avx512vnni", dot_q4_0_vnni, rows_q4_0_vnni),
        (GgmlType::Q4_1, true) => ("q4_1*q8_1/avx512vnni", dot_q4_1_vnni, rows_q4_1_vnni),
        (GgmlType::Q5_0, true) => (
            "q5_0*q8_0/avx512vnni",
            dot_q5_0_vnni,
            rows_q5_0_vnni_prepared,
        ),
        (GgmlType::Q5_1, true) => ("q5_1*q8_1/avx512vnni", dot_q5_1_vnni, rows_q5_1_vnni),
        (GgmlType::Q3_K, _) => ("q3_k*q8_k/avx512", dot_q3_k, rows_q3_k),
        (GgmlType::Q6_K, false) => ("q6_k*q8_k/avx512", dot_q6_k, rows_q6_k),
        (GgmlType::Q6_K, true) => ("q6_k*q8_k/avx512vnni", dot_q6_k_vnni, rows_q6_k_vnni),
        // Measured no faster with zmm registers than AVX2 (or, without VNNI, than the AVX2
        // kernels): use those.
        (GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1, false)
        | (GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::Q5_K, _) => {
            return crate::x86::avx2::lowbit::dot_fns(ty)
        }
        _ => return None,
    };
    Some(DotFns { name, dot, rows })
}
