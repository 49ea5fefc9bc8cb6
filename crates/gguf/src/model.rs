//! A loaded model: one GGUF file or every shard of a split set, memory-mapped (or read into
//! memory), with the tensor table of all shards and zero-copy access to tensor data.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{GgufError, Result};
use crate::meta::Metadata;
use crate::parse::{GgufHeader, TensorInfo};

/// Metadata key: number of shards of a split model (u16).
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// Metadata key: 0-based index of this shard (u16).
pub const KEY_SPLIT_NO: &str = "split.no";
/// Metadata key: number of tensors in all shards together (i32).
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// Smallest possible GGUF file: magic, version, tensor count, metadata count.
const MIN_FILE_BYTES: u64 = 24;

/// How to load a model's files.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// Memory-map the files (default). When false, each file is read into a heap buffer.
    pub use_mmap: bool,
    /// Lock the file data in RAM with `mlock(2)` so it cannot be paged out (default off).
    /// If locking fails (typically `RLIMIT_MEMLOCK`, see `ulimit -l`), loading fails with
    /// [`GgufError::Mlock`], which names the file, the size and the OS error.
    pub mlock: bool,
    /// Fault every page of a mapped file in while loading (`MAP_POPULATE`, default off), so
    /// that the first use of each expert does not stop on a page fault. Loading then reads the
    /// whole file; llama.cpp does this by default. `hmoe bench` turns it on so that its first
    /// test is not slower than the rest.
    pub populate: bool,
}

impl Default for LoadOptions {
    fn default() -> LoadOptions {
        LoadOptions {
            use_mmap: true,
            mlock: false,
            populate: false,
        }
    }
}

/// The bytes of one file.
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

/// One file of a model and whether its heap buffer was locked with mlock.
struct Shard {
    bytes: Bytes,
    locked_heap: bool,
    /// Whether its pages were locked (mapping or buffer): then they are never released.
    locked: bool,
}

impl Shard {
    fn data(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }

    fn load(path: &Path, opts: LoadOptions) -> Result<Shard> {
        let io = |op, source| GgufError::Io {
            op,
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(|e| io("open", e))?;
        let len = file.metadata().map_err(|e| io("stat", e))?.len();
        if len < MIN_FILE_BYTES {
            return Err(GgufError::Truncated {
                what: "GGUF header".to_string(),
                offset: 0,
                needed: MIN_FILE_BYTES,
                available: len,
            }
            .in_file(path));
        }
        let mut shard = if opts.use_mmap {
            // SAFETY: the mapping is read-only and private to this process. Rust's aliasing
            // rules are only upheld while no other process truncates or rewrites the file;
            // like every mmap-based model loader we require model files not to be modified
            // while they are loaded (a truncation would raise SIGBUS on access).
            let mut options = memmap2::MmapOptions::new();
            if opts.populate {
                options.populate();
            }
            let map = unsafe { options.map(&file) }.map_err(|e| io("map", e))?;
            Shard {
                bytes: Bytes::Mapped(map),
                locked_heap: false,
                locked: false,
            }
        } else {
            let mut bytes = Vec::new();
            bytes
                .try_reserve_exact(len as usize)
                .map_err(|e| io("read", std::io::Error::other(e)))?;
            (&file).read_to_end(&mut bytes).map_err(|e| io("read", e))?;
            Shard {
                bytes: Bytes::Owned(bytes),
                locked_heap: false,
                locked: false,
            }
        };
        if opts.mlock {
            shard.lock().map_err(|source| GgufError::Mlock {
                path: path.to_path_buf(),
                bytes: shard.data().len() as u64,
                source,
            })?;
        }
        Ok(shard)
    }

    fn lock(&mut self) -> std::io::Result<()> {
        self.locked = true;
        match &self.bytes {
            Bytes::Mapped(m) => m.lock(),
            Bytes::Owned(v) => {
                if v.is_empty() {
                    return Ok(());
                }
                // SAFETY: the pointer and length describe the live heap buffer owned by this
                // shard; mlock only changes the pages' residency, never their contents, and the
                // buffer is never reallocated while locked (it is immutable after loading).
                let rc = unsafe { libc::mlock(v.as_ptr().cast(), v.len()) };
                if rc != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                self.locked_heap = true;
                Ok(())
            }
        }
    }
}

impl Shard {
    /// Gives back this process's hold on the whole pages of `part`, a slice of this shard's
    /// unlocked mapping (anything else is left alone): its resident size drops by them, and a
    /// later read faults the same bytes back in from the page cache or the file.
    fn release(&self, part: &[u8]) {
        let Bytes::Mapped(m) = &self.bytes else {
            return;
        };
        let (base, start) = (m.as_ptr() as usize, part.as_ptr() as usize);
        if self.locked || start < base || start + part.len() > base + m.len() {
            return;
        }
        if let Some(pages) = hmoe_quant::whole_pages(part) {
            // SAFETY: `pages` lies inside the mapping, which is read-only and private: no
            // page of it was ever written, so dropping the process's pages loses nothing, and
            // every reference into it stays valid (a read faults the file's bytes back in).
            let _ = unsafe {
                m.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    pages.start - base,
                    pages.len(),
                )
            };
        }
    }
}

