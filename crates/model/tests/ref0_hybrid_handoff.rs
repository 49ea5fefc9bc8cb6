//! The hybrid hand-off on the reference device: in a decode step with the routed experts on
//! the host, each MoE layer moves its router's outputs (normed hidden state, chosen experts,
//! weights) down in one packed copy and its expert sum up in one copy, and nothing else
//! crosses; the logits are the CPU device's bit for bit. For the gpt-oss, qwen3moe and
//! deepseek2 stand-ins. Meanwhile the CPU's pool workers poll for the hybrid's longer time.

mod common;

use std::time::Duration;

use common::fixtures;
use hmoe_backend::{Ref0, TransferCounts};
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted};

const UBATCH: usize = 8;
const N_CTX: usize = 64;
const N_DECODE: usize = 3;

fn open(file: &str) -> GgufModel {
    GgufModel::open(fixtures().join(file), LoadOptions::default()).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32
}

/// A prompt of 12 tokens, then greedy decode steps: each step's logits and, where `counts`
/// gives the device's transfer counts, each decode step's transfers.
fn run(
    model: &dyn LanguageModel,
    counts: &dyn Fn() -> Option<TransferCounts>,
) -> (Vec<Vec<f32>>, Vec<TransferCounts>) {
    let n_vocab = model.n_vocab();
    let prompt: Vec<u32> = (0..12).map(|i| ((i * 53 + 7) % n_vocab) as u32).collect();
    let mut cache = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let mut logits = vec![model
        .forward(&mut cache, &prompt, LogitsWanted::Last)
        .unwrap()];
    let mut steps = Vec::new();
    for _ in 0..N_DECODE {
        let next = argmax(logits.last().unwrap());
        let before = counts().unwrap_or_default();
        logits.push(
            model
                .forward(&mut cache, &[next], LogitsWanted::Last)
                .unwrap(),
        );
        let after = counts().unwrap_or_default();
        steps.push(TransferCounts {
            uploads: after.uploads - before.uploads,
            upload_bytes: after.upload_bytes - before.upload_bytes,
            downloads: after.downloads - before.downloads,
            download_bytes: after.download_bytes - before.download_bytes,
        });
    }
    (logits, steps)
}

/// `file` with `n_layer` layers of which `n_moe` have routed experts, `d` wide, `k` experts
/// per token.
fn check(file: &str, n_layer: usize, n_moe: u64, d: u64, k: u64) {
    let cpu = hmoe_model::load(open(file)).unwrap();
    let (want, _) = run(cpu.as_ref(), &|| None);
    let load = |home| {
        let placement = ExpertPlacement {
            layers: vec![home; n_layer],
            op_offload_min_batch: None,
        };
        DeviceModel::load(open(file), Ref0::new(), &placement).unwrap()
    };
    let on_device = load(ExpertHome::Device);
    let (got, device_steps) = run(&on_device, &|| on_device.stats().transfers);
    assert_eq!(bits_of(&got), bits_of(&want), "{file}: experts on REF0");
    let hybrid = load(ExpertHome::Host);
    // While a model has host layers, idle pool workers poll through the device phase.
    if std::env::var_os("HMOE_POOL_SPIN_US").is_none() {
        assert!(
            hmoe_pool::global().poll_time() >= Duration::from_millis(2),
            "{file}"
        );
    }
    let (got, hybrid_steps) = run(&hybrid, &|| hybrid.stats().transfers);
    assert_eq!(bits_of(&got), bits_of(&want), "{file}: experts on the host");
    for (s, (h, dv)) in hybrid_steps.iter().zip(&device_steps).enumerate() {
        let what = format!("{file}: decode step {s}");
        // Down: the logits, then one packed copy per MoE layer (h, the ids and the
        // weights of the one token side by side).
        assert_eq!(dv.downloads, 1, "{what}");
        assert_eq!(h.downloads, 1 + n_moe, "{what}");
        assert_eq!(
            h.download_bytes - dv.download_bytes,
            n_moe * 4 * (d + 2 * k),
            "{what}"
        );
        // Up: what the all-device step uploads, and one expert sum per MoE layer.
        assert_eq!(h.uploads, dv.uploads + n_moe, "{what}");
        assert_eq!(h.upload_bytes - dv.upload_bytes, n_moe * 4 * d, "{what}");
    }
}

fn bits_of(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter().map(|l| bits(l)).collect()
}

/// The widths of a fixture: (layers, embedding width, experts per token).
fn dims(file: &str, arch: &str) -> (usize, u64, u64) {
    let g = open(file);
    let m = g.metadata();
    let get = |key: &str| m.get_u64(&format!("{arch}.{key}")).unwrap();
    (
        get("block_count") as usize,
        get("embedding_length"),
        get("expert_used_count"),
    )
}

#[test]
fn gpt_oss_hybrid_decode_moves_one_packed_copy_down_and_one_up_per_layer() {
    let file = "gpt-oss/gptoss-tiny.gguf";
    let (n_layer, d, k) = dims(file, "gpt-oss");
    check(file, n_layer, n_layer as u64, d, k);
}

#[test]
fn qwen3moe_hybrid_decode_moves_one_packed_copy_down_and_one_up_per_layer() {
    let file = "qwen3moe/qwen3moe-tiny.gguf";
    let (n_layer, d, k) = dims(file, "qwen3moe");
    check(file, n_layer, n_layer as u64, d, k);
}

#[test]
fn deepseek2_hybrid_decode_moves_one_packed_copy_down_and_one_up_per_layer() {
    let file = "deepseek2/deepseek2-tiny.gguf";
    let (n_layer, d, k) = dims(file, "deepseek2");
    let dense = open(file)
        .metadata()
        .get_u64("deepseek2.leading_dense_block_count")
        .unwrap() as usize;
    check(file, n_layer, (n_layer - dense) as u64, d, k);
}
