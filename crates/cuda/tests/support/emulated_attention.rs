//! Attention over K/V pairs in the emulator of tests/emulated.rs, against REF0: the row kernel
//! (`-fa off` over float values, run by the main kernel test through [`attention_cases`]) and
//! the chunked flash kernel (`-fa on`, and block-quantized values whatever `-fa` says), split
//! over positions and not, over every ring type pair, rotated and not.

use hmoe_backend::{AttnParams, KvLayout, Ref0};
use hmoe_cuda::ChunkedShape;
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::common::{
    attn_params, kv_layouts, noise, ref_attention, ref_ring, ATTN_CASES, KV_PAIRS,
};
use super::emulator::{assert_bits, s, Emulator};

/// The row kernel (`-fa off` over f32/f16 values) over random rings of every type pair with
/// float values (quantized keys on the shapes whose heads are whole blocks) of [`ATTN_CASES`],
/// with and without sinks, one and four value chains. Quantized values take the chunked
/// kernel whatever `-fa` says:
/// `emulated_chunked_flash_attention_gives_the_reference_backends_bits`.
pub(crate) fn attention_cases(emu: &Emulator, cpu: &Ref0, rng: &mut StdRng) {
    let (n_head, n_kv) = (8usize, 2usize);
    for (hd, window, cells, pos0, n_tokens) in ATTN_CASES {
        let kvw = n_kv * hd;
        for pair in KV_PAIRS
            .into_iter()
            .filter(|&(_, v)| matches!(v, GgmlType::F32 | GgmlType::F16))
        {
            let Some((kl, vl)) = kv_layouts(pair, hd, n_kv, cells) else {
                continue;
            };
            let (kt, vt) = pair;
            // Sinks with one value chain (gpt-oss), four chains without (Qwen3-MoE).
            for (with_sinks, value_chains) in [(false, 1), (true, 1), (false, 4)] {
                let kb = ref_ring(cpu, kl, &noise(rng, cells * kvw, 1.0));
                let vb = ref_ring(cpu, vl, &noise(rng, cells * kvw, 1.0));
                let q = noise(rng, n_tokens * n_head * hd, 1.0);
                let sinks = noise(rng, n_head, 2.0);
                let p = attn_params(n_head, n_kv, hd, cells, window, value_chains);
                emu.write("q", &q);
                emu.write("k", &kb);
                emu.write("v", &vb);
                emu.write("sinks", &sinks);
                let mut args = attn_args(&p, (kl, vl), n_tokens, pos0, with_sinks);
                args.push(s(value_chains));
                emu.run("attn", &args);
                let got: Vec<f32> = emu.read("out");
                let sinks_opt = with_sinks.then_some(&sinks[..]);
                let want =
                    ref_attention(cpu, &p, &q, (kl, &kb), (vl, &vb), sinks_opt, n_tokens, pos0);
                let what = format!(
                    "attention K {kt} / V {vt} hd {hd} window {window:?} pos0 {pos0} n {n_tokens} \
                     sinks {with_sinks} chains {value_chains}"
                );
                assert_bits(&what, &got, &want);
            }
        }
    }
}

/// The emulator's arguments every attention op takes first (the kernels' `AttnArgs`): the
/// shape of `p`, `n_tokens` queries from `pos0`, whether there are sinks, and the rings' types
/// and rotations.
fn attn_args(
    p: &AttnParams,
    (kl, vl): (KvLayout, KvLayout),
    n_tokens: usize,
    pos0: usize,
    with_sinks: bool,
) -> Vec<String> {
    vec![
        s(n_tokens),
        s(p.n_head),
        s(p.n_head_kv),
        s(p.head_dim),
        s(p.cells),
        s(pos0),
        s(p.window.unwrap_or(0)),
        s(i32::from(with_sinks)),
        s(p.scale.to_bits()),
        s(kl.ty.id()),
        s(vl.ty.id()),
        s(kl.rot),
        s(vl.rot),
    ]
}

/// A chunked attention test's `(n_head, n_kv, head_dim, window, cells, pos0, n_tokens)`.
type ChunkedCase = (usize, usize, usize, Option<usize>, usize, usize, usize);

/// Shapes of the chunked flash attention tests: one token at the first position, inside the first block, at the last position
/// of chunk 0 and the first of chunk 1, after three chunks at a position that is no multiple
/// of 32; GQA 1:1; a window over a chunk boundary in a ring that wraps; heads of 256 (two
/// blocks per KV head's group); prefill batches over a chunk boundary (token tiles of 2), with
/// a window in a wrapping ring (the window's start inside a block), 20 tokens of heads of 16
/// from position 20 (one tile), and heads of 80 (no multiple of 32: float keys only).
const CHUNKED_CASES: [ChunkedCase; 12] = [
    (8, 1, 64, None, 600, 0, 1),
    (8, 1, 64, None, 600, 17, 1),
    (8, 1, 64, None, 600, 255, 1),
    (8, 1, 64, None, 600, 256, 1),
    (8, 1, 64, None, 600, 533, 1),
    (2, 2, 64, None, 600, 300, 1),
    (8, 1, 64, Some(100), 160, 780, 1),
    (8, 1, 256, None, 400, 300, 1),
    (8, 2, 64, None, 600, 250, 5),
    (8, 1, 32, Some(40), 80, 270, 7),
    (8, 8, 16, None, 64, 20, 20),
    (4, 1, 80, None, 300, 40, 3),
];

