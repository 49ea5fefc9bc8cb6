//! What the kernels support: the weight types they multiply, the K/V ring types they store and
//! attend over, and the expert sets the MoE block takes, known without opening a device.

use hmoe_backend::KvLayout;
use hmoe_quant::GgmlType;

use crate::error::CudaError;
use crate::kernels::{ATT_MAX_HEAD_DIM, MMA_ROWS_MXFP4, MMA_ROWS_Q8_0, MMA_WARPS, TILE_ROWS};

/// The weight types the kernels dequantise and multiply (`matmul`, `matmul_heads`,
/// `get_rows`, expert sets): F32, F16, BF16, Q8_0 and MXFP4, and the low-bit types
/// of GGUF files ([`LOWBIT_TYPES`]).
pub const SUPPORTED_TYPES: [GgmlType; 14] = hmoe_quant::WEIGHT_TYPES;

/// The low-bit weight types the kernels multiply (besides F32, F16, BF16, Q8_0 and MXFP4).
pub const LOWBIT_TYPES: [GgmlType; 9] = hmoe_quant::LOWBIT_TYPES;

/// Whether `ty` is one of [`LOWBIT_TYPES`].
pub(super) fn is_lowbit(ty: GgmlType) -> bool {
    LOWBIT_TYPES.contains(&ty)
}

/// The K/V ring types of K/V pairs the attention kernels read (`attn_row`, `attn_chunked`);
/// `kv_store` also stores the other types of [`K_ONLY_TYPES`].
pub const KV_TYPES: [GgmlType; 4] = [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0];

/// Whether [`CudaDevice::moe`](crate::CudaDevice::moe) takes experts with gate, up and down
/// of these types: one type of [`SUPPORTED_TYPES`], or each of [`LOWBIT_TYPES`] or Q8_0.
pub fn expert_types_supported(gate: GgmlType, up: GgmlType, down: GgmlType) -> bool {
    let types = [gate, up, down];
    let lowbit_set = |ty: GgmlType| is_lowbit(ty) || ty == GgmlType::Q8_0;
    let one = types.iter().all(|&ty| ty == gate) && SUPPORTED_TYPES.contains(&gate);
    one || types.iter().any(|&ty| is_lowbit(ty)) && types.into_iter().all(lowbit_set)
}

/// Whether the attention kernels read keys of `k` with values of `v`: both of [`KV_TYPES`]
/// (f32/f16 values by the row kernel with `-fa off` and the chunked flash kernel with `-fa on`,
/// Q8_0/Q4_0 values by the chunked flash kernel whatever `-fa` says, as the CPU device chooses
/// its path; keys of every type in both).
pub fn kv_pair_supported(k: GgmlType, v: GgmlType) -> bool {
    KV_TYPES.contains(&v) && KV_TYPES.contains(&k)
}

/// The types of K-only (latent) rings the kernels attend over
/// ([`hmoe_backend::Backend::k_only_types`]): every K/V type of the contract
/// ([`hmoe_backend::KV_TYPES`]). `kv_store` stores rings of all of them (the device's
/// `kv_types`); [`KV_TYPES`] are those of K/V pairs.
pub const K_ONLY_TYPES: [GgmlType; 8] = hmoe_backend::KV_TYPES;

/// What the CUDA device keeps and computes, known without opening one: the weight types of
/// [`SUPPORTED_TYPES`], rings of every type of [`K_ONLY_TYPES`], K/V pairs of [`KV_TYPES`]
/// ([`kv_pair_supported`]).
pub const CAPABILITIES: hmoe_backend::Capabilities = hmoe_backend::Capabilities {
    weight_types: &SUPPORTED_TYPES,
    kv_types: &K_ONLY_TYPES,
    kv_pair_types: &KV_TYPES,
    k_only_types: &K_ONLY_TYPES,
    rope_freq_factors: false,
};

/// Whether a ring of `l` is one the kernels store and read: a type of [`K_ONLY_TYPES`] (which
/// holds [`KV_TYPES`]; the attention kernels also check the pair, [`kv_pair_supported`]),
/// rotated only when block-quantized, in chunks of at most [`ATT_MAX_HEAD_DIM`].
pub(super) fn kv_type_ok(l: &KvLayout) -> bool {
    let block = !matches!(l.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    K_ONLY_TYPES.contains(&l.ty) && (l.rot == 0 || block && l.rot <= ATT_MAX_HEAD_DIM)
}

/// An error unless the kernels multiply weights of `ty` ([`SUPPORTED_TYPES`]).
pub(super) fn check_type(ty: GgmlType, op: &'static str) -> Result<(), CudaError> {
    if SUPPORTED_TYPES.contains(&ty) {
        Ok(())
    } else {
        Err(CudaError::UnsupportedType { ty, op })
    }
}

/// A tiled Q8_0/MXFP4 product's kernel: its entry point, the weight rows one block covers and
/// the threads of a block (each block takes up to `TILE_SLOTS` tokens or expert slots).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TiledKernel {
    /// The entry point.
    pub name: &'static str,
    /// Weight rows per block.
    pub rows_per_block: u32,
    /// Threads per block.
    pub threads: u32,
}

