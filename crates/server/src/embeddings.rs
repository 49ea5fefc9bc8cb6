//! llama-server's embedding routes (`--embedding`): `/embedding` and `/embeddings` (its own
//! answer: an array of `{index, embedding}`, `embedding` a list of vectors: one per token with
//! pooling `none`, else one) and `/v1/embeddings` (OpenAI's: `data`, `usage`, optionally
//! base64).
//!
//! The vector of a token is the model's final hidden state after the output norm (the head's
//! input, [`LogitsWanted::Hidden`]); the pooling (`--pooling`, else the model's
//! `{arch}.pooling_type`, else `none` as llama.cpp) makes one vector of a prompt's: the mean of
//! every token's, the first token's (`cls`, and `rank`: llama.cpp's rank pooling picks the
//! first token of every architecture hmoe runs, and none of them has a classification head),
//! or the last one's. Pooled vectors are normalized as `embd_normalize` asks
//! ([`normalize`]); per-token ones are not. hmoe's models are causal, so a prompt of any
//! length up to a slot's context is computed exactly in micro-batches (llama-server refuses a
//! prompt over its micro-batch unless the pooling is `last`).
//!
//! Each prompt runs in a cache of its own, outside the slots, one forward pass after another
//! with the slots' steps (the model runs one pass at a time).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::model_host::ModelHost;
use crate::params::Fields;
use crate::parsed_body::{blocking, ParsedBody};
use crate::state::AppState;
use hmoe_model::{LogitsWanted, ModelError};

pub use crate::pooling::Pooling;

/// Most prompts one embedding request may hold (OpenAI's limit on `input`).
pub const MAX_INPUTS: usize = 2048;

/// The pooling a model is served with: `--pooling`, else its metadata's, else `none`
/// (llama.cpp's default for a model that names none).
fn served_pooling(config: &crate::ServerConfig, host: &ModelHost) -> Pooling {
    (config.pooling)
        .or_else(|| Pooling::of_model(host.model.gguf().metadata()))
        .unwrap_or(Pooling::None)
}

/// `embd_normalize` as llama.cpp's `common_embd_normalize`: -1 none, 0 max-abs scaled to
/// int16's range, 2 Euclidean, any other p the p-norm (1: taxicab); a zero norm gives zeros.
pub fn normalize(inp: &[f32], embd_norm: i64) -> Vec<f32> {
    let sum: f64 = match embd_norm {
        -1 => 1.0,
        0 => inp.iter().fold(0f64, |m, x| m.max(x.abs() as f64)) / 32760.0,
        2 => inp.iter().map(|x| (x * x) as f64).sum::<f64>().sqrt(),
        p => inp
            .iter()
            .map(|x| (x.abs() as f64).powf(p as f64))
            .sum::<f64>()
            .powf(1.0 / p as f64),
    };
    let norm = if sum > 0.0 { (1.0 / sum) as f32 } else { 0.0 };
    inp.iter().map(|x| x * norm).collect()
}

/// Standard base64 (with padding) of `bytes`: `encoding_format: "base64"`.
fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            out.push(match i <= c.len() {
                true => ABC[(n >> shift & 63) as usize] as char,
                false => '=',
            });
        }
    }
    out
}

/// The final hidden states after the output norm of `tokens` (`n_embd` floats per token),
/// run in a cache of their own on a blocking thread. Ids outside the vocabulary and prompts
/// longer than a slot's context are 400s.
pub(crate) async fn hidden_states(
    host: &Arc<ModelHost>,
    tokens: Vec<u32>,
) -> Result<Vec<f32>, ApiError> {
    let n_vocab = host.model.n_vocab();
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(ApiError::bad_request(format!(
            "token id {bad} is outside the vocabulary (n_vocab {n_vocab})"
        )));
    }
    let n_ctx = host.n_ctx_slot();
    if tokens.len() > n_ctx {
        return Err(ApiError::bad_request(format!(
            "input is too large to process: {} tokens, and a slot's context is {n_ctx} \
             (--ctx-size / --parallel)",
            tokens.len()
        )));
    }
    let host = host.clone();
    blocking(move || {
        let slots = host.scheduler.config();
        let mut cache = host
            .model
            .new_cache(slots.kv_type, tokens.len(), slots.n_ubatch);
        (host
            .model
            .forward(&mut cache, &tokens, LogitsWanted::Hidden))
        .map_err(|e| match e {
            e if e.is_out_of_memory() => ApiError::unavailable(e.to_string()),
            e @ (ModelError::BadToken { .. } | ModelError::ContextFull { .. }) => {
                ApiError::bad_request(e.to_string())
            }
            e => ApiError::internal(e.to_string()),
        })
    })
    .await
}

