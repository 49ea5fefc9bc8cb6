//! Tool calls written as text by the non-harmony chat formats, read back from the output stream.
//!
//! The format is chosen from the chat template text, the way llama-server picks its handler:
//!
//! * [`ToolCallFormat::Qwen3Coder`] (template has `<tool_call>`, `<function=` and `<parameter=`):
//!   `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`,
//!   each value typed by the tool's JSON schema (a string unless the schema says otherwise).
//! * [`ToolCallFormat::Hermes`] (template has `<tool_call>`: Qwen3, Qwen2.5, Hermes):
//!   `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>`.
//! * [`ToolCallFormat::DeepSeek`] (template has `<｜tool▁calls▁begin｜>`): a block
//!   `<｜tool▁calls▁begin｜>` … `<｜tool▁calls▁end｜>` of calls
//!   `<｜tool▁call▁begin｜>HEAD<｜tool▁sep｜>BODY<｜tool▁call▁end｜>`: V3.1 writes `NAME` and the
//!   JSON arguments, R1 writes `function` and ``NAME\n```json\nARGS\n``` ``.
//! * [`ToolCallFormat::Llama3`] (template has `<|start_header_id|>ipython<|end_header_id|>`) and
//!   [`ToolCallFormat::Mistral`] (template has `[TOOL_CALLS]`): calls without an end tag, read
//!   until their JSON ends (see the `jsoncall` module).
//!
//! Inside `<tool_call>` both the JSON and the XML body are read whatever the template, since
//! a forced tool call's grammar writes the JSON one. Text before a call is content; a call that
//! does not parse is given back as content, as is anything held past [`MAX_HELD`] bytes.

use std::collections::HashMap;

use serde_json::{Map, Value};

use crate::jsoncall::{self, args_object, Extent, Scan, MISTRAL_CALLS, PYTHON_TAG};
use crate::reasoning::{partial_suffix, push_delta, ChatDelta};

/// Most bytes of one tool call (or DeepSeek block) held back while waiting for its end; past
/// this, the text is given back as content.
pub const MAX_HELD: usize = 256 * 1024;

/// Most trailing whitespace of content held back (it is dropped when a call follows).
const MAX_WS: usize = 4096;

/// How a chat format writes tool calls in text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>` + JSON `{"name", "arguments"}` + `</tool_call>` (Qwen3, Hermes).
    Hermes,
    /// `<tool_call><function=NAME><parameter=P>…</parameter></function></tool_call>`
    /// (Qwen3-Coder).
    Qwen3Coder,
    /// DeepSeek V3 / V3.1 / R1 `<｜tool▁calls▁begin｜>` blocks.
    DeepSeek,
    /// Llama 3.x: `{"name": NAME, "parameters": {...}}` at the start of the answer, or
    /// `<|python_tag|>` then such an object or a builtin `NAME.call(KEY=VALUE, ...)`.
    Llama3,
    /// Mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments", "id"}`, or
    /// `[TOOL_CALLS]NAME[ARGS]{...}`.
    Mistral,
}

const TOOL_CALL: &str = "<tool_call>";
const TOOL_CALL_END: &str = "</tool_call>";
const DS_CALLS: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";

impl ToolCallFormat {
    /// The format a chat template teaches, from its text (`None`: no known tool-call markup).
    pub fn detect(template: &str) -> Option<ToolCallFormat> {
        let has = |s: &str| template.contains(s);
        if has(TOOL_CALL) && has("<function=") && has("<parameter=") {
            Some(ToolCallFormat::Qwen3Coder)
        } else if has(TOOL_CALL) {
            Some(ToolCallFormat::Hermes)
        } else if has(DS_CALLS) {
            Some(ToolCallFormat::DeepSeek)
        } else if has("<|start_header_id|>ipython<|end_header_id|>") {
            Some(ToolCallFormat::Llama3)
        } else if has(MISTRAL_CALLS) {
            Some(ToolCallFormat::Mistral)
        } else {
            None
        }
    }

