//! AVX2 + FMA + F16C kernels. Each reproduces the scalar reference bit for bit: the 16-lane
//! accumulators of the float dots are pairs of 8-lane registers, the integer dots keep ggml's
//! 8-lane layout (lane k of a block sums elements 4k..4k+4).
//!
//! Helpers are `#[inline(always)]` without target features and are only called from the
//! `#[target_feature]` entry points at the bottom, into which they are inlined.
//!
//! Safety: every `unsafe fn` here needs AVX2, FMA and F16C, and pointers valid for the whole
//! blocks it reads or writes (the contract in `kernel_fns.rs`).

use core::arch::x86_64::*;

use crate::cache_hint::prefetch_l2;
use crate::kernel_fns::{DequantFn, DotFns, QuantFn};
use crate::scalar::shared::{self, E8M0_HALF, KVALUES_MXFP4, MXFP4_BYTES, Q8_0_BYTES, QK};
use crate::scalar::{self, basic};
use crate::GgmlType;

/// Horizontal sum by halving, ggml's `hsum_float_8`.
#[inline(always)]
pub(crate) unsafe fn hsum8(v: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// The little-endian f16 at `p` as f32 (F16C).
#[inline(always)]
pub(crate) unsafe fn f16_at(p: *const u8) -> f32 {
    let h = p.cast::<u16>().read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// A float element type of the float dot products.
pub(crate) trait FloatElem {
    /// Bytes per element.
    const SIZE: usize;
    /// Eight elements from `p` as f32.
    unsafe fn load8(p: *const u8) -> __m256;
    /// One element from `p` as f32.
    unsafe fn get(p: *const u8) -> f32;
}

pub(crate) struct F32E;
pub(crate) struct F16E;
pub(crate) struct Bf16E;

impl FloatElem for F32E {
    const SIZE: usize = 4;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        _mm256_loadu_ps(p.cast())
    }
    #[inline(always)]
    unsafe fn get(p: *const u8) -> f32 {
        p.cast::<f32>().read_unaligned()
    }
}

impl FloatElem for F16E {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
    #[inline(always)]
    unsafe fn get(p: *const u8) -> f32 {
        f16_at(p)
    }
}

impl FloatElem for Bf16E {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p.cast()),
        )))
    }
    #[inline(always)]
    unsafe fn get(p: *const u8) -> f32 {
        shared::bf16_to_f32(p.cast::<u16>().read_unaligned())
    }
}

/// Four 16-lane FMA accumulators (here 8 registers, zmm k = ymm 2k, 2k+1) over 64-element steps,
/// reduced as ggml's `GGML_F32_VEC_REDUCE`. Returns each row's sum of the first `n & !63`.
#[inline(always)]
unsafe fn fma64_rows<E: FloatElem, const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
) -> [f32; R] {
    let np = n & !63;
    let mut acc = [[_mm256_setzero_ps(); 8]; R];
    let mut i = 0;
    while i < np {
        for j in 0..8 {
            let off = (i + 8 * j) * E::SIZE;
            let y = E::load8(a.add(off));
            for (r, acc) in acc.iter_mut().enumerate() {
                acc[j] = _mm256_fmadd_ps(E::load8(w.add(r * stride + off)), y, acc[j]);
            }
        }
        i += 64;
    }
    let mut res = [0.0f32; R];
    for (res, acc) in res.iter_mut().zip(&acc) {
        let a0 = _mm256_add_ps(acc[0], acc[4]);
        let a1 = _mm256_add_ps(acc[1], acc[5]);
        let a2 = _mm256_add_ps(acc[2], acc[6]);
        let a3 = _mm256_add_ps(acc[3], acc[7]);
        *res = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3)));
    }
    res
}

#[inline(always)]
unsafe fn f32_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    f32_tails(fma64_rows::<F32E, R>(n, w, stride, a), n, w, stride, a, out);
}

#[inline(always)]
unsafe fn f16_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    f16_tails(fma64_rows::<F16E, R>(n, w, stride, a), n, w, stride, a, out);
}

/// Finishes `R` F32 rows from the sums of their first `n & !63` elements: the FMA chain goes on
/// element by element (ggml's `vec_dot_f32` leftovers). Shared by the AVX2 and AVX-512 kernels.
#[inline(always)]
pub(crate) unsafe fn f32_tails<const R: usize>(
    sums: [f32; R],
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    for (r, &s) in sums.iter().enumerate() {
        let mut sum = s;
        for i in n & !63..n {
            sum = F32E::get(w.add(r * stride + 4 * i)).mul_add(F32E::get(a.add(4 * i)), sum);
        }
        *out.add(r) = sum;
    }
}

