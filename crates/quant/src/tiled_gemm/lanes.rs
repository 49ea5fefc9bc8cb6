//! [`super::avx2::Gemm`] with AVX-512 VNNI and the tokens in vector lanes: each int32 lane of a
//! zmm is one of 16 tokens, so the integer sums need no horizontal adds. The tokens' Q8_K
//! quants are rearranged once per call ([`Lanes`]: four bytes of each token side by side),
//! and each four weight codes, broadcast, meet the 16 tokens' four bytes in one `vpdpbusd`.
//! A group's sum is scaled with `vpmulld` (per 32 elements for Q4_K and Q5_K, whose scales
//! and mins are per sub-block, per 16 for the others) into `s1`, the mins through the
//! tokens' `bsums` into `s2`. The integers are exact, and the fold into the float
//! accumulators is the per-lane sequence of [`super::Fold`], so the bits are those of the
//! scalar order (`DotKernel::dot_tokens`).
//!
//! Safety: every `unsafe fn` here needs AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI, and the
//! slices it is given whole.

use std::arch::x86_64::*;

use super::avx2::decode;
use super::Fold;
use crate::scalar::kquants::{Q8_K_BSUMS, Q8_K_BYTES, Q8_K_QS};
use crate::tiled::{Decoded, SuperBlockFormat};

/// Tokens per tile: the 16 int32 lanes of a zmm.
const T: usize = 16;
/// Four-byte units of a super-block.
const UNITS: usize = 64;
/// 16-element groups of a super-block.
const GROUPS: usize = 16;

/// The tokens' Q8_K rows rearranged per super-block and tile of 16 tokens, zeros past the
/// last token.
struct Lanes {
    tiles: usize,
    /// `[super-block][tile][unit][token]`: bytes `4u..4u+4` of the token's quants.
    units: Vec<u32>,
    /// `[super-block][tile][group][token]`: the token's sum of group `g` (`bsums[g]`).
    bsums: Vec<i32>,
    /// `[super-block][tile][token]`: the token's scale.
    d: Vec<f32>,
}

impl Lanes {
    /// `n_tokens` rows of `n_sb` Q8_K blocks each, back to back in `acts`.
    fn new(n_sb: usize, acts: &[u8], n_tokens: usize) -> Lanes {
        let tiles = n_tokens.div_ceil(T);
        let mut l = Lanes {
            tiles,
            units: vec![0; n_sb * tiles * UNITS * T],
            bsums: vec![0; n_sb * tiles * GROUPS * T],
            d: vec![0.0; n_sb * tiles * T],
        };
        let a_row = n_sb * Q8_K_BYTES;
        for (t, row) in acts.chunks_exact(a_row).take(n_tokens).enumerate() {
            let lane = t % T;
            for (b, blk) in row.chunks_exact(Q8_K_BYTES).enumerate() {
                let base = b * tiles + t / T;
                l.d[base * T + lane] = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
                let qs = blk[Q8_K_QS..].chunks_exact(4).take(UNITS);
                for (u, q) in qs.enumerate() {
                    l.units[(base * UNITS + u) * T + lane] =
                        u32::from_le_bytes([q[0], q[1], q[2], q[3]]);
                }
                let bs = blk[Q8_K_BSUMS..].chunks_exact(2).take(GROUPS);
                for (g, s) in bs.enumerate() {
                    l.bsums[(base * GROUPS + g) * T + lane] =
                        i16::from_le_bytes([s[0], s[1]]) as i32;
                }
            }
        }
        l
    }
}

/// `Σ code·a` over units `u0..u0 + n` for the 16 tokens of `units` (one tile).
#[inline(always)]
unsafe fn dot_units(codes: *const u8, units: *const u32, u0: usize, n: usize) -> __m512i {
    let mut t = _mm512_setzero_si512();
    for u in u0..u0 + n {
        let w = _mm512_set1_epi32(codes.add(4 * u).cast::<i32>().read_unaligned());
        let a = _mm512_loadu_si512(units.add(u * T).cast());
        t = _mm512_dpbusd_epi32(t, w, a);
    }
    t
}

