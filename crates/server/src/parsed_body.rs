//! Request bodies parsed off the async workers, within a memory budget.
//!
//! A JSON body parsed into a tree takes many times its size (a 60 MB array of small token ids
//! becomes gigabytes of values), and parsing, tokenizing or rendering it takes seconds. So a
//! body is parsed on a blocking thread ([`blocking`]), never on the few async workers that
//! answer every connection (`/health` among them), and so is the work that reads a large body
//! (tokenizing a prompt, rendering a chat template).
//!
//! Bodies also share a budget ([`crate::config::Limits::parse_budget`], `--parse-budget`): a
//! body takes its size from the budget before it is parsed and gives it back when its tree is
//! dropped, so that the trees held at once stay within about 40 × the budget. Bodies over
//! [`SMALL_BODY`] and smaller ones have a budget each (of that size), so that large uploads
//! never hold up ordinary requests. A body that finds its budget taken waits for it, at most
//! `--timeout`, then gets 503 naming the limit; a body larger than the budget takes all of it.

use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use serde_json::{Map, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;
use crate::id_arrays::CompactBody;

/// Bodies up to this size take from a budget of their own (see the module's text).
pub const SMALL_BODY: usize = 1 << 20;

/// Bodies up to this size are parsed on the async worker that received them (a millisecond or
/// so); larger ones on a blocking thread.
const INLINE_PARSE: usize = 64 << 10;

/// The budget is counted in units of this many bytes (the semaphore counts in `u32`).
const UNIT: usize = 1 << 10;

/// Runs `f` on a blocking thread and returns its result: for work that takes time in
/// proportion to a request's size, which must not hold an async worker.
pub async fn blocking<T, F>(f: F) -> Result<T, ApiError>
where
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("a request's work stopped: {e}")))?
}

/// The bytes of request bodies that may be parsed and held as JSON trees at once: as much
/// for bodies over [`SMALL_BODY`] as for smaller ones.
pub struct ParseBudget {
    large: Arc<Semaphore>,
    small: Arc<Semaphore>,
    total: u32,
    wait: Duration,
}

impl ParseBudget {
    /// A budget of `bytes` (at least one unit) each for large and small bodies; a body waits at
    /// most `wait` for its share.
    pub fn new(bytes: usize, wait: Duration) -> ParseBudget {
        let total = (bytes / UNIT).clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize)) as u32;
        ParseBudget {
            large: Arc::new(Semaphore::new(total as usize)),
            small: Arc::new(Semaphore::new(total as usize)),
            total,
            wait,
        }
    }

    /// The budget in bytes (for large bodies; as much again for small ones).
    pub fn bytes(&self) -> usize {
        self.total as usize * UNIT
    }

    /// The share of a body of `len` bytes: its size in units, the whole budget at most.
    fn share(&self, len: usize) -> u32 {
        len.div_ceil(UNIT).clamp(1, self.total as usize) as u32
    }

    /// Waits for a body's share of its budget.
    async fn take(&self, len: usize) -> Result<OwnedSemaphorePermit, ApiError> {
        let (pool, which) = match len > SMALL_BODY {
            true => (&self.large, "over"),
            false => (&self.small, "up to"),
        };
        let wanted = pool.clone().acquire_many_owned(self.share(len));
        match tokio::time::timeout(self.wait, wanted).await {
            Ok(Ok(p)) => Ok(p),
            // The semaphore is never closed.
            Ok(Err(_)) | Err(_) => Err(ApiError::unavailable(format!(
                "request bodies {which} {} MiB being parsed fill their parse budget of {} MiB \
                 (--parse-budget) and stayed so for {} s (--timeout); try again later",
                SMALL_BODY >> 20,
                self.bytes() >> 20,
                self.wait.as_secs()
            ))),
        }
    }

    /// Parses `bytes` as a JSON object on a blocking thread, after taking its share of the
    /// budget; the share is given back when the last handle on the tree is dropped.
    pub async fn parse(&self, bytes: Bytes) -> Result<ParsedBody, ApiError> {
        let permit = self.take(bytes.len()).await?;
        let large = bytes.len() > SMALL_BODY;
        let body = if bytes.len() > INLINE_PARSE {
            blocking(move || parse_body(&bytes)).await?
        } else {
            parse_body(&bytes)?
        };
        Ok(ParsedBody(Arc::new(Tree {
            body,
            permit: Some(permit),
            large,
        })))
    }
}

