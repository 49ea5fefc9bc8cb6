//! The K/V rings: storing rows of keys or values into a ring of any K/V type of the contract
//! (`kv_store_*`), converted (and, for block-quantized rings, rotated) as the CPU device's
//! cache stores them.

use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};
use hmoe_backend::KvLayout;
use hmoe_quant::GgmlType;

use super::capabilities::kv_type_ok;
use super::{grid_1d, i32_of, CudaDevice};
use crate::error::{ensure, CudaError};

/// The store kernel of a block-quantized K/V type.
fn kv_store_kernel(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::Q4_0 => "kv_store_q4_0",
        GgmlType::Q4_1 => "kv_store_q4_1",
        GgmlType::Q5_0 => "kv_store_q5_0",
        GgmlType::Q5_1 => "kv_store_q5_1",
        _ => "kv_store_q8_0",
    }
}

impl CudaDevice {
    /// Writes `n_tokens` rows of `layout.width` f32 values from `src` into the K/V ring
    /// `ring` of `layout` (one of [`K_ONLY_TYPES`](super::K_ONLY_TYPES)): token t goes to
    /// cell `(pos0 + t) % cells`, converted as the CPU device's cache converts it (see
    /// `kv_store_*` in the kernels). `pos0` is read on the device from `pos_at[0]` (the
    /// step's positions; a negative one stores nothing), so the launch is the same for
    /// every position.
    pub fn kv_store(
        &self,
        src: &CudaSlice<f32>,
        ring: &mut CudaSlice<u8>,
        layout: &KvLayout,
        n_tokens: usize,
        pos_at: &CudaView<'_, i32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "kv_store";
        let (width, cells) = (layout.width, layout.cells);
        ensure(kv_type_ok(layout), OP, || {
            format!("{} K/V rings (rotation {})", layout.ty, layout.rot)
        })?;
        ensure(
            cells > 0 && src.len() >= n_tokens * width && ring.len() >= layout.bytes(),
            OP,
            || {
                format!(
                    "src {} / ring {} bytes for {n_tokens}×{width} into {cells} cells",
                    src.len(),
                    ring.len()
                )
            },
        )?;
        let total = n_tokens * width;
        if total == 0 {
            return Ok(());
        }
        let (n_i, w_i, c_i) = (
            i32_of(OP, "tokens", n_tokens)?,
            i32_of(OP, "width", width)?,
            i32_of(OP, "cells", cells)?,
        );
        let (kernel, grid) = match layout.ty {
            GgmlType::F16 => ("kv_store_f16", grid_1d(total, OP)?),
            GgmlType::F32 => ("kv_store_f32", grid_1d(total, OP)?),
            GgmlType::BF16 => ("kv_store_bf16", grid_1d(total, OP)?),
            // One thread per rotation chunk (or block when not rotated).
            ty => {
                let chunk = layout.rot.max(ty.block_elems());
                (kv_store_kernel(ty), grid_1d(total / chunk, OP)?)
            }
        };
        let rot = i32_of(OP, "rotation", layout.rot)?;
        let mut b = self.builder(kernel);
        b.arg(src)
            .arg(ring)
            .arg(&n_i)
            .arg(&w_i)
            .arg(&c_i)
            .arg(pos_at);
        if !matches!(layout.ty, GgmlType::F16 | GgmlType::F32 | GgmlType::BF16) {
            b.arg(&rot);
        }
        // SAFETY: argument types match the `kv_store_*` kernel of the type; the ring holds
        // `cells` rows of the type's `row_bytes(width)` (checked above); `pos_at` names at
        // least one i32; writes land in cells < `cells` (the kernel skips a negative position).
        unsafe { b.launch(grid) }?;
        Ok(())
    }
}
