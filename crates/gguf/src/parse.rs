//! Parsing one GGUF file held in a byte slice, with a bounds-checked cursor.
//!
//! Every count and length read from the file is checked against the bytes that remain *before*
//! anything is allocated, so hostile files cannot trigger huge allocations; every offset sum is
//! checked for overflow; nothing here indexes out of bounds or panics.

use std::collections::HashSet;

use crate::error::{GgufError, Result, TensorProblem};
use crate::meta::{MetaType, MetaValue, Metadata};
use crate::GgmlType;

/// The alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// The deepest nesting of arrays (an array of arrays has depth 2) the reader accepts.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// The most array elements all metadata values of one file may hold together. Each element
/// becomes a 32-byte [`MetaValue`], so without a limit a large hostile file of one-byte array
/// elements could make the reader allocate 32 times its size. Real files hold far fewer
/// (the o200k vocabulary: about 850 000).
pub const MAX_META_ELEMENTS: u64 = 1 << 26;

/// The most dimensions a tensor may have (ggml's limit).
pub const MAX_DIMS: usize = 4;

/// Smallest encoding of one metadata entry: key length (8), type (4), a 1-byte value.
const MIN_KV_BYTES: u64 = 13;
/// Smallest encoding of one tensor info: name length (8), n_dims (4), one dim (8), type (4),
/// offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 32;

/// One tensor of a model: its name, type, shape and where its data lies.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Shape in ggml `ne` order: `dims[0]` is the contiguous row length.
    pub dims: Vec<u64>,
    /// Product of the dims.
    pub n_elements: u64,
    /// Bytes of data.
    pub n_bytes: u64,
    /// Index of the shard file holding the data (0 for single files).
    pub shard: usize,
    /// Absolute byte offset of the data in its shard file.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of rows: `n_elements / dims[0]` (0 for a malformed, hand-built info).
    pub fn n_rows(&self) -> u64 {
        self.dims
            .first()
            .and_then(|&d0| self.n_elements.checked_div(d0))
            .unwrap_or(0)
    }

    /// Bytes of one row of `dims[0]` elements (0 for a malformed, hand-built info).
    pub fn row_bytes(&self) -> u64 {
        self.dims
            .first()
            .and_then(|&d0| self.ty.row_bytes(d0))
            .unwrap_or(0)
    }
}

/// Element count and byte size of a tensor of type `ty` and shape `dims`, with every rule
/// checked: 1..=4 dims, each > 0, no overflow (and at most i64::MAX elements, ggml's limit),
/// dims[0] a whole number of blocks.
pub(crate) fn tensor_size(
    ty: GgmlType,
    dims: &[u64],
) -> std::result::Result<(u64, u64), TensorProblem> {
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(TensorProblem::DimCount(
            u32::try_from(dims.len()).unwrap_or(u32::MAX),
        ));
    }
    if let Some(index) = dims.iter().position(|&d| d == 0) {
        return Err(TensorProblem::ZeroDim { index });
    }
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| TensorProblem::ElementCountOverflow {
            dims: dims.to_vec(),
        })?;
    let row = dims[0];
    let block = ty.block_elems();
    if !row.is_multiple_of(block as u64) {
        return Err(TensorProblem::RowNotBlockMultiple { ty, row, block });
    }
    let n_bytes = ty
        .row_bytes(row)
        .and_then(|rb| rb.checked_mul(n_elements / row))
        .ok_or_else(|| TensorProblem::ByteSizeOverflow {
            ty,
            dims: dims.to_vec(),
        })?;
    Ok((n_elements, n_bytes))
}

/// `value` rounded up to a multiple of `alignment` (a power of two), or `None` on overflow.
pub(crate) fn align_up(value: u64, alignment: u64) -> Option<u64> {
    let mask = alignment.checked_sub(1)?;
    value.checked_add(mask).map(|v| v & !mask)
}

/// Checks a `general.alignment` value: an unsigned integer, a nonzero power of two, ≤ 2^31.
pub(crate) fn check_alignment(value: &MetaValue) -> Result<u64> {
    match value.as_u64() {
        Some(a) if a.is_power_of_two() && a <= 1 << 31 => Ok(a),
        Some(a) => Err(GgufError::InvalidAlignment {
            value: a.to_string(),
        }),
        None => Err(GgufError::InvalidAlignment {
            value: format!("{value:?}"),
        }),
    }
}

