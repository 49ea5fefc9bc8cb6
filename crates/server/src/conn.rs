//! The accept loop: HTTP/1.1 connections with a header read timeout and a cap on how many are
//! open, so that clients which connect and stall cannot use up the process's file descriptors.
//!
//! Up to [`Limits::max_connections`] connections are served normally. Beyond that a reserve of
//! connections is still accepted, each with a one-second header timeout and no keep-alive,
//! that answer `/health` as usual and every other route with 503; when the reserve is full the
//! oldest reserve connection is closed to make room. So `/health` answers while stalled
//! clients hold every place (normal ones are dropped after [`Limits::header_timeout`]).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinSet};
use tower_service::Service;

use crate::config::Limits;
use crate::error::ApiError;
use crate::guard::is_health;

/// Header timeout of the connections accepted beyond the cap.
const RESERVE_HEADER_TIMEOUT: Duration = Duration::from_secs(1);

/// File descriptors kept free for everything but connections (model files, pipes, logs).
const FD_MARGIN: usize = 64;

/// Normal places and reserve places, fitted under the process's open-file limit.
pub fn connection_caps(max_connections: usize, fd_limit: Option<usize>) -> (usize, usize) {
    let want = max_connections.max(1);
    let reserve = |n: usize| n / 8 + 16;
    let Some(limit) = fd_limit else {
        return (want, reserve(want));
    };
    let room = limit.saturating_sub(FD_MARGIN);
    if want + reserve(want) <= room {
        return (want, reserve(want));
    }
    // n + n/8 + 16 <= room
    let n = (room.saturating_sub(16) * 8 / 9).max(1);
    (n, room.saturating_sub(n).max(1))
}

/// The soft limit on open files (`/proc/self/limits`), where the system says.
pub fn open_file_limit() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Serves `app` on `listener` until `down` turns true, then lets open responses finish
/// (connections are shut down gracefully; the caller bounds how long it waits).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: &Limits,
    down: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let (cap, reserve) = connection_caps(limits.max_connections, open_file_limit());
    if cap < limits.max_connections {
        tracing::warn!(
            "--max-connections {} lowered to {cap} to fit the open-file limit",
            limits.max_connections
        );
    }
    let open = Arc::new(AtomicUsize::new(0));
    let mut conns = JoinSet::new();
    let mut reserved: VecDeque<AbortHandle> = VecDeque::new();
    let mut stop = down.clone();
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was accepted:
                    // wait a little rather than spin.
                    tracing::debug!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = changed_to_true(&mut stop) => break,
        };
        while conns.try_join_next().is_some() {}
        let overflow = open.load(Relaxed) >= cap;
        let guard = if overflow {
            reserved.retain(|h| !h.is_finished());
            if reserved.len() >= reserve {
                if let Some(oldest) = reserved.pop_front() {
                    oldest.abort();
                }
            }
            None
        } else {
            open.fetch_add(1, Relaxed);
            Some(Open(open.clone()))
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let header_timeout = if overflow {
            RESERVE_HEADER_TIMEOUT
        } else {
            limits.header_timeout
        };
        let mut down = down.clone();
        let handle = conns.spawn(async move {
            let _open = guard;
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let mut app = app.clone();
                async move {
                    if overflow && !is_health(req.uri().path()) {
                        return Ok::<Response, Infallible>(too_many(cap));
                    }
                    app.call(req.map(Body::new)).await
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .keep_alive(!overflow);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!("connection: {e}");
                    }
                }
                _ = changed_to_true(&mut down) => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.as_mut().await;
                }
            }
        });
        if overflow {
            reserved.push_back(handle);
        }
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// Waits until the flag is true (without holding the watch's guard).
async fn changed_to_true(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|d| *d).await.map(|_| ());
}

fn too_many(cap: usize) -> Response {
    let mut r = ApiError::unavailable(format!(
        "too many open connections (at most {cap}, --max-connections); try again later"
    ))
    .into_response();
    r.headers_mut().insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_fit_the_file_limit() {
        assert_eq!(connection_caps(512, None), (512, 80));
        assert_eq!(connection_caps(512, Some(1 << 20)), (512, 80));
        let (n, r) = connection_caps(512, Some(256));
        assert!(n + r <= 256 - FD_MARGIN && n >= 1 && r >= 1, "{n} {r}");
        let (n, r) = connection_caps(512, Some(10));
        assert!(n >= 1 && r >= 1);
        assert!(open_file_limit().is_none_or(|l| l > 0));
    }
}
