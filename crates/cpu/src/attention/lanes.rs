//! The chunked flash kernel over f32/f16 keys ([`super::flash_attention`]) with the query rows
//! that share a KV head in the lanes of one vector: [`ROW_LANES`] rows scored against a block
//! of keys together ([`chain_scores`]), their online softmax stepped key by key in lanes
//! ([`LaneSoftmax::step_block`], the kernel [`softmax_lanes`]), and their value sums with the
//! accumulators of every row held in registers across the block ([`LaneSoftmax::add_values`]).
//!
//! Each lane performs exactly the operations of the row-at-a-time arithmetic on the same
//! operands in the same order ([`dot_chain`] scores, [`online_softmax_step`] factors, one FMA
//! per value element), so results keep their bits; only which row an instruction serves
//! changes.
//!
//! [`dot_chain`]: hmoe_backend::numerics::dot_chain
//! [`online_softmax_step`]: hmoe_backend::numerics::online_softmax_step

use hmoe_quant::{softmax_lanes, LaneFactors, SOFTMAX_LANES};

/// Query rows scored and summed together, one per vector lane.
pub(super) const ROW_LANES: usize = SOFTMAX_LANES;

/// Keys [`chain_scores`] scores at once (independent FMA chains).
const KEYS_AT_ONCE: usize = 8;

/// [`hmoe_backend::numerics::dot_chain`] of [`ROW_LANES`] query rows (`qt[e·ROW_LANES + l]`:
/// element `e` of row `l`) with `out.len()` keys of `kd` floats, one after another in `keys`:
/// `out[i][l]` is row `l`'s score of key `i`. Lanes are rows, so each key element is broadcast
/// and every step is one vector FMA, with [`KEYS_AT_ONCE`] keys in flight.
pub(super) fn chain_scores(qt: &[f32], keys: &[f32], kd: usize, out: &mut [[f32; ROW_LANES]]) {
    let qt = &qt[..kd * ROW_LANES];
    let mut blocks = out.chunks_exact_mut(KEYS_AT_ONCE);
    let mut i = 0;
    for dst in &mut blocks {
        let k: [&[f32]; KEYS_AT_ONCE] = std::array::from_fn(|u| &keys[(i + u) * kd..][..kd]);
        let mut acc = [[0f32; ROW_LANES]; KEYS_AT_ONCE];
        for (e, q) in qt.chunks_exact(ROW_LANES).enumerate() {
            for (a, ku) in acc.iter_mut().zip(&k) {
                let kv = ku[e];
                for (x, &qv) in a.iter_mut().zip(q) {
                    *x = qv.mul_add(kv, *x);
                }
            }
        }
        dst.copy_from_slice(&acc);
        i += KEYS_AT_ONCE;
    }
    for dst in blocks.into_remainder() {
        let k = &keys[i * kd..][..kd];
        let mut acc = [0f32; ROW_LANES];
        for (q, &kv) in qt.chunks_exact(ROW_LANES).zip(k) {
            for (x, &qv) in acc.iter_mut().zip(q) {
                *x = qv.mul_add(kv, *x);
            }
        }
        *dst = acc;
        i += 1;
    }
}

/// The online-softmax state of up to [`ROW_LANES`] rows, one per lane, and the factors of the
/// block of keys last stepped.
pub(super) struct LaneSoftmax {
    m: [f32; ROW_LANES],
    s: [f32; ROW_LANES],
    /// The visible positions of each lane (`first..=last`); lanes without a row see every
    /// key and are never read back.
    first: [usize; ROW_LANES],
    last: [usize; ROW_LANES],
    keys: Vec<LaneFactors>,
}

