//! Chat requests to prompts: the request's messages and tools rendered with the model's chat
//! template, its reasoning format and template variables read, and the prompt tokenized with
//! the generation settings ready to run.

use hmoe_chat::ReasoningFormat;
use serde_json::{Map, Value};

use crate::chat_messages::{normalize_messages, normalize_tools};
use crate::error::ApiError;
use crate::output::OutputKind;
use crate::params::{gen_params, Fields, Flavor, GenParams};
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

/// Takes the model named by `model`, renders the chat request `req` (OpenAI chat fields) and
/// reads its generation settings.
pub async fn prepare_chat(
    st: &AppState,
    model: Option<&str>,
    req: &Map<String, Value>,
) -> Result<PreparedChat, ApiError> {
    let lease = st.registry.acquire(model).await?;
    let (text, format, tools) = render_chat(st, &lease, req)?;
    let host = lease.host.clone();
    let chat = host.chat()?;
    // As llama-server: several calls may follow one another unless the request says not.
    let parallel = Fields(req).bool("parallel_tool_calls")?.unwrap_or(true);
    let prompt = chat.tokenize(&host.tokenizer, &text)?;
    let mut gen = gen_params(
        &Fields(req),
        &st.config.sampling,
        Flavor::Chat,
        &host.tokenizer,
        chat.forced_tool_format(&host.tokenizer),
    )?;
    gen.compile(&host).await?;
    let output = chat.output_kind(&text, format, tools.as_ref(), parallel);
    Ok(PreparedChat {
        lease,
        prompt,
        gen,
        output,
    })
}

fn reasoning_format(s: &str) -> Result<ReasoningFormat, ApiError> {
    match s {
        "none" => Ok(ReasoningFormat::None),
        "auto" => Ok(ReasoningFormat::Auto),
        "deepseek" | "deepseek-legacy" => Ok(ReasoningFormat::Deepseek),
        other => Err(ApiError::bad_request(format!(
            "unknown reasoning_format '{other}' (none, auto, deepseek)"
        ))),
    }
}

/// The prompt text of a chat request (template rendered), how to read its reasoning, and the
/// tools the template was given (`None`: none, or `tool_choice` `"none"`).
pub(crate) fn render_chat(
    st: &AppState,
    lease: &Lease,
    req: &Map<String, Value>,
) -> Result<(String, ReasoningFormat, Option<Value>), ApiError> {
    let f = Fields(req);
    let chat = lease.host.chat()?;
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
        Some(s) => reasoning_format(s)?,
        None => st.config.chat.reasoning_format,
    };
    let mut extra = st.config.chat.template_kwargs.clone();
    match f.value("chat_template_kwargs") {
        None => {}
        Some(Value::Object(kw)) => extra.extend(kw.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "'chat_template_kwargs' must be an object",
            ))
        }
    }
    if let Some(effort) = f.str("reasoning_effort")? {
        extra.insert("reasoning_effort".into(), effort.into());
    }
    let add_generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(true);
    let text = chat.render(&messages, tools.as_ref(), add_generation_prompt, extra)?;
    Ok((text, format, tools))
}
