//! A model's chat format: its (or `--chat-template-file`'s) template compiled, how it renders a
//! conversation, writes tool calls and reasoning, and how its output is to be read.

use std::sync::Arc;

use hmoe_chat::{
    open_think, ChatError, ChatTemplate, HarmonyTokens, ReasoningFormat, TemplateFamily,
    ToolCallFormat, ToolCallSpec,
};
use hmoe_grammar::ToolFormat;
use hmoe_tokenizer::Tokenizer;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::output::OutputKind;
use crate::plain_content::{mark_messages, unmark, RenderedPrompt};

/// A model's chat format.
pub struct ChatSetup {
    template: ChatTemplate,
    source: String,
    harmony: Option<HarmonyTokens>,
    think: bool,
    tool_calls: Option<ToolCallFormat>,
    /// The variables its family reads (`date_string`, FireFunction's `functions`, ...).
    family: TemplateFamily,
    bos: String,
    eos: String,
    /// Whether tokenizing adds BOS / EOS: the rendered prompt's own are then taken off.
    add_bos: bool,
    add_eos: bool,
}

impl std::fmt::Debug for ChatSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatSetup")
            .field("harmony", &self.harmony.is_some())
            .field("think", &self.think)
            .field("tool_calls", &self.tool_calls)
            .finish()
    }
}

impl ChatSetup {
    /// Compiles `source` for a model with vocabulary `tok`.
    pub fn new(source: String, tok: &Tokenizer) -> Result<ChatSetup, ChatError> {
        let template = ChatTemplate::new(&source)?;
        let harmony = if source.contains("<|channel|>") {
            HarmonyTokens::from_tokenizer(tok).ok()
        } else {
            None
        };
        let text = |id: Option<u32>| {
            id.and_then(|i| tok.token_text(i))
                .unwrap_or_default()
                .to_string()
        };
        Ok(ChatSetup {
            think: harmony.is_none() && source.contains("<think>"),
            tool_calls: harmony
                .is_none()
                .then(|| ToolCallFormat::detect(&source))
                .flatten(),
            family: TemplateFamily::detect(&source),
            template,
            harmony,
            bos: text(tok.bos()),
            eos: text(tok.eos()),
            add_bos: tok.add_bos(),
            add_eos: tok.add_eos(),
            source,
        })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the model speaks harmony (gpt-oss).
    pub fn is_harmony(&self) -> bool {
        self.harmony.is_some()
    }

    /// Renders a conversation (already [`normalize_messages`](crate::chat_messages::normalize_messages)d), with the assistant's
    /// generation prompt when `add_generation_prompt`, with the spans the messages wrote (see
    /// [`crate::plain_content`]). As llama-server does, a BOS (EOS) the template wrote at the
    /// start (end) is taken off when tokenizing adds one, so that the prompt has one and
    /// `/apply-template` shows none. The variables the template's family reads and
    /// llama-server gives (see [`TemplateFamily`]) are added where `extra` (the server's and
    /// request's `chat_template_kwargs`) does not set them. Whatever the template rejects or
    /// fails on is a 400 carrying the template's message.
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        mut extra: Map<String, Value>,
    ) -> Result<RenderedPrompt, ApiError> {
        extra
            .entry("bos_token")
            .or_insert_with(|| self.bos.clone().into());
        extra
            .entry("eos_token")
            .or_insert_with(|| self.eos.clone().into());
        for (k, v) in self.family.variables(tools, std::time::SystemTime::now()) {
            extra.entry(k).or_insert(v);
        }
        let tools = tools.filter(|_| self.family.takes_tools());
        let mut messages = if self.is_harmony() {
            harmony_history(messages)
        } else {
            messages.clone()
        };
        if self.tool_calls == Some(ToolCallFormat::Mistral) {
            mistral_ids(&mut messages);
        }
        let messages = mark_messages(&messages);
        let messages = &messages;
        let extra = Value::Object(extra);
        let mut result = self
            .template
            .render(messages, tools, add_generation_prompt, &extra);
        if matches!(result, Err(ChatError::Template(_))) {
            // Templates that print every message's `content` as a string fail on assistant
            // tool-call turns without one: they get an empty string instead.
            if let Some(filled) = fill_missing_content(messages) {
                result = self
                    .template
                    .render(&filled, tools, add_generation_prompt, &extra);
            }
        }
        let bos = self.add_bos.then_some(self.bos.as_str());
        let eos = self.add_eos.then_some(self.eos.as_str());
        result
            .map(|text| strip_special_ends(unmark(&text), bos, eos))
            .map_err(|e| match e {
                ChatError::Raised(m) | ChatError::Input(m) => ApiError::bad_request(m),
                ChatError::Template(m) => {
                    ApiError::bad_request(format!("the chat template failed: {m}"))
                }
            })
    }

