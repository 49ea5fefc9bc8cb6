//! Hybrid execution with the CPU on both sides of the expert boundary: placements come from
//! hmoe-placement's real `plan()` (`-ngl all --cpu-moe`, `-ngl all --n-cpu-moe 1`, `-ngl all`),
//! device layers run on a [`StagingDevice`] (own weight copies, staged inputs and outputs,
//! counted transfers). Logits must be bit-identical to the plain host model for `forward` and
//! `forward_multi`, transfers exactly one round trip per device layer per micro-batch (none when
//! the host holds every expert), op offload must copy exactly the routed experts, and the
//! hybrid runs must stay within the goldens' tolerance.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::{fixtures, floats, ids, load_json, softmax64};
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{
    ExpertBatch, ExpertDevice, ExpertDeviceError, ExpertHome, ExpertPlacement, ExpertTensors,
    GptOss, KvType, LogitsWanted, ModelError, SeqBatch, StagingDevice, TransferStats,
};
use hmoe_placement::{
    plan, DeviceBudget, GpuLayers, ModelShape, PlacementFlags, TensorDesc, TensorRule,
};

const H: ExpertHome = ExpertHome::Host;
const D: ExpertHome = ExpertHome::Device;

fn open(file: &str) -> GgufModel {
    GgufModel::open(
        fixtures().join("gpt-oss").join(file),
        LoadOptions::default(),
    )
    .unwrap()
}

/// The placement `plan()` makes for `-ngl all` plus `rules` on one roomy GPU.
fn planned(gguf: &GgufModel, rules: Vec<TensorRule>) -> ExpertPlacement {
    let shape = ModelShape::from_metadata(gguf.metadata()).unwrap();
    let tensors: Vec<TensorDesc> = gguf.tensors().iter().map(TensorDesc::from).collect();
    let flags = PlacementFlags {
        n_gpu_layers: GpuLayers::All,
        rules,
        ctx_size: Some(512),
        ..PlacementFlags::default()
    };
    let p = plan(
        &tensors,
        &shape,
        &DeviceBudget::with_gpus(&[64 << 30]),
        &flags,
    )
    .unwrap();
    let names = gguf.tensors().iter().map(|t| t.name.as_str());
    let on_gpu = p.tensor_devices.iter().map(|d| d.is_gpu());
    ExpertPlacement::from_tensor_devices(shape.n_layer as usize, names.zip(on_gpu)).unwrap()
}

/// The three flag sets of issue #5 and the expert homes they must give a 4-layer model.
fn configs() -> Vec<(&'static str, Vec<TensorRule>, [ExpertHome; 4])> {
    vec![
        ("-ngl all --cpu-moe", vec![TensorRule::CpuMoe], [H, H, H, H]),
        (
            "-ngl all --n-cpu-moe 1",
            vec![TensorRule::NCpuMoe(1)],
            [H, D, D, D],
        ),
        ("-ngl all", vec![], [D, D, D, D]),
    ]
}

/// Bytes of layer `l`'s routed-expert tensors in the file (weights and biases).
fn expert_tensor_bytes(gguf: &GgufModel, l: usize) -> u64 {
    gguf.tensors()
        .iter()
        .filter(|t| {
            ["gate", "up", "down"]
                .iter()
                .any(|m| t.name.starts_with(&format!("blk.{l}.ffn_{m}_exps.")))
        })
        .map(|t| t.n_bytes)
        .sum()
}

/// A hybrid model over a fresh staging device (kept for its counters).
fn hybrid(file: &str, placement: &ExpertPlacement) -> (GptOss, Arc<StagingDevice>) {
    let dev = Arc::new(StagingDevice::new("staging"));
    let model = GptOss::load_placed(open(file), placement, dev.clone()).unwrap();
    (model, dev)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32
}

/// Prompt (all logits) then greedy decode steps; every logits vector in order.
fn run(model: &GptOss, prompt: &[u32], ubatch: usize, n_decode: usize) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(KvType::F32, 256, ubatch);
    let mut out = vec![model
        .forward(&mut cache, prompt, LogitsWanted::All)
        .unwrap()];
    for _ in 0..n_decode {
        let last = out.last().unwrap();
        let next = argmax(&last[last.len() - model.params().n_vocab..]);
        out.push(
            model
                .forward(&mut cache, &[next], LogitsWanted::Last)
                .unwrap(),
        );
    }
    out
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 1000).collect()
}

