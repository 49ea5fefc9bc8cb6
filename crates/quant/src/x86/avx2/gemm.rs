//! AVX2 + FMA + F16C GEMM kernels, bit-identical to the scalar references in `scalar/gemm.rs`.
//!
//! * MXFP4: 8 weight rows in the 8 lanes, the layout of the AVX-512 kernel at half width
//!   (see `x86/avx512/gemm.rs`); the scale `2^(e-128)` is built from the exponent bits and
//!   multiplied by `d`. Calls of up to 4 tokens use each decoded block at once, with products by
//!   `vpmaddubsw` of the biased values (≤ 24) with activation bytes, four 16-bit results summed
//!   before one `vpmaddwd` (|sum| ≤ 24576). Longer calls decode runs of 16 blocks of two row
//!   groups into L1 once, as signed table values with `-128 · Σ w` per row, and take every token
//!   over them: each broadcast activation dword (the bytes plus 128, `ActBlocks::flipped`) is
//!   the unsigned operand of two `vpmaddubsw` whose signed operand is read from L1 (|sum| ≤
//!   24480), so one broadcast serves 16 rows; the accumulators of up to 64 tokens are carried
//!   from run to run. The next rows are prefetched. Both give the same exact integer sums.
//!   Rows interleaved at load in groups of 16 (`GemmKernel::interleave_into`) are read as two
//!   8-row halves, each block four loads and an exponent load instead of 8 row loads, 12
//!   shuffles and 8 scalar byte loads.
//! * Q8_0: tiles of 1 row × 8 tokens of 8-lane accumulators (ggml's AVX2 `vec_dot` per
//!   pair). The activations come as `ActBlocks::q8_tiles`: per tile of 8 tokens and block,
//!   the 8 scales and 8 × 32 quants side by side and 32-byte aligned, so a tile is one
//!   sequential stream and no load spans two cache lines (at a 34-byte block's offset 2 half
//!   of them did). A tile runs over 64 rows in runs of 64 blocks (18 KiB of activations,
//!   which stay in L1 while every row of the group goes over them), its accumulators kept per
//!   row between runs. A taller tile spills accumulators and is no faster. The eight scale
//!   products `dw · da` of a block are one vector multiply, stored and read back per pair by
//!   a broadcast load, which takes the per-pair multiply off the two FMA pipes. (Zen 4, one
//!   thread, 512 tokens: 48 GMAC/s at every width from 1,536 to 18,432, against 31–40 with
//!   the file's block layout and chunks of 64 tokens; the two integer multiplies of a pair
//!   bound it at about 54.)
//! * Both take the activation blocks' scales as f32 from `gemm::ActBlocks` (converted once per
//!   matmul, not once per row group).
//! * F32: tiles of 2 rows × 2 tokens of 16-lane (two-register) FMA accumulators.
//!
//! Safety: every `unsafe fn` here needs AVX2, FMA and F16C, and the slice contract of
//! [`GemmFn`].

use core::arch::x86_64::*;

use crate::cache_hint::prefetch_l2;
use crate::gemm_layout::{
    row_ptrs, ActBlocks, GemmFn, KVALUES_MXFP4_PLUS12, Q8_0_TILE_TOKENS, X16_NIBBLE_BYTES,
};
use crate::scalar::shared::{KVALUES_MXFP4, MXFP4_BYTES, Q8_0_BYTES, QK};
use crate::x86::avx2::dot::{f16_at, hsum8};
use crate::GgmlType;

/// MXFP4 rows per group (one per lane).
const G: usize = 8;

