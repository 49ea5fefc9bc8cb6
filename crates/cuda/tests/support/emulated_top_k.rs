//! The top-k kernels (kernels/top_k.cu) in the emulator of tests/emulated.rs, against REF0:
//! rows of every size around the kernels' chunk (8192) and tile (1024), k from 1 (greedy) to
//! the bound (256), logits with many ties, ±0, ±inf, the extremes, subnormals and NaNs.

use hmoe_backend::{Backend, Ref0, TOP_K_CHUNK, TOP_K_MAX};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::emulator::{s, Emulator};

/// `n` rows of `n_vocab` logits of the kind `kind`: 0 few levels (ties everywhere), 1 noise
/// with specials mixed in (±0, ±inf, extremes, subnormals), 2 like 1 with NaNs too, 3
/// ascending (every logit ranks before the ones already seen).
fn logits(rng: &mut StdRng, n: usize, n_vocab: usize, kind: u32) -> Vec<f32> {
    const SPECIAL: [f32; 9] = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN,
        1e-45,
        -1e-45,
        f32::MIN_POSITIVE,
    ];
    (0..n * n_vocab)
        .map(|i| match kind {
            0 => rng.random_range(0..4) as f32 - 1.5,
            3 => (i % n_vocab) as f32 * 0.25,
            _ => match rng.random_range(0..20) {
                0 => SPECIAL[rng.random_range(0..SPECIAL.len())],
                1 if kind == 2 => [f32::NAN, -f32::NAN][rng.random_range(0..2)],
                _ => rng.random_range(-30.0f32..30.0),
            },
        })
        .collect()
}

#[test]
#[ignore = "slow (a minute or two): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_top_k_gives_the_reference_backends_bits() {
    let Some(emu) = Emulator::build("top_k") else {
        return;
    };
    let dev = Ref0::new();
    let mut rng = StdRng::seed_from_u64(46);
    let mut cases = 0;
    for (n_vocab, n) in [
        (1, 1),
        (3, 2),
        (257, 3),
        (1023, 1),
        (1025, 2),
        (TOP_K_CHUNK, 1),
        (TOP_K_CHUNK + 1, 2),
        (2 * TOP_K_CHUNK + 777, 1),
    ] {
        for k in [1, 2, 40, 64, TOP_K_MAX] {
            if k > n_vocab {
                continue;
            }
            for kind in 0..4 {
                let x = logits(&mut rng, n, n_vocab, kind);
                emu.write("logits", &x);
                emu.run("top_k", &[s(n), s(n_vocab), s(k)]);
                let (got_v, got_i) = (emu.read::<f32>("values"), emu.read::<i32>("ids"));
                let xd = dev.upload(&x).unwrap();
                let mut scratch = dev
                    .alloc_scratch::<i32>(dev.top_k_scratch(n, n_vocab, k))
                    .unwrap();
                let mut v = dev.alloc::<f32>(n * k).unwrap();
                let mut ids = dev.alloc::<i32>(n * k).unwrap();
                dev.top_k(&xd, n_vocab, k, &mut scratch, &mut v, &mut ids)
                    .unwrap();
                let what = format!("top_k {n}×{n_vocab} k={k} kind {kind}");
                assert_eq!(got_i, dev.download(&ids).unwrap(), "{what}: ids");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got_v), bits(&dev.download(&v).unwrap()), "{what}");
                cases += 1;
            }
        }
    }
    eprintln!("top_k: {cases} cases, REF0's bits");
}
