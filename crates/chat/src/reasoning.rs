//! Splitting model output into reasoning and answer for OpenAI-style responses.
//!
//! * `<think>…</think>` models (Qwen3, DeepSeek R1/V3.1): [`ThinkSplitter`] on the text stream.
//! * gpt-oss (harmony): [`HarmonyStream`] on the token stream; `analysis` becomes reasoning,
//!   `final` (and tool-less `commentary`) becomes content, `to=functions.NAME` becomes a tool call.

use hmoe_tokenizer::{StreamDecoder, Tokenizer};

use crate::harmony::{HarmonyEvent, HarmonyParser, HarmonyStop, HarmonyTokens};
use crate::ChatError;

/// Where reasoning text goes (llama.cpp's `--reasoning-format`). `deepseek-legacy` reads as
/// [`ReasoningFormat::Deepseek`]: llama-server (d32676d77) answers the same for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningFormat {
    /// No parsing: the raw text (with `<think>` tags or harmony markup) is the content.
    None,
    /// Reasoning into `reasoning_content` (same as `Deepseek`).
    #[default]
    Auto,
    /// Reasoning into `reasoning_content`.
    Deepseek,
}

impl std::str::FromStr for ReasoningFormat {
    type Err = ChatError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(ReasoningFormat::None),
            "auto" => Ok(ReasoningFormat::Auto),
            "deepseek" | "deepseek-legacy" => Ok(ReasoningFormat::Deepseek),
            other => Err(ChatError::Input(format!(
                "unknown reasoning format '{other}' (none, auto, deepseek, deepseek-legacy)"
            ))),
        }
    }
}

/// A piece of a streamed chat response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatDelta {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A tool call begins (`index` counts calls in this response).
    ToolCallStart {
        /// Position of the call in the response.
        index: usize,
        /// Function name.
        name: String,
    },
    /// More argument text of tool call `index`.
    ToolCallArgs {
        /// Position of the call in the response.
        index: usize,
        /// Argument text (JSON, streamed).
        delta: String,
    },
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Streaming `<think>…</think>` splitter.
///
/// Reasoning is recognised when the output starts with `<think>` (leading whitespace allowed) or
/// when the prompt already opened it (`opened`, e.g. DeepSeek R1 templates that end with
/// `<think>\n`). Text after `</think>` is content, with its leading whitespace removed. Tags
/// split across chunks are held back until they are complete.
///
/// As llama-server does, a prompt that opened `<think>` counts as the start of the output: the
/// whitespace after its `<think>` begins the reasoning, and with [`ReasoningFormat::None`] the
/// content begins with the prompt's `<think>` and that whitespace.
#[derive(Debug, Clone)]
pub struct ThinkSplitter {
    format: ReasoningFormat,
    state: ThinkState,
    held: String,
}

