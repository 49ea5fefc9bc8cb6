//! The gpt-oss executor ([`DeviceModel`]) against the CPU device and llama.cpp's goldens (f16
//! KV) on the gpt-oss fixtures, for the placements of GPU offload (`-ngl all`, `-ngl all
//! --cpu-moe`, `-ngl all --n-cpu-moe 1`, planned by hmoe-placement's real `plan()`) and op
//! offload from 4 tokens: teacher-forced top-10 probabilities at every step, one host round
//! trip per host layer per micro-batch (none with every expert on the GPU), op offload of the
//! prompts' host layers.
//!
//! Each check runs twice: on the CUDA device (skipped without one: "no CUDA device: skipped")
//! and on [`Ref0`], plain Rust with the kernels' semantics, which runs everywhere.
//!
//! Tolerances. The executor converts activations as ggml's CPU backend does (Q8_0 blocks for
//! Q8_0/MXFP4 weights, the attention query and probabilities rounded to f16) and sums in the
//! CPU device's orders, so on [`Ref0`] its probabilities are the CPU device's bit for
//! bit on every gpt-oss fixture (asserted). Before that (f32 activations, f64 sums) routing
//! flips put the reference backend at max |Δp| 0.44 (tiny), 0.28 (small) and 0.03 (openai).
//! The 5e-3 criterion of the GPU offload work is asserted on the reference backend for every
//! fixture (at most one step per case above it, as the fixtures' README allows for routing
//! flips) and on
//! the GPU for gptoss-openai-f32experts; on the Q8_0/MXFP4 fixtures the GPU's figures are
//! reported, not asserted (cuBLAS, `cosf`/`sinf` and `expf` on the GPU can still flip a
//! routing choice).

use hmoe_backend::{Backend, Ref0};
use hmoe_cuda::CudaDevice;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::executor::PREFETCH_ROUTES_PER_EXPERT;
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, GptOssParams, KvType, LanguageModel, LogitsWanted,
};
use hmoe_placement::{plan, DeviceBudget, GpuLayers, PlacementFlags, TensorDesc, TensorRule};
use hmoe_quant::GgmlType;
use serde_json::Value;

/// The probability tolerance of the GPU offload work (5e-3).
const P_TOL: f64 = 5e-3;

/// What a fixture run must meet: every top-10 probability within `p` of the CPU device's and
/// the golden's, except at up to `flips_per_case` steps of each case.
#[derive(Clone, Copy)]
struct Tolerance {
    p: f64,
    flips_per_case: usize,
}

/// The 5e-3 tolerance at every step.
const STRICT: Tolerance = Tolerance {
    p: P_TOL,
    flips_per_case: 0,
};
/// 5e-3 with one step per case left to a routing flip (the fixtures' README).
const ONE_FLIP: Tolerance = Tolerance {
    p: P_TOL,
    flips_per_case: 1,
};
/// No assertion (figures reported only).
const REPORT: Tolerance = Tolerance {
    p: f64::INFINITY,
    flips_per_case: 0,
};

use hmoe_testdata::fixtures;

fn cuda() -> CudaDevice {
    CudaDevice::new(0).unwrap_or_else(|e| panic!("a GPU is present but: {e}"))
}

fn has_device() -> bool {
    let ok = hmoe_cuda::probe().is_ok_and(|g| !g.is_empty());
    if !ok {
        eprintln!("no CUDA device: skipped");
    }
    ok
}

