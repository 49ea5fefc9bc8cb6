//! Qwen3-MoE (`qwen3moe`) on the reference device: `DeviceModel<Ref0>` gives the CPU's
//! logits bit for bit (every prompt position over several micro-batches, then greedy decode
//! steps, whose single-token attention sums values in `vec_dot`'s four chains) on the F32
//! fixture and on `make-test-model`-style files with Q8_0 attention and Q8_0 experts (or Q4_K
//! experts with Q6_K down: the placements and batched sequences), with the
//! routed experts on the device, on the host (one round trip per layer per micro-batch), on
//! the host with op offload, and on the host for one layer only; for f32, f16, bf16 and
//! (where heads are whole blocks) q8_0 K/V caches; and several sequences batched in one
//! `forward_multi` get what each gets alone, with one round trip per host layer. The last
//! layer's experts take the rows whose logits are wanted alone. Heads the device cannot
//! attend (not a multiple of 16 values) are refused at load.

mod common;

use std::path::PathBuf;

use common::fixtures;
use hmoe_backend::Ref0;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::kv_cache::{CacheType, FlashAttn};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted, SeqBatch,
};
use hmoe_quant::GgmlType;
use hmoe_synth::{qwen3moe_writer, Qwen3MoeSpec};

const UBATCH: usize = 8;
const N_CTX: usize = 64;

/// The models: the F32 fixture (2 layers, heads of 16) and a synthetic one written here.
#[derive(Clone, Copy, Debug)]
enum Model {
    Fixture,
    /// Q8_0 attention, embedding, head and experts, heads of 32.
    Synth,
    /// [`Model::Synth`] 256 wide with 4 experts, Q4_K gate/up and Q6_K down (as in Q4_K_M
    /// files): an expert gets 8 or more rows of a batch (the CPU's tiled K-quant order).
    SynthKQuant,
}

/// The synthetic model's dimensions.
fn synth_spec() -> Qwen3MoeSpec {
    Qwen3MoeSpec {
        n_layer: 2,
        n_embd: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 32,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 64,
        n_vocab: 300,
        expert_type: GgmlType::Q8_0,
        down_expert_type: None,
        seed: 7,
    }
}

/// Writes `spec` to a temporary file named after `stem` and returns its path.
fn write(spec: &Qwen3MoeSpec, stem: &str) -> PathBuf {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("hmoe-{stem}.gguf"));
    // Written under a name of this process, then renamed: one file per stem however many runs.
    let part = path.with_extension(format!("{}.part", std::process::id()));
    qwen3moe_writer(spec).unwrap().write(&part).unwrap();
    std::fs::rename(&part, &path).unwrap();
    path
}

/// Writes the synthetic model once per test binary and returns its path.
fn synth_path() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| write(&synth_spec(), "device-qwen3moe"))
        .clone()
}

