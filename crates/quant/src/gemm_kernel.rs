//! Multi-row, multi-token products ("GEMM") for the weight types whose llama.cpp order differs
//! from, or gains from tiling over, the per-row [`crate::DotKernel`]:
//!
//! * **MXFP4 × Q8_0, block-wise order** (llama.cpp's repacked MXFP4 kernels): per output
//!   `acc = 0`, then for each 32-element block `b` in order
//!   `acc = fma(isum_b as f32, e8m0_half(e_b) · d_b, acc)`, where `isum_b` is the exact integer
//!   dot of the block's table values with the activation bytes and the scale product is rounded
//!   to f32 first. This is *not* the order of [`crate::DotKernel`]'s MXFP4 kernel (ggml's
//!   `vec_dot`, two 8-lane accumulators).
//! * **Q8_0 × Q8_0**: bit-identical to [`crate::DotKernel::dot`] (ggml's `vec_dot` order, which
//!   llama.cpp's tinyBLAS shares for Q8_0).
//! * **Q4_0, Q5_0 × Q8_0 and Q4_1, Q5_1 × Q8_1**: bit-identical to [`crate::DotKernel::dot`]
//!   (`vec_dot` order; see `x86/avx2/gemm_lowbit.rs` and `x86/avx512/gemm_lowbit.rs`).
//! * **F32 × F32, 16-lane order** (llama.cpp's tinyBLAS for batches): lane `i % 16` takes
//!   `fma(w_i, a_i, lane)`, then the lanes are summed by halving (as `_mm512_reduce_add_ps`).
//!   For a single token ggml uses `vec_dot_f32` instead, which is [`crate::DotKernel::dot`].
//!
//! The SIMD kernels put 16 (AVX-512) or 8 (AVX2) MXFP4 weight rows in the vector lanes, so the
//! per-block FMA is one vector instruction: each row's 16 nibble bytes are transposed as
//! dwords, so lane `r` of the `k`-th vector holds elements `4k..4k+4` (and `16+4k..`) of row
//! `r`, and one `vpdpbusd` (or `vpmaddubsw` + `vpmaddwd`) against a broadcast activation dword
//! adds four products per row. Weights enter the unsigned operand as `value + 12`; the
//! `12 · Σa` this adds is subtracted per block from the integer sum (precomputed per token in
//! [`GemmActs`]), which keeps the integer sum exact for every activation byte including -128.
//! (AVX2's batched path turns the roles round, for want of registers: activation bytes plus 128
//! unsigned, signed table values, `-128 · Σ w` subtracted per row and block.)
//! With several tokens, each decoded block of a row group serves a tile of up to 8 tokens
//! (accumulators in registers); Q8_0 and F32 use register tiles of rows × tokens. The
//! single-token passes, which are memory-bound, prefetch the next rows into L2.

use crate::dispatch::gemm_fn;
use crate::error::{check_isa, row_bytes};
use crate::gemm_layout::interleave_x16;
use crate::gemm_layout::{
    ActBlocks, GemmFn, Q8TileBlock, AMX_MIN_TOKENS, AMX_TILE_TOKENS, Q8_0_TILE_TOKENS,
};
#[cfg(target_arch = "x86_64")]
use crate::gemm_layout::{LOWBIT_TILE_TOKENS_AVX2, LOWBIT_TILE_TOKENS_AVX512};
use crate::scalar::shared::{f16_to_f32, rd_u16, Q8_0_BYTES, QK};
use crate::{vec_dot_type, GgmlType, Isa, QuantError};

/// Activation rows prepared for one [`GemmKernel`]: the rows themselves plus, for MXFP4, the
/// per-block correction `-12 · Σ a` of the biased weights. Prepare once per matmul and share
/// between threads.
#[derive(Clone, Debug)]
pub struct GemmActs<'a> {
    weight: GgmlType,
    /// The name of the kernel that prepared them: each kernel reads its own [`ActBlocks`].
    kernel: &'static str,
    n: usize,
    n_tokens: usize,
    data: &'a [u8],
    blocks: ActBlocks,
}

impl GemmActs<'_> {
    /// Elements per activation row.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Number of activation rows (tokens).
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }
}

/// A resolved multi-token kernel for one weight type on one ISA (MXFP4, Q8_0, F32, Q4_0, Q4_1,
/// Q5_0, Q5_1; see the module docs for each type's summation order). Cheap to copy,
/// `Send + Sync`.
#[derive(Clone, Copy)]
pub struct GemmKernel {
    weight: GgmlType,
    act: GgmlType,
    isa: Isa,
    name: &'static str,
    f: GemmFn,
    /// Reads MXFP4 rows interleaved by [`GemmKernel::interleave_into`].
    interleaved: bool,
    /// Runs batches on AMX tiles (reads [`ActBlocks::block_scales`]).
    amx: bool,
}

