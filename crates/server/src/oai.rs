//! Response bodies: OpenAI chat completions and completions (whole and as SSE chunks) and
//! llama.cpp's native `/completion`, built from the scheduler's events.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use hmoe_chat::ChatDelta;
use hmoe_tokenizer::Tokenizer;
use rand::distr::{Alphanumeric, SampleString};
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::params::Flavor;
use crate::scheduler::{Finish, JobEvent, Summary, TokenLogprob};

/// `PREFIX` + 24 random alphanumerics.
pub fn random_id(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        Alphanumeric.sample_string(&mut rand::rng(), 24)
    )
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A tool call as collected.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolCall {
    /// `call_…` id.
    pub id: String,
    /// Function name.
    pub name: String,
    /// Arguments (JSON text as generated).
    pub arguments: String,
}

/// Builds one request's response, whole or as stream chunks.
pub struct Responder {
    flavor: Flavor,
    id: String,
    created: u64,
    model: String,
    tok: Arc<Tokenizer>,
    include_usage: bool,
    content: String,
    reasoning: String,
    tool_calls: Vec<ToolCall>,
    probs: Vec<TokenLogprob>,
    text_offset: usize,
    summary: Option<Summary>,
    post_sampling: bool,
}

impl Responder {
    /// A responder for a request of `flavor` answered by `model`.
    pub fn new(flavor: Flavor, model: &str, tok: Arc<Tokenizer>, include_usage: bool) -> Responder {
        let prefix = match flavor {
            Flavor::Chat => "chatcmpl-",
            Flavor::Completion | Flavor::Native => "cmpl-",
        };
        Responder {
            flavor,
            id: random_id(prefix),
            created: unix_now(),
            model: model.to_string(),
            tok,
            include_usage,
            content: String::new(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            probs: Vec::new(),
            text_offset: 0,
            summary: None,
            post_sampling: false,
        }
    }

    /// `/completion`'s `post_sampling_probs`: probabilities (`prob`, `top_probs`) rather than
    /// log-probabilities.
    pub fn with_post_sampling(mut self, on: bool) -> Responder {
        self.post_sampling = on;
        self
    }

    /// Records deltas and returns them as chat `delta` objects (consecutive pieces of the same
    /// kind merged).
    fn absorb(&mut self, deltas: Vec<ChatDelta>) -> Vec<Value> {
        let mut out: Vec<Value> = Vec::new();
        for d in deltas {
            match d {
                ChatDelta::Content(t) => {
                    self.content.push_str(&t);
                    merge_text(&mut out, "content", &t);
                }
                ChatDelta::Reasoning(t) => {
                    self.reasoning.push_str(&t);
                    merge_text(&mut out, "reasoning_content", &t);
                }
                ChatDelta::ToolCallStart { index, name } => {
                    while self.tool_calls.len() <= index {
                        self.tool_calls.push(ToolCall {
                            id: random_id("call_"),
                            ..ToolCall::default()
                        });
                    }
                    self.tool_calls[index].name = name.clone();
                    let id = self.tool_calls[index].id.clone();
                    out.push(
                        json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                                                    "function": {"name": name, "arguments": ""}}]}),
                    );
                }
                ChatDelta::ToolCallArgs { index, delta } => {
                    if let Some(c) = self.tool_calls.get_mut(index) {
                        c.arguments.push_str(&delta);
                    }
                    let merged = out.last_mut().and_then(|last| {
                        let call = last.get_mut("tool_calls")?.get_mut(0)?;
                        if call.get("index")?.as_u64()? != index as u64 {
                            return None;
                        }
                        let args = call.get_mut("function")?.get_mut("arguments")?;
                        let s = args.as_str()?.to_string() + &delta;
                        *args = Value::String(s);
                        Some(())
                    });
                    if merged.is_none() {
                        out.push(json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}));
                    }
                }
            }
        }
        out
    }

    fn finish_reason(&self, s: &Summary) -> &'static str {
        match s.finish {
            Finish::Length => "length",
            Finish::Eog if !self.tool_calls.is_empty() => "tool_calls",
            Finish::Eog | Finish::StopWord(_) => "stop",
        }
    }

    fn piece(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.tok.token_bytes(id).to_vec();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// Log-probabilities in the route's format (`None` when none were asked for).
    fn logprobs_json(&mut self, probs: &[TokenLogprob]) -> Value {
        match self.flavor {
            Flavor::Chat => {
                let content: Vec<Value> =
                    probs.iter().map(|p| self.token_entry(p, false)).collect();
                json!({ "content": content })
            }
            Flavor::Completion => {
                let mut tokens = Vec::new();
                let mut lps = Vec::new();
                let mut tops = Vec::new();
                let mut offsets = Vec::new();
                for p in probs {
                    let (text, _) = self.piece(p.id);
                    offsets.push(self.text_offset);
                    self.text_offset += text.len();
                    tokens.push(text);
                    lps.push(p.logprob);
                    let mut m = Map::new();
                    for &(id, lp) in &p.top {
                        m.insert(self.piece(id).0, lp.into());
                    }
                    tops.push(Value::Object(m));
                }
                json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
            }
            Flavor::Native => {
                Value::Array(probs.iter().map(|p| self.token_entry(p, true)).collect())
            }
        }
    }

    /// A token's entry: `token`, `logprob` (or, for `/completion` with `post_sampling_probs`,
    /// `prob`) and `bytes`, with its `id` on `/completion`.
    fn prob_entry(&self, id: u32, lp: f32, native: bool) -> Map<String, Value> {
        let (text, bytes) = self.piece(id);
        let mut m = Map::new();
        if native {
            m.insert("id".into(), id.into());
        }
        m.insert("token".into(), text.into());
        if native && self.post_sampling {
            m.insert("prob".into(), (lp as f64).exp().into());
        } else {
            m.insert("logprob".into(), lp.into());
        }
        m.insert("bytes".into(), bytes.into());
        m
    }

    /// A generated token's entry with its alternatives (`top_logprobs`, or `top_probs`).
    fn token_entry(&self, p: &TokenLogprob, native: bool) -> Value {
        let mut m = self.prob_entry(p.id, p.logprob, native);
        let top: Vec<Value> = p
            .top
            .iter()
            .map(|&(id, lp)| Value::Object(self.prob_entry(id, lp, native)))
            .collect();
        let key = if native && self.post_sampling {
            "top_probs"
        } else {
            "top_logprobs"
        };
        m.insert(key.into(), top.into());
        Value::Object(m)
    }

    fn usage(s: &Summary) -> Value {
        json!({
            "prompt_tokens": s.n_prompt,
            "completion_tokens": s.n_generated,
            "total_tokens": s.n_prompt + s.n_generated,
            "prompt_tokens_details": {"cached_tokens": s.n_cached},
        })
    }

    fn timings(s: &Summary) -> Value {
        let evaluated = s.n_prompt - s.n_cached;
        let per = |n: usize, ms: f64| if n == 0 { 0.0 } else { ms / n as f64 };
        let rate = |n: usize, ms: f64| if ms <= 0.0 { 0.0 } else { n as f64 * 1e3 / ms };
        let decoded = s.n_generated.saturating_sub(1);
        json!({
            "cache_n": s.n_cached,
            "prompt_n": evaluated,
            "prompt_ms": s.prompt_ms,
            "prompt_per_token_ms": per(evaluated, s.prompt_ms),
            "prompt_per_second": rate(evaluated, s.prompt_ms),
            "predicted_n": s.n_generated,
            "predicted_ms": s.decode_ms,
            "predicted_per_token_ms": per(decoded, s.decode_ms),
            "predicted_per_second": rate(decoded, s.decode_ms),
        })
    }

    fn chunk(&self, choice: Value) -> Value {
        let object = match self.flavor {
            Flavor::Chat => "chat.completion.chunk",
            _ => "text_completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "system_fingerprint": "hmoe", "choices": [choice]})
    }

    /// The first stream chunk (chat: the assistant role).
    pub fn stream_start(&self) -> Vec<String> {
        match self.flavor {
            Flavor::Chat => vec![self
                .chunk(json!({"index": 0, "delta": {"role": "assistant", "content": null}, "logprobs": null, "finish_reason": null}))
                .to_string()],
            _ => Vec::new(),
        }
    }

    /// Stream chunks (SSE `data:` payloads) for one event; the last event ends with `[DONE]`
    /// for the OpenAI routes.
    pub fn stream_event(&mut self, ev: JobEvent) -> Vec<String> {
        match ev {
            JobEvent::Output { deltas, probs } => self.stream_output(deltas, probs),
            JobEvent::Done(s) => {
                let out = self.stream_done(&s);
                self.summary = Some(s);
                out
            }
            JobEvent::Failed(m) => vec![m.api_error().body().to_string()],
        }
    }

    fn stream_output(&mut self, deltas: Vec<ChatDelta>, probs: Vec<TokenLogprob>) -> Vec<String> {
        let lp = if probs.is_empty() {
            Value::Null
        } else {
            self.logprobs_json(&probs)
        };
        self.probs.extend(probs);
        match self.flavor {
            Flavor::Chat => {
                let mut ds = self.absorb(deltas);
                if ds.is_empty() {
                    if lp.is_null() {
                        return Vec::new();
                    }
                    ds.push(json!({}));
                }
                let mut lp = Some(lp);
                ds.into_iter()
                    .map(|d| {
                        let lp = lp.take().unwrap_or(Value::Null);
                        self.chunk(
                            json!({"index": 0, "delta": d, "logprobs": lp, "finish_reason": null}),
                        )
                        .to_string()
                    })
                    .collect()
            }
            Flavor::Completion => {
                let before = self.content.len();
                self.absorb(deltas);
                let text = self.content[before..].to_string();
                if text.is_empty() && lp.is_null() {
                    return Vec::new();
                }
                vec![self
                    .chunk(json!({"text": text, "index": 0, "logprobs": lp, "finish_reason": null}))
                    .to_string()]
            }
            Flavor::Native => {
                let before = self.content.len();
                self.absorb(deltas);
                let text = self.content[before..].to_string();
                if text.is_empty() && lp.is_null() {
                    return Vec::new();
                }
                let mut m = json!({"content": text, "tokens": [], "stop": false, "index": 0});
                if !lp.is_null() {
                    m["completion_probabilities"] = lp;
                }
                vec![m.to_string()]
            }
        }
    }

    fn stream_done(&mut self, s: &Summary) -> Vec<String> {
        let reason = self.finish_reason(s);
        match self.flavor {
            Flavor::Native => vec![self.native_final(s, String::new(), false).to_string()],
            Flavor::Chat | Flavor::Completion => {
                let choice = match self.flavor {
                    Flavor::Chat => {
                        json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason})
                    }
                    _ => json!({"text": "", "index": 0, "logprobs": null, "finish_reason": reason}),
                };
                let mut chunks = vec![self.chunk(choice)];
                if self.include_usage {
                    let mut u = self.chunk(Value::Null);
                    u["choices"] = json!([]);
                    u["usage"] = Self::usage(s);
                    chunks.push(u);
                }
                // The last chunk carries the timings, as llama-server sends them.
                if let Some(last) = chunks.last_mut() {
                    last["timings"] = Self::timings(s);
                }
                let mut out: Vec<String> = chunks.iter().map(Value::to_string).collect();
                out.push("[DONE]".into());
                out
            }
        }
    }

    fn native_final(&self, s: &Summary, content: String, with_tokens: bool) -> Value {
        let (stop_type, word) = match &s.finish {
            Finish::Eog => ("eos", String::new()),
            Finish::StopWord(w) => ("word", w.clone()),
            Finish::Length => ("limit", String::new()),
        };
        json!({
            "content": content,
            "tokens": if with_tokens { json!(s.tokens) } else { json!([]) },
            "id_slot": s.slot,
            "stop": true,
            "model": self.model,
            "tokens_predicted": s.n_generated,
            "tokens_evaluated": s.n_prompt,
            "tokens_cached": s.n_cached,
            "stop_type": stop_type,
            "stopping_word": word,
            "truncated": s.truncated,
            "timings": Self::timings(s),
        })
    }

    /// Records an event of a non-streamed request; `Err` when the request failed.
    pub fn collect(&mut self, ev: JobEvent) -> Result<(), ApiError> {
        match ev {
            JobEvent::Output { deltas, probs } => {
                self.absorb(deltas);
                self.probs.extend(probs);
                Ok(())
            }
            JobEvent::Done(s) => {
                self.summary = Some(s);
                Ok(())
            }
            JobEvent::Failed(m) => Err(m.api_error()),
        }
    }

    /// Whether the request has ended.
    pub fn is_done(&self) -> bool {
        self.summary.is_some()
    }

    /// The whole response of a non-streamed request.
    pub fn response(mut self, logprobs: bool) -> Result<Value, ApiError> {
        let s = self
            .summary
            .take()
            .ok_or_else(|| ApiError::internal("the request ended without a result"))?;
        let reason = self.finish_reason(&s);
        let probs = std::mem::take(&mut self.probs);
        let lp = if logprobs {
            self.logprobs_json(&probs)
        } else {
            Value::Null
        };
        Ok(match self.flavor {
            Flavor::Chat => {
                let mut msg = json!({"role": "assistant", "content": self.content});
                if !self.reasoning.is_empty() {
                    msg["reasoning_content"] = self.reasoning.clone().into();
                }
                if !self.tool_calls.is_empty() {
                    if self.content.is_empty() {
                        msg["content"] = Value::Null;
                    }
                    msg["tool_calls"] = self
                        .tool_calls
                        .iter()
                        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                        .collect();
                }
                json!({
                    "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "system_fingerprint": "hmoe",
                    "choices": [{"index": 0, "message": msg, "logprobs": lp, "finish_reason": reason}],
                    "usage": Self::usage(&s), "timings": Self::timings(&s),
                })
            }
            Flavor::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": "hmoe",
                "choices": [{"text": self.content, "index": 0, "logprobs": lp, "finish_reason": reason}],
                "usage": Self::usage(&s), "timings": Self::timings(&s),
            }),
            Flavor::Native => {
                let content = std::mem::take(&mut self.content);
                let mut m = self.native_final(&s, content, true);
                if logprobs {
                    m["completion_probabilities"] = lp;
                }
                m
            }
        })
    }
}

/// llama-server's `response_fields`: the fields of `body` that `paths` name, each under its
/// path (`a/b` names `body["a"]["b"]`); a path that names nothing is left out.
pub fn select_fields(body: &Value, paths: &[String]) -> Value {
    let mut out = serde_json::Map::new();
    for path in paths {
        let found = (path.split('/')).try_fold(body, |v, key| v.get(key));
        if let Some(v) = found {
            out.insert(path.clone(), v.clone());
        }
    }
    Value::Object(out)
}

fn merge_text(out: &mut Vec<Value>, key: &str, text: &str) {
    if let Some(Value::Object(last)) = out.last_mut() {
        if last.len() == 1 {
            if let Some(Value::String(s)) = last.get_mut(key) {
                s.push_str(text);
                return;
            }
        }
    }
    out.push(json!({ key: text }));
}
