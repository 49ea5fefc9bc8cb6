//! Several sequences at once on the reference device: three sequences of
//! different lengths batched on REF0 (`DeviceModel<Ref0>::forward_multi`, each sequence with
//! its own device K/V cache) get, bit for bit, the logits each gets alone on REF0, alone on
//! the CPU, and batched the same way on the CPU's `forward_multi`, with every
//! layer's experts on the device (`-ngl all`), every layer's on the host (`--cpu-moe`) and the
//! first layer's on the host (`--n-cpu-moe 1`), for quantized, F32-dense and F32-expert
//! weights; the transfer counts show one round trip per host layer per micro-batch, whatever
//! the number of sequences in it, and nothing else crossing but ids, positions and logits;
//! split by the executor into two micro-batches in flight (host layers), the bits stay.
//! Device caches follow their handles and are freed by need (least recently used first).

mod common;

use common::fixtures;
use hmoe_backend::Ref0;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvCache, KvType, LanguageModel, LogitsWanted,
    SeqBatch,
};

const UBATCH: usize = 16;
const N_CTX: usize = 64;
const N_DECODE: usize = 4;

fn open(file: &str) -> GgufModel {
    GgufModel::open(
        fixtures().join("gpt-oss").join(file),
        LoadOptions::default(),
    )
    .unwrap()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The prompts: three sequences of different lengths (one micro-batch each).
fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![46, 77, 344],
        (0..7).map(|i| (i * 37 + 11) % 1000).collect(),
        (0..12).map(|i| (i * 13 + 5) % 1000).collect(),
    ]
}

/// Each sequence alone on `model`: its feeds (the prompt, then greedy decode tokens) and the
/// last token's logits of each feed.
fn alone(model: &dyn LanguageModel, prompt: &[u32]) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let mut cache = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let mut feeds = vec![prompt.to_vec()];
    let mut logits = vec![model
        .forward(&mut cache, prompt, LogitsWanted::Last)
        .unwrap()];
    for _ in 0..N_DECODE {
        let next = argmax(logits.last().unwrap());
        feeds.push(vec![next]);
        logits.push(
            model
                .forward(&mut cache, &[next], LogitsWanted::Last)
                .unwrap(),
        );
    }
    (feeds, logits)
}

/// The step schedule: which sequences run in each step (each runs its prompt and its
/// decode tokens in order; sequence 2 joins late and sequence 1 sits one step out, so prompts
/// and decode tokens share steps).
fn schedule() -> Vec<Vec<usize>> {
    vec![
        vec![0, 1],
        vec![0, 2],
        vec![0, 1, 2],
        vec![0, 1, 2],
        vec![0, 1, 2],
        vec![1, 2],
    ]
}

/// Runs the schedule on `model` with `forward_multi`; the logits of every feed of every
/// sequence (empty where a step did not ask for them) and the steps that asked for any.
fn batched(model: &dyn LanguageModel, feeds: &[Vec<Vec<u32>>]) -> (Vec<Vec<Vec<f32>>>, u64) {
    let mut caches: Vec<KvCache> = feeds
        .iter()
        .map(|_| model.new_cache(KvType::F16, N_CTX, UBATCH))
        .collect();
    let mut next = vec![0usize; feeds.len()];
    let mut out = vec![Vec::new(); feeds.len()];
    let mut with_logits = 0;
    for (step, members) in schedule().into_iter().enumerate() {
        let wants: Vec<bool> = members.iter().map(|&i| (step + i) % 4 != 3).collect();
        let mut seqs: Vec<SeqBatch<'_, '_>> = Vec::new();
        for (i, cache) in caches.iter_mut().enumerate() {
            if let Some(j) = members.iter().position(|&m| m == i) {
                seqs.push(SeqBatch {
                    cache,
                    tokens: &feeds[i][next[i]],
                    logits: wants[j],
                });
            }
        }
        let logits = model.forward_multi(&mut seqs).unwrap();
        drop(seqs);
        with_logits += u64::from(wants.iter().any(|&w| w));
        for ((&i, want), l) in members.iter().zip(wants).zip(logits) {
            assert_eq!(l.is_empty(), !want, "sequence {i}, step {step}");
            out[i].push(l);
            next[i] += 1;
        }
    }
    for (i, c) in caches.iter().enumerate() {
        assert_eq!(next[i], feeds[i].len(), "sequence {i} ran every feed");
        assert_eq!(c.n_past(), feeds[i].iter().map(Vec::len).sum::<usize>());
    }
    (out, with_logits)
}

