//! The sampler chain's stages beyond the basic cuts: locally typical sampling, XTC, top-n-sigma
//! and mirostat's truncations, and the stage names llama-server reads from `samplers`. Each
//! works on a candidate list the way llama.cpp's sampler of the same name does.

use std::cmp::Ordering;

/// One stage of the chain, in llama-server's vocabulary (`samplers`, `--samplers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplerStage {
    /// The repetition penalty (`penalties`).
    Penalties,
    /// DRY, the "don't repeat yourself" penalty (`dry`).
    Dry,
    /// Keep tokens within n standard deviations of the top logit (`top_n_sigma`).
    TopNSigma,
    /// Keep the k most likely (`top_k`).
    TopK,
    /// Locally typical sampling (`typ_p`).
    TypicalP,
    /// Nucleus sampling (`top_p`).
    TopP,
    /// Drop tokens below a share of the top probability (`min_p`).
    MinP,
    /// Exclude top choices (`xtc`).
    Xtc,
    /// Scale the logits (`temperature`).
    Temperature,
}

impl SamplerStage {
    /// llama-server's default order (`edskypmxt`).
    pub const DEFAULT_ORDER: [SamplerStage; 9] = [
        SamplerStage::Penalties,
        SamplerStage::Dry,
        SamplerStage::TopNSigma,
        SamplerStage::TopK,
        SamplerStage::TypicalP,
        SamplerStage::TopP,
        SamplerStage::MinP,
        SamplerStage::Xtc,
        SamplerStage::Temperature,
    ];

    /// llama-server's name of the stage.
    pub fn name(self) -> &'static str {
        match self {
            SamplerStage::Penalties => "penalties",
            SamplerStage::Dry => "dry",
            SamplerStage::TopNSigma => "top_n_sigma",
            SamplerStage::TopK => "top_k",
            SamplerStage::TypicalP => "typ_p",
            SamplerStage::TopP => "top_p",
            SamplerStage::MinP => "min_p",
            SamplerStage::Xtc => "xtc",
            SamplerStage::Temperature => "temperature",
        }
    }

    /// The stage a name stands for: llama-server's names and the other spellings it accepts in
    /// a request (`top-k`, `nucleus`, `typical`, `temp`, ...).
    pub fn from_name(name: &str) -> Option<SamplerStage> {
        let stage = match name {
            "top-k" => SamplerStage::TopK,
            "top-p" | "nucleus" => SamplerStage::TopP,
            "typical-p" | "typical" | "typ-p" | "typ" => SamplerStage::TypicalP,
            "min-p" => SamplerStage::MinP,
            "temp" => SamplerStage::Temperature,
            _ => return Self::DEFAULT_ORDER.into_iter().find(|s| s.name() == name),
        };
        Some(stage)
    }

    /// The stage of a letter of the short form (`"edskypmxt"`).
    pub fn from_char(c: char) -> Option<SamplerStage> {
        let i = "edskypmxt".find(c)?;
        Some(Self::DEFAULT_ORDER[i])
    }
}

/// Which mirostat, if any, replaces the chain (llama.cpp: temperature, then mirostat draws).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mirostat {
    /// The chain of [`SamplerStage`]s.
    #[default]
    Off = 0,
    /// Mirostat 1.0: a top-k whose k follows the estimated Zipf exponent and the target
    /// surprise.
    V1 = 1,
    /// Mirostat 2.0: keeps tokens whose surprise is at most the running target.
    V2 = 2,
}

/// Candidates with their logits; `sorted` when most likely first (ties: lower id first).
pub(crate) struct Cands {
    pub v: Vec<(u32, f32)>,
    pub sorted: bool,
}