/// The little-endian dword at `p`, broadcast.
#[inline(always)]
unsafe fn bcast32(p: *const u8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// One group of 8 MXFP4 rows as the kernels read it, block by block.
trait Group8 {
    /// Block `b`'s nibble bytes, transposed as dwords: lane `r` of the `k`-th vector holds
    /// bytes `4k..4k+4` of row `r`'s block.
    unsafe fn nibbles(&self, b: usize) -> [__m256i; 4];
    /// Block `b`'s exponent bytes, row `r`'s in byte `r` (the low 8 bytes).
    unsafe fn exponents(&self, b: usize) -> __m128i;
}

/// 8 rows in the file's layout (rows past the matrix are its last row again; their results
/// are dropped).
struct FileRows([*const u8; G]);

impl Group8 for FileRows {
    #[inline(always)]
    unsafe fn nibbles(&self, b: usize) -> [__m256i; 4] {
        let (rows, off) = (&self.0, b * MXFP4_BYTES);
        let mut z = [_mm256_setzero_si256(); 4];
        for (g, z) in z.iter_mut().enumerate() {
            // 128-bit lane i of z[g] holds row 4i + g.
            let lo = _mm_loadu_si128(rows[g].add(off + 1).cast());
            let hi = _mm_loadu_si128(rows[4 + g].add(off + 1).cast());
            *z = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi);
        }
        // 4×4 dword transpose inside each 128-bit lane: lane 4i + j of v[k] = dword k of row
        // 4i + j.
        let t01l = _mm256_unpacklo_epi32(z[0], z[1]);
        let t01h = _mm256_unpackhi_epi32(z[0], z[1]);
        let t23l = _mm256_unpacklo_epi32(z[2], z[3]);
        let t23h = _mm256_unpackhi_epi32(z[2], z[3]);
        [
            _mm256_unpacklo_epi64(t01l, t23l),
            _mm256_unpackhi_epi64(t01l, t23l),
            _mm256_unpacklo_epi64(t01h, t23h),
            _mm256_unpackhi_epi64(t01h, t23h),
        ]
    }

    #[inline(always)]
    unsafe fn exponents(&self, b: usize) -> __m128i {
        let mut e8 = 0u64;
        for (i, r) in self.0.iter().enumerate() {
            e8 |= (*r.add(b * MXFP4_BYTES) as u64) << (8 * i);
        }
        _mm_cvtsi64_si128(e8 as i64)
    }
}

/// Half `h` (rows `8h..8h + 8`) of a group of 16 rows interleaved by
/// [`crate::gemm_layout::interleave_x16`] (`base` its first byte, `nb` blocks a row): each block's
/// nibbles are already transposed (the half's 32 bytes of each 64-byte vector) and its
/// exponents contiguous, so a block is four loads and one more for the exponents.
struct X16Half {
    base: *const u8,
    nb: usize,
    h: usize,
}

impl Group8 for X16Half {
    #[inline(always)]
    unsafe fn nibbles(&self, b: usize) -> [__m256i; 4] {
        let p = self.base.add(b * X16_NIBBLE_BYTES + 32 * self.h);
        core::array::from_fn(|k| _mm256_loadu_si256(p.add(64 * k).cast()))
    }

    #[inline(always)]
    unsafe fn exponents(&self, b: usize) -> __m128i {
        let p = self
            .base
            .add(self.nb * X16_NIBBLE_BYTES + 2 * G * b + G * self.h);
        _mm_loadl_epi64(p.cast())
    }
}

/// The values in `table` (16 bytes) of the transposed nibbles `v` ([`Group8::nibbles`]):
/// `u[k]` (`u[4 + k]`) holds in lane `r` the values of elements `4k..4k+4` (`16+4k..16+4k+4`)
/// of row `r`.
#[inline(always)]
unsafe fn lookup8(v: &[__m256i; 4], table: *const u8) -> [__m256i; 8] {
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(table.cast()));
    let m4 = _mm256_set1_epi8(0x0f);
    let mut u = [_mm256_setzero_si256(); 8];
    for k in 0..4 {
        u[k] = _mm256_shuffle_epi8(table, _mm256_and_si256(v[k], m4));
        u[4 + k] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi32::<4>(v[k]), m4));
    }
    u
}

/// Each of the 8 rows' block scale `2^(e-128)` (the exponent bytes `e8`,
/// [`Group8::exponents`]).
#[inline(always)]
unsafe fn pow2_8(e8: __m128i) -> __m256 {
    let e = _mm256_cvtepu8_epi32(e8);
    // 2^(e-128): exponent field e - 1 for e ≥ 2, the subnormals 2^-128 and 2^-127 below.
    let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
    let sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    let is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, is_sub))
}

/// Decodes block `b` of 8 rows: the biased values ([`lookup8`] of the table plus 12) and each
/// row's `2^(e-128)`.
#[inline(always)]
unsafe fn decode8(rows: &impl Group8, b: usize) -> ([__m256i; 8], __m256) {
    (
        lookup8(&rows.nibbles(b), KVALUES_MXFP4_PLUS12.as_ptr()),
        pow2_8(rows.exponents(b)),
    )
}