/// The 501 of an embedding or reranking route on a server started without it.
fn disabled(what: &str, flag: &str) -> ApiError {
    ApiError::not_supported(format!(
        "This server does not support {what}. Start it with `{flag}`"
    ))
}

/// Whether the server may answer embedding requests (`--embedding`), else the 501 llama-server
/// answers.
pub(crate) fn check_enabled(st: &AppState) -> Result<(), ApiError> {
    match st.config.embeddings {
        true => Ok(()),
        false => Err(disabled("embeddings", "--embeddings")),
    }
}

/// Whether the server may rerank (`--reranking`: embeddings with rank pooling), else the 501
/// llama-server answers.
pub(crate) fn check_reranking(st: &AppState) -> Result<(), ApiError> {
    match st.config.embeddings && st.config.pooling == Some(Pooling::Rank) {
        true => Ok(()),
        false => Err(disabled("reranking", "--reranking")),
    }
}

/// `POST /embedding`, `/embeddings`: llama-server's own answer.
pub async fn native(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    embed(&st, body, false).await
}

/// `POST /v1/embeddings`: OpenAI's answer (llama-server's own when the body has `content`
/// rather than `input`).
pub async fn openai(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    embed(&st, body, true).await
}

/// The request's fields, checked before anything is tokenized.
struct EmbedRequest {
    /// Answer in OpenAI's shape.
    oai: bool,
    base64: bool,
    embd_normalize: i64,
    /// The field that holds the prompts (`input`, else `content`).
    key: &'static str,
}

impl EmbedRequest {
    fn read(req: &ParsedBody, oai_route: bool) -> Result<EmbedRequest, ApiError> {
        let f = Fields(req);
        let has = |k: &str| f.value(k).is_some() || req.ids(k).is_some();
        let (key, oai) = match (has("input"), has("content")) {
            (true, _) => ("input", oai_route),
            // `content` is not OpenAI's: the answer is llama-server's own.
            (false, true) => ("content", false),
            (false, false) => {
                return Err(ApiError::bad_request(
                    "\"input\" or \"content\" must be provided",
                ))
            }
        };
        let base64 = match f.str("encoding_format")? {
            None | Some("float") => false,
            Some("base64") => true,
            Some(_) => {
                return Err(ApiError::bad_request(
                    "The format to return the embeddings in. Can be either float or base64",
                ))
            }
        };
        let embd_normalize = f.i64("embd_normalize")?.unwrap_or(2);
        if !(-1..=i32::MAX as i64).contains(&embd_normalize) {
            return Err(ApiError::bad_request(
                "'embd_normalize' must be -1 (none), 0 (max absolute), 1 (taxicab), 2 \
                 (Euclidean) or a larger p (p-norm)",
            ));
        }
        Ok(EmbedRequest {
            oai,
            base64,
            embd_normalize,
            key,
        })
    }
}

