//! Two micro-batches in flight on the reference device (`micro_batches.rs` of the executor):
//! a step of several sequences with host-expert layers runs as two groups, the device
//! queueing one group's attention before the host waits for the other's copy down.
//!
//! - 2 to 5 sequences of different prompt lengths, prefilled together and then decoding
//!   together, get each sequence's solo logits bit for bit, on the gpt-oss, Qwen3-MoE and
//!   DeepSeek-V3 fixtures, with every layer's experts on the host (`--cpu-moe`) and the first
//!   MoE layer's only (`--n-cpu-moe 1`; DeepSeek's layer 0 is dense), in REF0's replay mode
//!   (the groups' recorded segments replay), and the decode steps after the first allocate
//!   nothing on the device;
//! - REF0's op log shows the interleaving: between one group's copy down and the host's wait
//!   for it, the other group's attention is queued (and its copy down), and the host runs a
//!   group's experts with nothing queued in between; with one sequence, or with the split
//!   turned off, one set of staging buffers and no attention queued between a copy down and
//!   its wait.

mod common;

use std::collections::HashMap;

use common::{argmax, bits, open_fixture as open};
use hmoe_backend::{Ref0, Ref0Event};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvCache, KvType, LanguageModel, LogitsWanted,
    SeqBatch,
};

const UBATCH: usize = 16;
const N_CTX: usize = 64;
/// Decode steps: the first allocates its buffers, the second records, the others replay.
const N_DECODE: usize = 4;

/// (file, index of the first MoE layer)
const MODELS: [(&str, usize); 3] = [
    ("gpt-oss/gptoss-tiny.gguf", 0),
    ("qwen3moe/qwen3moe-tiny.gguf", 0),
    ("deepseek2/deepseek2-tiny.gguf", 1),
];

fn n_layer(file: &str) -> usize {
    let g = open(file);
    let arch = g.metadata().architecture().unwrap().to_string();
    g.metadata()
        .get_u32(&format!("{arch}.block_count"))
        .unwrap() as usize
}

/// `--cpu-moe`, and the first MoE layer on the host.
fn placements(file: &str, first_moe: usize) -> [(&'static str, ExpertPlacement); 2] {
    let n = n_layer(file);
    let mut first = vec![ExpertHome::Device; n];
    first[first_moe] = ExpertHome::Host;
    let p = |layers| ExpertPlacement {
        layers,
        op_offload_min_batch: None,
    };
    [
        ("--cpu-moe", p(vec![ExpertHome::Host; n])),
        ("--n-cpu-moe 1", p(first)),
    ]
}

/// Five prompts of different lengths (each one micro-batch).
fn prompts() -> Vec<Vec<u32>> {
    [3usize, 9, 1, 14, 6]
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            (0..n)
                .map(|i| ((i * 37 + s * 101 + 5) % 500) as u32)
                .collect()
        })
        .collect()
}

/// A sequence alone: its prompt, then `N_DECODE` greedy steps; the tokens fed after the
/// prompt and every feed's last logits.
fn alone(model: &dyn LanguageModel, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let mut out = vec![model
        .forward(&mut cache, prompt, LogitsWanted::Last)
        .unwrap()];
    let mut fed = Vec::new();
    for _ in 0..N_DECODE {
        let next = argmax(out.last().unwrap());
        fed.push(next);
        out.push(
            model
                .forward(&mut cache, &[next], LogitsWanted::Last)
                .unwrap(),
        );
    }
    (fed, out)
}

/// One `forward_multi` step of `caches` with `feeds`, every sequence wanting its logits.
fn step(model: &dyn LanguageModel, caches: &mut [KvCache], feeds: &[&[u32]]) -> Vec<Vec<f32>> {
    let mut seqs: Vec<SeqBatch<'_, '_>> = caches
        .iter_mut()
        .zip(feeds)
        .map(|(cache, &tokens)| SeqBatch {
            cache,
            tokens,
            logits: true,
        })
        .collect();
    model.forward_multi(&mut seqs).unwrap()
}

