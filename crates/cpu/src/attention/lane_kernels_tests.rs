//! Tests of the lane kernels: every ISA against the row-at-a-time arithmetic, bit for bit.

use super::*;

/// Deterministic values in [-8, 8).
fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 19) as f32 - 8.0
        })
        .collect()
}

/// The row-at-a-time block step (hmoe-backend's `softmax_block`), lane by lane: the
/// reference.
fn reference(
    m: &mut [f32; SOFTMAX_LANES],
    s: &mut [f32; SOFTMAX_LANES],
    raw: &[[f32; SOFTMAX_LANES]],
    scale: f32,
    (from, to): ([i32; SOFTMAX_LANES], [i32; SOFTMAX_LANES]),
) -> LaneBlock {
    let n = raw.len();
    let mut out = LaneBlock {
        p: vec![[0.0; SOFTMAX_LANES]; n],
        seen: vec![0; n],
        ..LaneBlock::default()
    };
    for l in 0..SOFTMAX_LANES {
        let lo = (from[l].max(0) as usize).min(n);
        let visible = lo..(to[l].max(0) as usize).clamp(lo, n);
        let scores: Vec<f32> = raw[visible.clone()].iter().map(|r| r[l] * scale).collect();
        let big = scores.iter().fold(m[l], |b, &x| if x > b { x } else { b });
        out.ms[l] = if big > m[l] {
            hmoe_quant::expf(m[l] - big)
        } else {
            1.0
        };
        s[l] *= out.ms[l];
        for (i, &x) in visible.clone().zip(&scores) {
            out.p[i][l] = hmoe_quant::expf(x - big);
            s[l] += out.p[i][l];
            out.seen[i] |= 1 << l;
        }
        m[l] = big;
    }
    out.every = out.seen.iter().all(|&b| b == u8::MAX);
    out
}

/// Every ISA this CPU has.
fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|isa| isa.is_available())
        .collect()
}

/// `v` as f16 (and back, exactly), and the offsets of `n` heads of `d` elements spread
/// over it out of order, `gap` elements apart.
fn heads(v: &[f32], n: usize, d: usize, gap: usize) -> (Vec<f16>, Vec<usize>) {
    let h = v.iter().map(|&x| f16::from_f32(x)).collect();
    let at = (0..n).map(|i| (i * 7 % n) * (d + gap)).collect();
    (h, at)
}

