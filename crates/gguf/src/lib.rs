//! GGUF v2/v3 files: a reader over memory-mapped files (or in-memory buffers) that also opens
//! split models (`NAME-00001-of-0000N.gguf`), and a writer.
//!
//! Reading is safe against hostile files: all parsing goes through a bounds-checked cursor over
//! a `&[u8]`, every count and length is checked against the bytes that remain before anything
//! is allocated, offsets are checked for overflow, and every tensor's data must be aligned and
//! lie inside its file. The only `unsafe` code creates the memory map and locks/unlocks heap
//! buffers with `mlock(2)`.
//!
//! ```no_run
//! use hmoe_gguf::{GgufModel, LoadOptions};
//! let model = GgufModel::open("model-00001-of-00003.gguf", LoadOptions::default())?;
//! println!("{:?}", model.metadata().architecture());
//! for t in model.tensors() {
//!     println!("{} {} {:?}", t.name, t.ty, t.dims);
//! }
//! let embd: &[u8] = model.tensor_data("token_embd.weight").unwrap_or_default();
//! # let _ = embd;
//! # Ok::<(), hmoe_gguf::GgufError>(())
//! ```
#![warn(missing_docs)]

mod error;
mod meta;
mod model;
mod parse;
mod writer;

pub use error::{GgufError, Result, TensorProblem};
pub use hmoe_quant::GgmlType;
pub use meta::{MetaType, MetaValue, Metadata};
pub use model::{
    split_path, split_shard_paths, GgufModel, LoadOptions, PageReleaser, SharedData, SharedOwner,
    KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT,
};
pub use parse::{
    GgufHeader, TensorInfo, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_META_ELEMENTS,
};
pub use writer::GgufWriter;
