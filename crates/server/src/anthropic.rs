//! `POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat
//! machinery.
//!
//! `system`, `messages` with `text`, `tool_use`, `tool_result` and `thinking` blocks, `tools`
//! (`input_schema`) and `tool_choice` become a chat request; the answer is `thinking`, `text`
//! and `tool_use` blocks, streamed as the named events (`message_start`, `content_block_*`,
//! `message_delta`, `message_stop`) the `anthropic` package's `messages.stream` reads.

use std::borrow::Cow;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::chat_render::{chat_prompt, prepare_chat, ToChat};
use crate::content_blocks::{
    arguments_object, copy_shared_fields, function_tool, run_blocks, Block, BlockApi, BlockEvent,
    BlockKind, Blocks, Sent,
};
use crate::error::ApiError;
use crate::oai::random_id;
use crate::params::Fields;
use crate::scheduler::{Finish, Summary};
use crate::state::AppState;

/// `POST /v1/messages`.
pub async fn messages(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let req = st.bodies.parse(body).await?;
    let p = prepare_chat(&st, &req, |r| chat_request(r, true).map(Cow::Owned)).await?;
    drop(req);
    let api = MessagesApi {
        id: random_id("msg_"),
        model: p.lease.host.id.clone(),
        n_prompt: p.prompt.len(),
    };
    run_blocks(p.lease, p.prompt, p.gen, p.output, "toolu_", api).await
}

/// `POST /v1/messages/count_tokens`: the prompt's length in tokens.
pub async fn count_tokens(
    State(st): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req = st.bodies.parse(body).await?;
    let to_chat: ToChat = |r| chat_request(r, false).map(Cow::Owned);
    let (_, n) = chat_prompt(&st, &req, to_chat, true).await?;
    Ok(Json(json!({"input_tokens": n.unwrap_or(0)})).into_response())
}

/// Text of an Anthropic content value (a string or `text` blocks).
fn text_of(v: Option<&Value>, what: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut out = String::new();
            for b in blocks {
                match (
                    b.get("type").and_then(Value::as_str),
                    b.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (ty, _) => {
                        return Err(ApiError::bad_request(format!(
                            "{what}: blocks of type '{}' are not supported here",
                            ty.unwrap_or("(none)")
                        )))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(ApiError::bad_request(format!(
            "{what} must be a string or an array of blocks"
        ))),
    }
}

/// The chat messages of one Anthropic message: a user turn's `tool_result` blocks become tool
/// messages (before its text), an assistant turn's `thinking`, `text` and `tool_use` blocks one
/// assistant message.
fn turn(i: usize, m: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let what = format!("messages[{i}]");
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request(format!("{what} has no string 'role'")))?;
    if role != "user" && role != "assistant" {
        return Err(ApiError::bad_request(format!(
            "{what}: 'role' must be user or assistant"
        )));
    }
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => {
            return Err(ApiError::bad_request(format!(
                "{what}: 'content' must be a string or an array of blocks"
            )))
        }
    };
    let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let what = format!("{what}.content[{j}]");
        let s = |k: &str| b.get(k).and_then(Value::as_str);
        match s("type") {
            Some("text") => text.push_str(s("text").unwrap_or_default()),
            Some("thinking") if role == "assistant" => {
                thinking.push_str(s("thinking").unwrap_or_default())
            }
            Some("redacted_thinking") => {}
            Some("tool_use") if role == "assistant" => {
                let (Some(id), Some(name)) = (s("id"), s("name")) else {
                    return Err(ApiError::bad_request(format!(
                        "{what}: a tool_use block needs 'id' and 'name'"
                    )));
                };
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}));
            }
            Some("tool_result") if role == "user" => {
                let id = s("tool_use_id").ok_or_else(|| {
                    ApiError::bad_request(format!("{what}: a tool_result needs 'tool_use_id'"))
                })?;
                let mut content = text_of(b.get("content"), &what)?;
                if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    content = format!("Error: {content}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "{what}: blocks of type '{}' are not supported in a {role} message",
                    other.unwrap_or("(none)")
                )))
            }
        }
    }
    if role == "assistant" {
        let mut a = json!({"role": "assistant", "content": text});
        if !thinking.is_empty() {
            a["reasoning_content"] = thinking.into();
        }
        if !calls.is_empty() {
            a["tool_calls"] = Value::Array(calls);
        }
        out.push(a);
    } else if !text.is_empty()
        || !blocks
            .iter()
            .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
    {
        out.push(json!({"role": "user", "content": text}));
    }
    Ok(())
}

