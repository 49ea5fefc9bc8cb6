//! Constrained sampling with llguidance: GBNF and Lark grammars, JSON schemas, any JSON
//! object, and the tool-call formats of chat templates (gpt-oss harmony, `<tool_call>` tags),
//! enforced token by token over hmoe's tokenizer.
//!
//! A [`Vocab`] is llguidance's view of a tokenizer: a trie of every token's bytes, chat markup
//! tokens (control tokens, and user-defined ones written `<…>`) under llguidance's
//! special-token marker so grammars name them as `<|name|>`, and the end-of-generation tokens
//! as its EOS set. Building it walks the whole vocabulary once (seconds for a 200k vocabulary: build
//! it once per tokenizer, off the async workers). [`Vocab::compile`] turns a [`Grammar`] into a [`Constraint`], which masks each step's logits ([`Constraint::mask`]) and
//! follows the chosen tokens ([`Constraint::accept`]).
//!
//! Compilation is bounded ([`limits`]): a grammar's size, rules, terminals and nesting are
//! checked before llguidance sees it, it compiles on a thread of its own with a large stack,
//! and its caller waits at most [`limits::COMPILE_TIMEOUT`]. llguidance's messages reach the
//! caller as one short line.
#![warn(missing_docs)]

mod gbnf;
pub mod limits;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use hmoe_tokenizer::{TokenAttr, Tokenizer, VocabType};
use llguidance::api::TopLevelGrammar;
use llguidance::{CancellationHandle, Matcher, ParserFactory};
use serde_json::{json, Value};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

pub use gbnf::{gbnf_to_lark, GbnfError};

/// Why a grammar could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// A GBNF grammar that does not parse.
    #[error(transparent)]
    Gbnf(#[from] GbnfError),
    /// llguidance refused the grammar or schema (its message, one short line).
    #[error("invalid grammar: {0}")]
    Invalid(String),
    /// The grammar is over one of the [`limits`] (the message names it).
    #[error("{0}")]
    Limit(String),
    /// The grammar could not be compiled for want of a resource (a thread, or a free place
    /// among [`limits::max_compiles`]).
    #[error("cannot compile the grammar now: {0}")]
    Unavailable(String),
    /// The constraint failed while generating (llguidance's message).
    #[error("constrained sampling failed: {0}")]
    Runtime(String),
    /// The compilation was stopped through its [`CompileCancel`] (its caller went away).
    #[error("the grammar's compilation was cancelled")]
    Cancelled,
}

/// Stops a compilation that is no longer wanted: [`CompileCancel::cancel`] (for instance when
/// the request that asked for it goes away) makes [`Vocab::compile_until`] return
/// [`GrammarError::Cancelled`], and the compiling thread stops at llguidance's next check
/// (its parser start and first mask check often; building the grammar from the text, bounded
/// by the [`limits`], is checked before and after), which gives its place among
/// [`limits::max_compiles`] back.
#[derive(Clone, Debug, Default)]
pub struct CompileCancel(Arc<AtomicBool>);

impl CompileCancel {
    /// A flag not yet set.
    pub fn new() -> CompileCancel {
        CompileCancel::default()
    }

    /// Asks the compilation to stop.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether [`CompileCancel::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// What the compiling thread shares with its caller: the caller's flag and llguidance's
/// cancellation handles of the work under way, which the caller cancels when its flag is set
/// or its deadline passes.
#[derive(Default)]
struct Stop {
    asked: CompileCancel,
    handles: Mutex<Vec<CancellationHandle>>,
}

impl Stop {
    /// `Err(Cancelled)` once the caller asked to stop.
    fn check(&self) -> Result<(), GrammarError> {
        match self.asked.is_cancelled() {
            true => Err(GrammarError::Cancelled),
            false => Ok(()),
        }
    }

    /// Lets the caller cancel `handle`'s work (at once when it already asked to stop).
    fn watch(&self, handle: Option<CancellationHandle>) {
        if let Some(h) = handle {
            let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
            if self.asked.is_cancelled() {
                h.cancel();
            }
            handles.push(h);
        }
    }

