//! Bounds on what one grammar may cost: its size, its rules and terminals, how deep its groups
//! nest, the stack and the time its compilation gets. llguidance compiles recursively (a chain
//! of rules each naming the next recurses once per rule) and adds each terminal after a linear
//! search of those before it (n terminals cost n² steps), so without these a request of a few
//! megabytes could overflow a stack or hold a core for minutes.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::GrammarError;

/// Largest grammar in bytes: GBNF or Lark text, a JSON schema as compact JSON, or a tool
/// call's names and parameter schemas together.
pub const MAX_GRAMMAR_BYTES: usize = 1 << 20;

/// Most rules (definitions) in a GBNF or Lark grammar. A chain of this many rules, each
/// naming the next, compiles within [`COMPILE_STACK`] (about 4 KiB of stack per rule).
pub const MAX_RULES: usize = 32_768;

/// Most terminals (string literals, character classes, regexes, `.`) in a GBNF or Lark
/// grammar: 20,000 distinct ones compile in about half a second.
pub const MAX_TERMINALS: usize = 20_000;

/// Most alternatives (`|`) in a GBNF or Lark grammar: llguidance's time grows with the square
/// of one rule's alternatives (20,000 take about half a second, 200,000 minutes).
pub const MAX_ALTERNATIVES: usize = 20_000;

/// Most tools a forced tool call may choose among (each is a JSON grammar of its own; a
/// thousand take about half a second).
pub const MAX_TOOLS: usize = 512;

/// Deepest nesting of parenthesized groups in a GBNF grammar (llguidance's own Lark limit).
pub const MAX_NESTING: usize = 30;

/// Longest a caller waits for a compilation (a place among [`max_compiles`], then the work)
/// before it gets [`GrammarError::Limit`]; the size limits keep real compilations far below
/// it.
pub const COMPILE_TIMEOUT: Duration = Duration::from_secs(10);

/// Stack reserved (not committed: pages are touched only as deep as the recursion goes) for
/// the thread that compiles a grammar.
pub const COMPILE_STACK: usize = 256 << 20;

/// Most compilations running at once in the process: the CPU count, at least 4. A
/// compilation whose caller stopped waiting (the deadline passed, the client left) holds its
/// place until it ends, so abandoned compilations cannot take more cores than this.
pub fn max_compiles() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get().max(4))
}

/// Compilations running now.
static COMPILING: Mutex<usize> = Mutex::new(0);

/// How many compilations hold a place among [`max_compiles`] now (a cancelled or timed-out one
/// until its thread has stopped).
pub fn compiles_running() -> usize {
    *COMPILING.lock().unwrap_or_else(|p| p.into_inner())
}
/// Signalled when one ends.
static COMPILE_ENDED: Condvar = Condvar::new();

/// A place among [`max_compiles`], given back when dropped.
pub(crate) struct CompileSlot(());

impl CompileSlot {
    /// Takes a place, waiting until `deadline` for one to free up.
    pub(crate) fn take(deadline: Instant) -> Result<CompileSlot, GrammarError> {
        let limit = max_compiles();
        let mut n = COMPILING.lock().unwrap_or_else(|p| p.into_inner());
        while *n >= limit {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(GrammarError::Unavailable(format!(
                    "{limit} grammars are compiling (the limit); try again"
                )));
            }
            n = COMPILE_ENDED
                .wait_timeout(n, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *n += 1;
        Ok(CompileSlot(()))
    }
}

impl Drop for CompileSlot {
    fn drop(&mut self) {
        let mut n = COMPILING.lock().unwrap_or_else(|p| p.into_inner());
        *n -= 1;
        COMPILE_ENDED.notify_one();
    }
}

/// Longest message of llguidance's passed on, in bytes.
const MAX_MESSAGE: usize = 300;

/// Refuses `n` of `what` beyond `limit`.
pub(crate) fn check(n: usize, limit: usize, what: &str) -> Result<(), GrammarError> {
    match n > limit {
        true => Err(GrammarError::Limit(format!(
            "the grammar has more than {limit} {what} (the limit)"
        ))),
        false => Ok(()),
    }
}

/// What [`lark_counts`] counts.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct LarkCounts {
    /// Rule (and terminal) definitions.
    pub rules: usize,
    /// String literals and regexes.
    pub terminals: usize,
    /// `|` outside strings, regexes and comments.
    pub alternatives: usize,
}

