//! `POST /v1/responses`: OpenAI's Responses API over the chat machinery.
//!
//! `input` (a string or items: messages, `reasoning`, `function_call`, `function_call_output`)
//! and `instructions` become chat messages; function `tools` and `tool_choice` become chat
//! tools; the output is a list of `reasoning`, `message` and `function_call` items, streamed as
//! the `response.*` events the `openai` package's `responses.stream` reads. Nothing is stored:
//! `previous_response_id` is refused.

use std::borrow::Cow;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde_json::{json, Map, Value};

use crate::chat_render::prepare_chat;
use crate::content_blocks::{
    copy_shared_fields, function_tool, run_blocks, Block, BlockApi, BlockEvent, BlockKind, Blocks,
    Sent,
};
use crate::error::ApiError;
use crate::oai::{random_id, unix_now};
use crate::params::Fields;
use crate::scheduler::{Finish, Summary};
use crate::state::AppState;

/// The route.
pub async fn create(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let req = st.bodies.parse(body).await?;
    let p = prepare_chat(&st, &req, |r| chat_request(r).map(Cow::Owned)).await?;
    let api = ResponsesApi::new(&p.lease.host.id, &req);
    drop(req);
    run_blocks(p.lease, p.prompt, p.gen, p.output, "call_", api).await
}

/// Text of a Responses content value: a string or parts (`input_text`, `output_text`,
/// `summary_text`, `reasoning_text`, `refusal`).
fn parts_text(v: Option<&Value>, what: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                let ty = p
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("input_text");
                let text = match ty {
                    "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text" => {
                        p.get("text").and_then(Value::as_str)
                    }
                    "refusal" => p.get("refusal").and_then(Value::as_str),
                    other => {
                        return Err(ApiError::bad_request(format!(
                            "{what}: content of type '{other}' is not supported"
                        )))
                    }
                };
                out.push_str(text.ok_or_else(|| {
                    ApiError::bad_request(format!("{what}: a '{ty}' part has no text"))
                })?);
            }
            Ok(out)
        }
        Some(_) => Err(ApiError::bad_request(format!(
            "{what}: 'content' must be a string or an array of parts"
        ))),
    }
}

/// Builds chat messages from Responses input items; an assistant turn collects the reasoning,
/// text and function calls that follow each other.
#[derive(Default)]
struct Conversation {
    messages: Vec<Value>,
    assistant: Option<Map<String, Value>>,
}

impl Conversation {
    fn flush(&mut self) {
        if let Some(a) = self.assistant.take() {
            self.messages.push(Value::Object(a));
        }
    }

    fn push(&mut self, m: Value) {
        self.flush();
        self.messages.push(m);
    }

    /// The assistant turn being built; a new one when `key` (reasoning or content) is already
    /// filled or the turn already called tools (calls themselves accumulate).
    fn assistant(&mut self, key: &str) -> &mut Map<String, Value> {
        let taken = key != "tool_calls"
            && self
                .assistant
                .as_ref()
                .is_some_and(|a| a.contains_key(key) || a.contains_key("tool_calls"));
        if taken {
            self.flush();
        }
        self.assistant.get_or_insert_with(|| {
            let mut m = Map::new();
            m.insert("role".into(), "assistant".into());
            m
        })
    }

    fn item(&mut self, i: usize, item: &Value) -> Result<(), ApiError> {
        let what = format!("input[{i}]");
        let Value::Object(o) = item else {
            return Err(ApiError::bad_request(format!("{what} must be an object")));
        };
        let str_of = |k: &str| o.get(k).and_then(Value::as_str);
        let ty = str_of("type").unwrap_or("message");
        match ty {
            "message" => {
                let role = str_of("role")
                    .ok_or_else(|| ApiError::bad_request(format!("{what} has no string 'role'")))?;
                let text = parts_text(o.get("content"), &what)?;
                match role {
                    "assistant" => {
                        self.assistant("content")
                            .insert("content".into(), text.into());
                    }
                    "user" | "system" => self.push(json!({"role": role, "content": text})),
                    "developer" => self.push(json!({"role": "system", "content": text})),
                    other => {
                        return Err(ApiError::bad_request(format!(
                            "{what}: unknown role '{other}'"
                        )))
                    }
                }
            }
            "reasoning" => {
                let mut text = parts_text(o.get("content"), &what)?;
                if text.is_empty() {
                    text = parts_text(o.get("summary"), &what)?;
                }
                self.assistant("reasoning_content")
                    .insert("reasoning_content".into(), text.into());
            }
            "function_call" => {
                let (Some(name), Some(call_id)) = (str_of("name"), str_of("call_id")) else {
                    return Err(ApiError::bad_request(format!(
                        "{what}: a function_call needs 'name' and 'call_id'"
                    )));
                };
                let call = json!({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": str_of("arguments").unwrap_or("{}")}});
                let a = self.assistant("tool_calls");
                match a.get_mut("tool_calls") {
                    Some(Value::Array(calls)) => calls.push(call),
                    _ => {
                        a.insert("tool_calls".into(), json!([call]));
                    }
                }
            }
            "function_call_output" => {
                let call_id = str_of("call_id").ok_or_else(|| {
                    ApiError::bad_request(format!("{what}: a function_call_output needs 'call_id'"))
                })?;
                let output = parts_text(o.get("output"), &what)?;
                self.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            "item_reference" => {
                return Err(ApiError::bad_request(format!(
                    "{what}: item references need stored responses, which this server does not keep"
                )))
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "{what}: input items of type '{other}' are not supported"
                )))
            }
        }
        Ok(())
    }
}

