//! Which model answers a request: the single model of `-m`, or router mode over a directory
//! (`--models-dir`) where models load on first use and the least recently used one with no
//! request in flight is unloaded to stay within `--models-max`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{json, Value};

use crate::config::{ModelSource, ServerConfig};
use crate::error::{ApiError, ServerError};
use crate::host::ModelHost;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A model's name from its file: the file name without `.gguf` and without a split suffix
/// (`-00001-of-00003`).
pub fn model_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = strip_suffix_ci(&file, ".gguf").unwrap_or(&file);
    match split_suffix(stem) {
        Some((prefix, _, _)) => prefix.to_string(),
        None => stem.to_string(),
    }
}

fn strip_suffix_ci<'a>(s: &'a str, suffix: &str) -> Option<&'a str> {
    let n = s.len().checked_sub(suffix.len())?;
    (s.is_char_boundary(n) && s[n..].eq_ignore_ascii_case(suffix)).then(|| &s[..n])
}

/// `NAME-00001-of-00003` → (NAME, 1, 3).
fn split_suffix(stem: &str) -> Option<(&str, u32, u32)> {
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) {
        return None;
    }
    Some((prefix, no.parse().ok()?, count.parse().ok()?))
}

fn is_gguf(path: &Path) -> bool {
    let name = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    strip_suffix_ci(&name, ".gguf").is_some() && !name.to_ascii_lowercase().starts_with("mmproj")
}

/// The models of a directory: `*.gguf` files (a split set counts once, by its first shard) and
/// sub-directories holding one model (named after the sub-directory).
pub fn scan_models_dir(dir: &Path) -> std::io::Result<BTreeMap<String, PathBuf>> {
    let mut out = BTreeMap::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            let Ok(inner) = std::fs::read_dir(&path) else {
                continue;
            };
            let mut files: Vec<PathBuf> = inner
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && is_gguf(p))
                .collect();
            files.sort();
            let firsts: Vec<&PathBuf> = files.iter().filter(|p| first_shard_or_whole(p)).collect();
            if let ([only], Some(name)) = (firsts.as_slice(), path.file_name()) {
                out.entry(name.to_string_lossy().into_owned())
                    .or_insert_with(|| (*only).clone());
            }
        } else if is_gguf(&path) && first_shard_or_whole(&path) {
            out.entry(model_name(&path)).or_insert(path);
        }
    }
    Ok(out)
}

fn first_shard_or_whole(path: &Path) -> bool {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = strip_suffix_ci(&file, ".gguf").unwrap_or(&file);
    split_suffix(stem).is_none_or(|(_, no, _)| no == 1)
}

enum SingleState {
    Loading,
    Ready(Arc<ModelHost>),
    Failed(String),
}

struct Single {
    id: String,
    path: PathBuf,
    state: Mutex<SingleState>,
}

#[derive(Clone, Debug, PartialEq)]
enum Status {
    Unloaded,
    Loading,
    Loaded,
    Failed(String),
}

struct Entry {
    path: PathBuf,
    host: Option<Arc<ModelHost>>,
    last_used: u64,
    in_flight: usize,
    status: Status,
}

struct DirState {
    entries: BTreeMap<String, Entry>,
}

struct Dir {
    dir: PathBuf,
    max: usize,
    state: Mutex<DirState>,
    load_lock: tokio::sync::Mutex<()>,
    tick: AtomicU64,
}

enum Mode {
    Single(Single),
    Dir(Arc<Dir>),
}

/// The served models.
pub struct Registry {
    mode: Mode,
    config: Arc<ServerConfig>,
}

/// A model held for one request: while it lives, router mode will not unload the model.
pub struct Lease {
    /// The model.
    pub host: Arc<ModelHost>,
    dir: Option<(Arc<Dir>, String)>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some((dir, name)) = &self.dir {
            if let Some(e) = lock(&dir.state).entries.get_mut(name) {
                e.in_flight = e.in_flight.saturating_sub(1);
            }
        }
    }
}

impl Registry {
    /// The registry for `config.models` (nothing is loaded yet; see [`Registry::load_single`]).
    pub fn new(config: Arc<ServerConfig>) -> Result<Registry, ServerError> {
        let mode = match &config.models {
            ModelSource::File(path) => {
                let id = config
                    .alias
                    .first()
                    .cloned()
                    .unwrap_or_else(|| model_name(path));
                Mode::Single(Single {
                    id,
                    path: path.clone(),
                    state: Mutex::new(SingleState::Loading),
                })
            }
            ModelSource::Dir(dir) => {
                let found = scan_models_dir(dir).map_err(|e| {
                    ServerError::Config(format!("--models-dir {}: {e}", dir.display()))
                })?;
                if found.is_empty() {
                    tracing::warn!("no GGUF models in {}", dir.display());
                }
                let entries = found
                    .into_iter()
                    .map(|(name, path)| {
                        (
                            name,
                            Entry {
                                path,
                                host: None,
                                last_used: 0,
                                in_flight: 0,
                                status: Status::Unloaded,
                            },
                        )
                    })
                    .collect();
                Mode::Dir(Arc::new(Dir {
                    dir: dir.clone(),
                    max: config.models_max,
                    state: Mutex::new(DirState { entries }),
                    load_lock: tokio::sync::Mutex::new(()),
                    tick: AtomicU64::new(0),
                }))
            }
        };
        Ok(Registry { mode, config })
    }

