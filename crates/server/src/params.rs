//! Reading request bodies: typed field access with OpenAI-style 400s, and the generation
//! settings shared by the completion routes.

use std::sync::Arc;

use hmoe_engine::{DryParams, Mirostat, SamplerParams, SamplerStage};
use hmoe_grammar::{
    CompileCancel, Constraint, Frame, Grammar, GrammarError, Tool, ToolFormat, Vocab,
};
use hmoe_tokenizer::Tokenizer;
use serde_json::{Map, Value};

use crate::config::SamplingDefaults;
use crate::error::ApiError;
use crate::model_host::ModelHost;
use crate::output::OutputKind;
use crate::sampling::LogitAdjust;
use crate::scheduler::JobSpec;

/// Typed access to the fields of a request object.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    /// A number.
    pub fn f64(&self, key: &str) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| ApiError::bad_request(format!("'{key}' must be a number"))),
        }
    }

    /// A number as f32.
    pub fn f32(&self, key: &str) -> Result<Option<f32>, ApiError> {
        Ok(self.f64(key)?.map(|v| v as f32))
    }

    /// An integer (a float with no fraction is accepted).
    pub fn i64(&self, key: &str) -> Result<Option<i64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match (v.as_i64(), v.as_f64()) {
                (Some(i), _) => Ok(Some(i)),
                (None, Some(f)) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
                _ => Err(ApiError::bad_request(format!("'{key}' must be an integer"))),
            },
        }
    }

    /// A non-negative integer.
    pub fn usize(&self, key: &str) -> Result<Option<usize>, ApiError> {
        match self.i64(key)? {
            None => Ok(None),
            Some(i) if i >= 0 => Ok(Some(i as usize)),
            Some(_) => Err(ApiError::bad_request(format!(
                "'{key}' must not be negative"
            ))),
        }
    }

    /// A boolean.
    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| ApiError::bad_request(format!("'{key}' must be a boolean"))),
        }
    }

    /// A string.
    pub fn str(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| ApiError::bad_request(format!("'{key}' must be a string"))),
        }
    }

    /// The raw value.
    pub fn value(&self, key: &str) -> Option<&'a Value> {
        self.get(key)
    }
}

/// Which route's conventions apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// `/v1/chat/completions`: `logprobs: bool` + `top_logprobs: N`.
    Chat,
    /// `/v1/completions`: `logprobs: N`.
    Completion,
    /// `/completion` (llama.cpp native): `n_probs: N`.
    Native,
}

/// Generation settings of a request.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// Sampler chain.
    pub sampling: SamplerParams,
    /// Token limit.
    pub n_predict: Option<usize>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Report log-probabilities of the chosen tokens.
    pub logprobs: bool,
    /// Alternatives per token.
    pub n_probs: usize,
    /// Probabilities after the sampler chain (`/completion`'s `post_sampling_probs`).
    pub post_sampling_probs: bool,
    /// Penalties and bias.
    pub adjust: LogitAdjust,
    /// Ignore end-of-generation tokens.
    pub ignore_eos: bool,
    /// Stream with SSE.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
    /// Reuse cached prompt prefixes.
    pub cache_prompt: bool,
    /// Grammar the output must follow (`grammar`, `json_schema`, `response_format`,
    /// `tool_choice`) and where it goes, until [`GenParams::compile`] compiles it.
    pub grammar: Option<(Grammar, Frame)>,
    /// The compiled grammar.
    pub constraint: Option<Constraint>,
    /// Stop at a newline once generation has run this long (`t_max_predict_ms`).
    pub t_max_predict: Option<std::time::Duration>,
    /// The slot to run in (`id_slot`; `None`: any).
    pub id_slot: Option<usize>,
    /// The fields of a whole `/completion` answer to send, by path (`response_fields`;
    /// empty: all).
    pub response_fields: Vec<String>,
    /// Add llama-server's `__verbose` object to a whole answer (the request's `verbose`, or
    /// the server's `--verbose`).
    pub verbose: bool,
}

