//! AVX-512 F/BW/VL dot products (VNNI `vpdpbusd` when present), bit-identical to the scalar
//! reference: a 16-lane accumulator is one zmm register, and the integer kernels process two
//! blocks per zmm, lanes 0..8 for the first block and 8..16 for the second, which is exactly the
//! 8-lane layout of ggml's AVX2 kernels side by side.
//!
//! Quantisation and dequantisation use the AVX2 kernels (see `x86/avx512.rs`).
//!
//! Safety: every `unsafe fn` here needs AVX-512 F/BW/VL plus AVX2, FMA and F16C (and VNNI for
//! the `VNNI = true` kernels), and pointers valid for the whole blocks it reads.

use core::arch::x86_64::*;
use core::mem::MaybeUninit;

use crate::cache_hint::prefetch_l2;
use crate::kernel_fns::DotFns;
use crate::scalar::basic;
use crate::scalar::shared::{E8M0_HALF, KVALUES_MXFP4, MXFP4_BYTES, Q8_0_BYTES, QK};
use crate::x86::avx2::dot::{bf16_tail, f16_at, f16_tails, f32_tails, hsum8, q8_q8_lanes};
use crate::x86::avx2::dot::{Bf16E, FloatElem, F16E, F32E};
use crate::GgmlType;

/// Lanes 0..8 of a zmm.
#[inline(always)]
pub(crate) unsafe fn lo256(v: __m512) -> __m256 {
    _mm512_castps512_ps256(v)
}

/// Lanes 8..16 of a zmm (without AVX512DQ).
#[inline(always)]
pub(crate) unsafe fn hi256(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

/// Horizontal sum by halving, the order of `_mm512_reduce_add_ps`.
#[inline(always)]
pub(crate) unsafe fn hsum16(v: __m512) -> f32 {
    hsum8(_mm256_add_ps(lo256(v), hi256(v)))
}

/// Two 32-byte loads as one zmm.
#[inline(always)]
pub(crate) unsafe fn load_2x256(p0: *const u8, p1: *const u8) -> __m512i {
    let lo = _mm512_castsi256_si512(_mm256_loadu_si256(p0.cast()));
    _mm512_inserti64x4::<1>(lo, _mm256_loadu_si256(p1.cast()))
}

/// Sixteen elements of a float type (the AVX2 kernels' [`FloatElem`]) as one zmm.
trait Load16: FloatElem {
    /// Sixteen elements from `p` as f32.
    unsafe fn load16(p: *const u8) -> __m512;
}

impl Load16 for F32E {
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> __m512 {
        _mm512_loadu_ps(p.cast())
    }
}

impl Load16 for F16E {
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
}

impl Load16 for Bf16E {
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(p.cast()),
        )))
    }
}

/// Four 16-lane FMA accumulators over 64-element steps, reduced as ggml's
/// `GGML_F32_VEC_REDUCE`. Returns each row's sum of the first `n & !63` elements.
#[inline(always)]
unsafe fn fma64_rows<E: Load16, const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
) -> [f32; R] {
    let np = n & !63;
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let mut i = 0;
    while i < np {
        for j in 0..4 {
            let off = (i + 16 * j) * E::SIZE;
            let y = E::load16(a.add(off));
            for (r, acc) in acc.iter_mut().enumerate() {
                acc[j] = _mm512_fmadd_ps(E::load16(w.add(r * stride + off)), y, acc[j]);
            }
        }
        i += 64;
    }
    let mut res = [0.0f32; R];
    for (res, acc) in res.iter_mut().zip(&acc) {
        let s0 = _mm512_add_ps(acc[0], acc[2]);
        let s1 = _mm512_add_ps(acc[1], acc[3]);
        *res = hsum16(_mm512_add_ps(s0, s1));
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
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let mut i = 0;
    while i < np {
        for j in 0..2 {
            let off = (i + 16 * j) * 2;
            let y = Bf16E::load16(a.add(off));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = Bf16E::load16(w.add(r * stride + off));
                acc[j] = _mm512_add_ps(_mm512_mul_ps(x, y), acc[j]);
            }
        }
        i += 32;
    }
    for (r, acc) in acc.iter().enumerate() {
        let mut sum = 0.0f64;
        sum += hsum16(acc[0]) as f64;
        sum += hsum16(acc[1]) as f64;
        *out.add(r) = bf16_tail(sum, np, n, w.add(r * stride), a);
    }
}

