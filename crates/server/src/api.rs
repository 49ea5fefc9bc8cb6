//! HTTP routes (llama-server's paths) and the API-key / CORS middleware.

use std::borrow::Cow;
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap};
use axum::middleware;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Map, Value};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::chat_render::{chat_prompt, prepare_chat};
use crate::error::ApiError;
use crate::metrics;
use crate::oai::Responder;
use crate::output::OutputKind;
use crate::params::{
    choices, gen_params, too_many_completions, Fields, Flavor, GenParams, MAX_COMPLETIONS,
};
use crate::parsed_body::{blocking, ParsedBody};
use crate::registry::Lease;
use crate::state::AppState;

type St = State<Arc<AppState>>;
type Res = Result<Response, ApiError>;

/// The application: every route, behind the API-key check.
pub fn router(state: Arc<AppState>) -> Router {
    let page = if state.config.webui {
        crate::webui::routes()
    } else {
        Router::new()
    };
    page.route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/models", get(models))
        .route("/v1/models", get(models))
        .route("/models/load", post(load_model))
        .route("/models/unload", post(unload_model))
        .route("/models/{name}", axum::routing::delete(delete_model))
        .route("/chat/completions", post(chat))
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions/input_tokens", post(chat_input_tokens))
        .route("/v1/chat/completions/input_tokens", post(chat_input_tokens))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(crate::responses::create))
        .route("/responses", post(crate::responses::create))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route(
            "/v1/messages/count_tokens",
            post(crate::anthropic::count_tokens),
        )
        .route("/completion", post(native_completion))
        .route("/completions", post(native_completion))
        .route("/embedding", post(crate::embeddings::native))
        .route("/embeddings", post(crate::embeddings::native))
        .route("/v1/embeddings", post(crate::embeddings::openai))
        .route("/rerank", post(crate::rerank::rerank))
        .route("/reranking", post(crate::rerank::rerank))
        .route("/v1/rerank", post(crate::rerank::rerank))
        .route("/v1/reranking", post(crate::rerank::rerank))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .route("/props", get(props))
        .route("/slots", get(slots))
        .route("/slots/{id_slot}", post(crate::slot_actions::slot_action))
        .route("/metrics", get(metrics_route))
        .fallback(not_found)
        // The guard reads bodies within the limit; the extractors must not apply axum's 2 MB.
        .layer(DefaultBodyLimit::max(state.config.limits.max_body))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::guard::guard,
        ))
        .layer(middleware::from_fn(crate::request_log::log_requests))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::not_found("File Not Found")
}

async fn health(State(st): St) -> Res {
    st.registry.health()?;
    Ok(Json(json!({"status": "ok"})).into_response())
}

