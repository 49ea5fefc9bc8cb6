//! The CPU as a device of the contract (`hmoe_cpu::Cpu`, what `hmoe_model::load` runs every
//! model on): every layer's experts on the host path (the round trip through the staging
//! buffers and `run_host_experts`) gives the logits of every layer's experts on the device
//! (the `moe` op over the file mapping) bit for bit, on every MoE fixture architecture
//! (gpt-oss with MXFP4/Q8_0/F32 experts, Qwen3-MoE, DeepSeek-V2/V3) and on synthetic Qwen3-MoE
//! and DeepSeek files with Q4_K experts and Q6_K down matrices, every prompt position over
//! several micro-batches and then greedy decode steps, for f32, f16 and (where heads are whole
//! blocks) q8_0 K/V, with `-fa auto` and `-fa on`; several sequences batched in one
//! `forward_multi` get what each gets alone; DeepSeek's latent cache in q8_0, q4_0, q5_1, f32
//! and bf16 too. REF0 is compared with the CPU in the `device_*` files of each architecture.

mod common;

use std::path::PathBuf;
use std::sync::Mutex;

use common::fixtures;
use hmoe_cpu::Cpu;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::kv_cache::{CacheType, FlashAttn};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted, SeqBatch,
};
use hmoe_quant::GgmlType;
use hmoe_synth::{deepseek2_writer, qwen3moe_writer, Deepseek2Spec, Qwen3MoeSpec};

const N_CTX: usize = 64;
const UBATCH: usize = 16;

/// `DeviceModel<Cpu>` of `g`, its routed experts on `home`.
fn cpu_device_of(g: GgufModel, home: ExpertHome) -> DeviceModel<Cpu> {
    let arch = g.metadata().architecture().unwrap().to_string();
    let n_layer = g
        .metadata()
        .get_u32(&format!("{arch}.block_count"))
        .unwrap() as usize;
    let placement = ExpertPlacement::all(n_layer, home).with_op_offload(None);
    DeviceModel::load(g, Cpu::new(), &placement).unwrap()
}

/// Where the experts of every test model go.
const HOMES: [ExpertHome; 2] = [ExpertHome::Host, ExpertHome::Device];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32
}

/// A 20-token prompt (every position's logits), then three greedy decode steps.
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

/// Writes a synthetic model once per test binary (named after `stem`) and returns its path.
fn synth(stem: &'static str) -> PathBuf {
    static PATHS: Mutex<Vec<(&str, PathBuf)>> = Mutex::new(Vec::new());
    let mut paths = PATHS.lock().unwrap();
    if let Some((_, p)) = paths.iter().find(|(s, _)| *s == stem) {
        return p.clone();
    }
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("hmoe-{stem}.gguf"));
    // Written under a name of this process, then renamed: one file per stem however many runs.
    let part = path.with_extension(format!("{}.part", std::process::id()));
    match stem {
        // Q4_K gate/up and Q6_K down experts (as in Q4_K_M files), 4 experts of which 2 are
        // used: some expert gets 8 rows of a 16-token micro-batch (the tiled K-quant order).
        "device-cpu-qwen3moe-kquant" => qwen3moe_writer(&Qwen3MoeSpec {
            n_layer: 2,
            n_embd: 256,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 32,
            n_expert: 4,
            n_expert_used: 2,
            n_ff_exp: 256,
            n_vocab: 300,
            expert_type: GgmlType::Q4_K,
            down_expert_type: Some(GgmlType::Q6_K),
            seed: 7,
        }),
        "device-cpu-deepseek2-kquant" => deepseek2_writer(&Deepseek2Spec {
            n_layer: 3,
            n_expert: 4,
            n_expert_used: 2,
            n_group: 1,
            n_group_used: 1,
            n_ff_exp: 256,
            n_vocab: 300,
            expert_type: GgmlType::Q4_K,
            down_expert_type: Some(GgmlType::Q6_K),
            ..Deepseek2Spec::tiny()
        }),
        // Latent rows of 64 + 64 values: whole blocks of every K/V type.
        "device-cpu-deepseek2-latent" => deepseek2_writer(&Deepseek2Spec {
            n_layer: 3,
            qk_rope_dim: 64,
            n_vocab: 300,
            ..Deepseek2Spec::tiny()
        }),
        other => panic!("no synthetic model {other}"),
    }
    .unwrap()
    .write(&part)
    .unwrap();
    std::fs::rename(&part, &path).unwrap();
    paths.push((stem, path.clone()));
    path
}

fn open_path(path: &PathBuf) -> GgufModel {
    GgufModel::open(path, LoadOptions::default()).unwrap()
}

