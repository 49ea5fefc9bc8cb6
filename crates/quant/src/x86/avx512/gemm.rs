//! AVX-512 F/BW/VL GEMM kernels (VNNI `vpdpbusd` when present), bit-identical to the scalar
//! references in `scalar/gemm.rs`.
//!
//! * MXFP4: 16 weight rows in the 16 lanes. For each block the rows' 16 nibble bytes are
//!   transposed as dwords (4 × `vinserti32x4` per 4 rows, then `vpunpck{l,h}{dq,qdq}`), so
//!   vector `k` holds, in lane `r`, bytes `4k..4k+4` of row `r`: elements `4k..4k+4` in the low
//!   nibbles and `16+4k..` in the high ones. `vpshufb` maps nibbles to `value + 12`, and one
//!   `vpdpbusd` per vector against a broadcast activation dword adds four products to every
//!   row's sum; the sum starts at `-12 · Σa`, so it ends exact. The scale `2^(e-128) · d` is
//!   `vscalefps(d, e - 128)` (one rounding, as the scalar product of two f32), then one FMA
//!   accumulates all 16 rows. Calls of up to 8 tokens use each decoded block at once
//!   (accumulators in registers); longer ones decode runs of 16 blocks of a row group into L1
//!   once and take every token over them in tiles of 8, the accumulators of up to 64 tokens
//!   carried from run to run. Each group prefetches the next one into L2. Rows interleaved at
//!   load (`X16`, `GemmKernel::interleave_into`) hold each block of a group already transposed,
//!   with the 16 exponents together: four loads and one exponent load per block instead.
//! * Q8_0: tiles of 4 rows × 8 tokens, in chunks of 64 tokens; two tokens share a zmm (lanes
//!   0..8 and 8..16 are the 8-lane accumulators of ggml's AVX2 kernel for each). With VNNI the
//!   blocks go in passes of 64 over all the tiles, so a pass's activations stay in L2.
//! * F32: tiles of 4 rows × 4 tokens of 16-lane FMA accumulators.
//!
//! Safety: every `unsafe fn` here needs AVX-512 F/BW/VL plus AVX2, FMA and F16C (and VNNI for
//! `VNNI = true`), and the slice contract of [`GemmFn`].

use core::arch::x86_64::*;
use core::ops::Range;

use crate::cache_hint::prefetch_l2;
use crate::gemm_layout::{row_ptrs, GemmFn, KVALUES_MXFP4_PLUS12, X16_NIBBLE_BYTES};
use crate::scalar::shared::{MXFP4_BYTES, Q8_0_BYTES, QK};
use crate::x86::avx2::dot::{f16_at, hsum8};
use crate::x86::avx512::dot::{dot_u8i8, hi256, hsum16, lo256, load_2x256, neg_where};
use crate::GgmlType;

/// MXFP4 rows per group (one per lane).
const G: usize = 16;

/// `acc + Σ u[4l..4l+4] · s[4l..4l+4]` per int32 lane `l` (unsigned × signed bytes): `vpdpbusd`,
/// or `vpmaddubsw` + `vpmaddwd`, whose 16-bit pair sums cannot saturate for `u ≤ 24`.
#[inline(always)]
unsafe fn dot_acc<const VNNI: bool>(acc: __m512i, u: __m512i, s: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpbusd_epi32(acc, u, s)
    } else {
        let p = _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
        _mm512_add_epi32(acc, p)
    }
}

/// The little-endian dword at `p`, broadcast.
#[inline(always)]
unsafe fn bcast32(p: *const u8) -> __m512i {
    _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// The 16 table bytes at `t` in every 128-bit lane, for [`decode16`].
#[inline(always)]
pub(crate) unsafe fn nibble_table(t: *const u8) -> __m512i {
    _mm512_broadcast_i32x4(_mm_loadu_si128(t.cast()))
}

/// Decodes block `b` of the row group at `base` (16 rows of `nb` blocks, `stride` bytes
/// each, in the file's layout or, with `X16`, interleaved: see
/// [`crate::gemm_layout::interleave_x16`]) through `table` ([`nibble_table`]): `u[k]`
/// (`u[4 + k]`) holds in lane `r` the table values of elements `4k..4k+4` (`16+4k..16+4k+4`)
/// of row `r`; the second result is each row's exponent minus 128, as f32.
#[inline(always)]
pub(crate) unsafe fn decode16<const VBMI: bool, const X16: bool>(
    base: *const u8,
    stride: usize,
    nb: usize,
    b: usize,
    table: __m512i,
) -> ([__m512i; 8], __m512) {
    let (v, e) = if X16 {
        let nibbles = base.add(b * X16_NIBBLE_BYTES);
        let v = [0, 1, 2, 3].map(|k| _mm512_loadu_si512(nibbles.add(64 * k).cast()));
        let exps = base.add(nb * X16_NIBBLE_BYTES + b * G);
        (v, _mm512_cvtepu8_epi32(_mm_loadu_si128(exps.cast())))
    } else {
        transpose16(base, stride, b * MXFP4_BYTES)
    };
    let mut u = [_mm512_setzero_si512(); 8];
    for k in 0..4 {
        let hi = _mm512_srli_epi32::<4>(v[k]);
        if VBMI {
            // `vpermb` reads 6 index bits; the table repeats every 16 bytes, so bits 4 and 5
            // (the other nibble, or the next byte's low bits after the shift) do not matter.
            u[k] = _mm512_permutexvar_epi8(v[k], table);
            u[4 + k] = _mm512_permutexvar_epi8(hi, table);
        } else {
            let m4 = _mm512_set1_epi8(0x0f);
            u[k] = _mm512_shuffle_epi8(table, _mm512_and_si512(v[k], m4));
            u[4 + k] = _mm512_shuffle_epi8(table, _mm512_and_si512(hi, m4));
        }
    }
    let ef = _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128)));
    (u, ef)
}

