//! Micro-benchmark of decode's single-token row kernels (`dot_rows`, the kernel
//! `DotKernel::for_matrix` picks) on Qwen2.5-0.5B's matrix shapes, one thread:
//! `cargo run --release -p hmoe-quant --example bench_decode [-- REPS]`.
//!
//! Prints, per matrix, the weight bytes read per second from cache ("hot": one matrix again
//! and again) and from memory ("cold": cycling through 256 MiB of copies).

use std::time::Instant;

use hmoe_quant::{quantize_row, DotKernel, GgmlType};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median seconds per call of `f(i)` over `reps` calls, after one warm-up call.
fn time(reps: usize, mut f: impl FnMut(usize)) -> f64 {
    f(0);
    median(
        (1..=reps)
            .map(|i| {
                let t = Instant::now();
                f(i);
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Random blocks of `ty` with small finite scales at the format's f16 scale offsets.
fn weights(ty: GgmlType, n: usize, rows: usize, next: &mut impl FnMut() -> u32) -> Vec<u8> {
    let mut w: Vec<u8> = (0..ty.row_bytes(n as u64).unwrap() as usize * rows)
        .map(|_| next() as u8)
        .collect();
    let at: &[usize] = match ty {
        GgmlType::Q6_K => &[208],
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        _ => &[0],
    };
    let half = half::f16::from_f32(0.001).to_le_bytes();
    for b in w.chunks_exact_mut(ty.block_bytes()) {
        for &o in at {
            b[o..o + 2].copy_from_slice(&half);
        }
    }
    w
}

fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 32) as u32
    };
    println!("decode rows, one thread, median of {reps}");
    println!("{:<40} {:>10} {:>10}", "matrix", "hot GB/s", "cold GB/s");
    for (ty, n, rows) in [
        (GgmlType::Q5_0, 896, 4864),
        (GgmlType::Q5_0, 896, 896),
        (GgmlType::Q8_0, 896, 8192),
        (GgmlType::Q8_0, 2048, 4096),
        (GgmlType::Q8_0, 4096, 2048),
        (GgmlType::Q6_K, 4864, 896),
        (GgmlType::Q4_K, 4864, 896),
    ] {
        let k = DotKernel::for_matrix(ty, rows).unwrap();
        let w = weights(ty, n, rows, &mut next);
        let copies = (256 << 20) / w.len() + 1;
        let cold: Vec<Vec<u8>> = (0..copies).map(|_| w.clone()).collect();
        let x: Vec<f32> = (0..n)
            .map(|_| next() as f32 / u32::MAX as f32 - 0.5)
            .collect();
        let mut act = vec![0u8; k.act_row_bytes(n)];
        quantize_row(k.act_type(), &x, &mut act).unwrap();
        let mut out = vec![0f32; rows];
        let hot = time(reps * 10, |_| k.dot_rows(n, &w, &act, &mut out));
        let cold_t = time(reps * 10, |i| {
            k.dot_rows(n, &cold[i % copies], &act, &mut out)
        });
        println!(
            "{:<40} {:>10.1} {:>10.1}",
            format!("{} {rows}x{n}", k.name()),
            w.len() as f64 / hot / 1e9,
            w.len() as f64 / cold_t / 1e9
        );
    }
}
