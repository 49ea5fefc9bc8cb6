//! The prompt/decode loop: prompt in one batch, then one token per step, sampled or (for
//! teacher-forced comparisons) given.

use std::time::Instant;

use hmoe_model::{KvCache, KvType, LanguageModel, ModelError, SeqBatch, TokenLogits};

use crate::Sampler;

/// Wall-clock split of one generation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    /// Tokens in the prompt batch.
    pub prompt_tokens: usize,
    /// Milliseconds spent on the prompt.
    pub prompt_ms: f64,
    /// Decode steps run (tokens fed after the prompt).
    pub decode_tokens: usize,
    /// Milliseconds spent decoding.
    pub decode_ms: f64,
}

impl Timings {
    /// Prompt throughput in tokens per second.
    pub fn prompt_tps(&self) -> f64 {
        rate(self.prompt_tokens, self.prompt_ms)
    }
    /// Decode throughput in tokens per second.
    pub fn decode_tps(&self) -> f64 {
        rate(self.decode_tokens, self.decode_ms)
    }
}

fn rate(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

/// Result of [`Generator::generate`].
#[derive(Clone, Debug, Default)]
pub struct Generation {
    /// The prompt as fed.
    pub prompt_tokens: Vec<u32>,
    /// Tokens produced (or the teacher tokens, when teacher-forced).
    pub generated: Vec<u32>,
    /// For each generated token, the `top_k_probs` most likely ids of the distribution it was
    /// chosen from (softmax at temperature 1, before sampling).
    pub top_probs: Vec<Vec<(u32, f32)>>,
    /// Speed.
    pub timings: Timings,
}

/// Called with each new token; returning `false` stops generation.
pub type StepObserver<'a> = &'a mut dyn FnMut(u32) -> bool;

/// One sequence on one model.
pub struct Generator<'m> {
    model: &'m dyn LanguageModel,
    cache: KvCache,
    /// Whether a sampler that needs no more than a token's best logits gets only those,
    /// ranked on the device (off when the environment sets `HMOE_DEVICE_TOPK=0`).
    device_top_k: bool,
}

impl<'m> Generator<'m> {
    /// A generator with a KV cache of `n_ctx` positions.
    pub fn new(model: &'m dyn LanguageModel, kv: KvType, n_ctx: usize, n_ubatch: usize) -> Self {
        Generator {
            cache: model.new_cache(kv, n_ctx, n_ubatch),
            model,
            device_top_k: !std::env::var("HMOE_DEVICE_TOPK").is_ok_and(|v| v == "0"),
        }
    }

    /// This generator with the device's ranking of the best logits on or off (see
    /// [`Sampler::top_needed`]); the tokens are the same either way.
    pub fn with_device_top_k(self, on: bool) -> Self {
        Generator {
            device_top_k: on,
            ..self
        }
    }

    /// Runs `tokens` and returns the last one's logits: its `top` best alone when the model
    /// gives only those ([`LanguageModel::forward_multi_top`]).
    fn step(&mut self, tokens: &[u32], top: Option<usize>) -> Result<TokenLogits, ModelError> {
        let mut seq = [SeqBatch {
            cache: &mut self.cache,
            tokens,
            logits: true,
        }];
        let mut out = self.model.forward_multi_top(&mut seq, &[top])?;
        Ok(out.pop().unwrap_or(TokenLogits::Full(Vec::new())))
    }

    /// Runs `prompt` then produces up to `n_predict` tokens (or exactly the `teacher` tokens).
    /// Stops early after a token for which `is_stop` holds or when `on_token` returns false.
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &mut self,
        prompt: &[u32],
        n_predict: usize,
        sampler: &mut Sampler,
        teacher: Option<&[u32]>,
        top_k_probs: usize,
        is_stop: &dyn Fn(u32) -> bool,
        on_token: StepObserver,
    ) -> Result<Generation, ModelError> {
        self.cache.clear();
        let mut out = Generation {
            prompt_tokens: prompt.to_vec(),
            ..Generation::default()
        };
        let n_steps = teacher.map_or(n_predict, |t| t.len());
        if prompt.is_empty() || n_steps == 0 {
            return Ok(out);
        }
        for &t in prompt {
            sampler.accept(t);
        }
        // The best logits alone when sampling needs no more (and nothing reports the rest).
        let top = match (teacher, top_k_probs, self.device_top_k) {
            (None, 0, true) => sampler.top_needed(crate::TOP_K_MAX),
            _ => None,
        };
        let start = Instant::now();
        let mut logits = self.step(prompt, top)?;
        out.timings.prompt_tokens = prompt.len();
        out.timings.prompt_ms = start.elapsed().as_secs_f64() * 1e3;
        let start = Instant::now();
        for step in 0..n_steps {
            if let (1.., TokenLogits::Full(l)) = (top_k_probs, &logits) {
                out.top_probs.push(top_probs(l, top_k_probs));
            }
            let token = match (teacher, &logits) {
                (Some(t), _) => t[step],
                (None, TokenLogits::Full(l)) => sampler.sample(l),
                (None, TokenLogits::Top(t)) => sampler.sample_top(t),
            };
            sampler.accept(token);
            out.generated.push(token);
            let go_on = on_token(token);
            if !go_on || is_stop(token) || step + 1 == n_steps {
                break;
            }
            logits = self.step(&[token], top)?;
            out.timings.decode_tokens += 1;
        }
        out.timings.decode_ms = start.elapsed().as_secs_f64() * 1e3;
        Ok(out)
    }
}

/// The `k` most probable ids of softmax(`logits`) (computed in f64), most probable first,
/// ties to the lower id.
pub fn top_probs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    ids.truncate(k);
    ids.into_iter()
        .map(|i| (i, ((logits[i as usize] as f64 - max).exp() / sum) as f32))
        .collect()
}

#[cfg(test)]
#[path = "generate_top_tests.rs"]
mod top_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_probs_are_sorted_normalised_and_tie_to_lower_id() {
        let p = top_probs(&[1.0, 2.0, 2.0, 0.0], 3);
        assert_eq!(p.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        let e: f64 = [1f64, 2.0, 2.0, 0.0].iter().map(|v| v.exp()).sum();
        assert!((p[0].1 as f64 - 2f64.exp() / e).abs() < 1e-7);
    }
}
