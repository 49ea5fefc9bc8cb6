//! `make-test-model --routing-locality`: on a file written with it, the device expert cache
//! hits clearly more often than on the same model with random routers (which route nearly
//! uniformly, so an LRU of a quarter of the experts hits about a quarter of the time). Both
//! are measured with a short run on the reference device (every layer's experts on the host,
//! the cache holding 8 of 32 experts per layer, tokens fed one at a time as in decoding).

use hmoe_backend::Ref0;
use hmoe_gguf::GgufModel;
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted, MoeCacheStats,
};
use hmoe_synth::{gpt_oss_writer, GptOssSpec};

const N_TOKENS: usize = 96;

fn spec(locality: Option<f32>) -> GptOssSpec {
    GptOssSpec {
        n_layer: 2,
        n_embd: 128,
        n_head: 4,
        n_head_kv: 2,
        n_ff_exp: 128,
        n_expert: 32,
        n_expert_used: 4,
        routing_locality: locality,
        ..GptOssSpec::tiny()
    }
}

/// The cache's counts after feeding `N_TOKENS` pseudo-random tokens one at a time.
fn run(locality: Option<f32>) -> MoeCacheStats {
    let s = spec(locality);
    let bytes = gpt_oss_writer(&s).unwrap().to_bytes().unwrap();
    let placement = ExpertPlacement {
        layers: vec![ExpertHome::Host; s.n_layer],
        op_offload_min_batch: None,
    };
    let dev = DeviceModel::load(
        GgufModel::from_bytes(bytes).unwrap(),
        Ref0::new(),
        &placement,
    )
    .unwrap();
    // One expert: three MXFP4 matrices of n_ff × n_embd and f32 biases.
    let expert = (3 * 128 * 128 / 32 * 17 + 4 * (2 * 128 + 128)) as u64;
    let cap = dev
        .set_moe_cache(8 * expert * s.n_layer as u64)
        .unwrap()
        .capacity;
    assert_eq!(cap, 8 * s.n_layer as u64);
    let mut cache = dev.new_cache(KvType::F16, 256, 1);
    let mut x = 12345u32;
    for _ in 0..N_TOKENS {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let tok = (x >> 8) % s.n_vocab as u32;
        let logits = dev.forward(&mut cache, &[tok], LogitsWanted::Last).unwrap();
        assert!(logits.iter().all(|v| v.is_finite()));
    }
    dev.moe_cache_stats()
}

#[test]
fn locality_routing_makes_the_expert_cache_hit_more() {
    let random = run(None);
    let local = run(Some(0.9));
    let pairs = (N_TOKENS * 4 * 2) as u64;
    assert_eq!(random.hits + random.misses, pairs);
    assert_eq!(local.hits + local.misses, pairs);
    eprintln!(
        "hit rate with 8 of 32 experts per layer cached: random routers {:.1}%, \
         --routing-locality 0.9 {:.1}%",
        100.0 * random.hit_rate(),
        100.0 * local.hit_rate()
    );
    assert!(
        local.hit_rate() > random.hit_rate() + 0.2,
        "locality {:.3} vs random {:.3}",
        local.hit_rate(),
        random.hit_rate()
    );
}

#[test]
fn locality_must_be_a_fraction_of_whole_halves() {
    assert!(spec(Some(1.5)).validate().is_err());
    assert!(spec(Some(-0.1)).validate().is_err());
    let odd = GptOssSpec {
        n_embd: 96,
        ..spec(Some(0.5))
    };
    assert!(odd.validate().unwrap_err().contains("multiple of 64"));
    assert!(spec(Some(0.0)).validate().is_ok());
}