/// The chat request (OpenAI chat fields) a Responses request stands for.
fn chat_request(req: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let f = Fields(req);
    for key in ["previous_response_id", "conversation"] {
        if f.value(key).is_some() {
            return Err(ApiError::bad_request(format!(
                "'{key}' is not supported: this server keeps no responses; send the whole conversation in 'input'"
            )));
        }
    }
    let mut conv = Conversation::default();
    if let Some(text) = f.str("instructions")? {
        conv.push(json!({"role": "system", "content": text}));
    }
    match f.value("input") {
        Some(Value::String(s)) => conv.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::bad_request(
                "'input' must not be empty: give a string or at least one input item",
            ))
        }
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                conv.item(i, item)?;
            }
        }
        _ => {
            return Err(ApiError::bad_request(
                "'input' must be a string or an array of input items",
            ))
        }
    }
    conv.flush();
    let mut out = Map::new();
    out.insert("messages".into(), Value::Array(conv.messages));
    // Settings with the same meaning pass through (llama.cpp's sampling extensions too).
    copy_shared_fields(req, &mut out);
    if let Some(n) = f.value("max_output_tokens") {
        out.insert("max_tokens".into(), n.clone());
    }
    if let Some(effort) = f
        .value("reasoning")
        .and_then(|r| r.get("effort"))
        .filter(|e| e.is_string())
    {
        out.insert("reasoning_effort".into(), effort.clone());
    }
    if let Some(format) = f.value("text").and_then(|t| t.get("format")) {
        out.insert("response_format".into(), response_format(format)?);
    }
    if let Some(tools) = f.value("tools") {
        let Value::Array(list) = tools else {
            return Err(ApiError::bad_request("'tools' must be an array"));
        };
        let functions: Vec<Value> = list
            .iter()
            .filter(|t| t.get("type").and_then(Value::as_str) == Some("function"))
            .map(|t| {
                function_tool(
                    t,
                    &[
                        ("name", "name"),
                        ("description", "description"),
                        ("parameters", "parameters"),
                        ("strict", "strict"),
                    ],
                )
            })
            .collect();
        if functions.len() < list.len() {
            tracing::debug!("/v1/responses: built-in (non-function) tools are ignored");
        }
        out.insert("tools".into(), Value::Array(functions));
    }
    match f.value("tool_choice") {
        None => {}
        Some(Value::String(s)) => {
            out.insert("tool_choice".into(), s.as_str().into());
        }
        Some(Value::Object(o)) => {
            if let (Some("function"), Some(name)) = (
                o.get("type").and_then(Value::as_str),
                o.get("name").and_then(Value::as_str),
            ) {
                out.insert(
                    "tool_choice".into(),
                    json!({"type": "function", "function": {"name": name}}),
                );
            }
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "'tool_choice' must be a string or an object",
            ))
        }
    }
    Ok(out)
}

/// `text.format` as a chat `response_format`.
fn response_format(format: &Value) -> Result<Value, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(json!({"type": "text"})),
        Some("json_object") => Ok(json!({"type": "json_object"})),
        Some("json_schema") => {
            let mut schema = Map::new();
            for key in ["name", "schema", "strict", "description"] {
                if let Some(v) = format.get(key) {
                    schema.insert(key.into(), v.clone());
                }
            }
            Ok(json!({"type": "json_schema", "json_schema": schema}))
        }
        _ => Err(ApiError::bad_request(
            "'text.format' must have 'type' text, json_object or json_schema",
        )),
    }
}

