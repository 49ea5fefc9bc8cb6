//! Pre-tokenizers for byte-level BPE: the text is cut into words by a list of regular expressions
//! before BPE merges run inside each word.
//!
//! The pre-tokenizer is chosen by the GGUF key `tokenizer.ggml.pre`, with the same names and the
//! same expression lists as llama.cpp. Each expression of a list is applied in turn to every piece
//! produced by the previous ones; both the matches and the unmatched gaps become pieces (HF
//! `Split(behavior = Isolated)`), and a lookahead never sees past the end of its piece.
//!
//! Regex engine: PCRE2 with JIT (`pcre2` crate, UTF + UCP mode). The o200k pattern needs the
//! `\s+(?!\S)` lookahead, which the `regex` crate lacks. Measured on `wiki.test.raw` (1.29 MB, one
//! core of this 2-core box), splitting with the o200k pattern: PCRE2-JIT 96 MB/s, fancy-regex 0.20
//! 47 MB/s, identical 258,031 pieces. PCRE2 was chosen for the 2x.
//!
//! `gpt-4o` uses OpenAI's original o200k pattern (the one tiktoken runs), not llama.cpp's rewrite
//! of it, whose emulated character classes drop `\p{M}` (so llama.cpp splits Khmer, Devanagari and
//! Thai words differently from tiktoken); tiktoken is the reference for gpt-oss.

use crate::TokenizerError;

/// A byte range of the input text.
pub(crate) type Span = (usize, usize);

/// GPT-2's pattern (`\s+` appended: llama.cpp's hand-written splitter for this pattern also takes
/// whitespace that the lookahead alternative leaves over).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3 (`(?i:...)` spelled out for ASCII letters, as llama.cpp and HF do in effect).
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2 / Qwen2.5 / Qwen3: like Llama 3 with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// OpenAI o200k (gpt-4o, gpt-oss), exactly as tiktoken defines it.
const O200K: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Cased letters of the DeepSeek LLM tokenizer (Latin, Greek, Cyrillic, Armenian, Georgian,
/// Cherokee, Glagolitic, Coptic, ... upper/lower case ranges).
const DEEPSEEK_LLM_LETTERS: &str = concat!(
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}",
    r"\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}",
    r"\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}",
    r"\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}",
    r"\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}",
    r"\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}",
    r"\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}",
    r"\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}",
    r"\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}",
    r"\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}",
    r"\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}",
    r"\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}",
    r"\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}",
    r"\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}",
    r"\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+"
);

/// CJK ideographs (U+4E00..U+9FA5), U+0800..U+4E00 and Hangul (DeepSeek LLM / Coder).
const DEEPSEEK_CJK: &str = r"[\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}]+";

const DEEPSEEK_LLM: &[&str] = &[
    r"[\r\n]",
    DEEPSEEK_LLM_LETTERS,
    r"\s?[\x{21}-\x{2F}\x{3A}-\x{7E}\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
    r"\s+\z",
    DEEPSEEK_CJK,
    r"\p{N}+",
];

const DEEPSEEK_CODER: &[&str] = &[
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    DEEPSEEK_CJK,
    r"\p{N}",
];

const DEEPSEEK_V3: &[&str] = &[
    r"\p{N}{1,3}",
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    r"[\x{21}-\x{2F}\x{3A}-\x{40}\x{5B}-\x{60}\x{7B}-\x{7E}][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

const DEFAULT: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];

const FALCON: &[&str] = &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"];

const SMOLLM: &[&str] = &[r"\p{N}", GPT2];

const BLOOM: &[&str] =
    &[r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{0964}\x{06D4}\x{060C})]+"];

/// What a pre-tokenizer name selects.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PreSpec {
    /// The expressions, applied in order.
    pub regexes: &'static [&'static str],
    /// A word that is itself a token is emitted whole without running merges (llama.cpp's
    /// `ignore_merges`; tiktoken always does this).
    pub ignore_merges: bool,
    /// Default of `add_bos` when the GGUF file does not say.
    pub default_add_bos: bool,
    /// The model has no BOS token unless the file names one.
    pub no_default_bos: bool,
}

impl PreSpec {
    const fn new(regexes: &'static [&'static str]) -> PreSpec {
        PreSpec {
            regexes,
            ignore_merges: false,
            default_add_bos: false,
            no_default_bos: false,
        }
    }
}

/// The names this crate knows (for error messages and docs).
pub const KNOWN_PRE_TOKENIZERS: &[&str] = &[
    "default",
    "gpt-2",
    "phi-2",
    "mpt",
    "olmo",
    "jais",
    "trillion",
    "exaone4",
    "gigachat",
    "a.x-4.0",
    "mellum",
    "granite-docling",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "dbrx",
    "smaug-bpe",
    "chatglm-bpe",
    "glm4",
    "qwen2",
    "deepseek-r1-qwen",
    "megrez",
    "stablelm2",
    "hunyuan",
    "solar-open",
    "kormo",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "hunyuan-dense",
    "gpt-4o",
    "llama4",
    "kanana2",
    "minimax-m2",
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva-7b",
    "falcon",
    "poro-chat",
    "bloom",
    "gpt3-finnish",
];

