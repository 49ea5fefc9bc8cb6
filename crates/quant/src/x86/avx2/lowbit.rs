//! AVX2 + FMA + F16C dot products for Q4_0, Q4_1, Q5_0, Q5_1 (× Q8_0 / Q8_1) and the K-quants
//! (× Q8_K). They follow ggml's AVX2 kernels lane for lane (see `scalar/legacy.rs` and
//! `scalar/kquants.rs` for the lane layout), so they equal the scalar references bit for bit;
//! the integer parts may be regrouped freely because int32 sums are exact.
//!
//! Safety: every `unsafe fn` here needs AVX2, FMA and F16C, and pointers valid for the whole
//! blocks it reads (the contract in `kernel_fns.rs`).

use core::arch::x86_64::*;

use crate::cache_hint::prefetch_l2;
use crate::kernel_fns::DotFns;
use crate::scalar::kquants::{
    Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BSUMS, Q8_K_BYTES, Q8_K_QS,
    QK_K,
};
use crate::scalar::legacy::{Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q8_1_BYTES};
use crate::scalar::shared::{Q8_0_BYTES, QK};
use crate::x86::avx2::dot::{f16_at, hsum8};
use crate::GgmlType;

/// The 32 nibbles of the 16 bytes at `p` as bytes: low nibbles in 0..16, high nibbles in 16..32.
#[inline(always)]
pub(crate) unsafe fn nibbles32(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p.cast());
    let both = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(q), _mm_srli_epi16::<4>(q));
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// 0xff in byte `i` where bit `i` of the little-endian u32 at `p` is set, else 0.
#[inline(always)]
pub(crate) unsafe fn bits32(p: *const u8) -> __m256i {
    bits_mask(p.cast::<u32>().read_unaligned())
}

/// 0xff in byte `i` where bit `i` of `bits` is set, else 0.
#[inline(always)]
pub(crate) unsafe fn bits_mask(bits: u32) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    // Byte i takes byte i/8 of the word (both 128-bit lanes hold the whole word).
    let spread = _mm256_shuffle_epi8(
        v,
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit)
}

/// Unsigned × signed bytes into 8 int32 lanes (lane k sums bytes 4k..4k+4) as f32, with
/// `vpdpbusd` (AVX-512 VNNI/VL) when `VNNI`, else `vpmaddubsw` + `vpmaddwd`. Both give the same
/// integers because the 16-bit pair sums never saturate for our operands (u ≤ 31, so
/// |2·u·s| ≤ 7936).
#[inline(always)]
pub(crate) unsafe fn u8i8_lanes<const VNNI: bool>(u: __m256i, s: __m256i) -> __m256 {
    let p = if VNNI {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    } else {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    };
    _mm256_cvtepi32_ps(p)
}

