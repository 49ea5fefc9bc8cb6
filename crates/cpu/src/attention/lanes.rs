//! The chunked flash kernel over f32/f16 keys ([`super::flash_attention`]) with the query rows
//! that share a KV head in the lanes of one vector: [`ROW_LANES`] rows scored against a block
//! of keys together ([`super::lane_kernels::lane_scores`]), their softmax stepped a block at a time in
//! lanes ([`LaneSoftmax::step_block`], the kernel [`softmax_lanes`]), and their value sums
//! with the accumulators of every row held in registers across the block
//! ([`super::lane_kernels::lane_values`]); keys, and f32/f16 values, are read in place from the
//! cache (other values are converted to f32 a block at a time first).
//!
//! Each lane performs exactly the operations of the row-at-a-time arithmetic on the same
//! operands in the same order ([`dot_chain`] scores, [`softmax_block`] factors, one FMA per
//! key and value element), so results keep their bits; only which row an instruction serves
//! changes.
//!
//! [`dot_chain`]: hmoe_backend::numerics::dot_chain
//! [`softmax_block`]: hmoe_backend::numerics::softmax_block

use super::lane_kernels::{softmax_lanes, LaneBlock, SOFTMAX_LANES};

/// Query rows scored and summed together, one per vector lane.
pub(super) const ROW_LANES: usize = SOFTMAX_LANES;

/// The softmax state of up to [`ROW_LANES`] rows, one per lane, and the factors of the block
/// of keys last stepped.
pub(super) struct LaneSoftmax {
    m: [f32; ROW_LANES],
    s: [f32; ROW_LANES],
    /// The visible positions of each lane (`first..=last`); lanes without a row see every
    /// key and are never read back.
    first: [usize; ROW_LANES],
    last: [usize; ROW_LANES],
    block: LaneBlock,
}

impl Default for LaneSoftmax {
    fn default() -> LaneSoftmax {
        LaneSoftmax {
            m: [f32::NEG_INFINITY; ROW_LANES],
            s: [0.0; ROW_LANES],
            first: [0; ROW_LANES],
            last: [usize::MAX; ROW_LANES],
            block: LaneBlock::default(),
        }
    }
}

impl LaneSoftmax {
    /// Loads lane `l`'s row: its running maximum and sum and its visible positions.
    pub(super) fn set_row(&mut self, l: usize, (m, s): (f32, f32), (first, last): (usize, usize)) {
        (self.m[l], self.s[l]) = (m, s);
        (self.first[l], self.last[l]) = (first, last);
    }

    /// Clears lane `l` (no row: sees every key, state never read).
    pub(super) fn clear_row(&mut self, l: usize) {
        self.set_row(l, (f32::NEG_INFINITY, 0.0), (0, usize::MAX));
    }

    /// Lane `l`'s running maximum and sum.
    pub(super) fn row_state(&self, l: usize) -> (f32, f32) {
        (self.m[l], self.s[l])
    }

    /// Steps every lane's maximum and sum through the block of keys of positions `p0..p0 +
    /// raw.len()` (`raw[i][l]`: lane `l`'s unscaled score of key `i`) as the row kernel's
    /// block step does for the keys each lane sees ([`softmax_lanes`]), and keeps the block's
    /// factors for [`super::lane_kernels::lane_values`] ([`LaneSoftmax::block`]).
    pub(super) fn step_block(&mut self, raw: &[[f32; ROW_LANES]], scale: f32, p0: usize) {
        let n = raw.len();
        // Each lane's visible keys of the block, `from..to`.
        let from = self.first.map(|f| f.saturating_sub(p0).min(n) as i32);
        let to = self
            .last
            .map(|l| l.saturating_add(1).saturating_sub(p0).min(n) as i32);
        softmax_lanes(
            &mut self.m,
            &mut self.s,
            raw,
            scale,
            (from, to),
            &mut self.block,
        );
    }

    /// The factors of the block last stepped, for [`super::lane_kernels::lane_values`].
    pub(super) fn block(&self) -> &LaneBlock {
        &self.block
    }
}
