//! The CUDA kernels without a GPU: the kernel source (`src/kernels/*.cu`) compiled for the host with clang++ and run by a
//! thread-per-CUDA-thread emulator (`support/kernel_emulator.cpp`, launches as in src/device/),
//! against [`Ref0`]. Q8_0/MXFP4/F32 products and those of the low-bit types (Q4_0 … Q6_K, in
//! every order the CPU device picks: `vec_dot`, tiled K-quants, repacked Q4_0/Q4_K), the
//! quantizers (Q8_0, Q8_1, Q8_K), embedding rows, the MoE block, the router (with its product
//! in one launch: support/emulated_routing.rs), the logits' top-k,
//! the K/V store of every ring type and attention over every ring type pair (the row kernel
//! and the chunked flash kernel, rotated rings) and over K-only rings of every type (both latent paths)
//! must give the reference backend's bits (the kernels' `expf_libm` computes glibc's `expf`
//! bit for bit; the emulator's libm stands in for the GPU's `cosf`/`sinf`); F16/BF16 products
//! (another summation order) are only reported.
//!
//! Slow (minutes: every shuffle is a barrier of OS threads), so ignored by default:
//! `cargo test -p hmoe-cuda --test emulated -- --ignored --nocapture`. Skipped when clang++
//! with C++20 `<barrier>` and F16C is not available. A real GPU runs tests/gpu.rs and tests/gpu_moe.rs.

use std::path::PathBuf;

use hmoe_backend::{Backend, ExpertMatrix, ExpertTensors, GatedAct, KvLayout, KvRing, Ref0};
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::SeedableRng;

mod common;
use common::{
    act_quantizer_cases, extreme_scales, lowbit_expert_sets, noise, quantizer_cases, ref_moe,
    ref_ring, KERNEL_ACT, LOWBIT_MATMULS, LOWBIT_MOE, LOWBIT_SEL, LOWBIT_TOKENS, LOWBIT_TYPES,
    TYPES,
};

#[path = "support/emulator.rs"]
mod emulator;
use emulator::{assert_bits, compare, exact, reported, s, weights, Emulator};

#[path = "support/emulated_mma.rs"]
mod emulated_mma;

#[path = "support/emulated_top_k.rs"]
mod emulated_top_k;

#[path = "support/emulated_moe_decode.rs"]
mod emulated_moe_decode;

#[path = "support/emulated_attention.rs"]
mod emulated_attention;
use emulated_attention::attention_cases;

#[path = "support/emulated_latent.rs"]
mod emulated_latent;

#[path = "support/emulated_routing.rs"]
mod emulated_routing;

#[path = "support/emulated_norm_quant.rs"]
mod emulated_norm_quant;

/// The device an emulated product stands for: `Sm80` multiplies Q8_0/MXFP4 weights with the
/// int8 tensor-core kernels (kernels/mma.cu), here for every batch size and with weights of
/// extreme scales ([`extreme_scales`]); `Older` with the kernels the launch code picks below
/// sm_80.
#[derive(Clone, Copy, PartialEq)]
enum Arch {
    Older,
    Sm80,
}

/// Weights for a product on `arch`: [`random_weights`], with [`extreme_scales`] (`big` ones
/// too when `big`) on `Sm80`.
fn arch_weights(
    rng: &mut StdRng,
    arch: Arch,
    ty: GgmlType,
    (rows, cols): (usize, usize),
    big: bool,
) -> Vec<u8> {
    let mut q = weights(rng, ty, rows, cols);
    if arch == Arch::Sm80 {
        extreme_scales(rng, ty, &mut q, cols, big);
    }
    q
}

/// Runs the emulated matmul of a `rows × cols` matrix of `ty` on `n` random tokens against
/// REF0's: the same bits for the types of [`exact`], else only reported. On `Sm80` the
/// tokens' magnitudes also vary over 1e-30 … 1e4. Returns the emulator's outputs.
fn matmul_case(
    emu: &Emulator,
    cpu: &Ref0,
    rng: &mut StdRng,
    (ty, arch): (GgmlType, Arch),
    (rows, cols): (usize, usize),
    n: usize,
) -> Vec<f32> {
    let q = arch_weights(rng, arch, ty, (rows, cols), true);
    let mut x = noise(rng, n * cols, 1.0);
    if arch == Arch::Sm80 {
        let scales = [1.0, 1e-30, 1e4, 1e-3];
        x.iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v *= scales[i / cols % 4]);
    }
    matmul_check(emu, cpu, (ty, arch), (rows, cols, n), &q, &x)
}