impl AsRef<[u8]> for Shard {
    fn as_ref(&self) -> &[u8] {
        self.data()
    }
}

impl Drop for Shard {
    fn drop(&mut self) {
        // Mapped pages are unlocked by munmap; heap pages must be unlocked explicitly because
        // freeing the buffer does not unmap them.
        if let (true, Bytes::Owned(v)) = (self.locked_heap, &self.bytes) {
            // SAFETY: same buffer and length as the successful mlock in `lock`, still alive.
            // A failure here cannot be reported from drop and leaves pages merely locked.
            unsafe { libc::munlock(v.as_ptr().cast(), v.len()) };
        }
    }
}

/// Something that holds bytes in place for as long as it lives (a file's mapping or buffer).
pub type SharedOwner = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Gives back the pages of a slice of a mapped file ([`GgufModel::page_releaser`]).
pub type PageReleaser = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// A tensor's bytes with their owner: `owner.as_ref()[range]` ([`GgufModel::shared_data_of`]).
pub type SharedData = (SharedOwner, std::ops::Range<usize>);

/// A model: one GGUF file, or all shards of a split set, with the tensor table of every shard
/// and zero-copy access to tensor data.
pub struct GgufModel {
    version: u32,
    alignment: u64,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    shards: Vec<Arc<Shard>>,
    paths: Vec<PathBuf>,
}

impl std::fmt::Debug for GgufModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufModel")
            .field("version", &self.version)
            .field("architecture", &self.metadata.architecture())
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("shard_paths", &self.paths)
            .finish()
    }
}

/// Parses the file name of a split shard, `PREFIX-0000k-of-0000N.gguf` (at least five digits
/// each, as written by llama-gguf-split): `Some((prefix, k, n))`.
fn parse_split_name(name: &str) -> Option<(&str, u32, u32)> {
    let stem = name.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = head.rsplit_once('-')?;
    let parse = |digits: &str| -> Option<u32> {
        if digits.len() < 5 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let v: u32 = digits.parse().ok()?;
        (format!("{v:05}") == digits).then_some(v)
    };
    Some((prefix, parse(no)?, parse(count)?))
}

/// The path of shard `no` (1-based) of `count` for a split prefix (`dir/model`).
pub fn split_path(prefix: &Path, no: u32, count: u32) -> PathBuf {
    let mut name = prefix.as_os_str().to_owned();
    name.push(format!("-{no:05}-of-{count:05}.gguf"));
    PathBuf::from(name)
}

/// If `path`'s file name has the split-shard form `PREFIX-0000k-of-0000N.gguf`, the paths of
/// all N shards in order (`Ok(None)` for any other name). A name with k = 0, N = 0 or k > N is
/// an error. Does not touch the file system.
pub fn split_shard_paths(path: &Path) -> Result<Option<Vec<PathBuf>>> {
    Ok(split_siblings(path)?.map(|(paths, _)| paths))
}

