//! A byte-level BPE vocabulary with no merges: every byte is a token, followed by reserved
//! tokens and the harmony specials, so that text round-trips through any synthetic model.

use hmoe_gguf::{GgufWriter, MetaType, MetaValue};

/// gpt-oss's special tokens, placed at the end of the vocabulary.
const HARMONY_SPECIALS: [&str; 8] = [
    "<|startoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
];

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
/// tokens, reserved control tokens, then the 8 harmony specials (bos `<|startoftext|>`, eos
/// `<|return|>`).
pub fn add_byte_vocab(w: &mut GgufWriter, n_vocab: usize) {
    let n_vocab = n_vocab.max(256 + HARMONY_SPECIALS.len());
    let first_special = n_vocab - HARMONY_SPECIALS.len();
    let mut tokens = Vec::with_capacity(n_vocab);
    let mut types = Vec::with_capacity(n_vocab);
    for id in 0..n_vocab {
        if id < 256 {
            tokens.push(byte_token(id as u8));
            types.push(1);
        } else if id < first_special {
            tokens.push(format!("<|reserved_{id}|>"));
            types.push(3);
        } else {
            tokens.push(HARMONY_SPECIALS[id - first_special].to_string());
            types.push(3);
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
        MetaValue::U32(first_special as u32),
    );
    w.add_meta(
        "tokenizer.ggml.eos_token_id",
        MetaValue::U32(first_special as u32 + 1),
    );
    w.add_meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
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
}
