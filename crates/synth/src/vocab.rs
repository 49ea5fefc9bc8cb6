//! A byte-level BPE vocabulary with no merges: every byte is a token, followed by reserved
//! tokens and the model family's special tokens, so that text round-trips through any synthetic
//! model; and the family's chat template, so that a stand-in model chats at once.
//!
//! The templates in `crates/synth/templates/` are copies of the models' own chat templates as
//! published with them on Hugging Face (gpt-oss: openai/gpt-oss-120b, Apache-2.0; Qwen3:
//! Qwen/Qwen3-0.6B, Apache-2.0; DeepSeek-V3.1: deepseek-ai/DeepSeek-V3.1, MIT); see
//! `templates/README.md`.

use hmoe_gguf::{GgufWriter, MetaType, MetaValue};

/// Token type of a control token (GGUF `tokenizer.ggml.token_type`).
const CONTROL: i32 = 3;
/// Token type of a user-defined token (matched in any text, shown when decoded).
const USER_DEFINED: i32 = 4;

/// A model family's special tokens (placed at the end of the vocabulary, at most 8 of them so
/// that 264 tokens always hold them) and its chat template.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    /// The tokens with their GGUF token types.
    pub specials: &'static [(&'static str, i32)],
    /// Index into `specials` of the BOS token.
    pub bos: usize,
    /// Index into `specials` of the EOS token.
    pub eos: usize,
    /// Whether BOS is added when tokenizing with special tokens.
    pub add_bos: bool,
    /// The Jinja chat template (`tokenizer.chat_template`).
    pub chat_template: &'static str,
}

/// gpt-oss: the harmony tokens (bos `<|startoftext|>`, eos `<|return|>`) and the harmony
/// template.
pub const GPT_OSS: Family = Family {
    specials: &[
        ("<|startoftext|>", CONTROL),
        ("<|return|>", CONTROL),
        ("<|constrain|>", CONTROL),
        ("<|channel|>", CONTROL),
        ("<|start|>", CONTROL),
        ("<|end|>", CONTROL),
        ("<|message|>", CONTROL),
        ("<|call|>", CONTROL),
    ],
    bos: 0,
    eos: 1,
    add_bos: false,
    chat_template: include_str!("../templates/gpt-oss.jinja"),
};

/// Qwen3: ChatML tokens (eos `<|im_end|>`), `<think>` reasoning and `<tool_call>`.
pub const QWEN3: Family = Family {
    specials: &[
        ("<|endoftext|>", CONTROL),
        ("<|im_start|>", CONTROL),
        ("<|im_end|>", CONTROL),
        ("<think>", USER_DEFINED),
        ("</think>", USER_DEFINED),
        ("<tool_call>", USER_DEFINED),
        ("</tool_call>", USER_DEFINED),
    ],
    bos: 0,
    eos: 2,
    add_bos: false,
    chat_template: include_str!("../templates/qwen3.jinja"),
};

/// DeepSeek-V3 (the V3.1 template): sentence and role tokens, `<think>` reasoning, tool calls.
pub const DEEPSEEK_V3: Family = Family {
    specials: &[
        ("<\u{ff5c}begin\u{2581}of\u{2581}sentence\u{ff5c}>", CONTROL),
        ("<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>", CONTROL),
        ("<\u{ff5c}User\u{ff5c}>", USER_DEFINED),
        ("<\u{ff5c}Assistant\u{ff5c}>", USER_DEFINED),
        ("<think>", USER_DEFINED),
        ("</think>", USER_DEFINED),
        (
            "<\u{ff5c}tool\u{2581}calls\u{2581}begin\u{ff5c}>",
            USER_DEFINED,
        ),
        (
            "<\u{ff5c}tool\u{2581}calls\u{2581}end\u{ff5c}>",
            USER_DEFINED,
        ),
    ],
    bos: 0,
    eos: 1,
    add_bos: true,
    chat_template: include_str!("../templates/deepseek-v3.jinja"),
};

