//! Block quantisation formats used by GGUF files: the type table, conversions to and from f32,
//! and the dot-product kernels the model's matmuls are built from.
//!
//! Supported weight types: F32, F16, BF16, Q8_0, MXFP4, the legacy Q4_0, Q4_1, Q5_0, Q5_1 and
//! the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; activation formats Q8_0, Q8_1 (for Q4_1/Q5_1)
//! and Q8_K (for K-quants). Every operation has a scalar reference and x86-64 AVX2 (+FMA,
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
//!   with the min corrections where ggml puts them (see `kquants.rs`). Horizontal sums halve the
//!   vector repeatedly, as `_mm512_reduce_add_ps` and ggml's `hsum_float_8` do. Scalar
//!   `a*b + c` in ggml's C that GCC contracts to FMA (`summs += m*s`) is an FMA here too;
//!   dequantisation rounds each product, as ggml's base library (built without FMA) does.
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
//! MXFP4 (AVX2) and Q2_K (AVX-512) weights through repacked 8-row layouts when the row count
//! is a multiple of 8; those use other accumulation orders than the `vec_dot` kernels mirrored
//! here.
//!
//! For batches (and for MXFP4 in llama.cpp's repacked order) [`GemmKernel`] multiplies many
//! rows by many tokens in tiles: MXFP4 × Q8_0 in the block-wise order of llama.cpp's repacked
//! MXFP4 kernels (one FMA per block of an exact integer block sum, see `gemm.rs`), Q8_0
//! bit-identical to [`DotKernel::dot`], F32 in tinyBLAS's 16-lane order.
//!
//! [`expf`] and [`expf_slice`] compute `e^x` bit-identically to glibc's `expf` (its FMA build,
//! what `f32::exp` calls on x86-64 with FMA), the latter vectorised (see `exp.rs`);
//! [`expf_ggml`] and [`expf_ggml_slice`] compute ggml's vectorised exponential.
//!
//! All functions are thread-safe and allocation-free, except [`GemmKernel::prepare`] (a vector
//! of block sums for MXFP4) and [`GemmKernel::gemm`] for MXFP4 with fewer than 16 rows.
#![warn(missing_docs)]

#[macro_use]
mod kernels;
mod exp;
mod gemm;
mod kquants;
mod legacy;
mod repack;
mod scalar;
mod tiled;
mod types;
#[cfg(target_arch = "x86_64")]
mod x86_amx;
#[cfg(target_arch = "x86_64")]
mod x86_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_avx2_lowbit;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;
#[cfg(target_arch = "x86_64")]
mod x86_avx512_lowbit;
#[cfg(target_arch = "x86_64")]
mod x86_gemm_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_gemm_avx512;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_exp;
#[cfg(test)]
mod tests_gemm;
#[cfg(test)]
mod tests_lowbit;

use std::sync::OnceLock;

pub use exp::{expf, expf_ggml, expf_ggml_slice, expf_slice, expf_slice_with};
pub use gemm::{GemmActs, GemmKernel};
use kernels::{DequantFn, DotFn, DotRowsFn, QuantFn};
pub use tiled::{BatchKind, TILED_MIN_TOKENS};
pub use types::{GgmlType, LOWBIT_TYPES, WEIGHT_TYPES};

/// An instruction-set level the kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, the reference every other path must reproduce.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL (plus AVX2/FMA/F16C); VNNI is used when the CPU has it.
    Avx512,
}

impl Isa {
    /// The fastest ISA this CPU supports (detected once, then cached).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            if Isa::Avx512.is_available() {
                Isa::Avx512
            } else if Isa::Avx2.is_available() {
                Isa::Avx2
            } else {
                Isa::Scalar
            }
        })
    }

    /// Every ISA this CPU supports, slowest first (always starts with [`Isa::Scalar`]).
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.is_available())
            .collect()
    }

    /// Whether this CPU can run kernels of this ISA.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => cpu::has_avx2(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => cpu::has_avx512(),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }

    /// Short lower-case name (`scalar`, `avx2`, `avx512`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether AMX-INT8 runs here, and if not, why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AmxStatus {
    /// Tile permission granted and a tile multiply gave the right result: batched MXFP4
    /// products use AMX (see [`amx_in_use`]).
    Usable,
    /// The CPU does not report AMX-TILE and AMX-INT8 (or AVX-512 VNNI/VBMI, which the
    /// kernel's fallbacks need).
    NotReported,
    /// `HMOE_AMX=0` turned it off.
    Disabled,
    /// The kernel refused the tile permission (the errno).
    PermissionDenied(i32),
    /// The probe's tile instructions faulted or computed the wrong result.
    ProbeFailed(String),
}