/// Looks up a pre-tokenizer by its GGUF name.
pub(crate) fn spec_for(name: &str) -> Option<PreSpec> {
    const GPT2_LIST: &[&str] = &[GPT2];
    const LLAMA3_LIST: &[&str] = &[LLAMA3];
    const QWEN2_LIST: &[&str] = &[QWEN2];
    const O200K_LIST: &[&str] = &[O200K];
    Some(match name {
        "default" => PreSpec::new(DEFAULT),
        "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion" | "exaone4" | "gigachat"
        | "a.x-4.0" | "mellum" | "granite-docling" => PreSpec::new(GPT2_LIST),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => PreSpec {
            ignore_merges: true,
            default_add_bos: true,
            ..PreSpec::new(LLAMA3_LIST)
        },
        "dbrx" | "smaug-bpe" => PreSpec::new(LLAMA3_LIST),
        "chatglm-bpe" | "glm4" => PreSpec {
            no_default_bos: true,
            ..PreSpec::new(LLAMA3_LIST)
        },
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" | "hunyuan" | "solar-open"
        | "kormo" => PreSpec::new(QWEN2_LIST),
        "deepseek-llm" => PreSpec::new(DEEPSEEK_LLM),
        "deepseek-coder" => PreSpec::new(DEEPSEEK_CODER),
        "deepseek-v3" | "hunyuan-dense" => PreSpec::new(DEEPSEEK_V3),
        "gpt-4o" | "llama4" | "kanana2" | "minimax-m2" => PreSpec {
            ignore_merges: true,
            ..PreSpec::new(O200K_LIST)
        },
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            PreSpec::new(SMOLLM)
        }
        "falcon" => PreSpec::new(FALCON),
        "poro-chat" | "bloom" | "gpt3-finnish" => PreSpec::new(BLOOM),
        _ => return None,
    })
}

/// A compiled pre-tokenizer.
pub(crate) struct PreTokenizer {
    regexes: Vec<pcre2::bytes::Regex>,
}

impl std::fmt::Debug for PreTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreTokenizer")
            .field("regexes", &self.regexes.len())
            .finish()
    }
}

impl PreTokenizer {
    /// Compiles the expressions of `spec`.
    pub(crate) fn new(spec: &PreSpec) -> Result<PreTokenizer, TokenizerError> {
        let regexes = spec
            .regexes
            .iter()
            .map(|pattern| {
                pcre2::bytes::RegexBuilder::new()
                    .utf(true)
                    .ucp(true)
                    .jit_if_available(true)
                    .build(pattern)
                    .map_err(|e| TokenizerError::Regex(format!("{pattern}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PreTokenizer { regexes })
    }

    /// Splits `text` into word spans (byte ranges, in order, covering the whole text).
    pub(crate) fn split(&self, text: &str, out: &mut Vec<Span>) -> Result<(), TokenizerError> {
        out.clear();
        if text.is_empty() {
            return Ok(());
        }
        let bytes = text.as_bytes();
        out.push((0, bytes.len()));
        let mut next = Vec::new();
        for re in &self.regexes {
            next.clear();
            for &(start, end) in out.iter() {
                let piece = &bytes[start..end];
                let mut last = 0;
                for m in re.find_iter(piece) {
                    let m = m.map_err(|e| TokenizerError::Regex(e.to_string()))?;
                    if m.start() > last {
                        next.push((start + last, start + m.start()));
                    }
                    if m.end() > m.start() {
                        next.push((start + m.start(), start + m.end()));
                    }
                    last = m.end();
                }
                if last < piece.len() {
                    next.push((start + last, end));
                }
            }
            std::mem::swap(out, &mut next);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(name: &str, text: &str) -> Vec<String> {
        let pre = PreTokenizer::new(&spec_for(name).unwrap()).unwrap();
        let mut spans = Vec::new();
        pre.split(text, &mut spans).unwrap();
        spans.iter().map(|&(a, b)| text[a..b].to_string()).collect()
    }

    #[test]
    fn all_known_names_compile() {
        for name in KNOWN_PRE_TOKENIZERS {
            let spec = spec_for(name).unwrap_or_else(|| panic!("{name}"));
            PreTokenizer::new(&spec).unwrap();
        }
        assert!(spec_for("no-such-pre").is_none());
    }

    #[test]
    fn gpt2_splits_words_and_spaces() {
        assert_eq!(
            split("gpt-2", "Hello world  x\n\ny's"),
            ["Hello", " world", " ", " x", "\n", "\n", "y", "'s"]
        );
    }

    #[test]
    fn o200k_keeps_marks_with_letters() {
        // Khmer: base letters and combining marks stay one word, as in tiktoken.
        let text = "\u{1780}\u{17B6}\u{179A}";
        assert_eq!(split("gpt-4o", text), [text]);
        assert_eq!(
            split("gpt-4o", "I'M fine123456"),
            ["I'M", " fine", "123", "456"]
        );
    }

    #[test]
    fn sequential_lists_and_end_anchor() {
        // deepseek-llm: newlines isolated first; `\s+\z` only at the end of a piece.
        assert_eq!(
            split("deepseek-llm", "ab \ncd  "),
            ["ab", " ", "\n", "cd", "  "]
        );
    }
}