/// Finishes `R` F16 rows from the sums of their first `n & !63` elements: the leftover products
/// are added in f64 (ggml's `vec_dot_f16`). Shared by the AVX2 and AVX-512 kernels.
#[inline(always)]
pub(crate) unsafe fn f16_tails<const R: usize>(
    sums: [f32; R],
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    for (r, &s) in sums.iter().enumerate() {
        let mut sum = s as f64;
        for i in n & !63..n {
            sum += (F16E::get(w.add(r * stride + 2 * i)) * F16E::get(a.add(2 * i))) as f64;
        }
        *out.add(r) = sum as f32;
    }
}

/// The BF16 row at `w` finished from `sum` (its first `np` elements): the leftover products
/// added in f64 (ggml's `vec_dot_bf16`). Shared by the AVX2 and AVX-512 kernels.
#[inline(always)]
pub(crate) unsafe fn bf16_tail(
    mut sum: f64,
    np: usize,
    n: usize,
    w: *const u8,
    a: *const u8,
) -> f32 {
    for i in np..n {
        sum += (Bf16E::get(w.add(2 * i)) * Bf16E::get(a.add(2 * i))) as f64;
    }
    sum as f32
}

/// Two 16-lane multiply-then-add accumulators over 32-element steps (ggml's AVX-512F BF16 dot).
#[inline(always)]
unsafe fn bf16_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let np = n & !31;
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let mut i = 0;
    while i < np {
        for j in 0..4 {
            let off = (i + 8 * j) * 2;
            let y = Bf16E::load8(a.add(off));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = Bf16E::load8(w.add(r * stride + off));
                acc[j] = _mm256_add_ps(_mm256_mul_ps(x, y), acc[j]);
            }
        }
        i += 32;
    }
    for (r, acc) in acc.iter().enumerate() {
        let mut sum = 0.0f64;
        sum += hsum8(_mm256_add_ps(acc[0], acc[1])) as f64;
        sum += hsum8(_mm256_add_ps(acc[2], acc[3])) as f64;
        *out.add(r) = bf16_tail(sum, np, n, w.add(r * stride), a);
    }
}

/// Int8 dot of 32 bytes into 8 int32 lanes (lane k sums bytes 4k..4k+4) as f32:
/// `maddubs(|x|, sign(y, x))` then pairwise add, ggml's `mul_sum_i8_pairs_float`.
#[inline(always)]
pub(crate) unsafe fn q8_q8_lanes(x: __m256i, y: __m256i) -> __m256 {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    let p16 = _mm256_maddubs_epi16(ax, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
}

/// Q8_0 weights times Q8_0 activations: one 8-lane FMA chain per row (ggml's AVX2 kernel).
#[inline(always)]
unsafe fn q8_0_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let nb = n / QK;
    let mut acc = [_mm256_setzero_ps(); R];
    // With several rows (contiguous in `dot_rows`), prefetch the next R rows into L2 as this
    // pass runs: the pass is memory-bound and the hardware prefetchers miss the R streams.
    let next = w.wrapping_add(R * stride);
    for ib in 0..nb {
        if R > 1 {
            prefetch_l2(next.wrapping_add(ib * R * Q8_0_BYTES), R * Q8_0_BYTES + 64);
        }
        let ab = a.add(ib * Q8_0_BYTES);
        let y = _mm256_loadu_si256(ab.add(2).cast());
        let da = f16_at(ab);
        for (r, acc) in acc.iter_mut().enumerate() {
            let wb = w.add(r * stride + ib * Q8_0_BYTES);
            let q = q8_q8_lanes(_mm256_loadu_si256(wb.add(2).cast()), y);
            let d = f16_at(wb) * da;
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), q, *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// The 32 table values of an MXFP4 block: bytes 0..16 from the low nibbles, 16..32 from the high.
#[inline(always)]
unsafe fn mxfp4_values(qs: *const u8, table: __m256i) -> __m256i {
    let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs.cast()));
    let q = _mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    _mm256_shuffle_epi8(table, _mm256_and_si256(q, _mm256_set1_epi8(0x0f)))
}