impl std::fmt::Display for AmxStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AmxStatus::Usable => {
                f.write_str("amx-int8 runs (tile permission granted, probe passed)")
            }
            AmxStatus::NotReported => f.write_str("no amx (not reported by the CPU)"),
            AmxStatus::Disabled => f.write_str("no amx (HMOE_AMX=0)"),
            AmxStatus::PermissionDenied(e) => {
                write!(f, "no amx (tile permission refused, errno {e})")
            }
            AmxStatus::ProbeFailed(why) => write!(f, "no amx ({why})"),
        }
    }
}

/// Whether batched MXFP4 products run on AMX tiles here ([`GemmKernel`] on [`Isa::Avx512`]
/// picks them then): the CPU reports AMX-TILE/AMX-INT8, Linux granted the tile permission and
/// a probe multiply in a forked child ran and was right. Decided once per process.
pub fn amx_status() -> &'static AmxStatus {
    #[cfg(target_arch = "x86_64")]
    return x86_amx::amx_status();
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
            (cpu::has_avx512_vnni(), "vnni"),
            (cpu::has_avx512_vbmi(), "vbmi"),
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

/// CPU feature detection (x86-64 only), cached by `std`'s detection macro.
#[cfg(target_arch = "x86_64")]
mod cpu {
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
}

/// Errors from the conversion functions and kernel construction.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The type has no kernel for this operation (yet).
    #[error("{op} is not supported for {ty}")]
    Unsupported {
        /// The type asked for.
        ty: GgmlType,
        /// The operation (`dequantize`, `quantize`, `dot`).
        op: &'static str,
    },
    /// The element count is not a whole number of blocks.
    #[error("{n} elements is not a whole number of {ty} blocks of {block}")]
    NotBlockMultiple {
        /// The type.
        ty: GgmlType,
        /// The element count given.
        n: usize,
        /// Elements per block of `ty`.
        block: usize,
    },
    /// A byte buffer does not have the size the element count implies.
    #[error("a {ty} row of {n} elements is {expected} bytes, got {got}")]
    LengthMismatch {
        /// The type.
        ty: GgmlType,
        /// The element count.
        n: usize,
        /// Bytes the row must have.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// A GEMM operand does not have the size the others imply.
    #[error("{what}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// Which operand.
        what: &'static str,
        /// The size the other operands imply.
        expected: usize,
        /// The size given.
        got: usize,
    },
    /// The CPU cannot run the requested ISA.
    #[error("instruction set {0} is not available on this CPU")]
    IsaUnavailable(Isa),
}

/// ggml's `vec_dot_type`: the format activations must be in to be dotted with weights of type
/// `w` (F32→F32, F16→F16, BF16→BF16, Q8_0/MXFP4/Q4_0/Q5_0→Q8_0, Q4_1/Q5_1/Q8_1→Q8_1,
/// K-quants→Q8_K). Q8_K is not a weight type; ggml's table leaves it at F32.
pub fn vec_dot_type(w: GgmlType) -> GgmlType {
    use GgmlType::*;
    match w {
        F32 | Q8_K => F32,
        F16 => F16,
        BF16 => BF16,
        Q4_0 | Q5_0 | Q8_0 | MXFP4 => Q8_0,
        Q4_1 | Q5_1 | Q8_1 => Q8_1,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => Q8_K,
    }
}

/// Bytes of a row of `n` elements of `ty`, or the error for a partial block.
fn row_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let block = ty.block_elems();
    if !n.is_multiple_of(block) {
        return Err(QuantError::NotBlockMultiple { ty, n, block });
    }
    // n / block * block_bytes cannot overflow for a slice that exists in memory as f32s.
    Ok(n / block * ty.block_bytes())
}

fn check_len(ty: GgmlType, n: usize, got: usize) -> Result<(), QuantError> {
    let expected = row_bytes(ty, n)?;
    if expected != got {
        return Err(QuantError::LengthMismatch {
            ty,
            n,
            expected,
            got,
        });
    }
    Ok(())
}

fn check_isa(isa: Isa) -> Result<(), QuantError> {
    if isa.is_available() {
        Ok(())
    } else {
        Err(QuantError::IsaUnavailable(isa))
    }
}

/// Dequantises `dst.len()` elements from `src` (exactly `ty.row_bytes(dst.len())` bytes).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    dequantize_row_with(Isa::best(), ty, src, dst)
}

/// [`dequantize_row`] on a chosen ISA (all ISAs give identical results).
pub fn dequantize_row_with(
    isa: Isa,
    ty: GgmlType,
    src: &[u8],
    dst: &mut [f32],
) -> Result<(), QuantError> {
    check_isa(isa)?;
    let f: DequantFn = kernels::dequantize_fn(isa, ty).ok_or(QuantError::Unsupported {
        ty,
        op: "dequantize",
    })?;
    check_len(ty, dst.len(), src.len())?;
    // SAFETY: `isa` is available on this CPU and `src` holds exactly the blocks of `dst`.
    unsafe { f(src, dst) };
    Ok(())
}