fn open(file: &str) -> GgufModel {
    let path = fixtures().join("gpt-oss").join(file);
    GgufModel::open(&path, LoadOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The placement `plan()` makes for `-ngl all` plus `rules` on one roomy GPU.
fn planned(gguf: &GgufModel, rules: Vec<TensorRule>) -> ExpertPlacement {
    let shape = hmoe_model::model_shape(gguf).unwrap();
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

/// The placements of GPU offload, and two with op offload from 4 tokens (so that every golden
/// prompt, 5 to 40 tokens, runs its host layers on the GPU and decode steps round-trip).
fn configs() -> Vec<(&'static str, Vec<TensorRule>, Option<usize>)> {
    vec![
        ("-ngl all", vec![], None),
        ("-ngl all --cpu-moe", vec![TensorRule::CpuMoe], None),
        ("-ngl all --n-cpu-moe 1", vec![TensorRule::NCpuMoe(1)], None),
        (
            "-ngl all --cpu-moe --op-offload-min-batch 4",
            vec![TensorRule::CpuMoe],
            Some(4),
        ),
        (
            "-ngl all --n-cpu-moe 1 --op-offload-min-batch 4",
            vec![TensorRule::NCpuMoe(1)],
            Some(4),
        ),
    ]
}

fn softmax64(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The ten most probable ids, most probable first.
fn top10(p: &[f64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    idx.truncate(10);
    idx
}

/// Teacher-forced probabilities of every golden case: the prompt in one batch, then the
/// golden greedy tokens one at a time; one probability vector per step.
/// The hyperparameters of the fixture `file`.
fn params(file: &str) -> GptOssParams {
    let g = open(file);
    let n_vocab = g.tensor_info("token_embd.weight").unwrap().dims[1] as usize;
    GptOssParams::from_metadata(g.metadata(), n_vocab).unwrap()
}

fn teacher_forced(model: &dyn LanguageModel, case: &Value) -> Vec<Vec<f64>> {
    let prompt = ids(&case["prompt_tokens"]);
    let greedy = ids(&case["greedy_tokens"]);
    let steps = case["top_probs"].as_array().unwrap().len();
    let mut cache = model.new_cache(KvType::F16, 512, 512);
    let mut logits = model
        .forward(&mut cache, &prompt, LogitsWanted::Last)
        .unwrap();
    let mut out = vec![softmax64(&logits)];
    for &next in greedy.iter().take(steps.saturating_sub(1)) {
        logits = model
            .forward(&mut cache, &[next], LogitsWanted::Last)
            .unwrap();
        out.push(softmax64(&logits));
    }
    out
}

/// Runs every configuration of [`configs`] on `file` and checks it against the CPU device and
/// the golden within `tol`; returns the worst |Δp| against the CPU per configuration.
fn check_fixture<B: Backend + 'static>(
    file: &str,
    golden_file: &str,
    tol: Tolerance,
    backend: impl Fn() -> B,
) -> Vec<(&'static str, f64)> {
    let mut report = Vec::new();
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("gpt-oss").join(golden_file)).unwrap(),
    )
    .unwrap();
    let cases = golden["cases"].as_array().unwrap();
    let cpu = hmoe_model::load(open(file)).unwrap();
    let cpu_runs: Vec<_> = cases
        .iter()
        .map(|c| teacher_forced(cpu.as_ref(), c))
        .collect();
    for (name, rules, op_offload) in configs() {
        let gguf = open(file);
        let placement = planned(&gguf, rules).with_op_offload(op_offload);
        let n_host = placement
            .layers
            .iter()
            .filter(|&&h| h == ExpertHome::Host)
            .count() as u64;
        let gpu = DeviceModel::load(gguf, backend(), &placement).unwrap();
        let (mut worst_cpu, mut worst_golden) = (0f64, 0f64);
        let mut steps = 0u64;
        for (i, case) in cases.iter().enumerate() {
            let got = teacher_forced(&gpu, case);
            steps += got.len() as u64;
            let mut flips = Vec::new();
            for (step, (g, c)) in got.iter().zip(&cpu_runs[i]).enumerate() {
                let vs_cpu = top10(c)
                    .into_iter()
                    .map(|id| (g[id] - c[id]).abs())
                    .fold(0f64, f64::max);
                let vs_golden = case["top_probs"][step]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|pair| {
                        let id = pair[0].as_u64().unwrap() as usize;
                        (g[id] - pair[1].as_f64().unwrap()).abs()
                    })
                    .fold(0f64, f64::max);
                worst_cpu = worst_cpu.max(vs_cpu);
                worst_golden = worst_golden.max(vs_golden);
                if vs_cpu > tol.p || vs_golden > tol.p {
                    flips.push((step, vs_cpu, vs_golden));
                }
            }
            assert!(
                flips.len() <= tol.flips_per_case,
                "{file} {name} case {i}: {} steps above |Δp| {} (step, vs CPU, vs golden): \
                 {flips:?}",
                flips.len(),
                tol.p
            );
        }
        let stats = gpu.stats();
        // Every step is one micro-batch (prompts are shorter than the micro-batch); with op
        // offload each prompt's host layers run on the GPU, decode steps round-trip. The last
        // layer multiplies the prompt's last token alone, below op offload's 4 tokens, so
        // where it is a host layer it round-trips in the prompt's step too.
        let n_cases = cases.len() as u64;
        let last_host = u64::from(placement.layers.last() == Some(&ExpertHome::Host));
        let (trips, offloads) = match op_offload {
            None => (n_host * steps, 0),
            Some(_) => (
                n_host * (steps - n_cases) + last_host * n_cases,
                (n_host - last_host) * n_cases,
            ),
        };
        // A prompt that routes to nearly every expert uploads the first slice of each
        // offloaded host layer's experts while the host layer before it runs (all but the
        // first).
        let p = params(file);
        let prefetches = match op_offload {
            Some(_) => {
                cases
                    .iter()
                    .filter(|c| {
                        let n = c["prompt_tokens"].as_array().unwrap().len();
                        n * p.n_expert_used >= PREFETCH_ROUTES_PER_EXPERT * p.n_expert
                    })
                    .count() as u64
                    * (n_host - last_host).saturating_sub(1)
            }
            _ => 0,
        };
        assert_eq!(stats.ubatches, steps, "{name}");
        assert_eq!(stats.host_round_trips, trips, "{name}");
        assert_eq!(stats.offloaded_layers, offloads, "{name}");
        assert_eq!(stats.prefetched_layers, prefetches, "{name}");
        eprintln!(
            "{file} {name}: max |Δp| vs CPU {worst_cpu:.2e}, vs golden {worst_golden:.2e}, \
             {} host round trips, {} offloaded layers ({} experts, {} prefetched), {:.1} MiB \
             of weights on the GPU",
            stats.host_round_trips,
            stats.offloaded_layers,
            stats.offloaded_experts,
            stats.prefetched_layers,
            gpu.weight_bytes() as f64 / (1 << 20) as f64
        );
        report.push((name, worst_cpu));
    }
    report
}

#[test]
fn gpu_f32experts_within_5e3_of_the_cpu_device_and_the_golden() {
    if !has_device() {
        return;
    }
    check_fixture(
        "gptoss-openai-f32experts.gguf",
        "gptoss-openai-f32experts.golden-f16kv.json",
        STRICT,
        cuda,
    );
}

#[test]
fn gpu_tiny_small_openai_reported() {
    if !has_device() {
        return;
    }
    for stem in ["gptoss-tiny", "gptoss-small", "gptoss-openai"] {
        let gguf = format!("{stem}.gguf");
        let golden = format!("{stem}.golden-f16kv.json");
        for (name, worst) in check_fixture(&gguf, &golden, REPORT, cuda) {
            eprintln!(
                "GPU {stem} {name}: max |Δp| vs CPU {worst:.3e} ({})",
                if worst <= P_TOL {
                    "within 5e-3"
                } else {
                    "above 5e-3"
                }
            );
        }
    }
}

/// All logits of a prompt in micro-batches of 3 (ring wrap-around in the sliding layers,
/// several micro-batches per call) against the CPU device, and a cache that goes back
/// (truncate) continuing as the CPU's does.
#[test]
fn micro_batches_and_truncation_match_the_cpu_device() {
    if !has_device() {
        return;
    }
    micro_batches_and_truncation(cuda());
}

fn micro_batches_and_truncation<B: Backend + 'static>(backend: B) {
    let file = "gptoss-openai-f32experts.gguf";
    let cpu = hmoe_model::load(open(file)).unwrap();
    let gguf = open(file);
    let placement = planned(&gguf, vec![TensorRule::NCpuMoe(1)]).with_op_offload(None);
    let gpu = DeviceModel::load(gguf, backend, &placement).unwrap();
    let n_vocab = cpu.n_vocab();
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % n_vocab as u32).collect();
    let worst = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        a.chunks(n_vocab)
            .zip(b.chunks(n_vocab))
            .map(|(x, y)| {
                let (px, py) = (softmax64(x), softmax64(y));
                px.iter()
                    .zip(&py)
                    .map(|(u, v)| (u - v).abs())
                    .fold(0f64, f64::max)
            })
            .fold(0f64, f64::max)
    };
    // Micro-batches of 3 (the sliding layers' rings wrap) against one micro-batch: the same
    // executor on the same backend sees the same keys, so the results agree closely (not
    // exactly: F32 products of one token and of a batch sum in different orders, as on the
    // CPU; on CUDA batches of 16+ tokens take cuBLAS, another order again).
    let mut whole = gpu.new_cache(KvType::F16, 64, 512);
    let want = LanguageModel::forward(&gpu, &mut whole, &prompt, LogitsWanted::All).unwrap();
    let mut gc = gpu.new_cache(KvType::F16, 64, 3);
    let got = LanguageModel::forward(&gpu, &mut gc, &prompt, LogitsWanted::All).unwrap();
    let dp = worst(&got, &want);
    assert!(dp <= 1e-3, "ubatch 3 vs 512: max |Δp| {dp}");
    let mut cc = LanguageModel::new_cache(cpu.as_ref(), KvType::F16, 64, 3);
    let cpu_all =
        LanguageModel::forward(cpu.as_ref(), &mut cc, &prompt, LogitsWanted::All).unwrap();
    let dp = worst(&got, &cpu_all);
    assert!(dp <= P_TOL, "ubatch 3 vs the CPU device: max |Δp| {dp}");
    // Back 2 positions (the ring holds window + 3) and on, as the CPU cache does.
    assert!(cc.truncate(38) && gc.truncate(38));
    let next = [5u32, 6, 7];
    let want = LanguageModel::forward(cpu.as_ref(), &mut cc, &next, LogitsWanted::Last).unwrap();
    let got = LanguageModel::forward(&gpu, &mut gc, &next, LogitsWanted::Last).unwrap();
    let dp = worst(&got, &want);
    assert!(dp <= P_TOL, "after truncate: max |Δp| {dp}");
    // Another sequence has its own cache on the device: this one continues undisturbed.
    let mut other = gpu.new_cache(KvType::F16, 64, 3);
    LanguageModel::forward(&gpu, &mut other, &[1, 2], LogitsWanted::Last).unwrap();
    let want = LanguageModel::forward(cpu.as_ref(), &mut cc, &[1], LogitsWanted::Last).unwrap();
    let got = LanguageModel::forward(&gpu, &mut gc, &[1], LogitsWanted::Last).unwrap();
    let dp = worst(&got, &want);
    assert!(dp <= P_TOL, "after another sequence: max |Δp| {dp}");
    // A bf16 cache runs where the device keeps one (REF0) and is an error where it does not
    // (CUDA).
    let bf16 = KvType::parse("bf16").unwrap();
    let mut bf16_cache = gpu.new_cache(bf16, 64, 3);
    let kept = gpu.device().supports_kv(GgmlType::BF16, GgmlType::BF16);
    let run = LanguageModel::forward(&gpu, &mut bf16_cache, &[1], LogitsWanted::Last);
    assert_eq!(run.is_ok(), kept, "{:?}", run.err());
}