    /// A short name (`hermes`, `qwen3-coder`, `deepseek`, `llama3`, `mistral`).
    pub fn name(self) -> &'static str {
        match self {
            ToolCallFormat::Hermes => "hermes",
            ToolCallFormat::Qwen3Coder => "qwen3-coder",
            ToolCallFormat::DeepSeek => "deepseek",
            ToolCallFormat::Llama3 => "llama3",
            ToolCallFormat::Mistral => "mistral",
        }
    }

    /// The markup strings of this format (a token whose text is one of them is read as text).
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            ToolCallFormat::Hermes | ToolCallFormat::Qwen3Coder => &[TOOL_CALL, TOOL_CALL_END],
            ToolCallFormat::DeepSeek => &[DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP],
            ToolCallFormat::Llama3 => &[PYTHON_TAG],
            ToolCallFormat::Mistral => &[
                MISTRAL_CALLS,
                jsoncall::MISTRAL_ARGS,
                jsoncall::MISTRAL_CALL_ID,
            ],
        }
    }

    /// What opens tool-call text in content.
    fn opener(self) -> &'static str {
        match self {
            ToolCallFormat::DeepSeek => DS_CALLS,
            ToolCallFormat::Llama3 => PYTHON_TAG,
            ToolCallFormat::Mistral => MISTRAL_CALLS,
            ToolCallFormat::Hermes | ToolCallFormat::Qwen3Coder => TOOL_CALL,
        }
    }

    /// Whether a call ends where its JSON ends (no end tag).
    fn self_delimited(self) -> bool {
        matches!(self, ToolCallFormat::Llama3 | ToolCallFormat::Mistral)
    }

    /// What opens and closes one call.
    fn call_tags(self) -> (&'static str, &'static str) {
        match self {
            ToolCallFormat::DeepSeek => (DS_CALL, DS_CALL_END),
            _ => (TOOL_CALL, TOOL_CALL_END),
        }
    }
}

/// What a request's tool calls are read with: the format, the tools' argument schemas and
/// whether several calls may follow one another.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallSpec {
    format: ToolCallFormat,
    parallel: bool,
    /// Function name to its `parameters.properties`.
    params: HashMap<String, Map<String, Value>>,
}

impl ToolCallSpec {
    /// A spec for `format`; `tools` is the request's OpenAI tool list (`{"type": "function",
    /// "function": {"name", "parameters"}}`); with `parallel` false, reading ends after the
    /// first call.
    pub fn new(format: ToolCallFormat, tools: Option<&Value>, parallel: bool) -> ToolCallSpec {
        let mut params = HashMap::new();
        for t in tools.and_then(Value::as_array).into_iter().flatten() {
            let f = t.get("function").unwrap_or(t);
            if let Some(name) = f.get("name").and_then(Value::as_str) {
                let props = f
                    .get("parameters")
                    .and_then(|p| p.get("properties"))
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                params.insert(name.to_string(), props);
            }
        }
        ToolCallSpec {
            format,
            parallel,
            params,
        }
    }

    /// The format.
    pub fn format(&self) -> ToolCallFormat {
        self.format
    }

    /// Whether several calls are read.
    pub fn parallel(&self) -> bool {
        self.parallel
    }

    /// An XML parameter's value, typed by the function's schema for it: JSON when the schema's
    /// type is not (or does not include) `string` and the text parses, else the text.
    fn typed_value(&self, function: &str, param: &str, text: &str) -> Value {
        let ty = self
            .params
            .get(function)
            .and_then(|p| p.get(param))
            .and_then(|s| s.get("type"));
        let wants_string = match ty {
            None => true,
            Some(Value::String(t)) => t == "string",
            Some(Value::Array(ts)) => ts.iter().any(|t| t == "string"),
            Some(_) => true,
        };
        if !wants_string {
            if let Ok(v) = serde_json::from_str::<Value>(text.trim()) {
                return v;
            }
        }
        Value::String(text.to_string())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Content, looking for the opener.
    Text,
    /// Just after a call: whitespace is dropped.
    AfterCall,
    /// Inside a DeepSeek block, between calls.
    Block,
    /// Inside one call, waiting for its end tag.
    Call,
    /// Llama 3.x at the start of the answer or after a call: a `{` here opens a call.
    Start,
    /// Inside a self-delimited call, waiting for its JSON to end.
    Json,
    /// The one call of a non-parallel request was read: the rest is ignored.
    Done,
}

/// Streaming tool-call reader over content text: feed the content as it comes, get content and
/// tool-call deltas. A call is reported (`ToolCallStart`, then its whole arguments as one
/// `ToolCallArgs`) when its end tag arrives.
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    spec: std::sync::Arc<ToolCallSpec>,
    state: State,
    /// Text not yet decided on.
    held: String,
    /// In [`State::Call`]: how much of `held` is known to hold no end tag.
    scanned: usize,
    /// Markup consumed since the last call was reported (given back if what follows fails).
    raw: String,
    /// Calls reported in the current DeepSeek block.
    block_calls: usize,
    n_calls: usize,
    /// In [`State::Json`]: how far the call's text was scanned.
    extent: Extent,
}

