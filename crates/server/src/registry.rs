//! Which model answers a request: the single model of `-m`, or router mode over a directory
//! (`--models-dir`) where models load on first use and the least recently used one with no
//! request in flight is unloaded to stay within `--models-max`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hmoe_gguf::GgufModel;

use serde_json::{json, Value};

use crate::config::{ModelPreset, ModelSource, ServerConfig};
use crate::error::{ApiError, ServerError};
use crate::model_files::{model_name, scan_models_dir};
use crate::model_host::{open_gguf, ModelHost, Prepared};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

enum SingleState {
    Loading,
    Ready(Arc<ModelHost>),
    Failed(String),
    /// Unloaded after `--sleep-idle-seconds` without a request; the next one loads it again.
    Sleeping,
}

struct Single {
    id: String,
    path: PathBuf,
    /// The file, opened (and its tables checked) before the server listens.
    opened: Mutex<Option<Box<GgufModel>>>,
    state: Mutex<SingleState>,
    /// When a request last took or released the model (for `--sleep-idle-seconds`).
    last_active: Arc<Mutex<Instant>>,
    /// Held by the request that wakes a sleeping model; the others wait for it.
    wake: tokio::sync::Mutex<()>,
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
    /// What it loads with: the server's configuration with its preset's settings.
    config: Arc<ServerConfig>,
    /// Its preset's aliases and flags.
    aliases: Vec<String>,
    args: Vec<String>,
    /// `models_dir` or `preset` (a model of the preset file only), as llama-server says.
    source: &'static str,
}

impl Entry {
    fn new(path: PathBuf, config: Arc<ServerConfig>, preset: Option<&ModelPreset>) -> Entry {
        Entry {
            source: match preset.and_then(|p| p.path.as_ref()) {
                Some(_) => "preset",
                None => "models_dir",
            },
            path,
            host: None,
            last_used: 0,
            in_flight: 0,
            status: Status::Unloaded,
            config,
            aliases: preset.map(|p| p.aliases.clone()).unwrap_or_default(),
            args: preset.map(|p| p.args.clone()).unwrap_or_default(),
        }
    }
}

struct DirState {
    entries: BTreeMap<String, Entry>,
    /// Alias → model name.
    aliases: BTreeMap<String, String>,
    /// The server's configuration with the presets these entries were made with (a model
    /// found later gets its `preset_default`).
    config: Arc<ServerConfig>,
}

impl DirState {
    /// The model `name` names: a model's name or one of its aliases.
    fn resolve(&self, name: &str) -> Option<String> {
        if self.entries.contains_key(name) {
            return Some(name.to_string());
        }
        self.aliases.get(name).cloned()
    }
}

/// The configuration a model loads with: the server's, with `preset`'s engine, chat and
/// loader.
fn model_config(base: &Arc<ServerConfig>, preset: Option<&ModelPreset>) -> Arc<ServerConfig> {
    match preset {
        None => base.clone(),
        Some(p) => {
            let mut c = (**base).clone();
            c.engine = p.engine.clone();
            c.chat = p.chat.clone();
            c.loader = p.loader.clone();
            Arc::new(c)
        }
    }
}

