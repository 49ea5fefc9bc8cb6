//! The reference device's K/V rings against the CPU device's cache and attention, bit for bit,
//! for every pair of `-ctk`/`-ctv` types: the bytes REF0 stores are the CPU cache's (rotated
//! as it rotates quantized heads), and attention over them gives the CPU device's bits (the row
//! kernel over f32/f16/bf16 values, flash attention over block-quantized ones), for prefill
//! batches and single tokens, full and sliding-window layers, with and without sinks, and
//! heads of 32 (not rotated), 64, 80 (a tail after the 64-element steps) and 128 (a K rotation
//! of 128); both of the CPU device's attentions: gpt-oss's (`attention`, one value chain) and
//! that of Llama-style blocks and Qwen3-MoE (`attention_ext`, `vec_dot`'s four value chains for
//! one token, [`AttnParams::value_chains`] 4). Here, in the CPU device's crate, because the
//! contract crate cannot see it.

use half::f16;
use hmoe_backend::{AttnParams, Backend, KvLayout, KvRing, Ref0};

use crate::attention::tests::noise;
use crate::attention::{attention, attention_ext, AttnLayout, AttnShape};
use crate::kv_storage::{Cells, LayerCache};
use hmoe_backend::{CacheType, FlashAttn, KvType};

/// The CPU cells as ring bytes (ggml's layout of the type, little-endian).
fn cell_bytes(c: &Cells) -> Vec<u8> {
    match c {
        Cells::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Cells::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Cells::Blocks { data, .. } => data.clone(),
    }
}

const N_HEAD: usize = 4;
const N_KV: usize = 2;

/// One case: the CPU cache and REF0's rings filled with the same `n` positions in
/// micro-batches of `ub`, then attention for the last `n_q` positions on both (`ext`: the CPU
/// engine's `attention_ext`, no sinks, against REF0 with four value chains).
fn check(
    k: CacheType,
    v: CacheType,
    hd: usize,
    window: Option<usize>,
    n_q: usize,
    sinks: bool,
    ext: bool,
) {
    check_with(k, v, FlashAttn::On, hd, (70, 40), window, n_q, sinks, ext);
}

/// [`check`] with flash attention `fa` over `n` positions stored `ub` at a time.
#[allow(clippy::too_many_arguments)]
fn check_with(
    k: CacheType,
    v: CacheType,
    fa: FlashAttn,
    hd: usize,
    (n, ub): (usize, usize),
    window: Option<usize>,
    n_q: usize,
    sinks: bool,
    ext: bool,
) {
    let w = N_KV * hd;
    let ty = KvType::new(k, v, fa).unwrap();
    let mut cache = LayerCache::for_context(ty, n, ub, w, window).with_head_dims(hd, hd);
    let layer = &mut cache;
    let dev = Ref0::new();
    let layout = |t: CacheType, cells: &Cells| {
        KvLayout::new(t.ggml_type(), w, layer.cells, cells.rotation()).unwrap()
    };
    let (kl, vl) = (layout(k, &layer.k), layout(v, &layer.v));
    assert_eq!(
        (kl.rot, vl.rot),
        (
            KvLayout::rotation(k.ggml_type(), hd, true),
            KvLayout::rotation(v.ggml_type(), hd, false)
        ),
        "the executor's rotation rule is the cache's"
    );
    let (mut kr, mut vr): (KvRing<Ref0>, KvRing<Ref0>) =
        (dev.kv_alloc(kl).unwrap(), dev.kv_alloc(vl).unwrap());
    let keys: Vec<f32> = noise(1, n * w).iter().map(|x| 3.0 * x).collect();
    let values = noise(2, n * w);
    for start in (0..n).step_by(ub) {
        let end = (start + ub).min(n);
        let (ks, vs) = (&keys[start * w..end * w], &values[start * w..end * w]);
        layer.store(start, ks, vs, end - start);
        dev.kv_store(&dev.upload(ks).unwrap(), &mut kr, end - start, start)
            .unwrap();
        dev.kv_store(&dev.upload(vs).unwrap(), &mut vr, end - start, start)
            .unwrap();
    }
    let what = format!(
        "K {k} / V {v}, fa {}, head {hd}, {n} positions, window {window:?}, {n_q} queries, \
         sinks {sinks}, ext {ext}",
        ty.flash_attn()
    );
    assert!(
        dev.download(&kr.data).unwrap() == cell_bytes(&layer.k),
        "{what}: K ring"
    );
    assert!(
        dev.download(&vr.data).unwrap() == cell_bytes(&layer.v),
        "{what}: V ring"
    );
    let q = noise(3, n_q * N_HEAD * hd);
    let sink_logits = [0.5f32, -1.0, 2.0, 0.0];
    let sinks = sinks.then_some(&sink_logits[..]);
    let scale = 1.0 / (hd as f32).sqrt();
    let shape = AttnShape {
        n_head: N_HEAD,
        n_head_kv: N_KV,
        head_dim: hd,
        scale,
    };
    let mut want = vec![0f32; q.len()];
    if ext {
        assert!(sinks.is_none(), "attention_ext has no sinks");
        let layout = AttnLayout {
            n_head: N_HEAD,
            n_head_kv: N_KV,
            k_dim: hd,
            v_dim: hd,
            v_in_k: false,
            scale,
        };
        attention_ext(layer, &layout, &q, n - n_q, &mut want);
    } else {
        attention(layer, &shape, &q, n - n_q, sinks, &mut want);
    }
    let p = AttnParams {
        n_head: N_HEAD,
        n_head_kv: N_KV,
        head_dim: hd,
        cells: layer.cells,
        window,
        scale,
        value_chains: if ext { 4 } else { 1 },
        flash: ty.flash_attn(),
    };
    let sd = sinks.map(|s| dev.upload(s).unwrap());
    let mut out = dev.alloc::<f32>(q.len()).unwrap();
    let qd = dev.upload(&q).unwrap();
    dev.attention(&p, &qd, &kr, &vr, sd.as_ref(), n_q, n - n_q, &mut out)
        .unwrap();
    let got = dev.download(&out).unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what} [{i}]: {g} vs {w}");
    }
}