/// Runs the emulated matmul of the `rows × cols` matrix `q` of `ty` on the `n` tokens `x`, on
/// a device of `arch`, against REF0's: the same bits for the types of [`exact`], else only
/// reported. Returns the emulator's outputs.
fn matmul_check(
    emu: &Emulator,
    cpu: &Ref0,
    (ty, arch): (GgmlType, Arch),
    (rows, cols, n): (usize, usize, usize),
    q: &[u8],
    x: &[f32],
) -> Vec<f32> {
    let m = cpu.upload_matrix(ty, rows, cols, q).unwrap();
    emu.write("w", q);
    emu.write("x", x);
    let tc = u8::from(arch == Arch::Sm80);
    emu.run("matmul", &[s(ty.id()), s(rows), s(cols), s(n), s(tc)]);
    let got: Vec<f32> = emu.read("y");
    let xd = cpu.upload(x).unwrap();
    let mut yd = cpu.alloc::<f32>(n * rows).unwrap();
    cpu.matmul(&m, &xd, n, &mut yd).unwrap();
    let want = cpu.download(&yd).unwrap();
    let what = format!("matmul {ty} {rows}x{cols} n={n}");
    if exact(ty) {
        assert_bits(&what, &got, &want);
    } else {
        reported(&what, &got, &want);
    }
    got
}

/// Q8_0 or MXFP4 weights with random quants (Q8_0 -128 included) and block scales drawn from
/// extremes and ordinary values: Q8_0's f16 d ±65504, the smallest subnormal and normal, 1,
/// 0 and 1e-3..1e-2; MXFP4's exponent bytes 0..3 (subnormal f32 scales) up to 2^72.
fn extreme_weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    use rand::{Rng, RngCore};
    let mut q = vec![0u8; ty.row_bytes(cols as u64).unwrap() as usize * rows];
    rng.fill_bytes(&mut q);
    for block in q.chunks_exact_mut(ty.block_bytes()) {
        if ty == GgmlType::MXFP4 {
            const E: [u8; 10] = [0, 1, 2, 3, 100, 127, 128, 129, 150, 200];
            block[0] = E[rng.random_range(0..E.len())];
        } else {
            const D: [u16; 7] = [0x7bff, 0xfbff, 0x0001, 0x8001, 0x0400, 0x3c00, 0x0000];
            // Ordinary scales for two draws in nine.
            let d = match D.get(rng.random_range(0..D.len() + 2)) {
                Some(&bits) => bits,
                None => half::f16::from_f32(rng.random_range(1e-3f32..1e-2)).to_bits(),
            };
            block[..2].copy_from_slice(&d.to_le_bytes());
        }
    }
    q
}

/// `n` tokens of `cols` activations, each at a magnitude from 1e-20 (its Q8_0 scales round to
/// zero) to 1e6 (scales near the f16 maximum).
fn extreme_tokens(rng: &mut StdRng, n: usize, cols: usize) -> Vec<f32> {
    use rand::Rng;
    const MAG: [f32; 6] = [1e-20, 1e-3, 1.0, 30.0, 1e3, 1e6];
    (0..n)
        .flat_map(|_| {
            let m = MAG[rng.random_range(0..MAG.len())];
            noise(rng, cols, m)
        })
        .collect()
}

/// The dp4a GEMV kernels of Q8_0 and MXFP4 weights (`kernels/gemv_dp4a.cu`, every batch under
/// the tiled kernel's 32 tokens) on weights and activations of extreme scales: every row count
/// from 1 to 17 and 31..33 (partial warps and blocks of 4 or 8 rows per warp), rows of 1, 2,
/// 3, 5, 8, 9 and 90 blocks (whole chunks of 8 blocks and tails; gpt-oss's 2880 columns; an
/// odd count puts MXFP4 rows at odd byte offsets), 1..8 tokens and batches over several
/// blocks of 8; REF0's bits.
#[test]
#[ignore = "slow (a minute or two): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_dp4a_gemv_gives_the_reference_backends_bits() {
    let Some(emu) = Emulator::build("dp4a") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(43);
    let mut shapes = Vec::new();
    for rows in (1..=17).chain(31..=33) {
        shapes.extend([1, 3, 8].map(|n| (rows, 64, n)));
    }
    for cols in [32, 64, 96, 160, 256, 288, 2880] {
        shapes.extend((1..=8).map(|n| (5, cols, n)));
    }
    shapes.extend([9, 17, 31].map(|n| (6, 96, n)));
    shapes.push((33, 2880, 2));
    for ty in [GgmlType::Q8_0, GgmlType::MXFP4] {
        for &(rows, cols, n) in &shapes {
            let q = extreme_weights(&mut rng, ty, rows, cols);
            let x = extreme_tokens(&mut rng, n, cols);
            matmul_check(&emu, &cpu, (ty, Arch::Older), (rows, cols, n), &q, &x);
        }
    }
}

