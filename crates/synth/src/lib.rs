//! Synthetic models: random-weight GGUF files with real architectures and tensor types, for
//! tests, demos and benchmarks (`hmoe make-test-model`).

mod gpt_oss;
mod vocab;

pub use gpt_oss::{gpt_oss_layout_writer, gpt_oss_writer, GptOssSpec};
pub use vocab::add_byte_vocab;