/// Every row's exact integer dot of one block with the activation block at `ab`, plus `bias`.
#[inline(always)]
unsafe fn isum8(u: &[__m256i; 8], ab: *const u8, bias: i32) -> __m256i {
    let mut lo = _mm256_maddubs_epi16(u[0], bcast32(ab.add(2)));
    let mut hi = _mm256_maddubs_epi16(u[4], bcast32(ab.add(2 + QK / 2)));
    for k in 1..4 {
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(u[k], bcast32(ab.add(2 + 4 * k))));
        hi = _mm256_add_epi16(
            hi,
            _mm256_maddubs_epi16(u[4 + k], bcast32(ab.add(2 + QK / 2 + 4 * k))),
        );
    }
    let ones = _mm256_set1_epi16(1);
    let s = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
    _mm256_add_epi32(s, _mm256_set1_epi32(bias))
}

/// `fma(isum, 2^(e-128) · d, acc)` for the 8 rows, `d` the activation block's scale at `d`.
#[inline(always)]
unsafe fn block_fma(isum: __m256i, pow2: __m256, d: *const f32, acc: __m256) -> __m256 {
    let scale = _mm256_mul_ps(pow2, _mm256_broadcast_ss(&*d));
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc)
}

/// Stores lanes `0..valid` of `v` to `out`, `step` floats apart.
#[inline(always)]
unsafe fn store_lanes(v: __m256, valid: usize, out: *mut f32, step: usize) {
    let mut tmp = [0f32; G];
    _mm256_storeu_ps(tmp.as_mut_ptr(), v);
    for (r, &x) in tmp.iter().enumerate().take(valid) {
        *out.add(r * step) = x;
    }
}

/// `TT` tokens (`a`, `bias`, `scales` and `out` at the first) over `H` row groups of 8 (rows
/// `8h..`, of which the first `valid` are real), decoding each block once for all of them; the
/// next `H` groups (contiguous) are prefetched into L2.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn mxfp4_tile_regs<const TT: usize, const H: usize, S: Group8>(
    nb: usize,
    groups: &[S; H],
    next: *const u8,
    a: *const u8,
    (bias, scales): (*const i32, *const f32),
    out: *mut f32,
    n_tokens: usize,
    valid: usize,
) {
    let astride = nb * Q8_0_BYTES;
    let mut acc = [[_mm256_setzero_ps(); TT]; H];
    for b in 0..nb {
        prefetch_l2(
            next.wrapping_add(b * H * G * MXFP4_BYTES),
            H * G * MXFP4_BYTES,
        );
        for (rows, acc) in groups.iter().zip(&mut acc) {
            let (u, pow2) = decode8(rows, b);
            for (j, acc) in acc.iter_mut().enumerate() {
                let (ab, at) = (a.add(j * astride + b * Q8_0_BYTES), j * nb + b);
                *acc = block_fma(isum8(&u, ab, *bias.add(at)), pow2, scales.add(at), *acc);
            }
        }
    }
    for (h, acc) in acc.iter().enumerate() {
        let valid = valid.saturating_sub(h * G).min(G);
        for (j, &acc) in acc.iter().enumerate() {
            store_lanes(acc, valid, out.add(h * G * n_tokens + j), n_tokens);
        }
    }
}

/// Calls of at most this many tokens decode each block in registers and use it at once
/// ([`mxfp4_gemm_small`]); longer ones decode a run of blocks once for all their tokens.
const SMALL_TOKENS: usize = 4;

/// Up to [`SMALL_TOKENS`] tokens: each block of `H` row groups (`groups(r0)`, rows
/// `r0..r0 + 8H`) decoded in registers and used by every token at once.
#[inline(always)]
unsafe fn mxfp4_gemm_small<const H: usize, S: Group8>(
    n: usize,
    w: &[u8],
    acts: &[u8],
    blocks: (&[i32], &[f32]),
    n_tokens: usize,
    out: &mut [f32],
    groups: impl Fn(usize) -> [S; H],
) {
    let nb = n / QK;
    let rows = out.len() / n_tokens;
    let stride = nb * MXFP4_BYTES;
    let (a, o) = (acts.as_ptr(), out.as_mut_ptr());
    let bs = (blocks.0.as_ptr(), blocks.1.as_ptr());
    for r0 in (0..rows).step_by(H * G) {
        let g = groups(r0);
        let next = w.as_ptr().wrapping_add((r0 + H * G) * stride);
        let valid = (rows - r0).min(H * G);
        let ot = o.add(r0 * n_tokens);
        match n_tokens {
            1 => mxfp4_tile_regs::<1, H, S>(nb, &g, next, a, bs, ot, n_tokens, valid),
            2 => mxfp4_tile_regs::<2, H, S>(nb, &g, next, a, bs, ot, n_tokens, valid),
            3 => mxfp4_tile_regs::<3, H, S>(nb, &g, next, a, bs, ot, n_tokens, valid),
            _ => mxfp4_tile_regs::<4, H, S>(nb, &g, next, a, bs, ot, n_tokens, valid),
        }
    }
}

