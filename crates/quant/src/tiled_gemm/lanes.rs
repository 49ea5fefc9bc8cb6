//! The batched K-quant products of `super::avx2::gemm_avx2` with AVX-512 VNNI and the tokens
//! in vector lanes: each int32 lane of a zmm is one of 16 tokens, so the integer sums need no
//! horizontal adds. The tokens' Q8_K quants are rearranged once per batch ([`Lanes`]: four
//! bytes of each token side by side, shared by every weight matrix the batch meets), and each
//! four weight codes, broadcast, meet the 16 tokens' four bytes in one `vpdpbusd`, for two
//! tiles of tokens at a time where the batch has them (one broadcast for both); a last tile
//! of at most 8 tokens runs in 256-bit vectors (`lane_vec.rs`). A group's sum is scaled with
//! `vpmulld` (per 32 elements for Q5_K, whose scales and mins are per sub-block, per 16 for
//! Q2_K, Q3_K and Q6_K), or for Q4_K as i16 halves by `vpdpwssd`; the mins and the code bias
//! go through the tokens' group sums, paired as i16 for `vpdpwssd` (two groups an
//! instruction). The integers are exact, and the fold into the float accumulators is the
//! per-lane sequence of [`super::Fold`], so the bits are those of the scalar order
//! (`DotKernel::dot_tokens`).
//!
//! Safety: every `unsafe fn` here needs AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI, and the
//! slices it is given whole.

use std::arch::x86_64::*;

use super::avx2::decode;
use super::lane_vec::LaneVec;
use super::Fold;
use crate::scalar::kquants::{Q8_K_BSUMS, Q8_K_BYTES, Q8_K_QS};
use crate::tiled::{Decoded, SuperBlockFormat};

/// Tokens per tile: the 16 int32 lanes of a zmm.
const T: usize = 16;
/// Four-byte units of a super-block.
const UNITS: usize = 64;
/// Pairs of 16-element groups of a super-block.
const PAIRS16: usize = 8;
/// Pairs of 32-element sub-blocks of a super-block.
const PAIRS32: usize = 4;

/// The tokens' Q8_K rows rearranged per super-block and tile of 16 tokens, zeros past the
/// last token.
pub(crate) struct Lanes {
    n_sb: usize,
    n_tokens: usize,
    tiles: usize,
    /// `[super-block][tile][unit][token]`: bytes `4u..4u+4` of the token's quants.
    units: Vec<u32>,
    /// `[super-block][tile][k][token]`: the token's `bsums[2k]` and `bsums[2k + 1]` as the low
    /// and high i16.
    pairs16: Vec<u32>,
    /// `[super-block][tile][p][token]`: the token's sums of sub-blocks `2p` and `2p + 1`
    /// (`bsums[4p] + bsums[4p + 1]`, `bsums[4p + 2] + bsums[4p + 3]`, each at most 32 · 128)
    /// as the low and high i16.
    pairs32: Vec<u32>,
    /// `[super-block][tile][token]`: the token's scale.
    d: Vec<f32>,
}

impl Lanes {
    /// `n_tokens` rows of `n_sb` Q8_K blocks each, back to back in `acts`.
    pub(crate) fn new(n_sb: usize, acts: &[u8], n_tokens: usize) -> Lanes {
        let tiles = n_tokens.div_ceil(T);
        let mut l = Lanes {
            n_sb,
            n_tokens,
            tiles,
            units: vec![0; n_sb * tiles * UNITS * T],
            pairs16: vec![0; n_sb * tiles * PAIRS16 * T],
            pairs32: vec![0; n_sb * tiles * PAIRS32 * T],
            d: vec![0.0; n_sb * tiles * T],
        };
        let a_row = n_sb * Q8_K_BYTES;
        let pack = |lo: i32, hi: i32| (lo as u16 as u32) | ((hi as u16 as u32) << 16);
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
                let bs: [i32; 16] = std::array::from_fn(|g| {
                    let o = Q8_K_BSUMS + 2 * g;
                    i16::from_le_bytes([blk[o], blk[o + 1]]) as i32
                });
                for k in 0..PAIRS16 {
                    l.pairs16[(base * PAIRS16 + k) * T + lane] = pack(bs[2 * k], bs[2 * k + 1]);
                }
                for p in 0..PAIRS32 {
                    let (lo, hi) = (bs[4 * p] + bs[4 * p + 1], bs[4 * p + 2] + bs[4 * p + 3]);
                    l.pairs32[(base * PAIRS32 + p) * T + lane] = pack(lo, hi);
                }
            }
        }
        l
    }
}

