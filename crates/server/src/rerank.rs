//! llama-server's rerank routes (`--reranking`): `/rerank`, `/reranking`, `/v1/rerank`,
//! `/v1/reranking`. A request gives a `query` and `documents` (Jina's and Cohere's form; the
//! answer is `{model, object, usage, results: [{index, relevance_score}]}`) or `texts` (Hugging
//! Face TEI's form; the answer is the array of `{index, score}`, with `text` when
//! `return_text`), best first, the first `top_n`.
//!
//! Each (query, document) pair is formatted as llama-server formats it: the model's rerank
//! template (`tokenizer.chat_template.rerank`, `{query}` and `{document}` replaced) when it
//! has one, else BOS (when the vocabulary adds it), the query, EOS (when it adds EOS; the
//! separator token when it has no EOS), the separator (when it adds one), the document, EOS.
//! The score is the first value of the pair's rank-pooled vector: llama.cpp's rank pooling is
//! the first token's hidden state, passed through the model's classification head when it
//! has one. None of the architectures hmoe runs has such a head (llama.cpp loads none for
//! them either), so, as llama-server's, the score is the first token's first value: a model
//! that is not a reranker ranks nothing, here as there.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use hmoe_tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::embeddings::{check_reranking, hidden_states, MAX_INPUTS};
use crate::error::ApiError;
use crate::params::Fields;
use crate::parsed_body::blocking;
use crate::state::AppState;

/// A pair's tokens as llama-server's `format_prompt_rerank` makes them (see the module docs).
fn pair_tokens(
    tok: &Tokenizer,
    meta: &hmoe_gguf::Metadata,
    query: &str,
    doc: &str,
) -> Result<Vec<u32>, ApiError> {
    let encode = |s: &str, parse_special: bool| {
        tok.encode(s, false, parse_special)
            .map_err(|e| ApiError::bad_request(format!("tokenizing: {e}")))
    };
    if let Some(template) = meta.get_str("tokenizer.chat_template.rerank") {
        let prompt = template
            .replace("{query}", query)
            .replace("{document}", doc);
        return encode(&prompt, true);
    }
    let sep = meta.get_u32("tokenizer.ggml.seperator_token_id");
    let add_sep = meta
        .get_bool("tokenizer.ggml.add_sep_token")
        .unwrap_or(false);
    let eos = tok.eos().or(sep);
    let mut out = Vec::new();
    if let Some(bos) = tok.bos().filter(|_| tok.add_bos()) {
        out.push(bos);
    }
    out.extend(encode(query, false)?);
    out.extend(eos.filter(|_| tok.add_eos()));
    out.extend(sep.filter(|_| add_sep));
    out.extend(encode(doc, false)?);
    out.extend(eos.filter(|_| tok.add_eos()));
    Ok(out)
}

/// The strings of an array of strings (`None`: not one).
fn strings(v: Option<&Value>) -> Option<Vec<String>> {
    (v?.as_array()?.iter())
        .map(|d| d.as_str().map(str::to_string))
        .collect()
}

/// `POST /rerank` and its aliases.
pub async fn rerank(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    check_reranking(&st)?;
    let req = st.bodies.parse(body).await?;
    let f = Fields(&req);
    let tei = f.value("texts").is_some();
    let query = match f.value("query") {
        Some(Value::String(q)) => q.clone(),
        Some(_) => return Err(ApiError::bad_request("\"query\" must be a string")),
        None => return Err(ApiError::bad_request("\"query\" must be provided")),
    };
    let documents = (strings(f.value("documents")))
        .or_else(|| strings(f.value("texts")))
        .filter(|d| !d.is_empty())
        .ok_or_else(|| ApiError::bad_request("\"documents\" must be a non-empty string array"))?;
    if documents.len() > MAX_INPUTS {
        return Err(ApiError::bad_request(format!(
            "{} documents; at most {MAX_INPUTS} a request",
            documents.len()
        )));
    }
    let top_n = match f.i64("top_n")? {
        None => documents.len(),
        Some(n) => {
            usize::try_from(n).map_err(|_| ApiError::bad_request("'top_n' must be 0 or more"))?
        }
    };
    let return_text = tei && f.bool("return_text")?.unwrap_or(false);
    let model_field = f.str("model")?.map(str::to_string);
    let lease = st.registry.acquire(f.str("model")?).await?;
    drop(req);
    let host = lease.host.clone();
    let tok = host.tokenizer.clone();
    let model = host.model.clone();
    let pairs = {
        let documents = documents.clone();
        blocking(move || {
            let meta = model.gguf().metadata();
            (documents.iter())
                .map(|d| pair_tokens(&tok, meta, &query, d))
                .collect::<Result<Vec<_>, _>>()
        })
        .await?
    };
    let mut n_tokens = 0;
    let mut ranked = Vec::with_capacity(pairs.len());
    for (index, tokens) in pairs.into_iter().enumerate() {
        if tokens.is_empty() {
            return Err(ApiError::bad_request("Input content cannot be empty"));
        }
        n_tokens += tokens.len();
        let rows = hidden_states(&host, tokens).await?;
        ranked.push((index, rows[0]));
    }
    drop(lease);
    // Best first; equal scores keep the documents' order.
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    ranked.truncate(top_n);
    let label = if tei { "score" } else { "relevance_score" };
    let results: Vec<Value> = (ranked.into_iter())
        .map(|(index, score)| {
            let mut e = json!({"index": index, label: score});
            if return_text {
                e["text"] = documents[index].clone().into();
            }
            e
        })
        .collect();
    if tei {
        return Ok(Json(Value::Array(results)).into_response());
    }
    Ok(Json(json!({
        "model": model_field.unwrap_or_else(|| host.id.clone()),
        "object": "list",
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        "results": results,
    }))
    .into_response())
}