impl std::fmt::Debug for GemmKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GemmKernel")
            .field("weight", &self.weight)
            .field("name", &self.name)
            .finish()
    }
}

impl GemmKernel {
    /// The kernel for weights of type `weight` (one that [`GemmKernel::supports`]) on `isa`;
    /// errors for other types or an ISA this CPU lacks.
    pub fn new(weight: GgmlType, isa: Isa) -> Result<GemmKernel, QuantError> {
        Self::resolve(weight, isa, true, true, crate::amx_in_use())
    }

    /// The kernel for `weight` on [`Isa::best`].
    pub fn best(weight: GgmlType) -> Result<GemmKernel, QuantError> {
        Self::new(weight, Isa::best())
    }

    /// Whether `weight` has a GEMM kernel (MXFP4, Q8_0, F32, Q4_0, Q4_1, Q5_0, Q5_1).
    pub fn supports(weight: GgmlType) -> bool {
        matches!(weight, GgmlType::MXFP4 | GgmlType::Q8_0 | GgmlType::F32) || is_lowbit(weight)
    }

    /// [`GemmKernel::new`]; `allow_vnni = false` (`allow_vbmi = false`, `allow_amx = false`)
    /// forces the AVX-512 kernels without VNNI (VBMI, AMX).
    pub(crate) fn resolve(
        weight: GgmlType,
        isa: Isa,
        allow_vnni: bool,
        allow_vbmi: bool,
        allow_amx: bool,
    ) -> Result<GemmKernel, QuantError> {
        check_isa(isa)?;
        let unsupported = QuantError::Unsupported {
            ty: weight,
            op: "gemm",
        };
        if !Self::supports(weight) {
            return Err(unsupported);
        }
        let ((name, f), amx) =
            gemm_fn(isa, weight, false, allow_vnni, allow_vbmi, allow_amx).ok_or(unsupported)?;
        Ok(GemmKernel {
            weight,
            act: vec_dot_type(weight),
            isa,
            name,
            f,
            interleaved: false,
            amx,
        })
    }

    /// The MXFP4 kernel over rows interleaved in groups of 16 ([`GemmKernel::interleave_into`]),
    /// which reads each block of 16 rows with four vector loads (eight on AVX2) instead of
    /// transposing it and gathering its exponents: on [`Isa::Avx512`] (on AMX tiles for batches
    /// where [`crate::amx_in_use`]) and [`Isa::Avx2`]; `None` elsewhere. Same bits as
    /// [`GemmKernel::new`]'s MXFP4 kernels.
    pub fn interleaved(isa: Isa) -> Option<GemmKernel> {
        Self::resolve_interleaved(isa, true, true, crate::amx_in_use())
    }

    /// [`GemmKernel::interleaved`]; `allow_vnni = false` (`allow_vbmi = false`, `allow_amx =
    /// false`) forces the kernels without VNNI (VBMI, AMX).
    pub(crate) fn resolve_interleaved(
        isa: Isa,
        allow_vnni: bool,
        allow_vbmi: bool,
        allow_amx: bool,
    ) -> Option<GemmKernel> {
        check_isa(isa).ok()?;
        let ((name, f), amx) = gemm_fn(
            isa,
            GgmlType::MXFP4,
            true,
            allow_vnni,
            allow_vbmi,
            allow_amx,
        )?;
        Some(GemmKernel {
            weight: GgmlType::MXFP4,
            act: GgmlType::Q8_0,
            isa,
            name,
            f,
            interleaved: true,
            amx,
        })
    }

    /// Whether the kernel reads interleaved rows ([`GemmKernel::interleave_into`]).
    pub fn is_interleaved(&self) -> bool {
        self.interleaved
    }

    /// Writes the MXFP4 rows of `n` elements in `weight_rows` to `dst` (as long) in the layout
    /// an [`GemmKernel::interleaved`] kernel reads. Each group of 16 rows keeps its byte range,
    /// so whole groups can be sliced as before; inside it, per block `b`, four 64-byte
    /// vectors, the `k`-th holding in its dword `r` nibble bytes `4k..4k+4` of row `r`'s block
    /// `b` (256 bytes a block), then the 16 exponent bytes of every block (row `r`'s at byte
    /// `r`). Errors for another kernel, or unless the rows are whole groups of 16.
    pub fn interleave_into(
        &self,
        n: usize,
        weight_rows: &[u8],
        dst: &mut [u8],
    ) -> Result<(), QuantError> {
        let group = row_bytes(GgmlType::MXFP4, n)? * 16;
        if !self.interleaved {
            return Err(QuantError::Unsupported {
                ty: self.weight,
                op: "interleave for a kernel that reads the file's layout",
            });
        }
        if !weight_rows.len().is_multiple_of(group) || dst.len() != weight_rows.len() {
            return Err(QuantError::ShapeMismatch {
                what: "interleaved bytes (whole groups of 16 rows, as long as the rows)",
                expected: weight_rows.len() / group * group,
                got: dst.len(),
            });
        }
        for (src, dst) in weight_rows
            .chunks_exact(group)
            .zip(dst.chunks_exact_mut(group))
        {
            interleave_x16(n / QK, src, dst);
        }
        Ok(())
    }