#[test]
fn two_micro_batches_in_flight_equal_each_sequence_alone() {
    for (file, first_moe) in MODELS {
        for (what, placement) in placements(file, first_moe) {
            let solo_dev = DeviceModel::load(open(file), Ref0::new(), &placement).unwrap();
            solo_dev.set_micro_batches(false);
            let solo: Vec<_> = prompts().iter().map(|p| alone(&solo_dev, p)).collect();
            for n in 2..=5 {
                let case = format!("{file} {what}, {n} sequences");
                let dev =
                    DeviceModel::load(open(file), Ref0::new().with_replay(), &placement).unwrap();
                dev.set_micro_batches(true);
                let all = prompts();
                let firsts = &all[..n];
                let mut caches: Vec<KvCache> = (0..n)
                    .map(|_| dev.new_cache(KvType::F16, N_CTX, UBATCH))
                    .collect();
                let before = dev.stats();
                let feeds: Vec<&[u32]> = firsts.iter().map(Vec::as_slice).collect();
                let mut got = vec![step(&dev, &mut caches, &feeds)];
                let mut made = Vec::new();
                for d in 0..N_DECODE {
                    let toks: Vec<[u32; 1]> = solo.iter().take(n).map(|s| [s.0[d]]).collect();
                    let feeds: Vec<&[u32]> = toks.iter().map(|t| t.as_slice()).collect();
                    let allocs = dev.device().allocations();
                    got.push(step(&dev, &mut caches, &feeds));
                    made.push(dev.device().allocations() - allocs);
                }
                for (f, logits) in got.iter().enumerate() {
                    for (s, l) in logits.iter().enumerate() {
                        assert!(
                            bits(l) == bits(&solo[s].1[f]),
                            "{case}: sequence {s}, feed {f} differs from its solo run"
                        );
                    }
                }
                let after = dev.stats();
                let steps = 1 + N_DECODE as u64;
                assert_eq!(after.split_steps - before.split_steps, steps, "{case}");
                assert_eq!(after.ubatches - before.ubatches, 2 * steps, "{case}");
                assert!(
                    made.iter().skip(1).all(|&m| m == 0),
                    "{case}: allocations per decode step {made:?}"
                );
                let st = dev.device().replay_stats();
                assert_eq!((st.errors, st.stale_scalars), (0, 0), "{case}: {st:?}");
                assert!(st.replayed > 0 && st.replayed_ops > 0, "{case}: {st:?}");
            }
        }
    }
}

/// One step's round trips by staging buffers: for each set (in the order of its first copy
/// down), the positions in the log of its copies down, waits and copies up.
struct Trips {
    log: Vec<Ref0Event>,
    groups: Vec<[Vec<usize>; 3]>,
}

impl Trips {
    fn of(log: Vec<Ref0Event>) -> Trips {
        let mut order: Vec<usize> = Vec::new();
        let mut at: HashMap<usize, [Vec<usize>; 3]> = HashMap::new();
        for (i, e) in log.iter().enumerate() {
            let (id, which) = match *e {
                Ref0Event::StageDown(id) => (id, 0),
                Ref0Event::Staged(id) => (id, 1),
                Ref0Event::StageUp(id) => (id, 2),
                Ref0Event::Op(_) => continue,
            };
            if !order.contains(&id) {
                order.push(id);
            }
            at.entry(id).or_default()[which].push(i);
        }
        let groups = order.iter().map(|id| at.remove(id).unwrap()).collect();
        Trips { log, groups }
    }

    /// The device ops queued strictly between positions `a` and `b` of the log.
    fn ops_between(&self, a: usize, b: usize) -> Vec<&'static str> {
        (self.log[a + 1..b].iter())
            .filter_map(|e| match e {
                Ref0Event::Op(op) => Some(*op),
                _ => None,
            })
            .collect()
    }
}