impl ToolCallParser {
    /// A reader for `spec`.
    pub fn new(spec: std::sync::Arc<ToolCallSpec>) -> ToolCallParser {
        let state = match spec.format {
            ToolCallFormat::Llama3 => State::Start,
            _ => State::Text,
        };
        ToolCallParser {
            spec,
            state,
            held: String::new(),
            scanned: 0,
            raw: String::new(),
            block_calls: 0,
            n_calls: 0,
            extent: Extent::default(),
        }
    }

    /// Whether reading is over (the single call of a non-parallel request was read): the
    /// generation can stop.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// How many calls were reported.
    pub fn n_calls(&self) -> usize {
        self.n_calls
    }

    /// Feeds content text.
    pub fn push(&mut self, text: &str) -> Vec<ChatDelta> {
        let mut out = Vec::new();
        if self.state == State::Done {
            return out;
        }
        self.held.push_str(text);
        let format = self.spec.format;
        let (call_open, call_close) = format.call_tags();
        loop {
            match self.state {
                State::Done => {
                    self.held.clear();
                    break;
                }
                State::AfterCall => {
                    let n = self.held.len() - self.held.trim_start().len();
                    self.held.drain(..n);
                    if self.held.is_empty() {
                        break;
                    }
                    self.state = match format {
                        ToolCallFormat::Llama3 => State::Start,
                        _ => State::Text,
                    };
                }
                State::Start => {
                    let rest = self.held.trim_start();
                    let ws = self.held.len() - rest.len();
                    if rest.starts_with('{') {
                        self.raw = self.held.drain(..ws).collect();
                        self.extent = Extent::default();
                        self.state = State::Json;
                    } else if rest.is_empty() && ws <= MAX_WS {
                        break;
                    } else {
                        self.state = State::Text;
                    }
                }
                State::Json => {
                    if !self.json_step(&mut out) {
                        break;
                    }
                }
                State::Text => {
                    let opener = format.opener();
                    if let Some(pos) = self.held.find(opener) {
                        let before = self.held[..pos].trim_end().to_string();
                        push_delta(&mut out, ChatDelta::Content(before));
                        self.raw = opener.to_string();
                        self.held.drain(..pos + opener.len());
                        self.scanned = 0;
                        self.block_calls = 0;
                        self.extent = Extent::default();
                        self.state = if format == ToolCallFormat::DeepSeek {
                            State::Block
                        } else if format.self_delimited() {
                            State::Json
                        } else {
                            State::Call
                        };
                        continue;
                    }
                    let partial = partial_suffix(&self.held, opener);
                    let body = &self.held[..self.held.len() - partial];
                    let ws = body.len() - body.trim_end().len();
                    let keep = if ws > MAX_WS { partial } else { partial + ws };
                    let emit = self.held.len() - keep;
                    let text: String = self.held.drain(..emit).collect();
                    push_delta(&mut out, ChatDelta::Content(text));
                    break;
                }
                State::Block => {
                    let n = self.held.len() - self.held.trim_start().len();
                    let ws: String = self.held.drain(..n).collect();
                    self.raw.push_str(&ws);
                    if self.held.is_empty() {
                        break;
                    }
                    if self.held.starts_with(call_open) {
                        self.raw.push_str(call_open);
                        self.held.drain(..call_open.len());
                        self.scanned = 0;
                        self.state = State::Call;
                    } else if self.held.starts_with(DS_CALLS_END) {
                        self.held.drain(..DS_CALLS_END.len());
                        self.raw.clear();
                        self.state = State::AfterCall;
                    } else if call_open.starts_with(self.held.as_str())
                        || DS_CALLS_END.starts_with(self.held.as_str())
                    {
                        break;
                    } else {
                        // Not a call: what the block held so far is content after all.
                        self.give_back(&mut out);
                    }
                }
                State::Call => {
                    let from = self.scanned;
                    match self.held[from..].find(call_close) {
                        Some(rel) => {
                            let pos = from + rel;
                            let body: String = self.held.drain(..pos).collect();
                            self.held.drain(..call_close.len());
                            self.raw.push_str(&body);
                            self.raw.push_str(call_close);
                            self.close_call(&body, &mut out);
                        }
                        None => {
                            if self.raw.len() + self.held.len() > MAX_HELD {
                                self.give_back(&mut out);
                                continue;
                            }
                            let mut s = self.held.len().saturating_sub(call_close.len());
                            while !self.held.is_char_boundary(s) {
                                s -= 1;
                            }
                            self.scanned = s;
                            break;
                        }
                    }
                }
            }
        }
        out
    }

