//! Tokenizers built from GGUF vocabulary metadata.
//!
//! * byte-level BPE (`tokenizer.ggml.model = "gpt2"`) with the pre-tokenizer named by
//!   `tokenizer.ggml.pre` (see [`KNOWN_PRE_TOKENIZERS`]; an unknown name is an error);
//! * SentencePiece-style BPE (`"llama"`) with `<0xXX>` byte fallback.
//!
//! Encoding follows llama.cpp (`llama_tokenize`): special tokens are cut out of the text first
//! (control tokens only with `parse_special`), BOS/EOS are added per the file's `add_bos_token` /
//! `add_eos_token` flags, and end-of-generation tokens are recognised the way llama.cpp marks them.
//! For `gpt-4o` (o200k, gpt-oss) the split follows tiktoken, the reference for that vocabulary.
#![warn(missing_docs)]

mod bpe;
mod byte_level;
mod fxhash;
mod load;
mod pretok;
mod special;
mod spm;
mod stream;

use std::cell::RefCell;

pub use pretok::KNOWN_PRE_TOKENIZERS;
pub use stream::StreamDecoder;

use bpe::{BpeModel, BpeScratch};
use fxhash::FxHashMap;
use pretok::{PreTokenizer, Span};
use special::{Fragment, SpecialTokens};
use spm::SpmScratch;

/// Errors from building or running a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required metadata key is absent.
    #[error("GGUF metadata has no `{0}`")]
    MissingKey(String),
    /// A metadata key has an unexpected type or value.
    #[error("GGUF metadata `{key}`: {problem}")]
    BadKey {
        /// The key.
        key: String,
        /// What is wrong with it.
        problem: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer this crate does not implement.
    #[error("unknown tokenizer model `{0}` (supported: gpt2, llama)")]
    UnknownModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not know.
    #[error("unknown pre-tokenizer `{0}` (tokenizer.ggml.pre); known: {known}", known = KNOWN_PRE_TOKENIZERS.join(", "))]
    UnknownPreTokenizer(String),
    /// The vocabulary is inconsistent.
    #[error("invalid vocabulary: {0}")]
    Invalid(String),
    /// The regex engine failed (compilation or matching).
    #[error("pre-tokenizer regex: {0}")]
    Regex(String),
}

/// The kind of tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabType {
    /// Byte-level BPE with a regex pre-tokenizer (`gpt2`).
    Bpe,
    /// SentencePiece-style BPE with byte fallback (`llama`).
    Spm,
}

/// Token attributes (llama.cpp's `llama_token_attr` subset), a bit set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TokenAttr(pub u8);

impl TokenAttr {
    /// Ordinary text token.
    pub const NORMAL: TokenAttr = TokenAttr(1);
    /// The unknown token.
    pub const UNKNOWN: TokenAttr = TokenAttr(2);
    /// Control token (BOS, EOS, chat markup): parsed from text only with `parse_special`.
    pub const CONTROL: TokenAttr = TokenAttr(4);
    /// User-defined token: always parsed from text.
    pub const USER_DEFINED: TokenAttr = TokenAttr(8);
    /// Unused slot.
    pub const UNUSED: TokenAttr = TokenAttr(16);
    /// SentencePiece byte token `<0xXX>`.
    pub const BYTE: TokenAttr = TokenAttr(32);

    /// Whether any bit of `other` is set.
    pub fn contains(self, other: TokenAttr) -> bool {
        self.0 & other.0 != 0
    }
}

/// A tokenizer built from GGUF metadata.
pub struct Tokenizer {
    /// Unique per instance (keys the per-thread word cache).
    uid: u64,
    vocab_type: VocabType,
    pre_name: String,
    /// Token text as stored in the file.
    texts: Vec<Box<str>>,
    /// Bytes each token stands for when detokenized.
    pieces: Vec<Box<[u8]>>,
    attrs: Vec<TokenAttr>,
    text_to_id: FxHashMap<Box<[u8]>, u32>,
    scores: Vec<f32>,
    /// BPE merge tables (BPE only).
    bpe: Option<BpeModel>,
    /// Pre-tokenizer (BPE only).
    pre: Option<PreTokenizer>,
    /// SentencePiece `<0xXX>` tokens.
    spm_byte_ids: [u32; 256],
    /// SentencePiece text may be encoded word by word (see `spm::words_are_independent`).
    spm_words_independent: bool,
    specials: SpecialTokens,
    add_space_prefix: bool,
    add_bos: bool,
    add_eos: bool,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    eog: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("type", &self.vocab_type)
            .field("pre", &self.pre_name)
            .field("n_vocab", &self.texts.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .finish_non_exhaustive()
    }
}

thread_local! {
    static SCRATCH: RefCell<(BpeScratch, SpmScratch, Vec<Span>)> = RefCell::new(Default::default());
}

impl Tokenizer {
    /// Builds the tokenizer from a loaded model's metadata (`tokenizer.ggml.*`).
    pub fn from_metadata(meta: &hmoe_gguf::Metadata) -> Result<Tokenizer, TokenizerError> {
        load::from_metadata(meta)
    }