impl Default for LaneSoftmax {
    fn default() -> LaneSoftmax {
        LaneSoftmax {
            m: [f32::NEG_INFINITY; ROW_LANES],
            s: [0.0; ROW_LANES],
            first: [0; ROW_LANES],
            last: [usize::MAX; ROW_LANES],
            keys: Vec::new(),
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

    /// Steps every lane's maximum and sum through the keys of positions `p0..p0 +
    /// raw.len()` (`raw[i][l]`: lane `l`'s unscaled score of key `i`) as the row kernel's
    /// online softmax does for each lane that sees the key ([`softmax_lanes`]), and keeps
    /// each key's factors for [`LaneSoftmax::add_values`].
    pub(super) fn step_block(&mut self, raw: &[[f32; ROW_LANES]], scale: f32, p0: usize) {
        let n = raw.len();
        if self.keys.len() < n {
            self.keys.resize(n, LaneFactors::default());
        }
        // Each lane's visible keys of the block, `from..to`.
        let from = self.first.map(|f| f.saturating_sub(p0).min(n) as i32);
        let to = self
            .last
            .map(|l| l.saturating_add(1).saturating_sub(p0).min(n) as i32);
        let keys = &mut self.keys[..n];
        softmax_lanes(&mut self.m, &mut self.s, raw, scale, (from, to), keys);
    }

    /// Adds the values of the `n` keys last stepped (key `i`'s value head of `vd` floats at
    /// `values[i·vd..]`) into the accumulators of the lanes' rows (`acc[l·vd..]` for lane
    /// `l < rows`): per key in order, `acc *= ms` where some lane's maximum rose, then
    /// `acc = fma(v, vs, acc)` in the lanes that see the key.
    pub(super) fn add_values(&self, acc: &mut [f32], rows: usize, values: &[f32], vd: usize) {
        let n = values.len() / vd;
        let whole = vd / SLICE * SLICE;
        for d0 in (0..whole).step_by(SLICE) {
            self.add_slice::<SLICE>(acc, rows, &values[..n * vd], vd, d0);
        }
        for d0 in whole..vd {
            self.add_slice::<1>(acc, rows, &values[..n * vd], vd, d0);
        }
    }

    /// [`LaneSoftmax::add_values`] for elements `d0..d0 + W` of every row, held in registers
    /// over the block's keys.
    #[inline(always)]
    fn add_slice<const W: usize>(
        &self,
        acc: &mut [f32],
        rows: usize,
        values: &[f32],
        vd: usize,
        d0: usize,
    ) {
        let mut a = [[0f32; W]; ROW_LANES];
        for (l, a) in a.iter_mut().enumerate().take(rows) {
            a.copy_from_slice(&acc[l * vd + d0..][..W]);
        }
        for (f, v) in self.keys.iter().zip(values.chunks_exact(vd)) {
            let v: &[f32; W] = v[d0..d0 + W].try_into().expect("W elements");
            if f.raise != 0 {
                for (a, &ms) in a.iter_mut().zip(&f.ms) {
                    a.iter_mut().for_each(|x| *x *= ms);
                }
            }
            if f.seen == u8::MAX {
                for (a, &vs) in a.iter_mut().zip(&f.vs) {
                    fma_slice(a, v, vs);
                }
            } else {
                for (l, (a, &vs)) in a.iter_mut().zip(&f.vs).enumerate() {
                    if f.seen >> l & 1 == 1 {
                        fma_slice(a, v, vs);
                    }
                }
            }
        }
        for (l, a) in a.iter().enumerate().take(rows) {
            acc[l * vd + d0..][..W].copy_from_slice(a);
        }
    }
}

/// Value elements per lane that [`LaneSoftmax::add_values`] holds in registers at once: one
/// 256-bit vector, so that the [`ROW_LANES`] rows' accumulators take half the registers.
const SLICE: usize = 8;

/// `a = fma(v, w, a)` element by element.
#[inline(always)]
fn fma_slice<const W: usize>(a: &mut [f32; W], v: &[f32; W], w: f32) {
    for (x, &y) in a.iter_mut().zip(v) {
        *x = y.mul_add(w, *x);
    }
}
