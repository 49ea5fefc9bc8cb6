//! Choosing tokens: the per-request picker (the engine's sampler by default), OpenAI's
//! penalties and logit bias, and log-probabilities for `logprobs` / `n_probs`.

use std::collections::HashMap;
use std::sync::Arc;

use hmoe_engine::{Sampler, SamplerParams};

/// Chooses each generated token of one request.
pub trait TokenPicker: Send {
    /// Records a token of the context (prompt or generated), e.g. for repetition penalties.
    fn accept(&mut self, token: u32);
    /// Picks the next token from the logits (already biased and penalised).
    fn pick(&mut self, logits: &[f32]) -> u32;
    /// The tokens `pick` would choose among and their probabilities, most likely first
    /// (`post_sampling_probs`); `None` when the picker cannot tell.
    fn distribution(&self, _logits: &[f32]) -> Option<Vec<(u32, f64)>> {
        None
    }
    /// The engine's sampler, when this picker is one: a token's best logits alone may then
    /// do ([`Sampler::top_needed`]); `None` (the default): the picker always gets the row.
    fn as_sampler(&mut self) -> Option<&mut Sampler> {
        None
    }
}

impl TokenPicker for Sampler {
    fn accept(&mut self, token: u32) {
        Sampler::accept(self, token);
    }
    fn pick(&mut self, logits: &[f32]) -> u32 {
        self.sample(logits)
    }
    fn distribution(&self, logits: &[f32]) -> Option<Vec<(u32, f64)>> {
        Some(Sampler::distribution(self, logits))
    }
    fn as_sampler(&mut self) -> Option<&mut Sampler> {
        Some(self)
    }
}

/// Builds the picker of each request from its sampling settings.
pub type PickerFactory = Arc<dyn Fn(&SamplerParams) -> Box<dyn TokenPicker> + Send + Sync>;

/// OpenAI-style adjustments applied to the logits before the picker sees them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitAdjust {
    /// Subtracted once from every token already generated (`presence_penalty`).
    pub presence: f32,
    /// Subtracted per occurrence from tokens already generated (`frequency_penalty`).
    pub frequency: f32,
    /// Added to a token's logit (`logit_bias`; -inf bans the token).
    pub bias: Vec<(u32, f32)>,
}

impl LogitAdjust {
    /// Whether the adjustment changes nothing.
    pub fn is_noop(&self) -> bool {
        self.presence == 0.0 && self.frequency == 0.0 && self.bias.is_empty()
    }

    /// Applies the adjustment; `counts` are the generated tokens so far.
    pub fn apply(&self, logits: &mut [f32], counts: &HashMap<u32, usize>) {
        for &(id, b) in &self.bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        if self.presence != 0.0 || self.frequency != 0.0 {
            for (&id, &n) in counts {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= self.presence + self.frequency * n as f32;
                }
            }
        }
    }
}

/// Natural log of softmax(`logits`) at `id` (computed in f64).
pub fn log_softmax_at(logits: &[f32], id: u32, lse: f64) -> f32 {
    logits
        .get(id as usize)
        .map_or(f32::NEG_INFINITY, |&l| (l as f64 - lse) as f32)
}

/// `ln Σ exp(logits)`, in f64.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return max;
    }
    max + logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_probs_normalise() {
        let logits = [1.0f32, 2.0, 3.0];
        let lse = log_sum_exp(&logits);
        let total: f64 = (0..3)
            .map(|i| (log_softmax_at(&logits, i, lse) as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(log_softmax_at(&logits, 9, lse), f32::NEG_INFINITY);
    }

    #[test]
    fn penalties_and_bias() {
        let adj = LogitAdjust {
            presence: 0.5,
            frequency: 0.25,
            bias: vec![(0, -100.0), (7, 1.0)],
        };
        let mut l = vec![0.0f32; 3];
        let counts = HashMap::from([(1u32, 2usize)]);
        adj.apply(&mut l, &counts);
        assert_eq!(l, vec![-100.0, -1.0, 0.0]);
        assert!(LogitAdjust::default().is_noop());
    }
}
