//! What changes while the device model runs ([`State`]: the device caches of the
//! sequences, the staging buffers, the expert cache) and what it counts ([`ExecStats`]).

use hmoe_backend::Backend;

use super::device_kv::DeviceKv;
use super::host_experts::HostIo;
use super::moe_cache::MoeCache;
use super::segments::SegmentEpoch;
use crate::error::ModelError;
use crate::language_model::ExecStats;

/// What changes while running.
pub(crate) struct State<B: Backend> {
    /// The device caches of the sequences seen, in no order.
    pub(crate) kvs: Vec<DeviceKv<B>>,
    /// Counts cache uses, for freeing the least recently used.
    pub(crate) clock: u64,
    /// Handles of sequences under way (`LanguageModel::retain_caches`), never freed to
    /// make room.
    pub(crate) busy: Vec<usize>,
    /// The staging buffers of the host round trip, one set per micro-batch in flight
    /// (`micro_batches.rs`; a step alone uses the first).
    pub(crate) io: [Option<HostIo<B>>; 2],
    pub(crate) stats: ExecStats,
    /// The device expert cache of the host layers (`--moe-cache`; empty: disabled).
    pub(crate) moe_cache: MoeCache<B>,
    /// Bytes of the op-offload ring (`None`: the largest ring, see `offload_ring.rs`).
    pub(crate) ring: Option<u64>,
    /// Bumped whenever a device cache is made or freed (`segments.rs`).
    pub(crate) kv_generation: u64,
    /// The shape and epoch of the last step that succeeded, when it could have had
    /// segments (`segments.rs`): a step that repeats it records or replays them.
    pub(crate) last_shape: Option<(u64, SegmentEpoch)>,
    /// The epoch the device's recordings belong to (dropped when it moves).
    pub(crate) segment_epoch: SegmentEpoch,
}

impl<B: Backend> Default for State<B> {
    fn default() -> Self {
        State {
            kvs: Vec::new(),
            clock: 0,
            busy: Vec::new(),
            io: [None, None],
            stats: ExecStats::default(),
            moe_cache: MoeCache::default(),
            ring: None,
            kv_generation: 0,
            last_shape: None,
            segment_epoch: SegmentEpoch::default(),
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
        let evicted = lru.map(|i| self.kvs.swap_remove(i)).is_some();
        self.kv_generation += u64::from(evicted);
        evicted
    }

    /// The index in `kvs` of the device cache of `handle`.
    pub(crate) fn slot_of(&self, handle: usize) -> Result<usize, ModelError> {
        (self.kvs.iter().position(|kv| kv.handle == handle))
            .ok_or_else(|| ModelError::Cache("no device cache for this handle".into()))
    }
}
