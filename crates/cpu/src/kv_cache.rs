//! The key/value cache: one ring of cells per layer. Full-attention layers hold the whole
//! context; sliding-window layers hold only `window + ubatch` cells, enough for every query of
//! a micro-batch to see its window (llama.cpp's iSWA cache does the same).
//!
//! K and V each have an element type ([`CacheType`], `-ctk` / `-ctv`). Rows are converted
//! when they are written, exactly as ggml's CPU `set_rows` does: f16/bf16 round to nearest
//! even, `q8_0` with ggml's x86 `quantize_row_q8_0`, `q4_0`/`q4_1`/`q5_0`/`q5_1` with ggml's
//! reference quantisers (which is what its CPU backend calls for them). A quantized V can only
//! be read by flash attention ([`KvType::new`] enforces it, as llama.cpp does).
//!
//! Like llama.cpp (since its PR 21038), a block-quantized half whose heads are a multiple of 64
//! long is stored *rotated*: each head is multiplied by an orthonormal Walsh–Hadamard matrix
//! before it is quantized, which spreads outliers over the block and so shrinks the
//! quantization error. Attention rotates the queries the same way (scores are unchanged by a
//! rotation of both sides) and rotates its output back when V was rotated. K uses the largest
//! power of two (≥ 64) dividing the head size, V always 64. The model sets this up with
//! [`KvCache::with_head_dims`], which knows the head sizes.
//!
//! Memory is allocated zeroed and untouched, so a large context (`-c 0`) costs memory only as
//! it fills.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use half::f16;
use hmoe_quant::GgmlType;

use hmoe_backend::numerics::rotate_chunks;
use hmoe_backend::KvLayout;

use half::vec::HalfBitsVecExt;

/// Element type of one half (K or V) of the cache: the values of `-ctk` / `-ctv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum CacheType {
    /// 32-bit floats: exact.
    F32,
    /// 16-bit floats (llama.cpp's default).
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit blocks of 32 with an f16 scale (34 bytes per 32 values).
    Q8_0,
    /// 4-bit blocks of 32 with an f16 scale (18 bytes per 32 values).
    Q4_0,
    /// 4-bit blocks of 32 with an f16 scale and minimum (20 bytes per 32 values).
    Q4_1,
    /// 5-bit blocks of 32 with an f16 scale (22 bytes per 32 values).
    Q5_0,
    /// 5-bit blocks of 32 with an f16 scale and minimum (24 bytes per 32 values).
    Q5_1,
}

impl CacheType {
    /// Every cache type, in llama.cpp's `-ctk` order.
    pub const ALL: [CacheType; 8] = [
        CacheType::F32,
        CacheType::F16,
        CacheType::BF16,
        CacheType::Q8_0,
        CacheType::Q4_0,
        CacheType::Q4_1,
        CacheType::Q5_0,
        CacheType::Q5_1,
    ];

    /// Parses a `-ctk` / `-ctv` value (`f32`, `f16`, `bf16`, `q8_0`, `q4_0`, `q4_1`, `q5_0`,
    /// `q5_1`; case-insensitive).
    pub fn parse(s: &str) -> Option<CacheType> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
    }

    /// The lower-case name llama.cpp uses (`q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
            CacheType::BF16 => "bf16",
            CacheType::Q8_0 => "q8_0",
            CacheType::Q4_0 => "q4_0",
            CacheType::Q4_1 => "q4_1",
            CacheType::Q5_0 => "q5_0",
            CacheType::Q5_1 => "q5_1",
        }
    }

    /// The ggml tensor type of the stored rows.
    pub fn ggml_type(self) -> GgmlType {
        match self {
            CacheType::F32 => GgmlType::F32,
            CacheType::F16 => GgmlType::F16,
            CacheType::BF16 => GgmlType::BF16,
            CacheType::Q8_0 => GgmlType::Q8_0,
            CacheType::Q4_0 => GgmlType::Q4_0,
            CacheType::Q4_1 => GgmlType::Q4_1,
            CacheType::Q5_0 => GgmlType::Q5_0,
            CacheType::Q5_1 => GgmlType::Q5_1,
        }
    }

    /// Block-quantized (ggml's `ggml_is_quantized`: not the float types, bf16 included).
    pub fn is_quantized(self) -> bool {
        !matches!(self, CacheType::F32 | CacheType::F16 | CacheType::BF16)
    }

    /// Elements per block: a head must be a multiple of this long.
    pub fn block_elems(self) -> usize {
        self.ggml_type().block_elems()
    }

    /// Bytes of `n` values (`n` a multiple of [`CacheType::block_elems`]; rounded down
    /// otherwise).
    pub fn row_bytes(self, n: usize) -> usize {
        let ty = self.ggml_type();
        n / ty.block_elems() * ty.block_bytes()
    }
}

