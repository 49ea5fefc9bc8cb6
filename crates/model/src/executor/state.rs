//! What changes while the device model runs ([`State`]: the device caches of the
//! sequences, the staging buffers, the expert cache) and what it counts ([`ExecStats`]).

use hmoe_backend::{Backend, TransferCounts};

use super::device_kv::DeviceKv;
use super::host_experts::HostIo;
use super::moe_cache::MoeCache;
use crate::error::ModelError;

/// Transfers at the expert boundary, counted by the executor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Micro-batches run.
    pub ubatches: u64,
    /// Round trips to the host experts (one per host layer per micro-batch).
    pub host_round_trips: u64,
    /// Bytes brought down for them: hidden state, expert ids and weights.
    pub bytes_to_host: u64,
    /// Bytes sent back up: the expert sums.
    pub bytes_to_device: u64,
    /// Host layers run on the device by op offload (one per such layer per micro-batch).
    pub offloaded_layers: u64,
    /// Experts uploaded for them (each routed expert once per offloaded layer).
    pub offloaded_experts: u64,
    /// Bytes of those uploads (weights and biases).
    pub offload_bytes: u64,
    /// Offloaded layers whose upload (of every expert) was started while the host layer
    /// before them ran (see `PREFETCH_ROUTES_PER_EXPERT`).
    pub prefetched_layers: u64,
    /// Every host ↔ device copy the device counted (weights at load included), for a device
    /// that counts them ([`Backend::transfers`]).
    pub transfers: Option<TransferCounts>,
}

/// What changes while running.
pub(crate) struct State<B: Backend> {
    /// The device caches of the sequences seen, in no order.
    pub(crate) kvs: Vec<DeviceKv<B>>,
    /// Counts cache uses, for freeing the least recently used.
    pub(crate) clock: u64,
    /// Handles of sequences under way (`LanguageModel::retain_caches`), never freed to
    /// make room.
    pub(crate) busy: Vec<usize>,
    pub(crate) io: Option<HostIo<B>>,
    pub(crate) stats: ExecStats,
    /// The device expert cache of the host layers (`--moe-cache`; empty: disabled).
    pub(crate) moe_cache: MoeCache<B>,
}

impl<B: Backend> Default for State<B> {
    fn default() -> Self {
        State {
            kvs: Vec::new(),
            clock: 0,
            busy: Vec::new(),
            io: None,
            stats: ExecStats::default(),
            moe_cache: MoeCache::default(),
        }
    }
}

impl<B: Backend> State<B> {
    /// Frees the least recently used device cache whose handle is neither in `keep` nor busy;
    /// false when there is none.
    pub(crate) fn evict_idle(&mut self, keep: &[usize]) -> bool {
        let lru = (self.kvs.iter().enumerate())
            .filter(|(_, kv)| !keep.contains(&kv.handle) && !self.busy.contains(&kv.handle))
            .min_by_key(|(_, kv)| kv.last_used)
            .map(|(i, _)| i);
        lru.map(|i| self.kvs.swap_remove(i)).is_some()
    }

    /// The index in `kvs` of the device cache of `handle`.
    pub(crate) fn slot_of(&self, handle: usize) -> Result<usize, ModelError> {
        (self.kvs.iter().position(|kv| kv.handle == handle))
            .ok_or_else(|| ModelError::Cache("no device cache for this handle".into()))
    }
}
