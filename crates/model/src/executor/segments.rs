//! The recorded segments of decode steps ([`Backend::begin_segment`]): where a step's ops may
//! be recorded once and replayed (CUDA graphs; REF0's replay mode checks the same in CI).
//!
//! A step's segments: from after the ids and positions go up to the first host layer's copy
//! down, then from each host layer's copy up to the next one's copy down, and last to the
//! logits' copy down (all on the device: one segment). Between them run the copies and the
//! host's experts, and the ops queued beside the host's experts, as issued.
//!
//! A step run as two micro-batches in flight (`micro_batches.rs`) has the segments above
//! for each group, with keys of the group's own ([`Segments::of_group`]); a group hands the
//! turn to the other only between its segments.
//!
//! Segments are on only for a step that repeats the last one: every sequence decodes one
//! token, the same sequences (their device caches) want the same logits as in the last step,
//! and nothing that a recording names changed since (no buffer of the scratch arena made or
//! freed, no device cache made or freed: [`SegmentEpoch`]). The first decode step after a
//! prefill allocates its buffers and runs as issued; the second records; the later ones
//! replay. Everything that varies from token to token reaches the ops through the ids and
//! positions buffers, written before the first segment opens. Whenever the epoch moves,
//! every recording is dropped before a buffer it names could be reused. Op offload and the
//! device expert cache change the ops from step to step and keep segments off.

use std::hash::{DefaultHasher, Hash, Hasher};

use hmoe_backend::{Backend, BackendError};

use crate::language_model::LogitsWanted;

/// What a recording depends on besides the step's shape: the scratch arena's generation
/// (bumped when it makes or frees a buffer) and the device caches' (bumped when one is made
/// or freed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SegmentEpoch {
    /// [`super::scratch_arena::ScratchArena::generation`].
    pub(crate) arena: u64,
    /// [`super::state::State::kv_generation`].
    pub(crate) kvs: u64,
}

/// One sequence of a step as its shape counts it: its device cache's index in the state and
/// its handle, its tokens and the logits it wants (not its positions).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeqShape {
    /// The index of its device cache.
    pub(crate) kv: usize,
    /// Its cache handle.
    pub(crate) handle: usize,
    /// Its tokens in the step.
    pub(crate) tokens: usize,
    /// The logits it wants.
    pub(crate) want: Option<LogitsWanted>,
    /// How many of its best logits alone it wants ([`super::step::Member::top`]).
    pub(crate) top: Option<usize>,
}

/// The key of a step's shape for segments (its sequences' device caches and wanted logits),
/// or `None` for a step that does not decode one token per sequence.
pub(crate) fn step_shape(seqs: &[SeqShape]) -> Option<u64> {
    if seqs.iter().any(|s| s.tokens != 1) {
        return None;
    }
    let mut h = DefaultHasher::new();
    for s in seqs {
        let want = match s.want {
            None => 0u8,
            Some(LogitsWanted::Last) => 1,
            Some(LogitsWanted::All) => 2,
            Some(LogitsWanted::Hidden) => 3,
        };
        (s.kv, s.handle, want, s.top).hash(&mut h);
    }
    Some(h.finish())
}

/// The segments of one step: the key of each, and whether one is open.
pub(crate) struct Segments {
    /// The step's shape and epoch hashed (`None`: segments off).
    base: Option<u64>,
    /// The next segment's index in the step.
    index: u64,
    open: bool,
}

impl Segments {
    /// No segments: every op runs as issued.
    pub(crate) fn off() -> Segments {
        Segments {
            base: None,
            index: 0,
            open: false,
        }
    }

    /// Segments of a step of shape `shape` in `epoch`.
    pub(crate) fn on(shape: u64, epoch: SegmentEpoch) -> Segments {
        let mut h = DefaultHasher::new();
        (shape, epoch.arena, epoch.kvs).hash(&mut h);
        Segments {
            base: Some(h.finish()),
            index: 0,
            open: false,
        }
    }

    /// The segments of group `group` of two micro-batches in flight (`micro_batches.rs`):
    /// keys of their own, off when these are.
    pub(crate) fn of_group(&self, group: usize) -> Segments {
        let base = self.base.map(|b| {
            let mut h = DefaultHasher::new();
            (b, "group", group).hash(&mut h);
            h.finish()
        });
        Segments {
            base,
            index: 0,
            open: false,
        }
    }

    /// Whether the step records or replays its segments.
    pub(crate) fn is_on(&self) -> bool {
        self.base.is_some()
    }

    /// Opens the step's next segment.
    pub(crate) fn begin<B: Backend>(&mut self, dev: &B) -> Result<(), BackendError> {
        let Some(base) = self.base else {
            return Ok(());
        };
        let mut h = DefaultHasher::new();
        (base, self.index).hash(&mut h);
        self.index += 1;
        dev.begin_segment(h.finish())?;
        self.open = true;
        Ok(())
    }

    /// Closes the open segment, if any (before a copy down, a wait or the host's work).
    pub(crate) fn end<B: Backend>(&mut self, dev: &B) -> Result<(), BackendError> {
        if !self.open {
            return Ok(());
        }
        self.open = false;
        dev.end_segment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_backend::Ref0;

    fn seq(kv: usize, handle: usize, tokens: usize) -> SeqShape {
        SeqShape {
            kv,
            handle,
            tokens,
            want: Some(LogitsWanted::Last),
            top: None,
        }
    }

    #[test]
    fn only_one_token_steps_have_a_shape() {
        assert!(step_shape(&[seq(0, 5, 2)]).is_none());
        assert!(step_shape(&[seq(0, 5, 1), seq(1, 6, 3)]).is_none());
        let a = step_shape(&[seq(0, 5, 1)]).unwrap();
        assert_eq!(step_shape(&[seq(0, 5, 1)]), Some(a));
        assert_ne!(step_shape(&[seq(1, 5, 1)]), Some(a));
        assert_ne!(step_shape(&[seq(0, 6, 1)]), Some(a));
        let mut all = seq(0, 5, 1);
        all.want = Some(LogitsWanted::All);
        assert_ne!(step_shape(&[all]), Some(a));
        let mut top = seq(0, 5, 1);
        top.top = Some(40);
        assert_ne!(step_shape(&[top]), Some(a));
        assert_ne!(step_shape(&[seq(0, 5, 1), seq(1, 6, 1)]), Some(a));
    }

    #[test]
    fn segment_keys_follow_the_index_and_off_opens_nothing() {
        let dev = Ref0::new().with_replay();
        let mut off = Segments::off();
        off.begin(&dev).unwrap();
        off.end(&dev).unwrap();
        assert_eq!(dev.replay_stats().recorded, 0);
        let epoch = SegmentEpoch::default();
        for _ in 0..2 {
            let mut s = Segments::on(1, epoch);
            for _ in 0..3 {
                s.begin(&dev).unwrap();
                s.end(&dev).unwrap();
            }
        }
        let st = dev.replay_stats();
        assert_eq!((st.recorded, st.replayed, st.errors), (3, 3, 0));
    }
}