/// Like [`split_shard_paths`], also giving the 0-based index of `path` among the shards.
fn split_siblings(path: &Path) -> Result<Option<(Vec<PathBuf>, usize)>> {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return Ok(None);
    };
    let Some((prefix, no, count)) = parse_split_name(name) else {
        return Ok(None);
    };
    if no == 0 || count == 0 || no > count || count > u32::from(u16::MAX) {
        return Err(GgufError::Split {
            path: path.to_path_buf(),
            detail: format!(
                "file name says shard {no} of {count}, which is impossible (1 <= shard <= count \
                 <= 65535)"
            ),
        });
    }
    let prefix = path.with_file_name(prefix);
    let paths = (1..=count).map(|k| split_path(&prefix, k, count)).collect();
    Ok(Some((paths, no as usize - 1)))
}

/// Reads an integer split key of a shard's metadata (`None` when absent).
fn split_key(meta: &Metadata, key: &str, path: &Path) -> Result<Option<u64>> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| GgufError::Split {
            path: path.to_path_buf(),
            detail: format!("{key} is {v:?}, expected a non-negative integer"),
        }),
    }
}

impl GgufModel {
    /// Opens a GGUF file. If its metadata says it is shard k of a split model
    /// (`split.count` > 1), every shard `PREFIX-0000i-of-0000N.gguf` beside it is opened too,
    /// whichever shard was named, and the shards are checked against each other: `split.count`
    /// equal everywhere, `split.no` equal to the position, `split.tensors.count` (when present)
    /// equal everywhere and to the total number of tensors, no duplicate tensor names.
    /// A missing shard is a [`GgufError::SplitShardMissing`] naming the file.
    pub fn open(path: impl AsRef<Path>, opts: LoadOptions) -> Result<GgufModel> {
        let path = path.as_ref();
        let (shard, header) = load_and_parse(path, opts)?;
        let count = split_key(&header.metadata, KEY_SPLIT_COUNT, path)?.unwrap_or(1);
        let no = split_key(&header.metadata, KEY_SPLIT_NO, path)?.unwrap_or(0);
        if count <= 1 {
            if no != 0 {
                return Err(GgufError::Split {
                    path: path.to_path_buf(),
                    detail: format!("split.no is {no} but split.count is {count}"),
                });
            }
            let mut model = GgufModel::empty(header.version, header.alignment, header.metadata);
            model.add_shard(shard, header.tensors, path.to_path_buf())?;
            return Ok(model);
        }
        let split_err = |detail: String| GgufError::Split {
            path: path.to_path_buf(),
            detail,
        };
        let (mut paths, own_index) = split_siblings(path)?.ok_or_else(|| {
            split_err(format!(
                "metadata says split.count = {count} but the file name does not have the form \
                 PREFIX-0000k-of-0000N.gguf, so the other shards cannot be found"
            ))
        })?;
        if paths.len() as u64 != count {
            return Err(split_err(format!(
                "file name says {} shards but split.count = {count}",
                paths.len()
            )));
        }
        if own_index as u64 != no {
            return Err(split_err(format!(
                "file name says shard {} but split.no = {no} (shard {})",
                own_index + 1,
                no + 1
            )));
        }
        // Keep the caller's spelling of the path it named.
        paths[own_index] = path.to_path_buf();
        let count_u32 = paths.len() as u32;
        let mut loaded: Vec<Option<(Shard, GgufHeader)>> = (0..paths.len()).map(|_| None).collect();
        loaded[own_index] = Some((shard, header));
        for (i, p) in paths.iter().enumerate() {
            if loaded[i].is_none() {
                if !p.exists() {
                    return Err(GgufError::SplitShardMissing {
                        path: p.clone(),
                        shard: i as u32 + 1,
                        count: count_u32,
                    });
                }
                loaded[i] = Some(load_and_parse(p, opts)?);
            }
        }
        let mut model: Option<GgufModel> = None;
        let mut declared_total: Option<u64> = None;
        for (i, (slot, p)) in loaded.into_iter().zip(&paths).enumerate() {
            let Some((shard, header)) = slot else {
                continue;
            };
            let shard_err = |detail: String| GgufError::Split {
                path: p.clone(),
                detail,
            };
            let c = split_key(&header.metadata, KEY_SPLIT_COUNT, p)?;
            if c != Some(count) {
                return Err(shard_err(format!(
                    "split.count is {} but {} says {count}",
                    show(c),
                    path.display()
                )));
            }
            let n = split_key(&header.metadata, KEY_SPLIT_NO, p)?;
            if n != Some(i as u64) {
                return Err(shard_err(format!(
                    "split.no is {} but this is shard {} (expected split.no = {i})",
                    show(n),
                    i + 1
                )));
            }
            let total = split_key(&header.metadata, KEY_SPLIT_TENSORS_COUNT, p)?;
            if i == 0 {
                declared_total = total;
            } else if total.is_some() && total != declared_total {
                return Err(shard_err(format!(
                    "split.tensors.count is {} but shard 1 says {}",
                    show(total),
                    show(declared_total)
                )));
            }
            let m = match &mut model {
                Some(m) => m,
                None => model.insert(GgufModel::empty(
                    header.version,
                    header.alignment,
                    header.metadata,
                )),
            };
            m.add_shard(shard, header.tensors, p.clone())?;
        }
        let model = model.ok_or_else(|| split_err("no shards".to_string()))?;
        if let Some(total) = declared_total {
            if total != model.tensors.len() as u64 {
                return Err(GgufError::Split {
                    path: paths[0].clone(),
                    detail: format!(
                        "split.tensors.count = {total} but the {count} shards hold {} tensors",
                        model.tensors.len()
                    ),
                });
            }
        }
        Ok(model)
    }

