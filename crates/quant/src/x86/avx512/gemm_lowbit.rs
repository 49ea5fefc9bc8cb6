//! AVX-512 F/BW/VL GEMM kernels (VNNI `vpdpbusd` when present) for Q4_0, Q5_0 (× Q8_0) and
//! Q4_1, Q5_1 (× Q8_1), bit-identical to their `vec_dot` kernels (`scalar/legacy.rs`) for
//! every row and token: per block eight int32 lanes (lane `k` sums elements `4k..4k+4`),
//! converted and fused-multiply-added with the f32 product `d_w · d_a` into an 8-lane
//! accumulator, summed by halving at the end; Q4_1/Q5_1 add their FMA chain of `m_w · s_a`.
//!
//! Two tokens share a zmm with their lanes interleaved: lane `2k` (`2k + 1`) is lane `k` of
//! the first (second) token. [`pair_tokens`] lays the activations out that way once per matmul
//! (`ActBlocks::pairs`, each byte plus 128), and each weight block is decoded once per tile to
//! its 32 values as bytes with every dword doubled (`vpermd`), so one `vpdpbusd` forms both
//! tokens' lanes `Σ (a + 128)·x`. The correction `-128 · Σ x` of each lane is computed once
//! per row and block (one more `vpdpbusd`) and starts every sum, which leaves `Σ a·x` exactly:
//! ggml's integer for Q4_1/Q5_1 (unsigned × signed bytes), and for Q4_0/Q5_0 (sign trick) for
//! every activation byte but -128, which [`pair_tokens`] reports (`ActBlocks::sign_fallback`).
//! A row's scale products for the tile's 16 tokens are one vector multiply, read back per pair
//! by a 64-bit broadcast load (`vbroadcastsd`, lanes `[2p, 2p + 1]` in every lane pair), and
//! its `m_w · s_a` chains one vector FMA per block.
//!
//! Tiles of one row × up to 32 tokens (16 accumulators in registers, no spills; two rows a
//! tile held the activations in registers too and spilled); the token tiles are the outer
//! loop, so a tile's paired activations stay in L1 while every row runs over them.
//!
//! Safety: every `unsafe fn` here needs AVX-512 F/BW/VL plus AVX2, FMA and F16C (and VNNI for
//! `VNNI = true`), and the slice contract of [`GemmFn`].

use core::arch::x86_64::*;

use crate::gemm_layout::{ActBlocks, GemmFn, LOWBIT_TILE_TOKENS_AVX512};
use crate::scalar::shared::QK;
use crate::x86::avx2::dot::{f16_at, hsum8};
use crate::x86::avx2::gemm_lowbit::{Format, Q40, Q41, Q50, Q51};
use crate::x86::avx512::dot::{hi256, lo256};
use crate::GgmlType;

/// Tokens per tile (16 pairs: 16 accumulators).
const TT: usize = 2 * LOWBIT_TILE_TOKENS_AVX512;
/// Bytes of one pair's block in `ActBlocks::pairs`.
const PAIR_BYTES: usize = 64;

/// Lays out `n_tokens` activation rows of `n` elements (`acts`, Q8_0 or Q8_1 as `weight`
/// takes) in token pairs for the kernels here: `blocks.pairs` (see `ActBlocks::pairs`) and
/// `blocks.sign_fallback`.
pub(crate) fn pair_tokens(
    weight: GgmlType,
    n: usize,
    acts: &[u8],
    n_tokens: usize,
    blocks: &mut ActBlocks,
) {
    let min = matches!(weight, GgmlType::Q4_1 | GgmlType::Q5_1);
    let (ab, nb) = (crate::vec_dot_type(weight).block_bytes(), n / QK);
    let (row, qs) = (nb * ab, ab - QK);
    let n_pairs = n_tokens.div_ceil(2);
    let quants = |t: usize, b: usize| &acts[t * row + b * ab + qs..][..QK];
    let dword = |q: &[u8], k: usize| {
        u32::from_le_bytes([q[4 * k], q[4 * k + 1], q[4 * k + 2], q[4 * k + 3]]) ^ 0x8080_8080
    };
    blocks.pairs.clear();
    blocks.pairs.resize(nb * n_pairs * PAIR_BYTES, 0);
    for (i, dst) in blocks.pairs.chunks_exact_mut(PAIR_BYTES).enumerate() {
        let (b, p) = (i / n_pairs, i % n_pairs);
        let (q0, q1) = (quants(2 * p, b), quants((2 * p + 1).min(n_tokens - 1), b));
        for (k, d) in dst.chunks_exact_mut(8).enumerate() {
            d[..4].copy_from_slice(&dword(q0, k).to_le_bytes());
            d[4..].copy_from_slice(&dword(q1, k).to_le_bytes());
        }
    }
    blocks.sign_fallback = !min
        && (0..n_tokens)
            .flat_map(|t| (0..nb).map(move |b| (t, b)))
            .any(|(t, b)| quants(t, b).contains(&0x80));
}

