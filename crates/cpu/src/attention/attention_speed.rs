//! Speed of attention on gpt-oss-120b's shapes (run by hand, see the module docs).

use super::attn_shape::*;
use super::*;

use crate::kv_storage::LayerCache;
use hmoe_backend::{CacheType, FlashAttn, KvType};

/// Nanoseconds of CPU time this process's threads have run (Linux's per-thread
/// `schedstat`; 0 where it is missing).
fn cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

#[test]
#[ignore]
fn attention_speed_decode() {
    speed(&[
        ("decode at depth 4096", 4096, 1),
        ("decode at depth 16384", 16384, 1),
    ]);
}

#[test]
#[ignore]
fn attention_speed_prefill() {
    speed(&[("prefill of 512", 0, 512)]);
}

/// Each `(what, depth, queries)` case for the chunked flash kernel over q8_0 and f16 caches
/// and the f16 row kernel.
fn speed(cases: &[(&str, usize, usize)]) {
    let (nh, nkv, hd) = (64, 8, 64);
    let w = nkv * hd;
    for &(what, depth, n_q) in cases {
        for (k, v, fa) in [
            (CacheType::Q8_0, CacheType::Q8_0, FlashAttn::On),
            (CacheType::F16, CacheType::F16, FlashAttn::On),
            (CacheType::F16, CacheType::F16, FlashAttn::Off),
        ] {
            let n = depth + n_q;
            let ty = KvType::new(k, v, fa).unwrap();
            let mut cache = LayerCache::for_context(ty, n, n_q, w, None).with_head_dims(hd, hd);
            let rows: Vec<f32> = (0..n * w)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            cache.store(0, &rows, &rows, n);
            let q: Vec<f32> = (0..n_q * nh * hd)
                .map(|i| ((i * 31) % 100) as f32 / 50.0 - 1.0)
                .collect();
            let shape = AttnShape {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: hd,
                scale: 0.125,
            };
            let mut out = vec![0f32; q.len()];
            let mut evict = vec![0u8; 64 << 20];
            // Per call: the best wall time of five, and the CPU time of all threads
            // averaged over them (steadier than wall time on a busy machine).
            let mut best = |cold: bool| {
                let (mut wall, mut cpu) = (f64::MAX, 0.0);
                for _ in 0..5 {
                    if cold {
                        evict.iter_mut().for_each(|b| *b = b.wrapping_add(1));
                        std::hint::black_box(&evict);
                    }
                    let (t, c) = (std::time::Instant::now(), cpu_ns());
                    attention(&cache, &shape, &q, depth, None, &mut out);
                    wall = wall.min(t.elapsed().as_secs_f64() * 1e3);
                    cpu += cpu_ns().saturating_sub(c) as f64 / 5e6;
                }
                (wall, cpu)
            };
            let ((warm, warm_cpu), (cold, cold_cpu)) = (best(false), best(true));
            eprintln!(
                "{what}, {k}/{v}, flash {}: {warm:.2} ms warm, {cold:.2} ms cold per layer \
                 ({} threads, wall); CPU {warm_cpu:.2} ms warm, {cold_cpu:.2} ms cold",
                ty.flash_attn(),
                hmoe_pool::current_num_threads()
            );
        }
    }
}