/// Pointers into [`Lanes`] at one super-block and tile.
#[derive(Clone, Copy)]
struct Tile {
    units: *const u32,
    pairs16: *const u32,
    pairs32: *const u32,
}

impl Tile {
    /// Tile `tile` of super-block `b`.
    #[inline(always)]
    unsafe fn at(l: &Lanes, b: usize, tile: usize) -> Tile {
        let base = b * l.tiles + tile;
        Tile {
            units: l.units.as_ptr().add(base * UNITS * T),
            pairs16: l.pairs16.as_ptr().add(base * PAIRS16 * T),
            pairs32: l.pairs32.as_ptr().add(base * PAIRS32 * T),
        }
    }
}

/// `Σ code·a` over units `u0..u0 + n` for the tokens of each of the `NT` tiles (adjacent in
/// [`Lanes`]; the first `V`'s lanes of each), each broadcast of four codes serving every tile.
#[inline(always)]
unsafe fn dot_units<V: LaneVec, const NT: usize>(
    codes: *const u8,
    t: &Tile,
    u0: usize,
    n: usize,
) -> [V; NT] {
    let mut s = [V::zero(); NT];
    for u in u0..u0 + n {
        let w = V::splat(codes.add(4 * u).cast::<i32>().read_unaligned());
        for (k, s) in s.iter_mut().enumerate() {
            *s = V::dpbusd(*s, w, V::load(t.units.add((k * UNITS + u) * T)));
        }
    }
    s
}

/// The dword of i16 `lo` and `hi`, in every lane.
#[inline(always)]
unsafe fn pair<V: LaneVec>(lo: i16, hi: i16) -> V {
    V::splat(((lo as u16 as u32) | ((hi as u16 as u32) << 16)) as i32)
}

/// `(s1, s2)` of `dec` over sub-blocks `2p` and `2p + 1` for `NT` tiles, Q4_K/Q5_K: scales,
/// mins and no code bias per 32-element sub-block (`dec.sc[2j] == dec.sc[2j + 1]`, the same
/// for `m`). With `HALVES` (Q4_K, codes below 16) each 16 elements' sum fits i16 (at most
/// 16 · 15 · 128): the two halves of a sub-block are interleaved as i16 pairs (one `vpermt2w`,
/// off the multiplier port) and scaled and added by one `vpdpwssd`, instead of a `vpmulld`
/// (two multiplier uops) and an add.
#[inline(always)]
unsafe fn sums_pair<V: LaneVec, const NT: usize, const HALVES: bool>(
    dec: &Decoded,
    t: &Tile,
    p: usize,
) -> ([V; NT], [V; NT]) {
    let codes = dec.codes.as_ptr();
    let mut s1 = [V::zero(); NT];
    for j in 2 * p..2 * p + 2 {
        if HALVES {
            let lo = dot_units::<V, NT>(codes, t, 8 * j, 4);
            let hi = dot_units::<V, NT>(codes, t, 8 * j + 4, 4);
            let sc = pair::<V>(dec.sc[2 * j], dec.sc[2 * j]);
            for k in 0..NT {
                s1[k] = V::dpwssd(s1[k], V::low_words(lo[k], hi[k]), sc);
            }
        } else {
            let sums = dot_units::<V, NT>(codes, t, 8 * j, 8);
            let sc = V::splat(dec.sc[2 * j] as i32);
            for (s1, x) in s1.iter_mut().zip(sums) {
                *s1 = V::add(*s1, V::mullo(x, sc));
            }
        }
    }
    let m = pair::<V>(dec.m[4 * p], dec.m[4 * p + 2]);
    let mut s2 = [V::zero(); NT];
    for (k, s2) in s2.iter_mut().enumerate() {
        *s2 = V::dpwssd(*s2, V::load(t.pairs32.add((k * PAIRS32 + p) * T)), m);
    }
    (s1, s2)
}

/// `(s1, s2)` of `dec` for `NT` tiles, Q4_K/Q5_K ([`sums_pair`] over the four pairs).
#[inline(always)]
unsafe fn sums_pairs<V: LaneVec, const NT: usize, const HALVES: bool>(
    dec: &Decoded,
    t: &Tile,
) -> ([V; NT], [V; NT]) {
    let mut s = ([V::zero(); NT], [V::zero(); NT]);
    for p in 0..PAIRS32 {
        let (s1, s2) = sums_pair::<V, NT, HALVES>(dec, t, p);
        for k in 0..NT {
            s.0[k] = V::add(s.0[k], s1[k]);
            s.1[k] = V::add(s.1[k], s2[k]);
        }
    }
    s
}

