//! Many K-quant (and IQ) weight rows against many tokens at once ([`DotKernel::dot_tokens_rows`]): the
//! same bits as [`DotKernel::dot_tokens`] row by row, but each weight super-block is decoded
//! once for all the tokens instead of once per token.
//!
//! Both orders this applies to build a super-block's result from two exact integers,
//! `s1 = Σ_g sc_g · (Σ code·a − bias · bsum_g)` and `s2 = Σ_g m_g · bsum_g` (see `tiled.rs`),
//! and differ only in how those enter the float accumulators ([`Fold`]):
//!
//! * llama.cpp's tiled order (K-quants from [`TILED_MIN_TOKENS`] tokens):
//!   `r = f32(s1)·d_w`, `r = fma(−dmin_w, f32(s2), r)`, `acc = fma(r, d_a, acc)`;
//! * the repacked Q4_K order of an expert matmul (`repack.rs`, every token count):
//!   `acc = fma(f32(s1), d_w·d_a, acc)`, `acc_min = fma(f32(s2), dmin_w·d_a, acc_min)`,
//!   result `acc − acc_min`; a dense matmul's repacked Q4_K takes that order for its last
//!   `n_tokens % 4` tokens and, with AVX-512 VNNI, the same two chains per pair of sub-blocks
//!   (llama.cpp's repacked GEMM) for its groups of four (without VNNI those go token by token).
//!
//! The IQ types keep their single-token order (`vec_dot` per token); on AVX2 and AVX-512 their
//! batches decode each weight block once for all the tokens (`x86/avx2/iquants.rs`).
//!
//! The integer sums are exact in any order, so the SIMD kernels form them for a tile of tokens
//! (one vector lane per token: after horizontal sums with AVX2, directly with AVX-512 VNNI,
//! `tiled_gemm/lanes.rs`) and fold them with the same per-lane float operations as the scalar
//! code: bit-identical on every ISA.

use crate::tiled::{SuperBlockFormat, TILED_MIN_TOKENS};
use crate::{BatchKind, DotKernel, GgmlType};

/// How a super-block's integer sums enter the float accumulators.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fold {
    /// llama.cpp's tiled order: one chain, `fma(f32(s1)·d_w − dmin_w·f32(s2), d_a, acc)`.
    Tiled,
    /// The repacked Q4_K GEMV order: two chains over `d_w·d_a` and `dmin_w·d_a`, subtracted.
    Repacked,
}

impl Fold {
    /// Writes the rows' results into `out` (`n_tokens` per row) from the accumulators
    /// `(acc, acc_min)`, `padded` per row: `acc` for the tiled order, `acc − acc_min` for
    /// the repacked one.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn write(
        self,
        out: &mut [f32],
        n_tokens: usize,
        (acc, acc_min): (&[f32], &[f32]),
        padded: usize,
    ) {
        for (r, dst) in out.chunks_exact_mut(n_tokens).enumerate() {
            for (t, o) in dst.iter_mut().enumerate() {
                let (x, m) = (acc[r * padded + t], acc_min[r * padded + t]);
                *o = match self {
                    Fold::Tiled => x,
                    Fold::Repacked => x - m,
                };
            }
        }
    }
}

