//! K/V rings: how a ring stores its rows ([`KvLayout`]), a ring on a device ([`KvRing`]),
//! the K/V element types the contract knows ([`KV_TYPES`]), and the shape checks of row
//! ranges.

use std::ops::Range;

use hmoe_quant::GgmlType;

use crate::{error, Backend, BackendError};

/// The element types of K/V rings the contract knows (the CPU device's `-ctk`/`-ctv` types):
/// F32, F16, BF16 and the block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1. A device says which it
/// stores and attends over ([`Backend::kv_types`]).
pub const KV_TYPES: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
];

/// The bytes of `n` rows of a ring of `layout` from cell `cell0` on, or the shape error when
/// the ring does not hold them.
pub fn kv_rows_range(
    layout: &KvLayout,
    cell0: usize,
    n: usize,
) -> Result<Range<usize>, BackendError> {
    let rb = layout.row_bytes();
    match cell0.checked_add(n).filter(|&end| end <= layout.cells) {
        Some(end) => Ok(cell0 * rb..end * rb),
        None => Err(BackendError::Shape {
            op: "K/V rows",
            what: format!("{n} rows at cell {cell0} of a ring of {}", layout.cells),
        }),
    }
}

/// How many rows of `layout` `len` bytes are, or the shape error when they are not whole rows.
pub fn kv_row_count(layout: &KvLayout, len: usize) -> Result<usize, BackendError> {
    let rb = layout.row_bytes();
    error::ensure(rb > 0 && len.is_multiple_of(rb), "K/V rows", || {
        format!("{len} bytes are not whole rows of {rb} bytes")
    })?;
    Ok(len / rb)
}

/// How a K/V ring stores its rows: `cells` rows (position `p` in cell `p % cells`) of `width`
/// values of `ty`, each row in ggml's layout of the type (the block types: whole blocks),
/// Walsh–Hadamard rotated in chunks of `rot` values before it is converted (0: not rotated;
/// llama.cpp's rotation of block-quantized heads, see [`crate::numerics::fwht`]). A ring holds K or V
/// of a layer, or a K-only (latent) cache of any width that is whole blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Element type of the rows (one of [`KV_TYPES`]).
    pub ty: GgmlType,
    /// Values per row.
    pub width: usize,
    /// Rows in the ring.
    pub cells: usize,
    /// Rotation chunk (a power of two dividing `width`), or 0.
    pub rot: usize,
}

impl KvLayout {
    /// A layout, or the shape error when `ty` is not a K/V type, `width` is not whole blocks
    /// of it, or `rot` is not 0 or a power of two dividing `width`.
    pub fn new(
        ty: GgmlType,
        width: usize,
        cells: usize,
        rot: usize,
    ) -> Result<KvLayout, BackendError> {
        const OP: &str = "K/V ring";
        if !KV_TYPES.contains(&ty) {
            return Err(BackendError::UnsupportedType { ty, op: OP });
        }
        error::ensure(
            width > 0 && width.is_multiple_of(ty.block_elems()),
            OP,
            || format!("rows of {width} values are not whole {ty} blocks"),
        )?;
        error::ensure(
            rot == 0 || (rot.is_power_of_two() && width.is_multiple_of(rot)),
            OP,
            || format!("rotation chunks of {rot} for rows of {width}"),
        )?;
        Ok(KvLayout {
            ty,
            width,
            cells,
            rot,
        })
    }

    /// The rotation chunk of a ring of `ty` whose heads are `head` values long, as llama.cpp
    /// (and the CPU device's cache) rotates them: a block-quantized type (not f32, f16 or
    /// bf16) with heads a multiple of 64 long is rotated, keys (`key`) in chunks of the
    /// largest power of two dividing the head, values in chunks of 64; else 0.
    pub fn rotation(ty: GgmlType, head: usize, key: bool) -> usize {
        let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if float || !head.is_multiple_of(64) || (key && head == 0) {
            return 0;
        }
        match key {
            true => 1 << head.trailing_zeros(),
            false => 64,
        }
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.width / self.ty.block_elems() * self.ty.block_bytes()
    }

    /// Bytes of the ring.
    pub fn bytes(&self) -> usize {
        self.cells * self.row_bytes()
    }
}

/// A K/V ring on device `B`: its bytes and their [`KvLayout`].
pub struct KvRing<B: Backend + ?Sized> {
    /// The rows, [`KvLayout::bytes`] bytes.
    pub data: B::Buf<u8>,
    /// How they are stored.
    pub layout: KvLayout,
}