    /// Sets the flag and cancels the watched work.
    fn stop(&self) {
        self.asked.cancel();
        let handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        handles.iter().for_each(CancellationHandle::cancel);
    }
}

/// What to enforce.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// A GBNF grammar (llama.cpp's format; start rule `root`).
    Gbnf(String),
    /// An llguidance Lark grammar (start rule `start`).
    Lark(String),
    /// JSON valid against a JSON schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// A call of one of `tools`, written the way the model's chat format writes tool calls.
    ToolCall {
        /// The format.
        format: ToolFormat,
        /// The functions that may be called.
        tools: Vec<Tool>,
    },
}

impl Grammar {
    /// Its size as [`limits::MAX_GRAMMAR_BYTES`] counts it: the text, the schema as compact
    /// JSON, or the tools' names and parameter schemas.
    pub fn size(&self) -> usize {
        match self {
            Grammar::Gbnf(src) | Grammar::Lark(src) => src.len(),
            Grammar::JsonSchema(schema) => schema.to_string().len(),
            Grammar::JsonObject => 0,
            Grammar::ToolCall { tools, .. } => tools
                .iter()
                .map(|t| t.name.len() + t.parameters.as_ref().map_or(0, |p| p.to_string().len()))
                .sum(),
        }
    }
}

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// JSON schema of its arguments (`None`: any object).
    pub parameters: Option<Value>,
}

/// How a model writes a tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// gpt-oss harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
    /// + arguments + `<|call|>` (after a prompt ending in `<|start|>assistant`).
    Harmony,
    /// Hermes / Qwen: `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>`.
    ToolCallTags,
    /// DeepSeek V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`
    /// `<｜tool▁call▁end｜><｜tool▁calls▁end｜>`.
    DeepSeek,
    /// Llama 3.x: `{"name": NAME, "parameters": {...}}`.
    Llama3,
    /// Mistral: `[TOOL_CALLS][{"name": NAME, "arguments": {...}}]`.
    Mistral,
}

impl ToolFormat {
    /// The format of a tokenizer's chat markup: harmony when it has harmony's control tokens,
    /// `<tool_call>` tags when it has that token, DeepSeek's when it has its tool-call tokens,
    /// else `None`.
    pub fn detect(tok: &Tokenizer) -> Option<ToolFormat> {
        let markup = |t: &str| tok.token_id(t).is_some_and(|id| is_markup(tok, id));
        if markup("<|channel|>") && markup("<|constrain|>") && markup("<|call|>") {
            Some(ToolFormat::Harmony)
        } else if markup("<tool_call>") && markup("</tool_call>") {
            Some(ToolFormat::ToolCallTags)
        } else if DEEPSEEK_MARKUP.iter().all(|t| markup(t)) {
            Some(ToolFormat::DeepSeek)
        } else {
            None
        }
    }
}

/// DeepSeek's tool-call markup: calls begin, call begin, separator, call end, calls end.
const DEEPSEEK_MARKUP: [&str; 5] = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
];

/// Whether token `id` is chat markup, which grammars name as `<|name|>` rather than spell: a
/// control token, or a user-defined one written `<…>` (e.g. harmony's `<|channel|>`, Qwen's
/// `<tool_call>`, which GGUF files mark user-defined).
fn is_markup(tok: &Tokenizer, id: u32) -> bool {
    let attr = tok.token_attr(id);
    let text = tok.token_text(id).unwrap_or_default();
    attr.contains(TokenAttr::CONTROL)
        || (attr.contains(TokenAttr::USER_DEFINED)
            && text.len() > 2
            && text.starts_with('<')
            && text.ends_with('>'))
}

/// Where the constrained text goes in the model's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    /// The whole output is the grammar's text.
    Raw,
    /// gpt-oss harmony: the output is a `final` channel message whose content is the grammar's
    /// text: `<|channel|>final<|message|>` + text + `<|return|>`.
    HarmonyFinal,
}

/// llguidance's view of a tokenizer (see the crate docs).
pub struct Vocab {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab")
            .field("n_vocab", &self.factory.tok_env().tok_trie().vocab_size())
            .finish()
    }
}

