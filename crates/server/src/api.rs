//! HTTP routes (llama-server's paths) and the API-key / CORS middleware.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, StreamExt};
use hmoe_chat::ReasoningFormat;
use serde_json::{json, Map, Value};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::chat::normalize_messages;
use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::metrics;
use crate::oai::Responder;
use crate::output::OutputKind;
use crate::params::{gen_params, parse_body, prompt_tokens, Fields, Flavor, GenParams};
use crate::registry::{Lease, Registry};
use crate::scheduler::JobSpec;

/// Largest request body accepted.
const MAX_BODY: usize = 64 << 20;

/// What every handler shares.
pub struct AppState {
    /// The configuration.
    pub config: Arc<ServerConfig>,
    /// The models.
    pub registry: Registry,
}

type St = State<Arc<AppState>>;
type Res = Result<Response, ApiError>;

/// The application: every route, behind the API-key check.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/models", get(models))
        .route("/v1/models", get(models))
        .route("/models/load", post(load_model))
        .route("/models/unload", post(unload_model))
        .route("/chat/completions", post(chat))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/completion", post(native_completion))
        .route("/completions", post(native_completion))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .route("/props", get(props))
        .route("/slots", get(slots))
        .route("/metrics", get(metrics_route))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

/// Routes anyone may call.
fn is_public(path: &str) -> bool {
    matches!(path, "/health" | "/v1/health" | "/models" | "/v1/models")
}

/// Compares in time independent of where the strings differ.
fn same_key(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn presented_key(h: &HeaderMap) -> Option<&str> {
    if let Some(v) = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        if v.len() > 7 && v[..7].eq_ignore_ascii_case("bearer ") {
            return Some(v[7..].trim());
        }
    }
    h.get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

async fn auth(State(st): St, req: Request, next: Next) -> Response {
    let cors = |mut r: Response| {
        r.headers_mut().insert(
            header::ACCESS_CONTROL_ALLOW_ORIGIN,
            HeaderValue::from_static("*"),
        );
        r
    };
    if req.method() == Method::OPTIONS {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("*"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("86400"),
        );
        return cors(r);
    }
    let keys = &st.config.api_keys;
    if !keys.is_empty() && !is_public(req.uri().path()) {
        let ok =
            presented_key(req.headers()).is_some_and(|k| keys.iter().any(|key| same_key(key, k)));
        if !ok {
            return cors(ApiError::unauthorized().into_response());
        }
    }
    cors(next.run(req).await)
}

async fn not_found() -> ApiError {
    ApiError::not_found("File Not Found")
}

async fn health(State(st): St) -> Res {
    st.registry.health()?;
    Ok(Json(json!({"status": "ok"})).into_response())
}

async fn models(State(st): St) -> Response {
    Json(json!({"object": "list", "data": st.registry.list()})).into_response()
}

async fn load_model(State(st): St, body: Bytes) -> Res {
    let req = parse_body(&body)?;
    let name = Fields(&req)
        .str("model")?
        .ok_or_else(|| ApiError::bad_request("'model' is required"))?;
    if !st.registry.is_router() {
        return Err(ApiError::not_supported(
            "loading models needs router mode (--models-dir)",
        ));
    }
    drop(st.registry.acquire(Some(name)).await?);
    Ok(Json(json!({"success": true})).into_response())
}

async fn unload_model(State(st): St, body: Bytes) -> Res {
    let req = parse_body(&body)?;
    let name = Fields(&req)
        .str("model")?
        .ok_or_else(|| ApiError::bad_request("'model' is required"))?;
    st.registry.unload(name).await?;
    Ok(Json(json!({"success": true})).into_response())
}

fn reasoning_format(s: &str) -> Result<ReasoningFormat, ApiError> {
    match s {
        "none" => Ok(ReasoningFormat::None),
        "auto" => Ok(ReasoningFormat::Auto),
        "deepseek" | "deepseek-legacy" => Ok(ReasoningFormat::Deepseek),
        other => Err(ApiError::bad_request(format!(
            "unknown reasoning_format '{other}' (none, auto, deepseek)"
        ))),
    }
}

/// The prompt text of a chat request (template rendered) and how to read its output.
fn render_chat(
    st: &AppState,
    lease: &Lease,
    req: &Map<String, Value>,
) -> Result<(String, ReasoningFormat), ApiError> {
    let f = Fields(req);
    let chat = lease.host.chat()?;
    let messages = normalize_messages(req.get("messages"))?;
    let choice = f.value("tool_choice");
    match choice {
        None => {}
        Some(Value::String(s)) if matches!(s.as_str(), "auto" | "none" | "required") => {}
        Some(Value::Object(o))
            if o.get("function")
                .and_then(|f| f.get("name"))
                .is_some_and(Value::is_string) => {}
        Some(_) => {
            return Err(ApiError::bad_request(
                "'tool_choice' must be \"auto\", \"none\", \"required\" or a function",
            ))
        }
    }
    let tools = match f.value("tools") {
        None => None,
        Some(Value::Array(t)) if t.is_empty() || choice.and_then(Value::as_str) == Some("none") => {
            None
        }
        Some(Value::Array(t)) => {
            if t.iter().any(|x| {
                x.get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .is_none()
            }) {
                return Err(ApiError::bad_request(
                    "every tool needs a 'function' with a 'name'",
                ));
            }
            Some(Value::Array(t.clone()))
        }
        Some(_) => return Err(ApiError::bad_request("'tools' must be an array")),
    };
    let format = match f.str("reasoning_format")? {
        Some(s) => reasoning_format(s)?,
        None => st.config.chat.reasoning_format,
    };
    let mut extra = st.config.chat.template_kwargs.clone();
    match f.value("chat_template_kwargs") {
        None => {}
        Some(Value::Object(kw)) => extra.extend(kw.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "'chat_template_kwargs' must be an object",
            ))
        }
    }
    if let Some(effort) = f.str("reasoning_effort")? {
        extra.insert("reasoning_effort".into(), effort.into());
    }
    Ok((chat.render(&messages, tools.as_ref(), extra)?, format))
}

