//! The sampler from a token's best logits alone ([`Sampler::sample_top`]) against the whole
//! row ([`Sampler::sample`]): the same tokens, draw for draw, and the same distribution, for
//! the chains that say they need no more ([`Sampler::top_needed`]), with the best logits
//! ranked by the CPU device's `top_k` and by REF0's (two passes through poisoned scratch);
//! and `None` for the chains that need the whole row.

use hmoe_backend::{Backend, Ref0, TOP_K_MAX};

use super::*;
use crate::DryParams;

/// A xorshift stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Logits like a model's (a peaked tail), with ties, ±inf and extremes mixed in; the best
    /// a number other than zero (a row with a NaN or a zero at the top comes down whole).
    fn logits(&mut self, n: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n)
            .map(|_| match self.next() % 50 {
                0 => f32::NEG_INFINITY,
                1 => -0.0,
                2 => 0.0,
                3 => f32::MIN,
                4..=15 => (self.next() % 6) as f32 * 0.5,
                _ => ((self.next() >> 40) as f32 / (1u64 << 24) as f32).powi(6) * 12.0 - 4.0,
            })
            .collect();
        let at = (self.next() % n as u64) as usize;
        v[at] = 9.0 + (self.next() % 3) as f32;
        v
    }
}

/// The `k` best of `logits`, ranked by the CPU device's op (`via_ref0`: REF0's).
fn best(logits: &[f32], k: usize, via_ref0: bool) -> Vec<(u32, f32)> {
    let (mut v, mut ids) = (vec![0f32; k], vec![0i32; k]);
    if via_ref0 {
        let dev = Ref0::new();
        let x = dev.upload(logits).unwrap();
        let mut s = dev
            .alloc_scratch::<i32>(dev.top_k_scratch(1, logits.len(), k))
            .unwrap();
        let (mut vd, mut idd) = (dev.alloc::<f32>(k).unwrap(), dev.alloc::<i32>(k).unwrap());
        dev.top_k(&x, logits.len(), k, &mut s, &mut vd, &mut idd)
            .unwrap();
        v = dev.download(&vd).unwrap();
        ids = dev.download(&idd).unwrap();
    } else {
        hmoe_backend::top_k_rows(logits, logits.len(), k, &mut v, &mut ids).unwrap();
    }
    ids.into_iter().map(|i| i as u32).zip(v).collect()
}

/// The chains of the comparison: greedy, llama-server's default, top-k 40 with top-p, min-p
/// and a temperature, top-k 1 at a temperature, locally typical sampling and XTC after top-k,
/// greedy behind a no-op penalty, top-k at the bound.
fn chains() -> Vec<SamplerParams> {
    let d = SamplerParams::default;
    vec![
        SamplerParams {
            temperature: 0.0,
            ..d()
        },
        d(),
        SamplerParams {
            top_k: 40,
            top_p: 0.9,
            min_p: 0.02,
            temperature: 1.3,
            ..d()
        },
        SamplerParams {
            top_k: 1,
            temperature: 2.0,
            ..d()
        },
        SamplerParams {
            typical_p: 0.8,
            xtc_probability: 0.5,
            xtc_threshold: 0.05,
            min_keep: 3,
            ..d()
        },
        SamplerParams {
            temperature: -1.0,
            top_k: 0,
            repeat_penalty: 1.0,
            ..d()
        },
        SamplerParams {
            top_k: TOP_K_MAX,
            top_p: 1.0,
            min_p: 0.0,
            ..d()
        },
    ]
}

#[test]
fn best_logits_alone_sample_as_the_whole_row_over_many_seeds() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut compared = 0;
    for (c, params) in chains().into_iter().enumerate() {
        for seed in 0..24u64 {
            let params = SamplerParams {
                seed: seed * 7919 + c as u64,
                ..params.clone()
            };
            let (mut full, mut top) = (Sampler::new(params.clone()), Sampler::new(params));
            let k = full.top_needed(TOP_K_MAX).expect("the chain needs no more");
            assert!(k == 1 || k == full.params.top_k, "chain {c}: k = {k}");
            let n_vocab = [50, 300, 2000, 9000][seed as usize % 4];
            for step in 0..6 {
                let logits = rng.logits(n_vocab);
                let b = best(&logits, k.min(n_vocab), (seed + step) % 2 == 1);
                assert_eq!(
                    full.distribution(&logits),
                    top.distribution_top(&b),
                    "chain {c} seed {seed} step {step}"
                );
                let (a, t) = (full.sample(&logits), top.sample_top(&b));
                assert_eq!(a, t, "chain {c} seed {seed} step {step}");
                full.accept(a);
                top.accept(t);
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 7 * 24 * 6);
}

#[test]
fn chains_that_need_the_whole_row_say_so() {
    let d = SamplerParams::default;
    let whole = [
        SamplerParams {
            repeat_penalty: 1.1,
            ..d()
        },
        SamplerParams {
            dry: DryParams {
                multiplier: 0.8,
                ..DryParams::default()
            },
            ..d()
        },
        SamplerParams {
            top_n_sigma: 1.0,
            ..d()
        },
        SamplerParams {
            mirostat: Mirostat::V2,
            ..d()
        },
        SamplerParams { top_k: 0, ..d() },
        SamplerParams {
            top_k: TOP_K_MAX + 1,
            ..d()
        },
        // Greedy behind a penalty that moves logits.
        SamplerParams {
            temperature: 0.0,
            repeat_penalty: 1.3,
            ..d()
        },
        // Top-k after top-p.
        SamplerParams {
            order: vec![
                SamplerStage::TopP,
                SamplerStage::TopK,
                SamplerStage::Temperature,
            ],
            ..d()
        },
    ];
    for (i, p) in whole.into_iter().enumerate() {
        assert_eq!(Sampler::new(p).top_needed(TOP_K_MAX), None, "chain {i}");
    }
    // A bound below the chain's k: the whole row.
    assert_eq!(Sampler::new(d()).top_needed(39), None);
    assert_eq!(Sampler::new(d()).top_needed(40), Some(40));
}
