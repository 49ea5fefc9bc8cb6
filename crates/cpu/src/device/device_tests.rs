//! Tests of the CPU device: weights kept in place or copied, expert sets, K/V rings.

use super::cpu_buffers::*;
use super::*;
use std::sync::Arc;

use hmoe_backend::ExpertMatrix;

/// `populate` leaves every byte as it was, whatever the buffer's alignment and size, on
/// fresh zeroed memory (the interleaved copy's case) and on written memory, and the
/// memory stays writable.
#[test]
fn populate_keeps_contents() {
    let mut fresh = vec![0u8; 64 << 20];
    populate(&mut fresh[100..]);
    assert!(fresh.iter().all(|&b| b == 0));
    fresh[(64 << 20) - 1] = 1;
    let mut written: Vec<u8> = (0..3 * 4096 + 100).map(|i| i as u8).collect();
    populate(&mut written[1..]);
    populate(&mut written[5..9]);
    populate(&mut []);
    assert!(written.iter().enumerate().all(|(i, &b)| b == i as u8));
}

#[test]
fn shared_weights_are_kept_in_place_and_multiply_like_a_copy() {
    let (rows, cols) = (3, 32);
    let vals: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.1).sin()).collect();
    let mut q = vec![0u8; GgmlType::Q8_0.row_bytes((rows * cols) as u64).unwrap() as usize];
    hmoe_quant::quantize_row(GgmlType::Q8_0, &vals, &mut q).unwrap();
    let owner: Arc<Vec<u8>> = Arc::new(q.clone());
    let shared = SharedBytes::new(owner.clone(), 0..q.len()).unwrap();
    let cpu = Cpu::new();
    let m = cpu
        .upload_matrix_shared(GgmlType::Q8_0, rows, cols, &shared)
        .unwrap();
    assert_eq!(m.data().as_ptr(), owner.as_ptr(), "no copy of the weights");
    let copy = cpu.upload_matrix(GgmlType::Q8_0, rows, cols, &q).unwrap();
    assert_ne!(copy.data().as_ptr(), owner.as_ptr());
    let x = cpu.upload(&vals[..2 * cols]).unwrap();
    let (mut a, mut b) = (cpu.alloc(2 * rows).unwrap(), cpu.alloc(2 * rows).unwrap());
    cpu.matmul(&m, &x, 2, &mut a).unwrap();
    cpu.matmul(&copy, &x, 2, &mut b).unwrap();
    assert_eq!(cpu.download(&a).unwrap(), cpu.download(&b).unwrap());
    assert!(cpu
        .upload_matrix_shared(GgmlType::Q8_0, rows + 1, cols, &shared)
        .is_err());
}

#[test]
fn shared_expert_sets_are_kept_in_place_and_sum_like_a_copy() {
    let (d, n_expert) = (32usize, 3usize);
    let row = GgmlType::Q8_0.row_bytes(d as u64).unwrap() as usize;
    let mut data = vec![0u8; n_expert * d * row];
    for (i, r) in data.chunks_exact_mut(row).enumerate() {
        let vals: Vec<f32> = (0..d)
            .map(|j| ((i * 7 + j * 3) % 11) as f32 * 0.1 - 0.5)
            .collect();
        hmoe_quant::quantize_row(GgmlType::Q8_0, &vals, r).unwrap();
    }
    let owner: Arc<Vec<u8>> = Arc::new(data.clone());
    let shared = SharedBytes::new(owner.clone(), 0..data.len()).unwrap();
    let bias: Vec<f32> = (0..n_expert * d).map(|i| i as f32 * 0.01).collect();
    let m = ExpertMatrix {
        ty: GgmlType::Q8_0,
        n_in: d,
        n_out: d,
        data: &data,
    };
    let t = ExpertTensors {
        n_expert,
        gate: m,
        up: m,
        down: m,
        gate_bias: &bias,
        up_bias: &bias,
        down_bias: &bias,
    };
    let cpu = Cpu::new();
    let three = [shared.clone(), shared.clone(), shared];
    let ids = [2usize, 0];
    let kept = cpu.upload_moe_shared(&t, &three, Some(&ids)).unwrap();
    let copy = cpu.upload_moe(&t, Some(&ids)).unwrap();
    let expert_bytes = d * row;
    let kept_gate = kept.view(0).unwrap().gate.as_ptr();
    assert_eq!(kept_gate, owner[2 * expert_bytes..].as_ptr(), "no copy");
    assert_eq!(Cpu::moe_bytes(&kept), Cpu::moe_bytes(&copy));
    let x: Vec<f32> = (0..2 * d).map(|i| (i as f32 * 0.37).sin()).collect();
    let x = cpu.upload(&x).unwrap();
    let sel = cpu.upload(&[0i32, 1, 1, 0]).unwrap();
    let wts = cpu.upload(&[0.6f32, 0.4, 0.7, 0.3]).unwrap();
    for act in [
        GatedAct::Silu,
        GatedAct::ClampedSwiglu {
            alpha: 1.702,
            limit: 7.0,
        },
    ] {
        let (mut a, mut b) = (cpu.alloc(2 * d).unwrap(), cpu.alloc(2 * d).unwrap());
        cpu.moe(&kept, act, &x, &sel, &wts, 2, &mut a).unwrap();
        cpu.moe(&copy, act, &x, &sel, &wts, 2, &mut b).unwrap();
        let (a, b) = (cpu.download(&a).unwrap(), cpu.download(&b).unwrap());
        assert!(a.iter().any(|&v| v != 0.0), "{act:?}");
        assert_eq!(a, b, "{act:?}");
    }
    assert!(cpu.upload_moe(&t, Some(&[3])).is_err());
}

