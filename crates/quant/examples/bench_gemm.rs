//! Micro-benchmark of the MXFP4 kernels on 2880 × 2880 matrices, one thread:
//! `cargo run --release -p hmoe-quant --example bench_gemm [-- REPS]`.
//!
//! Prints, per kernel, the median time of one matrix-vector product and the weight bytes read
//! per second, both for one matrix that stays in cache ("hot") and cycling through 256 MiB of
//! matrices ("cold", memory-bound), the same for Q8_0 `dot_rows` as a streaming reference, then
//! the multi-token GEMM throughput.

use std::time::Instant;

use hmoe_quant::{quantize_row, DotKernel, GemmKernel, GgmlType, Isa};

const N: usize = 2880;
const ROWS: usize = 2880;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Seconds per call of `f(i)` over `reps` calls (after one warm-up call): the median, or with
/// `min` the fastest (for calls longer than a scheduler slice on a shared machine).
fn time_with(reps: usize, min: bool, mut f: impl FnMut(usize)) -> f64 {
    f(0);
    let v: Vec<f64> = (1..=reps)
        .map(|i| {
            let t = Instant::now();
            f(i);
            t.elapsed().as_secs_f64()
        })
        .collect();
    if min {
        v.into_iter().fold(f64::MAX, f64::min)
    } else {
        median(v)
    }
}

/// Median seconds per call of `f(i)`.
fn time(reps: usize, f: impl FnMut(usize)) -> f64 {
    time_with(reps, false, f)
}

fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let mat_bytes = GgmlType::MXFP4.row_bytes(N as u64).unwrap() as usize * ROWS;
    let n_mats = (256 << 20) / mat_bytes + 1;
    // Quantise one matrix and copy it (different contents do not matter for speed).
    let x: Vec<f32> = (0..N * ROWS).map(|_| rnd()).collect();
    let mut one = vec![0u8; mat_bytes];
    quantize_row(GgmlType::MXFP4, &x, &mut one).unwrap();
    let mats: Vec<Vec<u8>> = (0..n_mats).map(|_| one.clone()).collect();
    let tokens = 64;
    let xa: Vec<f32> = (0..N * tokens).map(|_| rnd()).collect();
    let ab = GgmlType::Q8_0.row_bytes(N as u64).unwrap() as usize;
    let mut acts = vec![0u8; ab * tokens];
    quantize_row(GgmlType::Q8_0, &xa, &mut acts).unwrap();
    let act = &acts[..ab];
    let mut out = vec![0f32; ROWS * tokens];
    let gb = mat_bytes as f64 / 1e9;
    println!(
        "MXFP4 {ROWS}x{N} ({:.2} MB per matrix), one thread, median of {reps}",
        gb * 1e3
    );
    println!(
        "{:<36} {:>10} {:>9} {:>10} {:>9}",
        "kernel", "hot ms", "hot GB/s", "cold ms", "cold GB/s"
    );
    let report = |name: &str, hot: f64, cold: f64| {
        println!(
            "{name:<36} {:>10.3} {:>9.2} {:>10.3} {:>9.2}",
            hot * 1e3,
            gb / hot,
            cold * 1e3,
            gb / cold
        );
    };
    for isa in Isa::available() {
        let k = DotKernel::new(GgmlType::MXFP4, isa).unwrap();
        let mut run = |w: &[u8]| k.dot_rows(N, w, act, &mut out[..ROWS]);
        let hot = time(reps.min(if isa == Isa::Scalar { 3 } else { reps }), |_| {
            run(&one)
        });
        let cold = time(reps.min(if isa == Isa::Scalar { 3 } else { reps }), |i| {
            run(&mats[i % n_mats])
        });
        report(k.name(), hot, cold);
    }
    for isa in Isa::available() {
        let k = GemmKernel::new(GgmlType::MXFP4, isa).unwrap();
        let prep = k.prepare(N, act, 1).unwrap();
        let mut run = |w: &[u8]| k.gemm(w, &prep, &mut out[..ROWS]).unwrap();
        let r = if isa == Isa::Scalar { 3 } else { reps };
        let hot = time(r, |_| run(&one));
        let cold = time(r, |i| run(&mats[i % n_mats]));
        report(k.name(), hot, cold);
    }
    // The same matrices interleaved (one layout for every ISA) for the kernels that read them so.
    let interleaved: Vec<GemmKernel> = Isa::available()
        .into_iter()
        .filter_map(GemmKernel::interleaved)
        .collect();
    let xmats: Vec<Vec<u8>> = match interleaved.first() {
        Some(k) => {
            let mut x = one.clone();
            k.interleave_into(N, &one, &mut x).unwrap();
            (0..n_mats).map(|_| x.clone()).collect()
        }
        None => Vec::new(),
    };
    for k in &interleaved {
        let prep = k.prepare(N, act, 1).unwrap();
        let mut run = |w: &[u8]| k.gemm(w, &prep, &mut out[..ROWS]).unwrap();
        let hot = time(reps, |_| run(&xmats[0]));
        let cold = time(reps, |i| run(&xmats[i % n_mats]));
        report(k.name(), hot, cold);
    }
    // For comparison: Q8_0 rows of the same count (1.9x the bytes), the plain streaming dot.
    let q8_bytes = GgmlType::Q8_0.row_bytes(N as u64).unwrap() as usize * ROWS;
    let xq: Vec<f32> = x.iter().map(|v| v * 0.5).collect();
    let mut q8 = vec![0u8; q8_bytes];
    quantize_row(GgmlType::Q8_0, &xq, &mut q8).unwrap();
    let q8_mats: Vec<Vec<u8>> = (0..(256 << 20) / q8_bytes + 1)
        .map(|_| q8.clone())
        .collect();
    // Every SIMD ISA's row kernel: the AVX2 one shows what the AVX-512 one's design costs.
    for isa in Isa::available().into_iter().filter(|&i| i != Isa::Scalar) {
        let k = DotKernel::new(GgmlType::Q8_0, isa).unwrap();
        let mut run = |w: &[u8]| k.dot_rows(N, w, act, &mut out[..ROWS]);
        let hot = time(reps, |_| run(&q8));
        let cold = time(reps, |i| run(&q8_mats[i % q8_mats.len()]));
        let qgb = q8_bytes as f64 / 1e9;
        println!(
            "{:<36} {:>10.3} {:>9.2} {:>10.3} {:>9.2}",
            k.name(),
            hot * 1e3,
            qgb / hot,
            cold * 1e3,
            qgb / cold
        );
    }
    println!(
        "\nMXFP4 GEMM, T tokens, in calls of 64 rows as the model's matmul makes them, cycling \
         through the matrices (cold): fastest and median of {} calls",
        reps.min(20)
    );
    let gemms = Isa::available()
        .into_iter()
        .filter(|&i| i != Isa::Scalar)
        .map(|isa| (GemmKernel::new(GgmlType::MXFP4, isa).unwrap(), &mats))
        .chain(interleaved.iter().map(|&k| (k, &xmats)));
    for (k, mats) in gemms {
        for t in [1, 2, 4, 8, 12, 16, 32, 64] {
            let prep = k.prepare(N, &acts[..ab * t], t).unwrap();
            let wb = mat_bytes / ROWS;
            let mut run = |i: usize| {
                let w = &mats[i % n_mats];
                for (c, o) in out[..ROWS * t].chunks_mut(64 * t).enumerate() {
                    let rows = o.len() / t;
                    k.gemm(&w[c * 64 * wb..(c * 64 + rows) * wb], &prep, o)
                        .unwrap();
                }
            };
            let best = time_with(reps.min(20), true, &mut run);
            let med = time_with(reps.min(20), false, &mut run);
            let macs = (ROWS * N * t) as f64;
            println!(
                "{:<36} T={t:<3} {:>8.3} ms {:>8.3} ms {:>8.1} GMAC/s (fastest)",
                k.name(),
                best * 1e3,
                med * 1e3,
                macs / best / 1e9
            );
        }
    }

    // Q8_0 and F32 batches: the model's old path (one `DotKernel::dot` per row and token) against
    // the GEMM tiles, 1024 rows in calls of 16 / 64 rows, hot.
    let rows = 1024;
    for (ty, tokens) in [
        (GgmlType::Q8_0, 64),
        (GgmlType::Q8_0, 512),
        (GgmlType::F32, 64),
    ] {
        let wb = ty.row_bytes(N as u64).unwrap() as usize;
        let act_ty = hmoe_quant::vec_dot_type(ty);
        let abt = act_ty.row_bytes(N as u64).unwrap() as usize;
        let mut w = vec![0u8; wb * rows];
        quantize_row(ty, &x[..N * rows], &mut w).unwrap();
        let xs: Vec<f32> = (0..N * tokens).map(|i| x[i % x.len()] * 0.7).collect();
        let mut a = vec![0u8; abt * tokens];
        quantize_row(act_ty, &xs, &mut a).unwrap();
        let mut o = vec![0f32; rows * tokens];
        let dot = DotKernel::best(ty).unwrap();
        let per_dot = time_with(3, true, |_| {
            for (r, o) in o.chunks_mut(tokens).enumerate() {
                for (t, o) in o.iter_mut().enumerate() {
                    *o = dot.dot(N, &w[r * wb..(r + 1) * wb], &a[t * abt..(t + 1) * abt]);
                }
            }
        });
        let macs = (rows * N * tokens) as f64;
        println!(
            "\n{ty:?} {rows}x{N}, {tokens} tokens: per-token dot {:.2} ms ({:.1} GMAC/s)",
            per_dot * 1e3,
            macs / per_dot / 1e9
        );
        let k = GemmKernel::best(ty).unwrap();
        let prep = k.prepare(N, &a, tokens).unwrap();
        for chunk in [16, 64] {
            let s = time_with(reps.min(10), true, |_| {
                for (c, o) in o.chunks_mut(chunk * tokens).enumerate() {
                    let r = o.len() / tokens;
                    k.gemm(&w[c * chunk * wb..(c * chunk + r) * wb], &prep, o)
                        .unwrap();
                }
            });
            println!(
                "{:<36} calls of {chunk:>2} rows {:>8.2} ms ({:.1} GMAC/s)",
                k.name(),
                s * 1e3,
                macs / s / 1e9
            );
        }
    }
}
