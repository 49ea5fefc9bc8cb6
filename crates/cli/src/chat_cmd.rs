//! `hmoe chat`: an interactive conversation in the terminal, rendered with the model's chat
//! template. Reasoning goes to stderr, the answer to stdout, so `hmoe chat < questions.txt`
//! prints only answers.
//!
//! Ctrl-C during a reply stops it and keeps the conversation (the partial reply included);
//! Ctrl-C at the prompt, or Ctrl-D, leaves. `/clear` starts over, `/save FILE` writes the
//! conversation as JSON messages.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    /// Most tokens per reply (default 1024; 64 for a random-weight stand-in from
    /// `make-test-model`, whose replies are noise that would otherwise run on).
    #[arg(short = 'n', long = "n-predict")]
    pub n_predict: Option<usize>,
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

/// A line that is a command rather than a message.
#[derive(Debug, PartialEq)]
enum Command<'a> {
    /// `/clear`: forget the conversation (the system prompt stays).
    Clear,
    /// `/save FILE`: write the messages as JSON.
    Save(&'a str),
    /// A line starting with `/` that is neither (`/save` without a file included).
    Unknown(&'a str),
}

fn command(line: &str) -> Option<Command<'_>> {
    let line = line.trim();
    let rest = line.strip_prefix('/')?;
    let (name, arg) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
    let arg = arg.trim();
    Some(match (name, arg.is_empty()) {
        ("clear", true) => Command::Clear,
        ("save", false) => Command::Save(arg),
        _ => Command::Unknown(line),
    })
}

/// Tokens per reply when `-n` is not given.
const DEFAULT_N_PREDICT: usize = 1024;

/// Tokens per reply of a random-weight stand-in when `-n` is not given.
const STAND_IN_N_PREDICT: usize = 64;

/// Text as the terminal may show it: control characters other than newline and tab (ESC, BEL,
/// backspace, carriage return, C1 codes: what a model's raw bytes can hold) become U+FFFD, so
/// a reply cannot move the cursor, recolour or clear the terminal.
fn printable(t: &str) -> std::borrow::Cow<'_, str> {
    if !t.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return t.into();
    }
    t.chars()
        .map(|c| {
            if c.is_control() && c != '\n' && c != '\t' {
                '\u{FFFD}'
            } else {
                c
            }
        })
        .collect::<String>()
        .into()
}

/// The reply length: `-n`, else [`DEFAULT_N_PREDICT`], or [`STAND_IN_N_PREDICT`] for a
/// random-weight stand-in, whose replies are noise (with a note saying so).
fn reply_length(args: &ChatArgs, meta: &hmoe_gguf::Metadata) -> usize {
    let stand_in = meta
        .get_str("general.name")
        .is_some_and(|n| n.starts_with("hmoe synthetic"));
    if stand_in {
        eprintln!(
            "hmoe chat: this is a random-weight stand-in (make-test-model): its replies are noise{}; \
             scripts/fetch-real-models.sh fetches small real models (SmolLM2-135M, \
             Qwen2.5-Coder-0.5B) that answer",
            if args.n_predict.is_none() {
                format!(", cut at {STAND_IN_N_PREDICT} tokens (-n to change)")
            } else {
                String::new()
            }
        );
    }
    args.n_predict.unwrap_or(if stand_in {
        STAND_IN_N_PREDICT
    } else {
        DEFAULT_N_PREDICT
    })
}

/// Carries out a `/` command typed at the prompt.
fn run_command(c: Command<'_>, messages: &mut Vec<Value>, system: &[Value]) -> anyhow::Result<()> {
    match c {
        Command::Clear => {
            *messages = system.to_vec();
            eprintln!("(conversation cleared)");
        }
        Command::Save(file) => {
            let text = serde_json::to_string_pretty(&messages)?;
            match std::fs::write(file, text + "\n") {
                Ok(()) => eprintln!("(saved {} messages to {file})", messages.len()),
                Err(e) => eprintln!("could not write {file}: {e}"),
            }
        }
        Command::Unknown(c) => eprintln!("unknown command {c} (/clear, /save FILE)"),
    }
    Ok(())
}