    /// Ends the stream: held text is content, except a call that is complete but for its end
    /// tag, and the missing end of a DeepSeek block whose calls were read.
    pub fn finish(&mut self) -> Vec<ChatDelta> {
        let mut out = Vec::new();
        match self.state {
            State::Done | State::AfterCall => {}
            State::Json => self.give_back(&mut out),
            State::Text | State::Start => {
                let held = std::mem::take(&mut self.held);
                push_delta(&mut out, ChatDelta::Content(held));
            }
            State::Block => {
                if self.block_calls == 0 {
                    self.give_back(&mut out);
                }
                let rest = std::mem::take(&mut self.held);
                push_delta(&mut out, ChatDelta::Content(rest.trim().to_string()));
            }
            State::Call => {
                let body = std::mem::take(&mut self.held);
                match parse_call(&self.spec, &body) {
                    Some((name, args)) => self.report(name, args, &mut out),
                    None => {
                        self.raw.push_str(&body);
                        self.give_back(&mut out);
                    }
                }
            }
        }
        self.held.clear();
        self.raw.clear();
        self.state = State::Done;
        out
    }

    /// Gives the held markup back as content and reads on as text.
    fn give_back(&mut self, out: &mut Vec<ChatDelta>) {
        let mut text = std::mem::take(&mut self.raw);
        if matches!(self.state, State::Call | State::Json) {
            text.push_str(&std::mem::take(&mut self.held));
        }
        push_delta(out, ChatDelta::Content(text));
        self.state = State::Text;
    }

    /// One step in [`State::Json`]; `false` when more text is needed.
    fn json_step(&mut self, out: &mut Vec<ChatDelta>) -> bool {
        let format = self.spec.format;
        let mistral = format == ToolCallFormat::Mistral;
        match self.extent.scan(&self.held, mistral) {
            Scan::End(end) => {
                let body: String = self.held.drain(..end).collect();
                self.raw.push_str(&body);
                let calls = jsoncall::parse(mistral, &body)
                    .filter(|calls| calls.iter().all(|(name, _)| valid_name(name)));
                match calls {
                    Some(calls) => {
                        for (name, args) in calls {
                            if self.state == State::Done {
                                break;
                            }
                            self.report(name, Value::Object(args).to_string(), out);
                        }
                    }
                    None => self.reject(out),
                }
            }
            Scan::NotACall => {
                // What follows the offending character is read again as text.
                let bad: String = self.held.drain(..self.extent.pos()).collect();
                self.raw.push_str(&bad);
                self.reject(out);
            }
            Scan::More => {
                let implausible =
                    format == ToolCallFormat::Llama3 && !jsoncall::plausible_llama_head(&self.held);
                if !implausible && self.raw.len() + self.held.len() <= MAX_HELD {
                    return false;
                }
                self.give_back(out);
            }
        }
        true
    }

