//! The device's stream-ordered memory pool, told to keep what is freed.
//!
//! Every device buffer comes from the device's default memory pool (`cuMemAllocAsync`, where
//! the driver has it): the weights, the K/V rings, the executor's scratch and the ops' own
//! temporaries (a MoE block's gate and up products, quantized activations, the op-offload
//! ring's slices). The pool's release threshold is 0 by default, so at every synchronization
//! (the host's wait for each host layer's copy down in the hybrid, every download) the driver
//! hands the freed memory back to the system, and the next allocation maps it again. The
//! device sets the threshold to the largest value instead, as other engines over this
//! allocator do: freed memory stays in the pool and the next step's temporaries of the same
//! sizes come from it. `HMOE_CUDA_POOL_KEEP=0` keeps the driver's default.
//!
//! What is kept is at most the peak of the buffers alive at once (the plan's reckoning of the
//! device's memory), unless fragments of it cannot serve a larger request; an allocation that
//! runs out of device memory therefore trims the pool to what is in use (after the device's
//! streams have finished) and tries once more ([`retry_out_of_memory`]). The device's free
//! memory counts what the pool keeps unused ([`KeptPool::idle_bytes`]), so that the executor
//! does not evict idle sequences' caches or cached experts for memory the pool holds.

use cudarc::driver::sys::{CUmemPool_attribute, CUmemoryPool, CUresult};
use cudarc::driver::{result, CudaContext, DriverError};

/// The environment switch: `HMOE_CUDA_POOL_KEEP=0` (or `off`) leaves the pool's release
/// threshold at the driver's default.
pub const POOL_KEEP_ENV: &str = "HMOE_CUDA_POOL_KEEP";

/// Whether the environment leaves the pool keeping freed memory (anything but `0` or `off`).
pub fn pool_keep_requested() -> bool {
    crate::default_on(POOL_KEEP_ENV)
}

/// The default memory pool of a device whose freed memory it keeps.
pub(crate) struct KeptPool(CUmemoryPool);

// SAFETY: a memory pool is a driver handle of the device, valid from any thread for as long as
// the process runs (a device's default pool is never destroyed); the device only trims it.
unsafe impl Send for KeptPool {}
// SAFETY: as above; `cuMemPoolTrimTo` may be called from several threads at once.
unsafe impl Sync for KeptPool {}

impl KeptPool {
    /// The default pool of `ctx`'s device with its release threshold raised to the largest
    /// value; `None` where the device does not allocate stream-ordered or the switch is off.
    pub(crate) fn new(ctx: &CudaContext) -> Result<Option<KeptPool>, DriverError> {
        if !ctx.has_async_alloc() || !pool_keep_requested() {
            return Ok(None);
        }
        ctx.bind_to_thread()?;
        // SAFETY: the device handle comes from a live context, bound to this thread.
        let pool = unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }?;
        let mut threshold = u64::MAX;
        // SAFETY: the pool is the device's default pool (valid for the process's life), and
        // the release threshold attribute takes a `cuuint64_t`, which `threshold` is.
        unsafe {
            result::mem_pool::set_attribute(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        }?;
        Ok(Some(KeptPool(pool)))
    }

    /// Bytes the pool holds that no buffer uses (reserved less used): free for the next
    /// allocation from the pool, though the driver's free-memory figure counts them as taken.
    pub(crate) fn idle_bytes(&self) -> Result<u64, DriverError> {
        let attribute = |attr| {
            let mut v = 0u64;
            // SAFETY: the pool is the device's default pool (valid for the process's life),
            // and both attributes asked for are `cuuint64_t`s, which `v` is.
            unsafe { result::mem_pool::get_attribute(self.0, attr, (&mut v as *mut u64).cast()) }
                .map(|()| v)
        };
        let reserved = attribute(CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        let used = attribute(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        Ok(reserved.saturating_sub(used))
    }

    /// Hands every byte the pool keeps but nothing uses back to the system. The caller has
    /// waited for the streams, so that their queued frees have happened.
    pub(crate) fn trim(&self) -> Result<(), DriverError> {
        // SAFETY: the pool is the device's default pool, valid for the process's life.
        unsafe { result::mem_pool::trim_to(self.0, 0) }
    }
}

/// Whether `e` says the device ran out of memory.
fn out_of_memory(e: &DriverError) -> bool {
    e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

/// `alloc()`, and when that runs out of device memory, `make_room()` and `alloc()` once more;
/// any other error, or one from `make_room`, is returned as it is (the allocation's own error
/// when making room failed).
pub(crate) fn retry_out_of_memory<T>(
    mut alloc: impl FnMut() -> Result<T, DriverError>,
    make_room: impl FnOnce() -> Result<(), DriverError>,
) -> Result<T, DriverError> {
    match alloc() {
        Err(e) if out_of_memory(&e) => match make_room() {
            Ok(()) => alloc(),
            Err(_) => Err(e),
        },
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OOM: DriverError = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    const INVALID: DriverError = DriverError(CUresult::CUDA_ERROR_INVALID_VALUE);

    #[test]
    fn running_out_of_memory_makes_room_and_tries_once_more() {
        let mut tries = 0;
        let mut trimmed = false;
        let r = retry_out_of_memory(
            || {
                tries += 1;
                if tries == 1 {
                    Err(OOM)
                } else {
                    Ok(7)
                }
            },
            || {
                trimmed = true;
                Ok(())
            },
        );
        assert_eq!((r.unwrap(), tries, trimmed), (7, 2, true));

        // Still out of memory after the room was made: that error, after two tries.
        let mut tries = 0;
        let r: Result<(), _> = retry_out_of_memory(
            || {
                tries += 1;
                Err(OOM)
            },
            || Ok(()),
        );
        assert_eq!((r.unwrap_err().0, tries), (OOM.0, 2));
    }

    #[test]
    fn other_errors_and_failed_trims_are_returned_as_they_are() {
        let mut tried_room = false;
        let r: Result<(), _> = retry_out_of_memory(
            || Err(INVALID),
            || {
                tried_room = true;
                Ok(())
            },
        );
        assert_eq!((r.unwrap_err().0, tried_room), (INVALID.0, false));

        // Making room failed (a capture in progress, say): the allocation's own error, one try.
        let mut tries = 0;
        let r: Result<(), _> = retry_out_of_memory(
            || {
                tries += 1;
                Err(OOM)
            },
            || Err(INVALID),
        );
        assert_eq!((r.unwrap_err().0, tries), (OOM.0, 1));
        assert_eq!(retry_out_of_memory(|| Ok(3), || Err(INVALID)).unwrap(), 3);
    }
}
