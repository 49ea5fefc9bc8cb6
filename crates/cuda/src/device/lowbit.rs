//! The low-bit weight types of GGUF files (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K … Q6_K) on the device:
//! their activation quantizers (`quantize_q8_1`, `quantize_q8_k`, with `quantize_q8_0`), dense
//! products (`matmul_*`), per-head products (`matmul_heads_*`, MLA's absorbed projections) and
//! expert products (`moe_lowbit_*`, Q8_0 experts too when a set mixes them with low-bit ones,
//! as Q4_K_M files do).
//!
//! Each product sums in the order of the CPU device's kernel for it (hmoe_quant's
//! `DotKernel::for_matrix` and `dot_tokens`, which the reference device `Ref0` calls): the
//! repacked Q4_0/Q4_K order for matrices whose row count is a multiple of 8 (Q4_K's GEMM order
//! for a dense matmul's complete groups of four tokens), llama.cpp's tiled K-quant order from
//! [`TILED_MIN_TOKENS`] tokens (for experts: slots routed to the expert), ggml's `vec_dot`
//! otherwise. The launch code picks the order as that code does, and the kernels compute it
//! step for step, so the results are the CPU device's bits. From sm_80, batches (dense
//! matmuls of [`TILED_MIN_TOKENS`] tokens or more, experts with that many routed slots) in the
//! K-quants' tiled and repacked orders (integer sums per super-block or pair of sub-blocks)
//! run on int8 tensor cores (`matmul_mma_*`, `moe_mm_mma_*` in `kernels/mma_kquants.cu`), and
//! Q8_0 experts of a low-bit set on Q8_0's (`moe_mm_mma_q8_0`, the same `vec_dot` order);
//! decode keeps the warp kernels.

use cudarc::driver::{CudaSlice, PushKernelArg};
use hmoe_quant::{vec_dot_type, GgmlType, TILED_MIN_TOKENS};

use super::capabilities::{has_int8_mma, kquant_mma_kernels};
use super::{
    grid_1d, i32_of, rows_by_tokens, u32_of, CudaDevice, DeviceExperts, DeviceMatrix, ExpertAct,
    MoeWeights,
};
use crate::error::{ensure, CudaError};
use crate::kernels::{LB_TOKENS, MMA_ROWS_KQ, MMA_WARPS, ROW_WARPS, TILE_SLOTS};

/// The summation orders of the low-bit products (`LB_*` in the source).
const LB_VEC: i32 = 0;
const LB_TILED: i32 = 1;
const LB_BLOCK: i32 = 2;
const LB_PAIR: i32 = 3;

/// Whether the CPU device multiplies a matrix of `ty` with `rows` rows (per expert for
/// experts) with its repacked-order kernels (`DotKernel::for_matrix`: Q4_0 and Q4_K with a
/// row count that is a multiple of 8).
fn repacked(ty: GgmlType, rows: usize) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_K) && rows.is_multiple_of(8)
}

/// The orders of a dense matmul of `n` tokens by a `rows`-row matrix of `ty`, as
/// `DotKernel::dot_tokens(BatchKind::Dense, …)` picks them: `(grouped, order of the first
/// grouped tokens, order of the others)`.
fn dense_orders(ty: GgmlType, rows: usize, n: usize) -> (usize, i32, i32) {
    if repacked(ty, rows) {
        if ty == GgmlType::Q4_K {
            (n - n % 4, LB_PAIR, LB_BLOCK)
        } else {
            (0, LB_BLOCK, LB_BLOCK)
        }
    } else if ty.is_k_quant() && n >= TILED_MIN_TOKENS {
        (0, LB_TILED, LB_TILED)
    } else {
        (0, LB_VEC, LB_VEC)
    }
}

/// The orders of the per-head products of `n` tokens by a `rows`-row matrix of `ty` (every
/// head's batch; see `Cpu::matmul_heads`): a contiguous input (`dense`) as a dense matmul
/// ([`dense_orders`]), a strided one as `matmul_vec_dot` (`BatchKind::Expert`: the repacked
/// order for every token, tiled K-quants from [`TILED_MIN_TOKENS`], else `vec_dot`).
fn heads_orders(ty: GgmlType, rows: usize, n: usize, dense: bool) -> (usize, i32, i32) {
    if dense {
        dense_orders(ty, rows, n)
    } else if repacked(ty, rows) {
        (0, LB_BLOCK, LB_BLOCK)
    } else if ty.is_k_quant() && n >= TILED_MIN_TOKENS {
        (0, LB_TILED, LB_TILED)
    } else {
        (0, LB_VEC, LB_VEC)
    }
}

