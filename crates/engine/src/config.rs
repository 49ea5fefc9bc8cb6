//! What a caller asks of the engine: the model file, how to open it, the K/V cache and the
//! placement flags ([`EngineConfig`]).

use std::path::PathBuf;

use hmoe_gguf::LoadOptions;
use hmoe_model::KvType;
use hmoe_placement::PlacementFlags;

/// `--moe-cache`: a size, or the placement's spare room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeCacheFlag {
    /// This many MiB (0: off).
    Mib(u64),
    /// What the placement leaves beyond `--fit-target` on the device.
    Auto,
}

/// How to choose the device and load a model: the one input of the engine's `load` and
/// `load_opened`, which `hmoe run`, `serve`, `bench`, `chat` and `perplexity` fill from
/// their flags.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The model file (for a split model, any of its shards).
    pub model: PathBuf,
    /// How to open it (mapping, locking, faulting in).
    pub load: LoadOptions,
    /// The K/V cache types and the attention mode.
    pub kv: KvType,
    /// `--device`: the devices to use by name (`CUDA0,REF0`, `none`); `None`: every CUDA GPU
    /// found.
    pub devices: Option<String>,
    /// `--gpu-mem`: the memory of each GPU of the plan in bytes; empty: their free memory.
    pub gpu_mem: Vec<u64>,
    /// The placement flags (`-ot` rules may name the devices as `devices` does).
    pub flags: PlacementFlags,
    /// Op offload: micro-batches of at least this many tokens run the experts of host layers
    /// on the device; `None` never.
    pub op_offload: Option<usize>,
    /// The device expert cache (`None`: off).
    pub moe_cache: Option<MoeCacheFlag>,
    /// Whether the caller asked for a GPU explicitly: a run on the CPU then warns why.
    pub asks_for_gpu: bool,
    /// Whether the K/V cache may live on the device (`false`: `--no-kv-offload`, which keeps
    /// it in RAM and so runs the executor on the CPU).
    pub kv_offload: bool,
}
