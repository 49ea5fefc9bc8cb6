use super::*;
use crate::device::GpuBudget;
use crate::flags::{parse_override_list, RunTokens};
use crate::presets::{gpt_oss_tensor_table, GptOssDims};
use crate::tensor_rules::layers_exps_regex;
use hmoe_quant::GgmlType;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// 4 layers, tiny sizes: for the flag semantics.
fn tiny_dims() -> GptOssDims {
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
fn small_dims() -> GptOssDims {
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

fn model(d: GptOssDims) -> (Vec<TensorDesc>, ModelShape) {
    (gpt_oss_tensor_table(&d).unwrap(), d.shape())
}

fn gpus(free: &[u64]) -> DeviceBudget {
    DeviceBudget {
        gpus: free
            .iter()
            .map(|&free| GpuBudget { free, overhead: 0 })
            .collect(),
        host_free: None,
    }
}

fn off() -> PlacementFlags {
    PlacementFlags {
        fit: false,
        ..PlacementFlags::default()
    }
}

fn with_rules(mut f: PlacementFlags, rules: &[TensorRule]) -> PlacementFlags {
    f.rules = rules.to_vec();
    f
}

fn ot(s: &str) -> TensorRule {
    parse_override_list(s).unwrap().remove(0)
}

fn dev(p: &Plan, t: &[TensorDesc], name: &str) -> DeviceId {
    let i = t
        .iter()
        .position(|x| x.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"));
    p.tensor_devices[i]
}

fn gpu0(p: &Plan) -> &DeviceUsage {
    p.device(DeviceId::Gpu(0)).unwrap()
}

const G0: DeviceId = DeviceId::Gpu(0);
const CPU: DeviceId = DeviceId::Cpu;

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
/// decode step's chunks (over float values), and one task's scratch.
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
    // Over quantized values one chunk, whatever the depth; the query as Q8_0 blocks.
    let q8_scratch = flash_kept(&s, &q8, 512, 1) - 512 * state;
    assert_eq!(
        flash_kept(&s, &q8, 512, 256 * 1000),
        512 * state + q8_scratch
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

/// GPU total with the experts of `layers` on the CPU, context `ctx`, fit off.
fn total_with_cpu_experts(
    t: &[TensorDesc],
    s: &ModelShape,
    free: &[u64],
    ctx: u32,
    layers: &[u32],
    pre: &[TensorRule],
) -> Vec<u64> {
    let mut rules = pre.to_vec();
    if !layers.is_empty() {
        rules.push(TensorRule::Override {
            pattern: layers_exps_regex(layers.iter().copied()),
            device: "CPU".into(),
        });
    }
    let f = PlacementFlags {
        ctx_size: Some(ctx),
        ..with_rules(off(), &rules)
    };
    let p = plan(t, s, &gpus(free), &f).unwrap();
    p.devices[1..].iter().map(DeviceUsage::total).collect()
}

fn fit_flags(ctx: Option<u32>, margin_mib: u64) -> PlacementFlags {
    PlacementFlags {
        ctx_size: ctx,
        fit_target_mib: vec![margin_mib],
        ..PlacementFlags::default()
    }
}

#[test]
fn fit_changes_nothing_when_everything_fits() {
    let (t, s) = model(small_dims());
    let p = plan(&t, &s, &gpus(&[64 * GIB]), &fit_flags(None, 1024)).unwrap();
    assert_eq!(p.n_ctx, 32768);
    assert!(p.notes.is_empty());
    assert!(p.fit_cpu_expert_layers.is_empty());
    assert_eq!(gpu0(&p).expert_layers, 8);
}

#[test]
fn fit_reduces_the_context_first_when_c_was_not_given() {
    let (t, s) = model(small_dims());
    let need = total_with_cpu_experts(&t, &s, &[GIB], 8192, &[], &[])[0];
    let free = need + 10 * MIB;
    let p = plan(&t, &s, &gpus(&[free]), &fit_flags(None, 10)).unwrap();
    assert_eq!(p.n_ctx, 8192, "{:?}", p.notes);
    assert!(p.fit_cpu_expert_layers.is_empty());
    assert!(
        p.notes[0].contains("context reduced from 32768 to 8192"),
        "{:?}",
        p.notes
    );
    assert!(gpu0(&p).headroom().unwrap() >= 10 * MIB as i128);
    assert!(
        p.command_line().starts_with("-c 8192 -ngl all"),
        "{}",
        p.command_line()
    );

    // Never below --fit-ctx: experts move instead.
    let f = PlacementFlags {
        fit_ctx: 16384,
        ..fit_flags(None, 10)
    };
    let p = plan(&t, &s, &gpus(&[free]), &f).unwrap();
    assert_eq!(p.n_ctx, 16384);
    assert!(!p.fit_cpu_expert_layers.is_empty());

    // Never when -c was given (0 included): experts move instead.
    for c in [32768, 0] {
        let p = plan(&t, &s, &gpus(&[free]), &fit_flags(Some(c), 10)).unwrap();
        assert_eq!(p.n_ctx, 32768);
        assert!(!p.fit_cpu_expert_layers.is_empty());
        assert!(gpu0(&p).fits());
    }
}

#[test]
fn fit_moves_experts_of_the_last_layers_first() {
    let (t, s) = model(small_dims());
    let need2 = total_with_cpu_experts(&t, &s, &[GIB], 4096, &[6, 7], &[])[0];
    let need1 = total_with_cpu_experts(&t, &s, &[GIB], 4096, &[7], &[])[0];
    assert!(need1 > need2);
    let p = plan(
        &t,
        &s,
        &gpus(&[need2 + 64 * MIB]),
        &fit_flags(Some(4096), 64),
    )
    .unwrap();
    assert_eq!(p.fit_cpu_expert_layers, vec![6, 7]);
    assert_eq!(gpu0(&p).total(), need2);
    assert_eq!(gpu0(&p).expert_layers, 6);
    assert_eq!(p.device(CPU).unwrap().expert_layers, 2);
    assert_eq!(dev(&p, &t, "blk.5.ffn_up_exps.weight"), G0);
    assert_eq!(dev(&p, &t, "blk.6.ffn_up_exps.bias"), CPU);
    assert_eq!(dev(&p, &t, "blk.7.ffn_gate_inp.weight"), G0);
    assert!(p.notes.iter().any(|n| n.contains("6-7")), "{:?}", p.notes);
    // One byte less: the op-offload ring gives an expert a slice, no third layer goes.
    let p = plan(
        &t,
        &s,
        &gpus(&[need2 + 64 * MIB - 1]),
        &fit_flags(Some(4096), 64),
    )
    .unwrap();
    assert_eq!(p.fit_cpu_expert_layers, vec![6, 7]);
    assert_eq!(p.ring_slice_experts, 15);
    assert!(
        p.notes
            .iter()
            .any(|n| n.contains("ring shrunk from 16 to 15")),
        "{:?}",
        p.notes
    );
    // More than the ring can give (down to one expert a slice): a third layer goes.
    let ring = gpu0(&p).ring / 15 * 16;
    let p = plan(
        &t,
        &s,
        &gpus(&[need2 + 64 * MIB - (ring - ring / 16) - 1]),
        &fit_flags(Some(4096), 64),
    )
    .unwrap();
    assert_eq!(p.fit_cpu_expert_layers, vec![5, 6, 7]);
}

#[test]
fn fit_plans_reproduce_from_their_command_line_flags() {
    let (t, s) = model(small_dims());
    let need = total_with_cpu_experts(&t, &s, &[GIB], 4096, &[5, 6, 7], &[])[0];
    let b = gpus(&[need + 100 * MIB]);
    let p = plan(&t, &s, &b, &fit_flags(None, 100)).unwrap();
    assert_eq!(p.n_ctx, 4096);
    assert_eq!(p.fit_cpu_expert_layers, vec![5, 6, 7]);
    assert_eq!(
        p.command_line(),
        r"-c 4096 -ngl all -ot 'blk\.([5-7])\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU'"
    );
    for fit in [false, true] {
        let f = PlacementFlags {
            fit,
            ..p.flags.clone()
        };
        let q = plan(&t, &s, &b, &f).unwrap();
        assert_eq!(q.tensor_devices, p.tensor_devices);
        assert_eq!(q.devices, p.devices);
        assert!(q.fit_cpu_expert_layers.is_empty());
    }
}

#[test]
fn fit_respects_user_rules() {
    let (t, s) = model(small_dims());
    // Layer 7's expert weights are pinned to the GPU: fit must take 6 and 5 instead.
    let pin = ot(r"blk\.7\.ffn_(up|gate|down)_exps=CUDA0");
    let need = total_with_cpu_experts(&t, &s, &[GIB], 4096, &[5, 6], std::slice::from_ref(&pin))[0];
    let f = PlacementFlags {
        rules: vec![pin.clone()],
        ..fit_flags(Some(4096), 64)
    };
    let p = plan(&t, &s, &gpus(&[need + 64 * MIB]), &f).unwrap();
    assert_eq!(p.fit_cpu_expert_layers, vec![5, 6]);
    assert_eq!(dev(&p, &t, "blk.7.ffn_up_exps.weight"), G0);
    assert_eq!(p.flags.rules[0], pin, "user rules stay first");

    // --n-cpu-moe 2 already holds layers 0-1 on the CPU; fit adds from the end.
    let f = PlacementFlags {
        rules: vec![TensorRule::NCpuMoe(2)],
        ..fit_flags(Some(4096), 64)
    };
    let need = total_with_cpu_experts(&t, &s, &[GIB], 4096, &[7], &[TensorRule::NCpuMoe(2)])[0];
    let p = plan(&t, &s, &gpus(&[need + 64 * MIB]), &f).unwrap();
    assert_eq!(p.fit_cpu_expert_layers, vec![7]);
    assert_eq!(p.device(CPU).unwrap().expert_layers, 3);

    // -ngl given: fit never touches it, so a too-small GPU is an error.
    let f = PlacementFlags {
        n_gpu_layers: GpuLayers::All,
        rules: vec![TensorRule::CpuMoe],
        ..fit_flags(Some(4096), 64)
    };
    let e = plan(&t, &s, &gpus(&[100 * MIB]), &f).unwrap_err();
    let PlacementError::DoesNotFit(short) = &e else {
        panic!("{e}")
    };
    assert_eq!(short.len(), 1);
    assert_eq!(short[0].device, G0);
    assert_eq!(short[0].free, 100 * MIB);
    assert_eq!(short[0].margin, 64 * MIB);
    assert!(short[0].missing() > 0);
    let msg = e.to_string();
    assert!(
        msg.contains("CUDA0 needs") && msg.contains("MiB more"),
        "{msg}"
    );
}

#[test]
fn fit_reduces_layers_only_when_ngl_is_auto() {
    let (t, s) = model(small_dims());
    let f = PlacementFlags {
        rules: vec![TensorRule::CpuMoe],
        ..fit_flags(Some(4096), 64)
    };
    let all = total_with_cpu_experts(&t, &s, &[GIB], 4096, &[], &[TensorRule::CpuMoe])[0];
    // 3 MiB short once the op-offload ring is down to one expert a slice.
    let fit_off = PlacementFlags {
        fit: false,
        ..f.clone()
    };
    let ring = gpu0(&plan(&t, &s, &gpus(&[all]), &fit_off).unwrap()).ring;
    let all = all - (ring - ring / 16);
    let p = plan(&t, &s, &gpus(&[all + 64 * MIB - 3 * MIB]), &f).unwrap();
    assert!(p.n_gpu_layers < 9);
    assert!(gpu0(&p).fits());
    assert!(
        p.notes.iter().any(|n| n.contains("-ngl reduced")),
        "{:?}",
        p.notes
    );
    // The embedding is on the CPU anyway, and the first layers leave first.
    let last_cpu = p.n_layer + 1 - p.n_gpu_layers;
    assert_eq!(
        dev(&p, &t, &format!("blk.{}.attn_q.weight", last_cpu - 1)),
        CPU
    );

    // Nothing fits: not even -ngl 0 leaves 64 MiB of 65 MiB once overhead is counted.
    let mut b = gpus(&[65 * MIB]);
    b.gpus[0].overhead = 2 * MIB;
    let e = plan(&t, &s, &b, &f).unwrap_err();
    assert!(matches!(e, PlacementError::DoesNotFit(_)), "{e}");
}

#[test]
fn fit_off_returns_the_plan_as_asked() {
    let (t, s) = model(small_dims());
    let f = PlacementFlags {
        fit: false,
        ..fit_flags(None, 1024)
    };
    let p = plan(&t, &s, &gpus(&[GIB]), &f).unwrap();
    assert!(!p.fits());
    assert!(!gpu0(&p).fits());
    assert_eq!(p.n_ctx, 32768);
    assert_eq!(gpu0(&p).expert_layers, 8);
}

#[test]
fn fit_works_per_gpu() {
    let (t, s) = model(small_dims());
    // 9 slots over two equal GPUs: blocks 0-4 on CUDA0, 5-7 and the head on CUDA1.
    let base = total_with_cpu_experts(&t, &s, &[GIB, GIB], 4096, &[], &[]);
    let free = base[0].max(base[1]) + 200 * MIB;
    let m0 = (free - base[0]) / MIB + 1; // CUDA0 lacks at most 1 MiB
    let f = PlacementFlags {
        fit_target_mib: vec![m0, 0],
        ..fit_flags(Some(4096), 0)
    };
    let p = plan(&t, &s, &gpus(&[free, free]), &f).unwrap();
    // With op offload the first layer moved to the CPU brings the op-offload ring to CUDA0,
    // which shrinks (to grow back into what the move left): one layer is enough.
    assert_eq!(p.fit_cpu_expert_layers, vec![4], "the last layer on CUDA0");
    assert!(
        (1..16).contains(&p.ring_slice_experts),
        "{}",
        p.ring_slice_experts
    );
    assert_eq!(p.device(DeviceId::Gpu(1)).unwrap().expert_layers, 3);
}

/// The issue's closing numbers, on the real gpt-oss-120b table.
#[test]
fn gpt_oss_120b_closing_numbers() {
    let (t, s) = model(GptOssDims::gpt_oss_120b());
    let experts_total: u64 = t
        .iter()
        .filter(|x| x.name.contains("_exps"))
        .map(|x| x.n_bytes)
        .sum();

    // -c 4096 -ngl all --cpu-moe (fit on, GPU large enough that it changes nothing).
    let f = PlacementFlags {
        ctx_size: Some(4096),
        n_gpu_layers: GpuLayers::All,
        rules: vec![TensorRule::CpuMoe],
        ..PlacementFlags::default()
    };
    let p = plan(&t, &s, &DeviceBudget::with_gpus(&[8 * GIB]), &f).unwrap();
    println!(
        "gpt-oss-120b -c 4096 -ngl all --cpu-moe, --gpu-mem 8GiB:\n{}",
        p.table()
    );
    println!("  {}\n", p.command_line());
    let g = gpu0(&p);
    assert!(
        (3.0e9..5.0e9).contains(&(g.total() as f64)),
        "{}",
        g.total()
    );
    assert_eq!(p.device(CPU).unwrap().expert_layers, 36);
    assert_eq!(g.expert_layers, 0);
    let cpu_experts: u64 = t
        .iter()
        .zip(&p.tensor_devices)
        .filter(|(x, d)| x.name.contains("_exps") && **d == CPU)
        .map(|(x, _)| x.n_bytes)
        .sum();
    assert_eq!(cpu_experts, experts_total);
    assert!((60.9e9..61.1e9).contains(&(cpu_experts as f64)));

    // --gpu-mem 8GiB and 22GiB, fit on, experts left to fit.
    let mut prev = 0;
    for gib in [8, 22] {
        let f = PlacementFlags {
            ctx_size: Some(4096),
            n_gpu_layers: GpuLayers::All,
            ..PlacementFlags::default()
        };
        let p = plan(&t, &s, &DeviceBudget::with_gpus(&[gib * GIB]), &f).unwrap();
        println!(
            "gpt-oss-120b -c 4096 -ngl all --fit on, --gpu-mem {gib}GiB:\n{}",
            p.table()
        );
        println!("  {}\n", p.command_line());
        let g = gpu0(&p);
        assert!(g.headroom().unwrap() >= GIB as i128);
        assert!(
            g.expert_layers > prev,
            "{gib} GiB: {} expert layers",
            g.expert_layers
        );
        // The early layers' experts are the ones on the GPU.
        assert_eq!(dev(&p, &t, "blk.0.ffn_up_exps.weight"), G0);
        assert_eq!(dev(&p, &t, "blk.35.ffn_up_exps.weight"), CPU);
        prev = g.expert_layers;
    }

    // Without -c: the context is cut to --fit-ctx before experts move.
    let p = plan(
        &t,
        &s,
        &DeviceBudget::with_gpus(&[22 * GIB]),
        &PlacementFlags::default(),
    )
    .unwrap();
    println!("gpt-oss-120b defaults, --gpu-mem 22GiB:\n{}", p.table());
    println!("  {}\n  {:?}\n", p.command_line(), p.notes);
    assert_eq!(p.n_ctx, 4096);
    assert_eq!(gpu0(&p).expert_layers, prev);

    // gpt-oss-20b on an 8 GiB card with the defaults.
    let d = GptOssDims::gpt_oss_20b();
    let t = gpt_oss_tensor_table(&d).unwrap();
    let p = plan(
        &t,
        &d.shape(),
        &DeviceBudget::with_gpus(&[8 * GIB]),
        &PlacementFlags::default(),
    )
    .unwrap();
    println!("gpt-oss-20b defaults, --gpu-mem 8GiB:\n{}", p.table());
    println!("  {}\n  {:?}\n", p.command_line(), p.notes);
    assert!(gpu0(&p).fits());
}

#[test]
fn the_expert_cache_gets_the_room_beyond_the_margin() {
    let mut u = DeviceUsage {
        device: DeviceId::Gpu(0),
        weights: 3 * GIB,
        kv: GIB,
        compute: 512 * MIB,
        overhead: 256 * MIB,
        free: Some(8 * GIB),
        margin: GIB,
        layers: 4,
        expert_layers: 0,
        ring: 0,
        moe_cache: 0,
    };
    // 8 GiB − 4.75 GiB used − 1 GiB margin.
    assert_eq!(u.room_beyond_margin(), 8 * GIB - 4 * GIB - 768 * MIB - GIB);
    u.free = Some(5 * GIB);
    assert_eq!(u.room_beyond_margin(), 0, "inside the margin");
    u.free = Some(4 * GIB);
    assert_eq!(u.room_beyond_margin(), 0, "over the device");
    u.free = None;
    assert_eq!(u.room_beyond_margin(), 0, "free memory unknown");
    // A plan: the room is what fit left on the GPU.
    let (t, s) = model(tiny_dims());
    let flags = with_rules(PlacementFlags::default(), &[TensorRule::CpuMoe]);
    let p = plan(&t, &s, &gpus(&[2 * GIB]), &flags).unwrap();
    let g = gpu0(&p);
    assert_eq!(g.margin, GIB);
    assert!(g.room_beyond_margin() > 0);
    assert_eq!(
        g.room_beyond_margin(),
        g.free.unwrap() - g.total() - g.margin
    );
}
