//! The dense Llama-family files (`archs/llama.rs`: `llama`, `qwen2`) on a device, the
//! reference device and the CPU as a device (`hmoe_cpu::Cpu`), each test taking the device as
//! a parameter: `DeviceModel<Ref0>` and `DeviceModel<Cpu>` give the CPU's logits bit for bit on the real published
//! weights (SmolLM2-135M-Instruct Q4_1 with its Q8_0 tied embedding, normal RoPE and 3-way GQA;
//! Qwen2.5-Coder-0.5B-Instruct Q4_K_M with Q4_K/Q5_0/Q6_K/Q8_0 weights, q/k/v biases, NeoX
//! RoPE and 7-way GQA), teacher-forced over llama.cpp's golden prompts and greedy tokens (the
//! prompt over several micro-batches of 8, once with every position's logits, then one token
//! at a time past 16 positions), with f32, f16 and q8_0 K/V. Nothing crosses the bus between the
//! ids and the logits (two small uploads and the logits per micro-batch), and several
//! sequences batched in one `forward_multi` get what each gets alone (the transfers are
//! counted on REF0; the CPU makes none).
//!
//! The GGUFs are not committed (`scripts/fetch-real-models.sh` puts them in `$HMOE_MODELS`,
//! default `~/.cache/hmoe-models`); without them each test prints `SKIPPED: <why>` and passes.

mod common;

use std::path::PathBuf;

use common::{ids, load_json};
use hmoe_backend::{Backend, Ref0};
use hmoe_cpu::Cpu;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted, SeqBatch,
};

const SMOLLM2: (&str, &str) = (
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "smollm2-135m-instruct-q4_1.golden.json",
);
const QWEN25: (&str, &str) = (
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.golden.json",
);

/// Micro-batch of the teacher-forced runs: the longer prompts take several, of 8 tokens (the
/// size from which the CPU tiles K-quant products) and a remainder.
const UBATCH: usize = 8;
const N_CTX: usize = 128;
/// Greedy tokens fed per case (each gives the next distribution).
const STEPS: usize = 8;

/// Opens `file` from the model cache, or prints why the test is skipped.
fn open(file: &str) -> Option<GgufModel> {
    let dir = std::env::var_os("HMOE_MODELS")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/hmoe-models")));
    match dir.map(|d| d.join(file)) {
        Some(p) if p.is_file() => Some(GgufModel::open(&p, LoadOptions::default()).unwrap()),
        _ => {
            eprintln!(
                "SKIPPED: {file} not in the model cache ($HMOE_MODELS or ~/.cache/hmoe-models); \
                 run scripts/fetch-real-models.sh to download it"
            );
            None
        }
    }
}

/// The CPU and the same file on `dev` (no experts: every layer's home is moot).
fn models<B: Backend + 'static>(
    file: &str,
    dev: B,
) -> Option<(Box<dyn LanguageModel>, DeviceModel<B>)> {
    let cpu = hmoe_model::load(open(file)?).unwrap();
    let gguf = open(file)?;
    let n_layer = hmoe_model::DenseParams::from_metadata(
        gguf.metadata(),
        match gguf.metadata().architecture() {
            Some("qwen2") => hmoe_model::DenseArch::Qwen2,
            _ => hmoe_model::DenseArch::Llama,
        },
        cpu.n_vocab(),
    )
    .unwrap()
    .n_layer;
    let placement = ExpertPlacement {
        layers: vec![ExpertHome::Host; n_layer],
        op_offload_min_batch: None,
    };
    let dev = DeviceModel::load(gguf, dev, &placement).unwrap();
    Some((cpu, dev))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The golden cases' prompts and greedy continuations.
fn cases(golden: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    let g = load_json("real", golden);
    g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (ids(&c["prompt_tokens"]), ids(&c["greedy_tokens"])))
        .collect()
}

/// Teacher-forced logits: the prompt's (`wanted`), then each of the first [`STEPS`] greedy
/// tokens one at a time.
fn teacher_forced(
    model: &dyn LanguageModel,
    kv: KvType,
    prompt: &[u32],
    greedy: &[u32],
    wanted: LogitsWanted,
) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(kv, N_CTX, UBATCH);
    let mut out = vec![model.forward(&mut cache, prompt, wanted).unwrap()];
    for &t in &greedy[..STEPS] {
        out.push(model.forward(&mut cache, &[t], LogitsWanted::Last).unwrap());
    }
    out
}

