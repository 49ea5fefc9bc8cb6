//! DeepSeek-V3 (`deepseek2`) on the reference device: `DeviceModel<Ref0>` on the fixture gives
//! the CPU's logits bit for bit (every prompt position over several micro-batches, then
//! greedy decode steps) with the routed experts on the device, on the host (one round trip
//! per MoE layer per micro-batch), on the host with op offload, and on the host for the first
//! MoE layer only; two sequences batched in one `forward_multi` (two micro-batches in flight
//! with host layers) get what each gets alone.

mod common;

use common::fixtures;
use hmoe_backend::Ref0;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted, SeqBatch,
};

const UBATCH: usize = 8;
const N_CTX: usize = 64;

fn open() -> GgufModel {
    let path = fixtures().join("deepseek2/deepseek2-tiny.gguf");
    GgufModel::open(path, LoadOptions::default()).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32
}

/// A prompt of 20 tokens (three micro-batches) with every position's logits, then 3 greedy
/// decode steps: the logits of each feed.
fn run(model: &dyn LanguageModel, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(KvType::F16, N_CTX, UBATCH);
    let mut out = vec![model
        .forward(&mut cache, prompt, LogitsWanted::All)
        .unwrap()];
    for _ in 0..3 {
        let next = argmax(&out.last().unwrap()[out.last().unwrap().len() - 1024..]);
        out.push(
            model
                .forward(&mut cache, &[next], LogitsWanted::Last)
                .unwrap(),
        );
    }
    out
}

fn prompt() -> Vec<u32> {
    (0..20).map(|i| (i * 53 + 7) % 1000).collect()
}

#[test]
fn ref0_deepseek2_is_the_cpu_device_bit_for_bit() {
    let cpu = hmoe_model::load(open()).unwrap();
    let want = run(cpu.as_ref(), &prompt());
    let n_layer = 3; // 1 dense, 2 MoE
    let host_first_moe = vec![ExpertHome::Device, ExpertHome::Host, ExpertHome::Device];
    let cases: [(&str, Vec<ExpertHome>, Option<usize>, u64); 4] = [
        (
            "experts on REF0",
            vec![ExpertHome::Device; n_layer],
            None,
            0,
        ),
        (
            "experts on the host",
            vec![ExpertHome::Host; n_layer],
            None,
            2,
        ),
        ("op offload", vec![ExpertHome::Host; n_layer], Some(4), 2),
        ("first MoE layer on the host", host_first_moe, None, 1),
    ];
    for (what, layers, offload, host_moe_layers) in cases {
        let placement = ExpertPlacement {
            layers,
            op_offload_min_batch: offload,
        };
        let dev = DeviceModel::load(open(), Ref0::new(), &placement).unwrap();
        let before = dev.stats();
        let got = run(&dev, &prompt());
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(bits(g) == bits(w), "{what}: feed {s} differs from the CPU");
        }
        let after = dev.stats();
        // 3 micro-batches of the prompt, then 3 of one token each.
        let ubatches = after.ubatches - before.ubatches;
        assert_eq!(ubatches, 6, "{what}");
        let trips = after.host_round_trips - before.host_round_trips;
        let offloaded = after.offloaded_layers - before.offloaded_layers;
        if offload.is_some() {
            // The prompt's micro-batches (8, 8, 4 tokens) run the host layers on the device.
            assert_eq!(
                (trips, offloaded),
                (3 * host_moe_layers, 3 * host_moe_layers),
                "{what}"
            );
        } else {
            assert_eq!(
                (trips, offloaded),
                (ubatches * host_moe_layers, 0),
                "{what}"
            );
        }
    }
}

#[test]
fn ref0_deepseek2_batched_sequences_equal_each_alone() {
    for home in [ExpertHome::Device, ExpertHome::Host] {
        let placement = ExpertPlacement {
            layers: vec![home; 3],
            op_offload_min_batch: None,
        };
        let dev = DeviceModel::load(open(), Ref0::new(), &placement).unwrap();
        let prompts: [Vec<u32>; 2] = [vec![5, 900, 31], (0..11).map(|i| i * 41 + 2).collect()];
        let alone: Vec<Vec<f32>> = prompts
            .iter()
            .map(|p| {
                let mut c = dev.new_cache(KvType::F16, N_CTX, 16);
                dev.forward(&mut c, p, LogitsWanted::Last).unwrap()
            })
            .collect();
        let mut caches: Vec<_> = (0..2)
            .map(|_| dev.new_cache(KvType::F16, N_CTX, 16))
            .collect();
        let before = dev.stats();
        let mut seqs: Vec<SeqBatch<'_, '_>> = caches
            .iter_mut()
            .zip(&prompts)
            .map(|(cache, p)| SeqBatch {
                cache,
                tokens: p,
                logits: true,
            })
            .collect();
        let together = dev.forward_multi(&mut seqs).unwrap();
        let trips = dev.stats().host_round_trips - before.host_round_trips;
        for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
            assert!(
                bits(t) == bits(a),
                "{home:?}: sequence {i} batched vs alone"
            );
        }
        // One micro-batch for both, or with host layers one per sequence in flight (the
        // executor's split): one round trip per host MoE layer per micro-batch.
        let want = if home == ExpertHome::Host { 2 * 2 } else { 0 };
        assert_eq!(trips, want, "{home:?}");
    }
}