    /// How the template writes tool calls, when it is not harmony and hmoe knows the format.
    pub fn tool_call_format(&self) -> Option<ToolCallFormat> {
        self.tool_calls
    }

    /// How a forced tool call (`tool_choice` `"required"` or a function) is written: the
    /// template's format (Qwen3-Coder templates get `<tool_call>` JSON, which hmoe reads back as
    /// well), else what the vocabulary's markup tokens suggest.
    pub fn forced_tool_format(&self, tok: &Tokenizer) -> Option<ToolFormat> {
        match (self.harmony, self.tool_calls) {
            (Some(_), _) => Some(ToolFormat::Harmony),
            (None, Some(ToolCallFormat::Hermes | ToolCallFormat::Qwen3Coder)) => {
                Some(ToolFormat::ToolCallTags)
            }
            (None, Some(ToolCallFormat::DeepSeek)) => Some(ToolFormat::DeepSeek),
            (None, Some(ToolCallFormat::Llama3)) => Some(ToolFormat::Llama3),
            (None, Some(ToolCallFormat::Mistral)) => Some(ToolFormat::Mistral),
            (None, None) => ToolFormat::detect(tok),
        }
    }

    /// How to read the output that follows `prompt`; `tools` are the tools the template was
    /// given: with them, tool calls in the template's format are read from the text (several
    /// when `parallel`). With `thinking` off, as llama-server, `<think>` in the output is text
    /// unless the prompt left `<think>` open (DeepSeek R1 templates that always open it) and
    /// `open_is_reasoning` (false when a grammar makes the output the answer from its start).
    pub fn output_kind(
        &self,
        prompt: &str,
        format: ReasoningFormat,
        tools: Option<&Value>,
        parallel: bool,
        thinking: bool,
        open_is_reasoning: bool,
    ) -> OutputKind {
        let open = open_think(prompt).filter(|_| open_is_reasoning);
        let think = (self.harmony.is_none() && self.think && (thinking || open.is_some()))
            .then(|| (format, open.map(str::to_string)));
        match (self.harmony, self.tool_calls, tools) {
            (Some(t), _, _) if prompt.ends_with("<|start|>assistant") => {
                OutputKind::Harmony(t, format)
            }
            (Some(_), _, _) => OutputKind::Text,
            (None, Some(calls), Some(tools)) => OutputKind::ToolCalls {
                think,
                spec: Arc::new(ToolCallSpec::new(calls, Some(tools), parallel)),
            },
            (None, _, _) => match think {
                Some((f, open)) => OutputKind::Think(f, open),
                None => OutputKind::Text,
            },
        }
    }

    /// Tokenizes a rendered prompt (special tokens parsed from the template's markup, never
    /// from what the messages wrote; BOS added per the model unless the prompt already starts
    /// with it).
    pub fn tokenize(&self, tok: &Tokenizer, prompt: &RenderedPrompt) -> Result<Vec<u32>, ApiError> {
        let mut ids = tok
            .encode_with_plain(&prompt.text, true, &prompt.plain)
            .map_err(|e| ApiError::bad_request(format!("tokenizing the prompt: {e}")))?;
        if let Some(bos) = tok.bos() {
            if tok.add_bos() && ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
                ids.remove(0);
            }
        }
        Ok(ids)
    }
}