/// Asks the CPU to start loading `items` into its caches: a hint for data that will be read
/// soon from scattered places (a KV cache), with no effect on results.
#[inline]
pub fn prefetch<T>(items: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let start = items.as_ptr() as usize & !63;
        let end = items.as_ptr() as usize + std::mem::size_of_val(items);
        for line in (start..end).step_by(64) {
            // SAFETY: a prefetch is a hint that never faults or changes memory; `line` is the
            // first byte of a cache line that holds part of `items`.
            unsafe {
                core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                    line as *const i8,
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = items;
}

/// The addresses of the whole memory pages inside `bytes` (the page size from the OS), for
/// advice (`madvise`) that takes whole pages; `None` when it holds none or the page size is
/// unknown.
pub fn whole_pages(bytes: &[u8]) -> Option<std::ops::Range<usize>> {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        let start = bytes.as_ptr() as usize;
        let pages = start.checked_next_multiple_of(page)?..(start + bytes.len()) / page * page;
        (pages.end > pages.start).then_some(pages)
    }
    #[cfg(not(unix))]
    {
        let _ = bytes;
        None
    }
}

/// f16 values as the F16 row bytes the kernels take (little-endian, as GGUF stores them),
/// without a copy.
#[cfg(target_endian = "little")]
pub fn f16_bytes(v: &[half::f16]) -> &[u8] {
    // SAFETY: `f16` is a `repr(transparent)` u16: two bytes, no padding, every bit pattern a
    // valid u8 pair; u8 needs no alignment; the new length covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// [`dequantize_row`] resolved once for one type on [`Isa::best`], for callers that convert
/// many short rows (attention's value heads) where the per-call lookup would dominate.
#[derive(Clone, Copy)]
pub struct Dequantizer {
    ty: GgmlType,
    f: DequantFn,
}

impl Dequantizer {
    /// The dequantiser for `ty`; errors for types without one.
    pub fn new(ty: GgmlType) -> Result<Dequantizer, QuantError> {
        let f = kernels::dequantize_fn(Isa::best(), ty).ok_or(QuantError::Unsupported {
            ty,
            op: "dequantize",
        })?;
        Ok(Dequantizer { ty, f })
    }

    /// Dequantises `dst.len()` elements from `src`, bit-identical to [`dequantize_row`].
    ///
    /// # Panics
    /// If `src` is not exactly the blocks of `dst.len()` elements.
    #[inline]
    pub fn row(&self, src: &[u8], dst: &mut [f32]) {
        let (be, bb) = (self.ty.block_elems(), self.ty.block_bytes());
        assert!(
            dst.len().is_multiple_of(be) && src.len() == dst.len() / be * bb,
            "{} bytes are not the {} blocks of {} elements",
            src.len(),
            self.ty,
            dst.len()
        );
        // SAFETY: `Isa::best` is available on this CPU and `src` holds exactly the blocks of
        // `dst` (asserted above).
        unsafe { (self.f)(src, dst) }
    }
}

/// Quantises `src` into `dst` (exactly `ty.row_bytes(src.len())` bytes). Supports F32, F16,
/// BF16 (round to nearest even), the activation formats Q8_0, Q8_1 and Q8_K (bit-exact with
/// ggml's x86 quantisers), and MXFP4, Q4_0, Q4_1, Q5_0, Q5_1 (ggml's reference quantisers, for
/// writing test models). K-quant weights cannot be quantised here.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    quantize_row_with(Isa::best(), ty, src, dst)
}

/// [`quantize_row`] on a chosen ISA (all ISAs give identical bytes).
pub fn quantize_row_with(
    isa: Isa,
    ty: GgmlType,
    src: &[f32],
    dst: &mut [u8],
) -> Result<(), QuantError> {
    check_isa(isa)?;
    let f: QuantFn =
        kernels::quantize_fn(isa, ty).ok_or(QuantError::Unsupported { ty, op: "quantize" })?;
    check_len(ty, src.len(), dst.len())?;
    // SAFETY: `isa` is available on this CPU and `dst` holds exactly the blocks of `src`.
    unsafe { f(src, dst) };
    Ok(())
}

/// A resolved dot-product kernel for one weight type on one ISA: cheap to copy, `Send + Sync`,
/// call per row from any thread.
#[derive(Clone, Copy)]
pub struct DotKernel {
    weight: GgmlType,
    act: GgmlType,
    isa: Isa,
    name: &'static str,
    /// Elements per weight block (1 for float types).
    block: usize,
    w_block_bytes: usize,
    a_block_bytes: usize,
    dot: DotFn,
    rows: DotRowsFn,
}

impl std::fmt::Debug for DotKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DotKernel")
            .field("weight", &self.weight)
            .field("act", &self.act)
            .field("name", &self.name)
            .finish()
    }
}

