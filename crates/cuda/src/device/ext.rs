//! The ops of multi-head latent attention and grouped expert routing on the device: strided
//! row copies, normal-style RoPE over part of each head, per-head products, SwiGLU, attention
//! over a K-only ring of any K/V type, and expert choice (kernels `copy_rows_f32`,
//! `rope_norm_f32`, `matmul_heads_*`, `swiglu_f32`, `attn_k_only_*`, `route_f32`). Shapes are checked by the
//! callers (hmoe_backend::shapes, in the contract's implementation).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use hmoe_backend::{Gating, KOnlyAttnParams, RopeParams, Routing, RowCopy};
use hmoe_quant::GgmlType;

use super::{ensure, grid_1d, i32_of, u32_of, CudaDevice, DeviceMatrix, MAX_GRID_Y, ROW_WARPS};
use crate::error::CudaError;
use crate::kernels::{KO_MAX_K, KO_MAX_V, KO_THREADS, ROUTE_MAX_EXPERTS, ROUTE_MAX_GROUPS};

impl CudaDevice {
    /// Strided row copy on the device (see [`RowCopy`]).
    pub fn copy_rows(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        c: &RowCopy,
    ) -> Result<(), CudaError> {
        const OP: &str = "copy_rows";
        let total = c.n_rows * c.width;
        if total == 0 {
            return Ok(());
        }
        let (n_rows, width) = (i32_of(OP, "rows", c.n_rows)?, i32_of(OP, "width", c.width)?);
        let s = [c.src_stride, c.src_offset, c.dst_stride, c.dst_offset].map(|v| v as u64);
        let mut b = self.builder("copy_rows_f32");
        b.arg(src)
            .arg(dst)
            .arg(&n_rows)
            .arg(&width)
            .arg(&s[0])
            .arg(&s[1])
            .arg(&s[2])
            .arg(&s[3]);
        // SAFETY: argument types match `copy_rows_f32`; the caller checked that every row
        // lies inside both buffers.
        unsafe { b.launch(grid_1d(total, OP)?) }?;
        Ok(())
    }

