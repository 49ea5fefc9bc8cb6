//! Op offload in slices on the reference device: the routed experts of host layers stream
//! through the op-offload ring, a few experts a slice, for micro-batches that route to every
//! expert. Whatever the ring's size the logits are the CPU's bit for bit (Q8_0 experts, and
//! Q4_K/Q6_K experts whose products' order depends on the rows an expert gets, one sequence
//! and two batched); the slices uploaded are those planned; the ring never holds more than its
//! size; and a REF0 budget that the whole layer at once would overrun holds the ring.

mod common;

use std::path::PathBuf;

use hmoe_backend::{Backend, BackendError, Ref0};
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::kv_cache::{CacheType, FlashAttn};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted, ModelError,
    SeqBatch,
};
use hmoe_placement::{ring_bytes, ring_max_slice};
use hmoe_quant::GgmlType;
use hmoe_synth::{qwen3moe_writer, Qwen3MoeSpec};

const UBATCH: usize = 16;
const N_CTX: usize = 64;
const N_LAYER: usize = 2;

/// Q8_0 experts (8 of them), or Q4_K gate/up with Q6_K down (4 of them, 256 wide); 3 a
/// token (three slot outputs: their sum's order shows).
fn spec(kquant: bool) -> Qwen3MoeSpec {
    let base = Qwen3MoeSpec {
        n_layer: N_LAYER,
        n_embd: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 32,
        n_expert: 8,
        n_expert_used: 3,
        n_ff_exp: 64,
        n_vocab: 300,
        expert_type: GgmlType::Q8_0,
        down_expert_type: None,
        seed: 11,
    };
    match kquant {
        false => base,
        true => Qwen3MoeSpec {
            n_embd: 256,
            n_expert: 4,
            n_ff_exp: 256,
            expert_type: GgmlType::Q4_K,
            down_expert_type: Some(GgmlType::Q6_K),
            ..base
        },
    }
}

fn open(kquant: bool) -> GgufModel {
    static PATHS: [std::sync::OnceLock<PathBuf>; 2] =
        [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    let path = PATHS[kquant as usize].get_or_init(|| {
        let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("hmoe-offload-ring-{kquant}.gguf"));
        // Written under a name of this process, then renamed: one file however many runs.
        let part = p.with_extension(format!("{}.part", std::process::id()));
        qwen3moe_writer(&spec(kquant))
            .unwrap()
            .write(&part)
            .unwrap();
        std::fs::rename(&part, &p).unwrap();
        p
    });
    GgufModel::open(path, LoadOptions::default()).unwrap()
}

fn kv() -> KvType {
    KvType::new(CacheType::F16, CacheType::F16, FlashAttn::On).unwrap()
}

