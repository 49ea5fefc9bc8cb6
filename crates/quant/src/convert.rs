//! Rows to and from f32: [`dequantize_row`], [`quantize_row`], [`Dequantizer`] and the f16 row
//! bytes.

use crate::dispatch::{dequantize_fn, quantize_fn};
use crate::error::check_isa;
use crate::error::check_len;
use crate::kernel_fns::{DequantFn, QuantFn};
use crate::{GgmlType, Isa, QuantError};

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
    let f: DequantFn = dequantize_fn(isa, ty).ok_or(QuantError::Unsupported {
        ty,
        op: "dequantize",
    })?;
    check_len(ty, dst.len(), src.len())?;
    // SAFETY: `isa` is available on this CPU and `src` holds exactly the blocks of `dst`.
    unsafe { f(src, dst) };
    Ok(())
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
        let f = dequantize_fn(Isa::best(), ty).ok_or(QuantError::Unsupported {
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
    let f: QuantFn = quantize_fn(isa, ty).ok_or(QuantError::Unsupported { ty, op: "quantize" })?;
    check_len(ty, src.len(), dst.len())?;
    // SAFETY: `isa` is available on this CPU and `dst` holds exactly the blocks of `src`.
    unsafe { f(src, dst) };
    Ok(())
}

/// f16 values as the F16 row bytes the kernels take (little-endian, as GGUF stores them),
/// without a copy.
#[cfg(target_endian = "little")]
pub fn f16_bytes(v: &[half::f16]) -> &[u8] {
    // SAFETY: `f16` is a `repr(transparent)` u16: two bytes, no padding, every bit pattern a
    // valid u8 pair; u8 needs no alignment; the new length covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
