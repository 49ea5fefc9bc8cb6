//! Tests of [`expf`] and [`expf_slice`]: the scalar port against the C library's `expf` (what
//! `f32::exp` calls) over a dense sample, every vector path against the scalar port, and
//! ignored exhaustive and speed checks.

use std::hint::black_box;
use std::time::Instant;

use crate::tests::Rng;
use crate::*;

/// Whether `f32::exp` is glibc's FMA build of `expf`, the function [`expf`] reproduces: x86-64
/// glibc picks it when the CPU has FMA and AVX2.
fn libm_is_glibc_fma() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
    {
        is_x86_feature_detected!("fma") && is_x86_feature_detected!("avx2")
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Inputs at and next to every boundary of the algorithm, signed zeros, infinities, NaNs
/// (quiet, signalling, with payloads, negative), extremes and subnormals.
fn edge_inputs() -> Vec<f32> {
    let centres: [u32; 14] = [
        0x42b1_7217, // overflow threshold 0x1.62e42ep6
        0xc2cf_f1b4, // underflow threshold -0x1.9fe368p6
        0xc2ce_8ecf, // smallest-subnormal threshold -0x1.9d1d9ep6
        0x42b0_0000, // 88: special-case checks start
        0xc2b0_0000, // -88
        0xc2ae_ac50, // ~ln(2^-126): results turn subnormal
        0xc2b1_7218, // ~ln(2^-128)
        0xc2cf_0000, // ~-103.5
        0x3f80_0000, // 1
        0xbf80_0000, // -1
        0x3d31_7218, // ln2/32: table step
        0xbd31_7218,
        0x7f7f_ffff, // f32::MAX
        0xff7f_ffff, // f32::MIN
    ];
    let mut bits: Vec<u32> = centres
        .iter()
        .flat_map(|&c| (0..9u32).map(move |d| c.wrapping_add(d).wrapping_sub(4)))
        .collect();
    bits.extend([
        0x0000_0000, // 0
        0x8000_0000, // -0
        0x0000_0001, // smallest subnormal
        0x8000_0001,
        0x0080_0000, // smallest normal
        0x8080_0000,
        0x7f80_0000, // +inf
        0xff80_0000, // -inf
        0x7fc0_0000, // quiet NaN
        0xffc0_0000,
        0x7fc1_2345,
        0xff81_2345, // signalling NaN, negative, payload
        0x7f80_0001, // signalling NaN
        0x7fff_ffff,
        // The only inputs in [-104, 89] whose result changes if `k` and `r` come from the rounded
        // product `x * 32/ln2` instead of FMAs (found by the exhaustive tests).
        0xc27c_65d9, // -63.09946
        0x4202_422f, // 32.564632
    ]);
    bits.into_iter().map(f32::from_bits).collect()
}

/// Formats up to ten mismatches `(x, ours, theirs)` for a failure message.
fn describe(bad: &[(f32, f32, f32)], ours: &str, theirs: &str) -> String {
    let mut s = String::new();
    for &(x, a, b) in bad.iter().take(10) {
        s += &format!(
            "\n  x = {x:e} ({:#010x}): {ours} = {a:e} ({:#010x}), {theirs} = {b:e} ({:#010x})",
            x.to_bits(),
            a.to_bits(),
            b.to_bits()
        );
    }
    s
}

/// Compares [`expf`] with `f32::exp` on every `step`-th f32 bit pattern in `[lo, hi]` (both of
/// one sign, `lo` the smaller magnitude) and returns the mismatches.
fn scalar_vs_libm(lo: f32, hi: f32, step: usize) -> Vec<(f32, f32, f32)> {
    (lo.to_bits()..=hi.to_bits())
        .step_by(step)
        .map(f32::from_bits)
        .filter_map(|x| {
            let (a, b) = (expf(x), x.exp());
            (a.to_bits() != b.to_bits()).then_some((x, a, b))
        })
        .collect()
}

#[test]
fn scalar_matches_glibc_expf() {
    if !libm_is_glibc_fma() {
        eprintln!("skipped: f32::exp here is not glibc's FMA expf");
        return;
    }
    let mut bad = scalar_vs_libm(-0.0, -104.0, 97);
    bad.extend(scalar_vs_libm(0.0, 89.0, 97));
    for x in edge_inputs() {
        let (a, b) = (expf(x), x.exp());
        if a.to_bits() != b.to_bits() {
            bad.push((x, a, b));
        }
    }
    assert!(
        bad.is_empty(),
        "{} inputs where hmoe_quant::expf differs from f32::exp (glibc expf) bit for bit:{}",
        bad.len(),
        describe(&bad, "expf", "f32::exp")
    );
}

#[test]
fn scalar_special_cases() {
    assert_eq!(expf(0.0), 1.0);
    assert_eq!(expf(-0.0), 1.0);
    assert_eq!(expf(f32::NEG_INFINITY).to_bits(), 0);
    assert_eq!(expf(f32::INFINITY), f32::INFINITY);
    assert!(expf(f32::NAN).is_nan());
    let top = expf(f32::from_bits(0x42b1_7217));
    assert!(top.is_finite() && top > 3.4e38, "{top}");
    assert_eq!(expf(f32::from_bits(0x42b1_7218)), f32::INFINITY);
    assert_eq!(expf(f32::from_bits(0xc2cf_f1b4)).to_bits(), 1);
    assert_eq!(expf(f32::from_bits(0xc2cf_f1b5)).to_bits(), 0);
    assert_eq!(expf(-1.0), (-1.0f64).exp() as f32);
}

/// A random input: mostly softmax-range values, some anywhere in the main-path range, some
/// edge values and some arbitrary bit patterns (NaNs included).
fn random_input(rng: &mut Rng, edges: &[f32]) -> f32 {
    let unit = (rng.u64() >> 40) as f32 / (1u64 << 24) as f32;
    match rng.below(8) {
        0..=3 => -87.0 * unit,
        4 | 5 => -104.5 + 194.0 * unit,
        6 => edges[rng.below(edges.len() as u64) as usize],
        _ => f32::from_bits(rng.u64() as u32),
    }
}

#[test]
fn every_isa_matches_scalar() {
    let edges = edge_inputs();
    let mut rng = Rng(0x5eed_e4bf);
    let lens = [
        0usize, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 23, 31, 33, 64, 100, 1001, 4099,
    ];
    let mut inputs: Vec<Vec<f32>> = Vec::new();
    for _ in 0..8 {
        for &n in &lens {
            inputs.push((0..n).map(|_| random_input(&mut rng, &edges)).collect());
        }
    }
    // Whole vectors of only softmax-range values (the no-special-lane path).
    inputs.push((0..4096).map(|i| -87.0 * i as f32 / 4095.0).collect());
    // Every edge value in every lane position next to ordinary values.
    inputs.push(
        edges
            .iter()
            .flat_map(|&e| [e, -1.5, 0.25, -30.0, e])
            .collect(),
    );
    for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
        if !isa.is_available() {
            assert_eq!(
                expf_slice_with(isa, &mut [0.0]),
                Err(QuantError::IsaUnavailable(isa))
            );
            continue;
        }
        for xs in &inputs {
            let mut got = xs.clone();
            expf_slice_with(isa, &mut got).unwrap();
            let bad: Vec<_> = xs
                .iter()
                .zip(&got)
                .map(|(&x, &g)| (x, g, expf(x)))
                .filter(|(_, g, e)| g.to_bits() != e.to_bits())
                .collect();
            assert!(
                bad.is_empty(),
                "{isa}: expf_slice differs from scalar expf in {} of {} elements:{}",
                bad.len(),
                xs.len(),
                describe(&bad, &format!("expf_slice/{isa}"), "expf")
            );
        }
    }
    let mut best = inputs[3].clone();
    expf_slice(&mut best);
    let want: Vec<u32> = inputs[3].iter().map(|&x| expf(x).to_bits()).collect();
    assert_eq!(best.iter().map(|y| y.to_bits()).collect::<Vec<_>>(), want);
}

