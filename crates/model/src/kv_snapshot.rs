//! A sequence's K/V as it leaves the device and comes back ([`KvSnapshot`]): what a saved
//! slot keeps (llama-server's `--slot-save-path` files), independent of the device that
//! computed it (rows in the contract's [`KvLayout`]).

use hmoe_backend::KvLayout;

/// Saved rows of one ring: its layout and its first [`KvSnapshot::rows_of`] cells.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingRows {
    /// The ring's layout (type, values per row, cells, rotation).
    pub layout: KvLayout,
    /// The rows, [`KvLayout::row_bytes`] bytes each.
    pub data: Vec<u8>,
}

/// Saved rows of one layer: K, and V unless the cache is K-only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerRows {
    /// Keys.
    pub k: RingRows,
    /// Values (`None`: a K-only cache).
    pub v: Option<RingRows>,
}

/// The K/V of a sequence's first `n_past` positions, every layer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvSnapshot {
    /// Positions held.
    pub n_past: usize,
    /// Each layer's rows.
    pub layers: Vec<LayerRows>,
}

impl KvSnapshot {
    /// Rows a ring of `layout` holds for `n_past` positions: position `p` lives in cell
    /// `p % cells`, so cells `0..n_past`, or every cell once the ring has wrapped.
    pub fn rows_of(layout: &KvLayout, n_past: usize) -> usize {
        n_past.min(layout.cells)
    }

    /// Bytes of K/V rows held.
    pub fn bytes(&self) -> u64 {
        (self.layers.iter())
            .map(|l| l.k.data.len() + l.v.as_ref().map_or(0, |v| v.data.len()))
            .sum::<usize>() as u64
    }
}
