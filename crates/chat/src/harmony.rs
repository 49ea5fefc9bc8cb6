//! The gpt-oss "harmony" format, parsed token by token.
//!
//! A message is `<|start|>HEADER<|message|>CONTENT` closed by `<|end|>`, `<|return|>` (end of
//! generation) or `<|call|>` (a tool call; generation stops for the tool to run). The header holds
//! the author (`assistant`, `user`, a tool such as `functions.get_weather`), optionally
//! `<|channel|>CHANNEL` (`analysis`, `commentary`, `final`), a recipient `to=functions.NAME` and a
//! content type (`json`, `<|constrain|>json`, `code`), in either order.

use hmoe_tokenizer::{StreamDecoder, Tokenizer};

use crate::ChatError;

/// Ids of the harmony control tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HarmonyTokens {
    /// `<|start|>`
    pub start: u32,
    /// `<|end|>`
    pub end: u32,
    /// `<|message|>`
    pub message: u32,
    /// `<|channel|>`
    pub channel: u32,
    /// `<|constrain|>`
    pub constrain: u32,
    /// `<|return|>`
    pub return_: u32,
    /// `<|call|>`
    pub call: u32,
}

impl HarmonyTokens {
    /// Looks the tokens up in a vocabulary (o200k_harmony or the gpt-oss GGUF vocabularies).
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<HarmonyTokens, ChatError> {
        let id = |t: &str| {
            tok.token_id(t)
                .ok_or_else(|| ChatError::Input(format!("vocabulary has no {t} token")))
        };
        Ok(HarmonyTokens {
            start: id("<|start|>")?,
            end: id("<|end|>")?,
            message: id("<|message|>")?,
            channel: id("<|channel|>")?,
            constrain: id("<|constrain|>")?,
            return_: id("<|return|>")?,
            call: id("<|call|>")?,
        })
    }

    /// Whether `id` stops generation (`<|return|>`, `<|call|>`).
    pub fn is_stop(&self, id: u32) -> bool {
        id == self.return_ || id == self.call
    }
}

/// The parsed header of a message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HarmonyHeader {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// For tool messages: the tool that wrote it (`functions.get_weather`, `browser.search`).
    pub name: Option<String>,
    /// `analysis`, `commentary`, `final`, ...
    pub channel: Option<String>,
    /// `to=` target (`functions.get_weather`, `assistant`, `python`).
    pub recipient: Option<String>,
    /// Content type (`json` from `<|constrain|>json` or a bare `json`, `code`, ...).
    pub content_type: Option<String>,
}

impl HarmonyHeader {
    /// Parses header text (markers spelled as their token text), e.g.
    /// `assistant to=functions.f<|channel|>commentary <|constrain|>json`.
    pub fn parse(text: &str) -> HarmonyHeader {
        let mut h = HarmonyHeader::default();
        let mut rest = String::with_capacity(text.len());
        // Take `<|channel|>X` and `<|constrain|>X` out first.
        let mut s = text;
        loop {
            let ch = s.find("<|channel|>");
            let co = s.find("<|constrain|>");
            let (pos, tag, is_channel) = match (ch, co) {
                (Some(a), Some(b)) if a < b => (a, "<|channel|>", true),
                (Some(a), None) => (a, "<|channel|>", true),
                (_, Some(b)) => (b, "<|constrain|>", false),
                (None, None) => break,
            };
            rest.push_str(&s[..pos]);
            rest.push(' ');
            let after = &s[pos + tag.len()..];
            let word_end = after
                .find(|c: char| c.is_whitespace() || c == '<')
                .unwrap_or(after.len());
            let word = after[..word_end].to_string();
            if is_channel {
                h.channel = Some(word);
            } else {
                h.content_type = Some(word);
            }
            s = &after[word_end..];
        }
        rest.push_str(s);
        let mut words = rest.split_whitespace();
        let author = words.next().unwrap_or_default();
        match author {
            "system" | "developer" | "user" | "assistant" | "tool" => h.role = author.to_string(),
            "" => {}
            name => {
                h.role = "tool".into();
                h.name = Some(name.to_string());
            }
        }
        for w in words {
            if let Some(r) = w.strip_prefix("to=") {
                h.recipient = Some(r.to_string());
            } else if h.content_type.is_none() {
                h.content_type = Some(w.to_string());
            }
        }
        h
    }

