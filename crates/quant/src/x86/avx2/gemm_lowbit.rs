//! AVX2 + FMA + F16C GEMM kernels for the legacy 32-element formats Q4_0, Q5_0 (× Q8_0) and
//! Q4_1, Q5_1 (× Q8_1), bit-identical to their `vec_dot` kernels (`scalar/legacy.rs`) for
//! every row and token: per block eight int32 lanes (lane `k` sums elements `4k..4k+4`, ggml's
//! sign trick for Q4_0/Q5_0, unsigned × signed bytes for Q4_1/Q5_1), converted and
//! fused-multiply-added with the f32 product `d_w · d_a` into an 8-lane accumulator, summed by
//! halving at the end; Q4_1/Q5_1 add their FMA chain of `m_w · s_a` last.
//!
//! Tiles of 1 row × 8 tokens (one accumulator register per token) in chunks of 64 tokens, as
//! the AVX2 Q8_0 kernel: each weight block is decoded once per tile, the tile's eight scale
//! products are one vector multiply (the activations' scales by block in
//! `ActBlocks::block_scales`) read back per token by a broadcast load, and the `m_w · s_a`
//! chains of the eight tokens are one vector FMA per block (`ActBlocks::block_sums`).
//!
//! The [`Format`]s are shared with the AVX-512 kernels (`x86/avx512/gemm_lowbit.rs`).
//!
//! Safety: every `unsafe fn` here needs AVX2, FMA and F16C, and the slice contract of
//! [`GemmFn`].

use core::arch::x86_64::*;

use crate::gemm_layout::{row_ptrs, ActBlocks, GemmFn, LOWBIT_TILE_TOKENS_AVX2};
use crate::scalar::legacy::{Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q8_1_BYTES};
use crate::scalar::shared::{Q8_0_BYTES, QK};
use crate::x86::avx2::dot::{f16_at, hsum8};
use crate::x86::avx2::gemm::broadcast_load;
use crate::x86::avx2::lowbit::{bits32, nibbles32};
use crate::GgmlType;

/// One of the four weight formats, as the GEMM kernels read its blocks.
pub(crate) trait Format {
    /// Bytes per weight block.
    const BYTES: usize;
    /// Whether the format has a min (Q4_1/Q5_1: unsigned values, Q8_1 activations, the
    /// `m_w · s_a` chain); else its values are signed and ggml multiplies them by the sign trick.
    const MIN: bool;
    /// The 32 values of the block at `wb` as bytes, element `j` in byte `j`: `q - 8` (Q4_0),
    /// `q - 16` (Q5_0) as signed bytes, `q` (Q4_1, Q5_1; at most 31).
    ///
    /// # Safety
    /// The CPU has AVX2; `wb` points at a whole block.
    unsafe fn values(wb: *const u8) -> __m256i;

    /// Bytes per activation block (Q8_1 for formats with a min, else Q8_0).
    const ACT_BYTES: usize = if Self::MIN { Q8_1_BYTES } else { Q8_0_BYTES };
    /// Offset of the 32 quants in an activation block.
    const ACT_QS: usize = Self::ACT_BYTES - QK;
}

/// Q4_0: `d: f16`, 16 nibble bytes.
pub(crate) struct Q40;
/// Q4_1: `d: f16`, `m: f16`, 16 nibble bytes.
pub(crate) struct Q41;
/// Q5_0: `d: f16`, `qh: u32`, 16 nibble bytes.
pub(crate) struct Q50;
/// Q5_1: `d: f16`, `m: f16`, `qh: u32`, 16 nibble bytes.
pub(crate) struct Q51;

impl Format for Q40 {
    const BYTES: usize = Q4_0_BYTES;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn values(wb: *const u8) -> __m256i {
        _mm256_sub_epi8(nibbles32(wb.add(2)), _mm256_set1_epi8(8))
    }
}

impl Format for Q41 {
    const BYTES: usize = Q4_1_BYTES;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn values(wb: *const u8) -> __m256i {
        nibbles32(wb.add(4))
    }
}

impl Format for Q50 {
    const BYTES: usize = Q5_0_BYTES;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn values(wb: *const u8) -> __m256i {
        // Byte | 0xf0 (= q - 16 as int8) where the fifth bit is clear.
        let hi = _mm256_andnot_si256(bits32(wb.add(2)), _mm256_set1_epi8(0xf0u8 as i8));
        _mm256_or_si256(nibbles32(wb.add(6)), hi)
    }
}

impl Format for Q51 {
    const BYTES: usize = Q5_1_BYTES;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn values(wb: *const u8) -> __m256i {
        let hi = _mm256_and_si256(bits32(wb.add(4)), _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles32(wb.add(8)), hi)
    }
}

