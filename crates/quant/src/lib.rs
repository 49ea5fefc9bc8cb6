//! Block quantisation formats used by GGUF files: the type table, conversions to and from f32,
//! and the dot-product kernels the model's matmuls are built from.
//!
//! Supported weight types: F32, F16, BF16, Q8_0, MXFP4, the legacy Q4_0, Q4_1, Q5_0, Q5_1,
//! the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and the IQ types ([`IQ_TYPES`]: IQ1_S, IQ1_M,
//! IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS); activation formats Q8_0 (also for
//! IQ4_NL), Q8_1 (for Q4_1/Q5_1) and Q8_K (for K-quants and the other IQ types). Every
//! operation but the IQ types' (scalar on every ISA) has a scalar reference and x86-64 AVX2 (+FMA,
//! F16C) and AVX-512 (F/BW/VL, VNNI when present) paths chosen at run time.
//!
//! | type | dequantize | quantize | dot (activations) |
//! |---|---|---|---|
//! | F32, F16, BF16 | yes | yes | self |
//! | Q8_0 | yes | ggml's x86 activation quantiser | Q8_0 |
//! | MXFP4 | yes | ggml's reference quantiser | Q8_0 |
//! | Q4_0, Q5_0 | yes | ggml's reference quantisers | Q8_0 |
//! | Q4_1, Q5_1 | yes | ggml's reference quantisers | Q8_1 |
//! | Q2_K ... Q6_K | yes | no | Q8_K |
//! | IQ1_S ... IQ4_XS | yes (bit-exact with gguf-py) | no | Q8_K (IQ4_NL: Q8_0); scalar, AVX2 (also on AVX-512) |
//! | Q8_1 | yes (`d·q`) | ggml's x86 activation quantiser | — |
//! | Q8_K | yes (`d·q`) | ggml's activation quantiser | — |
//!
//! # Numerics
//! The kernels reproduce what ggml's CPU backend computes on x86, built the way the reference
//! fixtures were (AVX2/FMA/F16C/AVX-512/VNNI flags, no AVX512-BF16/FP16):
//! * activations are converted once per row into [`vec_dot_type`] of the weight, bit-exact with
//!   ggml's x86 quantisers: Q8_0 (f16 scale `amax/127`, multiplier `127/amax`, round half to
//!   even), Q8_1 (the same plus `s = f16(amax/127 · Σq)`), Q8_K (ggml's scalar reference:
//!   `iscale = -127/max` of the first largest-magnitude value, the `nearest_int` bit trick,
//!   `d = 1/iscale` as f32, 16-element sums);
//! * the dot products keep ggml's accumulation order: F32/F16 four 16-lane FMA accumulators over
//!   64-element steps, BF16 two 16-lane multiply-add accumulators over 32-element steps (F16/BF16
//!   summed into f64 at the end), Q8_0/Q4_0/Q5_0 one 8-lane FMA accumulator of per-block int32
//!   partial sums (lane k sums elements 4k..4k+4), Q4_1/Q5_1 the same plus a scalar FMA chain of
//!   `m·s` added last, MXFP4 two 8-lane accumulators for even/odd blocks, K-quants one 8-lane FMA
//!   accumulator per super-block of int32 lanes (lane l takes bytes 4l..4l+4 of each 32-byte run)
//!   with the min corrections where ggml puts them (see `scalar/kquants.rs`). Horizontal sums
//!   halve the vector repeatedly, as `_mm512_reduce_add_ps` and ggml's `hsum_float_8` do. Scalar
//!   `a*b + c` in ggml's C that GCC contracts to FMA (`summs += m*s`) is an FMA here too;
//!   dequantisation rounds each product, as ggml's base library (built without FMA) does.
//!
//! The IQ types' products follow ggml's AVX2 kernels the same way (see `scalar/iquants.rs`):
//! integer lanes per super-block, one FMA per lane and super-block, halving sums, then the
//! type's constant; IQ1_S/IQ1_M add their ±1/8 shift terms last. They were checked against the
//! exactly summed dequantised values and end to end against llama.cpp (top-10 probabilities of
//! stand-in models within 3.7e-7, docs/performance.md), not against dot products recorded from
//! ggml. IQ4_NL matrices of a multiple of 8 rows take the order of llama.cpp's repacked
//! `iq4_nl_8x8` kernels instead ([`DotKernel::for_matrix`], `repack.rs`); llama.cpp built
//! without repacking (`--no-repack`) sums dense IQ4_NL products in tinyBLAS's order, which is
//! neither.
//!
//! Because the scalar reference emulates those lanes, **all ISAs return bit-identical results**
//! for every supported type (the tests check equality, not a tolerance), and for Q4_0 through
//! Q6_K, Q8_0 and MXFP4 they equal outputs recorded from ggml itself (dot, activation bytes,
//! dequantised values). Edge cases that differ from exact arithmetic, as in ggml: where ggml
//! multiplies signed bytes with the `_mm256_sign_epi8` trick (Q8_0, Q4_0, Q5_0, MXFP4), an
//! activation byte -128 times a negative weight has its sign flipped; our quantisers only emit
//! -128 for NaN inputs. Measured against f64 on random rows of 2880, |dot − exact| / Σ|w·x|
//! stays below 1.1e-8 (F32), 1.3e-5 (F16), 1.3e-4 (BF16), 2.4e-4 (Q8_0, MXFP4), almost all of
//! it from converting the activations. For the low-bit types (against Σ dequantize(w)·x, rows of
//! 32 to 4864) the worst cases seen are 0.4e-3 (Q3_K) to 1.9e-3 (Q5_0) with uniform activations
//! and 2.7e-3 to 6.8e-3 with activations spanning 2^±8 within a block; the tests bound each
//! case by the activation quantisation error.
//!
//! Note for matching llama.cpp end to end: llama.cpp routes some dense F32/F16/BF16/Q8_0/Q4_0/
//! Q5_0 matmuls through its llamafile sgemm, and with `GGML_CPU_REPACK` (default on) Q4_0, Q4_K,
//! IQ4_NL, MXFP4 (AVX2) and Q2_K (AVX-512) weights through repacked 8-row layouts when the row
//! count is a multiple of 8; those use other accumulation orders than the `vec_dot` kernels
//! mirrored here (Q4_0, IQ4_NL, Q4_K and MXFP4 in their repacked orders are mirrored too).
//!
//! For batches (and for MXFP4 in llama.cpp's repacked order) [`GemmKernel`] multiplies many
//! rows by many tokens in tiles: MXFP4 × Q8_0 in the block-wise order of llama.cpp's repacked
//! MXFP4 kernels (one FMA per block of an exact integer block sum, see `gemm_kernel.rs`), Q8_0
//! and Q4_0/Q4_1/Q5_0/Q5_1 bit-identical to [`DotKernel::dot`], F32 in tinyBLAS's 16-lane order.
//!
//! [`expf`] and [`expf_slice`] compute `e^x` bit-identically to glibc's `expf` (its FMA build,
//! what `f32::exp` calls on x86-64 with FMA), the latter vectorised (see `exp.rs`);
//! [`expf_ggml`] and [`expf_ggml_slice`] compute ggml's vectorised exponential.
//!
//! All functions are thread-safe and allocation-free, except [`GemmKernel::prepare`] (a vector
//! of block sums for MXFP4) and [`GemmKernel::gemm`] for MXFP4 with fewer than 16 rows.
#![warn(missing_docs)]

#[macro_use]
mod kernel_fns;
mod cache_hint;
mod convert;
mod dispatch;
mod dot_kernel;
mod error;
mod exp;
mod gemm_kernel;
mod gemm_layout;
mod isa;
mod pages;
mod repack;
mod scalar;
mod tiled;
mod tiled_gemm;
mod types;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_exp;

pub use cache_hint::prefetch;
pub use convert::{
    dequantize_row, dequantize_row_with, f16_bytes, quantize_row, quantize_row_with, Dequantizer,
};
pub use dispatch::{amx_in_use, amx_status, kernel_summary};
pub use dot_kernel::DotKernel;
pub use error::QuantError;
pub use exp::{expf, expf_ggml, expf_ggml_slice, expf_slice, expf_slice_with};
pub use gemm_kernel::{GemmActs, GemmKernel};
pub use isa::{AmxStatus, Isa};
pub use pages::whole_pages;
pub use scalar::iquants::set_iq_block_scale;
pub use tiled::{BatchKind, TILED_MIN_TOKENS};
pub use tiled_gemm::TokenRows;
pub use types::{vec_dot_type, GgmlType, IQ_TYPES, LOWBIT_TYPES, WEIGHT_TYPES};