/// The per-head product kernel of a low-bit type.
fn heads_kernel(ty: GgmlType, op: &'static str) -> Result<&'static str, CudaError> {
    Ok(match ty {
        GgmlType::Q4_0 => "matmul_heads_q4_0",
        GgmlType::Q4_1 => "matmul_heads_q4_1",
        GgmlType::Q5_0 => "matmul_heads_q5_0",
        GgmlType::Q5_1 => "matmul_heads_q5_1",
        GgmlType::Q2_K => "matmul_heads_q2_k",
        GgmlType::Q3_K => "matmul_heads_q3_k",
        GgmlType::Q4_K => "matmul_heads_q4_k",
        GgmlType::Q5_K => "matmul_heads_q5_k",
        GgmlType::Q6_K => "matmul_heads_q6_k",
        ty => return Err(CudaError::UnsupportedType { ty, op }),
    })
}

/// The embedding kernel of a low-bit type.
pub(super) fn get_rows_kernel(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q4_0 => "get_rows_q4_0",
        GgmlType::Q4_1 => "get_rows_q4_1",
        GgmlType::Q5_0 => "get_rows_q5_0",
        GgmlType::Q5_1 => "get_rows_q5_1",
        GgmlType::Q2_K => "get_rows_q2_k",
        GgmlType::Q3_K => "get_rows_q3_k",
        GgmlType::Q4_K => "get_rows_q4_k",
        GgmlType::Q5_K => "get_rows_q5_k",
        GgmlType::Q6_K => "get_rows_q6_k",
        _ => return None,
    })
}

/// The dense and expert product kernels of a low-bit type (Q8_0: expert products only).
fn product_kernels(
    ty: GgmlType,
    op: &'static str,
) -> Result<(&'static str, &'static str), CudaError> {
    Ok(match ty {
        GgmlType::Q4_0 => ("matmul_q4_0", "moe_lowbit_q4_0"),
        GgmlType::Q4_1 => ("matmul_q4_1", "moe_lowbit_q4_1"),
        GgmlType::Q5_0 => ("matmul_q5_0", "moe_lowbit_q5_0"),
        GgmlType::Q5_1 => ("matmul_q5_1", "moe_lowbit_q5_1"),
        GgmlType::Q2_K => ("matmul_q2_k", "moe_lowbit_q2_k"),
        GgmlType::Q3_K => ("matmul_q3_k", "moe_lowbit_q3_k"),
        GgmlType::Q4_K => ("matmul_q4_k", "moe_lowbit_q4_k"),
        GgmlType::Q5_K => ("matmul_q5_k", "moe_lowbit_q5_k"),
        GgmlType::Q6_K => ("matmul_q6_k", "moe_lowbit_q6_k"),
        GgmlType::Q8_0 => ("matmul_dp4a_q8_0", "moe_lowbit_q8_0"),
        ty => return Err(CudaError::UnsupportedType { ty, op }),
    })
}

impl CudaDevice {
    /// The first `len` values of `x` (whole blocks) quantized to the activation type `act`
    /// (Q8_0, Q8_1 or Q8_K: ggml's `vec_dot_type` of a quantized weight type), exactly as
    /// `hmoe_quant::quantize_row(act, …)` makes them from finite values.
    pub fn quantize_acts(
        &self,
        act: GgmlType,
        x: &CudaSlice<f32>,
        len: usize,
    ) -> Result<CudaSlice<u8>, CudaError> {
        const OP: &str = "quantize_acts";
        let (name, block, bytes) = match act {
            GgmlType::Q8_0 => return self.quantize_q8_0(x, len),
            GgmlType::Q8_1 => ("quantize_q8_1", 32, 36),
            GgmlType::Q8_K => ("quantize_q8_k", 256, 292),
            ty => return Err(CudaError::UnsupportedType { ty, op: OP }),
        };
        ensure(len.is_multiple_of(block) && len <= x.len(), OP, || {
            format!(
                "{len} values of a buffer of {} in blocks of {block}",
                x.len()
            )
        })?;
        let blocks = len / block;
        // Scratch: every byte is written by the kernel below before it is read.
        let mut out = self.alloc_scratch::<u8>(blocks * bytes)?;
        if blocks == 0 {
            return Ok(out);
        }
        let n_blocks = blocks as u64;
        let mut b = self.builder(name);
        b.arg(x).arg(&mut out).arg(&n_blocks);
        // SAFETY: argument types match `quantize_q8_1`/`quantize_q8_k`; x holds block × blocks
        // values and out bytes × blocks bytes.
        unsafe { b.launch(grid_1d(blocks, OP)?) }?;
        Ok(out)
    }