/// Tokenization for llguidance's forced tokens: the tokenizer itself while it lives.
struct Env {
    trie: TokTrie,
    tok: Weak<Tokenizer>,
    canonical: bool,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let encoded = match (std::str::from_utf8(s), self.tok.upgrade()) {
            (Ok(text), Some(tok)) => tok.encode(text, false, false).ok(),
            _ => None,
        };
        encoded.unwrap_or_else(|| self.trie.greedy_tokenize(s))
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

impl Vocab {
    /// Builds the trie of `tok`'s vocabulary.
    pub fn new(tok: &Arc<Tokenizer>) -> Result<Vocab, GrammarError> {
        let n = tok.n_vocab();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| match is_markup(tok, id) {
                true => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tok.token_text(id).unwrap_or_default().as_bytes());
                    w
                }
                false => tok.token_bytes(id).to_vec(),
            })
            .collect();
        let eog: Vec<u32> = tok.eog_tokens().to_vec();
        let eos = eog.first().copied().or(tok.eos()).unwrap_or(0);
        let mut info = TokRxInfo::new(n as u32, eos);
        info.tok_bos = tok.bos();
        let mut trie = TokTrie::from(&info, &words);
        if !eog.is_empty() {
            trie = trie.with_eos_tokens(&eog);
        }
        let env: TokEnv = Arc::new(Env {
            trie,
            tok: Arc::downgrade(tok),
            // SentencePiece encodings of a piece of text add a leading space.
            canonical: tok.vocab_type() == VocabType::Bpe,
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| GrammarError::Invalid(limits::short_message(&e.to_string())))?;
        factory.quiet();
        // No parser state or grammar text in messages: they go to clients.
        factory.limits_mut().verbose_errors = false;
        Ok(Vocab {
            factory: Arc::new(factory),
        })
    }

    /// The Lark text llguidance compiles for `grammar` in `frame`, once `grammar` is found
    /// within the [`limits`].
    pub fn lark(&self, grammar: &Grammar, frame: Frame) -> Result<String, GrammarError> {
        limits::check(grammar.size(), limits::MAX_GRAMMAR_BYTES, "bytes")?;
        let body = match grammar {
            Grammar::Gbnf(src) => return framed(gbnf_to_lark(src)?, frame),
            Grammar::Lark(src) => {
                let n = limits::lark_counts(src);
                limits::check(n.rules, limits::MAX_RULES, "rules")?;
                limits::check(n.terminals, limits::MAX_TERMINALS, "terminals")?;
                limits::check(n.alternatives, limits::MAX_ALTERNATIVES, "alternatives")?;
                return framed(src.clone(), frame);
            }
            Grammar::JsonSchema(schema) => format!("start: {}\n", json_rule(schema.clone())?),
            Grammar::JsonObject => format!("start: {}\n", json_rule(json!({"type": "object"}))?),
            Grammar::ToolCall { format, tools } => return self.tool_call_lark(*format, tools),
        };
        framed(body, frame)
    }

    fn tool_call_lark(&self, format: ToolFormat, tools: &[Tool]) -> Result<String, GrammarError> {
        if tools.is_empty() {
            return Err(GrammarError::Invalid("no tool to call".into()));
        }
        limits::check(tools.len(), limits::MAX_TOOLS, "tools")?;
        let mut out = String::from("start: ");
        let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
        out.push_str(&alts.join(" | "));
        out.push('\n');
        let trie = self.factory.tok_env().tok_trie();
        // A control token by name, else its text.
        let mark = |t: &str| match trie.get_special_token(t) {
            Some(_) => t.to_string(),
            None => lark_string(t),
        };
        for (i, tool) in tools.iter().enumerate() {
            let params = tool
                .parameters
                .clone()
                .unwrap_or_else(|| json!({"type": "object"}));
            match format {
                ToolFormat::Harmony => {
                    out.push_str(&format!(
                        "call_{i}: {} {} {} {} {} {} {}\n",
                        mark("<|channel|>"),
                        lark_string(&format!("commentary to=functions.{} ", tool.name)),
                        mark("<|constrain|>"),
                        lark_string("json"),
                        mark("<|message|>"),
                        json_rule(params)?,
                        mark("<|call|>"),
                    ));
                }
                ToolFormat::ToolCallTags => {
                    let call = json!({
                        "type": "object",
                        "properties": {"name": {"const": tool.name}, "arguments": params},
                        "required": ["name", "arguments"],
                        "additionalProperties": false,
                    });
                    out.push_str(&format!(
                        "call_{i}: {} {} {} {} {}\n",
                        mark("<tool_call>"),
                        lark_string("\n"),
                        json_rule(call)?,
                        lark_string("\n"),
                        mark("</tool_call>"),
                    ));
                }
                ToolFormat::Llama3 | ToolFormat::Mistral => {
                    let key = match format {
                        ToolFormat::Llama3 => "parameters",
                        _ => "arguments",
                    };
                    let call = json!({
                        "type": "object",
                        "properties": {"name": {"const": tool.name}, key: params},
                        "required": ["name", key],
                        "additionalProperties": false,
                    });
                    let rule = if format == ToolFormat::Mistral {
                        let calls = json!({"type": "array", "items": call,
                                           "minItems": 1, "maxItems": 1});
                        format!("{} {}", mark("[TOOL_CALLS]"), json_rule(calls)?)
                    } else {
                        json_rule(call)?
                    };
                    out.push_str(&format!("call_{i}: {rule}\n"));
                }
                ToolFormat::DeepSeek => {
                    let [calls, call, sep, call_end, calls_end] = DEEPSEEK_MARKUP.map(mark);
                    out.push_str(&format!(
                        "call_{i}: {calls} {call} {} {sep} {} {call_end} {calls_end}\n",
                        lark_string(&tool.name),
                        json_rule(params)?,
                    ));
                }
            }
        }
        Ok(out)
    }

    /// Compiles `grammar` (framed as `frame`) into a constraint at the start of generation:
    /// [`Vocab::compile_until`] with a flag nobody sets.
    pub fn compile(&self, grammar: &Grammar, frame: Frame) -> Result<Constraint, GrammarError> {
        self.compile_until(grammar, frame, &CompileCancel::new())
    }

    /// Compiles `grammar` (framed as `frame`) into a constraint at the start of generation,
    /// and computes its first mask, so that a grammar that allows nothing (a `$ref` cycle) is
    /// refused here. In a frame the grammar's text starts after the frame's markup, so the
    /// grammar alone is compiled and checked first: the framed grammar's first mask is the
    /// markup's. The work runs on a thread with a [`limits::COMPILE_STACK`] stack. When
    /// `cancel` is set this returns [`GrammarError::Cancelled`], and after
    /// [`limits::COMPILE_TIMEOUT`] [`GrammarError::Limit`]; either way the thread is asked to
    /// stop (see [`CompileCancel`]).
    pub fn compile_until(
        &self,
        grammar: &Grammar,
        frame: Frame,
        cancel: &CompileCancel,
    ) -> Result<Constraint, GrammarError> {
        let lark = self.lark(grammar, frame)?;
        let unframed = match frame {
            Frame::Raw => None,
            Frame::HarmonyFinal => Some(self.lark(grammar, Frame::Raw)?),
        };
        let factory = self.factory.clone();
        let (tx, rx) = mpsc::sync_channel(1);
        let deadline = Instant::now() + limits::COMPILE_TIMEOUT;
        let slot = limits::CompileSlot::take(deadline)?;
        let stop = Arc::new(Stop {
            asked: CompileCancel::new(),
            handles: Mutex::default(),
        });
        let work = stop.clone();
        std::thread::Builder::new()
            .name("hmoe-grammar".into())
            .stack_size(limits::COMPILE_STACK)
            .spawn(move || {
                let _slot = slot;
                let checked =
                    unframed.map_or(Ok(()), |g| compile_lark(&factory, g, &work).map(drop));
                let _ = tx.send(checked.and_then(|()| compile_lark(&factory, lark, &work)));
            })
            .map_err(|e| GrammarError::Unavailable(format!("no compiler thread: {e}")))?;
        // Wait in short steps, so that the caller's flag is seen while the work runs.
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if cancel.is_cancelled() {
                stop.stop();
                return Err(GrammarError::Cancelled);
            }
            if left.is_zero() {
                stop.stop();
                return Err(GrammarError::Limit(format!(
                    "the grammar took longer than {} s to compile (the limit)",
                    limits::COMPILE_TIMEOUT.as_secs()
                )));
            }
            match rx.recv_timeout(left.min(CANCEL_POLL)) {
                Ok(compiled) => return compiled,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(GrammarError::Invalid("the grammar compiler failed".into()))
                }
            }
        }
    }
}

