//! AVX-512 F/BW/VL kernels (VNNI where the CPU has it): the base types' dot products (`dot`),
//! the low-bit formats where zmm registers pay (`lowbit`, else the AVX2 kernels; the IQ types use
//! the AVX2 ones, but for IQ2_XXS rows with VBMI, `avx2/iquants/tokens_vnni.rs`) and the batched products
//! (`gemm`, `gemm_lowbit`). This file is their table for [`crate::Isa::Avx512`]; quantisation and
//! dequantisation use the AVX2 kernels.

use crate::kernel_fns::DotFns;
use crate::GgmlType;

pub(crate) mod dot;
pub(crate) mod gemm;
pub(crate) mod gemm_lowbit;
pub(crate) mod lowbit;
mod q5_0_rows;

/// The AVX-512 dot kernel for weights of type `ty`; the VNNI variants when `vnni` (the caller
/// checked the CPU). `None` for a type without one.
pub(crate) fn dot_fns(ty: GgmlType, vnni: bool) -> Option<DotFns> {
    dot::dot_fns(ty, vnni)
        .or_else(|| lowbit::dot_fns(ty, vnni))
        .or_else(|| {
            let vbmi = vnni && crate::x86::features::has_avx512_vbmi();
            vbmi.then(|| crate::x86::avx2::iquants::tokens_vnni::rows_fns(ty))?
        })
        .or_else(|| crate::x86::avx2::iquants::dot_fns(ty))
}
