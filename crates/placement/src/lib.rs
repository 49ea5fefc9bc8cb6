//! Placement planning for hmoe: which device holds each tensor, and how much memory each
//! device needs (weights, KV cache, compute buffers), with llama.cpp's flag semantics
//! (`-ngl`, `--cpu-moe`, `--n-cpu-moe`, `-ot`, `-c`, `-ctk/-ctv`, `-b/-ub`, `-np`, `--fit`).
//!
//! Everything here is a pure function of (tensor table, hyperparameters, device budgets,
//! flags): no file I/O, no GPU. [`plan`] is the entry point; the memory model is documented in
//! the `plan` module ([`plan()`]'s docs list the rules).

mod device;
mod error;
mod flags;
mod plan;
mod presets;
mod shape;
mod tensor;

pub use device::{DeviceBudget, DeviceId, GpuBudget, DEFAULT_GPU_OVERHEAD};
pub use error::{PlacementError, Shortfall};
pub use flags::{
    parse_cache_type, parse_override_list, parse_size, shell_quote, GpuLayers, PlacementFlags,
    TensorRule, FFN_EXPS_REGEX, OP_OFFLOAD_MIN_BATCH,
};
pub use plan::{plan, DeviceUsage, Plan};
pub use presets::{gpt_oss_tensor_table, GptOssDims};
pub use shape::{HparamSource, ModelShape};
pub use tensor::{layer_group, tensor_kind, LayerGroup, TensorDesc, TensorKind};