/// MXFP4 experts interleaved for the AVX2/AVX-512 kernels (copies, shared or not, any subset of
/// experts) sum to the same bits as the file's layout, for one token (the decode path) and
/// a batch, with both activations.
#[test]
fn interleaved_mxfp4_experts_sum_like_the_files_layout() {
    let (d, ff, n_expert) = (64usize, 96usize, 4usize);
    let mut rnd = Stream(0x1667);
    let mut mat = |rows: usize, cols: usize| -> Vec<u8> {
        let vals: Vec<f32> = (0..n_expert * rows * cols)
            .map(|_| rnd.value(1.0))
            .collect();
        let mut q = vec![0u8; GgmlType::MXFP4.row_bytes(cols as u64).unwrap() as usize];
        q.resize(q.len() * n_expert * rows, 0);
        hmoe_quant::quantize_row(GgmlType::MXFP4, &vals, &mut q).unwrap();
        q
    };
    let (gate, up, down) = (mat(ff, d), mat(ff, d), mat(d, ff));
    let bias: Vec<f32> = (0..n_expert * ff).map(|i| (i % 7) as f32 * 0.01).collect();
    let m = |data, n_in, n_out| ExpertMatrix {
        ty: GgmlType::MXFP4,
        n_in,
        n_out,
        data,
    };
    let t = ExpertTensors {
        n_expert,
        gate: m(&gate, d, ff),
        up: m(&up, d, ff),
        down: m(&down, ff, d),
        gate_bias: &bias,
        up_bias: &bias,
        down_bias: &bias[..n_expert * d],
    };
    let shared = [&gate, &up, &down].map(|v| {
        let owner = Arc::new(v.clone());
        SharedBytes::new(owner, 0..v.len()).unwrap()
    });
    let (on, off) = (
        Cpu::with_expert_interleaving(true),
        Cpu::with_expert_interleaving(false),
    );
    let ids = [3usize, 1, 2];
    let sets = [
        on.upload_moe_shared(&t, &shared, Some(&ids)).unwrap(),
        on.upload_moe(&t, Some(&ids)).unwrap(),
        off.upload_moe_shared(&t, &shared, Some(&ids)).unwrap(),
    ];
    let interleaved = hmoe_quant::GemmKernel::interleaved(hmoe_quant::Isa::best()).is_some();
    let first_gate = sets[0].view(0).unwrap().gate;
    assert_eq!(first_gate != t.gate.expert(3).unwrap(), interleaved);
    assert_eq!(Cpu::moe_bytes(&sets[0]), Cpu::moe_bytes(&sets[2]));
    for n in [1usize, 5] {
        let x: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let x = off.upload(&x).unwrap();
        let sel: Vec<i32> = (0..2 * n as i32).map(|i| (i * 5 + 1) % 3).collect();
        let sel = off.upload(&sel).unwrap();
        let wts: Vec<f32> = (0..2 * n).map(|i| 0.3 + (i % 3) as f32 * 0.2).collect();
        let wts = off.upload(&wts).unwrap();
        for act in [
            GatedAct::Silu,
            GatedAct::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            },
        ] {
            let outs: Vec<Vec<f32>> = sets
                .iter()
                .map(|set| {
                    let mut y = off.alloc(n * d).unwrap();
                    off.moe(set, act, &x, &sel, &wts, 2, &mut y).unwrap();
                    off.download(&y).unwrap()
                })
                .collect();
            assert!(outs[2].iter().any(|&v| v != 0.0), "{act:?}");
            for o in &outs[..2] {
                let same = o
                    .iter()
                    .zip(&outs[2])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "n={n} {act:?}");
            }
        }
    }
}

