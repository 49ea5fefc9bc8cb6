//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`), as llama.cpp runs it.
//!
//! The text (spaces already replaced by U+2581) starts as one symbol per UTF-8 character. The
//! adjacent pair whose concatenation is a vocabulary token with the highest score is merged, ties
//! going to the leftmost pair, until no pair forms a token. Symbols that are not tokens fall back
//! to `<0xXX>` byte tokens.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::fxhash::FxHashMap;

/// Score with a total order (for the heap).
#[derive(Clone, Copy, PartialEq)]
struct Score(f32);

impl Eq for Score {}

impl PartialOrd for Score {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Score {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const END: usize = usize::MAX;

/// Reusable SentencePiece encoder state.
#[derive(Default)]
pub(crate) struct SpmScratch {
    syms: Vec<Sym>,
    heap: BinaryHeap<(Score, Reverse<usize>, usize, usize)>,
}

/// Length of the UTF-8 sequence that starts with `b` (1 for continuation bytes, as llama.cpp).
#[inline]
fn utf8_len(b: u8) -> usize {
    const LOOKUP: [usize; 16] = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4];
    LOOKUP[(b >> 4) as usize]
}

const SPACE: &[u8] = "\u{2581}".as_bytes();

/// Whether no token contains U+2581 right after another character. Then no token can span a
/// position where U+2581 follows a different character, merges on the two sides never interact,
/// and the text can be encoded word by word with the same result (much faster on long texts).
pub(crate) fn words_are_independent<'a>(texts: impl IntoIterator<Item = &'a str>) -> bool {
    texts.into_iter().all(|t| {
        let b = t.as_bytes();
        let mut from = 0;
        while let Some(pos) = find_space(&b[from..]) {
            let at = from + pos;
            if at > 0 && !b[..at].ends_with(SPACE) {
                return false;
            }
            from = at + SPACE.len();
        }
        true
    })
}

fn find_space(b: &[u8]) -> Option<usize> {
    b.windows(SPACE.len()).position(|w| w == SPACE)
}

/// Cuts escaped text before every U+2581 that follows another character.
pub(crate) fn words(text: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut start = 0;
    let mut i = 0;
    std::iter::from_fn(move || {
        if start >= text.len() {
            return None;
        }
        while i < text.len() {
            if i > start && text[i..].starts_with(SPACE) && !text[..i].ends_with(SPACE) {
                let w = &text[start..i];
                start = i;
                return Some(w);
            }
            i += 1;
        }
        let w = &text[start..];
        start = text.len();
        Some(w)
    })
}

/// Appends the tokens of `text` (already whitespace-escaped).
pub(crate) fn encode(
    text: &[u8],
    vocab: &FxHashMap<Box<[u8]>, u32>,
    scores: &[f32],
    byte_ids: &[u32; 256],
    out: &mut Vec<u32>,
    s: &mut SpmScratch,
) {
    s.syms.clear();
    s.heap.clear();
    let mut offs = 0;
    while offs < text.len() {
        let len = utf8_len(text[offs]).min(text.len() - offs);
        let index = s.syms.len();
        s.syms.push(Sym {
            start: offs,
            len,
            prev: index.wrapping_sub(1),
            next: if offs + len == text.len() {
                END
            } else {
                index + 1
            },
        });
        offs += len;
    }
    if s.syms.is_empty() {
        return;
    }
    if let Some(first) = s.syms.first_mut() {
        first.prev = END;
    }
    let try_add = |syms: &[Sym],
                   heap: &mut BinaryHeap<(Score, Reverse<usize>, usize, usize)>,
                   l: usize,
                   r: usize| {
        if l == END || r == END {
            return;
        }
        let start = syms[l].start;
        let size = syms[l].len + syms[r].len;
        if let Some(&id) = vocab.get(&text[start..start + size]) {
            let score = scores.get(id as usize).copied().unwrap_or(0.0);
            heap.push((Score(score), Reverse(l), r, size));
        }
    };
    for i in 1..s.syms.len() {
        try_add(&s.syms, &mut s.heap, i - 1, i);
    }
    while let Some((_, Reverse(l), r, size)) = s.heap.pop() {
        let (left, right) = (s.syms[l], s.syms[r]);
        if left.len == 0 || right.len == 0 || left.len + right.len != size {
            continue;
        }
        s.syms[l].len += right.len;
        s.syms[r].len = 0;
        s.syms[l].next = right.next;
        if right.next != END {
            s.syms[right.next].prev = l;
        }
        let (prev, next) = (s.syms[l].prev, s.syms[l].next);
        try_add(&s.syms, &mut s.heap, prev, l);
        try_add(&s.syms, &mut s.heap, l, next);
    }
    let mut i = 0;
    while i != END {
        let sym = s.syms[i];
        let piece = &text[sym.start..sym.start + sym.len];
        match vocab.get(piece) {
            Some(&id) => out.push(id),
            None => {
                for &b in piece {
                    let id = byte_ids[b as usize];
                    if id != crate::bpe::NO_TOKEN {
                        out.push(id);
                    }
                }
            }
        }
        i = sym.next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highest_score_wins_and_bytes_fall_back() {
        let mut vocab = FxHashMap::default();
        let toks: [&[u8]; 6] = [b"a", b"b", b"c", b"ab", b"bc", b"abc"];
        for (i, t) in toks.iter().enumerate() {
            vocab.insert(t.to_vec().into_boxed_slice(), i as u32);
        }
        let scores = [0.0, 0.0, 0.0, -1.0, -0.5, -2.0];
        let mut byte_ids = [crate::bpe::NO_TOKEN; 256];
        byte_ids[b'z' as usize] = 100;
        let mut out = Vec::new();
        let mut s = SpmScratch::default();
        // "bc" scores higher than "ab", so a + bc; "abc" is not reachable from (a, bc)... it is:
        // a + bc = abc is a token, merged next.
        encode(b"abc", &vocab, &scores, &byte_ids, &mut out, &mut s);
        assert_eq!(out, [5]);
        out.clear();
        encode(b"abz", &vocab, &scores, &byte_ids, &mut out, &mut s);
        assert_eq!(out, [3, 100]);
    }

    #[test]
    fn word_cutting() {
        let t = "\u{2581}a\u{2581}\u{2581}bc\u{2581}d".as_bytes();
        let w: Vec<&str> = words(t).map(|w| std::str::from_utf8(w).unwrap()).collect();
        assert_eq!(w, ["\u{2581}a", "\u{2581}\u{2581}bc", "\u{2581}d"]);
        assert_eq!(words(b"").count(), 0);
        assert!(words_are_independent([
            "\u{2581}\u{2581}x",
            "ab",
            "\u{2581}"
        ]));
        assert!(!words_are_independent(["a\u{2581}b"]));
    }
}