impl std::fmt::Display for CacheType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `-fa on|off|auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashAttn {
    /// Always use flash attention.
    On,
    /// Never (an error with a quantized V cache).
    Off,
    /// On wherever it is supported, as llama.cpp's default: on the CPU, always.
    Auto,
}

impl FlashAttn {
    /// Parses llama.cpp's values: `on`/`enabled`/`true`/`1`, `off`/`disabled`/`false`/`0`,
    /// `auto`/`-1`.
    pub fn parse(s: &str) -> Option<FlashAttn> {
        match s.to_ascii_lowercase().as_str() {
            "on" | "enabled" | "true" | "1" => Some(FlashAttn::On),
            "off" | "disabled" | "false" | "0" => Some(FlashAttn::Off),
            "auto" | "-1" => Some(FlashAttn::Auto),
            _ => None,
        }
    }
}

/// A K/V type combination llama.cpp refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvTypeError {
    /// A quantized V cache is only read by flash attention.
    #[error("a quantized V cache ({0}) requires flash attention, which was turned off")]
    QuantizedVNeedsFlash(CacheType),
}

/// What the KV cache stores and how attention reads it: the K and V element types and
/// whether flash attention is on. Flash attention decides which V types are allowed (a
/// quantized V needs it, as in llama.cpp); attention over block-quantized values runs ggml's
/// flash kernel (online softmax); over f32/f16/bf16 values flash attention (`-fa on` and
/// `-fa auto`, the default, as llama.cpp resolves auto on the CPU) runs the chunked online
/// softmax (within the fixture tolerances of the goldens), while `-fa off` keeps the row
/// kernel, which meets the non-flash goldens exactly (see the `attention` module).
///
/// [`KvType::F32`] and [`KvType::F16`] are the non-flash caches of earlier versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvType {
    k: CacheType,
    v: CacheType,
    flash_attn: bool,
}

impl KvType {
    /// f32 K and V, non-flash attention: exact.
    pub const F32: KvType = KvType {
        k: CacheType::F32,
        v: CacheType::F32,
        flash_attn: false,
    };
    /// f16 K and V, non-flash attention: queries and probabilities are rounded to f16 before
    /// their dot products, as ggml's CPU backend does.
    pub const F16: KvType = KvType {
        k: CacheType::F16,
        v: CacheType::F16,
        flash_attn: false,
    };

    /// K and V types with flash attention `fa` (auto = on, as llama.cpp resolves it on the
    /// CPU); a quantized V with `fa` off is refused, as llama.cpp refuses it.
    pub fn new(k: CacheType, v: CacheType, fa: FlashAttn) -> Result<KvType, KvTypeError> {
        let flash_attn = match fa {
            FlashAttn::On | FlashAttn::Auto => true,
            FlashAttn::Off if v.is_quantized() => return Err(KvTypeError::QuantizedVNeedsFlash(v)),
            FlashAttn::Off => false,
        };
        Ok(KvType { k, v, flash_attn })
    }

    /// Parses one `-ctk`/`-ctv` value for both K and V; flash attention is off unless the
    /// type is quantized (which needs it).
    pub fn parse(s: &str) -> Option<KvType> {
        let t = CacheType::parse(s)?;
        Some(KvType {
            k: t,
            v: t,
            flash_attn: t.is_quantized(),
        })
    }

    /// The K element type.
    pub fn k(self) -> CacheType {
        self.k
    }

    /// The V element type.
    pub fn v(self) -> CacheType {
        self.v
    }

    /// Whether attention runs as flash attention: ggml's kernel over block-quantized values,
    /// the chunked kernel over f32/f16/bf16 values.
    pub fn flash_attn(self) -> bool {
        self.flash_attn
    }
}

/// Storage of one tensor (K or V) of one layer: `cells × width` elements.
#[derive(Debug)]
pub enum Cells {
    /// f32 values.
    F32(Vec<f32>),
    /// f16 values.
    F16(Vec<f16>),
    /// BF16 and the block types, as ggml lays them out: `ty.block_elems()` values in
    /// `ty.block_bytes()` bytes. Rows are rotated in chunks of `rot` values before they are
    /// quantized (0: not rotated).
    Blocks {
        /// The element type.
        ty: GgmlType,
        /// The blocks.
        data: Vec<u8>,
        /// The rotation chunk (0: not rotated).
        rot: usize,
    },
}

impl Cells {
    fn new(ty: CacheType, len: usize) -> Cells {
        // Zeroed memory comes from the allocator without touching the pages, so a large
        // context costs memory only as it fills.
        match ty {
            CacheType::F32 => Cells::F32(vec![0.0; len]),
            CacheType::F16 => Cells::F16(vec![0u16; len].reinterpret_into()),
            _ => Cells::Blocks {
                ty: ty.ggml_type(),
                data: vec![0u8; ty.row_bytes(len)],
                rot: 0,
            },
        }
    }

    /// Zeroed storage for a device ring of `layout` (its type, `cells × width` values, its
    /// rotation), or `None` for a type that is not a cache type.
    pub fn for_layout(layout: &KvLayout) -> Option<Cells> {
        let ty = CacheType::ALL
            .into_iter()
            .find(|t| t.ggml_type() == layout.ty)?;
        let mut cells = Cells::new(ty, layout.cells * layout.width);
        if let Cells::Blocks { rot, .. } = &mut cells {
            *rot = layout.rot;
        }
        Some(cells)
    }

    /// The values as ggml lays them out (little-endian), what a device ring holds.
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            Cells::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Cells::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Cells::Blocks { data, .. } => data.clone(),
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_elems(&self) -> usize {
        match self {
            Cells::F32(_) | Cells::F16(_) => 1,
            Cells::Blocks { ty, .. } => ty.block_elems(),
        }
    }

    /// Length of the Walsh–Hadamard chunks rows are rotated in (0: not rotated).
    pub fn rotation(&self) -> usize {
        match self {
            Cells::Blocks { rot, .. } => *rot,
            _ => 0,
        }
    }

    /// Stores `src` at element offset `at`, converting to the cell type as ggml's `set_rows`
    /// does. For block types `at` and `src.len()` are whole blocks (the cache checks that
    /// before anything is written).
    pub fn store(&mut self, at: usize, src: &[f32]) {
        match self {
            Cells::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            Cells::F16(v) => {
                for (d, &s) in v[at..at + src.len()].iter_mut().zip(src) {
                    *d = f16::from_f32(s);
                }
            }
            Cells::Blocks { ty, data, rot } => {
                let (be, bb) = (ty.block_elems(), ty.block_bytes());
                let dst = &mut data[at / be * bb..(at + src.len()) / be * bb];
                let rotated;
                let src = if *rot > 0 {
                    rotated = rotate_chunks(src, *rot);
                    &rotated[..]
                } else {
                    src
                };
                hmoe_quant::quantize_row(*ty, src, dst)
                    .expect("K/V rows are whole blocks (checked by the cache)");
            }
        }
    }
}

/// The cache of one layer.
#[derive(Debug)]
pub struct LayerCache {
    /// The keys.
    pub k: Cells,
    /// The values (empty in a K-only cache).
    pub v: Cells,
    /// Number of cells in the ring; position `p` lives in cell `p % cells`.
    pub cells: usize,
    /// `Some(w)`: a query at `p` sees keys `p-w+1 ..= p`.
    pub window: Option<usize>,
    /// Flash attention ([`KvType::flash_attn`]): attention takes the flash kernel over
    /// f32/f16/bf16 values too.
    pub flash: bool,
    /// Set by attention when a head does not start on a block boundary of a block type
    /// (llama.cpp refuses such caches); the forward pass then reports an error.
    pub refused: AtomicBool,
}

impl LayerCache {
    fn new(
        ty: KvType,
        cells: usize,
        k_width: usize,
        v_width: usize,
        window: Option<usize>,
    ) -> LayerCache {
        LayerCache {
            k: Cells::new(ty.k, cells * k_width),
            v: Cells::new(ty.v, cells * v_width),
            cells,
            window,
            flash: ty.flash_attn(),
            refused: AtomicBool::new(false),
        }
    }

    /// Stores the keys (and values, unless `v` is empty: a K-only cache) of a batch whose first
    /// token sits at position `pos0`; `k` and `v` hold one row per token.
    pub fn store(&mut self, pos0: usize, k: &[f32], v: &[f32], n_tokens: usize) {
        let (kw, vw) = (k.len() / n_tokens, v.len() / n_tokens);
        for t in 0..n_tokens {
            let cell = (pos0 + t) % self.cells;
            self.k.store(cell * kw, &k[t * kw..(t + 1) * kw]);
            if vw > 0 {
                self.v.store(cell * vw, &v[t * vw..(t + 1) * vw]);
            }
        }
    }

    /// Records that attention could not read this layer (see `refused`).
    pub fn refuse(&self) {
        self.refused.store(true, Ordering::Relaxed);
    }
}

/// Key/value cache for one sequence.
#[derive(Debug)]
pub struct KvCache {
    /// One ring per layer.
    pub layers: Vec<LayerCache>,
    /// Element types and attention mode.
    pub ty: KvType,
    /// Elements per cell of K (kv heads × head dim, or the latent width).
    pub width: usize,
    /// Elements per cell of V (equal to `width`; 0 for a K-only cache).
    pub v_width: usize,
    n_ctx: usize,
    n_ubatch: usize,
    n_past: usize,
    /// This handle's identity, alive while the handle is ([`KvCache::id`], [`KvCache::watch`]).
    alive: Arc<()>,
}

impl KvCache {
    /// A cache for `n_ctx` positions; `windows[l]` is the sliding window of layer `l`, if any;
    /// `width` = kv heads × head dim; batches are processed `n_ubatch` tokens at a time.
    pub fn new(
        ty: KvType,
        n_ctx: usize,
        n_ubatch: usize,
        width: usize,
        windows: &[Option<usize>],
    ) -> KvCache {
        let layers = windows
            .iter()
            .map(|&window| {
                let cells = match window {
                    Some(w) => n_ctx.min(w + n_ubatch),
                    None => n_ctx,
                };
                LayerCache::new(ty, cells, width, width, window)
            })
            .collect();
        KvCache {
            layers,
            ty,
            width,
            v_width: width,
            n_ctx,
            n_ubatch,
            n_past: 0,
            alive: Arc::new(()),
        }
    }

    /// Tells the cache the head sizes of its keys and values, which turns on llama.cpp's
    /// Walsh–Hadamard rotation of block-quantized halves whose heads are a multiple of 64 long
    /// (see the module docs). Call before anything is stored.
    pub fn with_head_dims(mut self, k_head: usize, v_head: usize) -> KvCache {
        let rot_k = KvLayout::rotation(self.ty.k.ggml_type(), k_head, true);
        let rot_v = match self.is_k_only() {
            true => 0,
            false => KvLayout::rotation(self.ty.v.ggml_type(), v_head, false),
        };
        for layer in &mut self.layers {
            for (cells, r) in [(&mut layer.k, rot_k), (&mut layer.v, rot_v)] {
                if let Cells::Blocks { rot, .. } = cells {
                    *rot = r;
                }
            }
        }
        self
    }

    /// A number that tells this handle apart from every other live handle, and from every
    /// dropped one whose [`KvCache::watch`] is still held.
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.alive) as usize
    }

    /// A watch on this handle: [`Weak::strong_count`] drops to 0 when the handle is dropped,
    /// so that whoever keeps K/V for it elsewhere can free it.
    pub fn watch(&self) -> Weak<()> {
        Arc::downgrade(&self.alive)
    }

    /// Positions already in the cache (the next token goes to this position).
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Context size.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Micro-batch size the sliding-window rings were sized for.
    pub fn n_ubatch(&self) -> usize {
        self.n_ubatch
    }

    /// Element types and attention mode.
    pub fn kv_type(&self) -> KvType {
        self.ty
    }

    /// Forgets everything (a new sequence).
    pub fn clear(&mut self) {
        self.n_past = 0;
    }

    /// Drops positions from `pos` on, so the sequence continues from there. Sliding-window
    /// layers cannot go back further than their ring holds; returns false then (and changes
    /// nothing), so the caller re-evaluates from scratch.
    pub fn truncate(&mut self, pos: usize) -> bool {
        if pos >= self.n_past {
            return true;
        }
        let ok = self
            .layers
            .iter()
            .all(|l| l.window.is_none() || self.n_past - pos + l.window.unwrap_or(0) <= l.cells);
        if ok {
            self.n_past = pos;
        }
        ok
    }

    /// Bytes held by the cache (reserved; pages are touched only as positions fill).
    pub fn bytes(&self) -> usize {
        let per_cell = self.ty.k.row_bytes(self.width) + self.ty.v.row_bytes(self.v_width);
        self.layers.iter().map(|l| l.cells * per_cell).sum()
    }

    /// A cache that stores only keys, `k_width` elements per position in each of `n_layer`
    /// full-attention layers: for multi-head latent attention, whose values are the first
    /// elements of each key (llama.cpp's K-only MLA cache). The values take the K type.
    pub fn new_k_only(
        ty: KvType,
        n_ctx: usize,
        n_ubatch: usize,
        k_width: usize,
        n_layer: usize,
    ) -> KvCache {
        let layers = (0..n_layer)
            .map(|_| LayerCache::new(ty, n_ctx, k_width, 0, None))
            .collect();
        KvCache {
            layers,
            ty,
            width: k_width,
            v_width: 0,
            n_ctx,
            n_ubatch: n_ubatch.max(1),
            n_past: 0,
            alive: Arc::new(()),
        }
    }

    /// Whether the cache holds keys only (values are read from the keys).
    pub fn is_k_only(&self) -> bool {
        self.v_width == 0
    }

    /// Moves the sequence on by `n` positions (after a forward pass stored them).
    pub fn advance(&mut self, n: usize) {
        self.n_past += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_parse_and_size_like_ggml() {
        for t in CacheType::ALL {
            assert_eq!(CacheType::parse(&t.name().to_uppercase()), Some(t));
        }
        assert_eq!(CacheType::parse("q4_k"), None);
        assert_eq!(CacheType::Q8_0.row_bytes(64), 68);
        assert_eq!(CacheType::Q4_0.row_bytes(64), 36);
        assert_eq!(CacheType::BF16.row_bytes(64), 128);
        assert!(CacheType::Q5_1.is_quantized() && !CacheType::BF16.is_quantized());
        assert_eq!(KvType::parse("f16"), Some(KvType::F16));
        assert!(KvType::parse("q8_0").unwrap().flash_attn());
        assert_eq!(FlashAttn::parse("enabled"), Some(FlashAttn::On));
        assert_eq!(FlashAttn::parse("0"), Some(FlashAttn::Off));
        assert_eq!(FlashAttn::parse("-1"), Some(FlashAttn::Auto));
        assert_eq!(FlashAttn::parse("maybe"), None);
    }

    #[test]
    fn quantized_v_needs_flash_attention() {
        let err = KvType::new(CacheType::F16, CacheType::Q8_0, FlashAttn::Off).unwrap_err();
        assert!(
            err.to_string().contains("requires flash attention"),
            "{err}"
        );
        assert!(KvType::new(CacheType::Q8_0, CacheType::F16, FlashAttn::Off).is_ok());
        assert!(KvType::new(CacheType::BF16, CacheType::BF16, FlashAttn::Off).is_ok());
        let auto = KvType::new(CacheType::Q4_0, CacheType::Q4_0, FlashAttn::Auto).unwrap();
        assert!(auto.flash_attn());
        assert!(KvType::new(CacheType::F32, CacheType::F32, FlashAttn::Auto)
            .unwrap()
            .flash_attn());
        // `auto` is `on` over float values too: the chunked kernel, as llama.cpp's CPU auto.
        let f16 = |fa| KvType::new(CacheType::F16, CacheType::F16, fa).unwrap();
        assert_eq!(f16(FlashAttn::Auto), f16(FlashAttn::On));
        assert!(f16(FlashAttn::On).flash_attn());
        assert!(!f16(FlashAttn::Off).flash_attn());
    }

    #[test]
    fn rows_are_quantized_when_written_and_memory_is_sized_per_type() {
        let ty = KvType::new(CacheType::Q8_0, CacheType::Q4_0, FlashAttn::On).unwrap();
        let mut cache = KvCache::new(ty, 16, 4, 64, &[None, Some(4)]);
        assert_eq!(cache.bytes(), (16 + 8) * (68 + 36));
        let k: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
        let v: Vec<f32> = k.iter().map(|x| x * 3.0).collect();
        cache.layers[0].store(5, &k, &v, 2);
        let (mut want_k, mut want_v) = (vec![0u8; 136], vec![0u8; 72]);
        hmoe_quant::quantize_row(GgmlType::Q8_0, &k, &mut want_k).unwrap();
        hmoe_quant::quantize_row(GgmlType::Q4_0, &v, &mut want_v).unwrap();
        match (&cache.layers[0].k, &cache.layers[0].v) {
            (Cells::Blocks { data: kd, .. }, Cells::Blocks { data: vd, .. }) => {
                assert_eq!(&kd[5 * 68..7 * 68], &want_k[..]);
                assert_eq!(&vd[5 * 36..7 * 36], &want_v[..]);
            }
            other => panic!("unexpected cells {other:?}"),
        }
    }
}
