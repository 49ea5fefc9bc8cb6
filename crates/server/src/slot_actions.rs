//! `POST /slots/{id_slot}?action=save|restore|erase` (llama-server's slot actions, enabled by
//! `--slot-save-path`): a slot's tokens and K/V cache saved to a file of that directory,
//! restored from one into an idle slot (whose next request then reuses the restored prefix),
//! or erased. Files are checked before use ([`crate::slot_file`]); a file name is a plain
//! name inside the directory, nothing else.

use std::collections::HashMap;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::ApiError;
use crate::model_host::ModelHost;
use crate::params::Fields;
use crate::parsed_body::{blocking, ParsedBody};
use crate::slot_file::{self, Identity, SlotFileError};
use crate::state::AppState;

/// The route: checks that slot files are enabled, the slot id and the action, then runs it
/// on the model the query's or the body's `model` names.
pub async fn slot_action(
    State(st): State<Arc<AppState>>,
    Path(id_slot): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let Some(dir) = st.config.slot_save_path.clone() else {
        return Err(ApiError::not_supported(
            "This server does not support slots action. Start it with `--slot-save-path`",
        ));
    };
    let id: usize = (id_slot.parse()).map_err(|_| ApiError::bad_request("Invalid slot ID"))?;
    let action = q.get("action").map_or("", String::as_str);
    if !["save", "restore", "erase"].contains(&action) {
        return Err(ApiError::bad_request("Invalid action"));
    }
    let req: Option<ParsedBody> = match body.is_empty() {
        true => None,
        false => Some(st.bodies.parse(body).await?),
    };
    let model = match (q.get("model"), &req) {
        (Some(m), _) => Some(m.as_str()),
        (None, Some(r)) => Fields(r).str("model")?,
        (None, None) => None,
    };
    let lease = st.registry.acquire(model).await?;
    let host = lease.host.clone();
    let n_slots = host.scheduler.config().n_slots.max(1);
    if id >= n_slots {
        return Err(ApiError::bad_request(format!(
            "Invalid slot ID: the server has {n_slots} slots (0 to {})",
            n_slots - 1
        )));
    }
    let t0 = Instant::now();
    let ms = || t0.elapsed().as_secs_f64() * 1e3;
    let body = match action {
        "erase" => {
            let n = (host.scheduler.erase_slot(id).await).map_err(|e| e.api_error())?;
            json!({"id_slot": id, "n_erased": n})
        }
        "save" => {
            let filename = filename(req.as_ref())?;
            let (n_saved, n_written) = save(host, id, dir.join(&filename)).await?;
            json!({
                "id_slot": id, "filename": filename, "n_saved": n_saved,
                "n_written": n_written, "timings": {"save_ms": ms()},
            })
        }
        _ => {
            let filename = filename(req.as_ref())?;
            let (n_restored, n_read) = restore(host, id, dir.join(&filename)).await?;
            json!({
                "id_slot": id, "filename": filename, "n_restored": n_restored,
                "n_read": n_read, "timings": {"restore_ms": ms()},
            })
        }
    };
    drop(lease);
    Ok(Json(body).into_response())
}

/// The body's `filename`: required, and a plain name inside the slot directory.
fn filename(req: Option<&ParsedBody>) -> Result<String, ApiError> {
    let name = match req {
        Some(r) => Fields(r).str("filename")?,
        None => None,
    };
    let name = name.ok_or_else(|| ApiError::bad_request("'filename' is required"))?;
    match slot_file::valid_filename(name) {
        true => Ok(name.to_string()),
        false => Err(ApiError::bad_request("Invalid filename")),
    }
}

/// What a slot file of `host` must match: its weights and how its K/V was computed.
fn identity(host: &ModelHost) -> Identity {
    Identity {
        model: slot_file::model_identity(host.model.gguf()),
        flash_attn: host.scheduler.config().kv_type.flash_attn(),
    }
}

/// Saves slot `id` to `path`; the tokens saved and the bytes written.
async fn save(host: Arc<ModelHost>, id: usize, path: PathBuf) -> Result<(usize, u64), ApiError> {
    let state = (host.scheduler.save_slot(id).await).map_err(|e| e.api_error())?;
    let n_saved = state.tokens.len();
    let n_written = blocking(move || {
        slot_file::write(&path, identity(&host), &state)
            .map_err(|e| ApiError::internal(format!("writing the slot save file: {e}")))
    })
    .await?;
    tracing::info!("slot {id}: saved {n_saved} tokens ({n_written} bytes)");
    Ok((n_saved, n_written))
}

/// Restores slot `id` from `path`; the tokens restored and the bytes read.
async fn restore(host: Arc<ModelHost>, id: usize, path: PathBuf) -> Result<(usize, u64), ApiError> {
    let h = host.clone();
    let (state, n_read) = blocking(move || read_checked(&h, &path)).await?;
    let n = (host.scheduler.restore_slot(id, state).await).map_err(|e| e.api_error())?;
    tracing::info!("slot {id}: restored {n} tokens ({n_read} bytes)");
    Ok((n, n_read))
}

/// Reads the slot file at `path` for `host`: checked against its identity, its slots' size
/// and its vocabulary.
fn read_checked(host: &ModelHost, path: &FsPath) -> Result<(slot_file::SlotState, u64), ApiError> {
    let (state, n_read) =
        slot_file::read(path, identity(host), host.n_ctx_slot()).map_err(|e| match e {
            SlotFileError::Io(e) if e.kind() == std::io::ErrorKind::NotFound => {
                ApiError::bad_request("the slot save file does not exist")
            }
            SlotFileError::Io(e) => ApiError::internal(format!("reading the slot save file: {e}")),
            e => ApiError::bad_request(e.to_string()),
        })?;
    let n_vocab = host.model.n_vocab();
    if let Some(t) = state.tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(ApiError::bad_request(format!(
            "invalid slot save file: token {t} is not in the vocabulary ({n_vocab})"
        )));
    }
    Ok((state, n_read))
}
