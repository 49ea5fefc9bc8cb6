//! The synthetic Qwen3-MoE and DeepSeek files load in hmoe-model and produce sane logits.

use hmoe_gguf::GgufModel;
use hmoe_model::{KvType, LanguageModel, LogitsWanted};
use hmoe_quant::GgmlType;
use hmoe_synth::{deepseek2_writer, qwen3moe_writer, Deepseek2Spec, Qwen3MoeSpec};

const TOKENS: [u32; 7] = [72, 101, 108, 108, 111, 44, 32];

/// Runs the prompt in one batch and token by token; checks the logits are finite, spread out,
/// and the same both ways (up to f32 summation-order noise).
fn check(model: Box<dyn LanguageModel>, what: &str) {
    let n_vocab = model.n_vocab();
    let mut cache = model.new_cache(KvType::F32, 64, 64);
    let batch = model
        .forward(&mut cache, &TOKENS, LogitsWanted::All)
        .unwrap();
    assert_eq!(batch.len(), TOKENS.len() * n_vocab);
    assert!(
        batch.iter().all(|v| v.is_finite()),
        "{what}: non-finite logits"
    );
    let last = &batch[(TOKENS.len() - 1) * n_vocab..];
    let mean = last.iter().sum::<f32>() / n_vocab as f32;
    let std = (last.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n_vocab as f32).sqrt();
    assert!(std > 0.1 && std < 100.0, "{what}: logit std {std}");
    let mut cache = model.new_cache(KvType::F32, 64, 64);
    let mut single = Vec::new();
    for &t in &TOKENS {
        single = model.forward(&mut cache, &[t], LogitsWanted::Last).unwrap();
    }
    let diff = single
        .iter()
        .zip(last)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(diff < 0.05 * std.max(1.0), "{what}: batch vs single {diff}");
}

fn load(bytes: Vec<u8>) -> Box<dyn LanguageModel> {
    hmoe_model::load(GgufModel::from_bytes(bytes).unwrap()).unwrap()
}

#[test]
fn qwen3moe_synthetic_models_run() {
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K] {
        let spec = Qwen3MoeSpec {
            n_layer: 2,
            expert_type: ty,
            ..Qwen3MoeSpec::tiny()
        };
        let model = load(qwen3moe_writer(&spec).unwrap().to_bytes().unwrap());
        assert_eq!(model.n_vocab(), spec.n_vocab);
        check(model, &format!("qwen3moe {ty}"));
    }
}

#[test]
fn deepseek2_synthetic_models_run() {
    let plain_q = Deepseek2Spec {
        q_lora_rank: 0,
        n_expert_shared: 0,
        n_group: 1,
        n_group_used: 1,
        ..Deepseek2Spec::tiny()
    };
    for (spec, what) in [
        (Deepseek2Spec::tiny(), "deepseek2 q8_0"),
        (
            Deepseek2Spec {
                expert_type: GgmlType::Q4_K,
                n_ff_exp: 256,
                ..Deepseek2Spec::tiny()
            },
            "deepseek2 q4_k",
        ),
        (plain_q, "deepseek2 without q_lora, groups, shared experts"),
    ] {
        let model = load(deepseek2_writer(&spec).unwrap().to_bytes().unwrap());
        check(model, what);
    }
}
