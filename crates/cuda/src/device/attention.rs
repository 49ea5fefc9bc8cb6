//! Attention over K/V ring pairs, with GQA, sinks and sliding windows: the row kernel
//! (`attn_row`, float values) and flash attention (`attn_flash`, block-quantized values).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use hmoe_backend::{AttnParams, KvLayout};
use hmoe_quant::GgmlType;

use super::capabilities::{kv_pair_supported, kv_type_ok};
use super::{i32_of, u32_of, CudaDevice, MAX_GRID_Y};
use crate::error::{ensure, CudaError};
use crate::kernels::{ATT_MAX_HEAD_DIM, ATT_WARPS};

/// Threads of one warp (the flash attention kernel's block).
const WARP_THREADS: u32 = 32;

/// ggml's id of a type, as the kernels name them (`TY_*`).
fn ggml_id(ty: GgmlType) -> i32 {
    ty.id() as i32
}

impl CudaDevice {
    /// Attention for `n_tokens` queries at positions `pos0..pos0 + n_tokens` (their K/V
    /// already stored) over the K and V rings of `kl` and `vl`, with GQA, the window of `p`
    /// and optional per-head `sinks` (`n_head` logits). `q` and `out`:
    /// `n_tokens × n_head × head_dim`. The CPU device's numerics for the rings' types (see
    /// `attn_row` and `attn_flash` in the kernels): f16/f32 values take the row kernel (for
    /// f16 the query and the probabilities rounded to f16), block-quantized values flash
    /// attention; the query is rotated like the keys and the output back like the values.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        p: &AttnParams,
        q: &CudaSlice<f32>,
        k: (&CudaSlice<u8>, &KvLayout),
        v: (&CudaSlice<u8>, &KvLayout),
        sinks: Option<&CudaSlice<f32>>,
        n_tokens: usize,
        pos0: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "attention";
        let ((k_ring, kl), (v_ring, vl)) = (k, v);
        let qw = p.n_head * p.head_dim;
        let kvw = p.n_head_kv * p.head_dim;
        ensure(
            p.head_dim.is_multiple_of(16)
                && p.head_dim > 0
                && p.head_dim <= ATT_MAX_HEAD_DIM
                && p.n_head_kv > 0
                && p.n_head.is_multiple_of(p.n_head_kv)
                && p.cells > 0
                && p.head_dim.is_multiple_of(kl.ty.block_elems())
                && p.head_dim.is_multiple_of(vl.ty.block_elems())
                && kv_pair_supported(kl.ty, vl.ty)
                && matches!(p.value_chains, 1 | 4),
            OP,
            || format!("unsupported shape {p:?} for K {} / V {}", kl.ty, vl.ty),
        )?;
        for (which, l) in [("K", kl), ("V", vl)] {
            ensure(
                kv_type_ok(l)
                    && l.width == kvw
                    && l.cells == p.cells
                    && (l.rot == 0 || p.head_dim.is_multiple_of(l.rot)),
                OP,
                || format!("{which} ring {l:?} for {p:?}"),
            )?;
        }
        ensure(
            q.len() >= n_tokens * qw
                && out.len() >= n_tokens * qw
                && k_ring.len() >= kl.bytes()
                && v_ring.len() >= vl.bytes()
                && sinks.is_none_or(|s| s.len() >= p.n_head),
            OP,
            || {
                format!(
                    "q {} / out {} / k {} / v {} bytes for {n_tokens} tokens, {} cells",
                    q.len(),
                    out.len(),
                    k_ring.len(),
                    v_ring.len(),
                    p.cells
                )
            },
        )?;
        // Every key the batch's queries see must still be in the ring.
        let span = p.keys_seen(n_tokens, pos0);
        ensure(span <= p.cells || n_tokens == 0, OP, || {
            format!(
                "{} cells cannot hold the {span} keys this batch sees",
                p.cells
            )
        })?;
        if n_tokens == 0 {
            return Ok(());
        }
        ensure(n_tokens <= MAX_GRID_Y, OP, || {
            format!("{n_tokens} tokens in one call")
        })?;
        let has_sinks = i32::from(sinks.is_some());
        let sinks = sinks.unwrap_or(&self.dummy);
        let window = i32_of(OP, "window", p.window.unwrap_or(0))?;
        let (n_i, nh, nkv, hd, cells) = (
            i32_of(OP, "tokens", n_tokens)?,
            i32_of(OP, "heads", p.n_head)?,
            i32_of(OP, "kv heads", p.n_head_kv)?,
            i32_of(OP, "head_dim", p.head_dim)?,
            i32_of(OP, "cells", p.cells)?,
        );
        let pos0_i = i32_of(OP, "pos0 + tokens", pos0 + n_tokens)? - n_i;
        let (k_ty, v_ty) = (ggml_id(kl.ty), ggml_id(vl.ty));
        let (k_rot, v_rot) = (
            i32_of(OP, "rotation", kl.rot)?,
            i32_of(OP, "rotation", vl.rot)?,
        );
        let value_chains = i32_of(OP, "value chains", p.value_chains)?;
        let flash = !matches!(vl.ty, GgmlType::F16 | GgmlType::F32);
        let (kernel, block) = if flash {
            ("attn_flash", WARP_THREADS)
        } else {
            ("attn_row", ATT_WARPS * 32)
        };
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "heads", p.n_head)?, n_tokens as u32, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder(kernel);
        b.arg(q)
            .arg(k_ring)
            .arg(v_ring)
            .arg(sinks)
            .arg(&has_sinks)
            .arg(out)
            .arg(&n_i)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&cells)
            .arg(&pos0_i)
            .arg(&window)
            .arg(&p.scale)
            .arg(&k_ty)
            .arg(&v_ty)
            .arg(&k_rot)
            .arg(&v_rot);
        // The row kernel's last argument (flash attention sums values in its own order).
        if !flash {
            b.arg(&value_chains);
        }
        // SAFETY: argument types match the kernel; sizes checked above; cells are indexed
        // modulo `cells`; the types are those the kernels read (`kv_type_ok`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