/// The block at byte `off` of the 16 rows `base + r · stride` in the file's layout, transposed
/// as dwords: lane `r` of the `k`-th vector holds nibble bytes `4k..4k+4` of row `r`; and each
/// row's exponent byte in lane `r`. (Addresses are formed from four group bases and
/// `g · stride`, so the row pointers stay in registers.)
#[inline(always)]
unsafe fn transpose16(base: *const u8, stride: usize, off: usize) -> ([__m512i; 4], __m512i) {
    let p = [
        base.add(off),
        base.add(4 * stride + off),
        base.add(8 * stride + off),
        base.add(12 * stride + off),
    ];
    let mut z = [_mm512_setzero_si512(); 4];
    for (g, z) in z.iter_mut().enumerate() {
        // 128-bit lane i of z[g] holds row 4i + g.
        let q = |i: usize| p[i].add(g * stride + 1).cast::<__m128i>();
        let mut v = _mm512_castsi128_si512(_mm_loadu_si128(q(0)));
        v = _mm512_mask_broadcast_i32x4(v, 0x00f0, _mm_loadu_si128(q(1)));
        v = _mm512_mask_broadcast_i32x4(v, 0x0f00, _mm_loadu_si128(q(2)));
        v = _mm512_mask_broadcast_i32x4(v, 0xf000, _mm_loadu_si128(q(3)));
        *z = v;
    }
    // 4×4 dword transpose inside each 128-bit lane: lane 4i + j of v[k] = dword k of row 4i + j.
    let t01l = _mm512_unpacklo_epi32(z[0], z[1]);
    let t01h = _mm512_unpackhi_epi32(z[0], z[1]);
    let t23l = _mm512_unpacklo_epi32(z[2], z[3]);
    let t23h = _mm512_unpackhi_epi32(z[2], z[3]);
    let v = [
        _mm512_unpacklo_epi64(t01l, t23l),
        _mm512_unpackhi_epi64(t01l, t23l),
        _mm512_unpacklo_epi64(t01h, t23h),
        _mm512_unpackhi_epi64(t01h, t23h),
    ];
    // The exponent bytes: one dword gather from the 16 block starts (the exponent and the
    // first three nibble bytes), masked to the exponent; lane r is row r.
    let rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(stride as i32),
    );
    let g = _mm512_i32gather_epi32::<1>(rows, p[0].cast());
    (v, _mm512_and_si512(g, _mm512_set1_epi32(0xff)))
}

/// Every row's exact integer dot of one block with the activation block at `ab`, starting from
/// `bias = -12 · Σa` (two chains for latency).
#[inline(always)]
unsafe fn isum16<const VNNI: bool>(u: &[__m512i; 8], ab: *const u8, bias: i32) -> __m512i {
    let mut s0 = _mm512_set1_epi32(bias);
    let mut s1 = _mm512_setzero_si512();
    for k in 0..4 {
        s0 = dot_acc::<VNNI>(s0, u[k], bcast32(ab.add(2 + 4 * k)));
        s1 = dot_acc::<VNNI>(s1, u[4 + k], bcast32(ab.add(2 + QK / 2 + 4 * k)));
    }
    _mm512_add_epi32(s0, s1)
}

/// `fma(isum, 2^(e-128) · d, acc)` for the 16 rows, `d` the activation block's f16 scale at `ab`.
#[inline(always)]
unsafe fn block_fma(isum: __m512i, ef: __m512, ab: *const u8, acc: __m512) -> __m512 {
    let scale = _mm512_scalef_ps(_mm512_set1_ps(f16_at(ab)), ef);
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc)
}

/// The lanes `skip..skip + valid` of a row group's results.
#[derive(Clone, Copy)]
struct Lanes {
    skip: usize,
    valid: usize,
}

/// Stores `lanes` of `v` to `out`, `step` floats apart.
#[inline(always)]
unsafe fn store_lanes(v: __m512, lanes: Lanes, out: *mut f32, step: usize) {
    let mut tmp = [0f32; G];
    _mm512_storeu_ps(tmp.as_mut_ptr(), v);
    for (r, &x) in tmp[lanes.skip..].iter().take(lanes.valid).enumerate() {
        *out.add(r * step) = x;
    }
}