/// The chat request (OpenAI chat fields) an Anthropic request stands for; `generate` requires
/// `max_tokens` (count_tokens does not).
fn chat_request(req: &Map<String, Value>, generate: bool) -> Result<Map<String, Value>, ApiError> {
    let f = Fields(req);
    let mut messages = Vec::new();
    let system = text_of(f.value("system"), "'system'")?;
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system}));
    }
    let Some(Value::Array(list)) = f.value("messages") else {
        return Err(ApiError::bad_request(
            "'messages' must be an array of messages",
        ));
    };
    for (i, m) in list.iter().enumerate() {
        turn(i, m, &mut messages)?;
    }
    let mut out = Map::new();
    out.insert("messages".into(), Value::Array(messages));
    if generate {
        let n = f
            .usize("max_tokens")?
            .ok_or_else(|| ApiError::bad_request("'max_tokens' is required"))?;
        out.insert("max_tokens".into(), n.into());
    }
    copy_shared_fields(req, &mut out);
    if let Some(stops) = f.value("stop_sequences") {
        out.insert("stop".into(), stops.clone());
    }
    if let Some(tools) = f.value("tools") {
        let Value::Array(list) = tools else {
            return Err(ApiError::bad_request("'tools' must be an array"));
        };
        let functions: Vec<Value> = list
            .iter()
            .filter(|t| {
                t.get("input_schema").is_some() || t.get("type").is_none_or(|ty| ty == "custom")
            })
            .map(|t| {
                function_tool(
                    t,
                    &[
                        ("name", "name"),
                        ("description", "description"),
                        ("input_schema", "parameters"),
                    ],
                )
            })
            .collect();
        out.insert("tools".into(), Value::Array(functions));
    }
    if let Some(choice) = f.value("tool_choice") {
        let ty = choice.get("type").and_then(Value::as_str);
        let mapped = match ty {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                let name = choice.get("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::bad_request("'tool_choice' of type tool needs a 'name'")
                })?;
                json!({"type": "function", "function": {"name": name}})
            }
            _ => {
                return Err(ApiError::bad_request(
                    "'tool_choice' must have 'type' auto, any, tool or none",
                ))
            }
        };
        out.insert("tool_choice".into(), mapped);
        if choice
            .get("disable_parallel_tool_use")
            .and_then(Value::as_bool)
            == Some(true)
        {
            out.insert("parallel_tool_calls".into(), false.into());
        }
    }
    Ok(out)
}

/// Builds the Anthropic answer.
struct MessagesApi {
    id: String,
    model: String,
    n_prompt: usize,
}

impl MessagesApi {
    fn block(b: &Block, done: bool) -> Value {
        let text = if done { b.text.as_str() } else { "" };
        match &b.kind {
            BlockKind::Reasoning => json!({"type": "thinking", "thinking": text, "signature": ""}),
            BlockKind::Text => json!({"type": "text", "text": text}),
            BlockKind::ToolCall { id, name } => json!({"type": "tool_use", "id": id, "name": name,
                "input": if done { arguments_object(text) } else { json!({}) }}),
        }
    }

    fn stop(s: &Summary, blocks: &Blocks) -> (&'static str, Value) {
        match &s.finish {
            Finish::Length => ("max_tokens", Value::Null),
            Finish::StopWord(w) => ("stop_sequence", w.as_str().into()),
            Finish::Eog if blocks.has_tool_calls() => ("tool_use", Value::Null),
            Finish::Eog => ("end_turn", Value::Null),
        }
    }

