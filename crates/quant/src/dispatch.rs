//! The one place that knows every ISA: for each operation, the kernel behind the public API on
//! each instruction set, and what this process runs (AVX-512 extensions, the AMX tiles).

use crate::gemm_layout::GemmFn;
use crate::kernel_fns::{DequantFn, DotFns, QuantFn};
#[cfg(target_arch = "x86_64")]
use crate::x86::{self, features};
use crate::{scalar, AmxStatus, GgmlType, Isa};

/// The dot kernel for weights of type `ty` on `isa` (AVX-512 uses VNNI when `allow_vnni` and the
/// CPU has it). `None` when the type has no kernel.
pub(crate) fn dot_fns(isa: Isa, ty: GgmlType, allow_vnni: bool) -> Option<DotFns> {
    match isa {
        Isa::Scalar => scalar::dot_fns(ty),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::avx2::dot_fns(ty),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::avx512::dot_fns(ty, allow_vnni && features::has_avx512_vnni()),
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => {
            let _ = allow_vnni;
            None
        }
    }
}

/// The quantiser for `ty` on `isa`.
pub(crate) fn quantize_fn(isa: Isa, ty: GgmlType) -> Option<QuantFn> {
    match isa {
        Isa::Scalar => scalar::quantize_fn(ty),
        // Quantisation runs once per activation row; the AVX2 kernels serve AVX-512 too.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => x86::avx2::quantize_fn(ty),
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => None,
    }
}

/// The dequantiser for `ty` on `isa`.
pub(crate) fn dequantize_fn(isa: Isa, ty: GgmlType) -> Option<DequantFn> {
    match isa {
        Isa::Scalar => scalar::dequantize_fn(ty),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => x86::avx2::dequantize_fn(ty),
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => None,
    }
}

/// The GEMM for `weight` on `isa` (MXFP4 over rows interleaved in groups of 16 with `x16`)
/// and whether it runs on AMX tiles: `allow_vnni = false` (`allow_vbmi = false`, `allow_amx =
/// false`) forces the AVX-512 kernels without VNNI (VBMI, AMX). `None` where `isa` has no such
/// kernel (the interleaved layout on [`Isa::Scalar`], any ISA but scalar off x86-64).
pub(crate) fn gemm_fn(
    isa: Isa,
    weight: GgmlType,
    x16: bool,
    allow_vnni: bool,
    allow_vbmi: bool,
    allow_amx: bool,
) -> Option<((&'static str, GemmFn), bool)> {
    match isa {
        Isa::Scalar => (!x16).then(|| (scalar::gemm::scalar_fn(weight), false)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if x16 => Some((x86::avx2::gemm::gemm_fn_x16(), false)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Some((
            x86::avx2::gemm_lowbit::gemm_fn(weight)
                .unwrap_or_else(|| x86::avx2::gemm::gemm_fn(weight)),
            false,
        )),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Some(avx512_gemm_fn(
            weight, x16, allow_vnni, allow_vbmi, allow_amx,
        )),
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => {
            let _ = (allow_vnni, allow_vbmi, allow_amx);
            None
        }
    }
}

/// The AVX-512 GEMM for `weight` (MXFP4 over rows interleaved in groups of 16 with `x16`) and
/// whether it runs on AMX tiles: batched MXFP4 on the tiles where they run and are allowed
/// (the same bits as VNNI + VBMI), else the VNNI/VBMI kernels where allowed and present. The
/// AMX status, which probes the tiles, is asked only when AMX is allowed.
#[cfg(target_arch = "x86_64")]
fn avx512_gemm_fn(
    weight: GgmlType,
    x16: bool,
    allow_vnni: bool,
    allow_vbmi: bool,
    allow_amx: bool,
) -> ((&'static str, GemmFn), bool) {
    let tiles = (weight == GgmlType::MXFP4 && allow_vnni && allow_vbmi && allow_amx)
        .then(|| x86::amx::gemm_fn(x16))
        .flatten();
    if let Some(tiles) = tiles {
        return (tiles, true);
    }
    let vnni = allow_vnni && features::has_avx512_vnni();
    let vbmi = allow_vbmi && features::has_avx512_vbmi();
    let kernel = if x16 {
        x86::avx512::gemm::gemm_fn_x16(vnni, vbmi)
    } else {
        x86::avx512::gemm_lowbit::gemm_fn(weight, vnni)
            .unwrap_or_else(|| x86::avx512::gemm::gemm_fn(weight, vnni, vbmi))
    };
    (kernel, false)
}

/// Whether batched MXFP4 products run on AMX tiles here ([`crate::GemmKernel`] on [`Isa::Avx512`]
/// picks them then): the CPU reports AMX-TILE/AMX-INT8, Linux granted the tile permission and
/// a probe multiply in a forked child ran and was right. Decided once per process.
pub fn amx_status() -> &'static AmxStatus {
    #[cfg(target_arch = "x86_64")]
    return x86::amx::amx_status();
    #[cfg(not(target_arch = "x86_64"))]
    return &AmxStatus::NotReported;
}

/// Whether batched MXFP4 products (from 16 tokens) use the AMX tiles: wherever they run
/// ([`amx_status`]; `HMOE_AMX=0` turns them off). On the one AMX machine measured (a 16-core
/// Xeon, 2 threads, gpt-oss pp512) they were faster than AVX-512 VNNI in each of three
/// alternating pairs (1.08–1.31×), and bit-identical.
pub fn amx_in_use() -> bool {
    *amx_status() == AmxStatus::Usable
}

/// One line naming the CPU kernels this process uses, for benchmark reports: the best ISA,
/// VNNI/VBMI where the AVX-512 kernels use them, and the AMX status.
pub fn kernel_summary() -> String {
    let isa = Isa::best();
    let mut s = isa.name().to_string();
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        for (has, name) in [
            (features::has_avx512_vnni(), "vnni"),
            (features::has_avx512_vbmi(), "vbmi"),
        ] {
            if has {
                s.push('+');
                s.push_str(name);
            }
        }
    }
    let amx = amx_status();
    let used = if amx_in_use() {
        ", used for batched MXFP4 from 16 tokens"
    } else {
        ""
    };
    format!("{s}, {amx}{used}")
}