/// Router mode's models: the directory's, each with its preset (or the default one), and the
/// preset file's models with a `model` path of their own. A preset that names no model, a
/// missing file, or a name or alias given twice is an error.
fn dir_state(dir: &Path, config: &Arc<ServerConfig>) -> Result<DirState, ServerError> {
    let found = scan_models_dir(dir)
        .map_err(|e| ServerError::Config(format!("--models-dir {}: {e}", dir.display())))?;
    if found.is_empty() && config.presets.is_empty() {
        tracing::warn!("no GGUF models in {}", dir.display());
    }
    let default = model_config(config, config.preset_default.as_ref());
    let mut entries = BTreeMap::new();
    for (name, path) in found {
        let entry = match config.presets.get(&name) {
            Some(p) if p.path.is_none() => Entry::new(path, model_config(config, Some(p)), Some(p)),
            _ => Entry::new(path, default.clone(), config.preset_default.as_ref()),
        };
        entries.insert(name, entry);
    }
    for (name, p) in &config.presets {
        let bad = |why: String| ServerError::Config(format!("--models-preset [{name}]: {why}"));
        match &p.path {
            Some(path) => {
                if !path.is_file() {
                    return Err(bad(format!(
                        "model file {} is not a regular file (or does not exist)",
                        path.display()
                    )));
                }
                let e = Entry::new(path.clone(), model_config(config, Some(p)), Some(p));
                entries.insert(name.clone(), e);
            }
            None if !entries.contains_key(name) => {
                return Err(bad(format!(
                    "no model of that name in {} and no `model` key giving its file",
                    dir.display()
                )))
            }
            None => {}
        }
    }
    let mut aliases = BTreeMap::new();
    for (name, e) in &entries {
        for a in &e.aliases {
            if entries.contains_key(a) {
                return Err(ServerError::Config(format!(
                    "alias '{a}' of model '{name}' is the name of another model"
                )));
            }
            if let Some(other) = aliases.insert(a.clone(), name.clone()) {
                return Err(ServerError::Config(format!(
                    "alias '{a}' is given to both '{other}' and '{name}'"
                )));
            }
        }
    }
    Ok(DirState {
        entries,
        aliases,
        config: config.clone(),
    })
}

struct Dir {
    dir: PathBuf,
    max: usize,
    state: Mutex<DirState>,
    load_lock: tokio::sync::Mutex<()>,
    tick: AtomicU64,
    /// Signalled when a lease ends or a model is unloaded (waiting requests look again).
    released: tokio::sync::Notify,
    /// Requests waiting for a busy model to be released.
    waiters: AtomicUsize,
}

/// A place among the requests waiting for a model (released on drop).
struct WaitTicket(Arc<Dir>);

impl WaitTicket {
    /// A place, if fewer than `max` requests wait.
    fn take(d: &Arc<Dir>, max: usize) -> Option<WaitTicket> {
        d.waiters
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| WaitTicket(d.clone()))
    }
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Relaxed);
    }
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
    /// Single-model mode: when a request last held the model, set on release.
    active: Option<Arc<Mutex<Instant>>>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(a) = &self.active {
            *lock(a) = Instant::now();
        }
        if let Some((dir, name)) = &self.dir {
            if let Some(e) = lock(&dir.state).entries.get_mut(name) {
                e.in_flight = e.in_flight.saturating_sub(1);
            }
            dir.released.notify_waiters();
        }
    }
}

