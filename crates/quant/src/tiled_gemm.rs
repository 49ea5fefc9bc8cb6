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
//!   `n_tokens % 4` tokens and the same two chains per pair of sub-blocks (llama.cpp's
//!   repacked GEMM) for its groups of four.
//!
//! The tokens of a batch can be prepared once ([`TokenRows`]) for every row block and matrix
//! they meet: the VNNI kernel's rearranged activations are then built once per batch.
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

/// Activation rows prepared once for any number of [`DotKernel::dot_token_rows`] calls with
/// the same tokens (the row blocks of one matrix on several threads, or several matrices):
/// on AVX-512 VNNI the tokens rearranged for the lanes kernel, built by the first call that
/// needs them. `Sync`, so the threads of a job share it.
pub struct TokenRows<'a> {
    kind: BatchKind,
    n: usize,
    acts: &'a [u8],
    n_tokens: usize,
    #[cfg(target_arch = "x86_64")]
    lanes: std::sync::OnceLock<lanes::Lanes>,
}

impl std::fmt::Debug for TokenRows<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenRows")
            .field("kind", &self.kind)
            .field("n", &self.n)
            .field("n_tokens", &self.n_tokens)
            .finish()
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
        let tokens = self.prepare_token_rows(kind, n, acts, n_tokens);
        self.dot_token_rows(&tokens, weight_rows, out);
    }

    /// The `n_tokens` activation rows of `n` elements in `acts` (this kernel's activation
    /// type, back to back) for `kind` products with [`DotKernel::dot_token_rows`]. Any kernel
    /// with the same activation type may use them.
    pub fn prepare_token_rows<'a>(
        &self,
        kind: BatchKind,
        n: usize,
        acts: &'a [u8],
        n_tokens: usize,
    ) -> TokenRows<'a> {
        let ab = self.act_row_bytes(n);
        assert!(
            acts.len() >= n_tokens * ab,
            "prepare_token_rows: short activation rows"
        );
        TokenRows {
            kind,
            n,
            acts: &acts[..n_tokens * ab],
            n_tokens,
            #[cfg(target_arch = "x86_64")]
            lanes: std::sync::OnceLock::new(),
        }
    }

    /// [`DotKernel::dot_tokens_rows`] with the tokens of `tokens`: `out[r * n_tokens + t]` for
    /// the `out.len() / n_tokens` weight rows in `weight_rows`, with the same bits.
    pub fn dot_token_rows(&self, tokens: &TokenRows<'_>, weight_rows: &[u8], out: &mut [f32]) {
        let (kind, n, n_tokens) = (tokens.kind, tokens.n, tokens.n_tokens);
        if n_tokens == 0 {
            return;
        }
        let acts = tokens.acts;
        let wb = self.weight_row_bytes(n);
        let rows = out.len() / n_tokens;
        assert!(
            weight_rows.len() >= rows * wb && acts.len() >= n_tokens * self.act_row_bytes(n),
            "dot_tokens_rows: short weight or activation rows"
        );
        #[cfg(target_arch = "x86_64")]
        let w = &weight_rows[..rows * wb];
        #[cfg(target_arch = "x86_64")]
        if self.is_repacked()
            && kind == BatchKind::Dense
            && self.weight_type() == GgmlType::Q4_K
            && self.isa() != crate::Isa::Scalar
        {
            let vnni = self.isa() == crate::Isa::Avx512 && crate::x86::features::has_avx512_vnni();
            q4k_dense_repacked(vnni, n, w, acts, n_tokens, out);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if let Some((format, fold)) = self.super_block_order(kind, n_tokens) {
            let n_sb = n / crate::scalar::kquants::QK_K;
            match self.isa() {
                crate::Isa::Avx512 if crate::x86::features::has_avx512_vnni() => {
                    let l = tokens
                        .lanes
                        .get_or_init(|| lanes::Lanes::new(n_sb, acts, n_tokens));
                    // SAFETY: the kernel's ISA was checked when it was made (AVX2 is part of
                    // AVX-512), VNNI just now; `w` holds the rows, `l` the tokens.
                    unsafe { lanes::gemm_vnni(format, fold, l, w, out) };
                    return;
                }
                crate::Isa::Avx2 | crate::Isa::Avx512 => {
                    // SAFETY: the kernel's ISA (AVX2, or AVX-512 which includes it) was checked
                    // when it was made; `w` holds the rows, `acts` the tokens.
                    unsafe { avx2::gemm_avx2(format, fold, n_sb, w, acts, out) };
                    return;
                }
                crate::Isa::Scalar => {}
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

/// A dense matmul's batch of repacked Q4_K rows `w` in the orders of
/// [`DotKernel::dot_tokens`]: the complete groups of four tokens in llama.cpp's repacked GEMM
/// order (per pair of sub-blocks), the last `n_tokens % 4` in its GEMV order (per
/// super-block, [`Fold::Repacked`]); each weight super-block decoded once per tile of tokens,
/// with AVX-512 VNNI where `vnni` (the caller checked it), with AVX2 otherwise.
#[cfg(target_arch = "x86_64")]
fn q4k_dense_repacked(
    vnni: bool,
    n: usize,
    w: &[u8],
    acts: &[u8],
    n_tokens: usize,
    out: &mut [f32],
) {
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
        let fold = Fold::Repacked;
        // SAFETY: the kernel's ISA (AVX2, or AVX-512 which includes it) was checked when it was
        // made, VNNI by the caller where `vnni`; `w` holds `rows` Q4_K rows of `n_sb`
        // super-blocks, `a` `k` Q8_K rows.
        unsafe {
            if vnni {
                let l = lanes::Lanes::new(n_sb, a, k);
                if pairwise {
                    lanes::gemm_vnni_q4k_pairwise(&l, w, &mut part);
                } else {
                    lanes::gemm_vnni(SuperBlockFormat::Q4K, fold, &l, w, &mut part);
                }
            } else if pairwise {
                avx2::gemm_avx2_q4k_pairwise(n_sb, w, a, &mut part);
            } else {
                avx2::gemm_avx2(SuperBlockFormat::Q4K, fold, n_sb, w, a, &mut part);
            }
        }
        for (dst, src) in out.chunks_exact_mut(n_tokens).zip(part.chunks_exact(k)) {
            dst[t0..t1].copy_from_slice(src);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod lane_vec;
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

    /// Decodes the super-block at `b` into `dec`, Q4_K, Q5_K and Q6_K (codes, scales and
    /// float scales) with vector instructions and every field written, the other formats
    /// through [`Decoded::new`].
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
            SuperBlockFormat::Q4K | SuperBlockFormat::Q5K => {
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
        if format != SuperBlockFormat::Q6K {
            // Elements 64j..64j+32 are the low nibbles of qs[32j..], the next 32 the high ones
            // (qs at byte 16 for Q4_K, 48 for Q5_K); Q5_K's element 32i + l adds bit i of
            // qh[l] (byte 16 + l) as bit 4.
            let (qs, qh) = match format {
                SuperBlockFormat::Q5K => (48, Some(ld(16))),
                _ => (16, None),
            };
            let bit4 = _mm256_set1_epi8(0x10);
            for j in 0..4 {
                let q = ld(qs + 32 * j);
                let mut lo = _mm256_and_si256(q, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
                if let Some(qh) = qh {
                    // Bit 2j of qh to bit 4 for the low nibbles, bit 2j + 1 for the high.
                    let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j as i32));
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(h), bit4));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<3>(h), bit4));
                }
                _mm256_storeu_si256(codes.add(2 * j), lo);
                _mm256_storeu_si256(codes.add(2 * j + 1), hi);
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

    /// `out[r * n_tokens + t]` for the `out.len() / n_tokens` rows of `w` (super-blocks of
    /// `format`, `n_sb` a row) and the `n_tokens = acts.len() / (n_sb · Q8_K_BYTES)` tokens,
    /// with 256-bit vectors.
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
        gemm::<false>(format, fold, n_sb, w, acts, out)
    }

    /// Q4_K rows against tokens in the order of llama.cpp's repacked GEMM (per pair of
    /// sub-blocks, as `lanes::gemm_vnni_q4k_pairwise`), with 256-bit vectors.
    ///
    /// # Safety
    /// As [`gemm_avx2`], `w` holding Q4_K rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemm_avx2_q4k_pairwise(
        n_sb: usize,
        w: &[u8],
        acts: &[u8],
        out: &mut [f32],
    ) {
        gemm::<true>(SuperBlockFormat::Q4K, Fold::Repacked, n_sb, w, acts, out)
    }

    /// [`gemm_avx2`]'s body; `PAIRWISE` folds Q4_K per pair of sub-blocks instead of per
    /// super-block (both chains, [`Fold::Repacked`]'s result).
    #[inline(always)]
    unsafe fn gemm<const PAIRWISE: bool>(
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
        let mut dec = Decoded::scales(format, &w[..format.bytes()]);
        // Which groups' bias and mins `finish` takes: all, or those of one pair of sub-blocks.
        let all_groups = _mm256_set1_epi16(-1);
        let mut pair_masks = [all_groups; 4];
        for (p, mask) in pair_masks.iter_mut().enumerate() {
            let mut m = [0i16; 16];
            m[4 * p..4 * p + 4].fill(-1);
            *mask = _mm256_loadu_si256(m.as_ptr() as *const __m256i);
        }
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
                    let mut a = [a0; TILE];
                    for (i, a) in a.iter_mut().enumerate() {
                        *a = a0.add((t0 + i).min(n_tokens - 1) * a_row);
                    }
                    let da = _mm256_loadu_ps(d_a.as_ptr().add(b * padded + t0));
                    let acc_p = acc.as_mut_ptr().add(r * padded + t0);
                    let min_p = acc_min.as_mut_ptr().add(r * padded + t0);
                    if PAIRWISE {
                        // Sub-blocks 2p and 2p + 1 are chunks 2p, 2p + 1 and groups 4p..4p + 4.
                        let d = _mm256_mul_ps(_mm256_set1_ps(dec.d), da);
                        let dmin = _mm256_mul_ps(_mm256_set1_ps(dec.dmin), da);
                        let (mut x, mut m) = (_mm256_loadu_ps(acc_p), _mm256_loadu_ps(min_p));
                        for (p, mask) in pair_masks.iter().enumerate() {
                            let s = group_sums(&dec, &a, 2 * p..2 * p + 2);
                            let (s1, s2) = finish(&dec, &a, s, *mask);
                            x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), d, x);
                            m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), dmin, m);
                        }
                        _mm256_storeu_ps(acc_p, x);
                        _mm256_storeu_ps(min_p, m);
                        continue;
                    }
                    let (s1, s2) = finish(&dec, &a, group_sums(&dec, &a, 0..8), all_groups);
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

    /// The 32-element chunks `chunks` of the super-block `dec` against the Q8_K blocks `a` of
    /// a tile of tokens (repeat the last one to fill it): per token, int32 lanes summing to
    /// `Σ_g sc_g · Σ code·a` over those chunks' groups.
    ///
    /// # Safety
    /// The CPU has AVX2; the blocks are in bounds.
    #[inline(always)]
    unsafe fn group_sums(
        dec: &Decoded,
        a: &[*const u8; TILE],
        chunks: std::ops::Range<usize>,
    ) -> [__m256i; TILE] {
        let mut s = [_mm256_setzero_si256(); TILE];
        for c in chunks {
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
    /// from their [`group_sums`] `s`: the code bias and the mins through the blocks' `bsums`,
    /// of the groups whose i16 lanes are set in `groups`.
    ///
    /// # Safety
    /// The CPU has AVX2; the blocks are in bounds.
    #[inline(always)]
    unsafe fn finish(
        dec: &Decoded,
        a: &[*const u8; TILE],
        mut s: [__m256i; TILE],
        groups: __m256i,
    ) -> (__m256i, __m256i) {
        // The code bias times each group's scale (|sc| ≤ 128, bias ≤ 32: fits i16).
        let sc_bias = _mm256_mullo_epi16(
            _mm256_loadu_si256(dec.sc.as_ptr() as *const __m256i),
            _mm256_set1_epi16(dec.bias as i16),
        );
        let sc_bias = _mm256_and_si256(sc_bias, groups);
        let m16 = _mm256_and_si256(_mm256_loadu_si256(dec.m.as_ptr() as *const __m256i), groups);
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
    use crate::scalar::kquants::{Q8_K_BSUMS, Q8_K_BYTES, Q8_K_QS, QK_K};
    use crate::tiled::tests::{acts, weights, TYPES};
    use crate::tiled::SuperBlockFormat;
    use crate::{BatchKind, DotKernel, GgmlType, Isa};

    /// `rows` rows of `n` elements of `ty`: row `r % 5` filled with 0xff (every code and
    /// scale at its largest, Q6_K's scales -1), 0x00, 0x80 (Q6_K's scales -128), 0x7f, or
    /// random bytes, each super-block keeping the small finite `d` and `dmin` of
    /// [`weights`].
    fn extreme_weights(ty: GgmlType, n: usize, rows: usize) -> Vec<u8> {
        let format = SuperBlockFormat::of(ty).unwrap();
        let scales: &[usize] = match format {
            SuperBlockFormat::Q2K => &[80, 81, 82, 83],
            SuperBlockFormat::Q3K => &[108, 109],
            SuperBlockFormat::Q4K | SuperBlockFormat::Q5K => &[0, 1, 2, 3],
            SuperBlockFormat::Q6K => &[208, 209],
        };
        let mut w = weights(ty, n * rows, 41);
        let row = w.len() / rows;
        for (r, row) in w.chunks_exact_mut(row).enumerate() {
            let fill = [Some(0xff), Some(0x00), Some(0x80), Some(0x7f), None][r % 5];
            let Some(fill) = fill else { continue };
            for b in row.chunks_exact_mut(format.bytes()) {
                let keep: Vec<u8> = scales.iter().map(|&o| b[o]).collect();
                b.fill(fill);
                for (&o, &v) in scales.iter().zip(&keep) {
                    b[o] = v;
                }
            }
        }
        w
    }

    /// `tokens` Q8_K rows of `n` elements: token `t % 4` all -128, all 127, alternating
    /// -128 and 127, or quantized noise; the group sums `bsums` as they must be.
    fn extreme_acts(n: usize, tokens: usize) -> Vec<u8> {
        let noise = acts(n, tokens, 77);
        let mut a = vec![0u8; tokens * n / QK_K * Q8_K_BYTES];
        for (i, (b, src)) in a
            .chunks_exact_mut(Q8_K_BYTES)
            .zip(noise.chunks_exact(Q8_K_BYTES))
            .enumerate()
        {
            let t = i / (n / QK_K);
            b.copy_from_slice(src);
            let q = |e: usize| -> i8 {
                match t % 4 {
                    0 => -128,
                    1 => 127,
                    2 if e.is_multiple_of(2) => -128,
                    2 => 127,
                    _ => src[Q8_K_QS + e] as i8,
                }
            };
            for e in 0..QK_K {
                b[Q8_K_QS + e] = q(e) as u8;
            }
            for g in 0..16 {
                let s: i16 = (0..16).map(|e| q(16 * g + e) as i16).sum();
                b[Q8_K_BSUMS + 2 * g..Q8_K_BSUMS + 2 * g + 2].copy_from_slice(&s.to_le_bytes());
            }
        }
        a
    }

    /// Extreme weight rows and activations, 1 to 40 tokens (one and several tiles, the pairs
    /// of tiles of the VNNI kernel and a single one after them), every K-quant, both kinds,
    /// the file's and the repacked order: the rows kernel on every ISA equals the scalar
    /// kernel's `dot_tokens` row by row.
    #[test]
    fn extreme_blocks_match_the_scalar_order_on_every_isa() {
        let (n, rows) = (512, 10);
        let a = extreme_acts(n, 40);
        for ty in TYPES {
            let w = extreme_weights(ty, n, rows);
            let plain = DotKernel::new(ty, Isa::Scalar).unwrap();
            let repacked = crate::repack::repacked_on(ty, Isa::Scalar);
            for isa in Isa::available() {
                let mut kernels = vec![(DotKernel::new(ty, isa).unwrap(), plain)];
                if let (Some(k), Some(s)) = (crate::repack::repacked_on(ty, isa), repacked) {
                    kernels.push((k, s));
                }
                for (k, scalar) in kernels {
                    let (ab, wb) = (k.act_row_bytes(n), k.weight_row_bytes(n));
                    for kind in [BatchKind::Dense, BatchKind::Expert] {
                        for t in [1, 3, 4, 8, 12, 15, 16, 17, 31, 32, 33, 40] {
                            let a = &a[..t * ab];
                            let mut got = vec![f32::NAN; rows * t];
                            k.dot_tokens_rows(kind, n, &w, a, t, &mut got);
                            for r in 0..rows {
                                let mut want = vec![0f32; t];
                                scalar.dot_tokens(kind, n, &w[r * wb..(r + 1) * wb], a, &mut want);
                                let got = &got[r * t..(r + 1) * t];
                                assert!(want.iter().all(|v| v.is_finite()));
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

    /// Tokens prepared once serve several matrices and row blocks, with the bits of
    /// `dot_tokens_rows` on each.
    #[test]
    fn prepared_tokens_serve_every_row_block() {
        let (n, rows, t) = (512, 24, 37);
        let a = acts(n, t, 5);
        for ty in TYPES {
            let k = DotKernel::for_matrix(ty, rows).unwrap();
            let w = weights(ty, n * rows, 9);
            let wb = k.weight_row_bytes(n);
            let mut want = vec![0f32; rows * t];
            k.dot_tokens_rows(BatchKind::Expert, n, &w, &a, t, &mut want);
            let tokens = k.prepare_token_rows(BatchKind::Expert, n, &a, t);
            let mut got = vec![f32::NAN; rows * t];
            for (i, dst) in got.chunks_mut(8 * t).enumerate() {
                k.dot_token_rows(&tokens, &w[i * 8 * wb..(i * 8 + dst.len() / t) * wb], dst);
            }
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{ty:?}"
            );
        }
    }

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
