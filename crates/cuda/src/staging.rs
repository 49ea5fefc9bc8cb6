//! Uploads from pageable memory (the file mapping) through a ring of pinned buffers.
//!
//! A copy from pageable memory makes the driver stage it through its own pinned buffer with
//! one CPU thread, which on op offload (gigabytes of experts per micro-batch) is the whole
//! cost. Here the CPU pool gathers the source into one pinned slot while the copy engine
//! drains the slot before it, so the upload runs at the slower of the pool's copy speed and
//! the bus instead of one thread's.
//!
//! A buffer uploaded this way lives on the copy stream (allocated, written and freed there)
//! and is read by kernels on the compute stream; [`CopyUpload`] orders the two streams for
//! it (cudarc's per-buffer event tracking is off, see [`crate::CudaDevice`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, PinnedHostSlice,
    ValidAsZeroBits,
};

use crate::error::{ensure, CudaError};

/// Pinned slots in the ring: one being filled, the others in flight.
const SLOTS: usize = 3;
/// Bytes per slot: large enough that each copy runs far past its launch cost.
const SLOT_BYTES: usize = 32 << 20;
/// Bytes each task of the CPU pool gathers (one slot is split into this many tasks).
const TASK_BYTES: usize = 1 << 20;

/// The ring: each slot with the event recorded after the copy that last read it.
pub(crate) struct Staging {
    slots: Vec<(PinnedHostSlice<u8>, CudaEvent)>,
    next: usize,
}

impl Staging {
    /// Allocates the ring's pinned slots in `ctx` (`SLOTS × SLOT_BYTES` of page-locked
    /// memory), each with an event without timing.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Staging, CudaError> {
        let slots = (0..SLOTS)
            .map(|_| {
                let event = ctx.new_event(Some(
                    cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
                ))?;
                Ok((pinned_zeroed::<u8>(ctx, SLOT_BYTES)?, event))
            })
            .collect::<Result<_, CudaError>>()?;
        Ok(Staging { slots, next: 0 })
    }

    /// Queues on `stream` the upload of `parts` (each `part_len` bytes, concatenated) into
    /// the start of `dst`. Returns once every byte has been gathered into a slot; the last
    /// copies may still be running (the caller records a [`CopyUpload`] after them, which
    /// orders them before the buffer's uses on the compute stream).
    pub(crate) fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        parts: &[&[u8]],
        part_len: usize,
        dst: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let total = parts.len() * part_len;
        ensure(
            parts.iter().all(|p| p.len() == part_len) && dst.len() >= total,
            "staged upload",
            || {
                format!(
                    "{} parts of {part_len} bytes into {}",
                    parts.len(),
                    dst.len()
                )
            },
        )?;
        let (base, _written) = dst.device_ptr_mut(stream);
        let mut done = 0;
        while done < total {
            let len = (total - done).min(SLOT_BYTES);
            let (buf, copied) = &mut self.slots[self.next];
            // The copy that last read this slot must finish before it is refilled.
            copied.synchronize()?;
            let slot = &mut buf.as_mut_slice()?[..len];
            hmoe_pool::global().for_each_chunk_mut(slot, TASK_BYTES, |i, chunk| {
                gather(parts, part_len, done + i * TASK_BYTES, chunk)
            });
            // SAFETY: `slot` is pinned host memory of `len` bytes that stays untouched until
            // `copied` (recorded next) has fired, and `base + done .. + len` lies inside
            // `dst` (`done + len <= total <= dst.len()`), which `_written` keeps alive and
            // marks written on the stream.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    base + done as u64,
                    slot,
                    stream.cu_stream(),
                )
            }?;
            copied.record(stream)?;
            self.next = (self.next + 1) % SLOTS;
            done += len;
        }
        Ok(())
    }
}