/// Builds the Responses output.
struct ResponsesApi {
    id: String,
    /// Item ids are `PREFIX_{base}_{block}`.
    base: String,
    created: u64,
    model: String,
    /// Request fields echoed in the response object.
    echo: Map<String, Value>,
    seq: u64,
}

impl ResponsesApi {
    fn new(model: &str, req: &Map<String, Value>) -> ResponsesApi {
        let mut echo = Map::new();
        for key in [
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "tools",
            "tool_choice",
            "metadata",
            "reasoning",
            "text",
            "parallel_tool_calls",
        ] {
            echo.insert(key.into(), req.get(key).cloned().unwrap_or(Value::Null));
        }
        let defaults = [
            ("tools", json!([])),
            ("tool_choice", json!("auto")),
            ("metadata", json!({})),
            ("parallel_tool_calls", json!(true)),
            ("text", json!({"format": {"type": "text"}})),
        ];
        for (key, v) in defaults {
            if echo[key].is_null() {
                echo.insert(key.into(), v);
            }
        }
        ResponsesApi {
            id: random_id("resp_"),
            base: random_id(""),
            created: unix_now(),
            model: model.to_string(),
            echo,
            seq: 0,
        }
    }

    fn item_id(&self, n: usize, kind: &BlockKind) -> String {
        let prefix = match kind {
            BlockKind::Reasoning => "rs",
            BlockKind::Text => "msg",
            BlockKind::ToolCall { .. } => "fc",
        };
        format!("{prefix}_{}_{n}", self.base)
    }

    /// Output item `n`; `done` marks it completed (else in progress, without its text).
    fn item(&self, n: usize, b: &Block, done: bool) -> Value {
        let id = self.item_id(n, &b.kind);
        let status = if done { "completed" } else { "in_progress" };
        let text = if done { b.text.as_str() } else { "" };
        match &b.kind {
            BlockKind::Reasoning => {
                json!({"type": "reasoning", "id": id, "status": status, "summary": [],
                "content": if done { json!([{"type": "reasoning_text", "text": text}]) } else { json!([]) }})
            }
            BlockKind::Text => {
                json!({"type": "message", "id": id, "status": status, "role": "assistant",
                "content": if done { json!([Self::part(b, text)]) } else { json!([]) }})
            }
            BlockKind::ToolCall { id: call_id, name } => json!({"type": "function_call", "id": id,
                "status": status, "call_id": call_id, "name": name, "arguments": text}),
        }
    }

    fn part(b: &Block, text: &str) -> Value {
        match b.kind {
            BlockKind::Reasoning => json!({"type": "reasoning_text", "text": text}),
            _ => json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []}),
        }
    }

    fn object(&self, status: &str, s: Option<&Summary>, blocks: Option<&Blocks>) -> Value {
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "error": null, "incomplete_details": null,
            "previous_response_id": null, "store": false, "truncation": "disabled",
            "output": [], "usage": null,
        });
        for (k, v) in &self.echo {
            r[k] = v.clone();
        }
        if let Some(b) = blocks {
            r["output"] = b
                .blocks()
                .iter()
                .enumerate()
                .map(|(n, blk)| self.item(n, blk, true))
                .collect();
            r["output_text"] = b
                .blocks()
                .iter()
                .filter(|blk| blk.kind == BlockKind::Text)
                .map(|blk| blk.text.as_str())
                .collect::<String>()
                .into();
        }
        if let Some(s) = s {
            if s.finish == Finish::Length {
                r["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
            let reasoning = blocks.map_or(0, Blocks::reasoning_tokens);
            r["usage"] = json!({
                "input_tokens": s.n_prompt,
                "input_tokens_details": {"cached_tokens": s.n_cached},
                "output_tokens": s.n_generated,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": s.n_prompt + s.n_generated,
            });
        }
        r
    }

    fn status(s: &Summary) -> &'static str {
        if s.finish == Finish::Length {
            "incomplete"
        } else {
            "completed"
        }
    }

    fn event(&mut self, ty: &str, mut data: Value) -> Sent {
        data["type"] = ty.into();
        data["sequence_number"] = self.seq.into();
        self.seq += 1;
        Sent {
            event: ty.to_string(),
            data,
        }
    }
}

