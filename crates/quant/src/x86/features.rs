//! CPU feature detection (x86-64 only), cached by `std`'s detection macro.

/// AVX2 + FMA + F16C: the feature set of [`crate::Isa::Avx2`].
pub(crate) fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// AVX2 set plus AVX-512 F/BW/VL: the feature set of [`crate::Isa::Avx512`].
pub(crate) fn has_avx512() -> bool {
    has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
}

/// AVX-512 VNNI (`vpdpbusd`), used by the AVX-512 integer dot products when present.
pub(crate) fn has_avx512_vnni() -> bool {
    has_avx512() && is_x86_feature_detected!("avx512vnni")
}

/// AVX-512 VBMI (`vpermb`), used by the AVX-512 MXFP4 GEMM's nibble lookup when present.
pub(crate) fn has_avx512_vbmi() -> bool {
    has_avx512() && is_x86_feature_detected!("avx512vbmi")
}
