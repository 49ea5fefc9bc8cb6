//! Block quantisation formats used by GGUF files: the type table, dequantisation and dot-product
//! kernels (scalar reference plus SIMD paths chosen at run time).

mod types;

pub use types::GgmlType;
