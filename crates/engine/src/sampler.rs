//! Token sampling with llama.cpp's chain, in llama-server's default order: repetition
//! penalty → DRY → top-n-sigma → top-k → locally typical → top-p → min-p → XTC →
//! temperature → draw ([`SamplerParams::order`] reorders it), or temperature → mirostat. A
//! temperature of 0 (or below) keeps only the most likely token left at that point.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::dry::DryParams;
use crate::sampler_stages::{
    mirostat_v1_k, mirostat_v2_keep, softmax, top_n_sigma, typical, xtc, Cands, Mirostat,
    SamplerStage,
};

/// Sampling settings (llama-server's defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    /// Temperature; ≤ 0 means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens below `min_p` × the top probability (0 = off).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recent tokens by this (1 = off).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    /// Locally typical sampling's mass (`typical_p`; 1 = off).
    pub typical_p: f32,
    /// Keep logits within this many standard deviations of the top one (`top_n_sigma`;
    /// ≤ 0 = off).
    pub top_n_sigma: f32,
    /// XTC's chance of acting at a step (`xtc_probability`; 0 = off).
    pub xtc_probability: f32,
    /// XTC's probability threshold (`xtc_threshold`; above 0.5 = off).
    pub xtc_threshold: f32,
    /// The DRY penalty.
    pub dry: DryParams,
    /// Mirostat in place of the chain.
    pub mirostat: Mirostat,
    /// Mirostat's target surprise in bits (`mirostat_tau`).
    pub mirostat_tau: f32,
    /// Mirostat's learning rate (`mirostat_eta`).
    pub mirostat_eta: f32,
    /// Fewest tokens top-p, min-p, locally typical sampling and XTC leave (`min_keep`).
    pub min_keep: usize,
    /// The chain's stages in order (`samplers`); a stage left out does not run.
    pub order: Vec<SamplerStage>,
    /// Random seed.
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            typical_p: 1.0,
            top_n_sigma: -1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            dry: DryParams::default(),
            mirostat: Mirostat::Off,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            min_keep: 0,
            order: SamplerStage::DEFAULT_ORDER.to_vec(),
            seed: 0xFFFF_FFFF,
        }
    }
}

/// Tokens mirostat 1.0 estimates the Zipf exponent from (llama.cpp's `m`).
const MIROSTAT_M: usize = 100;