/// Prefetches into L2 the 272 bytes of the next row group (contiguous, at `next`) that match
/// block `b` of the current one, so the next group streams in while this one computes (the
/// prefetch hint only: addresses past the rows are harmless).
#[inline(always)]
pub(crate) unsafe fn prefetch_group(next: *const u8, b: usize) {
    prefetch_l2(next.wrapping_add(b * G * MXFP4_BYTES), G * MXFP4_BYTES);
}

/// `TT` tokens (`a`, `bias` and `out` at the first) over one row group, decoding each block
/// once for all of them; the next group is prefetched.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn mxfp4_tile<const TT: usize, const VNNI: bool, const VBMI: bool, const X16: bool>(
    nb: usize,
    base: *const u8,
    stride: usize,
    a: *const u8,
    bias: *const i32,
    out: *mut f32,
    n_tokens: usize,
    lanes: Lanes,
) {
    let astride = nb * Q8_0_BYTES;
    let next = base.wrapping_add(G * stride);
    let mut acc = [_mm512_setzero_ps(); TT];
    let table = nibble_table(KVALUES_MXFP4_PLUS12.as_ptr());
    for b in 0..nb {
        prefetch_group(next, b);
        let (u, ef) = decode16::<VBMI, X16>(base, stride, nb, b, table);
        for (j, acc) in acc.iter_mut().enumerate() {
            let ab = a.add(j * astride + b * Q8_0_BYTES);
            *acc = block_fma(isum16::<VNNI>(&u, ab, *bias.add(j * nb + b)), ef, ab, *acc);
        }
    }
    for (j, &acc) in acc.iter().enumerate() {
        store_lanes(acc, lanes, out.add(j), n_tokens);
    }
}

/// Blocks per row of gpt-oss's matrices (width 2880 in and out).
const GPT_OSS_NB: usize = 2880 / QK;

#[inline(always)]
unsafe fn mxfp4_gemm<const VNNI: bool, const VBMI: bool, const X16: bool>(
    n: usize,
    w: &[u8],
    acts: &[u8],
    bias: &[i32],
    n_tokens: usize,
    out: &mut [f32],
) {
    let nb = n / QK;
    let rows = out.len() / n_tokens;
    let stride = nb * MXFP4_BYTES;
    // Fewer than 16 rows: run on a zero-padded copy (interleaved rows come in whole groups).
    debug_assert!(!X16 || rows.is_multiple_of(G));
    let padded: Vec<u8>;
    let w = if rows < G {
        padded = [&w[..rows * stride], &vec![0u8; (G - rows) * stride]].concat();
        Padded {
            w: padded.as_ptr(),
            rows: G,
        }
    } else {
        Padded {
            w: w.as_ptr(),
            rows,
        }
    };
    // One token of gpt-oss's width: compiled with the row stride a constant, so each of the 16
    // rows is the group's base plus an immediate offset (no row pointers to keep in registers,
    // nor to spill and reload every block).
    if n_tokens == 1 && nb == GPT_OSS_NB {
        mxfp4_gemm_nb::<VNNI, VBMI, X16>(GPT_OSS_NB, w, acts, bias, 1, out)
    } else if n_tokens <= TILE_TOKENS {
        mxfp4_gemm_nb::<VNNI, VBMI, X16>(nb, w, acts, bias, n_tokens, out)
    } else {
        mxfp4_gemm_runs::<VNNI, VBMI, X16>(nb, w, acts, bias, n_tokens, out)
    }
}

/// Weight rows, at least [`G`] of them (fewer are zero-padded by [`mxfp4_gemm`]).
#[derive(Clone, Copy)]
struct Padded {
    w: *const u8,
    rows: usize,
}

/// The row group that yields rows `r0..` of the `rows` wanted: its first row's address and
/// which of its lanes are those rows (a partial last group reruns the rows before it and keeps
/// the new rows' results).
#[inline(always)]
unsafe fn row_group(w: Padded, r0: usize, rows: usize, stride: usize) -> (*const u8, Lanes) {
    let first = r0.min(w.rows - G);
    let lanes = Lanes {
        skip: r0 - first,
        valid: (rows - r0).min(G),
    };
    (w.w.add(first * stride), lanes)
}

/// Tokens whose accumulators one tile keeps in registers.
const TILE_TOKENS: usize = 8;
/// Blocks of a row group decoded at a time: their values (8 registers each) and scales stay
/// in L1 while every token of the call runs over them.
const DEC_BLOCKS: usize = 16;
/// Tokens whose accumulators one pass over a row group carries from run to run.
const TOK_CHUNK: usize = 64;

/// `DEC_BLOCKS` decoded blocks of one row group ([`decode16`]'s results).
struct Decoded {
    u: [[__m512i; 8]; DEC_BLOCKS],
    ef: [__m512; DEC_BLOCKS],
}