/// The order candidates are ranked in: most likely first, ties by id (a total order over
/// distinct ids, NaNs included, so every selection by it has one answer).
fn rank(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

impl Cands {
    /// Sorts most likely first, ties by id.
    pub fn sort(&mut self) {
        if !self.sorted {
            self.v.sort_by(rank);
            self.sorted = true;
        }
    }

    /// Keeps the first `k` candidates in rank order, sorted: what [`Cands::sort`] and then
    /// `truncate(k)` leave, without sorting the whole vocabulary (see [`Cands::top_of`]).
    pub fn keep_top(&mut self, k: usize) {
        if self.sorted || k == 0 || k >= self.v.len() {
            self.sort();
            self.v.truncate(k);
            return;
        }
        *self = Cands::top_of(self.v.iter().copied(), k);
    }

    /// The first `k` (≥ 1) of `cands` in rank order, sorted. One pass keeps a buffer of at
    /// most `2k` candidates that rank before the `k`-th best seen so far, cut back to `k` (a
    /// linear-time selection) whenever it fills: O(n) for any input order.
    pub fn top_of(cands: impl Iterator<Item = (u32, f32)>, k: usize) -> Cands {
        let k = k.max(1);
        let mut buf: Vec<(u32, f32)> = Vec::with_capacity(2 * k);
        let mut kth: Option<(u32, f32)> = None;
        // The k-th best logit as a plain float: a logit below it (a float comparison, false
        // for NaNs) ranks after the k-th best, so most of the vocabulary costs one compare.
        let mut below = f32::NEG_INFINITY;
        for c in cands {
            if c.1 < below || kth.is_some_and(|w| rank(&c, &w) != Ordering::Less) {
                continue;
            }
            buf.push(c);
            if buf.len() == 2 * k {
                buf.select_nth_unstable_by(k - 1, rank);
                buf.truncate(k);
                kth = Some(buf[k - 1]);
                below = buf[k - 1].1;
            }
        }
        buf.sort_by(rank);
        buf.truncate(k);
        Cands {
            v: buf,
            sorted: true,
        }
    }
}

/// Softmax of the candidates' logits at `temperature`, in f64.
pub(crate) fn softmax(cand: &[(u32, f32)], temperature: f32) -> Vec<f64> {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max) as f64;
    let t = temperature as f64;
    let e: Vec<f64> = cand
        .iter()
        .map(|c| ((c.1 as f64 - max) / t).exp())
        .collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

/// Locally typical sampling: the tokens whose surprise is closest to the distribution's
/// entropy, fewest first, until their probability passes `p` (and at least `min_keep`).
pub(crate) fn typical(c: &mut Cands, p: f32, min_keep: usize, temp: f32) {
    if p >= 1.0 {
        return;
    }
    c.sort();
    let probs = softmax(&c.v, temp);
    let entropy: f64 = probs
        .iter()
        .filter(|&&q| q > 0.0)
        .map(|&q| -q * q.ln())
        .sum();
    let score = |q: f64| (-q.ln() - entropy).abs();
    let mut order: Vec<usize> = (0..c.v.len()).collect();
    order.sort_by(|&a, &b| score(probs[a]).total_cmp(&score(probs[b])));
    let mut cum = 0.0;
    let keep = (order.iter().enumerate())
        .position(|(n, &i)| {
            cum += probs[i];
            cum > p as f64 && n + 1 >= min_keep
        })
        .map_or(order.len(), |i| i + 1);
    c.v = order[..keep].iter().map(|&i| c.v[i]).collect();
    c.sorted = false;
}

/// XTC: with chance `chance` ≤ `probability`, removes every token at or above `threshold`
/// but the least likely of them, when at least `min_keep` tokens remain. `chance` is drawn only when the stage can act (llama.cpp's
/// order of draws).
pub(crate) fn xtc(
    c: &mut Cands,
    probability: f32,
    threshold: f32,
    min_keep: usize,
    temp: f32,
    chance: impl FnOnce() -> f32,
) {
    if probability <= 0.0 || threshold > 0.5 || c.v.len() < 2 {
        return;
    }
    if chance() > probability {
        return;
    }
    c.sort();
    let probs = softmax(&c.v, temp);
    let above = probs.iter().take_while(|&&q| q >= threshold as f64).count();
    if above > 1 && c.v.len() - (above - 1) >= min_keep {
        c.v.drain(..above - 1);
    }
}

/// Top-n-sigma: keeps the tokens whose logit is within `n` standard deviations of the top one
/// (the statistics over the finite logits).
pub(crate) fn top_n_sigma(c: &mut Cands, n: f32) {
    if n <= 0.0 || c.v.len() <= 1 {
        return;
    }
    let finite: Vec<f64> = (c.v.iter())
        .map(|x| x.1 as f64)
        .filter(|l| *l != f64::NEG_INFINITY)
        .collect();
    if finite.is_empty() {
        return;
    }
    let max = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mean = finite.iter().sum::<f64>() / finite.len() as f64;
    let var = finite.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / finite.len() as f64;
    let floor = max - n as f64 * var.sqrt();
    c.v.retain(|x| x.1 as f64 >= floor);
}

/// Mirostat 1.0's k for sorted probabilities: the Zipf exponent estimated from the `m` most
/// likely tokens, the target surprise `mu` and the vocabulary size.
pub(crate) fn mirostat_v1_k(probs: &[f64], mu: f32, n_vocab: usize, m: usize) -> usize {
    let (mut sum_tb, mut sum_tt) = (0.0f64, 0.0f64);
    for i in 0..(m - 1).min(probs.len().saturating_sub(1)) {
        let t = ((i + 2) as f64 / (i + 1) as f64).ln();
        let b = (probs[i] / probs[i + 1]).ln();
        sum_tb += t * b;
        sum_tt += t * t;
    }
    let s_hat = sum_tb / sum_tt;
    let eps = s_hat - 1.0;
    let k = ((eps * 2f64.powf(mu as f64)) / (1.0 - (n_vocab as f64).powf(-eps))).powf(1.0 / s_hat);
    // A NaN or negative k keeps one token, as llama.cpp's `max(int(k), 1)` does.
    if k.is_finite() && k >= 1.0 {
        (k as usize).min(probs.len())
    } else if k.is_infinite() && k > 0.0 {
        probs.len()
    } else {
        1
    }
}

/// Mirostat 2.0: how many of the sorted probabilities have a surprise (bits) of at most `mu`;
/// at least one.
pub(crate) fn mirostat_v2_keep(probs: &[f64], mu: f32) -> usize {
    probs
        .iter()
        .take_while(|&&q| -q.log2() <= mu as f64)
        .count()
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits with ties, infinities, signed zeros and NaNs: every ranking corner.
    fn awkward_logits(n: usize, seed: u64) -> Vec<(u32, f32)> {
        let mut x = seed | 1;
        (0..n as u32)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let l = match x % 16 {
                    0 => f32::NEG_INFINITY,
                    1 => f32::NAN,
                    2 => -0.0,
                    3 => 0.0,
                    4 => f32::INFINITY,
                    5..=8 => (x % 5) as f32,
                    _ => ((x >> 20) % 2000) as f32 / 37.0 - 20.0,
                };
                (i, l)
            })
            .collect()
    }

    #[test]
    fn keep_top_is_sort_then_truncate() {
        for (n, seed) in [(1, 1), (7, 2), (100, 3), (1000, 4), (5000, 5)] {
            let v = awkward_logits(n, seed);
            for order in [0, 1, 2] {
                let mut v = v.clone();
                match order {
                    1 => v.reverse(),
                    2 => v.sort_by(|a, b| a.1.total_cmp(&b.1)), // worst first: every one inserts
                    _ => {}
                }
                for k in [1, 2, 3, 40, n.saturating_sub(1), n, n + 3] {
                    let mut want = Cands {
                        v: v.clone(),
                        sorted: false,
                    };
                    want.sort();
                    want.v.truncate(k);
                    let mut got = Cands {
                        v: v.clone(),
                        sorted: false,
                    };
                    got.keep_top(k);
                    assert!(got.sorted);
                    let bits = |c: &Cands| -> Vec<(u32, u32)> {
                        c.v.iter().map(|&(i, l)| (i, l.to_bits())).collect()
                    };
                    assert_eq!(bits(&got), bits(&want), "n {n} k {k} order {order}");
                }
            }
        }
    }

    fn cands(probs: &[f32]) -> Cands {
        Cands {
            v: probs
                .iter()
                .enumerate()
                .map(|(i, p)| (i as u32, p.ln()))
                .collect(),
            sorted: false,
        }
    }

    fn ids(c: &Cands) -> Vec<u32> {
        c.v.iter().map(|x| x.0).collect()
    }

    #[test]
    fn names_and_letters_round_trip() {
        for (i, s) in SamplerStage::DEFAULT_ORDER.into_iter().enumerate() {
            assert_eq!(SamplerStage::from_name(s.name()), Some(s));
            assert_eq!(
                SamplerStage::from_char("edskypmxt".as_bytes()[i] as char),
                Some(s)
            );
        }
        assert_eq!(SamplerStage::from_name("nucleus"), Some(SamplerStage::TopP));
        assert_eq!(
            SamplerStage::from_name("temp"),
            Some(SamplerStage::Temperature)
        );
        assert_eq!(SamplerStage::from_name("infill"), None);
        assert_eq!(SamplerStage::from_char('i'), None);
    }

    #[test]
    fn typical_keeps_the_tokens_nearest_the_entropy() {
        // p = 0.5, 0.3, 0.2: entropy 1.0297 nats; |surprise - entropy| = 0.337, 0.174, 0.580,
        // so the order is 1, 0, 2 and the mass passes 0.5 after two tokens, 0.2 after one.
        let mut c = cands(&[0.5, 0.3, 0.2]);
        typical(&mut c, 0.5, 0, 1.0);
        assert_eq!(ids(&c), vec![1, 0]);
        let mut c = cands(&[0.5, 0.3, 0.2]);
        typical(&mut c, 0.2, 0, 1.0);
        assert_eq!(ids(&c), vec![1]);
        let mut c = cands(&[0.5, 0.3, 0.2]);
        typical(&mut c, 0.2, 3, 1.0);
        assert_eq!(ids(&c), vec![1, 0, 2]);
        let mut c = cands(&[0.5, 0.3, 0.2]);
        typical(&mut c, 1.0, 0, 1.0);
        assert_eq!(ids(&c), vec![0, 1, 2]);
    }

    #[test]
    fn xtc_removes_all_top_choices_but_the_last() {
        let mut c = cands(&[0.5, 0.3, 0.15, 0.05]);
        xtc(&mut c, 1.0, 0.1, 0, 1.0, || 0.5);
        assert_eq!(ids(&c), vec![2, 3]);
        // Removing would leave fewer than min_keep: no effect.
        let mut c = cands(&[0.5, 0.3, 0.15, 0.05]);
        xtc(&mut c, 1.0, 0.1, 3, 1.0, || 0.5);
        assert_eq!(c.v.len(), 4);
        // One token above the threshold: nothing to exclude.
        let mut c = cands(&[0.5, 0.3, 0.15, 0.05]);
        xtc(&mut c, 1.0, 0.4, 0, 1.0, || 0.5);
        assert_eq!(ids(&c), vec![0, 1, 2, 3]);
        // The chance is above the probability: no effect.
        let mut c = cands(&[0.5, 0.3, 0.15, 0.05]);
        xtc(&mut c, 0.25, 0.1, 0, 1.0, || 0.5);
        assert_eq!(c.v.len(), 4);
        // Off: the chance is not drawn.
        let mut c = cands(&[0.5, 0.3]);
        xtc(&mut c, 0.0, 0.1, 0, 1.0, || unreachable!());
        xtc(&mut c, 1.0, 0.6, 0, 1.0, || unreachable!());
    }

    #[test]
    fn top_n_sigma_cuts_below_the_band() {
        // logits 4, 2, 0, -2: mean 1, std sqrt(5) = 2.236; n = 1 keeps logits >= 1.764.
        let mut c = Cands {
            v: vec![
                (0, 4.0),
                (1, 2.0),
                (2, 0.0),
                (3, -2.0),
                (4, f32::NEG_INFINITY),
            ],
            sorted: false,
        };
        top_n_sigma(&mut c, 1.0);
        assert_eq!(ids(&c), vec![0, 1]);
    }

    #[test]
    fn mirostat_truncations() {
        // Zipf with exponent 2 over 8 tokens: s_hat = 2, eps = 1, mu = 2:
        // k = (2^2 / (1 - 1/8))^(1/2) = 2.14 -> 2.
        let z: Vec<f64> = (1..=8).map(|i| 1.0 / (i * i) as f64).collect();
        let sum: f64 = z.iter().sum();
        let probs: Vec<f64> = z.iter().map(|p| p / sum).collect();
        assert_eq!(mirostat_v1_k(&probs, 2.0, 8, 100), 2);
        assert_eq!(mirostat_v1_k(&probs, 6.0, 8, 100), 8);
        // Surprises 1, 2, 3, 3 bits.
        let probs = [0.5, 0.25, 0.125, 0.125];
        assert_eq!(mirostat_v2_keep(&probs, 2.0), 2);
        assert_eq!(mirostat_v2_keep(&probs, 0.5), 1);
        assert_eq!(mirostat_v2_keep(&probs, 3.0), 4);
    }
}
