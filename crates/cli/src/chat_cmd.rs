//! `hmoe chat`: an interactive conversation in the terminal, rendered with the model's chat
//! template. Reasoning goes to stderr, the answer to stdout, so `hmoe chat < questions.txt`
//! prints only answers.

use std::io::{BufRead, Write};

use anyhow::Context;
use hmoe_chat::{
    load_chat_template, special_token_vars, ChatDelta, ChatTemplate, HarmonyStream, HarmonyTokens,
    ReasoningFormat, ThinkSplitter,
};
use hmoe_engine::{Generator, Sampler, SamplerParams};
use hmoe_tokenizer::{StreamDecoder, Tokenizer};
use serde_json::{json, Value};

use crate::common::ModelArgs;

/// Arguments of `hmoe chat`.
#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Use this Jinja chat template instead of the model's.
    #[arg(long = "chat-template-file")]
    pub chat_template_file: Option<std::path::PathBuf>,
    /// System prompt.
    #[arg(long = "system-prompt", visible_alias = "sys")]
    pub system_prompt: Option<String>,
    /// Where reasoning goes: none (inline with the answer), auto or deepseek (to stderr).
    #[arg(long = "reasoning-format", default_value = "auto")]
    pub reasoning_format: ReasoningFormat,
    /// gpt-oss reasoning effort (low, medium, high).
    #[arg(long = "reasoning-effort")]
    pub reasoning_effort: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 1024)]
    pub n_predict: usize,
    /// Temperature (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Random seed.
    #[arg(short = 's', long = "seed", default_value_t = 0xFFFF_FFFF)]
    pub seed: u64,
}

/// Splits generated tokens into answer and reasoning, for harmony or `<think>` models.
enum Splitter {
    Harmony(Box<HarmonyStream>),
    Think(ThinkSplitter, StreamDecoder),
}

impl Splitter {
    fn push(&mut self, tok: &Tokenizer, id: u32) -> Vec<ChatDelta> {
        match self {
            Splitter::Harmony(h) => h.push(tok, id),
            Splitter::Think(t, d) => {
                if tok.is_eog(id) {
                    return Vec::new();
                }
                let text = d.push(tok, id);
                t.push(&text)
            }
        }
    }

    fn finish(&mut self) -> Vec<ChatDelta> {
        match self {
            Splitter::Harmony(h) => h.finish(),
            Splitter::Think(t, d) => {
                let mut out = t.push(&d.finish());
                out.extend(t.finish());
                out
            }
        }
    }
}

/// Runs `hmoe chat`.
pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    let kv = args.model.kv_type()?;
    args.model.check_placement()?;
    let model = args.model.load()?;
    let meta = model.gguf().metadata();
    let tok = Tokenizer::from_metadata(meta)?;
    let template = ChatTemplate::new(&load_chat_template(
        meta,
        args.chat_template_file.as_deref(),
    )?)?;
    let harmony = HarmonyTokens::from_tokenizer(&tok).ok();
    let mut extra = special_token_vars(&tok);
    if let (Some(effort), Value::Object(m)) = (&args.reasoning_effort, &mut extra) {
        m.insert("reasoning_effort".into(), effort.clone().into());
    }
    let n_ctx = args.model.n_ctx(model.as_ref());
    let mut generator = Generator::new(model.as_ref(), kv, n_ctx, args.model.n_ubatch());
    let mut sampler = Sampler::new(SamplerParams {
        temperature: args.temp,
        seed: args.seed,
        ..SamplerParams::default()
    });
    let mut messages: Vec<Value> = Vec::new();
    if let Some(sys) = &args.system_prompt {
        messages.push(json!({"role": "system", "content": sys}));
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("\n> ");
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        messages.push(json!({"role": "user", "content": line}));
        let prompt = template.render(&Value::Array(messages.clone()), None, true, &extra)?;
        let ids = tok.encode(&prompt, false, true)?;
        if ids.len() + args.n_predict > n_ctx {
            anyhow::bail!(
                "the conversation ({} tokens) no longer fits the context ({n_ctx}); raise -c",
                ids.len()
            );
        }
        let mut splitter = match &harmony {
            Some(h) => Splitter::Harmony(Box::new(HarmonyStream::new(*h, args.reasoning_format))),
            None => Splitter::Think(
                ThinkSplitter::new(args.reasoning_format, false),
                StreamDecoder::new(),
            ),
        };
        let mut answer = String::new();
        let show = |deltas: Vec<ChatDelta>, answer: &mut String| {
            for d in deltas {
                match d {
                    ChatDelta::Content(t) => {
                        print!("{t}");
                        answer.push_str(&t);
                    }
                    ChatDelta::Reasoning(t) => eprint!("{t}"),
                    ChatDelta::ToolCallStart { name, .. } => eprint!("[tool call {name}] "),
                    ChatDelta::ToolCallArgs { delta, .. } => eprint!("{delta}"),
                }
            }
            let _ = std::io::stdout().flush();
        };
        let is_stop = |id: u32| tok.is_eog(id) || harmony.as_ref().is_some_and(|h| h.is_stop(id));
        generator.generate(
            &ids,
            args.n_predict,
            &mut sampler,
            None,
            0,
            &is_stop,
            &mut |id| {
                show(splitter.push(&tok, id), &mut answer);
                true
            },
        )?;
        show(splitter.finish(), &mut answer);
        println!();
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    Ok(())
}