/// `TT` tokens (`a` and `bias` at the run's first block, of the first token) over the `nbc`
/// decoded blocks of `dec`, carrying their accumulators in `acc`.
#[inline(always)]
unsafe fn mxfp4_run_tile<const TT: usize, const VNNI: bool>(
    dec: &Decoded,
    nbc: usize,
    (a, astride): (*const u8, usize),
    (bias, nb): (*const i32, usize),
    acc: &mut [__m512],
) {
    let mut r = [_mm512_setzero_ps(); TT];
    r.copy_from_slice(&acc[..TT]);
    for i in 0..nbc {
        let u = &dec.u[i];
        for (j, r) in r.iter_mut().enumerate() {
            let ab = a.add(j * astride + i * Q8_0_BYTES);
            *r = block_fma(
                isum16::<VNNI>(u, ab, *bias.add(j * nb + i)),
                dec.ef[i],
                ab,
                *r,
            );
        }
    }
    acc[..TT].copy_from_slice(&r);
}

/// More than [`TILE_TOKENS`] tokens: each run of [`DEC_BLOCKS`] blocks of a row group is
/// decoded once into L1 and every token of a chunk of up to [`TOK_CHUNK`] runs over it, so the
/// decoding is not repeated per tile of tokens.
#[inline(always)]
unsafe fn mxfp4_gemm_runs<const VNNI: bool, const VBMI: bool, const X16: bool>(
    nb: usize,
    w: Padded,
    acts: &[u8],
    bias: &[i32],
    n_tokens: usize,
    out: &mut [f32],
) {
    let rows = out.len() / n_tokens;
    let stride = nb * MXFP4_BYTES;
    let astride = nb * Q8_0_BYTES;
    let (a, bias, o) = (acts.as_ptr(), bias.as_ptr(), out.as_mut_ptr());
    let mut dec = Decoded {
        u: [[_mm512_setzero_si512(); 8]; DEC_BLOCKS],
        ef: [_mm512_setzero_ps(); DEC_BLOCKS],
    };
    let mut acc = [_mm512_setzero_ps(); TOK_CHUNK];
    let table = nibble_table(KVALUES_MXFP4_PLUS12.as_ptr());
    for tc in (0..n_tokens).step_by(TOK_CHUNK) {
        let tn = (n_tokens - tc).min(TOK_CHUNK);
        for r0 in (0..rows).step_by(G) {
            let (base, lanes) = row_group(w, r0, rows, stride);
            let next = base.wrapping_add(G * stride);
            acc[..tn].fill(_mm512_setzero_ps());
            for b0 in (0..nb).step_by(DEC_BLOCKS) {
                let nbc = (nb - b0).min(DEC_BLOCKS);
                for i in 0..nbc {
                    let b = b0 + i;
                    prefetch_group(next, b);
                    (dec.u[i], dec.ef[i]) = decode16::<VBMI, X16>(base, stride, nb, b, table);
                }
                for t0 in (0..tn).step_by(TILE_TOKENS) {
                    let t = tc + t0;
                    let at = (a.add(t * astride + b0 * Q8_0_BYTES), astride);
                    let bt = (bias.add(t * nb + b0), nb);
                    let acc = &mut acc[t0..];
                    match tn - t0 {
                        1 => mxfp4_run_tile::<1, VNNI>(&dec, nbc, at, bt, acc),
                        2 => mxfp4_run_tile::<2, VNNI>(&dec, nbc, at, bt, acc),
                        3 => mxfp4_run_tile::<3, VNNI>(&dec, nbc, at, bt, acc),
                        4 => mxfp4_run_tile::<4, VNNI>(&dec, nbc, at, bt, acc),
                        5 => mxfp4_run_tile::<5, VNNI>(&dec, nbc, at, bt, acc),
                        6 => mxfp4_run_tile::<6, VNNI>(&dec, nbc, at, bt, acc),
                        7 => mxfp4_run_tile::<7, VNNI>(&dec, nbc, at, bt, acc),
                        _ => mxfp4_run_tile::<8, VNNI>(&dec, nbc, at, bt, acc),
                    }
                }
            }
            for (j, &acc) in acc[..tn].iter().enumerate() {
                store_lanes(acc, lanes, o.add(r0 * n_tokens + tc + j), n_tokens);
            }
        }
    }
}

/// [`mxfp4_gemm`] for rows of `nb` blocks.
#[inline(always)]
unsafe fn mxfp4_gemm_nb<const VNNI: bool, const VBMI: bool, const X16: bool>(
    nb: usize,
    w: Padded,
    acts: &[u8],
    bias: &[i32],
    n_tokens: usize,
    out: &mut [f32],
) {
    let rows = out.len() / n_tokens;
    let stride = nb * MXFP4_BYTES;
    let astride = nb * Q8_0_BYTES;
    let (a, bias, o) = (acts.as_ptr(), bias.as_ptr(), out.as_mut_ptr());
    for r0 in (0..rows).step_by(G) {
        let (base, lanes) = row_group(w, r0, rows, stride);
        let out_g = o.add(r0 * n_tokens);
        // Tokens in tiles of up to 8 (accumulators in registers); each tile decodes the group's
        // blocks again, from cache after the first.
        for t0 in (0..n_tokens).step_by(TILE_TOKENS) {
            let (at, bt, ot) = (a.add(t0 * astride), bias.add(t0 * nb), out_g.add(t0));
            let args = (nb, base, stride, at, bt, ot, n_tokens, lanes);
            match n_tokens - t0 {
                1 => tile_call::<1, VNNI, VBMI, X16>(args),
                2 => tile_call::<2, VNNI, VBMI, X16>(args),
                3 => tile_call::<3, VNNI, VBMI, X16>(args),
                4 => tile_call::<4, VNNI, VBMI, X16>(args),
                5 => tile_call::<5, VNNI, VBMI, X16>(args),
                6 => tile_call::<6, VNNI, VBMI, X16>(args),
                7 => tile_call::<7, VNNI, VBMI, X16>(args),
                _ => tile_call::<8, VNNI, VBMI, X16>(args),
            }
        }
    }
}