impl GenParams {
    /// Compiles the requested grammar for `host`'s vocabulary (see [`compile_constraint`]); call
    /// before [`GenParams::job`].
    pub async fn compile(&mut self, host: &Arc<ModelHost>) -> Result<(), ApiError> {
        if let Some((grammar, frame)) = self.grammar.take() {
            self.constraint = Some(compile_constraint(host, grammar, frame).await?);
        }
        Ok(())
    }

    /// The scheduler's job for `prompt` with these settings, its output read as `output`; the
    /// request's constraint moves into the job.
    pub fn job(&mut self, prompt: Vec<u32>, output: OutputKind) -> JobSpec {
        debug_assert!(self.grammar.is_none(), "GenParams::compile comes first");
        JobSpec {
            prompt,
            n_predict: self.n_predict,
            sampling: self.sampling.clone(),
            adjust: self.adjust.clone(),
            logprobs: self.logprobs,
            n_probs: self.n_probs,
            post_sampling_probs: self.post_sampling_probs,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            output,
            cache_prompt: self.cache_prompt,
            constraint: self.constraint.take(),
            t_max_predict: self.t_max_predict,
            id_slot: self.id_slot,
        }
    }
}

/// Most completions one request may ask for (prompts times `n`).
pub const MAX_COMPLETIONS: usize = 16;

/// `n`: how many choices the request asks for (1 to [`MAX_COMPLETIONS`]).
pub fn choices(f: &Fields<'_>) -> Result<usize, ApiError> {
    match f.i64("n")? {
        None => Ok(1),
        Some(n) if n < 1 => Err(ApiError::bad_request("'n' must be 1 or more")),
        Some(n) if n as u64 > MAX_COMPLETIONS as u64 => Err(too_many_completions(n as usize)),
        Some(n) => Ok(n as usize),
    }
}

/// The 400 for a request asking for `n` completions, more than [`MAX_COMPLETIONS`].
pub fn too_many_completions(n: usize) -> ApiError {
    ApiError::bad_request(format!(
        "{n} completions asked for in one request; at most {MAX_COMPLETIONS}"
    ))
}

/// Most alternatives per token a request may ask for.
pub const MAX_PROBS: usize = 100;

/// Most stop strings a request may give, and the longest one in bytes: every generated token
/// is checked against all of them.
pub const MAX_STOP: (usize, usize) = (64, 1024);