fn check(file: &str) {
    let cpu = hmoe_model::load(open(file)).unwrap();
    let reference: Vec<_> = prompts().iter().map(|p| alone(cpu.as_ref(), p)).collect();
    let feeds: Vec<Vec<Vec<u32>>> = reference.iter().map(|r| r.0.clone()).collect();
    let (cpu_batched, _) = batched(cpu.as_ref(), &feeds);
    let n_layer = open(file)
        .metadata()
        .get_u64("gpt-oss.block_count")
        .unwrap() as usize;
    let n_steps = schedule().len() as u64;
    let placements = [
        ("-ngl all", vec![ExpertHome::Device; n_layer]),
        ("--cpu-moe", vec![ExpertHome::Host; n_layer]),
        ("--n-cpu-moe 1", {
            let mut v = vec![ExpertHome::Device; n_layer];
            v[0] = ExpertHome::Host;
            v
        }),
    ];
    for (what, layers) in placements {
        let host_layers = layers.iter().filter(|&&h| h == ExpertHome::Host).count() as u64;
        let placement = ExpertPlacement {
            layers,
            ..ExpertPlacement::all(n_layer, ExpertHome::Device)
        };
        let dev = DeviceModel::load(open(file), Ref0::new(), &placement).unwrap();
        // Alone on REF0: the CPU's bits.
        for (i, (f, want)) in reference.iter().enumerate() {
            let (_, got) = alone(&dev, &f[0]);
            for (s, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    bits(g) == bits(w),
                    "{file} {what}: sequence {i} alone, feed {s}"
                );
            }
        }
        // One micro-batch per step (the split into two in flight off; on below).
        dev.set_micro_batches(false);
        let before = dev.stats();
        let (got, with_logits) = batched(&dev, &feeds);
        let after = dev.stats();
        for (i, (g, c)) in got.iter().zip(&cpu_batched).enumerate() {
            for (s, (gl, cl)) in g.iter().zip(c).enumerate() {
                assert!(
                    bits(gl) == bits(cl),
                    "{file} {what}: sequence {i}, feed {s}: REF0 batched vs the CPU's forward_multi"
                );
                if !gl.is_empty() {
                    assert!(
                        bits(gl) == bits(&reference[i].1[s]),
                        "{file} {what}: sequence {i}, feed {s}: batched vs alone"
                    );
                }
            }
        }
        // Counts of the batched run: one micro-batch per step, one round trip per host layer
        // per step; down: the logits of each step that wants any and each round trip's
        // inputs; up: ids and positions per step and each round trip's sum.
        assert_eq!(after.ubatches - before.ubatches, n_steps, "{file} {what}");
        let trips = after.host_round_trips - before.host_round_trips;
        assert_eq!(trips, host_layers * n_steps, "{file} {what}");
        assert_eq!(after.offloaded_layers, 0, "{file} {what}: below 32 tokens");
        let (t0, t1) = (before.transfers.unwrap(), after.transfers.unwrap());
        assert_eq!(
            t1.downloads - t0.downloads,
            with_logits + trips,
            "{file} {what}"
        );
        assert_eq!(
            t1.uploads - t0.uploads,
            2 * n_steps + trips,
            "{file} {what}"
        );
        // Two micro-batches in flight where there are host layers: the same bits, and one
        // round trip per host layer per micro-batch.
        dev.set_micro_batches(true);
        let before = dev.stats();
        let (split, _) = batched(&dev, &feeds);
        let after = dev.stats();
        for (i, (s, g)) in split.iter().zip(&got).enumerate() {
            for (f, (sl, gl)) in s.iter().zip(g).enumerate() {
                assert!(
                    bits(sl) == bits(gl),
                    "{file} {what}: sequence {i}, feed {f}: two in flight vs one micro-batch"
                );
            }
        }
        let splits = after.split_steps - before.split_steps;
        assert_eq!(splits > 0, host_layers > 0, "{file} {what}");
        let ubatches = after.ubatches - before.ubatches;
        assert_eq!(ubatches, n_steps + splits, "{file} {what}");
        assert_eq!(
            after.host_round_trips - before.host_round_trips,
            host_layers * ubatches,
            "{file} {what}"
        );
    }
}

#[test]
fn quantized_weights_batched_on_ref0_are_bit_exact() {
    check("gptoss-tiny.gguf");
}

#[test]
fn f32_weights_batched_on_ref0_are_bit_exact() {
    check("gptoss-openai.gguf");
}

#[test]
fn f32_experts_batched_on_ref0_are_bit_exact() {
    check("gptoss-openai-f32experts.gguf");
}