/// `(s1, s2)` of `dec` for one tile, Q4_K/Q5_K: scales, mins and no code bias per 32-element
/// sub-block (`dec.sc[2j] == dec.sc[2j + 1]`, the same for `m`).
#[inline(always)]
unsafe fn sums_pairs(dec: &Decoded, units: *const u32, bsums: *const i32) -> (__m512i, __m512i) {
    let mut s = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for p in 0..4 {
        let (s1, s2) = sums_pair(dec, units, bsums, p);
        s = (_mm512_add_epi32(s.0, s1), _mm512_add_epi32(s.1, s2));
    }
    s
}

/// [`sums_pairs`] over sub-blocks `2p` and `2p + 1` only.
#[inline(always)]
unsafe fn sums_pair(
    dec: &Decoded,
    units: *const u32,
    bsums: *const i32,
    p: usize,
) -> (__m512i, __m512i) {
    let codes = dec.codes.as_ptr();
    let (mut s1, mut s2) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for j in 2 * p..2 * p + 2 {
        let t = dot_units(codes, units, 8 * j, 8);
        s1 = _mm512_add_epi32(
            s1,
            _mm512_mullo_epi32(t, _mm512_set1_epi32(dec.sc[2 * j] as i32)),
        );
        let bs = _mm512_add_epi32(
            _mm512_loadu_si512(bsums.add(2 * j * T).cast()),
            _mm512_loadu_si512(bsums.add((2 * j + 1) * T).cast()),
        );
        s2 = _mm512_add_epi32(
            s2,
            _mm512_mullo_epi32(bs, _mm512_set1_epi32(dec.m[2 * j] as i32)),
        );
    }
    (s1, s2)
}

/// `(s1, s2)` of `dec` for one tile, per 16-element group with the code bias (a power of
/// two: 32 for Q6_K, 4 for Q3_K, 0 for Q2_K).
#[inline(always)]
unsafe fn sums_groups(dec: &Decoded, units: *const u32, bsums: *const i32) -> (__m512i, __m512i) {
    debug_assert!(dec.bias == 0 || (dec.bias as u32).is_power_of_two());
    let codes = dec.codes.as_ptr();
    let shift = _mm512_set1_epi32(dec.bias.trailing_zeros() as i32);
    let (mut s1, mut s2) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for g in 0..GROUPS {
        let mut t = dot_units(codes, units, 4 * g, 4);
        let bs = _mm512_loadu_si512(bsums.add(g * T).cast());
        if dec.bias != 0 {
            t = _mm512_sub_epi32(t, _mm512_sllv_epi32(bs, shift));
        }
        s1 = _mm512_add_epi32(
            s1,
            _mm512_mullo_epi32(t, _mm512_set1_epi32(dec.sc[g] as i32)),
        );
        if dec.has_min {
            let m = _mm512_set1_epi32(dec.m[g] as i32);
            s2 = _mm512_add_epi32(s2, _mm512_mullo_epi32(bs, m));
        }
    }
    (s1, s2)
}

/// [`super::avx2::Gemm`] with the tokens in the lanes of 512-bit vectors.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `w` holds the rows, `acts` the
/// tokens' Q8_K rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemm_vnni(
    format: SuperBlockFormat,
    fold: Fold,
    n_sb: usize,
    w: &[u8],
    acts: &[u8],
    out: &mut [f32],
) {
    gemm::<false>(format, fold, n_sb, w, acts, out)
}

/// Q4_K rows against tokens in the order of llama.cpp's repacked GEMM, which a dense matmul
/// uses for its complete groups of four tokens (`repack.rs`, `dot_q4_k_pairwise`): per pair
/// `p` of sub-blocks `acc = fma(f32(isum_p), d_w·d_a, acc)` and `acc_min = fma(f32(imin_p),
/// dmin_w·d_a, acc_min)`, the result `acc − acc_min`.
///
/// # Safety
/// As [`gemm_vnni`], `w` holding Q4_K rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemm_vnni_q4k_pairwise(n_sb: usize, w: &[u8], acts: &[u8], out: &mut [f32]) {
    gemm::<true>(SuperBlockFormat::Q4K, Fold::Repacked, n_sb, w, acts, out)
}

