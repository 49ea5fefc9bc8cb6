//! Multi-head latent attention on the device: attention over a K-only ring of any K/V type,
//! the values being the first `v_dim` of each cached key. Decode-sized calls run split over
//! positions (`attn_k_only_scores_*`, `attn_k_only_weights_*`, `attn_k_only_values_*`,
//! kernels/latent_split.cu: every score once, each key and value read once per group of
//! heads); larger ones (long prefill) one block per (head, token) (`attn_k_only_*`,
//! kernels/latent_attention.cu). Both give the CPU device's bits. The caller checks the
//! shapes (hmoe_backend::shapes, in the contract's implementation).

use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use hmoe_backend::attention_scratch::{K_ONLY_DECODE_SCORES_MAX, K_ONLY_SCORES_MAX};
use hmoe_backend::KOnlyAttnParams;
use hmoe_quant::GgmlType;

use super::{i32_of, u32_of, CudaDevice, MAX_GRID_Y};
use crate::error::{ensure, CudaError};
use crate::kernels::{KO_MAX_K, KO_MAX_V, KO_THREADS, KS_HEADS, KS_MAX_TILES, KS_POS, KV_DIMS};

/// The kernels of a K-only ring of `ty`: the one-block-per-(head, token) kernel, then the
/// split path's scores, weights and values kernels. The weights kernel is the ring's own
/// where it rounds the weights (f16, bf16), else the f32 one.
fn k_only_kernels(ty: GgmlType) -> Option<[&'static str; 4]> {
    macro_rules! kernels {
        ($ty:literal, $weights:literal) => {
            [
                concat!("attn_k_only_", $ty),
                concat!("attn_k_only_scores_", $ty),
                concat!("attn_k_only_weights_", $weights),
                concat!("attn_k_only_values_", $ty),
            ]
        };
    }
    Some(match ty {
        GgmlType::F32 => kernels!("f32", "f32"),
        GgmlType::F16 => kernels!("f16", "f16"),
        GgmlType::BF16 => kernels!("bf16", "bf16"),
        GgmlType::Q8_0 => kernels!("q8_0", "f32"),
        GgmlType::Q4_0 => kernels!("q4_0", "f32"),
        GgmlType::Q4_1 => kernels!("q4_1", "f32"),
        GgmlType::Q5_0 => kernels!("q5_0", "f32"),
        GgmlType::Q5_1 => kernels!("q5_1", "f32"),
        _ => return None,
    })
}

/// Whether a call of `n_tokens` over `p` runs split over positions: it has scores, at most
/// [`K_ONLY_DECODE_SCORES_MAX`] of them for one token and
/// [`K_ONLY_SCORES_MAX`] for several, and its head groups fit a grid's y.
fn k_only_split(p: &KOnlyAttnParams, n_tokens: usize) -> bool {
    let scores = n_tokens
        .checked_mul(p.n_head)
        .and_then(|x| x.checked_mul(p.cells));
    let most = match n_tokens {
        1 => K_ONLY_DECODE_SCORES_MAX,
        _ => K_ONLY_SCORES_MAX,
    };
    scores.is_some_and(|s| (1..=most).contains(&s)) && p.n_head.div_ceil(KS_HEADS) <= MAX_GRID_Y
}

