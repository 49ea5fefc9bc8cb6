//! Turning generated tokens into response pieces: plain text, `<think>` splitting, the tool calls
//! of Qwen3 / Qwen3-Coder / DeepSeek templates, or gpt-oss harmony channels and tool calls, with
//! stop strings held back until they can no longer match.

use std::sync::Arc;

use hmoe_chat::{
    ChatDelta, HarmonyStream, HarmonyTokens, ReasoningFormat, ThinkSplitter, ToolCallParser,
    ToolCallSpec,
};
use hmoe_tokenizer::{StreamDecoder, Tokenizer};

/// How a request's output is read.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputKind {
    /// Plain text (completions, chat templates without reasoning).
    Text,
    /// `<think>…</think>` reasoning; `Some` = the prompt's tail from the `<think>` it opened
    /// (see [`hmoe_chat::open_think`]).
    Think(ReasoningFormat, Option<String>),
    /// Text whose content holds tool calls in `spec`'s format (after `<think>` splitting as
    /// [`OutputKind::Think`] when `think` is set).
    ToolCalls {
        /// The reasoning format and the `<think>` the prompt opened, as in
        /// [`OutputKind::Think`], for templates with reasoning.
        think: Option<(ReasoningFormat, Option<String>)>,
        /// The format and the request's tools.
        spec: Arc<ToolCallSpec>,
    },
    /// gpt-oss harmony after a prompt ending in `<|start|>assistant`.
    Harmony(HarmonyTokens, ReasoningFormat),
}

/// Holds back text that may be the start of a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    hit: Option<String>,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Default::default()
        }
    }

    /// The stop string that matched, once one did.
    pub fn hit(&self) -> Option<&str> {
        self.hit.as_deref()
    }

    /// Feeds text; returns the part that is certainly not (the start of) a stop string. After
    /// a match, returns the text before it and nothing ever again.
    pub fn push(&mut self, text: &str) -> String {
        if self.hit.is_some() {
            return String::new();
        }
        if self.stops.is_empty() {
            return text.to_string();
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|p| (p, s)))
            .min_by_key(|(p, _)| *p);
        if let Some((pos, stop)) = first {
            self.hit = Some(stop.clone());
            let out = self.held[..pos].to_string();
            self.held.clear();
            return out;
        }
        let keep = self
            .stops
            .iter()
            .map(|s| partial_suffix(&self.held, s))
            .max()
            .unwrap_or(0);
        let emit = self.held.len() - keep;
        let out = self.held[..emit].to_string();
        self.held.drain(..emit);
        out
    }

    /// Ends the stream: held-back text was not a stop string after all.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest proper prefix of `tag` that ends `s` (at a character boundary).
fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| {
            s.len() >= n
                && s.is_char_boundary(s.len() - n)
                && tag.as_bytes().starts_with(&s.as_bytes()[s.len() - n..])
        })
        .unwrap_or(0)
}

/// The reader of one request's output.
pub struct OutputState {
    kind: OutputKind,
    decoder: StreamDecoder,
    think: Option<ThinkSplitter>,
    calls: Option<ToolCallParser>,
    harmony: Option<HarmonyStream>,
    stop: StopMatcher,
}

impl OutputState {
    /// A reader of `kind` output that stops at any of `stops`.
    pub fn new(kind: OutputKind, stops: Vec<String>) -> OutputState {
        let (think, calls, harmony) = match &kind {
            OutputKind::Text => (None, None, None),
            OutputKind::Think(f, open) => {
                (Some(ThinkSplitter::new(*f, open.as_deref())), None, None)
            }
            OutputKind::ToolCalls { think, spec } => (
                think
                    .as_ref()
                    .map(|(f, open)| ThinkSplitter::new(*f, open.as_deref())),
                Some(ToolCallParser::new(spec.clone())),
                None,
            ),
            OutputKind::Harmony(t, f) => (None, None, Some(HarmonyStream::new(*t, *f))),
        };
        OutputState {
            kind,
            decoder: StreamDecoder::new(),
            think,
            calls,
            harmony,
            stop: StopMatcher::new(stops),
        }
    }

    /// The stop string that ended the output, if any.
    pub fn stop_hit(&self) -> Option<&str> {
        self.stop.hit()
    }

    /// Whether an end-of-generation token should be read too (harmony needs `<|return|>` /
    /// `<|call|>` to close its message; text outputs drop it).
    pub fn reads_eog(&self) -> bool {
        matches!(self.kind, OutputKind::Harmony(..))
    }

