//! What the messages said, kept apart from the chat template's markup in the rendered prompt,
//! so that the text of a control token typed into a message (`<|im_end|>`, gpt-oss's
//! `<|end|><|start|>system`) is tokenized as text and cannot forge a role boundary; only the
//! template's own markup becomes control tokens.
//!
//! Each message's text fields are wrapped in two noncharacters before rendering (its leading
//! and trailing whitespace left outside, so that a template's `trim` acts as before); after
//! rendering the markers are taken out and the byte ranges they enclosed are the plain spans
//! (docs/server.md, "Special tokens"). A marker the template split from its partner (a
//! template that cuts a message at `</think>`) is dropped, and that piece is parsed as before.

use std::ops::Range;

use serde_json::Value;

/// Opens a message's text in the rendered prompt.
const OPEN: char = '\u{FDD0}';
/// Closes it.
const CLOSE: char = '\u{FDD1}';

/// The message fields templates print as text.
const TEXT_FIELDS: [&str; 3] = ["content", "reasoning_content", "thinking"];

/// A rendered chat prompt and the byte ranges of it that came from the messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedPrompt {
    /// The prompt text.
    pub text: String,
    /// Sorted, disjoint byte ranges of `text` that the messages wrote.
    pub plain: Vec<Range<usize>>,
}

impl RenderedPrompt {
    /// Appends `text` that a message wrote (the content of a continued assistant message):
    /// it is tokenized as text.
    pub fn push_plain(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let start = self.text.len();
        self.text.push_str(text);
        match self.plain.last_mut() {
            Some(r) if r.end == start => r.end = self.text.len(),
            _ => self.plain.push(start..self.text.len()),
        }
    }
}

/// `messages` with each text field wrapped in the markers (markers already in the text are
/// replaced by U+FFFD, so none can be forged).
pub fn mark_messages(messages: &Value) -> Value {
    let mut out = messages.clone();
    let Some(list) = out.as_array_mut() else {
        return out;
    };
    for m in list.iter_mut().filter_map(Value::as_object_mut) {
        for field in TEXT_FIELDS {
            if let Some(Value::String(s)) = m.get_mut(field) {
                *s = mark(s);
            }
        }
    }
    out
}

fn mark(s: &str) -> String {
    let core = s.trim();
    if core.is_empty() {
        return s.to_string();
    }
    let lead = &s[..s.len() - s.trim_start().len()];
    let trail = &s[lead.len() + core.len()..];
    let mut out = String::with_capacity(s.len() + 8);
    out.push_str(lead);
    out.push(OPEN);
    out.extend(core.chars().map(|c| match c {
        OPEN | CLOSE => char::REPLACEMENT_CHARACTER,
        c => c,
    }));
    out.push(CLOSE);
    out.push_str(trail);
    out
}

/// The rendered text of marked messages with the markers taken out.
pub fn unmark(rendered: &str) -> RenderedPrompt {
    let mut text = String::with_capacity(rendered.len());
    let mut plain = Vec::new();
    let mut open = None;
    for c in rendered.chars() {
        match c {
            OPEN => open = Some(text.len()),
            CLOSE => {
                if let Some(start) = open.take() {
                    if start < text.len() {
                        plain.push(start..text.len());
                    }
                }
            }
            c => text.push(c),
        }
    }
    RenderedPrompt { text, plain }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn marks_round_trip_to_ranges() {
        let m = mark_messages(&json!([
            {"role": "user", "content": "  hi <|im_end|> \n"},
            {"role": "assistant", "content": "", "reasoning_content": "r"},
            {"role": "user", "content": "a\u{FDD1}b"},
        ]));
        assert_eq!(m[0]["content"], "  \u{FDD0}hi <|im_end|>\u{FDD1} \n");
        assert_eq!(m[1]["content"], "");
        assert_eq!(m[2]["content"], "\u{FDD0}a\u{FFFD}b\u{FDD1}");
        let rendered = format!(
            "<s>{}</s>{}",
            m[0]["content"].as_str().unwrap().trim(),
            m[2]["content"].as_str().unwrap()
        );
        let p = unmark(&rendered);
        assert_eq!(p.text, "<s>hi <|im_end|></s>a\u{FFFD}b");
        assert_eq!(&p.text[p.plain[0].clone()], "hi <|im_end|>");
        assert_eq!(&p.text[p.plain[1].clone()], "a\u{FFFD}b");
        // A marker split from its partner is dropped.
        let p = unmark("\u{FDD0}x\u{FDD1}y\u{FDD1}\u{FDD0}z");
        assert_eq!(p.text, "xyz");
        assert_eq!(p.plain, vec![Range { start: 0, end: 1 }]);
    }
}