/// The chunked flash attention kernels (`attn_chunked`, `attn_chunked_fold`: `-fa on`, and
/// Q8_0/Q4_0 values whatever `-fa` says) give REF0's bits with `AttnParams::flash` for every
/// K/V pair of [`KV_PAIRS`] (f16/f16, f32/f32, Q8_0 keys with f16 values, Q4_0 keys with f32
/// values, Q8_0/Q8_0, Q4_0/Q4_0, f16 keys with Q8_0 values, f32 keys with Q4_0 values) in every
/// shape of [`CHUNKED_CASES`] whose heads are whole blocks of the pair, with and without sinks,
/// folded in the block and split over the chunks (the launch shape of `ChunkedShape`, then with
/// `split` flipped); quantized rings rotated as the executor rotates them and not rotated.
/// Over quantized values REF0 gives the same bits with `flash` off (`-fa off` takes the
/// chunked kernel too).
#[test]
#[ignore = "slow (minutes): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_chunked_flash_attention_gives_the_reference_backends_bits() {
    let Some(emu) = Emulator::build("chunked") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(43);
    let mut checked = 0;
    for (i, &(n_head, n_kv, hd, window, cells, pos0, n)) in CHUNKED_CASES.iter().enumerate() {
        for pair in KV_PAIRS {
            let Some((kl, vl)) = kv_layouts(pair, hd, n_kv, cells) else {
                continue;
            };
            let (kt, vt) = pair;
            // The executor's rotation, and none (where it rotates).
            let unrotated = (KvLayout { rot: 0, ..kl }, KvLayout { rot: 0, ..vl });
            let layouts = [(kl, vl), unrotated];
            let n_layouts = if kl.rot + vl.rot > 0 { 2 } else { 1 };
            for &(kl, vl) in &layouts[..n_layouts] {
                let with_sinks = i % 2 == 1;
                let what = format!(
                    "chunked attention K {kt} (rot {}) / V {vt} (rot {}) heads {n_head}/{n_kv} \
                     hd {hd} window {window:?} pos0 {pos0} n {n} sinks {with_sinks}",
                    kl.rot, vl.rot
                );
                chunked_case(
                    &emu,
                    &cpu,
                    &mut rng,
                    (kl, vl),
                    CHUNKED_CASES[i],
                    with_sinks,
                    &what,
                );
                checked += 1;
            }
        }
    }
    eprintln!("chunked attention: {checked} cases, each split and unsplit, equal REF0");
}

/// One case of [`emulated_chunked_flash_attention_gives_the_reference_backends_bits`]: random
/// rings of `(kl, vl)` and queries of `case`, the kernels' output in both launch shapes against
/// REF0's bits.
fn chunked_case(
    emu: &Emulator,
    cpu: &Ref0,
    rng: &mut StdRng,
    (kl, vl): (KvLayout, KvLayout),
    (n_head, n_kv, hd, window, cells, pos0, n): ChunkedCase,
    with_sinks: bool,
    what: &str,
) {
    let kvw = n_kv * hd;
    let kb = ref_ring(cpu, kl, &noise(rng, cells * kvw, 1.0));
    let vb = ref_ring(cpu, vl, &noise(rng, cells * kvw, 1.0));
    let q = noise(rng, n * n_head * hd, 2.0);
    let sinks = noise(rng, n_head, 3.0);
    let mut p = attn_params(n_head, n_kv, hd, cells, window, 1);
    p.flash = true;
    let sinks_opt = with_sinks.then_some(&sinks[..]);
    let want = ref_attention(cpu, &p, &q, (kl, &kb), (vl, &vb), sinks_opt, n, pos0);
    if !matches!(vl.ty, GgmlType::F32 | GgmlType::F16) {
        let off = AttnParams { flash: false, ..p };
        let want_off = ref_attention(cpu, &off, &q, (kl, &kb), (vl, &vb), sinks_opt, n, pos0);
        assert_bits(&format!("{what}: REF0 with -fa off"), &want_off, &want);
    }
    emu.write("q", &q);
    emu.write("k", &kb);
    emu.write("v", &vb);
    emu.write("sinks", &sinks);
    let shape = ChunkedShape::new(&p, n);
    for split in [shape.split, !shape.split] {
        let mut args = attn_args(&p, (kl, vl), n, pos0, with_sinks);
        args.extend([
            s(shape.heads_per_cta),
            s(shape.tokens_per_cta),
            s(shape.slots),
            s(i32::from(split)),
        ]);
        emu.run("attn_chunked", &args);
        let got: Vec<f32> = emu.read("out");
        assert_bits(&format!("{what} split {split} {shape:?}"), &got, &want);
    }
}