    /// Single-model mode: loads the model (blocking). A no-op in router mode.
    pub fn load_single(&self) -> Result<(), ServerError> {
        let Mode::Single(s) = &self.mode else {
            return Ok(());
        };
        match ModelHost::load(s.id.clone(), &s.path, &self.config) {
            Ok(host) => {
                *lock(&s.state) = SingleState::Ready(Arc::new(host));
                Ok(())
            }
            Err(e) => {
                *lock(&s.state) = SingleState::Failed(e.to_string());
                Err(e)
            }
        }
    }

    /// Whether the server can answer (single mode: the model is loaded).
    pub fn health(&self) -> Result<(), ApiError> {
        match &self.mode {
            Mode::Single(s) => match &*lock(&s.state) {
                SingleState::Ready(_) => Ok(()),
                SingleState::Loading => Err(ApiError::unavailable("Loading model")),
                SingleState::Failed(e) => {
                    Err(ApiError::internal(format!("the model failed to load: {e}")))
                }
            },
            Mode::Dir(_) => Ok(()),
        }
    }

    /// The model for a request's `model` field (loading it in router mode).
    pub async fn acquire(&self, name: Option<&str>) -> Result<Lease, ApiError> {
        let name = name.filter(|n| !n.is_empty());
        match &self.mode {
            // One model answers whatever `model` a client sends (llama-server does the same);
            // responses carry the served name.
            Mode::Single(s) => match &*lock(&s.state) {
                SingleState::Ready(h) => Ok(Lease {
                    host: h.clone(),
                    dir: None,
                }),
                SingleState::Loading => Err(ApiError::unavailable("Loading model")),
                SingleState::Failed(e) => {
                    Err(ApiError::internal(format!("the model failed to load: {e}")))
                }
            },
            Mode::Dir(d) => {
                let Some(name) = name else {
                    return Err(ApiError::bad_request(
                        "'model' is required in router mode (see /v1/models)",
                    ));
                };
                self.acquire_dir(d, name).await
            }
        }
    }

    async fn acquire_dir(&self, d: &Arc<Dir>, name: &str) -> Result<Lease, ApiError> {
        loop {
            if let Some(lease) = Self::try_lease(d, name)? {
                return Ok(lease);
            }
            let _loading = d.load_lock.lock().await;
            if let Some(lease) = Self::try_lease(d, name)? {
                return Ok(lease);
            }
            let (path, evicted) = {
                let mut st = lock(&d.state);
                let loaded = st.entries.values().filter(|e| e.host.is_some()).count();
                let mut evicted = None;
                if d.max > 0 && loaded >= d.max {
                    let victim = st
                        .entries
                        .iter()
                        .filter(|(_, e)| e.host.is_some() && e.in_flight == 0)
                        .min_by_key(|(_, e)| e.last_used)
                        .map(|(k, _)| k.clone());
                    let Some(victim) = victim else {
                        return Err(ApiError::unavailable(
                            "model limit reached and every loaded model is busy, try again later",
                        ));
                    };
                    let e = st.entries.get_mut(&victim).expect("victim exists");
                    e.status = Status::Unloaded;
                    tracing::info!("unloading {victim} (least recently used) to load {name}");
                    evicted = e.host.take();
                }
                let e = st
                    .entries
                    .get_mut(name)
                    .ok_or_else(|| ApiError::bad_request(format!("model '{name}' not found")))?;
                e.status = Status::Loading;
                (e.path.clone(), evicted)
            };
            if let Some(h) = evicted {
                // Joining the model's worker thread blocks.
                let _ = tokio::task::spawn_blocking(move || drop(h)).await;
            }
            let config = self.config.clone();
            let id = name.to_string();
            let loaded =
                tokio::task::spawn_blocking(move || ModelHost::load(id, &path, &config)).await;
            let mut st = lock(&d.state);
            let e = st
                .entries
                .get_mut(name)
                .ok_or_else(|| ApiError::bad_request(format!("model '{name}' not found")))?;
            match loaded {
                Ok(Ok(host)) => {
                    e.host = Some(Arc::new(host));
                    e.status = Status::Loaded;
                }
                Ok(Err(err)) => {
                    e.status = Status::Failed(err.to_string());
                    return Err(ApiError::internal(format!(
                        "failed to load model '{name}': {err}"
                    )));
                }
                Err(join) => {
                    e.status = Status::Failed(join.to_string());
                    return Err(ApiError::internal(format!(
                        "failed to load model '{name}': {join}"
                    )));
                }
            }
        }
    }

