//! Q4_0, IQ4_NL and Q4_K products in the order of llama.cpp's *repacked* x86 kernels.
//!
//! On an AVX2 machine llama.cpp stores Q4_0, IQ4_NL and Q4_K weight matrices whose row count
//! is a multiple of 8 in an 8-row interleaved layout (`q4_0_8x8`, `iq4_nl_8x8`, `q4_K_8x8`) and
//! multiplies them with its own GEMV/GEMM kernels instead of `vec_dot`. Those accumulate
//! differently from `vec_dot` (which [`DotKernel::new`] mirrors): the integer part of each
//! block is exact, then one scalar FMA chain per output runs over the blocks in order:
//!
//! * **Q4_0 × Q8_0**: `acc = fma(isum_b as f32, d_w · d_a, acc)` per 32-element block, where
//!   `isum_b = Σ (q − 8)·a` and the scale product is rounded to f32 first;
//! * **IQ4_NL × Q8_0**: the same with `isum_b = Σ kvalues[q]·a` (ggml runs both through one
//!   kernel template with a 16-entry value table); `vec_dot` instead keeps two 8-lane
//!   accumulators for even and odd blocks;
//! * **Q4_K × Q8_K**: per 256-element super-block, `isum = Σ_j sc_j · Σ q·a` over the eight
//!   sub-blocks and `imin = Σ_j m_j · (bsum_{2j} + bsum_{2j+1})`, then
//!   `acc = fma(isum as f32, d_w · d_a, acc)` and `acc_min = fma(imin as f32, dmin_w · d_a,
//!   acc_min)`; the result is `acc − acc_min`.
//!
//! llama.cpp's dense matmul hands the tokens of a batch in groups of four to its GEMM kernel and
//! the remaining `n % 4` tokens to the GEMV kernel. For Q4_0 both sum in block order. For Q4_K
//! the GEMM kernel runs its two FMA chains per pair of sub-blocks (64 elements: `isum` and
//! `imin` of sub-blocks `2p, 2p+1`) instead of per super-block; [`DotKernel::dot_tokens`]
//! applies that order to the grouped tokens. (Expert matmuls, `mul_mat_id`, use the GEMV order
//! for every token: [`DotKernel::dot`].)
//!
//! [`DotKernel::for_matrix`] picks these kernels where llama.cpp would repack; every ISA returns
//! bit-identical results.

use crate::error::check_isa;
use crate::kernel_fns::{DotFn, DotFns};
use crate::scalar::iq_grids::KVALUES_IQ4NL;
use crate::scalar::iquants::IQ4_NL_BYTES;
use crate::scalar::shared::{f16_to_f32, rd_f32, rd_u16, QK};
use crate::{DotKernel, GgmlType, Isa, QuantError};

const Q4_0_BYTES: usize = 18;
const Q8_0_BYTES: usize = 34;
const QK_K: usize = 256;
const Q4_K_BYTES: usize = 144;
const Q8_K_BYTES: usize = 292;

impl DotKernel {
    /// The kernel llama.cpp's CPU backend uses for a weight matrix of type `weight` with
    /// `n_rows` output rows (per expert for stacked experts): the repacked-order Q4_0/IQ4_NL/Q4_K
    /// kernels of this module when `n_rows` is a multiple of 8, else [`DotKernel::best`].
    pub fn for_matrix(weight: GgmlType, n_rows: usize) -> Result<DotKernel, QuantError> {
        let isa = Isa::best();
        match repacked_fns(weight, isa) {
            Some(fns) if n_rows.is_multiple_of(8) => {
                check_isa(isa)?;
                Ok(DotKernel::from_fns(weight, isa, fns))
            }
            _ => DotKernel::best(weight),
        }
    }

    /// Whether this is one of the repacked-order kernels ([`DotKernel::for_matrix`]), whose
    /// batches sum in that order rather than through a [`crate::GemmKernel`].
    pub fn is_repacked(&self) -> bool {
        self.name().contains(REPACKED)
    }

