//! The CPU engine's kernels (DESIGN.md §1, the `backend` layer): attention over the K/V cache
//! (the row kernel and flash attention, every `-ctk`/`-ctv` type) and the cache itself. They
//! know no architecture; the architectures (crate `hmoe-model`) call them.

pub mod attention;
pub mod kv_cache;
pub mod ops;
#[cfg(test)]
mod ref0_kv_tests;

pub use kv_cache::{KvCache, KvType};
