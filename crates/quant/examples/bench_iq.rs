//! Micro-benchmark of the IQ dot products (the decode path of IQ experts on the CPU), one thread:
//! `cargo run --release -p hmoe-quant --example bench_iq [-- REPS [ROWS [TOKENS]]]`.
//!
//! For each IQ type, `ROWS` weight rows of DeepSeek-V3's hidden size (7168) times one activation
//! row with `dot_rows`, the scalar kernel and the best ISA's timed alternately (the machine may be
//! shared); prints the medians, rows per second and weight GB/s, and checks the two agree bit
//! for bit. Then the batch of `TOKENS` tokens on the best ISA with `dot_tokens_rows` (each
//! weight block decoded once for all tokens): its median time per token against the single-token
//! `dot_rows` (short runs: on a loaded machine long ones are preempted more often), and its bits
//! against `dot_rows` per token.

use std::time::Instant;

use hmoe_quant::{
    quantize_row, set_iq_block_scale, vec_dot_type, BatchKind, DotKernel, Isa, IQ_TYPES,
};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1).map(|s| s.parse::<usize>().ok());
    let reps = args.next().flatten().unwrap_or(15);
    let rows = args.next().flatten().unwrap_or(256);
    let tokens = args.next().flatten().unwrap_or(16);
    let n = 7168;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 32) as u32
    };
    let best = Isa::best();
    println!("IQ dot products, {rows} rows x {n}, one thread, median of {reps} (alternating)");
    println!(
        "{:<10} {:>11} {:>11} {:>8} {:>12} {:>9} {:>13} {:>8}",
        "type",
        "scalar ms",
        "simd ms",
        "speedup",
        "simd rows/s",
        "simd GB/s",
        format!("{tokens}t ms/tok"),
        "vs 1 tok"
    );
    for ty in IQ_TYPES {
        let scalar = DotKernel::new(ty, Isa::Scalar).unwrap();
        let simd = DotKernel::new(ty, best).unwrap();
        let rb = scalar.weight_row_bytes(n);
        let mut w: Vec<u8> = (0..rb * rows).map(|_| next() as u8).collect();
        let d = half::f16::from_f32(0.001).to_bits();
        for b in w.chunks_exact_mut(ty.block_bytes()) {
            set_iq_block_scale(ty, b, d);
        }
        let x: Vec<f32> = (0..n * tokens)
            .map(|_| next() as f32 / u32::MAX as f32 - 0.5)
            .collect();
        let ab = scalar.act_row_bytes(n);
        let mut acts = vec![0u8; ab * tokens];
        quantize_row(vec_dot_type(ty), &x, &mut acts).unwrap();
        let a = &acts[..ab];
        let (mut o1, mut o2) = (vec![0f32; rows], vec![0f32; rows]);
        let time = |k: &DotKernel, out: &mut [f32]| {
            let t = Instant::now();
            k.dot_rows(n, &w, a, out);
            t.elapsed().as_secs_f64()
        };
        time(&scalar, &mut o1);
        time(&simd, &mut o2);
        let (mut ts, mut tv) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            ts.push(time(&scalar, &mut o1));
            tv.push(time(&simd, &mut o2));
        }
        let same = o1.iter().zip(&o2).all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(same, "{ty}: {} differs from the scalar kernel", simd.name());
        let (ts, tv) = (median(ts), median(tv));
        // The batch, checked against `dot_rows` per token.
        let (mut per_token, mut batched) = (vec![0f32; rows * tokens], vec![0f32; rows * tokens]);
        for (t, o) in per_token.chunks_exact_mut(rows).enumerate() {
            simd.dot_rows(n, &w, &acts[t * ab..(t + 1) * ab], o);
        }
        let mut tb = Vec::new();
        for _ in 0..reps {
            let t = Instant::now();
            simd.dot_tokens_rows(BatchKind::Expert, n, &w, &acts, tokens, &mut batched);
            tb.push(t.elapsed().as_secs_f64() / tokens as f64);
        }
        for (i, b) in batched.iter().enumerate() {
            let p = per_token[(i % tokens) * rows + i / tokens];
            assert_eq!(p.to_bits(), b.to_bits(), "{ty}: batch differs");
        }
        let tb = median(tb);
        println!(
            "{:<10} {:>11.3} {:>11.3} {:>7.2}x {:>12.0} {:>9.2} {:>13.4} {:>7.2}x",
            ty.to_string(),
            ts * 1e3,
            tv * 1e3,
            ts / tv,
            rows as f64 / tv,
            (rb * rows) as f64 / tv / 1e9,
            tb * 1e3,
            tv / tb
        );
    }
}
