//! Writing GGUF v3 files, whole or split into shards laid out like llama-gguf-split output.

use std::collections::HashSet;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::{GgufError, Result, TensorProblem};
use crate::meta::{MetaValue, Metadata};
use crate::model::{split_path, GgufModel, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT};
use crate::parse::{align_up, check_alignment, tensor_size, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH};
use crate::GgmlType;

/// Key of the data alignment.
const KEY_ALIGNMENT: &str = "general.alignment";

struct WTensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: TensorBytes,
}

/// A tensor's data: bytes to write, or a hole of that many bytes (a sparse file region that
/// reads as zeros and takes no disk space: full-size layouts for planning without weights).
enum TensorBytes {
    Data(Vec<u8>),
    Hole(u64),
}

impl TensorBytes {
    fn len(&self) -> u64 {
        match self {
            TensorBytes::Data(d) => d.len() as u64,
            TensorBytes::Hole(n) => *n,
        }
    }
}

/// Builds a GGUF v3 file: metadata in insertion order, tensors in insertion order, each
/// tensor's data padded with zeros to the alignment (default 32).
pub struct GgufWriter {
    alignment: u64,
    metadata: Metadata,
    tensors: Vec<WTensor>,
    names: HashSet<String>,
}

impl Default for GgufWriter {
    fn default() -> GgufWriter {
        GgufWriter::new()
    }
}

impl std::fmt::Debug for GgufWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufWriter")
            .field("alignment", &self.alignment)
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Counts bytes written through it, so that padding can be computed while streaming.
struct Counting<W> {
    inner: W,
    written: u64,
}

impl<W: Write + Seek> Counting<W> {
    /// Leaves `n` bytes unwritten (a hole; the file length is fixed at the end).
    fn skip(&mut self, n: u64) -> std::io::Result<()> {
        let n_i64 = i64::try_from(n).map_err(std::io::Error::other)?;
        self.inner.seek(SeekFrom::Current(n_i64))?;
        self.written += n;
        Ok(())
    }
}

impl<W: Write> Counting<W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.inner.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, alignment: u64) -> std::io::Result<()> {
        let target = align_up(self.written, alignment).unwrap_or(self.written);
        let zeros = [0u8; 64];
        while self.written < target {
            let n = (target - self.written).min(zeros.len() as u64) as usize;
            self.put(&zeros[..n])?;
        }
        Ok(())
    }

    fn string(&mut self, s: &str) -> std::io::Result<()> {
        self.put(&(s.len() as u64).to_le_bytes())?;
        self.put(s.as_bytes())
    }
}

fn encode_value<W: Write>(out: &mut Counting<W>, value: &MetaValue) -> std::io::Result<()> {
    match value {
        MetaValue::U8(v) => out.put(&v.to_le_bytes()),
        MetaValue::I8(v) => out.put(&v.to_le_bytes()),
        MetaValue::U16(v) => out.put(&v.to_le_bytes()),
        MetaValue::I16(v) => out.put(&v.to_le_bytes()),
        MetaValue::U32(v) => out.put(&v.to_le_bytes()),
        MetaValue::I32(v) => out.put(&v.to_le_bytes()),
        MetaValue::U64(v) => out.put(&v.to_le_bytes()),
        MetaValue::I64(v) => out.put(&v.to_le_bytes()),
        MetaValue::F32(v) => out.put(&v.to_le_bytes()),
        MetaValue::F64(v) => out.put(&v.to_le_bytes()),
        MetaValue::Bool(v) => out.put(&[u8::from(*v)]),
        MetaValue::String(s) => out.string(s),
        MetaValue::Array(ty, items) => {
            out.put(&ty.id().to_le_bytes())?;
            out.put(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|item| encode_value(out, item))
        }
    }
}

/// Checks that every array holds only elements of its declared type and that arrays nest no
/// deeper than the reader accepts.
fn check_value(key: &str, value: &MetaValue, depth: usize) -> Result<()> {
    let MetaValue::Array(ty, items) = value else {
        return Ok(());
    };
    if depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::InvalidMeta {
            key: key.to_string(),
            detail: format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
        });
    }
    for (i, item) in items.iter().enumerate() {
        if item.meta_type() != *ty {
            return Err(GgufError::InvalidMeta {
                key: key.to_string(),
                detail: format!(
                    "array declared with {ty:?} elements holds a {:?} at index {i}",
                    item.meta_type()
                ),
            });
        }
        check_value(key, item, depth + 1)?;
    }
    Ok(())
}