/// MXFP4 weights times Q8_0 activations: even and odd blocks in two 8-lane FMA chains, the odd
/// last block in scalar (ggml's AVX2 kernel). Products are `maddubs(|w|, sign(y, w))`, as
/// ggml's `mul_add_epi8`.
#[inline(always)]
unsafe fn mxfp4_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let nb = n / QK;
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast()));
    let ones = _mm256_set1_epi16(1);
    let mut acc1 = [_mm256_setzero_ps(); R];
    let mut acc2 = [_mm256_setzero_ps(); R];
    let mut ib = 0;
    while ib + 1 < nb {
        let a0 = a.add(ib * Q8_0_BYTES);
        let a1 = a0.add(Q8_0_BYTES);
        let y0 = _mm256_loadu_si256(a0.add(2).cast());
        let y1 = _mm256_loadu_si256(a1.add(2).cast());
        let (da0, da1) = (f16_at(a0), f16_at(a1));
        for r in 0..R {
            let w0 = w.add(r * stride + ib * MXFP4_BYTES);
            let w1 = w0.add(MXFP4_BYTES);
            let v0 = mxfp4_values(w0.add(1), table);
            let v1 = mxfp4_values(w1.add(1), table);
            let s0 = _mm256_sign_epi8(y0, v0);
            let s1 = _mm256_sign_epi8(y1, v1);
            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v0), s0), ones);
            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v1), s1), ones);
            let s0 = _mm256_set1_ps(da0 * E8M0_HALF[*w0 as usize]);
            let s1 = _mm256_set1_ps(da1 * E8M0_HALF[*w1 as usize]);
            acc1[r] = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(p0), acc1[r]);
            acc2[r] = _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(p1), acc2[r]);
        }
        ib += 2;
    }
    for r in 0..R {
        let mut sum = hsum8(_mm256_add_ps(acc1[r], acc2[r]));
        if ib < nb {
            let wb = core::slice::from_raw_parts(w.add(r * stride + ib * MXFP4_BYTES), MXFP4_BYTES);
            let ab = core::slice::from_raw_parts(a.add(ib * Q8_0_BYTES), Q8_0_BYTES);
            sum = basic::mxfp4_tail(wb, ab, sum);
        }
        *out.add(r) = sum;
    }
}

entry_points!("avx2,fma,f16c", dot_f32, rows_f32, f32_rows, 2);
entry_points!("avx2,fma,f16c", dot_f16, rows_f16, f16_rows, 2);
entry_points!("avx2,fma,f16c", dot_bf16, rows_bf16, bf16_rows, 2);
entry_points!("avx2,fma,f16c", dot_q8_0, rows_q8_0, q8_0_rows, 4);
entry_points!("avx2,fma,f16c", dot_mxfp4, rows_mxfp4, mxfp4_rows, 4);

pub(crate) fn dot_fns(ty: GgmlType) -> Option<DotFns> {
    Some(match ty {
        GgmlType::F32 => DotFns {
            name: "f32*f32/avx2",
            dot: dot_f32,
            rows: rows_f32,
        },
        GgmlType::F16 => DotFns {
            name: "f16*f16/avx2",
            dot: dot_f16,
            rows: rows_f16,
        },
        GgmlType::BF16 => DotFns {
            name: "bf16*bf16/avx2",
            dot: dot_bf16,
            rows: rows_bf16,
        },
        GgmlType::Q8_0 => DotFns {
            name: "q8_0*q8_0/avx2",
            dot: dot_q8_0,
            rows: rows_q8_0,
        },
        GgmlType::MXFP4 => DotFns {
            name: "mxfp4*q8_0/avx2",
            dot: dot_mxfp4,
            rows: rows_mxfp4,
        },
        _ => return None,
    })
}

// ----------------------------------------------------------------------------------------------
// quantise / dequantise

/// ggml's x86 `quantize_row_q8_0`, operation for operation.
///
/// # Safety
/// AVX2/FMA/F16C present; `dst` holds `src.len() / 32` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    let sign = _mm256_set1_ps(-0.0);
    for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q8_0_BYTES)) {
        let x = x.as_ptr();
        let v0 = _mm256_loadu_ps(x);
        let v1 = _mm256_loadu_ps(x.add(8));
        let v2 = _mm256_loadu_ps(x.add(16));
        let v3 = _mm256_loadu_ps(x.add(24));
        let mut m = _mm256_andnot_ps(sign, v0);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v1));
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v2));
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v3));
        let mut m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let amax = _mm_cvtss_f32(m4);

        let d = amax / 127.0;
        let dh = _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(d)));
        out[..2].copy_from_slice(&(dh as u16).to_le_bytes());
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mul = _mm256_set1_ps(id);

        const RN: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let i0 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v0, mul)));
        let i1 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v1, mul)));
        let i2 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v2, mul)));
        let i3 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v3, mul)));
        // The packs work per 128-bit lane; the permute restores element order.
        let p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(out.as_mut_ptr().add(2).cast(), p);
    }
}