/// GPT-2's printable stand-in for each byte (byte-level BPE stores tokens this way).
fn byte_token(b: u8) -> String {
    let printable = |c: u8| (b'!'..=b'~').contains(&c) || (0xA1..=0xAC).contains(&c) || c >= 0xAE;
    if printable(b) {
        return char::from(b).to_string();
    }
    let shift = (0..=255u8)
        .filter(|&c| !printable(c))
        .position(|c| c == b)
        .unwrap_or(0);
    char::from_u32(256 + shift as u32).map_or_else(String::new, |c| c.to_string())
}

/// Adds `tokenizer.*` metadata for a vocabulary of `n_vocab` tokens (at least 264): 256 byte
/// tokens, reserved control tokens, then the family's special tokens; and its chat template.
pub fn add_byte_vocab(w: &mut GgufWriter, n_vocab: usize, family: &Family) {
    let specials = family.specials;
    let n_vocab = n_vocab.max(264).max(256 + specials.len());
    let first_special = n_vocab - specials.len();
    let mut tokens = Vec::with_capacity(n_vocab);
    let mut types = Vec::with_capacity(n_vocab);
    for id in 0..n_vocab {
        if id < 256 {
            tokens.push(byte_token(id as u8));
            types.push(1);
        } else if id < first_special {
            tokens.push(format!("<|reserved_{id}|>"));
            types.push(CONTROL);
        } else {
            let (text, ty) = specials[id - first_special];
            tokens.push(text.to_string());
            types.push(ty);
        }
    }
    let strings = |v: Vec<String>| {
        MetaValue::Array(
            MetaType::String,
            v.into_iter().map(MetaValue::String).collect(),
        )
    };
    w.add_meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
    w.add_meta("tokenizer.ggml.pre", MetaValue::String("gpt-4o".into()));
    w.add_meta("tokenizer.ggml.tokens", strings(tokens));
    w.add_meta(
        "tokenizer.ggml.token_type",
        MetaValue::Array(
            MetaType::I32,
            types.into_iter().map(MetaValue::I32).collect(),
        ),
    );
    w.add_meta("tokenizer.ggml.merges", strings(Vec::new()));
    w.add_meta(
        "tokenizer.ggml.bos_token_id",
        MetaValue::U32((first_special + family.bos) as u32),
    );
    w.add_meta(
        "tokenizer.ggml.eos_token_id",
        MetaValue::U32((first_special + family.eos) as u32),
    );
    w.add_meta(
        "tokenizer.ggml.add_bos_token",
        MetaValue::Bool(family.add_bos),
    );
    w.add_meta(
        "tokenizer.chat_template",
        MetaValue::String(family.chat_template.into()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_are_distinct_and_printable() {
        let all: std::collections::HashSet<String> = (0..=255u8).map(byte_token).collect();
        assert_eq!(all.len(), 256);
        assert_eq!(byte_token(b'a'), "a");
        assert_eq!(byte_token(b' '), "\u{120}");
        assert_eq!(byte_token(b'\n'), "\u{10a}");
    }

    #[test]
    fn families_fit_the_smallest_vocabulary_and_their_templates_use_them() {
        for f in [GPT_OSS, QWEN3, DEEPSEEK_V3] {
            assert!(f.specials.len() <= 8 && f.bos < f.specials.len() && f.eos < f.specials.len());
        }
        // Each template ends a turn with a token of its family.
        assert!(GPT_OSS.chat_template.contains("<|end|>"));
        assert!(QWEN3.chat_template.contains(QWEN3.specials[QWEN3.eos].0));
        assert!(DEEPSEEK_V3
            .chat_template
            .contains(DEEPSEEK_V3.specials[DEEPSEEK_V3.eos].0));
        assert!(DEEPSEEK_V3
            .chat_template
            .contains(DEEPSEEK_V3.specials[3].0));
    }
}
