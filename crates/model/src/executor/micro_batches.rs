//! Two micro-batches in flight: a step of several sequences whose model has host-expert
//! layers runs as two groups of sequences, A and B, on one device stream, so that the device
//! runs one group's attention while the CPU runs the other's experts.
//!
//! Each group is a micro-batch of its own (its ids, positions, layers and logits, as
//! [`super::device_model::DeviceModel`] runs any step), issued by its own host thread; the
//! two threads take turns ([`Turns`]), so that exactly one of them issues device ops or runs
//! host experts at a time and the order of everything is the same in every step. A group
//! hands the turn over ([`Turn::hand_over`]) where it would otherwise wait for the device:
//! after a host layer's copy down is queued (before the host waits for it,
//! `expert_boundary.rs`), and before the logits' copy down. One layer of a decode step then
//! goes:
//!
//! ```text
//! A: attention L, router, copy down ─┐ hand over
//! B: expert sum L-1 of B (host) … copy up, attention L, router, copy down ─┐ hand over
//! A: wait for A's copy, experts L of A on the CPU (the device runs B's attention L), copy up,
//!    attention L+1 … copy down ─┐ hand over
//! B: wait for B's copy, experts L of B (the device runs A's attention L+1) …
//! ```
//!
//! Each group waits only for its own copy down (on CUDA the pinned buffer's event; each
//! group has its own staging buffers, `State::io`), so the device work the other group queued
//! meanwhile runs while the CPU computes. The results do not depend on the split: every op
//! is batch-invariant as the module docs of the executor say, so each sequence's logits are
//! those it gets alone, bit for bit.
//!
//! The executor splits a step ([`split_point`]) only when the model has a host-expert layer,
//! the step has two sequences or more, no op offload runs the host layers on the device for
//! it and the device expert cache is off; the groups are consecutive sequences with token
//! counts as even as possible. `HMOE_MICRO_BATCHES=0` (or `off`) turns the split off
//! ([`micro_batches_requested`]); [`super::DeviceModel::set_micro_batches`] sets it.
//!
//! Recorded segments (`segments.rs`) work per group: each group's segments have keys of their
//! own, and a group hands the turn over only with no segment open (a segment closes before
//! the copy down and the logits), so the two groups' segments never nest.

use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use hmoe_backend::Backend;

use super::state::State;

/// The environment switch: `HMOE_MICRO_BATCHES=0` (or `off`) runs every step as one
/// micro-batch.
pub const MICRO_BATCHES_ENV: &str = "HMOE_MICRO_BATCHES";

/// Whether the environment leaves two micro-batches in flight on (anything but `0` or
/// `off`).
pub(crate) fn micro_batches_requested() -> bool {
    switch_on(std::env::var(MICRO_BATCHES_ENV).ok().as_deref())
}

/// Whether a value of the switch leaves it on (unset, or anything but `0` or `off`).
fn switch_on(v: Option<&str>) -> bool {
    !v.is_some_and(|v| matches!(v.trim(), "0" | "off"))
}

/// Where a step of sequences of `tokens` tokens each splits into two groups (the first
/// `at` sequences, then the rest), the token counts as even as possible; `None` for fewer
/// than two sequences.
pub(crate) fn split_point(tokens: &[usize]) -> Option<usize> {
    let total: usize = tokens.iter().sum();
    let mut before = 0;
    let mut best: Option<(usize, usize)> = None;
    for (at, &t) in tokens
        .iter()
        .enumerate()
        .take(tokens.len().saturating_sub(1))
    {
        before += t;
        let gap = before.abs_diff(total - before);
        if best.is_none_or(|(g, _)| gap < g) {
            best = Some((gap, at + 1));
        }
    }
    best.map(|(_, at)| at)
}

/// What the two groups share: the state, whose turn it is and which has finished.
struct Shared<B: Backend> {
    state: State<B>,
    holder: usize,
    done: [bool; 2],
}

/// The turns of the two groups of a step over the executor's state (see the module docs).
pub(crate) struct Turns<B: Backend> {
    shared: Mutex<Shared<B>>,
    cv: Condvar,
}

impl<B: Backend> Turns<B> {
    /// Turns over `state`, group 0's first.
    pub(crate) fn new(state: State<B>) -> Turns<B> {
        Turns {
            shared: Mutex::new(Shared {
                state,
                holder: 0,
                done: [false; 2],
            }),
            cv: Condvar::new(),
        }
    }

    /// The state back, once both groups are done.
    pub(crate) fn into_state(self) -> State<B> {
        let shared = self.shared.into_inner();
        shared.unwrap_or_else(PoisonError::into_inner).state
    }

    /// Runs group `me` (0 or 1): `f` over its turn, which it gets once the other group hands
    /// it over or is done. When `f` has returned (everything it held dropped: its scratch
    /// buffers back in the arena) or unwound, the group is done and the other runs to its end.
    pub(crate) fn run<R>(&self, me: usize, f: impl FnOnce(Turn<'_, B>) -> R) -> R {
        let _done = Done { turns: self, me };
        let g = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        let g = self.wait_for(g, me);
        f(Turn {
            turns: self,
            me,
            guard: Some(g),
        })
    }

    fn wait_for<'t>(
        &'t self,
        g: MutexGuard<'t, Shared<B>>,
        me: usize,
    ) -> MutexGuard<'t, Shared<B>> {
        let other = 1 - me;
        (self.cv.wait_while(g, |s| s.holder != me && !s.done[other]))
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Marks group `me` done when dropped (see [`Turns::run`]).
struct Done<'t, B: Backend> {
    turns: &'t Turns<B>,
    me: usize,
}