/// # Safety
/// AVX2/FMA/F16C present; `dst` holds `2 * src.len()` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    let n8 = src.len() & !7;
    for i in (0..n8).step_by(8) {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
        _mm_storeu_si128(dst.as_mut_ptr().add(2 * i).cast(), h);
    }
    for i in n8..src.len() {
        dst[2 * i..2 * i + 2].copy_from_slice(&shared::f32_to_f16(src[i]).to_le_bytes());
    }
}

/// # Safety
/// AVX2/FMA/F16C present; `src` holds `2 * dst.len()` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    let n8 = dst.len() & !7;
    for i in (0..n8).step_by(8) {
        _mm256_storeu_ps(
            dst.as_mut_ptr().add(i),
            F16E::load8(src.as_ptr().add(2 * i)),
        );
    }
    for (i, d) in dst.iter_mut().enumerate().skip(n8) {
        *d = F16E::get(src.as_ptr().add(2 * i));
    }
}

/// # Safety
/// AVX2/FMA/F16C present; `src` holds `2 * dst.len()` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    let n8 = dst.len() & !7;
    for i in (0..n8).step_by(8) {
        _mm256_storeu_ps(
            dst.as_mut_ptr().add(i),
            Bf16E::load8(src.as_ptr().add(2 * i)),
        );
    }
    for (i, d) in dst.iter_mut().enumerate().skip(n8) {
        *d = Bf16E::get(src.as_ptr().add(2 * i));
    }
}

/// Eight int8 at `p` times `d`.
#[inline(always)]
unsafe fn i8x8_times(p: *const u8, d: __m256) -> __m256 {
    let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()));
    _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)
}

/// # Safety
/// AVX2/FMA/F16C present; `src` holds `dst.len() / 32` Q8_0 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_0_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = _mm256_set1_ps(f16_at(b.as_ptr()));
        for k in 0..4 {
            _mm256_storeu_ps(
                y.as_mut_ptr().add(8 * k),
                i8x8_times(b.as_ptr().add(2 + 8 * k), d),
            );
        }
    }
}

/// # Safety
/// AVX2/FMA/F16C present; `src` holds `dst.len() / 32` MXFP4 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_mxfp4(src: &[u8], dst: &mut [f32]) {
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast()));
    let mut vals = [0u8; 32];
    for (b, y) in src.chunks_exact(MXFP4_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = _mm256_set1_ps(E8M0_HALF[b[0] as usize]);
        _mm256_storeu_si256(
            vals.as_mut_ptr().cast(),
            mxfp4_values(b.as_ptr().add(1), table),
        );
        for k in 0..4 {
            _mm256_storeu_ps(
                y.as_mut_ptr().add(8 * k),
                i8x8_times(vals.as_ptr().add(8 * k), d),
            );
        }
    }
}

pub(crate) fn quantize_fn(ty: GgmlType) -> Option<QuantFn> {
    Some(match ty {
        GgmlType::F32 => scalar::quantize_fn(GgmlType::F32)?,
        GgmlType::F16 => quantize_f16,
        // ggml converts BF16 activations in scalar code; so do we.
        GgmlType::BF16 => basic::quantize_bf16,
        GgmlType::Q8_0 => quantize_q8_0,
        // The MXFP4 quantiser is a reference for writing test files, not a hot path.
        GgmlType::MXFP4 => basic::quantize_mxfp4,
        // So are the weight quantisers; ggml's x86 Q8_K quantiser is its scalar reference.
        _ => return scalar::quantize_fn(ty),
    })
}

pub(crate) fn dequantize_fn(ty: GgmlType) -> Option<DequantFn> {
    Some(match ty {
        GgmlType::F32 => basic::dequantize_f32,
        GgmlType::F16 => dequantize_f16,
        GgmlType::BF16 => dequantize_bf16,
        GgmlType::Q8_0 => dequantize_q8_0,
        GgmlType::MXFP4 => dequantize_mxfp4,
        // Dequantisation of the low-bit formats is not a hot path (token embeddings, tests).
        _ => return scalar::dequantize_fn(ty),
    })
}
