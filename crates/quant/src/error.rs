//! The crate's error type, and the row-length checks that produce it.

use crate::{GgmlType, Isa};

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

/// Bytes of a row of `n` elements of `ty`, or the error for a partial block.
pub(crate) fn row_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let block = ty.block_elems();
    if !n.is_multiple_of(block) {
        return Err(QuantError::NotBlockMultiple { ty, n, block });
    }
    // n / block * block_bytes cannot overflow for a slice that exists in memory as f32s.
    Ok(n / block * ty.block_bytes())
}

/// `Ok` where `got` is the byte count of a `ty` row of `n` elements.
pub(crate) fn check_len(ty: GgmlType, n: usize, got: usize) -> Result<(), QuantError> {
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

/// `Ok` where this CPU can run `isa`, else [`QuantError::IsaUnavailable`].
pub(crate) fn check_isa(isa: Isa) -> Result<(), QuantError> {
    if isa.is_available() {
        Ok(())
    } else {
        Err(QuantError::IsaUnavailable(isa))
    }
}