    fn usage(s: &Summary) -> Value {
        json!({"input_tokens": s.n_prompt - s.n_cached, "cache_read_input_tokens": s.n_cached,
               "cache_creation_input_tokens": 0, "output_tokens": s.n_generated})
    }

    fn sent(ty: &str, mut data: Value) -> Sent {
        data["type"] = ty.into();
        Sent {
            event: ty.to_string(),
            data,
        }
    }
}

impl BlockApi for MessagesApi {
    fn stream_start(&mut self) -> Vec<Sent> {
        let message = json!({"id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}});
        vec![Self::sent("message_start", json!({ "message": message }))]
    }

    fn stream_block(&mut self, ev: &BlockEvent, blocks: &Blocks) -> Vec<Sent> {
        let sent = match ev {
            BlockEvent::Start(n) => Self::sent(
                "content_block_start",
                json!({"index": n, "content_block": Self::block(&blocks.blocks()[*n], false)}),
            ),
            BlockEvent::Delta(n, text) => {
                let delta = match blocks.blocks()[*n].kind {
                    BlockKind::Reasoning => json!({"type": "thinking_delta", "thinking": text}),
                    BlockKind::Text => json!({"type": "text_delta", "text": text}),
                    BlockKind::ToolCall { .. } => {
                        json!({"type": "input_json_delta", "partial_json": text})
                    }
                };
                Self::sent("content_block_delta", json!({"index": n, "delta": delta}))
            }
            BlockEvent::Stop(n) => Self::sent("content_block_stop", json!({ "index": n })),
        };
        vec![sent]
    }

    fn stream_done(&mut self, s: &Summary, blocks: &Blocks) -> Vec<Sent> {
        let (reason, word) = Self::stop(s, blocks);
        vec![
            Self::sent(
                "message_delta",
                json!({"delta": {"stop_reason": reason, "stop_sequence": word}, "usage": Self::usage(s)}),
            ),
            Self::sent("message_stop", json!({})),
        ]
    }

    fn stream_failed(&mut self, message: &str) -> Sent {
        Self::sent(
            "error",
            json!({"error": {"type": "api_error", "message": message}}),
        )
    }

    fn response(&self, s: &Summary, blocks: &Blocks) -> Value {
        let (reason, word) = Self::stop(s, blocks);
        let content: Vec<Value> = blocks
            .blocks()
            .iter()
            .map(|b| Self::block(b, true))
            .collect();
        json!({"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": content, "stop_reason": reason, "stop_sequence": word,
               "usage": Self::usage(s)})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_become_chat_messages() {
        let req = json!({
            "model": "x", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}],
            "stop_sequences": ["END"],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
                    {"type": "text", "text": "and?"}]}
            ]
        });
        let c = chat_request(req.as_object().unwrap(), true).unwrap();
        let m = c["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "sys"}));
        assert_eq!(m[2]["reasoning_content"], "hmm");
        assert_eq!(m[2]["content"], "Let me look.");
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "t1", "content": "42"})
        );
        assert_eq!(m[4], json!({"role": "user", "content": "and?"}));
        assert_eq!(
            c["tools"][0]["function"]["parameters"],
            json!({"type": "object"})
        );
        assert_eq!(c["tool_choice"], "required");
        assert_eq!(c["parallel_tool_calls"], false);
        assert_eq!(c["stop"], json!(["END"]));
        assert_eq!(c["max_tokens"], 5);
        for bad in [
            json!({"messages": [{"role": "user", "content": "x"}]}),
            json!({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}),
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
        ] {
            assert_eq!(
                chat_request(bad.as_object().unwrap(), true)
                    .unwrap_err()
                    .status
                    .as_u16(),
                400,
                "{bad}"
            );
        }
    }
}