/// Reads the generation settings common to the completion routes. A grammar the request asks
/// for is checked for shape here and compiled by [`GenParams::compile`]; `tool_format` is how
/// a forced chat tool call is written (the chat template's format; see
/// [`crate::chat_format::ChatSetup::forced_tool_format`]).
pub fn gen_params(
    f: &Fields<'_>,
    defaults: &SamplingDefaults,
    flavor: Flavor,
    tok: &Arc<Tokenizer>,
    tool_format: Option<ToolFormat>,
) -> Result<GenParams, ApiError> {
    let d = &defaults.params;
    let mut sampling = d.clone();
    if let Some(t) = f.f32("temperature")? {
        sampling.temperature = t;
    }
    if let Some(p) = f.f32("top_p")? {
        // llama-server clamps: 1 or more keeps every token, 0 or less the likeliest one.
        sampling.top_p = p.clamp(0.0, 1.0);
    }
    if let Some(k) = f.i64("top_k")? {
        sampling.top_k = k.max(0) as usize;
    }
    if let Some(p) = f.f32("min_p")? {
        sampling.min_p = p;
    }
    if let Some(p) = f.f32("repeat_penalty")? {
        sampling.repeat_penalty = p;
    }
    if let Some(n) = f.i64("repeat_last_n")? {
        sampling.repeat_last_n = n.max(0) as usize;
    }
    sampler_fields(f, defaults, tok, &mut sampling)?;
    unsupported_fields(f)?;
    sampling.seed = match f.i64("seed")? {
        Some(s) if s >= 0 => s as u64,
        _ if !defaults.random_seed => d.seed,
        _ => rand::random::<u32>() as u64,
    };
    let mut n_predict = defaults.n_predict;
    for key in ["n_predict", "max_tokens", "max_completion_tokens"] {
        if let Some(n) = f.i64(key)? {
            n_predict = if n < 0 { None } else { Some(n as usize) };
        }
    }
    let stop = match f.value("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    ApiError::bad_request("'stop' must be a string or an array of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::bad_request(
                "'stop' must be a string or an array of strings",
            ))
        }
    };
    let (max_count, max_len) = MAX_STOP;
    if stop.len() > max_count || stop.iter().any(|s| s.len() > max_len) {
        return Err(ApiError::bad_request(format!(
            "'stop' may hold at most {max_count} strings of at most {max_len} bytes each"
        )));
    }
    let (logprobs, n_probs) = match flavor {
        Flavor::Chat => {
            let on = f.bool("logprobs")?.unwrap_or(false);
            let top = f.usize("top_logprobs")?.unwrap_or(0);
            if top > 0 && !on {
                return Err(ApiError::bad_request(
                    "'top_logprobs' needs 'logprobs': true",
                ));
            }
            (
                on,
                if on {
                    top.max(f.usize("n_probs")?.unwrap_or(0))
                } else {
                    0
                },
            )
        }
        Flavor::Completion => match f.value("logprobs") {
            Some(Value::Bool(b)) => (*b, 0),
            _ => match f.usize("logprobs")? {
                Some(n) => (true, n),
                None => (false, 0),
            },
        },
        Flavor::Native => {
            let n = f.usize("n_probs")?.unwrap_or(0);
            (n > 0, n)
        }
    };
    if n_probs > MAX_PROBS {
        return Err(ApiError::bad_request(format!(
            "at most {MAX_PROBS} alternatives per token may be asked for"
        )));
    }
    // `n` (choices): checked here, run by the routes (crate::multi).
    choices(f)?;
    let adjust = LogitAdjust {
        presence: (f.f32("presence_penalty")?).unwrap_or(defaults.presence_penalty),
        frequency: (f.f32("frequency_penalty")?).unwrap_or(defaults.frequency_penalty),
        bias: logit_bias(f.value("logit_bias"), tok)?,
    };
    let grammar = constraint(f, flavor, tok, tool_format)?;
    let include_usage = match f.value("stream_options") {
        Some(Value::Object(o)) => o
            .get("include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        Some(_) => return Err(ApiError::bad_request("'stream_options' must be an object")),
        None => false,
    };
    Ok(GenParams {
        sampling,
        n_predict,
        stop,
        logprobs,
        n_probs,
        post_sampling_probs: flavor == Flavor::Native
            && f.bool("post_sampling_probs")?.unwrap_or(false),
        adjust,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        stream: f.bool("stream")?.unwrap_or(false),
        include_usage,
        cache_prompt: f.bool("cache_prompt")?.unwrap_or(true),
        grammar,
        constraint: None,
        t_max_predict: match f.i64("t_max_predict_ms")? {
            Some(ms) if ms > 0 => Some(std::time::Duration::from_millis(ms as u64)),
            _ => None,
        },
        response_fields: response_fields(f, flavor)?,
        verbose: f.bool("verbose")?.unwrap_or(false),
        id_slot: match f.i64("id_slot")? {
            None | Some(-1) => None,
            Some(i) if i >= 0 => Some(i as usize),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "'id_slot' must be -1 (any) or a slot id",
                ))
            }
        },
    })
}