/// `matmul_shared`'s one dp4a launch (`kernels/gemv_dp4a.cu`: up to three Q8_0 or MXFP4
/// matrices of one width over the same quantized activations, each with an optional bias
/// added to its finished sums): REF0's `matmul` then `add_bias` bits for each matrix, with
/// groups of one, two and three matrices of row counts that end in partial blocks, biases on
/// some, 1..17 tokens (over several blocks of 8) and extreme scales.
#[test]
#[ignore = "slow (a minute or two): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_dp4a_groups_with_biases_give_matmul_then_add_bias_bits() {
    let Some(emu) = Emulator::build("dp4a_group") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(47);
    // (rows of each member, 0 for none; mask of the members with a bias)
    let groups: [([usize; 3], usize); 4] = [
        ([17, 5, 33], 0b101),
        ([4, 0, 0], 0b001),
        ([9, 31, 0], 0b010),
        ([64, 8, 8], 0b111),
    ];
    for ty in [GgmlType::Q8_0, GgmlType::MXFP4] {
        for (g, &(rows, mask)) in groups.iter().enumerate() {
            let cols = if g == 3 { 2880 } else { 96 };
            for n in [1usize, 3, 8, 9, 17] {
                let x = extreme_tokens(&mut rng, n, cols);
                emu.write("x", &x);
                let mut members = Vec::new();
                for (i, &r) in rows.iter().enumerate().filter(|(_, &r)| r > 0) {
                    let q = extreme_weights(&mut rng, ty, r, cols);
                    let b = (mask >> i & 1 == 1).then(|| noise(&mut rng, r, 4.0));
                    emu.write(&format!("w{i}"), &q);
                    if let Some(b) = &b {
                        emu.write(&format!("b{i}"), b);
                    }
                    members.push((i, r, q, b));
                }
                let args = [ty.id() as usize, cols, n, rows[0], rows[1], rows[2], mask];
                emu.run("matmul_group", &args.map(s));
                let xd = cpu.upload(&x).unwrap();
                for (i, r, q, b) in &members {
                    let got: Vec<f32> = emu.read(&format!("y{i}"));
                    let m = cpu.upload_matrix(ty, *r, cols, q).unwrap();
                    let mut yd = cpu.alloc::<f32>(n * r).unwrap();
                    cpu.matmul(&m, &xd, n, &mut yd).unwrap();
                    if let Some(b) = b {
                        cpu.add_bias(&mut yd, &cpu.upload(b).unwrap()).unwrap();
                    }
                    let want = cpu.download(&yd).unwrap();
                    let what = format!("dp4a group {ty} {rows:?} member {i} n={n}");
                    assert_bits(&what, &got, &want);
                }
            }
        }
    }
}

/// The F32/F16/BF16 GEMV kernel with a bias (gpt-oss's F32 router and its bias in one
/// launch): the product's own bits plus the bias, as `add_bias` adds it. F32 against REF0's
/// `matmul` then `add_bias`; F16/BF16 (whose GEMV order differs from REF0's, only reported
/// elsewhere) against the same kernel without the bias, then the bias added here.
#[test]
#[ignore = "slow (a minute): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_float_gemv_with_a_bias_gives_matmul_then_add_bias_bits() {
    let Some(emu) = Emulator::build("gemv_bias") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(53);
    let mut compared = 0;
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for (rows, cols, n) in [(13, 160, 1), (32, 2880, 1), (7, 96, 3)] {
            let q = weights(&mut rng, ty, rows, cols);
            let x = noise(&mut rng, n * cols, 1.0);
            let bias = noise(&mut rng, rows, 3.0);
            emu.write("w", &q);
            emu.write("x", &x);
            emu.write("b", &bias);
            let base = [s(ty.id()), s(rows), s(cols), s(n), s(0)];
            emu.run("matmul", &base);
            let plain: Vec<f32> = emu.read("y");
            emu.run("matmul", &[&base[..], &[s(1)]].concat());
            let got: Vec<f32> = emu.read("y");
            let want: Vec<f32> = if ty == GgmlType::F32 {
                let m = cpu.upload_matrix(ty, rows, cols, &q).unwrap();
                let mut yd = cpu.alloc::<f32>(n * rows).unwrap();
                cpu.matmul(&m, &cpu.upload(&x).unwrap(), n, &mut yd)
                    .unwrap();
                cpu.add_bias(&mut yd, &cpu.upload(&bias).unwrap()).unwrap();
                cpu.download(&yd).unwrap()
            } else {
                plain
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v + bias[i % rows])
                    .collect()
            };
            assert_bits(
                &format!("gemv {ty} {rows}x{cols} n={n} with a bias"),
                &got,
                &want,
            );
            compared += 1;
        }
    }
    assert_eq!(compared, 9);
}