/// How often a caller waiting for a compilation looks at its [`CompileCancel`].
const CANCEL_POLL: Duration = Duration::from_millis(20);

/// Compiles Lark text into a constraint and computes its first mask (see
/// [`Vocab::compile_until`]), stopping where `stop` asks: llguidance's parser start and first
/// mask run under cancellation handles `stop` watches.
fn compile_lark(
    factory: &ParserFactory,
    lark: String,
    stop: &Stop,
) -> Result<Constraint, GrammarError> {
    let invalid = |e: &str| GrammarError::Invalid(limits::short_message(e));
    stop.check()?;
    let mut parser = factory
        .create_parser(TopLevelGrammar::from_lark(lark))
        .map_err(|e| invalid(&e.to_string()))?;
    stop.check()?;
    stop.watch(Some(parser.enable_cancellation()));
    let matcher = Matcher::new(Ok(parser));
    stop.check()?;
    if let Some(e) = matcher.get_error() {
        return Err(invalid(&e));
    }
    let mut probe = matcher.deep_clone();
    stop.watch(probe.cancellation_handle());
    let first = probe.compute_mask_or_eos();
    stop.check()?;
    let first = first.map_err(|e| {
        let message = limits::short_message(&e.to_string());
        GrammarError::Invalid(match message.starts_with("NoExtension") {
            true => {
                "the grammar allows no output (does a rule or `$ref` refer only to itself?)".into()
            }
            false => format!("the grammar fails at its start: {message}"),
        })
    })?;
    if first.num_set() == 0 {
        return Err(GrammarError::Invalid("the grammar allows no token".into()));
    }
    Ok(Constraint { matcher })
}