/// The sampler fields beyond the basic cuts: `typical_p`, `top_n_sigma`, XTC, DRY, mirostat,
/// `min_keep` and the chain's order (`samplers`), as llama-server reads them.
fn sampler_fields(
    f: &Fields<'_>,
    defaults: &SamplingDefaults,
    tok: &Tokenizer,
    s: &mut SamplerParams,
) -> Result<(), ApiError> {
    let bad = |m: &str| ApiError::bad_request(m.to_string());
    if let Some(p) = f.f32("typical_p")? {
        s.typical_p = p;
    }
    if let Some(n) = f.f32("top_n_sigma")? {
        s.top_n_sigma = n;
    }
    if let Some(p) = f.f32("xtc_probability")? {
        s.xtc_probability = p;
    }
    if let Some(t) = f.f32("xtc_threshold")? {
        s.xtc_threshold = t;
    }
    if let Some(m) = f.f32("dry_multiplier")? {
        s.dry.multiplier = m;
    }
    if let Some(b) = f.f32("dry_base")? {
        s.dry.base = b;
    }
    if let Some(n) = f.i64("dry_allowed_length")? {
        s.dry.allowed_length = n.max(0) as usize;
    }
    if let Some(n) = f.i64("dry_penalty_last_n")? {
        s.dry.penalty_last_n = dry_last_n(n)?;
    }
    let breakers = match f.value("dry_sequence_breakers") {
        None => None,
        Some(Value::Array(a)) if !a.is_empty() => Some(
            a.iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<String>>>()
                .ok_or_else(|| bad("'dry_sequence_breakers' must be an array of strings"))?,
        ),
        Some(_) => {
            return Err(bad(
                "'dry_sequence_breakers' must be a non-empty array of strings",
            ))
        }
    };
    if s.dry.enabled() {
        let strings = breakers
            .as_deref()
            .unwrap_or(&defaults.dry_sequence_breakers);
        s.dry.breakers = dry_breakers(strings, tok);
    }
    match f.i64("mirostat")? {
        None => {}
        Some(0) => s.mirostat = Mirostat::Off,
        Some(1) => s.mirostat = Mirostat::V1,
        Some(2) => s.mirostat = Mirostat::V2,
        Some(_) => return Err(bad("'mirostat' must be 0 (off), 1 or 2")),
    }
    if let Some(t) = f.f32("mirostat_tau")? {
        s.mirostat_tau = t;
    }
    if let Some(e) = f.f32("mirostat_eta")? {
        s.mirostat_eta = e;
    }
    if let Some(n) = f.i64("min_keep")? {
        s.min_keep = n.max(0) as usize;
    }
    if let Some(v) = f.value("samplers") {
        s.order = sampler_order(v)?;
    }
    Ok(())
}

/// `dry_penalty_last_n`: -1 is the whole context, 0 turns DRY off.
pub fn dry_last_n(n: i64) -> Result<Option<usize>, ApiError> {
    match n {
        -1 => Ok(None),
        n if n >= 0 => Ok(Some(n as usize)),
        _ => Err(ApiError::bad_request(
            "'dry_penalty_last_n' must be -1 (the whole context) or more",
        )),
    }
}

/// DRY's sequence breakers for `tok`'s vocabulary (see [`DryParams::breakers_of`]).
pub fn dry_breakers(strings: &[String], tok: &Tokenizer) -> Vec<(u32, Vec<u32>)> {
    DryParams::breakers_of(
        strings,
        tok.n_vocab(),
        |id| tok.decode(&[id]),
        |tail| {
            tok.encode(&String::from_utf8_lossy(tail), false, false)
                .unwrap_or_default()
        },
    )
}

/// `samplers`: llama-server's stage names in order (an array), or their letters in a string
/// (`"edskypmxt"`). A stage hmoe lacks is a 400.
pub fn sampler_order(v: &Value) -> Result<Vec<SamplerStage>, ApiError> {
    let names = SamplerStage::DEFAULT_ORDER
        .map(SamplerStage::name)
        .join(", ");
    let unknown = |what: String| {
        ApiError::bad_request(format!(
            "'samplers': hmoe has no sampler {what} (it has {names})"
        ))
    };
    match v {
        Value::Array(a) => a
            .iter()
            .map(|n| match n.as_str() {
                Some(name) => {
                    SamplerStage::from_name(name).ok_or_else(|| unknown(format!("'{name}'")))
                }
                None => Err(ApiError::bad_request(
                    "'samplers' must be an array of sampler names or a string of their letters",
                )),
            })
            .collect(),
        Value::String(chars) => chars
            .chars()
            .map(|c| SamplerStage::from_char(c).ok_or_else(|| unknown(format!("letter '{c}'"))))
            .collect(),
        _ => Err(ApiError::bad_request(
            "'samplers' must be an array of sampler names or a string of their letters",
        )),
    }
}

