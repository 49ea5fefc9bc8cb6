//! Generation with the best logits ranked on the device against the whole row brought down
//! ([`Generator::with_device_top_k`]): the same tokens on REF0 (whose every transfer is
//! counted: fewer bytes come down) and on the CPU device, over many seeds and sampler
//! settings, and a chain that needs the whole row (a repetition penalty) takes it.

use hmoe_backend::{Backend, Ref0};
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{DeviceModel, LanguageModel};

use super::*;
use crate::SamplerParams;

fn open() -> GgufModel {
    let path = hmoe_testdata::fixtures().join("gpt-oss/gptoss-tiny.gguf");
    GgufModel::open(&path, LoadOptions::default()).unwrap()
}

/// The tokens `n` steps of `params` produce after a fixed prompt, with the device's ranking on
/// or off.
fn tokens(model: &dyn LanguageModel, params: &SamplerParams, on: bool, n: usize) -> Vec<u32> {
    let mut g = Generator::new(model, KvType::F16, 128, 16).with_device_top_k(on);
    let mut s = Sampler::new(params.clone());
    let prompt: Vec<u32> = (0..9).map(|i| (i * 53 + 11) % 900).collect();
    let out = g
        .generate(&prompt, n, &mut s, None, 0, &|_| false, &mut |_| true)
        .unwrap();
    out.generated
}

#[test]
fn device_top_k_generates_the_same_tokens() {
    let d = SamplerParams::default;
    let settings = [
        SamplerParams {
            temperature: 0.0,
            ..d()
        },
        d(),
        SamplerParams {
            top_k: 40,
            top_p: 0.9,
            min_p: 0.02,
            temperature: 1.5,
            ..d()
        },
        // Needs the whole row: both ways take it.
        SamplerParams {
            repeat_penalty: 1.3,
            ..d()
        },
    ];
    let ref0 = DeviceModel::load_whole(open(), Ref0::new()).unwrap();
    let cpu = hmoe_model::load(open()).unwrap();
    let n = 12;
    for (i, p) in settings.iter().enumerate() {
        for seed in 0..6 {
            let p = SamplerParams {
                seed: 1000 * i as u64 + seed,
                ..p.clone()
            };
            let down = || ref0.device().transfers().unwrap().download_bytes;
            let before = down();
            let whole = tokens(&ref0, &p, false, n);
            let mid = down();
            let top = tokens(&ref0, &p, true, n);
            let after = down();
            assert_eq!(whole, top, "REF0 setting {i} seed {seed}");
            match Sampler::new(p.clone()).top_needed(crate::TOP_K_MAX) {
                Some(_) => assert!(after - mid < mid - before, "setting {i}: bytes down"),
                None => assert_eq!(after - mid, mid - before, "setting {i}: bytes down"),
            }
            assert_eq!(
                tokens(cpu.as_ref(), &p, false, n),
                tokens(cpu.as_ref(), &p, true, n),
                "CPU setting {i} seed {seed}"
            );
            assert_eq!(whole, tokens(cpu.as_ref(), &p, true, n), "CPU vs REF0");
        }
    }
}
