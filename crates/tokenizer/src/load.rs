//! Building a [`Tokenizer`] from GGUF metadata, with llama.cpp's defaults and fix-ups
//! (`llama_vocab::impl::load`).

use hmoe_gguf::{MetaValue, Metadata};

use crate::bpe::{BpeModel, NO_TOKEN};
use crate::byte_level::{byte_to_char, decode_token_text, ReverseTable};
use crate::fxhash::FxHashMap;
use crate::pretok::{spec_for, PreTokenizer};
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

pub(crate) fn from_metadata(meta: &Metadata) -> Result<Tokenizer, TokenizerError> {
    let model = meta
        .get_str(KEY_MODEL)
        .ok_or_else(|| TokenizerError::MissingKey(KEY_MODEL.into()))?;
    let vocab_type = match model {
        "gpt2" => VocabType::Bpe,
        "llama" => VocabType::Spm,
        other => return Err(TokenizerError::UnknownModel(other.to_string())),
    };

    // Pre-tokenizer (BPE only).
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

    // Tokens.
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
    let mut text_to_id: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
    text_to_id.reserve(n);
    for (i, t) in texts.iter().enumerate() {
        if let Some(prev) = text_to_id.insert(t.as_bytes().into(), i as u32) {
            return Err(TokenizerError::Invalid(format!(
                "duplicate token {t:?} has ids {prev} and {i}"
            )));
        }
    }

    // Types and scores.
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
    let mut scores = Vec::new();
    if let Some(s) = meta.get_array(KEY_SCORES) {
        if s.len() < n {
            return Err(bad(
                KEY_SCORES,
                format!("{} entries for {n} tokens", s.len()),
            ));
        }
        scores = s[..n]
            .iter()
            .map(|v| {
                v.as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| bad(KEY_SCORES, "not a number array"))
            })
            .collect::<Result<_, _>>()?;
    }

    // Special ids and flags, with llama.cpp's defaults per tokenizer kind.
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
    let pad = token_id_key(meta, "padding", n).flatten();
    let mut eot = token_id_key(meta, "eot", n).flatten();
    let mut eom = token_id_key(meta, "eom", n).flatten();
    let mut fim_pad = token_id_key(meta, "fim_pad", n).flatten();
    let mut fim_rep = token_id_key(meta, "fim_rep", n).flatten();
    let mut fim_sep = token_id_key(meta, "fim_sep", n).flatten();

    let (mut add_bos, mut add_eos, mut add_space_prefix) = match vocab_type {
        VocabType::Spm => (true, false, true),
        VocabType::Bpe => (pre_spec.is_some_and(|p| p.default_add_bos), false, false),
    };
    if let Some(v) = bool_key(meta, "tokenizer.ggml.add_space_prefix") {
        add_space_prefix = v;
    }
    if let Some(v) = bool_key(meta, "tokenizer.ggml.add_bos_token") {
        add_bos = v;
    }
    if let Some(v) = bool_key(meta, "tokenizer.ggml.add_eos_token") {
        add_eos = v;
    }
    if add_bos && bos.is_none() {
        return Err(TokenizerError::Invalid(
            "tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"
                .into(),
        ));
    }
    if add_eos && eos.is_none() {
        return Err(TokenizerError::Invalid(
            "tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set"
                .into(),
        ));
    }

    // Special tokens found by their text (lowest id first when several match).
    let lookup = |list: &[&str]| -> Option<u32> {
        let mut ids: Vec<u32> = list
            .iter()
            .filter_map(|t| text_to_id.get(t.as_bytes()).copied())
            .collect();
        ids.sort_unstable();
        ids.first().copied()
    };
    let mark_control = |id: Option<u32>, attrs: &mut [TokenAttr]| {
        if let Some(i) = id {
            attrs[i as usize].0 |= TokenAttr::CONTROL.0;
        }
    };
    if eot.is_none() {
        eot = lookup(EOT_TEXTS);
        mark_control(eot, &mut attrs);
    }
    if eom.is_none() {
        eom = lookup(&["<|eom_id|>"]);
        mark_control(eom, &mut attrs);
    }
    if fim_pad.is_none() {
        fim_pad = lookup(FIM_PAD_TEXTS);
        mark_control(fim_pad, &mut attrs);
    }
    if fim_rep.is_none() {
        fim_rep = lookup(FIM_REP_TEXTS);
        mark_control(fim_rep, &mut attrs);
    }
    if fim_sep.is_none() {
        fim_sep = lookup(FIM_SEP_TEXTS);
        mark_control(fim_sep, &mut attrs);
    }

    // End-of-generation set.
    let mut eog: Vec<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
    for t in EOG_TEXTS {
        if let Some(&id) = text_to_id.get(t.as_bytes()) {
            eog.push(id);
            mark_control(Some(id), &mut attrs);
        }
    }
    for t in HARMONY_MARKUP {
        if let Some(&id) = text_to_id.get(t.as_bytes()) {
            attrs[id as usize] = TokenAttr::USER_DEFINED;
        }
    }
    eog.extend([eos, eot, eom].into_iter().flatten());
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

    // Detokenized bytes of each token.
    let rev = ReverseTable::new();
    let pieces: Vec<Box<[u8]>> = texts
        .iter()
        .zip(&attrs)
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
        .collect();

    // Special-token matcher.
    let specials = SpecialTokens::new(
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
    )?;

    // SentencePiece byte tokens: `<0xXX>`, else the byte itself as a token.
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

    // BPE merges.
    let (bpe, pre) = match pre_spec {
        Some(spec) => {
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
                tracing::debug!(
                    "{skipped} BPE merges refer to strings outside the vocabulary; ignored"
                );
            }
            let whole_words = spec.ignore_merges.then(|| {
                let mut m: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
                for (i, (p, a)) in pieces.iter().zip(&attrs).enumerate() {
                    if *a == TokenAttr::NORMAL {
                        m.entry(p.clone()).or_insert(i as u32);
                    }
                }
                m
            });
            (
                Some(BpeModel {
                    byte_ids,
                    merges,
                    whole_words,
                }),
                Some(PreTokenizer::new(&spec)?),
            )
        }
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
        add_space_prefix,
        add_bos,
        add_eos,
        bos,
        eos,
        eot,
        eom,
        unk,
        pad,
        eog,
    })
}

/// `<0xAB>` → 0xAB.
fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}
