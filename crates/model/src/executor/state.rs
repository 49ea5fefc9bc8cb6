//! What changes while the device model runs ([`State`]: the device caches of the
//! sequences, the staging buffers, the expert cache) and what it counts ([`ExecStats`]).

use hmoe_backend::Backend;

use super::device_kv::DeviceKv;
use super::host_experts::HostIo;
use super::moe_cache::MoeCache;
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
    pub(crate) io: Option<HostIo<B>>,
    pub(crate) stats: ExecStats,
    /// The device expert cache of the host layers (`--moe-cache`; empty: disabled).
    pub(crate) moe_cache: MoeCache<B>,
    /// Bytes of the op-offload ring (`None`: the largest ring, see `offload_ring.rs`).
    pub(crate) ring: Option<u64>,
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
            ring: None,
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
