//! Tool calls that end where their JSON ends (no closing tag), for the formats llama-server calls
//! Llama 3.x and Mistral Nemo:
//!
//! * Llama 3.x: a JSON object `{"name": NAME, "parameters": {...}}` (optionally with
//!   `"type": "function"` first) at the start of the answer or after `<|python_tag|>`, or a
//!   builtin call `<|python_tag|>NAME.call(KEY=JSON, ...)`.
//! * Mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments", "id"}` objects, or (newer
//!   templates) `[TOOL_CALLS]NAME[ARGS]{...}`, optionally `NAME[CALL_ID]ID[ARGS]{...}`.
//!
//! [`Extent`] finds where such a call ends in streamed text; [`parse`] reads it.

use serde_json::{Map, Value};

/// Most bytes before a call's first bracket (a function name and `[CALL_ID]`/`[ARGS]` markup).
const MAX_HEAD: usize = 256;

/// Llama 3.x's marker before a builtin (or JSON) tool call.
pub(crate) const PYTHON_TAG: &str = "<|python_tag|>";
/// Mistral's marker before tool calls.
pub(crate) const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
/// Mistral's marker between a call's name and its arguments (newer templates).
pub(crate) const MISTRAL_ARGS: &str = "[ARGS]";
/// Mistral's marker before a call's id (newer templates).
pub(crate) const MISTRAL_CALL_ID: &str = "[CALL_ID]";

/// What scanning the text of a call found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scan {
    /// The call is not complete yet.
    More,
    /// The call ends at this byte offset.
    End(usize),
    /// The text cannot be a call.
    NotACall,
}

/// Where a self-delimited call ends, scanned incrementally over text that only grows at its
/// end: a head of name characters (and, for Mistral, `[ARGS]` / `[CALL_ID]` markup), then one
/// balanced `{}` / `[]` / `()` group, brackets inside JSON strings not counted.
#[derive(Debug, Clone, Default)]
pub(crate) struct Extent {
    pos: usize,
    depth: usize,
    in_str: bool,
    esc: bool,
}

impl Extent {
    /// Where scanning stopped: after a call's end, or at the character that is not a call's.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Scans `text` (the same text as before, possibly longer) on from where the last call
    /// stopped; `mistral` skips Mistral's markup in the head.
    pub(crate) fn scan(&mut self, text: &str, mistral: bool) -> Scan {
        let bytes = text.as_bytes();
        'bytes: while self.pos < bytes.len() {
            let b = bytes[self.pos];
            if self.depth == 0 {
                if mistral {
                    let rest = &text[self.pos..];
                    for m in [MISTRAL_ARGS, MISTRAL_CALL_ID] {
                        if rest.starts_with(m) {
                            self.pos += m.len();
                            continue 'bytes;
                        }
                        if m.starts_with(rest) {
                            return Scan::More;
                        }
                    }
                }
                let head = b.is_ascii_alphanumeric()
                    || matches!(b, b'_' | b'-' | b'.')
                    || b.is_ascii_whitespace();
                match b {
                    b'{' | b'[' | b'(' => self.depth = 1,
                    _ if head && self.pos < MAX_HEAD => {}
                    _ => return Scan::NotACall,
                }
                self.pos += 1;
                continue;
            }
            if self.in_str {
                if self.esc {
                    self.esc = false;
                } else if b == b'\\' {
                    self.esc = true;
                } else if b == b'"' {
                    self.in_str = false;
                }
            } else {
                match b {
                    b'"' => self.in_str = true,
                    b'{' | b'[' | b'(' => self.depth += 1,
                    b'}' | b']' | b')' => {
                        self.depth -= 1;
                        if self.depth == 0 {
                            self.pos += 1;
                            return Scan::End(self.pos);
                        }
                    }
                    _ => {}
                }
            }
            self.pos += 1;
        }
        Scan::More
    }
}

/// Whether the start of a Llama 3.x JSON call (`{` …) can still be `{"name"` or `{"type"`.
pub(crate) fn plausible_llama_head(text: &str) -> bool {
    let Some(rest) = text.trim_start().strip_prefix('{') else {
        return true;
    };
    let rest = rest.trim_start();
    ["\"name\"", "\"type\""]
        .iter()
        .any(|k| k.starts_with(rest) || rest.starts_with(k))
}

