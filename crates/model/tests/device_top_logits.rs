//! A token's best logits alone (`LanguageModel::forward_multi_top`), ranked on the device
//! (`Backend::top_k`): on REF0 (fresh and in replay mode, experts on the device and on the
//! host) and on the CPU device, for the gpt-oss and Qwen3-MoE fixtures, each decode step's
//! `k` best pairs are those of the whole row the same model gives without them (ids and bits),
//! for k = 1 (greedy), 40 (llama-server's default top-k) and the bound; REF0 counts what
//! crosses the bus (the `k` values and ids instead of `n_vocab` logits) and allocates nothing
//! per decode step after the first; two sequences batched get each its own count, and a step
//! where one wants the whole row brings every row down whole.

mod common;

use common::{bits, open_fixture as open};
use hmoe_backend::{Backend, Ref0, TOP_K_MAX};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, SeqBatch, TokenLogits,
};

const UBATCH: usize = 8;
const N_CTX: usize = 64;
const N_DECODE: usize = 6;

const MODELS: [&str; 2] = ["gpt-oss/gptoss-tiny.gguf", "qwen3moe/qwen3moe-tiny.gguf"];

/// The tokens fed: a prompt of 11 (two micro-batches, so its logits come down whole), then
/// one per decode step.
fn feeds() -> Vec<Vec<u32>> {
    let mut f = vec![(0..11).map(|i| (i * 37 + 5) % 500).collect::<Vec<u32>>()];
    f.extend((0..N_DECODE as u32).map(|i| vec![(i * 91 + 17) % 500]));
    f
}

/// One sequence through `feeds`, asking for its `top` best logits; each step's logits and
/// what `counter` read after it (REF0: bytes brought down, allocations).
fn run(
    model: &dyn LanguageModel,
    top: Option<usize>,
    counter: &dyn Fn() -> (u64, u64),
) -> (Vec<TokenLogits>, Vec<(u64, u64)>) {
    let mut cache = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let (mut out, mut counts) = (Vec::new(), vec![counter()]);
    for tokens in feeds() {
        let mut seq = [SeqBatch {
            cache: &mut cache,
            tokens: &tokens,
            logits: true,
        }];
        out.extend(model.forward_multi_top(&mut seq, &[top]).unwrap());
        counts.push(counter());
    }
    (out, counts)
}

/// The `k` best of `row` in the host sampler's order (by value with `total_cmp`, ties to the
/// lower id), by a full sort.
fn best(row: &[f32], k: usize) -> Vec<(u32, u32)> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    (idx.into_iter().take(k))
        .map(|i| (i as u32, row[i].to_bits()))
        .collect()
}

fn full(l: &TokenLogits) -> &[f32] {
    match l {
        TokenLogits::Full(v) => v,
        TokenLogits::Top(_) => panic!("the whole row was expected"),
    }
}

/// `got` (asked for `k`) against the whole rows `want`: the prompt's logits whole, every
/// decode step's `k` best (bits) unless its best is NaN or zero.
fn check(what: &str, got: &[TokenLogits], want: &[TokenLogits], k: usize) {
    assert_eq!(bits(full(&got[0])), bits(full(&want[0])), "{what}: prompt");
    for (s, (g, w)) in got.iter().zip(want).enumerate().skip(1) {
        let w = full(w);
        match g {
            TokenLogits::Top(t) => {
                let t: Vec<(u32, u32)> = t.iter().map(|&(i, v)| (i, v.to_bits())).collect();
                assert_eq!(t, best(w, k.min(w.len())), "{what}: step {s}");
            }
            TokenLogits::Full(v) => {
                let top = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                assert!(
                    top.is_nan() || top == 0.0,
                    "{what}: step {s} came down whole"
                );
                assert_eq!(bits(v), bits(w), "{what}: step {s}");
            }
        }
    }
}

