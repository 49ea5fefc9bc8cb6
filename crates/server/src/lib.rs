//! `hmoe serve`: an OpenAI-compatible HTTP server with llama-server's routes and flags.
//!
//! * Routes: `/health`, `/v1/models`, `/v1/chat/completions`, `/v1/completions`,
//!   `/completion`, `/tokenize`, `/detokenize`, `/apply-template`, `/props`, `/slots`
//!   (and `POST /slots/{id}` with `--slot-save-path`, [`slot_actions`]),
//!   `/metrics`, with `--embedding` `/embedding(s)` and `/v1/embeddings` ([`embeddings`]),
//!   with `--reranking` `/rerank` ([`rerank`]), and in router mode `/models/load`,
//!   `/models/unload` and `DELETE /models/{name}` (see [`api`]).
//! * Each model runs `n_parallel` slots on one worker thread with continuous batching
//!   ([`scheduler`]); requests beyond the slots wait in a bounded queue, then get 503.
//! * gpt-oss output is split by harmony channel into `content`, `reasoning_content` and
//!   `tool_calls` ([`output`]), per `--reasoning-format`.
//! * With `--sleep-idle-seconds`, the single model is unloaded after that long without a
//!   request and loaded again by the next one ([`registry::Registry::sleep_if_idle`]).
//! * Router mode serves every GGUF of a directory, loading on demand and unloading the least
//!   recently used idle model beyond `--models-max` ([`registry`]).
//!
//! ```no_run
//! use hmoe_server::{ModelSource, RunningServer, ServerConfig};
//! let mut config = ServerConfig::new(ModelSource::File("model.gguf".into()));
//! config.port = 0; // any free port
//! let server = RunningServer::start(config).unwrap();
//! println!("listening on {}", server.local_addr());
//! server.wait().unwrap();
//! ```
#![warn(missing_docs)]

pub mod anthropic;
pub mod api;
pub mod chat_format;
pub mod chat_messages;
pub mod chat_render;
pub mod config;
pub mod conn;
pub mod content_blocks;
pub mod embeddings;
pub mod error;
pub mod guard;
pub mod id_arrays;
pub mod loader;
pub mod metrics;
pub mod model_files;
pub mod model_host;
pub mod multi;
pub mod oai;
pub mod output;
pub mod params;
pub mod parsed_body;
pub mod pieces;
pub mod plain_content;
pub mod pooling;
pub mod registry;
pub mod request_log;
pub mod rerank;
pub mod responses;
pub mod sampling;
pub mod scheduler;
pub mod slot_actions;
pub mod slot_file;
pub mod state;
pub mod webui;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::{oneshot, watch};

pub use config::{
    ChatConfig, EngineConfig, Limits, ModelPreset, ModelSource, PresetReader, SamplingDefaults,
    ServerConfig,
};
pub use error::{ApiError, ServerError};
pub use loader::{cpu_loader, DevicePlacement, LoadedModel, ModelLoader, Placement};
pub use sampling::{PickerFactory, TokenPicker};

/// How long a stopping server waits for open responses to end (generations are stopped at
/// once, so what remains is mostly bytes in flight).
const DRAIN: Duration = Duration::from_secs(1);

/// How long a stopping server then waits for work on blocking threads (a body being parsed, a
/// prompt tokenized, a model loading) and for the models' workers to end, before it returns
/// and leaves them to finish on their own: a stop (SIGTERM) takes at most about
/// `DRAIN + 2 × LINGER`, whatever the load.
const LINGER: Duration = Duration::from_millis(300);

/// How often `--sleep-idle-seconds` looks whether the model has been idle long enough.
const SLEEP_POLL: Duration = Duration::from_millis(100);

/// A server running on its own thread (with its own async runtime).
pub struct RunningServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
}

impl RunningServer {
    /// Checks the configuration (an empty API key is an error) and, in single-model mode, opens
    /// the model file; then binds `config.host:config.port` and serves, the model loading in
    /// the background (`/health` answers 503 until it is ready). Returns once the socket
    /// listens, or with the first error before anything listens.
    pub fn start(config: ServerConfig) -> Result<RunningServer, ServerError> {
        Self::spawn(config, false)
    }

    /// Like [`RunningServer::start`], and also stops on SIGINT/SIGTERM (for the CLI).
    pub fn start_with_signals(config: ServerConfig) -> Result<RunningServer, ServerError> {
        Self::spawn(config, true)
    }

