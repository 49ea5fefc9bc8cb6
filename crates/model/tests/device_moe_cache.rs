//! The device expert cache (`--moe-cache`) on the reference device: with
//! every layer's experts on the host (`--cpu-moe`) and a cache holding about half of each
//! layer's experts, the logits equal the run without a cache and the CPU's bit for bit
//! (a prompt over several micro-batches with every position's logits, then greedy decode
//! steps; and two sequences batched in one `forward_multi`), on the gpt-oss fixtures and the
//! deepseek2 fixture; hits + misses are the routed pairs of the host layers; the cache holds
//! no more device memory than its budget; a budget too small for one expert, or a placement
//! with nothing to cache, is an error naming the sizes. The fixtures cover Q8_0/MXFP4 and
//! F32 experts (whose sums depend on the rows multiplied together).

mod common;

use common::fixtures;
use hmoe_backend::Ref0;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted, SeqBatch,
};

const UBATCH: usize = 8;
const N_CTX: usize = 64;
const N_DECODE: usize = 6;

fn open(file: &str) -> GgufModel {
    GgufModel::open(fixtures().join(file), LoadOptions::default()).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32
}

fn prompt() -> Vec<u32> {
    (0..20).map(|i| (i * 53 + 7) % 1000).collect()
}

/// The prompt with every position's logits, then greedy decode steps: each feed's logits.
fn run(model: &dyn LanguageModel, n_vocab: usize) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let mut out = vec![model
        .forward(&mut cache, &prompt(), LogitsWanted::All)
        .unwrap()];
    for _ in 0..N_DECODE {
        let last = out.last().unwrap();
        let next = argmax(&last[last.len() - n_vocab..]);
        out.push(
            model
                .forward(&mut cache, &[next], LogitsWanted::Last)
                .unwrap(),
        );
    }
    out
}

/// Two sequences in one `forward_multi` per step (prompts of 5 and 3 tokens, then one token
/// each): the last logits of each sequence per step.
fn run_pair(model: &dyn LanguageModel) -> Vec<Vec<f32>> {
    let mut a = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let mut b = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let feeds: [(&[u32], &[u32]); 3] = [
        (&[5, 9, 11, 300, 2], &[7, 8, 9]),
        (&[40], &[41]),
        (&[42], &[43]),
    ];
    let mut out = Vec::new();
    for (fa, fb) in feeds {
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
        out.extend(model.forward_multi(&mut seqs).unwrap());
    }
    out
}

/// `(n_layer, n_expert, n_expert_used, bytes of one expert's weights and biases)` of the file.
fn expert_dims(g: &GgufModel, layer: usize) -> (usize, usize, usize, u64) {
    let m = g.metadata();
    let arch = m.architecture().unwrap().to_string();
    let get = |k: &str| m.get_u32(&format!("{arch}.{k}")).unwrap() as usize;
    let n_expert = get("expert_count");
    let mut bytes = 0;
    for t in ["gate", "up", "down"] {
        for kind in ["weight", "bias"] {
            if let Some(info) = g.tensor_info(&format!("blk.{layer}.ffn_{t}_exps.{kind}")) {
                // Biases are kept as f32 on the device.
                bytes += if kind == "bias" {
                    4 * info.n_elements
                } else {
                    info.n_bytes
                };
            }
        }
    }
    (
        get("block_count"),
        n_expert,
        get("expert_used_count"),
        bytes / n_expert as u64,
    )
}