/// `%json` with compact separators (no free whitespace, which a weak model could emit without
/// end) unless the schema sets its own `x-guidance` options.
fn json_rule(mut schema: Value) -> Result<String, GrammarError> {
    llama_tuples(&mut schema, 0);
    match &mut schema {
        Value::Object(o) => {
            o.entry("x-guidance")
                .or_insert_with(|| json!({"whitespace_flexible": false}));
        }
        Value::Bool(true) => schema = json!({"x-guidance": {"whitespace_flexible": false}}),
        _ => {
            return Err(GrammarError::Invalid(
                "a JSON schema must be an object".into(),
            ))
        }
    }
    Ok(format!("%json {schema}"))
}

/// Schemas as llama.cpp's json-schema-to-grammar reads them where llguidance (JSON Schema
/// 2020-12) differs: an array-form `items` (a draft 4-7 tuple) is `prefixItems` and nothing
/// after them, and a schema without `type` that has `items` or `prefixItems` is an array (for
/// 2020-12 it would accept any value that is not one). Nested schemas alike, to a bounded depth.
fn llama_tuples(v: &mut Value, depth: usize) {
    const MAX_DEPTH: usize = 64;
    let Value::Object(o) = v else { return };
    if let Some(Value::Array(tuple)) = o.get("items").cloned() {
        if !o.contains_key("prefixItems") {
            o.insert("prefixItems".into(), Value::Array(tuple));
            o.insert("items".into(), Value::Bool(false));
        }
    }
    if !o.contains_key("type") && (o.contains_key("items") || o.contains_key("prefixItems")) {
        o.insert("type".into(), "array".into());
    }
    if depth >= MAX_DEPTH {
        return;
    }
    // Only where schemas sit (`const`, `enum`, `default` hold data, left as they are).
    for (key, child) in o.iter_mut() {
        match (key.as_str(), child) {
            ("properties" | "patternProperties" | "$defs" | "definitions", Value::Object(m)) => {
                for s in m.values_mut() {
                    llama_tuples(s, depth + 1);
                }
            }
            ("prefixItems" | "anyOf" | "oneOf" | "allOf", Value::Array(list)) => {
                for s in list.iter_mut() {
                    llama_tuples(s, depth + 1);
                }
            }
            ("items" | "additionalProperties" | "not" | "if" | "then" | "else" | "contains", s) => {
                llama_tuples(s, depth + 1)
            }
            _ => {}
        }
    }
}

