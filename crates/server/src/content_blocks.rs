//! Output as a list of blocks (reasoning, text, tool calls), the shape both the OpenAI Responses
//! API (`output` items) and the Anthropic Messages API (`content` blocks) give a response, and
//! the loop that runs a request for such an API, whole or as a named-event SSE stream.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use hmoe_chat::ChatDelta;
use serde_json::{Map, Value};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::error::ApiError;
use crate::oai::random_id;
use crate::output::OutputKind;
use crate::params::GenParams;
use crate::registry::Lease;
use crate::scheduler::{JobEvent, Summary};

/// What a block holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// Reasoning text.
    Reasoning,
    /// Answer text.
    Text,
    /// A function call: its id and name; the block's text is the arguments (JSON).
    ToolCall {
        /// Call id (`call_…` / `toolu_…`).
        id: String,
        /// Function name.
        name: String,
    },
}

/// One block of output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Its kind.
    pub kind: BlockKind,
    /// Its text (for tool calls, the arguments).
    pub text: String,
}

/// A change to the block list, in stream order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockEvent {
    /// Block `n` begins.
    Start(usize),
    /// More text of block `n`.
    Delta(usize, String),
    /// Block `n` is complete.
    Stop(usize),
}

/// Groups [`ChatDelta`]s into blocks: a new block whenever the kind changes or a tool call
/// begins; one block open at a time.
#[derive(Debug, Default)]
pub struct Blocks {
    blocks: Vec<Block>,
    open: Option<usize>,
    /// Block of each tool call index.
    calls: Vec<usize>,
    call_prefix: &'static str,
    /// Token events that carried reasoning.
    reasoning_tokens: usize,
}

impl Blocks {
    /// An empty list whose tool-call ids start with `call_prefix`.
    pub fn new(call_prefix: &'static str) -> Blocks {
        Blocks {
            call_prefix,
            ..Blocks::default()
        }
    }

    /// The blocks so far.
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// How many generated tokens produced reasoning text (each output event is one token).
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// Whether any block is a tool call.
    pub fn has_tool_calls(&self) -> bool {
        !self.calls.is_empty()
    }

    fn close(&mut self, out: &mut Vec<BlockEvent>) {
        if let Some(n) = self.open.take() {
            out.push(BlockEvent::Stop(n));
        }
    }

    fn open(&mut self, kind: BlockKind, out: &mut Vec<BlockEvent>) -> usize {
        self.close(out);
        self.blocks.push(Block {
            kind,
            text: String::new(),
        });
        let n = self.blocks.len() - 1;
        self.open = Some(n);
        out.push(BlockEvent::Start(n));
        n
    }

    fn append(&mut self, n: usize, text: String, out: &mut Vec<BlockEvent>) {
        if text.is_empty() {
            return;
        }
        self.blocks[n].text.push_str(&text);
        if self.open == Some(n) {
            out.push(BlockEvent::Delta(n, text));
        }
    }

    fn text(&mut self, kind: BlockKind, text: String, out: &mut Vec<BlockEvent>) {
        if text.is_empty() {
            return;
        }
        let n = match self.open {
            Some(n) if self.blocks[n].kind == kind => n,
            _ => self.open(kind, out),
        };
        self.append(n, text, out);
    }

    /// Feeds the deltas of one generated token; returns what changed.
    pub fn push(&mut self, deltas: Vec<ChatDelta>) -> Vec<BlockEvent> {
        let mut out = Vec::new();
        if deltas.iter().any(|d| matches!(d, ChatDelta::Reasoning(_))) {
            self.reasoning_tokens += 1;
        }
        for d in deltas {
            match d {
                ChatDelta::Content(t) => self.text(BlockKind::Text, t, &mut out),
                ChatDelta::Reasoning(t) => self.text(BlockKind::Reasoning, t, &mut out),
                ChatDelta::ToolCallStart { index, name } => {
                    let id = random_id(self.call_prefix);
                    let n = self.open(BlockKind::ToolCall { id, name }, &mut out);
                    if self.calls.len() <= index {
                        self.calls.resize(index + 1, n);
                    }
                    self.calls[index] = n;
                }
                ChatDelta::ToolCallArgs { index, delta } => {
                    if let Some(&n) = self.calls.get(index) {
                        self.append(n, delta, &mut out);
                    }
                }
            }
        }
        out
    }

    /// Closes the open block.
    pub fn finish(&mut self) -> Vec<BlockEvent> {
        let mut out = Vec::new();
        self.close(&mut out);
        out
    }
}

/// One SSE event: its `event:` name and JSON data.
#[derive(Clone, Debug, PartialEq)]
pub struct Sent {
    /// The event name.
    pub event: String,
    /// The payload.
    pub data: Value,
}

/// An API whose responses are made of blocks.
pub trait BlockApi: Send + 'static {
    /// The events that open a stream.
    fn stream_start(&mut self) -> Vec<Sent>;
    /// The events for a change to the blocks.
    fn stream_block(&mut self, ev: &BlockEvent, blocks: &Blocks) -> Vec<Sent>;
    /// The events that end a stream.
    fn stream_done(&mut self, s: &Summary, blocks: &Blocks) -> Vec<Sent>;
    /// The event that reports a failure mid-stream.
    fn stream_failed(&mut self, message: &str) -> Sent;
    /// The whole response.
    fn response(&self, s: &Summary, blocks: &Blocks) -> Value;
}

