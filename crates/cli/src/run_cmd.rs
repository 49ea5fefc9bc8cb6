//! `hmoe run`: generate a continuation of a prompt and report speed.

use std::io::Write;

use anyhow::{bail, Context};
use hmoe_engine::{Generator, Sampler, SamplerParams};
use hmoe_tokenizer::Tokenizer;
use serde_json::json;

use crate::common::{parse_ids, ModelArgs};

/// Arguments of `hmoe run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text.
    #[arg(short = 'p', long = "prompt")]
    pub prompt: Option<String>,
    /// Prompt as token ids (`1,2,3`) instead of text.
    #[arg(long = "prompt-tokens")]
    pub prompt_tokens: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    pub n_predict: usize,
    /// Feed these ids one decode step at a time instead of sampling (teacher forcing).
    #[arg(long = "teacher-tokens")]
    pub teacher_tokens: Option<String>,
    /// Temperature (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k sampling (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Top-p sampling (1 = off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p sampling (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed.
    #[arg(short = 's', long = "seed", default_value_t = 0xFFFF_FFFF)]
    pub seed: u64,
    /// Print one JSON object (prompt ids, generated ids, top probabilities, timings).
    #[arg(long = "json")]
    pub json: bool,
    /// With --json: the K most probable next tokens at every step.
    #[arg(long = "top-k-probs", default_value_t = 0)]
    pub top_k_probs: usize,
    /// Keep generating past end-of-generation tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
}

/// Runs `hmoe run`.
pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let kv = args.model.kv_type()?;
    args.model.check_placement()?;
    let model = args.model.load()?;
    let tokenizer = Tokenizer::from_metadata(model.gguf().metadata());
    let prompt = match (&args.prompt_tokens, &args.prompt) {
        (Some(ids), _) => parse_ids(ids)?,
        (None, Some(text)) => {
            let tok = tokenizer.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
            tok.encode(text, true, false)?
        }
        (None, None) => bail!("give a prompt with -p TEXT or --prompt-tokens IDS"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let teacher = args.teacher_tokens.as_deref().map(parse_ids).transpose()?;
    let n_ctx = args.model.n_ctx(model.as_ref());
    let needed = prompt.len() + teacher.as_ref().map_or(args.n_predict, Vec::len);
    if needed > n_ctx {
        bail!(
            "prompt ({}) plus tokens to generate exceed the context ({n_ctx}); raise -c",
            prompt.len()
        );
    }
    let mut sampler = Sampler::new(SamplerParams {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        repeat_last_n: args.repeat_last_n,
        seed: args.seed,
    });
    let n_ubatch = args.model.n_ubatch();
    let mut generator = Generator::new(model.as_ref(), kv, n_ctx, n_ubatch);
    let tok = tokenizer.as_ref().ok();
    let is_stop =
        |id: u32| !args.ignore_eos && teacher.is_none() && tok.is_some_and(|t| t.is_eog(id));
    let mut stdout = std::io::stdout().lock();
    let mut pending = Vec::new();
    let mut on_token = |id: u32| {
        if let (false, Some(t)) = (args.json, tok) {
            pending.extend_from_slice(t.token_bytes(id));
            let shown = complete_utf8_prefix(&pending);
            let _ = stdout.write_all(&pending[..shown]);
            let _ = stdout.flush();
            pending.drain(..shown);
        }
        true
    };
    let out = generator
        .generate(
            &prompt,
            args.n_predict,
            &mut sampler,
            teacher.as_deref(),
            args.top_k_probs,
            &is_stop,
            &mut on_token,
        )
        .context("generation failed")?;
    let t = &out.timings;
    if args.json {
        let top: Vec<Vec<(u32, f32)>> = out.top_probs;
        let obj = json!({
            "prompt_tokens": out.prompt_tokens,
            "generated_tokens": out.generated,
            "top_probs": top,
            "timings": {
                "prompt_n": t.prompt_tokens, "prompt_ms": t.prompt_ms, "prompt_per_second": t.prompt_tps(),
                "predicted_n": t.decode_tokens, "predicted_ms": t.decode_ms, "predicted_per_second": t.decode_tps(),
            }
        });
        println!("{obj}");
    } else {
        println!("{}", String::from_utf8_lossy(&pending));
        eprintln!(
            "prompt: {} tokens in {:.1} ms, {:.2} t/s | generation: {} tokens in {:.1} ms, {:.2} t/s",
            t.prompt_tokens, t.prompt_ms, t.prompt_tps(), t.decode_tokens, t.decode_ms, t.decode_tps()
        );
    }
    Ok(())
}

/// Length of the longest prefix that does not end inside a UTF-8 sequence (invalid bytes are
/// passed through; only an incomplete tail is held back for the next token).
fn complete_utf8_prefix(bytes: &[u8]) -> usize {
    match std::str::from_utf8(bytes) {
        Ok(_) => bytes.len(),
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        Err(_) => bytes.len(),
    }
}