impl BlockApi for ResponsesApi {
    fn stream_start(&mut self) -> Vec<Sent> {
        let r = self.object("in_progress", None, None);
        vec![
            self.event("response.created", json!({"response": r.clone()})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn stream_block(&mut self, ev: &BlockEvent, blocks: &Blocks) -> Vec<Sent> {
        let (BlockEvent::Start(n) | BlockEvent::Delta(n, _) | BlockEvent::Stop(n)) = ev;
        let n = *n;
        let b = &blocks.blocks()[n];
        let item_id = self.item_id(n, &b.kind);
        let at = json!({"item_id": item_id, "output_index": n});
        let with = |mut base: Value, extra: Value| {
            if let (Some(o), Value::Object(e)) = (base.as_object_mut(), extra) {
                o.extend(e);
            }
            base
        };
        let mut out = Vec::new();
        match ev {
            BlockEvent::Start(_) => {
                let item = self.item(n, b, false);
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": n, "item": item}),
                ));
                if !matches!(b.kind, BlockKind::ToolCall { .. }) {
                    let part = Self::part(b, "");
                    out.push(self.event(
                        "response.content_part.added",
                        with(at, json!({"content_index": 0, "part": part})),
                    ));
                }
            }
            BlockEvent::Delta(_, text) => {
                let (ty, extra) = match b.kind {
                    BlockKind::Text => (
                        "response.output_text.delta",
                        json!({"content_index": 0, "delta": text, "logprobs": []}),
                    ),
                    BlockKind::Reasoning => (
                        "response.reasoning_text.delta",
                        json!({"content_index": 0, "delta": text}),
                    ),
                    BlockKind::ToolCall { .. } => (
                        "response.function_call_arguments.delta",
                        json!({"delta": text}),
                    ),
                };
                out.push(self.event(ty, with(at, extra)));
            }
            BlockEvent::Stop(_) => {
                match &b.kind {
                    BlockKind::Text => out.push(self.event(
                        "response.output_text.done",
                        with(
                            at.clone(),
                            json!({"content_index": 0, "text": b.text, "logprobs": []}),
                        ),
                    )),
                    BlockKind::Reasoning => out.push(self.event(
                        "response.reasoning_text.done",
                        with(at.clone(), json!({"content_index": 0, "text": b.text})),
                    )),
                    BlockKind::ToolCall { name, .. } => out.push(self.event(
                        "response.function_call_arguments.done",
                        with(at.clone(), json!({"arguments": b.text, "name": name})),
                    )),
                }
                if !matches!(b.kind, BlockKind::ToolCall { .. }) {
                    let part = Self::part(b, &b.text);
                    out.push(self.event(
                        "response.content_part.done",
                        with(at, json!({"content_index": 0, "part": part})),
                    ));
                }
                let item = self.item(n, b, true);
                out.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": n, "item": item}),
                ));
            }
        }
        out
    }

    fn stream_done(&mut self, s: &Summary, blocks: &Blocks) -> Vec<Sent> {
        let status = Self::status(s);
        let r = self.object(status, Some(s), Some(blocks));
        let ty = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        vec![self.event(ty, json!({"response": r}))]
    }

    fn stream_failed(&mut self, message: &str) -> Sent {
        self.event(
            "error",
            json!({"code": "server_error", "message": message, "param": null}),
        )
    }

    fn response(&self, s: &Summary, blocks: &Blocks) -> Value {
        self.object(Self::status(s), Some(s), Some(blocks))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_items_become_chat_messages() {
        let req = json!({
            "model": "x", "instructions": "Be brief.", "max_output_tokens": 9,
            "reasoning": {"effort": "low"},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "web_search"}],
            "tool_choice": {"type": "function", "name": "f"},
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\": 1}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}
            ]
        });
        let c = chat_request(req.as_object().unwrap()).unwrap();
        let m = c["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[1], json!({"role": "user", "content": "hi"}));
        assert_eq!(m[2]["reasoning_content"], "think");
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "c1", "content": "one"})
        );
        assert_eq!(m[4], json!({"role": "assistant", "content": "done"}));
        assert_eq!(c["max_tokens"], 9);
        assert_eq!(c["reasoning_effort"], "low");
        assert_eq!(c["tools"].as_array().unwrap().len(), 1);
        assert_eq!(c["tool_choice"]["function"]["name"], "f");
        let bad = [
            json!({"input": 5}),
            json!({"input": "x", "previous_response_id": "resp_1"}),
            json!({"input": [{"type": "input_image"}]}),
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
        ];
        for b in bad {
            assert_eq!(
                chat_request(b.as_object().unwrap())
                    .unwrap_err()
                    .status
                    .as_u16(),
                400,
                "{b}"
            );
        }
        // An empty input names 'input', the field the client sent, never 'messages'.
        for b in [
            json!({"input": []}),
            json!({"input": [], "instructions": "x"}),
        ] {
            let e = chat_request(b.as_object().unwrap()).unwrap_err();
            let text = e.message;
            assert!(
                text.contains("'input'") && !text.contains("messages"),
                "{text}"
            );
        }
    }
}