async fn embed(st: &AppState, body: Bytes, oai_route: bool) -> Result<Response, ApiError> {
    check_enabled(st)?;
    let req = st.bodies.parse(body).await?;
    let r = EmbedRequest::read(&req, oai_route)?;
    let lease = st.registry.acquire(Fields(&req).str("model")?).await?;
    let host = lease.host.clone();
    let pooling = served_pooling(&st.config, &host);
    if r.oai && pooling == Pooling::None {
        return Err(ApiError::bad_request(
            "Pooling type 'none' is not OAI compatible. Please use a different pooling type",
        ));
    }
    let model_field = Fields(&req).str("model")?.map(str::to_string);
    let tok = host.tokenizer.clone();
    let key = r.key;
    let prompts = blocking(move || {
        crate::multi::prompts_in(&req, key, &tok, |n| {
            (n > MAX_INPUTS).then(|| {
                ApiError::bad_request(format!(
                    "'{key}' holds {n} prompts; at most {MAX_INPUTS} a request"
                ))
            })
        })
    })
    .await?;
    if prompts.is_empty() {
        return Err(ApiError::bad_request(format!("'{key}' holds no prompt")));
    }
    if prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::bad_request("Input content cannot be empty"));
    }
    let n_embd = host.model.n_embd();
    let mut results = Vec::with_capacity(prompts.len());
    let mut n_tokens = 0;
    for (index, tokens) in prompts.into_iter().enumerate() {
        n_tokens += tokens.len();
        let rows = hidden_states(&host, tokens).await?;
        let vectors = match pooling.pool(&rows, n_embd) {
            Some(v) => vec![normalize(&v, r.embd_normalize)],
            None => rows.chunks_exact(n_embd).map(<[f32]>::to_vec).collect(),
        };
        results.push((index, vectors));
    }
    drop(lease);
    if !r.oai {
        let out: Vec<Value> = (results.into_iter())
            .map(|(index, vectors)| json!({"index": index, "embedding": vectors}))
            .collect();
        return Ok(Json(Value::Array(out)).into_response());
    }
    let data: Vec<Value> = (results.into_iter())
        .map(|(index, mut vectors)| {
            let v = vectors.swap_remove(0);
            match r.base64 {
                true => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!({"embedding": base64(&bytes), "index": index, "object": "embedding",
                           "encoding_format": "base64"})
                }
                false => json!({"embedding": v, "index": index, "object": "embedding"}),
            }
        })
        .collect();
    Ok(Json(json!({
        "model": model_field.unwrap_or_else(|| host.id.clone()),
        "object": "list",
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        "data": data,
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_is_common_embd_normalize() {
        // llama.cpp: the norm in double, its inverse rounded to float, each value times it.
        let scaled = |v: &[f32], sum: f64| -> Vec<f32> {
            let inv = (1.0 / sum) as f32;
            v.iter().map(|x| x * inv).collect()
        };
        let v = [3.0f32, -4.0, 0.0];
        assert_eq!(normalize(&v, -1), v);
        assert_eq!(normalize(&v, 2), scaled(&v, 5.0));
        assert_eq!(normalize(&v, 1), scaled(&v, 7.0));
        assert_eq!(normalize(&v, 0), scaled(&v, 4.0 / 32760.0));
        assert_eq!(normalize(&v, 0)[1], -32760.0, "the largest becomes ±32760");
        let p3 = (27.0f64 + 64.0).powf(1.0 / 3.0);
        assert_eq!(normalize(&v, 3), scaled(&v, p3));
        assert_eq!(normalize(&[0.0, 0.0], 2), [0.0, 0.0]);
    }

    #[test]
    fn pooling_picks_rows() {
        let rows = [1.0f32, 2.0, 5.0, 10.0];
        assert_eq!(Pooling::Cls.pool(&rows, 2), Some(vec![1.0, 2.0]));
        assert_eq!(Pooling::Rank.pool(&rows, 2), Some(vec![1.0, 2.0]));
        assert_eq!(Pooling::Last.pool(&rows, 2), Some(vec![5.0, 10.0]));
        assert_eq!(Pooling::Mean.pool(&rows, 2), Some(vec![3.0, 6.0]));
        assert_eq!(Pooling::None.pool(&rows, 2), None);
        assert_eq!(Pooling::named("mean"), Some(Pooling::Mean));
        assert_eq!(Pooling::named("max"), None);
    }

    #[test]
    fn base64_is_standard_with_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64(&[0xff, 0xfe, 0x00]), "//4A");
    }
}
