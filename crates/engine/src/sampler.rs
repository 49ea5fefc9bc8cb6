//! Token sampling with llama.cpp's chain: repetition penalty → top-k → top-p → min-p →
//! temperature → draw. A temperature of 0 (or below) is greedy argmax.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings (llama.cpp's defaults).
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
            seed: 0xFFFF_FFFF,
        }
    }
}

/// A stateful sampler: remembers recent tokens for the penalty and owns its RNG.
pub struct Sampler {
    params: SamplerParams,
    rng: StdRng,
    recent: Vec<u32>,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplerParams) -> Sampler {
        Sampler {
            rng: StdRng::seed_from_u64(params.seed),
            params,
            recent: Vec::new(),
        }
    }

    /// Records a token of the context (prompt or generated) for the repetition penalty.
    pub fn accept(&mut self, token: u32) {
        self.recent.push(token);
        let keep = self.params.repeat_last_n;
        if self.recent.len() > keep {
            self.recent.drain(..self.recent.len() - keep);
        }
    }

    /// Picks the next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let (cand, probs) = match self.chain(logits) {
            Chain::Greedy(t) => return t,
            Chain::Draw(cand, probs) => (cand, probs),
        };
        let r: f64 = self.rng.random();
        let mut cum = 0.0;
        for (i, q) in probs.iter().enumerate() {
            cum += q;
            if r < cum {
                return cand[i].0;
            }
        }
        cand[cand.len() - 1].0
    }

    /// The tokens the next [`Sampler::sample`] chooses among, with their probabilities, most
    /// likely first (llama.cpp's post-sampling probabilities): what is left after the penalty,
    /// top-k, top-p and min-p, at the temperature. Greedy sampling leaves the most likely
    /// token alone, with probability 1.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        match self.chain(logits) {
            Chain::Greedy(t) => vec![(t, 1.0)],
            Chain::Draw(cand, probs) => cand.into_iter().map(|c| c.0).zip(probs).collect(),
        }
    }

    /// Runs the chain up to the draw.
    fn chain(&self, logits: &[f32]) -> Chain {
        let p = &self.params;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if p.repeat_penalty != 1.0 {
            for (id, l) in cand.iter_mut() {
                if self.recent.contains(id) {
                    *l = if *l > 0.0 {
                        *l / p.repeat_penalty
                    } else {
                        *l * p.repeat_penalty
                    };
                }
            }
        }
        if p.temperature <= 0.0 {
            return Chain::Greedy(argmax(&cand));
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let probs = softmax(&cand, 1.0);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let keep = probs
                .iter()
                .position(|&q| {
                    cum += q;
                    cum >= p.top_p as f64
                })
                .map_or(cand.len(), |i| i + 1);
            cand.truncate(keep);
        }
        if p.min_p > 0.0 {
            let probs = softmax(&cand, 1.0);
            let floor = probs[0] * p.min_p as f64;
            let keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
            cand.truncate(keep);
        }
        let probs = softmax(&cand, p.temperature);
        Chain::Draw(cand, probs)
    }
}

/// Where the chain leaves a draw.
enum Chain {
    /// Temperature ≤ 0: this token, no draw.
    Greedy(u32),
    /// Candidates (most likely first) and their probabilities.
    Draw(Vec<(u32, f32)>, Vec<f64>),
}

fn argmax(cand: &[(u32, f32)]) -> u32 {
    let mut best = cand[0];
    for &c in cand {
        if c.1 > best.1 {
            best = c;
        }
    }
    best.0
}

/// Softmax of the candidates' logits at `temperature`, in f64.
fn softmax(cand: &[(u32, f32)], temperature: f32) -> Vec<f64> {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max) as f64;
    let t = temperature as f64;
    let e: Vec<f64> = cand
        .iter()
        .map(|c| ((c.1 as f64 - max) / t).exp())
        .collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplerParams {
        SamplerParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..SamplerParams::default()
        }
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
        let d = s.distribution(&logits);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        assert!(
            (d[0].1 - 0.625).abs() < 1e-6 && (d[1].1 - 0.375).abs() < 1e-6,
            "{d:?}"
        );
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
}
