//! Chat requests to prompts: the request's messages and tools rendered with the model's chat
//! template, its reasoning format and template variables read, and the prompt tokenized with
//! the generation settings ready to run.

use std::borrow::Cow;

use hmoe_chat::ReasoningFormat;
use hmoe_grammar::Grammar;
use serde_json::{Map, Value};

use crate::chat_messages::{joined_content, normalize_messages, normalize_tools};
use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::model_host::ModelHost;
use crate::output::OutputKind;
use crate::params::{gen_params, Fields, Flavor, GenParams};
use crate::parsed_body::{blocking, ParsedBody};
use crate::plain_content::RenderedPrompt;
use crate::registry::Lease;
use crate::state::AppState;

/// A chat request ready to run: the model held, the prompt, the settings and how to read the
/// output.
pub struct PreparedChat {
    /// The model.
    pub lease: Lease,
    /// The rendered and tokenized prompt.
    pub prompt: Vec<u32>,
    /// The generation settings.
    pub gen: GenParams,
    /// How to read the output.
    pub output: OutputKind,
}

/// How a route's request becomes a chat request (OpenAI chat fields): the chat route's own
/// body as it is, another API's converted.
pub type ToChat =
    for<'a> fn(&'a Map<String, Value>) -> Result<Cow<'a, Map<String, Value>>, ApiError>;

/// Takes the model named by the body's `model`, turns the body into a chat request with
/// `to_chat`, renders it and reads its generation settings. Everything that takes time in
/// proportion to the body (conversion, template, tokenizer) runs on a blocking thread.
pub async fn prepare_chat(
    st: &AppState,
    req: &ParsedBody,
    to_chat: ToChat,
) -> Result<PreparedChat, ApiError> {
    let lease = st.registry.acquire(Fields(req).str("model")?).await?;
    let host = lease.host.clone();
    let config = st.config.clone();
    let body = req.clone();
    let (prompt, mut gen, output) = blocking(move || {
        let req = to_chat(&body)?;
        let Rendered {
            prompt: rendered,
            format,
            tools,
            thinking,
        } = render_chat(&config, &host, &req)?;
        let chat = host.chat()?;
        // As llama-server: several calls may follow one another unless the request says not.
        let parallel = Fields(&req).bool("parallel_tool_calls")?.unwrap_or(true);
        let prompt = chat.tokenize(&host.tokenizer, &rendered)?;
        let gen = gen_params(
            &Fields(&req),
            &config.sampling,
            Flavor::Chat,
            &host.tokenizer,
            chat.forced_tool_format(&host.tokenizer),
        )?;
        // A grammar hmoe wrote (a forced call, a response format) is the answer from the
        // first token: there is no reasoning to read, even after an open `<think>`.
        let answer_only = gen.grammar.as_ref().is_some_and(|(g, _)| {
            matches!(
                g,
                Grammar::ToolCall { .. } | Grammar::JsonSchema(_) | Grammar::JsonObject
            )
        });
        let output = chat.output_kind(
            &rendered.text,
            format,
            tools.as_ref(),
            parallel,
            thinking && !answer_only,
            !answer_only,
        );
        Ok((prompt, gen, output))
    })
    .await?;
    gen.compile(&lease.host).await?;
    Ok(PreparedChat {
        lease,
        prompt,
        gen,
        output,
    })
}

/// The prompt `req` renders to (`to_chat` as in [`prepare_chat`]) and, with `count`, its
/// length in tokens, made on a blocking thread.
pub async fn chat_prompt(
    st: &AppState,
    req: &ParsedBody,
    to_chat: ToChat,
    count: bool,
) -> Result<(String, Option<usize>), ApiError> {
    let lease = st.registry.acquire(Fields(req).str("model")?).await?;
    let host = lease.host.clone();
    let config = st.config.clone();
    let body = req.clone();
    blocking(move || {
        let req = to_chat(&body)?;
        let prompt = render_chat(&config, &host, &req)?.prompt;
        let n = match count {
            true => Some(host.chat()?.tokenize(&host.tokenizer, &prompt)?.len()),
            false => None,
        };
        Ok((prompt.text, n))
    })
    .await
}

/// A chat request rendered.
struct Rendered {
    /// The prompt.
    prompt: RenderedPrompt,
    /// Where its reasoning goes.
    format: ReasoningFormat,
    /// The tools the template was given (`None`: none, or `tool_choice` `"none"`).
    tools: Option<Value>,
    /// Whether thinking is on (`enable_thinking` as the template saw it).
    thinking: bool,
}

