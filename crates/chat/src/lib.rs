//! Chat formatting for hmoe: rendering the model's chat template, and reading the model's output
//! back as messages (gpt-oss harmony channels and tool calls, `<think>` reasoning, the tool calls
//! of Qwen3 / Qwen3-Coder / DeepSeek templates).
#![warn(missing_docs)]

mod builtin;
mod family;
mod harmony;
mod jsoncall;
mod model;
mod reasoning;
mod template;
mod toolcall;

pub use builtin::{builtin_template, builtin_template_names, resolve_chat_template};
pub use family::TemplateFamily;
pub use harmony::{
    HarmonyEvent, HarmonyHeader, HarmonyMessage, HarmonyParser, HarmonyStop, HarmonyTokens,
};
pub use model::{load_chat_template, special_token_vars, KEY_CHAT_TEMPLATE};
pub use reasoning::{open_think, ChatDelta, HarmonyStream, ReasoningFormat, ThinkSplitter};
pub use template::{render_template, ChatTemplate, Clock};
pub use toolcall::{ToolCallFormat, ToolCallParser, ToolCallSpec, MAX_HELD};

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The template does not compile or failed while rendering.
    #[error("chat template: {0}")]
    Template(String),
    /// The template called `raise_exception(message)` (it rejects the conversation).
    #[error("chat template rejected the conversation: {0}")]
    Raised(String),
    /// Bad input to this crate.
    #[error("{0}")]
    Input(String),
}

#[cfg(test)]
mod tests {
    #[test]
    fn shareable_across_threads() {
        fn check<T: Send + Sync>() {}
        check::<super::ChatTemplate>();
        check::<super::HarmonyParser>();
        check::<super::HarmonyStream>();
        check::<super::ThinkSplitter>();
        check::<super::ToolCallParser>();
    }
}
