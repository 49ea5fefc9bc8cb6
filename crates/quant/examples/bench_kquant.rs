//! Micro-benchmark of the batched K-quant expert products, one thread, on Qwen3-30B-A3B's expert
//! shapes (gate/up: Q4_K 768 × 2048, down: Q6_K 2048 × 768):
//! `cargo run --release -p hmoe-quant --example bench_kquant [-- REPS [TOKENS]]`.
//!
//! Prints, per matrix, the median time of `dot_tokens_rows` over all rows (each super-block
//! decoded once for every token) and of `dot_tokens` row by row (the same bits), and the
//! multiply-accumulates per second of the former; then decode's single-token `dot_rows` over
//! the same matrix from cache, in GB/s of weights.

use std::time::Instant;

use hmoe_quant::{quantize_row, BatchKind, DotKernel, GgmlType};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median seconds per call of `f` over `reps` calls, after one warm-up call.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Random super-blocks of `ty` with small finite scales (`d` and `dmin` where the format
/// keeps them at these offsets: Q4_K at bytes 0 and 2, Q6_K at byte 208).
fn weights(ty: GgmlType, n: usize, rows: usize, next: &mut impl FnMut() -> u32) -> Vec<u8> {
    let mut w: Vec<u8> = (0..ty.row_bytes(n as u64).unwrap() as usize * rows)
        .map(|_| next() as u8)
        .collect();
    let half = |x: f32| half::f16::from_f32(x).to_le_bytes();
    let at: &[usize] = if ty == GgmlType::Q6_K {
        &[208]
    } else {
        &[0, 2]
    };
    for b in w.chunks_exact_mut(ty.block_bytes()) {
        for &o in at {
            b[o..o + 2].copy_from_slice(&half(0.001));
        }
    }
    w
}

fn main() {
    let mut args = std::env::args().skip(1).map(|s| s.parse::<usize>().ok());
    let reps = args.next().flatten().unwrap_or(20);
    let tokens = args.next().flatten().unwrap_or(32);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 32) as u32
    };
    println!("K-quant expert products, {tokens} tokens, one thread, median of {reps}");
    println!(
        "{:<28} {:>12} {:>14} {:>8} {:>10}",
        "matrix", "rows ms", "per-row ms", "speedup", "GMAC/s"
    );
    for (ty, n, rows) in [(GgmlType::Q4_K, 2048, 768), (GgmlType::Q6_K, 768, 2048)] {
        let k = DotKernel::for_matrix(ty, rows).unwrap();
        let w = weights(ty, n, rows, &mut next);
        let x: Vec<f32> = (0..n * tokens)
            .map(|_| next() as f32 / u32::MAX as f32 - 0.5)
            .collect();
        let ab = k.act_row_bytes(n);
        let mut acts = vec![0u8; ab * tokens];
        quantize_row(GgmlType::Q8_K, &x, &mut acts).unwrap();
        let mut out = vec![0f32; rows * tokens];
        let batched = time(reps, || {
            k.dot_tokens_rows(BatchKind::Expert, n, &w, &acts, tokens, &mut out)
        });
        let wb = k.weight_row_bytes(n);
        let per_row = time(reps, || {
            for (r, dst) in out.chunks_exact_mut(tokens).enumerate() {
                k.dot_tokens(BatchKind::Expert, n, &w[r * wb..(r + 1) * wb], &acts, dst);
            }
        });
        println!(
            "{:<28} {:>12.3} {:>14.3} {:>7.2}x {:>10.1}",
            format!("{} {rows}x{n}", k.name()),
            batched * 1e3,
            per_row * 1e3,
            per_row / batched,
            (rows * n * tokens) as f64 / batched / 1e9
        );
    }
    println!("single token (decode), dot_rows over the whole matrix from cache");
    for (ty, n, rows) in [(GgmlType::Q4_K, 2048, 768), (GgmlType::Q6_K, 768, 2048)] {
        let k = DotKernel::for_matrix(ty, rows).unwrap();
        let w = weights(ty, n, rows, &mut next);
        let x: Vec<f32> = (0..n)
            .map(|_| next() as f32 / u32::MAX as f32 - 0.5)
            .collect();
        let mut act = vec![0u8; k.act_row_bytes(n)];
        quantize_row(GgmlType::Q8_K, &x, &mut act).unwrap();
        let mut out = vec![0f32; rows];
        let t = time(reps * 10, || k.dot_rows(n, &w, &act, &mut out));
        println!(
            "{:<28} {:>12.3} ms {:>8.1} GB/s",
            format!("{} {rows}x{n}", k.name()),
            t * 1e3,
            w.len() as f64 / t / 1e9
        );
    }
}