impl DotKernel {
    /// The kernel for weights of type `weight` on `isa`; errors for unsupported types or an
    /// ISA this CPU lacks.
    pub fn new(weight: GgmlType, isa: Isa) -> Result<DotKernel, QuantError> {
        Self::resolve(weight, isa, true)
    }

    /// [`DotKernel::new`] with `allow_vnni = false` forcing the AVX-512 kernels that do not use
    /// VNNI (for tests on VNNI machines).
    fn resolve(weight: GgmlType, isa: Isa, allow_vnni: bool) -> Result<DotKernel, QuantError> {
        check_isa(isa)?;
        let fns = kernels::dot_fns(isa, weight, allow_vnni).ok_or(QuantError::Unsupported {
            ty: weight,
            op: "dot",
        })?;
        let act = vec_dot_type(weight);
        Ok(DotKernel {
            weight,
            act,
            isa,
            name: fns.name,
            block: weight.block_elems(),
            w_block_bytes: weight.block_bytes(),
            a_block_bytes: act.block_bytes(),
            dot: fns.dot,
            rows: fns.rows,
        })
    }

    /// The kernel for `weight` on [`Isa::best`].
    pub fn best(weight: GgmlType) -> Result<DotKernel, QuantError> {
        Self::new(weight, Isa::best())
    }

    /// The weight type.
    pub fn weight_type(&self) -> GgmlType {
        self.weight
    }

    /// The activation type ([`vec_dot_type`] of the weight type).
    pub fn act_type(&self) -> GgmlType {
        self.act
    }

    /// The ISA the kernel runs on.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// A name for logs, e.g. `mxfp4*q8_0/avx512vnni`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Bytes of one weight row of `n` elements (`n` a multiple of the block size).
    pub fn weight_row_bytes(&self, n: usize) -> usize {
        n / self.block * self.w_block_bytes
    }

    /// Bytes of one activation row of `n` elements (`n` a multiple of the block size).
    pub fn act_row_bytes(&self, n: usize) -> usize {
        n / self.block * self.a_block_bytes
    }

    /// Dot of one weight row (`n` elements, weight format) with one activation row (`n`
    /// elements, activation format).
    ///
    /// Lengths are the caller's contract (checked by `debug_assert`). In release builds a
    /// partial trailing block is ignored and a too-short slice panics; never undefined behaviour.
    #[inline]
    pub fn dot(&self, n: usize, weight_row: &[u8], act_row: &[u8]) -> f32 {
        debug_assert_eq!(n % self.block, 0, "{n} is not a multiple of the block size");
        let wb = self.weight_row_bytes(n);
        let ab = self.act_row_bytes(n);
        debug_assert_eq!(weight_row.len(), wb, "weight row length");
        debug_assert_eq!(act_row.len(), ab, "activation row length");
        let w = &weight_row[..wb];
        let a = &act_row[..ab];
        // SAFETY: the ISA was checked in `resolve`; `w` and `a` hold exactly
        // `n / block` blocks each (block-rounded `n` is passed).
        unsafe { (self.dot)(n / self.block * self.block, w, a) }
    }

    /// Dots `out.len()` weight rows (contiguous, `weight_row_bytes(n)` apart) with one activation
    /// row, writing one result per row. Bit-identical to calling [`DotKernel::dot`] per row; the
    /// SIMD kernels process several rows per pass so each activation block is loaded once.
    ///
    /// Same length contract as [`DotKernel::dot`]; `weight_rows` holds exactly `out.len()` rows.
    #[inline]
    pub fn dot_rows(&self, n: usize, weight_rows: &[u8], act_row: &[u8], out: &mut [f32]) {
        debug_assert_eq!(n % self.block, 0, "{n} is not a multiple of the block size");
        let rb = self.weight_row_bytes(n);
        let ab = self.act_row_bytes(n);
        let total = rb.saturating_mul(out.len());
        debug_assert_eq!(weight_rows.len(), total, "weight rows length");
        debug_assert_eq!(act_row.len(), ab, "activation row length");
        let w = &weight_rows[..total];
        let a = &act_row[..ab];
        // SAFETY: the ISA was checked in `resolve`; `w` holds `out.len()` rows of `rb` bytes and
        // `a` one activation row, all of `n / block` whole blocks.
        unsafe { (self.rows)(n / self.block * self.block, w, rb, a, out) }
    }
}