/// A stateful sampler: remembers the context for the penalties, owns its RNGs (the draw's and
/// XTC's, as llama.cpp's samplers each have one) and mirostat's running target.
pub struct Sampler {
    params: SamplerParams,
    rng: StdRng,
    xtc_rng: StdRng,
    /// The context tokens the penalties look at, oldest first.
    recent: Vec<u32>,
    /// How many of `recent` to keep (`None`: all, for DRY over the whole context).
    keep: Option<usize>,
    /// Mirostat's target surprise, in bits.
    mu: f32,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplerParams) -> Sampler {
        let keep = match params.dry.enabled() {
            true => params
                .dry
                .penalty_last_n
                .map(|n| n.max(params.repeat_last_n)),
            false => Some(params.repeat_last_n),
        };
        Sampler {
            rng: StdRng::seed_from_u64(params.seed),
            xtc_rng: StdRng::seed_from_u64(params.seed),
            mu: 2.0 * params.mirostat_tau,
            params,
            recent: Vec::new(),
            keep,
        }
    }

    /// Records a token of the context (prompt or generated) for the penalties.
    pub fn accept(&mut self, token: u32) {
        self.recent.push(token);
        if let Some(keep) = self.keep {
            // Trimmed in bulk, so that a long context costs amortised constant time.
            if self.recent.len() > 2 * keep.max(32) {
                self.recent.drain(..self.recent.len() - keep);
            }
        }
    }

    /// Picks the next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.sample_from(Logits::Full(logits))
    }

    /// How many of a token's best logits this sampler's choice and [`Sampler::distribution`]
    /// depend on, when that is at most `bound`: 1 for greedy sampling (a temperature ≤ 0 that
    /// nothing before it can move off the first maximum) or top-k 1; the chain's `top_k` when
    /// top-k is its first stage that changes or drops a logit. `None` when the chain needs the
    /// whole vocabulary (mirostat, penalties or DRY before top-k, no top-k, a larger k).
    /// [`Sampler::sample_top`] on those best logits then picks what [`Sampler::sample`] on
    /// all of them picks.
    pub fn top_needed(&self, bound: usize) -> Option<usize> {
        let p = &self.params;
        if p.mirostat != Mirostat::Off {
            return None;
        }
        let k = match self.greedy_fast() && self.neutral_before(SamplerStage::Temperature) {
            true => 1,
            false if p.top_k > 0 && self.untouched_before_top_k() => p.top_k,
            false => return None,
        };
        (k <= bound).then_some(k)
    }

    /// [`Sampler::sample`] from a token's best logits alone: `top` holds the
    /// [`Sampler::top_needed`] best `(id, logit)` pairs (or every logit of a smaller
    /// vocabulary) in the candidates' rank order (by value with `total_cmp`, largest first,
    /// ties to the lower id), the best not NaN nor zero (where `>` and `total_cmp` disagree).
    pub fn sample_top(&mut self, top: &[(u32, f32)]) -> u32 {
        self.sample_from(Logits::Top(top))
    }

    /// [`Sampler::distribution`] from a token's best logits alone (see [`Sampler::sample_top`]).
    pub fn distribution_top(&self, top: &[(u32, f32)]) -> Vec<(u32, f64)> {
        self.distribution_from(Logits::Top(top))
    }

    fn sample_from(&mut self, logits: Logits<'_>) -> u32 {
        let mut xtc_rng = self.xtc_rng.clone();
        let chain = self.chain(logits, &mut xtc_rng);
        self.xtc_rng = xtc_rng;
        let (cand, probs) = match chain {
            Chain::Greedy(t) => return t,
            Chain::Draw(cand, probs) => (cand, probs),
        };
        let r: f64 = self.rng.random();
        let mut cum = 0.0;
        let mut pick = cand.len() - 1;
        for (i, q) in probs.iter().enumerate() {
            cum += q;
            if r < cum {
                pick = i;
                break;
            }
        }
        if self.params.mirostat != Mirostat::Off {
            let surprise = -probs[pick].log2() as f32;
            self.mu -= self.params.mirostat_eta * (surprise - self.params.mirostat_tau);
        }
        cand[pick].0
    }

    /// The tokens the next [`Sampler::sample`] chooses among, with their probabilities, most
    /// likely first (llama.cpp's post-sampling probabilities): what is left after the chain,
    /// at the temperature. Greedy sampling leaves the most likely token alone, with
    /// probability 1. XTC's random choice is the one the next `sample` makes.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        self.distribution_from(Logits::Full(logits))
    }

    fn distribution_from(&self, logits: Logits<'_>) -> Vec<(u32, f64)> {
        match self.chain(logits, &mut self.xtc_rng.clone()) {
            Chain::Greedy(t) => vec![(t, 1.0)],
            Chain::Draw(cand, probs) => {
                let mut d: Vec<(u32, f64)> = cand.into_iter().map(|c| c.0).zip(probs).collect();
                d.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                d
            }
        }
    }

    /// The context window of `n` tokens (`None`: all that is kept).
    fn window(&self, n: Option<usize>) -> &[u32] {
        let n = n.map_or(self.recent.len(), |n| n.min(self.recent.len()));
        &self.recent[self.recent.len() - n..]
    }

    /// Runs the chain up to the draw.
    fn chain(&self, logits: Logits<'_>, xtc_rng: &mut StdRng) -> Chain {
        let p = &self.params;
        let (logits, top) = match logits {
            Logits::Full(l) => (l, None),
            Logits::Top(t) => (&[][..], Some(t)),
        };
        let all = || logits.iter().enumerate().map(|(i, &l)| (i as u32, l));
        if p.mirostat != Mirostat::Off {
            // (Never from the best logits alone: `top_needed` says so.)
            let c = Cands {
                v: top.map_or_else(|| all().collect(), <[_]>::to_vec),
                sorted: false,
            };
            let n_vocab = logits.len().max(c.v.len());
            return self.mirostat(c, n_vocab);
        }
        let greedy_fast = self.greedy_fast();
        // When nothing before top-k changes a logit (the default chain), top-k selects
        // straight from the logits: the vocabulary is never copied or sorted. The best
        // logits alone (`top_needed`) are those candidates already.
        let mut c = match top {
            Some(t) => Cands {
                v: t.to_vec(),
                sorted: true,
            },
            None if p.top_k > 0 && !greedy_fast && self.untouched_before_top_k() => {
                Cands::top_of(all(), p.top_k)
            }
            None => Cands {
                v: all().collect(),
                sorted: false,
            },
        };
        let mut temp = 1.0f32;
        let mut greedy = false;
        for &stage in &p.order {
            if greedy_fast && stage == SamplerStage::Temperature {
                return Chain::Greedy(argmax(&c.v));
            }
            match stage {
                SamplerStage::Penalties => self.repetition_penalty(&mut c),
                SamplerStage::Dry => {
                    p.dry.apply(self.window(p.dry.penalty_last_n), &mut c.v);
                    c.sorted = false;
                }
                SamplerStage::TopNSigma => top_n_sigma(&mut c, p.top_n_sigma),
                SamplerStage::TopK if greedy_fast => {}
                SamplerStage::TopK if p.top_k > 0 => c.keep_top(p.top_k),
                SamplerStage::TopK => c.sort(),
                SamplerStage::TypicalP => typical(&mut c, p.typical_p, p.min_keep, temp),
                SamplerStage::TopP if greedy_fast || p.top_p >= 1.0 => {}
                SamplerStage::TopP => {
                    c.sort();
                    let probs = softmax(&c.v, temp);
                    let mut cum = 0.0;
                    let keep = (probs.iter().enumerate())
                        .position(|(i, &q)| {
                            cum += q;
                            cum >= p.top_p as f64 && i + 1 >= p.min_keep
                        })
                        .map_or(c.v.len(), |i| i + 1);
                    c.v.truncate(keep);
                }
                SamplerStage::MinP if greedy_fast || p.min_p <= 0.0 => {}
                SamplerStage::MinP => {
                    c.sort();
                    let probs = softmax(&c.v, temp);
                    let floor = probs[0] * p.min_p as f64;
                    let keep = probs.iter().take_while(|&&q| q >= floor).count();
                    let keep = keep.max(p.min_keep).max(1);
                    c.v.truncate(keep);
                }
                SamplerStage::Xtc => {
                    let (prob, threshold) = (p.xtc_probability, p.xtc_threshold);
                    xtc(&mut c, prob, threshold, p.min_keep, temp, || {
                        xtc_rng.random()
                    })
                }
                SamplerStage::Temperature if p.temperature <= 0.0 => {
                    c.v = vec![c.v[argmax_index(&c.v)]];
                    c.sorted = true;
                    greedy = true;
                }
                SamplerStage::Temperature => temp = p.temperature,
            }
        }
        // Later stages keep the one token a temperature of 0 leaves.
        if greedy {
            return Chain::Greedy(c.v[0].0);
        }
        let probs = softmax(&c.v, temp);
        Chain::Draw(c.v, probs)
    }

    /// Greedy without sorting the vocabulary: a temperature ≤ 0 in the chain and no stage
    /// before it that can drop the most likely token (locally typical sampling, XTC).
    fn greedy_fast(&self) -> bool {
        let p = &self.params;
        let mut before_temp = p
            .order
            .iter()
            .take_while(|&&s| s != SamplerStage::Temperature);
        p.temperature <= 0.0
            && p.order.contains(&SamplerStage::Temperature)
            && !before_temp.any(|s| match s {
                SamplerStage::TypicalP => p.typical_p < 1.0,
                SamplerStage::Xtc => p.xtc_probability > 0.0,
                _ => false,
            })
    }

    /// Whether the chain has a top-k stage and no stage before it changes or drops a logit
    /// (the repetition penalty at 1, DRY off, top-n-sigma off).
    fn untouched_before_top_k(&self) -> bool {
        let p = &self.params;
        p.order.contains(&SamplerStage::TopK)
            && (p.order.iter())
                .take_while(|&&s| s != SamplerStage::TopK)
                .all(|&s| self.neutral(s) == Some(true))
    }

    /// Whether no stage before `stage` changes a logit (the cuts may run: greedy skips them).
    fn neutral_before(&self, stage: SamplerStage) -> bool {
        (self.params.order.iter())
            .take_while(|&&s| s != stage)
            .all(|&s| self.neutral(s) != Some(false))
    }

    /// Whether a stage that changes logits leaves them as they are (`None`: a stage that
    /// only cuts or scales).
    fn neutral(&self, stage: SamplerStage) -> Option<bool> {
        let p = &self.params;
        match stage {
            SamplerStage::Penalties => Some(p.repeat_penalty == 1.0),
            SamplerStage::Dry => Some(!p.dry.enabled()),
            SamplerStage::TopNSigma => Some(p.top_n_sigma <= 0.0),
            _ => None,
        }
    }

    /// The repetition penalty over the last `repeat_last_n` context tokens.
    fn repetition_penalty(&self, c: &mut Cands) {
        let p = &self.params;
        if p.repeat_penalty == 1.0 {
            return;
        }
        let recent = self.window(Some(p.repeat_last_n));
        for (id, l) in c.v.iter_mut() {
            if recent.contains(id) {
                *l = if *l > 0.0 {
                    *l / p.repeat_penalty
                } else {
                    *l * p.repeat_penalty
                };
            }
        }
        c.sorted = false;
    }

    /// Temperature, then mirostat's truncation at the current target.
    fn mirostat(&self, mut c: Cands, n_vocab: usize) -> Chain {
        let p = &self.params;
        if p.temperature <= 0.0 {
            return Chain::Greedy(argmax(&c.v));
        }
        c.sort();
        let probs = softmax(&c.v, p.temperature);
        let keep = match p.mirostat {
            Mirostat::V1 => mirostat_v1_k(&probs, self.mu, n_vocab, MIROSTAT_M),
            _ => mirostat_v2_keep(&probs, self.mu),
        };
        c.v.truncate(keep);
        let probs = softmax(&c.v, p.temperature);
        Chain::Draw(c.v, probs)
    }
}