impl DotKernel {
    /// [`DotKernel::dot_tokens`] for each of the `out.len() / n_tokens` weight rows in
    /// `weight_rows` (whole rows back to back) with the `n_tokens` activation rows in `acts`:
    /// `out[r * n_tokens + t]` is row `r` with token `t`, with the same bits. Where the order is
    /// built from per-super-block integer sums (tiled K-quants, repacked Q4_K experts) the
    /// SIMD kernels decode each weight super-block once for every token.
    pub fn dot_tokens_rows(
        &self,
        kind: BatchKind,
        n: usize,
        weight_rows: &[u8],
        acts: &[u8],
        n_tokens: usize,
        out: &mut [f32],
    ) {
        if n_tokens == 0 {
            return;
        }
        let wb = self.weight_row_bytes(n);
        let rows = out.len() / n_tokens;
        assert!(
            weight_rows.len() >= rows * wb && acts.len() >= n_tokens * self.act_row_bytes(n),
            "dot_tokens_rows: short weight or activation rows"
        );
        #[cfg(target_arch = "x86_64")]
        if self.is_repacked()
            && kind == BatchKind::Dense
            && self.weight_type() == GgmlType::Q4_K
            && self.isa() == crate::Isa::Avx512
            && crate::x86::features::has_avx512_vnni()
        {
            let (w, a) = (
                &weight_rows[..rows * wb],
                &acts[..n_tokens * self.act_row_bytes(n)],
            );
            q4k_dense_repacked_vnni(n, w, a, n_tokens, out);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if let Some((format, fold)) = self.super_block_order(kind, n_tokens) {
            let vnni = crate::x86::features::has_avx512_vnni();
            let f = match self.isa() {
                crate::Isa::Avx512 if vnni => Some(lanes::gemm_vnni as avx2::Gemm),
                crate::Isa::Avx2 | crate::Isa::Avx512 => Some(avx2::gemm_avx2 as avx2::Gemm),
                crate::Isa::Scalar => None,
            };
            if let Some(f) = f {
                let (w, a) = (
                    &weight_rows[..rows * wb],
                    &acts[..n_tokens * self.act_row_bytes(n)],
                );
                // SAFETY: the kernel's ISA was checked when it was made (AVX2 is part of both,
                // VNNI was asked); `w` holds the rows, `a` the tokens.
                unsafe { f(format, fold, n / crate::scalar::kquants::QK_K, w, a, out) };
                return;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if self.isa() != crate::Isa::Scalar
            && !self.is_repacked()
            && crate::IQ_TYPES.contains(&self.weight_type())
        {
            let (w, a) = (
                &weight_rows[..rows * wb],
                &acts[..n_tokens * self.act_row_bytes(n)],
            );
            // SAFETY: the kernel's ISA (AVX2, or AVX-512 which includes it) was checked when it
            // was made; `w` holds the rows, `a` the tokens, of whole blocks.
            let ty = self.weight_type();
            let vnni = self.isa() == crate::Isa::Avx512 && crate::x86::features::has_avx512_vnni();
            let vbmi = vnni && crate::x86::features::has_avx512_vbmi();
            // SAFETY: as above; VNNI and VBMI were checked just now.
            let done = (vnni
                && unsafe {
                    crate::x86::avx2::iquants::tokens_vnni::tokens_rows(
                        ty, n, w, a, n_tokens, out, vbmi,
                    )
                })
                || unsafe { crate::x86::avx2::iquants::tokens_rows(ty, n, w, a, n_tokens, out) };
            if done {
                return;
            }
        }
        for (r, dst) in out.chunks_exact_mut(n_tokens).enumerate() {
            self.dot_tokens(kind, n, &weight_rows[r * wb..(r + 1) * wb], acts, dst);
        }
    }

    /// The super-block format and fold of a `kind` batch of `n_tokens`, where its order is
    /// one of [`Fold`]'s.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn super_block_order(
        &self,
        kind: BatchKind,
        n_tokens: usize,
    ) -> Option<(SuperBlockFormat, Fold)> {
        if self.is_repacked() {
            let q4k_expert = kind == BatchKind::Expert && self.weight_type() == GgmlType::Q4_K;
            return q4k_expert.then_some((SuperBlockFormat::Q4K, Fold::Repacked));
        }
        let format = SuperBlockFormat::of(self.weight_type())?;
        (n_tokens >= TILED_MIN_TOKENS).then_some((format, Fold::Tiled))
    }
}

/// A dense matmul's batch of repacked Q4_K rows `w` with AVX-512 VNNI, in the orders of
/// [`DotKernel::dot_tokens`]: the complete groups of four tokens in llama.cpp's repacked GEMM
/// order (per pair of sub-blocks), the last `n_tokens % 4` in its GEMV order (per
/// super-block, [`Fold::Repacked`]); each weight super-block decoded once per tile of tokens.
#[cfg(target_arch = "x86_64")]
fn q4k_dense_repacked_vnni(n: usize, w: &[u8], acts: &[u8], n_tokens: usize, out: &mut [f32]) {
    let n_sb = n / crate::scalar::kquants::QK_K;
    let ab = n_sb * crate::scalar::kquants::Q8_K_BYTES;
    let rows = out.len() / n_tokens;
    let grouped = n_tokens - n_tokens % 4;
    for (pairwise, t0, t1) in [(true, 0, grouped), (false, grouped, n_tokens)] {
        let k = t1 - t0;
        if k == 0 {
            continue;
        }
        let (a, mut part) = (&acts[t0 * ab..t1 * ab], vec![0f32; rows * k]);
        // SAFETY: the caller checked AVX-512 VNNI (with the AVX2 that every AVX-512 kernel
        // has); `w` holds `rows` Q4_K rows of `n_sb` super-blocks, `a` `k` Q8_K rows.
        unsafe {
            if pairwise {
                lanes::gemm_vnni_q4k_pairwise(n_sb, w, a, &mut part);
            } else {
                lanes::gemm_vnni(SuperBlockFormat::Q4K, Fold::Repacked, n_sb, w, a, &mut part);
            }
        }
        for (dst, src) in out.chunks_exact_mut(n_tokens).zip(part.chunks_exact(k)) {
            dst[t0..t1].copy_from_slice(src);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod lanes;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::Fold;
    use crate::scalar::kquants::{Q8_K_BSUMS, Q8_K_BYTES, Q8_K_QS};
    use crate::tiled::{Decoded, SuperBlockFormat};
    use crate::x86::avx2::lowbit::{hsum_8x8, k4_scales_mins};

    /// Tokens per tile: one accumulator register each.
    const TILE: usize = 8;

    /// Decodes the super-block at `b` into `dec`, Q4_K and Q6_K (codes, scales and float
    /// scales) with vector instructions and every field written, the other formats through
    /// [`Decoded::new`].
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; `b` holds one super-block of `format`.
    #[inline(always)]
    pub(super) unsafe fn decode(format: SuperBlockFormat, b: &[u8], dec: &mut Decoded) {
        let ld = |o: usize| _mm256_loadu_si256(b.as_ptr().add(o) as *const __m256i);
        let low = _mm256_set1_epi8(0x0f);
        // The f16 at byte `o` of the block, converted by F16C (exact, as `f16_to_f32`).
        let f16_at = |o: usize| {
            let h = u16::from_le_bytes([b[o], b[o + 1]]);
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
        };
        match format {
            SuperBlockFormat::Q4K => {
                // Scales 0..8 then mins 0..8 as i16 (`k4_scales_mins`), each repeated for the
                // two 16-element groups of its sub-block.
                let sm = k4_scales_mins(b.as_ptr());
                let (sc, m) = (
                    _mm256_castsi256_si128(sm),
                    _mm256_extracti128_si256::<1>(sm),
                );
                let sc_p = dec.sc.as_mut_ptr() as *mut __m128i;
                let m_p = dec.m.as_mut_ptr() as *mut __m128i;
                _mm_storeu_si128(sc_p, _mm_unpacklo_epi16(sc, sc));
                _mm_storeu_si128(sc_p.add(1), _mm_unpackhi_epi16(sc, sc));
                _mm_storeu_si128(m_p, _mm_unpacklo_epi16(m, m));
                _mm_storeu_si128(m_p.add(1), _mm_unpackhi_epi16(m, m));
                dec.bias = 0;
                dec.d = f16_at(0);
                dec.dmin = f16_at(2);
                dec.has_min = true;
            }
            SuperBlockFormat::Q6K => {
                let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.as_ptr().add(192).cast()));
                _mm256_storeu_si256(dec.sc.as_mut_ptr() as *mut __m256i, sc);
                dec.m = [0; 16];
                dec.bias = 32;
                dec.d = f16_at(208);
                dec.dmin = 0.0;
                dec.has_min = false;
            }
            _ => {
                *dec = Decoded::new(format, b);
                return;
            }
        }
        let codes = dec.codes.as_mut_ptr() as *mut __m256i;
        if format == SuperBlockFormat::Q4K {
            // Elements 64j..64j+32 are the low nibbles of qs[32j..], the next 32 the high ones.
            for j in 0..4 {
                let q = ld(16 + 32 * j);
                _mm256_storeu_si256(codes.add(2 * j), _mm256_and_si256(q, low));
                _mm256_storeu_si256(
                    codes.add(2 * j + 1),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(q), low),
                );
            }
        } else {
            // Per half h: groups 0..4 of 32 take ql[64h..64h+32] low, ql[64h+32..] low, the
            // same two high, and bits 2g..2g+2 of qh[32h..32h+32] as bits 4..6.
            for h in 0..2 {
                let (la, lb, qh) = (ld(64 * h), ld(64 * h + 32), ld(128 + 32 * h));
                let hi = |mask: i8| _mm256_and_si256(qh, _mm256_set1_epi8(mask));
                let g = [
                    _mm256_or_si256(_mm256_and_si256(la, low), _mm256_slli_epi16::<4>(hi(0x03))),
                    _mm256_or_si256(_mm256_and_si256(lb, low), _mm256_slli_epi16::<2>(hi(0x0c))),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(la), low), hi(0x30)),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(lb), low),
                        _mm256_srli_epi16::<2>(hi(0xc0u8 as i8)),
                    ),
                ];
                for (k, v) in g.into_iter().enumerate() {
                    _mm256_storeu_si256(codes.add(4 * h + k), v);
                }
            }
        }
    }

    /// The signature of the entry points: `out[r * n_tokens + t]` for the `out.len() /
    /// n_tokens` rows of `w` (super-blocks of `format`, `n_sb` a row) and the `n_tokens =
    /// acts.len() / (n_sb · Q8_K_BYTES)` tokens.
    pub(super) type Gemm = unsafe fn(SuperBlockFormat, Fold, usize, &[u8], &[u8], &mut [f32]);

    /// [`Gemm`] with 256-bit vectors.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `w` holds the rows, `acts` the tokens' Q8_K rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemm_avx2(
        format: SuperBlockFormat,
        fold: Fold,
        n_sb: usize,
        w: &[u8],
        acts: &[u8],
        out: &mut [f32],
    ) {
        gemm(format, fold, n_sb, w, acts, out)
    }

    /// [`Gemm`]'s body.
    #[inline(always)]
    unsafe fn gemm(
        format: SuperBlockFormat,
        fold: Fold,
        n_sb: usize,
        w: &[u8],
        acts: &[u8],
        out: &mut [f32],
    ) {
        let a_row = n_sb * Q8_K_BYTES;
        let n_tokens = acts.len() / a_row;
        let w_row = n_sb * format.bytes();
        let padded = n_tokens.next_multiple_of(TILE);
        // The tokens' scales as [super-block][token], zeros past the last token.
        let mut d_a = vec![0f32; n_sb * padded];
        for (t, a) in acts.chunks_exact(a_row).enumerate() {
            for (b, blk) in a.chunks_exact(Q8_K_BYTES).enumerate() {
                d_a[b * padded + t] = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
            }
        }
        // Super-blocks outermost, so that the tokens' blocks of one stay in L1 for every row.
        let rows = out.len() / n_tokens;
        let mut acc = vec![0f32; rows * padded];
        let mut acc_min = vec![0f32; rows * padded];
        if rows == 0 {
            return;
        }
        // Overwritten by `decode` for each super-block.
        let mut dec = Decoded::new(format, &w[..format.bytes()]);
        for b in 0..n_sb {
            let a0 = acts.as_ptr().add(b * Q8_K_BYTES);
            for r in 0..rows {
                // The weights stream from memory in steps of a row, which the hardware
                // prefetchers do not follow: ask for the super-block two rows on.
                let ahead = b * rows + r + 2;
                if ahead < n_sb * rows {
                    let at = ahead % rows * w_row + ahead / rows * format.bytes();
                    crate::prefetch(&w[at..at + format.bytes()]);
                }
                decode(
                    format,
                    &w[r * w_row + b * format.bytes()..][..format.bytes()],
                    &mut dec,
                );
                for t0 in (0..n_tokens).step_by(TILE) {
                    let a: [*const u8; TILE] =
                        std::array::from_fn(|i| a0.add((t0 + i).min(n_tokens - 1) * a_row));
                    let (s1, s2) = finish(&dec, &a, group_sums(&dec, &a));
                    let da = _mm256_loadu_ps(d_a.as_ptr().add(b * padded + t0));
                    let acc_p = acc.as_mut_ptr().add(r * padded + t0);
                    let min_p = acc_min.as_mut_ptr().add(r * padded + t0);
                    let (s1, s2) = (_mm256_cvtepi32_ps(s1), _mm256_cvtepi32_ps(s2));
                    match fold {
                        Fold::Tiled => {
                            let mut x = _mm256_mul_ps(s1, _mm256_set1_ps(dec.d));
                            if dec.has_min {
                                x = _mm256_fmadd_ps(_mm256_set1_ps(-dec.dmin), s2, x);
                            }
                            _mm256_storeu_ps(acc_p, _mm256_fmadd_ps(x, da, _mm256_loadu_ps(acc_p)));
                        }
                        Fold::Repacked => {
                            let d = _mm256_mul_ps(_mm256_set1_ps(dec.d), da);
                            let dmin = _mm256_mul_ps(_mm256_set1_ps(dec.dmin), da);
                            _mm256_storeu_ps(acc_p, _mm256_fmadd_ps(s1, d, _mm256_loadu_ps(acc_p)));
                            let m = _mm256_fmadd_ps(s2, dmin, _mm256_loadu_ps(min_p));
                            _mm256_storeu_ps(min_p, m);
                        }
                    }
                }
            }
        }
        fold.write(out, n_tokens, (&acc, &acc_min), padded);
    }

    /// The super-block `dec` against the Q8_K blocks `a` of a tile of tokens (repeat the last
    /// one to fill it): per token, int32 lanes summing to `Σ_g sc_g · Σ code·a`.
    ///
    /// # Safety
    /// The CPU has AVX2; the blocks are in bounds.
    #[inline(always)]
    unsafe fn group_sums(dec: &Decoded, a: &[*const u8; TILE]) -> [__m256i; TILE] {
        let mut s = [_mm256_setzero_si256(); TILE];
        for c in 0..8 {
            let q = _mm256_loadu_si256(dec.codes.as_ptr().add(32 * c) as *const __m256i);
            // The scales of groups 2c and 2c+1 as i16 pairs for `vpmaddwd`; a code is at most
            // 63, so the byte-pair sums (≤ 2·63·128) fit i16.
            let sc = _mm256_set_m128i(
                _mm_set1_epi16(dec.sc[2 * c + 1]),
                _mm_set1_epi16(dec.sc[2 * c]),
            );
            for (s, a) in s.iter_mut().zip(a) {
                let y = _mm256_loadu_si256(a.add(Q8_K_QS + 32 * c) as *const __m256i);
                *s = _mm256_add_epi32(*s, _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), sc));
            }
        }
        s
    }

    /// `(s1, s2)` of the super-block `dec` with the tile's tokens (lane `i` for token `i`),
    /// from their [`group_sums`] `s`: the code bias and the mins through the blocks' `bsums`.
    ///
    /// # Safety
    /// The CPU has AVX2; the blocks are in bounds.
    #[inline(always)]
    unsafe fn finish(
        dec: &Decoded,
        a: &[*const u8; TILE],
        mut s: [__m256i; TILE],
    ) -> (__m256i, __m256i) {
        // The code bias times each group's scale (|sc| ≤ 128, bias ≤ 32: fits i16).
        let sc_bias = _mm256_mullo_epi16(
            _mm256_loadu_si256(dec.sc.as_ptr() as *const __m256i),
            _mm256_set1_epi16(dec.bias as i16),
        );
        let m16 = _mm256_loadu_si256(dec.m.as_ptr() as *const __m256i);
        let mut mins = [_mm256_setzero_si256(); TILE];
        for ((s, m), a) in s.iter_mut().zip(&mut mins).zip(a) {
            let bsums = _mm256_loadu_si256(a.add(Q8_K_BSUMS) as *const __m256i);
            *s = _mm256_sub_epi32(*s, _mm256_madd_epi16(bsums, sc_bias));
            *m = _mm256_madd_epi16(bsums, m16);
        }
        (hsum_8x8(&s), hsum_8x8(&mins))
    }
}

