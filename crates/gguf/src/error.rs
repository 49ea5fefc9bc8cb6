//! Errors of this crate. Every message names the field, offset, value and limit involved, and
//! errors raised while loading a file are wrapped in [`GgufError::InFile`] with its path.

use std::path::PathBuf;

use crate::GgmlType;

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, GgufError>;

/// Everything that can go wrong reading or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// An I/O operation on a file failed.
    #[error("cannot {op} {path}: {source}")]
    Io {
        /// What was being done (`open`, `map`, `read`, `write`, `create`).
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// `LoadOptions::mlock` was set and locking the file's pages in memory failed.
    #[error(
        "mlock of {bytes} bytes of {path} failed: {source} (raise the locked-memory limit, \
         e.g. `ulimit -l`, or load without mlock)"
    )]
    Mlock {
        /// The file whose data could not be locked.
        path: PathBuf,
        /// How many bytes were to be locked.
        bytes: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// An error found in a particular file (the inner error has the details).
    #[error("{}: {inner}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        inner: Box<GgufError>,
    },

    /// The data ends before a field does.
    #[error(
        "unexpected end of data reading {what} at offset {offset}: needs {needed} bytes, \
         only {available} left"
    )]
    Truncated {
        /// The field being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// Bytes it needs.
        needed: u64,
        /// Bytes left in the file from `offset`.
        available: u64,
    },

    /// The file does not start with `GGUF`.
    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },

    /// A GGUF version other than 2 or 3.
    #[error(
        "unsupported GGUF version {version}{}: only versions 2 and 3 are supported",
        version_hint(*version)
    )]
    UnsupportedVersion {
        /// The version field as read (little-endian).
        version: u32,
    },

    /// A count read from the file (metadata entries, tensors, array elements) cannot possibly
    /// fit in the bytes that remain, so it is rejected before anything is allocated.
    #[error(
        "{what} = {count} at offset {offset} is impossible: {count} items of at least \
         {min_item_bytes} bytes each do not fit in the {available} bytes left"
    )]
    CountTooLarge {
        /// Which count.
        what: String,
        /// Its value.
        count: u64,
        /// Where it was read.
        offset: u64,
        /// The smallest encoding of one item.
        min_item_bytes: u64,
        /// Bytes left after the count.
        available: u64,
    },

    /// A string length larger than the rest of the file.
    #[error("{what}: string length {len} at offset {offset} exceeds the {available} bytes left")]
    StringTooLong {
        /// Which string.
        what: String,
        /// The length read.
        len: u64,
        /// Where the length was read.
        offset: u64,
        /// Bytes left after the length.
        available: u64,
    },

    /// A metadata key or tensor name that is not valid UTF-8.
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// Which string.
        what: String,
        /// Where its bytes start.
        offset: u64,
    },

    /// A metadata value type id outside 0..=12.
    #[error(
        "metadata '{key}': unknown value type id {type_id} at offset {offset} (valid ids: 0..=12)"
    )]
    UnknownMetaType {
        /// The key whose value (or array element type) is bad.
        key: String,
        /// The id read.
        type_id: u32,
        /// Where it was read.
        offset: u64,
    },

    /// A bool stored as something other than 0 or 1.
    #[error("metadata '{key}': bool value {value} at offset {offset} is neither 0 nor 1")]
    InvalidBool {
        /// The key.
        key: String,
        /// The byte read.
        value: u8,
        /// Where it was read.
        offset: u64,
    },

    /// Arrays of arrays nested deeper than the limit.
    #[error("metadata '{key}': arrays nested deeper than {limit} levels at offset {offset}")]
    NestingTooDeep {
        /// The key.
        key: String,
        /// The limit ([`crate::MAX_ARRAY_DEPTH`]).
        limit: usize,
        /// Where the too-deep array starts.
        offset: u64,
    },

    /// The metadata arrays hold more elements in total than [`crate::MAX_META_ELEMENTS`].
    #[error(
        "metadata '{key}': the metadata arrays hold more than {limit} elements in total (limit)"
    )]
    MetadataTooLarge {
        /// The key whose array crossed the limit.
        key: String,
        /// The limit.
        limit: u64,
    },

    /// The same metadata key twice.
    #[error("duplicate metadata key '{key}' at offset {offset}")]
    DuplicateKey {
        /// The key.
        key: String,
        /// Where the second copy was read.
        offset: u64,
    },

    /// `general.alignment` is not a nonzero power of two that fits in a u32.
    #[error("invalid general.alignment {value}: must be a nonzero power of two of at most 2^31")]
    InvalidAlignment {
        /// The value as found (`3`, `String("x")`, ...).
        value: String,
    },

    /// A tensor table entry (or a tensor given to the writer) is invalid.
    #[error("tensor '{name}'{}: {problem}", at_offset(*offset))]
    InvalidTensor {
        /// The tensor name.
        name: String,
        /// Where its table entry starts, when read from a file.
        offset: Option<u64>,
        /// What is wrong.
        problem: TensorProblem,
    },

    /// Two tensors with the same name.
    #[error("duplicate tensor name '{name}'")]
    DuplicateTensor {
        /// The name.
        name: String,
    },

    /// A shard of a split model could not be found.
    #[error("split model: shard {shard} of {count} is missing: {} does not exist", path.display())]
    SplitShardMissing {
        /// The file that should hold it.
        path: PathBuf,
        /// 1-based shard number.
        shard: u32,
        /// Number of shards.
        count: u32,
    },

    /// The shards of a split model disagree with each other or with their file names.
    #[error("split model {}: {detail}", path.display())]
    Split {
        /// The shard in which the inconsistency was found.
        path: PathBuf,
        /// What is inconsistent.
        detail: String,
    },

    /// A metadata entry the writer cannot encode.
    #[error("metadata '{key}': {detail}")]
    InvalidMeta {
        /// The key.
        key: String,
        /// What is wrong.
        detail: String,
    },

    /// A bad argument to a writer method.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// What is wrong with one tensor (see [`GgufError::InvalidTensor`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorProblem {
    /// Not 1 to 4 dimensions.
    #[error("has {0} dimensions; must be 1 to 4")]
    DimCount(u32),
    /// A zero dimension.
    #[error("dims[{index}] is 0; every dimension must be > 0")]
    ZeroDim {
        /// Which dimension.
        index: usize,
    },
    /// The product of the dimensions overflows (or exceeds i64::MAX, ggml's limit).
    #[error("element count of dims {dims:?} overflows")]
    ElementCountOverflow {
        /// The dims.
        dims: Vec<u64>,
    },
    /// A type id this crate does not know.
    #[error("unknown ggml type id {0}")]
    UnknownType(u32),
    /// The row length is not a whole number of quantisation blocks.
    #[error("dims[0] = {row} is not a multiple of the {ty} block size {block}")]
    RowNotBlockMultiple {
        /// The type.
        ty: GgmlType,
        /// `dims[0]`.
        row: u64,
        /// Elements per block.
        block: usize,
    },
    /// The byte size overflows a u64.
    #[error("byte size of {ty} dims {dims:?} overflows")]
    ByteSizeOverflow {
        /// The type.
        ty: GgmlType,
        /// The dims.
        dims: Vec<u64>,
    },
    /// The data offset is not a multiple of the file's alignment.
    #[error("data offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned {
        /// Offset relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// The data does not fit in the file (or its end overflows).
    #[error(
        "data at relative offset {offset} ({bytes} bytes from absolute offset {start}) runs past \
         the end of the file ({file_len} bytes)"
    )]
    OutOfBounds {
        /// Offset relative to the data section.
        offset: u64,
        /// Absolute start (saturated on overflow).
        start: u64,
        /// Size of the data.
        bytes: u64,
        /// File length.
        file_len: u64,
    },
    /// Data given to the writer has the wrong size.
    #[error("data is {got} bytes but {ty} {dims:?} needs {expected}")]
    DataSize {
        /// The type.
        ty: GgmlType,
        /// The dims.
        dims: Vec<u64>,
        /// Bytes expected.
        expected: u64,
        /// Bytes given.
        got: u64,
    },
}

