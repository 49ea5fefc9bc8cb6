//! Attention over K/V ring pairs, with GQA, sinks and sliding windows: the row kernel
//! (`attn_row`, float values with `-fa off`) and the chunked flash kernel (`attn_chunked`,
//! `-fa on`, and block-quantized values whatever `-fa` says; see `attention_chunked`).

use cudarc::driver::{CudaSlice, CudaView, LaunchArgs, LaunchConfig, PushKernelArg};
use hmoe_backend::{AttnParams, KvLayout};
use hmoe_quant::GgmlType;

use super::capabilities::{kv_pair_supported, kv_type_ok};
use super::{i32_of, u32_of, CudaDevice, MAX_GRID_Y};
use crate::error::{ensure, CudaError};
use crate::kernels::{ATT_MAX_HEAD_DIM, ATT_WARPS};

/// The scalar arguments every attention kernel takes, as the kernels' `int`s (the batch's
/// first position is not one: the kernels read it on the device, `read_pos0`).
pub(super) struct AttnArgs {
    pub(super) has_sinks: i32,
    pub(super) n_tokens: i32,
    pub(super) n_head: i32,
    pub(super) n_kv: i32,
    pub(super) head_dim: i32,
    pub(super) cells: i32,
    /// The sliding window (0: none).
    pub(super) window: i32,
    /// The rings' ggml type ids.
    pub(super) k_ty: i32,
    pub(super) v_ty: i32,
    /// The keys' and the values' rotation chunks (0: not rotated).
    pub(super) k_rot: i32,
    pub(super) v_rot: i32,
}

/// The buffers every attention kernel reads first: (queries, K ring, V ring, sinks or the
/// dummy).
pub(super) type AttnRings<'r> = (
    &'r CudaSlice<f32>,
    &'r CudaSlice<u8>,
    &'r CudaSlice<u8>,
    &'r CudaSlice<f32>,
);

impl AttnArgs {
    /// Pushes what `attn_row` and `attn_chunked` take first: the rings and
    /// `has_sinks` (the output goes next).
    pub(super) fn push_rings<'a>(&'a self, b: &mut LaunchArgs<'a>, rings: AttnRings<'a>) {
        let (q, k_ring, v_ring, sinks) = rings;
        b.arg(q)
            .arg(k_ring)
            .arg(v_ring)
            .arg(sinks)
            .arg(&self.has_sinks);
    }

    /// Pushes the shape they take after their outputs, from `n_tokens` to the keys'
    /// rotation, the position buffer `pos_at` where the first position goes (`attn_chunked`
    /// takes the values' rotation next; `attn_row` reads only float values, never rotated).
    pub(super) fn push_shape<'a>(
        &'a self,
        b: &mut LaunchArgs<'a>,
        pos_at: &'a CudaView<'_, i32>,
        scale: &'a f32,
    ) {
        b.arg(&self.n_tokens)
            .arg(&self.n_head)
            .arg(&self.n_kv)
            .arg(&self.head_dim)
            .arg(&self.cells)
            .arg(pos_at)
            .arg(&self.window)
            .arg(scale)
            .arg(&self.k_ty)
            .arg(&self.v_ty)
            .arg(&self.k_rot);
    }
}

/// Whether attention with `p` over values of `v` takes the chunked flash kernel, as the CPU
/// device takes its chunked path: `-fa on` (`p.flash`), and block-quantized values whatever
/// `-fa` says (llama.cpp reads a quantized V cache only by flash attention).
fn takes_chunked(p: &AttnParams, v: GgmlType) -> bool {
    p.flash || !matches!(v, GgmlType::F32 | GgmlType::F16)
}

/// ggml's id of a type, as the kernels name them (`TY_*`).
fn ggml_id(ty: GgmlType) -> i32 {
    ty.id() as i32
}

impl CudaDevice {
    /// Attention for `n_tokens` queries at positions `pos0..pos0 + n_tokens` (their K/V
    /// already stored; `pos0` read on the device from `pos_at[0]`, so that the launch is the
    /// same for every position: a batch that would see keys past the ring writes nothing)
    /// over the K and V rings of `kl` and `vl`, with GQA, the window of `p`
    /// and optional per-head `sinks` (`n_head` logits). `q` and `out`:
    /// `n_tokens × n_head × head_dim`. The CPU device's numerics for the rings' types (see
    /// `attn_row` and `attn_chunked` in the kernels): the chunked flash kernel with `p.flash`
    /// (`-fa on`) and over block-quantized values, else the row kernel (for f16 the query and
    /// the probabilities rounded to f16); the query is rotated like the keys and the output
    /// back like the values.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        p: &AttnParams,
        q: &CudaSlice<f32>,
        k: (&CudaSlice<u8>, &KvLayout),
        v: (&CudaSlice<u8>, &KvLayout),
        sinks: Option<&CudaSlice<f32>>,
        n_tokens: usize,
        pos_at: &CudaView<'_, i32>,
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
        if n_tokens == 0 {
            return Ok(());
        }
        ensure(n_tokens <= MAX_GRID_Y, OP, || {
            format!("{n_tokens} tokens in one call")
        })?;
        let sinks_or = sinks.unwrap_or(&self.dummy);
        let a = AttnArgs {
            has_sinks: i32::from(sinks.is_some()),
            n_tokens: i32_of(OP, "tokens", n_tokens)?,
            n_head: i32_of(OP, "heads", p.n_head)?,
            n_kv: i32_of(OP, "kv heads", p.n_head_kv)?,
            head_dim: i32_of(OP, "head_dim", p.head_dim)?,
            cells: i32_of(OP, "cells", p.cells)?,
            window: i32_of(OP, "window", p.window.unwrap_or(0))?,
            k_ty: ggml_id(kl.ty),
            v_ty: ggml_id(vl.ty),
            k_rot: i32_of(OP, "rotation", kl.rot)?,
            v_rot: i32_of(OP, "rotation", vl.rot)?,
        };
        let rings = (q, k_ring, v_ring, sinks_or);
        if takes_chunked(p, vl.ty) {
            return self.attention_chunked(p, &a, rings, pos_at, n_tokens, out);
        }
        let value_chains = i32_of(OP, "value chains", p.value_chains)?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "heads", p.n_head)?, n_tokens as u32, 1),
            block_dim: (ATT_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("attn_row");
        a.push_rings(&mut b, rings);
        b.arg(out);
        a.push_shape(&mut b, pos_at, &p.scale);
        b.arg(&value_chains);
        // SAFETY: argument types match the kernel; sizes checked above; `pos_at` names an
        // i32; cells are indexed modulo `cells`; the types are those the kernels read
        // (`kv_type_ok`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_with_flash_and_over_quantized_values() {
        let mut p = AttnParams {
            n_head: 8,
            n_head_kv: 2,
            head_dim: 64,
            cells: 64,
            window: None,
            scale: 0.125,
            value_chains: 1,
            flash: true,
        };
        for v in [GgmlType::F16, GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_0] {
            assert!(takes_chunked(&p, v), "{v}");
        }
        // `-fa off`: the row kernel over float values, quantized values still chunked.
        p.flash = false;
        assert!(!takes_chunked(&p, GgmlType::F16) && !takes_chunked(&p, GgmlType::F32));
        assert!(takes_chunked(&p, GgmlType::Q8_0) && takes_chunked(&p, GgmlType::Q4_0));
    }
}
