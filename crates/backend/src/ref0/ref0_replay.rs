//! REF0's replay mode ([`crate::Ref0::with_replay`]): what a CUDA graph does to a segment of a
//! step ([`crate::Backend::begin_segment`]), on the host, so that CI catches what a graph would
//! get wrong without a GPU. The first time a segment's key is seen, every op queued in it is
//! recorded: its name, the buffers it names (their addresses and lengths) and its by-value
//! arguments. When the key is seen again the ops are replayed: each op issued must be the
//! recording's next one over the same buffers, and it runs with the recording's by-value
//! arguments, not the ones issued, as a graph's kernels run with the arguments captured. A
//! value that varies from step to step but reaches an op by value (a position, a length) is
//! then frozen at the recording's, and the replayed step's results differ from a fresh run's;
//! [`ReplayStats::stale_scalars`] counts such ops. An allocation, a transfer or a wait inside
//! a segment (which a graph cannot hold), an op that is not the recording's, or a segment that
//! ends early are errors.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::BackendError;

/// What REF0's replay mode counted ([`crate::Ref0::replay_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Segments recorded.
    pub recorded: u64,
    /// Segments replayed from a recording.
    pub replayed: u64,
    /// Ops run from a recording.
    pub replayed_ops: u64,
    /// Replayed ops issued with by-value arguments other than the recording's (they ran with
    /// the recording's, as a graph would).
    pub stale_scalars: u64,
    /// Errors inside segments (an op not the recording's, an allocation or transfer inside).
    pub errors: u64,
}

/// A buffer as a recording names it: its address and length.
pub(crate) type Ident = (usize, usize);

/// One recorded op.
struct OpRecord {
    op: &'static str,
    bufs: Vec<Ident>,
    scalars: Box<dyn Any + Send>,
}

/// Whether a segment is open, and what it does.
enum Mode {
    /// No segment open: ops run as issued.
    Outside,
    /// Recording segment `key`.
    Recording(u64, Vec<OpRecord>),
    /// Replaying segment `key`, at its op `next`.
    Replaying(u64, usize),
}

struct Inner {
    mode: Mode,
    recordings: HashMap<u64, Vec<OpRecord>>,
    stats: ReplayStats,
}

/// The replay state of one REF0 device (inert unless enabled).
pub(crate) struct Replay {
    enabled: bool,
    inner: Mutex<Inner>,
}

fn replay_error(what: String) -> BackendError {
    BackendError::Device {
        device: crate::REF0_NAME.into(),
        message: format!("replay: {what}"),
    }
}

impl Replay {
    /// A replay state, recording and replaying segments when `enabled`.
    pub(crate) fn new(enabled: bool) -> Replay {
        Replay {
            enabled,
            inner: Mutex::new(Inner {
                mode: Mode::Outside,
                recordings: HashMap::new(),
                stats: ReplayStats::default(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What was counted.
    pub(crate) fn stats(&self) -> ReplayStats {
        self.lock().stats
    }

    /// `Err(e)` counted as an error inside a segment.
    fn fail<T>(inner: &mut Inner, what: String) -> Result<T, BackendError> {
        inner.stats.errors += 1;
        Err(replay_error(what))
    }

    /// Opens segment `key`: replayed if recorded, else recorded.
    pub(crate) fn begin(&self, key: u64) -> Result<(), BackendError> {
        if !self.enabled {
            return Ok(());
        }
        let mut g = self.lock();
        if !matches!(g.mode, Mode::Outside) {
            return Self::fail(&mut g, format!("segment {key:#x} opened inside another"));
        }
        g.mode = match g.recordings.contains_key(&key) {
            true => Mode::Replaying(key, 0),
            false => Mode::Recording(key, Vec::new()),
        };
        Ok(())
    }

    /// Closes the open segment (a recording is kept; a replay must have run every op).
    pub(crate) fn end(&self) -> Result<(), BackendError> {
        if !self.enabled {
            return Ok(());
        }
        let mut g = self.lock();
        match std::mem::replace(&mut g.mode, Mode::Outside) {
            Mode::Outside => Self::fail(&mut g, "no segment open to end".into()),
            Mode::Recording(key, ops) => {
                g.recordings.insert(key, ops);
                g.stats.recorded += 1;
                Ok(())
            }
            Mode::Replaying(key, next) => {
                let n = g.recordings.get(&key).map_or(0, Vec::len);
                if next != n {
                    return Self::fail(
                        &mut g,
                        format!("segment {key:#x} ended after {next} of its {n} ops"),
                    );
                }
                g.stats.replayed += 1;
                Ok(())
            }
        }
    }

    /// Drops every recording and closes an open segment.
    pub(crate) fn forget(&self) {
        let mut g = self.lock();
        g.mode = Mode::Outside;
        g.recordings.clear();
    }

    /// An op `op` over the buffers `bufs` with the by-value arguments `scalars`: the
    /// arguments it runs with (outside a segment and while recording, `scalars`; while
    /// replaying, the recording's), or the error of an op that is not the recording's next.
    pub(crate) fn op<S: Clone + PartialEq + Send + 'static>(
        &self,
        op: &'static str,
        bufs: &[Ident],
        scalars: S,
    ) -> Result<S, BackendError> {
        if !self.enabled {
            return Ok(scalars);
        }
        let mut g = self.lock();
        let Inner {
            mode,
            recordings,
            stats,
        } = &mut *g;
        match mode {
            Mode::Outside => Ok(scalars),
            Mode::Recording(_, ops) => {
                ops.push(OpRecord {
                    op,
                    bufs: bufs.to_vec(),
                    scalars: Box::new(scalars.clone()),
                });
                Ok(scalars)
            }
            Mode::Replaying(key, next) => {
                let rec = recordings.get(key).and_then(|r| r.get(*next));
                let recorded = rec
                    .filter(|r| r.op == op && r.bufs == bufs)
                    .and_then(|r| r.scalars.downcast_ref::<S>());
                let Some(recorded) = recorded.cloned() else {
                    let what = match rec {
                        Some(r) => format!(
                            "op {} of segment {key:#x} is {op} over {bufs:?}, recorded as {} \
                             over {:?}",
                            *next, r.op, r.bufs
                        ),
                        None => format!("{op} past the end of segment {key:#x}"),
                    };
                    stats.errors += 1;
                    return Err(replay_error(what));
                };
                if recorded != scalars {
                    stats.stale_scalars += 1;
                }
                stats.replayed_ops += 1;
                *next += 1;
                Ok(recorded)
            }
        }
    }

    /// `Ok` outside a segment; inside one, the error of `what` (an allocation, a transfer or
    /// a wait, which a graph cannot hold).
    pub(crate) fn outside(&self, what: &'static str) -> Result<(), BackendError> {
        if !self.enabled {
            return Ok(());
        }
        let mut g = self.lock();
        match g.mode {
            Mode::Outside => Ok(()),
            _ => Self::fail(&mut g, format!("{what} inside a recorded segment")),
        }
    }
}

#[cfg(test)]
#[path = "ref0_replay_tests.rs"]
mod tests;
