//! The CPU as a device of the contract (`hmoe_cpu::Cpu`): `DeviceModel<Cpu>`, every layer's
//! experts on the host path, gives the CPU engine's logits bit for bit on every MoE fixture
//! architecture (gpt-oss, Qwen3-MoE, DeepSeek-V2/V3), every prompt position over several
//! micro-batches and then greedy decode steps, for f32, f16 and (where heads are whole blocks)
//! q8_0 K/V, with `-fa auto` and `-fa on`; several sequences batched in one `forward_multi`
//! get what each gets alone. The real dense files are covered with the device as a parameter
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

const N_CTX: usize = 64;
const UBATCH: usize = 8;

fn open(dir: &str, file: &str) -> GgufModel {
    GgufModel::open(fixtures().join(dir).join(file), LoadOptions::default()).unwrap()
}

/// `DeviceModel<Cpu>` of the file, its routed experts on the host path.
fn cpu_device(dir: &str, file: &str) -> DeviceModel<Cpu> {
    let g = open(dir, file);
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