async fn chat(State(st): St, body: Bytes) -> Res {
    let req = parse_body(&body)?;
    let f = Fields(&req);
    let lease = st.registry.acquire(f.str("model")?).await?;
    let (text, format) = render_chat(&st, &lease, &req)?;
    let host = lease.host.clone();
    let chat = host.chat()?;
    let prompt = chat.tokenize(&host.tokenizer, &text)?;
    let gen = gen_params(&f, &st.config.sampling, Flavor::Chat, &host.tokenizer)?;
    let output = chat.output_kind(&text, format);
    run(lease, Flavor::Chat, prompt, gen, output).await
}

async fn completions(State(st): St, body: Bytes) -> Res {
    let req = parse_body(&body)?;
    let f = Fields(&req);
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::bad_request("'echo' is not supported"));
    }
    if f.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_request("'suffix' is not supported"));
    }
    if f.i64("best_of")?.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("only 'best_of': 1 is supported"));
    }
    let lease = st.registry.acquire(f.str("model")?).await?;
    let tok = lease.host.tokenizer.clone();
    let prompt = prompt_tokens(req.get("prompt"), &tok)?;
    let gen = gen_params(&f, &st.config.sampling, Flavor::Completion, &tok)?;
    run(lease, Flavor::Completion, prompt, gen, OutputKind::Text).await
}

async fn native_completion(State(st): St, body: Bytes) -> Res {
    let req = parse_body(&body)?;
    let f = Fields(&req);
    let lease = st.registry.acquire(f.str("model")?).await?;
    let tok = lease.host.tokenizer.clone();
    let prompt = prompt_tokens(req.get("prompt"), &tok)?;
    let gen = gen_params(&f, &st.config.sampling, Flavor::Native, &tok)?;
    run(lease, Flavor::Native, prompt, gen, OutputKind::Text).await
}

/// Queues the request and answers it whole or as an SSE stream. The lease (and the request)
/// lives as long as the response: a client that goes away drops the stream, the receiver with
/// it, and the scheduler frees the slot.
async fn run(
    lease: Lease,
    flavor: Flavor,
    prompt: Vec<u32>,
    gen: GenParams,
    output: OutputKind,
) -> Res {
    let host = lease.host.clone();
    let spec = JobSpec {
        prompt,
        n_predict: gen.n_predict,
        sampling: gen.sampling,
        adjust: gen.adjust,
        logprobs: gen.logprobs,
        n_probs: gen.n_probs,
        stop: gen.stop,
        ignore_eos: gen.ignore_eos,
        output,
        cache_prompt: gen.cache_prompt,
        constraint: gen.constraint,
    };
    let mut rx = host.submit(spec)?;
    let mut resp = Responder::new(flavor, &host.id, host.tokenizer.clone(), gen.include_usage);
    if gen.stream {
        let head = resp.stream_start();
        let events = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
            let _held = &lease;
            stream::iter(resp.stream_event(ev))
        });
        let sse = stream::iter(head)
            .chain(events)
            .map(|data| Ok::<_, Infallible>(Event::default().data(data)));
        return Ok(Sse::new(sse)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    while let Some(ev) = rx.recv().await {
        resp.collect(ev)?;
        if resp.is_done() {
            break;
        }
    }
    let body = resp.response(gen.logprobs)?;
    drop(lease);
    Ok(Json(body).into_response())
}

