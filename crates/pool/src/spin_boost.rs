//! A longer idle poll while a user needs it ([`ThreadPool::boost_spin`]): the hybrid's
//! decode hands each layer's experts to the pool after a GPU phase of a few hundred
//! microseconds at most, longer than [`crate::DEFAULT_SPIN`], so without a boost every layer
//! would begin by waking parked workers through a futex.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::{Shared, ThreadPool};

/// While alive, idle workers of its pool poll for at least the boosted time before they park
/// (see [`ThreadPool::boost_spin`]).
pub struct SpinBoost<'p> {
    shared: Option<&'p Shared>,
}

impl std::fmt::Debug for SpinBoost<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpinBoost")
            .field("active", &self.shared.is_some())
            .finish()
    }
}

impl ThreadPool {
    /// Makes idle workers poll for at least `spin` before they park until the returned guard
    /// drops (several guards at once: the longest time asked for so far, until the last
    /// drops). Does nothing on a pool whose poll time was set by hand (`HMOE_POOL_SPIN_US`):
    /// that setting wins.
    pub fn boost_spin(&self, spin: Duration) -> SpinBoost<'_> {
        if !self.boostable {
            return SpinBoost { shared: None };
        }
        let sh = &*self.shared;
        let us = u64::try_from(spin.as_micros()).unwrap_or(u64::MAX);
        sh.boost_us.fetch_max(us, Ordering::Relaxed);
        sh.boosts.fetch_add(1, Ordering::Relaxed);
        SpinBoost { shared: Some(sh) }
    }

    /// How long an idle worker polls now before it parks.
    pub fn poll_time(&self) -> Duration {
        self.shared.poll_time()
    }
}

impl Shared {
    /// The pool's poll time, or the boosted one while a [`SpinBoost`] lives.
    pub(crate) fn poll_time(&self) -> Duration {
        match self.boosts.load(Ordering::Relaxed) {
            0 => self.spin,
            _ => self
                .spin
                .max(Duration::from_micros(self.boost_us.load(Ordering::Relaxed))),
        }
    }
}

impl Drop for SpinBoost<'_> {
    fn drop(&mut self) {
        if let Some(sh) = self.shared {
            sh.boosts.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
