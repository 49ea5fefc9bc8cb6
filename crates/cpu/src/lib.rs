//! The CPU's kernels and the CPU as a device of the contract (`docs/architecture.md`, the
//! `backend` layer): attention over the K/V cache (the row kernel and flash attention, every
//! `-ctk`/`-ctv` type), the K/V storage, the row kernels (RMSNorm, matmul over quantized
//! weights, softmax, SwiGLU), the routed-expert kernels, and [`Cpu`], the
//! `hmoe_backend::Backend` built from them. They know no architecture; the architectures
//! (crate `hmoe-model`) call them.
#![warn(missing_docs)]

pub mod allocator;
pub mod attention;
mod device;
mod experts;
pub mod kv_storage;
pub mod ops;
#[cfg(test)]
mod ref0_kv_tests;

pub use device::{
    host_memory, set_expert_interleaving, Cpu, CpuBuf, CpuMatrix, CpuMoe, HostMemory, CPU_NAME,
};