/// Every f32 in `[lo, hi]` (one sign; `lo` the smaller magnitude) through [`expf`] and every
/// available [`expf_slice_with`] path, against `f32::exp`.
fn exhaustive(lo: f32, hi: f32) {
    assert!(libm_is_glibc_fma(), "f32::exp here is not glibc's FMA expf");
    let isas = Isa::available();
    let mut bad = Vec::new();
    let mut xs = Vec::with_capacity(4096);
    let mut ys = Vec::with_capacity(4096);
    let mut bits = lo.to_bits();
    let last = hi.to_bits();
    loop {
        xs.clear();
        while xs.len() < 4096 && bits <= last {
            xs.push(f32::from_bits(bits));
            bits += 1;
        }
        if xs.is_empty() {
            break;
        }
        let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
        for (&x, &w) in xs.iter().zip(&want) {
            let a = expf(x);
            if a.to_bits() != w.to_bits() {
                bad.push((x, a, w));
            }
        }
        for &isa in &isas {
            ys.clone_from(&xs);
            expf_slice_with(isa, &mut ys).unwrap();
            for ((&x, &y), &w) in xs.iter().zip(&ys).zip(&want) {
                if y.to_bits() != w.to_bits() {
                    bad.push((x, y, w));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} results differ from f32::exp (glibc expf) in [{lo}, {hi}]:{}",
        bad.len(),
        describe(&bad, "expf or expf_slice", "f32::exp")
    );
}

#[test]
#[ignore = "exhaustive: ~1.1e9 inputs, tens of seconds"]
fn exhaustive_negative_matches_glibc() {
    exhaustive(-0.0, -104.0);
}

#[test]
#[ignore = "exhaustive: ~1.1e9 inputs, tens of seconds"]
fn exhaustive_positive_matches_glibc() {
    exhaustive(0.0, 89.0);
}

#[test]
#[ignore = "timing, prints ns per element"]
fn speed() {
    let mut rng = Rng(7);
    let xs: Vec<f32> = (0..4096)
        .map(|_| -30.0 * (rng.u64() >> 40) as f32 / (1u64 << 24) as f32)
        .collect();
    let reps = 2000;
    let time = |f: &mut dyn FnMut(&mut [f32])| {
        let mut ys = xs.clone();
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                ys.copy_from_slice(&xs);
                f(black_box(&mut ys));
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        best * 1e9 / (reps * xs.len()) as f64
    };
    let libm = time(&mut |ys| ys.iter_mut().for_each(|y| *y = y.exp()));
    let copy = time(&mut |_| {});
    let scalar = time(&mut |ys| ys.iter_mut().for_each(|y| *y = expf(*y)));
    println!("4096 values in [-30, 0], ns per element (incl. {copy:.3} ns copy):");
    println!("  f32::exp (libm)  {libm:.3}");
    println!("  expf (portable)  {scalar:.3}");
    for isa in Isa::available() {
        let t = time(&mut |ys| expf_slice_with(isa, ys).unwrap());
        println!("  expf_slice/{isa:<7}{t:.3}");
    }
}