/// Device caches per handle: two sequences fed in turn through `forward` keep their own
/// caches (each gets its logits alone); on a device with room for two caches, a third
/// sequence frees the least recently used one, whose handle then fails to continue (with a
/// clear error) until it starts again from position 0, which gives the same logits again.
#[test]
fn device_caches_follow_their_handles_and_are_freed_by_need() {
    let file = "gptoss-tiny.gguf";
    let cpu = hmoe_model::load(open(file)).unwrap();
    let reference: Vec<_> = prompts().iter().map(|p| alone(cpu.as_ref(), p)).collect();
    let n_layer = open(file)
        .metadata()
        .get_u64("gpt-oss.block_count")
        .unwrap() as usize;
    let placement = ExpertPlacement::all(n_layer, ExpertHome::Device);
    // Measure the weights and one sequence's cache on an unlimited device.
    let probe = DeviceModel::load(open(file), Ref0::new(), &placement).unwrap();
    let weights = probe.device().bytes_held();
    let mut c = probe.new_cache(KvType::F16, N_CTX, UBATCH);
    probe.forward(&mut c, &[1], LogitsWanted::Last).unwrap();
    // Beside them the device holds the step's scratch buffers, kept for the next step.
    let kv = probe.device().bytes_held() - weights - probe.scratch_held_bytes();
    // Room for two caches, a micro-batch's scratch, and half a cache more.
    let budget = weights + 2 * kv + probe.scratch_bytes(UBATCH) + kv / 2;
    let dev = DeviceModel::load(open(file), Ref0::with_budget(budget), &placement).unwrap();
    let mut caches: Vec<KvCache> = (0..3)
        .map(|_| dev.new_cache(KvType::F16, N_CTX, UBATCH))
        .collect();
    // Sequences 0 and 1 in turn, feed by feed.
    for s in 0..reference[0].0.len() {
        for i in 0..2 {
            let got = dev
                .forward(&mut caches[i], &reference[i].0[s], LogitsWanted::Last)
                .unwrap();
            assert!(
                bits(&got) == bits(&reference[i].1[s]),
                "sequence {i}, feed {s}"
            );
        }
    }
    assert_eq!(
        dev.device().bytes_held(),
        weights + 2 * kv + dev.scratch_held_bytes()
    );
    // Sequence 2 needs room: sequence 0's cache (used least recently) is freed.
    let got = dev
        .forward(&mut caches[2], &reference[2].0[0], LogitsWanted::Last)
        .unwrap();
    assert!(bits(&got) == bits(&reference[2].1[0]));
    assert_eq!(
        dev.device().bytes_held(),
        weights + 2 * kv + dev.scratch_held_bytes()
    );
    let got = dev
        .forward(&mut caches[1], &[5], LogitsWanted::Last)
        .unwrap();
    assert_eq!(got.len(), dev.n_vocab(), "sequence 1 kept its cache");
    let e = dev
        .forward(&mut caches[0], &[5], LogitsWanted::Last)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no device cache for it") && e.contains("starts at 0"),
        "{e}"
    );
    caches[0].clear();
    let got = dev
        .forward(&mut caches[0], &reference[0].0[0], LogitsWanted::Last)
        .unwrap();
    assert!(bits(&got) == bits(&reference[0].1[0]), "sequence 0 again");
}

/// A step with a bad token, a sequence past its context or a cache whose heads are not whole
/// blocks of its K/V type (gptoss-tiny's 16 in q8_0) is an error before anything runs: no
/// sequence advances, and nothing goes to the device.
#[test]
fn bad_steps_run_nothing() {
    let file = "gptoss-tiny.gguf";
    let n_layer = open(file)
        .metadata()
        .get_u64("gpt-oss.block_count")
        .unwrap() as usize;
    let placement = ExpertPlacement::all(n_layer, ExpertHome::Host);
    let dev = DeviceModel::load(open(file), Ref0::new(), &placement).unwrap();
    let mut a = dev.new_cache(KvType::F16, 8, UBATCH);
    let mut b = dev.new_cache(KvType::F16, 8, UBATCH);
    let mut c = dev.new_cache(KvType::parse("q8_0").unwrap(), 8, UBATCH);
    let before = dev.stats();
    let long = [1u32; 9];
    let bad: [(usize, &[u32]); 3] = [(0, &[5000]), (0, &long), (1, &[3])];
    for (which, tokens) in bad {
        let second = if which == 0 { &mut b } else { &mut c };
        let mut seqs = [
            SeqBatch {
                cache: &mut a,
                tokens: &[1, 2],
                logits: true,
            },
            SeqBatch {
                cache: second,
                tokens,
                logits: true,
            },
        ];
        assert!(dev.forward_multi(&mut seqs).is_err(), "{tokens:?}");
    }
    assert_eq!((a.n_past(), b.n_past(), c.n_past()), (0, 0, 0));
    assert_eq!(dev.stats(), before);
}