/// The tiled product of `ty` (Q8_0 or MXFP4 weights; `experts`: the grouped MoE product
/// `moe_mm_*`, else the dense `matmul_tiled_*`) for a device of `compute_capability`: the int8
/// tensor-core kernels (`*_mma_*`, `mma.sync` m16n8k32) from sm_80, the `__dp4a` kernels
/// before. Both give the same bits.
pub(super) fn tiled_kernel(
    ty: GgmlType,
    experts: bool,
    compute_capability: (u32, u32),
) -> TiledKernel {
    let mxfp4 = ty == GgmlType::MXFP4;
    if has_int8_mma(compute_capability) {
        let name = match (experts, mxfp4) {
            (true, true) => "moe_mm_mma_mxfp4",
            (true, false) => "moe_mm_mma_q8_0",
            (false, true) => "matmul_mma_mxfp4",
            (false, false) => "matmul_mma_q8_0",
        };
        let rows_per_block = if mxfp4 { MMA_ROWS_MXFP4 } else { MMA_ROWS_Q8_0 };
        TiledKernel {
            name,
            rows_per_block,
            threads: 32 * MMA_WARPS,
        }
    } else {
        let name = match (experts, mxfp4) {
            (true, true) => "moe_mm_mxfp4",
            (true, false) => "moe_mm_q8_0",
            (false, true) => "matmul_tiled_mxfp4",
            (false, false) => "matmul_tiled_q8_0",
        };
        TiledKernel {
            name,
            rows_per_block: TILE_ROWS,
            threads: 256,
        }
    }
}

/// Whether a device of `compute_capability` has the int8 tensor-core instructions the `*_mma_*`
/// kernels use (`mma.sync` m16n8k32, `ldmatrix`, `cp.async`: sm_80 on).
pub(super) fn has_int8_mma(compute_capability: (u32, u32)) -> bool {
    compute_capability.0 >= 8
}

/// The tensor-core products of a K-quant `ty` (Q2_K … Q6_K) for a device of
/// `compute_capability`: `(dense, experts)` entry points (`matmul_mma_*`, `moe_mm_mma_*`; both
/// `MMA_ROWS_KQ` rows and `32 * MMA_WARPS` threads per block); none for other types or before
/// sm_80. They serve the CPU device's tiled and repacked orders, not `vec_dot`'s.
pub(super) fn kquant_mma_kernels(
    ty: GgmlType,
    compute_capability: (u32, u32),
) -> Option<(&'static str, &'static str)> {
    if !has_int8_mma(compute_capability) {
        return None;
    }
    Some(match ty {
        GgmlType::Q2_K => ("matmul_mma_q2_k", "moe_mm_mma_q2_k"),
        GgmlType::Q3_K => ("matmul_mma_q3_k", "moe_mm_mma_q3_k"),
        GgmlType::Q4_K => ("matmul_mma_q4_k", "moe_mm_mma_q4_k"),
        GgmlType::Q5_K => ("matmul_mma_q5_k", "moe_mm_mma_q5_k"),
        GgmlType::Q6_K => ("matmul_mma_q6_k", "moe_mm_mma_q6_k"),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_sets_of_one_type_or_low_bit_with_q8_0() {
        use expert_types_supported as ok;
        use GgmlType::*;
        assert!(ok(Q4_K, Q4_K, Q6_K) && ok(Q5_0, Q5_0, Q8_0) && ok(Q2_K, Q3_K, Q3_K));
        assert!(ok(MXFP4, MXFP4, MXFP4) && ok(F32, F32, F32) && ok(Q6_K, Q6_K, Q6_K));
        assert!(!ok(Q4_K, Q4_K, MXFP4) && !ok(F16, F16, Q8_0) && !ok(Q8_0, Q8_0, F32));
        assert!(!ok(Q8_K, Q8_K, Q8_K));
    }

    #[test]
    fn tensor_core_products_from_sm_80() {
        use GgmlType::*;
        for cc in [(7, 0), (7, 5)] {
            let k = tiled_kernel(MXFP4, true, cc);
            assert_eq!(
                (k.name, k.rows_per_block, k.threads),
                ("moe_mm_mxfp4", TILE_ROWS, 256)
            );
            assert_eq!(tiled_kernel(Q8_0, false, cc).name, "matmul_tiled_q8_0");
        }
        for cc in [(8, 0), (8, 6), (9, 0), (12, 0)] {
            let k = tiled_kernel(MXFP4, true, cc);
            assert_eq!(
                (k.name, k.rows_per_block),
                ("moe_mm_mma_mxfp4", MMA_ROWS_MXFP4)
            );
            let k = tiled_kernel(Q8_0, false, cc);
            assert_eq!(
                (k.name, k.rows_per_block),
                ("matmul_mma_q8_0", MMA_ROWS_Q8_0)
            );
            assert_eq!(tiled_kernel(Q8_0, true, cc).name, "moe_mm_mma_q8_0");
            assert_eq!(tiled_kernel(MXFP4, false, cc).name, "matmul_mma_mxfp4");
        }
        for ty in [Q8_0, MXFP4] {
            for experts in [false, true] {
                let name = tiled_kernel(ty, experts, (9, 0)).name;
                assert!(crate::kernels::KERNELS.contains(&name), "{name}");
                let name = tiled_kernel(ty, experts, (7, 5)).name;
                assert!(crate::kernels::KERNELS.contains(&name), "{name}");
            }
        }
    }

    #[test]
    fn kquant_tensor_core_products_from_sm_80() {
        use GgmlType::*;
        for ty in [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K] {
            assert!(kquant_mma_kernels(ty, (7, 5)).is_none());
            let (dense, experts) = kquant_mma_kernels(ty, (8, 0)).unwrap();
            for name in [dense, experts] {
                assert!(crate::kernels::KERNELS.contains(&name), "{name}");
            }
        }
        for ty in [Q4_0, Q5_1, Q8_0, MXFP4, F16] {
            assert!(kquant_mma_kernels(ty, (9, 0)).is_none());
        }
    }
}