/// `Σ_g v_g · bsum_g` over the 16 groups for `NT` tiles, `v` the i16 values of `dec` (its
/// scales or mins), two groups a `vpdpwssd`.
#[inline(always)]
unsafe fn group_products<V: LaneVec, const NT: usize>(v: &[i16; 16], t: &Tile) -> [V; NT] {
    let mut s = [V::zero(); NT];
    for k in 0..PAIRS16 {
        let w = pair::<V>(v[2 * k], v[2 * k + 1]);
        for (i, s) in s.iter_mut().enumerate() {
            *s = V::dpwssd(*s, V::load(t.pairs16.add((i * PAIRS16 + k) * T)), w);
        }
    }
    s
}

/// `(s1, s2)` of `dec` for `NT` tiles, per 16-element group with the code bias (a power of
/// two: 32 for Q6_K, 4 for Q3_K, 0 for Q2_K): `s1 = Σ_g sc_g · Σ code·a − bias · Σ_g sc_g ·
/// bsum_g`, exact in wrapping i32 arithmetic as the result fits.
#[inline(always)]
unsafe fn sums_groups<V: LaneVec, const NT: usize>(dec: &Decoded, t: &Tile) -> ([V; NT], [V; NT]) {
    debug_assert!(dec.bias == 0 || (dec.bias as u32).is_power_of_two());
    let codes = dec.codes.as_ptr();
    let mut s1 = [V::zero(); NT];
    for g in 0..16 {
        let sums = dot_units::<V, NT>(codes, t, 4 * g, 4);
        let sc = V::splat(dec.sc[g] as i32);
        for (s1, x) in s1.iter_mut().zip(sums) {
            *s1 = V::add(*s1, V::mullo(x, sc));
        }
    }
    if dec.bias != 0 {
        let shift = _mm_cvtsi32_si128(dec.bias.trailing_zeros() as i32);
        let corr = group_products::<V, NT>(&dec.sc, t);
        for (s1, c) in s1.iter_mut().zip(corr) {
            *s1 = V::sub(*s1, V::sll(c, shift));
        }
    }
    let s2 = if dec.has_min {
        group_products::<V, NT>(&dec.m, t)
    } else {
        [V::zero(); NT]
    };
    (s1, s2)
}

/// `super::avx2::gemm_avx2` with the tokens in the lanes of 512-bit vectors, over the tokens
/// of `lanes`.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; `w` holds the rows of the
/// super-blocks `lanes` has per token, `out` a result per row and token of `lanes`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemm_vnni(
    format: SuperBlockFormat,
    fold: Fold,
    lanes: &Lanes,
    w: &[u8],
    out: &mut [f32],
) {
    gemm::<false>(format, fold, lanes, w, out)
}

/// Q4_K rows against tokens in the order of llama.cpp's repacked GEMM, which a dense matmul
/// uses for its complete groups of four tokens (`repack.rs`, `dot_q4_k_pairwise`): per pair
/// `p` of sub-blocks `acc = fma(f32(isum_p), d_w·d_a, acc)` and `acc_min = fma(f32(imin_p),
/// dmin_w·d_a, acc_min)`, the result `acc − acc_min`.
///
/// # Safety
/// As [`gemm_vnni`], `w` holding Q4_K rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemm_vnni_q4k_pairwise(lanes: &Lanes, w: &[u8], out: &mut [f32]) {
    gemm::<true>(SuperBlockFormat::Q4K, Fold::Repacked, lanes, w, out)
}

/// One row's float accumulators `acc` and `acc_min` (a tile of tokens after another).
struct Accs<'a> {
    acc: &'a mut [f32],
    acc_min: &'a mut [f32],
}

