//! Inputs shared by the GPU tests (`gpu.rs`) and the host emulation (`emulated.rs`).

use hmoe_backend::{AttnParams, Backend, GatedAct, Ref0, RefMoe};
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

/// The activation of the MoE kernels, as the contract's `moe` takes it.
pub const KERNEL_ACT: GatedAct = GatedAct::ClampedSwiglu {
    alpha: 1.702,
    limit: 7.0,
};

/// The reference device's expert sum of `x` over `m` with activation `act` (host slices in,
/// the result out).
pub fn ref_moe(
    cpu: &Ref0,
    m: &RefMoe,
    act: GatedAct,
    x: &[f32],
    sel: &[i32],
    wts: &[f32],
    k: usize,
) -> Vec<f32> {
    let (xd, sd, wd) = (
        cpu.upload(x).unwrap(),
        cpu.upload(sel).unwrap(),
        cpu.upload(wts).unwrap(),
    );
    let mut out = cpu.alloc::<f32>(x.len()).unwrap();
    cpu.moe(m, act, &xd, &sd, &wd, k, &mut out).unwrap();
    cpu.download(&out).unwrap()
}

/// The reference device's attention over f16 rings given as host slices.
#[allow(clippy::too_many_arguments)]
pub fn ref_attention(
    cpu: &Ref0,
    p: &AttnParams,
    q: &[f32],
    k_bits: &[u16],
    v_bits: &[u16],
    sinks: Option<&[f32]>,
    n_tokens: usize,
    pos0: usize,
) -> Vec<f32> {
    let (qd, kd, vd) = (
        cpu.upload(q).unwrap(),
        cpu.upload(k_bits).unwrap(),
        cpu.upload(v_bits).unwrap(),
    );
    let sd = sinks.map(|s| cpu.upload(s).unwrap());
    let mut out = cpu.alloc::<f32>(q.len()).unwrap();
    cpu.attention(p, &qd, &kd, &vd, sd.as_ref(), n_tokens, pos0, &mut out)
        .unwrap();
    cpu.download(&out).unwrap()
}