impl GgufWriter {
    /// An empty writer (version 3, alignment 32).
    pub fn new() -> GgufWriter {
        GgufWriter {
            alignment: DEFAULT_ALIGNMENT,
            metadata: Metadata::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
        }
    }

    /// A writer holding a copy of `model`'s metadata (less the `split.*` keys) and of all its
    /// tensors, in order, with its alignment.
    pub fn from_model(model: &GgufModel) -> Result<GgufWriter> {
        let mut w = GgufWriter::new();
        for (k, v) in model.metadata().iter() {
            if ![KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT].contains(&k) {
                w.add_meta(k, v.clone());
            }
        }
        w.alignment = model.alignment();
        for t in model.tensors() {
            w.add_tensor(t.name.clone(), t.ty, &t.dims, model.data_of(t).to_vec())?;
        }
        Ok(w)
    }

    /// Sets the data alignment (a nonzero power of two, checked when writing). A value other
    /// than 32 is also stored as `general.alignment` (u32); setting 32 updates an existing
    /// `general.alignment` entry instead of adding one.
    pub fn set_alignment(&mut self, alignment: u64) {
        self.alignment = alignment;
        let stored = u32::try_from(alignment).unwrap_or(u32::MAX);
        if alignment != DEFAULT_ALIGNMENT || self.metadata.contains_key(KEY_ALIGNMENT) {
            self.metadata.insert(KEY_ALIGNMENT, MetaValue::U32(stored));
        }
    }

    /// The data alignment.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Sets a metadata entry: replaces the value of an existing key in place, otherwise appends.
    /// Setting `general.alignment` to an integer also sets the data alignment.
    pub fn add_meta(&mut self, key: impl Into<String>, value: MetaValue) {
        let key = key.into();
        if key == KEY_ALIGNMENT {
            if let Some(a) = value.as_u64() {
                self.alignment = a;
            }
        }
        self.metadata.insert(key, value);
    }

    /// Removes a metadata entry, returning its value.
    pub fn remove_meta(&mut self, key: &str) -> Option<MetaValue> {
        if key == KEY_ALIGNMENT {
            self.alignment = DEFAULT_ALIGNMENT;
        }
        self.metadata.remove(key)
    }

