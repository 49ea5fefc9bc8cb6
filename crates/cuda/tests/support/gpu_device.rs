//! The device and helpers shared by the GPU test files (`gpu.rs`, `gpu_moe.rs`, `gpu_fusions.rs`).

#![allow(dead_code)]

use std::sync::OnceLock;

use hmoe_cuda::CudaDevice;
use hmoe_quant::{dequantize_row, GgmlType};
use rand::rngs::StdRng;

use crate::common::random_weights;

/// The device shared by the tests (opened once: NVRTC compiles the kernels on first use).
pub fn device() -> Option<&'static CudaDevice> {
    static DEV: OnceLock<Option<CudaDevice>> = OnceLock::new();
    let dev = DEV.get_or_init(|| match hmoe_cuda::probe() {
        Ok(gpus) if !gpus.is_empty() => {
            Some(CudaDevice::new(0).unwrap_or_else(|e| panic!("a GPU is present but: {e}")))
        }
        _ => None,
    });
    if dev.is_none() {
        eprintln!("no CUDA device: skipped");
    }
    dev.as_ref()
}

/// `rows × cols` random weights in `ty` and their exact dequantised values.
pub fn weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let q = random_weights(rng, ty, rows, cols);
    let mut deq = vec![0f32; rows * cols];
    for r in 0..rows {
        dequantize_row(
            ty,
            &q[r * rb..(r + 1) * rb],
            &mut deq[r * cols..(r + 1) * cols],
        )
        .unwrap();
    }
    (q, deq)
}

/// `|got - want| <= tol · scale` element-wise, where `scale` is each value's error scale.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], scale: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!(
            (g - w).abs() <= tol * s.max(1e-6),
            "{what}[{i}]: got {g}, want {w} (scale {s}, tol {tol})"
        );
    }
}
