//! The executor's scratch arena ([`ScratchArena`]): the device buffers a micro-batch's ops
//! write their temporaries into (hidden states, norms, projections, router outputs, the ids
//! and positions, the logits), allocated uninitialised ([`Backend::alloc_scratch`]) the first
//! time a step needs a buffer of a length, then handed out again instead of allocated: from
//! the second decode step of a shape on, a step allocates nothing on the device.
//!
//! A buffer is taken ([`ScratchArena::take`]) as a [`Scratch`] guard, which derefs to the
//! device buffer and gives it back to the arena when dropped, so that a later op of the same
//! step (the next layer) takes it again: the arena holds about one layer's temporaries at once
//! (`ModelDims::scratch_per_token`), plus the step's hidden state and logits. Buffers are
//! matched by their exact length. At the end of a step ([`ScratchArena::end_step`]) the
//! buffers that no op of that step took are freed, so a prefill's large buffers do not outlive
//! the first decode step.
//!
//! Device order: a buffer goes back while ops that read or write it may still be queued. The
//! next op that takes it is queued after them on the same stream (REF0 and the CPU run ops in
//! order; CUDA queues every op of the executor on its compute stream), so it runs after them.
//! A buffer that another stream uses (CUDA's copy stream, op offload) must not come from the
//! arena.

use std::ops::{Deref, DerefMut, Range};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use hmoe_backend::{Backend, BackendError, Elem, RowCopy};

/// Free buffers of one element type, each with the step that last gave it back and the
/// generation it was made in (its age: the oldest is handed out first).
type FreeList<B, T> = Mutex<Vec<(<B as Backend>::Buf<T>, u64, u64)>>;

/// The reusable scratch buffers of a device model's steps (see the module docs).
pub(crate) struct ScratchArena<B: Backend> {
    f32s: FreeList<B, f32>,
    i32s: FreeList<B, i32>,
    /// The step under way (counts [`ScratchArena::end_step`] calls).
    step: AtomicU64,
    /// Bumped whenever a buffer is made or freed ([`ScratchArena::generation`]).
    generation: AtomicU64,
}

/// An element type the arena keeps buffers of.
pub(crate) trait ArenaElem: Elem {
    /// The arena's free buffers of this type.
    fn free_list<B: Backend>(a: &ScratchArena<B>) -> &FreeList<B, Self>;
}

impl ArenaElem for f32 {
    fn free_list<B: Backend>(a: &ScratchArena<B>) -> &FreeList<B, f32> {
        &a.f32s
    }
}

impl ArenaElem for i32 {
    fn free_list<B: Backend>(a: &ScratchArena<B>) -> &FreeList<B, i32> {
        &a.i32s
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Only whole buffers move in and out under the lock; a panic elsewhere leaves it usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<B: Backend> Default for ScratchArena<B> {
    fn default() -> Self {
        ScratchArena {
            f32s: Mutex::new(Vec::new()),
            i32s: Mutex::new(Vec::new()),
            step: AtomicU64::new(0),
            generation: AtomicU64::new(0),
        }
    }
}

impl<B: Backend> ScratchArena<B> {
    /// A buffer of `len` elements whose contents are unspecified (the ops that write it
    /// overwrite it whole): the free one of that length made first, or a new one. Taking
    /// the oldest makes the buffers a step gets a function of the free buffers and the
    /// step's ops alone: a step that repeats the last one (the same lengths taken and given
    /// back in the same order) gets the same buffers for the same ops, which a recorded
    /// segment (`segments.rs`) needs.
    pub(crate) fn take<T: ArenaElem>(
        &self,
        dev: &B,
        len: usize,
    ) -> Result<Scratch<'_, B, T>, BackendError> {
        let reused = {
            let mut free = lock(T::free_list(self));
            let at = (free.iter().enumerate())
                .filter(|(_, (b, _, _))| B::buf_len(b) == len)
                .min_by_key(|(_, (_, _, made))| *made)
                .map(|(i, _)| i);
            at.map(|i| free.swap_remove(i))
        };
        let (buf, made) = match reused {
            Some((b, _, made)) => (b, made),
            None => {
                let b = dev.alloc_scratch::<T>(len)?;
                (b, self.generation.fetch_add(1, Ordering::Relaxed))
            }
        };
        Ok(Scratch {
            buf: Some(buf),
            made,
            arena: self,
        })
    }

    /// A buffer holding a copy of `src[range]` (a copy on the device, `copy_rows`).
    pub(crate) fn slice(
        &self,
        dev: &B,
        src: &B::Buf<f32>,
        range: Range<usize>,
    ) -> Result<Scratch<'_, B, f32>, BackendError> {
        let mut out = self.take::<f32>(dev, range.len())?;
        dev.copy_rows(src, &mut out, &span(range.start, range.len(), 0))?;
        Ok(out)
    }