/// Runs a request: submits it, then answers whole or as a stream of the API's events. The lease
/// lives as long as the response.
pub async fn run_blocks<A: BlockApi>(
    lease: Lease,
    prompt: Vec<u32>,
    mut gen: GenParams,
    output: OutputKind,
    call_prefix: &'static str,
    mut api: A,
) -> Result<Response, ApiError> {
    let host = lease.host.clone();
    let stream_it = gen.stream;
    let mut rx = host.submit(gen.job(prompt, output))?;
    let mut blocks = Blocks::new(call_prefix);
    if stream_it {
        let head = api.stream_start();
        let events = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
            let _held = &lease;
            let out: Vec<Sent> = match ev {
                JobEvent::Output { deltas, .. } => blocks
                    .push(deltas)
                    .iter()
                    .flat_map(|e| api.stream_block(e, &blocks))
                    .collect(),
                JobEvent::Done(s) => {
                    let mut out: Vec<Sent> = blocks
                        .finish()
                        .iter()
                        .flat_map(|e| api.stream_block(e, &blocks))
                        .collect();
                    out.extend(api.stream_done(&s, &blocks));
                    out
                }
                JobEvent::Failed(m) => vec![api.stream_failed(&m.message)],
            };
            stream::iter(out)
        });
        let sse = stream::iter(head)
            .chain(events)
            .map(|s| Ok::<_, Infallible>(Event::default().event(s.event).data(s.data.to_string())));
        return Ok(Sse::new(sse)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    while let Some(ev) = rx.recv().await {
        match ev {
            JobEvent::Output { deltas, .. } => {
                blocks.push(deltas);
            }
            JobEvent::Done(s) => {
                blocks.finish();
                let body = api.response(&s, &blocks);
                drop(lease);
                return Ok(Json(body).into_response());
            }
            JobEvent::Failed(m) => return Err(m.api_error()),
        }
    }
    Err(ApiError::internal("the request ended without a result"))
}

/// Request fields that mean the same on the chat route (llama.cpp's extensions too).
const SHARED_FIELDS: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stream",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "reasoning_format",
    "chat_template_kwargs",
    "cache_prompt",
    "parallel_tool_calls",
    "typical_p",
    "top_n_sigma",
    "xtc_probability",
    "xtc_threshold",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "samplers",
    "min_keep",
    "t_max_predict_ms",
    "n_keep",
    "id_slot",
    "n_indent",
    "lora",
    "response_fields",
];

/// Copies the fields of `req` that the chat route reads the same way into `out`.
pub fn copy_shared_fields(req: &Map<String, Value>, out: &mut Map<String, Value>) {
    for &key in SHARED_FIELDS {
        if let Some(v) = req.get(key).filter(|v| !v.is_null()) {
            out.insert(key.into(), v.clone());
        }
    }
}

/// A chat `function` tool from an API's tool object, its fields renamed `(from, to)`.
pub fn function_tool(t: &Value, names: &[(&str, &str)]) -> Value {
    let mut func = Map::new();
    for &(from, to) in names {
        if let Some(v) = t.get(from).filter(|v| !v.is_null()) {
            func.insert(to.into(), v.clone());
        }
    }
    serde_json::json!({"type": "function", "function": func})
}

/// A tool call's arguments as a JSON object (what the model wrote when it is one, else `{}`).
pub fn arguments_object(text: &str) -> Value {
    match serde_json::from_str::<Value>(text) {
        Ok(v @ Value::Object(_)) => v,
        _ => Value::Object(Default::default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_group_into_blocks() {
        let mut b = Blocks::new("call_");
        let ev = b.push(vec![
            ChatDelta::Reasoning("think".into()),
            ChatDelta::Reasoning("ing".into()),
            ChatDelta::Content(String::new()),
            ChatDelta::Content("Hi".into()),
            ChatDelta::ToolCallStart {
                index: 0,
                name: "f".into(),
            },
            ChatDelta::ToolCallArgs {
                index: 0,
                delta: "{}".into(),
            },
        ]);
        assert_eq!(
            ev,
            vec![
                BlockEvent::Start(0),
                BlockEvent::Delta(0, "think".into()),
                BlockEvent::Delta(0, "ing".into()),
                BlockEvent::Stop(0),
                BlockEvent::Start(1),
                BlockEvent::Delta(1, "Hi".into()),
                BlockEvent::Stop(1),
                BlockEvent::Start(2),
                BlockEvent::Delta(2, "{}".into()),
            ]
        );
        assert_eq!(b.finish(), vec![BlockEvent::Stop(2)]);
        assert_eq!(b.blocks()[0].text, "thinking");
        assert!(b.has_tool_calls());
        assert!(
            matches!(&b.blocks()[2].kind, BlockKind::ToolCall { id, name } if id.starts_with("call_") && name == "f")
        );
        assert_eq!(arguments_object("{\"a\": 1}")["a"], 1);
        assert_eq!(arguments_object("[1]"), serde_json::json!({}));
    }
}
