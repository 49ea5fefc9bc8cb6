//! Attention over K-only (latent) rings of every type in the emulator of tests/emulated.rs,
//! against REF0: the K/V store of the types only K-only rings use, both latent paths (one
//! block per (head, token), and split over positions through scores and weights), and the
//! rest of DeepSeek's layer on the device: per-head products and grouped routing.

use hmoe_backend::{Backend, KvLayout, KvRing, Ref0};
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::common::{noise, ref_ring, TYPES};
use super::emulator::{assert_bits, s, Emulator};
use super::matmul_heads_case;

/// The shape of a K-only attention case: `heads` query heads, a ring of `cells`, `n` tokens
/// from `pos0`, and at most `tiles` blocks per (head group, token) for the split path's scores
/// (fewer than its tiles of positions make its blocks stride).
#[derive(Clone, Copy)]
struct KOnlyShape {
    heads: usize,
    cells: usize,
    pos0: usize,
    n: usize,
    tiles: usize,
}

/// A [`KOnlyShape`] of 2 heads and 40 cells for `n` tokens from `pos0`.
fn ko(pos0: usize, n: usize) -> KOnlyShape {
    KOnlyShape {
        heads: 2,
        cells: 40,
        pos0,
        n,
        tiles: 256,
    }
}

/// The split path's tiles per launch in the launch code (KS_MAX_TILES).
const KS_MAX_TILES: usize = 256;

/// Runs the emulated attention over a random K-only ring of `ty` (keys of `kd` values, values
/// the first `vd`) of `shape`, both the one-block-per-(head, token) kernel and the split path,
/// against REF0's. The ring's cells after the batch's last position hold 0xff bytes (NaN in
/// every type) and the split path's scratch stale bits, which must not reach the result. A
/// batch that would see past the ring must leave `out` as it was (REF0 refuses it).
fn k_only_case(
    emu: &Emulator,
    cpu: &Ref0,
    rng: &mut StdRng,
    ty: GgmlType,
    (kd, vd): (usize, usize),
    shape: KOnlyShape,
) {
    use hmoe_backend::KOnlyAttnParams;
    let KOnlyShape {
        heads: nh,
        cells,
        pos0,
        n,
        tiles,
    } = shape;
    let p = KOnlyAttnParams {
        n_head: nh,
        k_dim: kd,
        v_dim: vd,
        cells,
        scale: 0.05,
    };
    let layout = KvLayout::new(ty, kd, cells, 0).unwrap();
    let mut bytes = ref_ring(cpu, layout, &noise(rng, cells * kd, 3.0));
    let row = bytes.len() / cells;
    if pos0 + n < cells {
        bytes[(pos0 + n) * row..].fill(0xff);
    }
    let q = noise(rng, n * nh * kd, 3.0);
    let ring = KvRing {
        data: cpu.upload(&bytes).unwrap(),
        layout,
    };
    let qd = cpu.upload(&q).unwrap();
    let sentinel = vec![f32::from_bits(0x7fc0_1234); n * nh * vd];
    let mut out = cpu.upload(&sentinel).unwrap();
    let want = match cpu.attention_k_only(&p, &qd, &ring, n, pos0, &mut out) {
        Ok(()) => cpu.download(&out).unwrap(),
        Err(_) => {
            assert!(pos0 + n > cells, "REF0 refused {ty} {kd}/{vd} {pos0}+{n}");
            sentinel.clone()
        }
    };
    emu.write("q", &q);
    emu.write("k", &bytes);
    for (split, tiles) in [(0, KS_MAX_TILES), (1, tiles)] {
        emu.write("out", &sentinel);
        let args = [
            s(n),
            s(nh),
            s(kd),
            s(vd),
            s(cells),
            s(pos0),
            s(p.scale.to_bits()),
            s(ty.id()),
            s(split),
            s(tiles),
        ];
        emu.run("attn_k_only", &args);
        let got: Vec<f32> = emu.read("out");
        let path = match split {
            0 => "one block per (head, token)".to_string(),
            _ => format!("split, at most {tiles} score tiles"),
        };
        let what = format!(
            "attention_k_only ({path}) {ty} kd {kd} vd {vd} heads {nh} cells {cells} \
             pos0 {pos0} n {n}"
        );
        assert_bits(&what, &got, &want);
    }
}

