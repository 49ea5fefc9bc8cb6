//! REF0's op log ([`crate::Ref0::with_op_log`]): the order in which an executor queued the
//! device's ops and the host round trips' copies and waits, so that CI can check what a
//! schedule queues before the host waits (two micro-batches in flight: one group's attention
//! queued between the other's copy down and the host's wait for it) without a GPU.

use std::sync::{Mutex, PoisonError};

/// One entry of REF0's op log, in the order the device was asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ref0Event {
    /// A device op queued (its name, as REF0's replay mode records it).
    Op(&'static str),
    /// A round trip's copy down queued into the staging buffers of id `0`
    /// ([`crate::HostStaging::id`]).
    StageDown(usize),
    /// The host waited for the copy down into the staging buffers of id `0` (`staged`).
    Staged(usize),
    /// The expert sum in the staging buffers of id `0` queued up.
    StageUp(usize),
}

/// The op log of one REF0 device (inert unless enabled).
pub(crate) struct OpLog {
    enabled: bool,
    events: Mutex<Vec<Ref0Event>>,
}

impl OpLog {
    /// A log, kept when `enabled`.
    pub(crate) fn new(enabled: bool) -> OpLog {
        OpLog {
            enabled,
            events: Mutex::new(Vec::new()),
        }
    }

    /// Notes `e` when the log is kept.
    pub(crate) fn note(&self, e: Ref0Event) {
        if self.enabled {
            (self.events.lock())
                .unwrap_or_else(PoisonError::into_inner)
                .push(e);
        }
    }

    /// The events noted so far, the log emptied.
    pub(crate) fn take(&self) -> Vec<Ref0Event> {
        std::mem::take(&mut *self.events.lock().unwrap_or_else(PoisonError::into_inner))
    }
}