/// Parses a request body as a JSON object, its arrays of token ids compact (on the calling
/// thread, with no budget: [`ParseBudget::parse`] is what the routes call).
pub fn parse_body(bytes: &[u8]) -> Result<CompactBody, ApiError> {
    serde_json::from_slice::<CompactBody>(bytes).map_err(|e| {
        let object = bytes.trim_ascii_start().first() == Some(&b'{');
        if e.classify() == serde_json::error::Category::Data && !object {
            ApiError::bad_request("the request body must be a JSON object")
        } else {
            ApiError::bad_request(format!("Invalid JSON in the request body: {e}"))
        }
    })
}

/// A parsed request body: a JSON object, cheap to clone (for work on a blocking thread),
/// holding its share of the parse budget while any clone lives. Arrays of token ids in
/// `prompt` and `tokens` are kept apart, 4 bytes an id ([`ParsedBody::ids`]); the object
/// holds every other field.
#[derive(Clone)]
pub struct ParsedBody(Arc<Tree>);

impl ParsedBody {
    /// The array of token ids `key` holds, if it holds one (then the object has no `key`).
    pub fn ids(&self, key: &str) -> Option<&[u32]> {
        (self.0.body.ids.iter())
            .find(|(k, _)| k == key)
            .map(|(_, ids)| ids.as_slice())
    }
}

struct Tree {
    body: CompactBody,
    permit: Option<OwnedSemaphorePermit>,
    large: bool,
}

impl Deref for ParsedBody {
    type Target = Map<String, Value>;

    fn deref(&self) -> &Map<String, Value> {
        &self.0.body.map
    }
}

impl Drop for Tree {
    /// Freeing a large tree takes as long as building it: that too happens on a blocking
    /// thread, and the budget's share comes back once it is done.
    fn drop(&mut self) {
        if !self.large {
            return;
        }
        let body = std::mem::take(&mut self.body);
        let permit = self.permit.take();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn_blocking(move || drop((body, permit)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(len: usize) -> Bytes {
        let mut s = String::from("{\"x\":\"");
        s.push_str(&"a".repeat(len.saturating_sub(8)));
        s.push_str("\"}");
        Bytes::from(s)
    }

    #[tokio::test]
    async fn large_bodies_wait_for_the_budget_and_give_it_back() {
        let budget = ParseBudget::new(3 << 20, Duration::from_millis(200));
        let a = budget.parse(body(2 << 20)).await.unwrap();
        assert_eq!(a["x"].as_str().unwrap().len(), (2 << 20) - 8);
        // Small bodies are never held up by large ones, but have a budget of their own.
        let small = budget.parse(body(1000)).await.unwrap();
        assert!(small.contains_key("x"));
        drop(small);
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(budget.parse(body(SMALL_BODY)).await.unwrap());
        }
        let e = budget.parse(body(SMALL_BODY)).await.err().unwrap();
        assert!(e.message.contains("up to 1 MiB"), "{}", e.message);
        drop(held);
        // A second large body does not fit beside the first: it waits, then gets 503.
        let e = budget.parse(body(2 << 20)).await.err().unwrap();
        assert_eq!(e.status.as_u16(), 503);
        assert!(e.message.contains("--parse-budget"), "{}", e.message);
        // Clones hold the share; once the last is gone (and freed) the budget is back.
        let clone = a.clone();
        drop(a);
        assert!(budget.parse(body(2 << 20)).await.is_err());
        drop(clone);
        let b = budget.parse(body(2 << 20)).await.unwrap();
        drop(b);
        // A body larger than the whole budget takes all of it, not more.
        assert!(budget.parse(body(5 << 20)).await.is_ok());
        // Malformed bodies are 400 and give their share back.
        let e = budget
            .parse(Bytes::from(vec![b'['; 2 << 20]))
            .await
            .err()
            .unwrap();
        assert_eq!(e.status.as_u16(), 400);
        assert!(budget.parse(body(2 << 20)).await.is_ok());
    }
}