impl Registry {
    /// The registry for `config.models`. A single model's file is opened and its tables
    /// checked now (an error names the file); nothing is loaded yet (see
    /// [`Registry::load_single`]).
    pub fn new(config: Arc<ServerConfig>) -> Result<Registry, ServerError> {
        let mode = match &config.models {
            ModelSource::File(path) => {
                // llama-server keeps the aliases in a sorted set: the first of it is the id.
                let id = (config.alias.iter().min())
                    .cloned()
                    .unwrap_or_else(|| model_name(path));
                let opened = open_gguf(path, &config)?;
                Mode::Single(Single {
                    id,
                    path: path.clone(),
                    opened: Mutex::new(Some(Box::new(opened))),
                    state: Mutex::new(SingleState::Loading),
                    last_active: Arc::new(Mutex::new(Instant::now())),
                    wake: tokio::sync::Mutex::new(()),
                })
            }
            ModelSource::Dir(dir) => {
                let state = dir_state(dir, &config)?;
                Mode::Dir(Arc::new(Dir {
                    dir: dir.clone(),
                    max: config.models_max,
                    state: Mutex::new(state),
                    load_lock: tokio::sync::Mutex::new(()),
                    tick: AtomicU64::new(0),
                    released: tokio::sync::Notify::new(),
                    waiters: AtomicUsize::new(0),
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
        let opened = lock(&s.opened).take();
        let loaded = match opened {
            Some(gguf) => Prepared::new(*gguf, &s.path, &self.config)
                .and_then(|p| p.start(s.id.clone(), &self.config)),
            None => ModelHost::load(s.id.clone(), &s.path, &self.config),
        };
        match loaded {
            Ok(host) => {
                *lock(&s.state) = SingleState::Ready(Arc::new(host));
                if let Some(ready) = &self.config.on_ready {
                    ready();
                }
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
                SingleState::Ready(_) | SingleState::Sleeping => Ok(()),
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
            Mode::Single(s) => loop {
                match &*lock(&s.state) {
                    SingleState::Ready(h) => {
                        *lock(&s.last_active) = Instant::now();
                        return Ok(Lease {
                            host: h.clone(),
                            dir: None,
                            active: Some(s.last_active.clone()),
                        });
                    }
                    SingleState::Loading => return Err(ApiError::unavailable("Loading model")),
                    SingleState::Failed(e) => {
                        return Err(ApiError::internal(format!("the model failed to load: {e}")))
                    }
                    SingleState::Sleeping => {}
                }
                self.wake(s).await?;
            },
            Mode::Dir(d) => {
                let Some(name) = name else {
                    return Err(ApiError::bad_request(
                        "'model' is required in router mode (see /v1/models)",
                    ));
                };
                self.acquire_dir(d, name, self.config.models_autoload).await
            }
        }
    }

    /// Loads a sleeping single model again (one request does; the others wait for it and
    /// then find it ready). A failure leaves it sleeping, for the next request to try.
    async fn wake(&self, s: &Single) -> Result<(), ApiError> {
        let _waking = s.wake.lock().await;
        if !matches!(*lock(&s.state), SingleState::Sleeping) {
            return Ok(());
        }
        tracing::info!("{}: waking up: loading the model again", s.id);
        let (id, path, config) = (s.id.clone(), s.path.clone(), self.config.clone());
        let loaded = tokio::task::spawn_blocking(move || ModelHost::load(id, &path, &config))
            .await
            .map_err(|e| ApiError::internal(format!("loading the model stopped: {e}")))?;
        let host = loaded.map_err(|e| ApiError::internal(format!("waking the model: {e}")))?;
        *lock(&s.last_active) = Instant::now();
        *lock(&s.state) = SingleState::Ready(Arc::new(host));
        Ok(())
    }

    /// Single-model mode with `--sleep-idle-seconds`: unloads the model if no request has held
    /// it for `idle` and none holds it now. Called periodically.
    pub async fn sleep_if_idle(&self, idle: Duration) {
        let Mode::Single(s) = &self.mode else {
            return;
        };
        let host = {
            let mut state = lock(&s.state);
            let SingleState::Ready(h) = &*state else {
                return;
            };
            // Held (by a request, or a moment by /metrics or /props): not idle.
            if Arc::strong_count(h) > 1 || lock(&s.last_active).elapsed() < idle {
                return;
            }
            std::mem::replace(&mut *state, SingleState::Sleeping)
        };
        tracing::info!(
            "{}: sleeping after {} s without a request: model unloaded",
            s.id,
            idle.as_secs()
        );
        // Joining the model's worker thread blocks.
        let _ = tokio::task::spawn_blocking(move || drop(host)).await;
    }

    /// Whether the single model sleeps (`--sleep-idle-seconds`).
    pub fn is_sleeping(&self) -> bool {
        match &self.mode {
            Mode::Single(s) => matches!(*lock(&s.state), SingleState::Sleeping),
            Mode::Dir(_) => false,
        }
    }

    /// Router mode: loads `name` (`POST /models/load`, whatever `--no-models-autoload` says),
    /// unloading the least recently used idle model beyond `--models-max`. A model already
    /// loaded is a 400, as in llama-server.
    pub async fn load(&self, name: &str) -> Result<(), ApiError> {
        let Mode::Dir(d) = &self.mode else {
            return Err(ApiError::not_supported(
                "loading models needs router mode (--models-dir)",
            ));
        };
        {
            let st = lock(&d.state);
            let canonical = st.resolve(name);
            if let Some(e) = canonical.as_ref().and_then(|n| st.entries.get(n)) {
                if e.host.is_some() {
                    return Err(ApiError::bad_request(format!(
                        "model '{name}' is already loaded"
                    )));
                }
            }
        }
        drop(self.acquire_dir(d, name, true).await?);
        Ok(())
    }

    /// Router mode: a lease on `name`, loading it when needed. When `--models-max` models are
    /// loaded and every one has requests in flight, the request waits (at most `--timeout`, with
    /// at most `--max-queue` others) until one is released.
    async fn acquire_dir(
        &self,
        d: &Arc<Dir>,
        name: &str,
        autoload: bool,
    ) -> Result<Lease, ApiError> {
        let limits = &self.config.limits;
        let deadline = Instant::now() + limits.timeout;
        let mut ticket: Option<WaitTicket> = None;
        loop {
            if let Some(lease) = self.try_lease(d, name)? {
                return Ok(lease);
            }
            // Made before looking, so that a release in between still wakes this request.
            let released = d.released.notified();
            {
                // A model being loaded holds the lock: a request for it waits here.
                let _loading = d.load_lock.lock().await;
                if let Some(lease) = self.try_lease(d, name)? {
                    return Ok(lease);
                }
                if !autoload {
                    return Err(ApiError::bad_request(format!(
                        "model '{name}' is not loaded (--no-models-autoload: load it with POST /models/load)"
                    )));
                }
                if self.load_into(d, name).await? {
                    continue;
                }
            }
            if ticket.is_none() {
                ticket = Some(WaitTicket::take(d, self.config.engine.max_queue).ok_or_else(
                    || {
                        ApiError::unavailable(
                            "every loaded model is busy and the queue for models is full, try again later",
                        )
                    },
                )?);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ApiError::unavailable(format!(
                    "model limit reached and every loaded model stayed busy for {} s (--timeout), try again later",
                    limits.timeout.as_secs()
                )));
            }
            // A release notifies; the poll interval covers one that came before `released`
            // was first polled.
            let wait = (deadline - now).min(Duration::from_millis(250));
            let _ = tokio::time::timeout(wait, released).await;
        }
    }

    /// The least recently used loaded model with no request in flight, if the limit needs one
    /// unloaded to load another; `Ok(None)` when there is room; `Err(())` when every loaded
    /// model is busy.
    fn victim(d: &Dir, st: &DirState) -> Result<Option<String>, ()> {
        let loaded = st.entries.values().filter(|e| e.host.is_some()).count();
        if d.max == 0 || loaded < d.max {
            return Ok(None);
        }
        st.entries
            .iter()
            .filter(|(_, e)| e.host.is_some() && e.in_flight == 0)
            .min_by_key(|(_, e)| e.last_used)
            .map(|(k, _)| Some(k.clone()))
            .ok_or(())
    }

    /// Loads `name` (holding `load_lock`): `Ok(false)` when the limit is reached and every
    /// loaded model is busy. The model is prepared (file, tokenizer, template checked) before
    /// anything is unloaded for it, so a model that fails to load evicts nothing.
    async fn load_into(&self, d: &Arc<Dir>, name: &str) -> Result<bool, ApiError> {
        let (name, path, config) = {
            let mut st = lock(&d.state);
            if Self::victim(d, &st).is_err() {
                return Ok(false);
            }
            let canonical = st.resolve(name);
            let e = (canonical.as_ref())
                .and_then(|n| st.entries.get_mut(n))
                .ok_or_else(|| ApiError::bad_request(format!("model '{name}' not found")))?;
            e.status = Status::Loading;
            (
                canonical.unwrap_or_default(),
                e.path.clone(),
                e.config.clone(),
            )
        };
        let name = name.as_str();
        let fail = |message: String| {
            if let Some(e) = lock(&d.state).entries.get_mut(name) {
                e.status = Status::Failed(message.clone());
            }
            ApiError::internal(format!("failed to load model '{name}': {message}"))
        };
        let model_config = config.clone();
        let prepared = tokio::task::spawn_blocking(move || {
            let gguf = open_gguf(&path, &model_config)?;
            Prepared::new(gguf, &path, &model_config)
        })
        .await;
        let prepared = match prepared {
            Ok(Ok(p)) => p,
            Ok(Err(err)) => return Err(fail(err.to_string())),
            Err(join) => return Err(fail(join.to_string())),
        };
        let evicted = {
            let mut st = lock(&d.state);
            match Self::victim(d, &st) {
                Ok(None) => None,
                Ok(Some(victim)) => {
                    tracing::info!("unloading {victim} (least recently used) to load {name}");
                    st.entries.get_mut(&victim).and_then(|e| {
                        e.status = Status::Unloaded;
                        e.host.take()
                    })
                }
                Err(()) => {
                    // A request took the idle model meanwhile.
                    if let Some(e) = st.entries.get_mut(name) {
                        e.status = Status::Unloaded;
                    }
                    return Ok(false);
                }
            }
        };
        if let Some(h) = evicted {
            // Joining the model's worker thread blocks.
            let _ = tokio::task::spawn_blocking(move || drop(h)).await;
        }
        let id = name.to_string();
        let started = tokio::task::spawn_blocking(move || prepared.start(id, &config)).await;
        let host = match started {
            Ok(Ok(h)) => h,
            Ok(Err(err)) => return Err(fail(err.to_string())),
            Err(join) => return Err(fail(join.to_string())),
        };
        let mut st = lock(&d.state);
        let e = st
            .entries
            .get_mut(name)
            .ok_or_else(|| ApiError::bad_request(format!("model '{name}' not found")))?;
        e.host = Some(Arc::new(host));
        e.status = Status::Loaded;
        Ok(true)
    }

    /// A lease on `name` if it is loaded; `Err` if there is no such model.
    fn try_lease(&self, d: &Arc<Dir>, name: &str) -> Result<Option<Lease>, ApiError> {
        let mut st = lock(&d.state);
        if st.resolve(name).is_none() {
            // A model may have been added since the last scan.
            if let Ok(found) = scan_models_dir(&d.dir) {
                let base = st.config.clone();
                let preset = base.preset_default.as_ref();
                let config = model_config(&base, preset);
                for (n, path) in found {
                    if !st.aliases.contains_key(&n) {
                        (st.entries.entry(n))
                            .or_insert_with(|| Entry::new(path, config.clone(), preset));
                    }
                }
            }
        }
        let canonical = st.resolve(name);
        let Some(e) = canonical.as_ref().and_then(|n| st.entries.get_mut(n)) else {
            return Err(ApiError::bad_request(format!(
                "model '{name}' not found (see /v1/models)"
            )));
        };
        let Some(host) = &e.host else { return Ok(None) };
        e.in_flight += 1;
        e.last_used = d.tick.fetch_add(1, Relaxed) + 1;
        Ok(Some(Lease {
            host: host.clone(),
            dir: Some((d.clone(), canonical.unwrap_or_default())),
            active: None,
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
            let canonical = st.resolve(name);
            let e = (canonical.as_ref())
                .and_then(|n| st.entries.get_mut(n))
                .ok_or_else(|| ApiError::bad_request(format!("model '{name}' not found")))?;
            if e.in_flight > 0 {
                return Err(ApiError::bad_request(format!(
                    "model '{name}' has requests in flight"
                )));
            }
            let Some(host) = e.host.take() else {
                return Err(ApiError::bad_request(match e.status {
                    Status::Loading => format!("model '{name}' is still loading"),
                    _ => format!("model '{name}' is not loaded"),
                }));
            };
            e.status = Status::Unloaded;
            host
        };
        let _ = tokio::task::spawn_blocking(move || drop(host)).await;
        d.released.notify_waiters();
        Ok(())
    }

    /// Router mode: reads the preset file again (with `--models-preset`) and scans the
    /// directory, as `GET /models?reload=1` asks. A model whose file, flags and aliases are
    /// unchanged keeps its state (a loaded one stays loaded); one that is gone or changed is
    /// replaced by the new list's (a loaded one is unloaded, its requests in flight finish on
    /// it); new ones are added unloaded. A preset file that no longer reads, or names a missing
    /// file, is an error and the list stays as it was. It waits for a load in progress.
    pub async fn reload(&self) -> Result<(), ApiError> {
        let Mode::Dir(d) = &self.mode else {
            return Ok(());
        };
        let _loading = d.load_lock.lock().await;
        let (base, dir) = (self.config.clone(), d.dir.clone());
        let fresh = tokio::task::spawn_blocking(move || {
            let mut config = (*base).clone();
            if let Some(read) = &base.preset_reader {
                let (presets, default) = read().map_err(ApiError::internal)?;
                config.presets = presets;
                config.preset_default = default;
            }
            dir_state(&dir, &Arc::new(config)).map_err(|e| ApiError::internal(e.to_string()))
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
        let dropped: Vec<Arc<ModelHost>> = {
            let mut st = lock(&d.state);
            let old = std::mem::replace(&mut *st, fresh);
            let mut dropped = Vec::new();
            for (name, prev) in old.entries {
                match st.entries.get_mut(&name) {
                    Some(e)
                        if e.path == prev.path
                            && e.args == prev.args
                            && e.aliases == prev.aliases =>
                    {
                        *e = prev;
                    }
                    Some(e) => {
                        // Its leases still end on this name: it counts as busy until they do.
                        e.in_flight = prev.in_flight;
                        dropped.extend(prev.host);
                    }
                    None => dropped.extend(prev.host),
                }
            }
            dropped
        };
        let _ = tokio::task::spawn_blocking(move || drop(dropped)).await;
        d.released.notify_waiters();
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

    /// The `data` of `/v1/models`; with `full` false (a client without the API key) router
    /// mode lists names and status only: no file paths, sizes or load errors.
    pub fn list(&self, full: bool) -> Vec<Value> {
        match &self.mode {
            Mode::Single(s) => {
                let (created, meta) = match &*lock(&s.state) {
                    SingleState::Ready(h) => (h.created, h.meta()),
                    _ => (0, Value::Null),
                };
                let sorted = |v: &[String]| -> Vec<String> {
                    let set: std::collections::BTreeSet<&String> = v.iter().collect();
                    set.into_iter().cloned().collect()
                };
                vec![json!({"id": s.id, "aliases": sorted(&self.config.alias),
                            "tags": sorted(&self.config.tags), "object": "model",
                            "created": created, "owned_by": "hmoe", "meta": meta})]
            }
            Mode::Dir(d) => (lock(&d.state).entries.iter())
                .map(|(name, e)| Self::list_entry(name, e, full))
                .collect(),
        }
    }

    /// One model of router mode's `/v1/models`, with llama-server's fields (`aliases`,
    /// `tags`, `status` with `value` and `args`, `source`). Without the key: names and status.
    fn list_entry(name: &str, e: &Entry, full: bool) -> Value {
        let value = match &e.status {
            Status::Loading => "loading",
            Status::Loaded => "loaded",
            Status::Unloaded | Status::Failed(_) => "unloaded",
        };
        if !full {
            return json!({"id": name, "aliases": e.aliases, "object": "model",
                          "owned_by": "hmoe", "status": {"value": value}});
        }
        let mut status = json!({"value": value, "args": e.args});
        if let Status::Failed(m) = &e.status {
            status["failed"] = true.into();
            status["message"] = m.clone().into();
        }
        let (created, meta) = (e.host.as_ref()).map_or((0, Value::Null), |h| (h.created, h.meta()));
        json!({"id": name, "aliases": e.aliases, "tags": [], "object": "model",
               "created": created, "owned_by": "hmoe", "path": e.path.display().to_string(),
               "source": e.source, "status": status, "meta": meta})
    }

    /// `/props` in router mode (without `?model=`): the router's settings.
    pub fn router_props(&self) -> Value {
        let Mode::Dir(d) = &self.mode else {
            return json!({});
        };
        let st = lock(&d.state);
        let loaded: Vec<&String> = st
            .entries
            .iter()
            .filter(|(_, e)| e.host.is_some())
            .map(|(k, _)| k)
            .collect();
        let l = &self.config.limits;
        json!({
            "role": "router",
            "max_instances": d.max,
            "models_autoload": self.config.models_autoload,
            "model_path": "none",
            "total_models": st.entries.len(),
            "loaded_models": loaded,
            "models_max": d.max,
            "max_queue": self.config.engine.max_queue,
            "waiting": d.waiters.load(Relaxed),
            "timeout": l.timeout.as_secs(),
            "n_parallel": self.config.engine.n_parallel,
            "n_ctx": self.config.engine.n_ctx,
        })
    }

    /// Stops every model's slots (running requests fail, so streams end).
    pub fn shutdown(&self) {
        for h in self.loaded() {
            h.scheduler.shutdown();
        }
    }
}