/// Folds the `NT` tiles from `tile` on of super-block `b` of one row (`dec`) into `accs`, the
/// first `V`'s lanes of each.
#[inline(always)]
unsafe fn tiles<V: LaneVec, const NT: usize, const PAIRWISE: bool>(
    format: SuperBlockFormat,
    fold: Fold,
    dec: &Decoded,
    l: &Lanes,
    (b, tile): (usize, usize),
    accs: &mut Accs<'_>,
) {
    let t = Tile::at(l, b, tile);
    let mut da = [V::fsplat(0.0); NT];
    for (k, da) in da.iter_mut().enumerate() {
        *da = V::fload(l.d.as_ptr().add((b * l.tiles + tile + k) * T));
    }
    let acc_p = accs.acc.as_mut_ptr().add(tile * T);
    let min_p = accs.acc_min.as_mut_ptr().add(tile * T);
    if PAIRWISE {
        for (k, da) in da.into_iter().enumerate() {
            let d = V::fmul(V::fsplat(dec.d), da);
            let dmin = V::fmul(V::fsplat(dec.dmin), da);
            let (ap, mp) = (acc_p.add(k * T), min_p.add(k * T));
            let (mut x, mut m) = (V::fload(ap), V::fload(mp));
            let tk = Tile {
                units: t.units.add(k * UNITS * T),
                pairs16: t.pairs16.add(k * PAIRS16 * T),
                pairs32: t.pairs32.add(k * PAIRS32 * T),
            };
            for p in 0..PAIRS32 {
                let (s1, s2) = sums_pair::<V, 1, true>(dec, &tk, p);
                x = V::fmadd(V::to_f32(s1[0]), d, x);
                m = V::fmadd(V::to_f32(s2[0]), dmin, m);
            }
            V::fstore(ap, x);
            V::fstore(mp, m);
        }
        return;
    }
    let (s1, s2) = match format {
        SuperBlockFormat::Q4K => sums_pairs::<V, NT, true>(dec, &t),
        SuperBlockFormat::Q5K => sums_pairs::<V, NT, false>(dec, &t),
        _ => sums_groups::<V, NT>(dec, &t),
    };
    for k in 0..NT {
        let (s1, s2) = (V::to_f32(s1[k]), V::to_f32(s2[k]));
        let (ap, mp) = (acc_p.add(k * T), min_p.add(k * T));
        match fold {
            Fold::Tiled => {
                let mut x = V::fmul(s1, V::fsplat(dec.d));
                if dec.has_min {
                    x = V::fmadd(V::fsplat(-dec.dmin), s2, x);
                }
                V::fstore(ap, V::fmadd(x, da[k], V::fload(ap)));
            }
            Fold::Repacked => {
                let d = V::fmul(V::fsplat(dec.d), da[k]);
                let dmin = V::fmul(V::fsplat(dec.dmin), da[k]);
                V::fstore(ap, V::fmadd(s1, d, V::fload(ap)));
                V::fstore(mp, V::fmadd(s2, dmin, V::fload(mp)));
            }
        }
    }
}

/// [`gemm_vnni`]'s body; `PAIRWISE` folds Q4_K per pair of sub-blocks instead of per
/// super-block (both chains, [`Fold::Repacked`]'s result). Whole tiles of 16 tokens run two
/// at a time in 512-bit vectors, a last tile of at most 8 tokens in 256-bit ones.
#[inline(always)]
unsafe fn gemm<const PAIRWISE: bool>(
    format: SuperBlockFormat,
    fold: Fold,
    lanes: &Lanes,
    w: &[u8],
    out: &mut [f32],
) {
    let (n_sb, n_tokens) = (lanes.n_sb, lanes.n_tokens);
    let rows = out.len().checked_div(n_tokens).unwrap_or(0);
    if rows == 0 {
        return;
    }
    let padded = lanes.tiles * T;
    let sb_bytes = format.bytes();
    let w_row = n_sb * sb_bytes;
    assert!(w.len() >= rows * w_row, "weight rows");
    let mut acc = vec![0f32; rows * padded];
    let mut acc_min = vec![0f32; rows * padded];
    let (full, half) = match n_tokens % T {
        0 => (lanes.tiles, false),
        r if r <= T / 2 => (lanes.tiles - 1, true),
        _ => (lanes.tiles, false),
    };
    // Overwritten by `decode` for each super-block.
    let mut dec = Decoded::scales(format, &w[..sb_bytes]);
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
            let mut accs = Accs {
                acc: &mut acc[r * padded..(r + 1) * padded],
                acc_min: &mut acc_min[r * padded..(r + 1) * padded],
            };
            let at = |tile| (b, tile);
            let mut tile = 0;
            while tile + 2 <= full {
                tiles::<__m512i, 2, PAIRWISE>(format, fold, &dec, lanes, at(tile), &mut accs);
                tile += 2;
            }
            if tile < full {
                tiles::<__m512i, 1, PAIRWISE>(format, fold, &dec, lanes, at(tile), &mut accs);
            }
            if half {
                tiles::<__m256i, 1, PAIRWISE>(format, fold, &dec, lanes, at(full), &mut accs);
            }
        }
    }
    fold.write(out, n_tokens, (&acc, &acc_min), padded);
}