/// Blocks of a row pair decoded at a time: their values and scales stay in L1 while every
/// token of the call runs over them.
const DEC_BLOCKS: usize = 16;
/// Tokens whose accumulators one pass over a row pair keeps (a call's tokens in chunks).
const TOK_CHUNK: usize = 64;

/// One block of 8 rows as the batched path reads it: the signed table values ([`lookup8`]),
/// `-128 · Σ w` per row (which cancels the `+128` of the flipped activation bytes), and each
/// row's `2^(e-128)`.
#[derive(Clone, Copy)]
struct SignedBlock {
    s: [__m256i; 8],
    bias: __m256i,
    pow2: __m256,
}

/// Decodes block `b` of 8 rows for the batched path.
#[inline(always)]
unsafe fn decode8_signed(rows: &impl Group8, b: usize) -> SignedBlock {
    let s = lookup8(&rows.nibbles(b), KVALUES_MXFP4.as_ptr().cast());
    // Σ w per lane: the eight vectors added as bytes (|Σ| ≤ 8 · 12), then each lane's four.
    let mut total = s[0];
    for s in &s[1..] {
        total = _mm256_add_epi8(total, *s);
    }
    let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), total);
    let sum = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    SignedBlock {
        s,
        bias: _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<7>(sum)),
        pow2: pow2_8(rows.exponents(b)),
    }
}

/// One token's block (`a`: its 32 flipped bytes, `d`: its scale) over two decoded row groups:
/// `vpmaddubsw` of each broadcast activation dword (≤ 255) with both groups' signed values
/// (|w| ≤ 12), four 16-bit results summed before one `vpmaddwd` (|sum| ≤ 24480).
#[inline(always)]
unsafe fn block2(
    x: &SignedBlock,
    y: &SignedBlock,
    a: *const u8,
    d: *const f32,
    acc: (__m256, __m256),
) -> (__m256, __m256) {
    let mut lo = [_mm256_setzero_si256(); 2];
    let mut hi = [_mm256_setzero_si256(); 2];
    for k in 0..4 {
        let bl = bcast32(a.add(4 * k));
        let bh = bcast32(a.add(QK / 2 + 4 * k));
        for (g, blk) in [x, y].into_iter().enumerate() {
            lo[g] = _mm256_add_epi16(lo[g], _mm256_maddubs_epi16(bl, blk.s[k]));
            hi[g] = _mm256_add_epi16(hi[g], _mm256_maddubs_epi16(bh, blk.s[4 + k]));
        }
    }
    let ones = _mm256_set1_epi16(1);
    let d = _mm256_broadcast_ss(&*d);
    let mut out = [acc.0, acc.1];
    for (g, blk) in [x, y].into_iter().enumerate() {
        let isum = _mm256_add_epi32(
            _mm256_madd_epi16(lo[g], ones),
            _mm256_madd_epi16(hi[g], ones),
        );
        let isum = _mm256_add_epi32(isum, blk.bias);
        let scale = _mm256_mul_ps(blk.pow2, d);
        out[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, out[g]);
    }
    (out[0], out[1])
}