#[test]
fn best_logits_are_the_whole_rows_best_and_only_they_cross_the_bus() {
    for file in MODELS {
        let cpu = hmoe_model::load(open(file)).unwrap();
        let n_vocab = cpu.n_vocab();
        let (want, _) = run(cpu.as_ref(), None, &|| (0, 0));
        let n_layer = {
            let g = open(file);
            let arch = g.metadata().architecture().unwrap().to_string();
            (g.metadata().get_u32(&format!("{arch}.block_count"))).unwrap() as usize
        };
        for k in [1, 40, TOP_K_MAX] {
            let (got, _) = run(cpu.as_ref(), Some(k), &|| (0, 0));
            check(&format!("{file} CPU k={k}"), &got, &want, k);
            for (name, home, replay) in [
                ("REF0", ExpertHome::Device, false),
                ("REF0 --cpu-moe", ExpertHome::Host, false),
                ("REF0 replay", ExpertHome::Device, true),
            ] {
                let placement = ExpertPlacement {
                    layers: vec![home; n_layer],
                    op_offload_min_batch: None,
                };
                let dev = match replay {
                    true => Ref0::new().with_replay(),
                    false => Ref0::new(),
                };
                let dev = DeviceModel::load(open(file), dev, &placement).unwrap();
                let counter = || {
                    let d = dev.device();
                    (d.transfers().unwrap().download_bytes, d.allocations())
                };
                let what = format!("{file} {name} k={k}");
                let (got, counts) = run(&dev, Some(k), &counter);
                check(&what, &got, &want, k);
                // Each decode step brings down the k best values and ids (the expert
                // boundary's round trips aside), and allocates nothing after the first.
                let (_, full_counts) = run(&dev, None, &counter);
                for s in 2..counts.len() {
                    let down = counts[s].0 - counts[s - 1].0;
                    let down_full = full_counts[s].0 - full_counts[s - 1].0;
                    let k = k.min(n_vocab) as u64;
                    assert_eq!(
                        down_full - down,
                        4 * n_vocab as u64 - 8 * k,
                        "{what}: step {s}"
                    );
                    if s > 2 {
                        assert_eq!(counts[s].1, counts[s - 1].1, "{what}: step {s} allocated");
                    }
                }
                if replay {
                    assert!(
                        dev.device().replay_stats().replayed > 0,
                        "{what}: no replay"
                    );
                }
            }
        }
    }
}

#[test]
fn batched_sequences_get_each_their_own_count() {
    let file = MODELS[0];
    let dev = DeviceModel::load_whole(open(file), Ref0::new()).unwrap();
    let pair = |tops: [Option<usize>; 2]| {
        let mut a = dev.new_cache(KvType::F16, N_CTX, UBATCH);
        let mut b = dev.new_cache(KvType::F16, N_CTX, UBATCH);
        let mut out = Vec::new();
        for (j, t) in feeds().into_iter().enumerate() {
            let other = vec![(t[0] + 3) % 500; t.len().min(5)];
            let mut seqs = [
                SeqBatch {
                    cache: &mut a,
                    tokens: &t,
                    logits: true,
                },
                SeqBatch {
                    cache: &mut b,
                    tokens: &other,
                    logits: j > 0,
                },
            ];
            out.push(dev.forward_multi_top(&mut seqs, &tops).unwrap());
        }
        out
    };
    let whole = pair([None, None]);
    let tops = pair([Some(40), Some(1)]);
    let mixed = pair([Some(40), None]);
    for (s, ((w, t), m)) in whole.iter().zip(&tops).zip(&mixed).enumerate().skip(1) {
        for (i, k) in [(0, 40), (1, 1)] {
            match &t[i] {
                TokenLogits::Top(p) => {
                    let p: Vec<(u32, u32)> = p.iter().map(|&(i, v)| (i, v.to_bits())).collect();
                    assert_eq!(p, best(full(&w[i]), k), "step {s} sequence {i}");
                }
                TokenLogits::Full(_) => panic!("step {s} sequence {i}: the whole row"),
            }
            assert_eq!(bits(full(&m[i])), bits(full(&w[i])), "step {s} mixed {i}");
        }
    }
    // The sequence that wants no logits gets none.
    assert_eq!(tops[0][1], TokenLogits::Full(Vec::new()));
    assert!(dev
        .forward_multi_top(&mut [], &[Some(1)])
        .is_err_and(|e| e.to_string().contains("top-k")));
}
