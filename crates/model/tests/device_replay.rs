//! Recorded segments of decode steps (what CUDA captures into graphs) replayed on REF0: with
//! REF0's replay mode, each decode step's segments are recorded once and replayed from then on
//! with the recording's by-value arguments and buffers, as a graph would run them
//! (`hmoe_backend::Ref0::with_replay`). The logits must stay a fresh run's bit for bit for
//! every decode step, on the gpt-oss, Qwen3-MoE and DeepSeek-V3 fixtures, with `-fa` on and
//! off, every expert on the device (one segment per step), on the host (`--cpu-moe`: a
//! segment between each two host layers' round trips) and the first layer's on the host
//! (`--n-cpu-moe 1`): a position or length that reached an op by value would be frozen at the
//! recording's and change them (the backend's `ref0_replay_tests.rs` shows it does).

mod common;

use common::{argmax, bits, open_fixture as open};
use hmoe_backend::{CacheType, FlashAttn, Ref0};
use hmoe_model::{DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted};

const UBATCH: usize = 8;
const N_CTX: usize = 64;
/// Decode steps: the first allocates its buffers, the second records, the others replay.
const N_DECODE: usize = 6;

const MODELS: [&str; 3] = [
    "gpt-oss/gptoss-tiny.gguf",
    "qwen3moe/qwen3moe-tiny.gguf",
    "deepseek2/deepseek2-tiny.gguf",
];

/// A prompt of 11 tokens (two micro-batches), then greedy decode steps: each feed's logits.
fn run(model: &dyn LanguageModel, ty: KvType) -> Vec<Vec<f32>> {
    let prompt: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % 500).collect();
    let mut cache = model.new_cache(ty, N_CTX, UBATCH);
    let mut out = vec![model
        .forward(&mut cache, &prompt, LogitsWanted::Last)
        .unwrap()];
    for _ in 0..N_DECODE {
        let next = argmax(out.last().unwrap());
        out.push(
            model
                .forward(&mut cache, &[next], LogitsWanted::Last)
                .unwrap(),
        );
    }
    out
}

#[test]
fn replayed_decode_steps_are_fresh_runs_bit_for_bit() {
    for file in MODELS {
        let n_layer = {
            let g = open(file);
            let arch = g.metadata().architecture().unwrap().to_string();
            (g.metadata().get_u32(&format!("{arch}.block_count"))).unwrap() as usize
        };
        let mut first_on_host = vec![ExpertHome::Device; n_layer];
        first_on_host[0] = ExpertHome::Host;
        let placements = [
            ("all on device", vec![ExpertHome::Device; n_layer]),
            ("--cpu-moe", vec![ExpertHome::Host; n_layer]),
            ("--n-cpu-moe 1", first_on_host),
        ];
        for (what, layers) in placements {
            let placement = ExpertPlacement {
                layers,
                op_offload_min_batch: None,
            };
            for fa in [FlashAttn::Off, FlashAttn::On] {
                let ty = KvType::new(CacheType::F16, CacheType::F16, fa).unwrap();
                let case = format!("{file} {what} -fa {fa:?}");
                let fresh = DeviceModel::load(open(file), Ref0::new(), &placement).unwrap();
                let want = run(&fresh, ty);
                let replay =
                    DeviceModel::load(open(file), Ref0::new().with_replay(), &placement).unwrap();
                let got = run(&replay, ty);
                for (s, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        bits(g) == bits(w),
                        "{case}: feed {s} differs from a fresh run"
                    );
                }
                let st = replay.device().replay_stats();
                assert_eq!((st.errors, st.stale_scalars), (0, 0), "{case}: {st:?}");
                // One recording step, and every later step replays each of its segments.
                assert!(st.recorded > 0 && st.replayed_ops > 0, "{case}: {st:?}");
                assert_eq!(
                    st.replayed,
                    st.recorded * (N_DECODE as u64 - 2),
                    "{case}: {st:?}"
                );
                let host_layers = replay.stats().host_round_trips > 0;
                assert_eq!(st.recorded > 1, host_layers, "{case}: {st:?}");
            }
        }
    }
}