    /// The function name when this message calls `functions.NAME`.
    pub fn function_call(&self) -> Option<&str> {
        self.recipient.as_deref()?.strip_prefix("functions.")
    }
}

/// How a message ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HarmonyStop {
    /// `<|end|>`: more messages may follow.
    End,
    /// `<|return|>`: the final answer is complete (generation ends).
    Return,
    /// `<|call|>`: a tool call is complete (generation ends, the tool runs).
    Call,
    /// The stream ended (or a new `<|start|>` came) without a closing token.
    Unterminated,
}

/// What the parser reports as tokens arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HarmonyEvent {
    /// A header was completed by `<|message|>`.
    MessageStart(HarmonyHeader),
    /// More content text of the current message (complete UTF-8 only).
    Content(String),
    /// The current message ended.
    MessageEnd(HarmonyStop),
}

/// A complete message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HarmonyMessage {
    /// Its header.
    pub header: HarmonyHeader,
    /// Its content text.
    pub content: String,
    /// How it ended.
    pub stop: HarmonyStop,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Between messages: waiting for `<|start|>`.
    ExpectStart,
    /// Reading a header (text so far, markers as text).
    Header(String),
    /// Reading content.
    Content,
}

/// Streaming harmony parser: feed tokens one at a time, get events.
#[derive(Debug, Clone)]
pub struct HarmonyParser {
    tokens: HarmonyTokens,
    state: State,
    decoder: StreamDecoder,
    header: Option<HarmonyHeader>,
    content: String,
    messages: Vec<HarmonyMessage>,
    stray: String,
}

impl HarmonyParser {
    /// A parser for a whole conversation (expects `<|start|>` first).
    pub fn new(tokens: HarmonyTokens) -> HarmonyParser {
        HarmonyParser {
            tokens,
            state: State::ExpectStart,
            decoder: StreamDecoder::new(),
            header: None,
            content: String::new(),
            messages: Vec::new(),
            stray: String::new(),
        }
    }

    /// A parser for model output after a prompt that ends in `<|start|>assistant`: the first
    /// tokens continue that header (`<|channel|>analysis<|message|>...`).
    pub fn for_generation(tokens: HarmonyTokens) -> HarmonyParser {
        let mut p = HarmonyParser::new(tokens);
        p.state = State::Header("assistant".into());
        p
    }

    /// The control token ids.
    pub fn tokens(&self) -> &HarmonyTokens {
        &self.tokens
    }