/// `file`'s logits with the cache equal those without and the CPU's; the counts add
/// up; the memory stays within the budget. `moe_layers`: the layers with routed experts.
fn check(file: &str, moe_layers: &[usize]) {
    let g = open(file);
    let (n_layer, n_expert, k, expert_bytes) = expert_dims(&g, moe_layers[0]);
    let n_vocab = g
        .tensor_info("output.weight")
        .map(|i| i.dims[1] as usize)
        .unwrap();
    let cpu = hmoe_model::load(open(file)).unwrap();
    let want = run(cpu.as_ref(), n_vocab);
    let want_pair = run_pair(cpu.as_ref());
    let placement = ExpertPlacement {
        layers: vec![ExpertHome::Host; n_layer],
        op_offload_min_batch: None,
    };
    let plain = DeviceModel::load(open(file), Ref0::new(), &placement).unwrap();
    assert!(plain.moe_cache_stats().budget_bytes == 0);
    assert!(LanguageModel::moe_cache_stats(&plain).is_none());
    let got_plain = run(&plain, n_vocab);
    // About half of each layer's experts.
    let budget = moe_layers.len() as u64 * expert_bytes * (n_expert as u64 / 2) + expert_bytes / 2;
    let cached = DeviceModel::load(open(file), Ref0::with_budget(4 << 30), &placement).unwrap();
    let set = cached.set_moe_cache(budget).unwrap();
    let cap = (n_expert / 2) as u64 * moe_layers.len() as u64;
    assert_eq!(set.capacity, cap, "{file}: experts the cache holds");
    let free0 = cached.device_memory().unwrap().free_bytes.unwrap();
    let got = run(&cached, n_vocab);
    for (i, ((g, p), w)) in got.iter().zip(&got_plain).zip(&want).enumerate() {
        assert!(bits(g) == bits(p), "{file}: feed {i}, cache vs no cache");
        assert!(bits(g) == bits(w), "{file}: feed {i}, cache vs the CPU");
    }
    let s = LanguageModel::moe_cache_stats(&cached).unwrap();
    let tokens = (prompt().len() + N_DECODE) as u64;
    assert_eq!(
        s.hits + s.misses,
        tokens * k as u64 * moe_layers.len() as u64,
        "{file}: every routed pair of the host layers is a hit or a miss: {s:?}"
    );
    assert!(s.hits > 0 && s.misses > 0, "{file}: {s:?}");
    assert!(s.uploads > 0 && s.evictions > 0, "{file}: {s:?}");
    assert!(s.held_bytes <= budget && s.held_bytes > 0, "{file}: {s:?}");
    // What the device lost to the run: the cache and the sequence's K/V (measured without
    // the cache on a fresh model), beside the scratch buffers kept for the next step.
    let free1 = cached.device_memory().unwrap().free_bytes.unwrap();
    let used = free0 - free1 - cached.scratch_held_bytes();
    let kv = cached.device_memory().unwrap().kv_bytes;
    assert!(
        used <= kv + budget,
        "{file}: {used} bytes taken, K/V {kv} + budget {budget}"
    );
    assert_eq!(
        used,
        kv + s.held_bytes,
        "{file}: only K/V and cached experts"
    );
    eprintln!(
        "{file}: hit rate {:.1}% ({} hits, {} misses, {} uploads, {} evictions, {} experts)",
        100.0 * s.hit_rate(),
        s.hits,
        s.misses,
        s.uploads,
        s.evictions,
        s.capacity
    );
    // Two sequences in one micro-batch.
    let got_pair = run_pair(&cached);
    for (i, (g, w)) in got_pair.iter().zip(&want_pair).enumerate() {
        assert!(bits(g) == bits(w), "{file}: batched logits {i}");
    }
    // Disabled again.
    assert_eq!(cached.set_moe_cache(0).unwrap().capacity, 0);
    assert!(LanguageModel::moe_cache_stats(&cached).is_none());
}

#[test]
fn gptoss_tiny_cache_is_bit_identical() {
    check("gpt-oss/gptoss-tiny.gguf", &[0, 1, 2, 3]);
}

#[test]
fn gptoss_small_cache_is_bit_identical() {
    let g = open("gpt-oss/gptoss-small.gguf");
    let n = g.metadata().get_u32("gpt-oss.block_count").unwrap() as usize;
    check("gpt-oss/gptoss-small.gguf", &(0..n).collect::<Vec<_>>());
}

/// F32 experts, whose sums depend on the rows multiplied together.
#[test]
fn gptoss_f32_experts_cache_is_bit_identical() {
    let g = open("gpt-oss/gptoss-openai-f32experts.gguf");
    let n = g.metadata().get_u32("gpt-oss.block_count").unwrap() as usize;
    check(
        "gpt-oss/gptoss-openai-f32experts.gguf",
        &(0..n).collect::<Vec<_>>(),
    );
}

/// F32 experts too.
#[test]
fn deepseek2_cache_is_bit_identical() {
    // Layer 0 is dense.
    check("deepseek2/deepseek2-tiny.gguf", &[1, 2]);
}

#[test]
fn a_cache_too_small_or_with_nothing_to_cache_is_an_error() {
    let file = "gpt-oss/gptoss-tiny.gguf";
    let (n_layer, _, _, expert_bytes) = expert_dims(&open(file), 0);
    let host = ExpertPlacement {
        layers: vec![ExpertHome::Host; n_layer],
        op_offload_min_batch: None,
    };
    let dev = DeviceModel::load(open(file), Ref0::new(), &host).unwrap();
    let e = dev.set_moe_cache(expert_bytes).unwrap_err().to_string();
    assert!(
        e.contains("too small") && e.contains("one expert takes"),
        "{e}"
    );
    assert_eq!(
        dev.moe_cache_stats().budget_bytes,
        0,
        "disabled after the error"
    );
    // One expert per layer fits exactly.
    let s = dev.set_moe_cache(n_layer as u64 * expert_bytes).unwrap();
    assert_eq!(s.capacity, n_layer as u64);
    // Every layer's experts on the device: nothing to cache.
    let all = ExpertPlacement {
        layers: vec![ExpertHome::Device; n_layer],
        op_offload_min_batch: None,
    };
    let dev = DeviceModel::load(open(file), Ref0::new(), &all).unwrap();
    let e = dev.set_moe_cache(64 << 20).unwrap_err().to_string();
    assert!(e.contains("nothing to cache"), "{e}");
}
