//! `--fit` with what is elastic: the op-offload ring shrinks first, then the expert cache of
//! `--moe-cache MiB`, then (only without `-c`) the context; the plan never exceeds the card.
//! On the real gpt-oss-120b table (the shape preset, no file).

use hmoe_placement::{
    gpt_oss_tensor_table, plan, ring_bytes, ring_max_slice, DeviceBudget, DeviceId, DeviceUsage,
    GptOssDims, GpuLayers, PlacementFlags, Plan, TensorDesc, TensorRule,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn g120() -> (Vec<TensorDesc>, hmoe_placement::ModelShape) {
    let d = GptOssDims::gpt_oss_120b();
    (gpt_oss_tensor_table(&d).unwrap(), d.shape())
}

/// `-ngl 99 --cpu-moe` with `-c ctx` (`None`: not given) and `--moe-cache` bytes.
fn cpu_moe(ctx: Option<u32>, moe_cache: u64) -> PlacementFlags {
    PlacementFlags {
        n_gpu_layers: GpuLayers::Count(99),
        rules: vec![TensorRule::CpuMoe],
        ctx_size: ctx,
        moe_cache,
        ..PlacementFlags::default()
    }
}

fn gpu0(p: &Plan) -> &DeviceUsage {
    p.device(DeviceId::Gpu(0)).unwrap()
}

/// Bytes of one expert of gpt-oss-120b (gate, up, down and their biases).
fn expert_bytes(t: &[TensorDesc]) -> u64 {
    let layer: u64 = (t.iter())
        .filter(|x| x.name.starts_with("blk.0.") && x.name.contains("_exps"))
        .map(|x| x.n_bytes)
        .sum();
    layer / 128
}

fn assert_within_card(p: &Plan, free: u64) {
    let g = gpu0(p);
    assert!(p.fits(), "{}", p.table());
    assert!(g.total() + g.margin <= free, "{}", p.table());
}

#[test]
fn the_ring_is_planned_and_shrinks_first() {
    let (t, s) = g120();
    let eb = expert_bytes(&t);
    // A large card: the largest ring, 2 × 32 experts, in the compute column.
    let big = plan(
        &t,
        &s,
        &DeviceBudget::with_gpus(&[80 * GIB]),
        &cpu_moe(Some(4096), 0),
    );
    let big = big.unwrap();
    assert_eq!(big.ring_slice_experts, ring_max_slice(128));
    assert_eq!(gpu0(&big).ring, ring_bytes(32, 128, eb));
    assert!(gpu0(&big).compute > gpu0(&big).ring);
    assert!(big.notes.is_empty(), "{:?}", big.notes);
    // Without op offload there is no ring.
    let no_offload = PlacementFlags {
        op_offload: false,
        ..cpu_moe(Some(4096), 0)
    };
    let p = plan(&t, &s, &DeviceBudget::with_gpus(&[80 * GIB]), &no_offload).unwrap();
    assert_eq!((gpu0(&p).ring, p.ring_slice_experts), (0, 0));

    // gpt-oss-120b, -c 0 (the trained 131072, pinned) on 8 GiB with the default margin:
    // the ring shrinks to what the card leaves, the context stays.
    let p = plan(
        &t,
        &s,
        &DeviceBudget::with_gpus(&[8 * GIB]),
        &cpu_moe(Some(0), 0),
    )
    .unwrap();
    println!(
        "gpt-oss-120b -c 0 -ngl 99 --cpu-moe on 8 GiB:\n{}{:?}",
        p.table(),
        p.notes
    );
    assert_within_card(&p, 8 * GIB);
    assert_eq!(p.n_ctx, 131072);
    let slice = p.ring_slice_experts;
    assert!((1..32).contains(&slice), "{slice}");
    assert_eq!(gpu0(&p).ring, ring_bytes(slice, 128, eb));
    assert!(
        p.notes.iter().any(|n| n.contains("ring shrunk from 32 to")),
        "{:?}",
        p.notes
    );
    // The largest ring that fits: one more expert per slice would not.
    let over = DeviceUsage {
        ring: ring_bytes(slice + 1, 128, eb),
        compute: gpu0(&p).compute - gpu0(&p).ring + ring_bytes(slice + 1, 128, eb),
        ..gpu0(&p).clone()
    };
    assert!(!over.fits());

    // -c 32768 on 6 GiB and -c 4096 on 4 GiB fit too.
    for (ctx, free) in [(32768, 6 * GIB), (4096, 4 * GIB)] {
        let p = plan(
            &t,
            &s,
            &DeviceBudget::with_gpus(&[free]),
            &cpu_moe(Some(ctx), 0),
        )
        .unwrap();
        println!(
            "-c {ctx} on {} GiB:\n{}{:?}",
            free / GIB,
            p.table(),
            p.notes
        );
        assert_within_card(&p, free);
        assert_eq!(p.n_ctx, ctx);
        assert!(p.ring_slice_experts >= 1);
    }
}

#[test]
fn the_expert_cache_shrinks_after_the_ring_and_before_the_context() {
    let (t, s) = g120();
    let eb = expert_bytes(&t);
    let free = 8 * GIB;
    // -c 4096 leaves ~3 GiB beyond the margin: a 2 GiB cache fits beside the largest ring.
    let p = plan(
        &t,
        &s,
        &DeviceBudget::with_gpus(&[free]),
        &cpu_moe(Some(4096), 2 * GIB),
    );
    let p = p.unwrap();
    assert_eq!(gpu0(&p).moe_cache, 2 * GIB);
    assert_eq!(p.flags.moe_cache, 2 * GIB);
    assert!(
        p.command_line().contains("--moe-cache 2048"),
        "{}",
        p.command_line()
    );
    // 5 GiB asked: the ring goes to one expert a slice first, then the cache shrinks to what
    // is left, in whole MiB.
    let p = plan(
        &t,
        &s,
        &DeviceBudget::with_gpus(&[free]),
        &cpu_moe(Some(4096), 5 * GIB),
    );
    let p = p.unwrap();
    println!("--moe-cache 5120 on 8 GiB:\n{}{:?}", p.table(), p.notes);
    assert_within_card(&p, free);
    assert_eq!(p.ring_slice_experts, 1);
    assert_eq!(gpu0(&p).ring, ring_bytes(1, 128, eb));
    let cache = gpu0(&p).moe_cache;
    assert!(
        cache > 0 && cache < 5 * GIB && cache.is_multiple_of(MIB),
        "{cache}"
    );
    assert!(gpu0(&p).room_beyond_margin() < MIB);
    assert!(p
        .notes
        .iter()
        .any(|n| n.contains("expert cache shrunk from 5120")));
    // Without -c, the context is not touched while the cache can give.
    let p = plan(
        &t,
        &s,
        &DeviceBudget::with_gpus(&[free]),
        &cpu_moe(None, 5 * GIB),
    )
    .unwrap();
    assert_eq!(p.n_ctx, 131072, "{:?}", p.notes);
    assert!(
        p.notes.iter().all(|n| !n.contains("context")),
        "{:?}",
        p.notes
    );
    assert_within_card(&p, free);
    // A card too small for the trained context even with the smallest ring and no cache:
    // then, and only without -c, the context shrinks.
    let p = plan(
        &t,
        &s,
        &DeviceBudget::with_gpus(&[5 * GIB]),
        &cpu_moe(None, GIB),
    )
    .unwrap();
    println!("no -c, 5 GiB:\n{}{:?}", p.table(), p.notes);
    assert_within_card(&p, 5 * GIB);
    assert!(p.n_ctx < 131072);
    assert!(
        p.notes.iter().any(|n| n.contains("context reduced")),
        "{:?}",
        p.notes
    );
    assert!(
        p.notes.iter().any(|n| n.contains("left out")),
        "{:?}",
        p.notes
    );
    assert_eq!(gpu0(&p).moe_cache, 0);
    // With -c pinned, the same card is an error naming the shortfall, never a plan over it.
    assert!(plan(
        &t,
        &s,
        &DeviceBudget::with_gpus(&[5 * GIB]),
        &cpu_moe(Some(0), 0)
    )
    .is_err());
}
