//! The router's product and its top-k + softmax in one launch (`router_logits_topk_*`,
//! kernels/router.cu: the GEMV blocks write the logits, the block that finishes last takes
//! every token's top-k) in the emulator of tests/emulated.rs, against REF0's `matmul_shared`
//! then `router_top_k`; and the two-launch router (`router_topk_softmax`, which shares the
//! top-k's device code) on the same logits.

use hmoe_backend::{Backend, Ref0};
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::common::noise;
use super::emulator::{assert_bits, s, weights, Emulator};

/// One case of the one-launch router: `ne` experts over rows of `d`, `n` tokens, `k` chosen.
#[derive(Clone, Copy, Debug)]
struct RouterCase {
    ty: GgmlType,
    ne: usize,
    k: usize,
    d: usize,
    n: usize,
    bias: bool,
    /// The second half of the rows of W (and of the bias) equal to the first: every logit
    /// comes twice, so the top-k breaks ties (to the lower id) throughout.
    twins: bool,
}

/// What a router launch gives: logits, chosen experts and their weights.
struct Routed {
    logits: Vec<f32>,
    sel: Vec<i32>,
    w: Vec<f32>,
}

/// The case's random weights (bytes of `ty`), tokens and bias.
fn inputs(rng: &mut StdRng, c: &RouterCase) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let mut q = weights(rng, c.ty, c.ne, c.d);
    let mut bias = noise(rng, c.ne, 0.5);
    if c.twins {
        let (half, rb) = (c.ne / 2, q.len() / c.ne);
        q.copy_within(0..half * rb, half * rb);
        bias.copy_within(0..half, half);
    }
    (q, noise(rng, c.n * c.d, 1.0), bias)
}

/// REF0's `matmul_shared` (the one matrix with its bias) then `router_top_k`.
fn reference(cpu: &Ref0, c: &RouterCase, (q, x, bias): (&[u8], &[f32], &[f32])) -> Routed {
    let m = cpu.upload_matrix(c.ty, c.ne, c.d, q).unwrap();
    let bd = cpu.upload(bias).unwrap();
    let mut logits = cpu.alloc::<f32>(c.n * c.ne).unwrap();
    let mut sel = cpu.alloc::<i32>(c.n * c.k).unwrap();
    let mut w = cpu.alloc::<f32>(c.n * c.k).unwrap();
    let xd = cpu.upload(x).unwrap();
    let b = [c.bias.then_some(&bd)];
    cpu.matmul_shared(&[&m], &b, &xd, c.n, &mut [&mut logits])
        .unwrap();
    cpu.router_top_k(&logits, c.ne, c.k, &mut sel, &mut w)
        .unwrap();
    Routed {
        logits: cpu.download(&logits).unwrap(),
        sel: cpu.download(&sel).unwrap(),
        w: cpu.download(&w).unwrap(),
    }
}

/// The emulated two launches of CUDA's other path: the GEMV kernel with the bias, then
/// `router_topk_softmax` of its logits.
fn two_launches(emu: &Emulator, c: &RouterCase, (q, x, bias): (&[u8], &[f32], &[f32])) -> Routed {
    emu.write("w", q);
    emu.write("x", x);
    emu.write("b", bias);
    let args = [c.ty.id() as usize, c.ne, c.d, c.n, 0, usize::from(c.bias)].map(s);
    emu.run("matmul", &args);
    let logits: Vec<f32> = emu.read("y");
    let (sel, w) = router(emu, &logits, c);
    Routed { logits, sel, w }
}

/// The emulated `router_topk_softmax` of `logits`.
fn router(emu: &Emulator, logits: &[f32], c: &RouterCase) -> (Vec<i32>, Vec<f32>) {
    emu.write("logits", logits);
    emu.run("router", &[s(c.n), s(c.ne), s(c.k)]);
    (emu.read("sel"), emu.read("w"))
}