/// Signed × signed bytes into 8 int32 lanes as f32 by ggml's sign trick: `|x|·sign(y, x)`.
#[inline(always)]
pub(crate) unsafe fn i8i8_lanes<const VNNI: bool>(x: __m256i, y: __m256i) -> __m256 {
    u8i8_lanes::<VNNI>(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

/// Q4_0 / Q5_0 weights times Q8_0: one 8-lane FMA chain per row over the blocks.
#[inline(always)]
unsafe fn signed_rows<const R: usize, const VNNI: bool, const Q5: bool>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let (bytes, qs) = if Q5 { (Q5_0_BYTES, 6) } else { (Q4_0_BYTES, 2) };
    let mut acc = [_mm256_setzero_ps(); R];
    // The next R rows go into L2 as this group runs (the hardware prefetchers miss R
    // streams): at each step of 8 blocks the share of them that matches (a hint: addresses
    // past the rows are never read).
    let next = w.wrapping_add(R * stride);
    for ib in 0..n / QK {
        if R > 1 && ib % 8 == 0 {
            let len = (n / QK - ib).min(8);
            prefetch_l2(next.wrapping_add(ib * R * bytes), len * R * bytes);
        }
        let ab = a.add(ib * Q8_0_BYTES);
        let y = _mm256_loadu_si256(ab.add(2).cast());
        let da = f16_at(ab);
        for (r, acc) in acc.iter_mut().enumerate() {
            let wb = w.add(r * stride + ib * bytes);
            let x = if Q5 {
                // Byte | 0xf0 (= q - 16 as int8) where the fifth bit is clear.
                let hi = _mm256_andnot_si256(bits32(wb.add(2)), _mm256_set1_epi8(0xf0u8 as i8));
                _mm256_or_si256(nibbles32(wb.add(qs)), hi)
            } else {
                _mm256_sub_epi8(nibbles32(wb.add(qs)), _mm256_set1_epi8(8))
            };
            let q = i8i8_lanes::<VNNI>(x, y);
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(wb) * da), q, *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// Q4_1 / Q5_1 weights times Q8_1: an 8-lane FMA chain of `d_w·d_a·lanes` and a scalar FMA
/// chain of `m·s`, added at the end.
#[inline(always)]
unsafe fn min_rows<const R: usize, const VNNI: bool, const Q5: bool>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let (bytes, qs) = if Q5 { (Q5_1_BYTES, 8) } else { (Q4_1_BYTES, 4) };
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [0.0f32; R];
    // As in `signed_rows`: the next R rows into L2, a step of 8 blocks at a time.
    let next = w.wrapping_add(R * stride);
    for ib in 0..n / QK {
        if R > 1 && ib % 8 == 0 {
            let len = (n / QK - ib).min(8);
            prefetch_l2(next.wrapping_add(ib * R * bytes), len * R * bytes);
        }
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
            let q = u8i8_lanes::<VNNI>(x, y);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(wb) * da), q, acc[r]);
        }
    }
    for r in 0..R {
        *out.add(r) = hsum8(acc[r]) + summs[r];
    }
}

// ----------------------------------------------------------------------------------------------
// K-quants

/// `_mm256_shuffle_epi8` index picking int16 `2k` of each lane's scales in the low 128-bit lane
/// and int16 `2k+1` in the high lane (the two 16-element sub-blocks of a 32-byte run).
#[inline(always)]
unsafe fn pair_scale_shuffle(k: usize) -> __m256i {
    let lo = (4 * k as i64) | ((4 * k as i64 + 1) << 8);
    let hi = lo + 0x0202;
    let lo = lo * 0x0001_0001_0001_0001;
    let hi = hi * 0x0001_0001_0001_0001;
    _mm256_setr_epi64x(lo, lo, hi, hi)
}

/// `_mm256_shuffle_epi8` index broadcasting int16 `i` of each lane's scales to all of it.
#[inline(always)]
unsafe fn one_scale_shuffle(i: usize) -> __m256i {
    let v = ((2 * i as i64) | ((2 * i as i64 + 1) << 8)) * 0x0001_0001_0001_0001;
    _mm256_set1_epi64x(v)
}

/// The low and high 8 int16 of `v`, each repeated in both 128-bit lanes.
#[inline(always)]
unsafe fn dup_halves(v: __m256i) -> [__m256i; 2] {
    let lo = _mm256_castsi256_si128(v);
    let hi = _mm256_extracti128_si256::<1>(v);
    [
        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), lo),
        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(hi), hi),
    ]
}

/// Bits `2k..2k+2` of every byte of `v`.
#[inline(always)]
unsafe fn crumb(v: __m256i, k: usize) -> __m256i {
    let s = _mm_cvtsi32_si128(2 * k as i32);
    _mm256_and_si256(_mm256_srl_epi16(v, s), _mm256_set1_epi8(3))
}

/// The Q8_K quants of one 32-byte run of a super-block.
#[inline(always)]
unsafe fn q8k_run(ab: *const u8, run: usize) -> __m256i {
    _mm256_loadu_si256(ab.add(Q8_K_QS + 32 * run).cast())
}

