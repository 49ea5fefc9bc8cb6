//! Scalar reference kernels. These define the numbers: the SIMD paths must reproduce them bit
//! for bit, so the dot products emulate the SIMD lanes and accumulation order of ggml's x86
//! kernels (see the crate docs), and `mul_add` stands for a fused multiply-add.
//!
//! `basic` holds the base types (F32, F16, BF16, Q8_0, MXFP4), `legacy` Q4_0 … Q5_1 and Q8_1,
//! `kquants` Q2_K … Q6_K and Q8_K, `iquants` the IQ types (whose tables `iq_grids` holds), `gemm` the batched products, `shared` the block layouts and
//! lane emulations every ISA uses. This file is their table for [`crate::Isa::Scalar`].

use crate::kernel_fns::{DequantFn, DotFns, QuantFn};
use crate::GgmlType;

pub(crate) mod basic;
pub(crate) mod gemm;
pub(crate) mod iq_grids;
pub(crate) mod iquants;
pub(crate) mod kquants;
pub(crate) mod legacy;
pub(crate) mod shared;

pub(crate) fn dot_fns(ty: GgmlType) -> Option<DotFns> {
    Some(match ty {
        GgmlType::F32 => scalar_kernel!("f32*f32/scalar", basic::dot_f32),
        GgmlType::F16 => scalar_kernel!("f16*f16/scalar", basic::dot_f16),
        GgmlType::BF16 => scalar_kernel!("bf16*bf16/scalar", basic::dot_bf16),
        GgmlType::Q8_0 => scalar_kernel!("q8_0*q8_0/scalar", basic::dot_q8_0),
        GgmlType::MXFP4 => scalar_kernel!("mxfp4*q8_0/scalar", basic::dot_mxfp4),
        GgmlType::Q4_0 => scalar_kernel!("q4_0*q8_0/scalar", legacy::dot_q4_0),
        GgmlType::Q4_1 => scalar_kernel!("q4_1*q8_1/scalar", legacy::dot_q4_1),
        GgmlType::Q5_0 => scalar_kernel!("q5_0*q8_0/scalar", legacy::dot_q5_0),
        GgmlType::Q5_1 => scalar_kernel!("q5_1*q8_1/scalar", legacy::dot_q5_1),
        GgmlType::Q2_K => scalar_kernel!("q2_k*q8_k/scalar", kquants::dot_q2_k),
        GgmlType::Q3_K => scalar_kernel!("q3_k*q8_k/scalar", kquants::dot_q3_k),
        GgmlType::Q4_K => scalar_kernel!("q4_k*q8_k/scalar", kquants::dot_q4_k),
        GgmlType::Q5_K => scalar_kernel!("q5_k*q8_k/scalar", kquants::dot_q5_k),
        GgmlType::Q6_K => scalar_kernel!("q6_k*q8_k/scalar", kquants::dot_q6_k),
        GgmlType::Q8_1 | GgmlType::Q8_K => return None,
        _ => return iquants::dot_fns(ty),
    })
}

pub(crate) fn quantize_fn(ty: GgmlType) -> Option<QuantFn> {
    Some(match ty {
        GgmlType::F32 => basic::quantize_f32,
        GgmlType::F16 => basic::quantize_f16,
        GgmlType::BF16 => basic::quantize_bf16,
        GgmlType::Q8_0 => basic::quantize_q8_0,
        GgmlType::MXFP4 => basic::quantize_mxfp4,
        GgmlType::Q4_0 => legacy::quantize_q4_0,
        GgmlType::Q4_1 => legacy::quantize_q4_1,
        GgmlType::Q5_0 => legacy::quantize_q5_0,
        GgmlType::Q5_1 => legacy::quantize_q5_1,
        GgmlType::Q8_1 => legacy::quantize_q8_1,
        GgmlType::Q8_K => kquants::quantize_q8_k,
        GgmlType::Q5_K => kquants::quantize_q5_k,
        _ => return None,
    })
}

pub(crate) fn dequantize_fn(ty: GgmlType) -> Option<DequantFn> {
    Some(match ty {
        GgmlType::F32 => basic::dequantize_f32,
        GgmlType::F16 => basic::dequantize_f16,
        GgmlType::BF16 => basic::dequantize_bf16,
        GgmlType::Q8_0 => basic::dequantize_q8_0,
        GgmlType::MXFP4 => basic::dequantize_mxfp4,
        GgmlType::Q4_0 => legacy::dequantize_q4_0,
        GgmlType::Q4_1 => legacy::dequantize_q4_1,
        GgmlType::Q5_0 => legacy::dequantize_q5_0,
        GgmlType::Q5_1 => legacy::dequantize_q5_1,
        GgmlType::Q8_1 => legacy::dequantize_q8_1,
        GgmlType::Q2_K => kquants::dequantize_q2_k,
        GgmlType::Q3_K => kquants::dequantize_q3_k,
        GgmlType::Q4_K => kquants::dequantize_q4_k,
        GgmlType::Q5_K => kquants::dequantize_q5_k,
        GgmlType::Q6_K => kquants::dequantize_q6_k,
        GgmlType::Q8_K => kquants::dequantize_q8_k,
        _ => return iquants::dequantize_fn(ty),
    })
}
