//! Chat requests to prompts: OpenAI messages normalised for Hugging Face templates, the
//! model's (or `--chat-template-file`'s) template, and how the output is to be read.

use std::sync::Arc;

use hmoe_chat::{
    ChatError, ChatTemplate, HarmonyTokens, ReasoningFormat, ToolCallFormat, ToolCallSpec,
};
use hmoe_grammar::ToolFormat;
use hmoe_tokenizer::Tokenizer;
use serde_json::{Map, Value};

use crate::api::{render_chat, AppState};
use crate::error::ApiError;
use crate::output::OutputKind;
use crate::params::{gen_params, Fields, Flavor, GenParams};
use crate::registry::Lease;

/// A chat request ready to run: the model held, the prompt, the settings and how to read the
/// output.
pub struct PreparedChat {
    /// The model.
    pub lease: Lease,
    /// The rendered and tokenized prompt.
    pub prompt: Vec<u32>,
    /// The generation settings.
    pub gen: GenParams,
    /// How to read the output.
    pub output: OutputKind,
}

/// Takes the model named by `model`, renders the chat request `req` (OpenAI chat fields) and
/// reads its generation settings.
pub async fn prepare_chat(
    st: &AppState,
    model: Option<&str>,
    req: &Map<String, Value>,
) -> Result<PreparedChat, ApiError> {
    let lease = st.registry.acquire(model).await?;
    let (text, format, tools) = render_chat(st, &lease, req)?;
    let host = lease.host.clone();
    let chat = host.chat()?;
    // As llama-server: several calls may follow one another unless the request says not.
    let parallel = Fields(req).bool("parallel_tool_calls")?.unwrap_or(true);
    let prompt = chat.tokenize(&host.tokenizer, &text)?;
    let mut gen = gen_params(
        &Fields(req),
        &st.config.sampling,
        Flavor::Chat,
        &host.tokenizer,
        chat.forced_tool_format(&host.tokenizer),
    )?;
    gen.compile(&host).await?;
    let output = chat.output_kind(&text, format, tools.as_ref(), parallel);
    Ok(PreparedChat {
        lease,
        prompt,
        gen,
        output,
    })
}

/// A model's chat format.
pub struct ChatSetup {
    template: ChatTemplate,
    source: String,
    harmony: Option<HarmonyTokens>,
    think: bool,
    tool_calls: Option<ToolCallFormat>,
    bos: String,
    eos: String,
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
            template,
            harmony,
            bos: text(tok.bos()),
            eos: text(tok.eos()),
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

    /// Renders a conversation (already [`normalize_messages`]d), with the assistant's
    /// generation prompt when `add_generation_prompt`. Whatever the template rejects or fails
    /// on is a 400 carrying the template's message.
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        mut extra: Map<String, Value>,
    ) -> Result<String, ApiError> {
        extra
            .entry("bos_token")
            .or_insert_with(|| self.bos.clone().into());
        extra
            .entry("eos_token")
            .or_insert_with(|| self.eos.clone().into());
        let harmony_fixed;
        let messages = if self.is_harmony() {
            harmony_fixed = harmony_history(messages);
            &harmony_fixed
        } else {
            messages
        };
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
        result.map_err(|e| match e {
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
            (None, None) => ToolFormat::detect(tok),
        }
    }

    /// How to read the output that follows `prompt`; `tools` are the tools the template was
    /// given: with them, tool calls in the template's format are read from the text (several
    /// when `parallel`).
    pub fn output_kind(
        &self,
        prompt: &str,
        format: ReasoningFormat,
        tools: Option<&Value>,
        parallel: bool,
    ) -> OutputKind {
        let think = (self.harmony.is_none() && self.think)
            .then(|| (format, prompt.trim_end().ends_with("<think>")));
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

    /// Tokenizes a rendered prompt (special tokens parsed; BOS added per the model unless the
    /// template already wrote it).
    pub fn tokenize(&self, tok: &Tokenizer, prompt: &str) -> Result<Vec<u32>, ApiError> {
        let mut ids = tok
            .encode(prompt, true, true)
            .map_err(|e| ApiError::bad_request(format!("tokenizing the prompt: {e}")))?;
        if let Some(bos) = tok.bos() {
            if tok.add_bos() && ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
                ids.remove(0);
            }
        }
        Ok(ids)
    }
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

/// Checks a request's `tools` and fills what templates read without checking: every function
/// gets a `description` (empty) and `parameters` (an empty object schema) when it has none, as
/// llama-server does. `None` when there are no tools or `tool_choice` is `"none"`.
pub fn normalize_tools(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
) -> Result<Option<Value>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(t)) => t,
        Some(_) => return Err(ApiError::bad_request("'tools' must be an array")),
    };
    if list.is_empty() || tool_choice.and_then(Value::as_str) == Some("none") {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let mut t = t.clone();
        let f = t
            .get_mut("function")
            .and_then(Value::as_object_mut)
            .filter(|f| f.get("name").is_some_and(Value::is_string))
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "tools[{i}]: every tool needs a 'function' with a 'name'"
                ))
            })?;
        if !f.get("description").is_some_and(Value::is_string) {
            f.insert("description".into(), "".into());
        }
        if !f.get("parameters").is_some_and(Value::is_object) {
            f.insert(
                "parameters".into(),
                serde_json::json!({"type": "object", "properties": {}}),
            );
        }
        out.push(t);
    }
    Ok(Some(Value::Array(out)))
}

