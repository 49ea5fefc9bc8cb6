//! The key/value cache: one ring of cells per layer. Full-attention layers hold the whole
//! context; sliding-window layers hold only `window + ubatch` cells, enough for every query of
//! a micro-batch to see its window (llama.cpp's iSWA cache does the same).

use half::f16;

use crate::{LogitsWanted, ModelError};
use half::vec::HalfBitsVecExt;

/// Element type of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvType {
    /// 32-bit floats: exact.
    F32,
    /// 16-bit floats (llama.cpp's default): queries and probabilities are rounded to f16 before
    /// their dot products, as ggml's CPU backend does.
    F16,
}

impl KvType {
    /// Parses `f32` / `f16` (the values of `-ctk/-ctv` this cache supports).
    pub fn parse(s: &str) -> Option<KvType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(KvType::F32),
            "f16" => Some(KvType::F16),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }
}

/// Storage of one tensor (K or V) of one layer: `cells × width` elements.
#[derive(Debug)]
pub(crate) enum Cells {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl Cells {
    fn new(ty: KvType, len: usize) -> Cells {
        match ty {
            KvType::F32 => Cells::F32(vec![0.0; len]),
            // Zeroed integers come from the allocator without touching the pages, so a large
            // context costs memory only as it fills.
            KvType::F16 => Cells::F16(vec![0u16; len].reinterpret_into()),
        }
    }

    /// Stores `src` at element offset `at`, rounding to the cell type.
    pub(crate) fn store(&mut self, at: usize, src: &[f32]) {
        match self {
            Cells::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            Cells::F16(v) => {
                for (d, &s) in v[at..at + src.len()].iter_mut().zip(src) {
                    *d = f16::from_f32(s);
                }
            }
        }
    }
}

/// The cache of one layer.
#[derive(Debug)]
pub(crate) struct LayerCache {
    pub k: Cells,
    pub v: Cells,
    /// Number of cells in the ring; position `p` lives in cell `p % cells`.
    pub cells: usize,
    /// `Some(w)`: a query at `p` sees keys `p-w+1 ..= p`.
    pub window: Option<usize>,
}

impl LayerCache {
    /// Stores the keys (and values, unless `v` is empty: a K-only cache) of a batch whose first
    /// token sits at position `pos0`; `k` and `v` hold one row per token.
    pub(crate) fn store(&mut self, pos0: usize, k: &[f32], v: &[f32], n_tokens: usize) {
        let (kw, vw) = (k.len() / n_tokens, v.len() / n_tokens);
        for t in 0..n_tokens {
            let cell = (pos0 + t) % self.cells;
            self.k.store(cell * kw, &k[t * kw..(t + 1) * kw]);
            if vw > 0 {
                self.v.store(cell * vw, &v[t * vw..(t + 1) * vw]);
            }
        }
    }
}

/// Key/value cache for one sequence.
#[derive(Debug)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    pub(crate) ty: KvType,
    pub(crate) width: usize,
    /// Elements per cell of V (equal to `width`; 0 for a K-only cache).
    pub(crate) v_width: usize,
    n_ctx: usize,
    n_ubatch: usize,
    n_past: usize,
}

impl KvCache {
    /// A cache for `n_ctx` positions; `windows[l]` is the sliding window of layer `l`, if any;
    /// `width` = kv heads × head dim; batches are processed `n_ubatch` tokens at a time.
    pub fn new(ty: KvType, n_ctx: usize, n_ubatch: usize, width: usize, windows: &[Option<usize>]) -> KvCache {
        let layers = windows
            .iter()
            .map(|&window| {
                let cells = match window {
                    Some(w) => n_ctx.min(w + n_ubatch),
                    None => n_ctx,
                };
                LayerCache {
                    k: Cells::new(ty, cells * width),
                    v: Cells::new(ty, cells * width),
                    cells,
                    window,
                }
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
        }
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

    /// Element type.
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

    /// Bytes held by the cache.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.cells * (self.width + self.v_width))
            .sum::<usize>()
            * self.ty.bytes()
    }

    /// A cache that stores only keys, `k_width` elements per position in each of `n_layer`
    /// full-attention layers: for multi-head latent attention, whose values are the first
    /// elements of each key (llama.cpp's K-only MLA cache).
    pub fn new_k_only(ty: KvType, n_ctx: usize, n_ubatch: usize, k_width: usize, n_layer: usize) -> KvCache {
        let layers = (0..n_layer)
            .map(|_| LayerCache {
                k: Cells::new(ty, n_ctx * k_width),
                v: Cells::new(ty, 0),
                cells: n_ctx,
                window: None,
            })
            .collect();
        KvCache {
            layers,
            ty,
            width: k_width,
            v_width: 0,
            n_ctx,
            n_ubatch: n_ubatch.max(1),
            n_past: 0,
        }
    }

    /// Whether the cache holds keys only (values are read from the keys).
    pub fn is_k_only(&self) -> bool {
        self.v_width == 0
    }

    /// Checks `tokens` against the vocabulary and the context, then runs them through `step`
    /// one micro-batch at a time (`step(cache, chunk, wanted)` must advance the cache by the
    /// chunk and return the logits it was asked for), concatenating the logits.
    pub(crate) fn run_ubatches(
        &mut self,
        tokens: &[u32],
        wanted: LogitsWanted,
        n_vocab: usize,
        mut step: impl FnMut(&mut KvCache, &[u32], Option<LogitsWanted>) -> Vec<f32>,
    ) -> Result<Vec<f32>, ModelError> {
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(ModelError::BadToken { id, n_vocab });
        }
        if self.n_past + tokens.len() > self.n_ctx {
            return Err(ModelError::ContextFull {
                pos: self.n_past,
                n_tokens: tokens.len(),
                n_ctx: self.n_ctx,
            });
        }
        let mut logits = Vec::new();
        let n_chunks = tokens.len().div_ceil(self.n_ubatch);
        for (i, chunk) in tokens.chunks(self.n_ubatch).enumerate() {
            let want = match wanted {
                LogitsWanted::All => Some(LogitsWanted::All),
                LogitsWanted::Last if i + 1 == n_chunks => Some(LogitsWanted::Last),
                LogitsWanted::Last => None,
            };
            logits.extend(step(self, chunk, want));
        }
        Ok(logits)
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.n_past += n;
    }
}
