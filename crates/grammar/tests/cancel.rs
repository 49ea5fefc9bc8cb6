//! A compilation whose caller goes away stops: [`Vocab::compile_until`] returns
//! [`GrammarError::Cancelled`] at once, and where the work is llguidance's first mask the
//! compiling thread gives its place back long before the whole compilation would have ended. In a test binary of its own, because it
//! reads the process-wide count of running compilations.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_grammar::limits::compiles_running;
use hmoe_grammar::{CompileCancel, Frame, Grammar, GrammarError, Vocab};
use hmoe_tokenizer::Tokenizer;
use serde_json::json;

/// gpt-oss's 201k-token vocabulary: a grammar's first mask walks all of it.
fn vocab() -> Vocab {
    let dir = hmoe_testdata::fixtures();
    let path = dir.join("tokenizer/ggml-vocab-o200k-harmony.gguf");
    let g = GgufModel::open(path, LoadOptions::default()).expect("fixture");
    let tok = Arc::new(Tokenizer::from_metadata(g.metadata()).expect("tokenizer"));
    Vocab::new(&tok).unwrap()
}

/// Waits until no compilation holds a place, returning how long that took.
fn until_idle(limit: Duration) -> Duration {
    let t0 = Instant::now();
    while compiles_running() > 0 {
        assert!(
            t0.elapsed() < limit,
            "a compilation still runs after {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    t0.elapsed()
}

/// One test (not two): both read the process-wide count.
#[test]
fn a_cancelled_compilation_returns_at_once_and_its_thread_stops_early() {
    let vocab = vocab();
    // A regular expression whose lexer states llguidance builds while it computes the first
    // mask over the vocabulary, which it checks for cancellation as it goes. (Shapes whose cost
    // is in building the grammar from its text, such as 20,000 alternatives, cannot be
    // stopped inside llguidance: they run to their end, which the size limits bound.)
    let g = Grammar::JsonSchema(json!({"type": "string", "pattern": "^(a{400}){400}$"}));
    let t0 = Instant::now();
    vocab.compile(&g, Frame::Raw).unwrap();
    let whole = t0.elapsed();
    until_idle(Duration::from_secs(5));

    let cancel = CompileCancel::new();
    let late = cancel.clone();
    let after = whole / 5;
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(after);
        late.cancel();
        Instant::now()
    });
    let err = vocab.compile_until(&g, Frame::Raw, &cancel).unwrap_err();
    let returned = Instant::now();
    let cancelled_at = canceller.join().unwrap();
    assert_eq!(err, GrammarError::Cancelled);
    let waited = returned.saturating_duration_since(cancelled_at);
    assert!(
        waited < Duration::from_millis(200),
        "returned {waited:?} after the cancel"
    );
    let stopped = until_idle(whole * 3 + Duration::from_secs(1));
    println!(
        "whole compilation {whole:?}; cancelled after {after:?}; the caller returned {waited:?} \
         later, the thread stopped {stopped:?} after that"
    );
    assert!(
        after + stopped < whole,
        "the thread ran to the end: cancelled at {after:?}, stopped {stopped:?} later, whole {whole:?}"
    );

    // Cancelled before it starts: it never runs.
    let cancel = CompileCancel::new();
    cancel.cancel();
    let err = vocab
        .compile_until(&Grammar::Gbnf("root ::= \"x\"".into()), Frame::Raw, &cancel)
        .unwrap_err();
    assert_eq!(err, GrammarError::Cancelled);
    until_idle(Duration::from_secs(2));
}
