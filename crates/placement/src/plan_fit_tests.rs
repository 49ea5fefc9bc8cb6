//! The fit search's tests: what `--fit` shrinks first, per GPU, against users' rules, and the
//! closing numbers on gpt-oss-120b's real tensor table. Fixtures are shared with `plan_tests.rs`.

use super::tests::{
    dev, gpu0, gpus, model, off, ot, small_dims, tiny_dims, with_rules, CPU, G0, GIB, MIB,
};
use super::*;
use crate::presets::{gpt_oss_tensor_table, GptOssDims};
use crate::tensor_rules::layers_exps_regex;

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
