//! Several completions in one request, as llama-server answers them: an array of prompts on
//! the completion routes (`"prompt": ["a", [1, 2], {"prompt_string": "b"}]`) and `n` choices on
//! the OpenAI routes. Each completion is its own job in the scheduler (they share the slots as
//! separate requests would); the answer comes when all have ended: on `/completion` an array
//! of answers, each with its `index`, on the OpenAI routes one answer whose `choices` hold one
//! choice per completion.

use axum::response::{IntoResponse, Json, Response};
use hmoe_tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::oai::{select_fields, Responder};
use crate::output::OutputKind;
use crate::params::{
    prompt_tokens, too_many_completions as too_many, Fields, Flavor, GenParams, MAX_COMPLETIONS,
};
use crate::parsed_body::ParsedBody;
use crate::registry::Lease;

/// The prompts of a completion request's `prompt`, tokenized. One prompt: a string, an array
/// of token ids, an array mixing ids and strings (one sequence), or an object with
/// `prompt_string`. Several: an array of those (strings, id arrays, objects).
pub fn prompts(req: &ParsedBody, tok: &Tokenizer) -> Result<Vec<Vec<u32>>, ApiError> {
    prompts_in(req, "prompt", tok, |n| {
        (n > MAX_COMPLETIONS).then(|| too_many(n))
    })
}

/// The prompts of the request's `key` (`prompt`, or the embedding routes' `input`), read as
/// [`prompts`] reads them; `limit` gives the error for an array of that many prompts (`None`:
/// not too many), checked before any is tokenized.
pub fn prompts_in(
    req: &ParsedBody,
    key: &str,
    tok: &Tokenizer,
    limit: impl Fn(usize) -> Option<ApiError>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    if let Some(ids) = req.ids(key) {
        return Ok(vec![ids.to_vec()]);
    }
    let prompt = req.get(key);
    match prompt {
        Some(Value::Array(a)) if !one_sequence(a) => {
            if let Some(e) = limit(a.len()) {
                return Err(e);
            }
            a.iter().map(|p| one_prompt(Some(p), tok)).collect()
        }
        _ => Ok(vec![one_prompt(prompt, tok)?]),
    }
}

/// Whether an array is one prompt: only ids, or ids and strings mixed (llama-server's rule).
fn one_sequence(a: &[Value]) -> bool {
    let ids = a.iter().filter(|v| v.is_u64()).count();
    ids > 0 && a.iter().all(|v| v.is_u64() || v.is_string())
}

/// One prompt: an object with `prompt_string` (llama-server's form for multimodal prompts;
/// hmoe's models read text only) or what [`prompt_tokens`] reads.
fn one_prompt(v: Option<&Value>, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let Some(Value::Object(o)) = v else {
        return prompt_tokens(v, tok);
    };
    let media = Fields(o).value("multimodal_data");
    if media.is_some_and(|m| m.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(ApiError::bad_request(
            "'multimodal_data': this model reads text only (no image or audio input)",
        ));
    }
    match Fields(o).str("prompt_string")? {
        Some(s) => prompt_tokens(Some(&Value::String(s.to_string())), tok),
        None => Err(ApiError::bad_request(
            "a prompt object needs 'prompt_string' (a string)",
        )),
    }
}

/// Runs one job per prompt and answers them together (see the module's note). Streams and
/// grammars take one completion a request: several are a 400.
pub async fn run_many(
    lease: Lease,
    flavor: Flavor,
    prompts: Vec<Vec<u32>>,
    mut gen: GenParams,
    output: OutputKind,
) -> Result<Response, ApiError> {
    if prompts.len() > MAX_COMPLETIONS {
        return Err(too_many(prompts.len()));
    }
    if gen.stream {
        return Err(ApiError::bad_request(
            "several prompts or choices are answered whole, not streamed: send 'stream': false \
             or one request per completion",
        ));
    }
    if gen.constraint.is_some() {
        return Err(ApiError::bad_request(
            "a grammar or response format constrains one completion a request: send one \
             request per prompt and 'n': 1",
        ));
    }
    let host = lease.host.clone();
    let mut jobs = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        jobs.push(host.submit(gen.job(prompt, output.clone()))?);
    }
    let mut bodies = Vec::with_capacity(jobs.len());
    for mut rx in jobs {
        let mut resp = Responder::new(flavor, &host.id, host.tokenizer.clone(), false)
            .with_post_sampling(gen.post_sampling_probs);
        while let Some(ev) = rx.recv().await {
            resp.collect(ev)?;
            if resp.is_done() {
                break;
            }
        }
        bodies.push(resp.response(gen.logprobs)?);
    }
    drop(lease);
    Ok(Json(combine(flavor, bodies, &gen.response_fields)).into_response())
}

/// The answers of several completions as one: `/completion`'s array, or the OpenAI routes'
/// choices (indexed in order) with the usage summed.
fn combine(flavor: Flavor, bodies: Vec<Value>, fields: &[String]) -> Value {
    if flavor == Flavor::Native {
        let all = bodies.into_iter().enumerate().map(|(i, mut b)| {
            b["index"] = i.into();
            if fields.is_empty() {
                b
            } else {
                select_fields(&b, fields)
            }
        });
        return Value::Array(all.collect());
    }
    let mut out = bodies.first().cloned().unwrap_or_else(|| json!({}));
    let mut choices = Vec::new();
    let mut usage = [0u64; 3];
    let keys = ["prompt_tokens", "completion_tokens", "total_tokens"];
    for (i, b) in bodies.iter().enumerate() {
        let mut choice = b["choices"][0].clone();
        choice["index"] = i.into();
        choices.push(choice);
        for (sum, key) in usage.iter_mut().zip(keys) {
            *sum += b["usage"][key].as_u64().unwrap_or(0);
        }
    }
    out["choices"] = Value::Array(choices);
    for (sum, key) in usage.iter().zip(keys) {
        out["usage"][key] = (*sum).into();
    }
    out
}
