//! Slot files (`--slot-save-path`, `POST /slots/{id}?action=save|restore`): a slot's tokens
//! and the K/V of their positions, checked before anything of them is used.
//!
//! Layout (little-endian): the magic `HMOESLOT`, the format version (u32), the model's
//! identity ([`model_identity`], u64), the flash-attention flag the K/V was computed with
//! (u8), the token count and the leading positions a cold prefill computes the same way
//! (u64 each), the layer count (u32) and each layer's K and V ring layouts (type id, values
//! per row, cells, rotation; a 0 byte where a K-only cache has no V), then the tokens (u32
//! each), each ring's rows ([`KvSnapshot::rows_of`] of them), and a checksum of everything
//! before it (u64). Reading checks the magic, the version, the identity, every layout's
//! sizes, that the file is exactly as long as its header says before reading any rows,
//! and the checksum; a file that fails any check is an [`SlotFileError`], never a panic.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use hmoe_gguf::{GgmlType, GgufModel};
use hmoe_model::{KvLayout, KvSnapshot, LayerRows, RingRows};

const MAGIC: &[u8; 8] = b"HMOESLOT";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
const MAX_LAYERS: usize = 1 << 16;
const MAX_WIDTH: usize = 1 << 24;
const MAX_CELLS: usize = 1 << 32;

/// Why a slot file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SlotFileError {
    /// Reading or writing failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Not a slot file of this format, or damaged.
    #[error("invalid slot save file: {0}")]
    Invalid(String),
    /// A slot file of another model or K/V computation.
    #[error("the slot save file was written for {0}")]
    Foreign(String),
}

/// What a slot file holds.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotState {
    /// The tokens whose K/V the snapshot holds (one per position).
    pub tokens: Vec<u32>,
    /// Leading positions computed as a cold prefill computes them.
    pub n_exact: usize,
    /// The K/V of the tokens' positions.
    pub kv: KvSnapshot,
}

/// Which model and K/V computation a file belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    /// [`model_identity`] of the model.
    pub model: u64,
    /// Whether attention ran as flash attention (the K/V of deeper layers depends on it).
    pub flash_attn: bool,
}

/// A 64-bit checksum fed in pieces, eight bytes at a time (FNV-style multiply and fold).
#[derive(Clone, Copy)]
struct Checksum {
    h: u64,
    tail: [u8; 8],
    n_tail: usize,
}

impl Checksum {
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn new() -> Checksum {
        Checksum {
            h: 0xcbf2_9ce4_8422_2325,
            tail: [0; 8],
            n_tail: 0,
        }
    }

    fn word(&mut self, w: u64) {
        self.h = (self.h ^ w).wrapping_mul(Self::PRIME).rotate_left(29);
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while self.n_tail > 0 && !bytes.is_empty() {
            self.tail[self.n_tail] = bytes[0];
            self.n_tail = (self.n_tail + 1) % 8;
            bytes = &bytes[1..];
            if self.n_tail == 0 {
                self.word(u64::from_le_bytes(self.tail));
            }
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.word(u64::from_le_bytes(w.try_into().unwrap_or_default()));
        }
        for &b in words.remainder() {
            self.tail[self.n_tail] = b;
            self.n_tail += 1;
        }
    }

    fn finish(mut self) -> u64 {
        let n = self.n_tail as u64;
        let tail = u64::from_le_bytes(self.tail) & (1u64 << (8 * n)).wrapping_sub(1);
        self.word(tail ^ (n << 56));
        self.h
    }
}

impl std::fmt::Write for Checksum {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.feed(s.as_bytes());
        Ok(())
    }
}

/// The identity of a model's weights: a checksum of its metadata (every key and value), its
/// tensor table (names, types, shapes, sizes) and the first bytes of every tensor, so that a
/// file of another model, or of another quantization or fine-tune of the same one, is
/// refused. Reads one page per tensor of the file mapping.
pub fn model_identity(gguf: &GgufModel) -> u64 {
    use std::fmt::Write as _;
    let mut h = Checksum::new();
    for (key, value) in gguf.metadata().iter() {
        let _ = write!(h, "{key}={value:?};");
    }
    for t in gguf.tensors() {
        let _ = write!(h, "{}:{}:{:?}:{};", t.name, t.ty.id(), t.dims, t.n_bytes);
        let data = gguf.data_of(t);
        h.feed(&data[..data.len().min(32)]);
    }
    h.finish()
}

/// Whether `name` may name a file in the slot directory: a plain file name (no `/`, `\`,
/// drive colon, `..`, control character or leading dot), 1 to 255 bytes (as llama-server's
/// filename check).
pub fn valid_filename(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && !name.ends_with(['.', ' '])
        && !name.starts_with(' ')
        && !name.chars().any(|c| c.is_control() || "/\\:".contains(c))
}