// The same checks with the executor on the reference backend (plain Rust with the kernels'
// semantics): they run everywhere and test the executor's logic and the numerics of f32
// activations against the CPU device; only the CUDA kernels themselves are left to the tests
// above (and to tests/gpu.rs, kernel by kernel).

#[test]
fn reference_backend_f32experts_within_5e3_of_the_cpu_device_and_the_golden() {
    check_fixture(
        "gptoss-openai-f32experts.gguf",
        "gptoss-openai-f32experts.golden-f16kv.json",
        STRICT,
        Ref0::new,
    );
}

/// The 5e-3 criterion on the Q8_0/MXFP4 fixtures, which needs ggml's activation conversion:
/// within 5e-3 of the CPU device and the golden (one step per case may flip). The reference
/// backend in fact reproduces the CPU device bit for bit (Δp = 0 everywhere): the CUDA kernels
/// mirror it, so a change of numerics on either side shows up here first.
#[test]
fn reference_backend_tiny_small_openai_within_5e3_of_the_cpu_device_and_the_golden() {
    for stem in ["gptoss-tiny", "gptoss-small", "gptoss-openai"] {
        let gguf = format!("{stem}.gguf");
        let golden = format!("{stem}.golden-f16kv.json");
        for (name, worst) in check_fixture(&gguf, &golden, ONE_FLIP, Ref0::new) {
            eprintln!("reference {stem} {name}: max |Δp| vs CPU {worst:.3e}");
            assert_eq!(
                worst, 0.0,
                "{stem} {name}: the reference backend no longer reproduces the CPU device bit \
                 for bit (the kernels mirror it: update both with the CPU's numerics)"
            );
        }
    }
}

