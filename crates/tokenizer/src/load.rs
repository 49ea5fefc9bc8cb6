//! Building a [`Tokenizer`] from GGUF metadata, with llama.cpp's defaults and fix-ups
//! (`llama_vocab::impl::load`).

use hmoe_gguf::{MetaValue, Metadata};

use crate::bpe::{BpeModel, NO_TOKEN};
use crate::byte_level::{byte_to_char, decode_token_text, ReverseTable};
use crate::fxhash::FxHashMap;
use crate::pretok::{spec_for, PreSpec, PreTokenizer};
use crate::special::SpecialTokens;
use crate::{TokenAttr, Tokenizer, TokenizerError, VocabType};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_MERGES: &str = "tokenizer.ggml.merges";

/// Texts that make a token end-of-generation (llama.cpp's list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "[e~[",
];

/// Texts that identify the end-of-turn token when the file does not name one.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "<end_of_utterance>",
];

/// Fill-in-the-middle pad / repo / file-separator tokens: end generation in llama.cpp.
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// gpt-oss markup that llama.cpp always renders and always parses (made user-defined).
const HARMONY_MARKUP: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

fn bad(key: &str, problem: impl Into<String>) -> TokenizerError {
    TokenizerError::BadKey {
        key: key.to_string(),
        problem: problem.into(),
    }
}

/// An optional token id key; ids outside the vocabulary are ignored (llama.cpp warns and keeps
/// the default).
fn token_id_key(meta: &Metadata, name: &str, n_vocab: usize) -> Option<Option<u32>> {
    let key = format!("tokenizer.ggml.{name}_token_id");
    let v = meta.get(&key)?.as_u64()?;
    if v < n_vocab as u64 {
        Some(Some(v as u32))
    } else {
        tracing::warn!("{key} = {v} is outside the vocabulary ({n_vocab} tokens); ignored");
        None
    }
}

fn bool_key(meta: &Metadata, name: &str) -> Option<bool> {
    meta.get(name).and_then(MetaValue::as_bool)
}

fn attr_from_type(t: i64) -> TokenAttr {
    match t {
        1 => TokenAttr::NORMAL,
        2 => TokenAttr::UNKNOWN,
        3 => TokenAttr::CONTROL,
        4 => TokenAttr::USER_DEFINED,
        5 => TokenAttr::UNUSED,
        6 => TokenAttr::BYTE,
        _ => TokenAttr(0),
    }
}

/// Builds the tokenizer the file describes, step by step as llama.cpp's
/// `llama_vocab::impl::load` does (the order of the steps decides which error a broken file
/// reports first).
pub(crate) fn from_metadata(meta: &Metadata) -> Result<Tokenizer, TokenizerError> {
    let vocab_type = read_vocab_type(meta)?;
    let (pre_name, pre_spec) = read_pre_tokenizer(meta, vocab_type)?;
    let texts = read_token_texts(meta)?;
    let text_to_id = index_token_texts(&texts)?;
    let n = texts.len();
    let mut attrs = read_token_types(meta, n)?;
    let scores = read_scores(meta, n)?;
    let mut ids = SpecialIds::from_keys(meta, vocab_type, pre_spec, n);
    let add = AddFlags::from_keys(meta, vocab_type, pre_spec, &ids)?;
    ids.find_missing_by_text(&text_to_id, &mut attrs);
    let eog = end_of_generation(&ids, &text_to_id, &mut attrs);
    let pieces = token_pieces(&texts, &attrs, vocab_type);
    let specials = special_matcher(&texts, &attrs)?;
    let spm_byte_ids = spm_byte_ids(vocab_type, &text_to_id);
    let (bpe, pre) = match pre_spec {
        Some(spec) => (
            Some(bpe_model(meta, &spec, &text_to_id, &pieces, &attrs)?),
            Some(PreTokenizer::new(&spec)?),
        ),
        None => (None, None),
    };
    let spm_words_independent = vocab_type == VocabType::Spm
        && crate::spm::words_are_independent(texts.iter().map(|t| &**t));

    static NEXT_UID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    Ok(Tokenizer {
        uid: NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        vocab_type,
        pre_name,
        texts,
        pieces,
        attrs,
        text_to_id,
        scores,
        bpe,
        pre,
        spm_byte_ids,
        spm_words_independent,
        specials,
        add_space_prefix: add.space_prefix,
        add_bos: add.bos,
        add_eos: add.eos,
        bos: ids.bos,
        eos: ids.eos,
        eot: ids.eot,
        eom: ids.eom,
        unk: ids.unk,
        pad: ids.pad,
        eog,
    })
}

