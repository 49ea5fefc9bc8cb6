//! The process allocator's thresholds for a run of the CPU backend.
//!
//! A prompt's products allocate and free buffers of a few hundred KiB per expert and layer.
//! glibc serves those from fresh `mmap`s or trims them back to the kernel as they are freed,
//! by thresholds that move with the sizes it has seen freed, so how often the same pages are
//! faulted in, zeroed and unmapped again (with a TLB shootdown on every core) depends on the
//! order of unrelated allocations: writing batch results by column blocks instead of through
//! one matrix-sized buffer made the Qwen3-30B stand-in's pp512 5-8% slower on Zen 4 (page
//! faults per run 62,000 -> 147,000). Fixed thresholds took that back (docs/performance.md).

/// Allocations from this size are mapped on their own (glibc's default starts at 128 KiB and
/// moves).
pub const MMAP_THRESHOLD: usize = 4 << 20;
/// Free memory at the top of a heap (each thread's arena has one) beyond this is returned to
/// the kernel: what the process may keep unused is bounded by this per arena.
pub const TRIM_THRESHOLD: usize = 8 << 20;

/// Fixes the allocator's thresholds at [`MMAP_THRESHOLD`] and [`TRIM_THRESHOLD`] (glibc; a
/// no-op elsewhere). Returns whether the allocator took both.
pub fn fix_allocator_thresholds() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only sets allocator parameters; both values are in glibc's
        // accepted ranges (the mmap threshold at most 32 MiB on 64-bit targets).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_the_thresholds() {
        assert!(super::fix_allocator_thresholds());
        // The heap still serves and frees as before.
        let v = vec![1u8; super::MMAP_THRESHOLD - 4096];
        assert_eq!(v.iter().map(|&b| b as usize).sum::<usize>(), v.len());
    }
}
