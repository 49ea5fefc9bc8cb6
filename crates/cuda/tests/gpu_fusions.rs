//! The fused contract ops on a GPU: each one launch on the CUDA device, each promising the
//! bits of the ops it fuses (its default body). Here every fused op runs against those ops on
//! the same device, bit for bit, so that a GPU session tells a fusion's fault apart from the
//! ops' own (the emulator, tests/emulated.rs, checks the same kernels against REF0 without a
//! GPU). Each test returns early ("no CUDA device: skipped") where there is none.

use hmoe_backend::{Backend, KvLayout, RopeParams};
use hmoe_cuda::CudaDevice;
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::SeedableRng;

#[allow(dead_code)]
mod common;
#[path = "support/gpu_device.rs"]
mod gpu_device;
use common::noise;
use gpu_device::device;

/// `got` and `want` hold the same bits.
fn assert_same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: {g} against {w}");
    }
}

/// The residual add and the norm in one launch: `x` updated and the normed output, as
/// `add_assign` then `rms_norm` give them (rows of gpt-oss's 2,880 and of 64; 1 and 5 rows).
#[test]
fn add_rms_norm_gives_the_add_then_the_norms_bits() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(71);
    for (rows, d) in [(1, 2880), (5, 2880), (3, 64)] {
        let x = noise(&mut rng, rows * d, 3.0);
        let y = noise(&mut rng, rows * d, 1.0);
        let w = dev.upload(&noise(&mut rng, d, 1.0)).unwrap();
        let yd = dev.upload(&y).unwrap();
        let (mut x1, mut x2) = (dev.upload(&x).unwrap(), dev.upload(&x).unwrap());
        let (mut o1, mut o2) = (
            dev.alloc::<f32>(rows * d).unwrap(),
            dev.alloc::<f32>(rows * d).unwrap(),
        );
        Backend::add_rms_norm(dev, &mut x1, &yd, &w, 1e-5, &mut o1).unwrap();
        Backend::add_assign(dev, &mut x2, &yd).unwrap();
        Backend::rms_norm(dev, &x2, &w, 1e-5, &mut o2).unwrap();
        let what = format!("add_rms_norm {rows}x{d}");
        assert_same_bits(
            &what,
            &dev.download(&x1).unwrap(),
            &dev.download(&x2).unwrap(),
        );
        assert_same_bits(
            &what,
            &dev.download(&o1).unwrap(),
            &dev.download(&o2).unwrap(),
        );
    }
}

/// RoPE of the queries and the keys in one launch, as two `rope_neox` give it (gpt-oss's 64
/// query and 8 key heads of 64, YaRN, and a plain RoPE; positions far apart).
#[test]
fn rope_neox_qk_gives_two_ropes_bits() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(72);
    let (nq, nk, hd) = (64, 8, 64);
    let positions = [0i32, 1, 7, 130, 4095, 70000];
    let n = positions.len();
    let pd = dev.upload(&positions).unwrap();
    for p in [
        RopeParams::yarn(hd, 150000.0, 32.0, 4096, 1.0, 32.0, 1.0),
        RopeParams::plain(hd, 10000.0),
    ] {
        let q = noise(&mut rng, n * nq * hd, 2.0);
        let k = noise(&mut rng, n * nk * hd, 2.0);
        let (mut q1, mut k1) = (dev.upload(&q).unwrap(), dev.upload(&k).unwrap());
        let (mut q2, mut k2) = (dev.upload(&q).unwrap(), dev.upload(&k).unwrap());
        Backend::rope_neox_qk(dev, &mut q1, &mut k1, &pd, (nq, nk), hd, &p).unwrap();
        Backend::rope_neox(dev, &mut q2, &pd, nq, hd, &p).unwrap();
        Backend::rope_neox(dev, &mut k2, &pd, nk, hd, &p).unwrap();
        assert_same_bits(
            "rope q",
            &dev.download(&q1).unwrap(),
            &dev.download(&q2).unwrap(),
        );
        assert_same_bits(
            "rope k",
            &dev.download(&k1).unwrap(),
            &dev.download(&k2).unwrap(),
        );
    }
}

/// A K ring and a V ring of these types and rotations on `dev`, `cells` rows of `width`.
fn ring_pair(
    dev: &CudaDevice,
    (kt, k_rot): (GgmlType, usize),
    (vt, v_rot): (GgmlType, usize),
    width: usize,
    cells: usize,
) -> [hmoe_backend::KvRing<CudaDevice>; 2] {
    [(kt, k_rot), (vt, v_rot)].map(|(ty, rot)| {
        let layout = KvLayout::new(ty, width, cells, rot).unwrap();
        dev.kv_alloc(layout).unwrap()
    })
}

/// Keys and values stored in one launch, as two `kv_store_at` store them: the rings' bytes,
/// for float and block types, rotated and not, from a position that wraps the ring.
#[test]
fn kv_store_pair_at_gives_two_stores_bytes() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(73);
    let (width, cells, n) = (512, 64, 5);
    let pairs = [
        ((GgmlType::F16, 0), (GgmlType::F16, 0)),
        ((GgmlType::Q8_0, 64), (GgmlType::F16, 0)),
        ((GgmlType::F32, 0), (GgmlType::Q4_0, 64)),
        ((GgmlType::Q8_0, 64), (GgmlType::Q8_0, 64)),
    ];
    // The batch's first position is read on the device from positions[first].
    let positions = [61i32, 62, 63, 64, 65];
    let pd = dev.upload(&positions).unwrap();
    for (k_ty, v_ty) in pairs {
        let k = dev.upload(&noise(&mut rng, n * width, 2.0)).unwrap();
        let v = dev.upload(&noise(&mut rng, n * width, 2.0)).unwrap();
        let [mut k1, mut v1] = ring_pair(dev, k_ty, v_ty, width, cells);
        let [mut k2, mut v2] = ring_pair(dev, k_ty, v_ty, width, cells);
        Backend::kv_store_pair_at(dev, (&k, &mut k1), (&v, &mut v1), n, &pd, 0).unwrap();
        Backend::kv_store_at(dev, &k, &mut k2, n, &pd, 0).unwrap();
        Backend::kv_store_at(dev, &v, &mut v2, n, &pd, 0).unwrap();
        for (what, a, b) in [("K", &k1, &k2), ("V", &v1, &v2)] {
            let (a, b) = (
                dev.kv_read(a, 0..cells).unwrap(),
                dev.kv_read(b, 0..cells).unwrap(),
            );
            assert!(a == b, "{what} ring of {k_ty:?}/{v_ty:?}: the bytes differ");
        }
    }
}