/// `acc + Σ u[4l..4l+4] · s[4l..4l+4]` per int32 lane `l` (unsigned × signed bytes):
/// `vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`, whose 16-bit pair sums cannot saturate here
/// (`u ≤ 255` against `|s| ≤ 31`: `2 · 255 · 31 < 2^15`).
#[inline(always)]
unsafe fn dot_acc<const VNNI: bool>(acc: __m512i, u: __m512i, s: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpbusd_epi32(acc, u, s)
    } else {
        let p = _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
        _mm512_add_epi32(acc, p)
    }
}

/// The 64 bits at `p` in every 64-bit lane, as a load (`vbroadcastsd`): where the compiler
/// would otherwise turn the read of a just-stored value into shuffles of the stored register.
/// (Its own `avx512f` feature lets the zmm operand compile whatever the build's target CPU;
/// the kernels that call it inline it.)
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn broadcast_pair(p: *const f32) -> __m512 {
    let r: __m512;
    // SAFETY: the caller passes the address of two initialised f32; the asm only reads them.
    core::arch::asm!(
        "vbroadcastsd {r}, qword ptr [{p}]",
        r = out(zmm_reg) r,
        p = in(reg) p,
        options(pure, readonly, nostack, preserves_flags)
    );
    r
}

/// The operands of one GEMM call.
struct Mats {
    nb: usize,
    rows: usize,
    /// Bytes per weight row.
    stride: usize,
    w: *const u8,
    pairs: *const u8,
    n_pairs: usize,
    /// `[block][token]` scales and (Q4_1/Q5_1) sums, `padded` tokens a block.
    scales: *const f32,
    sums: *const f32,
    padded: usize,
    n_tokens: usize,
    out: *mut f32,
}

#[inline(always)]
unsafe fn lowbit_gemm<F: Format, const VNNI: bool>(
    n: usize,
    w: &[u8],
    _acts: &[u8],
    blocks: &ActBlocks,
    n_tokens: usize,
    out: &mut [f32],
) {
    // (The activations are read as `blocks.pairs`.)
    let nb = n / QK;
    let m = Mats {
        nb,
        rows: out.len() / n_tokens,
        stride: nb * F::BYTES,
        w: w.as_ptr(),
        pairs: blocks.pairs.as_ptr(),
        n_pairs: n_tokens.div_ceil(2),
        scales: blocks.block_scales.as_ptr(),
        sums: blocks.block_sums.as_ptr(),
        padded: n_tokens.next_multiple_of(LOWBIT_TILE_TOKENS_AVX512),
        n_tokens,
        out: out.as_mut_ptr(),
    };
    for t0 in (0..n_tokens).step_by(TT) {
        // The tile's pairs in runs of 16, 8, 4, 2 and 1, each over every row while its
        // activations stay in L1.
        let pairs = (n_tokens - t0).min(TT).div_ceil(2);
        let mut p0 = 0;
        for run in [16, 8, 4, 2, 1] {
            if pairs - p0 < run {
                continue;
            }
            for r in 0..m.rows {
                let t = t0 + 2 * p0;
                match run {
                    16 => tile::<F, VNNI, 16>(&m, r, t),
                    8 => tile::<F, VNNI, 8>(&m, r, t),
                    4 => tile::<F, VNNI, 4>(&m, r, t),
                    2 => tile::<F, VNNI, 2>(&m, r, t),
                    _ => tile::<F, VNNI, 1>(&m, r, t),
                }
            }
            p0 += run;
        }
    }
}