/// MXFP4 × Q8_0 over rows in the file's layout or, with `X16`, interleaved in groups of 16
/// ([`crate::gemm_layout::interleave_x16`]; the rows are whole groups then).
#[inline(always)]
unsafe fn mxfp4_gemm<const X16: bool>(
    n: usize,
    w: &[u8],
    acts: &[u8],
    blocks: &ActBlocks,
    n_tokens: usize,
    out: &mut [f32],
) {
    let nb = n / QK;
    let rows = out.len() / n_tokens;
    let stride = nb * MXFP4_BYTES;
    debug_assert!(!X16 || rows.is_multiple_of(2 * G));
    let base = w.as_ptr();
    let halves = |r0: usize| {
        [0, 1].map(|h| X16Half {
            base: base.add(r0 * stride),
            nb,
            h,
        })
    };
    let file = |r0: usize| FileRows(row_ptrs::<G>(base, r0, rows, stride));
    if n_tokens <= SMALL_TOKENS {
        let bs = (blocks.bias.as_slice(), blocks.scales.as_slice());
        return if X16 {
            mxfp4_gemm_small(n, w, acts, bs, n_tokens, out, halves)
        } else {
            mxfp4_gemm_small(n, w, acts, bs, n_tokens, out, |r0| [file(r0)])
        };
    }
    if X16 {
        mxfp4_gemm_batched(n, w, blocks, n_tokens, out, halves)
    } else {
        mxfp4_gemm_batched(n, w, blocks, n_tokens, out, |r0| [file(r0), file(r0 + G)])
    }
}