/// The models and the K/V types their heads allow.
fn cases() -> Vec<(PathBuf, Vec<CacheType>)> {
    use CacheType::*;
    let f = |dir: &str, file: &str| fixtures().join(dir).join(file);
    vec![
        (f("gpt-oss", "gptoss-small.gguf"), vec![F32, F16, Q8_0]),
        (f("gpt-oss", "gptoss-openai.gguf"), vec![F16, Q8_0]),
        (f("gpt-oss", "gptoss-openai-f32experts.gguf"), vec![F16]),
        // Heads of 16 are not whole Q8_0 blocks.
        (f("qwen3moe", "qwen3moe-tiny.gguf"), vec![F32, F16, BF16]),
        // The latent cache is f16.
        (f("deepseek2", "deepseek2-tiny.gguf"), vec![F16]),
        (synth("device-cpu-qwen3moe-kquant"), vec![F16, Q8_0]),
        (synth("device-cpu-deepseek2-kquant"), vec![F16]),
    ]
}

#[test]
fn cpu_host_experts_are_the_device_experts_bit_for_bit() {
    for (path, types) in cases() {
        let cpu = hmoe_model::load(open_path(&path)).unwrap();
        let file = path.file_name().unwrap().to_string_lossy();
        for home in HOMES {
            let dev = cpu_device_of(open_path(&path), home);
            // `-fa off` (the row kernel) and `-fa on` (the chunked flash kernel over float
            // values; block-quantized values, which need flash attention, take ggml's).
            for &ty in &types {
                let fas: &[FlashAttn] = if ty.is_quantized() {
                    &[FlashAttn::On]
                } else {
                    &[FlashAttn::Off, FlashAttn::On]
                };
                for &fa in fas {
                    let kv = KvType::new(ty, ty, fa).unwrap();
                    let what = format!("{file} experts on {home:?}, K/V {ty} {fa:?}");
                    assert_same(&run(&dev, kv), &run(cpu.as_ref(), kv), &what);
                }
            }
            // Experts on the device: no round trip to the host path.
            let trips = dev.stats().host_round_trips;
            assert_eq!(
                trips == 0,
                home == ExpertHome::Device,
                "{file}: {trips} round trips"
            );
        }
    }
}

/// Asserts that `got` and `want` (feeds of [`run`]) are the same bits.
fn assert_same(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len());
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(bits(g) == bits(w), "{what}: feed {s} differs");
    }
}

/// DeepSeek's latent (K-only) cache in every `-ctk` type the CPU keeps it in, on a
/// synthetic file with latent rows of 64 + 64 values (whole blocks of every type, a multiple
/// of 64 that neither the CPU nor the device rotates).
#[test]
fn cpu_device_latent_cache_types_are_the_cpu_devices_bit_for_bit() {
    let path = synth("device-cpu-deepseek2-latent");
    let cpu = hmoe_model::load(open_path(&path)).unwrap();
    use CacheType::*;
    for ty in [Q8_0, Q4_0, Q5_1, F32, BF16] {
        // `-ctv` is not used by a K-only cache.
        let kv = KvType::new(ty, F16, FlashAttn::Auto).unwrap();
        let want = run(cpu.as_ref(), kv);
        for home in HOMES {
            let dev = cpu_device_of(open_path(&path), home);
            let what = format!("latent {ty}, experts on {home:?}");
            assert_same(&run(&dev, kv), &want, &what);
        }
    }
}

#[test]
fn cpu_device_batched_sequences_equal_each_alone() {
    for ((path, _), home) in cases()
        .into_iter()
        .flat_map(|c| HOMES.map(|h| (c.clone(), h)))
    {
        let file = path.file_name().unwrap().to_string_lossy();
        let dev = cpu_device_of(open_path(&path), home);
        let ty = KvType::new(CacheType::F16, CacheType::F16, FlashAttn::Auto).unwrap();
        let n_vocab = dev.n_vocab() as u32;
        let prompts: [Vec<u32>; 3] = [
            vec![5, 200 % n_vocab, 31],
            (0..11).map(|i| (i * 23 + 2) % n_vocab).collect(),
            vec![17],
        ];
        let alone: Vec<Vec<f32>> = prompts
            .iter()
            .map(|p| {
                let mut c = dev.new_cache(ty, N_CTX, 16);
                dev.forward(&mut c, p, LogitsWanted::Last).unwrap()
            })
            .collect();
        let mut caches: Vec<_> = (0..3).map(|_| dev.new_cache(ty, N_CTX, 16)).collect();
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
        for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
            assert!(
                bits(t) == bits(a),
                "{file} experts on {home:?}: sequence {i} differs batched"
            );
        }
    }
}
