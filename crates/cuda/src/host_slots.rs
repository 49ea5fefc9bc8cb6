//! Persistent pinned host buffers for the small copies of every step: the token ids and
//! positions up (the contract's `upload_into`) and the logits down (`download`). A copy from
//! pageable memory makes the driver stage it through a pinned buffer of its own, and an
//! upload from pageable memory returns only once the driver has read its source; through
//! these buffers each copy is one asynchronous copy from or to pinned memory that was
//! allocated once (a slot grows when a copy needs more; then it is reallocated once).
//!
//! Ordering: each slot has an event recorded on the compute stream after the copy that last
//! used it; the host waits for that event before it writes or reads the slot again. The
//! slots are used in turn, so a step's two uploads (ids, positions) do not wait for each
//! other.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    PinnedHostSlice,
};
use hmoe_backend::Elem;

use crate::error::CudaError;
use crate::staging::pinned_zeroed;

/// Slots in turn.
const SLOTS: usize = 4;
/// Bytes of a new slot (more when a copy needs it).
const MIN_SLOT_BYTES: usize = 64 << 10;
/// The largest copy that goes through a slot; larger ones (weights, a prefill's logits) go
/// the pageable way, where the pinned copy would cost as much as the driver's staging.
pub(crate) const MAX_SLOT_BYTES: usize = 4 << 20;

/// One pinned buffer and the event recorded after the copy that last used it.
struct Slot {
    buf: PinnedHostSlice<u8>,
    copied: CudaEvent,
}

/// The slots (allocated at their first use).
#[derive(Default)]
pub(crate) struct HostSlots {
    slots: Vec<Slot>,
    next: usize,
}

impl HostSlots {
    /// The next slot, holding at least `bytes`, once the copy that last used it has finished.
    fn slot(&mut self, ctx: &Arc<CudaContext>, bytes: usize) -> Result<&mut Slot, CudaError> {
        let i = self.next;
        self.next = (self.next + 1) % SLOTS;
        let new_slot = |bytes: usize| -> Result<Slot, CudaError> {
            Ok(Slot {
                buf: pinned_zeroed::<u8>(ctx, bytes.max(MIN_SLOT_BYTES))?,
                copied: ctx.new_event(None)?,
            })
        };
        if i >= self.slots.len() {
            let slot = new_slot(bytes)?;
            self.slots.push(slot);
        } else {
            let slot = &mut self.slots[i];
            slot.copied.synchronize()?;
            if slot.buf.len() < bytes {
                *slot = new_slot(bytes)?;
            }
        }
        Ok(&mut self.slots[i])
    }

    /// Queues on `stream` the copy of `src` into the start of `dst` (`src.len() <=
    /// dst.len()`, `size_of_val(src) <= MAX_SLOT_BYTES`, checked by the caller) through a
    /// slot, and returns once `src` is in the slot.
    pub(crate) fn upload<T: DeviceRepr + Elem>(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        src: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(src);
        let slot = self.slot(ctx, bytes)?;
        let host = &mut slot.buf.as_mut_slice()?[..bytes];
        // SAFETY: `src` is `bytes` bytes of plain device values (f32, i32, u16, u8: no
        // padding), read here as bytes.
        host.copy_from_slice(unsafe { std::slice::from_raw_parts(src.as_ptr().cast(), bytes) });
        let (ptr, _written) = dst.device_ptr_mut(stream);
        // SAFETY: `host` is pinned memory of `bytes` bytes that is not touched again until
        // `copied` (recorded next, on the same stream) has fired; `ptr` is `dst`, at least
        // `bytes` long, which `_written` borrows until the copy is queued.
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, host, stream.cu_stream()) }?;
        slot.copied.record(stream)?;
        Ok(())
    }

    /// The contents of `src` (`size_of_val <= MAX_SLOT_BYTES`, checked by the caller),
    /// through a slot: waits for the ops queued on `stream` before the copy.
    pub(crate) fn download<T: DeviceRepr + Elem>(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        let mut out = vec![T::default(); src.len()];
        let bytes = std::mem::size_of_val(out.as_slice());
        if bytes == 0 {
            return Ok(out);
        }
        let slot = self.slot(ctx, bytes)?;
        let host = &mut slot.buf.as_mut_slice()?[..bytes];
        let (ptr, _read) = src.device_ptr(stream);
        // SAFETY: `host` is pinned memory of `bytes` bytes, read below only after `copied`
        // (recorded after the copy) has fired; `ptr` is `src`, `bytes` long.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(host, ptr, stream.cu_stream()) }?;
        slot.copied.record(stream)?;
        slot.copied.synchronize()?;
        // SAFETY: `out` is `bytes` bytes of plain device values (f32, i32, u16, u8: every
        // bit pattern is a value), written here as bytes.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), bytes) };
        dst.copy_from_slice(host);
        Ok(out)
    }
}
