//! CPU feature detection (x86-64 only), cached by `std`'s detection macro.

use std::sync::OnceLock;

/// The highest ISA level `HMOE_ISA` allows: 0 for `scalar`, 1 for `avx2`, 2 otherwise (unset,
/// `avx512` or anything else). It caps what the features below report, so an AVX-512 machine
/// can run (and measure) the kernels an AVX2-only CPU would; read once.
fn isa_cap() -> u8 {
    static CAP: OnceLock<u8> = OnceLock::new();
    *CAP.get_or_init(|| cap_of(std::env::var("HMOE_ISA").ok().as_deref()))
}

/// [`isa_cap`] of a value of `HMOE_ISA`.
fn cap_of(value: Option<&str>) -> u8 {
    match value.map(str::trim).map(str::to_ascii_lowercase).as_deref() {
        Some("scalar") => 0,
        Some("avx2") => 1,
        _ => 2,
    }
}

/// AVX2 + FMA + F16C: the feature set of [`crate::Isa::Avx2`].
pub(crate) fn has_avx2() -> bool {
    isa_cap() >= 1
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// AVX2 set plus AVX-512 F/BW/VL: the feature set of [`crate::Isa::Avx512`].
pub(crate) fn has_avx512() -> bool {
    isa_cap() >= 2
        && has_avx2()
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

#[cfg(test)]
mod tests {
    use super::cap_of;

    #[test]
    fn hmoe_isa_values_cap_the_features() {
        assert_eq!(cap_of(None), 2);
        assert_eq!(cap_of(Some("avx512")), 2);
        assert_eq!(cap_of(Some(" AVX2 ")), 1);
        assert_eq!(cap_of(Some("scalar")), 0);
        assert_eq!(cap_of(Some("sse")), 2);
    }
}