/// llama-server fields hmoe does not implement: a neutral value is accepted, anything else
/// is a 400 that says so. `n_keep` says what to keep when a full context shifts; hmoe never
/// shifts a context (a full one ends the generation, as llama-server's default
/// `--no-context-shift` does), so no value changes anything.
fn unsupported_fields(f: &Fields<'_>) -> Result<(), ApiError> {
    let no = |what: &str| ApiError::bad_request(format!("hmoe does not support {what}"));
    if let Some(n) = f.i64("n_keep")? {
        if n < -1 {
            return Err(ApiError::bad_request("'n_keep' must be -1 (all) or more"));
        }
    }
    if f.i64("n_indent")?.is_some_and(|n| n > 0) {
        return Err(no("'n_indent' (a minimum indentation of generated lines)"));
    }
    match f.value("lora") {
        None => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => return Err(no("'lora' (LoRA adapters); send [] or leave it out")),
    }
    Ok(())
}

/// `response_fields`: paths (`a/b`) of the fields a whole `/completion` answer keeps, as
/// llama-server reads them. The OpenAI routes and streams have fixed shapes: a non-empty list
/// there is a 400.
fn response_fields(f: &Fields<'_>, flavor: Flavor) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::bad_request("'response_fields' must be an array of strings");
    let fields: Vec<String> = match f.value("response_fields") {
        None => Vec::new(),
        Some(Value::Array(a)) => (a.iter())
            .map(|v| v.as_str().map(str::to_string).ok_or_else(bad))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad()),
    };
    if !fields.is_empty() && (flavor != Flavor::Native || f.bool("stream")? == Some(true)) {
        return Err(ApiError::bad_request(
            "hmoe applies 'response_fields' to whole /completion answers only (not to streams \
             or the OpenAI routes)",
        ));
    }
    Ok(fields)
}

/// The grammar a request asks for: `grammar` (GBNF; Lark after `%llguidance`) and
/// `json_schema` (llama.cpp), `response_format` `json_object` / `json_schema` (OpenAI), and on
/// chat `tool_choice` `"required"` or a named function, written in the model's tool-call format.
/// On a gpt-oss chat a response format is the `final` channel's content. At most one may be
/// given.
fn constraint(
    f: &Fields<'_>,
    flavor: Flavor,
    tok: &Arc<Tokenizer>,
    tool_format: Option<ToolFormat>,
) -> Result<Option<(Grammar, Frame)>, ApiError> {
    let bad = |m: &str| ApiError::bad_request(m.to_string());
    let mut asked: Vec<Grammar> = Vec::new();
    if let Some(g) = f.str("grammar")? {
        asked.push(match g.trim_start().strip_prefix("%llguidance") {
            Some(_) => Grammar::Lark(g.to_string()),
            None => Grammar::Gbnf(g.to_string()),
        });
    }
    if let Some(s) = f.value("json_schema") {
        asked.push(Grammar::JsonSchema(s.clone()));
    }
    match f.value("response_format") {
        None => {}
        Some(Value::Object(o)) => {
            match o.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some("json_object") => asked.push(match o.get("schema") {
                    Some(s) => Grammar::JsonSchema(s.clone()),
                    None => Grammar::JsonObject,
                }),
                Some("json_schema") => {
                    let schema = o
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .or_else(|| o.get("schema"))
                    .ok_or_else(|| bad("'response_format' json_schema needs 'json_schema': {'schema': ...}"))?;
                    asked.push(Grammar::JsonSchema(schema.clone()));
                }
                _ => return Err(bad(
                    "'response_format' type must be \"text\", \"json_object\" or \"json_schema\"",
                )),
            }
        }
        Some(_) => return Err(bad("'response_format' must be an object")),
    }
    let mut frame = Frame::Raw;
    if flavor == Flavor::Chat {
        if ToolFormat::detect(tok) == Some(ToolFormat::Harmony) {
            frame = Frame::HarmonyFinal;
        }
        if let Some(call) = tool_call(f, tool_format)? {
            asked.push(call);
            frame = Frame::Raw;
        }
    }
    if asked.len() > 1 {
        return Err(bad(
            "give at most one of 'grammar', 'json_schema', 'response_format' and a forced 'tool_choice'",
        ));
    }
    Ok(asked.pop().map(|g| (g, frame)))
}