async fn tokenize(State(st): St, body: Bytes) -> Res {
    let req = parse_body(&body)?;
    let f = Fields(&req);
    let lease = st.registry.acquire(f.str("model")?).await?;
    let tok = &lease.host.tokenizer;
    let content = f
        .str("content")?
        .ok_or_else(|| ApiError::bad_request("'content' (a string) is required"))?;
    let add_special = f.bool("add_special")?.unwrap_or(false);
    let parse_special = f.bool("parse_special")?.unwrap_or(true);
    let ids = tok
        .encode(content, add_special, parse_special)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let tokens: Value = if f.bool("with_pieces")?.unwrap_or(false) {
        ids.iter()
            .map(|&id| {
                let bytes = tok.token_bytes(id);
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => json!(s),
                    Err(_) => json!(bytes),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        json!(ids)
    };
    Ok(Json(json!({ "tokens": tokens })).into_response())
}

async fn detokenize(State(st): St, body: Bytes) -> Res {
    let req = parse_body(&body)?;
    let f = Fields(&req);
    let lease = st.registry.acquire(f.str("model")?).await?;
    let tok = &lease.host.tokenizer;
    let ids: Vec<u32> = match f.value("tokens") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&i| (i as usize) < tok.n_vocab())
                    .map(|i| i as u32)
                    .ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "'tokens' holds {v}, which is not a token id of this model"
                        ))
                    })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::bad_request(
                "'tokens' must be an array of token ids",
            ))
        }
    };
    Ok(Json(json!({"content": tok.decode_lossy(&ids)})).into_response())
}

async fn apply_template(State(st): St, body: Bytes) -> Res {
    let req = parse_body(&body)?;
    let lease = st.registry.acquire(Fields(&req).str("model")?).await?;
    let (text, _) = render_chat(&st, &lease, &req)?;
    Ok(Json(json!({ "prompt": text })).into_response())
}

async fn props(State(st): St, Query(q): Query<HashMap<String, String>>) -> Res {
    if st.registry.is_router() && !q.contains_key("model") {
        return Ok(Json(json!({"role": "router", "total_models": st.registry.list().len(), "build_info": build_info()})).into_response());
    }
    let lease = st
        .registry
        .acquire(q.get("model").map(String::as_str))
        .await?;
    let h = &lease.host;
    let s = &st.config.sampling;
    let tok = &h.tokenizer;
    let text = |id: Option<u32>| {
        id.and_then(|i| tok.token_text(i))
            .unwrap_or_default()
            .to_string()
    };
    Ok(Json(json!({
        "default_generation_settings": {
            "id": 0,
            "n_ctx": h.n_ctx_slot(),
            "params": {
                "temperature": s.params.temperature, "top_k": s.params.top_k, "top_p": s.params.top_p,
                "min_p": s.params.min_p, "repeat_penalty": s.params.repeat_penalty,
                "repeat_last_n": s.params.repeat_last_n,
                "seed": if s.random_seed { -1i64 } else { s.params.seed as i64 },
                "n_predict": s.n_predict.map_or(-1i64, |n| n as i64),
            },
        },
        "total_slots": h.scheduler.config().n_slots,
        "model_alias": h.id,
        "model_path": h.path.display().to_string(),
        "chat_template": h.chat.as_ref().map(|c| c.source()),
        "bos_token": text(tok.bos()),
        "eos_token": text(tok.eos()),
        "build_info": build_info(),
        "modalities": {"vision": false, "audio": false},
        "is_sleeping": false,
    }))
    .into_response())
}

fn build_info() -> String {
    format!("hmoe {}", env!("CARGO_PKG_VERSION"))
}

async fn slots(State(st): St, Query(q): Query<HashMap<String, String>>) -> Res {
    if !st.config.slots_endpoint {
        return Err(ApiError::not_supported(
            "This server does not support slots endpoint. Start it without `--no-slots`",
        ));
    }
    let lease = st
        .registry
        .acquire(q.get("model").map(String::as_str))
        .await?;
    let views: Vec<Value> = lease
        .host
        .scheduler
        .slots()
        .into_iter()
        .map(|v| {
            json!({
                "id": v.id, "id_task": v.id_task.map_or(-1i64, |t| t as i64), "n_ctx": v.n_ctx,
                "is_processing": v.is_processing, "n_past": v.n_past, "n_prompt_tokens": v.n_prompt,
                "next_token": {"n_decoded": v.n_decoded},
            })
        })
        .collect();
    Ok(Json(Value::Array(views)).into_response())
}

async fn metrics_route(State(st): St) -> Res {
    if !st.config.metrics {
        return Err(ApiError::not_supported(
            "This server does not support metrics endpoint. Start it with `--metrics`",
        ));
    }
    let hosts = st.registry.loaded();
    let label = st.registry.is_router();
    let entries: Vec<(Option<String>, &metrics::Stats)> = hosts
        .iter()
        .map(|h| (label.then(|| h.id.clone()), &*h.stats))
        .collect();
    let text = metrics::render(&entries);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_from_headers() {
        let mut h = HeaderMap::new();
        assert_eq!(presented_key(&h), None);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer  sk-1 "),
        );
        assert_eq!(presented_key(&h), Some("sk-1"));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("k2"));
        assert_eq!(presented_key(&h), Some("k2"));
        assert!(same_key("abc", "abc") && !same_key("abc", "abd") && !same_key("ab", "abc"));
        assert!(is_public("/health") && !is_public("/v1/chat/completions"));
    }
}