/// The shape of an MoE case: `ne` experts of `d → ff → d`, `n` tokens of `k` slots.
#[derive(Clone, Copy)]
struct MoeShape {
    ne: usize,
    d: usize,
    ff: usize,
    n: usize,
    k: usize,
}

/// RMSNorm and the residual add with it in one launch (`add_rms_norm_f32`), RoPE (NeoX and
/// normal, of one tensor and of two in one launch) and the store of keys and values in one
/// launch (`kv_store` over two rings) give REF0's bits.
#[test]
#[ignore = "slow (seconds): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_norms_rope_and_kv_pairs_give_the_reference_backends_bits() {
    use hmoe_backend::RopeParams;
    let Some(emu) = Emulator::build("norms") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(11);
    // RMSNorm, and the residual add with it in one launch (add_rms_norm): REF0's rms_norm,
    // and its add_assign then rms_norm (x updated as add_assign leaves it). Rows shorter than
    // the block, gpt-oss's 2880 and a length not a multiple of 32; values of mixed magnitude.
    for (rows, n) in [(3usize, 64usize), (2, 2880), (4, 1000)] {
        let x = noise(&mut rng, rows * n, 30.0);
        let y = noise(&mut rng, rows * n, 0.5);
        let w = noise(&mut rng, n, 2.0);
        let eps = 1e-5f32;
        let wd = cpu.upload(&w).unwrap();
        let mut want = cpu.alloc::<f32>(rows * n).unwrap();
        for add in [false, true] {
            emu.write("x", &x);
            emu.write("w", &w);
            emu.write("y", &y);
            emu.run("rms_norm", &[s(n), s(eps.to_bits()), s(u8::from(add))]);
            let mut xw = cpu.upload(&x).unwrap();
            if add {
                cpu.add_assign(&mut xw, &cpu.upload(&y).unwrap()).unwrap();
            }
            cpu.rms_norm(&xw, &wd, eps, &mut want).unwrap();
            let what = format!("rms_norm rows {rows} n {n} residual {add}");
            assert_bits(
                &what,
                &emu.read::<f32>("out"),
                &cpu.download(&want).unwrap(),
            );
            assert_bits(&what, &emu.read::<f32>("x"), &cpu.download(&xw).unwrap());
        }
    }

    // RoPE, plain and YaRN: NeoX over whole heads of 64 and the first 32 dims of them; normal
    // over the dims after a latent part (DeepSeek's keys and queries). Each of one tensor (no
    // second) and of queries and keys in one launch (REF0: rope_neox_qk's default, each
    // alone).
    let neox = [
        RopeParams::plain(64, 10000.0),
        RopeParams::yarn(32, 150000.0, 32.0, 4096, 1.0, 32.0, 1.0),
    ];
    let norm = [
        RopeParams::plain(8, 10000.0),
        RopeParams::yarn(64, 10000.0, 40.0, 4096, 0.7, 32.0, 1.0),
    ];
    let cases =
        (neox.iter().map(|p| (0, 0, 64, p))).chain(norm.iter().map(|p| (1, 16, 16 + p.n_dims, p)));
    for (kind, first, hd, p) in cases {
        for (nh, nh2) in [(2usize, 0usize), (4, 1)] {
            let n = 3;
            let x = noise(&mut rng, n * nh * hd, 2.0);
            let x2 = noise(&mut rng, n * nh2.max(1) * hd, 2.0);
            let pos: Vec<i32> = vec![0, 7, 3000];
            emu.write("x", &x);
            emu.write("x2", &x2);
            emu.write("pos", &pos);
            let f = [
                p.theta_scale,
                p.freq_scale,
                p.ext_factor,
                p.attn_factor,
                p.corr_dims[0],
                p.corr_dims[1],
            ];
            emu.write("params", &f);
            let args = [kind, n, nh, nh2, hd, first, p.n_dims].map(s);
            emu.run("rope", &args);
            let pd = cpu.upload(&pos).unwrap();
            let outs = [("x", &x, nh), ("x2", &x2, nh2)];
            for (file, input, heads) in outs.into_iter().filter(|o| o.2 > 0) {
                let mut xd = cpu.upload(input).unwrap();
                match kind {
                    0 => cpu.rope_neox(&mut xd, &pd, heads, hd, p).unwrap(),
                    _ => cpu.rope_norm(&mut xd, &pd, heads, hd, first, p).unwrap(),
                }
                let what = format!("rope kind {kind} {file} of {nh} + {nh2} heads {p:?}");
                assert_bits(&what, &emu.read::<f32>(file), &cpu.download(&xd).unwrap());
            }
        }
    }

    // Keys and values into rings of two types in one launch, rotated or not, in rings that
    // wrap: each REF0's kv_store's bytes.
    let (f16, f32, q8, q4) = (GgmlType::F16, GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_0);
    for (kt, k_rot, vt, v_rot) in [
        (f16, 0, f16, 0),
        (q8, 64, f16, 0),
        (f32, 0, q4, 64),
        (q8, 128, q8, 0),
        (q4, 0, q8, 64),
    ] {
        let (width, cells, pos0, n) = (256usize, 5usize, 3usize, 4usize);
        let rows = [
            noise(&mut rng, n * width, 2.0),
            noise(&mut rng, n * width, 2.0),
        ];
        let layouts = [(kt, k_rot), (vt, v_rot)]
            .map(|(ty, rot)| KvLayout::new(ty, width, cells, rot).unwrap());
        let mut want = Vec::new();
        for (i, (layout, rows)) in layouts.iter().zip(&rows).enumerate() {
            let before = ref_ring(&cpu, *layout, &noise(&mut rng, cells * width, 1.0));
            let mut ring = KvRing::<Ref0> {
                data: cpu.upload(&before).unwrap(),
                layout: *layout,
            };
            cpu.kv_store(&cpu.upload(rows).unwrap(), &mut ring, n, pos0)
                .unwrap();
            let suffix = ["", "2"][i];
            emu.write(&format!("src{suffix}"), rows);
            emu.write(&format!("ring{suffix}"), &before);
            want.push(cpu.download(&ring.data).unwrap());
        }
        let (k, v) = (&layouts[0], &layouts[1]);
        let args = [k.ty.id() as usize, n, width, cells, pos0, k.rot]
            .into_iter()
            .chain([v.ty.id() as usize, width, cells, v.rot])
            .map(s)
            .collect::<Vec<_>>();
        emu.run("kv_store", &args);
        let what = format!("kv_store pair {kt} rot {k_rot} / {vt} rot {v_rot}");
        assert!(emu.read::<u8>("ring") == want[0], "{what}: keys");
        assert!(emu.read::<u8>("ring2") == want[1], "{what}: values");
    }
}