    /// Tokenizes `text`.
    ///
    /// `add_special` adds BOS/EOS exactly when the metadata's `add_bos_token`/`add_eos_token` say
    /// so (with llama.cpp's defaults when absent). `parse_special` turns the text of control
    /// tokens (e.g. `<|start|>`) into those tokens; user-defined tokens are always recognised.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_spans(text, add_special, parse_special, &[])
    }

    /// Tokenizes a rendered chat prompt: special tokens are parsed from the template's own
    /// text, while in `plain` (sorted, disjoint byte ranges: what the messages said) the text
    /// of any special token, user-defined ones too, stays text, so content cannot forge role
    /// boundaries. Apart from that, as
    /// [`Tokenizer::encode`] with `parse_special`: the pieces between control tokens are
    /// tokenized whole, plain or not.
    pub fn encode_with_plain(
        &self,
        text: &str,
        add_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_spans(text, add_special, true, plain)
    }

    fn encode_spans(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let frags = self.specials.partition(text, parse_special, plain);
        SCRATCH.with(|scratch| -> Result<(), TokenizerError> {
            let mut scratch = scratch.borrow_mut();
            let (bpe_scratch, spm_scratch, spans) = &mut *scratch;
            let mut prev_special = true;
            for frag in frags {
                match frag {
                    Fragment::Token(id) => {
                        out.push(id);
                        prev_special = true;
                    }
                    Fragment::Text(start, end) => {
                        let part = &text[start..end];
                        match self.vocab_type {
                            VocabType::Bpe => {
                                self.encode_bpe(part, &mut out, bpe_scratch, spans)?
                            }
                            VocabType::Spm => {
                                let mut escaped = Vec::with_capacity(part.len() + 3);
                                if self.add_space_prefix && prev_special {
                                    escaped.extend_from_slice("\u{2581}".as_bytes());
                                }
                                for &b in part.as_bytes() {
                                    if b == b' ' {
                                        escaped.extend_from_slice("\u{2581}".as_bytes());
                                    } else {
                                        escaped.push(b);
                                    }
                                }
                                let mut run = |piece: &[u8]| {
                                    spm::encode(
                                        piece,
                                        &self.text_to_id,
                                        &self.scores,
                                        &self.spm_byte_ids,
                                        &mut out,
                                        spm_scratch,
                                    )
                                };
                                if self.spm_words_independent {
                                    spm::words(&escaped).for_each(run);
                                } else {
                                    run(&escaped);
                                }
                            }
                        }
                        prev_special = false;
                    }
                }
            }
            Ok(())
        })?;
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    fn encode_bpe(
        &self,
        text: &str,
        out: &mut Vec<u32>,
        scratch: &mut BpeScratch,
        spans: &mut Vec<Span>,
    ) -> Result<(), TokenizerError> {
        let (Some(pre), Some(bpe)) = (&self.pre, &self.bpe) else {
            return Err(TokenizerError::Invalid(
                "BPE tokenizer without merges".into(),
            ));
        };
        pre.split(text, spans)?;
        scratch.claim(self.uid);
        let bytes = text.as_bytes();
        for &(a, b) in spans.iter() {
            bpe.encode_word(&bytes[a..b], out, scratch);
        }
        Ok(())
    }

    /// The words the pre-tokenizer cuts `text` into (byte-level BPE only; `None` for
    /// SentencePiece, which has no pre-tokenizer). Special tokens are not treated specially.
    pub fn pre_tokenize<'t>(&self, text: &'t str) -> Result<Option<Vec<&'t str>>, TokenizerError> {
        let Some(pre) = &self.pre else {
            return Ok(None);
        };
        let mut spans = Vec::new();
        pre.split(text, &mut spans)?;
        Ok(Some(spans.iter().map(|&(a, b)| &text[a..b]).collect()))
    }

    /// Concatenated piece bytes of `ids` (special tokens rendered as their text; ids out of
    /// range are skipped). Not necessarily valid UTF-8: see [`StreamDecoder`].
    pub fn decode(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id));
        }
        out
    }

    /// [`Tokenizer::decode`] as a string, invalid UTF-8 replaced by U+FFFD.
    pub fn decode_lossy(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode(ids)).into_owned()
    }

    /// The bytes token `id` stands for (empty for ids out of range and unused tokens).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], |p| p)
    }

    /// The token's text as stored in the vocabulary (byte-level BPE tokens use the GPT-2
    /// alphabet, e.g. `Ġthe`; SentencePiece ones use `▁`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(|t| &**t)
    }

    /// The id of the token whose stored text is `text` (e.g. `"<|return|>"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.text_to_id.get(text.as_bytes()).copied()
    }

    /// The token's attributes.
    pub fn token_attr(&self, id: u32) -> TokenAttr {
        self.attrs.get(id as usize).copied().unwrap_or_default()
    }

    /// Whether `id` is a control token (chat markup, BOS/EOS...).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_attr(id).contains(TokenAttr::CONTROL)
    }

    /// Vocabulary size.
    pub fn n_vocab(&self) -> usize {
        self.texts.len()
    }

    /// Tokenizer kind.
    pub fn vocab_type(&self) -> VocabType {
        self.vocab_type
    }

    /// The pre-tokenizer name (`tokenizer.ggml.pre`; `"default"` when absent).
    pub fn pre_tokenizer(&self) -> &str {
        &self.pre_name
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn token (from the file, else found by its text as llama.cpp does).
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// End-of-message token (`<|eom_id|>`).
    pub fn eom(&self) -> Option<u32> {
        self.eom
    }

    /// Unknown token.
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }

    /// Padding token.
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    /// Whether `encode(.., add_special = true, ..)` adds BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` adds EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether generating `id` ends generation (EOS, EOT, `<|im_end|>`, gpt-oss `<|return|>` and
    /// `<|call|>`, ... as llama.cpp marks them; gpt-oss `<|end|>` is not).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation tokens, ascending.
    pub fn eog_tokens(&self) -> &[u32] {
        &self.eog
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn shareable_across_threads() {
        fn check<T: Send + Sync>() {}
        check::<super::Tokenizer>();
        check::<super::StreamDecoder>();
    }
}