impl CudaDevice {
    /// Attention over a K-only ring of `ty`, any of [`crate::K_ONLY_TYPES`] (not rotated; see
    /// `hmoe_backend::Backend::attention_k_only`): for a block-quantized ring the query
    /// quantized to the keys' `vec_dot_type` ([`CudaDevice::quantize_acts`], as the CPU device
    /// converts it for the keys' `vec_dot`). The first position is read on the device from
    /// `pos_at[0]` (the kernels write nothing when the batch would see past the ring). Split
    /// over positions when [`k_only_split`] says so, else one block per (head, token).
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
        let Some([row, scores, weights, values]) = k_only_kernels(ty) else {
            return Err(CudaError::UnsupportedType { ty, op: OP });
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
        let (nt, nh, kd, vd, cells) = (
            i32_of(OP, "tokens", n_tokens)?,
            i32_of(OP, "heads", p.n_head)?,
            i32_of(OP, "k_dim", p.k_dim)?,
            i32_of(OP, "v_dim", p.v_dim)?,
            i32_of(OP, "cells", p.cells)?,
        );
        let qq = match blocks {
            true => {
                let len = n_tokens * p.n_head * p.k_dim;
                Some(self.quantize_acts(hmoe_quant::vec_dot_type(ty), q, len)?)
            }
            false => None,
        };
        // Not read for float rings (any bytes stand in).
        let qq = qq.as_ref().unwrap_or(k_cache);
        let block = (KO_THREADS, 1, 1);
        if !k_only_split(p, n_tokens) {
            let cfg = LaunchConfig {
                grid_dim: (u32_of(OP, "heads", p.n_head)?, n_tokens as u32, 1),
                block_dim: block,
                shared_mem_bytes: 0,
            };
            let mut b = self.builder(row);
            b.arg(q).arg(qq).arg(k_cache).arg(out);
            b.arg(&nt).arg(&nh).arg(&kd).arg(&vd).arg(&cells);
            b.arg(pos_at).arg(&p.scale);
            // SAFETY: argument types match `attn_k_only_<type>` (q f32; qq the queries' blocks
            // in the keys' vec_dot_type for block rings; the ring's bytes rows of k_dim values
            // of `ty`, in an allocation aligned for f32); the caller checked q, the ring
            // (`cells × k_dim` of `ty`) and out against the shape; `pos_at` names an i32, and
            // the kernel reads only positions the ring holds (`read_pos0`).
            unsafe { b.launch(cfg) }?;
            return Ok(());
        }
        // At most K_ONLY_DECODE_SCORES_MAX (k_only_split), so every grid dimension fits
        // a u32.
        let mut s = self.alloc_scratch::<f32>(n_tokens * p.n_head * p.cells)?;
        let groups = p.n_head.div_ceil(KS_HEADS) as u32;
        let tiles = p.cells.div_ceil(KS_POS).min(KS_MAX_TILES) as u32;
        let cfg = |grid_dim| LaunchConfig {
            grid_dim,
            block_dim: block,
            shared_mem_bytes: 0,
        };
        let mut b = self.builder(scores);
        b.arg(q).arg(qq).arg(k_cache).arg(&mut s);
        b.arg(&nt).arg(&nh).arg(&kd).arg(&cells);
        b.arg(pos_at).arg(&p.scale);
        // SAFETY: argument types match `attn_k_only_scores_<type>` (q, qq and the ring as for
        // `attn_k_only_<type>` above); it writes the scores of positions up to the batch's
        // last (< cells, `read_pos0`) into the scratch of n_tokens × n_head × cells floats.
        unsafe { b.launch(cfg((tiles, groups, n_tokens as u32))) }?;
        let mut b = self.builder(weights);
        b.arg(&mut s).arg(&nt).arg(&nh).arg(&cells).arg(pos_at);
        // SAFETY: argument types match `attn_k_only_weights_<type>`; it reads and rewrites the
        // same positions of the scratch as the scores kernel wrote (queued before it on the
        // stream).
        unsafe { b.launch(cfg((p.n_head as u32, n_tokens as u32, 1))) }?;
        let dims = p.v_dim.div_ceil(KV_DIMS) as u32;
        let mut b = self.builder(values);
        b.arg(&s).arg(k_cache).arg(out);
        b.arg(&nt)
            .arg(&nh)
            .arg(&kd)
            .arg(&vd)
            .arg(&cells)
            .arg(pos_at);
        // SAFETY: argument types match `attn_k_only_values_<type>`; it reads the weights the
        // weights kernel wrote (queued before it) and the ring's first v_dim values of those
        // positions, and writes n_tokens × n_head × v_dim floats of out (checked by the caller).
        unsafe { b.launch(cfg((dims, groups, n_tokens as u32))) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_k_only_type_names_four_loaded_kernels() {
        for ty in crate::K_ONLY_TYPES {
            let names = k_only_kernels(ty).unwrap_or_else(|| panic!("{ty}: no kernels"));
            for name in names {
                assert!(crate::kernels::KERNELS.contains(&name), "{ty}: {name}");
            }
        }
        assert!(k_only_kernels(GgmlType::Q4_K).is_none());
    }
}