/// [`gemm_vnni`]'s body; `PAIRWISE` folds Q4_K per pair of sub-blocks instead of per
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
    let rows = out.len().checked_div(n_tokens).unwrap_or(0);
    if rows == 0 {
        return;
    }
    let lanes = Lanes::new(n_sb, acts, n_tokens);
    let padded = lanes.tiles * T;
    let sb_bytes = format.bytes();
    let w_row = n_sb * sb_bytes;
    let pairs = matches!(format, SuperBlockFormat::Q4K | SuperBlockFormat::Q5K);
    let mut acc = vec![0f32; rows * padded];
    let mut acc_min = vec![0f32; rows * padded];
    // Overwritten by `decode` for each super-block.
    let mut dec = Decoded::new(format, &w[..sb_bytes]);
    // Super-blocks outermost, so that the tokens' blocks of one stay in L1 for every row.
    for b in 0..n_sb {
        for r in 0..rows {
            // The weights stream from memory in steps of a row, which the hardware prefetchers
            // do not follow: ask for the super-block two rows on.
            let ahead = b * rows + r + 2;
            if ahead < n_sb * rows {
                let at = ahead % rows * w_row + ahead / rows * sb_bytes;
                crate::prefetch(&w[at..at + sb_bytes]);
            }
            decode(format, &w[r * w_row + b * sb_bytes..][..sb_bytes], &mut dec);
            for tile in 0..lanes.tiles {
                let base = b * lanes.tiles + tile;
                let units = lanes.units.as_ptr().add(base * UNITS * T);
                let bsums = lanes.bsums.as_ptr().add(base * GROUPS * T);
                let da = _mm512_loadu_ps(lanes.d.as_ptr().add(base * T));
                let acc_p = acc.as_mut_ptr().add(r * padded + tile * T);
                let min_p = acc_min.as_mut_ptr().add(r * padded + tile * T);
                if PAIRWISE {
                    let d = _mm512_mul_ps(_mm512_set1_ps(dec.d), da);
                    let dmin = _mm512_mul_ps(_mm512_set1_ps(dec.dmin), da);
                    let (mut x, mut m) = (_mm512_loadu_ps(acc_p), _mm512_loadu_ps(min_p));
                    for p in 0..4 {
                        let (s1, s2) = sums_pair(&dec, units, bsums, p);
                        x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), d, x);
                        m = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), dmin, m);
                    }
                    _mm512_storeu_ps(acc_p, x);
                    _mm512_storeu_ps(min_p, m);
                    continue;
                }
                let (s1, s2) = if pairs {
                    sums_pairs(&dec, units, bsums)
                } else {
                    sums_groups(&dec, units, bsums)
                };
                let (s1, s2) = (_mm512_cvtepi32_ps(s1), _mm512_cvtepi32_ps(s2));
                match fold {
                    Fold::Tiled => {
                        let mut x = _mm512_mul_ps(s1, _mm512_set1_ps(dec.d));
                        if dec.has_min {
                            x = _mm512_fmadd_ps(_mm512_set1_ps(-dec.dmin), s2, x);
                        }
                        _mm512_storeu_ps(acc_p, _mm512_fmadd_ps(x, da, _mm512_loadu_ps(acc_p)));
                    }
                    Fold::Repacked => {
                        let d = _mm512_mul_ps(_mm512_set1_ps(dec.d), da);
                        let dmin = _mm512_mul_ps(_mm512_set1_ps(dec.dmin), da);
                        _mm512_storeu_ps(acc_p, _mm512_fmadd_ps(s1, d, _mm512_loadu_ps(acc_p)));
                        let m = _mm512_fmadd_ps(s2, dmin, _mm512_loadu_ps(min_p));
                        _mm512_storeu_ps(min_p, m);
                    }
                }
            }
        }
    }
    fold.write(out, n_tokens, (&acc, &acc_min), padded);
}