impl<B: Backend> Drop for Done<'_, B> {
    fn drop(&mut self) {
        let mut g = (self.turns.shared.lock()).unwrap_or_else(PoisonError::into_inner);
        g.done[self.me] = true;
        g.holder = 1 - self.me;
        self.turns.cv.notify_all();
    }
}

/// One group's turn: the state while it holds it ([`Turns::run`]).
pub(crate) struct Turn<'t, B: Backend> {
    turns: &'t Turns<B>,
    me: usize,
    /// `None` only inside [`Turn::hand_over`].
    guard: Option<MutexGuard<'t, Shared<B>>>,
}

impl<B: Backend> Turn<'_, B> {
    /// Hands the turn to the other group and waits for it back (no wait when the other is
    /// done).
    pub(crate) fn hand_over(&mut self) {
        let Some(mut g) = self.guard.take() else {
            return;
        };
        let other = 1 - self.me;
        if !g.done[other] {
            g.holder = other;
            self.turns.cv.notify_all();
            g = self.turns.wait_for(g, self.me);
        }
        self.guard = Some(g);
    }

    fn shared(&self) -> &Shared<B> {
        match &self.guard {
            Some(g) => g,
            None => unreachable!("a turn holds its guard outside `hand_over`"),
        }
    }

    fn shared_mut(&mut self) -> &mut Shared<B> {
        match &mut self.guard {
            Some(g) => g,
            None => unreachable!("a turn holds its guard outside `hand_over`"),
        }
    }
}

/// The state a micro-batch runs over: the step's own, or that of the group whose turn it is.
pub(crate) enum StepState<'s, B: Backend> {
    /// The step is one micro-batch.
    Alone(&'s mut State<B>),
    /// One of two micro-batches in flight.
    InFlight(Turn<'s, B>),
}

impl<B: Backend> StepState<'_, B> {
    /// Hands the turn to the other micro-batch in flight (before the host waits for the
    /// device) and takes it back; nothing for a step alone.
    pub(crate) fn hand_over(&mut self) {
        if let StepState::InFlight(t) = self {
            t.hand_over();
        }
    }

    /// The group whose staging buffers the micro-batch uses (0 alone).
    pub(crate) fn group(&self) -> usize {
        match self {
            StepState::Alone(_) => 0,
            StepState::InFlight(t) => t.me,
        }
    }
}

impl<B: Backend> Deref for StepState<'_, B> {
    type Target = State<B>;
    fn deref(&self) -> &State<B> {
        match self {
            StepState::Alone(s) => s,
            StepState::InFlight(t) => &t.shared().state,
        }
    }
}

impl<B: Backend> DerefMut for StepState<'_, B> {
    fn deref_mut(&mut self) -> &mut State<B> {
        match self {
            StepState::Alone(s) => s,
            StepState::InFlight(t) => &mut t.shared_mut().state,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_backend::Ref0;

    #[test]
    fn the_switch_turns_the_split_off_with_0_or_off() {
        for (v, on) in [(None, true), (Some("1"), true), (Some(""), true)] {
            assert_eq!(switch_on(v), on, "{v:?}");
        }
        for v in ["0", "off", " off "] {
            assert!(!switch_on(Some(v)), "{v:?}");
        }
    }

    #[test]
    fn the_split_evens_the_tokens() {
        assert_eq!(split_point(&[]), None);
        assert_eq!(split_point(&[1]), None);
        assert_eq!(split_point(&[1, 1]), Some(1));
        assert_eq!(split_point(&[1, 1, 1]), Some(1));
        assert_eq!(split_point(&[1, 1, 1, 1, 1]), Some(2));
        assert_eq!(split_point(&[8, 1, 1, 1]), Some(1));
        assert_eq!(split_point(&[1, 1, 1, 8]), Some(3));
    }

    #[test]
    fn turns_alternate_at_each_hand_over_and_end_with_the_group() {
        let turns = Turns::<Ref0>::new(State::default());
        let log = Mutex::new(Vec::new());
        let note = |s: &mut StepState<'_, Ref0>, what: &'static str| {
            s.stats.ubatches += 1;
            log.lock().unwrap().push((s.group(), what));
        };
        std::thread::scope(|sc| {
            sc.spawn(|| {
                turns.run(1, |t| {
                    let mut s = StepState::InFlight(t);
                    for what in ["b0", "b1", "b2"] {
                        note(&mut s, what);
                        s.hand_over();
                    }
                })
            });
            turns.run(0, |t| {
                let mut s = StepState::InFlight(t);
                for what in ["a0", "a1"] {
                    note(&mut s, what);
                    s.hand_over();
                }
            });
        });
        let order: Vec<_> = log.into_inner().unwrap();
        let want = [(0, "a0"), (1, "b0"), (0, "a1"), (1, "b1"), (1, "b2")];
        assert_eq!(order, want);
        assert_eq!(turns.into_state().stats.ubatches, 5);
    }
}