fn version_hint(version: u32) -> &'static str {
    match version {
        1 => " (GGUF v1 used 32-bit counts and lengths; convert the file with a current tool)",
        v if matches!(v.swap_bytes(), 2 | 3) => " (this looks like a big-endian GGUF file)",
        _ => "",
    }
}

fn at_offset(offset: Option<u64>) -> String {
    match offset {
        Some(o) => format!(" (tensor info at offset {o})"),
        None => String::new(),
    }
}

impl GgufError {
    /// Wraps `self` with the path of the file it concerns (unless it already names a file).
    pub(crate) fn in_file(self, path: &std::path::Path) -> GgufError {
        match self {
            e @ (GgufError::Io { .. }
            | GgufError::Mlock { .. }
            | GgufError::InFile { .. }
            | GgufError::SplitShardMissing { .. }
            | GgufError::Split { .. }) => e,
            e => GgufError::InFile {
                path: path.to_path_buf(),
                inner: Box::new(e),
            },
        }
    }

    /// The innermost error, looking through [`GgufError::InFile`] wrappers.
    pub fn innermost(&self) -> &GgufError {
        match self {
            GgufError::InFile { inner, .. } => inner.innermost(),
            e => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_problem() {
        let e = GgufError::Mlock {
            path: "/m/x.gguf".into(),
            bytes: 4096,
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        };
        let msg = e.to_string();
        assert!(
            msg.starts_with("mlock of 4096 bytes of /m/x.gguf failed: "),
            "{msg}"
        );
        assert!(msg.contains("ulimit -l"), "{msg}");

        let e = GgufError::UnsupportedVersion { version: 1 }.in_file("/m/x.gguf".as_ref());
        let msg = e.to_string();
        assert!(
            msg.starts_with("/m/x.gguf: unsupported GGUF version 1 (GGUF v1"),
            "{msg}"
        );
        assert!(matches!(
            e.innermost(),
            GgufError::UnsupportedVersion { version: 1 }
        ));
        // Errors that already name their file are not wrapped again.
        let e = e.in_file("/other".as_ref());
        assert!(e.to_string().starts_with("/m/x.gguf: "));

        let e = GgufError::InvalidTensor {
            name: "w".into(),
            offset: Some(99),
            problem: TensorProblem::UnknownType(77),
        };
        assert_eq!(
            e.to_string(),
            "tensor 'w' (tensor info at offset 99): unknown ggml type id 77"
        );
        assert_eq!(
            GgufError::BadMagic { found: *b"GGML" }.to_string(),
            "not a GGUF file: magic bytes are [47, 47, 4d, 4c], expected \"GGUF\" (47 47 55 46)"
        );
    }
}