/// The tokenizer kind from `tokenizer.ggml.model`: `gpt2` (byte-level BPE) or `llama`
/// (SentencePiece).
fn read_vocab_type(meta: &Metadata) -> Result<VocabType, TokenizerError> {
    let model = meta
        .get_str(KEY_MODEL)
        .ok_or_else(|| TokenizerError::MissingKey(KEY_MODEL.into()))?;
    match model {
        "gpt2" => Ok(VocabType::Bpe),
        "llama" => Ok(VocabType::Spm),
        other => Err(TokenizerError::UnknownModel(other.to_string())),
    }
}

/// The pre-tokenizer's name (`default` when the file names none) and, for BPE, what it
/// selects.
fn read_pre_tokenizer(
    meta: &Metadata,
    vocab_type: VocabType,
) -> Result<(String, Option<PreSpec>), TokenizerError> {
    let pre_name = meta.get_str(KEY_PRE).unwrap_or("default").to_string();
    let pre_spec = match vocab_type {
        VocabType::Bpe => {
            if meta.get(KEY_PRE).is_none() {
                tracing::warn!(
                    "GGUF has no {KEY_PRE}; using the 'default' pre-tokenizer (quality may suffer)"
                );
            }
            Some(
                spec_for(&pre_name)
                    .ok_or_else(|| TokenizerError::UnknownPreTokenizer(pre_name.clone()))?,
            )
        }
        VocabType::Spm => None,
    };
    Ok((pre_name, pre_spec))
}

/// The vocabulary's token texts; an empty one becomes `[EMPTY_<id>]` (as in llama.cpp).
fn read_token_texts(meta: &Metadata) -> Result<Vec<Box<str>>, TokenizerError> {
    let tokens = meta
        .get_array(KEY_TOKENS)
        .ok_or_else(|| TokenizerError::MissingKey(KEY_TOKENS.into()))?;
    let n = tokens.len();
    if n == 0 || n > u32::MAX as usize - 1 {
        return Err(bad(KEY_TOKENS, format!("{n} tokens")));
    }
    let mut texts: Vec<Box<str>> = Vec::with_capacity(n);
    for (i, t) in tokens.iter().enumerate() {
        let s = t
            .as_str()
            .ok_or_else(|| bad(KEY_TOKENS, "not an array of strings"))?;
        texts.push(if s.is_empty() {
            format!("[EMPTY_{i}]").into()
        } else {
            s.into()
        });
    }
    Ok(texts)
}

/// Text → id of every token; two tokens with one text are an error.
fn index_token_texts(texts: &[Box<str>]) -> Result<FxHashMap<Box<[u8]>, u32>, TokenizerError> {
    let mut text_to_id: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
    text_to_id.reserve(texts.len());
    for (i, t) in texts.iter().enumerate() {
        if let Some(prev) = text_to_id.insert(t.as_bytes().into(), i as u32) {
            return Err(TokenizerError::Invalid(format!(
                "duplicate token {t:?} has ids {prev} and {i}"
            )));
        }
    }
    Ok(text_to_id)
}

/// Each token's attributes from `tokenizer.ggml.token_type`; all normal when the file has
/// none.
fn read_token_types(meta: &Metadata, n: usize) -> Result<Vec<TokenAttr>, TokenizerError> {
    let mut attrs = vec![TokenAttr::NORMAL; n];
    if let Some(types) = meta.get_array(KEY_TYPES) {
        if types.len() < n {
            return Err(bad(
                KEY_TYPES,
                format!("{} entries for {n} tokens", types.len()),
            ));
        }
        for (a, t) in attrs.iter_mut().zip(types) {
            *a = attr_from_type(
                t.as_i64()
                    .ok_or_else(|| bad(KEY_TYPES, "not an integer array"))?,
            );
        }
    }
    Ok(attrs)
}

/// Each token's score from `tokenizer.ggml.scores`; empty when the file has none.
fn read_scores(meta: &Metadata, n: usize) -> Result<Vec<f32>, TokenizerError> {
    let Some(s) = meta.get_array(KEY_SCORES) else {
        return Ok(Vec::new());
    };
    if s.len() < n {
        return Err(bad(
            KEY_SCORES,
            format!("{} entries for {n} tokens", s.len()),
        ));
    }
    s[..n]
        .iter()
        .map(|v| {
            v.as_f64()
                .map(|f| f as f32)
                .ok_or_else(|| bad(KEY_SCORES, "not a number array"))
        })
        .collect()
}