fn put_layout(out: &mut Vec<u8>, l: &KvLayout) {
    out.extend(l.ty.id().to_le_bytes());
    for n in [l.width, l.cells, l.rot] {
        out.extend((n as u64).to_le_bytes());
    }
}

/// Writes `state` to `path` (through a hidden temporary file beside it, renamed when
/// complete); returns the bytes written.
pub fn write(path: &Path, id: Identity, state: &SlotState) -> Result<u64, SlotFileError> {
    let mut head = Vec::new();
    head.extend(MAGIC);
    head.extend(VERSION.to_le_bytes());
    head.extend(id.model.to_le_bytes());
    head.push(id.flash_attn as u8);
    head.extend((state.tokens.len() as u64).to_le_bytes());
    head.extend((state.n_exact as u64).to_le_bytes());
    head.extend((state.kv.layers.len() as u32).to_le_bytes());
    for l in &state.kv.layers {
        put_layout(&mut head, &l.k.layout);
        head.push(l.v.is_some() as u8);
        if let Some(v) = &l.v {
            put_layout(&mut head, &v.layout);
        }
    }
    head.extend(state.tokens.iter().flat_map(|t| t.to_le_bytes()));
    // A name of its own per save, so that two saves to one name never share a partial file.
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let tmp = path.with_file_name(format!(
        ".{}.{}-{}.partial",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id(),
        SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let written = (|| {
        let mut out = BufWriter::new(File::create(&tmp)?);
        let mut sum = Checksum::new();
        let mut n = 0u64;
        let rows = (state.kv.layers.iter())
            .flat_map(|l| std::iter::once(&l.k).chain(l.v.as_ref()))
            .map(|r| &r.data[..]);
        for part in std::iter::once(&head[..]).chain(rows) {
            sum.feed(part);
            out.write_all(part)?;
            n += part.len() as u64;
        }
        out.write_all(&sum.finish().to_le_bytes())?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(n + 8)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// A reader that feeds the checksum with what it reads and counts it.
struct Source<R> {
    r: R,
    sum: Checksum,
    read: u64,
}

impl<R: Read> Source<R> {
    fn bytes(&mut self, n: usize) -> Result<Vec<u8>, SlotFileError> {
        let mut buf = vec![0u8; n];
        self.r.read_exact(&mut buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => invalid("the file is truncated"),
            _ => SlotFileError::Io(e),
        })?;
        self.sum.feed(&buf);
        self.read += n as u64;
        Ok(buf)
    }

    fn u64(&mut self) -> Result<u64, SlotFileError> {
        let b = self.bytes(8)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }

    fn u32(&mut self) -> Result<u32, SlotFileError> {
        let b = self.bytes(4)?;
        Ok(u32::from_le_bytes(b.try_into().unwrap_or_default()))
    }

    fn u8(&mut self) -> Result<u8, SlotFileError> {
        Ok(self.bytes(1)?[0])
    }

    fn layout(&mut self) -> Result<KvLayout, SlotFileError> {
        let id = self.u32()?;
        let ty = GgmlType::from_id(id).ok_or_else(|| invalid(format!("K/V type id {id}")))?;
        let [width, cells, rot] = [self.u64()?, self.u64()?, self.u64()?];
        if width as usize > MAX_WIDTH || cells as usize > MAX_CELLS || rot > width {
            return Err(invalid(format!(
                "a ring of {cells} rows of {width} values (rotation {rot})"
            )));
        }
        KvLayout::new(ty, width as usize, cells as usize, rot as usize)
            .map_err(|e| invalid(e.to_string()))
    }
}

fn invalid(what: impl Into<String>) -> SlotFileError {
    SlotFileError::Invalid(what.into())
}

/// Reads and checks the slot file at `path` for a model of identity `id` whose slots hold
/// at most `max_tokens` positions; returns what it holds and its size in bytes.
pub fn read(
    path: &Path,
    id: Identity,
    max_tokens: usize,
) -> Result<(SlotState, u64), SlotFileError> {
    let file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut src = Source {
        r: BufReader::new(file),
        sum: Checksum::new(),
        read: 0,
    };
    if src.bytes(8)? != MAGIC {
        return Err(invalid("not a slot file of hmoe (no HMOESLOT magic)"));
    }
    let version = src.u32()?;
    if version != VERSION {
        return Err(invalid(format!(
            "format version {version}; this server reads version {VERSION}"
        )));
    }
    let model = src.u64()?;
    let flash_attn = src.u8()? != 0;
    if model != id.model {
        return Err(SlotFileError::Foreign(format!(
            "another model (identity {model:016x}; this model's is {:016x})",
            id.model
        )));
    }
    if flash_attn != id.flash_attn {
        return Err(SlotFileError::Foreign(format!(
            "flash attention {}; this server runs it {}",
            if flash_attn { "on" } else { "off" },
            if id.flash_attn { "on" } else { "off" }
        )));
    }
    let n_tokens = src.u64()?;
    let n_exact = src.u64()?;
    if n_tokens > max_tokens as u64 {
        return Err(invalid(format!(
            "Restored prompt does not fit in the slot context: {n_tokens} tokens, a slot holds {max_tokens}"
        )));
    }
    let n_layer = src.u32()? as usize;
    if n_layer > MAX_LAYERS {
        return Err(invalid(format!("{n_layer} layers")));
    }
    let n_tokens = n_tokens as usize;
    let mut layouts = Vec::with_capacity(n_layer);
    for _ in 0..n_layer {
        let k = src.layout()?;
        let v = match src.u8()? {
            0 => None,
            _ => Some(src.layout()?),
        };
        layouts.push((k, v));
    }
    // Rows ≤ tokens ≤ a slot, widths and layers capped; saturating: a size no file has.
    let rows_bytes = |l: &KvLayout| {
        (KvSnapshot::rows_of(l, n_tokens) as u64).saturating_mul(l.row_bytes() as u64)
    };
    let body = (layouts.iter())
        .map(|(k, v)| rows_bytes(k).saturating_add(v.as_ref().map_or(0, rows_bytes)))
        .fold(0u64, u64::saturating_add);
    let expected = (src.read + 4 * n_tokens as u64 + 8).saturating_add(body);
    if len != expected {
        return Err(invalid(format!(
            "the file is {len} bytes where its header describes {expected} (truncated or damaged)"
        )));
    }
    let tokens = (src.bytes(4 * n_tokens)?.chunks_exact(4))
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let mut ring = |layout: KvLayout| -> Result<RingRows, SlotFileError> {
        let data = src.bytes(rows_bytes(&layout) as usize)?;
        Ok(RingRows { layout, data })
    };
    let mut layers = Vec::with_capacity(n_layer);
    for (k, v) in layouts {
        layers.push(LayerRows {
            k: ring(k)?,
            v: v.map(&mut ring).transpose()?,
        });
    }
    let sum = src.sum.finish();
    let stored = {
        let mut b = [0u8; 8];
        src.r.read_exact(&mut b)?;
        u64::from_le_bytes(b)
    };
    if sum != stored {
        return Err(invalid("checksum mismatch (the file is damaged)"));
    }
    let state = SlotState {
        tokens,
        n_exact: (n_exact as usize).min(n_tokens),
        kv: KvSnapshot {
            n_past: n_tokens,
            layers,
        },
    };
    Ok((state, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SlotState {
        let layout = KvLayout::new(GgmlType::F16, 8, 4, 0).unwrap();
        let rows = |n: usize, salt: u8| RingRows {
            layout,
            data: (0..n * layout.row_bytes())
                .map(|i| i as u8 ^ salt)
                .collect(),
        };
        SlotState {
            tokens: vec![5, 6, 7],
            n_exact: 2,
            kv: KvSnapshot {
                n_past: 3,
                layers: vec![
                    LayerRows {
                        k: rows(3, 1),
                        v: Some(rows(3, 2)),
                    },
                    LayerRows {
                        k: rows(3, 3),
                        v: None,
                    },
                ],
            },
        }
    }

    #[test]
    fn files_round_trip_and_damage_is_found() {
        let dir = std::env::temp_dir().join(format!("hmoe-slot-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.bin");
        let id = Identity {
            model: 42,
            flash_attn: true,
        };
        let n = write(&path, id, &sample()).unwrap();
        assert_eq!(n, std::fs::metadata(&path).unwrap().len());
        let (state, read_n) = read(&path, id, 10).unwrap();
        assert_eq!((state, read_n), (sample(), n));
        let err =
            |path: &Path, id: Identity, max: usize| read(path, id, max).unwrap_err().to_string();
        assert!(err(&path, Identity { model: 43, ..id }, 10).contains("another model"));
        assert!(err(
            &path,
            Identity {
                flash_attn: false,
                ..id
            },
            10
        )
        .contains("flash"));
        assert!(err(&path, id, 2).contains("does not fit"));
        let bytes = std::fs::read(&path).unwrap();
        for cut in [0, 5, 30, bytes.len() - 1] {
            std::fs::write(&path, &bytes[..cut]).unwrap();
            assert!(
                err(&path, id, 10).starts_with("invalid slot save file"),
                "cut at {cut}"
            );
        }
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        flipped[bytes.len() - 20] ^= 0x40;
        std::fs::write(&path, &flipped).unwrap();
        assert!(err(&path, id, 10).contains("checksum"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn file_names_stay_in_the_directory() {
        for ok in ["slot1.bin", "a b.bin", "x"] {
            assert!(valid_filename(ok), "{ok}");
        }
        for bad in [
            "",
            "../x",
            "a/b",
            "a\\b",
            "/etc/passwd",
            "..",
            ".",
            ".hidden",
            "c:x",
            "a\nb",
        ] {
            assert!(!valid_filename(bad), "{bad:?}");
        }
        assert!(!valid_filename(&"x".repeat(256)));
    }
}