#[test]
fn ref0_kv_rings_and_attention_are_the_cpu_devices_bit_for_bit() {
    for k in CacheType::ALL {
        for v in CacheType::ALL {
            for hd in [32usize, 64, 80, 128] {
                if !hd.is_multiple_of(k.block_elems()) || !hd.is_multiple_of(v.block_elems()) {
                    continue;
                }
                // Prefill batches and decode tokens over full and sliding layers; heads other
                // than gpt-oss's 64 on fewer cases.
                let cases: &[(Option<usize>, usize, bool)] = match hd {
                    64 => &[
                        (None, 40, true),
                        (Some(8), 40, true),
                        (None, 1, false),
                        (Some(8), 1, true),
                        (Some(20), 7, false),
                    ],
                    _ => &[(Some(8), 40, true), (None, 1, true)],
                };
                for &(window, n_q, sinks) in cases {
                    check(k, v, hd, window, n_q, sinks, false);
                    check(k, v, hd, window, n_q, false, true);
                }
            }
        }
    }
}

/// Over f32/f16/bf16 values, flash attention's chunks (several of them, a window across a
/// chunk boundary, prefill and decode) and `-fa off`'s row kernel are REF0's bit for bit.
#[test]
fn ref0_chunked_flash_and_row_kernels_are_the_cpu_devices_bit_for_bit() {
    for t in [CacheType::F32, CacheType::F16, CacheType::BF16] {
        for fa in [FlashAttn::On, FlashAttn::Off] {
            for (window, n_q, sinks) in [(None, 1, true), (None, 40, false), (Some(300), 1, true)] {
                check_with(t, t, fa, 64, (700, 256), window, n_q, sinks, false);
                // `attention_ext` (no sinks, four value chains) at the same depths.
                check_with(t, t, fa, 64, (700, 256), window, n_q, false, true);
            }
        }
    }
    // Block keys with f16 values.
    check_with(
        CacheType::Q8_0,
        CacheType::F16,
        FlashAttn::On,
        64,
        (600, 256),
        None,
        3,
        true,
        false,
    );
}

/// A ring's bytes are what the store makes of them: an f16 cell holds the value's f16 bits,
/// and a row that is not whole blocks of the ring's type is refused when the ring is made.
#[test]
fn ref0_rings_store_cells_and_refuse_partial_blocks() {
    let dev = Ref0::new();
    let layout = KvLayout::new(hmoe_quant::GgmlType::F16, 4, 3, 0).unwrap();
    let mut ring = dev.kv_alloc(layout).unwrap();
    let rows = [0.1f32, 0.2, 0.3, 0.4, 1.5, -2.5, 3.25, 65504.0];
    dev.kv_store(&dev.upload(&rows).unwrap(), &mut ring, 2, 2)
        .unwrap();
    let bytes = dev.download(&ring.data).unwrap();
    // Position 2 in cell 2, position 3 in cell 0.
    let bits = |cell: usize, i: usize| {
        let at = 2 * (cell * 4 + i);
        u16::from_le_bytes([bytes[at], bytes[at + 1]])
    };
    assert_eq!(bits(2, 1), f16::from_f32(0.2).to_bits());
    assert_eq!(bits(0, 3), f16::from_f32(65504.0).to_bits());
    assert_eq!(bits(1, 0), 0, "cell 1 untouched");
    let e = KvLayout::new(hmoe_quant::GgmlType::Q8_0, 48, 4, 0).unwrap_err();
    assert!(e.to_string().contains("not whole Q8_0 blocks"), "{e}");
    assert!(KvLayout::new(hmoe_quant::GgmlType::Q4_K, 256, 4, 0).is_err());
}
