//! AVX2 + FMA + F16C kernels: the base types (`dot`: F32, F16, BF16, Q8_0, MXFP4, with their
//! quantisers and dequantisers), the low-bit formats (`lowbit`), the IQ types (`iquants`) and the batched products
//! (`gemm`, `gemm_lowbit`). This file is their table for [`crate::Isa::Avx2`].

use crate::kernel_fns::DotFns;
use crate::GgmlType;

pub(crate) mod dot;
pub(crate) mod gemm;
pub(crate) mod gemm_lowbit;
pub(crate) mod iquants;
pub(crate) mod lowbit;

pub(crate) use dot::{dequantize_fn, quantize_fn};

/// The AVX2 dot kernel for weights of type `ty`, `None` for a type without one.
pub(crate) fn dot_fns(ty: GgmlType) -> Option<DotFns> {
    dot::dot_fns(ty)
        .or_else(|| lowbit::dot_fns(ty))
        .or_else(|| iquants::dot_fns(ty))
}
