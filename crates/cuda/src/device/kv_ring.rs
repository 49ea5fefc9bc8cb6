//! The K/V rings: storing rows of keys or values into a ring of any K/V type of the contract
//! (`kv_store`), converted (and, for block-quantized rings, rotated) as the CPU device's
//! cache stores them; the keys and the values of a layer in one launch.

use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};
use hmoe_backend::KvLayout;

use super::capabilities::kv_type_ok;
use super::{grid_1d, i32_of, u32_of, CudaDevice};
use crate::error::{ensure, CudaError};

/// One store of [`CudaDevice::kv_store_pair`]: rows of f32 values, the ring they go into and
/// its layout.
pub type KvStore<'a> = (&'a CudaSlice<f32>, &'a mut CudaSlice<u8>, &'a KvLayout);

/// What the `kv_store` kernel takes of one store checked for `n_tokens` rows: its items (values
/// of a float ring, chunks of `max(rot, 32)` values of a block-quantized one) and its type,
/// rotation, width and cells as the kernel's ints.
fn checked(
    (src, ring, layout): &KvStore<'_>,
    n_tokens: usize,
) -> Result<(usize, [i32; 4]), CudaError> {
    const OP: &str = "kv_store";
    let (width, cells) = (layout.width, layout.cells);
    ensure(kv_type_ok(layout), OP, || {
        format!("{} K/V rings (rotation {})", layout.ty, layout.rot)
    })?;
    let float = layout.ty.block_elems() == 1;
    let chunk = if float { 1 } else { layout.rot.max(32) };
    ensure(
        cells > 0
            && src.len() >= n_tokens * width
            && ring.len() >= layout.bytes()
            && width.is_multiple_of(chunk),
        OP,
        || {
            format!(
                "src {} / ring {} bytes for {n_tokens}×{width} into {cells} cells",
                src.len(),
                ring.len()
            )
        },
    )?;
    let ints = [
        layout.ty.id() as i32,
        i32_of(OP, "rotation", layout.rot)?,
        i32_of(OP, "width", width)?,
        i32_of(OP, "cells", cells)?,
    ];
    Ok((n_tokens * width / chunk, ints))
}

impl CudaDevice {
    /// Writes `n_tokens` rows of `layout.width` f32 values from `src` into the K/V ring
    /// `ring` of `layout` (one of [`K_ONLY_TYPES`](super::K_ONLY_TYPES)): token t goes to
    /// cell `(pos0 + t) % cells`, converted as the CPU device's cache converts it (see
    /// `kv_store` in the kernels). `pos0` is read on the device from `pos_at[0]` (the
    /// step's positions; a negative one stores nothing), so the launch is the same for
    /// every position.
    pub fn kv_store(
        &self,
        src: &CudaSlice<f32>,
        ring: &mut CudaSlice<u8>,
        layout: &KvLayout,
        n_tokens: usize,
        pos_at: &CudaView<'_, i32>,
    ) -> Result<(), CudaError> {
        self.kv_store_pair((src, ring, layout), None, n_tokens, pos_at)
    }

    /// [`Self::kv_store`] of `k`, and of `v` when given (a layer's keys and values, into rings
    /// of any types), in one launch.
    pub fn kv_store_pair(
        &self,
        k: KvStore<'_>,
        v: Option<KvStore<'_>>,
        n_tokens: usize,
        pos_at: &CudaView<'_, i32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "kv_store";
        let (k_items, k_ints) = checked(&k, n_tokens)?;
        let v_checked = v.as_ref().map(|v| checked(v, n_tokens)).transpose()?;
        let items = k_items.max(v_checked.map_or(0, |(n, _)| n));
        if items == 0 {
            return Ok(());
        }
        let n_i = i32_of(OP, "tokens", n_tokens)?;
        let mut cfg = grid_1d(items, OP)?;
        cfg.grid_dim.1 = u32_of(OP, "rings", 1 + usize::from(v.is_some()))?;
        let mut b = self.builder("kv_store");
        let (src, ring, _) = k;
        b.arg(src).arg(ring);
        for x in &k_ints {
            b.arg(x);
        }
        // Without a second store, the first again in its place: grid.y 1 never reads it.
        let v_ints = v_checked.map_or(k_ints, |(_, ints)| ints);
        match v {
            Some((src, ring, _)) => b.arg(src).arg(ring),
            None => b.arg(&self.dummy).arg(&self.dummy),
        };
        for x in &v_ints {
            b.arg(x);
        }
        b.arg(&n_i).arg(pos_at);
        // SAFETY: argument types match `kv_store` (u8 rings, f32 rows); each ring holds
        // `cells` rows of its type's `row_bytes(width)` and each source n_tokens × width
        // values (`checked`); `pos_at` names at least one i32; writes land in cells < `cells`
        // (the kernel skips a negative position); with one store grid.y is 1 and the second
        // set (the dummy) is never read.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
