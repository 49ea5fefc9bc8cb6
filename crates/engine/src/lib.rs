//! Generation on top of a model: sampling and the prompt/decode loop.
#![warn(missing_docs)]

mod bench;
mod generate;
mod sampler;

pub use bench::{
    kv_bytes_per_token, mean, measure_read_bandwidth, run_test, stddev, BenchConfig, BenchError,
    BenchSamples, BenchTest, WeightTraffic,
};
pub use generate::{top_probs, Generation, Generator, StepObserver, Timings};
pub use sampler::{Sampler, SamplerParams};