    /// The dot of a token in one of a dense matmul's complete groups of four with a repacked
    /// kernel: the GEMM order for Q4_K, [`DotKernel::dot`] for Q4_0.
    pub(crate) fn dot_repacked_grouped(&self, n: usize, weight_row: &[u8], act_row: &[u8]) -> f32 {
        if self.weight_type() != GgmlType::Q4_K {
            return self.dot(n, weight_row, act_row);
        }
        let (wb, ab) = (self.weight_row_bytes(n), self.act_row_bytes(n));
        let f = pairwise_fn(self.isa());
        // SAFETY: the ISA was checked when the kernel was made; the slices hold whole blocks of
        // `n` elements (a too-short slice panics here).
        unsafe { f(n / QK_K * QK_K, &weight_row[..wb], &act_row[..ab]) }
    }
}

/// The repacked-order kernel for `weight` on `isa` (the ISA checked), for tests that force an
/// ISA below the best.
#[cfg(test)]
pub(crate) fn repacked_on(weight: GgmlType, isa: Isa) -> Option<DotKernel> {
    check_isa(isa).ok()?;
    repacked_fns(weight, isa).map(|fns| DotKernel::from_fns(weight, isa, fns))
}

/// The GEMM-order Q4_K dot for `isa`.
fn pairwise_fn(isa: Isa) -> DotFn {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        return avx2::dot_q4_k_pairwise;
    }
    let _ = isa;
    dot_q4_k_pairwise
}

/// Marker in the names of this module's kernels.
const REPACKED: &str = "/repacked";

/// The repacked-order kernels for `weight` on `isa`, if llama.cpp repacks that type.
fn repacked_fns(weight: GgmlType, isa: Isa) -> Option<DotFns> {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        return match weight {
            GgmlType::Q4_0 => Some(DotFns {
                name: "q4_0*q8_0/repacked (avx2)",
                dot: avx2::dot_q4_0,
                rows: avx2::rows_q4_0,
            }),
            GgmlType::IQ4_NL => Some(DotFns {
                name: "iq4_nl*q8_0/repacked (avx2)",
                dot: avx2::dot_iq4_nl,
                rows: avx2::rows_iq4_nl,
            }),
            GgmlType::Q4_K if isa == Isa::Avx512 && crate::x86::features::has_avx512_vnni() => {
                Some(DotFns {
                    name: "q4_K*q8_K/repacked (avx512vnni)",
                    dot: avx2::dot_q4_k,
                    rows: q4k_rows::rows_q4_k_vnni,
                })
            }
            GgmlType::Q4_K => Some(DotFns {
                name: "q4_K*q8_K/repacked (avx2)",
                dot: avx2::dot_q4_k,
                rows: q4k_rows::rows_q4_k_avx2,
            }),
            _ => None,
        };
    }
    let _ = isa;
    match weight {
        GgmlType::Q4_0 => Some(scalar_kernel!(
            "q4_0*q8_0/repacked (scalar)",
            dot_q4_0_blockwise
        )),
        GgmlType::IQ4_NL => Some(scalar_kernel!(
            "iq4_nl*q8_0/repacked (scalar)",
            dot_iq4_nl_blockwise
        )),
        GgmlType::Q4_K => Some(scalar_kernel!(
            "q4_K*q8_K/repacked (scalar)",
            dot_q4_k_blockwise
        )),
        _ => None,
    }
}

/// Q4_0 × Q8_0 in block order (scalar reference).
pub(crate) fn dot_q4_0_blockwise(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (wb, ab) in w
        .chunks_exact(Q4_0_BYTES)
        .zip(a.chunks_exact(Q8_0_BYTES))
        .take(n / QK)
    {
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            let q = wb[2 + j];
            isum += ((q & 0x0f) as i32 - 8) * ab[2 + j] as i8 as i32;
            isum += ((q >> 4) as i32 - 8) * ab[2 + QK / 2 + j] as i8 as i32;
        }
        let scale = f16_to_f32(rd_u16(wb, 0)) * f16_to_f32(rd_u16(ab, 0));
        acc = (isum as f32).mul_add(scale, acc);
    }
    acc
}