/// `d_a·d_w` and `-d_a·dmin_w` of a super-block (f16 `d`, `dmin` at `off`, `off + 2`).
#[inline(always)]
unsafe fn k_scales(ab: *const u8, wb: *const u8, off: usize) -> (f32, f32) {
    let yd = ab.cast::<f32>().read_unaligned();
    (yd * f16_at(wb.add(off)), -yd * f16_at(wb.add(off + 2)))
}

#[inline(always)]
unsafe fn q2_k_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let m4 = _mm_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..n / QK_K {
        let ab = a.add(i * Q8_K_BYTES);
        let bsums = _mm256_loadu_si256(ab.add(Q8_K_BSUMS).cast());
        for (r, acc) in acc.iter_mut().enumerate() {
            let wb = w.add(r * stride + i * Q2_K_BYTES);
            let (d, dmin) = k_scales(ab, wb, 80);
            let packed = _mm_loadu_si128(wb.cast());
            let mins = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), m4));
            let prod = _mm256_madd_epi16(mins, bsums);
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), *acc);
            let scales = dup_halves(_mm256_cvtepi8_epi16(_mm_and_si128(packed, m4)));
            let mut sumi = _mm256_setzero_si256();
            for (half, scales) in scales.iter().enumerate() {
                let q2 = _mm256_loadu_si256(wb.add(16 + 32 * half).cast());
                for k in 0..4 {
                    let p = _mm256_maddubs_epi16(crumb(q2, k), q8k_run(ab, 4 * half + k));
                    let sc = _mm256_shuffle_epi8(*scales, pair_scale_shuffle(k));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sc, p));
                }
            }
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// The 16 Q3_K scales minus 32 as int8 (ggml's 32-bit unpacking of the 12 packed bytes).
#[inline(always)]
pub(crate) unsafe fn q3_k_scales(wb: *const u8) -> __m128i {
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
    let four = _mm256_set1_epi8(4);
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..n / QK_K {
        let ab = a.add(i * Q8_K_BYTES);
        for (r, acc) in acc.iter_mut().enumerate() {
            let wb = w.add(r * stride + i * Q3_K_BYTES);
            let d = ab.cast::<f32>().read_unaligned() * f16_at(wb.add(108));
            let scales = dup_halves(_mm256_cvtepi8_epi16(q3_k_scales(wb)));
            let hbits = _mm256_loadu_si256(wb.cast());
            let mut sumi = _mm256_setzero_si256();
            for (half, scales) in scales.iter().enumerate() {
                let q3 = _mm256_loadu_si256(wb.add(32 + 32 * half).cast());
                for k in 0..4 {
                    let bit = _mm256_set1_epi8((1u8 << (4 * half + k)) as i8);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(hbits, bit), bit);
                    // 4 where the high bit is clear: q = low - 4.
                    let h = _mm256_andnot_si256(set, four);
                    let y = q8k_run(ab, 4 * half + k);
                    let p = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(crumb(q3, k), y),
                        _mm256_maddubs_epi16(h, y),
                    );
                    let sc = _mm256_shuffle_epi8(*scales, pair_scale_shuffle(k));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sc, p));
                }
            }
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// The 8 scales and 8 mins of a Q4_K/Q5_K super-block as 16 int16 (scales first), unpacked as
/// ggml's AVX2 kernels do (the same values as `get_scale_min_k4`).
#[inline(always)]
pub(crate) unsafe fn k4_scales_mins(wb: *const u8) -> __m256i {
    let p = wb.add(4).cast::<u32>();
    let (u0, u1, u2) = (
        p.read_unaligned(),
        p.add(1).read_unaligned(),
        p.add(2).read_unaligned(),
    );
    let (m1, m2, m3) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
    let sc_lo = u0 & m1;
    let sc_hi = (u2 & m2) | (((u0 >> 6) & m3) << 4);
    let mn_lo = u1 & m1;
    let mn_hi = ((u2 >> 4) & m2) | (((u1 >> 6) & m3) << 4);
    _mm256_cvtepu8_epi16(_mm_setr_epi32(
        sc_lo as i32,
        sc_hi as i32,
        mn_lo as i32,
        mn_hi as i32,
    ))
}

