//! The engine: choosing the device and loading the model on it ([`load`], one entry point for
//! every command and library user), and generation on top of a model: sampling, the
//! prompt/decode loop and the benchmark.
#![warn(missing_docs)]

mod bench;
mod config;
mod devices;
mod dry;
mod error;
mod generate;
mod load;
mod plan;
mod sampler;
mod sampler_stages;
mod select;

pub use bench::{
    kv_bytes_per_token, mean, measure_read_bandwidth, run_test, stddev, BenchConfig, BenchError,
    BenchSamples, BenchTest, WeightTraffic,
};
pub use config::{EngineConfig, MoeCacheFlag};
pub use devices::{
    device_budget, parse_device_list, selected_devices, Probed, Selected, REF0_DEFAULT_BYTES,
};
pub use dry::DryParams;
pub use error::{error_chain, EngineError};
pub use generate::{top_probs, Generation, Generator, StepObserver, Timings};
pub use hmoe_backend::TOP_K_MAX;
pub use load::{interleaves_experts, load, load_opened, start_threads, EngineUsed, LoadedEngine};
pub use plan::{plan_engine, plan_error, plan_flags, MoeCacheBudget, PlannedEngine};
pub use sampler::{Sampler, SamplerParams};
pub use sampler_stages::{Mirostat, SamplerStage};
pub use select::{
    backend_name, choose_engine, device_capabilities, device_k_only_types, device_keeps_kv,
    device_name, gpu_executor_arch, EngineChoice, EngineDevice, EngineInputs,
};