/// IQ4_NL × Q8_0 in block order (scalar reference): each block's exact integer dot of the
/// table values with the activation bytes, then one FMA with `d_w · d_a`.
pub(crate) fn dot_iq4_nl_blockwise(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (wb, ab) in w
        .chunks_exact(IQ4_NL_BYTES)
        .zip(a.chunks_exact(Q8_0_BYTES))
        .take(n / QK)
    {
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            let q = wb[2 + j];
            isum += KVALUES_IQ4NL[(q & 0x0f) as usize] as i32 * ab[2 + j] as i8 as i32;
            isum += KVALUES_IQ4NL[(q >> 4) as usize] as i32 * ab[2 + QK / 2 + j] as i8 as i32;
        }
        let scale = f16_to_f32(rd_u16(wb, 0)) * f16_to_f32(rd_u16(ab, 0));
        acc = (isum as f32).mul_add(scale, acc);
    }
    acc
}

/// The six-bit scale and min of sub-block `j` of a Q4_K super-block (`get_scale_min_k4`).
#[inline(always)]
fn q4_k_scale_min(scales: &[u8], j: usize) -> (i32, i32) {
    if j < 4 {
        ((scales[j] & 63) as i32, (scales[j + 4] & 63) as i32)
    } else {
        (
            ((scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4)) as i32,
            ((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)) as i32,
        )
    }
}

/// The activation block's sum of elements `16i..16i+16` (`bsums[i]`).
#[inline(always)]
fn q8_k_bsum(ab: &[u8], i: usize) -> i32 {
    i16::from_le_bytes([ab[4 + QK_K + 2 * i], ab[4 + QK_K + 2 * i + 1]]) as i32
}

/// `imin` of one super-block: the exact `Σ_j m_j · (bsum_{2j} + bsum_{2j+1})`.
#[inline(always)]
fn q4_k_imin(wb: &[u8], ab: &[u8]) -> i32 {
    (0..8)
        .map(|j| {
            q4_k_scale_min(&wb[4..16], j).1 * (q8_k_bsum(ab, 2 * j) + q8_k_bsum(ab, 2 * j + 1))
        })
        .sum()
}

/// Folds one super-block's integer sums into the two FMA chains.
#[inline(always)]
fn q4_k_step(wb: &[u8], ab: &[u8], isum: i32, acc: &mut f32, acc_min: &mut f32) {
    let da = rd_f32(ab, 0);
    let d = f16_to_f32(rd_u16(wb, 0)) * da;
    let dmin = f16_to_f32(rd_u16(wb, 1)) * da;
    *acc = (isum as f32).mul_add(d, *acc);
    *acc_min = (q4_k_imin(wb, ab) as f32).mul_add(dmin, *acc_min);
}