fn is_attention(op: &str) -> bool {
    op.starts_with("attention")
}

#[test]
fn the_op_log_shows_one_groups_attention_queued_while_the_other_waits() {
    for (file, _) in MODELS {
        let n = n_layer(file);
        let placement = ExpertPlacement {
            layers: vec![ExpertHome::Host; n],
            op_offload_min_batch: None,
        };
        let dev = DeviceModel::load(open(file), Ref0::new().with_op_log(), &placement).unwrap();
        dev.set_micro_batches(true);
        let mut caches: Vec<KvCache> = (0..3)
            .map(|_| dev.new_cache(KvType::F16, N_CTX, UBATCH))
            .collect();
        let p = prompts();
        step(&dev, &mut caches, &[&p[0], &p[1], &p[2]]);
        let before = dev.stats().host_round_trips;
        dev.device().take_op_log();
        // A decode step of three sequences: two groups.
        step(&dev, &mut caches, &[&[1], &[2], &[3]]);
        let trips = Trips::of(dev.device().take_op_log());
        let moe_layers = (dev.stats().host_round_trips - before) as usize / 2;
        assert!(moe_layers > 0, "{file}");
        assert_eq!(trips.groups.len(), 2, "{file}: two groups' staging buffers");
        for (g, t) in trips.groups.iter().enumerate() {
            for (which, v) in t.iter().enumerate() {
                assert_eq!(v.len(), moe_layers, "{file}: group {g}, event kind {which}");
            }
        }
        let [a_down, a_wait, a_up] = &trips.groups[0];
        let [b_down, b_wait, _] = &trips.groups[1];
        for l in 0..moe_layers {
            // Between A's copy down and the host's wait for it: B's attention and B's copy
            // down, queued before the host runs A's experts.
            assert!(
                a_down[l] < b_down[l] && b_down[l] < a_wait[l],
                "{file}: layer {l}"
            );
            let queued = trips.ops_between(a_down[l], a_wait[l]);
            assert!(
                queued.iter().any(|op| is_attention(op)),
                "{file}: layer {l}: B's attention not queued before A's wait: {queued:?}"
            );
            // The host runs A's experts: nothing queued between the wait and the copy up.
            assert!(
                trips.ops_between(a_wait[l], a_up[l]).is_empty(),
                "{file}: layer {l}"
            );
            // And the other way round: A's next layer (or its head) is queued before B's
            // wait.
            assert!(
                !trips.ops_between(b_down[l], b_wait[l]).is_empty(),
                "{file}: layer {l}: nothing of A queued before B's wait"
            );
        }
        // One sequence, or the split off: one set of staging buffers, and no attention
        // queued between a copy down and its wait (DeepSeek's shared experts run there,
        // beside the routed ones).
        let mut one = vec![dev.new_cache(KvType::F16, N_CTX, UBATCH)];
        step(&dev, &mut one, &[&p[3]]);
        let splits = dev.stats().split_steps;
        for (what, split) in [("one sequence", true), ("split off", false)] {
            dev.set_micro_batches(split);
            dev.device().take_op_log();
            if split {
                step(&dev, &mut one, &[&[4]]);
            } else {
                step(&dev, &mut caches, &[&[5], &[6], &[7]]);
            }
            let trips = Trips::of(dev.device().take_op_log());
            assert_eq!(trips.groups.len(), 1, "{file} {what}");
            let [down, wait, _] = &trips.groups[0];
            assert_eq!(down.len(), moe_layers, "{file} {what}");
            for (d, w) in down.iter().zip(wait) {
                let queued = trips.ops_between(*d, *w);
                assert!(
                    !queued.iter().any(|op| is_attention(op)),
                    "{file} {what}: {queued:?}"
                );
            }
        }
        assert_eq!(dev.stats().split_steps, splits, "{file}: no split");
    }
}