#[test]
fn lane_scores_are_one_fma_chain_per_key_and_row() {
    // Heads of 64 (gpt-oss), 80, 72 (a tail of 8 only), 20 (a tail shorter than 8) and
    // 300 (longer than the vector kernels take); whole groups, a short last group, one key.
    for kd in [64, 80, 72, 20, 300] {
        for n in [32, 13, 1] {
            let qt = noise(3, kd * SOFTMAX_LANES);
            let gap = 5;
            let cache = noise(4, n * (kd + gap));
            let (half, at) = heads(&cache, n, kd, gap);
            let half_f32: Vec<f32> = half.iter().map(|h| h.to_f32()).collect();
            for isa in isas() {
                for (keys, exact) in [
                    (LaneHeads::F32(&cache), &cache),
                    (LaneHeads::F16(&half), &half_f32),
                ] {
                    let mut out = vec![[0f32; SOFTMAX_LANES]; n];
                    let ahead = Ahead::of(keys, 0..kd * 3);
                    lane_scores_on(isa, &qt, keys, &at, kd, &mut out, ahead);
                    for (i, o) in out.iter().enumerate() {
                        for (l, &got) in o.iter().enumerate() {
                            let k = &exact[at[i]..at[i] + kd];
                            let want = (0..kd)
                                .fold(0f32, |s, e| qt[e * SOFTMAX_LANES + l].mul_add(k[e], s));
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{isa:?} kd {kd} n {n} key {i} lane {l}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn lane_values_step_each_row_as_the_scalar_code() {
    // Heads of 64 (every kernel), 88 (AVX2's, not AVX-512's), 20 (the scalar code's); all
    // rows and fewer; blocks every lane sees whole, and blocks with keys some lanes do
    // not see.
    for vd in [64, 88, 20] {
        for rows in [SOFTMAX_LANES, 5] {
            for masked in [false, true] {
                let n = 37;
                let gap = 3;
                let cache = noise(5, n * (vd + gap));
                let (half, at) = heads(&cache, n, vd, gap);
                let w = noise(99, (n + 1) * SOFTMAX_LANES);
                let seen: Vec<u8> = (0..n)
                    .map(|i| match masked {
                        true => [u8::MAX, 0b1011_0110, 0, u8::MAX][i % 4],
                        false => u8::MAX,
                    })
                    .collect();
                let block = LaneBlock {
                    ms: std::array::from_fn(|l| [1.0, w[l].abs() / 8.0][l % 2]),
                    p: (0..n)
                        .map(|i| std::array::from_fn(|l| w[(i + 1) * SOFTMAX_LANES + l] / 8.0))
                        .collect(),
                    every: !masked,
                    seen,
                };
                let acc0 = noise(6, rows * vd);
                for values in [LaneHeads::F32(&cache), LaneHeads::F16(&half)] {
                    let mut want = acc0.clone();
                    scalar_values(&block, values, &at, vd, &mut want, rows, Ahead::default());
                    // The scalar code itself: per row, element and key.
                    let mut naive = acc0.clone();
                    for l in 0..rows {
                        for e in 0..vd {
                            let x = &mut naive[l * vd + e];
                            *x *= block.ms[l];
                            for (i, &a) in at.iter().enumerate() {
                                if block.seen[i] >> l & 1 == 1 {
                                    *x = values.get(a, e).mul_add(block.p[i][l], *x);
                                }
                            }
                        }
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&want), bits(&naive), "scalar vd {vd}");
                    for isa in isas() {
                        let mut got = acc0.clone();
                        let ahead = Ahead::of(values, 0..vd * 5);
                        lane_values_on(isa, &block, values, &at, vd, &mut got, rows, ahead);
                        let what = format!("{isa:?} vd {vd} rows {rows} masked {masked}");
                        assert_eq!(bits(&got), bits(&want), "{what}");
                    }
                }
            }
        }
    }
}

#[test]
fn lane_kernels_refuse_heads_outside_the_cache() {
    let cache = vec![0f32; 100];
    let qt = vec![0f32; 64 * SOFTMAX_LANES];
    let mut out = vec![[0f32; SOFTMAX_LANES]; 1];
    let keys = LaneHeads::F32(&cache);
    let past_end = std::panic::catch_unwind(|| {
        lane_scores(&qt, keys, &[40], 64, &mut out.clone(), Ahead::default())
    });
    assert!(past_end.is_err(), "a key past the cache");
    lane_scores(&qt, keys, &[36], 64, &mut out, Ahead::of(keys, 90..1000));
    let mut acc = vec![0f32; 64];
    let block = LaneBlock {
        p: vec![[0.0; SOFTMAX_LANES]],
        seen: vec![u8::MAX],
        ..LaneBlock::default()
    };
    let past_end = std::panic::catch_unwind(move || {
        lane_values(
            &block,
            keys,
            &[usize::MAX],
            64,
            &mut acc,
            1,
            Ahead::default(),
        )
    });
    assert!(past_end.is_err(), "a value head past the cache");
}

#[test]
fn softmax_lanes_are_the_row_step_lane_by_lane() {
    // Blocks of one key, a whole block (32) and a long one; a fresh state (−∞ maxima)
    // and a running one that the block does and does not raise; lanes that see every key,
    // a window, none; and scores with NaN and infinities.
    for n in [1, 32, 71] {
        let mut scores = noise(1, n * SOFTMAX_LANES);
        for (i, x) in [(5, f32::NAN), (77, f32::INFINITY), (130, f32::NEG_INFINITY)] {
            if i < scores.len() {
                scores[i] = x;
            }
        }
        let raw: Vec<[f32; SOFTMAX_LANES]> = scores
            .chunks_exact(SOFTMAX_LANES)
            .map(|c| c.try_into().unwrap())
            .collect();
        let from = [0, 0, 3, 40, 0, 70, 0, 10];
        let to = [n as i32, 33, 50, 41, 0, 71, n as i32, 5];
        for isa in isas() {
            for (m0, s0) in [(f32::NEG_INFINITY, 0.0), (1.5, 2.25), (9.0, 0.5)] {
                let (mut m, mut s) = ([m0; SOFTMAX_LANES], [s0; SOFTMAX_LANES]);
                let (mut want_m, mut want_s) = (m, s);
                let want = reference(&mut want_m, &mut want_s, &raw, 0.125, (from, to));
                let mut got = LaneBlock::default();
                softmax_lanes_on(isa, &mut m, &mut s, &raw, 0.125, (from, to), &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let what = format!("{isa:?} n {n} m {m0}");
                assert_eq!(bits(&m), bits(&want_m), "{what}: maxima");
                assert_eq!(bits(&s), bits(&want_s), "{what}: sums");
                assert_eq!(bits(&got.ms), bits(&want.ms), "{what}: ms");
                assert_eq!(got.seen, want.seen, "{what}: seen");
                assert_eq!(got.every, want.every, "{what}: every");
                let probs = |b: &LaneBlock| bits(b.p.as_flattened());
                assert_eq!(probs(&got), probs(&want), "{what}: probabilities");
            }
        }
        // A block every lane sees whole is marked so.
        let mut got = LaneBlock::default();
        let all = ([0; SOFTMAX_LANES], [n as i32; SOFTMAX_LANES]);
        let (mut m, mut s) = ([0.0; SOFTMAX_LANES], [0.0; SOFTMAX_LANES]);
        softmax_lanes(&mut m, &mut s, &raw, 0.125, all, &mut got);
        assert!(got.every, "n {n}");
    }
}