/// Without room on the device for a second layer's experts (a 256 MiB budget keeps less than
/// the prefetch reserve free) the executor uploads each layer when it reaches it: no
/// prefetch, the same bits.
#[test]
fn reference_backend_without_room_does_not_prefetch() {
    for (name, worst) in check_fixture(
        "gptoss-small.gguf",
        "gptoss-small.golden-f16kv.json",
        ONE_FLIP,
        || Ref0::with_budget(256 << 20),
    ) {
        assert_eq!(worst, 0.0, "{name}");
    }
}

#[test]
fn reference_backend_micro_batches_and_truncation() {
    micro_batches_and_truncation(Ref0::new());
}

#[test]
fn reference_backend_stages_one_round_trip_per_host_layer() {
    let file = "gptoss-tiny.gguf";
    let gguf = open(file);
    let params = params(file);
    let placement = planned(&gguf, vec![TensorRule::NCpuMoe(1)]).with_op_offload(None);
    let gpu = DeviceModel::load(gguf, Ref0::new(), &placement).unwrap();
    let mut cache = gpu.new_cache(KvType::F16, 64, 8);
    LanguageModel::forward(&gpu, &mut cache, &[1, 2, 3, 4, 5], LogitsWanted::Last).unwrap();
    LanguageModel::forward(&gpu, &mut cache, &[6], LogitsWanted::Last).unwrap();
    let s = gpu.stats();
    assert_eq!((s.ubatches, s.host_round_trips), (2, 2), "one host layer");
    assert_eq!(gpu.device().round_trips(), 2);
    let d = params.n_embd as u64;
    let k = params.n_expert_used as u64;
    assert_eq!(s.bytes_to_host, 4 * 6 * (d + 2 * k));
    assert_eq!(s.bytes_to_device, 4 * 6 * d);
}