    /// The metadata so far.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Number of tensors so far.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// Adds a tensor with shape `dims` (ggml order, `dims[0]` = row length). Checks the shape
    /// (1 to 4 dims, each > 0, row a whole number of blocks), that `data` has exactly the
    /// size of that many rows of `ty`, and that the name is new.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
        data: Vec<u8>,
    ) -> Result<()> {
        self.push_tensor(name.into(), ty, dims, TensorBytes::Data(data))
    }

    /// Adds a tensor whose data is left as a hole in the file (reads as zeros, uses no disk):
    /// the real tensor table of a large model, for planning and inspection without weights.
    pub fn add_tensor_hole(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
    ) -> Result<()> {
        let name = name.into();
        let (_, n_bytes) = tensor_size(ty, dims).map_err(|problem| GgufError::InvalidTensor {
            name: name.clone(),
            offset: None,
            problem,
        })?;
        self.push_tensor(name, ty, dims, TensorBytes::Hole(n_bytes))
    }

    fn push_tensor(
        &mut self,
        name: String,
        ty: GgmlType,
        dims: &[u64],
        data: TensorBytes,
    ) -> Result<()> {
        let bad = |name: &str, problem| GgufError::InvalidTensor {
            name: name.to_string(),
            offset: None,
            problem,
        };
        let (_, n_bytes) = tensor_size(ty, dims).map_err(|p| bad(&name, p))?;
        if data.len() != n_bytes {
            return Err(bad(
                &name,
                TensorProblem::DataSize {
                    ty,
                    dims: dims.to_vec(),
                    expected: n_bytes,
                    got: data.len(),
                },
            ));
        }
        if self.names.contains(&name) {
            return Err(GgufError::DuplicateTensor { name });
        }
        self.names.insert(name.clone());
        self.tensors.push(WTensor {
            name,
            ty,
            dims: dims.to_vec(),
            data,
        });
        Ok(())
    }

    /// Checks what `add_meta`/`set_alignment` could not: the alignment and array contents.
    fn validate(&self) -> Result<()> {
        let alignment = check_alignment(&MetaValue::U64(self.alignment))?;
        if let Some(v) = self.metadata.get(KEY_ALIGNMENT) {
            if check_alignment(v)? != alignment {
                return Err(GgufError::InvalidAlignment {
                    value: format!("{v:?} (the writer's alignment is {alignment})"),
                });
            }
        }
        self.metadata
            .iter()
            .try_for_each(|(k, v)| check_value(k, v, 0))
    }

    /// Writes one file with the given metadata entries and tensors; returns its length.
    fn encode<W: Write + Seek>(
        &self,
        out: W,
        meta: &[(&str, &MetaValue)],
        tensors: &[WTensor],
    ) -> std::io::Result<u64> {
        let mut out = Counting {
            inner: out,
            written: 0,
        };
        out.put(b"GGUF")?;
        out.put(&3u32.to_le_bytes())?;
        out.put(&(tensors.len() as u64).to_le_bytes())?;
        out.put(&(meta.len() as u64).to_le_bytes())?;
        for (k, v) in meta {
            out.string(k)?;
            out.put(&v.meta_type().id().to_le_bytes())?;
            encode_value(&mut out, v)?;
        }
        let mut offset = 0u64;
        for t in tensors {
            out.string(&t.name)?;
            out.put(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                out.put(&d.to_le_bytes())?;
            }
            out.put(&t.ty.id().to_le_bytes())?;
            out.put(&offset.to_le_bytes())?;
            offset = align_up(offset + t.data.len(), self.alignment).unwrap_or(u64::MAX);
        }
        out.pad_to(self.alignment)?;
        for t in tensors {
            match &t.data {
                TensorBytes::Data(d) => out.put(d)?,
                TensorBytes::Hole(n) => out.skip(*n)?,
            }
            out.pad_to(self.alignment)?;
        }
        out.inner.flush()?;
        Ok(out.written)
    }

    fn all_meta(&self) -> Vec<(&str, &MetaValue)> {
        self.metadata.iter().collect()
    }

    /// The whole file in memory.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.validate()?;
        let mut buf = std::io::Cursor::new(Vec::new());
        let len = self
            .encode(&mut buf, &self.all_meta(), &self.tensors)
            .map_err(|e| GgufError::InvalidArgument(format!("writing to memory failed: {e}")))?;
        let mut bytes = buf.into_inner();
        bytes.resize(len as usize, 0);
        Ok(bytes)
    }

    /// Writes the file to `path` (streamed, without building it in memory).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        self.validate()?;
        write_file(path.as_ref(), |w| {
            self.encode(w, &self.all_meta(), &self.tensors)
        })
    }

    /// Writes a split model: files `PREFIX-00001-of-0000N.gguf` … with at most
    /// `max_tensors_per_shard` tensors each, laid out like llama-gguf-split output: the first
    /// shard carries all metadata (less any old `split.*` keys) followed by `split.no` (u16),
    /// `split.tensors.count` (i32) and `split.count` (u16); the others carry only these three
    /// keys (after `general.alignment` when it is not 32). With no tensors one shard is written.
    /// Returns the paths in order.
    pub fn write_split(
        &self,
        prefix: impl AsRef<Path>,
        max_tensors_per_shard: usize,
    ) -> Result<Vec<PathBuf>> {
        self.validate()?;
        if max_tensors_per_shard == 0 {
            return Err(GgufError::InvalidArgument(
                "write_split: max_tensors_per_shard must be at least 1".to_string(),
            ));
        }
        let chunks: Vec<&[WTensor]> = if self.tensors.is_empty() {
            vec![&[]]
        } else {
            self.tensors.chunks(max_tensors_per_shard).collect()
        };
        let count = u16::try_from(chunks.len()).map_err(|_| {
            GgufError::InvalidArgument(format!(
                "write_split: {} shards needed but split.count is a u16",
                chunks.len()
            ))
        })?;
        let total = i32::try_from(self.tensors.len()).map_err(|_| {
            GgufError::InvalidArgument(format!(
                "write_split: {} tensors do not fit split.tensors.count (i32)",
                self.tensors.len()
            ))
        })?;
        let split_keys = [KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT];
        let total_value = MetaValue::I32(total);
        let count_value = MetaValue::U16(count);
        let alignment_value = self.metadata.get(KEY_ALIGNMENT);
        let mut paths = Vec::with_capacity(chunks.len());
        for (i, tensors) in chunks.into_iter().enumerate() {
            let no_value = MetaValue::U16(i as u16);
            let mut meta: Vec<(&str, &MetaValue)> = if i == 0 {
                self.metadata
                    .iter()
                    .filter(|(k, _)| !split_keys.contains(k))
                    .collect()
            } else {
                alignment_value
                    .filter(|_| self.alignment != DEFAULT_ALIGNMENT)
                    .map(|v| (KEY_ALIGNMENT, v))
                    .into_iter()
                    .collect()
            };
            meta.push((KEY_SPLIT_NO, &no_value));
            meta.push((KEY_SPLIT_TENSORS_COUNT, &total_value));
            meta.push((KEY_SPLIT_COUNT, &count_value));
            let path = split_path(prefix.as_ref(), i as u32 + 1, u32::from(count));
            write_file(&path, |w| self.encode(w, &meta, tensors))?;
            paths.push(path);
        }
        Ok(paths)
    }
}