/// `GET /models`: the served models; in router mode `?reload=1` (a client with the API key)
/// first reads the preset file again and scans the directory ([`Registry::reload`]).
///
/// [`Registry::reload`]: crate::registry::Registry::reload
async fn models(
    State(st): St,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Res {
    let full = crate::guard::authorized(&st.config, &headers);
    if q.get("reload")
        .is_some_and(|v| matches!(v.as_str(), "1" | "true"))
    {
        if !full {
            return Err(ApiError::unauthorized());
        }
        st.registry.reload().await?;
    }
    Ok(Json(json!({"object": "list", "data": st.registry.list(full)})).into_response())
}

/// The `model` a load or unload request names.
fn named_model(req: &Map<String, Value>) -> Result<&str, ApiError> {
    Fields(req)
        .str("model")?
        .ok_or_else(|| ApiError::bad_request("'model' is required"))
}

async fn load_model(State(st): St, body: Bytes) -> Res {
    let req = st.bodies.parse(body).await?;
    let name = named_model(&req)?;
    st.registry.load(name).await?;
    Ok(Json(json!({"success": true})).into_response())
}

async fn unload_model(State(st): St, body: Bytes) -> Res {
    let req = st.bodies.parse(body).await?;
    let name = named_model(&req)?;
    st.registry.unload(name).await?;
    Ok(Json(json!({"success": true})).into_response())
}

/// `DELETE /models/{name}`: `POST /models/unload` by path.
async fn delete_model(State(st): St, Path(name): Path<String>) -> Res {
    st.registry.unload(&name).await?;
    Ok(Json(json!({"success": true})).into_response())
}

async fn chat(State(st): St, body: Bytes) -> Res {
    let req = st.bodies.parse(body).await?;
    let n = choices(&Fields(&req))?;
    let mut p = prepare_chat(&st, &req, |r| Ok(Cow::Borrowed(r))).await?;
    drop(req);
    p.gen.verbose |= st.config.verbose;
    if n > 1 {
        let prompts = vec![p.prompt; n];
        return crate::multi::run_many(p.lease, Flavor::Chat, prompts, p.gen, p.output).await;
    }
    run(p.lease, Flavor::Chat, p.prompt, p.gen, p.output).await
}

/// llama-server's `/chat/completions/input_tokens`: how many tokens the chat request's prompt
/// (messages, tools, template) is, without generating.
async fn chat_input_tokens(State(st): St, body: Bytes) -> Res {
    let req = st.bodies.parse(body).await?;
    let p = prepare_chat(&st, &req, |r| Ok(Cow::Borrowed(r))).await?;
    Ok(Json(json!({ "input_tokens": p.prompt.len() })).into_response())
}

async fn completions(State(st): St, body: Bytes) -> Res {
    let req = st.bodies.parse(body).await?;
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
    complete(&st, req, Flavor::Completion).await
}

async fn native_completion(State(st): St, body: Bytes) -> Res {
    let req = st.bodies.parse(body).await?;
    complete(&st, req, Flavor::Native).await
}

/// Runs the text completion of the request's `prompt` (OpenAI's or llama.cpp's route); the
/// prompt is tokenized on a blocking thread, and the body is dropped before generation.
async fn complete(st: &AppState, req: ParsedBody, flavor: Flavor) -> Res {
    let lease = st.registry.acquire(Fields(&req).str("model")?).await?;
    let tok = lease.host.tokenizer.clone();
    let config = st.config.clone();
    let (mut prompts, mut gen) = blocking(move || {
        let f = Fields(&req);
        let n = if flavor == Flavor::Native {
            1
        } else {
            choices(&f)?
        };
        let prompts = crate::multi::prompts(&req, &tok)?;
        if prompts.len() * n > MAX_COMPLETIONS {
            return Err(too_many_completions(prompts.len() * n));
        }
        let prompts: Vec<Vec<u32>> = (prompts.iter())
            .flat_map(|p| std::iter::repeat_n(p.clone(), n))
            .collect();
        let mut gen = gen_params(&f, &config.sampling, flavor, &tok, None)?;
        gen.verbose |= config.verbose;
        Ok((prompts, gen))
    })
    .await?;
    gen.compile(&lease.host).await?;
    if prompts.len() > 1 {
        return crate::multi::run_many(lease, flavor, prompts, gen, OutputKind::Text).await;
    }
    let prompt = prompts.pop().unwrap_or_default();
    run(lease, flavor, prompt, gen, OutputKind::Text).await
}

/// Queues the request and answers it whole or as an SSE stream. The lease (and the request)
/// lives as long as the response: a client that goes away drops the stream, the receiver with
/// it, and the scheduler frees the slot.
async fn run(
    lease: Lease,
    flavor: Flavor,
    prompt: Vec<u32>,
    mut gen: GenParams,
    output: OutputKind,
) -> Res {
    let host = lease.host.clone();
    let verbose_prompt = (gen.verbose && !gen.stream).then(|| host.tokenizer.decode_lossy(&prompt));
    let mut rx = host.submit(gen.job(prompt, output))?;
    let mut resp = Responder::new(flavor, &host.id, host.tokenizer.clone(), gen.include_usage)
        .with_post_sampling(gen.post_sampling_probs);
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
    let (logprobs, fields) = (gen.logprobs, std::mem::take(&mut gen.response_fields));
    let finish = move || -> Result<Vec<u8>, ApiError> {
        let mut body = resp.response(logprobs)?;
        if let Some(prompt) = verbose_prompt {
            add_verbose(&mut body, flavor, prompt);
        }
        if !fields.is_empty() {
            body = crate::oai::select_fields(&body, &fields);
        }
        serde_json::to_vec(&body).map_err(|e| ApiError::internal(format!("the answer: {e}")))
    };
    // With probabilities the answer grows with tokens × n_probs (megabytes): built and
    // written on the blocking pool, so that no async worker stalls on it.
    let bytes = match logprobs || gen.n_probs > 0 {
        true => blocking(finish).await?,
        false => finish()?,
    };
    drop(lease);
    Ok(([(header::CONTENT_TYPE, "application/json")], bytes).into_response())
}

/// llama-server's `__verbose` object of a whole answer (`--verbose`): the prompt as its tokens
/// read back (BOS included) and the generated text. The native route's answer has these
/// fields already.
fn add_verbose(body: &mut Value, flavor: Flavor, prompt: String) {
    let content = match flavor {
        Flavor::Chat => body["choices"][0]["message"]["content"].clone(),
        Flavor::Completion => body["choices"][0]["text"].clone(),
        Flavor::Native => return,
    };
    body["__verbose"] = json!({"prompt": prompt, "content": content});
}

async fn tokenize(State(st): St, body: Bytes) -> Res {
    let req = st.bodies.parse(body).await?;
    let lease = st.registry.acquire(Fields(&req).str("model")?).await?;
    let tok = lease.host.tokenizer.clone();
    let (ids, with_pieces) = blocking(move || {
        let f = Fields(&req);
        let content = f
            .str("content")?
            .ok_or_else(|| ApiError::bad_request("'content' (a string) is required"))?;
        let add_special = f.bool("add_special")?.unwrap_or(false);
        let parse_special = f.bool("parse_special")?.unwrap_or(true);
        let ids = tok
            .encode(content, add_special, parse_special)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok((ids, f.bool("with_pieces")?.unwrap_or(false)))
    })
    .await?;
    Ok(crate::pieces::tokens_response(
        lease.host.tokenizer.clone(),
        ids,
        with_pieces,
    ))
}

async fn detokenize(State(st): St, body: Bytes) -> Res {
    let req = st.bodies.parse(body).await?;
    let lease = st.registry.acquire(Fields(&req).str("model")?).await?;
    let tok = lease.host.tokenizer.clone();
    let content = blocking(move || {
        let ids: Vec<u32> = match Fields(&req).value("tokens") {
            None => match req.ids("tokens") {
                Some(ids) => match ids.iter().find(|&&i| i as usize >= tok.n_vocab()) {
                    Some(i) => {
                        return Err(ApiError::bad_request(format!(
                            "'tokens' holds {i}, which is not a token id of this model"
                        )))
                    }
                    None => ids.to_vec(),
                },
                None => Vec::new(),
            },
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
        Ok(tok.decode_lossy(&ids))
    })
    .await?;
    Ok(Json(json!({ "content": content })).into_response())
}

async fn apply_template(State(st): St, body: Bytes) -> Res {
    let req = st.bodies.parse(body).await?;
    let (text, _) = chat_prompt(&st, &req, |r| Ok(Cow::Borrowed(r)), false).await?;
    Ok(Json(json!({ "prompt": text })).into_response())
}

async fn props(State(st): St, Query(q): Query<HashMap<String, String>>) -> Res {
    if st.registry.is_router() && !q.contains_key("model") {
        let mut p = st.registry.router_props();
        p["build_info"] = build_info().into();
        return Ok(Json(p).into_response());
    }
    if st.registry.is_sleeping() {
        // What is known without the model: reading /props does not wake it.
        let id = (st.registry.list(false).first()).map_or(Value::Null, |m| m["id"].clone());
        return Ok(Json(json!({
            "model_alias": id,
            "total_slots": st.config.engine.n_parallel,
            "build_info": build_info(),
            "modalities": {"vision": false, "audio": false},
            "is_sleeping": true,
        }))
        .into_response());
    }
    // The single model is read without a lease: reading /props is no activity that keeps
    // it from sleeping (--sleep-idle-seconds).
    let single = (!st.registry.is_router())
        .then(|| st.registry.loaded().pop())
        .flatten();
    let h = match single {
        Some(h) => h,
        None => (st
            .registry
            .acquire(q.get("model").map(String::as_str))
            .await?)
            .host
            .clone(),
    };
    let h = &h;
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
                "typical_p": s.params.typical_p, "top_n_sigma": s.params.top_n_sigma,
                "xtc_probability": s.params.xtc_probability,
                "xtc_threshold": s.params.xtc_threshold,
                "mirostat": s.params.mirostat as u8,
                "mirostat_tau": s.params.mirostat_tau, "mirostat_eta": s.params.mirostat_eta,
                "dry_multiplier": s.params.dry.multiplier, "dry_base": s.params.dry.base,
                "dry_allowed_length": s.params.dry.allowed_length,
                "dry_penalty_last_n": s.params.dry.penalty_last_n.map_or(-1i64, |n| n as i64),
                "dry_sequence_breakers": s.dry_sequence_breakers,
                "samplers": s.params.order.iter().map(|st| st.name()).collect::<Vec<_>>(),
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
        "placement": h.placement.to_json(),
    }))
    .into_response())
}

/// `b<commits>-<short hash>` of the build, as llama-server's `build_info` (see build.rs).
fn build_info() -> &'static str {
    env!("HMOE_BUILD_INFO")
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
    let mut text = metrics::render(&entries);
    let devices: Vec<(Option<String>, hmoe_model::DeviceMemory)> = (hosts.iter())
        .filter_map(|h| Some((label.then(|| h.id.clone()), h.model.device_memory()?)))
        .collect();
    text.push_str(&metrics::render_devices(&devices));
    let caches: Vec<(Option<String>, hmoe_model::MoeCacheStats)> = (hosts.iter())
        .filter_map(|h| Some((label.then(|| h.id.clone()), h.model.moe_cache_stats()?)))
        .collect();
    text.push_str(&metrics::render_moe_cache(&caches));
    let steps: Vec<(Option<String>, hmoe_model::ExecStats)> = (hosts.iter())
        .filter_map(|h| Some((label.then(|| h.id.clone()), h.model.device_stats()?)))
        .collect();
    text.push_str(&metrics::render_device_steps(&steps));
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}