fn check_bit_for_bit<B: Backend + 'static>((file, golden): (&str, &str), dev: B) {
    let Some((cpu, dev)) = models(file, dev) else {
        return;
    };
    let kvs = [
        ("f32", KvType::F32),
        ("f16", KvType::F16),
        ("q8_0", KvType::parse("q8_0").unwrap()),
    ];
    for (i, (prompt, greedy)) in cases(golden).iter().enumerate() {
        // Every case with f32 K/V; the second (an 18- or 13-token prompt, whose decode steps
        // see more than one 16-position chunk) also with f16 and q8_0.
        for (kv_name, kv) in kvs.iter().take(if i == 1 { 3 } else { 1 }) {
            // Every prompt position's logits in the first case (the output head over a
            // batch), the last one's in the others.
            let wanted = match i {
                0 => LogitsWanted::All,
                _ => LogitsWanted::Last,
            };
            let want = teacher_forced(cpu.as_ref(), *kv, prompt, greedy, wanted);
            let before = dev.stats();
            let got = teacher_forced(&dev, *kv, prompt, greedy, wanted);
            for (s, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    bits(g) == bits(w),
                    "{file} case {i} K/V {kv_name}: feed {s} differs from the CPU"
                );
            }
            let after = dev.stats();
            let ubatches = after.ubatches - before.ubatches;
            assert_eq!(
                ubatches as usize,
                prompt.len().div_ceil(UBATCH) + STEPS,
                "{file} case {i}"
            );
            assert_eq!(
                after.host_round_trips, 0,
                "{file}: no experts, no round trips"
            );
            // Per micro-batch the ids and positions up; the logits down for those that want
            // them (the prompt's last and each step); nothing else (on a device that counts).
            if let (Some(t0), Some(t1)) = (before.transfers, after.transfers) {
                assert_eq!(t1.uploads - t0.uploads, 2 * ubatches, "{file} case {i}");
                let downloads = t1.downloads - t0.downloads;
                assert_eq!(downloads as usize, 1 + STEPS, "{file} case {i}");
            }
        }
    }
}

#[test]
fn ref0_smollm2_is_the_cpu_device_bit_for_bit() {
    check_bit_for_bit(SMOLLM2, Ref0::new());
}

#[test]
fn ref0_qwen25_is_the_cpu_device_bit_for_bit() {
    check_bit_for_bit(QWEN25, Ref0::new());
}

#[test]
fn cpu_smollm2_is_the_cpu_device_bit_for_bit() {
    check_bit_for_bit(SMOLLM2, Cpu::new());
}

#[test]
fn cpu_qwen25_is_the_cpu_device_bit_for_bit() {
    check_bit_for_bit(QWEN25, Cpu::new());
}

/// The golden prompts batched in one `forward_multi` (42 tokens for Qwen2.5: the CPU
/// would tile K-quant products over such a batch, so they run per sequence), then a decode
/// step of all three: each sequence's logits are what it gets alone, and the CPU's.
fn check_batched<B: Backend + 'static>((file, golden): (&str, &str), dev: B) {
    let Some((cpu, dev)) = models(file, dev) else {
        return;
    };
    let cases = cases(golden);
    let kv = KvType::F16;
    let alone = |model: &dyn LanguageModel| -> Vec<[Vec<f32>; 2]> {
        cases
            .iter()
            .map(|(p, g)| {
                let mut c = model.new_cache(kv, N_CTX, 32);
                let first = model.forward(&mut c, p, LogitsWanted::Last).unwrap();
                let second = model.forward(&mut c, &g[..1], LogitsWanted::Last).unwrap();
                [first, second]
            })
            .collect()
    };
    let want = alone(cpu.as_ref());
    for (i, (d, w)) in alone(&dev).iter().zip(&want).enumerate() {
        for step in 0..2 {
            assert!(
                bits(&d[step]) == bits(&w[step]),
                "{file}: sequence {i} step {step} alone differs from the CPU"
            );
        }
    }
    let mut caches: Vec<_> = cases.iter().map(|_| dev.new_cache(kv, N_CTX, 32)).collect();
    for step in 0..2 {
        let before = dev.stats();
        let mut seqs: Vec<SeqBatch<'_, '_>> = caches
            .iter_mut()
            .zip(&cases)
            .map(|(cache, (p, g))| SeqBatch {
                cache,
                tokens: if step == 0 { p } else { &g[..1] },
                logits: true,
            })
            .collect();
        let together = dev.forward_multi(&mut seqs).unwrap();
        assert_eq!(
            dev.stats().ubatches - before.ubatches,
            1,
            "{file}: one micro-batch"
        );
        for (i, (t, w)) in together.iter().zip(&want).enumerate() {
            assert!(
                bits(t) == bits(&w[step]),
                "{file}: sequence {i} step {step} batched differs from the CPU alone"
            );
        }
    }
}

#[test]
fn ref0_smollm2_batched_sequences_equal_each_alone() {
    check_batched(SMOLLM2, Ref0::new());
}

#[test]
fn ref0_qwen25_batched_sequences_equal_each_alone() {
    check_batched(QWEN25, Ref0::new());
}

#[test]
fn cpu_smollm2_batched_sequences_equal_each_alone() {
    check_batched(SMOLLM2, Cpu::new());
}

#[test]
fn cpu_qwen25_batched_sequences_equal_each_alone() {
    check_batched(QWEN25, Cpu::new());
}