/// The K/V store of the types only K-only rings use, and attention over K-only (latent)
/// rings of every K/V type (f32, f16, bf16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), by the
/// one-block-per-(head, token) kernel and the split path: keys whose last 64-element step
/// (f32, f16) or 32-element step (bf16) is partial and whole ones, one query token (four value
/// chains for f32/f16) and a batch, positions over more than one chunk of 16 and over several
/// of the split path's tiles, a partial group of heads; REF0's bits.
#[test]
#[ignore = "slow: cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_k_only_rings_of_every_type_give_the_reference_backends_bits() {
    let Some(emu) = Emulator::build("k_only") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(9);
    // The K/V store of the types only K-only rings use (bf16, Q4_1, Q5_0, Q5_1; block types
    // also rotated): REF0's bytes, in a ring that wraps, with an all-zero block and one whose
    // largest magnitudes tie.
    for ty in [
        GgmlType::BF16,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
    ] {
        let rots: &[usize] = match ty {
            GgmlType::BF16 => &[0],
            _ => &[0, 64],
        };
        for &rot in rots {
            let (width, cells, pos0, n) = (128usize, 5usize, 3usize, 4usize);
            let layout = KvLayout::new(ty, width, cells, rot).unwrap();
            let before = ref_ring(&cpu, layout, &noise(&mut rng, cells * width, 1.0));
            let mut rows = noise(&mut rng, n * width, 2.0);
            rows[..32].fill(0.0);
            rows[32..64].fill(0.25);
            rows[40] = -0.75;
            rows[50] = 0.75;
            let mut ring = KvRing::<Ref0> {
                data: cpu.upload(&before).unwrap(),
                layout,
            };
            cpu.kv_store(&cpu.upload(&rows).unwrap(), &mut ring, n, pos0)
                .unwrap();
            emu.write("src", &rows);
            emu.write("ring", &before);
            let args = [ty.id() as usize, n, width, cells, pos0, rot];
            emu.run("kv_store", &args.map(s));
            let got: Vec<u8> = emu.read("ring");
            assert!(
                got == cpu.download(&ring.data).unwrap(),
                "kv_store {ty} rot {rot}"
            );
        }
    }
    for ty in hmoe_cuda::K_ONLY_TYPES {
        let dims: &[(usize, usize)] = match ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => &[(80, 48), (128, 64)],
            _ => &[(96, 64)],
        };
        // Ten heads (a group of 8 and a partial one), positions over several tiles of scores
        // (32, the blocks striding over them) and of values (64), a partly filled ring, and a
        // batch that would see past the ring (nothing written).
        let long = KOnlyShape {
            heads: 10,
            cells: 160,
            pos0: 130,
            n: 1,
            tiles: 2,
        };
        let across = KOnlyShape {
            heads: 10,
            cells: 100,
            pos0: 60,
            n: 6,
            tiles: KS_MAX_TILES,
        };
        for &dims in dims {
            for case in [ko(20, 1), ko(3, 5), ko(34, 4), long, across, ko(38, 4)] {
                k_only_case(&emu, &cpu, &mut rng, ty, dims, case);
            }
        }
    }
}