    fn close_call(&mut self, body: &str, out: &mut Vec<ChatDelta>) {
        match parse_call(&self.spec, body) {
            Some((name, args)) => self.report(name, args, out),
            None => self.reject(out),
        }
    }

    /// The markup consumed since the last call is content after all; reads on as text.
    fn reject(&mut self, out: &mut Vec<ChatDelta>) {
        push_delta(out, ChatDelta::Content(std::mem::take(&mut self.raw)));
        self.state = State::Text;
    }

    fn report(&mut self, name: String, args: String, out: &mut Vec<ChatDelta>) {
        let index = self.n_calls;
        self.n_calls += 1;
        self.block_calls += 1;
        self.raw.clear();
        out.push(ChatDelta::ToolCallStart { index, name });
        out.push(ChatDelta::ToolCallArgs { index, delta: args });
        self.state = if !self.spec.parallel {
            self.held.clear();
            State::Done
        } else if self.spec.format == ToolCallFormat::DeepSeek {
            State::Block
        } else {
            State::AfterCall
        };
    }
}

/// A call's name and its arguments (a JSON object, as text) from the text between its tags.
fn parse_call(spec: &ToolCallSpec, body: &str) -> Option<(String, String)> {
    let (name, args) = match spec.format {
        ToolCallFormat::DeepSeek => parse_deepseek(body)?,
        ToolCallFormat::Llama3 | ToolCallFormat::Mistral => return None,
        ToolCallFormat::Hermes | ToolCallFormat::Qwen3Coder => {
            let b = body.trim();
            if b.starts_with('{') {
                parse_json_call(b)?
            } else {
                parse_xml_call(spec, b)?
            }
        }
    };
    valid_name(&name).then(|| (name, Value::Object(args).to_string()))
}

/// Whether `name` can be a function's name (not empty, no whitespace or markup).
fn valid_name(name: &str) -> bool {
    !name.is_empty() && !name.contains(|c: char| c.is_whitespace() || c == '<' || c == '[')
}

/// `{"name": NAME, "arguments": {...}}` (`parameters` accepted for `arguments`).
fn parse_json_call(text: &str) -> Option<(String, Map<String, Value>)> {
    let v: Value = serde_json::from_str(text).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => Map::new(),
        Some(a) => args_object(a)?,
    };
    Some((name, args))
}

/// `<function=NAME>` then `<parameter=P>\nVALUE\n</parameter>` pieces then `</function>`.
fn parse_xml_call(spec: &ToolCallSpec, text: &str) -> Option<(String, Map<String, Value>)> {
    let rest = text.strip_prefix("<function=")?;
    let end = rest.find('>')?;
    let name = rest[..end].trim().to_string();
    let mut rest = &rest[end + 1..];
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            return after.trim().is_empty().then_some((name, args));
        }
        let p = rest.strip_prefix("<parameter=")?;
        let end = p.find('>')?;
        let param = p[..end].trim().to_string();
        let p = &p[end + 1..];
        let close = p.find("</parameter>")?;
        let raw = &p[..close];
        let value = raw.strip_prefix('\n').unwrap_or(raw);
        let value = value.strip_suffix('\n').unwrap_or(value);
        args.insert(param.clone(), spec.typed_value(&name, &param, value));
        rest = &p[close + "</parameter>".len()..];
    }
}

/// V3.1 `NAME<｜tool▁sep｜>{ARGS}` or R1 `function<｜tool▁sep｜>NAME\n```json\nARGS\n``` `.
fn parse_deepseek(body: &str) -> Option<(String, Map<String, Value>)> {
    let (head, rest) = body.split_once(DS_SEP)?;
    let rest = rest.trim();
    if rest.starts_with('{') {
        let args = args_object(&serde_json::from_str(rest).ok()?)?;
        return Some((head.trim().to_string(), args));
    }
    let (name, fenced) = rest.split_once('\n')?;
    let fenced = fenced.trim();
    let inner = fenced
        .strip_prefix("```json")
        .or_else(|| fenced.strip_prefix("```"))?
        .strip_suffix("```")?;
    let args = args_object(&serde_json::from_str(inner.trim()).ok()?)?;
    Some((name.trim().to_string(), args))
}