/// A bounds-checked little-endian cursor over the file bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// How many more array elements the metadata may hold (see [`MAX_META_ELEMENTS`]).
    elements_left: u64,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader {
            buf,
            pos: 0,
            elements_left: MAX_META_ELEMENTS,
        }
    }

    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    /// The next `n` bytes; `what` describes the field for the error.
    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8]> {
        let available = self.remaining();
        if n > available {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.offset(),
                needed: n,
                available,
            });
        }
        // n <= remaining, so the conversion and the range are in bounds.
        let n = n as usize;
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: impl FnOnce() -> String) -> Result<[u8; N]> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count of items each at least `min_item_bytes` long, checked against the bytes left.
    fn count(&mut self, min_item_bytes: u64, what: impl Fn() -> String) -> Result<usize> {
        let offset = self.offset();
        let count = self.u64(&what)?;
        let available = self.remaining();
        if count > available / min_item_bytes {
            return Err(GgufError::CountTooLarge {
                what: what(),
                count,
                offset,
                min_item_bytes,
                available,
            });
        }
        // count <= remaining bytes <= usize::MAX.
        Ok(count as usize)
    }

    /// The raw bytes of a length-prefixed string.
    fn string_bytes(&mut self, what: impl Fn() -> String) -> Result<&'a [u8]> {
        let offset = self.offset();
        let len = self.u64(&what)?;
        let available = self.remaining();
        if len > available {
            return Err(GgufError::StringTooLong {
                what: what(),
                len,
                offset,
                available,
            });
        }
        self.take(len, what)
    }

    /// A string that must be valid UTF-8 (keys, tensor names).
    fn strict_str(&mut self, what: impl Fn() -> String) -> Result<&'a str> {
        let bytes = self.string_bytes(&what)?;
        std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
            what: what(),
            offset: self.offset() - bytes.len() as u64,
        })
    }

    /// A string value; invalid UTF-8 is replaced by U+FFFD.
    fn lossy_string(&mut self, what: impl Fn() -> String) -> Result<String> {
        let bytes = self.string_bytes(what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn meta_type(&mut self, key: &str) -> Result<MetaType> {
        let offset = self.offset();
        let id = self.u32(|| format!("value type of metadata '{key}'"))?;
        MetaType::from_id(id).ok_or_else(|| GgufError::UnknownMetaType {
            key: key.to_string(),
            type_id: id,
            offset,
        })
    }

    /// A value of type `ty` (not an array).
    fn scalar(&mut self, ty: MetaType, key: &str) -> Result<MetaValue> {
        let what = || format!("{ty:?} value of metadata '{key}'");
        Ok(match ty {
            MetaType::U8 => MetaValue::U8(u8::from_le_bytes(self.array(what)?)),
            MetaType::I8 => MetaValue::I8(i8::from_le_bytes(self.array(what)?)),
            MetaType::U16 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            MetaType::I16 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            MetaType::U32 => MetaValue::U32(u32::from_le_bytes(self.array(what)?)),
            MetaType::I32 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            MetaType::U64 => MetaValue::U64(u64::from_le_bytes(self.array(what)?)),
            MetaType::I64 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            MetaType::F32 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            MetaType::F64 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            MetaType::Bool => {
                let offset = self.offset();
                let [b] = self.array(what)?;
                bool_value(b, key, offset)?
            }
            MetaType::String => MetaValue::String(self.lossy_string(what)?),
            MetaType::Array => self.array_value(key, 1)?,
        })
    }

    /// An array (element type, count, elements) at nesting depth `depth` (1 = top level).
    fn array_value(&mut self, key: &str, depth: usize) -> Result<MetaValue> {
        let start = self.offset();
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep {
                key: key.to_string(),
                limit: MAX_ARRAY_DEPTH,
                offset: start,
            });
        }
        let ty = self.meta_type(key)?;
        let n = self.count(ty.min_size(), || {
            format!("array count of metadata '{key}' ({ty:?} elements)")
        })?;
        if n as u64 > self.elements_left {
            return Err(GgufError::MetadataTooLarge {
                key: key.to_string(),
                limit: MAX_META_ELEMENTS,
            });
        }
        self.elements_left -= n as u64;
        let mut items = Vec::with_capacity(n);
        match ty.fixed_size() {
            Some(size) => {
                let offset = self.offset();
                // n * size <= remaining: checked by count().
                let bytes = self.take((n * size) as u64, || {
                    format!("elements of metadata '{key}'")
                })?;
                for (i, chunk) in bytes.chunks_exact(size).enumerate() {
                    items.push(decode_fixed(ty, chunk, key, offset + (i * size) as u64)?);
                }
            }
            None if ty == MetaType::String => {
                for i in 0..n {
                    items.push(MetaValue::String(
                        self.lossy_string(|| format!("metadata '{key}'[{i}]"))?,
                    ));
                }
            }
            None => {
                for _ in 0..n {
                    items.push(self.array_value(key, depth + 1)?);
                }
            }
        }
        Ok(MetaValue::Array(ty, items))
    }
}

