//! `hmoe run`: generate a continuation of a prompt and report speed.

use std::io::Write;

use anyhow::{bail, Context};
use hmoe_engine::{Generator, Sampler, SamplerParams};
use hmoe_model::{ExecStats, LanguageModel};
use hmoe_placement::{plan_run, DeviceBudget, DeviceId, RunTokens, TensorDesc};
use hmoe_tokenizer::Tokenizer;
use serde_json::{json, Value};

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
    /// Measure the run's memory: resident memory just before the model is opened, the peak
    /// (VmHWM) at the end, and the placement estimate of CPU weights, KV cache and compute
    /// for this run; printed to stderr, or as `memory` in the --json object. Linux only.
    #[arg(long = "memory-report")]
    pub memory_report: bool,
}

/// Runs `hmoe run`.
pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let kv = args.model.kv_type()?;
    args.model.check_placement()?;
    let baseline = args.memory_report.then(Memory::now).transpose()?;
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
        ..SamplerParams::default()
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
    let memory = match &baseline {
        Some(b) => {
            let run = RunTokens {
                prompt: prompt.len() as u32,
                total: (prompt.len() + out.timings.decode_tokens) as u32,
            };
            Some(memory_report(
                b,
                &Memory::now()?,
                model.as_ref(),
                &args,
                n_ctx,
                run,
            )?)
        }
        None => None,
    };
    let t = &out.timings;
    if args.json {
        let top: Vec<Vec<(u32, f32)>> = out.top_probs;
        let mut obj = json!({
            "prompt_tokens": out.prompt_tokens,
            "generated_tokens": out.generated,
            "top_probs": top,
            "timings": {
                "prompt_n": t.prompt_tokens, "prompt_ms": t.prompt_ms, "prompt_per_second": t.prompt_tps(),
                "predicted_n": t.decode_tokens, "predicted_ms": t.decode_ms, "predicted_per_second": t.decode_tps(),
            }
        });
        if let Some(m) = memory {
            obj["memory"] = m;
        }
        let engine = args.model.engine.get().cloned().unwrap_or_default();
        obj["engine"] = json!(engine.backend);
        if let Some(s) = model.device_stats() {
            obj["device_stats"] = stats_json(&s);
        }
        if let Some(c) = model.moe_cache_stats() {
            obj["moe_cache"] = json!({
                "hits": c.hits, "misses": c.misses, "uploads": c.uploads,
                "evictions": c.evictions, "held_bytes": c.held_bytes,
                "budget_bytes": c.budget_bytes, "capacity": c.capacity,
            });
        }
        println!("{obj}");
    } else {
        // The text and its final newline first, so that the reports start on a line of their
        // own when stdout and stderr share a terminal.
        println!("{}", String::from_utf8_lossy(&pending));
        std::io::stdout().flush()?;
        if let Some(m) = &memory {
            eprint!("{}", render_memory(m));
        }
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

/// Resident memory of this process at one moment (Linux `/proc/self`).
struct Memory {
    /// `VmRSS`: resident now.
    rss: u64,
    /// `VmHWM`: the peak resident set so far.
    hwm: u64,
    /// Resident pages of the program itself: the executable and shared libraries.
    program: u64,
    /// Resident pages of other file mappings (the model's weights).
    mapped_files: u64,
    /// Resident anonymous memory (heap, thread stacks, KV cache, buffers).
    anon: u64,
}

impl Memory {
    fn now() -> anyhow::Result<Memory> {
        let status = std::fs::read_to_string("/proc/self/status")
            .context("--memory-report needs /proc/self/status (Linux)")?;
        let field = |key: &str| -> anyhow::Result<u64> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|kib| kib.parse::<u64>().ok())
                .map(|kib| kib * 1024)
                .with_context(|| format!("no {key} in /proc/self/status"))
        };
        let smaps = std::fs::read_to_string("/proc/self/smaps")
            .context("--memory-report needs /proc/self/smaps (Linux)")?;
        let exe = std::env::current_exe().ok();
        let (program, mapped_files, anon) = split_smaps(&smaps, exe.as_deref());
        Ok(Memory {
            rss: field("VmRSS:")?,
            hwm: field("VmHWM:")?,
            program,
            mapped_files,
            anon,
        })
    }
}

/// Resident bytes of `/proc/self/smaps` split into (program, other files, anonymous): a
/// mapping of `exe` or of a shared library (`*.so*`) is program; another path is a file;
/// no path, or a `[heap]`-style name, is anonymous.
fn split_smaps(smaps: &str, exe: Option<&std::path::Path>) -> (u64, u64, u64) {
    let (mut program, mut files, mut anon) = (0, 0, 0);
    let mut kind = 2;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if let Some(kib) = line.strip_prefix("Rss:") {
            let bytes = kib
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024;
            match kind {
                0 => program += bytes,
                1 => files += bytes,
                _ => anon += bytes,
            }
        } else if first.contains('-') && !first.ends_with(':') {
            // A mapping header: range, perms, offset, dev, inode, [path].
            let path = fields.nth(4).unwrap_or("");
            kind = if path.is_empty() || path.starts_with('[') {
                2
            } else if exe.is_some_and(|e| e == std::path::Path::new(path)) || path.contains(".so") {
                0
            } else {
                1
            };
        }
    }
    (program, files, anon)
}

