//! The CPU device's K/V storage: one ring of cells per layer ([`LayerCache`]), each half (K
//! or V) held as [`Cells`] of its element type. Full-attention layers hold the whole context;
//! sliding-window layers hold only `window + ubatch` cells, enough for every query of a
//! micro-batch to see its window (llama.cpp's iSWA cache does the same).
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
//! power of two (≥ 64) dividing the head size, V always 64 ([`KvLayout::rotation`];
//! [`LayerCache::with_head_dims`] sets it up from the head sizes).
//!
//! Memory is allocated zeroed and untouched, so a large context (`-c 0`) costs memory only as
//! it fills.

use std::sync::atomic::{AtomicBool, Ordering};

use half::f16;
use hmoe_quant::GgmlType;

use hmoe_backend::numerics::rotate_chunks;
use hmoe_backend::{CacheType, KvLayout, KvType};

use half::vec::HalfBitsVecExt;

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

    /// The bytes `range` of [`Cells::to_bytes`] (a range of whole elements), copied alone.
    pub fn read_bytes(&self, range: std::ops::Range<usize>) -> Vec<u8> {
        match self {
            Cells::F32(v) => (v[range.start / 4..range.end / 4].iter())
                .flat_map(|x| x.to_le_bytes())
                .collect(),
            Cells::F16(v) => (v[range.start / 2..range.end / 2].iter())
                .flat_map(|x| x.to_le_bytes())
                .collect(),
            Cells::Blocks { data, .. } => data[range].to_vec(),
        }
    }

    /// Overwrites the bytes of [`Cells::to_bytes`] from `at` on (whole elements) with `src`.
    pub fn write_bytes(&mut self, at: usize, src: &[u8]) {
        match self {
            Cells::F32(v) => {
                for (d, b) in v[at / 4..].iter_mut().zip(src.chunks_exact(4)) {
                    *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Cells::F16(v) => {
                for (d, b) in v[at / 2..].iter_mut().zip(src.chunks_exact(2)) {
                    *d = f16::from_le_bytes([b[0], b[1]]);
                }
            }
            Cells::Blocks { data, .. } => data[at..at + src.len()].copy_from_slice(src),
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
    /// Flash attention ([`KvType::flash_attn`]): attention takes the chunked flash kernel over
    /// f32/f16/bf16 values too (block-quantized values always take it).
    pub flash: bool,
    /// Set by attention when a head does not start on a block boundary of a block type
    /// (llama.cpp refuses such caches); the forward pass then reports an error.
    pub refused: AtomicBool,
}

impl LayerCache {
    /// Zeroed storage of `cells` positions: `k_width` key and `v_width` value elements per
    /// cell, not rotated (see [`LayerCache::with_head_dims`]).
    fn new(
        ty: KvType,
        cells: usize,
        k_width: usize,
        v_width: usize,
        window: Option<usize>,
    ) -> LayerCache {
        LayerCache {
            k: Cells::new(ty.k(), cells * k_width),
            v: Cells::new(ty.v(), cells * v_width),
            cells,
            window,
            flash: ty.flash_attn(),
            refused: AtomicBool::new(false),
        }
    }

    /// A ring for a sequence of `n_ctx` positions processed `n_ubatch` tokens at a time:
    /// `n_ctx` cells for a full-attention layer, `min(n_ctx, window + n_ubatch)` for a
    /// sliding-window one; `width` elements per cell of K and of V.
    pub fn for_context(
        ty: KvType,
        n_ctx: usize,
        n_ubatch: usize,
        width: usize,
        window: Option<usize>,
    ) -> LayerCache {
        let cells = match window {
            Some(w) => n_ctx.min(w + n_ubatch),
            None => n_ctx,
        };
        LayerCache::new(ty, cells, width, width, window)
    }

    /// Sets the rotation of block-quantized halves from the head sizes of the keys and values
    /// (llama.cpp's Walsh–Hadamard rotation, see the module docs). Call before anything is
    /// stored.
    pub fn with_head_dims(mut self, k_head: usize, v_head: usize) -> LayerCache {
        if let Cells::Blocks { ty, rot, .. } = &mut self.k {
            *rot = KvLayout::rotation(*ty, k_head, true);
        }
        if let Cells::Blocks { ty, rot, .. } = &mut self.v {
            *rot = KvLayout::rotation(*ty, v_head, false);
        }
        self
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

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_backend::FlashAttn;

    #[test]
    fn rows_are_quantized_when_written_and_memory_is_sized_per_type() {
        let ty = KvType::new(CacheType::Q8_0, CacheType::Q4_0, FlashAttn::On).unwrap();
        let mut layers = [None, Some(4)].map(|w| LayerCache::for_context(ty, 16, 4, 64, w));
        let bytes: usize = (layers.iter())
            .map(|l| l.k.to_bytes().len() + l.v.to_bytes().len())
            .sum();
        assert_eq!(bytes, (16 + 8) * (68 + 36));
        let k: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
        let v: Vec<f32> = k.iter().map(|x| x * 3.0).collect();
        layers[0].store(5, &k, &v, 2);
        let (mut want_k, mut want_v) = (vec![0u8; 136], vec![0u8; 72]);
        hmoe_quant::quantize_row(GgmlType::Q8_0, &k, &mut want_k).unwrap();
        hmoe_quant::quantize_row(GgmlType::Q4_0, &v, &mut want_v).unwrap();
        match (&layers[0].k, &layers[0].v) {
            (Cells::Blocks { data: kd, .. }, Cells::Blocks { data: vd, .. }) => {
                assert_eq!(&kd[5 * 68..7 * 68], &want_k[..]);
                assert_eq!(&vd[5 * 36..7 * 36], &want_v[..]);
            }
            other => panic!("unexpected cells {other:?}"),
        }
    }
}