/// The arguments of [`mxfp4_tile`].
type TileArgs = (
    usize,
    *const u8,
    usize,
    *const u8,
    *const i32,
    *mut f32,
    usize,
    Lanes,
);

#[inline(always)]
unsafe fn tile_call<const TT: usize, const VNNI: bool, const VBMI: bool, const X16: bool>(
    x: TileArgs,
) {
    mxfp4_tile::<TT, VNNI, VBMI, X16>(x.0, x.1, x.2, x.3, x.4, x.5, x.6, x.7)
}

// ----------------------------------------------------------------------------------------------
// Q8_0

/// Q8_0 rows per tile.
const Q8_R: usize = 4;
/// Q8_0 token pairs per tile.
const Q8_TP: usize = 4;
/// Q8_0 tokens per chunk (a multiple of `2 * Q8_TP`).
const Q8_TC: usize = 64;

#[inline(always)]
unsafe fn q8_0_gemm<const VNNI: bool>(
    n: usize,
    w: &[u8],
    acts: &[u8],
    n_tokens: usize,
    out: &mut [f32],
) {
    let nb = n / QK;
    let mats = Q8Mats {
        nb,
        rows: out.len() / n_tokens,
        w: w.as_ptr(),
        acts: acts.as_ptr(),
        n_tokens,
        out: out.as_mut_ptr(),
    };
    // Taken out and put back, so the kernels run in this function's target features (a
    // closure would not inherit them).
    let mut pairs = if VNNI {
        Q8_PAIRS.take()
    } else {
        Q8Pairs::default()
    };
    // Tokens in chunks whose activations stay in L2 while every row tile runs over them.
    for tc in (0..n_tokens).step_by(Q8_TC) {
        let chunk = tc..n_tokens.min(tc + Q8_TC);
        if VNNI && pairs.prepare(&mats, chunk.clone()) {
            q8_0_chunk_vnni(&mats, chunk, &mut pairs);
        } else {
            q8_0_chunk_signed::<VNNI>(&mats, chunk);
        }
    }
    if VNNI {
        Q8_PAIRS.set(pairs);
    }
}

/// The operands of one Q8_0 GEMM call.
struct Q8Mats {
    nb: usize,
    rows: usize,
    w: *const u8,
    acts: *const u8,
    n_tokens: usize,
    out: *mut f32,
}

impl Q8Mats {
    /// Bytes per weight or activation row.
    fn stride(&self) -> usize {
        self.nb * Q8_0_BYTES
    }

    /// Token `t`'s activation row, past the last token clamped to it.
    unsafe fn act(&self, t: usize) -> *const u8 {
        self.acts.add(t.min(self.n_tokens - 1) * self.stride())
    }

    /// Token pair `(t, t + 1)`'s quants and scales of block `b`: lanes 0..8 (bytes 0..32) the
    /// low token's, 8..16 the high one's.
    #[inline(always)]
    unsafe fn pair(&self, t: usize, b: usize) -> (__m512i, __m512) {
        let (tl, th) = (
            self.act(t).add(b * Q8_0_BYTES),
            self.act(t + 1).add(b * Q8_0_BYTES),
        );
        let y = load_2x256(tl.add(2), th.add(2));
        let d = _mm512_mask_blend_ps(
            0xff00,
            _mm512_set1_ps(f16_at(tl)),
            _mm512_set1_ps(f16_at(th)),
        );
        (y, d)
    }

    /// Stores a tile's results: `acc[r][p]` is row `r0 + r`'s pair of tokens `t0 + 2p`,
    /// `t0 + 2p + 1`, each kept if below `t_end`.
    #[inline(always)]
    unsafe fn store<const R: usize, const TP: usize>(
        &self,
        acc: &[[__m512; TP]; R],
        r0: usize,
        t0: usize,
        t_end: usize,
    ) {
        for (r, acc) in acc.iter().enumerate().take(self.rows - r0) {
            let dst = self.out.add((r0 + r) * self.n_tokens);
            for (p, &acc) in acc.iter().enumerate() {
                let t = t0 + 2 * p;
                if t < t_end {
                    *dst.add(t) = hsum8(lo256(acc));
                }
                if t + 1 < t_end {
                    *dst.add(t + 1) = hsum8(hi256(acc));
                }
            }
        }
    }
}

