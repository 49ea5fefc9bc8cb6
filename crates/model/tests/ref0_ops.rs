//! The reference device's products against the CPU engine's (`hmoe_model::ops::matmul`), bit
//! for bit, for the types whose order it follows (Q8_0, MXFP4, F32 one token and batches),
//! including F32 rows with a tail after the last 64 elements. (Here, above both: the contract
//! crate cannot see the CPU engine.)

use hmoe_backend::{Backend, Ref0};
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `rows × cols` weights of `ty` quantized from noise.
fn weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut q = vec![0u8; rows * rb];
    for row in q.chunks_exact_mut(rb) {
        let src: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        hmoe_quant::quantize_row(ty, &src, row).unwrap();
    }
    q
}

#[test]
fn ref0_matmul_is_the_cpu_engines_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(11);
    let dev = Ref0::new();
    for ty in [GgmlType::Q8_0, GgmlType::MXFP4, GgmlType::F32] {
        for (rows, cols) in [(37, 256), (9, 160), (5, 2880)] {
            let q = weights(&mut rng, ty, rows, cols);
            let m = dev.upload_matrix(ty, rows, cols, &q).unwrap();
            for n in [1usize, 3, 9] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|_| rng.random_range(-3.0f32..3.0))
                    .collect();
                let xd = dev.upload(&x).unwrap();
                let mut yd = dev.alloc::<f32>(n * rows).unwrap();
                dev.matmul(&m, &xd, n, &mut yd).unwrap();
                let got = dev.download(&yd).unwrap();
                let kernel = hmoe_quant::DotKernel::best(ty).unwrap();
                let mut qa = hmoe_model::ops::QuantizedActs::default();
                qa.quantize(kernel.act_type(), &x, cols);
                let mut want = vec![0f32; n * rows];
                hmoe_model::ops::matmul(kernel, &q, cols, rows, &qa, &mut want);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{ty} {rows}x{cols} n={n} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
}