    /// Parses one GGUF file held in memory (for tests and fuzzing). Split keys are not
    /// checked: a shard parses as the tensors it holds.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufModel> {
        let header = GgufHeader::parse(&bytes)?;
        let mut model = GgufModel::empty(header.version, header.alignment, header.metadata);
        let shard = Shard {
            bytes: Bytes::Owned(bytes),
            locked_heap: false,
            locked: false,
        };
        model.add_shard_unchecked(shard, header.tensors);
        Ok(model)
    }

    fn empty(version: u32, alignment: u64, metadata: Metadata) -> GgufModel {
        GgufModel {
            version,
            alignment,
            metadata,
            tensors: Vec::new(),
            index: HashMap::new(),
            shards: Vec::new(),
            paths: Vec::new(),
        }
    }

    fn add_shard(&mut self, shard: Shard, tensors: Vec<TensorInfo>, path: PathBuf) -> Result<()> {
        if let Some(t) = tensors.iter().find(|t| self.index.contains_key(&t.name)) {
            return Err(GgufError::Split {
                path,
                detail: format!(
                    "tensor '{}' also appears in an earlier shard (duplicate tensor name)",
                    t.name
                ),
            });
        }
        self.add_shard_unchecked(shard, tensors);
        self.paths.push(path);
        Ok(())
    }

    fn add_shard_unchecked(&mut self, shard: Shard, tensors: Vec<TensorInfo>) {
        let shard_index = self.shards.len();
        self.shards.push(Arc::new(shard));
        self.index.reserve(tensors.len());
        for mut t in tensors {
            t.shard = shard_index;
            self.index.insert(t.name.clone(), self.tensors.len());
            self.tensors.push(t);
        }
    }

    /// GGUF version of the (first) file.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment of the (first) file.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The metadata of the first shard (the one that carries the model's metadata).
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Every tensor of every shard, in shard order then file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The data of tensor `name`: a zero-copy view into the mapping (or buffer).
    pub fn tensor_data(&self, name: &str) -> Option<&[u8]> {
        self.tensor_info(name).map(|t| self.data_of(t))
    }

    /// The data of a tensor of this model. An info that does not describe data inside this
    /// model's files (one built by hand) gives an empty slice.
    pub fn data_of(&self, info: &TensorInfo) -> &[u8] {
        let range = || -> Option<&[u8]> {
            let data = self.shards.get(info.shard)?.data();
            let start = usize::try_from(info.offset).ok()?;
            let end = start.checked_add(usize::try_from(info.n_bytes).ok()?)?;
            data.get(start..end)
        };
        range().unwrap_or(&[])
    }

    /// [`GgufModel::data_of`] with a handle that keeps the tensor's file (its mapping or
    /// buffer) alive: the bytes `range` of `owner`, shared without a copy, so that a device
    /// on the host can keep the weights where they are. `None` for an info that does not
    /// describe data inside this model's files.
    pub fn shared_data_of(&self, info: &TensorInfo) -> Option<SharedData> {
        let shard = self.shards.get(info.shard)?;
        let start = usize::try_from(info.offset).ok()?;
        let end = start.checked_add(usize::try_from(info.n_bytes).ok()?)?;
        (end <= shard.data().len()).then(|| (Arc::clone(shard) as SharedOwner, start..end))
    }

    /// For a device that has copied `info`'s tensor and no longer reads it from the file:
    /// gives back this process's hold on the whole pages of a slice of its bytes, so that the
    /// copy does not count twice in the resident size. `None` where there is nothing to give
    /// back (the file read into a buffer, or locked with mlock).
    pub fn page_releaser(&self, info: &TensorInfo) -> Option<PageReleaser> {
        let shard = self.shards.get(info.shard)?;
        let mapped = matches!(shard.bytes, Bytes::Mapped(_)) && !shard.locked;
        let shard = Arc::clone(shard);
        mapped.then(|| Arc::new(move |part: &[u8]| shard.release(part)) as PageReleaser)
    }

    /// The files of this model, shard order (empty for [`GgufModel::from_bytes`]).
    pub fn shard_paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Sum of the data sizes of all tensors.
    pub fn total_tensor_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .fold(0u64, |acc, t| acc.saturating_add(t.n_bytes))
    }
}