#[cfg(test)]
mod tests {
    use crate::tiled::tests::{acts, weights, TYPES};
    use crate::{BatchKind, DotKernel, Isa};

    /// Every token count around the tile and threshold sizes, every K-quant, both kinds, the
    /// file's and the repacked order: the rows kernel equals `dot_tokens` row by row.
    #[test]
    fn rows_kernel_matches_dot_tokens_bit_for_bit() {
        let (n, rows) = (512, 8);
        for ty in TYPES {
            let w = weights(ty, n * rows, 11);
            let a = acts(n, 19, 23);
            for isa in Isa::available() {
                let kernels = [
                    DotKernel::new(ty, isa).unwrap(),
                    DotKernel::for_matrix(ty, rows).unwrap(),
                ];
                for k in kernels {
                    let ab = k.act_row_bytes(n);
                    for kind in [BatchKind::Dense, BatchKind::Expert] {
                        for t in [1, 2, 7, 8, 9, 16, 19] {
                            let a = &a[..t * ab];
                            let mut got = vec![f32::NAN; rows * t];
                            k.dot_tokens_rows(kind, n, &w, a, t, &mut got);
                            let wb = k.weight_row_bytes(n);
                            for r in 0..rows {
                                let mut want = vec![0f32; t];
                                k.dot_tokens(kind, n, &w[r * wb..(r + 1) * wb], a, &mut want);
                                let got = &got[r * t..(r + 1) * t];
                                assert_eq!(
                                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                    "{ty:?} {isa} {} {kind:?} {t} tokens row {r}",
                                    k.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