/// Over [`SMALL_TOKENS`] tokens: runs of [`DEC_BLOCKS`] blocks of two row groups (`pair(r0)`,
/// rows `r0..r0 + 16`) decoded into L1 once and taken by every token of a chunk (the flipped
/// activation bytes in `blocks`).
#[inline(always)]
unsafe fn mxfp4_gemm_batched<S: Group8>(
    n: usize,
    w: &[u8],
    blocks: &ActBlocks,
    n_tokens: usize,
    out: &mut [f32],
    pair: impl Fn(usize) -> [S; 2],
) {
    let nb = n / QK;
    let rows = out.len() / n_tokens;
    let stride = nb * MXFP4_BYTES;
    let o = out.as_mut_ptr();
    let (flipped, scales) = (blocks.flipped.as_ptr(), blocks.scales.as_ptr());
    let blank = SignedBlock {
        s: [_mm256_setzero_si256(); 8],
        bias: _mm256_setzero_si256(),
        pow2: _mm256_setzero_ps(),
    };
    let mut dec = [[blank; DEC_BLOCKS]; 2];
    let mut acc = [(_mm256_setzero_ps(), _mm256_setzero_ps()); TOK_CHUNK];
    for tc in (0..n_tokens).step_by(TOK_CHUNK) {
        let tn = (n_tokens - tc).min(TOK_CHUNK);
        for r0 in (0..rows).step_by(2 * G) {
            let groups = pair(r0);
            let next = w.as_ptr().wrapping_add((r0 + 2 * G) * stride);
            acc[..tn].fill((_mm256_setzero_ps(), _mm256_setzero_ps()));
            for b0 in (0..nb).step_by(DEC_BLOCKS) {
                let nbc = (nb - b0).min(DEC_BLOCKS);
                for i in 0..nbc {
                    let b = b0 + i;
                    // The next row pair (contiguous) into L2 while this one runs.
                    prefetch_l2(
                        next.wrapping_add(b * 2 * G * MXFP4_BYTES),
                        2 * G * MXFP4_BYTES,
                    );
                    for (dec, rows) in dec.iter_mut().zip(&groups) {
                        dec[i] = decode8_signed(rows, b);
                    }
                }
                for (t, acc) in acc[..tn].iter_mut().enumerate() {
                    let at = (tc + t) * nb + b0;
                    let (a, d) = (flipped.add(at * QK), scales.add(at));
                    let mut r = *acc;
                    for (i, (x, y)) in dec[0][..nbc].iter().zip(&dec[1][..nbc]).enumerate() {
                        r = block2(x, y, a.add(i * QK), d.add(i), r);
                    }
                    *acc = r;
                }
            }
            for (g, r) in [r0, r0 + G].into_iter().enumerate() {
                if r < rows {
                    let valid = (rows - r).min(G);
                    for (j, acc) in acc[..tn].iter().enumerate() {
                        let v = if g == 0 { acc.0 } else { acc.1 };
                        store_lanes(v, valid, o.add(r * n_tokens + tc + j), n_tokens);
                    }
                }
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------
// Q8_0

/// Q8_0 tokens per tile.
const Q8_T: usize = Q8_0_TILE_TOKENS;
/// Q8_0 rows whose tiles' accumulators are kept while a run of blocks goes over them.
const Q8_R: usize = 64;
/// Q8_0 blocks per run: a tile's activations over a run (64 × 288 bytes) stay in L1
/// while every row of the group goes over them.
const Q8_KB: usize = 64;

/// `[p]` in every lane, as a load: the broadcast stays a load-port operation where the
/// compiler would otherwise turn it into shuffles of the register the value was stored from.
/// (Its own `avx` feature lets the ymm operand compile whatever the build's target CPU; the
/// AVX2 kernels that call it inline it.)
#[inline]
#[target_feature(enable = "avx")]
pub(crate) unsafe fn broadcast_load(p: *const f32) -> __m256 {
    let r: __m256;
    // SAFETY: the caller passes the address of an initialised f32; the asm only reads it.
    core::arch::asm!(
        "vbroadcastss {r}, dword ptr [{p}]",
        r = out(ymm_reg) r,
        p = in(reg) p,
        options(pure, readonly, nostack, preserves_flags)
    );
    r
}

#[inline(always)]
unsafe fn q8_0_gemm(
    n: usize,
    w: &[u8],
    _acts: &[u8],
    blocks: &ActBlocks,
    n_tokens: usize,
    out: &mut [f32],
) {
    let nb = n / QK;
    let rows = out.len() / n_tokens;
    let stride = nb * Q8_0_BYTES;
    let o = out.as_mut_ptr();
    let ones = _mm256_set1_epi16(1);
    let mut tile_d = [0f32; Q8_T];
    // The accumulators of a group of rows for one tile of tokens, kept across the runs.
    let mut group = [[_mm256_setzero_ps(); Q8_T]; Q8_R];
    for r0 in (0..rows).step_by(Q8_R) {
        let group = &mut group[..(rows - r0).min(Q8_R)];
        for t0 in (0..n_tokens).step_by(Q8_T) {
            let tile = blocks.q8_tiles.as_ptr().add(t0 / Q8_T * nb);
            group.fill([_mm256_setzero_ps(); Q8_T]);
            for b0 in (0..nb).step_by(Q8_KB) {
                for (r, kept) in group.iter_mut().enumerate() {
                    let wr = w.as_ptr().add((r0 + r) * stride);
                    // In registers over the run (a reference into `group` would be stored back
                    // every block).
                    let mut acc = *kept;
                    for b in b0..nb.min(b0 + Q8_KB) {
                        let off = b * Q8_0_BYTES;
                        let a = &*tile.add(b);
                        let x = _mm256_loadu_si256(wr.add(off + 2).cast());
                        let ax = _mm256_sign_epi8(x, x);
                        // The f32 products dw · da of the tile's tokens, one multiply for all
                        // 8, each read back into every lane by the pair below.
                        let dw = _mm256_set1_ps(f16_at(wr.add(off)));
                        let da = _mm256_load_ps(a.d.as_ptr());
                        _mm256_storeu_ps(tile_d.as_mut_ptr(), _mm256_mul_ps(dw, da));
                        for (j, acc) in acc.iter_mut().enumerate() {
                            // ggml's `mul_sum_i8_pairs_float`: maddubs(|x|, sign(y, x)).
                            let y = _mm256_load_si256(a.qs[j].as_ptr().cast());
                            let p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(y, x));
                            let q = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                            *acc = _mm256_fmadd_ps(broadcast_load(tile_d.as_ptr().add(j)), q, *acc);
                        }
                    }
                    *kept = acc;
                }
            }
            for (r, acc) in group.iter().enumerate() {
                for (j, &acc) in acc.iter().enumerate().take(n_tokens - t0) {
                    *o.add((r0 + r) * n_tokens + t0 + j) = hsum8(acc);
                }
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------
// F32

/// F32 rows per tile.
const F_R: usize = 2;
/// F32 tokens per tile.
const F_T: usize = 2;

/// `fma(x, y, acc)` in the lanes set in `mask` (all bits of the lane), `acc` elsewhere.
#[inline(always)]
unsafe fn fma_masked(x: __m256, y: __m256, acc: __m256, mask: __m256) -> __m256 {
    _mm256_blendv_ps(acc, _mm256_fmadd_ps(x, y, acc), mask)
}

#[inline(always)]
unsafe fn f32_gemm(n: usize, w: &[u8], acts: &[u8], n_tokens: usize, out: &mut [f32]) {
    let rows = out.len() / n_tokens;
    let stride = 4 * n;
    let o = out.as_mut_ptr();
    let n16 = n & !15;
    let rem = (n - n16) as i32;
    let idx_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let idx_hi = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    let m_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), idx_lo);
    let m_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), idx_hi);
    for r0 in (0..rows).step_by(F_R) {
        let wr = row_ptrs::<F_R>(w.as_ptr(), r0, rows, stride);
        for t0 in (0..n_tokens).step_by(F_T) {
            let ta = row_ptrs::<F_T>(acts.as_ptr(), t0, n_tokens, stride);
            // [row][token][half]: lanes 0..8 and 8..16 of the 16-lane accumulator.
            let mut acc = [[[_mm256_setzero_ps(); 2]; F_T]; F_R];
            let mut i = 0;
            while i < n16 {
                let mut y = [[_mm256_setzero_ps(); 2]; F_T];
                for (y, &p) in y.iter_mut().zip(&ta) {
                    y[0] = _mm256_loadu_ps(p.add(4 * i).cast());
                    y[1] = _mm256_loadu_ps(p.add(4 * i + 32).cast());
                }
                for (acc, &p) in acc.iter_mut().zip(&wr) {
                    let x0 = _mm256_loadu_ps(p.add(4 * i).cast());
                    let x1 = _mm256_loadu_ps(p.add(4 * i + 32).cast());
                    for (acc, y) in acc.iter_mut().zip(&y) {
                        acc[0] = _mm256_fmadd_ps(x0, y[0], acc[0]);
                        acc[1] = _mm256_fmadd_ps(x1, y[1], acc[1]);
                    }
                }
                i += 16;
            }
            if rem != 0 {
                let mut y = [[_mm256_setzero_ps(); 2]; F_T];
                for (y, &p) in y.iter_mut().zip(&ta) {
                    y[0] = _mm256_maskload_ps(p.add(4 * n16).cast(), m_lo);
                    y[1] = _mm256_maskload_ps(p.add(4 * n16 + 32).cast(), m_hi);
                }
                let (f_lo, f_hi) = (_mm256_castsi256_ps(m_lo), _mm256_castsi256_ps(m_hi));
                for (acc, &p) in acc.iter_mut().zip(&wr) {
                    let x0 = _mm256_maskload_ps(p.add(4 * n16).cast(), m_lo);
                    let x1 = _mm256_maskload_ps(p.add(4 * n16 + 32).cast(), m_hi);
                    for (acc, y) in acc.iter_mut().zip(&y) {
                        acc[0] = fma_masked(x0, y[0], acc[0], f_lo);
                        acc[1] = fma_masked(x1, y[1], acc[1], f_hi);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate().take(rows - r0) {
                for (j, acc) in acc.iter().enumerate().take(n_tokens - t0) {
                    *o.add((r0 + r) * n_tokens + t0 + j) = hsum8(_mm256_add_ps(acc[0], acc[1]));
                }
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------
// entry points

gemm_entry!("avx2,fma,f16c", mxfp4_avx2, mxfp4_gemm::<false>, blocks);
gemm_entry!("avx2,fma,f16c", mxfp4_x16_avx2, mxfp4_gemm::<true>, blocks);
gemm_entry!("avx2,fma,f16c", q8_0_avx2, q8_0_gemm, blocks);
gemm_entry!("avx2,fma,f16c", f32_avx2, f32_gemm);

/// The AVX2 MXFP4 GEMM over rows interleaved in groups of 16
/// ([`crate::gemm_layout::interleave_x16`]).
pub(crate) fn gemm_fn_x16() -> (&'static str, GemmFn) {
    ("mxfp4*q8_0 blockwise x16/avx2", mxfp4_x16_avx2)
}

/// The AVX2 GEMM for `ty` (MXFP4, Q8_0 or F32).
pub(crate) fn gemm_fn(ty: GgmlType) -> (&'static str, GemmFn) {
    match ty {
        GgmlType::MXFP4 => ("mxfp4*q8_0 blockwise/avx2", mxfp4_avx2),
        GgmlType::Q8_0 => ("q8_0*q8_0 gemm/avx2", q8_0_avx2),
        _ => ("f32*f32 lanes16/avx2", f32_avx2),
    }
}