/// The tail of `prompt` from the `<think>` it ends in (only whitespace after it), if it does.
pub fn open_think(prompt: &str) -> Option<&str> {
    let at = prompt.trim_end().strip_suffix(OPEN).map(str::len)?;
    Some(&prompt[at..])
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ThinkState {
    /// Nothing but whitespace seen yet.
    Start,
    /// Inside reasoning.
    Thinking,
    /// Just after `</think>`: skipping whitespace.
    AfterClose,
    /// Answer text.
    Content,
}

impl ThinkSplitter {
    /// A splitter; `opened` is the prompt's tail from the `<think>` it ends in (see
    /// [`open_think`]), `None` when the prompt did not open reasoning.
    pub fn new(format: ReasoningFormat, opened: Option<&str>) -> ThinkSplitter {
        let (state, held) = match opened {
            None => (ThinkState::Start, String::new()),
            // The prompt's text is shown again as the raw output's start.
            Some(open) if format == ReasoningFormat::None => (ThinkState::Content, open.into()),
            Some(open) => (
                ThinkState::Thinking,
                open.strip_prefix(OPEN).unwrap_or(open).to_string(),
            ),
        };
        ThinkSplitter {
            format,
            state,
            held,
        }
    }

    /// Feeds a chunk of output text.
    pub fn push(&mut self, text: &str) -> Vec<ChatDelta> {
        let mut out = Vec::new();
        if self.format == ReasoningFormat::None {
            let held = std::mem::take(&mut self.held);
            push_delta(&mut out, ChatDelta::Content(held + text));
            return out;
        }
        self.held.push_str(text);
        loop {
            match self.state {
                ThinkState::Start => {
                    let trimmed = self.held.trim_start();
                    if trimmed.is_empty() {
                        break;
                    }
                    if let Some(rest) = trimmed.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = ThinkState::Thinking;
                    } else if OPEN.starts_with(trimmed) {
                        break; // maybe the start of `<think>`
                    } else {
                        self.state = ThinkState::Content;
                    }
                }
                ThinkState::Thinking => match self.held.find(CLOSE) {
                    Some(pos) => {
                        push_delta(&mut out, ChatDelta::Reasoning(self.held[..pos].to_string()));
                        self.held = self.held[pos + CLOSE.len()..].to_string();
                        self.state = ThinkState::AfterClose;
                    }
                    None => {
                        let keep = partial_suffix(&self.held, CLOSE);
                        let emit = self.held.len() - keep;
                        push_delta(
                            &mut out,
                            ChatDelta::Reasoning(self.held[..emit].to_string()),
                        );
                        self.held.drain(..emit);
                        break;
                    }
                },
                ThinkState::AfterClose => {
                    let trimmed = self.held.trim_start();
                    if trimmed.is_empty() {
                        self.held.clear();
                        break;
                    }
                    self.held = trimmed.to_string();
                    self.state = ThinkState::Content;
                }
                ThinkState::Content => {
                    push_delta(&mut out, ChatDelta::Content(std::mem::take(&mut self.held)));
                    break;
                }
            }
        }
        out
    }

    /// Ends the stream, flushing held-back text.
    pub fn finish(&mut self) -> Vec<ChatDelta> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        match self.state {
            ThinkState::Thinking => push_delta(&mut out, ChatDelta::Reasoning(held)),
            ThinkState::Start | ThinkState::Content => {
                push_delta(&mut out, ChatDelta::Content(held))
            }
            ThinkState::AfterClose => {}
        }
        out
    }
}

pub(crate) fn push_delta(out: &mut Vec<ChatDelta>, d: ChatDelta) {
    let empty = match &d {
        ChatDelta::Content(s) | ChatDelta::Reasoning(s) => s.is_empty(),
        ChatDelta::ToolCallArgs { delta, .. } => delta.is_empty(),
        ChatDelta::ToolCallStart { .. } => false,
    };
    if !empty {
        out.push(d);
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `tag`.
pub(crate) fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| {
            s.len() >= n && s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..])
        })
        .unwrap_or(0)
}

/// Turns gpt-oss output tokens into [`ChatDelta`]s.
#[derive(Debug, Clone)]
pub struct HarmonyStream {
    format: ReasoningFormat,
    parser: HarmonyParser,
    raw: StreamDecoder,
    /// What the current message's content is routed to.
    route: Route,
    n_calls: usize,
    stop: Option<HarmonyStop>,
    /// Whether the output is harmony: unknown until the first header is read or goes wrong.
    shape: Shape,
    /// Raw text while the shape is unknown (shown as content if it is not harmony).
    pending_raw: String,
}

/// What the output turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Unknown,
    Harmony,
    /// Not harmony (e.g. a model with random weights): the raw text is the content.
    Raw,
}

/// Longest first header accepted after `assistant` (e.g. `<|channel|>commentary
/// to=functions.NAME <|constrain|>json`).
const MAX_HEADER: usize = 256;

/// Whether `rest`, the header text after `assistant` so far, can still become a harmony header:
/// it starts with `<|channel|>` or ` to=`.
fn plausible_header(rest: &str) -> bool {
    rest.len() <= MAX_HEADER
        && !rest.contains('\n')
        && ["<|channel|>", " to="]
            .iter()
            .any(|p| rest.starts_with(p) || p.starts_with(rest))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Content,
    Reasoning,
    Call(usize),
    Drop,
}