/// Runs the emulated MoE block with gate, up and down experts of `types` (random weights,
/// biases when `act.1`, the activation `act.0`) and the expert ids `sel` against REF0's: the
/// same bits when every type is of [`exact`], else only reported.
fn moe_case(
    emu: &Emulator,
    cpu: &Ref0,
    rng: &mut StdRng,
    (types, arch): ([GgmlType; 3], Arch),
    MoeShape { ne, d, ff, n, k }: MoeShape,
    sel: &[i32],
    (act, with_bias): (GatedAct, bool),
) {
    let [gt, ut, dt] = types;
    let (gq, uq, dq) = (
        arch_weights(rng, arch, gt, (ne * ff, d), false),
        arch_weights(rng, arch, ut, (ne * ff, d), false),
        arch_weights(rng, arch, dt, (ne * d, ff), false),
    );
    let (bg, bu, bd) = (
        noise(rng, ne * ff, 0.5),
        noise(rng, ne * ff, 0.5),
        noise(rng, ne * d, 0.5),
    );
    let x = noise(rng, n * d, 1.0);
    let wts = noise(rng, n * k, 1.0);
    for (name, v) in [("gate", &gq), ("up", &uq), ("down", &dq)] {
        emu.write(name, v);
    }
    for (name, v) in [
        ("bg", &bg),
        ("bu", &bu),
        ("bd", &bd),
        ("x", &x),
        ("wts", &wts),
    ] {
        emu.write(name, v);
    }
    emu.write("sel", sel);
    let act_id = usize::from(act == GatedAct::Silu);
    let args = [
        gt.id() as usize,
        ne,
        d,
        ff,
        n,
        k,
        act_id,
        usize::from(with_bias),
        ut.id() as usize,
        dt.id() as usize,
        usize::from(arch == Arch::Sm80),
    ];
    emu.run("moe", &args.map(s));
    let got: Vec<f32> = emu.read("out");
    let matrix = |ty, n_in, n_out, data| ExpertMatrix {
        ty,
        n_in,
        n_out,
        data,
    };
    let t = ExpertTensors {
        n_expert: ne,
        gate: matrix(gt, d, ff, &gq),
        up: matrix(ut, d, ff, &uq),
        down: matrix(dt, ff, d, &dq),
        gate_bias: if with_bias { &bg } else { &[] },
        up_bias: if with_bias { &bu } else { &[] },
        down_bias: if with_bias { &bd } else { &[] },
    };
    let rm = cpu.upload_moe(&t, None).unwrap();
    let want = ref_moe(cpu, &rm, act, &x, sel, &wts, k);
    let what = format!("moe {types:?} {act:?}");
    if types.iter().all(|&ty| exact(ty)) {
        assert_bits(&what, &got, &want);
    } else {
        reported(&what, &got, &want);
    }
}

