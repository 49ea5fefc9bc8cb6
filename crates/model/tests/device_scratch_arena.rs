//! The executor's scratch arena on the reference device: after the first decode step, a
//! decode step allocates nothing on the device (REF0 counts every allocation), for the
//! gpt-oss, Qwen3-MoE and DeepSeek-V3 fixtures, with the routed experts on the device and on
//! the host (one round trip per layer), one sequence at a time and two batched in one
//! `forward_multi`; and the logits of every step stay the CPU's bit for bit. REF0 fills fresh
//! scratch with NaN, so an op that read scratch it had not written would show here too.

mod common;

use common::fixtures;
use hmoe_backend::Ref0;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted, SeqBatch,
};

const UBATCH: usize = 8;
const N_CTX: usize = 64;
const N_DECODE: usize = 5;

const MODELS: [&str; 3] = [
    "gpt-oss/gptoss-tiny.gguf",
    "qwen3moe/qwen3moe-tiny.gguf",
    "deepseek2/deepseek2-tiny.gguf",
];

fn open(file: &str) -> GgufModel {
    GgufModel::open(fixtures().join(file), LoadOptions::default()).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32
}

/// A prompt of 11 tokens (two micro-batches, the last position's logits), then greedy decode
/// steps: each feed's logits, and the device allocations each decode step made (`allocs`
/// reads the device's count; the CPU has none).
fn run(model: &dyn LanguageModel, allocs: &dyn Fn() -> u64) -> (Vec<Vec<f32>>, Vec<u64>) {
    let prompt: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % 500).collect();
    let mut cache = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let mut out = vec![model
        .forward(&mut cache, &prompt, LogitsWanted::Last)
        .unwrap()];
    let mut made = Vec::new();
    for _ in 0..N_DECODE {
        let next = argmax(out.last().unwrap());
        let before = allocs();
        out.push(
            model
                .forward(&mut cache, &[next], LogitsWanted::Last)
                .unwrap(),
        );
        made.push(allocs() - before);
    }
    (out, made)
}

/// Two sequences in one `forward_multi` per step (prompts of 5 and 3 tokens, then one token
/// each): the logits of each, and the device allocations of each one-token step.
fn run_pair(model: &dyn LanguageModel, allocs: &dyn Fn() -> u64) -> (Vec<Vec<f32>>, Vec<u64>) {
    let mut a = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let mut b = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let mut feeds: Vec<(Vec<u32>, Vec<u32>)> = vec![(vec![5, 9, 11, 300, 2], vec![7, 8, 9])];
    feeds.extend((0..N_DECODE as u32).map(|i| (vec![40 + i], vec![60 + i])));
    let (mut out, mut made) = (Vec::new(), Vec::new());
    for (j, (fa, fb)) in feeds.iter().enumerate() {
        let mut seqs = [
            SeqBatch {
                cache: &mut a,
                tokens: fa,
                logits: true,
            },
            SeqBatch {
                cache: &mut b,
                tokens: fb,
                logits: true,
            },
        ];
        let before = allocs();
        out.extend(model.forward_multi(&mut seqs).unwrap());
        if j > 0 {
            made.push(allocs() - before);
        }
    }
    (out, made)
}

/// Whether the first decode step allocated (its buffers are one token long, the prompt's
/// were longer) and every later one nothing.
fn none_after_first(made: &[u64]) -> bool {
    made.first().is_some_and(|&m| m > 0) && made.iter().skip(1).all(|&m| m == 0)
}

#[test]
fn decode_steps_after_the_first_allocate_nothing_on_ref0() {
    for file in MODELS {
        let cpu = hmoe_model::load(open(file)).unwrap();
        let (want, _) = run(cpu.as_ref(), &|| 0);
        let (want_pair, _) = run_pair(cpu.as_ref(), &|| 0);
        let meta = cpu.gguf().metadata();
        let arch = meta.architecture().unwrap();
        let n_layer = meta.get_u32(&format!("{arch}.block_count")).unwrap() as usize;
        for home in [ExpertHome::Device, ExpertHome::Host] {
            let placement = ExpertPlacement {
                layers: vec![home; n_layer],
                op_offload_min_batch: None,
            };
            let dev = DeviceModel::load(open(file), Ref0::new(), &placement).unwrap();
            let allocs = || dev.device().allocations();
            let (got, made) = run(&dev, &allocs);
            for (s, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    bits(g) == bits(w),
                    "{file} {home:?}: feed {s} is not the CPU's"
                );
            }
            assert!(
                none_after_first(&made),
                "{file} {home:?}: allocations per decode step {made:?}"
            );
            let (got, made) = run_pair(&dev, &allocs);
            for (s, (g, w)) in got.iter().zip(&want_pair).enumerate() {
                assert!(
                    bits(g) == bits(w),
                    "{file} {home:?}: pair logits {s} not the CPU's"
                );
            }
            assert!(
                none_after_first(&made),
                "{file} {home:?}: allocations per batched decode step {made:?}"
            );
        }
    }
}