/// The calls (name, arguments) a complete call text holds, its opening marker already removed;
/// `None` when it is not calls.
pub(crate) fn parse(mistral: bool, body: &str) -> Option<Vec<(String, Map<String, Value>)>> {
    let body = body.trim();
    if mistral {
        if body.starts_with('[') {
            let items = match serde_json::from_str::<Value>(body).ok()? {
                Value::Array(a) if !a.is_empty() => a,
                _ => return None,
            };
            return items.iter().map(|c| named_call(c, "arguments")).collect();
        }
        let (head, json) = body.split_once(MISTRAL_ARGS)?;
        let name = head.split(MISTRAL_CALL_ID).next()?.trim();
        let args = args_object(&serde_json::from_str(json).ok()?)?;
        return Some(vec![(name.to_string(), args)]);
    }
    if body.starts_with('{') {
        let v: Value = serde_json::from_str(body).ok()?;
        if v.get("type").is_some_and(|t| t != "function") {
            return None;
        }
        let key = if v.get("parameters").is_some() {
            "parameters"
        } else {
            "arguments"
        };
        return Some(vec![named_call(&v, key)?]);
    }
    let (name, rest) = body.split_once(".call(")?;
    let inner = rest.strip_suffix(')')?;
    Some(vec![(name.trim().to_string(), parse_kwargs(inner)?)])
}

/// `{"name": NAME, KEY: ARGS}` with ARGS an object or a string holding one (KEY required).
fn named_call(v: &Value, key: &str) -> Option<(String, Map<String, Value>)> {
    let name = v.get("name")?.as_str()?.to_string();
    Some((name, args_object(v.get(key)?)?))
}

/// A JSON object of arguments: an object, or a string holding one.
pub(crate) fn args_object(v: &Value) -> Option<Map<String, Value>> {
    match v {
        Value::Object(o) => Some(o.clone()),
        Value::String(s) => match serde_json::from_str::<Value>(s).ok()? {
            Value::Object(o) => Some(o),
            _ => None,
        },
        _ => None,
    }
}

/// `KEY=JSON, KEY=JSON` (a builtin call's arguments).
fn parse_kwargs(mut s: &str) -> Option<Map<String, Value>> {
    let mut args = Map::new();
    loop {
        s = s.trim_start();
        if s.is_empty() {
            return Some(args);
        }
        let (key, rest) = s.split_once('=')?;
        let key = key.trim();
        if key.is_empty() || !key.chars().all(|c| c.is_alphanumeric() || c == '_') {
            return None;
        }
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        let used = values.byte_offset();
        args.insert(key.to_string(), value);
        s = rest[used..].trim_start();
        match s.strip_prefix(',') {
            Some(r) => s = r,
            None => return s.is_empty().then_some(args),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn scan_all(text: &str, mistral: bool) -> Scan {
        let mut e = Extent::default();
        e.scan(text, mistral)
    }

    #[test]
    fn extents() {
        assert_eq!(scan_all("{\"a\": \"}\"} x", false), Scan::End(10));
        assert_eq!(scan_all("{\"a\": \"\\\"}\"", false), Scan::More);
        assert_eq!(scan_all("f.call(q=\")\") tail", false), Scan::End(13));
        assert_eq!(scan_all("hello, world", false), Scan::NotACall);
        assert_eq!(scan_all("f[ARGS]{}", true), Scan::End(9));
        assert_eq!(
            scan_all("f[CALL_ID]a1[ARGS]{\"x\":[1]}", true),
            Scan::End(27)
        );
        assert_eq!(scan_all("f[AR", true), Scan::More);
        assert_eq!(scan_all(&"a".repeat(MAX_HEAD + 1), false), Scan::NotACall);
        // Grown text scans on from where it stopped.
        let mut e = Extent::default();
        assert_eq!(e.scan("[{\"n\": \"]", true), Scan::More);
        assert_eq!(e.scan("[{\"n\": \"]\"}]", true), Scan::End(12));
    }

    #[test]
    fn parses() {
        let one = |n: &str, a: Value| Some(vec![(n.to_string(), a.as_object().unwrap().clone())]);
        assert_eq!(
            parse(
                false,
                "{\"type\": \"function\", \"name\": \"f\", \"parameters\": {\"a\": 1}}"
            ),
            one("f", json!({"a": 1}))
        );
        assert_eq!(parse(false, "{\"name\": \"Bob\", \"age\": 3}"), None);
        assert_eq!(
            parse(false, "brave_search.call(query=\"a, b\", n=2)"),
            one("brave_search", json!({"query": "a, b", "n": 2}))
        );
        assert_eq!(parse(false, "f.call(query=)"), None);
        assert_eq!(
            parse(
                true,
                "[{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\", \"id\": \"abcdefghi\"}]"
            ),
            one("f", json!({"a": 1}))
        );
        assert_eq!(parse(true, "[]"), None);
        assert_eq!(
            parse(true, "f[CALL_ID]x1[ARGS]{\"a\": [1]}"),
            one("f", json!({"a": [1]}))
        );
        assert!(plausible_llama_head("{ \"na"));
        assert!(plausible_llama_head("{\"type\": \"function\""));
        assert!(!plausible_llama_head("{\"answer\""));
    }
}
