//! Inputs shared by the GPU tests (`gpu.rs`, `gpu_moe.rs`) and the host emulation (`emulated.rs`).

use hmoe_backend::{AttnParams, Backend, GatedAct, KvLayout, KvRing, Ref0, RefMoe};
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

/// The low-bit weight types the kernels multiply (their own kernels and activations).
pub const LOWBIT_TYPES: [GgmlType; 9] = hmoe_cuda::LOWBIT_TYPES;

/// Matmul shapes `(rows, cols)` of the low-bit tests: a row count that is not a multiple of 8
/// (`vec_dot` and the tiled K-quant order) and one that is (the repacked Q4_0/Q4_K orders),
/// with two K-quant super-blocks per row and one.
pub const LOWBIT_MATMULS: [(usize, usize); 2] = [(13, 512), (16, 256)];

/// Token counts of the low-bit matmul tests: one token, a batch under the tiled K-quant
/// threshold (8), and two over it (the kernels take 8 tokens per warp; for repacked Q4_K:
/// whole groups of four and one more, the last warp's tokens in both orders for 13).
pub const LOWBIT_TOKENS: [usize; 4] = [1, 3, 9, 13];

/// The low-bit expert sets `[gate, up, down]` of the tests: each type alone, and the mixes of
/// Q4_K_M files (Q4_K gate/up with Q6_K down, Q5_0 with Q8_0 down).
pub fn lowbit_expert_sets() -> Vec<[GgmlType; 3]> {
    LOWBIT_TYPES
        .iter()
        .map(|&ty| [ty; 3])
        .chain([
            [GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K],
            [GgmlType::Q5_0, GgmlType::Q5_0, GgmlType::Q8_0],
        ])
        .collect()
}

/// The low-bit MoE tests' shape `(experts, d, ff, tokens, k)`.
pub const LOWBIT_MOE: (usize, usize, usize, usize, usize) = (4, 256, 256, 10, 2);

/// Expert ids of the low-bit MoE tests ([`LOWBIT_MOE`]): expert 1 in every token (10 slots:
/// the tiled K-quant order, more than the kernels' 8 slots per warp), the others 3 each, and
/// an id out of range.
pub const LOWBIT_SEL: [i32; 20] = [1, 0, 2, 1, 1, 3, 0, 1, 1, 2, 1, -1, 3, 1, 1, 0, 2, 1, 1, 3];

