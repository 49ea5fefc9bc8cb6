//! The accept loop: HTTP/1.1 connections with a header read timeout and a cap on how many are
//! open, so that clients which connect and stall cannot use up the process's file descriptors.
//!
//! Up to [`Limits::max_connections`] connections are served normally. Beyond that a reserve of
//! connections is still accepted, each with a one-second header timeout and no keep-alive,
//! that answer `/health` as usual and every other route with 503; when the reserve is full the
//! oldest reserve connection is closed to make room. So `/health` answers while stalled
//! clients hold every place (normal ones are dropped after [`Limits::header_timeout`]).
//!
//! A client that stops reading a response is dropped too: when the socket has taken no bytes
//! for [`Limits::timeout`] (llama-server's write timeout is its `--timeout` as well) the write
//! fails, the connection closes, and a generation streaming to it is cancelled, so a stalled
//! reader holds neither a connection nor a slot for longer than that.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Sleep;
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
        let keep_alive = keep_alive_header(header_timeout);
        let mut down = down.clone();
        let write_timeout = limits.timeout;
        let handle = conns.spawn(async move {
            let _open = guard;
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let mut app = app.clone();
                let keep_alive = keep_alive.clone();
                async move {
                    if overflow && !is_health(req.uri().path()) {
                        return Ok::<Response, Infallible>(too_many(cap));
                    }
                    let closing = asks_to_close(&req);
                    let mut r = app.call(req.map(Body::new)).await?;
                    if !overflow && !closing {
                        r.headers_mut().insert(KEEP_ALIVE, keep_alive);
                    }
                    Ok(r)
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            // Header names go out Title-Case ("Access-Control-Allow-Origin"), as llama-server
            // writes them: names are case-insensitive, but some clients compare them exactly.
            builder
                .title_case_headers(true)
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .keep_alive(!overflow);
            let io = WriteDeadline::new(stream, write_timeout);
            let conn = builder.serve_connection(TokioIo::new(io), service);
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

/// The `Keep-Alive` header's name.
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// `Keep-Alive: timeout=N`: how long, in whole seconds (rounded down, so a client never
/// counts on more), an idle connection is kept before the header timeout closes it.
fn keep_alive_header(idle: Duration) -> HeaderValue {
    HeaderValue::from_str(&format!("timeout={}", idle.as_secs()))
        .unwrap_or(HeaderValue::from_static("timeout=0"))
}

/// Whether a request closes its connection after the response (`Connection: close`, or
/// HTTP/1.0 without `Connection: keep-alive`), so no `Keep-Alive` header applies.
fn asks_to_close<B>(req: &hyper::Request<B>) -> bool {
    let has = |token: &str| {
        req.headers()
            .get_all(hyper::header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    };
    has("close") || (req.version() == hyper::Version::HTTP_10 && !has("keep-alive"))
}

/// A stream whose writes fail once the peer has taken no bytes for `timeout`: the clock
/// starts when a write first finds the socket full and stops at the next write that goes
/// through. Reads pass through untouched (the header and body timeouts bound them).
struct WriteDeadline<S> {
    inner: S,
    timeout: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, timeout: Duration) -> WriteDeadline<S> {
        WriteDeadline {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// What a write that returned `r` returns under the deadline.
    fn watch<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.stalled = None;
            return r;
        }
        let timeout = self.timeout;
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the client read nothing for {} s (--timeout)",
                    timeout.as_secs()
                ),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, r)
    }
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

    /// A peer that never reads: writes fail after the timeout, not before, and a peer that
    /// reads again in time resets the clock.
    #[tokio::test(start_paused = true)]
    async fn writes_to_a_stalled_reader_time_out() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (a, mut b) = tokio::io::duplex(1024);
        let mut w = WriteDeadline::new(a, Duration::from_secs(5));
        let chunk = vec![7u8; 1024];
        w.write_all(&chunk).await.unwrap();
        let started = tokio::time::Instant::now();
        // The pipe is full: the next write waits for the reader, then gives up.
        let err = w.write_all(&chunk).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(
            started.elapsed() >= Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "{:?}",
            started.elapsed()
        );
        // A reader that keeps up never trips it, however long the whole transfer takes.
        let (a, mut b2) = tokio::io::duplex(1024);
        let mut w = WriteDeadline::new(a, Duration::from_secs(5));
        let reader = tokio::spawn(async move {
            let mut got = 0usize;
            let mut buf = [0u8; 512];
            while got < 16 * 1024 {
                tokio::time::sleep(Duration::from_secs(2)).await;
                got += b2.read(&mut buf).await.unwrap();
            }
            got
        });
        for _ in 0..16 {
            w.write_all(&chunk).await.unwrap();
        }
        assert_eq!(reader.await.unwrap(), 16 * 1024);
        drop(b.read(&mut [0u8; 1]).await);
    }
}
