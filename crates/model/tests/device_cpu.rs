//! The CPU as a device of the contract (`hmoe_cpu::Cpu`): `DeviceModel<Cpu>`, every layer's
//! experts on the host path, gives the CPU engine's logits bit for bit on every MoE fixture
//! architecture (gpt-oss, Qwen3-MoE, DeepSeek-V2/V3), every prompt position over several
//! micro-batches and then greedy decode steps, for f32, f16 and (where heads are whole blocks)
//! q8_0 K/V, with `-fa auto` and `-fa on`; several sequences batched in one `forward_multi`
//! get what each gets alone; DeepSeek's latent cache in q8_0, q4_0, q5_1, f32 and bf16
//! is the CPU engine's too. The real dense files are covered with the device as a parameter
//! in `device_dense.rs`; the REF0 files of the MoE architectures also put experts on the
//! device and count transfers, which the CPU does neither of.

mod common;

use common::fixtures;
use hmoe_cpu::Cpu;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::kv_cache::{CacheType, FlashAttn};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted, SeqBatch,
};
use hmoe_synth::{deepseek2_writer, Deepseek2Spec};

const N_CTX: usize = 64;
const UBATCH: usize = 8;

fn open(dir: &str, file: &str) -> GgufModel {
    GgufModel::open(fixtures().join(dir).join(file), LoadOptions::default()).unwrap()
}

/// `DeviceModel<Cpu>` of the file, its routed experts on the host path.
fn cpu_device(dir: &str, file: &str) -> DeviceModel<Cpu> {
    cpu_device_of(open(dir, file))
}

/// `DeviceModel<Cpu>` of `g`, its routed experts on the host path.
fn cpu_device_of(g: GgufModel) -> DeviceModel<Cpu> {
    let arch = g.metadata().architecture().unwrap().to_string();
    let n_layer = g
        .metadata()
        .get_u32(&format!("{arch}.block_count"))
        .unwrap() as usize;
    let placement = ExpertPlacement::all(n_layer, ExpertHome::Host).with_op_offload(None);
    DeviceModel::load(g, Cpu::new(), &placement).unwrap()
}

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

/// The fixtures and the K/V types their heads allow.
fn cases() -> Vec<(&'static str, &'static str, Vec<CacheType>)> {
    use CacheType::*;
    vec![
        ("gpt-oss", "gptoss-small.gguf", vec![F32, F16, Q8_0]),
        ("gpt-oss", "gptoss-openai.gguf", vec![F16, Q8_0]),
        ("gpt-oss", "gptoss-openai-f32experts.gguf", vec![F16]),
        // Heads of 16 are not whole Q8_0 blocks.
        ("qwen3moe", "qwen3moe-tiny.gguf", vec![F32, F16, BF16]),
        // The latent cache is f16.
        ("deepseek2", "deepseek2-tiny.gguf", vec![F16]),
    ]
}

#[test]
fn cpu_device_is_the_cpu_engine_bit_for_bit() {
    for (dir, file, types) in cases() {
        let cpu = hmoe_model::load(open(dir, file)).unwrap();
        let dev = cpu_device(dir, file);
        // `-fa auto` (the row kernel over float values) and `-fa on` (the chunked flash
        // kernel; block-quantized values take flash attention either way).
        for ty in types {
            for fa in [FlashAttn::Auto, FlashAttn::On] {
                let kv = KvType::new(ty, ty, fa).unwrap();
                let want = run(cpu.as_ref(), kv);
                let got = run(&dev, kv);
                assert_eq!(got.len(), want.len());
                for (s, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        bits(g) == bits(w),
                        "{file} K/V {ty} {fa:?}: feed {s} differs"
                    );
                }
            }
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

/// DeepSeek's latent (K-only) cache in every `-ctk` type the CPU engine keeps it in, on a
/// synthetic file with latent rows of 64 + 64 values (whole blocks of every type, a multiple
/// of 64 that neither the CPU engine nor the device rotates).
#[test]
fn cpu_device_latent_cache_types_are_the_cpu_engines_bit_for_bit() {
    let spec = Deepseek2Spec {
        n_layer: 3,
        qk_rope_dim: 64,
        n_vocab: 300,
        ..Deepseek2Spec::tiny()
    };
    let path = std::env::temp_dir().join(format!(
        "hmoe-device-cpu-latent-{}.gguf",
        std::process::id()
    ));
    deepseek2_writer(&spec).unwrap().write(&path).unwrap();
    let open = || GgufModel::open(&path, LoadOptions::default()).unwrap();
    let cpu = hmoe_model::load(open()).unwrap();
    let dev = cpu_device_of(open());
    use CacheType::*;
    for ty in [Q8_0, Q4_0, Q5_1, F32, BF16] {
        // `-ctv` is not used by a K-only cache.
        let kv = KvType::new(ty, F16, FlashAttn::Auto).unwrap();
        assert_same(
            &run(&dev, kv),
            &run(cpu.as_ref(), kv),
            &format!("latent {ty}"),
        );
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn cpu_device_batched_sequences_equal_each_alone() {
    for (dir, file, _) in cases() {
        let dev = cpu_device(dir, file);
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
            assert!(bits(t) == bits(a), "{file}: sequence {i} differs batched");
        }
    }
}
