//! The whole OS memory pages inside a byte range, for advice that takes whole pages.

/// The addresses of the whole memory pages inside `bytes` (the page size from the OS), for
/// advice (`madvise`) that takes whole pages; `None` when it holds none or the page size is
/// unknown.
pub fn whole_pages(bytes: &[u8]) -> Option<std::ops::Range<usize>> {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        let start = bytes.as_ptr() as usize;
        let pages = start.checked_next_multiple_of(page)?..(start + bytes.len()) / page * page;
        (pages.end > pages.start).then_some(pages)
    }
    #[cfg(not(unix))]
    {
        let _ = bytes;
        None
    }
}
