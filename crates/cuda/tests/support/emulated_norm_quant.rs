//! The norm that writes the quantized activations of the products reading it
//! (`norm_matmul_shared` on CUDA: `rms_norm_q8_0_f32` / `add_rms_norm_q8_0_f32` write the
//! normed rows as f32 and as Q8_0 blocks, then the dp4a group multiplies those) in the
//! emulator of tests/emulated.rs, against REF0's `norm_matmul_shared` (its default: the norm,
//! with the residual add where there is one, then `matmul_shared`).

use hmoe_backend::{Backend, Ref0};
use hmoe_quant::{quantize_row, GgmlType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::common::noise;
use super::emulator::{assert_bits, s, weights, Emulator};

/// A norm and its products: rows of `d` values, `n` tokens, up to three matrices (`rows`, 0
/// for none; `mask`: those with a bias), with the residual `y` added first when `add`.
struct NormCase {
    ty: GgmlType,
    d: usize,
    n: usize,
    rows: [usize; 3],
    mask: usize,
    add: bool,
}

/// Runs `c` in the emulator and on REF0 and asserts the same bits: the normed rows `h`, `x`
/// (with the residual added), each product and the Q8_0 blocks the norm wrote (those of
/// `hmoe_quant::quantize_row` of REF0's `h`). Returns the comparisons made.
fn norm_case(emu: &Emulator, cpu: &Ref0, rng: &mut StdRng, c: &NormCase) -> usize {
    let NormCase { ty, d, n, .. } = *c;
    let eps = 1e-5f32;
    // Values of mixed magnitude per row; a zero block (its scale 0) in the first row.
    let mut x = noise(rng, n * d, 30.0);
    for (r, row) in x.chunks_mut(d).enumerate() {
        let scale = [1.0, 1e-3, 1e3, 0.5][r % 4];
        row.iter_mut().for_each(|v| *v *= scale);
    }
    if d >= 64 {
        x[32..64].fill(0.0);
    }
    let y = noise(rng, n * d, 0.5);
    let mut w = noise(rng, d, 2.0);
    if d >= 96 {
        w[64..96].fill(0.0);
    }
    emu.write("x", &x);
    emu.write("w", &w);
    emu.write("y", &y);
    let mut members = Vec::new();
    for (i, &r) in c.rows.iter().enumerate().filter(|(_, &r)| r > 0) {
        let q = weights(rng, ty, r, d);
        let b = (c.mask >> i & 1 == 1).then(|| noise(rng, r, 4.0));
        emu.write(&format!("w{i}"), &q);
        if let Some(b) = &b {
            emu.write(&format!("b{i}"), b);
        }
        members.push((i, r, q, b));
    }
    let [r0, r1, r2] = c.rows;
    let args = [ty.id() as usize, d, n, r0, r1, r2, c.mask].map(s);
    let tail = [s(eps.to_bits()), s(u8::from(c.add))];
    emu.run("norm_matmul_group", &[&args[..], &tail[..]].concat());

    let mut xd = cpu.upload(&x).unwrap();
    let yd = cpu.upload(&y).unwrap();
    let wd = cpu.upload(&w).unwrap();
    let mut hd = cpu.alloc::<f32>(n * d).unwrap();
    let ms: Vec<_> = (members.iter())
        .map(|(_, r, q, _)| cpu.upload_matrix(ty, *r, d, q).unwrap())
        .collect();
    let bs: Vec<_> = (members.iter())
        .map(|(.., b)| b.as_ref().map(|b| cpu.upload(b).unwrap()))
        .collect();
    let mut outs: Vec<_> = (members.iter())
        .map(|(_, r, ..)| cpu.alloc::<f32>(n * r).unwrap())
        .collect();
    let pending = c.add.then_some(&yd);
    cpu.norm_matmul_shared(
        &mut xd,
        pending,
        (&wd, eps),
        &mut hd,
        &ms.iter().collect::<Vec<_>>(),
        &bs.iter().map(Option::as_ref).collect::<Vec<_>>(),
        n,
        &mut outs.iter_mut().collect::<Vec<_>>(),
    )
    .unwrap();
    let what = format!(
        "norm_matmul_shared {ty} d {d} n {n} {:?} residual {}",
        c.rows, c.add
    );
    let h = cpu.download(&hd).unwrap();
    assert_bits(&format!("{what}: h"), &emu.read::<f32>("out"), &h);
    assert_bits(
        &format!("{what}: x"),
        &emu.read::<f32>("x"),
        &cpu.download(&xd).unwrap(),
    );
    for ((i, ..), yd) in members.iter().zip(&outs) {
        let got: Vec<f32> = emu.read(&format!("y{i}"));
        assert_bits(
            &format!("{what}: member {i}"),
            &got,
            &cpu.download(yd).unwrap(),
        );
    }
    let mut want_q = vec![0u8; n * d / 32 * 34];
    quantize_row(GgmlType::Q8_0, &h, &mut want_q).unwrap();
    let got_q: Vec<u8> = emu.read("q");
    let same = got_q.iter().zip(&want_q).filter(|(a, b)| a == b).count();
    eprintln!(
        "{what}: Q8_0 blocks: {same}/{} bytes identical",
        want_q.len()
    );
    assert!(
        got_q.len() == want_q.len() && same == want_q.len(),
        "{what}: the Q8_0 blocks differ from quantize_row's"
    );
    3 + members.len()
}

/// The norm writing the Q8_0 activations of the products of its rows (two launches instead
/// of three: no quantizer between the norm and the dp4a group) gives REF0's bits for the
/// normed rows, `x` with the residual added, the Q8_0 blocks (`quantize_row`'s bytes of the
/// normed rows) and the products with their biases: Q8_0 and MXFP4 matrices of gpt-oss-120b's
/// Q, K and V (4,096, 512 and 512 rows of 2,880 columns: 90 blocks a row, the norm's warps
/// quantizing rounds of 8 blocks and a last one of 2) with biases, rows of 64, 96 and 32
/// values (fewer blocks than the norm's 8 warps) with groups of one to three matrices, 1 … 4
/// tokens, with and without the residual; and 33 rows (the tiled kernels' batches) of the
/// norm alone. Rows must be whole Q8_0 blocks (`norm_matmul_shared` runs the two ops
/// otherwise: a Q8_0/MXFP4 matrix has whole blocks of columns).
#[test]
#[ignore = "slow (minutes): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_norm_writing_q8_0_activations_gives_norm_then_matmul_shared_bits() {
    let Some(emu) = Emulator::build("norm_quant") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(59);
    let mut compared = 0;
    for ty in [GgmlType::Q8_0, GgmlType::MXFP4] {
        let groups: [(usize, [usize; 3], usize); 4] = [
            (2880, [4096, 512, 512], 0b111),
            (64, [17, 5, 33], 0b101),
            (96, [9, 31, 0], 0b010),
            (32, [4, 0, 0], 0b001),
        ];
        for (d, rows, mask) in groups {
            for n in 1..=4 {
                for add in [false, true] {
                    let c = NormCase {
                        ty,
                        d,
                        n,
                        rows,
                        mask,
                        add,
                    };
                    compared += norm_case(&emu, &cpu, &mut rng, &c);
                }
            }
        }
        let add = rng.random_bool(0.5);
        let c = NormCase {
            ty,
            d: 64,
            n: 33,
            rows: [0; 3],
            mask: 0,
            add,
        };
        compared += norm_case(&emu, &cpu, &mut rng, &c);
    }
    // Per type: 8 cases of 6, 6, 5 and 4 comparisons each, and 3 for the 33 rows.
    assert_eq!(compared, 2 * (8 * (6 + 6 + 5 + 4) + 3));
}
