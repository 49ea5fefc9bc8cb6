//! [`SharedBytes`]: weights a device may keep a handle to instead of a copy.

use std::ops::Range;
use std::sync::Arc;

/// Bytes that their owner keeps in place for as long as any handle to them lives (a tensor in
/// a model file's mapping): what [`crate::Backend::upload_matrix_shared`] takes, so that a device on
/// the host can keep the handle instead of a copy of the weights.
#[derive(Clone)]
pub struct SharedBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
    /// Gives back the process's pages of a slice of the bytes, where the owner can.
    release: Option<PageRelease>,
}

/// Gives back the process's pages of a slice of a file mapping ([`SharedBytes::release_pages`]).
pub type PageRelease = Arc<dyn Fn(&[u8]) + Send + Sync>;

impl SharedBytes {
    /// The bytes `range` of `owner`, or `None` when `range` lies outside them.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Option<Self> {
        let inside = range.start <= range.end && range.end <= (*owner).as_ref().len();
        inside.then_some(SharedBytes {
            owner,
            range,
            release: None,
        })
    }

    /// These bytes with `release`, which gives back the process's pages of a slice of them (a
    /// file mapping's; see [`SharedBytes::release_pages`]).
    pub fn with_page_release(self, release: PageRelease) -> Self {
        SharedBytes {
            release: Some(release),
            ..self
        }
    }

    /// For a device that copied `part` (a slice of [`SharedBytes::bytes`]) and will not read it
    /// here again: lets the owner give back its pages, so that the copy does not count twice
    /// in the resident size (a later read still sees the same bytes). Does nothing where the
    /// owner cannot (a heap buffer).
    pub fn release_pages(&self, part: &[u8]) {
        if let Some(release) = &self.release {
            release(part);
        }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({:?})", self.range)
    }
}