#[test]
#[ignore = "slow (minutes): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_kernels_give_the_reference_backends_bits() {
    let Some(emu) = Emulator::build("kernels") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(5);

    // The activation quantizer.
    let (x, want) = quantizer_cases(&mut rng);
    emu.write("x", &x);
    emu.run("quantize", &[]);
    assert_eq!(emu.read::<u8>("out"), want, "quantize_q8_0");

    // Matmul (the GEMV kernel; from 32 tokens the tiled kernel for Q8_0/MXFP4): rows with a
    // tail after 64 elements, gpt-oss's 2880, and 64.
    for (rows, cols) in [(13, 160), (6, 2880), (5, 64)] {
        for ty in TYPES {
            for n in [1usize, 3, 9, 20, 40] {
                matmul_case(&emu, &cpu, &mut rng, (ty, Arch::Older), (rows, cols), n);
            }
        }
    }

    // Router.
    let (n, ne, k) = (9, 128, 4);
    let logits = noise(&mut rng, n * ne, 4.0);
    emu.write("logits", &logits);
    emu.run("router", &[s(n), s(ne), s(k)]);
    let (mut sel, mut w) = (
        cpu.alloc::<i32>(n * k).unwrap(),
        cpu.alloc::<f32>(n * k).unwrap(),
    );
    let ld = cpu.upload(&logits).unwrap();
    cpu.router_top_k(&ld, ne, k, &mut sel, &mut w).unwrap();
    let (sel, w) = (cpu.download(&sel).unwrap(), cpu.download(&w).unwrap());
    assert_eq!(emu.read::<i32>("sel"), sel, "router ids");
    let (same, _) = compare(&emu.read::<f32>("w"), &w);
    assert_eq!(same, w.len(), "router weights");

    // MoE: expert 3 twice (F32: 16-lane order), an out-of-range id; then Q8_0 and MXFP4 with
    // 80 slots (the tiled kernels: several tiles of slots for some experts, partial row tiles
    // and shared-memory chunks, out-of-range ids).
    let small: Vec<i32> = vec![3, 0, 5, 3, 7, 1, 2, 6, 4, 9];
    let large: Vec<i32> = (0..80).map(|i| [3, 3, 5, 3, 9, 3, 7, -1][i % 8]).collect();
    let cases = TYPES
        .iter()
        .map(|&ty| (ty, 64, 5, small.clone()))
        .chain([GgmlType::Q8_0, GgmlType::MXFP4].map(|ty| (ty, 320, 40, large.clone())));
    // Each case with gpt-oss's clamped SwiGLU and biases, and with SiLU and no biases.
    let acts = [(KERNEL_ACT, true), (GatedAct::Silu, false)];
    for ((ty, d, n, sel), act) in cases.flat_map(|c| acts.map(|a| (c.clone(), a))) {
        let shape = MoeShape {
            ne: 8,
            d,
            ff: 96,
            n,
            k: 2,
        };
        moe_case(
            &emu,
            &cpu,
            &mut rng,
            ([ty; 3], Arch::Older),
            shape,
            &sel,
            act,
        );
    }

    // The K/V store of every ring type (rotated as the executor rotates quantized heads of
    // 64 and 128): REF0's bytes, in a ring that wraps.
    for (ty, hd) in [
        (GgmlType::F32, 64usize),
        (GgmlType::F16, 64),
        (GgmlType::Q8_0, 64),
        (GgmlType::Q8_0, 128),
        (GgmlType::Q4_0, 64),
        (GgmlType::Q4_0, 32),
    ] {
        let (width, cells, pos0, n) = (2 * hd, 5usize, 3usize, 4usize);
        let layout = KvLayout::new(ty, width, cells, KvLayout::rotation(ty, hd, true)).unwrap();
        let before = ref_ring(&cpu, layout, &noise(&mut rng, cells * width, 1.0));
        let rows = noise(&mut rng, n * width, 2.0);
        let mut ring = KvRing::<Ref0> {
            data: cpu.upload(&before).unwrap(),
            layout,
        };
        cpu.kv_store(&cpu.upload(&rows).unwrap(), &mut ring, n, pos0)
            .unwrap();
        emu.write("src", &rows);
        emu.write("ring", &before);
        emu.run(
            "kv_store",
            &[s(ty.id()), s(n), s(width), s(cells), s(pos0), s(layout.rot)],
        );
        let got: Vec<u8> = emu.read("ring");
        assert!(
            got == cpu.download(&ring.data).unwrap(),
            "kv_store {ty} hd {hd}"
        );
    }

    attention_cases(&emu, &cpu, &mut rng);
}