/// Prints a reply's pieces as they come: the answer on stdout (and kept in `answer`),
/// reasoning and tool calls on stderr, control bytes replaced.
fn show(deltas: Vec<ChatDelta>, answer: &mut String) {
    for d in deltas {
        match d {
            ChatDelta::Content(t) => {
                print!("{}", printable(&t));
                answer.push_str(&t);
            }
            ChatDelta::Reasoning(t) => eprint!("{}", printable(&t)),
            ChatDelta::ToolCallStart { name, .. } => eprint!("[tool call {}] ", printable(&name)),
            ChatDelta::ToolCallArgs { delta, .. } => eprint!("{}", printable(&delta)),
        }
    }
    let _ = std::io::stdout().flush();
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
    if let Value::Object(m) = &mut extra {
        // Thinking on, as llama.cpp tells every template (DeepSeek R1 / V3.1 templates close
        // `<think>` when it is not set).
        m.insert("enable_thinking".into(), true.into());
        if let Some(effort) = &args.reasoning_effort {
            m.insert("reasoning_effort".into(), effort.clone().into());
        }
    }
    let n_predict = reply_length(&args, meta);
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
    let system = messages.clone();
    // SIGINT sets `interrupted`; while it is already set (at the prompt) SIGINT does what it
    // always does and ends the program.
    let interrupted = Arc::new(AtomicBool::new(true));
    signal_hook::flag::register_conditional_default(
        signal_hook::consts::SIGINT,
        interrupted.clone(),
    )
    .context("installing the Ctrl-C handler")?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, interrupted.clone())
        .context("installing the Ctrl-C handler")?;
    eprintln!(
        "hmoe chat: {} - Ctrl-C stops a reply; Ctrl-C at the prompt or Ctrl-D leaves; /clear starts over, /save FILE keeps the conversation",
        args.model.model.display()
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        interrupted.store(true, Ordering::SeqCst);
        eprint!("\n> ");
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        if let Some(c) = command(&line) {
            run_command(c, &mut messages, &system)?;
            continue;
        }
        messages.push(json!({"role": "user", "content": line}));
        let prompt = template.render(&Value::Array(messages.clone()), None, true, &extra)?;
        let ids = tok.encode(&prompt, false, true)?;
        if ids.len() + n_predict > n_ctx {
            messages.pop();
            eprintln!(
                "the conversation ({} tokens) and a reply of -n {} no longer fit the context ({n_ctx}); /clear, or restart with a larger -c",
                ids.len(),
                n_predict
            );
            continue;
        }
        let mut splitter = match &harmony {
            Some(h) => Splitter::Harmony(Box::new(HarmonyStream::new(*h, args.reasoning_format))),
            None => Splitter::Think(
                ThinkSplitter::new(args.reasoning_format, hmoe_chat::open_think(&prompt)),
                StreamDecoder::new(),
            ),
        };
        let mut answer = String::new();
        let is_stop = |id: u32| tok.is_eog(id) || harmony.as_ref().is_some_and(|h| h.is_stop(id));
        interrupted.store(false, Ordering::SeqCst);
        let out = generator.generate(
            &ids,
            n_predict,
            &mut sampler,
            None,
            0,
            &is_stop,
            &mut |id| {
                show(splitter.push(&tok, id), &mut answer);
                !interrupted.load(Ordering::SeqCst)
            },
        )?;
        show(splitter.finish(), &mut answer);
        println!();
        if interrupted.load(Ordering::SeqCst) {
            eprintln!("[stopped]");
        }
        let t = &out.timings;
        eprintln!(
            "[{} tokens, {:.1} t/s; prompt {} tokens, {:.1} t/s]",
            out.generated.len(),
            t.decode_tps(),
            out.prompt_tokens.len(),
            t.prompt_tps()
        );
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_bytes_are_not_printed() {
        assert_eq!(printable("a\tb\nc"), "a\tb\nc");
        assert_eq!(
            printable("x\x1b[2Jy\x07\r\u{9b}z"),
            "x\u{FFFD}[2Jy\u{FFFD}\u{FFFD}\u{FFFD}z"
        );
    }

    #[test]
    fn commands() {
        assert_eq!(command("/clear"), Some(Command::Clear));
        assert_eq!(
            command("  /save  my chat.json "),
            Some(Command::Save("my chat.json"))
        );
        assert_eq!(command("/save"), Some(Command::Unknown("/save")));
        assert_eq!(command("/quit"), Some(Command::Unknown("/quit")));
        assert_eq!(command("hello /clear"), None);
    }
}