    /// [`CudaDevice::matmul`] for low-bit weights (sizes checked there): the activations in
    /// the weight's `vec_dot_type`, then a warp per row and `LB_TOKENS` tokens (the row
    /// decoded once for them), each product in the CPU device's order for this matrix and
    /// batch size; from sm_80 the K-quants' tiled and repacked orders on tensor cores.
    pub(super) fn matmul_lowbit(
        &self,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul";
        let (name, _) = product_kernels(w.ty, OP)?;
        let xq = self.quantize_acts(vec_dot_type(w.ty), x, n * w.cols)?;
        let (grouped, first, rest) = dense_orders(w.ty, w.rows, n);
        if let Some((mma, _)) = kquant_mma_kernels(w.ty, self.info.compute_capability) {
            // Batches (decode keeps the warp kernels) in orders that start from integer sums.
            if n >= TILED_MIN_TOKENS && first != LB_VEC && rest != LB_VEC {
                return self.matmul_kquant_mma(mma, w, &xq, n, (grouped, first, rest), y);
            }
        }
        let ints = [
            i32_of(OP, "rows", w.rows)?,
            i32_of(OP, "cols", w.cols)?,
            i32_of(OP, "tokens", n)?,
            i32_of(OP, "grouped tokens", grouped)?,
            first,
            rest,
        ];
        let cfg = rows_by_tokens(OP, (w.rows, ROW_WARPS), (n, LB_TOKENS), ROW_WARPS * 32)?;
        let row_bytes = w.row_bytes as u64;
        let mut b = self.builder(name);
        b.arg(&w.data).arg(&row_bytes).arg(&xq).arg(y);
        for v in &ints {
            b.arg(v);
        }
        // SAFETY: argument types match `matmul_<low-bit type>`; x holds n rows of w.cols (so
        // xq n activation rows) and y n rows of w.rows (checked by `matmul`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// [`CudaDevice::matmul_lowbit`] on tensor cores (`kernel`, a `matmul_mma_<K-quant>`) for
    /// the orders `(grouped, first, rest)` of [`dense_orders`] when neither is `vec_dot`'s:
    /// `MMA_ROWS_KQ` rows by `TILE_SLOTS` tokens per block.
    fn matmul_kquant_mma(
        &self,
        kernel: &'static str,
        w: &DeviceMatrix,
        xq: &CudaSlice<u8>,
        n: usize,
        (grouped, first, rest): (usize, i32, i32),
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul";
        let ints = [
            i32_of(OP, "rows", w.rows)?,
            i32_of(OP, "super-blocks per row", w.cols / 256)?,
            i32_of(OP, "tokens", n)?,
            i32_of(OP, "grouped tokens", grouped)?,
            first,
            rest,
        ];
        let cfg = rows_by_tokens(OP, (w.rows, MMA_ROWS_KQ), (n, TILE_SLOTS), 32 * MMA_WARPS)?;
        let row_bytes = w.row_bytes as u64;
        let mut b = self.builder(kernel);
        b.arg(&w.data)
            .arg(&row_bytes)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(xq);
        for v in &ints[2..] {
            b.arg(v);
        }
        b.arg(y);
        // SAFETY: argument types match `matmul_mma_<K-quant>`; xq holds n Q8_K rows of
        // w.cols / 256 blocks and y n rows of w.rows (checked by `matmul`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// [`CudaDevice::matmul_heads`] for low-bit weights (shapes checked by the caller):
    /// every head row's first `w.cols` values gathered (`copy_rows_f32`, when strided) and
    /// quantized to the weight's `vec_dot_type`, then a warp per row and `LB_TOKENS` tokens of
    /// one head, each product in the CPU device's order for a head's batch
    /// ([`heads_orders`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_heads_lowbit(
        &self,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        n_heads: usize,
        x_stride: usize,
        out: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul_heads";
        let name = heads_kernel(w.ty, OP)?;
        let n_rows = n * n_heads;
        if n_rows == 0 || out == 0 {
            return Ok(());
        }
        let cfg = rows_by_tokens(
            OP,
            (out, ROW_WARPS),
            (n.div_ceil(LB_TOKENS as usize) * n_heads, 1),
            ROW_WARPS * 32,
        )?;
        let dense = x_stride == w.cols;
        let gathered;
        let rows = if dense {
            x
        } else {
            // Scratch: copy_rows writes all n_rows × cols values before they are read.
            let mut g = self.alloc_scratch::<f32>(n_rows * w.cols)?;
            let copy = hmoe_backend::RowCopy {
                n_rows,
                width: w.cols,
                src_stride: x_stride,
                src_offset: 0,
                dst_stride: w.cols,
                dst_offset: 0,
            };
            self.copy_rows(x, &mut g, &copy)?;
            gathered = g;
            &gathered
        };
        let xq = self.quantize_acts(vec_dot_type(w.ty), rows, n_rows * w.cols)?;
        let (grouped, first, rest) = heads_orders(w.ty, w.rows, n, dense);
        let ints = [
            i32_of(OP, "rows per head", out)?,
            i32_of(OP, "cols", w.cols)?,
            i32_of(OP, "tokens", n)?,
            i32_of(OP, "heads", n_heads)?,
            i32_of(OP, "grouped tokens", grouped)?,
            first,
            rest,
        ];
        let row_bytes = w.row_bytes as u64;
        let mut b = self.builder(name);
        b.arg(&w.data).arg(&row_bytes).arg(&xq).arg(y);
        for v in &ints {
            b.arg(v);
        }
        // SAFETY: argument types match `matmul_heads_<low-bit type>`; xq holds n × n_heads
        // activation rows of w.cols, w n_heads × out rows, y n × n_heads rows of out (checked
        // by the caller).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The expert products of [`CudaDevice::moe`] when a set has low-bit experts (shapes
    /// checked there; gate, up and down each low-bit or Q8_0, of one type or not): the slots
    /// grouped by expert (`moe_group`), each matrix's products over activations in its own
    /// `vec_dot_type` (a warp per expert row and `LB_TOKENS` of its slots at a time), the
    /// gated activation and the down biases. Returns y, `[slots][d]`.
    pub(super) fn moe_products_lowbit(
        &self,
        w: &MoeWeights,
        act: ExpertAct,
        x: &CudaSlice<f32>,
        selected: &CudaSlice<i32>,
        k: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        const OP: &str = "moe";
        let (d, ff, ne) = (w.gate.cols, w.gate.rows, w.gate.n_expert);
        for m in [&w.gate, &w.up, &w.down] {
            product_kernels(m.ty, OP)?;
        }
        let n = x.len() / d;
        let slots = n * k;
        let (offsets, order) = self.moe_group(selected, slots, ne)?;

        let groups = (&offsets, &order);
        let xg = self.quantize_acts(vec_dot_type(w.gate.ty), x, n * d)?;
        let xu = if vec_dot_type(w.up.ty) == vec_dot_type(w.gate.ty) {
            None
        } else {
            Some(self.quantize_acts(vec_dot_type(w.up.ty), x, n * d)?)
        };
        // Scratch: moe_lowbit writes the rows of every slot with a valid expert, the only ones
        // moe_swiglu reads.
        let mut g = self.alloc_scratch::<f32>(slots * ff)?;
        // As above.
        let mut u = self.alloc_scratch::<f32>(slots * ff)?;
        self.moe_lowbit(&w.gate, &xg, k, groups, &mut g)?;
        self.moe_lowbit(&w.up, xu.as_ref().unwrap_or(&xg), k, groups, &mut u)?;
        let h = self.moe_gated(w, act, (&g, &u), selected, slots)?;
        let hq = self.quantize_acts(vec_dot_type(w.down.ty), &h, slots * ff)?;
        // Scratch: moe_lowbit writes the slots with a valid expert and moe_down_bias zeroes
        // the others.
        let mut y = self.alloc_scratch::<f32>(slots * d)?;
        self.moe_lowbit(&w.down, &hq, 1, groups, &mut y)?;
        self.moe_add_down_bias(w, &mut y, selected, slots)?;
        Ok(y)
    }

    /// `out[slot] = experts[e] · act[slot / act_div]` for every slot grouped under expert `e`
    /// by `moe_group` (`groups` = its offsets and order), in the CPU device's order for an
    /// expert matmul of as many rows as route to `e`.
    fn moe_lowbit(
        &self,
        experts: &DeviceExperts,
        act: &CudaSlice<u8>,
        act_div: usize,
        (offsets, order): (&CudaSlice<i32>, &CudaSlice<i32>),
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe";
        let (_, name) = product_kernels(experts.ty, OP)?;
        let cc = self.info.compute_capability;
        let rep = repacked(experts.ty, experts.rows);
        // From sm_80 the experts with at least TILED_MIN_TOKENS slots run on tensor cores (in
        // the tiled or repacked order, or Q8_0's vec_dot), the others (decode's) on the warp
        // kernels; mma_from 0: all on the warp kernels.
        let groups = (offsets, order);
        let mut mma_from = 0;
        if experts.ty == GgmlType::Q8_0 && has_int8_mma(cc) {
            self.moe_mm(experts, act, act_div, groups, TILED_MIN_TOKENS, out)?;
            mma_from = i32_of(OP, "tiled minimum", TILED_MIN_TOKENS)?;
        } else if let Some((_, mma)) = kquant_mma_kernels(experts.ty, cc) {
            let mode = if rep { LB_BLOCK } else { LB_TILED };
            self.moe_kquant_mma(mma, experts, act, act_div, groups, mode, out)?;
            mma_from = i32_of(OP, "tiled minimum", TILED_MIN_TOKENS)?;
        }
        let ints = [
            i32_of(OP, "rows", experts.rows)?,
            i32_of(OP, "cols", experts.cols)?,
        ];
        let act_div_i = i32_of(OP, "act_div", act_div)?;
        let tail = [
            i32::from(rep),
            i32_of(OP, "tiled minimum", TILED_MIN_TOKENS)?,
            mma_from,
        ];
        let row_bytes = experts.row_bytes as u64;
        let cfg = rows_by_tokens(
            OP,
            (experts.rows, ROW_WARPS),
            (experts.n_expert, 1),
            ROW_WARPS * 32,
        )?;
        let mut b = self.builder(name);
        b.arg(&experts.data).arg(&row_bytes);
        for v in &ints {
            b.arg(v);
        }
        b.arg(act).arg(&act_div_i).arg(offsets).arg(order);
        for v in &tail {
            b.arg(v);
        }
        b.arg(out);
        // SAFETY: argument types match `moe_lowbit_*`; experts holds n_expert × rows rows of
        // row_bytes, act the activation rows its slots name (slot / act_div < the rows
        // quantized by the caller), out a row of `rows` per slot; offsets holds n_expert + 1
        // values and order a slot for each of the offsets' entries (from moe_group).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The products of [`CudaDevice::moe_lowbit`] on tensor cores (`kernel`, a
    /// `moe_mm_mma_<K-quant>`) for the experts with at least `TILED_MIN_TOKENS` routed slots,
    /// all in `mode` (`LB_TILED` or `LB_BLOCK`), a block per tile of their slots
    /// (`moe_tiles`) and `MMA_ROWS_KQ` rows.
    #[allow(clippy::too_many_arguments)]
    fn moe_kquant_mma(
        &self,
        kernel: &'static str,
        experts: &DeviceExperts,
        act: &CudaSlice<u8>,
        act_div: usize,
        (offsets, order): (&CudaSlice<i32>, &CudaSlice<i32>),
        mode: i32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe";
        let (tiles, max) =
            self.moe_tiles(offsets, order.len(), experts.n_expert, TILED_MIN_TOKENS)?;
        let ints = [
            i32_of(OP, "rows", experts.rows)?,
            i32_of(OP, "super-blocks per row", experts.cols / 256)?,
        ];
        let act_div_i = i32_of(OP, "act_div", act_div)?;
        let row_tiles = experts.rows.div_ceil(MMA_ROWS_KQ as usize);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (u32_of(OP, "row tiles", row_tiles)?, max, 1),
            block_dim: (32 * MMA_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let row_bytes = experts.row_bytes as u64;
        let mut b = self.builder(kernel);
        b.arg(&experts.data)
            .arg(&row_bytes)
            .arg(&ints[0])
            .arg(&ints[1]);
        b.arg(act).arg(&act_div_i).arg(&tiles).arg(order).arg(&mode);
        b.arg(out);
        // SAFETY: argument types match `moe_mm_mma_<K-quant>`; experts holds n_expert × rows
        // rows of row_bytes, act the Q8_K rows its slots name, out a row of `rows` per slot;
        // the tile list (grid.y its capacity) names slots of `order` only.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::capabilities::{is_lowbit, LOWBIT_TYPES};
    use super::*;

    #[test]
    fn orders_follow_the_cpu_devices_kernel_choice() {
        // Repacked Q4_K: the GEMM order for whole groups of four, the GEMV order after.
        assert_eq!(dense_orders(GgmlType::Q4_K, 16, 11), (8, LB_PAIR, LB_BLOCK));
        assert_eq!(dense_orders(GgmlType::Q4_K, 16, 1), (0, LB_PAIR, LB_BLOCK));
        assert_eq!(dense_orders(GgmlType::Q4_0, 8, 9).1, LB_BLOCK);
        // Not repacked: K-quants tiled from TILED_MIN_TOKENS, vec_dot before; legacy vec_dot.
        let few = TILED_MIN_TOKENS - 1;
        assert_eq!(dense_orders(GgmlType::Q4_K, 13, few), (0, LB_VEC, LB_VEC));
        assert_eq!(
            dense_orders(GgmlType::Q6_K, 16, TILED_MIN_TOKENS),
            (0, LB_TILED, LB_TILED)
        );
        assert_eq!(dense_orders(GgmlType::Q5_1, 16, 40), (0, LB_VEC, LB_VEC));
        assert_eq!(dense_orders(GgmlType::Q4_0, 13, 40), (0, LB_VEC, LB_VEC));
    }

    #[test]
    fn head_orders_follow_the_cpu_devices_matmul_and_matmul_vec_dot() {
        let few = TILED_MIN_TOKENS - 1;
        // Contiguous inputs: a dense matmul per head.
        assert_eq!(
            heads_orders(GgmlType::Q4_K, 16, 6, true),
            (4, LB_PAIR, LB_BLOCK)
        );
        // Strided: every token as one (`mul_mat_id`'s order for repacked Q4_K).
        assert_eq!(
            heads_orders(GgmlType::Q4_K, 16, 6, false),
            (0, LB_BLOCK, LB_BLOCK)
        );
        assert_eq!(heads_orders(GgmlType::Q6_K, 10, few, false).1, LB_VEC);
        assert_eq!(
            heads_orders(GgmlType::Q6_K, 10, TILED_MIN_TOKENS, false).1,
            LB_TILED
        );
        assert_eq!(heads_orders(GgmlType::Q5_0, 16, 20, false).1, LB_VEC);
    }

    #[test]
    fn every_lowbit_type_has_its_kernels() {
        for ty in LOWBIT_TYPES {
            assert!(is_lowbit(ty));
            let (mm, moe) = product_kernels(ty, "test").unwrap();
            let rows = get_rows_kernel(ty).unwrap();
            let heads = heads_kernel(ty, "test").unwrap();
            for name in [mm, moe, rows, heads] {
                assert!(crate::kernels::KERNELS.contains(&name), "{name}");
            }
        }
        assert!(get_rows_kernel(GgmlType::Q8_0).is_none());
        assert!(product_kernels(GgmlType::MXFP4, "test").is_err());
    }

    #[test]
    fn the_source_names_the_orders_as_here() {
        for (name, v) in [
            ("LB_VEC", LB_VEC),
            ("LB_TILED", LB_TILED),
            ("LB_BLOCK", LB_BLOCK),
            ("LB_PAIR", LB_PAIR),
        ] {
            let line = format!("#define {name} {v}\n");
            assert!(crate::kernels::SOURCE.contains(&line), "{line}");
        }
    }
}