/// Text of an OpenAI `content` value: a string, or the text parts of an array joined.
pub fn content_text(v: &Value, what: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text") | None, Some(t)) => out.push_str(t),
                    (Some(ty), _) => {
                        return Err(ApiError::bad_request(format!(
                            "{what}: content parts of type '{ty}' are not supported"
                        )))
                    }
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "{what}: a content part has no text"
                        )))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::bad_request(format!(
            "{what}: 'content' must be a string or an array of parts"
        ))),
    }
}

/// Checks OpenAI messages and rewrites them the way templates expect: `content` as a string,
/// reasoning as both `reasoning_content` (Qwen3, DeepSeek templates) and `thinking` (gpt-oss),
/// tool-call `arguments` as JSON objects, no `content` on assistant tool-call messages that have
/// none.
pub fn normalize_messages(messages: Option<&Value>) -> Result<Value, ApiError> {
    let Some(Value::Array(list)) = messages else {
        return Err(ApiError::bad_request(
            "'messages' must be an array of messages",
        ));
    };
    if list.is_empty() {
        return Err(ApiError::bad_request("'messages' must not be empty"));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let what = format!("messages[{i}]");
        let Value::Object(m) = m else {
            return Err(ApiError::bad_request(format!("{what} must be an object")));
        };
        let Some(role) = m.get("role").and_then(Value::as_str) else {
            return Err(ApiError::bad_request(format!(
                "{what} has no string 'role'"
            )));
        };
        let mut n = m.clone();
        let has_calls = match m.get("tool_calls") {
            None | Some(Value::Null) => {
                n.remove("tool_calls");
                false
            }
            Some(Value::Array(calls)) => {
                let mut fixed = Vec::with_capacity(calls.len());
                for (j, c) in calls.iter().enumerate() {
                    fixed.push(normalize_tool_call(c, &format!("{what}.tool_calls[{j}]"))?);
                }
                let any = !fixed.is_empty();
                n.insert("tool_calls".into(), Value::Array(fixed));
                if !any {
                    n.remove("tool_calls");
                }
                any
            }
            Some(_) => {
                return Err(ApiError::bad_request(format!(
                    "{what}: 'tool_calls' must be an array"
                )))
            }
        };
        let text = content_text(m.get("content").unwrap_or(&Value::Null), &what)?;
        if role == "assistant" && has_calls && text.is_empty() {
            n.remove("content");
        } else {
            n.insert("content".into(), text.into());
        }
        let reasoning = match (m.get("reasoning_content"), m.get("thinking")) {
            (Some(r), _) if !r.is_null() => content_text(r, &what)?,
            (_, Some(r)) if !r.is_null() => content_text(r, &what)?,
            _ => String::new(),
        };
        n.remove("reasoning_content");
        n.remove("thinking");
        if !reasoning.is_empty() {
            n.insert("reasoning_content".into(), reasoning.clone().into());
            n.insert("thinking".into(), reasoning.into());
        }
        out.push(Value::Object(n));
    }
    Ok(Value::Array(out))
}

fn normalize_tool_call(c: &Value, what: &str) -> Result<Value, ApiError> {
    let Value::Object(c) = c else {
        return Err(ApiError::bad_request(format!("{what} must be an object")));
    };
    let mut c = c.clone();
    let Some(Value::Object(f)) = c.get_mut("function") else {
        return Err(ApiError::bad_request(format!(
            "{what} has no 'function' object"
        )));
    };
    if f.get("name").and_then(Value::as_str).is_none() {
        return Err(ApiError::bad_request(format!(
            "{what}.function has no string 'name'"
        )));
    }
    if let Some(Value::String(args)) = f.get("arguments") {
        if let Ok(parsed) = serde_json::from_str::<Value>(args) {
            f.insert("arguments".into(), parsed);
        }
    }
    Ok(Value::Object(c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_are_normalised() {
        let m = json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "reasoning_content": "think",
             "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "x", "content": "42"},
            {"role": "assistant", "content": null}
        ]);
        let n = normalize_messages(Some(&m)).unwrap();
        assert_eq!(n[0]["content"], "ab");
        assert!(n[1].get("content").is_none());
        assert_eq!(n[1]["thinking"], "think");
        assert_eq!(n[1]["reasoning_content"], "think");
        assert_eq!(
            n[1]["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
        assert_eq!(n[3]["content"], "");
    }

    #[test]
    fn bad_messages_are_400() {
        for bad in [
            json!(null),
            json!([]),
            json!([1]),
            json!([{"content": "x"}]),
            json!([{"role": "user", "content": 5}]),
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            json!([{"role": "assistant", "tool_calls": [{"function": {}}]}]),
        ] {
            let e = normalize_messages(Some(&bad)).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{bad}");
        }
        assert!(normalize_messages(None).is_err());
    }
}
