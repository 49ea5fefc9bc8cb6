//! CUDA graphs for the recorded segments of decode steps (the contract's `begin_segment`,
//! `end_segment` and `forget_segments`; the executor's `segments.rs` says where a step's
//! segments lie and when they repeat). The first time a segment's key is seen, its ops are
//! captured from the compute stream into a graph (stream capture: they are queued into the
//! graph, not run), which is instantiated and launched when the segment ends. When the key is
//! seen again the ops are not queued at all (each op of the contract returns at once while a
//! segment replays) and the graph is launched instead: one launch for the segment's ~100
//! kernels. The kernels read everything that varies from token to token from device buffers
//! (the ids and positions, uploaded before the segment), so the graph serves every token;
//! REF0's replay mode checks in CI that nothing reaches an op by value that a graph would
//! freeze (`hmoe_backend::Ref0::with_replay`).
//!
//! On by default where the device allocates stream-ordered (`cuMemAllocAsync`: the ops'
//! temporaries then become memory nodes of the graph), off with `HMOE_CUDA_GRAPHS=0` and
//! while the kernel profile is on (`HMOE_CUDA_PROFILE`: its timing events cannot be captured).
//! A capture that fails (an op the driver cannot capture, an instantiation error) turns them
//! off for the device's life: `end_segment` (or the op inside) reports the error, the executor
//! drops its recordings and runs the step again as issued, and every later step runs as issued.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};

use crate::error::CudaError;

/// The environment switch: `HMOE_CUDA_GRAPHS=0` turns graphs off.
pub const GRAPHS_ENV: &str = "HMOE_CUDA_GRAPHS";

/// Whether the environment leaves graphs on (anything but `0` or `off`).
pub fn graphs_requested() -> bool {
    crate::default_on(GRAPHS_ENV)
}

/// What the open segment does.
enum Mode {
    /// None open (or graphs off): ops run as issued.
    Outside,
    /// Capturing segment `key` from the compute stream.
    Capturing(u64),
    /// Replaying segment `key`: the ops issued return at once; its graph runs at the end.
    Replaying(u64),
}

/// A captured graph, held by the device whichever thread runs its steps.
struct Graph(CudaGraph);

// SAFETY: a CUDA graph and its executable are driver handles of the device's context, valid
// from any thread (`CudaGraph::launch` binds the context to the calling thread first); the
// device only reaches them under the `SegmentGraphs` lock, one thread at a time.
unsafe impl Send for Graph {}

struct Inner {
    mode: Mode,
    graphs: HashMap<u64, Graph>,
}

/// The graphs of one device's segments (see the module docs).
pub(crate) struct SegmentGraphs {
    on: AtomicBool,
    /// Whether a segment replays now (read by every op, so kept beside the lock).
    replaying: AtomicBool,
    inner: Mutex<Inner>,
}

impl SegmentGraphs {
    /// Graphs for a device, on when `on` (the device supports them and they are asked for).
    pub(crate) fn new(on: bool) -> SegmentGraphs {
        SegmentGraphs {
            on: AtomicBool::new(on),
            replaying: AtomicBool::new(false),
            inner: Mutex::new(Inner {
                mode: Mode::Outside,
                graphs: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether graphs are on.
    pub(crate) fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Whether a segment is being captured now: nothing may wait for the stream.
    pub(crate) fn capturing(&self) -> bool {
        matches!(self.lock().mode, Mode::Capturing(_))
    }

    /// Whether a segment replays now: an op issued returns at once (its graph runs it).
    pub(crate) fn replaying(&self) -> bool {
        self.replaying.load(Ordering::Relaxed)
    }

    /// Turns graphs off for good after `what` failed.
    fn give_up(&self, inner: &mut Inner, what: &str) {
        tracing::warn!("CUDA graphs off: {what}; decode steps run their kernels one by one");
        self.on.store(false, Ordering::Relaxed);
        self.replaying.store(false, Ordering::Relaxed);
        inner.mode = Mode::Outside;
        inner.graphs.clear();
    }

    /// Opens segment `key` on `stream`: replays its graph if it has one, else captures it.
    pub(crate) fn begin(&self, stream: &Arc<CudaStream>, key: u64) -> Result<(), CudaError> {
        if !self.on() {
            return Ok(());
        }
        let mut g = self.lock();
        if !matches!(g.mode, Mode::Outside) {
            self.give_up(&mut g, "a segment opened inside another");
            return Err(CudaError::Capture("a segment opened inside another".into()));
        }
        if g.graphs.contains_key(&key) {
            g.mode = Mode::Replaying(key);
            self.replaying.store(true, Ordering::Relaxed);
            return Ok(());
        }
        // Thread-local: another thread's driver calls (the CPU pool's) do not end it.
        match stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) {
            Ok(()) => g.mode = Mode::Capturing(key),
            // Nothing was captured: the segment's ops run as issued.
            Err(e) => self.give_up(&mut g, &format!("begin_capture: {e}")),
        }
        Ok(())
    }

    /// Closes the open segment: launches the replayed graph, or ends the capture,
    /// instantiates the graph and launches it. A capture that fails is an error (its ops
    /// did not run) and turns graphs off.
    pub(crate) fn end(&self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        let mut g = self.lock();
        match std::mem::replace(&mut g.mode, Mode::Outside) {
            Mode::Outside => Ok(()),
            Mode::Replaying(key) => {
                self.replaying.store(false, Ordering::Relaxed);
                let launched = g.graphs.get(&key).map(|graph| graph.0.launch());
                match launched {
                    Some(r) => Ok(r?),
                    None => Err(CudaError::Capture(format!("no graph for {key:#x}"))),
                }
            }
            Mode::Capturing(key) => {
                let graph = stream.end_capture(CUgraphInstantiate_flags(0));
                match graph {
                    Ok(Some(graph)) => {
                        graph.launch()?;
                        g.graphs.insert(key, Graph(graph));
                        Ok(())
                    }
                    Ok(None) => {
                        self.give_up(&mut g, "the capture was empty");
                        Err(CudaError::Capture("an empty capture".into()))
                    }
                    Err(e) => {
                        self.give_up(&mut g, &format!("end_capture: {e}"));
                        Err(CudaError::Capture(format!("end_capture: {e}")))
                    }
                }
            }
        }
    }

    /// Drops every graph and closes an open segment; a capture left open (its step failed)
    /// turns graphs off.
    pub(crate) fn forget(&self, stream: &Arc<CudaStream>) {
        let mut g = self.lock();
        self.replaying.store(false, Ordering::Relaxed);
        if let Mode::Capturing(_) = g.mode {
            // The graph of a failed step is dropped whatever the driver says.
            let _ = stream.end_capture(CUgraphInstantiate_flags(0));
            self.give_up(&mut g, "a step failed while its segment was captured");
        }
        g.mode = Mode::Outside;
        if !g.graphs.is_empty() {
            // Launches still running finish before their graphs go.
            let _ = stream.synchronize();
            g.graphs.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graphs_off_replay_nothing() {
        let g = SegmentGraphs::new(false);
        assert!(!g.on() && !g.replaying());
    }
}