fn bool_value(b: u8, key: &str, offset: u64) -> Result<MetaValue> {
    match b {
        0 => Ok(MetaValue::Bool(false)),
        1 => Ok(MetaValue::Bool(true)),
        value => Err(GgufError::InvalidBool {
            key: key.to_string(),
            value,
            offset,
        }),
    }
}

/// Decodes one fixed-size value from exactly `ty.fixed_size()` bytes.
fn decode_fixed(ty: MetaType, b: &[u8], key: &str, offset: u64) -> Result<MetaValue> {
    fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&b[..N]);
        out
    }
    Ok(match ty {
        MetaType::U8 => MetaValue::U8(b[0]),
        MetaType::I8 => MetaValue::I8(b[0] as i8),
        MetaType::Bool => bool_value(b[0], key, offset)?,
        MetaType::U16 => MetaValue::U16(u16::from_le_bytes(arr(b))),
        MetaType::I16 => MetaValue::I16(i16::from_le_bytes(arr(b))),
        MetaType::U32 => MetaValue::U32(u32::from_le_bytes(arr(b))),
        MetaType::I32 => MetaValue::I32(i32::from_le_bytes(arr(b))),
        MetaType::F32 => MetaValue::F32(f32::from_le_bytes(arr(b))),
        MetaType::U64 => MetaValue::U64(u64::from_le_bytes(arr(b))),
        MetaType::I64 => MetaValue::I64(i64::from_le_bytes(arr(b))),
        MetaType::F64 => MetaValue::F64(f64::from_le_bytes(arr(b))),
        // Only called for fixed-size types.
        MetaType::String | MetaType::Array => {
            return Err(GgufError::UnknownMetaType {
                key: key.to_string(),
                type_id: ty.id(),
                offset,
            })
        }
    })
}

/// The parsed header of one GGUF file: version, metadata and tensor table, with every tensor's
/// data range checked to lie inside the file.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    /// GGUF version (2 or 3).
    pub version: u32,
    /// Alignment of the data section and of every tensor's data.
    pub alignment: u64,
    /// Metadata in file order.
    pub metadata: Metadata,
    /// Offset just past the tensor table (the header's size before the alignment padding).
    pub table_end: u64,
    /// Tensor table in file order (`shard` 0, absolute offsets).
    pub tensors: Vec<TensorInfo>,
    /// Absolute offset of the data section (the end of the tensor table rounded up to the
    /// alignment; may lie past the end of a file that has no tensors).
    pub data_offset: u64,
}

impl GgufHeader {
    /// Parses a whole GGUF file held in memory. The whole file is needed because every
    /// tensor's data range is checked against its length.
    pub fn parse(file: &[u8]) -> Result<GgufHeader> {
        let mut r = Reader::new(file);
        let magic: [u8; 4] = r.array(|| "magic".to_string())?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = r.u32(|| "version".to_string())?;
        if !matches!(version, 2 | 3) {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let n_tensors_offset = r.offset();
        let n_tensors = r.u64(|| "tensor count".to_string())?;
        let n_kv = r.count(MIN_KV_BYTES, || "metadata entry count".to_string())?;

        let mut metadata = Metadata::new();
        metadata.reserve(n_kv);
        for i in 0..n_kv {
            let key_offset = r.offset();
            let key = r.strict_str(|| format!("metadata key #{i}"))?;
            let ty = r.meta_type(key)?;
            let value = r.scalar(ty, key)?;
            if !metadata.push_new(key.to_string(), value) {
                return Err(GgufError::DuplicateKey {
                    key: key.to_string(),
                    offset: key_offset,
                });
            }
        }
        let alignment = match metadata.get("general.alignment") {
            Some(v) => check_alignment(v)?,
            None => DEFAULT_ALIGNMENT,
        };

        let n_tensors = check_tensor_count(n_tensors, n_tensors_offset, r.remaining())?;
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut names = HashSet::with_capacity(n_tensors);
        let mut info_offsets = Vec::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let info_offset = r.offset();
            let name = r.strict_str(|| format!("name of tensor #{i}"))?;
            let bad = |problem| GgufError::InvalidTensor {
                name: name.to_string(),
                offset: Some(info_offset),
                problem,
            };
            let n_dims = r.u32(|| format!("dimension count of tensor '{name}'"))?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                return Err(bad(TensorProblem::DimCount(n_dims)));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                dims.push(r.u64(|| format!("dims[{d}] of tensor '{name}'"))?);
            }
            let type_id = r.u32(|| format!("type of tensor '{name}'"))?;
            let ty = GgmlType::from_id(type_id)
                .ok_or_else(|| bad(TensorProblem::UnknownType(type_id)))?;
            let rel_offset = r.u64(|| format!("data offset of tensor '{name}'"))?;
            let (n_elements, n_bytes) = tensor_size(ty, &dims).map_err(bad)?;
            if !names.insert(name) {
                return Err(GgufError::DuplicateTensor {
                    name: name.to_string(),
                });
            }
            info_offsets.push(info_offset);
            tensors.push(TensorInfo {
                name: name.to_string(),
                ty,
                dims,
                n_elements,
                n_bytes,
                shard: 0,
                offset: rel_offset,
            });
        }