/// The tokens `chunk` of [`q8_0_gemm`] with ggml's sign trick: `|x|` against the activations
/// negated where `x < 0`, in tiles of [`Q8_R`] rows × [`Q8_TP`] token pairs.
#[inline(always)]
unsafe fn q8_0_chunk_signed<const VNNI: bool>(m: &Q8Mats, chunk: Range<usize>) {
    let stride = m.stride();
    for r0 in (0..m.rows).step_by(Q8_R) {
        let wr = row_ptrs::<Q8_R>(m.w, r0, m.rows, stride);
        for t0 in chunk.clone().step_by(2 * Q8_TP) {
            let mut acc = [[_mm512_setzero_ps(); Q8_TP]; Q8_R];
            for b in 0..m.nb {
                let off = b * Q8_0_BYTES;
                let (ys, das): ([__m512i; Q8_TP], [__m512; Q8_TP]) = {
                    let pairs: [_; Q8_TP] = core::array::from_fn(|p| m.pair(t0 + 2 * p, b));
                    (pairs.map(|p| p.0), pairs.map(|p| p.1))
                };
                for (r, acc) in acc.iter_mut().enumerate() {
                    let wb = wr[r].add(off);
                    let x = _mm512_broadcast_i64x4(_mm256_loadu_si256(wb.add(2).cast()));
                    let ax = _mm512_abs_epi8(x);
                    let neg = _mm512_movepi8_mask(x);
                    let dw = _mm512_set1_ps(f16_at(wb));
                    for p in 0..Q8_TP {
                        // |x| · sign(y, x): y negated where x < 0 (ggml's sign trick).
                        let q = dot_u8i8::<VNNI>(ax, neg_where(ys[p], neg));
                        let s = _mm512_mul_ps(dw, das[p]);
                        acc[p] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(q), acc[p]);
                    }
                }
            }
            m.store(&acc, r0, t0, chunk.end);
        }
    }
}

/// The byte -128 in every lane.
#[inline(always)]
unsafe fn minus_128() -> __m512i {
    _mm512_set1_epi8(i8::MIN)
}

/// A chunk's token pairs as [`q8_0_chunk_vnni`] reads them, per pair and block: the two
/// tokens' activation bytes (lanes 0..8 of the low token, 8..16 of the high one), `-128·Σ` of
/// each lane's four bytes (the correction of the weights' bias), and their scales (lanes 0..8
/// and 8..16).
#[derive(Default)]
struct Q8Pairs {
    acts: Vec<__m512i>,
    corr: Vec<__m512i>,
    scales: Vec<__m512>,
    /// The accumulators of one block of rows' tiles between passes of [`q8_0_chunk_vnni`]
    /// (at most [`Q8V_RB`] / [`Q8V_R`] × 8 tiles, 128 KiB).
    acc: Vec<[[__m512; Q8V_TP]; Q8V_R]>,
}

impl Q8Pairs {
    /// Fills in the pairs of the tokens `chunk` (past the last token, that token again);
    /// `false` where an activation byte is -128, which ggml's sign trick negates to itself, so
    /// [`q8_0_chunk_vnni`] would not reproduce it (Q8_0 quantization never makes it).
    #[inline(always)]
    unsafe fn prepare(&mut self, m: &Q8Mats, chunk: Range<usize>) -> bool {
        let n = chunk.len().div_ceil(2) * m.nb;
        let z = _mm512_setzero_si512();
        self.acts.resize(n, z);
        self.corr.resize(n, z);
        self.scales.resize(n, _mm512_setzero_ps());
        let mut bad = 0u64;
        for (i, t) in chunk.step_by(2).enumerate() {
            for b in 0..m.nb {
                let (y, d) = m.pair(t, b);
                bad |= _mm512_cmpeq_epi8_mask(y, minus_128());
                self.acts[i * m.nb + b] = y;
                // 128 · Σ y per lane (the unsigned operand: 128 in every byte), negated.
                let sum128 = _mm512_dpbusd_epi32(z, minus_128(), y);
                self.corr[i * m.nb + b] = _mm512_sub_epi32(z, sum128);
                self.scales[i * m.nb + b] = d;
            }
        }
        bad == 0
    }
}

std::thread_local! {
    /// Each thread's [`Q8Pairs`], kept between calls (a chunk of 64 tokens of width 2880 is
    /// 540 KiB, which would otherwise be mapped and unmapped per call; the accumulators add at
    /// most 128 KiB).
    static Q8_PAIRS: core::cell::RefCell<Q8Pairs> = core::cell::RefCell::default();
}

/// Rows and token pairs per tile of [`q8_0_chunk_vnni`].
const Q8V_R: usize = 4;
const Q8V_TP: usize = 4;
/// Blocks per pass of [`q8_0_chunk_vnni`] over a chunk's rows: the passes' prepared pairs
/// (a chunk's 32 pairs × 64 blocks, 384 KiB) stay in L2 while every row tile reads them,
/// where whole rows of a wide matrix (width 16384: 3 MiB of pairs) would come from L3 for
/// each tile.
const Q8V_KB: usize = 64;
/// Rows per block of [`q8_0_chunk_vnni`]: the passes go over one block of rows at a time, so
/// the accumulators kept between passes are bounded whatever the matrix's height.
const Q8V_RB: usize = 64;