/// `prompt` without `bos` at its start and `eos` at its end where the template's markup (not a
/// message) wrote them.
fn strip_special_ends(
    mut prompt: RenderedPrompt,
    bos: Option<&str>,
    eos: Option<&str>,
) -> RenderedPrompt {
    if let Some(bos) = bos.filter(|b| !b.is_empty() && prompt.text.starts_with(b)) {
        let n = bos.len();
        if prompt.plain.first().is_none_or(|r| r.start >= n) {
            prompt.text.drain(..n);
            for r in &mut prompt.plain {
                *r = r.start - n..r.end - n;
            }
        }
    }
    if let Some(eos) = eos.filter(|e| !e.is_empty() && prompt.text.ends_with(e)) {
        let keep = prompt.text.len() - eos.len();
        if prompt.plain.last().is_none_or(|r| r.end <= keep) {
            prompt.text.truncate(keep);
        }
    }
    prompt
}

/// The messages with `content: ""` where a message has none; `None` when all have one.
fn fill_missing_content(messages: &Value) -> Option<Value> {
    let mut out = messages.clone();
    let mut changed = false;
    for m in out
        .as_array_mut()?
        .iter_mut()
        .filter_map(Value::as_object_mut)
    {
        if !m.contains_key("content") {
            m.insert("content".into(), "".into());
            changed = true;
        }
    }
    changed.then_some(out)
}

/// Mistral templates accept only 9-character alphanumeric tool-call ids (and raise on others):
/// every other id in the history (assistant `tool_calls[].id`, tool messages' `tool_call_id`)
/// is replaced by one derived from it, the same id by the same one.
fn mistral_ids(messages: &mut Value) {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let nine = |id: &mut Value| {
        let Some(text) = id.as_str() else { return };
        if text.len() == 9 && text.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return;
        }
        // FNV-1a: 64 bits hold 9 base-62 digits.
        let mut h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let short: String = (0..9)
            .map(|_| {
                let d = DIGITS[(h % 62) as usize] as char;
                h /= 62;
                d
            })
            .collect();
        *id = Value::String(short);
    };
    for m in messages
        .as_array_mut()
        .into_iter()
        .flatten()
        .filter_map(Value::as_object_mut)
    {
        if let Some(id) = m.get_mut("tool_call_id") {
            nine(id);
        }
        let calls = m.get_mut("tool_calls").and_then(Value::as_array_mut);
        for call in calls.into_iter().flatten() {
            if let Some(id) = call.get_mut("id") {
                nine(id);
            }
        }
    }
}

/// gpt-oss templates take an assistant tool-call turn's analysis from `thinking` or `content`,
/// not both: where a client sends both back, the reasoning is kept (the content of such a turn
/// is the model's preamble to the call).
fn harmony_history(messages: &Value) -> Value {
    let mut out = messages.clone();
    if let Some(list) = out.as_array_mut() {
        for m in list.iter_mut().filter_map(Value::as_object_mut) {
            let both = m.contains_key("tool_calls")
                && m.get("thinking")
                    .and_then(Value::as_str)
                    .is_some_and(|t| !t.is_empty())
                && m.get("content")
                    .and_then(Value::as_str)
                    .is_some_and(|t| !t.is_empty());
            if both {
                m.remove("content");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn mistral_ids_are_nine_alphanumerics_and_stay_paired() {
        let mut m = json!([
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_Xy12", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "abcDEF123", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_Xy12", "content": "1"},
            {"role": "tool", "tool_call_id": "abcDEF123", "content": "2"}
        ]);
        mistral_ids(&mut m);
        let first = m[0]["tool_calls"][0]["id"].as_str().unwrap();
        assert_eq!(first.len(), 9);
        assert!(first.bytes().all(|b| b.is_ascii_alphanumeric()), "{first}");
        assert_eq!(m[1]["tool_call_id"], first);
        assert_eq!(m[0]["tool_calls"][1]["id"], "abcDEF123");
        assert_eq!(m[2]["tool_call_id"], "abcDEF123");
    }
}
