//! Synthetic models: random-weight GGUF files with real architectures and tensor types, for
//! tests, demos and benchmarks (`hmoe make-test-model`).
#![warn(missing_docs)]

mod deepseek2;
mod gpt_oss;
mod qwen3moe;
mod tensors;
mod vocab;

pub use deepseek2::{deepseek2_layout_writer, deepseek2_writer, Deepseek2Spec};
pub use gpt_oss::{gpt_oss_layout_writer, gpt_oss_writer, GptOssSpec, TOPIC_GAIN};
pub use qwen3moe::{qwen3moe_layout_writer, qwen3moe_writer, Qwen3MoeSpec};
pub use tensors::supported_weight_type;
pub use vocab::{add_byte_vocab, Family, DEEPSEEK_V3, GPT_OSS, QWEN3};