        let table_end = r.offset();
        let data_offset = align_up(table_end, alignment).unwrap_or(u64::MAX);
        let file_len = file.len() as u64;
        for (t, &info_offset) in tensors.iter_mut().zip(&info_offsets) {
            let rel = t.offset;
            let problem = if !rel.is_multiple_of(alignment) {
                Some(TensorProblem::Misaligned {
                    offset: rel,
                    alignment,
                })
            } else {
                match data_offset.checked_add(rel) {
                    Some(start) if start.checked_add(t.n_bytes).is_some_and(|e| e <= file_len) => {
                        t.offset = start;
                        None
                    }
                    start => Some(TensorProblem::OutOfBounds {
                        offset: rel,
                        start: start.unwrap_or(u64::MAX),
                        bytes: t.n_bytes,
                        file_len,
                    }),
                }
            };
            if let Some(problem) = problem {
                return Err(GgufError::InvalidTensor {
                    name: t.name.clone(),
                    offset: Some(info_offset),
                    problem,
                });
            }
        }
        Ok(GgufHeader {
            version,
            alignment,
            metadata,
            table_end,
            tensors,
            data_offset,
        })
    }
}

fn check_tensor_count(n_tensors: u64, offset: u64, available: u64) -> Result<usize> {
    if n_tensors > available / MIN_TENSOR_INFO_BYTES {
        return Err(GgufError::CountTooLarge {
            what: "tensor count".to_string(),
            count: n_tensors,
            offset,
            min_item_bytes: MIN_TENSOR_INFO_BYTES,
            available,
        });
    }
    Ok(n_tensors as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_up_works() {
        assert_eq!(align_up(0, 32), Some(0));
        assert_eq!(align_up(1, 32), Some(32));
        assert_eq!(align_up(64, 32), Some(64));
        assert_eq!(align_up(u64::MAX, 32), None);
        assert_eq!(align_up(5, 0), None);
    }

    #[test]
    fn tensor_size_rules() {
        assert_eq!(tensor_size(GgmlType::F32, &[3, 2]), Ok((6, 24)));
        assert_eq!(tensor_size(GgmlType::Q8_0, &[64, 2]), Ok((128, 136)));
        assert_eq!(
            tensor_size(GgmlType::F32, &[]),
            Err(TensorProblem::DimCount(0))
        );
        assert_eq!(
            tensor_size(GgmlType::F32, &[1, 1, 1, 1, 1]),
            Err(TensorProblem::DimCount(5))
        );
        assert_eq!(
            tensor_size(GgmlType::F32, &[4, 0]),
            Err(TensorProblem::ZeroDim { index: 1 })
        );
        assert!(matches!(
            tensor_size(GgmlType::F32, &[1 << 32, 1 << 32]),
            Err(TensorProblem::ElementCountOverflow { .. })
        ));
        assert!(matches!(
            tensor_size(GgmlType::F32, &[1 << 62]),
            Err(TensorProblem::ByteSizeOverflow { .. })
        ));
        assert!(matches!(
            tensor_size(GgmlType::Q4_K, &[128]),
            Err(TensorProblem::RowNotBlockMultiple { block: 256, .. })
        ));
    }

    #[test]
    fn alignment_values() {
        assert_eq!(check_alignment(&MetaValue::U32(64)).ok(), Some(64));
        assert_eq!(check_alignment(&MetaValue::U8(1)).ok(), Some(1));
        assert!(check_alignment(&MetaValue::U32(0)).is_err());
        assert!(check_alignment(&MetaValue::U32(48)).is_err());
        assert!(check_alignment(&MetaValue::U64(1 << 40)).is_err());
        assert!(check_alignment(&MetaValue::I32(-32)).is_err());
        assert!(check_alignment(&MetaValue::String("32".into())).is_err());
    }

    #[test]
    fn truncated_reads_are_errors() {
        let mut r = Reader::new(&[1, 2, 3]);
        assert!(r.u32(|| "x".into()).is_err());
        assert_eq!(r.take(3, || "y".into()).ok(), Some(&[1u8, 2, 3][..]));
        assert!(r.take(1, || "z".into()).is_err());
        assert_eq!(r.take(0, || "z".into()).ok(), Some(&[][..]));
    }
}