/// Row `r` times the `P` token pairs from token `t0` (even).
#[inline(always)]
unsafe fn tile<F: Format, const VNNI: bool, const P: usize>(m: &Mats, r: usize, t0: usize) {
    let wr = m.w.add(r * m.stride);
    let zero = _mm512_setzero_si512();
    // vpermd indices doubling each dword of the low 256 bits.
    let dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let mut acc = [_mm512_setzero_ps(); P];
    // Per 16 tokens: their `m_w · s_a` chains, and the masks of the tokens read.
    let halves = (2 * P).div_ceil(16);
    let mut summs = [_mm512_setzero_ps(); 2];
    let mask = |h: usize| ((1u32 << (2 * P - 16 * h).min(16)) - 1) as __mmask16;
    // The row's scale products of the tile's tokens, for the current block.
    let mut s = [0f32; TT];
    for b in 0..m.nb {
        let wb = wr.add(b * F::BYTES);
        let x = _mm512_permutexvar_epi32(dup, _mm512_castsi256_si512(F::values(wb)));
        // -128 · Σ x per lane (128 = 0x80 as the unsigned operand).
        let corr = _mm512_sub_epi32(zero, dot_acc::<VNNI>(zero, _mm512_set1_epi8(-128), x));
        let dw = _mm512_set1_ps(f16_at(wb));
        for (h, summs) in summs.iter_mut().enumerate().take(halves) {
            let at = b * m.padded + t0 + 16 * h;
            let da = _mm512_maskz_loadu_ps(mask(h), m.scales.add(at));
            _mm512_storeu_ps(s.as_mut_ptr().add(16 * h), _mm512_mul_ps(dw, da));
            if F::MIN {
                // Each token's `summs = fma(m_w, s_a, summs)`.
                let sa = _mm512_maskz_loadu_ps(mask(h), m.sums.add(at));
                *summs = _mm512_fmadd_ps(_mm512_set1_ps(f16_at(wb.add(2))), sa, *summs);
            }
        }
        let ap = m.pairs.add((b * m.n_pairs + t0 / 2) * PAIR_BYTES);
        for (p, acc) in acc.iter_mut().enumerate() {
            let y = _mm512_loadu_si512(ap.add(p * PAIR_BYTES).cast());
            let q = dot_acc::<VNNI>(corr, y, x);
            let d = broadcast_pair(s.as_ptr().add(2 * p));
            *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), *acc);
        }
    }
    let mut sm = [0f32; TT];
    if F::MIN {
        for (h, summs) in summs.iter().enumerate().take(halves) {
            _mm512_storeu_ps(sm.as_mut_ptr().add(16 * h), *summs);
        }
    }
    // The first token's lanes to the low half, the second's to the high one.
    let split = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    let dst = m.out.add(r * m.n_tokens + t0);
    for (p, &acc) in acc.iter().enumerate() {
        let v = _mm512_permutexvar_ps(split, acc);
        for (i, half) in [lo256(v), hi256(v)].into_iter().enumerate() {
            let t = 2 * p + i;
            if t0 + t < m.n_tokens {
                // `hsum8(acc) + summs` (no addition for Q4_0/Q5_0: -0 would become +0).
                let h = hsum8(half);
                *dst.add(t) = if F::MIN { h + sm[t] } else { h };
            }
        }
    }
}

macro_rules! lowbit_entries {
    ($($plain:ident, $vnni:ident, $f:ty;)*) => {$(
        gemm_entry!(
            "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
            $plain,
            lowbit_gemm::<$f, false>,
            blocks
        );
        gemm_entry!(
            "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
            $vnni,
            lowbit_gemm::<$f, true>,
            blocks
        );
    )*};
}

lowbit_entries!(
    q4_0_plain, q4_0_vnni, Q40;
    q4_1_plain, q4_1_vnni, Q41;
    q5_0_plain, q5_0_vnni, Q50;
    q5_1_plain, q5_1_vnni, Q51;
);

/// The AVX-512 GEMM for `ty` (Q4_0, Q4_1, Q5_0 or Q5_1), with VNNI when `vnni`; `None` for
/// another type.
pub(crate) fn gemm_fn(ty: GgmlType, vnni: bool) -> Option<(&'static str, GemmFn)> {
    Some(match (ty, vnni) {
        (GgmlType::Q4_0, false) => ("q4_0*q8_0 gemm/avx512", q4_0_plain),
        (GgmlType::Q4_0, true) => ("q4_0*q8_0 gemm/avx512vnni", q4_0_vnni),
        (GgmlType::Q4_1, false) => ("q4_1*q8_1 gemm/avx512", q4_1_plain),
        (GgmlType::Q4_1, true) => ("q4_1*q8_1 gemm/avx512vnni", q4_1_vnni),
        (GgmlType::Q5_0, false) => ("q5_0*q8_0 gemm/avx512", q5_0_plain),
        (GgmlType::Q5_0, true) => ("q5_0*q8_0 gemm/avx512vnni", q5_0_vnni),
        (GgmlType::Q5_1, false) => ("q5_1*q8_1 gemm/avx512", q5_1_plain),
        (GgmlType::Q5_1, true) => ("q5_1*q8_1 gemm/avx512vnni", q5_1_vnni),
        _ => return None,
    })
}