/// The special token ids: from the file's `*_token_id` keys, else llama.cpp's defaults per
/// tokenizer kind, else (end-of-turn, end-of-message, fill-in-the-middle) found by text.
struct SpecialIds {
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    fim_pad: Option<u32>,
    fim_rep: Option<u32>,
    fim_sep: Option<u32>,
}

impl SpecialIds {
    /// The ids the file names, over llama.cpp's defaults for `vocab_type` (ids outside the
    /// `n`-token vocabulary dropped).
    fn from_keys(
        meta: &Metadata,
        vocab_type: VocabType,
        pre_spec: Option<PreSpec>,
        n: usize,
    ) -> SpecialIds {
        let (mut bos, mut eos, mut unk) = match vocab_type {
            VocabType::Spm => (Some(1), Some(2), Some(0)),
            VocabType::Bpe => (None, None, None),
        };
        if pre_spec.is_some_and(|p| p.no_default_bos) {
            bos = None;
        }
        let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        bos = in_range(bos);
        eos = in_range(eos);
        unk = in_range(unk);
        if let Some(v) = token_id_key(meta, "bos", n) {
            bos = v;
        }
        if let Some(v) = token_id_key(meta, "eos", n) {
            eos = v;
        }
        if let Some(v) = token_id_key(meta, "unknown", n) {
            unk = v;
        }
        SpecialIds {
            bos,
            eos,
            unk,
            pad: token_id_key(meta, "padding", n).flatten(),
            eot: token_id_key(meta, "eot", n).flatten(),
            eom: token_id_key(meta, "eom", n).flatten(),
            fim_pad: token_id_key(meta, "fim_pad", n).flatten(),
            fim_rep: token_id_key(meta, "fim_rep", n).flatten(),
            fim_sep: token_id_key(meta, "fim_sep", n).flatten(),
        }
    }

    /// Fills the end-of-turn, end-of-message and fill-in-the-middle ids the file does not name
    /// from their known texts (lowest id first when several match), and makes the tokens found
    /// control tokens.
    fn find_missing_by_text(
        &mut self,
        text_to_id: &FxHashMap<Box<[u8]>, u32>,
        attrs: &mut [TokenAttr],
    ) {
        let slots: [(&mut Option<u32>, &[&str]); 5] = [
            (&mut self.eot, EOT_TEXTS),
            (&mut self.eom, &["<|eom_id|>"]),
            (&mut self.fim_pad, FIM_PAD_TEXTS),
            (&mut self.fim_rep, FIM_REP_TEXTS),
            (&mut self.fim_sep, FIM_SEP_TEXTS),
        ];
        for (id, texts) in slots {
            if id.is_none() {
                *id = lowest_id(text_to_id, texts);
                mark_control(*id, attrs);
            }
        }
    }
}

/// The lowest id among the tokens with these texts.
fn lowest_id(text_to_id: &FxHashMap<Box<[u8]>, u32>, list: &[&str]) -> Option<u32> {
    let mut ids: Vec<u32> = list
        .iter()
        .filter_map(|t| text_to_id.get(t.as_bytes()).copied())
        .collect();
    ids.sort_unstable();
    ids.first().copied()
}

fn mark_control(id: Option<u32>, attrs: &mut [TokenAttr]) {
    if let Some(i) = id {
        attrs[i as usize].0 |= TokenAttr::CONTROL.0;
    }
}

/// Whether encoding adds BOS / EOS and a leading space: the file's keys over llama.cpp's
/// defaults per tokenizer kind.
struct AddFlags {
    bos: bool,
    eos: bool,
    space_prefix: bool,
}