/// The low-bit weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K … Q6_K): the Q8_1 and Q8_K activation
/// quantizers, embedding rows, matmuls of one token and of batches under and over the tiled
/// K-quant threshold, with row counts that do and do not make the CPU device repack Q4_0/Q4_K,
/// and expert sets of each type and of the Q4_K_M mixes (an expert that 8 slots route to: the
/// tiled order; fewer: `vec_dot`) must give REF0's bits (the CPU device's kernels, whose float
/// order the kernels replay for every batch size, so no tolerance is needed).
#[test]
#[ignore = "slow (a minute or two): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_lowbit_kernels_give_the_reference_backends_bits() {
    let Some(emu) = Emulator::build("lowbit") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(7);

    for act in [GgmlType::Q8_1, GgmlType::Q8_K] {
        let (x, want) = act_quantizer_cases(&mut rng, act);
        emu.write("x", &x);
        emu.run("quantize", &[s(act.id())]);
        assert_eq!(emu.read::<u8>("out"), want, "quantize {act}");
    }

    for ty in LOWBIT_TYPES {
        let (rows, cols) = (6, 512);
        let q = weights(&mut rng, ty, rows, cols);
        let ids: Vec<i32> = vec![3, 0, 5, -1, 6, 3];
        emu.write("w", &q);
        emu.write("ids", &ids);
        emu.run("get_rows", &[s(ty.id()), s(rows), s(cols)]);
        let got: Vec<f32> = emu.read("out");
        let table = cpu.upload_matrix(ty, rows, cols, &q).unwrap();
        let mut out = cpu.alloc::<f32>(ids.len() * cols).unwrap();
        cpu.get_rows(&table, &cpu.upload(&ids).unwrap(), &mut out)
            .unwrap();
        let (same, _) = compare(&got, &cpu.download(&out).unwrap());
        assert_eq!(same, got.len(), "get_rows {ty}");
    }

    for shape in LOWBIT_MATMULS {
        for ty in LOWBIT_TYPES {
            for n in LOWBIT_TOKENS {
                matmul_case(&emu, &cpu, &mut rng, (ty, Arch::Older), shape, n);
            }
        }
    }

    // SiLU without biases (Qwen3-MoE), and for the first set gpt-oss's activation with biases.
    let (ne, d, ff, n, k) = LOWBIT_MOE;
    let shape = MoeShape { ne, d, ff, n, k };
    for (i, types) in lowbit_expert_sets().into_iter().enumerate() {
        let act = if i == 0 {
            (KERNEL_ACT, true)
        } else {
            (GatedAct::Silu, false)
        };
        moe_case(
            &emu,
            &cpu,
            &mut rng,
            (types, Arch::Older),
            shape,
            &LOWBIT_SEL,
            act,
        );
    }
}

/// Runs the emulated per-head products of `nh` heads of `out` rows of `cols` of `ty` on `n`
/// tokens whose head rows are `stride` values apart, against REF0's.
fn matmul_heads_case(
    emu: &Emulator,
    cpu: &Ref0,
    rng: &mut StdRng,
    ty: GgmlType,
    (nh, out, cols): (usize, usize, usize),
    (stride, n): (usize, usize),
) {
    let w = weights(rng, ty, nh * out, cols);
    let m = cpu.upload_matrix(ty, nh * out, cols, &w).unwrap();
    let x = noise(rng, n * nh * stride, 2.0);
    emu.write("w", &w);
    emu.write("x", &x);
    let vec_order = usize::from(!(stride == cols && n > 1));
    let args = [ty.id() as usize, out, cols, n * nh, nh, stride, vec_order];
    emu.run("matmul_heads", &args.map(s));
    let got: Vec<f32> = emu.read("y");
    let xd = cpu.upload(&x).unwrap();
    let mut yd = cpu.alloc::<f32>(n * nh * out).unwrap();
    cpu.matmul_heads(&m, &xd, n, nh, stride, &mut yd).unwrap();
    let what = format!("matmul_heads {ty} {nh}x{out}x{cols} stride {stride} n {n}");
    let (same, max) = reported(&what, &got, &cpu.download(&yd).unwrap());
    if exact(ty) {
        assert_eq!(same, got.len(), "{what}");
    } else {
        assert!(max < 1e-3, "{what}");
    }
}

