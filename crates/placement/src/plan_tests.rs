use super::*;
use crate::device::GpuBudget;
use crate::flags::{parse_override_list, RunTokens};
use crate::presets::{gpt_oss_tensor_table, GptOssDims};
use hmoe_quant::GgmlType;

pub(super) const MIB: u64 = 1 << 20;
pub(super) const GIB: u64 = 1 << 30;

/// 4 layers, tiny sizes: for the flag semantics.
pub(super) fn tiny_dims() -> GptOssDims {
    GptOssDims {
        n_layer: 4,
        n_embd: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 16,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 64,
        n_vocab: 256,
        n_ctx_train: 4096,
        sliding_window: 32,
    }
}

/// 8 layers, ~54 MB of experts per layer: for the fit search with MiB margins.
pub(super) fn small_dims() -> GptOssDims {
    GptOssDims {
        n_layer: 8,
        n_embd: 1024,
        n_head: 16,
        n_head_kv: 4,
        head_dim: 64,
        n_expert: 32,
        n_expert_used: 4,
        n_ff_exp: 1024,
        n_vocab: 32000,
        n_ctx_train: 32768,
        sliding_window: 128,
    }
}

pub(super) fn model(d: GptOssDims) -> (Vec<TensorDesc>, ModelShape) {
    (gpt_oss_tensor_table(&d).unwrap(), d.shape())
}

pub(super) fn gpus(free: &[u64]) -> DeviceBudget {
    DeviceBudget {
        gpus: free
            .iter()
            .map(|&free| GpuBudget { free, overhead: 0 })
            .collect(),
        host_free: None,
    }
}

pub(super) fn off() -> PlacementFlags {
    PlacementFlags {
        fit: false,
        ..PlacementFlags::default()
    }
}

pub(super) fn with_rules(mut f: PlacementFlags, rules: &[TensorRule]) -> PlacementFlags {
    f.rules = rules.to_vec();
    f
}

pub(super) fn ot(s: &str) -> TensorRule {
    parse_override_list(s).unwrap().remove(0)
}