/// The four int32 min products `m[2k]·(b[4k]+b[4k+1]) + m[2k+1]·(b[4k+2]+b[4k+3])` of a
/// Q4_K/Q5_K super-block (`_mm_hadd_epi16` pair sums, then `_mm_madd_epi16`).
#[inline(always)]
pub(crate) unsafe fn k4_min_prod(scales_mins: __m256i, ab: *const u8) -> __m128i {
    let bsums = _mm256_loadu_si256(ab.add(Q8_K_BSUMS).cast());
    let pairs = _mm_hadd_epi16(
        _mm256_castsi256_si128(bsums),
        _mm256_extracti128_si256::<1>(bsums),
    );
    _mm_madd_epi16(_mm256_extracti128_si256::<1>(scales_mins), pairs)
}

/// Q4_K (`Q5 = false`) and Q5_K: the integer lanes of one super-block.
#[inline(always)]
pub(crate) unsafe fn k4_sumi<const Q5: bool>(
    wb: *const u8,
    ab: *const u8,
    scales_mins: __m256i,
) -> __m256i {
    let qs = if Q5 { 48 } else { 16 };
    let sc = _mm256_castsi256_si128(scales_mins);
    let scales = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(sc), sc);
    let m4 = _mm256_set1_epi8(0x0f);
    let hbits = if Q5 {
        _mm256_loadu_si256(wb.add(16).cast())
    } else {
        _mm256_setzero_si256()
    };
    let mut sumi = _mm256_setzero_si256();
    for j in 0..4 {
        let q = _mm256_loadu_si256(wb.add(qs + 32 * j).cast());
        let mut lo = _mm256_and_si256(q, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
        if Q5 {
            let b = |bit: usize| {
                let m = _mm256_set1_epi8((1u8 << bit) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hbits, m), m);
                _mm256_and_si256(set, _mm256_set1_epi8(16))
            };
            lo = _mm256_or_si256(lo, b(2 * j));
            hi = _mm256_or_si256(hi, b(2 * j + 1));
        }
        let pl = _mm256_maddubs_epi16(lo, q8k_run(ab, 2 * j));
        let ph = _mm256_maddubs_epi16(hi, q8k_run(ab, 2 * j + 1));
        let sl = _mm256_shuffle_epi8(scales, one_scale_shuffle(2 * j));
        let sh = _mm256_shuffle_epi8(scales, one_scale_shuffle(2 * j + 1));
        let p = _mm256_add_epi32(_mm256_madd_epi16(sl, pl), _mm256_madd_epi16(sh, ph));
        sumi = _mm256_add_epi32(sumi, p);
    }
    sumi
}

#[inline(always)]
unsafe fn q4_k_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_m = [_mm_setzero_ps(); R];
    for i in 0..n / QK_K {
        let ab = a.add(i * Q8_K_BYTES);
        for r in 0..R {
            let wb = w.add(r * stride + i * Q4_K_BYTES);
            let (d, dmin) = k_scales(ab, wb, 0);
            let sm = k4_scales_mins(wb);
            let prod = _mm_cvtepi32_ps(k4_min_prod(sm, ab));
            acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), prod, acc_m[r]);
            let sumi = k4_sumi::<false>(wb, ab, sm);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for r in 0..R {
        let m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
        let m = _mm_add_ss(m, _mm_movehdup_ps(m));
        *out.add(r) = hsum8(acc[r]) + _mm_cvtss_f32(m);
    }
}

/// Wrapping sum of four int32 lanes.
#[inline(always)]
unsafe fn hsum_i32_4(v: __m128i) -> i32 {
    let v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01>(v));
    _mm_cvtsi128_si32(v)
}