    /// Whether the output is complete before the model stopped: the one tool call of a request
    /// without `parallel_tool_calls` was read.
    pub fn ended(&self) -> bool {
        self.calls.as_ref().is_some_and(ToolCallParser::done)
    }

    /// Feeds one generated token.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Vec<ChatDelta> {
        let mut out = Vec::new();
        match &self.kind {
            OutputKind::Text | OutputKind::Think(..) | OutputKind::ToolCalls { .. } => {
                // Control tokens are not text, except a tool-call format's markup.
                let markup = match &self.kind {
                    OutputKind::ToolCalls { spec, .. } => tok
                        .token_text(id)
                        .filter(|t| spec.format().markers().contains(t)),
                    _ => None,
                };
                if tok.is_control(id) && markup.is_none() {
                    return out;
                }
                let text = match markup {
                    Some(m) if tok.is_control(id) => {
                        let mut t = self.decoder.finish();
                        t.push_str(m);
                        t
                    }
                    _ => self.decoder.push(tok, id),
                };
                let safe = self.stop.push(&text);
                self.text_out(&safe, &mut out);
            }
            OutputKind::Harmony(..) => {
                let deltas = match &mut self.harmony {
                    Some(h) => h.push(tok, id),
                    None => Vec::new(),
                };
                self.harmony_out(deltas, &mut out);
            }
        }
        out
    }

    /// Ends the output, flushing what was held back.
    pub fn finish(&mut self) -> Vec<ChatDelta> {
        let mut out = Vec::new();
        match self.kind {
            OutputKind::Text | OutputKind::Think(..) | OutputKind::ToolCalls { .. } => {
                let tail = self.decoder.finish();
                let mut safe = self.stop.push(&tail);
                safe.push_str(&self.stop.flush());
                self.text_out(&safe, &mut out);
                if let Some(t) = &mut self.think {
                    let rest = t.finish();
                    self.route_content(rest, &mut out);
                }
                if let Some(c) = &mut self.calls {
                    out.extend(c.finish());
                }
            }
            OutputKind::Harmony(..) => {
                let deltas = match &mut self.harmony {
                    Some(h) => h.finish(),
                    None => Vec::new(),
                };
                self.harmony_out(deltas, &mut out);
                let held = self.stop.flush();
                if !held.is_empty() {
                    out.push(ChatDelta::Content(held));
                }
            }
        }
        out
    }

    fn text_out(&mut self, text: &str, out: &mut Vec<ChatDelta>) {
        if text.is_empty() {
            return;
        }
        let deltas = match &mut self.think {
            Some(t) => t.push(text),
            None => vec![ChatDelta::Content(text.to_string())],
        };
        self.route_content(deltas, out);
    }

    /// Content goes through the tool-call reader when there is one.
    fn route_content(&mut self, deltas: Vec<ChatDelta>, out: &mut Vec<ChatDelta>) {
        let Some(calls) = &mut self.calls else {
            out.extend(deltas);
            return;
        };
        for d in deltas {
            match d {
                ChatDelta::Content(t) => out.extend(calls.push(&t)),
                other => out.push(other),
            }
        }
    }

    fn harmony_out(&mut self, deltas: Vec<ChatDelta>, out: &mut Vec<ChatDelta>) {
        for d in deltas {
            match d {
                ChatDelta::Content(t) => {
                    let safe = self.stop.push(&t);
                    if !safe.is_empty() {
                        out.push(ChatDelta::Content(safe));
                    }
                }
                other if self.stop.hit().is_none() => out.push(other),
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_held_back_and_cut() {
        let mut m = StopMatcher::new(vec!["END".into(), "".into()]);
        assert_eq!(m.push("abc E"), "abc ");
        assert_eq!(m.push("N"), "");
        assert_eq!(m.push("X"), "ENX");
        assert_eq!(m.push("yyEN"), "yy");
        assert_eq!(m.push("Dzz"), "");
        assert_eq!(m.hit(), Some("END"));
        assert_eq!(m.push("more"), "");
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("aé"), "a");
        assert_eq!(m.flush(), "é");
        let mut none = StopMatcher::new(Vec::new());
        assert_eq!(none.push("x"), "x");
    }

    #[test]
    fn earliest_stop_wins() {
        let mut m = StopMatcher::new(vec!["cd".into(), "b".into()]);
        assert_eq!(m.push("abcd"), "a");
        assert_eq!(m.hit(), Some("b"));
    }
}