    /// Ends a step: frees the buffers that no op took since the last call.
    pub(crate) fn end_step(&self) {
        let step = self.step.fetch_add(1, Ordering::Relaxed);
        let before = self.held();
        lock(&self.f32s).retain(|(_, used, _)| *used == step);
        lock(&self.i32s).retain(|(_, used, _)| *used == step);
        if self.held() != before {
            self.generation.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Free buffers held (between steps: every buffer of the arena).
    fn held(&self) -> usize {
        lock(&self.f32s).len() + lock(&self.i32s).len()
    }

    /// A count that moves whenever the arena makes or frees a buffer: while it stays, every
    /// buffer it handed out still lives (what a recorded segment names).
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Bytes of the buffers it holds free (between steps: the last step's).
    pub(crate) fn bytes(&self) -> u64 {
        fn sum<B: Backend, T: ArenaElem>(list: &FreeList<B, T>) -> u64 {
            let free = lock(list);
            free.iter()
                .map(|(b, _, _)| (B::buf_len(b) * T::BYTES) as u64)
                .sum()
        }
        sum::<B, f32>(&self.f32s) + sum::<B, i32>(&self.i32s)
    }

    /// Frees every free buffer (before a large allocation needs the room).
    pub(crate) fn clear(&self) {
        if self.held() > 0 {
            self.generation.fetch_add(1, Ordering::Relaxed);
        }
        lock(&self.f32s).clear();
        lock(&self.i32s).clear();
    }
}

/// One contiguous copy of `len` elements from `src_offset` of a buffer to `dst_offset` of
/// another, as a [`RowCopy`] of one row.
pub(crate) fn span(src_offset: usize, len: usize, dst_offset: usize) -> RowCopy {
    RowCopy {
        n_rows: 1,
        width: len,
        src_stride: len,
        src_offset,
        dst_stride: len,
        dst_offset,
    }
}

/// A buffer taken from a [`ScratchArena`]: derefs to the device buffer and goes back to the
/// arena when dropped.
pub(crate) struct Scratch<'a, B: Backend, T: ArenaElem> {
    /// The buffer; `None` only while it is given back in `drop`.
    buf: Option<B::Buf<T>>,
    /// The generation it was made in.
    made: u64,
    arena: &'a ScratchArena<B>,
}

impl<B: Backend, T: ArenaElem> Deref for Scratch<'_, B, T> {
    type Target = B::Buf<T>;
    fn deref(&self) -> &B::Buf<T> {
        self.buf
            .as_ref()
            .expect("a scratch buffer is held until dropped")
    }
}

impl<B: Backend, T: ArenaElem> DerefMut for Scratch<'_, B, T> {
    fn deref_mut(&mut self) -> &mut B::Buf<T> {
        self.buf
            .as_mut()
            .expect("a scratch buffer is held until dropped")
    }
}

impl<B: Backend, T: ArenaElem> Drop for Scratch<'_, B, T> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let step = self.arena.step.load(Ordering::Relaxed);
            lock(T::free_list(self.arena)).push((b, step, self.made));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_backend::Ref0;

    #[test]
    fn buffers_are_reused_and_the_unused_freed_at_the_end_of_a_step() {
        let dev = Ref0::new();
        let arena = ScratchArena::<Ref0>::default();
        {
            let a = arena.take::<f32>(&dev, 8).unwrap();
            // Fresh scratch is REF0's poison, not zeros.
            assert!(a.iter().all(|v| v.is_nan()));
            let _b = arena.take::<f32>(&dev, 8).unwrap();
            let _c = arena.take::<i32>(&dev, 4).unwrap();
        }
        arena.end_step();
        let made = dev.allocations();
        {
            let _a = arena.take::<f32>(&dev, 8).unwrap();
            let _b = arena.take::<f32>(&dev, 8).unwrap();
            let _c = arena.take::<i32>(&dev, 4).unwrap();
        }
        assert_eq!(
            dev.allocations(),
            made,
            "a step of the same shapes allocates nothing"
        );
        assert_eq!(dev.bytes_held(), 2 * 8 * 4 + 4 * 4);
        assert_eq!(arena.bytes(), dev.bytes_held());
        arena.end_step();
        {
            let _d = arena.take::<f32>(&dev, 3).unwrap();
        }
        arena.end_step();
        // Only the buffer of length 3 was taken in that step.
        assert_eq!(dev.bytes_held(), 3 * 4);
        let src = dev.upload(&[1f32, 2.0, 3.0, 4.0]).unwrap();
        let s = arena.slice(&dev, &src, 1..4).unwrap();
        assert_eq!(&s[..], &[2.0, 3.0, 4.0]);
        drop(s);
        arena.clear();
        assert_eq!(dev.bytes_held(), 4 * 4);
    }
}
