//! CUDA backend for hmoe: device probe, NVRTC-compiled kernels for the ops of the device
//! contract (`hmoe-backend`: embedding gather, RMSNorm, GEMV/GEMM for F32/F16/BF16/Q8_0/MXFP4
//! weights with ggml's activation conversion (Q8_0 activations for Q8_0/MXFP4 weights), and
//! for the low-bit types of GGUF files (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K … Q6_K: Q8_0/Q8_1/Q8_K
//! activations, the CPU device's kernel orders, in matmuls, embedding rows and experts), NeoX
//! RoPE with YaRN, attention with sinks, sliding window and GQA over f32/f16/Q8_0/Q4_0 K/V rings
//! (the CPU's chunked flash kernel with `-fa on` and over quantized values, split over the
//! positions for decode, and its row kernel over float values with `-fa off`), router
//! top-k + softmax, residual/bias adds, and the MXFP4 MoE expert block; batches of Q8_0/MXFP4
//! products run tiled kernels with shared-memory tiles, on int8 tensor cores (`mma.sync`) from
//! sm_80 and with `__dp4a` before, all with the same bits),
//! device buffers and transfers (uploads from the file mapping through pinned buffers).
//! [`CudaDevice`] implements [`hmoe_backend::Backend`]; this crate knows no architecture (the
//! executor that runs a model over it is `hmoe_model::executor`).
//!
//! Every entry point works on a machine without CUDA: the driver library is loaded at run
//! time (never linked), and before any CUDA call the crate checks that it can be loaded, so
//! the answer there is [`CudaError::NoDriver`], never a panic.
//!
//! Kernels are CUDA C in `kernels/*.cu` (one source, [`kernels::SOURCE`]), compiled once per device architecture by NVRTC at
//! [`CudaDevice::new`] and cached on disk as PTX (see [`cache`]).
#![warn(missing_docs)]

pub mod backend;
pub mod cache;
mod device;
mod error;
mod graphs;
mod host_slots;
pub mod kernels;
mod mem_pool;
mod probe;
mod profile;
mod staging;

pub use cudarc::driver::{CudaSlice, PinnedHostSlice};
pub use device::{
    expert_types_supported, kv_pair_supported, ChunkedShape, CudaDevice, DeviceExperts,
    DeviceMatrix, ExpertAct, MoeWeights, CAPABILITIES, CUBLAS_MIN_TOKENS, KV_TYPES, K_ONLY_TYPES,
    LOWBIT_TYPES, ROUTER_FUSED_MAX_TOKENS, SUPPORTED_TYPES,
};
pub use error::CudaError;
pub use graphs::{graphs_requested, GRAPHS_ENV};
pub use hmoe_backend::{AttnParams, RopeParams};
pub use mem_pool::{pool_keep_requested, POOL_KEEP_ENV};
pub use probe::{
    cublas_present, device_count, driver_present, nvrtc_present, probe, probe_one, GpuInfo,
};

/// Whether the environment switch `name` is on: unset or anything but `0` or `off` (the
/// switches of features that are on by default, `HMOE_CUDA_GRAPHS` and `HMOE_CUDA_POOL_KEEP`).
fn default_on(name: &str) -> bool {
    !std::env::var(name).is_ok_and(|v| matches!(v.trim(), "0" | "off"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_default_on_switch_is_off_with_0_or_off_only() {
        // A variable of this test's own: the process's environment is shared by the tests.
        const NAME: &str = "HMOE_CUDA_TEST_DEFAULT_ON";
        for (v, on) in [
            ("0", false),
            ("off", false),
            (" 0 ", false),
            ("1", true),
            ("", true),
        ] {
            std::env::set_var(NAME, v);
            assert_eq!(super::default_on(NAME), on, "{NAME}={v:?}");
        }
        std::env::remove_var(NAME);
        assert!(super::default_on(NAME));
    }
}