/// What the chain starts from.
#[derive(Clone, Copy)]
enum Logits<'a> {
    /// Every logit of the vocabulary.
    Full(&'a [f32]),
    /// The best ones, in rank order ([`Sampler::top_needed`]).
    Top(&'a [(u32, f32)]),
}

/// Where the chain leaves a draw.
enum Chain {
    /// A temperature of 0 left this token: no draw.
    Greedy(u32),
    /// Candidates and their probabilities.
    Draw(Vec<(u32, f32)>, Vec<f64>),
}

/// The first of the largest logits.
fn argmax_index(cand: &[(u32, f32)]) -> usize {
    let mut best = 0;
    for (i, c) in cand.iter().enumerate() {
        if c.1 > cand[best].1 {
            best = i;
        }
    }
    best
}

fn argmax(cand: &[(u32, f32)]) -> u32 {
    cand[argmax_index(cand)].0
}

#[cfg(test)]
#[path = "sampler_top_tests.rs"]
mod top_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DryParams;

    fn params(temperature: f32) -> SamplerParams {
        SamplerParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..SamplerParams::default()
        }
    }

    /// `s`'s distribution on `logits` is `want` (ids in order, probabilities to 1e-6).
    fn assert_distribution(s: &Sampler, logits: &[f32], want: &[(u32, f64)]) {
        let d = s.distribution(logits);
        let ids = |v: &[(u32, f64)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(ids(&d), ids(want), "{d:?}");
        assert!(
            d.iter().zip(want).all(|(a, b)| (a.1 - b.1).abs() < 1e-6),
            "{d:?}"
        );
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(params(0.0));
        assert_eq!(s.sample(&[0.0, 2.0, 2.0, 1.0]), 1);
        assert_eq!(s.distribution(&[0.0, 2.0, 2.0, 1.0]), vec![(1, 1.0)]);
    }

    #[test]
    fn distribution_is_what_is_left_after_the_chain() {
        // probabilities 0.5, 0.3, 0.2; top-k 2 keeps the first two, renormalised.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let s = Sampler::new(SamplerParams {
            top_k: 2,
            ..params(1.0)
        });
        assert_distribution(&s, &logits, &[(0, 0.625), (1, 0.375)]);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplerParams {
            top_k: 1,
            ..params(5.0)
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 3.0, 2.9]), 1);
        }
    }

    #[test]
    fn same_seed_same_draws_and_distribution_follows_probabilities() {
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let draw = |seed| {
            let mut s = Sampler::new(SamplerParams {
                seed,
                ..params(1.0)
            });
            (0..4000).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        let d = draw(7);
        let ones = d.iter().filter(|&&t| t == 1).count() as f64 / d.len() as f64;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        assert!(!d.contains(&2));
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // probabilities 0.5, 0.3, 0.2
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut s = Sampler::new(SamplerParams {
            top_p: 0.7,
            ..params(1.0)
        });
        assert!((0..500).all(|_| s.sample(&logits) != 2));
        let mut s = Sampler::new(SamplerParams {
            min_p: 0.5,
            ..params(1.0)
        });
        assert!((0..500).all(|_| s.sample(&logits) != 2));
        // min_keep holds a floor under both cuts.
        for (top_p, min_p) in [(0.1, 0.0), (1.0, 0.9)] {
            let s = Sampler::new(SamplerParams {
                top_p,
                min_p,
                min_keep: 2,
                ..params(1.0)
            });
            assert_eq!(s.distribution(&logits).len(), 2);
        }
    }

    #[test]
    fn repetition_penalty_demotes_recent_tokens() {
        let mut s = Sampler::new(SamplerParams {
            repeat_penalty: 2.0,
            ..params(0.0)
        });
        s.accept(0);
        assert_eq!(s.sample(&[3.0, 2.0]), 1);
        let mut s = Sampler::new(SamplerParams {
            repeat_penalty: 2.0,
            ..params(0.0)
        });
        s.accept(1);
        assert_eq!(s.sample(&[-1.0, -0.8]), 0);
    }

    #[test]
    fn typical_p_runs_before_the_temperature() {
        // p = 0.5, 0.3, 0.2; typical_p 0.2 keeps token 1 only (see sampler_stages), which a
        // temperature of 0 then takes although token 0 is the most likely.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut s = Sampler::new(SamplerParams {
            typical_p: 0.2,
            ..params(0.0)
        });
        assert_eq!(s.sample(&logits), 1);
        let s = Sampler::new(SamplerParams {
            typical_p: 0.5,
            ..params(1.0)
        });
        assert_distribution(&s, &logits, &[(0, 0.625), (1, 0.375)]);
    }

    #[test]
    fn xtc_at_probability_one_excludes_the_top_choices() {
        // p = 0.5, 0.3, 0.15, 0.05, threshold 0.1: tokens 0 and 1 go, 2 and 3 stay (3:1).
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
        let mut s = Sampler::new(SamplerParams {
            xtc_probability: 1.0,
            xtc_threshold: 0.1,
            ..params(1.0)
        });
        let d = s.distribution(&logits);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 3]);
        assert!((d[0].1 - 0.75).abs() < 1e-6, "{d:?}");
        assert!((0..200).all(|_| s.sample(&logits) >= 2));
    }

    #[test]
    fn the_order_decides_what_the_temperature_sees() {
        // p = 0.5, 0.3, 0.2; at temperature 4 they flatten to 0.376, 0.333, 0.291.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let early = Sampler::new(SamplerParams {
            min_p: 0.7,
            ..params(4.0)
        });
        // min-p 0.7 before the temperature: 0.3 < 0.35 -> token 0 alone.
        assert_eq!(early.distribution(&logits).len(), 1);
        let late = Sampler::new(SamplerParams {
            min_p: 0.7,
            order: vec![SamplerStage::Temperature, SamplerStage::MinP],
            ..params(4.0)
        });
        // After it: 0.333 and 0.291 are above 0.7 × 0.376 = 0.263 -> all three.
        assert_eq!(late.distribution(&logits).len(), 3);
        // A chain without the temperature samples at temperature 1.
        let none = Sampler::new(SamplerParams {
            order: vec![SamplerStage::TopK],
            ..params(0.0)
        });
        assert_eq!(none.distribution(&logits).len(), 3);
    }

    #[test]
    fn mirostat_v2_truncates_at_its_target_and_learns() {
        // Surprises 1, 2, 3, 3 bits; tau 1.01 -> mu 2.02 keeps tokens 0 and 1 (2/3, 1/3).
        let logits = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.125f32.ln()];
        let mut s = Sampler::new(SamplerParams {
            mirostat: Mirostat::V2,
            mirostat_tau: 1.01,
            mirostat_eta: 10.0,
            top_k: 1,
            ..params(1.0)
        });
        let d = s.distribution(&logits);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!((d[0].1 - 2.0 / 3.0).abs() < 1e-6);
        // Token 0 (surprise 0.585 < tau): mu rises by 10 × 0.425 and keeps all four; token 1
        // (1.585 > tau): mu falls below 0 and keeps one. top_k is not used under mirostat.
        let t = s.sample(&logits);
        let after = s.distribution(&logits).len();
        assert_eq!(after, if t == 0 { 4 } else { 1 }, "token {t}");
    }

    #[test]
    fn mirostat_v1_takes_k_from_the_zipf_estimate() {
        // Zipf exponent 2 over 8 tokens, tau 1 (mu 2): k = 2 (see sampler_stages).
        let logits: Vec<f32> = (1..=8).map(|i| -2.0 * (i as f32).ln()).collect();
        let s = Sampler::new(SamplerParams {
            mirostat: Mirostat::V1,
            mirostat_tau: 1.0,
            ..params(1.0)
        });
        let d = s.distribution(&logits);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        assert!((d[0].1 - 0.8).abs() < 1e-6, "{d:?}");
    }

    #[test]
    fn dry_penalises_the_token_that_extends_a_repeat() {
        let mut s = Sampler::new(SamplerParams {
            dry: DryParams {
                multiplier: 1.0,
                base: 2.0,
                ..DryParams::default()
            },
            ..params(0.0)
        });
        for t in [0, 1, 2, 3, 0, 1, 2] {
            s.accept(t);
        }
        // Token 3 would repeat "0 1 2 3": 1 × 2^(3-2) = 2 off its logit.
        assert_eq!(s.sample(&[0.0, 0.0, 0.0, 1.5, 0.0]), 0);
        assert_eq!(s.sample(&[0.0, 0.0, 0.0, 2.5, 0.0]), 3);
    }

    #[test]
    fn top_k_straight_from_the_logits_equals_the_full_chain() {
        // A no-op typical-p stage before top-k turns the shortcut off: both must agree.
        let fast = SamplerParams::default();
        let mut full = SamplerParams::default();
        full.order.retain(|&s| s != SamplerStage::TypicalP);
        full.order.insert(0, SamplerStage::TypicalP);
        let mut x = 0x1234_5678_9ABC_DEF1u64;
        for n in [1, 5, 40, 41, 1000, 20_000] {
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 23) as f32 / 3.0
                })
                .collect();
            let (a, b) = (Sampler::new(fast.clone()), Sampler::new(full.clone()));
            assert!(a.untouched_before_top_k() && !b.untouched_before_top_k());
            let (da, db) = (a.distribution(&logits), b.distribution(&logits));
            assert_eq!(da, db, "{n} logits");
            let (mut a, mut b) = (a, b);
            for _ in 0..8 {
                assert_eq!(a.sample(&logits), b.sample(&logits));
            }
        }
    }

    /// The default chain's cost per token at gpt-oss's 201,088-token vocabulary (issue target:
    /// at most 0.3 ms). Run by hand, optimised:
    /// `cargo test --release -p hmoe-engine sampler_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn sampler_speed_at_201k_vocabulary() {
        let n_vocab = 201_088;
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32
        };
        // A peaked distribution like a model's: most logits low, a few high.
        let steps: Vec<Vec<f32>> = (0..64)
            .map(|_| (0..n_vocab).map(|_| next().powi(8) * 30.0 - 5.0).collect())
            .collect();
        let mut s = Sampler::new(SamplerParams::default());
        for t in 0..100 {
            s.accept(t);
        }
        let mut times = Vec::new();
        for logits in steps.iter().cycle().take(256) {
            let t0 = std::time::Instant::now();
            let tok = s.sample(logits);
            times.push(t0.elapsed().as_secs_f64() * 1e3);
            s.accept(tok);
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        // What the top-k stage cost before it selected: a sort of the whole vocabulary.
        let mut sorts: Vec<f64> = steps
            .iter()
            .map(|logits| {
                let t0 = std::time::Instant::now();
                let mut c = Cands {
                    v: logits
                        .iter()
                        .enumerate()
                        .map(|(i, &l)| (i as u32, l))
                        .collect(),
                    sorted: false,
                };
                c.sort();
                c.v.truncate(40);
                std::hint::black_box(&c.v);
                t0.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        sorts.sort_by(f64::total_cmp);
        println!(
            "default sampler, {n_vocab} logits: median {median:.3} ms, p90 {:.3} ms \
             (a full sort of the vocabulary alone: median {:.3} ms)",
            times[times.len() * 9 / 10],
            sorts[sorts.len() / 2]
        );
        if !cfg!(debug_assertions) {
            assert!(median <= 0.3, "{median:.3} ms per token");
        }
    }
}
