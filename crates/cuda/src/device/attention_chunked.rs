//! Chunked flash attention (`-fa on`, and Q8_0/Q4_0 values whatever `-fa` says):
//! `attn_chunked` scores and sums each chunk of [`FLASH_CHUNK`] positions once for every query
//! head of a KV head (and a tile of query tokens), and either folds the chunks itself or, split
//! over the chunks (flash-decoding), leaves the chunk states to `attn_chunked_fold`; the output
//! is rotated back like the values by whichever writes it. The CPU device's chunked kernel bit
//! for bit (see the kernels' `attention_chunked.cu`).

use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use hmoe_backend::attention_scratch::{chunk_slots, chunk_states_len, CHUNK_STATES_MAX_BYTES};
use hmoe_backend::AttnParams;

use super::attention::{AttnArgs, AttnRings};
use super::{u32_of, CudaDevice, MAX_GRID_Y};
use crate::error::{ensure, CudaError};
use crate::kernels::{CH_MAX_ROWDIMS, CH_MAX_ROWS, CH_THREADS};

/// Split over the chunks only while the unsplit launch has fewer blocks than this (too few to
/// fill a GPU); a guess, not measured.
const SPLIT_BELOW_BLOCKS: usize = 256;

/// The launch shape of `attn_chunked` for a call: which rows each block serves, how many
/// chunk slots the grid has and whether the chunks are split over blocks. The results do not
/// depend on it (every shape gives the CPU device's bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkedShape {
    /// Query heads of one KV head per block (a divisor of the GQA group).
    pub heads_per_cta: usize,
    /// Query tokens per block.
    pub tokens_per_cta: usize,
    /// Chunk slots of a split launch (grid y): the most chunks a batch of this size can see in
    /// the ring, fixed by its capacity so that the grid does not depend on the position.
    pub slots: usize,
    /// One chunk per block, folded by `attn_chunked_fold` (else each block folds its chunks).
    pub split: bool,
}

impl ChunkedShape {
    /// The shape for `n_tokens` queries with `p` (a shape [`CudaDevice::attention`] takes:
    /// `n_head` a multiple of `n_head_kv > 0`, `head_dim` at most 256).
    pub fn new(p: &AttnParams, n_tokens: usize) -> ChunkedShape {
        let group = p.n_head / p.n_head_kv;
        let fits = |heads: usize| heads <= CH_MAX_ROWS && heads * p.head_dim <= CH_MAX_ROWDIMS;
        let heads_per_cta = (1..=group)
            .rev()
            .find(|&d| group.is_multiple_of(d) && fits(d))
            .unwrap_or(1);
        let tokens_per_cta = (CH_MAX_ROWS / heads_per_cta)
            .min(CH_MAX_ROWDIMS / (heads_per_cta * p.head_dim))
            .clamp(1, n_tokens.max(1));
        let slots = chunk_slots(p.cells, p.window, n_tokens);
        let mut shape = ChunkedShape {
            heads_per_cta,
            tokens_per_cta,
            slots,
            split: false,
        };
        let (x, _, z) = shape.grid(p, n_tokens);
        shape.split = slots > 1
            && x * z < SPLIT_BELOW_BLOCKS
            && slots <= MAX_GRID_Y
            && shape.scratch_len(p, n_tokens) * 4 <= CHUNK_STATES_MAX_BYTES;
        shape
    }

    /// The grid: (KV heads × head groups, chunk slots or 1, token tiles).
    pub fn grid(&self, p: &AttnParams, n_tokens: usize) -> (usize, usize, usize) {
        (
            p.n_head / self.heads_per_cta,
            if self.split { self.slots } else { 1 },
            n_tokens.div_ceil(self.tokens_per_cta),
        )
    }

    /// f32s of chunk states a split launch writes ([`chunk_states_len`]); 0 unsplit.
    pub fn scratch_len(&self, p: &AttnParams, n_tokens: usize) -> usize {
        match self.split {
            true => chunk_states_len(self.slots, n_tokens, p.n_head, p.head_dim),
            false => 0,
        }
    }
}

