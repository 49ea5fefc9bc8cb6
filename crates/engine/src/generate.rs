//! The prompt/decode loop: prompt in one batch, then one token per step, sampled or (for
//! teacher-forced comparisons) given.

use std::time::Instant;

use hmoe_model::{KvCache, KvType, LanguageModel, LogitsWanted, ModelError};

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
}

impl<'m> Generator<'m> {
    /// A generator with a KV cache of `n_ctx` positions.
    pub fn new(model: &'m dyn LanguageModel, kv: KvType, n_ctx: usize, n_ubatch: usize) -> Self {
        Generator {
            cache: model.new_cache(kv, n_ctx, n_ubatch),
            model,
        }
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
        let start = Instant::now();
        let mut logits = self
            .model
            .forward(&mut self.cache, prompt, LogitsWanted::Last)?;
        out.timings.prompt_tokens = prompt.len();
        out.timings.prompt_ms = start.elapsed().as_secs_f64() * 1e3;
        let start = Instant::now();
        for step in 0..n_steps {
            if top_k_probs > 0 {
                out.top_probs.push(top_probs(&logits, top_k_probs));
            }
            let token = match teacher {
                Some(t) => t[step],
                None => sampler.sample(&logits),
            };
            sampler.accept(token);
            out.generated.push(token);
            let go_on = on_token(token);
            if !go_on || is_stop(token) || step + 1 == n_steps {
                break;
            }
            logits = self
                .model
                .forward(&mut self.cache, &[token], LogitsWanted::Last)?;
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
