//! Multi-head latent attention on the device: attention over a K-only ring of any K/V type
//! (`attn_k_only_*`), the values being the first `v_dim` of each cached key. The caller checks
//! the shapes (hmoe_backend::shapes, in the contract's implementation).

use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use hmoe_backend::KOnlyAttnParams;
use hmoe_quant::GgmlType;

use super::{i32_of, u32_of, CudaDevice, MAX_GRID_Y};
use crate::error::{ensure, CudaError};
use crate::kernels::{KO_MAX_K, KO_MAX_V, KO_THREADS};

impl CudaDevice {
    /// Attention over a K-only ring of `ty`, any of [`crate::K_ONLY_TYPES`] (not rotated; see
    /// `hmoe_backend::Backend::attention_k_only`): for a block-quantized ring the query
    /// quantized to the keys' `vec_dot_type` ([`CudaDevice::quantize_acts`], as the CPU device
    /// converts it for the keys' `vec_dot`). The first position is read on the device from
    /// `pos_at[0]` (the kernel writes nothing when the batch would see past the ring).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_k_only(
        &self,
        p: &KOnlyAttnParams,
        q: &CudaSlice<f32>,
        ty: GgmlType,
        k_cache: &CudaSlice<u8>,
        n_tokens: usize,
        pos_at: &CudaView<'_, i32>,
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
        b.arg(pos_at).arg(&p.scale);
        // SAFETY: argument types match `attn_k_only_<type>` (q f32; qq the queries' blocks in
        // the keys' vec_dot_type for block rings; the ring's bytes rows of k_dim values of
        // `ty`, in an allocation aligned for f32); the caller checked q, the ring
        // (`cells × k_dim` of `ty`) and out against the shape; `pos_at` names an i32, and the
        // kernel reads only positions the ring holds (`read_pos0`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