impl AddFlags {
    /// The flags; adding a BOS or EOS token the file does not name is an error.
    fn from_keys(
        meta: &Metadata,
        vocab_type: VocabType,
        pre_spec: Option<PreSpec>,
        ids: &SpecialIds,
    ) -> Result<AddFlags, TokenizerError> {
        let (mut bos, mut eos, mut space_prefix) = match vocab_type {
            VocabType::Spm => (true, false, true),
            VocabType::Bpe => (pre_spec.is_some_and(|p| p.default_add_bos), false, false),
        };
        if let Some(v) = bool_key(meta, "tokenizer.ggml.add_space_prefix") {
            space_prefix = v;
        }
        if let Some(v) = bool_key(meta, "tokenizer.ggml.add_bos_token") {
            bos = v;
        }
        if let Some(v) = bool_key(meta, "tokenizer.ggml.add_eos_token") {
            eos = v;
        }
        if bos && ids.bos.is_none() {
            return Err(TokenizerError::Invalid(
                "tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"
                    .into(),
            ));
        }
        if eos && ids.eos.is_none() {
            return Err(TokenizerError::Invalid(
                "tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set"
                    .into(),
            ));
        }
        Ok(AddFlags {
            bos,
            eos,
            space_prefix,
        })
    }
}

/// The end-of-generation set (sorted): the fill-in-the-middle, EOS, EOT and EOM tokens and
/// every token with a known end-of-generation text, which become control tokens; gpt-oss
/// markup becomes user-defined. Then llama.cpp's fix-ups for o200k_harmony and gemma4.
fn end_of_generation(
    ids: &SpecialIds,
    text_to_id: &FxHashMap<Box<[u8]>, u32>,
    attrs: &mut [TokenAttr],
) -> Vec<u32> {
    let mut eog: Vec<u32> = [ids.fim_pad, ids.fim_rep, ids.fim_sep]
        .into_iter()
        .flatten()
        .collect();
    for t in EOG_TEXTS {
        if let Some(&id) = text_to_id.get(t.as_bytes()) {
            eog.push(id);
            mark_control(Some(id), attrs);
        }
    }
    for t in HARMONY_MARKUP {
        if let Some(&id) = text_to_id.get(t.as_bytes()) {
            attrs[id as usize] = TokenAttr::USER_DEFINED;
        }
    }
    eog.extend([ids.eos, ids.eot, ids.eom].into_iter().flatten());
    eog.sort_unstable();
    eog.dedup();
    // o200k_harmony: with <|return|> and <|call|> ending generation, <|end|> must not.
    let has = |eog: &[u32], t: &str| {
        text_to_id
            .get(t.as_bytes())
            .is_some_and(|id| eog.contains(id))
    };
    let end_id = text_to_id.get("<|end|>".as_bytes()).copied();
    if let Some(end) = end_id.filter(|e| eog.contains(e)) {
        let has_call = has(&eog, "<|call|>") || has(&eog, "<|calls|>");
        if has_call && (has(&eog, "<|return|>") || has(&eog, "<|flush|>")) {
            eog.retain(|&e| e != end);
            attrs[end as usize] = TokenAttr::USER_DEFINED;
        }
    }
    // gemma4 / paddleocr: with <|tool_response> present, </s> is ordinary.
    if has(&eog, "<|tool_response>") {
        if let Some(s) = text_to_id
            .get("</s>".as_bytes())
            .copied()
            .filter(|s| eog.contains(s))
        {
            eog.retain(|&e| e != s);
            attrs[s as usize] = TokenAttr::NORMAL;
        }
    }
    eog
}

/// The detokenized bytes of each token.
fn token_pieces(texts: &[Box<str>], attrs: &[TokenAttr], vocab_type: VocabType) -> Vec<Box<[u8]>> {
    let rev = ReverseTable::new();
    texts
        .iter()
        .zip(attrs)
        .map(|(t, &a)| -> Box<[u8]> {
            if a.contains(TokenAttr(
                TokenAttr::UNKNOWN.0 | TokenAttr::CONTROL.0 | TokenAttr::USER_DEFINED.0,
            )) {
                t.as_bytes().into()
            } else if a.contains(TokenAttr::NORMAL) {
                match vocab_type {
                    VocabType::Bpe => decode_token_text(t, &rev).into(),
                    VocabType::Spm => t.replace('\u{2581}', " ").into_bytes().into(),
                }
            } else if a.contains(TokenAttr::BYTE) {
                parse_byte_token(t).map_or_else(|| Box::from(&[][..]), |b| Box::from(&[b][..]))
            } else {
                Box::from(&[][..])
            }
        })
        .collect()
}