impl CudaDevice {
    /// `attn_chunked` (and `attn_chunked_fold` when split) for a call [`CudaDevice::attention`]
    /// checked: `rings` = (queries, K ring, V ring, sinks or the dummy), the first position
    /// read on the device from `pos_at[0]`.
    pub(super) fn attention_chunked(
        &self,
        p: &AttnParams,
        a: &AttnArgs,
        rings: AttnRings<'_>,
        pos_at: &CudaView<'_, i32>,
        n_tokens: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let sinks = rings.3;
        const OP: &str = "attention";
        let shape = ChunkedShape::new(p, n_tokens);
        let (gx, gy, gz) = shape.grid(p, n_tokens);
        ensure(gz <= MAX_GRID_Y, OP, || {
            format!("{n_tokens} tokens in one call")
        })?;
        let scratch = self.chunk_scratch(shape.scratch_len(p, n_tokens))?;
        let part = scratch.as_ref().unwrap_or(&self.dummy);
        let (hpc, tpc, split) = (
            shape.heads_per_cta as i32,
            shape.tokens_per_cta as i32,
            i32::from(shape.split),
        );
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "head groups", gx)?, gy as u32, gz as u32),
            block_dim: (CH_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        {
            let mut b = self.builder("attn_chunked");
            a.push_rings(&mut b, rings);
            b.arg(&mut *out).arg(part);
            a.push_shape(&mut b, pos_at, &p.scale);
            b.arg(&a.v_rot).arg(&hpc).arg(&tpc).arg(&split);
            // SAFETY: argument types match the kernel; the rings, queries, sinks and output were
            // checked by `attention`; the scratch holds every record a split launch writes
            // (`scratch_len`), and an unsplit launch does not touch it.
            unsafe { b.launch(cfg) }?;
        }
        if !shape.split {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "heads", p.n_head)?, n_tokens as u32, 1),
            block_dim: (p.head_dim.next_multiple_of(32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("attn_chunked_fold");
        b.arg(part)
            .arg(sinks)
            .arg(&a.has_sinks)
            .arg(out)
            .arg(&a.n_tokens)
            .arg(&a.n_head)
            .arg(&a.head_dim)
            .arg(&a.cells)
            .arg(pos_at)
            .arg(&a.window)
            .arg(&a.v_rot);
        // SAFETY: argument types match the kernel; it reads the records `attn_chunked` wrote
        // for the chunks each token sees (within `slots`, see `ChunkedShape::slots`: both
        // kernels skip a position whose keys the ring does not hold, `read_pos0`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Scratch for `len` f32 chunk states (`None` for none), uninitialised (no memset): the
    /// fold reads only the records `attn_chunked` wrote (the emulator poisons the scratch with
    /// NaN to show it). Allocated per call; the one place to hand it from an arena instead.
    fn chunk_scratch(&self, len: usize) -> Result<Option<CudaSlice<f32>>, CudaError> {
        match len {
            0 => Ok(None),
            _ => Ok(Some(self.alloc_scratch(len)?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(n_head: usize, n_kv: usize, hd: usize, cells: usize, w: Option<usize>) -> AttnParams {
        AttnParams {
            n_head,
            n_head_kv: n_kv,
            head_dim: hd,
            cells,
            window: w,
            scale: 0.125,
            value_chains: 1,
            flash: true,
        }
    }

    #[test]
    fn gpt_oss_decode_splits_and_prefill_folds_in_the_block() {
        // gpt-oss full layer: 64 heads over 8 KV heads of 64, 4096 cells.
        let p = params(64, 8, 64, 4096, None);
        let d = ChunkedShape::new(&p, 1);
        assert_eq!((d.heads_per_cta, d.tokens_per_cta), (8, 1));
        assert_eq!(d.slots, 17);
        assert!(d.split);
        assert_eq!(d.grid(&p, 1), (8, 17, 1));
        assert_eq!(d.scratch_len(&p, 1), 17 * 64 * 66);
        let pf = ChunkedShape::new(&p, 2048);
        assert_eq!((pf.heads_per_cta, pf.tokens_per_cta), (8, 2));
        assert!(!pf.split);
        assert_eq!(pf.grid(&p, 2048), (8, 1, 1024));
        assert_eq!(pf.scratch_len(&p, 2048), 0);
        // Its sliding layers (window 128): at most two chunks.
        let w = ChunkedShape::new(&params(64, 8, 64, 4096, Some(128)), 1);
        assert_eq!(w.slots, 2);
    }

    #[test]
    fn rows_stay_within_the_kernels_limits() {
        for (nh, nkv, hd) in [
            (64, 1, 256),
            (32, 32, 128),
            (128, 8, 16),
            (12, 4, 80),
            (8, 8, 16),
        ] {
            let p = params(nh, nkv, hd, 1000, None);
            for n in [1, 3, 100] {
                let s = ChunkedShape::new(&p, n);
                let rows = s.heads_per_cta * s.tokens_per_cta;
                assert!(
                    rows <= CH_MAX_ROWS && rows * hd <= CH_MAX_ROWDIMS,
                    "{p:?} {s:?}"
                );
                assert!((nh / nkv).is_multiple_of(s.heads_per_cta));
                assert!(s.tokens_per_cta <= n);
            }
        }
    }
}
