//! Teacher-forced comparison of the DeepSeek-V3 (MLA) forward pass with llama.cpp's goldens and
//! transformers' logits (../shared/fixtures/deepseek2; tolerances from its README). The model
//! runs with its K-only latent cache, as llama.cpp does.

mod common;

use common::{check_golden, check_reference};
use hmoe_model::{KvType, LanguageModel, LogitsWanted};

const DIR: &str = "deepseek2";
const MODEL: &str = "deepseek2-tiny";

#[test]
fn tiny_matches_llama_cpp_f32_kv() {
    check_golden(
        DIR,
        MODEL,
        &format!("{MODEL}.golden.json"),
        KvType::F32,
        2e-3,
        1e-3,
    );
}

#[test]
fn tiny_matches_llama_cpp_f16_kv() {
    let golden = format!("{MODEL}.golden-f16kv.json");
    check_golden(DIR, MODEL, &golden, KvType::F16, 2e-3, 0.005);
}

/// Every prompt position's logits within 1e-3 (+1e-4 relative) of transformers' float32 logits.
#[test]
fn tiny_logits_match_transformers() {
    check_reference(DIR, MODEL);
}

/// The cache is K-only (the latent rows), as REF0 counts its bytes: 3 layers × 512
/// positions × (kv_lora 16 + rope 8) f16 values.
#[test]
fn tiny_uses_k_only_latent_cache() {
    let path = common::fixtures().join(DIR).join(format!("{MODEL}.gguf"));
    let g = || hmoe_gguf::GgufModel::open(&path, Default::default()).unwrap();
    let placement = hmoe_model::ExpertPlacement::all(3, hmoe_model::ExpertHome::Device);
    let model = hmoe_model::DeviceModel::load(g(), hmoe_backend::Ref0::new(), &placement).unwrap();
    let mut cache = model.new_cache(KvType::F16, 512, 512);
    assert!(cache.is_k_only());
    model
        .forward(&mut cache, &[1, 2], LogitsWanted::Last)
        .unwrap();
    assert_eq!(model.device_memory().unwrap().kv_bytes, 3 * 512 * 24 * 2);
}