/// `rows × cols` random weights of `ty`: noise quantized by hmoe-quant where it quantizes the
/// type, else (the K-quants) random bytes with small f16 scales.
pub fn random_weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut q = vec![0u8; rows * rb];
    // The byte offsets of a K-quant super-block's f16 scales (d, and dmin where it has one).
    let scales: &[usize] = match ty {
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => {
            for row in q.chunks_exact_mut(rb) {
                quantize_row(ty, &noise(rng, cols, 1.0), row).unwrap();
            }
            return q;
        }
    };
    rng.fill(&mut q[..]);
    for block in q.chunks_exact_mut(ty.block_bytes()) {
        for &at in scales {
            let v = half::f16::from_f32(rng.random_range(1e-3f32..1e-2));
            block[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    q
}

/// Gives Q8_0/MXFP4 weights (rows of `cols`) extreme scales: zero, subnormal and, with `big`,
/// the largest (f16 65504; E8M0 2^126, 2^127: their products overflow), else E8M0 2^-1 and
/// f16 2^-14: one such scale in every block of a quarter of the rows, and in a quarter of the
/// blocks of another quarter.
pub fn extreme_scales(rng: &mut StdRng, ty: GgmlType, q: &mut [u8], cols: usize, big: bool) {
    let (e, d): (&[u8], &[u16]) = if big {
        (&[0, 1, 2, 254, 255], &[0, 1, 0x3ff, 0x400, 0x7bff])
    } else {
        (&[0, 1, 2, 127], &[0, 1, 0x3ff, 0x400])
    };
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    for row in q.chunks_exact_mut(rb) {
        let (whole, pick) = (rng.random_range(0..4), rng.random_range(0..e.len()));
        for block in row.chunks_exact_mut(ty.block_bytes()) {
            let i = match whole {
                0 => pick,
                1 if rng.random_range(0..4) == 0 => rng.random_range(0..e.len()),
                _ => continue,
            };
            if ty == GgmlType::MXFP4 {
                block[0] = e[i];
            } else {
                block[..2].copy_from_slice(&d[i].to_le_bytes());
            }
        }
    }
}

/// Activations for the quantizer of `act` (Q8_0, Q8_1 or Q8_K): [`quantizer_cases`]' values
/// padded with noise to whole blocks of `act`, then a zero block; with the CPU's bytes.
pub fn act_quantizer_cases(rng: &mut StdRng, act: GgmlType) -> (Vec<f32>, Vec<u8>) {
    let (mut x, _) = quantizer_cases(rng);
    let block = act.block_elems();
    let pad = x.len().next_multiple_of(block) - x.len();
    x.extend(noise(rng, pad, 2.0));
    x.extend(vec![0f32; block]);
    let mut want = vec![0u8; act.row_bytes(x.len() as u64).unwrap() as usize];
    quantize_row(act, &x, &mut want).unwrap();
    (x, want)
}

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

/// The K/V ring types of the kernels' tests, as (K, V) pairs: f16/f32 values (the row kernel
/// with `-fa off`) and Q8_0/Q4_0 values (the chunked flash kernel whatever `-fa` says), keys
/// of every type.
pub const KV_PAIRS: [(GgmlType, GgmlType); 8] = [
    (GgmlType::F16, GgmlType::F16),
    (GgmlType::F32, GgmlType::F32),
    (GgmlType::Q8_0, GgmlType::F16),
    (GgmlType::Q4_0, GgmlType::F32),
    (GgmlType::Q8_0, GgmlType::Q8_0),
    (GgmlType::Q4_0, GgmlType::Q4_0),
    (GgmlType::F16, GgmlType::Q8_0),
    (GgmlType::F32, GgmlType::Q4_0),
];

/// The attention parameters of the kernels' tests for `n_head` query heads over `n_kv` K/V
/// heads of `hd` values in rings of `cells`, with `window` and `value_chains`: scale
/// `1/sqrt(hd)`, `flash` off: the row kernel over float values (`attn_row`; a test sets
/// `flash` for the chunked kernel).
pub fn attn_params(
    n_head: usize,
    n_kv: usize,
    hd: usize,
    cells: usize,
    window: Option<usize>,
    value_chains: usize,
) -> AttnParams {
    AttnParams {
        n_head,
        n_head_kv: n_kv,
        head_dim: hd,
        cells,
        window,
        scale: 1.0 / (hd as f32).sqrt(),
        value_chains,
        flash: false,
    }
}

/// Attention shapes of the kernels' tests: `(head_dim, window, cells, pos0, n_tokens)`: full
/// causal; a window in a ring smaller than the sequence (cells wrap); a prefill batch with a
/// window; one token after 520 (several rounds of chunks); head dims of 16 (no 64-element
/// step) and 80 (a tail after it); 128 (a K rotation of 128) and 32 (quantized, not rotated).
pub const ATTN_CASES: [(usize, Option<usize>, usize, usize, usize); 10] = [
    (64, None, 64, 20, 3),
    (64, Some(8), 12, 40, 2),
    (64, Some(8), 32, 0, 20),
    (64, None, 600, 520, 1),
    (16, Some(8), 16, 30, 1),
    (16, None, 40, 5, 7),
    (80, None, 40, 33, 1),
    (80, Some(20), 48, 10, 4),
    (128, Some(8), 24, 30, 3),
    (32, None, 40, 20, 2),
];

/// The K and V ring layouts of a test with heads of `hd` (`n_kv` of them) in `cells` cells,
/// rotated as the executor rotates them; `None` when the heads are not whole blocks.
pub fn kv_layouts(
    (kt, vt): (GgmlType, GgmlType),
    hd: usize,
    n_kv: usize,
    cells: usize,
) -> Option<(KvLayout, KvLayout)> {
    let layout = |ty: GgmlType, key: bool| {
        let rot = KvLayout::rotation(ty, hd, key);
        (hd.is_multiple_of(ty.block_elems()))
            .then(|| KvLayout::new(ty, n_kv * hd, cells, rot).unwrap())
    };
    Some((layout(kt, true)?, layout(vt, false)?))
}

/// The bytes of a ring of `layout` whose every cell the reference device stored from `rows`
/// (`cells × width` values).
pub fn ref_ring(cpu: &Ref0, layout: KvLayout, rows: &[f32]) -> Vec<u8> {
    let mut ring = cpu.kv_alloc(layout).unwrap();
    let src = cpu.upload(rows).unwrap();
    cpu.kv_store(&src, &mut ring, layout.cells, 0).unwrap();
    cpu.download(&ring.data).unwrap()
}

/// The reference device's attention over K and V rings given as host bytes.
#[allow(clippy::too_many_arguments)]
pub fn ref_attention(
    cpu: &Ref0,
    p: &AttnParams,
    q: &[f32],
    k: (KvLayout, &[u8]),
    v: (KvLayout, &[u8]),
    sinks: Option<&[f32]>,
    n_tokens: usize,
    pos0: usize,
) -> Vec<f32> {
    let ring = |(layout, bytes): (KvLayout, &[u8])| KvRing::<Ref0> {
        data: cpu.upload(bytes).unwrap(),
        layout,
    };
    let (qd, kd, vd) = (cpu.upload(q).unwrap(), ring(k), ring(v));
    let sd = sinks.map(|s| cpu.upload(s).unwrap());
    let mut out = cpu.alloc::<f32>(q.len()).unwrap();
    cpu.attention(p, &qd, &kd, &vd, sd.as_ref(), n_tokens, pos0, &mut out)
        .unwrap();
    cpu.download(&out).unwrap()
}
