//! What the kernels support: the weight types they multiply, the K/V ring types they store and
//! attend over, and the expert sets the MoE block takes, known without opening a device.

use hmoe_backend::KvLayout;
use hmoe_quant::GgmlType;

use crate::error::CudaError;
use crate::kernels::ATT_MAX_HEAD_DIM;

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

/// The K/V ring types of K/V pairs the attention kernels read (`attn_row`, `attn_flash`);
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
/// (f32/f16 values by the row kernel, Q8_0/Q4_0 values by flash attention, as the CPU device
/// chooses its path by the value type; keys of every type in both).
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
}