    /// Feeds one token (its bytes from the tokenizer).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Vec<HarmonyEvent> {
        self.push_piece(id, tok.token_bytes(id))
    }

    /// Feeds one token given its id and bytes.
    pub fn push_piece(&mut self, id: u32, piece: &[u8]) -> Vec<HarmonyEvent> {
        let t = self.tokens;
        let mut ev = Vec::new();
        match &mut self.state {
            State::ExpectStart => {
                if id == t.start {
                    self.state = State::Header(String::new());
                } else {
                    // Text outside any message (not valid harmony); kept for inspection.
                    self.stray.push_str(&self.decoder.push_bytes(piece));
                }
            }
            State::Header(text) => {
                if id == t.message {
                    text.push_str(&self.decoder.finish());
                    let header = HarmonyHeader::parse(text);
                    ev.push(HarmonyEvent::MessageStart(header.clone()));
                    self.header = Some(header);
                    self.content.clear();
                    self.state = State::Content;
                } else if id == t.start {
                    // A new message before this header was finished: drop the broken header.
                    self.decoder = StreamDecoder::new();
                    self.state = State::Header(String::new());
                } else {
                    text.push_str(&self.decoder.push_bytes(piece));
                }
            }
            State::Content => {
                let stop = if id == t.end {
                    Some(HarmonyStop::End)
                } else if id == t.return_ {
                    Some(HarmonyStop::Return)
                } else if id == t.call {
                    Some(HarmonyStop::Call)
                } else if id == t.start {
                    Some(HarmonyStop::Unterminated)
                } else {
                    None
                };
                match stop {
                    Some(stop) => {
                        let tail = self.decoder.finish();
                        self.emit_content(tail, &mut ev);
                        self.finish_message(stop, &mut ev);
                        self.state = if id == t.start {
                            State::Header(String::new())
                        } else {
                            State::ExpectStart
                        };
                    }
                    None => {
                        let text = self.decoder.push_bytes(piece);
                        self.emit_content(text, &mut ev);
                    }
                }
            }
        }
        ev
    }

    fn emit_content(&mut self, text: String, ev: &mut Vec<HarmonyEvent>) {
        if !text.is_empty() {
            self.content.push_str(&text);
            ev.push(HarmonyEvent::Content(text));
        }
    }

    fn finish_message(&mut self, stop: HarmonyStop, ev: &mut Vec<HarmonyEvent>) {
        ev.push(HarmonyEvent::MessageEnd(stop));
        self.messages.push(HarmonyMessage {
            header: self.header.take().unwrap_or_default(),
            content: std::mem::take(&mut self.content),
            stop,
        });
    }

    /// Ends the stream: an open message is closed as [`HarmonyStop::Unterminated`].
    pub fn finish(&mut self) -> Vec<HarmonyEvent> {
        let mut ev = Vec::new();
        if self.state == State::Content {
            let tail = self.decoder.finish();
            self.emit_content(tail, &mut ev);
            self.finish_message(HarmonyStop::Unterminated, &mut ev);
            self.state = State::ExpectStart;
        }
        ev
    }

    /// The messages completed so far.
    pub fn messages(&self) -> &[HarmonyMessage] {
        &self.messages
    }

    /// The header of the message being read, once its `<|message|>` arrived.
    pub fn current_header(&self) -> Option<&HarmonyHeader> {
        match self.state {
            State::Content => self.header.as_ref(),
            _ => None,
        }
    }

    /// The header text read so far when the stream stopped inside a header (e.g. a prompt ending
    /// in `<|start|>assistant`).
    pub fn pending_header(&self) -> Option<&str> {
        match &self.state {
            State::Header(t) => Some(t),
            _ => None,
        }
    }

    /// Text seen outside any message.
    pub fn stray_text(&self) -> &str {
        &self.stray
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers() {
        let h =
            HarmonyHeader::parse("assistant to=functions.lookup_weather<|channel|>commentary json");
        assert_eq!(h.role, "assistant");
        assert_eq!(h.recipient.as_deref(), Some("functions.lookup_weather"));
        assert_eq!(h.function_call(), Some("lookup_weather"));
        assert_eq!(h.channel.as_deref(), Some("commentary"));
        assert_eq!(h.content_type.as_deref(), Some("json"));

        let h = HarmonyHeader::parse(
            "assistant<|channel|>commentary to=functions.get <|constrain|>json",
        );
        assert_eq!(
            (h.channel.as_deref(), h.recipient.as_deref()),
            (Some("commentary"), Some("functions.get"))
        );
        assert_eq!(h.content_type.as_deref(), Some("json"));

        let h = HarmonyHeader::parse("functions.lookup_weather to=assistant<|channel|>commentary");
        assert_eq!(
            (h.role.as_str(), h.name.as_deref()),
            ("tool", Some("functions.lookup_weather"))
        );
        assert_eq!(h.recipient.as_deref(), Some("assistant"));
        assert_eq!(h.function_call(), None);

        let h = HarmonyHeader::parse("user");
        assert_eq!(
            h,
            HarmonyHeader {
                role: "user".into(),
                ..Default::default()
            }
        );
    }
}