/// Wraps a Lark grammar's `start` in `frame`.
fn framed(lark: String, frame: Frame) -> Result<String, GrammarError> {
    match frame {
        Frame::Raw => Ok(lark),
        Frame::HarmonyFinal => Ok(format!(
            "start: <|channel|> \"final\" <|message|> inner <|return|>\n{}",
            rename_start(&lark)
        )),
    }
}

/// The grammar with its rule `start` renamed to `inner` (definition and uses).
fn rename_start(lark: &str) -> String {
    let mut out = String::with_capacity(lark.len() + 16);
    let bytes = lark.as_bytes();
    let mut i = 0;
    let mut in_str = false;
    while i < bytes.len() {
        let c = bytes[i];
        if in_str {
            out.push(c as char);
            if c == b'\\' && i + 1 < bytes.len() {
                out.push(bytes[i + 1] as char);
                i += 1;
            } else if c == b'"' {
                in_str = false;
            }
            i += 1;
            continue;
        }
        if c == b'"' {
            in_str = true;
        }
        let word_start = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric() || matches!(bytes[i - 1], b'_' | b'-'));
        if word_start && lark[i..].starts_with("start") {
            let after = bytes.get(i + 5).copied();
            if !after.is_some_and(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-')) {
                out.push_str("inner");
                i += 5;
                continue;
            }
        }
        // Copy one whole UTF-8 character.
        let len = lark[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&lark[i..i + len]);
        i += len;
    }
    out
}

/// `text` as a Lark (JSON) string literal.
fn lark_string(text: &str) -> String {
    Value::String(text.to_string())
        .to_string()
        .replace('\u{7f}', "\\u007f")
}

/// A grammar being enforced on one generation.
pub struct Constraint {
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Constraint {
        Constraint {
            matcher: self.matcher.deep_clone(),
        }
    }
}

impl Constraint {
    /// Sets the logit of every token the grammar does not allow next to −∞ (only the
    /// end-of-generation tokens once the grammar is complete).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Runtime(limits::short_message(&e.to_string())))?;
        if allowed.num_set() == 0 {
            return Err(GrammarError::Runtime("the grammar allows no token".into()));
        }
        let n = logits.len();
        allowed.iter_unset_entries(|i| {
            if i < n {
                logits[i] = f32::NEG_INFINITY;
            }
        });
        Ok(())
    }

    /// Follows a generated token (one the mask allowed).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Runtime(limits::short_message(&e.to_string())))
    }

    /// Whether the grammar is complete and allows nothing more.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_is_renamed_outside_strings_only() {
        let l = rename_start("start: a \"start\" | start_x\nx: start\n");
        assert_eq!(l, "inner: a \"start\" | start_x\nx: inner\n");
    }

    #[test]
    fn schemas_get_compact_separators_unless_they_say() {
        assert!(json_rule(json!({"type": "object"}))
            .unwrap()
            .contains("\"whitespace_flexible\":false"));
        let own = json_rule(json!({"x-guidance": {"whitespace_flexible": true}})).unwrap();
        assert!(own.contains("true"), "{own}");
        assert!(json_rule(json!([1])).is_err());
    }

    #[test]
    fn draft7_tuples_read_as_llama_cpp_reads_them() {
        let mut v = json!({"items": [{"type": "integer"}],
                           "properties": {"p": {"items": [{"const": 1}, {"const": 2}]}}});
        llama_tuples(&mut v, 0);
        assert_eq!(v["type"], "array");
        assert_eq!(v["prefixItems"], json!([{"type": "integer"}]));
        assert_eq!(v["items"], false);
        assert_eq!(
            v["properties"]["p"]["prefixItems"],
            json!([{"const": 1}, {"const": 2}])
        );
        // A property named `items` and data in `const` are not tuples.
        let plain = json!({"type": "object", "properties": {"items": {"type": "string"}},
                           "const": {"items": [1]}, "default": {"items": [2]}});
        let mut same = plain.clone();
        llama_tuples(&mut same, 0);
        assert_eq!(same, plain);
    }
}