/// Tokens per tile.
const T: usize = LOWBIT_TILE_TOKENS_AVX2;
/// Tokens per chunk (a multiple of `T`): their activations stay in L2 while every row runs.
const TC: usize = 64;

#[inline(always)]
unsafe fn lowbit_gemm<F: Format>(
    n: usize,
    w: &[u8],
    acts: &[u8],
    blocks: &ActBlocks,
    n_tokens: usize,
    out: &mut [f32],
) {
    let nb = n / QK;
    let rows = out.len() / n_tokens;
    let (stride, astride) = (nb * F::BYTES, nb * F::ACT_BYTES);
    let o = out.as_mut_ptr();
    let ones = _mm256_set1_epi16(1);
    // [block][token], tokens padded with zeros to whole tiles.
    let padded = n_tokens.next_multiple_of(T);
    let (scales, sums) = (blocks.block_scales.as_ptr(), blocks.block_sums.as_ptr());
    let mut tile_d = [0f32; T];
    let mut tile_m = [0f32; T];
    for tc in (0..n_tokens).step_by(TC) {
        for r in 0..rows {
            let wr = w.as_ptr().add(r * stride);
            for t0 in (tc..n_tokens.min(tc + TC)).step_by(T) {
                let ta = row_ptrs::<T>(acts.as_ptr(), t0, n_tokens, astride);
                let mut acc = [_mm256_setzero_ps(); T];
                let mut summs = _mm256_setzero_ps();
                for b in 0..nb {
                    let wb = wr.add(b * F::BYTES);
                    let x = F::values(wb);
                    let ux = if F::MIN { x } else { _mm256_sign_epi8(x, x) };
                    // The f32 products dw · da of the tile's tokens, one multiply for all 8,
                    // each read back into every lane below.
                    let dw = _mm256_set1_ps(f16_at(wb));
                    let da = _mm256_loadu_ps(scales.add(b * padded + t0));
                    _mm256_storeu_ps(tile_d.as_mut_ptr(), _mm256_mul_ps(dw, da));
                    if F::MIN {
                        // Each token's `summs = fma(m_w, s_a, summs)`.
                        let sa = _mm256_loadu_ps(sums.add(b * padded + t0));
                        summs = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(wb.add(2))), sa, summs);
                    }
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let y = _mm256_loadu_si256(ta[j].add(b * F::ACT_BYTES + F::ACT_QS).cast());
                        // ggml's `mul_sum_i8_pairs_float` (sign trick) for Q4_0/Q5_0, its
                        // `mul_sum_us8_pairs_float` for Q4_1/Q5_1.
                        let s = if F::MIN { y } else { _mm256_sign_epi8(y, x) };
                        let q = _mm256_cvtepi32_ps(_mm256_madd_epi16(
                            _mm256_maddubs_epi16(ux, s),
                            ones,
                        ));
                        *acc = _mm256_fmadd_ps(broadcast_load(tile_d.as_ptr().add(j)), q, *acc);
                    }
                }
                if F::MIN {
                    _mm256_storeu_ps(tile_m.as_mut_ptr(), summs);
                }
                for (j, &acc) in acc.iter().enumerate().take(n_tokens - t0) {
                    // `hsum8(acc) + summs` (no addition for Q4_0/Q5_0, which would turn -0 to +0).
                    let v = hsum8(acc);
                    *o.add(r * n_tokens + t0 + j) = if F::MIN { v + tile_m[j] } else { v };
                }
            }
        }
    }
}

gemm_entry!("avx2,fma,f16c", q4_0_avx2, lowbit_gemm::<Q40>, blocks);
gemm_entry!("avx2,fma,f16c", q4_1_avx2, lowbit_gemm::<Q41>, blocks);
gemm_entry!("avx2,fma,f16c", q5_0_avx2, lowbit_gemm::<Q50>, blocks);
gemm_entry!("avx2,fma,f16c", q5_1_avx2, lowbit_gemm::<Q51>, blocks);

/// The AVX2 GEMM for `ty` (Q4_0, Q4_1, Q5_0 or Q5_1), `None` for another type.
pub(crate) fn gemm_fn(ty: GgmlType) -> Option<(&'static str, GemmFn)> {
    Some(match ty {
        GgmlType::Q4_0 => ("q4_0*q8_0 gemm/avx2", q4_0_avx2),
        GgmlType::Q4_1 => ("q4_1*q8_1 gemm/avx2", q4_1_avx2),
        GgmlType::Q5_0 => ("q5_0*q8_0 gemm/avx2", q5_0_avx2),
        GgmlType::Q5_1 => ("q5_1*q8_1 gemm/avx2", q5_1_avx2),
        _ => return None,
    })
}
