//! A cache hint for data read soon from scattered places.

/// Asks the CPU to start loading `items` into its caches: a hint for data that will be read
/// soon from scattered places (a KV cache), with no effect on results.
#[inline]
pub fn prefetch<T>(items: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let start = items.as_ptr() as usize & !63;
        let end = items.as_ptr() as usize + std::mem::size_of_val(items);
        for line in (start..end).step_by(64) {
            // SAFETY: a prefetch is a hint that never faults or changes memory; `line` is the
            // first byte of a cache line that holds part of `items`.
            unsafe {
                core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                    line as *const i8,
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = items;
}

/// Asks the CPU to bring the `bytes` from `p` into L2, a cache line at a time from `p`: the
/// next rows of a memory-bound pass, whose side-by-side streams the hardware prefetchers
/// miss. Only a hint: an address past the rows is never read and changes no result.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_l2(p: *const u8, bytes: usize) {
    for l in 0..bytes.div_ceil(64) {
        // SAFETY: a prefetch never faults or changes memory, whatever the address.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T1 }>(
                p.wrapping_add(64 * l).cast(),
            )
        };
    }
}