/// The emulated one launch, twice in a row on the device's counter as the last run left it
/// (`done`), its blocks in `order` (0 grid order, 1 reversed, else shuffled with that seed).
/// The counter must be 0 again after it.
fn one_launch(
    emu: &Emulator,
    c: &RouterCase,
    (q, x, bias): (&[u8], &[f32], &[f32]),
    order: usize,
) -> Routed {
    emu.write("w", q);
    emu.write("x", x);
    emu.write("b", bias);
    let bias = usize::from(c.bias);
    let args = [c.ty.id() as usize, c.ne, c.d, c.n, c.k, bias, order, 2].map(s);
    emu.run("router_logits", &args);
    assert_eq!(
        emu.read::<i32>("done"),
        [0],
        "{c:?}: the counter is 0 again"
    );
    Routed {
        logits: emu.read("y"),
        sel: emu.read("sel"),
        w: emu.read("w"),
    }
}

/// `got` is `want` bit for bit (reported as `what`).
fn assert_routed(what: &str, got: &Routed, want: &Routed) {
    assert_bits(&format!("{what}: logits"), &got.logits, &want.logits);
    assert_eq!(got.sel, want.sel, "{what}: experts");
    assert_bits(&format!("{what}: weights"), &got.w, &want.w);
}

/// The one launch for gpt-oss-120b's router (128 experts, k 4), 32 experts k 4 and 8 experts
/// k 2, rows of 2,880 (gpt-oss) and 64, 1 … 4 tokens and a whole token tile (8), with and
/// without a bias, with and without tied logits, its blocks in grid order, reversed and
/// shuffled, each run twice in a row on one counter carried from case to case: REF0's bits
/// (logits, experts and weights), and the counter at 0 after every run. F16 and BF16 routers
/// (whose products are not REF0's order) give the bits of CUDA's two launches. The two-launch
/// router (`router_topk_softmax`) gives REF0's choice of REF0's logits.
#[test]
#[ignore = "slow (a minute or two): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_router_logits_and_top_k_in_one_launch_give_the_reference_backends_bits() {
    let Some(emu) = Emulator::build("router_logits") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(47);
    emu.write("done", &[0i32]);
    let mut cases = Vec::new();
    for (ne, k) in [(128, 4), (32, 4), (8, 2)] {
        for d in [2880, 64] {
            for n in 1..=4 {
                for (bias, twins) in [(false, false), (true, false), (false, true), (true, true)] {
                    let ty = GgmlType::F32;
                    cases.push(RouterCase {
                        ty,
                        ne,
                        k,
                        d,
                        n,
                        bias,
                        twins,
                    });
                }
            }
        }
    }
    let full = |ty, twins| RouterCase {
        ty,
        ne: 128,
        k: 4,
        d: 2880,
        n: hmoe_cuda::ROUTER_FUSED_MAX_TOKENS,
        bias: true,
        twins,
    };
    cases.extend([full(GgmlType::F32, false), full(GgmlType::F32, true)]);
    let (mut exact, mut halves) = (0, 0);
    for (i, c) in cases.iter().enumerate() {
        let (q, x, bias) = inputs(&mut rng, c);
        let io = (&q[..], &x[..], &bias[..]);
        let order = [0, 1, 7 + i][i % 3];
        let got = one_launch(&emu, c, io, order);
        let want = reference(&cpu, c, io);
        assert_routed(&format!("{c:?} order {order}"), &got, &want);
        let (sel, w) = router(&emu, &want.logits, c);
        assert_eq!(sel, want.sel, "{c:?}: router_topk_softmax's experts");
        assert_bits(&format!("{c:?}: router_topk_softmax"), &w, &want.w);
        exact += 1;
    }
    for ty in [GgmlType::F16, GgmlType::BF16] {
        for (i, c) in [
            full(ty, true),
            RouterCase {
                n: 3,
                d: 64,
                ne: 32,
                bias: false,
                ..full(ty, false)
            },
        ]
        .iter()
        .enumerate()
        {
            let (q, x, bias) = inputs(&mut rng, c);
            let io = (&q[..], &x[..], &bias[..]);
            let got = one_launch(&emu, c, io, 2 * i + 1);
            assert_routed(&format!("{c:?}"), &got, &two_launches(&emu, c, io));
            halves += 1;
        }
    }
    assert_eq!((exact, halves), (98, 4));
}