/// The measured growth of the run against the placement crate's CPU estimate for the same
/// flags and token counts.
fn memory_report(
    before: &Memory,
    after: &Memory,
    model: &dyn LanguageModel,
    args: &RunArgs,
    n_ctx: usize,
    run: RunTokens,
) -> anyhow::Result<Value> {
    let gguf = model.gguf();
    let shape = hmoe_model::model_shape(gguf)?;
    let tensors: Vec<TensorDesc> = gguf.tensors().iter().map(TensorDesc::from).collect();
    let mut flags = args.model.placement.to_flags()?;
    flags.ctx_size = Some(u32::try_from(n_ctx).context("context too large")?);
    flags.ubatch_size = args.model.n_ubatch() as u32;
    flags.fit = false;
    // This build computes everything on the CPU.
    let p = plan_run(
        &tensors,
        &shape,
        &DeviceBudget::default(),
        &flags,
        Some(run),
    )?;
    let cpu = p
        .device(DeviceId::Cpu)
        .context("the plan has no CPU entry")?;
    let estimate = cpu.weights + cpu.kv + cpu.compute;
    let growth = after.hwm.saturating_sub(before.rss);
    let program = after.program.saturating_sub(before.program);
    let model_growth = growth.saturating_sub(program);
    let pct = |m: u64| {
        if m == 0 {
            0.0
        } else {
            (estimate as f64 - m as f64) / m as f64 * 100.0
        }
    };
    Ok(json!({
        "baseline_rss": before.rss,
        "peak_rss": after.hwm,
        "end_rss": after.rss,
        "peak_growth": growth,
        "program_growth": program,
        "model_growth": model_growth,
        "end_growth": {
            "mapped_files": after.mapped_files.saturating_sub(before.mapped_files),
            "anon": after.anon as i128 - before.anon as i128,
        },
        "tokens": { "prompt": run.prompt, "total": run.total },
        "estimate": {
            "weights": cpu.weights,
            "kv": cpu.kv,
            "compute": cpu.compute,
            "total": estimate,
        },
        "error_pct_of_peak_growth": pct(growth),
        "error_pct_of_model_growth": pct(model_growth),
    }))
}

/// The memory report as text.
fn render_memory(m: &Value) -> String {
    let mib = |k: &Value| k.as_u64().map_or(0.0, |b| b as f64 / (1 << 20) as f64);
    let e = &m["estimate"];
    format!(
        "memory: baseline {:.2} MiB, peak {:.2} MiB, peak growth {:.2} MiB \
         (program pages {:.2} MiB, model {:.2} MiB)\n\
         memory: estimate {:.2} MiB = weights {:.2} + kv {:.2} + compute {:.2} \
         ({:+.2}% of the peak growth, {:+.2}% of the model's)\n",
        mib(&m["baseline_rss"]),
        mib(&m["peak_rss"]),
        mib(&m["peak_growth"]),
        mib(&m["program_growth"]),
        mib(&m["model_growth"]),
        mib(&e["total"]),
        mib(&e["weights"]),
        mib(&e["kv"]),
        mib(&e["compute"]),
        m["error_pct_of_peak_growth"].as_f64().unwrap_or(0.0),
        m["error_pct_of_model_growth"].as_f64().unwrap_or(0.0),
    )
}

/// The device executor's counts as JSON (`hmoe run --json`'s `device_stats`): micro-batches,
/// round trips at the expert boundary (one per CPU-expert layer per micro-batch), steps run
/// as two micro-batches in flight, op offload,
/// and the device's own count of every host ↔ device copy where it keeps one.
fn stats_json(s: &ExecStats) -> serde_json::Value {
    let mut v = serde_json::json!({
        "ubatches": s.ubatches,
        "host_round_trips": s.host_round_trips,
        "split_steps": s.split_steps,
        "bytes_to_host": s.bytes_to_host,
        "bytes_to_device": s.bytes_to_device,
        "offloaded_layers": s.offloaded_layers,
        "offloaded_experts": s.offloaded_experts,
        "prefetched_layers": s.prefetched_layers,
        "offload_slices": s.offload_slices,
        "ring_peak_bytes": s.ring_peak_bytes,
    });
    if let Some(t) = s.transfers {
        v["transfers"] = serde_json::json!({
            "uploads": t.uploads,
            "upload_bytes": t.upload_bytes,
            "downloads": t.downloads,
            "download_bytes": t.download_bytes,
        });
    }
    v
}
