//! Cutting special tokens out of raw text before the tokenizer proper runs (llama.cpp's
//! `tokenizer_st_partition`).
//!
//! Special tokens are tried longest text first; every occurrence of one in the remaining text
//! pieces becomes that token, then the next token is tried on what is left. Control and unknown
//! tokens are only cut out when `parse_special` is set; user-defined tokens always are, except
//! that no special token is cut out where it overlaps a range the caller marks as plain text (a
//! chat message's content: llama.cpp makes gpt-oss's `<|start|>` user-defined, so plain text
//! must exclude those too, or a message could forge a turn).

use std::ops::Range;

use aho_corasick::AhoCorasick;

use crate::TokenizerError;

/// A piece of the input: raw text (byte range) or an already decided token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// `text[start..end]`, still to be tokenized.
    Text(usize, usize),
    /// A special token.
    Token(u32),
}

/// The special tokens of a vocabulary.
#[derive(Debug)]
pub(crate) struct SpecialTokens {
    /// (id, text, cut out even without `parse_special`), longest text first (ties: lower id first).
    order: Vec<(u32, Box<[u8]>, bool)>,
    /// Finds which entries of `order` occur in a text at all (pattern i = `order[i]`).
    finder: Option<AhoCorasick>,
}

impl SpecialTokens {
    /// `specials`: (id, text, cut out even without `parse_special`).
    pub(crate) fn new(
        mut specials: Vec<(u32, Box<[u8]>, bool)>,
    ) -> Result<SpecialTokens, TokenizerError> {
        specials.retain(|s| !s.1.is_empty());
        specials.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
        let finder = if specials.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::new(specials.iter().map(|s| &s.1[..]))
                    .map_err(|e| TokenizerError::Invalid(format!("special token matcher: {e}")))?,
            )
        };
        Ok(SpecialTokens {
            order: specials,
            finder,
        })
    }

    /// Splits `text` into fragments, in order. A special token whose occurrence overlaps one of
    /// `plain` (sorted, disjoint byte ranges) stays text there.
    pub(crate) fn partition(
        &self,
        text: &str,
        parse_special: bool,
        plain: &[Range<usize>],
    ) -> Vec<Fragment> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(0, text.len()));
        let Some(finder) = &self.finder else {
            return frags;
        };
        let bytes = text.as_bytes();
        // Which special tokens occur anywhere (one pass), so the exact longest-first procedure
        // below only visits those.
        let mut present = vec![false; self.order.len()];
        let mut any = false;
        for m in finder.find_overlapping_iter(bytes) {
            let i = m.pattern().as_usize();
            if parse_special || self.order[i].2 {
                present[i] = true;
                any = true;
            }
        }
        if !any {
            return frags;
        }
        let mut next = Vec::with_capacity(8);
        for (i, (id, tok, _)) in self.order.iter().enumerate() {
            if !present[i] {
                continue;
            }
            next.clear();
            for &f in &frags {
                let Fragment::Text(mut start, end) = f else {
                    next.push(f);
                    continue;
                };
                let mut from = start;
                while let Some(pos) = find(&bytes[from..end], tok) {
                    let at = from + pos;
                    if overlaps(plain, at..at + tok.len()) {
                        from = at + 1;
                        continue;
                    }
                    if at > start {
                        next.push(Fragment::Text(start, at));
                    }
                    next.push(Fragment::Token(*id));
                    start = at + tok.len();
                    from = start;
                }
                if start < end {
                    next.push(Fragment::Text(start, end));
                }
            }
            std::mem::swap(&mut frags, &mut next);
        }
        frags
    }
}

/// Whether `r` overlaps one of `ranges` (sorted, disjoint).
fn overlaps(ranges: &[Range<usize>], r: Range<usize>) -> bool {
    let i = ranges.partition_point(|p| p.end <= r.start);
    ranges.get(i).is_some_and(|p| p.start < r.end)
}

/// First occurrence of `needle` in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.len() > hay.len() {
        return None;
    }
    let first = needle[0];
    let mut from = 0;
    while from + needle.len() <= hay.len() {
        let pos = from
            + hay[from..=hay.len() - needle.len()]
                .iter()
                .position(|&b| b == first)?;
        if &hay[pos..pos + needle.len()] == needle {
            return Some(pos);
        }
        from = pos + 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specials() -> SpecialTokens {
        SpecialTokens::new(vec![
            (1, b"<|a|>".to_vec().into(), false),
            (2, b"<|a|><|b|>".to_vec().into(), false),
            (3, b"[U]".to_vec().into(), true),
        ])
        .unwrap()
    }

    #[test]
    fn longest_first_and_parse_flag() {
        let s = specials();
        let t = "x<|a|><|b|>y<|a|>[U]";
        assert_eq!(
            s.partition(t, true, &[]),
            [
                Fragment::Text(0, 1),
                Fragment::Token(2),
                Fragment::Text(11, 12),
                Fragment::Token(1),
                Fragment::Token(3)
            ]
        );
        // Without parse_special only the user-defined token is cut out.
        assert_eq!(
            s.partition(t, false, &[]),
            [Fragment::Text(0, 17), Fragment::Token(3)]
        );
        assert!(s.partition("", true, &[]).is_empty());
        // Occurrences overlapping a plain range stay text, user-defined tokens too.
        assert_eq!(
            s.partition(t, true, &[1..3, 16..17]),
            [Fragment::Text(0, 17), Fragment::Token(3)]
        );
        assert_eq!(
            s.partition(t, true, std::slice::from_ref(&(1..3))),
            [
                Fragment::Text(0, 12),
                Fragment::Token(1),
                Fragment::Token(3)
            ]
        );
        assert_eq!(
            s.partition(t, true, std::slice::from_ref(&(12..17))),
            [
                Fragment::Text(0, 1),
                Fragment::Token(2),
                Fragment::Text(11, 17),
                Fragment::Token(3)
            ]
        );
        assert_eq!(
            s.partition(t, true, &[1..3, 18..19]),
            [
                Fragment::Text(0, 12),
                Fragment::Token(1),
                Fragment::Text(17, 20)
            ]
        );
        assert!(overlaps(&[2..4, 8..9], 3..5) && !overlaps(&[2..4, 8..9], 4..8));
        assert_eq!(find(b"aab", b"ab"), Some(1));
        assert_eq!(find(b"a", b"ab"), None);
    }
}
