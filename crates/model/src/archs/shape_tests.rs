//! The planner's shape read from metadata keys: each architecture's keys, the MLA cache of
//! DeepSeek, and the errors of a missing key, architecture or embedding.

use hmoe_gguf::{GgufModel, GgufWriter, MetaValue, Metadata};
use hmoe_placement::{GptOssDims, ModelShape};

use super::{arch_of, model_shape};
use crate::error::ModelError;

/// Metadata of architecture `arch` with the integer keys `ints` (`arch.` prefixed) and an
/// RMSNorm epsilon.
fn meta(arch: &str, ints: &[(&str, u32)]) -> Metadata {
    let mut m = Metadata::new();
    m.insert("general.architecture", MetaValue::String(arch.into()));
    for &(k, v) in ints {
        m.insert(format!("{arch}.{k}"), MetaValue::U32(v));
    }
    m.insert(
        format!("{arch}.attention.layer_norm_rms_epsilon"),
        MetaValue::F32(1e-5),
    );
    m
}

/// The shape of the architecture `m` names, with `n_vocab` embedding rows.
fn shape(m: &Metadata, n_vocab: usize) -> Result<ModelShape, ModelError> {
    arch_of(m)?.shape(m, n_vocab)
}

fn gpt_oss_120b() -> Metadata {
    meta(
        "gpt-oss",
        &[
            ("block_count", 36),
            ("embedding_length", 2880),
            ("feed_forward_length", 2880),
            ("expert_feed_forward_length", 2880),
            ("attention.head_count", 64),
            ("attention.head_count_kv", 8),
            ("attention.key_length", 64),
            ("attention.value_length", 64),
            ("attention.sliding_window", 128),
            ("context_length", 131072),
            ("expert_count", 128),
            ("expert_used_count", 4),
        ],
    )
}

#[test]
fn reads_gpt_oss_keys() {
    let s = shape(&gpt_oss_120b(), 201088).unwrap();
    assert_eq!(s, GptOssDims::gpt_oss_120b().shape());
    assert!(s.is_swa(0) && !s.is_swa(1) && s.is_swa(34) && !s.is_swa(35));
    s.validate().unwrap();
}

#[test]
fn missing_keys_are_errors_naming_the_key() {
    for key in [
        "block_count",
        "attention.head_count_kv",
        "attention.sliding_window",
        "expert_feed_forward_length",
        "context_length",
    ] {
        let mut m = gpt_oss_120b();
        m.remove(&format!("gpt-oss.{key}"));
        let e = shape(&m, 201088).unwrap_err();
        assert!(e.to_string().contains(&format!("gpt-oss.{key}")), "{e}");
    }
    let e = shape(&Metadata::new(), 10).unwrap_err();
    assert!(
        e.to_string().contains("missing general.architecture"),
        "{e}"
    );
    let e = shape(&meta("mixtral", &[("block_count", 2)]), 10).unwrap_err();
    assert!(
        matches!(e, ModelError::UnsupportedArch(ref a) if a.contains("mixtral")),
        "{e}"
    );
}

#[test]
fn the_vocabulary_is_the_embedding() {
    let mut w = GgufWriter::new();
    for (k, v) in gpt_oss_120b().iter() {
        w.add_meta(k, v.clone());
    }
    let g = GgufModel::from_bytes(w.to_bytes().unwrap()).unwrap();
    let e = model_shape(&g).unwrap_err();
    assert!(e.to_string().contains("token_embd.weight"), "{e}");
    w.add_tensor_hole(
        "token_embd.weight",
        hmoe_quant::GgmlType::F32,
        &[2880, 1000],
    )
    .unwrap();
    let g = GgufModel::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(model_shape(&g).unwrap().n_vocab, 1000);
}

#[test]
fn reads_deepseek_mla() {
    let mut m = meta(
        "deepseek2",
        &[
            ("block_count", 61),
            ("embedding_length", 7168),
            ("feed_forward_length", 18432),
            ("expert_feed_forward_length", 2048),
            ("attention.head_count", 128),
            ("attention.head_count_kv", 1),
            ("attention.key_length", 576),
            ("attention.value_length", 512),
            ("attention.key_length_mla", 192),
            ("attention.value_length_mla", 128),
            ("attention.kv_lora_rank", 512),
            ("attention.q_lora_rank", 1536),
            ("rope.dimension_count", 64),
            ("context_length", 163840),
            ("expert_count", 256),
            ("expert_used_count", 8),
            ("expert_shared_count", 1),
            ("leading_dense_block_count", 3),
        ],
    );
    m.insert("deepseek2.expert_weights_scale", MetaValue::F32(2.5));
    let s = shape(&m, 129280).unwrap();
    s.validate().unwrap();
    assert!(s.mla && !s.is_swa(0));
    // K only: kv_lora_rank 512 + rope 64 per position; queries of key_length_mla.
    assert_eq!(
        (
            s.n_head_kv,
            s.n_embd_k_gqa(),
            s.n_embd_v_gqa(),
            s.head_dim_v,
            s.head_dim_q
        ),
        (1, 576, 0, 512, 192)
    );
    assert_eq!((s.n_ff, s.n_ff_exp, s.n_ff_shexp), (18432, 2048, 2048));
    assert_eq!((s.n_expert, s.n_expert_used, s.n_vocab), (256, 8, 129280));
    // Without leading dense layers there is no dense FFN.
    m.insert("deepseek2.leading_dense_block_count", MetaValue::U32(0));
    assert_eq!(shape(&m, 129280).unwrap().n_ff, 0);
    // Only absorbed-MLA files run: the MLA sizes are required.
    m.remove("deepseek2.attention.key_length_mla");
    let e = shape(&m, 129280).unwrap_err();
    assert!(e.to_string().contains("key_length_mla"), "{e}");
}

#[test]
fn reads_qwen3moe_and_dense() {
    let mut m = meta(
        "qwen3moe",
        &[
            ("block_count", 48),
            ("embedding_length", 2048),
            ("expert_feed_forward_length", 768),
            ("attention.head_count", 32),
            ("attention.head_count_kv", 4),
            ("attention.key_length", 128),
            ("attention.value_length", 128),
            ("context_length", 40960),
            ("expert_count", 128),
            ("expert_used_count", 8),
        ],
    );
    let s = shape(&m, 151936).unwrap();
    s.validate().unwrap();
    assert_eq!(
        (s.n_embd_k_gqa(), s.n_embd_v_gqa(), s.n_vocab, s.n_ff_exp),
        (512, 512, 151936, 768)
    );
    assert_eq!((s.sliding_window, s.n_ff, s.n_ff_shexp), (0, 0, 0));
    // Without an expert width, the FFN length is split between the experts used.
    m.remove("qwen3moe.expert_feed_forward_length");
    m.insert("qwen3moe.feed_forward_length", MetaValue::U32(6144));
    assert_eq!(shape(&m, 151936).unwrap().n_ff_exp, 768);

    let m = meta(
        "qwen2",
        &[
            ("block_count", 24),
            ("embedding_length", 896),
            ("feed_forward_length", 4864),
            ("attention.head_count", 14),
            ("attention.head_count_kv", 2),
            ("context_length", 32768),
        ],
    );
    let s = shape(&m, 151936).unwrap();
    s.validate().unwrap();
    assert_eq!(s.arch, "qwen2");
    assert_eq!((s.n_head_kv, s.head_dim_k, s.head_dim_v), (2, 64, 64));
    assert_eq!((s.n_ff, s.n_expert, s.n_ff_exp), (4864, 0, 0));
}