/// The stream order of a buffer allocated, written and (when dropped) freed on the copy
/// stream and read by kernels on the compute stream. Two invariants, kept by hand since
/// cudarc's per-buffer events are off:
///
/// 1. Written before read: `ready` is recorded on the copy stream after the buffer's last
///    copy; the compute stream waits for it ([`CopyUpload::wait_on`]) before it queues a
///    kernel that reads the buffer (the `moe` op over offloaded or cached experts).
/// 2. Read before freed: when this is dropped, the copy stream waits for everything queued
///    on the compute stream so far (the kernels that read the buffer are queued before the
///    host drops it), and only then is the buffer freed on the copy stream. Its owner keeps
///    this ahead of the buffer (fields drop in declaration order), and any other buffer of
///    the copy stream that it owns is dropped after it.
pub(crate) struct CopyUpload {
    ready: CudaEvent,
    /// Whether the compute stream already waits for `ready`: everything queued on it later
    /// comes after that wait, so one wait is enough.
    waited: AtomicBool,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
}

impl CopyUpload {
    /// Records, on `copy`, that everything queued there so far (the buffer's copies) must be
    /// done before `compute` reads the buffer.
    pub(crate) fn record(
        copy: &Arc<CudaStream>,
        compute: &Arc<CudaStream>,
    ) -> Result<CopyUpload, CudaError> {
        Ok(CopyUpload {
            ready: copy.record_event(None)?,
            waited: AtomicBool::new(false),
            compute: Arc::clone(compute),
            copy: Arc::clone(copy),
        })
    }

    /// Makes the compute stream wait for the buffer's copies (invariant 1): call it before
    /// queuing a kernel that reads the buffer. Only the first call queues the wait (one
    /// driver call); the compute stream's later work is behind it anyway.
    pub(crate) fn wait_on(&self) -> Result<(), CudaError> {
        if !self.waited.load(Ordering::Acquire) {
            self.compute.wait(&self.ready)?;
            self.waited.store(true, Ordering::Release);
        }
        Ok(())
    }
}

impl Drop for CopyUpload {
    fn drop(&mut self) {
        // Invariant 2: the copy stream, which frees the buffer next, waits for the compute
        // stream's work queued so far. Errors are kept in the context, as cudarc's drops do.
        let ctx = self.copy.context();
        match self.compute.record_event(None) {
            Ok(done) => ctx.record_err(self.copy.wait(&done)),
            Err(e) => ctx.record_err::<()>(Err(e)),
        }
    }
}

/// A zeroed page-locked host buffer of `len` elements in `ctx`, for asynchronous copies.
pub(crate) fn pinned_zeroed<T: DeviceRepr + ValidAsZeroBits>(
    ctx: &Arc<CudaContext>,
    len: usize,
) -> Result<PinnedHostSlice<T>, CudaError> {
    // SAFETY: the memory is filled with zero bits (valid for T) before anyone reads it.
    let mut buf = unsafe {
        ctx.alloc_pinned_with_flags::<T>(len, cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE)
    }?;
    let bytes = buf.num_bytes();
    let ptr = buf.as_mut_ptr()?;
    // SAFETY: `ptr` points to `bytes` bytes of host memory owned by `buf`.
    unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
    Ok(buf)
}

/// Fills `out` with the bytes at `start..` of the concatenation of `parts` (each `part_len`
/// bytes long; `start + out.len()` within their total).
pub(crate) fn gather(parts: &[&[u8]], part_len: usize, start: usize, out: &mut [u8]) {
    let mut at = start;
    let mut filled = 0;
    while filled < out.len() {
        let (part, offset) = (at / part_len, at % part_len);
        let n = (part_len - offset).min(out.len() - filled);
        out[filled..filled + n].copy_from_slice(&parts[part][offset..offset + n]);
        filled += n;
        at += n;
    }
}

#[cfg(test)]
mod tests {
    use super::gather;

    #[test]
    fn gather_reads_across_part_boundaries() {
        let parts: Vec<Vec<u8>> = (0..5u8)
            .map(|p| (0..7u8).map(|i| p * 10 + i).collect())
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let whole: Vec<u8> = parts.concat();
        for start in 0..whole.len() {
            for len in 0..=whole.len() - start {
                let mut out = vec![0xAA; len];
                gather(&refs, 7, start, &mut out);
                assert_eq!(out, whole[start..start + len], "start {start} len {len}");
            }
        }
    }
}