    /// Normal-style RoPE over dims `first .. first + p.n_dims` of every head, in place.
    pub fn rope_norm(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<i32>,
        n_heads: usize,
        head_dim: usize,
        first: usize,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope_norm";
        let n = positions.len();
        if n == 0 || n_heads == 0 {
            return Ok(());
        }
        ensure(n <= MAX_GRID_Y, OP, || format!("{n} tokens in one call"))?;
        let ints = [
            i32_of(OP, "tokens", n)?,
            i32_of(OP, "heads", n_heads)?,
            i32_of(OP, "head_dim", head_dim)?,
            i32_of(OP, "first", first)?,
            i32_of(OP, "n_dims", p.n_dims)?,
        ];
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "heads", n_heads)?, n as u32, 1),
            block_dim: (((p.n_dims / 2).clamp(32, 256)) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("rope_norm_f32");
        b.arg(&mut *x).arg(positions);
        for v in &ints {
            b.arg(v);
        }
        b.arg(&p.theta_scale)
            .arg(&p.freq_scale)
            .arg(&p.ext_factor)
            .arg(&p.attn_factor)
            .arg(&p.corr_dims[0])
            .arg(&p.corr_dims[1]);
        // SAFETY: argument types match `rope_norm_f32`; the caller checked that x holds
        // n × heads × head_dim values and the rotated dims lie inside each head.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Per-head products (see `hmoe_backend::Backend::matmul_heads`): `out` rows per head;
    /// F32, F16, BF16, Q8_0, MXFP4 and the low-bit weights ([`crate::LOWBIT_TYPES`], in the
    /// CPU engine's orders for each head's batch).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_heads(
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
        if super::lowbit::is_lowbit(w.ty) {
            return self.matmul_heads_lowbit(w, x, n, n_heads, x_stride, out, y);
        }
        let quantized = matches!(w.ty, GgmlType::Q8_0 | GgmlType::MXFP4);
        ensure(!quantized || x_stride.is_multiple_of(32), OP, || {
            format!("a stride of {x_stride} is not whole Q8_0 blocks")
        })?;
        let n_rows = n * n_heads;
        if n_rows == 0 || out == 0 {
            return Ok(());
        }
        ensure(n_rows <= MAX_GRID_Y, OP, || {
            format!("{n_rows} head rows in one call")
        })?;
        let name = match w.ty {
            GgmlType::F32 => "matmul_heads_f32",
            GgmlType::F16 => "matmul_heads_f16",
            GgmlType::BF16 => "matmul_heads_bf16",
            GgmlType::Q8_0 => "matmul_heads_q8_0",
            _ => "matmul_heads_mxfp4",
        };
        let row_bytes = w.row_bytes as u64;
        let ints = [
            i32_of(OP, "rows per head", out)?,
            i32_of(OP, "cols", w.cols)?,
            i32_of(OP, "head rows", n_rows)?,
            i32_of(OP, "heads", n_heads)?,
            i32_of(OP, "stride", x_stride)?,
            i32::from(!(x_stride == w.cols && n > 1)),
        ];
        let cfg = LaunchConfig {
            grid_dim: (
                u32_of(OP, "row blocks", out.div_ceil(ROW_WARPS as usize))?,
                n_rows as u32,
                1,
            ),
            block_dim: (ROW_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let xq = if quantized {
            Some(self.quantize_q8_0(x, n_rows * x_stride)?)
        } else {
            None
        };
        let mut b = self.builder(name);
        b.arg(&w.data).arg(&row_bytes);
        match &xq {
            Some(q) => b.arg(q),
            None => b.arg(x),
        };
        b.arg(y);
        for v in &ints {
            b.arg(v);
        }
        // SAFETY: argument types match `matmul_heads_*` (x as Q8_0 blocks for Q8_0/MXFP4
        // weights, f32 otherwise); the caller checked x and y against the shape.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `gate = silu(gate) · up` in place, rows of `n`.
    pub fn swiglu(
        &self,
        gate: &mut CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "swiglu";
        let total = gate.len();
        if total == 0 {
            return Ok(());
        }
        let (total64, n_i) = (total as u64, i32_of(OP, "row", n)?);
        let mut b = self.builder("swiglu_f32");
        b.arg(&mut *gate).arg(up).arg(&total64).arg(&n_i);
        // SAFETY: argument types match `swiglu_f32`; up holds at least total values.
        unsafe { b.launch(grid_1d(total, OP)?) }?;
        Ok(())
    }

    /// Attention over a K-only ring of `ty`, any of [`crate::K_ONLY_TYPES`] (not rotated; see
    /// `hmoe_backend::Backend::attention_k_only`): for a block-quantized ring the query
    /// quantized to the keys' `vec_dot_type` ([`CudaDevice::quantize_acts`], as the CPU engine
    /// converts it for the keys' `vec_dot`).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_k_only(
        &self,
        p: &KOnlyAttnParams,
        q: &CudaSlice<f32>,
        ty: GgmlType,
        k_cache: &CudaSlice<u8>,
        n_tokens: usize,
        pos0: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "attention_k_only";
        let name = match ty {
            GgmlType::F32 => "attn_k_only_f32",
            GgmlType::F16 => "attn_k_only_f16",
            GgmlType::BF16 => "attn_k_only_bf16",
            GgmlType::Q8_0 => "attn_k_only_q8_0",
            GgmlType::Q4_0 => "attn_k_only_q4_0",
            GgmlType::Q4_1 => "attn_k_only_q4_1",
            GgmlType::Q5_0 => "attn_k_only_q5_0",
            GgmlType::Q5_1 => "attn_k_only_q5_1",
            ty => return Err(CudaError::UnsupportedType { ty, op: OP }),
        };
        ensure(p.k_dim <= KO_MAX_K && p.v_dim <= KO_MAX_V, OP, || {
            format!(
                "keys of {} and values of {} (at most {KO_MAX_K} and {KO_MAX_V})",
                p.k_dim, p.v_dim
            )
        })?;
        let blocks = !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        ensure(
            !blocks || p.k_dim.is_multiple_of(32) && p.v_dim.is_multiple_of(32),
            OP,
            || {
                format!(
                    "a K-only ring of {ty} with keys of {} and values of {}",
                    p.k_dim, p.v_dim
                )
            },
        )?;
        if n_tokens == 0 || p.n_head == 0 {
            return Ok(());
        }
        ensure(n_tokens <= MAX_GRID_Y, OP, || {
            format!("{n_tokens} tokens in one call")
        })?;
        let ints = [
            i32_of(OP, "tokens", n_tokens)?,
            i32_of(OP, "heads", p.n_head)?,
            i32_of(OP, "k_dim", p.k_dim)?,
            i32_of(OP, "v_dim", p.v_dim)?,
            i32_of(OP, "cells", p.cells)?,
            i32_of(OP, "pos0", pos0)?,
        ];
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "heads", p.n_head)?, n_tokens as u32, 1),
            block_dim: (KO_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let qq = match blocks {
            true => {
                let len = n_tokens * p.n_head * p.k_dim;
                Some(self.quantize_acts(hmoe_quant::vec_dot_type(ty), q, len)?)
            }
            false => None,
        };
        let mut b = self.builder(name);
        b.arg(q);
        match &qq {
            Some(qq) => b.arg(qq),
            // Not read for float rings.
            None => b.arg(q),
        };
        b.arg(k_cache).arg(out);
        for v in &ints {
            b.arg(v);
        }
        b.arg(&p.scale);
        // SAFETY: argument types match `attn_k_only_<type>` (q f32; qq the queries' blocks in
        // the keys' vec_dot_type for block rings; the ring's bytes rows of k_dim values of
        // `ty`, in an allocation aligned for f32); the caller checked q, the ring
        // (`cells × k_dim` of `ty`) and out against the shape and that the ring holds every
        // position the batch sees.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Expert choice of each row of router logits (see `hmoe_backend::Backend::route`).
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &self,
        logits: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        gating: Gating,
        routing: &Routing,
        n_expert: usize,
        selected: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "route";
        let (n_groups, n_used) = routing.groups.unwrap_or((1, 1));
        ensure(
            n_expert <= ROUTE_MAX_EXPERTS && n_groups <= ROUTE_MAX_GROUPS,
            OP,
            || {
                format!("{n_expert} experts in {n_groups} groups (at most {ROUTE_MAX_EXPERTS} in {ROUTE_MAX_GROUPS})")
            },
        )?;
        let n = logits.len() / n_expert.max(1);
        if n == 0 {
            return Ok(());
        }
        let probs = self.alloc_zeros::<f32>(n * n_expert)?;
        let scores = self.alloc_zeros::<f32>(n * n_expert)?;
        let has_bias = i32::from(bias.is_some());
        let bias = bias.unwrap_or(&self.dummy);
        let gating_i: i32 = match gating {
            Gating::Softmax => 0,
            Gating::Sigmoid => 1,
        };
        let ints = [
            i32_of(OP, "rows", n)?,
            i32_of(OP, "experts", n_expert)?,
            i32_of(OP, "k", routing.k)?,
            i32_of(OP, "groups", n_groups)?,
            i32_of(OP, "used groups", n_used)?,
            i32::from(routing.norm),
        ];
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "rows / 64", n.div_ceil(64))?, 1, 1),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("route_f32");
        b.arg(logits)
            .arg(bias)
            .arg(&has_bias)
            .arg(&gating_i)
            .arg(selected)
            .arg(weights)
            .arg(&probs)
            .arg(&scores);
        for v in &ints {
            b.arg(v);
        }
        b.arg(&routing.scale);
        // SAFETY: argument types match `route_f32`; the caller checked logits, bias, selected
        // and weights against the shape; probs and scores hold n × n_expert values.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
