//! Inputs shared by the GPU tests (`gpu.rs`) and the host emulation (`emulated.rs`).

use hmoe_quant::{quantize_row, GgmlType};
use rand::rngs::StdRng;
use rand::Rng;

/// The weight types the kernels multiply.
pub const TYPES: [GgmlType; 5] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::MXFP4,
];

/// `n` values uniform in `[-scale, scale)`.
pub fn noise(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// Activations for the Q8_0 quantizer: blocks at scales from 1e-30 to 1e4, an all-zero block,
/// and ties (amax 127 makes the multiplier 1, so x.5 rounds to even); with the bytes the CPU
/// quantizer makes of them.
pub fn quantizer_cases(rng: &mut StdRng) -> (Vec<f32>, Vec<u8>) {
    let mut x = Vec::new();
    for scale in [1e-3f32, 0.5, 3.0, 1e4, 1e-30] {
        x.extend(noise(rng, 32 * 7, scale));
    }
    x.extend([0.0f32; 32]);
    let mut ties = vec![0.5f32, 1.5, 2.5, -2.5, -3.5, 126.5, -126.5, 127.0];
    ties.resize(32, 0.25);
    x.extend(ties);
    let mut want = vec![0u8; x.len() / 32 * 34];
    quantize_row(GgmlType::Q8_0, &x, &mut want).unwrap();
    (x, want)
}