/// `Σ u[4k..4k+4] * s[4k..4k+4]` per int32 lane (unsigned × signed bytes), with `vpdpbusd` or
/// `vpmaddubsw` + `vpmaddwd`; the 16-bit pair sums cannot saturate for our operands
/// (u ≤ 128 with |s| ≤ 128).
#[inline(always)]
pub(crate) unsafe fn dot_u8i8<const VNNI: bool>(u: __m512i, s: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s)
    } else {
        _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1))
    }
}

/// `-v` where `mask` is set, else `v` (per byte, wrapping).
#[inline(always)]
pub(crate) unsafe fn neg_where(v: __m512i, mask: __mmask64) -> __m512i {
    _mm512_mask_sub_epi8(v, mask, _mm512_setzero_si512(), v)
}

/// Q8_0 × Q8_0: per row one 8-lane FMA chain over the blocks in order (as the AVX2 kernel);
/// the integer part runs on two blocks per zmm.
#[inline(always)]
unsafe fn q8_0_rows<const R: usize, const VNNI: bool>(
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
    let mut ib = 0;
    while ib + 1 < nb {
        if R > 1 {
            prefetch_l2(
                next.wrapping_add(ib * R * Q8_0_BYTES),
                2 * R * Q8_0_BYTES + 64,
            );
        }
        let a0 = a.add(ib * Q8_0_BYTES);
        let a1 = a0.add(Q8_0_BYTES);
        let y = load_2x256(a0.add(2), a1.add(2));
        let (da0, da1) = (f16_at(a0), f16_at(a1));
        for (r, acc) in acc.iter_mut().enumerate() {
            let w0 = w.add(r * stride + ib * Q8_0_BYTES);
            let w1 = w0.add(Q8_0_BYTES);
            let x = load_2x256(w0.add(2), w1.add(2));
            // |x| and sign(y, x): y negated where x < 0 (where x == 0 the product is 0 anyway).
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
            let wb = w.add(r * stride + ib * Q8_0_BYTES);
            let q = q8_q8_lanes(_mm256_loadu_si256(wb.add(2).cast()), y);
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(wb) * da), q, *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// MXFP4 × Q8_0: two blocks per zmm, so the even/odd accumulators of ggml's AVX2 kernel are the
/// two halves of one register; the odd last block in scalar. Products are `|w|·sign(y, w)` as
/// ggml's `mul_add_epi8` (y negated where w < 0; where w == 0 the product is 0 anyway).
#[inline(always)]
unsafe fn mxfp4_rows<const R: usize, const VNNI: bool>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let nb = n / QK;
    let table = _mm512_broadcast_i32x4(_mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast()));
    let shifts = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); R];
    let mut ib = 0;
    while ib + 1 < nb {
        let a0 = a.add(ib * Q8_0_BYTES);
        let a1 = a0.add(Q8_0_BYTES);
        let y = load_2x256(a0.add(2), a1.add(2));
        let da = _mm512_mask_blend_ps(
            0xff00,
            _mm512_set1_ps(f16_at(a0)),
            _mm512_set1_ps(f16_at(a1)),
        );
        for (r, acc) in acc.iter_mut().enumerate() {
            let w0 = w.add(r * stride + ib * MXFP4_BYTES);
            let w1 = w0.add(MXFP4_BYTES);
            // [qs0, qs0, qs1, qs1]: low nibbles then high nibbles of each block.
            let q = _mm512_mask_blend_epi64(
                0xf0,
                _mm512_broadcast_i32x4(_mm_loadu_si128(w0.add(1).cast())),
                _mm512_broadcast_i32x4(_mm_loadu_si128(w1.add(1).cast())),
            );
            let idx = _mm512_and_si512(_mm512_srlv_epi32(q, shifts), m4);
            let v = _mm512_shuffle_epi8(table, idx);
            let sy = neg_where(y, _mm512_movepi8_mask(v));
            let p = dot_u8i8::<VNNI>(_mm512_abs_epi8(v), sy);
            let e = _mm512_mask_blend_ps(
                0xff00,
                _mm512_set1_ps(E8M0_HALF[*w0 as usize]),
                _mm512_set1_ps(E8M0_HALF[*w1 as usize]),
            );
            *acc = _mm512_fmadd_ps(_mm512_mul_ps(da, e), _mm512_cvtepi32_ps(p), *acc);
        }
        ib += 2;
    }
    for (r, acc) in acc.iter().enumerate() {
        let mut sum = hsum8(_mm256_add_ps(lo256(*acc), hi256(*acc)));
        if ib < nb {
            let wb = core::slice::from_raw_parts(w.add(r * stride + ib * MXFP4_BYTES), MXFP4_BYTES);
            let ab = core::slice::from_raw_parts(a.add(ib * Q8_0_BYTES), Q8_0_BYTES);
            sum = basic::mxfp4_tail(wb, ab, sum);
        }
        *out.add(r) = sum;
    }
}

entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_f32,
    rows_f32,
    f32_rows,
    4
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_f16,
    rows_f16,
    f16_rows,
    4
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_bf16,
    rows_bf16,
    bf16_rows,
    4
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_q8_0,
    rows_q8_0,
    q8_0_rows,
    4,
    false
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_mxfp4,
    rows_mxfp4,
    mxfp4_rows,
    4,
    false
);
entry_points!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    dot_q8_0_vnni,
    rows_q8_0_vnni_signed,
    q8_0_rows,
    4,
    true
);

/// Most blocks per row that [`rows_q8_0_vnni`] prepares on the stack (longer rows take
/// [`q8_0_rows`]).
const Q8_0_PREP_BLOCKS: usize = 256;

/// One Q8_0 activation row prepared for [`q8_0_rows_biased`], for its first `nb` blocks (the
/// rest of the arrays is never written nor read, so it is left uninitialised: zeroing it
/// would cost as much as a pass over the rows).
struct Q8_0Prep {
    /// Per block, `-128 · Σ y` over each group of four quants (what biasing the weights by
    /// 128 adds to `vpdpbusd`'s sums).
    neg_bias: [MaybeUninit<__m256i>; Q8_0_PREP_BLOCKS],
    /// Per block, the activation scale as f32.
    d: [MaybeUninit<f32>; Q8_0_PREP_BLOCKS],
}

/// Prepares the `nb` blocks of `a`; `false` (nothing usable) where a quant is -128, whose
/// product ggml's sign trick wraps (never produced by ggml's quantisers, but bytes are bytes).
#[inline(always)]
unsafe fn q8_0_prepare(nb: usize, a: *const u8, prep: &mut Q8_0Prep) -> bool {
    let m128 = _mm256_set1_epi8(i8::MIN);
    let mut bad = 0u32;
    for ib in 0..nb {
        let ab = a.add(ib * Q8_0_BYTES);
        let y = _mm256_loadu_si256(ab.add(2).cast());
        bad |= _mm256_cmpeq_epi8_mask(y, m128);
        // 128 (the unsigned byte 0x80) times each group of four quants, negated.
        let c = _mm256_dpbusd_epi32(_mm256_setzero_si256(), m128, y);
        prep.neg_bias[ib].write(_mm256_sub_epi32(_mm256_setzero_si256(), c));
        prep.d[ib].write(f16_at(ab));
    }
    bad == 0
}