fn write_file(
    path: &Path,
    f: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<u64>,
) -> Result<()> {
    let io = |op, source| GgufError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::create(path).map_err(|e| io("create", e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let len = f(&mut w).map_err(|e| io("write", e))?;
    let file = w.into_inner().map_err(|e| io("write", e.into_error()))?;
    // A trailing hole is not written: give the file its full length.
    file.set_len(len).map_err(|e| io("extend", e))?;
    file.sync_all().map_err(|e| io("sync", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::MetaType;

    #[test]
    fn add_tensor_checks() {
        let mut w = GgufWriter::new();
        assert!(w
            .add_tensor("a", GgmlType::F32, &[2, 3], vec![0; 24])
            .is_ok());
        let e = w
            .add_tensor("a", GgmlType::F32, &[1], vec![0; 4])
            .unwrap_err();
        assert!(matches!(e, GgufError::DuplicateTensor { .. }), "{e}");
        let e = w
            .add_tensor("b", GgmlType::F32, &[2, 3], vec![0; 20])
            .unwrap_err();
        assert!(e.to_string().contains("data is 20 bytes"), "{e}");
        let e = w
            .add_tensor("c", GgmlType::Q8_0, &[16], vec![0; 17])
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("not a multiple of the Q8_0 block size 32"),
            "{e}"
        );
        let e = w
            .add_tensor("d", GgmlType::F32, &[1, 1, 1, 1, 1], vec![0; 4])
            .unwrap_err();
        assert!(e.to_string().contains("5 dimensions"), "{e}");
        let e = w.add_tensor("e", GgmlType::F32, &[0], vec![]).unwrap_err();
        assert!(e.to_string().contains("dims[0] is 0"), "{e}");
        assert_eq!(w.tensor_count(), 1);
    }

    #[test]
    fn invalid_writer_state_is_an_error() {
        let mut w = GgufWriter::new();
        w.set_alignment(24);
        assert!(w
            .to_bytes()
            .unwrap_err()
            .to_string()
            .contains("general.alignment"));
        w.set_alignment(64);
        assert!(w.to_bytes().is_ok());
        w.add_meta("general.alignment", MetaValue::String("x".into()));
        assert!(w.to_bytes().is_err());
        w.remove_meta("general.alignment");
        w.add_meta(
            "bad",
            MetaValue::Array(MetaType::U8, vec![MetaValue::U16(1)]),
        );
        let e = w.to_bytes().unwrap_err().to_string();
        assert!(e.contains("'bad'") && e.contains("index 0"), "{e}");
        let mut deep = MetaValue::Array(MetaType::U8, vec![]);
        for _ in 0..MAX_ARRAY_DEPTH {
            deep = MetaValue::Array(MetaType::Array, vec![deep]);
        }
        w.add_meta("bad", deep);
        assert!(w.to_bytes().unwrap_err().to_string().contains("nested"));
        assert!(w.write_split("/nonexistent/x", 0).is_err());
    }
}