pub(super) fn dev(p: &Plan, t: &[TensorDesc], name: &str) -> DeviceId {
    let i = t
        .iter()
        .position(|x| x.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"));
    p.tensor_devices[i]
}

pub(super) fn gpu0(p: &Plan) -> &DeviceUsage {
    p.device(DeviceId::Gpu(0)).unwrap()
}

pub(super) const G0: DeviceId = DeviceId::Gpu(0);
pub(super) const CPU: DeviceId = DeviceId::Cpu;

#[test]
fn ngl_takes_the_last_layers_and_counts_the_output_head() {
    let (t, s) = model(tiny_dims());
    let b = gpus(&[GIB]);
    let run = |ngl| {
        let f = PlacementFlags {
            n_gpu_layers: ngl,
            ..off()
        };
        plan(&t, &s, &b, &f).unwrap()
    };
    let p = run(GpuLayers::Count(0));
    assert!(p.tensor_devices.iter().all(|&d| d == CPU));
    assert_eq!(gpu0(&p).weights, 0);
    assert_eq!(gpu0(&p).kv, 0);

    let p = run(GpuLayers::Count(1));
    assert_eq!(dev(&p, &t, "output.weight"), G0);
    assert_eq!(dev(&p, &t, "output_norm.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.3.attn_q.weight"), CPU);
    assert_eq!(dev(&p, &t, "token_embd.weight"), CPU);
    assert_eq!(gpu0(&p).layers, 0);

    let p = run(GpuLayers::Count(2));
    assert_eq!(dev(&p, &t, "blk.3.attn_q.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.3.ffn_up_exps.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.2.attn_q.weight"), CPU);
    assert_eq!(gpu0(&p).layers, 1);
    assert_eq!(gpu0(&p).expert_layers, 1);
    // Layer 3 is a full-attention layer: 4096 cells of 2 heads x 16 x (K+V) x f16.
    assert_eq!(gpu0(&p).kv, 4096 * 2 * 32 * 2);

    for ngl in [
        GpuLayers::All,
        GpuLayers::Count(5),
        GpuLayers::Count(999),
        GpuLayers::Auto,
    ] {
        let p = run(ngl);
        assert_eq!(p.n_gpu_layers, 5);
        for (i, d) in p.tensor_devices.iter().enumerate() {
            let want = if t[i].name.starts_with("token_embd") {
                CPU
            } else {
                G0
            };
            assert_eq!(*d, want, "{}", t[i].name);
        }
        assert_eq!(gpu0(&p).layers, 4);
        assert_eq!(p.device(CPU).unwrap().kv, 0);
    }
}

#[test]
fn no_gpu_means_everything_on_the_cpu() {
    let (t, s) = model(tiny_dims());
    let p = plan(&t, &s, &DeviceBudget::default(), &PlacementFlags::default()).unwrap();
    assert!(p.tensor_devices.iter().all(|&d| d == CPU));
    assert_eq!(p.devices.len(), 1);
    let total: u64 = t.iter().map(|x| x.n_bytes).sum();
    // Plus the engine's f32 copies of norms, biases and sinks.
    let copies: u64 = t
        .iter()
        .filter(|x| x.dims.len() == 1 || x.name.ends_with(".bias"))
        .map(|x| 4 * x.dims.iter().product::<u64>())
        .sum();
    assert!(copies > 0);
    assert_eq!(p.devices[0].weights, total + copies);
    assert_eq!(p.devices[0].layers, 4);
    assert_eq!(p.devices[0].expert_layers, 4);
}

#[test]
fn host_copies_stay_on_the_cpu_whatever_the_placement() {
    let (t, s) = model(tiny_dims());
    let all_gpu = PlacementFlags {
        n_gpu_layers: GpuLayers::All,
        ..off()
    };
    let p = plan(&t, &s, &gpus(&[8 * GIB]), &all_gpu).unwrap();
    let embd = t.iter().find(|x| x.name == "token_embd.weight").unwrap();
    let norm_and_bias: u64 = t
        .iter()
        .filter(|x| x.dims.len() == 1 || x.name.ends_with(".bias"))
        .map(|x| 4 * x.dims.iter().product::<u64>())
        .sum();
    assert_eq!(p.device(CPU).unwrap().weights, embd.n_bytes + norm_and_bias);
}

#[test]
fn a_known_run_counts_the_kv_pages_it_writes() {
    let d = small_dims();
    let (t, s) = model(d);
    let flags = PlacementFlags {
        ctx_size: Some(8192),
        ..off()
    };
    let at = |run| plan_run(&t, &s, &DeviceBudget::default(), &flags, run).unwrap();
    let alloc = at(None);
    // f16 K and V rows of 4 heads × 64: 512 bytes each.
    let row = 4 * 64 * 2;
    let (full, swa) = (4, 4);
    assert_eq!(
        alloc.devices[0].kv,
        2 * row * (full * 8192 + swa * alloc.kv_cells_swa as u64)
    );
    // 1000 tokens: full layers hold 1000 cells, sliding ones their ring of 128 + 512.
    let run = RunTokens {
        prompt: 100,
        total: 1000,
    };
    let p = at(Some(run));
    let page = |n: u64| n.div_ceil(4096) * 4096;
    assert_eq!(
        p.devices[0].kv,
        2 * (full * page(1000 * row) + swa * page(640 * row))
    );
    // Ten tokens (5120 bytes): two pages per K and V buffer and layer.
    let short = RunTokens {
        prompt: 5,
        total: 10,
    };
    let p10 = at(Some(short));
    assert_eq!(p10.devices[0].kv, 2 * 8 * page(10 * row));
    assert_eq!(p10.devices[0].weights, alloc.devices[0].weights);
}

#[test]
fn a_generation_run_computes_last_token_logits_only() {
    let (t, s) = model(small_dims());
    let flags = PlacementFlags {
        ctx_size: Some(4096),
        ..off()
    };
    let budget = DeviceBudget::default();
    let worst = plan(&t, &s, &budget, &flags).unwrap().devices[0].compute;
    // 512 tokens × 32000 logits (and their transposed copy) dominate the unknown run.
    assert!(worst > 2 * 512 * 4 * 32000, "{worst}");
    let run = |prompt| {
        let tokens = RunTokens {
            prompt,
            total: prompt + 64,
        };
        plan_run(&t, &s, &budget, &flags, Some(tokens))
            .unwrap()
            .devices[0]
            .compute
    };
    let (short, long) = (run(8), run(512));
    assert!(short < long && long < worst / 4, "{short} {long} {worst}");
    // Prompts beyond the micro-batch are computed 512 tokens at a time.
    assert_eq!(run(5000), long);
    // A one-token prompt: the sampler (logits, candidates, sort scratch) is the peak, with
    // what flash attention keeps.
    assert_eq!(run(1), 20 * 32000 + flash_kept(&s, &flags, 1, 65));
}

/// Flash attention's kept buffers: the states of the largest micro-batch's tiles or of a
/// decode step's chunks, and one task's scratch.
#[test]
fn flash_attention_keeps_states_per_row_and_chunk() {
    let (_, s) = model(small_dims());
    let (h, dv) = (s.n_head, s.head_dim_v);
    let kv = |k, v| PlacementFlags {
        cache_type_k: k,
        cache_type_v: v,
        ..off()
    };
    let f16 = kv(GgmlType::F16, GgmlType::F16);
    let q8 = kv(GgmlType::Q8_0, GgmlType::Q8_0);
    let state = 4 * (dv + 2) * h;
    // The scratch depends on the micro-batch only: a deeper decode adds chunk states.
    let scratch = flash_kept(&s, &f16, 512, 1) - 512 * state;
    assert_eq!(flash_kept(&s, &f16, 100, 1), 112 * state + scratch);
    assert_eq!(flash_kept(&s, &f16, 512, 65536), 512 * state + scratch);
    assert_eq!(
        flash_kept(&s, &f16, 512, 256 * 1000),
        1000 * state + scratch
    );
    // Quantized values go in chunks too; the query as Q8_0 blocks.
    let q8_scratch = flash_kept(&s, &q8, 512, 1) - 512 * state;
    assert_eq!(
        flash_kept(&s, &q8, 512, 256 * 1000),
        1000 * state + q8_scratch
    );
    assert!(q8_scratch < scratch);
}

#[test]
fn cpu_moe_moves_expert_weights_and_biases_but_not_router() {
    let (t, s) = model(tiny_dims());
    let p = plan(
        &t,
        &s,
        &gpus(&[GIB]),
        &with_rules(off(), &[TensorRule::CpuMoe]),
    )
    .unwrap();
    for x in &t {
        let want = if x.name.contains("_exps") || x.name.starts_with("token_embd") {
            CPU
        } else {
            G0
        };
        assert_eq!(dev(&p, &t, &x.name), want, "{}", x.name);
    }
    assert_eq!(dev(&p, &t, "blk.1.ffn_gate_inp.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.1.ffn_gate_inp.bias"), G0);
    assert_eq!(dev(&p, &t, "blk.1.ffn_down_exps.bias"), CPU);
    assert_eq!(p.device(CPU).unwrap().expert_layers, 4);
    assert_eq!(gpu0(&p).expert_layers, 0);
    assert_eq!(gpu0(&p).layers, 4);
}

/// Op offload stages one whole layer's experts on the GPU (hmoe's executor uploads gate, up
/// and down, with their biases, and keeps them until the layer's MoE has run): with the
/// expert phase on the GPU either way, turning it on adds exactly one layer's expert bytes.
#[test]
fn op_offload_stages_one_layers_experts() {
    let (t, s) = model(small_dims());
    let compute = |op_offload: bool| {
        let f = PlacementFlags {
            op_offload,
            ..with_rules(off(), &[TensorRule::NCpuMoe(1)])
        };
        gpu0(&plan(&t, &s, &gpus(&[GIB]), &f).unwrap()).compute
    };
    let layer0: u64 = t
        .iter()
        .filter(|x| x.name.starts_with("blk.0.") && x.name.contains("_exps"))
        .map(|x| x.n_bytes)
        .sum();
    assert_eq!(compute(true) - compute(false), layer0);
}

#[test]
fn n_cpu_moe_takes_the_first_layers_only() {
    let d = GptOssDims {
        n_layer: 12,
        ..tiny_dims()
    };
    let (t, s) = model(d);
    let p = plan(
        &t,
        &s,
        &gpus(&[GIB]),
        &with_rules(off(), &[TensorRule::NCpuMoe(2)]),
    )
    .unwrap();
    for il in 0..12 {
        let want = if il < 2 { CPU } else { G0 };
        for n in [
            "ffn_up_exps.weight",
            "ffn_gate_exps.bias",
            "ffn_down_exps.weight",
        ] {
            assert_eq!(dev(&p, &t, &format!("blk.{il}.{n}")), want, "blk.{il}.{n}");
        }
        assert_eq!(dev(&p, &t, &format!("blk.{il}.ffn_gate_inp.weight")), G0);
    }
    // blk.1 must not catch blk.10 / blk.11.
    assert_eq!(dev(&p, &t, "blk.10.ffn_up_exps.weight"), G0);
    assert_eq!(p.device(CPU).unwrap().expert_layers, 2);
    assert_eq!(gpu0(&p).expert_layers, 10);
    // 0 is a no-op; more than the layers is --cpu-moe.
    let p0 = plan(
        &t,
        &s,
        &gpus(&[GIB]),
        &with_rules(off(), &[TensorRule::NCpuMoe(0)]),
    )
    .unwrap();
    assert_eq!(gpu0(&p0).expert_layers, 12);
    let p99 = plan(
        &t,
        &s,
        &gpus(&[GIB]),
        &with_rules(off(), &[TensorRule::NCpuMoe(99)]),
    )
    .unwrap();
    assert_eq!(gpu0(&p99).expert_layers, 0);
}

#[test]
fn ngl_and_n_cpu_moe_combine() {
    let (t, s) = model(tiny_dims());
    let f = PlacementFlags {
        n_gpu_layers: GpuLayers::Count(3),
        ..with_rules(off(), &[TensorRule::NCpuMoe(3)])
    };
    let p = plan(&t, &s, &gpus(&[GIB]), &f).unwrap();
    // -ngl 3 = output + blocks 2, 3; --n-cpu-moe 3 also takes block 2's experts.
    for n in [
        "blk.0.attn_q.weight",
        "blk.1.ffn_up_exps.weight",
        "blk.2.ffn_up_exps.weight",
    ] {
        assert_eq!(dev(&p, &t, n), CPU, "{n}");
    }
    for n in [
        "blk.2.attn_q.weight",
        "blk.2.ffn_gate_inp.weight",
        "blk.3.ffn_up_exps.weight",
    ] {
        assert_eq!(dev(&p, &t, n), G0, "{n}");
    }
    assert_eq!(gpu0(&p).layers, 2);
    assert_eq!(gpu0(&p).expert_layers, 1);
    assert_eq!(p.device(CPU).unwrap().expert_layers, 3);
}

#[test]
fn ot_before_cpu_moe_wins_and_after_loses() {
    let (t, s) = model(tiny_dims());
    let b = gpus(&[GIB]);
    let pin = ot(r"blk\.0\.ffn_up_exps=CUDA0");
    let p = plan(
        &t,
        &s,
        &b,
        &with_rules(off(), &[pin.clone(), TensorRule::CpuMoe]),
    )
    .unwrap();
    assert_eq!(dev(&p, &t, "blk.0.ffn_up_exps.weight"), G0);
    assert_eq!(
        dev(&p, &t, "blk.0.ffn_up_exps.bias"),
        G0,
        "unanchored: bias too"
    );
    assert_eq!(dev(&p, &t, "blk.0.ffn_down_exps.weight"), CPU);
    assert_eq!(dev(&p, &t, "blk.1.ffn_up_exps.weight"), CPU);

    let p = plan(&t, &s, &b, &with_rules(off(), &[TensorRule::CpuMoe, pin])).unwrap();
    assert_eq!(dev(&p, &t, "blk.0.ffn_up_exps.weight"), CPU);

    // The same with --n-cpu-moe.
    let pin = ot(r"blk\.1\.ffn_(up|gate|down)_exps\.weight=CUDA0");
    let p = plan(
        &t,
        &s,
        &b,
        &with_rules(off(), &[pin, TensorRule::NCpuMoe(4)]),
    )
    .unwrap();
    assert_eq!(dev(&p, &t, "blk.1.ffn_down_exps.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.1.ffn_down_exps.bias"), CPU);
    assert_eq!(gpu0(&p).expert_layers, 1);
}

#[test]
fn first_matching_ot_rule_wins() {
    let (t, s) = model(tiny_dims());
    let b = gpus(&[GIB]);
    let r = parse_override_list("exps=CPU,ffn_up_exps=CUDA0").unwrap();
    let p = plan(&t, &s, &b, &with_rules(off(), &r)).unwrap();
    assert_eq!(dev(&p, &t, "blk.2.ffn_up_exps.weight"), CPU);
    let r = parse_override_list("ffn_up_exps=CUDA0,exps=CPU").unwrap();
    let p = plan(&t, &s, &b, &with_rules(off(), &r)).unwrap();
    assert_eq!(dev(&p, &t, "blk.2.ffn_up_exps.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.2.ffn_gate_exps.weight"), CPU);
}

#[test]
fn ot_can_put_anything_anywhere() {
    let (t, s) = model(tiny_dims());
    let f = PlacementFlags {
        n_gpu_layers: GpuLayers::Count(0),
        ..with_rules(off(), &[ot(r"blk\.0\.attn=CUDA0"), ot("token_embd=CUDA0")])
    };
    let p = plan(&t, &s, &gpus(&[GIB]), &f).unwrap();
    assert_eq!(dev(&p, &t, "blk.0.attn_q.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.0.attn_sinks.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.0.attn_norm.weight"), G0);
    assert_eq!(dev(&p, &t, "token_embd.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.1.attn_q.weight"), CPU);
    // KV stays with the layer (-ngl 0: CPU).
    assert_eq!(gpu0(&p).kv, 0);
    assert_eq!(gpu0(&p).layers, 0);
}

#[test]
fn unknown_devices_and_bad_regexes_are_errors() {
    let (t, s) = model(tiny_dims());
    let e = plan(&t, &s, &gpus(&[GIB]), &with_rules(off(), &[ot("x=CUDA1")])).unwrap_err();
    assert_eq!(
        e,
        PlacementError::UnknownDevice {
            device: "CUDA1".into(),
            valid: "CPU, CUDA0".into()
        }
    );
    assert!(e.to_string().contains("valid devices: CPU, CUDA0"), "{e}");
    let e = plan(
        &t,
        &s,
        &DeviceBudget::default(),
        &with_rules(off(), &[ot("x=CUDA0")]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("valid devices: CPU"), "{e}");
    for bad in [r"blk\.(", r"(a)\1", "[z-a]"] {
        let e = plan(
            &t,
            &s,
            &gpus(&[GIB]),
            &with_rules(off(), &[ot(&format!("{bad}=CPU"))]),
        )
        .unwrap_err();
        assert!(matches!(e, PlacementError::BadRegex { .. }), "{bad}: {e}");
    }
    // A bad rule is an error even when it comes after a rule that matches everything.
    let e = plan(
        &t,
        &s,
        &gpus(&[GIB]),
        &with_rules(off(), &[ot(".=CPU"), ot("x=Vulkan0")]),
    )
    .unwrap_err();
    assert!(matches!(e, PlacementError::UnknownDevice { .. }));
}

#[test]
fn layers_split_over_gpus_by_free_memory() {
    let (t, s) = model(tiny_dims());
    let f = off();
    // 5 slots (4 blocks + output), equal shares: slots 0-2 on CUDA0, 3-4 on CUDA1.
    let p = plan(&t, &s, &gpus(&[GIB, GIB]), &f).unwrap();
    for il in 0..3 {
        assert_eq!(dev(&p, &t, &format!("blk.{il}.attn_q.weight")), G0);
    }
    assert_eq!(dev(&p, &t, "blk.3.attn_q.weight"), DeviceId::Gpu(1));
    assert_eq!(dev(&p, &t, "output.weight"), DeviceId::Gpu(1));
    // 1:3 shares: slots 0-1 on CUDA0.
    let p = plan(&t, &s, &gpus(&[GIB, 3 * GIB]), &f).unwrap();
    assert_eq!(dev(&p, &t, "blk.1.attn_q.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.2.attn_q.weight"), DeviceId::Gpu(1));
    assert_eq!(p.device(DeviceId::Gpu(1)).unwrap().layers, 2);
}

#[test]
fn kv_cache_sizes_follow_llama_cpp() {
    let (t, s) = model(GptOssDims::gpt_oss_120b());
    let b = gpus(&[1 << 40]);
    let kv = |f: PlacementFlags| {
        let p = plan(&t, &s, &b, &f).unwrap();
        (p.kv_cells_full, p.kv_cells_swa, gpu0(&p).kv)
    };
    let c = |n: u32| PlacementFlags {
        ctx_size: Some(n),
        ..off()
    };
    // f16: 8 kv heads x 64 x 2 bytes, K and V: 2 KiB per cell and layer.
    let (full, swa, bytes) = kv(c(4096));
    assert_eq!((full, swa), (4096, 768));
    assert_eq!(bytes, 18 * 4096 * 2048 + 18 * 768 * 2048);
    assert_eq!(kv(c(0)).0, 131072);
    assert_eq!(kv(off()).0, 131072);
    assert_eq!(kv(c(1000)), (1024, 768, 18 * (1024 + 768) * 2048));
    // Small contexts cap the sliding cache (and the ubatch).
    assert_eq!(kv(c(300)).0, 512);
    assert_eq!(kv(c(300)).1, 512);
    let p = plan(&t, &s, &b, &c(300)).unwrap();
    assert_eq!(p.n_ubatch, 512);
    let p = plan(&t, &s, &b, &c(200)).unwrap();
    assert_eq!((p.n_ctx, p.n_batch, p.n_ubatch), (256, 256, 256));
    // -np 4: the window is kept per sequence.
    let f = PlacementFlags {
        n_parallel: 4,
        ..c(8192)
    };
    assert_eq!(kv(f).1, 1024);
    // -ub 2048.
    let f = PlacementFlags {
        ubatch_size: 2048,
        ..c(8192)
    };
    assert_eq!(kv(f).1, 2304);
    // Quantised caches use the block size: q8_0 = 34 bytes per 32.
    let f = PlacementFlags {
        cache_type_k: GgmlType::Q8_0,
        cache_type_v: GgmlType::Q8_0,
        ..c(4096)
    };
    assert_eq!(kv(f).2, 18 * (4096 + 768) * 2 * 512 / 32 * 34);
    let f = PlacementFlags {
        cache_type_k: GgmlType::Q4_0,
        cache_type_v: GgmlType::F32,
        ..c(4096)
    };
    assert_eq!(kv(f).2, 18 * (4096 + 768) * (512 / 32 * 18 + 512 * 4));
    // KV of CPU layers stays on the CPU.
    let f = PlacementFlags {
        n_gpu_layers: GpuLayers::Count(3),
        ..c(4096)
    };
    let p = plan(&t, &s, &b, &f).unwrap();
    // Blocks 34 (sliding) and 35 (full) on the GPU.
    assert_eq!(gpu0(&p).kv, (4096 + 768) * 2048);
    assert_eq!(p.device(CPU).unwrap().kv, 17 * (4096 + 768) * 2048);
}

#[test]
fn invalid_settings_are_errors() {
    let (t, s) = model(tiny_dims());
    let b = gpus(&[GIB]);
    for f in [
        PlacementFlags {
            ubatch_size: 0,
            ..off()
        },
        PlacementFlags {
            batch_size: 0,
            ..off()
        },
        PlacementFlags {
            n_parallel: 0,
            ..off()
        },
        PlacementFlags {
            fit_ctx: 0,
            ..off()
        },
    ] {
        assert!(matches!(
            plan(&t, &s, &b, &f),
            Err(PlacementError::Invalid(_))
        ));
    }
    let f = PlacementFlags {
        cache_type_k: GgmlType::Q4_K,
        ..off()
    };
    assert!(matches!(
        plan(&t, &s, &b, &f),
        Err(PlacementError::BadCacheType(_))
    ));
    // A cached row of 48 elements cannot be q8_0.
    let mut s48 = s.clone();
    s48.head_dim_k = 24;
    let f = PlacementFlags {
        cache_type_k: GgmlType::Q8_0,
        ..off()
    };
    assert!(matches!(
        plan(&t, &s48, &b, &f),
        Err(PlacementError::Invalid(_))
    ));
    // A tensor beyond the model's layers.
    let mut t2 = t.clone();
    t2.push(TensorDesc::new("blk.9.attn_q.weight", GgmlType::F32, &[4]).unwrap());
    assert!(matches!(
        plan(&t2, &s, &b, &off()),
        Err(PlacementError::Shape(_))
    ));
}

#[test]
fn tied_output_head_is_duplicated_on_the_gpu() {
    let (mut t, s) = model(tiny_dims());
    let embd = t
        .iter()
        .find(|x| x.name == "token_embd.weight")
        .unwrap()
        .n_bytes;
    let untied = plan(&t, &s, &gpus(&[GIB]), &off()).unwrap();
    let head = t
        .iter()
        .find(|x| x.name == "output.weight")
        .unwrap()
        .n_bytes;
    t.retain(|x| x.name != "output.weight");
    let tied = plan(&t, &s, &gpus(&[GIB]), &off()).unwrap();
    assert_eq!(gpu0(&tied).weights, gpu0(&untied).weights - head + embd);
    assert_eq!(gpu0(&tied).compute, gpu0(&untied).compute);
    let f = PlacementFlags {
        n_gpu_layers: GpuLayers::Count(0),
        ..off()
    };
    let p = plan(&t, &s, &gpus(&[GIB]), &f).unwrap();
    assert_eq!(gpu0(&p).weights, 0);
}

/// A GPU's compute counts its attention's own temporaries (the chunk states of a call split
/// over positions, `hmoe_backend::attention_scratch`), which grow with the context, and no
/// attention mask (the engine has none): with micro-batches of 8 tokens the attention phase
/// is the largest, and going from 16,384 cells to 32,768 adds exactly the difference of the
/// two bounds (the sliding layers' rings, one chunk or two, are the same in both).
#[test]
fn gpu_compute_counts_split_attention_states_and_no_mask() {
    use hmoe_backend::attention_scratch::{attention_scratch_bound, ScratchShape};
    let (t, s) = model(small_dims());
    let compute = |ctx: u32| {
        let f = PlacementFlags {
            ctx_size: Some(ctx),
            ubatch_size: 8,
            batch_size: 8,
            n_gpu_layers: GpuLayers::All,
            ..off()
        };
        gpu0(&plan(&t, &s, &gpus(&[64 * GIB]), &f).unwrap()).compute
    };
    let bound = |cells: usize| {
        let shape = ScratchShape {
            n_head: 16,
            head_dim_v: 64,
            cells,
            window: None,
            k_only: false,
        };
        attention_scratch_bound(&shape, 8) as u64
    };
    // 8 tokens over 32,768 cells: 129 slots of 16 heads' 66 floats each, 4.4 MB.
    assert_eq!(bound(32_768), 4 * 129 * 8 * 16 * 66);
    assert_eq!(
        compute(32_768) - compute(16_384),
        bound(32_768) - bound(16_384)
    );
}
