//! The `/tokenize` answer, written as a stream of chunks: a 64 MiB prompt has millions of
//! tokens, and a JSON tree of `{"id", "piece"}` objects for each would take gigabytes, where
//! the token ids alone take 4 bytes each.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use hmoe_tokenizer::Tokenizer;

/// Tokens serialized per chunk.
const CHUNK: usize = 4096;

/// `{"tokens": [...]}`: the ids, or with `with_pieces` objects `{"id": N, "piece": P}` where
/// `P` is the token's text, or its bytes as an array of numbers when they are not UTF-8.
pub fn tokens_response(tokenizer: Arc<Tokenizer>, ids: Vec<u32>, with_pieces: bool) -> Response {
    let n_chunks = ids.len().div_ceil(CHUNK);
    let ids = Arc::new(ids);
    let body = (0..n_chunks).map(move |c| {
        let part = &ids[c * CHUNK..ids.len().min((c + 1) * CHUNK)];
        let mut out = Vec::with_capacity(part.len() * if with_pieces { 32 } else { 7 });
        for (i, &id) in part.iter().enumerate() {
            if c > 0 || i > 0 {
                out.push(b',');
            }
            if with_pieces {
                out.extend_from_slice(b"{\"id\":");
                out.extend_from_slice(id.to_string().as_bytes());
                out.extend_from_slice(b",\"piece\":");
                let bytes = tokenizer.token_bytes(id);
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => serde_json::to_vec(s),
                    Err(_) => serde_json::to_vec(bytes),
                };
                // Serializing a string or a byte slice cannot fail.
                out.extend_from_slice(&piece.unwrap_or_default());
                out.push(b'}');
            } else {
                out.extend_from_slice(id.to_string().as_bytes());
            }
        }
        Ok::<_, Infallible>(Bytes::from(out))
    });
    let parts = std::iter::once(Ok(Bytes::from_static(b"{\"tokens\":[")))
        .chain(body)
        .chain(std::iter::once(Ok(Bytes::from_static(b"]}"))));
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream::iter(parts)),
    )
        .into_response()
}