/// Expected counters of `n_dev` device layers over micro-batches of `sizes` tokens.
fn round_trips(n_dev: u64, sizes: &[u64], d: u64, k: u64) -> (u64, u64, u64, u64) {
    let tokens: u64 = sizes.iter().sum();
    (
        n_dev * sizes.len() as u64,
        n_dev * 4 * tokens * (d + 2 * k),
        n_dev * sizes.len() as u64,
        n_dev * 4 * tokens * d,
    )
}

fn trips(s: &TransferStats) -> (u64, u64, u64, u64) {
    (s.to_device, s.to_device_bytes, s.to_host, s.to_host_bytes)
}

#[test]
fn plans_give_the_expected_expert_homes() {
    let gguf = open("gptoss-small.gguf");
    for (name, rules, homes) in configs() {
        assert_eq!(planned(&gguf, rules).layers, homes, "{name}");
    }
}

#[test]
fn forward_is_bit_identical_with_one_round_trip_per_device_layer() {
    for file in ["gptoss-tiny.gguf", "gptoss-small.gguf"] {
        let host = GptOss::load(open(file)).unwrap();
        let (d, k) = (
            host.params().n_embd as u64,
            host.params().n_expert_used as u64,
        );
        // 20 prompt tokens in micro-batches of 8 (8, 8, 4), then 3 decode steps.
        let want = run(&host, &prompt(20), 8, 3);
        let sizes = [8, 8, 4, 1, 1, 1];
        for (name, rules, homes) in configs() {
            let gguf = open(file);
            let placement = planned(&gguf, rules).with_op_offload(None);
            let (model, dev) = hybrid(file, &placement);
            assert_eq!(model.expert_homes(), homes);
            let dev_layers: Vec<usize> = (0..4).filter(|&l| homes[l] == D).collect();
            let n_dev = dev_layers.len() as u64;
            let s = dev.stats();
            assert_eq!(
                s.uploads, n_dev,
                "{file} {name}: one upload per device layer"
            );
            assert_eq!(
                s.upload_bytes,
                dev_layers
                    .iter()
                    .map(|&l| expert_tensor_bytes(&gguf, l))
                    .sum::<u64>(),
                "{file} {name}: the device layers' expert tensors, byte for byte"
            );
            assert_eq!(dev.bytes_held(), s.upload_bytes);
            assert_eq!(trips(&s), (0, 0, 0, 0));
            let got = run(&model, &prompt(20), 8, 3);
            for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(bits(g), bits(w), "{file} {name}: step {step}");
            }
            assert_eq!(
                trips(&dev.stats()),
                round_trips(n_dev, &sizes, d, k),
                "{file} {name}: 2 transfers per device layer per micro-batch"
            );
            assert_eq!(dev.stats().uploads, n_dev, "no uploads while running");
        }
    }
}

/// Two sequences per step (a prompt chunk beside another prompt, then decode beside decode):
/// each sequence's logits equal the plain model's, and each step is one round trip per device
/// layer, whatever the number of sequences in it.
#[test]
fn forward_multi_is_bit_identical_with_one_round_trip_per_step() {
    let file = "gptoss-small.gguf";
    let host = GptOss::load(open(file)).unwrap();
    let (d, k) = (
        host.params().n_embd as u64,
        host.params().n_expert_used as u64,
    );
    let steps: Vec<Vec<Vec<u32>>> = vec![
        vec![prompt(5), prompt(7)[2..].to_vec(), vec![3]],
        vec![vec![46], vec![77], vec![9, 10]],
        vec![vec![510], vec![261], vec![11]],
    ];
    let drive = |model: &GptOss| -> Vec<Vec<Vec<f32>>> {
        let mut caches: Vec<_> = (0..3)
            .map(|_| model.new_cache(KvType::F32, 128, 16))
            .collect();
        steps
            .iter()
            .map(|feeds| {
                let mut seqs: Vec<SeqBatch<'_, '_>> = caches
                    .iter_mut()
                    .zip(feeds)
                    .map(|(cache, tokens)| SeqBatch {
                        cache,
                        tokens,
                        logits: true,
                    })
                    .collect();
                model.forward_multi(&mut seqs).unwrap()
            })
            .collect()
    };
    let want = drive(&host);
    for (name, rules, homes) in configs() {
        let placement = planned(&open(file), rules).with_op_offload(None);
        let (model, dev) = hybrid(file, &placement);
        let got = drive(&model);
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            for (seq, (g, w)) in g.iter().zip(w).enumerate() {
                assert_eq!(bits(g), bits(w), "{name}: step {step} sequence {seq}");
            }
        }
        let n_dev = homes.iter().filter(|&&h| h == D).count() as u64;
        let sizes: Vec<u64> = steps
            .iter()
            .map(|f| f.iter().map(|t| t.len() as u64).sum())
            .collect();
        assert_eq!(
            trips(&dev.stats()),
            round_trips(n_dev, &sizes, d, k),
            "{name}"
        );
    }
}