fn open(m: Model) -> GgufModel {
    let path = match m {
        Model::Fixture => fixtures().join("qwen3moe/qwen3moe-tiny.gguf"),
        Model::Synth => synth_path(),
        Model::SynthKQuant => {
            static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
            let spec = Qwen3MoeSpec {
                n_embd: 256,
                n_expert: 4,
                n_ff_exp: 256,
                expert_type: GgmlType::Q4_K,
                down_expert_type: Some(GgmlType::Q6_K),
                ..synth_spec()
            };
            PATH.get_or_init(|| write(&spec, "device-qwen3moe-kquant"))
                .clone()
        }
    };
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
fn run(model: &dyn LanguageModel, ty: KvType) -> Vec<Vec<f32>> {
    let n_vocab = model.n_vocab();
    let prompt: Vec<u32> = (0..20).map(|i| ((i * 53 + 7) % n_vocab) as u32).collect();
    let mut cache = model.new_cache(ty, N_CTX, UBATCH);
    let mut out = vec![model
        .forward(&mut cache, &prompt, LogitsWanted::All)
        .unwrap()];
    for _ in 0..3 {
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

fn kv(k: CacheType, v: CacheType) -> KvType {
    KvType::new(k, v, FlashAttn::On).unwrap()
}

fn assert_same(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(bits(g) == bits(w), "{what}: feed {s} differs from the CPU");
    }
}

#[test]
fn ref0_qwen3moe_is_the_cpu_device_bit_for_bit() {
    let (d, h) = (ExpertHome::Device, ExpertHome::Host);
    for m in [Model::Fixture, Model::Synth, Model::SynthKQuant] {
        let ty = kv(CacheType::F16, CacheType::F16);
        let cpu = hmoe_model::load(open(m)).unwrap();
        let want = run(cpu.as_ref(), ty);
        // (placement, op offload, host layers)
        let cases: [(&str, Vec<ExpertHome>, Option<usize>, u64); 4] = [
            ("experts on REF0", vec![d, d], None, 0),
            ("experts on the host", vec![h, h], None, 2),
            ("op offload", vec![h, h], Some(4), 2),
            ("first layer on the host", vec![h, d], None, 1),
        ];
        for (what, layers, offload, host_layers) in cases {
            let what = format!("{m:?}: {what}");
            let placement = ExpertPlacement {
                layers,
                op_offload_min_batch: offload,
            };
            let dev = DeviceModel::load(open(m), Ref0::new(), &placement).unwrap();
            let before = dev.stats();
            let got = run(&dev, ty);
            assert_same(&what, &got, &want);
            let after = dev.stats();
            // 3 micro-batches of the prompt, then 3 of one token each.
            let ubatches = after.ubatches - before.ubatches;
            assert_eq!(ubatches, 6, "{what}");
            let trips = after.host_round_trips - before.host_round_trips;
            let offloaded = after.offloaded_layers - before.offloaded_layers;
            if offload.is_some() {
                // The prompt's micro-batches (8, 8, 4 tokens) run the host layers on the
                // device; the decode steps round-trip.
                assert_eq!(
                    (trips, offloaded),
                    (3 * host_layers, 3 * host_layers),
                    "{what}"
                );
            } else {
                assert_eq!((trips, offloaded), (ubatches * host_layers, 0), "{what}");
            }
            // Device → host: each micro-batch's logits, one staged copy per round trip and
            // the routing of each offloaded layer (to upload the experts it routes to, or,
            // where a micro-batch routes 4 rows or more per expert and every expert is
            // uploaded, to run them slice by slice through the op-offload ring); nothing else
            // leaves the device.
            let (t0, t1) = (before.transfers.unwrap(), after.transfers.unwrap());
            assert_eq!(
                t1.downloads - t0.downloads,
                ubatches + trips + offloaded,
                "{what}"
            );
        }
    }
}

/// Every K/V type pair of the CPU that the heads allow, on both models, with the
/// experts on the device and on the host.
#[test]
fn ref0_qwen3moe_kv_types_are_the_cpu_devices_bit_for_bit() {
    use CacheType::*;
    for m in [Model::Fixture, Model::Synth] {
        let pairs: &[(CacheType, CacheType)] = match m {
            // Heads of 16 are not whole Q8_0 blocks.
            Model::Fixture => &[(F32, F32), (BF16, BF16), (F16, F32)],
            Model::Synth | Model::SynthKQuant => {
                &[(F32, F32), (Q8_0, Q8_0), (F16, Q8_0), (Q8_0, F16)]
            }
        };
        let cpu = hmoe_model::load(open(m)).unwrap();
        for &(k, v) in pairs {
            let ty = kv(k, v);
            let want = run(cpu.as_ref(), ty);
            for home in [ExpertHome::Device, ExpertHome::Host] {
                let placement = ExpertPlacement {
                    layers: vec![home; 2],
                    op_offload_min_batch: None,
                };
                let dev = DeviceModel::load(open(m), Ref0::new(), &placement).unwrap();
                let got = run(&dev, ty);
                assert_same(&format!("{m:?} K {k} / V {v}, {home:?}"), &got, &want);
            }
        }
    }
}

#[test]
fn ref0_qwen3moe_batched_sequences_equal_each_alone() {
    for m in [Model::Fixture, Model::Synth, Model::SynthKQuant] {
        for home in [ExpertHome::Device, ExpertHome::Host] {
            let placement = ExpertPlacement {
                layers: vec![home; 2],
                op_offload_min_batch: None,
            };
            let dev = DeviceModel::load(open(m), Ref0::new(), &placement).unwrap();
            let prompts: [Vec<u32>; 3] = [
                vec![5, 200, 31],
                (0..11).map(|i| i * 23 + 2).collect(),
                vec![17],
            ];
            let ty = kv(CacheType::F16, CacheType::F16);
            let alone: Vec<Vec<f32>> = prompts
                .iter()
                .map(|p| {
                    let mut c = dev.new_cache(ty, N_CTX, 16);
                    dev.forward(&mut c, p, LogitsWanted::Last).unwrap()
                })
                .collect();
            let mut caches: Vec<_> = (0..3).map(|_| dev.new_cache(ty, N_CTX, 16)).collect();
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
            let after = dev.stats();
            for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
                assert!(
                    bits(t) == bits(a),
                    "{m:?} {home:?}: sequence {i} batched vs alone"
                );
            }
            // One micro-batch for all three, or with host layers two in flight (the
            // executor's split): one round trip per host layer per micro-batch.
            let split = after.split_steps - before.split_steps;
            assert_eq!(split, u64::from(home == ExpertHome::Host), "{m:?} {home:?}");
            let ubatches = after.ubatches - before.ubatches;
            assert_eq!(ubatches, 1 + split, "{m:?} {home:?}");
            let want = if home == ExpertHome::Host {
                2 * ubatches
            } else {
                0
            };
            assert_eq!(
                after.host_round_trips - before.host_round_trips,
                want,
                "{m:?} {home:?}"
            );
            // A decode step of every sequence together, one token each (each single-token
            // attention in four value chains), equals each alone.
            let next = [7u32, 8, 9];
            let mut seqs: Vec<SeqBatch<'_, '_>> = caches
                .iter_mut()
                .zip(&next)
                .map(|(cache, t)| SeqBatch {
                    cache,
                    tokens: std::slice::from_ref(t),
                    logits: true,
                })
                .collect();
            let together = dev.forward_multi(&mut seqs).unwrap();
            for (i, (p, t)) in prompts.iter().zip(&next).enumerate() {
                let mut c = dev.new_cache(ty, N_CTX, 16);
                dev.forward(&mut c, p, LogitsWanted::Last).unwrap();
                let alone = dev.forward(&mut c, &[*t], LogitsWanted::Last).unwrap();
                assert!(
                    bits(&together[i]) == bits(&alone),
                    "{m:?} {home:?}: decode of sequence {i} batched vs alone"
                );
            }
        }
    }
}

/// The last layer runs its feed-forward block over the rows whose logits are wanted alone, as
/// llama.cpp does (`inp_out_ids`), so that a prompt's last token meets the last layer's F32
/// router as one row (`vec_dot`) whatever the micro-batch: with host experts the last layer's
/// round trip of a prompt that wants the last logits brings down one row, of one that wants
/// every position's logits all of them.
#[test]
fn ref0_qwen3moe_last_layer_experts_take_the_wanted_rows_alone() {
    let placement = ExpertPlacement {
        layers: vec![ExpertHome::Host; 2],
        op_offload_min_batch: None,
    };
    let dev = DeviceModel::load(open(Model::Synth), Ref0::new(), &placement).unwrap();
    let ty = kv(CacheType::F16, CacheType::F16);
    let bytes = |tokens: &[u32], want: LogitsWanted| {
        let mut c = dev.new_cache(ty, N_CTX, 16);
        let before = dev.stats().bytes_to_host;
        dev.forward(&mut c, tokens, want).unwrap();
        dev.stats().bytes_to_host - before
    };
    // A single token: one row down per host layer.
    let row = bytes(&[5], LogitsWanted::Last) / 2;
    assert!(row > 0);
    let prompt: Vec<u32> = (0..6).map(|i| i * 31 + 4).collect();
    assert_eq!(bytes(&prompt, LogitsWanted::All), 2 * 6 * row);
    assert_eq!(bytes(&prompt, LogitsWanted::Last), (6 + 1) * row);
    // Beside a sequence that wants no logits, one that wants its last gets what it gets alone.
    let other: Vec<u32> = (0..4).map(|i| i * 17 + 9).collect();
    let mut c = dev.new_cache(ty, N_CTX, 16);
    let alone = dev.forward(&mut c, &prompt, LogitsWanted::Last).unwrap();
    let mut caches: Vec<_> = (0..2).map(|_| dev.new_cache(ty, N_CTX, 16)).collect();
    let mut seqs: Vec<SeqBatch<'_, '_>> = caches
        .iter_mut()
        .zip([(&other, false), (&prompt, true)])
        .map(|(cache, (p, logits))| SeqBatch {
            cache,
            tokens: p,
            logits,
        })
        .collect();
    let together = dev.forward_multi(&mut seqs).unwrap();
    assert!(together[0].is_empty());
    assert!(bits(&together[1]) == bits(&alone));
}

/// Heads the contract's attention does not take (not a multiple of 16 values) are refused at
/// load on REF0 and on the CPU alike, naming the head size.
#[test]
fn ref0_qwen3moe_refuses_heads_it_cannot_attend() {
    let spec = Qwen3MoeSpec {
        head_dim: 8,
        ..synth_spec()
    };
    let path = write(&spec, "device-qwen3moe-hd8");
    let gguf = || GgufModel::open(&path, LoadOptions::default()).unwrap();
    let placement = ExpertPlacement {
        layers: vec![ExpertHome::Device; 2],
        op_offload_min_batch: None,
    };
    let Err(e) = DeviceModel::load(gguf(), Ref0::new(), &placement) else {
        panic!("heads of 8 loaded on the device")
    };
    assert!(e.to_string().contains("heads of 8 values"), "{e}");
    let Err(e) = hmoe_model::load(gguf()) else {
        panic!("heads of 8 loaded on the CPU")
    };
    assert!(e.to_string().contains("heads of 8 values"), "{e}");
    let _ = std::fs::remove_file(&path);
}

/// [`LogitsWanted::Hidden`]: every token's hidden state after the output norm, `n_embd`
/// floats each, over three micro-batches: the same bits on REF0 (experts on the device and on
/// the host) as on the CPU.
#[test]
fn ref0_qwen3moe_hidden_states_are_the_cpu_devices_bit_for_bit() {
    let (d, h) = (ExpertHome::Device, ExpertHome::Host);
    let ty = kv(CacheType::F32, CacheType::F32);
    for m in [Model::Fixture, Model::Synth] {
        let cpu = hmoe_model::load(open(m)).unwrap();
        let n_embd = cpu.n_embd();
        let prompt: Vec<u32> = (0..20)
            .map(|i| ((i * 31 + 3) % cpu.n_vocab()) as u32)
            .collect();
        let hidden = |model: &dyn LanguageModel, ubatch: usize| {
            let mut cache = model.new_cache(ty, N_CTX, ubatch);
            (model.forward(&mut cache, &prompt, LogitsWanted::Hidden)).unwrap()
        };
        let want = hidden(cpu.as_ref(), UBATCH);
        assert_eq!(want.len(), prompt.len() * n_embd, "{m:?}");
        assert!(want.iter().all(|x| x.is_finite()) && want.iter().any(|&x| x != 0.0));
        for layers in [vec![d, d], vec![h, h]] {
            let placement = ExpertPlacement {
                layers: layers.clone(),
                op_offload_min_batch: None,
            };
            let dev = DeviceModel::load(open(m), Ref0::new(), &placement).unwrap();
            assert!(
                bits(&hidden(&dev, UBATCH)) == bits(&want),
                "{m:?} {layers:?}: REF0's hidden states differ from the CPU's"
            );
        }
    }
}
