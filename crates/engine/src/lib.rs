//! Generation on top of a model: sampling and the prompt/decode loop.

mod generate;
mod sampler;

pub use generate::{top_probs, Generation, Generator, StepObserver, Timings};
pub use sampler::{Sampler, SamplerParams};