/// The kernels of latent attention and grouped routing (`rope_norm_f32`, `matmul_heads_*`,
/// `swiglu_f32`, `attn_k_only_f16`, `attn_k_only_q8_0`, `route_f32`) against the reference
/// device's ops, bit for bit (F16/BF16 per-head products only reported, as for `matmul`).
#[test]
#[ignore = "slow: cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_latent_attention_and_routing_kernels_give_the_reference_backends_bits() {
    use hmoe_backend::{Gating, Routing};
    let Some(emu) = Emulator::build("latent") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(6);

    // Per-head products, contiguous and strided inputs.
    for ty in TYPES {
        for case in [(64, 1), (64, 3), (64 + 32, 3)] {
            matmul_heads_case(&emu, &cpu, &mut rng, ty, (2, 8, 64), case);
        }
    }

    // SwiGLU with whole 16-blocks and a tail.
    for n in [32, 40] {
        let g = noise(&mut rng, 3 * n, 8.0);
        let u = noise(&mut rng, 3 * n, 2.0);
        emu.write("g", &g);
        emu.write("u", &u);
        emu.run("swiglu", &[s(n)]);
        let got: Vec<f32> = emu.read("g");
        let mut gd = cpu.upload(&g).unwrap();
        cpu.swiglu(&mut gd, &cpu.upload(&u).unwrap(), n).unwrap();
        assert_bits(&format!("swiglu n {n}"), &got, &cpu.download(&gd).unwrap());
    }

    // K-only attention: f16 keys not whole 16-lane steps (24) and whole (32), Q8_0 keys (the
    // query quantized, values dequantized from the keys), one token and a batch, more than
    // one chunk of 16 positions.
    for (ty, kd, vd) in [
        (GgmlType::F16, 24, 16),
        (GgmlType::F16, 32, 16),
        (GgmlType::Q8_0, 64, 32),
        (GgmlType::Q8_0, 96, 64),
    ] {
        let long = KOnlyShape {
            heads: 9,
            cells: 80,
            pos0: 70,
            n: 1,
            tiles: 1,
        };
        for case in [ko(20, 1), ko(3, 5), long] {
            k_only_case(&emu, &cpu, &mut rng, ty, (kd, vd), case);
        }
    }

    // Routing: softmax without groups, sigmoid with groups, a bias and scaled weights.
    let ne = 32;
    for (gating, routing, with_bias) in [
        (
            Gating::Softmax,
            Routing {
                k: 4,
                groups: None,
                norm: false,
                scale: 1.0,
            },
            false,
        ),
        (
            Gating::Sigmoid,
            Routing {
                k: 4,
                groups: Some((4, 2)),
                norm: true,
                scale: 2.5,
            },
            true,
        ),
    ] {
        let n = 6;
        let logits = noise(&mut rng, n * ne, 4.0);
        let bias = noise(&mut rng, ne, 0.3);
        emu.write("logits", &logits);
        emu.write("bias", &bias);
        let (groups, used) = routing.groups.unwrap_or((1, 1));
        let gating_i = usize::from(gating == Gating::Sigmoid);
        let args = [
            s(n),
            s(ne),
            s(routing.k),
            s(gating_i),
            s(groups),
            s(used),
            s(i32::from(routing.norm)),
            s(i32::from(with_bias)),
            s(routing.scale.to_bits()),
        ];
        emu.run("route", &args);
        let (got_sel, got_w): (Vec<i32>, Vec<f32>) = (emu.read("sel"), emu.read("w"));
        let ld = cpu.upload(&logits).unwrap();
        let bd = cpu.upload(&bias).unwrap();
        let k = routing.k;
        let (mut sel, mut w) = (
            cpu.alloc::<i32>(n * k).unwrap(),
            cpu.alloc::<f32>(n * k).unwrap(),
        );
        let b = with_bias.then_some(&bd);
        cpu.route(&ld, b, gating, &routing, ne, &mut sel, &mut w)
            .unwrap();
        assert_eq!(got_sel, cpu.download(&sel).unwrap(), "route {routing:?}");
        assert_bits(
            &format!("route {routing:?}"),
            &got_w,
            &cpu.download(&w).unwrap(),
        );
    }
}
