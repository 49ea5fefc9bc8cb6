//! `HMOE_CUDA_PROFILE=1`: GPU time per kernel, measured with CUDA events around every launch,
//! and how much of the time between the first and the last launch the GPU spent in kernels
//! (the rest is copies, memsets and the GPU waiting for the host). The device prints the table
//! when it is dropped (at the end of `hmoe bench`, `run` or `serve`), so a bench run's figure
//! per token is the table's total over the tokens it ran.
//!
//! Events are only read when the device synchronizes (and when many are pending), so the
//! profile adds two event records per launch and no host wait between launches.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::driver::{CudaEvent, DriverError};

/// Pending launches beyond which the profile reads the events without waiting for a
/// synchronization (a bound on the events alive at once).
const MAX_PENDING: usize = 4096;

/// Whether `HMOE_CUDA_PROFILE` asks for the profile (`1`, `on` or `true`).
pub(crate) fn requested() -> bool {
    matches!(
        std::env::var("HMOE_CUDA_PROFILE").as_deref(),
        Ok("1" | "on" | "true")
    )
}

/// The kernels' times so far.
#[derive(Default)]
pub(crate) struct Profile {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Launches whose events have not been read: kernel, start, end.
    pending: Vec<(&'static str, CudaEvent, CudaEvent)>,
    /// Per kernel: launches and milliseconds.
    totals: BTreeMap<&'static str, (u64, f64)>,
    /// The first launch's start event, the span's origin.
    first: Option<CudaEvent>,
    /// Milliseconds from the first launch's start to the last read launch's end.
    span_ms: f64,
}

impl Profile {
    /// Records one launch of `kernel` between `start` and `end` (events with timing).
    pub(crate) fn launched(&self, kernel: &'static str, start: CudaEvent, end: CudaEvent) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.pending.push((kernel, start, end));
        if s.pending.len() >= MAX_PENDING {
            // Reading waits for these launches; a profile run accepts that.
            let _ = s.settle();
        }
    }

    /// Reads the pending events (the caller has synchronized, or accepts waiting for them).
    pub(crate) fn settle(&self) -> Result<(), DriverError> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .settle()
    }

    /// The table: kernels by GPU time, with launches, total and mean time and share, then
    /// the time in kernels against the span from the first launch to the last.
    pub(crate) fn report(&self) -> String {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let busy: f64 = s.totals.values().map(|t| t.1).sum();
        let launches: u64 = s.totals.values().map(|t| t.0).sum();
        let mut rows: Vec<_> = s.totals.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let mut out = String::from(
            "cuda profile (HMOE_CUDA_PROFILE): kernel, launches, GPU ms, mean µs, share\n",
        );
        for (name, &(n, ms)) in rows {
            out += &format!(
                "  {name:<28} {n:>9} {ms:>11.3} {:>9.2} {:>6.1}%\n",
                ms * 1e3 / n as f64,
                100.0 * ms / busy.max(f64::MIN_POSITIVE)
            );
        }
        out += &format!(
            "  {launches} launches, {busy:.3} ms in kernels over a span of {:.3} ms from the first \
             launch to the last ({:.1}% busy; the rest is copies, memsets and waiting for the host)\n",
            s.span_ms,
            100.0 * busy / s.span_ms.max(f64::MIN_POSITIVE)
        );
        out
    }
}

impl State {
    fn settle(&mut self) -> Result<(), DriverError> {
        let mut last = None;
        for (kernel, start, end) in std::mem::take(&mut self.pending) {
            let ms = start.elapsed_ms(&end)? as f64;
            let t = self.totals.entry(kernel).or_default();
            t.0 += 1;
            t.1 += ms;
            if self.first.is_none() {
                self.first = Some(start);
            }
            last = Some(end);
        }
        if let (Some(first), Some(end)) = (&self.first, &last) {
            self.span_ms = first.elapsed_ms(end)? as f64;
        }
        Ok(())
    }
}