/// Q4_K × Q8_K in super-block order (scalar reference).
pub(crate) fn dot_q4_k_blockwise(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for (wb, ab) in w
        .chunks_exact(Q4_K_BYTES)
        .zip(a.chunks_exact(Q8_K_BYTES))
        .take(n / QK_K)
    {
        let mut isum = 0i32;
        for j in 0..8 {
            let (sc, _) = q4_k_scale_min(&wb[4..16], j);
            let qs = &wb[16 + 32 * (j / 2)..16 + 32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            let sub: i32 = qs
                .iter()
                .zip(&ab[4 + 32 * j..4 + 32 * j + 32])
                .map(|(&q, &y)| ((q >> shift) & 0x0f) as i32 * y as i8 as i32)
                .sum();
            isum += sc * sub;
        }
        q4_k_step(wb, ab, isum, &mut acc, &mut acc_min);
    }
    acc - acc_min
}

/// Q4_K × Q8_K in the order of llama.cpp's repacked GEMM (tokens in groups of four): both FMA
/// chains advance once per pair of sub-blocks.
pub(crate) fn dot_q4_k_pairwise(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for (wb, ab) in w
        .chunks_exact(Q4_K_BYTES)
        .zip(a.chunks_exact(Q8_K_BYTES))
        .take(n / QK_K)
    {
        let da = rd_f32(ab, 0);
        let d = f16_to_f32(rd_u16(wb, 0)) * da;
        let dmin = f16_to_f32(rd_u16(wb, 1)) * da;
        for p in 0..4 {
            let qs = &wb[16 + 32 * p..16 + 32 * p + 32];
            let (mut isum, mut imin) = (0i32, 0i32);
            for (j, shift) in [(2 * p, 0), (2 * p + 1, 4)] {
                let (sc, m) = q4_k_scale_min(&wb[4..16], j);
                let sub: i32 = qs
                    .iter()
                    .zip(&ab[4 + 32 * j..4 + 32 * j + 32])
                    .map(|(&q, &y)| ((q >> shift) & 0x0f) as i32 * y as i8 as i32)
                    .sum();
                isum += sc * sub;
                imin += m * (q8_k_bsum(ab, 2 * j) + q8_k_bsum(ab, 2 * j + 1));
            }
            acc = (isum as f32).mul_add(d, acc);
            acc_min = (imin as f32).mul_add(dmin, acc_min);
        }
    }
    acc - acc_min
}

#[cfg(target_arch = "x86_64")]
mod q4k_rows;

/// AVX2 versions: the integer sums of a block in SIMD, the FMA chains as in the scalar code.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{
        q4_k_scale_min, q4_k_step, q8_k_bsum, IQ4_NL_BYTES, KVALUES_IQ4NL, Q4_0_BYTES, Q4_K_BYTES,
        Q8_0_BYTES, Q8_K_BYTES, QK, QK_K,
    };
    use crate::scalar::shared::{f16_to_f32, rd_f32, rd_u16};

    /// Sum of the eight i32 lanes.
    #[inline(always)]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// Q4_0 × Q8_0 over the blocks of one row.
    #[inline(always)]
    unsafe fn q4_0_row(n: usize, w: *const u8, a: *const u8) -> f32 {
        let low = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = 0f32;
        for b in 0..n / QK {
            let wb = w.add(b * Q4_0_BYTES);
            let ab = a.add(b * Q8_0_BYTES);
            // SAFETY (caller): both blocks are in bounds.
            let raw = _mm_loadu_si128(wb.add(2) as *const __m128i);
            let q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(raw), raw), low);
            let y = _mm256_loadu_si256(ab.add(2) as *const __m256i);
            // Σ q·a with q in 0..16, minus 8·Σ a: exact in i32.
            let qa = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), ones);
            let sa = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), y), ones);
            let isum = hsum_i32(qa) - 8 * hsum_i32(sa);
            let scale = f16_to_f32(u16::from_le_bytes([*wb, *wb.add(1)]))
                * f16_to_f32(u16::from_le_bytes([*ab, *ab.add(1)]));
            acc = (isum as f32).mul_add(scale, acc);
        }
        acc
    }

    /// IQ4_NL × Q8_0 over the blocks of one row: table values by byte shuffle, products
    /// widened to i16 (exact for every byte), one FMA per block.
    #[inline(always)]
    unsafe fn iq4_nl_row(n: usize, w: *const u8, a: *const u8) -> f32 {
        let low = _mm_set1_epi8(0x0f);
        let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
        let mut acc = 0f32;
        for b in 0..n / QK {
            let wb = w.add(b * IQ4_NL_BYTES);
            let ab = a.add(b * Q8_0_BYTES);
            // SAFETY (caller): both blocks are in bounds.
            let raw = _mm_loadu_si128(wb.add(2) as *const __m128i);
            let q_lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, low));
            let q_hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(raw), low));
            let y_lo = _mm_loadu_si128(ab.add(2) as *const __m128i);
            let y_hi = _mm_loadu_si128(ab.add(2 + QK / 2) as *const __m128i);
            let p_lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(q_lo), _mm256_cvtepi8_epi16(y_lo));
            let p_hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(q_hi), _mm256_cvtepi8_epi16(y_hi));
            let isum = hsum_i32(_mm256_add_epi32(p_lo, p_hi));
            let scale = f16_to_f32(u16::from_le_bytes([*wb, *wb.add(1)]))
                * f16_to_f32(u16::from_le_bytes([*ab, *ab.add(1)]));
            acc = (isum as f32).mul_add(scale, acc);
        }
        acc
    }

    /// The scaled integer sums of sub-blocks `2p` and `2p + 1` of a Q4_K super-block, as
    /// eight i32 lanes.
    #[inline(always)]
    unsafe fn q4_k_pair(wb: &[u8], ab: &[u8], p: usize) -> __m256i {
        let low = _mm256_set1_epi8(0x0f);
        // SAFETY (caller): `wb`/`ab` are whole super-blocks, so these 32-byte loads are in bounds.
        let raw = _mm256_loadu_si256(wb.as_ptr().add(16 + 32 * p) as *const __m256i);
        let lo = _mm256_and_si256(raw, low);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low);
        let y_lo = _mm256_loadu_si256(ab.as_ptr().add(4 + 64 * p) as *const __m256i);
        let y_hi = _mm256_loadu_si256(ab.as_ptr().add(4 + 64 * p + 32) as *const __m256i);
        let (sc_lo, _) = q4_k_scale_min(&wb[4..16], 2 * p);
        let (sc_hi, _) = q4_k_scale_min(&wb[4..16], 2 * p + 1);
        // Pair sums ≤ 2·15·128 fit i16; scaled by ≤ 63 in i32.
        let p_lo = _mm256_madd_epi16(
            _mm256_maddubs_epi16(lo, y_lo),
            _mm256_set1_epi16(sc_lo as i16),
        );
        let p_hi = _mm256_madd_epi16(
            _mm256_maddubs_epi16(hi, y_hi),
            _mm256_set1_epi16(sc_hi as i16),
        );
        _mm256_add_epi32(p_lo, p_hi)
    }

    /// Q4_K × Q8_K over the super-blocks of one row.
    #[inline(always)]
    pub(super) unsafe fn q4_k_row(n: usize, w: *const u8, a: *const u8) -> f32 {
        let (mut acc, mut acc_min) = (0f32, 0f32);
        for b in 0..n / QK_K {
            // SAFETY (caller): both super-blocks are in bounds.
            let wb = std::slice::from_raw_parts(w.add(b * Q4_K_BYTES), Q4_K_BYTES);
            let ab = std::slice::from_raw_parts(a.add(b * Q8_K_BYTES), Q8_K_BYTES);
            let mut isum = _mm256_setzero_si256();
            for p in 0..4 {
                isum = _mm256_add_epi32(isum, q4_k_pair(wb, ab, p));
            }
            q4_k_step(wb, ab, hsum_i32(isum), &mut acc, &mut acc_min);
        }
        acc - acc_min
    }

    /// # Safety
    /// The CPU has AVX2/FMA/F16C; `w` and `a` hold the blocks of `n` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_k_pairwise(n: usize, w: &[u8], a: &[u8]) -> f32 {
        let (mut acc, mut acc_min) = (0f32, 0f32);
        for (wb, ab) in w
            .chunks_exact(Q4_K_BYTES)
            .zip(a.chunks_exact(Q8_K_BYTES))
            .take(n / QK_K)
        {
            let da = rd_f32(ab, 0);
            let d = f16_to_f32(rd_u16(wb, 0)) * da;
            let dmin = f16_to_f32(rd_u16(wb, 1)) * da;
            for p in 0..4 {
                let isum = hsum_i32(q4_k_pair(wb, ab, p));
                let imin: i32 = (2 * p..2 * p + 2)
                    .map(|j| {
                        q4_k_scale_min(&wb[4..16], j).1
                            * (q8_k_bsum(ab, 2 * j) + q8_k_bsum(ab, 2 * j + 1))
                    })
                    .sum();
                acc = (isum as f32).mul_add(d, acc);
                acc_min = (imin as f32).mul_add(dmin, acc_min);
            }
        }
        acc - acc_min
    }

    /// # Safety
    /// The CPU has AVX2/FMA/F16C; `w` and `a` hold the blocks of `n` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
        debug_assert!(w.len() >= n / QK * Q4_0_BYTES && a.len() >= n / QK * Q8_0_BYTES);
        q4_0_row(n, w.as_ptr(), a.as_ptr())
    }

    /// # Safety
    /// The CPU has AVX2/FMA/F16C; `w` holds `out.len()` rows `stride` bytes apart, `a` the
    /// blocks of `n` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_q4_0(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
        for (r, o) in out.iter_mut().enumerate() {
            *o = q4_0_row(n, w.as_ptr().add(r * stride), a.as_ptr());
        }
    }

    /// # Safety
    /// The CPU has AVX2/FMA/F16C; `w` and `a` hold the blocks of `n` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_iq4_nl(n: usize, w: &[u8], a: &[u8]) -> f32 {
        debug_assert!(w.len() >= n / QK * IQ4_NL_BYTES && a.len() >= n / QK * Q8_0_BYTES);
        iq4_nl_row(n, w.as_ptr(), a.as_ptr())
    }

    /// # Safety
    /// The CPU has AVX2/FMA/F16C; `w` holds `out.len()` rows `stride` bytes apart, `a` the
    /// blocks of `n` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_iq4_nl(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
        for (r, o) in out.iter_mut().enumerate() {
            *o = iq4_nl_row(n, w.as_ptr().add(r * stride), a.as_ptr());
        }
    }

    /// # Safety
    /// The CPU has AVX2/FMA/F16C; `w` and `a` hold the blocks of `n` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
        debug_assert!(w.len() >= n / QK_K * Q4_K_BYTES && a.len() >= n / QK_K * Q8_K_BYTES);
        q4_k_row(n, w.as_ptr(), a.as_ptr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{vec_dot_type, BatchKind};

    /// Deterministic bytes.
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    fn floats(n: usize, seed: u64) -> Vec<f32> {
        bytes(4 * n, seed)
            .chunks_exact(4)
            .map(|b| {
                (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) >> 8) as f32 / (1u32 << 23) as f32
                    - 1.0
            })
            .collect()
    }

    /// Weight blocks with sane (finite, small) f16 scales at `scale_at` offsets.
    fn weights(ty: GgmlType, n: usize, rows: usize, seed: u64) -> Vec<u8> {
        let mut w = bytes(ty.row_bytes(n as u64).unwrap() as usize * rows, seed);
        let (block, scales): (usize, &[usize]) = match ty {
            GgmlType::Q4_0 | GgmlType::IQ4_NL => (Q4_0_BYTES, &[0]),
            _ => (Q4_K_BYTES, &[0, 2]),
        };
        for (i, b) in w.chunks_exact_mut(block).enumerate() {
            for &o in scales {
                let v = half::f16::from_f32(0.001 + (i % 7) as f32 * 0.0003).to_bits();
                b[o..o + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        w
    }

    fn acts(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
        let act = vec_dot_type(ty);
        let mut a = vec![0u8; act.row_bytes(n as u64).unwrap() as usize];
        crate::quantize_row(act, &floats(n, seed), &mut a).unwrap();
        a
    }

    /// The block-order scalar reference of `ty`.
    fn blockwise(ty: GgmlType) -> fn(usize, &[u8], &[u8]) -> f32 {
        match ty {
            GgmlType::Q4_0 => dot_q4_0_blockwise,
            GgmlType::IQ4_NL => dot_iq4_nl_blockwise,
            _ => dot_q4_k_blockwise,
        }
    }

    const TYPES: [GgmlType; 3] = [GgmlType::Q4_0, GgmlType::IQ4_NL, GgmlType::Q4_K];

    #[test]
    fn blockwise_matches_dequantized_sum() {
        for ty in TYPES {
            let n = 512;
            let w = weights(ty, n, 1, 7);
            let a = acts(ty, n, 9);
            let (mut wf, mut af) = (vec![0f32; n], vec![0f32; n]);
            crate::dequantize_row(ty, &w, &mut wf).unwrap();
            crate::dequantize_row(vec_dot_type(ty), &a, &mut af).unwrap();
            let exact: f64 = wf.iter().zip(&af).map(|(x, y)| *x as f64 * *y as f64).sum();
            let mag: f64 = wf
                .iter()
                .zip(&af)
                .map(|(x, y)| (*x as f64 * *y as f64).abs())
                .sum();
            let got = blockwise(ty)(n, &w, &a);
            assert!(
                ((got as f64) - exact).abs() <= 1e-5 * mag,
                "{ty:?}: {got} vs {exact}"
            );
        }
    }

    #[test]
    fn every_isa_matches_the_scalar_order() {
        for ty in TYPES {
            for n in [256, 768, 4864] {
                // Two groups of eight rows and five single ones.
                let rows = 21;
                let w = weights(ty, n, rows, n as u64);
                let a = acts(ty, n, 3 + n as u64);
                let stride = ty.row_bytes(n as u64).unwrap() as usize;
                let want: Vec<f32> = w
                    .chunks_exact(stride)
                    .map(|r| blockwise(ty)(n, r, &a))
                    .collect();
                for isa in Isa::available() {
                    let fns = repacked_fns(ty, isa).unwrap();
                    let mut out = vec![0f32; rows];
                    // SAFETY: `isa` is available on this CPU; sizes are whole blocks.
                    unsafe { (fns.rows)(n, &w, stride, &a, &mut out) };
                    assert_eq!(out, want, "{ty:?} n={n} {isa}");
                    // SAFETY: as above.
                    let one = unsafe { (fns.dot)(n, &w[..stride], &a) };
                    assert_eq!(one.to_bits(), want[0].to_bits(), "{ty:?} n={n} {isa}");
                    if ty == GgmlType::Q4_K {
                        // SAFETY: as above.
                        let pair = unsafe { pairwise_fn(isa)(n, &w[..stride], &a) };
                        assert_eq!(
                            pair.to_bits(),
                            dot_q4_k_pairwise(n, &w[..stride], &a).to_bits()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn grouped_tokens_take_the_pairwise_order() {
        let n = 1024;
        let w = weights(GgmlType::Q4_K, n, 1, 11);
        let k = DotKernel::for_matrix(GgmlType::Q4_K, 8).unwrap();
        let ab = k.act_row_bytes(n);
        let all: Vec<u8> = (0..6)
            .flat_map(|t| acts(GgmlType::Q4_K, n, 12 + t))
            .collect();
        let row = |t: usize| &all[t * ab..(t + 1) * ab];
        // Tokens 0..4 of 6 are one group of four; 4 and 5 go through the GEMV order.
        let mut out = [0f32; 6];
        k.dot_tokens(BatchKind::Dense, n, &w, &all, &mut out);
        for (t, &got) in out.iter().enumerate() {
            let want = if t < 4 {
                dot_q4_k_pairwise(n, &w, row(t))
            } else {
                dot_q4_k_blockwise(n, &w, row(t))
            };
            assert_eq!(got.to_bits(), want.to_bits(), "token {t}");
            // Both orders sum the same products.
            let other = dot_q4_k_blockwise(n, &w, row(t));
            assert!((got - other).abs() <= 1e-5 * other.abs().max(1.0));
        }
        // Expert matmuls use the GEMV order for every token.
        k.dot_tokens(BatchKind::Expert, n, &w, &all, &mut out);
        for (t, &got) in out.iter().enumerate() {
            assert_eq!(
                got.to_bits(),
                dot_q4_k_blockwise(n, &w, row(t)).to_bits(),
                "token {t}"
            );
        }
        // Repacked Q4_0 has one order.
        let wq = weights(GgmlType::Q4_0, 64, 1, 1);
        let k0 = DotKernel::for_matrix(GgmlType::Q4_0, 8).unwrap();
        let a0: Vec<u8> = (0..4)
            .flat_map(|t| acts(GgmlType::Q4_0, 64, 2 + t))
            .collect();
        let mut out0 = [0f32; 4];
        k0.dot_tokens(BatchKind::Dense, 64, &wq, &a0, &mut out0);
        assert_eq!(out0[0], k0.dot(64, &wq, &a0[..k0.act_row_bytes(64)]));
    }

    /// A dense IQ4_NL matrix (the shared experts of DeepSeek stand-ins) multiplies in
    /// llama.cpp's repacked block order for one token and for batches, not in `vec_dot`'s
    /// even/odd order, whose bits differ.
    #[test]
    fn iq4_nl_matrices_take_the_block_order() {
        let (n, rows) = (256, 16);
        let ty = GgmlType::IQ4_NL;
        let w = weights(ty, n, rows, 5);
        let stride = ty.row_bytes(n as u64).unwrap() as usize;
        let k = DotKernel::for_matrix(ty, rows).unwrap();
        assert!(k.is_repacked(), "{}", k.name());
        let n_tokens = 7;
        let acts: Vec<u8> = (0..n_tokens as u64)
            .flat_map(|t| acts(ty, n, 40 + t))
            .collect();
        let ab = k.act_row_bytes(n);
        let mut differs = 0;
        for kind in [BatchKind::Dense, BatchKind::Expert] {
            let mut out = vec![0f32; rows * n_tokens];
            k.dot_tokens_rows(kind, n, &w, &acts, n_tokens, &mut out);
            for (r, row) in w.chunks_exact(stride).enumerate() {
                let mut one = [0f32; 1];
                k.dot_rows(n, row, &acts[..ab], &mut one);
                assert_eq!(
                    one[0].to_bits(),
                    dot_iq4_nl_blockwise(n, row, &acts[..ab]).to_bits()
                );
                for t in 0..n_tokens {
                    let a = &acts[t * ab..(t + 1) * ab];
                    let want = dot_iq4_nl_blockwise(n, row, a);
                    assert_eq!(
                        out[r * n_tokens + t].to_bits(),
                        want.to_bits(),
                        "{kind:?} {r} {t}"
                    );
                    let vec_dot = DotKernel::best(ty).unwrap().dot(n, row, a);
                    assert!((vec_dot - want).abs() <= 1e-5 * want.abs().max(1.0));
                    differs += usize::from(vec_dot.to_bits() != want.to_bits());
                }
            }
        }
        // The orders differ in the last bits for some of these products.
        assert!(differs > 0);
        // Row counts llama.cpp does not repack keep `vec_dot`.
        assert!(!DotKernel::for_matrix(ty, 12).unwrap().is_repacked());
    }

    #[test]
    fn for_matrix_repacks_only_multiples_of_eight() {
        let k = DotKernel::for_matrix(GgmlType::Q4_K, 896).unwrap();
        assert!(k.name().contains(REPACKED));
        let k = DotKernel::for_matrix(GgmlType::Q4_K, 900).unwrap();
        assert!(!k.name().contains(REPACKED));
        let k = DotKernel::for_matrix(GgmlType::Q8_0, 896).unwrap();
        assert_eq!(k.name(), DotKernel::best(GgmlType::Q8_0).unwrap().name());
    }

    #[test]
    fn q4_0_block_order_by_hand() {
        // Two blocks: weights all 9 (value +1), activations all 1 → isum 32 per block.
        let mut w = vec![0u8; 2 * Q4_0_BYTES];
        let mut a = vec![0u8; 2 * Q8_0_BYTES];
        for (b, (wb, ab)) in w
            .chunks_exact_mut(Q4_0_BYTES)
            .zip(a.chunks_exact_mut(Q8_0_BYTES))
            .enumerate()
        {
            wb[..2].copy_from_slice(
                &half::f16::from_f32(0.5 * (b + 1) as f32)
                    .to_bits()
                    .to_le_bytes(),
            );
            wb[2..].fill(0x99);
            ab[..2].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
            ab[2..].fill(1);
        }
        // fma(32, 0.125, 0) = 4, then fma(32, 0.25, 4) = 12.
        assert_eq!(dot_q4_0_blockwise(64, &w, &a), 12.0);
    }
}