/// A prompt of 36 tokens (micro-batches of 16, 16 and 4: the first two route to every expert)
/// with every position's logits, then 2 greedy steps.
fn run(model: &dyn LanguageModel, seed: usize) -> Result<Vec<Vec<f32>>, ModelError> {
    let n_vocab = model.n_vocab();
    let prompt: Vec<u32> = (0..36)
        .map(|i| ((i * 37 + seed * 101 + 5) % n_vocab) as u32)
        .collect();
    let mut cache = model.new_cache(kv(), N_CTX, UBATCH);
    let mut out = vec![model.forward(&mut cache, &prompt, LogitsWanted::All)?];
    for _ in 0..2 {
        let last = out.last().unwrap();
        let l = &last[last.len() - n_vocab..];
        let next = (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32;
        out.push(model.forward(&mut cache, &[next], LogitsWanted::Last)?);
    }
    Ok(out)
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

fn host_offload() -> ExpertPlacement {
    ExpertPlacement {
        layers: vec![ExpertHome::Host; N_LAYER],
        op_offload_min_batch: Some(4),
    }
}

/// Bytes of one expert of the model (gate, up and down).
fn expert_bytes(kquant: bool) -> u64 {
    let s = spec(kquant);
    let row = |ty: GgmlType, n: usize| ty.row_bytes(n as u64).unwrap();
    let down = s.down_expert_type.unwrap_or(s.expert_type);
    2 * s.n_ff_exp as u64 * row(s.expert_type, s.n_embd) + s.n_embd as u64 * row(down, s.n_ff_exp)
}

#[test]
fn every_ring_size_gives_the_cpus_bits_and_the_planned_slices() {
    for kquant in [false, true] {
        let n_expert = spec(kquant).n_expert as u64;
        let eb = expert_bytes(kquant);
        let want = bits(&run(hmoe_model::load(open(kquant)).unwrap().as_ref(), 0).unwrap());
        let sizes: Vec<Option<u64>> = (1..=ring_max_slice(n_expert))
            .map(|s| Some(ring_bytes(s, n_expert, eb)))
            .chain([None])
            .collect();
        for ring in sizes {
            let what = format!("kquant {kquant}, ring {ring:?}");
            let slice = ring.map_or(ring_max_slice(n_expert), |r| r / (2 * eb));
            let dev = DeviceModel::load(open(kquant), Ref0::new(), &host_offload()).unwrap();
            dev.set_op_offload_ring(ring);
            let got = bits(&run(&dev, 0).unwrap());
            assert!(got == want, "{what}: not the CPU's bits");
            let s = dev.stats();
            // Two micro-batches upload every expert of both layers, slice by slice; the
            // first slice of layer 1 goes up while layer 0 runs.
            let per_layer = n_expert.div_ceil(slice);
            assert_eq!(s.offloaded_layers, 3 * N_LAYER as u64, "{what}");
            let last: u64 = s.offloaded_experts - 2 * N_LAYER as u64 * n_expert;
            assert!(last <= N_LAYER as u64 * n_expert, "{what}");
            assert_eq!(s.prefetched_layers, 2, "{what}");
            let planned = ring_bytes(slice, n_expert, eb);
            assert!(s.ring_peak_bytes <= planned, "{what}: {s:?}");
            assert!(s.ring_peak_bytes > 0);
            if let Some(r) = ring {
                assert!(planned <= r, "{what}");
            }
            // The third micro-batch (4 tokens) uploads what it routes to; the first two every
            // expert, `per_layer` slices a layer.
            assert!(
                s.offload_slices >= 2 * N_LAYER as u64 * per_layer,
                "{what}: {s:?}"
            );
            assert!(
                s.offload_slices <= 2 * N_LAYER as u64 * per_layer + N_LAYER as u64 * per_layer,
                "{what}: {s:?}"
            );
            assert_eq!(s.offload_bytes, s.offloaded_experts * eb, "{what}");
            // Every byte uploaded for the experts crossed the bus as counted.
            let t = s.transfers.unwrap();
            assert!(
                t.upload_bytes >= dev.weight_bytes() + s.offload_bytes,
                "{what}"
            );
        }
    }
}

/// Two sequences in one micro-batch each get what they get alone on the CPU, the
/// K-quant experts' pairs run per sequence through the ring. The last layer multiplies only
/// the two rows whose logits are wanted, fewer than op offload's 4, so its experts stay on
/// the host (one round trip), as llama.cpp decides per op, and nothing is prefetched for it.
#[test]
fn batched_sequences_through_the_ring_are_the_cpus() {
    let kquant = true;
    let cpu = hmoe_model::load(open(kquant)).unwrap();
    let n_vocab = cpu.n_vocab();
    let prompt = |seed: usize| -> Vec<u32> {
        (0..12)
            .map(|i| ((i * 37 + seed * 101 + 5) % n_vocab) as u32)
            .collect()
    };
    let want: Vec<Vec<u32>> = (0..2)
        .map(|s| {
            let mut c = cpu.new_cache(kv(), N_CTX, 32);
            let l = cpu.forward(&mut c, &prompt(s), LogitsWanted::Last).unwrap();
            l.iter().map(|x| x.to_bits()).collect()
        })
        .collect();
    let dev = DeviceModel::load(open(kquant), Ref0::new(), &host_offload()).unwrap();
    dev.set_op_offload_ring(Some(ring_bytes(1, 4, expert_bytes(kquant))));
    let (p0, p1) = (prompt(0), prompt(1));
    let mut c0 = dev.new_cache(kv(), N_CTX, 32);
    let mut c1 = dev.new_cache(kv(), N_CTX, 32);
    let mut seqs = [
        SeqBatch {
            cache: &mut c0,
            tokens: &p0,
            logits: true,
        },
        SeqBatch {
            cache: &mut c1,
            tokens: &p1,
            logits: true,
        },
    ];
    let got = dev.forward_multi(&mut seqs).unwrap();
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        let g: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
        assert!(&g == w, "sequence {s} differs from the CPU");
    }
    let s = dev.stats();
    assert_eq!(s.offloaded_layers, N_LAYER as u64 - 1, "{s:?}");
    assert_eq!(s.offload_slices, (N_LAYER as u64 - 1) * 4, "{s:?}");
    assert_eq!(s.host_round_trips, 1, "{s:?}");
    assert_eq!(s.prefetched_layers, 0, "{s:?}");
}

/// REF0's budget enforces the ring: the peak of a prompt with a ring of one expert a slice is
/// a budget that the same prompt overruns with the largest ring (two half layers).
#[test]
fn a_budget_that_the_whole_layer_overruns_holds_the_ring() {
    let kquant = false;
    let (n_expert, eb) = (spec(kquant).n_expert as u64, expert_bytes(kquant));
    let small = Some(ring_bytes(1, n_expert, eb));
    let probe = DeviceModel::load(open(kquant), Ref0::new(), &host_offload()).unwrap();
    probe.set_op_offload_ring(small);
    let want = bits(&run(&probe, 0).unwrap());
    let peak = probe.device().peak_bytes();
    let fits = DeviceModel::load(open(kquant), Ref0::with_budget(peak), &host_offload()).unwrap();
    fits.set_op_offload_ring(small);
    assert!(bits(&run(&fits, 0).unwrap()) == want);
    assert!(fits.device().peak_bytes() <= peak);
    let over = DeviceModel::load(open(kquant), Ref0::with_budget(peak), &host_offload()).unwrap();
    over.set_op_offload_ring(None);
    match run(&over, 0) {
        Err(ModelError::Device(BackendError::OutOfMemory { .. })) => {}
        other => panic!(
            "the largest ring fit in the small ring's peak: {:?}",
            other.is_ok()
        ),
    }
    assert!(over.device().free_memory().unwrap().is_some());
}

/// The gpt-oss fixtures (MXFP4 experts, and F32 experts whose products' order depends on the
/// rows an expert gets; clamped SwiGLU, biases, 4 slots a token) through the smallest ring,
/// one expert a slice: the CPU's bits.
#[test]
fn gpt_oss_fixtures_through_the_smallest_ring_are_the_cpus() {
    for file in ["gptoss-small.gguf", "gptoss-openai-f32experts.gguf"] {
        let path = common::fixtures().join("gpt-oss").join(file);
        let open = || GgufModel::open(&path, LoadOptions::default()).unwrap();
        let want = bits(&run(hmoe_model::load(open()).unwrap().as_ref(), 0).unwrap());
        let n_layer = hmoe_model::model_shape(&open()).unwrap().n_layer as usize;
        let placement = ExpertPlacement {
            layers: vec![ExpertHome::Host; n_layer],
            op_offload_min_batch: Some(4),
        };
        let dev = DeviceModel::load(open(), Ref0::new(), &placement).unwrap();
        dev.set_op_offload_ring(Some(0));
        let got = bits(&run(&dev, 0).unwrap());
        assert!(got == want, "{file}: not the CPU's bits");
        let s = dev.stats();
        assert_eq!(s.offloaded_layers, 3 * n_layer as u64, "{file}");
        assert_eq!(
            s.offload_slices, s.offloaded_experts,
            "{file}: one expert a slice"
        );
        assert!(s.offload_slices > s.offloaded_layers, "{file}: {s:?}");
    }
}