/// Q8_0 × Q8_0 for `R` rows with VNNI on 8 lanes, one block per step: the weights biased to
/// unsigned (`x ^ 0x80 = x + 128`) go straight into `vpdpbusd`, whose accumulator starts at
/// the prepared `-128 · Σ y`, so each lane holds exactly the integer sum of [`q8_0_rows`]
/// (which needs `|x|`, `sign(y, x)` and a 2-block shuffle for it). The FMA chain per row is
/// the same, block by block, so the result is bit-identical; the pass issues about half the
/// instructions. `prep` holds the first `nb` blocks of `a`.
///
/// The rows go 8 blocks at a time: gather the R rows' 8 scales, then the 8 blocks' products.
/// Gathering the scales of whole rows first (an earlier form) left the memory idle while the
/// products ran and the products idle while the gathers waited on memory: cold-cache
/// throughput in `bench_gemm` went from 15–17 to 22–26 GB/s with this interleaving.
#[inline(always)]
unsafe fn q8_0_rows_biased<const R: usize>(
    nb: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    prep: &Q8_0Prep,
    out: *mut f32,
) {
    let da = prep.d.as_ptr().cast::<f32>();
    let offsets = _mm256_setr_epi32(0, 34, 68, 102, 136, 170, 204, 238);
    let bias = _mm256_set1_epi8(i8::MIN);
    let mut acc = [_mm256_setzero_ps(); R];
    // As in `q8_0_rows`: prefetch the next R rows into L2 as this group runs, the share of
    // them that matches the blocks of this step.
    let next = w.wrapping_add(R * stride);
    let mut scale = [[0f32; 8]; R];
    let mut ib0 = 0;
    while ib0 < nb {
        let len = (nb - ib0).min(8);
        if R > 1 {
            prefetch_l2(
                next.wrapping_add(ib0 * R * Q8_0_BYTES),
                len * R * Q8_0_BYTES,
            );
        }
        // Each row's scales times the activation's for this step's blocks (a short last step
        // masks the rest off, so nothing past it is read: 896-wide rows end in 4 blocks).
        let m = (0xffu32 >> (8 - len)) as __mmask8;
        let d_a = _mm256_maskz_loadu_ps(m, da.add(ib0));
        for (r, scale) in scale.iter_mut().enumerate() {
            let row = w.add(r * stride + ib0 * Q8_0_BYTES);
            // Four bytes from each block start: the f16 scale and the first 2 quants.
            let g =
                _mm256_mmask_i32gather_epi32::<1>(_mm256_setzero_si256(), m, offsets, row.cast());
            let d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(g));
            _mm256_storeu_ps(scale.as_mut_ptr(), _mm256_mul_ps(d, d_a));
        }
        for (k, c) in prep.neg_bias[ib0..ib0 + len].iter().enumerate() {
            let ib = ib0 + k;
            let y = _mm256_loadu_si256(a.add(ib * Q8_0_BYTES + 2).cast());
            let c = c.assume_init();
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_loadu_si256(w.add(r * stride + ib * Q8_0_BYTES + 2).cast());
                let p = _mm256_dpbusd_epi32(c, _mm256_xor_si256(x, bias), y);
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(scale[r][k]), _mm256_cvtepi32_ps(p), *acc);
            }
        }
        ib0 += len;
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// Q8_0 rows with VNNI: [`q8_0_rows_biased`] where the activation row can be prepared, else
/// the sign-trick kernel.
///
/// # Safety
/// The CPU has the enabled features; `w` holds `out.len()` rows `stride` bytes apart and `a`
/// the blocks of `n` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_q8_0_vnni(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
    let nb = n / QK;
    let mut prep = Q8_0Prep {
        neg_bias: [MaybeUninit::uninit(); Q8_0_PREP_BLOCKS],
        d: [MaybeUninit::uninit(); Q8_0_PREP_BLOCKS],
    };
    if nb > Q8_0_PREP_BLOCKS || !q8_0_prepare(nb, a.as_ptr(), &mut prep) {
        return rows_q8_0_vnni_signed(n, w, stride, a, out);
    }
    let rows = out.len();
    let (w, a, o) = (w.as_ptr(), a.as_ptr(), out.as_mut_ptr());
    let mut r = 0;
    while rows - r >= 4 {
        q8_0_rows_biased::<4>(nb, w.add(r * stride), stride, a, &prep, o.add(r));
        r += 4;
    }
    while r < rows {
        q8_0_rows_biased::<1>(nb, w.add(r * stride), stride, a, &prep, o.add(r));
        r += 1;
    }
}

entry_points!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    dot_mxfp4_vnni,
    rows_mxfp4_vnni,
    mxfp4_rows,
    4,
    true
);

/// The AVX-512 dot kernel for `ty`; the VNNI variants when `vnni` (the caller checked the CPU).
pub(crate) fn dot_fns(ty: GgmlType, vnni: bool) -> Option<DotFns> {
    Some(match (ty, vnni) {
        (GgmlType::F32, _) => DotFns {
            name: "f32*f32/avx512",
            dot: dot_f32,
            rows: rows_f32,
        },
        (GgmlType::F16, _) => DotFns {
            name: "f16*f16/avx512",
            dot: dot_f16,
            rows: rows_f16,
        },
        (GgmlType::BF16, _) => DotFns {
            name: "bf16*bf16/avx512",
            dot: dot_bf16,
            rows: rows_bf16,
        },
        (GgmlType::Q8_0, false) => DotFns {
            name: "q8_0*q8_0/avx512",
            dot: dot_q8_0,
            rows: rows_q8_0,
        },
        (GgmlType::Q8_0, true) => DotFns {
            name: "q8_0*q8_0/avx512vnni",
            dot: dot_q8_0_vnni,
            rows: rows_q8_0_vnni,
        },
        (GgmlType::MXFP4, false) => DotFns {
            name: "mxfp4*q8_0/avx512",
            dot: dot_mxfp4,
            rows: rows_mxfp4,
        },
        (GgmlType::MXFP4, true) => DotFns {
            name: "mxfp4*q8_0/avx512vnni",
            dot: dot_mxfp4_vnni,
            rows: rows_mxfp4_vnni,
        },
        _ => return None,
    })
}