/// The tokens `chunk` of [`q8_0_gemm`] with VNNI, `pairs` prepared for them. The weights
/// enter `vpdpbusd`'s unsigned operand as `x + 128` and the activations its signed one as they
/// are, so `Σ (x + 128)·a − 128·Σ a` is each lane's exact sum of four products `Σ a·x`: the
/// integer that ggml's sign trick (`maddubs(|x|, sign(a, x))`, `madd` by ones) gives for every
/// activation byte from -127 to 127 ([`Q8Pairs::prepare`] checks). The correction `-128·Σ a`
/// of each token pair and block is prepared once per chunk and loaded as the accumulator's
/// start, so a row × token pair costs one `vpdpbusd`, the conversion and the FMA, and a row
/// × block one flip of the weights' sign bits.
/// The rows go in blocks of [`Q8V_RB`], each block's in passes of [`Q8V_KB`] blocks, each
/// tile's accumulators kept in `pairs.acc` between passes (each lane still adds its blocks in
/// order); a row tile's weight scales are converted once per pass for all its token tiles.
#[inline(always)]
unsafe fn q8_0_chunk_vnni(m: &Q8Mats, chunk: Range<usize>, pairs: &mut Q8Pairs) {
    let (nb, stride) = (m.nb, m.stride());
    let (acts, corr) = (pairs.acts.as_ptr(), pairs.corr.as_ptr());
    let scales = pairs.scales.as_ptr();
    let last = chunk.len().div_ceil(2) - 1;
    let p_tiles = (last + 1).div_ceil(Q8V_TP);
    let z = _mm512_setzero_ps();
    if nb > Q8V_KB {
        pairs.acc.clear();
        pairs
            .acc
            .resize(Q8V_RB / Q8V_R * p_tiles, [[z; Q8V_TP]; Q8V_R]);
    }
    for rb in (0..m.rows).step_by(Q8V_RB) {
        for k0 in (0..nb).step_by(Q8V_KB) {
            let k1 = nb.min(k0 + Q8V_KB);
            for (rt, r0) in (rb..m.rows.min(rb + Q8V_RB)).step_by(Q8V_R).enumerate() {
                let wr = row_ptrs::<Q8V_R>(m.w, r0, m.rows, stride);
                // The tile's weight scales in this pass, converted once for its token tiles.
                let mut dw = [[0f32; Q8V_KB]; Q8V_R];
                for (r, dw) in dw.iter_mut().enumerate() {
                    for b in k0..k1 {
                        dw[b - k0] = f16_at(wr[r].add(b * Q8_0_BYTES));
                    }
                }
                for (pt, p0) in (0..=last).step_by(Q8V_TP).enumerate() {
                    // Pairs p0..p0 + Q8V_TP, past the chunk's end clamped to its last pair.
                    let pp: [usize; Q8V_TP] = core::array::from_fn(|i| (p0 + i).min(last) * nb);
                    let tile = rt * p_tiles + pt;
                    let mut acc = if k0 == 0 {
                        [[z; Q8V_TP]; Q8V_R]
                    } else {
                        pairs.acc[tile]
                    };
                    for b in k0..k1 {
                        let off = b * Q8_0_BYTES;
                        let ys: [__m512i; Q8V_TP] = core::array::from_fn(|i| *acts.add(pp[i] + b));
                        for (r, acc) in acc.iter_mut().enumerate() {
                            let x = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                                wr[r].add(off + 2).cast(),
                            ));
                            let xu = _mm512_xor_si512(x, minus_128());
                            let dw = _mm512_set1_ps(dw[r][b - k0]);
                            for (p, acc) in acc.iter_mut().enumerate() {
                                let q = _mm512_dpbusd_epi32(*corr.add(pp[p] + b), xu, ys[p]);
                                let s = _mm512_mul_ps(dw, *scales.add(pp[p] + b));
                                *acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(q), *acc);
                            }
                        }
                    }
                    if k1 == nb {
                        m.store(&acc, r0, chunk.start + 2 * p0, chunk.end);
                    } else {
                        pairs.acc[tile] = acc;
                    }
                }
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------
// F32

/// F32 rows per tile.
const F_R: usize = 4;
/// F32 tokens per tile.
const F_T: usize = 4;

#[inline(always)]
unsafe fn f32_gemm(n: usize, w: &[u8], acts: &[u8], n_tokens: usize, out: &mut [f32]) {
    let rows = out.len() / n_tokens;
    let stride = 4 * n;
    let o = out.as_mut_ptr();
    let n16 = n & !15;
    let tail: __mmask16 = ((1u32 << (n - n16)) - 1) as __mmask16;
    for r0 in (0..rows).step_by(F_R) {
        let wr = row_ptrs::<F_R>(w.as_ptr(), r0, rows, stride);
        for t0 in (0..n_tokens).step_by(F_T) {
            let ta = row_ptrs::<F_T>(acts.as_ptr(), t0, n_tokens, stride);
            let mut acc = [[_mm512_setzero_ps(); F_T]; F_R];
            let mut i = 0;
            while i < n16 {
                let mut y = [_mm512_setzero_ps(); F_T];
                for (y, &p) in y.iter_mut().zip(&ta) {
                    *y = _mm512_loadu_ps(p.add(4 * i).cast());
                }
                for (acc, &p) in acc.iter_mut().zip(&wr) {
                    let x = _mm512_loadu_ps(p.add(4 * i).cast());
                    for (acc, &y) in acc.iter_mut().zip(&y) {
                        *acc = _mm512_fmadd_ps(x, y, *acc);
                    }
                }
                i += 16;
            }
            if tail != 0 {
                let mut y = [_mm512_setzero_ps(); F_T];
                for (y, &p) in y.iter_mut().zip(&ta) {
                    *y = _mm512_maskz_loadu_ps(tail, p.add(4 * n16).cast());
                }
                for (acc, &p) in acc.iter_mut().zip(&wr) {
                    let x = _mm512_maskz_loadu_ps(tail, p.add(4 * n16).cast());
                    for (acc, &y) in acc.iter_mut().zip(&y) {
                        // Lanes past the row keep their value.
                        *acc = _mm512_mask3_fmadd_ps(x, y, *acc, tail);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate().take(rows - r0) {
                for (j, &acc) in acc.iter().enumerate().take(n_tokens - t0) {
                    *o.add((r0 + r) * n_tokens + t0 + j) = hsum16(acc);
                }
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------
// entry points

gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    mxfp4_plain,
    mxfp4_gemm::<false, false, false>,
    bias
);
gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    mxfp4_vnni,
    mxfp4_gemm::<true, false, false>,
    bias
);
gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c",
    mxfp4_plain_vbmi,
    mxfp4_gemm::<false, true, false>,
    bias
);
gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c",
    mxfp4_vnni_vbmi,
    mxfp4_gemm::<true, true, false>,
    bias
);
gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    mxfp4_x16_plain,
    mxfp4_gemm::<false, false, true>,
    bias
);
gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    mxfp4_x16_vnni,
    mxfp4_gemm::<true, false, true>,
    bias
);
gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c",
    mxfp4_x16_plain_vbmi,
    mxfp4_gemm::<false, true, true>,
    bias
);
gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c",
    mxfp4_x16_vnni_vbmi,
    mxfp4_gemm::<true, true, true>,
    bias
);
gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    q8_0_plain,
    q8_0_gemm::<false>
);
gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    q8_0_vnni,
    q8_0_gemm::<true>
);
gemm_entry!(
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    f32_plain,
    f32_gemm
);