    /// A lease on `name` if it is loaded; `Err` if there is no such model.
    fn try_lease(d: &Arc<Dir>, name: &str) -> Result<Option<Lease>, ApiError> {
        let mut st = lock(&d.state);
        if !st.entries.contains_key(name) {
            // A model may have been added since the last scan.
            if let Ok(found) = scan_models_dir(&d.dir) {
                for (n, path) in found {
                    st.entries.entry(n).or_insert(Entry {
                        path,
                        host: None,
                        last_used: 0,
                        in_flight: 0,
                        status: Status::Unloaded,
                    });
                }
            }
        }
        let Some(e) = st.entries.get_mut(name) else {
            return Err(ApiError::bad_request(format!(
                "model '{name}' not found (see /v1/models)"
            )));
        };
        let Some(host) = &e.host else { return Ok(None) };
        e.in_flight += 1;
        e.last_used = d.tick.fetch_add(1, Relaxed) + 1;
        Ok(Some(Lease {
            host: host.clone(),
            dir: Some((d.clone(), name.to_string())),
        }))
    }

    /// Router mode: unloads `name` now (400 if it has requests in flight or is not loaded).
    pub async fn unload(&self, name: &str) -> Result<(), ApiError> {
        let Mode::Dir(d) = &self.mode else {
            return Err(ApiError::not_supported(
                "unloading models needs router mode (--models-dir)",
            ));
        };
        let host = {
            let mut st = lock(&d.state);
            let e = st
                .entries
                .get_mut(name)
                .ok_or_else(|| ApiError::bad_request(format!("model '{name}' not found")))?;
            if e.in_flight > 0 {
                return Err(ApiError::bad_request(format!(
                    "model '{name}' has requests in flight"
                )));
            }
            e.status = Status::Unloaded;
            e.host
                .take()
                .ok_or_else(|| ApiError::bad_request(format!("model '{name}' is not loaded")))?
        };
        let _ = tokio::task::spawn_blocking(move || drop(host)).await;
        Ok(())
    }

    /// Whether this is router mode.
    pub fn is_router(&self) -> bool {
        matches!(self.mode, Mode::Dir(_))
    }

    /// The loaded models.
    pub fn loaded(&self) -> Vec<Arc<ModelHost>> {
        match &self.mode {
            Mode::Single(s) => match &*lock(&s.state) {
                SingleState::Ready(h) => vec![h.clone()],
                _ => Vec::new(),
            },
            Mode::Dir(d) => lock(&d.state)
                .entries
                .values()
                .filter_map(|e| e.host.clone())
                .collect(),
        }
    }

    /// The `data` of `/v1/models`.
    pub fn list(&self) -> Vec<Value> {
        match &self.mode {
            Mode::Single(s) => {
                let (created, meta) = match &*lock(&s.state) {
                    SingleState::Ready(h) => (h.created, h.meta()),
                    _ => (0, Value::Null),
                };
                vec![
                    json!({"id": s.id, "object": "model", "created": created, "owned_by": "hmoe", "meta": meta}),
                ]
            }
            Mode::Dir(d) => lock(&d.state)
                .entries
                .iter()
                .map(|(name, e)| {
                    let status = match &e.status {
                        Status::Unloaded => json!({"value": "unloaded"}),
                        Status::Loading => json!({"value": "loading"}),
                        Status::Loaded => json!({"value": "loaded"}),
                        Status::Failed(m) => {
                            json!({"value": "unloaded", "failed": true, "message": m})
                        }
                    };
                    let (created, meta) = e
                        .host
                        .as_ref()
                        .map_or((0, Value::Null), |h| (h.created, h.meta()));
                    json!({"id": name, "object": "model", "created": created, "owned_by": "hmoe",
                           "path": e.path.display().to_string(), "status": status, "meta": meta})
                })
                .collect(),
        }
    }

    /// Stops every model's slots (running requests fail, so streams end).
    pub fn shutdown(&self) {
        for h in self.loaded() {
            h.scheduler.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_from_files() {
        assert_eq!(model_name(Path::new("/m/gpt-oss-20b.gguf")), "gpt-oss-20b");
        assert_eq!(
            model_name(Path::new("/m/gpt-oss-120b-mxfp4-00001-of-00003.gguf")),
            "gpt-oss-120b-mxfp4"
        );
        assert_eq!(model_name(Path::new("x-1-of-2.GGUF")), "x-1-of-2");
        assert_eq!(split_suffix("a-00002-of-00003"), Some(("a", 2, 3)));
        assert!(first_shard_or_whole(Path::new("a-00001-of-00003.gguf")));
        assert!(!first_shard_or_whole(Path::new("a-00002-of-00003.gguf")));
        assert!(!is_gguf(Path::new("mmproj-x.gguf")));
    }

    #[test]
    fn scans_directories() {
        let dir = std::env::temp_dir().join(format!("hmoe-scan-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        for f in [
            "a.gguf",
            "b-00001-of-00002.gguf",
            "b-00002-of-00002.gguf",
            "notes.txt",
            "sub/model.gguf",
            "sub/mmproj-f16.gguf",
        ] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let found = scan_models_dir(&dir).unwrap();
        assert_eq!(found.keys().collect::<Vec<_>>(), vec!["a", "b", "sub"]);
        assert!(found["b"].ends_with("b-00001-of-00002.gguf"));
        assert!(found["sub"].ends_with("sub/model.gguf"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