impl HarmonyStream {
    /// A stream for output that follows a prompt ending in `<|start|>assistant`.
    pub fn new(tokens: HarmonyTokens, format: ReasoningFormat) -> HarmonyStream {
        HarmonyStream {
            format,
            parser: HarmonyParser::for_generation(tokens),
            raw: StreamDecoder::new(),
            route: Route::Drop,
            n_calls: 0,
            stop: None,
            shape: Shape::Unknown,
            pending_raw: String::new(),
        }
    }

    /// Feeds one generated token.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Vec<ChatDelta> {
        let mut out = Vec::new();
        if self.format == ReasoningFormat::None {
            // Raw text, markup included (special tokens rendered as their text).
            push_delta(&mut out, ChatDelta::Content(self.raw.push(tok, id)));
            if self.parser.tokens().is_stop(id) {
                self.stop = Some(if id == self.parser.tokens().call {
                    HarmonyStop::Call
                } else {
                    HarmonyStop::Return
                });
            }
            return out;
        }
        // Control tokens (`<|return|>`...) are not text of a non-harmony answer.
        let piece = if tok.is_control(id) {
            String::new()
        } else {
            self.raw.push(tok, id)
        };
        match self.shape {
            Shape::Raw => {
                push_delta(&mut out, ChatDelta::Content(piece));
                return out;
            }
            Shape::Unknown => self.pending_raw.push_str(&piece),
            Shape::Harmony => {}
        }
        for ev in self.parser.push(tok, id) {
            if matches!(ev, HarmonyEvent::MessageStart(_)) {
                self.shape = Shape::Harmony;
                self.pending_raw.clear();
            }
            self.route_event(ev, &mut out);
        }
        if self.shape == Shape::Unknown {
            let rest = self
                .parser
                .pending_header()
                .and_then(|h| h.strip_prefix("assistant"));
            if !rest.is_some_and(plausible_header) {
                // Not harmony: everything so far, and from now on each token, is content.
                self.shape = Shape::Raw;
                push_delta(
                    &mut out,
                    ChatDelta::Content(std::mem::take(&mut self.pending_raw)),
                );
            }
        }
        out
    }

    fn route_event(&mut self, ev: HarmonyEvent, out: &mut Vec<ChatDelta>) {
        match ev {
            HarmonyEvent::MessageStart(h) => {
                self.route = if let Some(name) = h.function_call() {
                    let index = self.n_calls;
                    self.n_calls += 1;
                    out.push(ChatDelta::ToolCallStart {
                        index,
                        name: name.to_string(),
                    });
                    Route::Call(index)
                } else {
                    match h.channel.as_deref() {
                        Some("analysis") => Route::Reasoning,
                        // Built-in tool calls (browser, python) are not functions: not shown.
                        _ if h.recipient.is_some() => Route::Drop,
                        _ => Route::Content,
                    }
                };
            }
            HarmonyEvent::Content(text) => match self.route {
                Route::Content => push_delta(out, ChatDelta::Content(text)),
                Route::Reasoning => push_delta(out, ChatDelta::Reasoning(text)),
                Route::Call(index) => {
                    push_delta(out, ChatDelta::ToolCallArgs { index, delta: text })
                }
                Route::Drop => {}
            },
            HarmonyEvent::MessageEnd(stop) => {
                if matches!(stop, HarmonyStop::Return | HarmonyStop::Call) {
                    self.stop = Some(stop);
                }
                self.route = Route::Drop;
            }
        }
    }

    /// Ends the stream.
    pub fn finish(&mut self) -> Vec<ChatDelta> {
        let mut out = Vec::new();
        if self.format == ReasoningFormat::None || self.shape == Shape::Raw {
            push_delta(&mut out, ChatDelta::Content(self.raw.finish()));
            return out;
        }
        if self.shape == Shape::Unknown {
            // The output ended inside its first header: not a harmony message.
            self.pending_raw.push_str(&self.raw.finish());
            push_delta(
                &mut out,
                ChatDelta::Content(std::mem::take(&mut self.pending_raw)),
            );
            return out;
        }
        for ev in self.parser.finish() {
            self.route_event(ev, &mut out);
        }
        out
    }

    /// `Some(Return)` after `<|return|>`, `Some(Call)` after `<|call|>`: generation should stop.
    pub fn stopped(&self) -> Option<HarmonyStop> {
        self.stop
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(s: &mut ThinkSplitter, chunks: &[&str]) -> (String, String) {
        let (mut r, mut c) = (String::new(), String::new());
        let mut all: Vec<ChatDelta> = chunks.iter().flat_map(|ch| s.push(ch)).collect();
        all.extend(s.finish());
        for d in all {
            match d {
                ChatDelta::Reasoning(t) => r.push_str(&t),
                ChatDelta::Content(t) => c.push_str(&t),
                other => panic!("{other:?}"),
            }
        }
        (r, c)
    }

    #[test]
    fn think_tags_split_across_chunks() {
        let mut s = ThinkSplitter::new(ReasoningFormat::Auto, None);
        let (r, c) = run(
            &mut s,
            &[
                "\n<th",
                "ink>Let me",
                " see.</th",
                "ink>\n\nThe answer",
                " is 4.",
            ],
        );
        assert_eq!(
            (r.as_str(), c.as_str()),
            ("Let me see.", "The answer is 4.")
        );
        // No tag: all content.
        let mut s = ThinkSplitter::new(ReasoningFormat::Deepseek, None);
        assert_eq!(
            run(&mut s, &["<thi", "nk?> no"]),
            (String::new(), "<think?> no".to_string())
        );
        // Prompt opened the reasoning: its whitespace after `<think>` starts it (as llama-server).
        let mut s = ThinkSplitter::new(ReasoningFormat::Auto, Some("<think>\n"));
        assert_eq!(
            run(&mut s, &["hmm</think>ok"]),
            ("\nhmm".to_string(), "ok".to_string())
        );
        // ... and with format none the raw content starts with the prompt's `<think>\n`.
        let mut s = ThinkSplitter::new(ReasoningFormat::None, Some("<think>\n"));
        assert_eq!(
            run(&mut s, &["abc</think>", "xyz"]),
            (String::new(), "<think>\nabc</think>xyz".to_string())
        );
        let mut s = ThinkSplitter::new(ReasoningFormat::None, Some("<think>"));
        assert_eq!(run(&mut s, &[]), (String::new(), "<think>".to_string()));
        assert_eq!(open_think("<｜Assistant｜><think>\n"), Some("<think>\n"));
        assert_eq!(open_think("x<think>"), Some("<think>"));
        assert_eq!(open_think("<think>\n</think>"), None);
        // Unclosed reasoning stays reasoning.
        let mut s = ThinkSplitter::new(ReasoningFormat::Auto, None);
        assert_eq!(
            run(&mut s, &["<think>abc</thi"]),
            ("abc</thi".to_string(), String::new())
        );
        // Format none: raw text.
        let mut s = ThinkSplitter::new(ReasoningFormat::None, None);
        assert_eq!(
            run(&mut s, &["<think>a</think>b"]),
            (String::new(), "<think>a</think>b".to_string())
        );
    }

    #[test]
    fn partial_suffixes() {
        assert_eq!(partial_suffix("abc</th", CLOSE), 4);
        assert_eq!(partial_suffix("abc<", CLOSE), 1);
        assert_eq!(partial_suffix("abc", CLOSE), 0);
        assert_eq!(partial_suffix("é", CLOSE), 0);
        assert_eq!(
            "none".parse::<ReasoningFormat>().unwrap(),
            ReasoningFormat::None
        );
        assert!("x".parse::<ReasoningFormat>().is_err());
        assert_eq!(
            "deepseek-legacy".parse::<ReasoningFormat>().unwrap(),
            ReasoningFormat::Deepseek
        );
    }
}