/// The AVX-512 GEMM for `ty` (MXFP4, Q8_0 or F32), with VNNI when `vnni` and (MXFP4) the
/// VBMI nibble lookup when `vbmi`.
pub(crate) fn gemm_fn(ty: GgmlType, vnni: bool, vbmi: bool) -> (&'static str, GemmFn) {
    match (ty, vnni) {
        (GgmlType::MXFP4, false) if vbmi => ("mxfp4*q8_0 blockwise/avx512vbmi", mxfp4_plain_vbmi),
        (GgmlType::MXFP4, true) if vbmi => {
            ("mxfp4*q8_0 blockwise/avx512vnni+vbmi", mxfp4_vnni_vbmi)
        }
        (GgmlType::MXFP4, false) => ("mxfp4*q8_0 blockwise/avx512", mxfp4_plain),
        (GgmlType::MXFP4, true) => ("mxfp4*q8_0 blockwise/avx512vnni", mxfp4_vnni),
        (GgmlType::Q8_0, false) => ("q8_0*q8_0 gemm/avx512", q8_0_plain),
        (GgmlType::Q8_0, true) => ("q8_0*q8_0 gemm/avx512vnni", q8_0_vnni),
        _ => ("f32*f32 lanes16/avx512", f32_plain),
    }
}

/// The AVX-512 MXFP4 GEMM over rows interleaved in groups of 16
/// ([`crate::gemm_layout::interleave_x16`]), with VNNI when `vnni` and the VBMI lookup when `vbmi`.
pub(crate) fn gemm_fn_x16(vnni: bool, vbmi: bool) -> (&'static str, GemmFn) {
    match (vnni, vbmi) {
        (false, false) => ("mxfp4*q8_0 blockwise x16/avx512", mxfp4_x16_plain),
        (true, false) => ("mxfp4*q8_0 blockwise x16/avx512vnni", mxfp4_x16_vnni),
        (false, true) => ("mxfp4*q8_0 blockwise x16/avx512vbmi", mxfp4_x16_plain_vbmi),
        (true, true) => (
            "mxfp4*q8_0 blockwise x16/avx512vnni+vbmi",
            mxfp4_x16_vnni_vbmi,
        ),
    }
}