/// Compiles `grammar` in `frame` for `host`'s vocabulary, on a blocking thread: the first
/// request builds the vocabulary (seconds for a 200k vocabulary), which no async worker waits
/// on, and later ones reuse it. An invalid grammar or schema, or one over hmoe-grammar's
/// limits (size, rules, terminals, nesting, compile time), is a 400 with a one-line message;
/// no thread for the compiler is a 503. A client that leaves drops this future, which stops
/// the compilation (its [`CompileCancel`]) and frees its place among the compilations.
pub async fn compile_constraint(
    host: &Arc<ModelHost>,
    grammar: Grammar,
    frame: Frame,
) -> Result<Constraint, ApiError> {
    let host = host.clone();
    let cancel = CompileCancel::new();
    let on_drop = CancelOnDrop(Some(cancel.clone()));
    let built = tokio::task::spawn_blocking(move || {
        let vocab = host
            .vocab
            .get_or_init(|| Vocab::new(&host.tokenizer).map(Arc::new))
            .clone()?;
        vocab.compile_until(&grammar, frame, &cancel)
    })
    .await;
    on_drop.disarm();
    let built = built.map_err(|e| ApiError::internal(format!("compiling the grammar: {e}")))?;
    built.map_err(|e| match e {
        GrammarError::Unavailable(_) => ApiError::unavailable(e.to_string()),
        _ => ApiError::bad_request(e.to_string()),
    })
}

/// Cancels a compilation when the request waiting for it is dropped (the client left), unless
/// disarmed first.
struct CancelOnDrop(Option<CompileCancel>);

impl CancelOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.cancel();
        }
    }
}