/// A split key's value for messages.
fn show(v: Option<u64>) -> String {
    v.map_or_else(|| "missing".to_string(), |v| v.to_string())
}

fn load_and_parse(path: &Path, opts: LoadOptions) -> Result<(Shard, GgufHeader)> {
    let shard = Shard::load(path, opts)?;
    let header = GgufHeader::parse(shard.data()).map_err(|e| e.in_file(path))?;
    Ok((shard, header))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names() {
        assert_eq!(parse_split_name("m-00002-of-00003.gguf"), Some(("m", 2, 3)));
        assert_eq!(
            parse_split_name("a-b-00001-of-00010.gguf"),
            Some(("a-b", 1, 10))
        );
        assert_eq!(
            parse_split_name("m-123456-of-200000.gguf"),
            Some(("m", 123456, 200000))
        );
        assert_eq!(parse_split_name("m-2-of-3.gguf"), None);
        assert_eq!(parse_split_name("m-000002-of-00003.gguf"), None);
        assert_eq!(parse_split_name("m-00002-of-00003.bin"), None);
        assert_eq!(parse_split_name("model.gguf"), None);
        assert_eq!(parse_split_name("m-0000x-of-00003.gguf"), None);

        let p = split_shard_paths(Path::new("/d/m-00002-of-00003.gguf"))
            .unwrap()
            .unwrap();
        assert_eq!(
            p,
            [
                PathBuf::from("/d/m-00001-of-00003.gguf"),
                PathBuf::from("/d/m-00002-of-00003.gguf"),
                PathBuf::from("/d/m-00003-of-00003.gguf"),
            ]
        );
        assert!(split_shard_paths(Path::new("m.gguf")).unwrap().is_none());
        assert!(split_shard_paths(Path::new("m-00004-of-00003.gguf")).is_err());
        assert!(split_shard_paths(Path::new("m-00000-of-00003.gguf")).is_err());
        assert!(split_shard_paths(Path::new("m-00001-of-99999.gguf")).is_err());
    }

    #[test]
    fn model_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<GgufModel>();
    }
}