    /// The weight type.
    pub fn weight_type(&self) -> GgmlType {
        self.weight
    }

    /// The activation type ([`vec_dot_type`] of the weight type: Q8_0, Q8_1 for Q4_1/Q5_1, F32
    /// for F32).
    pub fn act_type(&self) -> GgmlType {
        self.act
    }

    /// The ISA the kernel runs on.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// A name for logs, e.g. `mxfp4*q8_0 blockwise/avx512vnni`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Wraps `n_tokens` activation rows of `n` elements each (contiguous, in
    /// [`GemmKernel::act_type`]) for [`GemmKernel::gemm`], computing what the kernel needs per
    /// block once (for MXFP4 one `i32` per token and block; for the AVX2 kernels also the
    /// activations' scales as `f32`; for Q4_0/Q4_1/Q5_0/Q5_1 on AVX-512 the tokens in pairs;
    /// see `ActBlocks`).
    pub fn prepare<'a>(
        &self,
        n: usize,
        acts: &'a [u8],
        n_tokens: usize,
    ) -> Result<GemmActs<'a>, QuantError> {
        let row = row_bytes(self.act, n)?;
        let expected = row.checked_mul(n_tokens).ok_or(QuantError::ShapeMismatch {
            what: "activation bytes",
            expected: usize::MAX,
            got: acts.len(),
        })?;
        if acts.len() != expected {
            return Err(QuantError::ShapeMismatch {
                what: "activation bytes",
                expected,
                got: acts.len(),
            });
        }
        let mut blocks = ActBlocks::default();
        if self.weight == GgmlType::MXFP4 {
            blocks.bias = acts
                .chunks_exact(Q8_0_BYTES)
                .map(|b| -12 * b[2..].iter().map(|&q| q as i8 as i32).sum::<i32>())
                .collect();
        }
        #[cfg(target_arch = "x86_64")]
        if self.weight == GgmlType::MXFP4 && self.isa == Isa::Avx2 {
            blocks.flipped = acts
                .chunks_exact(Q8_0_BYTES)
                .flat_map(|b| b[2..].iter().map(|&q| q ^ 0x80))
                .collect();
            blocks.scales = acts
                .chunks_exact(Q8_0_BYTES)
                .map(|b| f16_to_f32(rd_u16(b, 0)))
                .collect();
        }
        #[cfg(target_arch = "x86_64")]
        if self.weight == GgmlType::Q8_0 && self.isa == Isa::Avx2 {
            let nb = n / QK;
            let tiles = n_tokens.div_ceil(Q8_0_TILE_TOKENS);
            blocks.q8_tiles = vec![Q8TileBlock::default(); tiles * nb];
            for (t, row) in acts.chunks_exact(row).enumerate() {
                let (tile, j) = (t / Q8_0_TILE_TOKENS, t % Q8_0_TILE_TOKENS);
                for (b, block) in row.chunks_exact(Q8_0_BYTES).enumerate() {
                    let dst = &mut blocks.q8_tiles[tile * nb + b];
                    dst.d[j] = f16_to_f32(rd_u16(block, 0));
                    for (q, &byte) in dst.qs[j].iter_mut().zip(&block[2..]) {
                        *q = byte as i8;
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        let tile = match (self.weight, self.isa) {
            (w, Isa::Avx2) if is_lowbit(w) => Some(LOWBIT_TILE_TOKENS_AVX2),
            (w, Isa::Avx512) if is_lowbit(w) => Some(LOWBIT_TILE_TOKENS_AVX512),
            (GgmlType::MXFP4, Isa::Avx512) if self.amx && n_tokens >= AMX_MIN_TOKENS => {
                Some(AMX_TILE_TOKENS)
            }
            _ => None,
        };
        #[cfg(target_arch = "x86_64")]
        if let Some(tile) = tile {
            let (nb, padded) = (n / QK, n_tokens.next_multiple_of(tile));
            // Q8_1 blocks (Q4_1/Q5_1) also give their sums `s`, the f16 after `d`.
            let q8_1 = self.act == GgmlType::Q8_1;
            blocks.block_scales = vec![0.0; nb * padded];
            blocks.block_sums = vec![0.0; if q8_1 { nb * padded } else { 0 }];
            for (t, row) in acts.chunks_exact(row).enumerate() {
                for (b, block) in row.chunks_exact(self.act.block_bytes()).enumerate() {
                    blocks.block_scales[b * padded + t] = f16_to_f32(rd_u16(block, 0));
                    if q8_1 {
                        blocks.block_sums[b * padded + t] = f16_to_f32(rd_u16(block, 1));
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if is_lowbit(self.weight) && self.isa == Isa::Avx512 && n_tokens > 0 {
            crate::x86::avx512::gemm_lowbit::pair_tokens(
                self.weight,
                n,
                acts,
                n_tokens,
                &mut blocks,
            );
        }
        Ok(GemmActs {
            weight: self.weight,
            kernel: self.name,
            n,
            n_tokens,
            data: acts,
            blocks,
        })
    }

    /// `out[r * n_tokens + t] = W[r] · a[t]` for the `out.len() / n_tokens` weight rows in
    /// `weight_rows` (contiguous) and the tokens of `acts`, in the kernel's summation order.
    /// Every ISA gives bit-identical results. Allocates only for MXFP4 with fewer than 16 rows
    /// (a padded copy of the rows). An interleaved kernel takes whole groups of 16 rows; `acts`
    /// must come from this kernel's [`GemmKernel::prepare`] (an error otherwise).
    pub fn gemm(
        &self,
        weight_rows: &[u8],
        acts: &GemmActs<'_>,
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        if acts.weight != self.weight {
            return Err(QuantError::Unsupported {
                ty: acts.weight,
                op: "gemm with activations prepared for another type",
            });
        }
        if acts.kernel != self.name {
            return Err(QuantError::Unsupported {
                ty: acts.weight,
                op: "gemm with activations prepared by another kernel",
            });
        }
        let t = acts.n_tokens;
        if t == 0 || out.is_empty() {
            return if out.is_empty() {
                Ok(())
            } else {
                Err(QuantError::ShapeMismatch {
                    what: "output elements",
                    expected: 0,
                    got: out.len(),
                })
            };
        }
        if !out.len().is_multiple_of(t) {
            return Err(QuantError::ShapeMismatch {
                what: "output elements (a multiple of the token count)",
                expected: out.len() / t * t,
                got: out.len(),
            });
        }
        let rows = out.len() / t;
        if self.interleaved && !rows.is_multiple_of(16) {
            return Err(QuantError::ShapeMismatch {
                what: "interleaved rows (whole groups of 16)",
                expected: rows / 16 * 16,
                got: rows,
            });
        }
        let expected = row_bytes(self.weight, acts.n)? * rows;
        if weight_rows.len() != expected {
            return Err(QuantError::ShapeMismatch {
                what: "weight bytes",
                expected,
                got: weight_rows.len(),
            });
        }
        if acts.blocks.sign_fallback {
            return self.gemm_vec_dot(weight_rows, acts, out);
        }
        // SAFETY: the ISA was checked in `resolve`; `weight_rows` holds `rows` whole rows of
        // `n` elements, `acts.data` `t` activation rows and `acts.blocks` what their blocks
        // give (computed in `prepare`), `out` `rows * t` results.
        unsafe { (self.f)(acts.n, weight_rows, acts.data, &acts.blocks, t, out) };
        Ok(())
    }

    /// [`GemmKernel::gemm`] (shapes checked) with each output one [`crate::DotKernel::dot`] of
    /// the weight type on this ISA: the same bits, for activations that the kernel's integer
    /// sums would not reproduce (see `ActBlocks::sign_fallback`).
    fn gemm_vec_dot(
        &self,
        weight_rows: &[u8],
        acts: &GemmActs<'_>,
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        let dot = crate::DotKernel::new(self.weight, self.isa)?;
        let (n, t) = (acts.n, acts.n_tokens);
        let (wb, ab) = (dot.weight_row_bytes(n), dot.act_row_bytes(n));
        for (r, o) in out.chunks_exact_mut(t).enumerate() {
            for (i, o) in o.iter_mut().enumerate() {
                *o = dot.dot(n, &weight_rows[r * wb..][..wb], &acts.data[i * ab..][..ab]);
            }
        }
        Ok(())
    }
}

/// Whether `ty` is Q4_0, Q4_1, Q5_0 or Q5_1.
fn is_lowbit(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1
    )
}
