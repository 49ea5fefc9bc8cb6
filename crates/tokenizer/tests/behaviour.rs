//! Special tokens, BOS/EOS flags, end-of-generation ids, streaming and bad metadata.

mod common;

use std::sync::OnceLock;

use common::load;
use hmoe_gguf::{MetaType, MetaValue, Metadata};
use hmoe_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

fn o200k() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| load("tokenizer/ggml-vocab-o200k-harmony.gguf"))
}

#[test]
fn o200k_specials_and_end_of_generation() {
    let t = o200k();
    assert_eq!(t.n_vocab(), 201088);
    assert_eq!(t.bos(), Some(199998));
    assert_eq!(t.eos(), Some(200002));
    let id = |s: &str| t.token_id(s).unwrap();
    assert_eq!(id("<|return|>"), 200002);
    assert!(t.is_eog(id("<|return|>")));
    assert!(t.is_eog(id("<|call|>")));
    assert!(t.is_eog(id("<|endoftext|>")));
    assert!(
        !t.is_eog(id("<|end|>")),
        "gpt-oss <|end|> closes a message, not the generation"
    );
    assert!(!t.is_eog(id("<|start|>")));
    // add_bos_token is false in this file: add_special adds nothing.
    assert_eq!(
        t.encode("hi", true, false).unwrap(),
        t.encode("hi", false, false).unwrap()
    );
    // Control tokens are parsed only on request ...
    let text = "<|return|>";
    assert_eq!(t.encode(text, false, true).unwrap(), [200002]);
    assert!(t.encode(text, false, false).unwrap().len() > 1);
    // ... while harmony markup is user-defined in llama.cpp, hence always parsed.
    assert_eq!(
        t.encode("<|start|>", false, false).unwrap(),
        [id("<|start|>")]
    );
    // Special tokens decode to their text.
    assert_eq!(t.decode(&[200002]), b"<|return|>");
}

#[test]
fn streaming_decode_holds_partial_characters() {
    let t = o200k();
    let text = "нещо на Български 🦙 ok 😶\u{200d}🌫\u{fe0f} កាន់តែ";
    let ids = t.encode(text, false, false).unwrap();
    let mut dec = StreamDecoder::new();
    let mut got = String::new();
    let mut split_seen = false;
    for &id in &ids {
        let s = dec.push(t, id);
        split_seen |= s.is_empty();
        got.push_str(&s);
    }
    got.push_str(&dec.finish());
    assert_eq!(got, text);
    assert!(split_seen, "some token ends inside a character");
    assert_eq!(t.decode_lossy(&ids), text);
}

#[test]
fn bos_follows_metadata_flags() {
    // llama-bpe: no add_bos_token key, llama.cpp's default for llama3 is true.
    let t = load("tokenizer/ggml-vocab-llama-bpe.gguf");
    assert!(t.add_bos());
    assert_eq!(t.encode("Hello", true, false).unwrap(), [128000, 9906]);
    assert_eq!(t.encode("Hello", false, false).unwrap(), [9906]);
    assert_eq!(t.encode("", true, false).unwrap(), [128000]);
    // SPM: BOS, and a space prefix before the first text piece.
    let s = load("tokenizer/ggml-vocab-llama-spm.gguf");
    let ids = s.encode("Hello world", true, false).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(s.decode(&ids[1..]), b" Hello world");
    assert!(s.is_eog(2));
    // gpt-2: no add_bos_token key, default false.
    let g = load("tokenizer/ggml-vocab-gpt-2.gguf");
    assert!(!g.add_bos());
    assert_eq!(
        g.encode("Hello", true, false).unwrap(),
        g.encode("Hello", false, false).unwrap()
    );
    assert!(g.is_eog(50256));
}

#[test]
fn spm_byte_fallback_round_trips() {
    let s = load("tokenizer/ggml-vocab-llama-spm.gguf");
    // Characters missing from the 32k vocabulary come out as <0xXX> byte tokens.
    let text = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok";
    let ids = s.encode(text, false, false).unwrap();
    assert!(
        ids.iter().any(|&i| (3..=258).contains(&i)),
        "byte fallback used: {ids:?}"
    );
    assert_eq!(s.decode(&ids), format!(" {text}").as_bytes());
}

fn strings(v: &[&str]) -> MetaValue {
    MetaValue::Array(
        MetaType::String,
        v.iter().map(|s| MetaValue::String(s.to_string())).collect(),
    )
}