/// The matcher of control, user-defined and unknown tokens in text; user-defined ones are
/// always parsed.
fn special_matcher(
    texts: &[Box<str>],
    attrs: &[TokenAttr],
) -> Result<SpecialTokens, TokenizerError> {
    SpecialTokens::new(
        attrs
            .iter()
            .enumerate()
            .filter(|(_, a)| {
                a.contains(TokenAttr(
                    TokenAttr::CONTROL.0 | TokenAttr::USER_DEFINED.0 | TokenAttr::UNKNOWN.0,
                ))
            })
            .map(|(i, a)| {
                let always = !a.contains(TokenAttr(TokenAttr::CONTROL.0 | TokenAttr::UNKNOWN.0));
                (i as u32, texts[i].as_bytes().into(), always)
            })
            .collect(),
    )
}

/// SentencePiece byte tokens: `<0xXX>`, else the byte itself as a token (all [`NO_TOKEN`]
/// for BPE).
fn spm_byte_ids(vocab_type: VocabType, text_to_id: &FxHashMap<Box<[u8]>, u32>) -> [u32; 256] {
    let mut spm_byte_ids = [NO_TOKEN; 256];
    if vocab_type == VocabType::Spm {
        for (b, slot) in spm_byte_ids.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = text_to_id
                .get(hex.as_bytes())
                .or_else(|| text_to_id.get(&[b as u8][..]))
                .copied()
                .unwrap_or(NO_TOKEN);
        }
    }
    spm_byte_ids
}

/// The BPE tables: each byte's token, the merges, and the whole-word lookup when the
/// pre-tokenizer ignores merges.
fn bpe_model(
    meta: &Metadata,
    spec: &PreSpec,
    text_to_id: &FxHashMap<Box<[u8]>, u32>,
    pieces: &[Box<[u8]>],
    attrs: &[TokenAttr],
) -> Result<BpeModel, TokenizerError> {
    let merges_list = meta
        .get_array(KEY_MERGES)
        .ok_or_else(|| TokenizerError::MissingKey(KEY_MERGES.into()))?;
    let chars = byte_to_char();
    let mut byte_ids = [NO_TOKEN; 256];
    for (b, slot) in byte_ids.iter_mut().enumerate() {
        let mut buf = [0u8; 4];
        let s = chars[b].encode_utf8(&mut buf);
        *slot = text_to_id.get(s.as_bytes()).copied().unwrap_or(NO_TOKEN);
    }
    let merges = read_merges(merges_list, text_to_id)?;
    let whole_words = spec.ignore_merges.then(|| {
        let mut m: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
        for (i, (p, a)) in pieces.iter().zip(attrs).enumerate() {
            if *a == TokenAttr::NORMAL {
                m.entry(p.clone()).or_insert(i as u32);
            }
        }
        m
    });
    Ok(BpeModel {
        byte_ids,
        merges,
        whole_words,
    })
}

/// `(left << 32) | right` → `(rank, merged token)` from `tokenizer.ggml.merges` (`"left
/// right"` strings, rank = position; the first of duplicates wins). Merges of strings outside
/// the vocabulary are skipped.
fn read_merges(
    merges_list: &[MetaValue],
    text_to_id: &FxHashMap<Box<[u8]>, u32>,
) -> Result<FxHashMap<u64, (u32, u32)>, TokenizerError> {
    let mut merges = FxHashMap::default();
    merges.reserve(merges_list.len());
    let mut skipped = 0usize;
    let mut joined = String::new();
    for (rank, m) in merges_list.iter().enumerate() {
        let m = m
            .as_str()
            .ok_or_else(|| bad(KEY_MERGES, "not an array of strings"))?;
        // Split at the first space after the first character.
        let Some(pos) = m
            .as_bytes()
            .iter()
            .skip(1)
            .position(|&b| b == b' ')
            .map(|p| p + 1)
        else {
            skipped += 1;
            continue;
        };
        let (left, right) = (&m[..pos], &m[pos + 1..]);
        joined.clear();
        joined.push_str(left);
        joined.push_str(right);
        match (
            text_to_id.get(left.as_bytes()),
            text_to_id.get(right.as_bytes()),
            text_to_id.get(joined.as_bytes()),
        ) {
            (Some(&l), Some(&r), Some(&j)) => {
                merges
                    .entry((u64::from(l) << 32) | u64::from(r))
                    .or_insert((rank as u32, j));
            }
            _ => skipped += 1,
        }
    }
    if skipped > 0 {
        tracing::debug!("{skipped} BPE merges refer to strings outside the vocabulary; ignored");
    }
    Ok(merges)
}

/// `<0xAB>` → 0xAB.
fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}