    fn spawn(config: ServerConfig, signals: bool) -> Result<RunningServer, ServerError> {
        /// The blocking pool's threads at most (tokio's default is 512); requests beyond
        /// them wait for one, within the parse budget's and `--timeout`'s bounds.
        const BLOCKING_THREADS: usize = 64;
        validate(&config)?;
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("hmoe-http".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    // Parsing, tokenizing, rendering and model loads run on the blocking
                    // pool: at most BLOCKING_THREADS of them, each gone after 2 s idle.
                    .max_blocking_threads(BLOCKING_THREADS)
                    .thread_keep_alive(std::time::Duration::from_secs(2))
                    .thread_name("hmoe-http")
                    .enable_all()
                    .build()?;
                let served = rt.block_on(async move {
                    let registry = match registry::Registry::new(Arc::new(config.clone())) {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = addr_tx.send(Err(e));
                            return Ok(());
                        }
                    };
                    let addr = format!("{}:{}", config.host, config.port);
                    let listener = match tokio::net::TcpListener::bind(&addr).await {
                        Ok(l) => l,
                        Err(source) => {
                            let _ = addr_tx.send(Err(ServerError::Bind {
                                addr: addr.clone(),
                                source,
                            }));
                            return Ok(());
                        }
                    };
                    let local = listener.local_addr()?;
                    let _ = addr_tx.send(Ok(local));
                    serve(listener, config, registry, stop_rx, signals).await
                });
                rt.shutdown_timeout(LINGER);
                served
            })?;
        let addr = addr_rx.recv().map_err(|_| {
            ServerError::Config("the server thread stopped before listening".into())
        })??;
        Ok(RunningServer {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Blocks until the server stops by itself (a signal, or the model failing to load).
    pub fn wait(mut self) -> Result<(), ServerError> {
        self.join()
    }

    /// Stops the server and waits for it.
    pub fn stop(mut self) -> Result<(), ServerError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.join()
    }

    fn join(&mut self) -> Result<(), ServerError> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| ServerError::Config("the server thread panicked".into()))?,
            None => Ok(()),
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.join();
    }
}

/// Settings no server can run with.
fn validate(config: &ServerConfig) -> Result<(), ServerError> {
    if config.api_keys.iter().any(|k| k.trim().is_empty()) {
        return Err(ServerError::Config(
            "an API key is empty (--api-key \"\" or a blank --api-key-file): an empty key does not mean no authentication; leave the flag out for none".into(),
        ));
    }
    if config.engine.n_parallel == 0 {
        return Err(ServerError::Config("--parallel must be at least 1".into()));
    }
    let l = &config.limits;
    if l.max_connections == 0 || l.max_body == 0 || l.parse_budget == 0 {
        return Err(ServerError::Config(
            "--max-connections, --parse-budget and the body limit must be at least 1".into(),
        ));
    }
    if l.header_timeout.is_zero() || l.timeout.is_zero() {
        return Err(ServerError::Config(
            "--timeout and --header-timeout must be at least 1 second".into(),
        ));
    }
    if let Some(dir) = config.slot_save_path.as_ref().filter(|d| !d.is_dir()) {
        return Err(ServerError::Config(format!(
            "--slot-save-path {}: not a directory",
            dir.display()
        )));
    }
    Ok(())
}

async fn wait_signal(signals: bool) {
    if !signals {
        return std::future::pending().await;
    }
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn serve(
    listener: tokio::net::TcpListener,
    config: ServerConfig,
    registry: registry::Registry,
    stop: oneshot::Receiver<()>,
    signals: bool,
) -> Result<(), ServerError> {
    let state = Arc::new(state::AppState {
        bodies: parsed_body::ParseBudget::new(config.limits.parse_budget, config.limits.timeout),
        config: Arc::new(config),
        registry,
    });
    let failure: Arc<Mutex<Option<ServerError>>> = Arc::new(Mutex::new(None));
    let (load_fail_tx, load_fail_rx) = oneshot::channel::<()>();
    {
        let st = state.clone();
        let failure = failure.clone();
        tokio::task::spawn_blocking(move || {
            // The error is returned by `RunningServer::wait` (and shown by `/health`).
            if let Err(e) = st.registry.load_single() {
                *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                let _ = load_fail_tx.send(());
            }
        });
    }
    if let Some(idle) = state.config.sleep_idle {
        // A weak handle: the task keeps nothing alive once the server stops.
        let weak = Arc::downgrade(&state);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SLEEP_POLL).await;
                let Some(st) = weak.upgrade() else { break };
                st.registry.sleep_if_idle(idle).await;
            }
        });
    }
    let (down_tx, down_rx) = watch::channel(false);
    {
        let st = state.clone();
        tokio::spawn(async move {
            let load_failed = async {
                if load_fail_rx.await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                _ = stop => {}
                _ = wait_signal(signals) => {}
                _ = load_failed => {}
            }
            st.registry.shutdown();
            let _ = down_tx.send(true);
        });
    }
    let app = api::router(state.clone());
    let server = conn::serve(listener, app, &state.config.limits, down_rx.clone());
    let drained = {
        let mut rx = down_rx;
        async move {
            let _ = rx.wait_for(|d| *d).await;
            tokio::time::sleep(DRAIN).await;
        }
    };
    tokio::select! {
        r = server => r?,
        _ = drained => tracing::warn!("some responses were still open when the server stopped"),
    }
    state.registry.shutdown();
    release(state);
    let err = failure.lock().unwrap_or_else(|p| p.into_inner()).take();
    match err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Drops the server's state (each model's worker thread is joined, which waits for the step it
/// is in) on a thread of its own, waiting at most [`LINGER`] for it.
fn release(state: Arc<state::AppState>) {
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("hmoe-release".into())
        .spawn(move || {
            drop(state);
            let _ = done_tx.send(());
        });
    if spawned.is_ok() {
        let _ = done_rx.recv_timeout(LINGER);
    }
}
