//! What every ISA's GEMM kernels share: the kernel signature, the per-block values
//! [`crate::GemmKernel::prepare`] computes once per matmul, the tile sizes that pad them, and the
//! interleaved MXFP4 layout (16 rows a group).

use crate::scalar::shared::{KVALUES_MXFP4, MXFP4_BYTES};

/// A GEMM kernel: `n` = elements per row, `w` = `out.len() / n_tokens` weight rows,
/// `acts` = `n_tokens` activation rows, `blocks` = what [`crate::GemmKernel::prepare`] computed per
/// activation block, `out` = `[row][token]`.
pub(crate) type GemmFn = unsafe fn(
    n: usize,
    w: &[u8],
    acts: &[u8],
    blocks: &ActBlocks,
    n_tokens: usize,
    out: &mut [f32],
);

/// What the kernels need per activation block, computed once per matmul so that no kernel
/// repeats it for every row group: for MXFP4 weights the correction `-12 · Σ a` of the biased
/// weights, and for the AVX2 kernels the blocks' f16 scales as f32 (and, for MXFP4, the bytes
/// plus 128). Each field is empty where its kernel does not read it.
#[derive(Clone, Debug, Default)]
pub(crate) struct ActBlocks {
    /// `-12 · Σ_j a_j` (MXFP4 weights only).
    pub(crate) bias: Vec<i32>,
    /// The block's scale `d` (MXFP4 weights, for the AVX2 kernel, which reads it).
    pub(crate) scales: Vec<f32>,
    /// The scales `d` as `[block][token]`, the tokens padded with zeros to whole tiles: of
    /// [`AMX_TILE_TOKENS`] for the AMX MXFP4
    /// kernel (whose tiles read 16 tokens' scales; only batches of at least 16 use it, so it
    /// never reads the padding, which only fixes the stride it expects), of
    /// [`LOWBIT_TILE_TOKENS_AVX2`] and [`LOWBIT_TILE_TOKENS_AVX512`] for Q4_0/Q4_1/Q5_0/Q5_1
    /// weights on those ISAs (the same vector product).
    pub(crate) block_scales: Vec<f32>,
    /// The block's 32 bytes plus 128, as unsigned bytes (`[token][block][32]`; the AVX2
    /// MXFP4 kernel's batched path, which multiplies them with the signed table values).
    pub(crate) flipped: Vec<u8>,
    /// The activations of the AVX2 Q8_0 kernel as `[tile of Q8_0_TILE_TOKENS tokens][block]`:
    /// each block's scales and quants of the tile's tokens side by side, 32-byte aligned, so
    /// that a tile's run of blocks is one sequential stream and no load spans two cache lines
    /// (tokens past the batch are zeros).
    pub(crate) q8_tiles: Vec<Q8TileBlock>,
    /// The activation blocks' second f16 `s` (Q8_1: `d · Σ q`) as f32, `[block][token]` padded
    /// like [`ActBlocks::block_scales`] (Q4_1/Q5_1 weights on AVX2 and AVX-512, whose kernels
    /// add `m_w · s` for a tile of tokens in one vector FMA).
    pub(crate) block_sums: Vec<f32>,
    /// Tokens paired for the AVX-512 Q4_0/Q4_1/Q5_0/Q5_1 kernels, `[block][pair][64]`: each
    /// activation byte plus 128, dword `2k` (`2k + 1`) holding bytes `4k..4k + 4` of the pair's
    /// first (second) token; an odd last token is paired with itself.
    pub(crate) pairs: Vec<u8>,
    /// Whether an activation byte is -128 where the weights are Q4_0/Q5_0 on AVX-512: ggml's
    /// sign trick negates it to itself, which the exact integer sums of the paired kernels do
    /// not reproduce, so [`crate::GemmKernel::gemm`] runs the `vec_dot` kernel per token then
    /// (Q8_0/Q8_1 quantization never makes the byte).
    pub(crate) sign_fallback: bool,
}

/// One Q8_0 block of a tile of [`Q8_0_TILE_TOKENS`] tokens ([`ActBlocks::q8_tiles`]).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(32))]
pub(crate) struct Q8TileBlock {
    /// The tokens' scales `d` as f32.
    pub(crate) d: [f32; Q8_0_TILE_TOKENS],
    /// The tokens' 32 quants.
    pub(crate) qs: [[i8; 32]; Q8_0_TILE_TOKENS],
}

/// Tokens per tile of the AVX2 Q8_0 kernel (of [`ActBlocks::q8_tiles`]).
pub(crate) const Q8_0_TILE_TOKENS: usize = 8;
/// Tokens per tile of the AVX2 Q4_0/Q4_1/Q5_0/Q5_1 kernels.
pub(crate) const LOWBIT_TILE_TOKENS_AVX2: usize = 8;
/// Tokens per tile of the AVX-512 Q4_0/Q4_1/Q5_0/Q5_1 kernels.
pub(crate) const LOWBIT_TILE_TOKENS_AVX512: usize = 16;
/// Tokens per tile of the AMX MXFP4 kernel (the padding of [`ActBlocks::block_scales`]).
pub(crate) const AMX_TILE_TOKENS: usize = 16;

/// Batches from this many tokens use the AMX tiles. Each block of 16 rows costs the tiles about
/// the same time whatever the tokens (a Xeon, one thread: 1.09 ms for 4 tokens, 1.30 ms for
/// 16 over a 2880² matrix, against VNNI's 0.43 and 1.34 ms), so they pay from a full tile on.
pub(crate) const AMX_MIN_TOKENS: usize = AMX_TILE_TOKENS;

/// The MXFP4 table values plus 12, so they fit the unsigned operand of `vpdpbusd`/`vpmaddubsw`.
pub(crate) const KVALUES_MXFP4_PLUS12: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (KVALUES_MXFP4[i] + 12) as u8;
        i += 1;
    }
    t
};

/// Bytes of one block of an interleaved group: 16 rows × 16 nibble bytes.
pub(crate) const X16_NIBBLE_BYTES: usize = 16 * 16;

/// One group of 16 MXFP4 rows of `nb` blocks (`src`) in the interleaved layout
/// ([`crate::GemmKernel::interleave_into`]).
pub(crate) fn interleave_x16(nb: usize, src: &[u8], dst: &mut [u8]) {
    const G: usize = 16;
    let stride = nb * MXFP4_BYTES;
    let (nibbles, exps) = dst.split_at_mut(nb * X16_NIBBLE_BYTES);
    for r in 0..G {
        let row = &src[r * stride..(r + 1) * stride];
        for (b, blk) in row.chunks_exact(MXFP4_BYTES).enumerate() {
            exps[b * G + r] = blk[0];
            for k in 0..4 {
                let at = b * X16_NIBBLE_BYTES + 64 * k + 4 * r;
                nibbles[at..at + 4].copy_from_slice(&blk[1 + 4 * k..5 + 4 * k]);
            }
        }
    }
}

/// Pointers to rows `r0..r0 + N` of `w` (`stride` bytes each), rows past `rows` clamped to the
/// last one (their results are dropped).
///
/// # Safety
/// `rows > 0` and every row lies inside the allocation of `w`.
#[inline(always)]
pub(crate) unsafe fn row_ptrs<const N: usize>(
    w: *const u8,
    r0: usize,
    rows: usize,
    stride: usize,
) -> [*const u8; N] {
    let mut p = [w; N];
    for (i, p) in p.iter_mut().enumerate() {
        *p = w.add((r0 + i).min(rows - 1) * stride);
    }
    p
}