#[inline(always)]
unsafe fn q5_k_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [0.0f32; R];
    for i in 0..n / QK_K {
        let ab = a.add(i * Q8_K_BYTES);
        for r in 0..R {
            let wb = w.add(r * stride + i * Q5_K_BYTES);
            let (d, dmin) = k_scales(ab, wb, 0);
            let sm = k4_scales_mins(wb);
            let psum = hsum_i32_4(k4_min_prod(sm, ab));
            summs[r] = dmin.mul_add(psum as f32, summs[r]);
            let sumi = k4_sumi::<true>(wb, ab, sm);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for r in 0..R {
        *out.add(r) = hsum8(acc[r]) + summs[r];
    }
}

/// The four unsigned 6-bit quants of Q6_K half `half` (32-byte runs 4·half..4·half+4).
#[inline(always)]
unsafe fn q6_k_quants(wb: *const u8, half: usize) -> [__m256i; 4] {
    let m15 = _mm256_set1_epi8(15);
    let ql1 = _mm256_loadu_si256(wb.add(64 * half).cast());
    let ql2 = _mm256_loadu_si256(wb.add(64 * half + 32).cast());
    let qh = _mm256_loadu_si256(wb.add(128 + 32 * half).cast());
    let h = |k: usize| {
        // Bits 2k, 2k+1 of qh moved to bits 4, 5.
        let m = _mm256_set1_epi8((3 << (2 * k)) as u8 as i8);
        let v = _mm256_and_si256(qh, m);
        match k {
            0 => _mm256_slli_epi16::<4>(v),
            1 => _mm256_slli_epi16::<2>(v),
            2 => v,
            _ => _mm256_srli_epi16::<2>(v),
        }
    };
    [
        _mm256_or_si256(_mm256_and_si256(ql1, m15), h(0)),
        _mm256_or_si256(_mm256_and_si256(ql2, m15), h(1)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m15), h(2)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql2), m15), h(3)),
    ]
}

/// `32·(bsums[2l]·sc[2l] + bsums[2l+1]·sc[2l+1])` per lane, the Q6_K offset correction.
#[inline(always)]
pub(crate) unsafe fn q6_k_offset(wb: *const u8, ab: *const u8) -> __m256i {
    let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(wb.add(192).cast()));
    let bsums = _mm256_loadu_si256(ab.add(Q8_K_BSUMS).cast());
    _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, sc))
}

#[inline(always)]
unsafe fn q6_k_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..n / QK_K {
        let ab = a.add(i * Q8_K_BYTES);
        for (r, acc) in acc.iter_mut().enumerate() {
            let wb = w.add(r * stride + i * Q6_K_BYTES);
            let d = ab.cast::<f32>().read_unaligned() * f16_at(wb.add(208));
            let scales = _mm_loadu_si128(wb.add(192).cast());
            let mut sumi = _mm256_setzero_si256();
            for half in 0..2 {
                let q = q6_k_quants(wb, half);
                for (k, q) in q.iter().enumerate() {
                    let p = _mm256_maddubs_epi16(*q, q8k_run(ab, 4 * half + k));
                    // Scales 8·half + 2k (low 16 bytes) and 8·half + 2k + 1 (high 16 bytes).
                    let s = 8 * half + 2 * k;
                    let idx = _mm_set_epi64x(
                        (s as i64 + 1) * 0x0101_0101_0101_0101,
                        (s as i64) * 0x0101_0101_0101_0101,
                    );
                    let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, idx));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sc, p));
                }
            }
            sumi = _mm256_sub_epi32(sumi, q6_k_offset(wb, ab));
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// Q4_0 rows (`q5_0_rows`, `q4_1_rows`, `q5_1_rows` the same for their types); `VNNI` picks
/// `vpdpbusd` for the integer products (the AVX-512 VL kernels) instead of AVX2's pair.
#[inline(always)]
pub(crate) unsafe fn q4_0_rows<const R: usize, const VNNI: bool>(
    n: usize,
    w: *const u8,
    s: usize,
    a: *const u8,
    o: *mut f32,
) {
    signed_rows::<R, VNNI, false>(n, w, s, a, o)
}
#[inline(always)]
pub(crate) unsafe fn q5_0_rows<const R: usize, const VNNI: bool>(
    n: usize,
    w: *const u8,
    s: usize,
    a: *const u8,
    o: *mut f32,
) {
    signed_rows::<R, VNNI, true>(n, w, s, a, o)
}
#[inline(always)]
pub(crate) unsafe fn q4_1_rows<const R: usize, const VNNI: bool>(
    n: usize,
    w: *const u8,
    s: usize,
    a: *const u8,
    o: *mut f32,
) {
    min_rows::<R, VNNI, false>(n, w, s, a, o)
}
#[inline(always)]
pub(crate) unsafe fn q5_1_rows<const R: usize, const VNNI: bool>(
    n: usize,
    w: *const u8,
    s: usize,
    a: *const u8,
    o: *mut f32,
) {
    min_rows::<R, VNNI, true>(n, w, s, a, o)
}