/// The tool-call grammar of `tool_choice` `"required"` (any of `tools`) or a named function.
fn tool_call(f: &Fields<'_>, format: Option<ToolFormat>) -> Result<Option<Grammar>, ApiError> {
    let wanted: Option<&str> = match f.value("tool_choice") {
        Some(Value::String(s)) if s == "required" => None,
        Some(Value::Object(o)) => match o.get("function").and_then(|x| x.get("name")) {
            Some(Value::String(n)) => Some(n.as_str()),
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let tools: Vec<Tool> = match f.value("tools") {
        Some(Value::Array(t)) => t
            .iter()
            .filter_map(|t| {
                let func = t.get("function")?;
                Some(Tool {
                    name: func.get("name")?.as_str()?.to_string(),
                    parameters: func.get("parameters").filter(|p| !p.is_null()).cloned(),
                })
            })
            .filter(|t| wanted.is_none_or(|w| w == t.name))
            .collect(),
        _ => Vec::new(),
    };
    if tools.is_empty() {
        return Err(ApiError::bad_request(match wanted {
            Some(w) => format!("'tool_choice' names '{w}', which is not among 'tools'"),
            None => "'tool_choice': \"required\" needs 'tools'".to_string(),
        }));
    }
    let Some(format) = format else {
        return Err(ApiError::bad_request(
            "this model's chat format has no tool-call markup hmoe can enforce (harmony, <tool_call> tags or DeepSeek's)",
        ));
    };
    Ok(Some(Grammar::ToolCall { format, tools }))
}

/// `logit_bias` as OpenAI (`{"id": bias}`) or llama.cpp (`[[id or text, bias or false], ...]`)
/// writes it; `false` bans a token. Text keys bias every token of the text.
fn logit_bias(v: Option<&Value>, tok: &Tokenizer) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = || ApiError::bad_request("'logit_bias' must map token ids to numbers");
    let bias_of = |b: &Value| -> Result<f32, ApiError> {
        match b {
            Value::Bool(false) => Ok(f32::NEG_INFINITY),
            Value::Number(n) => n.as_f64().map(|x| x as f32).ok_or_else(bad),
            _ => Err(bad()),
        }
    };
    // A token id outside the vocabulary is ignored, as llama-server does.
    let id = |i: i128| -> Vec<u32> {
        match usize::try_from(i) {
            Ok(i) if i < tok.n_vocab() => vec![i as u32],
            _ => Vec::new(),
        }
    };
    let ids_of = |k: &Value| -> Result<Vec<u32>, ApiError> {
        match k {
            Value::Number(n) => match (n.as_i64(), n.as_u64()) {
                (Some(i), _) => Ok(id(i.into())),
                (_, Some(u)) => Ok(id(u.into())),
                _ => Err(bad()),
            },
            Value::String(s) => match s.parse::<i128>() {
                Ok(i) => Ok(id(i)),
                Err(_) => tok.encode(s, false, false).map_err(|_| bad()),
            },
            _ => Err(bad()),
        }
    };
    let mut out = Vec::new();
    match v {
        None => {}
        Some(Value::Object(m)) => {
            for (k, b) in m {
                let b = bias_of(b)?;
                for id in ids_of(&Value::String(k.clone()))? {
                    out.push((id, b));
                }
            }
        }
        Some(Value::Array(a)) => {
            for pair in a {
                let Some([k, b]) = pair.as_array().map(Vec::as_slice) else {
                    return Err(bad());
                };
                let b = bias_of(b)?;
                for id in ids_of(k)? {
                    out.push((id, b));
                }
            }
        }
        Some(_) => return Err(bad()),
    }
    Ok(out)
}

/// A completion prompt: text, token ids, or a mix (llama.cpp); a one-element list of either.
pub fn prompt_tokens(v: Option<&Value>, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::bad_request(
            "'prompt' must be a string, an array of token ids, or a one-element array of those",
        )
    };
    let encode = |s: &str, first: bool| {
        tok.encode(s, first, true)
            .map_err(|e| ApiError::bad_request(format!("tokenizing the prompt: {e}")))
    };
    let id = |v: &Value| -> Result<u32, ApiError> {
        v.as_u64()
            .filter(|&i| i <= u32::MAX as u64)
            .map(|i| i as u32)
            .ok_or_else(bad)
    };
    match v {
        Some(Value::String(s)) => encode(s, true),
        Some(Value::Array(a)) if a.len() == 1 && (a[0].is_string() || a[0].is_array()) => {
            prompt_tokens(Some(&a[0]), tok)
        }
        Some(Value::Array(a)) if a.iter().any(Value::is_array) => Err(ApiError::bad_request(
            "several prompts in one request are not supported; send one request per prompt",
        )),
        Some(Value::Array(a))
            if a.iter().filter(|v| v.is_string()).count() > 1 && a.iter().all(Value::is_string) =>
        {
            Err(ApiError::bad_request(
                "several prompts in one request are not supported; send one request per prompt",
            ))
        }
        Some(Value::Array(a)) => {
            let mut out = Vec::new();
            for (i, part) in a.iter().enumerate() {
                match part {
                    Value::String(s) => out.extend(encode(s, i == 0)?),
                    other => out.push(id(other)?),
                }
            }
            Ok(out)
        }
        _ => Err(bad()),
    }
}