/// A tiny byte-level vocabulary: the 256 byte characters, "ab", and "<|x|>".
fn tiny(pre: Option<&str>) -> Metadata {
    let mut tokens: Vec<String> = (0u32..256)
        .map(|b| {
            let printable = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            let n = (0..b)
                .filter(|&x| {
                    !((0x21..=0x7E).contains(&x)
                        || (0xA1..=0xAC).contains(&x)
                        || (0xAE..=0xFF).contains(&x))
                })
                .count() as u32;
            char::from_u32(if printable { b } else { 0x100 + n })
                .unwrap()
                .to_string()
        })
        .collect();
    tokens.push("ab".into());
    tokens.push("<|x|>".into());
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut types = vec![MetaValue::I32(1); 257];
    types.push(MetaValue::I32(3));
    let mut m = Metadata::new();
    m.insert("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
    if let Some(p) = pre {
        m.insert("tokenizer.ggml.pre", MetaValue::String(p.into()));
    }
    m.insert("tokenizer.ggml.tokens", strings(&refs));
    m.insert(
        "tokenizer.ggml.token_type",
        MetaValue::Array(MetaType::I32, types),
    );
    m.insert("tokenizer.ggml.merges", strings(&["a b"]));
    m.insert("tokenizer.ggml.eos_token_id", MetaValue::U32(257));
    m
}

#[test]
fn tiny_vocabulary_works() {
    let t = Tokenizer::from_metadata(&tiny(Some("gpt-2"))).unwrap();
    assert_eq!(t.encode("abc", false, false).unwrap(), [256, b'c' as u32]);
    assert_eq!(t.encode("ab<|x|>", true, true).unwrap(), [256, 257]);
    assert!(t.is_eog(257));
    assert_eq!(t.bos(), None);
    // No `pre` key: llama.cpp's "default" pre-tokenizer.
    let d = Tokenizer::from_metadata(&tiny(None)).unwrap();
    assert_eq!(d.pre_tokenizer(), "default");
}

#[test]
fn unknown_pre_tokenizer_is_an_error_naming_it() {
    let err = Tokenizer::from_metadata(&tiny(Some("my-fancy-pre"))).unwrap_err();
    assert!(matches!(&err, TokenizerError::UnknownPreTokenizer(n) if n == "my-fancy-pre"));
    assert!(err.to_string().contains("`my-fancy-pre`"), "{err}");
}

#[test]
fn bad_metadata_is_reported() {
    let mut m = tiny(Some("gpt-2"));
    m.insert("tokenizer.ggml.model", MetaValue::String("bert".into()));
    assert!(
        matches!(Tokenizer::from_metadata(&m), Err(TokenizerError::UnknownModel(n)) if n == "bert")
    );

    let mut m = tiny(Some("gpt-2"));
    m.remove("tokenizer.ggml.tokens");
    assert!(
        matches!(Tokenizer::from_metadata(&m), Err(TokenizerError::MissingKey(k)) if k == "tokenizer.ggml.tokens")
    );

    let mut m = tiny(Some("gpt-2"));
    m.remove("tokenizer.ggml.merges");
    assert!(matches!(
        Tokenizer::from_metadata(&m),
        Err(TokenizerError::MissingKey(_))
    ));

    let mut m = tiny(Some("gpt-2"));
    m.insert(
        "tokenizer.ggml.tokens",
        MetaValue::Array(MetaType::U32, vec![MetaValue::U32(1)]),
    );
    assert!(matches!(
        Tokenizer::from_metadata(&m),
        Err(TokenizerError::BadKey { .. })
    ));

    let mut m = tiny(Some("gpt-2"));
    m.insert("tokenizer.ggml.add_bos_token", MetaValue::Bool(true));
    let err = Tokenizer::from_metadata(&m).unwrap_err();
    assert!(err.to_string().contains("bos_token_id"), "{err}");

    let mut m = tiny(Some("gpt-2"));
    m.insert("tokenizer.ggml.tokens", strings(&["a", "a"]));
    m.remove("tokenizer.ggml.token_type");
    assert!(matches!(
        Tokenizer::from_metadata(&m),
        Err(TokenizerError::Invalid(_))
    ));

    // Out-of-range special ids are ignored, not trusted.
    let mut m = tiny(Some("gpt-2"));
    m.insert("tokenizer.ggml.bos_token_id", MetaValue::U32(1_000_000));
    let t = Tokenizer::from_metadata(&m).unwrap();
    assert_eq!(t.bos(), None);
    assert!(t.decode(&[1_000_000]).is_empty());
}