entry_points!("avx2,fma,f16c", dot_q4_0, rows_q4_0, q4_0_rows, 4, false);
entry_points!("avx2,fma,f16c", dot_q4_1, rows_q4_1, q4_1_rows, 4, false);
entry_points!("avx2,fma,f16c", dot_q5_0, rows_q5_0, q5_0_rows, 4, false);
entry_points!("avx2,fma,f16c", dot_q5_1, rows_q5_1, q5_1_rows, 4, false);
entry_points!("avx2,fma,f16c", dot_q2_k, rows_q2_k, q2_k_rows, 1);
entry_points!("avx2,fma,f16c", dot_q3_k, rows_q3_k, q3_k_rows, 1);
entry_points!("avx2,fma,f16c", dot_q4_k, rows_q4_k, q4_k_rows, 1);
entry_points!("avx2,fma,f16c", dot_q5_k, rows_q5_k, q5_k_rows, 1);
entry_points!("avx2,fma,f16c", dot_q6_k, rows_q6_k, q6_k_rows, 1);

/// The AVX2 kernel for one of the low-bit weight types.
pub(crate) fn dot_fns(ty: GgmlType) -> Option<DotFns> {
    let (name, dot, rows): (_, crate::kernel_fns::DotFn, crate::kernel_fns::DotRowsFn) = match ty {
        GgmlType::Q4_0 => ("q4_0*q8_0/avx2", dot_q4_0, rows_q4_0),
        GgmlType::Q4_1 => ("q4_1*q8_1/avx2", dot_q4_1, rows_q4_1),
        GgmlType::Q5_0 => ("q5_0*q8_0/avx2", dot_q5_0, rows_q5_0),
        GgmlType::Q5_1 => ("q5_1*q8_1/avx2", dot_q5_1, rows_q5_1),
        GgmlType::Q2_K => ("q2_k*q8_k/avx2", dot_q2_k, rows_q2_k),
        GgmlType::Q3_K => ("q3_k*q8_k/avx2", dot_q3_k, rows_q3_k),
        GgmlType::Q4_K => ("q4_k*q8_k/avx2", dot_q4_k, rows_q4_k),
        GgmlType::Q5_K => ("q5_k*q8_k/avx2", dot_q5_k, rows_q5_k),
        GgmlType::Q6_K => ("q6_k*q8_k/avx2", dot_q6_k, rows_q6_k),
        _ => return None,
    };
    Some(DotFns { name, dot, rows })
}

/// Lane `i` of the result is the wrapping sum of the eight lanes of `v[i]` (exact for the
/// integer sums it adds).
#[inline(always)]
pub(crate) unsafe fn hsum_8x8(v: &[__m256i; 8]) -> __m256i {
    let a = _mm256_hadd_epi32(v[0], v[1]);
    let b = _mm256_hadd_epi32(v[2], v[3]);
    let c = _mm256_hadd_epi32(v[4], v[5]);
    let d = _mm256_hadd_epi32(v[6], v[7]);
    let ab = _mm256_hadd_epi32(a, b);
    let cd = _mm256_hadd_epi32(c, d);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(ab, cd),
        _mm256_permute2x128_si256::<0x31>(ab, cd),
    )
}