/// Per-head products of the low-bit types (MLA's `attn_k_b`/`attn_v_b` in low-bit files):
/// heads whose rows make a matrix the CPU device repacks (Q4_0/Q4_K, 16 rows) and one it does
/// not (9 rows), contiguous inputs (each head's batch as a dense matmul: the grouped repacked
/// Q4_K order for 4 of 6 tokens, tiled K-quants from 8) and strided ones (`vec_dot`'s order,
/// DeepSeek's `q_nope` inside query rows of 64 more values); REF0's bits.
#[test]
#[ignore = "slow (a minute or two): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_lowbit_matmul_heads_give_the_reference_backends_bits() {
    let Some(emu) = Emulator::build("heads") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(8);
    for ty in LOWBIT_TYPES {
        let cols = 256;
        for (nh, out) in [(2, 8), (3, 3)] {
            for (stride, n) in [
                (cols, 1),
                (cols, 6),
                (cols, 9),
                (cols + 64, 3),
                (cols + 64, 9),
            ] {
                matmul_heads_case(&emu, &cpu, &mut rng, ty, (nh, out, cols), (stride, n));
            }
        }
    }
}

/// The low-bit kernels on real weights: in each real GGUF of the model cache (`$HMOE_MODELS`,
/// default `~/.cache/hmoe-models`, filled by `scripts/fetch-real-models.sh`; Qwen2.5-Coder-0.5B
/// Q4_K_M and SmolLM2-135M Q4_1), the first matrix of every quantized type the kernels
/// multiply: the first 13 rows (`vec_dot` / tiled orders) and 16 rows (repacked Q4_0/Q4_K) on
/// one token and nine, and the embedding rows of `token_embd`; REF0's bits. A model that is not
/// there is skipped.
#[test]
#[ignore = "slow, and needs the real models: cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_lowbit_kernels_on_real_weights_give_the_reference_backends_bits() {
    use hmoe_gguf::{GgufModel, LoadOptions};
    let dir = std::env::var_os("HMOE_MODELS")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/hmoe-models")));
    let files = [
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ];
    let Some(emu) = Emulator::build("real") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(13);
    for file in files {
        let Some(path) = dir.as_ref().map(|d| d.join(file)).filter(|p| p.is_file()) else {
            eprintln!("SKIPPED: {file} not in the model cache");
            continue;
        };
        let gguf = GgufModel::open(&path, LoadOptions::default()).unwrap();
        let mut seen = Vec::new();
        for info in gguf.tensors() {
            let ty = info.ty;
            let embd = info.name == "token_embd.weight";
            if info.dims.len() != 2 || !LOWBIT_TYPES.contains(&ty) || seen.contains(&ty) && !embd {
                continue;
            }
            seen.push(ty);
            let cols = info.dims[0] as usize;
            let rb = ty.row_bytes(cols as u64).unwrap() as usize;
            let data = gguf.data_of(info);
            for rows in [13, 16] {
                let q = &data[..rows * rb];
                let m = cpu.upload_matrix(ty, rows, cols, q).unwrap();
                if embd {
                    let ids: Vec<i32> = vec![0, 12, 5, -1];
                    emu.write("w", q);
                    emu.write("ids", &ids);
                    emu.run("get_rows", &[s(ty.id()), s(rows), s(cols)]);
                    let got: Vec<f32> = emu.read("out");
                    let mut out = cpu.alloc::<f32>(ids.len() * cols).unwrap();
                    cpu.get_rows(&m, &cpu.upload(&ids).unwrap(), &mut out)
                        .unwrap();
                    let (same, _) = compare(&got, &cpu.download(&out).unwrap());
                    assert_eq!(same, got.len(), "{file}: get_rows {}", info.name);
                }
                for n in [1, 9] {
                    let x = noise(&mut rng, n * cols, 1.0);
                    emu.write("w", q);
                    emu.write("x", &x);
                    emu.run("matmul", &[s(ty.id()), s(rows), s(cols), s(n)]);
                    let got: Vec<f32> = emu.read("y");
                    let mut yd = cpu.alloc::<f32>(n * rows).unwrap();
                    cpu.matmul(&m, &cpu.upload(&x).unwrap(), n, &mut yd)
                        .unwrap();
                    let what = format!("{file}: {} ({ty}) {rows} rows n={n}", info.name);
                    assert_bits(&what, &got, &cpu.download(&yd).unwrap());
                }
            }
        }
    }
}