/// A deterministic stream of pseudo-random values (xorshift64*).
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value uniform in `[-scale, scale)`.
    fn value(&mut self, scale: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
}

/// `rows × cols` weights of a type REF0 multiplies with hmoe-quant's kernels: the legacy
/// types quantized from noise, the K-quants random bytes with small f16 scales.
fn quant_weights(s: &mut Stream, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut q = vec![0u8; rows * rb];
    // The byte offsets of a K-quant super-block's f16 scales (d, and dmin where it has one).
    let scales: &[usize] = match ty {
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        ty if hmoe_quant::IQ_TYPES.contains(&ty) => &[],
        _ => {
            for row in q.chunks_exact_mut(rb) {
                let vals: Vec<f32> = (0..cols).map(|_| s.value(1.0)).collect();
                hmoe_quant::quantize_row(ty, &vals, row).unwrap();
            }
            return q;
        }
    };
    q.iter_mut().for_each(|b| *b = s.next() as u8);
    for block in q.chunks_exact_mut(ty.block_bytes()) {
        for &at in scales {
            let v = half::f16::from_f32(0.001 + s.value(1.0).abs() * 0.009);
            block[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
        let v = half::f16::from_f32(0.001 + s.value(1.0).abs() * 0.009);
        hmoe_quant::set_iq_block_scale(ty, block, v.to_bits());
    }
    q
}

/// REF0's per-head products of the types it multiplies with hmoe-quant's kernels (MLA's
/// `attn_k_b`/`attn_v_b` in low-bit files) are the CPU's bits: contiguous inputs (each
/// head's batch in `matmul`'s order: repacked Q4_0/Q4_K for a matrix of rows in multiples
/// of 8, the grouped Q4_K order from 4 tokens, tiled K-quants from 8) and strided ones
/// (`vec_dot`'s order), one token and batches.
#[test]
fn ref0_matmul_heads_of_quant_kernel_types_is_the_cpus_bits() {
    let mut s = Stream(0x9e37_79b9_7f4a_7c15);
    let (cpu, ref0) = (Cpu::new(), hmoe_backend::Ref0::new());
    for ty in hmoe_backend::QUANT_KERNEL_TYPES {
        let cols = ty.block_elems().max(64);
        // 3 heads of 8 rows (a multiple of 8 in all), and 3 of 5.
        for (nh, out) in [(3, 8), (3, 5)] {
            let q = quant_weights(&mut s, ty, nh * out, cols);
            let mc = cpu.upload_matrix(ty, nh * out, cols, &q).unwrap();
            let mr = ref0.upload_matrix(ty, nh * out, cols, &q).unwrap();
            for (stride, n) in [
                (cols, 1),
                (cols, 5),
                (cols, 9),
                (cols + 32, 1),
                (cols + 32, 9),
            ] {
                let x: Vec<f32> = (0..n * nh * stride).map(|_| s.value(3.0)).collect();
                let mut yc = cpu.alloc::<f32>(n * nh * out).unwrap();
                let xc = cpu.upload(&x).unwrap();
                cpu.matmul_heads(&mc, &xc, n, nh, stride, &mut yc).unwrap();
                let mut yr = ref0.alloc::<f32>(n * nh * out).unwrap();
                let xr = ref0.upload(&x).unwrap();
                ref0.matmul_heads(&mr, &xr, n, nh, stride, &mut yr).unwrap();
                let (want, got) = (cpu.download(&yc).unwrap(), ref0.download(&yr).unwrap());
                let what = format!("{ty} {nh}x{out}x{cols} stride {stride} n {n}");
                assert!(want.iter().all(|v| v.is_finite()), "{what}: finite");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{what}");
            }
        }
    }
}

#[test]
fn rings_store_as_the_cpu_cache_and_download_its_bytes() {
    let cpu = Cpu::new();
    let layout = KvLayout::new(GgmlType::F16, 4, 2, 0).unwrap();
    let mut ring = cpu.kv_alloc(layout).unwrap();
    assert_eq!(Cpu::buf_len(&ring.data), layout.bytes());
    let src = cpu
        .upload(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
        .unwrap();
    // Positions 1 and 2 go to cells 1 and 0.
    cpu.kv_store(&src, &mut ring, 2, 1).unwrap();
    let bytes = cpu.download(&ring.data).unwrap();
    let f16_at = |i: usize| half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
    assert_eq!(f16_at(0).to_f32(), 5.0);
    assert_eq!(f16_at(4).to_f32(), 1.0);
    let mut not_a_ring = KvRing {
        data: cpu.alloc::<u8>(layout.bytes()).unwrap(),
        layout,
    };
    assert!(cpu.kv_store(&src, &mut not_a_ring, 2, 0).is_err());
}

/// A dense IQ4_NL matrix of a multiple of 8 rows (DeepSeek's shared experts) multiplies as
/// llama.cpp's repacked `iq4_nl_8x8` kernels do, for one token and for batches: per output,
/// each 32-element block's exact integer dot, then `acc = fma(isum, d_w · d_a, acc)` over the
/// blocks in order. The integers are recovered from the dequantized values (`d · q` is exact
/// in f32 for an f16 `d` and |q| ≤ 127), so the reference shares no code with the kernels.
#[test]
fn dense_iq4_nl_sums_in_llama_cpps_repacked_block_order() {
    let mut s = Stream(0x51_7cc1_b727_220a);
    let (rows, cols) = (16, 256);
    let ty = GgmlType::IQ4_NL;
    let q = quant_weights(&mut s, ty, rows, cols);
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let cpu = Cpu::new();
    let m = cpu.upload_matrix(ty, rows, cols, &q).unwrap();
    // Integer values and f16 scale of each 32-element block of a row of `ty`.
    let blocks = |ty: GgmlType, row: &[u8]| -> Vec<(f32, Vec<i32>)> {
        let mut deq = vec![0f32; cols];
        hmoe_quant::dequantize_row(ty, row, &mut deq).unwrap();
        let bb = ty.block_bytes();
        row.chunks_exact(bb)
            .zip(deq.chunks_exact(32))
            .map(|(b, v)| {
                let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                let ints = v.iter().map(|&x| (x / d) as i32).collect::<Vec<_>>();
                assert!(ints.iter().zip(v).all(|(&i, &x)| i as f32 * d == x));
                (d, ints)
            })
            .collect()
    };
    let mut differs_from_vec_dot = 0;
    for n in [1, 3, 4, 6] {
        let x: Vec<f32> = (0..n * cols).map(|_| s.value(2.0)).collect();
        let mut y = cpu.alloc::<f32>(n * rows).unwrap();
        cpu.matmul(&m, &cpu.upload(&x).unwrap(), n, &mut y).unwrap();
        let got = cpu.download(&y).unwrap();
        let vec_dot = hmoe_quant::DotKernel::best(ty).unwrap();
        for t in 0..n {
            let a_ty = hmoe_quant::vec_dot_type(ty);
            let mut a = vec![0u8; a_ty.row_bytes(cols as u64).unwrap() as usize];
            hmoe_quant::quantize_row(a_ty, &x[t * cols..(t + 1) * cols], &mut a).unwrap();
            let ab = blocks(a_ty, &a);
            for r in 0..rows {
                let w = &q[r * rb..(r + 1) * rb];
                let mut acc = 0f32;
                for ((dw, qw), (da, qa)) in blocks(ty, w).iter().zip(&ab) {
                    let isum: i32 = qw.iter().zip(qa).map(|(a, b)| a * b).sum();
                    acc = (isum as f32).mul_add(dw * da, acc);
                }
                let g = got[t * rows + r];
                assert_eq!(g.to_bits(), acc.to_bits(), "{n} tokens: token {t} row {r}");
                differs_from_vec_dot += usize::from(vec_dot.dot(cols, w, &a) != acc);
            }
        }
    }
    // `vec_dot`'s order (even and odd blocks apart) gives other bits for some of them.
    assert!(differs_from_vec_dot > 0);
}
