//! Micro-benchmark of decode attention at depth with gpt-oss's shape (64 query heads over 8
//! KV heads of 64), on the global thread pool:
//! `cargo run --release -p hmoe-cpu --example bench_attention [-- DEPTH REPS [CASE [THREADS]]]`,
//! where CASE (`f16-on`, `f16-off`, `q8_0-on`, `all`) picks the cases.
//!
//! Prints, per cache type and `-fa` setting, the median and the fastest time of one token's
//! attention over `DEPTH` cached positions of one full (not sliding) layer, and the K/V bytes
//! read per second. Between repetitions a buffer larger than the CPU's caches is read
//! (untimed), so the cache is read from memory as in decode, where the layer's weights pass
//! through the CPU caches between two attentions of a layer; with `HOT=1` in the environment
//! nothing is read in between (the cache stays in the CPU's caches as far as they hold it).

use std::time::Instant;

use hmoe_backend::{CacheType, FlashAttn, KvType};
use hmoe_cpu::attention::{attention, AttnShape};
use hmoe_cpu::kv_storage::LayerCache;

const N_HEAD: usize = 64;
const N_KV: usize = 8;
const HD: usize = 64;
/// Bytes read between repetitions to push the cache out of the CPU's caches.
const EVICT_BYTES: usize = 256 << 20;

/// Deterministic values in [-1, 1).
fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize, default| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let (depth, reps) = (number(0, 16384), number(1, 30));
    let only = args.get(2).filter(|c| *c != "all");
    if let Some(threads) = args.get(3).and_then(|s| s.parse().ok()) {
        hmoe_pool::init_global(threads).expect("the pool starts");
    }
    let ub = 512;
    let w = N_KV * HD;
    let shape = AttnShape {
        n_head: N_HEAD,
        n_head_kv: N_KV,
        head_dim: HD,
        scale: 1.0 / (HD as f32).sqrt(),
    };
    let sinks = noise(9, N_HEAD);
    println!(
        "depth {depth}, {} threads",
        hmoe_pool::current_num_threads()
    );
    for (ty, fa) in [
        (CacheType::F16, FlashAttn::On),
        (CacheType::F16, FlashAttn::Off),
        (CacheType::Q8_0, FlashAttn::On),
    ] {
        let fa_name = format!("{fa:?}").to_lowercase();
        if only.is_some_and(|c| *c != format!("{}-{fa_name}", ty.name())) {
            continue;
        }
        let kv = KvType::new(ty, ty, fa).expect("a valid cache type");
        let mut cache = LayerCache::for_context(kv, depth + 1, ub, w, None).with_head_dims(HD, HD);
        let layer = &mut cache;
        for start in (0..=depth).step_by(ub) {
            let end = (start + ub).min(depth + 1);
            let k = noise(start as u64 * 2 + 1, (end - start) * w);
            let v = noise(start as u64 * 2 + 2, (end - start) * w);
            layer.store(start, &k, &v, end - start);
        }
        let q = noise(3, N_HEAD * HD);
        let mut out = vec![0f32; q.len()];
        let mut times = Vec::with_capacity(reps);
        let hot = std::env::var_os("HOT").is_some();
        let evict = vec![1u64; if hot { 0 } else { EVICT_BYTES / 8 }];
        for rep in 0..=reps {
            // One word per cache line, read like a layer's weights.
            std::hint::black_box(evict.iter().step_by(8).fold(0u64, |a, &x| a ^ x));
            let t = Instant::now();
            attention(layer, &shape, &q, depth, Some(&sinks), &mut out);
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let (med, min) = (times[times.len() / 2], times[0]);
        let bytes = 2.0 * (depth + 1) as f64 * ty.row_bytes(w) as f64;
        println!(
            "{:>5} -fa {:<4}  median {:7.3} ms  min {:7.3} ms  {:6.2} GB/s",
            ty.name(),
            fa_name,
            med * 1e3,
            min * 1e3,
            bytes / med / 1e9
        );
    }
}