/// What the executor asked of the device.
#[derive(Clone, Debug, PartialEq)]
enum Call {
    UploadExperts { layer: usize, ids: Vec<usize> },
    Run { layer: usize, routed: Vec<usize> },
}

/// A device that records the executor's calls and forwards them to a staging device (this is
/// also what an out-of-crate implementation of the trait looks like).
struct Recorder {
    inner: StagingDevice,
    calls: Mutex<Vec<Call>>,
    fail_runs: bool,
}

impl Recorder {
    fn new(fail_runs: bool) -> Recorder {
        Recorder {
            inner: StagingDevice::new("recorded staging"),
            calls: Mutex::new(Vec::new()),
            fail_runs,
        }
    }
}

impl ExpertDevice for Recorder {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn upload_layer(&self, layer: usize, t: &ExpertTensors<'_>) -> Result<(), ExpertDeviceError> {
        self.inner.upload_layer(layer, t)
    }
    fn upload_experts(
        &self,
        layer: usize,
        t: &ExpertTensors<'_>,
        ids: &[usize],
    ) -> Result<(), ExpertDeviceError> {
        self.calls.lock().unwrap().push(Call::UploadExperts {
            layer,
            ids: ids.to_vec(),
        });
        self.inner.upload_experts(layer, t, ids)
    }
    fn run(
        &self,
        layer: usize,
        batch: &ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ExpertDeviceError> {
        if self.fail_runs {
            return Err(ExpertDeviceError::Backend {
                device: self.name().to_string(),
                message: "simulated launch failure".into(),
            });
        }
        self.calls.lock().unwrap().push(Call::Run {
            layer,
            routed: batch.routed_experts(),
        });
        self.inner.run(layer, batch, out)
    }
    fn stats(&self) -> TransferStats {
        self.inner.stats()
    }
}

/// Op offload: micro-batches of at least the threshold run their host layers' routed experts
/// on the device, copying exactly those experts (uploads, then a run on the same layer with
/// the same routed set), with bit-identical logits; smaller micro-batches stay on the host.
#[test]
fn op_offload_copies_exactly_the_routed_experts() {
    let file = "gptoss-small.gguf";
    let host = GptOss::load(open(file)).unwrap();
    let (d, k, n_expert) = (
        host.params().n_embd as u64,
        host.params().n_expert_used as u64,
        host.params().n_expert,
    );
    let gguf = open(file);
    let expert_bytes = expert_tensor_bytes(&gguf, 0) / n_expert as u64;
    // (placement, min batch, ubatch, prompt): the micro-batches are 40 / 16,16,8 / 3,3,3,3,1.
    let cases = [
        ("--cpu-moe", vec![TensorRule::CpuMoe], Some(32), 64, 40),
        ("--cpu-moe", vec![TensorRule::CpuMoe], Some(32), 16, 40),
        ("--cpu-moe", vec![TensorRule::CpuMoe], Some(8), 16, 40),
        ("--cpu-moe", vec![TensorRule::CpuMoe], None, 64, 40),
        ("--cpu-moe", vec![TensorRule::CpuMoe], Some(2), 3, 13),
        (
            "--n-cpu-moe 1",
            vec![TensorRule::NCpuMoe(1)],
            Some(32),
            64,
            40,
        ),
    ];
    let mut saw_partial = false;
    for (name, rules, min_batch, ubatch, n_prompt) in cases {
        let placement = planned(&gguf, rules).with_op_offload(min_batch);
        let rec = Arc::new(Recorder::new(false));
        let model = GptOss::load_placed(open(file), &placement, rec.clone()).unwrap();
        let load_stats = rec.stats();
        let want = run(&host, &prompt(n_prompt), ubatch, 2);
        let got = run(&model, &prompt(n_prompt), ubatch, 2);
        // The staging device's own (pipelined) offload, beside the trait's default that the
        // recorder uses.
        let (piped, staging) = hybrid(file, &placement);
        let got_piped = run(&piped, &prompt(n_prompt), ubatch, 2);
        for (step, ((g, p), w)) in got.iter().zip(&got_piped).zip(&want).enumerate() {
            assert_eq!(
                bits(g),
                bits(w),
                "{name} {min_batch:?} ub {ubatch}: step {step}"
            );
            assert_eq!(
                bits(p),
                bits(w),
                "{name} {min_batch:?} ub {ubatch}: step {step}"
            );
        }
        assert_eq!(
            staging.stats(),
            rec.stats(),
            "{name}: same transfers either way"
        );
        // Micro-batch sizes: the prompt's chunks, then two single-token decode steps.
        let mut sizes: Vec<usize> = prompt(n_prompt).chunks(ubatch).map(<[u32]>::len).collect();
        sizes.extend([1, 1]);
        let offloaded: Vec<usize> = sizes
            .iter()
            .copied()
            .filter(|&n| min_batch.is_some_and(|m| n >= m))
            .collect();
        let host_layers: Vec<usize> = (0..4).filter(|&l| placement.layers[l] == H).collect();
        let n_dev = (4 - host_layers.len()) as u64;
        // Calls: per offloaded micro-batch, for every host layer in order, an upload of exactly
        // the experts the following run routes to.
        let calls = rec.calls.lock().unwrap().clone();
        let offload_calls: Vec<&Call> = calls
            .iter()
            .enumerate()
            .filter(|(i, c)| {
                matches!(c, Call::UploadExperts { .. })
                    || matches!(
                        calls.get(i.wrapping_sub(1)),
                        Some(Call::UploadExperts { .. })
                    )
            })
            .map(|(_, c)| c)
            .collect();
        assert_eq!(
            offload_calls.len(),
            2 * offloaded.len() * host_layers.len(),
            "{name} {min_batch:?} ub {ubatch}"
        );
        let mut copied = 0u64;
        for (j, pair) in offload_calls.chunks(2).enumerate() {
            let want_layer = host_layers[j % host_layers.len()];
            match pair {
                [Call::UploadExperts { layer, ids }, Call::Run { layer: rl, routed }] => {
                    assert_eq!((*layer, *rl), (want_layer, want_layer));
                    assert_eq!(ids, routed, "{name}: uploads exactly the routed experts");
                    saw_partial |= ids.len() < n_expert;
                    copied += ids.len() as u64 * expert_bytes;
                }
                other => panic!("{name}: unexpected calls {other:?}"),
            }
        }
        let s = rec.stats();
        assert_eq!(
            s.uploads - load_stats.uploads,
            offload_calls.len() as u64 / 2
        );
        assert_eq!(s.upload_bytes - load_stats.upload_bytes, copied);
        // Round trips: every device layer each micro-batch, every host layer when offloaded.
        let (dev_sizes, off_sizes): (Vec<u64>, Vec<u64>) = (
            sizes.iter().map(|&n| n as u64).collect(),
            offloaded.iter().map(|&n| n as u64).collect(),
        );
        let a = round_trips(n_dev, &dev_sizes, d, k);
        let b = round_trips(host_layers.len() as u64, &off_sizes, d, k);
        assert_eq!(
            trips(&s),
            (a.0 + b.0, a.1 + b.1, a.2 + b.2, a.3 + b.3),
            "{name} {min_batch:?} ub {ubatch}"
        );
        eprintln!(
            "{name} op offload {min_batch:?} ubatch {ubatch}: {} experts copied ({} bytes), {} round trips",
            copied / expert_bytes,
            copied,
            s.to_device
        );
    }
    assert!(saw_partial, "some micro-batch routes to a strict subset");
}

/// Teacher-forced top-10 against llama.cpp's golden (f32 KV) for the hybrid placements, op
/// offload included (threshold lowered so that the golden prompts trigger it).
#[test]
fn hybrid_placements_match_the_golden() {
    let file = "gptoss-small.gguf";
    let golden = load_json("gpt-oss", "gptoss-small.golden.json");
    let gguf = open(file);
    for (name, rules, _) in configs() {
        for min_batch in [None, Some(4)] {
            let placement = planned(&gguf, rules.clone()).with_op_offload(min_batch);
            let (model, dev) = hybrid(file, &placement);
            let mut worst = 0f64;
            for (i, case) in golden["cases"].as_array().unwrap().iter().enumerate() {
                let greedy = ids(&case["greedy_tokens"]);
                let mut cache = model.new_cache(KvType::F32, 512, 512);
                let mut logits = model
                    .forward(&mut cache, &ids(&case["prompt_tokens"]), LogitsWanted::Last)
                    .unwrap();
                let last = floats(&case["prompt_logits_last"]);
                let dl = logits
                    .iter()
                    .zip(&last)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(dl <= 1e-3, "{name} case {i}: prompt logits |Δ| {dl}");
                for (step, top) in case["top_probs"].as_array().unwrap().iter().enumerate() {
                    let probs = softmax64(&logits);
                    for pair in top.as_array().unwrap() {
                        let id = pair[0].as_u64().unwrap() as usize;
                        let dp = (probs[id] - pair[1].as_f64().unwrap()).abs();
                        assert!(dp <= 5e-3, "{name} case {i} step {step}: |Δp| {dp}");
                        worst = worst.max(dp);
                    }
                    if step + 1 < greedy.len() {
                        logits = model
                            .forward(&mut cache, &[greedy[step]], LogitsWanted::Last)
                            .unwrap();
                    }
                }
            }
            eprintln!(
                "{name}, op offload {min_batch:?}: max |Δp| {worst:.2e}, {} round trips",
                dev.stats().to_device
            );
        }
    }
}

#[test]
fn bad_placements_and_device_failures_are_errors() {
    let file = "gptoss-tiny.gguf";
    let dev = Arc::new(StagingDevice::new("staging"));
    let short = ExpertPlacement::all(3, D);
    assert!(matches!(
        GptOss::load_placed(open(file), &short, dev.clone()),
        Err(ModelError::ExpertDevice(ExpertDeviceError::Placement(_)))
    ));
    let zero = ExpertPlacement::all(4, H).with_op_offload(Some(0));
    assert!(GptOss::load_placed(open(file), &zero, dev).is_err());
    let failing = Arc::new(Recorder::new(true));
    let model = GptOss::load_placed(open(file), &ExpertPlacement::all(4, D), failing).unwrap();
    let mut cache = model.new_cache(KvType::F32, 64, 8);
    assert!(matches!(
        model.forward(&mut cache, &[1, 2, 3], LogitsWanted::Last),
        Err(ModelError::ExpertDevice(ExpertDeviceError::Backend { .. }))
    ));
}

/// Not a check: the staging device's cost over the host path (copies of inputs and outputs
/// per layer), printed for the report.
#[test]
fn staging_overhead_report() {
    let file = "gptoss-small.gguf";
    let host = GptOss::load(open(file)).unwrap();
    let (all_dev, _) = hybrid(file, &ExpertPlacement::all(4, D).with_op_offload(None));
    let time = |m: &GptOss| {
        let t = Instant::now();
        for _ in 0..3 {
            run(m, &prompt(32), 32, 16);
        }
        t.elapsed().as_secs_f64() / 3.0
    };
    time(&host);
    let (th, td) = (time(&host), time(&all_dev));
    eprintln!(
        "32-token prompt + 16 decode steps: host {:.2} ms, all experts on the staging device {:.2} ms",
        th * 1e3,
        td * 1e3
    );
}