/// Rules, terminals and alternatives of Lark text, counted the way llguidance's lexer reads
/// it: `"…"` strings and `/…/` regexes are terminals, `#` and `//` start comments, and a line
/// that starts with a name (optionally `?` or `!` before it, a `.priority` after it) and `:`
/// defines a rule. Counts every string of an inline `%json {…}` too, so it errs on the high
/// side.
pub(crate) fn lark_counts(src: &str) -> LarkCounts {
    let b = src.as_bytes();
    let mut n = LarkCounts::default();
    let mut i = 0;
    let mut line_start = true;
    while i < b.len() {
        let c = b[i];
        if line_start {
            line_start = false;
            let mut j = i;
            while j < b.len() && matches!(b[j], b' ' | b'\t' | b'?' | b'!') {
                j += 1;
            }
            let name = j;
            while j < b.len() && (b[j].is_ascii_alphanumeric() || matches!(b[j], b'_' | b'-')) {
                j += 1;
            }
            if j > name && !b[name].is_ascii_digit() {
                while j < b.len() && (b[j].is_ascii_digit() || matches!(b[j], b'.' | b' ' | b'-')) {
                    j += 1;
                }
                if b.get(j) == Some(&b':') && b.get(j + 1) != Some(&b':') {
                    n.rules += 1;
                }
            }
        }
        match c {
            b'\n' => {
                line_start = true;
                i += 1;
            }
            b'#' => i = skip_line(b, i),
            b'/' if b.get(i + 1) == Some(&b'/') => i = skip_line(b, i),
            b'"' | b'/' => {
                n.terminals += 1;
                i = skip_quoted(b, i);
            }
            b'|' => {
                n.alternatives += 1;
                i += 1;
            }
            _ => i += 1,
        }
    }
    n
}

/// The index of the line break ending the line at `i` (or the end).
fn skip_line(b: &[u8], i: usize) -> usize {
    b[i..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(b.len(), |n| i + n)
}

/// The index after the string or regex starting at `i` (its quote `b[i]`, `\` escapes), or the
/// end of the line where it does not close there.
fn skip_quoted(b: &[u8], i: usize) -> usize {
    let quote = b[i];
    let mut j = i + 1;
    while j < b.len() && b[j] != b'\n' {
        match b[j] {
            b'\\' => j += 2,
            c if c == quote => return j + 1,
            _ => j += 1,
        }
    }
    j.min(b.len())
}

/// llguidance's message made short and safe to show a client: its first line (never a parser
/// state dump, a backtrace or a path), at most [`MAX_MESSAGE`] bytes.
pub(crate) fn short_message(e: &str) -> String {
    let first = e
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let first = match first.strip_prefix("panic: ") {
        Some(p) => format!("internal error: {p}"),
        None => first.to_string(),
    };
    if first.len() <= MAX_MESSAGE {
        return first;
    }
    let mut end = MAX_MESSAGE;
    while !first.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &first[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lark_counts_rules_and_terminals_not_comments() {
        let src =
            "%llguidance {}\nstart: a | \"x:y|\" b // \"no\" |\n?a.2: /[a\\/\"|]+/ # \"no\"\n\
                   B: \"q\\\"\" \n  x : \"::\" | x\ny::= z\n";
        let counts = LarkCounts {
            rules: 4,
            terminals: 4,
            alternatives: 2,
        };
        assert_eq!(lark_counts(src), counts);
    }

    #[test]
    fn compile_places_are_bounded_and_given_back() {
        let soon = || Instant::now() + Duration::from_millis(50);
        let held: Vec<CompileSlot> = (0..max_compiles())
            .map(|_| CompileSlot::take(soon()).unwrap())
            .collect();
        let e = CompileSlot::take(soon()).err().unwrap();
        assert!(matches!(e, GrammarError::Unavailable(_)), "{e}");
        assert!(e.to_string().contains("the limit"), "{e}");
        drop(held);
        CompileSlot::take(soon()).unwrap();
    }

    #[test]
    fn messages_keep_one_short_line() {
        let m = short_message("panic: assertion failed: x < 3\n<backtrace>\n/root/src/a.rs:1\n");
        assert_eq!(m, "internal error: assertion failed: x < 3");
        let m = short_message(&format!("{}\nmore", "é".repeat(400)));
        assert!(m.len() <= MAX_MESSAGE + 3 && m.ends_with('…'), "{m}");
        assert!(!m.contains('\n'));
    }
}