/// The template variables of a request: `--chat-template-kwargs` overridden by the request's
/// `chat_template_kwargs`, its `reasoning_effort`, and `enable_thinking` always set to a
/// boolean as llama-server sets it (true unless `--reasoning off`, `--reasoning-budget 0` or a
/// kwarg says `false`; a kwarg that is a string is a 400, one of another type is ignored).
fn template_vars(
    config: &ServerConfig,
    f: &Fields<'_>,
) -> Result<(Map<String, Value>, bool), ApiError> {
    let mut extra = config.chat.template_kwargs.clone();
    match f.value("chat_template_kwargs") {
        None => {}
        Some(Value::Object(kw)) => extra.extend(kw.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "'chat_template_kwargs' must be an object",
            ))
        }
    }
    let server_default = config.chat.template_kwargs.get("enable_thinking");
    let thinking = match extra.get("enable_thinking") {
        Some(Value::Bool(b)) => *b,
        Some(Value::String(_)) => {
            return Err(ApiError::bad_request(
                "invalid type for \"enable_thinking\" (expected boolean, got string)",
            ))
        }
        _ => server_default.and_then(Value::as_bool).unwrap_or(true),
    };
    extra.insert("enable_thinking".into(), thinking.into());
    if let Some(effort) = f.str("reasoning_effort")? {
        extra.insert("reasoning_effort".into(), effort.into());
    }
    Ok((extra, thinking))
}

/// Renders a chat request with the model's template.
fn render_chat(
    config: &ServerConfig,
    host: &ModelHost,
    req: &Map<String, Value>,
) -> Result<Rendered, ApiError> {
    let f = Fields(req);
    let chat = host.chat()?;
    let messages = normalize_messages(req.get("messages"))?;
    let choice = f.value("tool_choice");
    match choice {
        None => {}
        Some(Value::String(s)) if matches!(s.as_str(), "auto" | "none" | "required") => {}
        Some(Value::Object(o))
            if o.get("function")
                .and_then(|f| f.get("name"))
                .is_some_and(Value::is_string) => {}
        Some(_) => {
            return Err(ApiError::bad_request(
                "'tool_choice' must be \"auto\", \"none\", \"required\" or a function",
            ))
        }
    }
    let tools = normalize_tools(f.value("tools"), choice)?;
    let format = match f.str("reasoning_format")? {
        Some(s) => s
            .parse()
            .map_err(|e: hmoe_chat::ChatError| ApiError::bad_request(e.to_string()))?,
        None => config.chat.reasoning_format,
    };
    let (extra, thinking) = template_vars(config, &f)?;
    let add_generation_prompt = f.bool("add_generation_prompt")?;
    let (messages, prefill) = split_prefill(
        messages,
        req.get("messages"),
        f.bool("continue_final_message")?,
        add_generation_prompt,
        !config.chat.no_prefill_assistant,
    )?;
    let add_generation_prompt = prefill.is_some() || add_generation_prompt.unwrap_or(true);
    let mut prompt = chat.render(&messages, tools.as_ref(), add_generation_prompt, extra)?;
    // As llama-server, a continued answer is read as written: no reasoning split.
    let format = match prefill {
        Some(text) => {
            prompt.push_plain(&text);
            ReasoningFormat::None
        }
        None => format,
    };
    Ok(Rendered {
        prompt,
        format,
        tools,
        thinking,
    })
}

/// The conversation to render and the text that continues its generation prompt: as
/// llama-server, a conversation ending with an assistant message (with `--prefill-assistant`,
/// the default) is continued from that message's content, not closed: the messages before it
/// are rendered with the generation prompt and the content follows as written. vLLM's and
/// transformers' `continue_final_message: true` asks for the same explicitly (with
/// `add_generation_prompt: true` it is a 400, as there), `false` renders the message as a
/// closed turn. Two assistant messages at the end cannot be continued (400). `raw` is the
/// request's `messages`: the continued content's text parts are joined by blank lines, as
/// llama-server appends them.
fn split_prefill(
    messages: Value,
    raw: Option<&Value>,
    continue_final: Option<bool>,
    add_generation_prompt: Option<bool>,
    prefill_assistant: bool,
) -> Result<(Value, Option<String>), ApiError> {
    if continue_final == Some(true) && add_generation_prompt == Some(true) {
        return Err(ApiError::bad_request(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true",
        ));
    }
    let wanted = continue_final.unwrap_or(prefill_assistant);
    let Value::Array(mut list) = messages else {
        return Ok((messages, None));
    };
    let last_is_assistant =
        |l: &[Value]| l.last().and_then(|m| m.get("role")) == Some(&Value::from("assistant"));
    if !wanted || !last_is_assistant(&list) {
        return Ok((Value::Array(list), None));
    }
    let last = list.pop().unwrap_or_default();
    if last_is_assistant(&list) {
        return Err(ApiError::bad_request(
            "Cannot have 2 or more assistant messages at the end of the list.",
        ));
    }
    let content = (raw.and_then(Value::as_array).and_then(|l| l.last()))
        .or(Some(&last))
        .and_then(|m| m.get("content"))
        .unwrap_or(&Value::Null);
    let text = joined_content(content, "the last message", "\n\n")?;
    Ok((Value::Array(list), Some(text)))
}
