//! The placement planner on the real GGUF fixtures: shapes read from metadata by
//! [`hmoe_model::model_shape`], and the gpt-oss preset table checked against a file written by
//! llama.cpp's tooling.

mod common;
use common::fixtures;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_placement::{
    gpt_oss_tensor_table, plan, DeviceBudget, DeviceId, GptOssDims, ModelShape, PlacementFlags,
    TensorDesc, TensorRule,
};

fn open(rel: &str) -> (ModelShape, Vec<TensorDesc>) {
    let m = GgufModel::open(fixtures().join(rel), LoadOptions::default()).unwrap();
    let shape = hmoe_model::model_shape(&m).unwrap();
    (shape, m.tensors().iter().map(TensorDesc::from).collect())
}

#[test]
fn gpt_oss_tiny_shape_and_table_match_the_preset() {
    let (shape, tensors) = open("gpt-oss/gptoss-tiny.gguf");
    let dims = GptOssDims {
        n_layer: 4,
        n_embd: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 16,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 64,
        n_vocab: 1024,
        n_ctx_train: 131072,
        sliding_window: 8,
    };
    assert_eq!(shape, dims.shape());
    let mut want = gpt_oss_tensor_table(&dims).unwrap();
    let mut got = tensors;
    want.sort_by(|a, b| a.name.cmp(&b.name));
    got.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(got, want);
}

#[test]
fn split_fixture_plans_like_the_whole_file() {
    let (s1, t1) = open("gpt-oss/gptoss-tiny.gguf");
    let (s2, t2) = open("gpt-oss/gptoss-tiny-split-00001-of-00003.gguf");
    let b = DeviceBudget::with_gpus(&[4 << 30]);
    let f = PlacementFlags {
        rules: vec![TensorRule::CpuMoe],
        ..PlacementFlags::default()
    };
    let p1 = plan(&t1, &s1, &b, &f).unwrap();
    let p2 = plan(&t2, &s2, &b, &f).unwrap();
    assert_eq!(p1.devices, p2.devices);
}

#[test]
fn qwen3moe_and_deepseek2_shapes() {
    let (s, t) = open("qwen3moe/qwen3moe-tiny.gguf");
    assert_eq!(
        (s.n_layer, s.n_embd, s.n_vocab, s.n_ctx_train),
        (2, 64, 1024, 4096)
    );
    assert_eq!((s.n_expert, s.n_expert_used, s.n_ff_exp), (8, 2, 32));
    assert_eq!(
        (s.n_embd_k_gqa(), s.n_embd_v_gqa(), s.sliding_window),
        (32, 32, 0)
    );
    let p = plan(
        &t,
        &s,
        &DeviceBudget::with_gpus(&[4 << 30]),
        &PlacementFlags::default(),
    )
    .unwrap();
    assert_eq!(p.device(DeviceId::Gpu(0)).unwrap().expert_layers, 2);
    // Full-attention layers only: 4096 cells, f16 K and V.
    assert_eq!(
        p.device(DeviceId::Gpu(0)).unwrap().kv,
        2 * 4096 * (32 + 32) * 2
    );

    let (s, t) = open("deepseek2/deepseek2-tiny.gguf");
    assert!(s.mla);
    // K only: kv_lora_rank 16 + rope 8.
    assert_eq!(
        (s.n_embd_k_gqa(), s.n_embd_v_gqa(), s.head_dim_q),
        (24, 0, 24)
    );
    assert_eq!((s.n_ff, s.n_ff_shexp), (128, 32));
    let f = PlacementFlags {
        rules: vec![TensorRule::CpuMoe],
        ..PlacementFlags::default()
    };
    let p = plan(&t, &s, &DeviceBudget::with_gpus(&[4 << 30]), &f).unwrap();
    let gpu = p.device(DeviceId::Gpu(0)).unwrap();
    // Layer 0 is dense; layers 1-2 have routed experts, now on the CPU; the shared experts stay.
    assert_eq!(p.device(DeviceId::Cpu).unwrap().expert_layers, 2);
    assert_eq!(gpu.expert_layers, 0);
    for (t, d) in t.iter().zip(&p.tensor_devices) {
        let cpu = t.name.contains("_exps") || t.name.starts_with("token_embd");
        assert_eq!(*d == DeviceId::Cpu, cpu, "{}", t.name);
    }
    assert_eq!(gpu.kv, 3 * 4096 * 24 * 2);
}
