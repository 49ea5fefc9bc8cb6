//! Getting a model's chat template and the variables templates expect.

use std::path::Path;

use hmoe_gguf::Metadata;
use hmoe_tokenizer::Tokenizer;

use crate::ChatError;

/// GGUF key of the default chat template.
pub const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// The chat template to use: the file given by `--chat-template-file` when set, else the model's
/// `tokenizer.chat_template`.
pub fn load_chat_template(
    meta: &Metadata,
    override_file: Option<&Path>,
) -> Result<String, ChatError> {
    if let Some(path) = override_file {
        return std::fs::read_to_string(path).map_err(|e| {
            ChatError::Input(format!("reading chat template {}: {e}", path.display()))
        });
    }
    meta.get_str(KEY_CHAT_TEMPLATE)
        .map(str::to_string)
        .ok_or_else(|| {
            ChatError::Input(format!(
                "the model has no {KEY_CHAT_TEMPLATE}; pass --chat-template-file"
            ))
        })
}

/// `bos_token` / `eos_token` (their text) for templates that print them, as transformers passes
/// them; tokens the model lacks are left out.
pub fn special_token_vars(tok: &Tokenizer) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (key, id) in [("bos_token", tok.bos()), ("eos_token", tok.eos())] {
        if let Some(text) = id.and_then(|i| tok.token_text(i)) {
            m.insert(key.into(), text.into());
        }
    }
    serde_json::Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_gguf::MetaValue;

    #[test]
    fn override_file_wins() {
        let mut meta = Metadata::new();
        assert!(matches!(
            load_chat_template(&meta, None),
            Err(ChatError::Input(_))
        ));
        meta.insert(
            KEY_CHAT_TEMPLATE,
            MetaValue::String("{{ messages }}".into()),
        );
        assert_eq!(load_chat_template(&meta, None).unwrap(), "{{ messages }}");
        let dir = std::env::temp_dir().join(format!("hmoe-chat-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t.jinja");
        std::fs::write(&f, "custom").unwrap();
        assert_eq!(load_chat_template(&meta, Some(&f)).unwrap(), "custom");
        assert!(load_chat_template(&meta, Some(&dir.join("missing.jinja"))).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
