//! Errors: [`ApiError`] is what a client sees (OpenAI's error object, llama-server's `type`
//! names); [`ServerError`] is what stops the server from starting.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

/// An error answered to an HTTP client as
/// `{"error": {"code": N, "message": "...", "type": "..."}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI/llama-server error type (`invalid_request_error`, `authentication_error`, ...).
    pub kind: &'static str,
    /// Further fields of the error object (e.g. `n_prompt_tokens`, `n_ctx`).
    pub extra: Map<String, Value>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            extra: Map::new(),
        }
    }

    /// 400: the request is malformed or asks for something impossible.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400: the prompt does not fit in a slot's context.
    pub fn exceeds_context(n_prompt: usize, n_ctx: usize) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::BAD_REQUEST,
            "exceed_context_size_error",
            format!(
                "the request exceeds the available context size ({n_prompt} prompt tokens, {n_ctx} per slot), try increasing it"
            ),
        );
        e.extra.insert("n_prompt_tokens".into(), n_prompt.into());
        e.extra.insert("n_ctx".into(), n_ctx.into());
        e
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized() -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "Invalid API Key",
        )
    }

    /// 404: no such route or object.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    /// 408: the client did not send its request in time.
    pub fn timeout(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::REQUEST_TIMEOUT, "timeout_error", message)
    }

    /// 413: the request body is larger than allowed.
    pub fn too_large(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            message,
        )
    }

    /// 415: a body type the route refuses.
    pub fn unsupported_media_type(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            message,
        )
    }

    /// 500: the server failed.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// 501: the feature is switched off or not built.
    pub fn not_supported(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_IMPLEMENTED, "not_supported_error", message)
    }

    /// 409: the request conflicts with what a resource is doing now (a slot action on a
    /// slot that runs a request).
    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, "invalid_request_error", message)
    }

    /// 503: busy (queue full, model loading, model limit reached).
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            message,
        )
    }

    /// The JSON error object (also sent as an SSE event when a stream fails midway).
    pub fn body(&self) -> Value {
        let mut err = Map::new();
        err.insert("code".into(), self.status.as_u16().into());
        err.insert("message".into(), self.message.clone().into());
        err.insert("type".into(), self.kind.into());
        for (k, v) in &self.extra {
            err.insert(k.clone(), v.clone());
        }
        json!({ "error": err })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.as_u16(),
            self.kind,
            self.message
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Why the server could not start or load a model.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The listening socket could not be opened.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Address asked for.
        addr: String,
        /// OS error.
        source: std::io::Error,
    },
    /// A model file could not be loaded.
    #[error("loading {path}: {message}")]
    Load {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The configuration is inconsistent.
    #[error("{0}")]
    Config(String),
    /// The runtime failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
