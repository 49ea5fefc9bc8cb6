//! `hmoe perplexity`: perplexity of a model on a text file, computed like llama.cpp's
//! `llama-perplexity` so that the numbers compare directly.
//!
//! The whole file is tokenized once (BOS added when the vocabulary asks for it), cut into chunks
//! of `-c` tokens (at most `--chunks` of them), and each chunk is run from an empty cache with
//! its first token replaced by BOS (when the vocabulary adds one). Only the second half of each
//! chunk is scored, so every prediction sees at least `n_ctx / 2` tokens of context: the
//! negative log-likelihood of token `j + 1` under the logits of position `j`, for
//! `j = n_ctx/2 .. n_ctx-2`. The running perplexity `exp(mean nll)` is printed after each
//! chunk as `[i]ppl,`, then `Final estimate: PPL = p +/- e` with `e = p · sqrt(var(nll) /
//! (count − 1))`, llama.cpp's error estimate.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context};
use hmoe_model::LogitsWanted;
use hmoe_tokenizer::Tokenizer;
use rayon::prelude::*;

use crate::common::ModelArgs;

/// Arguments of `hmoe perplexity`.
#[derive(clap::Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(short = 'f', long = "file")]
    pub file: std::path::PathBuf,
    /// Score at most this many chunks (default: all).
    #[arg(long = "chunks")]
    pub chunks: Option<usize>,
}

/// Negative log-likelihood of `target` under `logits`, as llama.cpp's `log_softmax`: the max
/// logit in f32, `Σ exp(l − max)` of f32 exponentials accumulated in f64.
pub fn nll(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| (l - max).exp() as f64).sum();
    -((logits[target] - max) as f64 - sum.ln())
}

/// Running totals of the scored predictions.
#[derive(Default, Debug, Clone, Copy, PartialEq)]
pub struct NllSums {
    /// Σ nll.
    pub nll: f64,
    /// Σ nll².
    pub nll2: f64,
    /// Predictions scored.
    pub count: usize,
}

impl NllSums {
    /// Adds one prediction.
    pub fn add(&mut self, v: f64) {
        self.nll += v;
        self.nll2 += v * v;
        self.count += 1;
    }

    /// `exp(mean nll)`.
    pub fn ppl(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    /// llama.cpp's ± of the final estimate: `ppl · sqrt((mean nll² − mean²) / (count − 1))`,
    /// or `None` when the variance is not positive.
    pub fn ppl_error(&self) -> Option<f64> {
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        (var > 0.0 && self.count > 1).then(|| (var / (n - 1.0)).sqrt() * self.ppl())
    }
}

/// Runs `hmoe perplexity`.
pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    let kv = args.model.kv_type()?;
    args.model.check_placement()?;
    let text =
        std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let text = String::from_utf8_lossy(&text);
    let model = args.model.load()?;
    let tokenizer = Tokenizer::from_metadata(model.gguf().metadata())
        .map_err(|e| anyhow::anyhow!("the model has no usable vocabulary: {e}"))?;
    let n_ctx = args.model.n_ctx(model.as_ref());
    if n_ctx < 4 {
        bail!("the context (-c {n_ctx}) is too small to score anything");
    }
    let t0 = Instant::now();
    let tokens = tokenizer.encode(&text, true, false)?;
    eprintln!(
        "perplexity: tokenized {} bytes into {} tokens in {:.1} s",
        text.len(),
        tokens.len(),
        t0.elapsed().as_secs_f64()
    );
    if tokens.len() < 2 * n_ctx {
        bail!(
            "need at least {} tokens for a context of {n_ctx}; the file has {}",
            2 * n_ctx,
            tokens.len()
        );
    }
    let n_chunk = (tokens.len() / n_ctx).min(args.chunks.unwrap_or(usize::MAX));
    let bos = tokenizer.add_bos().then(|| tokenizer.bos()).flatten();
    let n_ubatch = args.model.n_ubatch();
    let n_vocab = model.n_vocab();
    let first = n_ctx / 2;
    eprintln!(
        "perplexity: {n_chunk} chunks of {n_ctx} tokens, micro-batch {n_ubatch}, KV {kv:?}, scoring positions {first}..{}",
        n_ctx - 1
    );
    let mut sums = NllSums::default();
    let mut stdout = std::io::stdout().lock();
    let t_run = Instant::now();
    for i in 0..n_chunk {
        let mut chunk = tokens[i * n_ctx..(i + 1) * n_ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let mut cache = model.new_cache(kv, n_ctx, n_ubatch);
        let t = Instant::now();
        let logits = model
            .forward(&mut cache, &chunk, LogitsWanted::All)
            .with_context(|| format!("chunk {}", i + 1))?;
        // The original tokens are the targets (the BOS only replaces the first input).
        let targets = &tokens[i * n_ctx..(i + 1) * n_ctx];
        let values: Vec<f64> = (first..n_ctx - 1)
            .into_par_iter()
            .map(|j| {
                nll(
                    &logits[j * n_vocab..(j + 1) * n_vocab],
                    targets[j + 1] as usize,
                )
            })
            .collect();
        values.into_iter().for_each(|v| sums.add(v));
        if i == 0 {
            let secs = t.elapsed().as_secs_f64();
            eprintln!(
                "perplexity: {secs:.2} s per chunk, ETA {:.1} min",
                secs * n_chunk as f64 / 60.0
            );
        }
        write!(stdout, "[{}]{:.4},", i + 1, sums.ppl())?;
        stdout.flush()?;
    }
    writeln!(stdout)?;
    match sums.ppl_error() {
        Some(err) => writeln!(
            stdout,
            "Final estimate: PPL = {:.4} +/- {:.5}",
            sums.ppl(),
            err
        )?,
        None => writeln!(stdout, "Final estimate: PPL = {:.4}", sums.ppl())?,
    }
    let secs = t_run.elapsed().as_secs_f64();
    eprintln!(
        "perplexity: {} tokens in {secs:.1} s ({:.1} tokens/s)",
        n_chunk * n_ctx,
        (n_chunk * n_ctx) as f64 / secs
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_minus_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (t, &l) in logits.iter().enumerate() {
            let want = -((l as f64).exp() / z).ln();
            assert!((nll(&logits, t) - want).abs() < 1e-6);
        }
    }

    #[test]
    fn sums_give_ppl_and_llama_cpp_error() {
        let mut s = NllSums::default();
        for v in [1.0, 2.0, 3.0, 2.0] {
            s.add(v);
        }
        assert_eq!(s.count, 4);
        assert!((s.ppl() - 2f64.exp()).abs() < 1e-12);
        // mean 2, mean of squares 4.5 → var 0.5, / 3 → sqrt(1/6)·e².
        let want = (0.5f64 / 3.0).sqrt() * 2f64.exp();
        assert!((s.ppl_error().unwrap() - want).abs() < 1e-12);
        let mut flat = NllSums::default();
        flat.add(1.0);
        flat.add(1.0);
        assert_eq!(flat.ppl_error(), None);
    }
}
