//! DRY ("don't repeat yourself"), llama.cpp's repetition penalty for sequences: a token that
//! would extend a repeat of at least `allowed_length` tokens of the recent context loses
//! `multiplier × base^(length − allowed_length)` of its logit. Sequence breakers (newlines,
//! punctuation) end the stretch a repeat may reach back over.

use std::collections::HashMap;

/// DRY's settings (llama-server's defaults: off, base 1.75, allowed length 2, the whole
/// context, breakers `\n`, `:`, `"`, `*`).
#[derive(Clone, Debug, PartialEq)]
pub struct DryParams {
    /// Penalty scale; 0 = off.
    pub multiplier: f32,
    /// Growth per token beyond `allowed_length`; below 1 = off.
    pub base: f32,
    /// Longest repeat left unpenalised.
    pub allowed_length: usize,
    /// How many recent context tokens it looks at (`None`: all of them; `Some(0)`: off).
    pub penalty_last_n: Option<usize>,
    /// Sequence breakers as token sequences: a head token and the tokens that must follow it
    /// (empty for a one-token breaker). See [`DryParams::breakers_of`].
    pub breakers: Vec<(u32, Vec<u32>)>,
}

impl Default for DryParams {
    fn default() -> Self {
        DryParams {
            multiplier: 0.0,
            base: 1.75,
            allowed_length: 2,
            penalty_last_n: None,
            breakers: Vec::new(),
        }
    }
}

/// Longest breaker string used, in bytes, and most tail tokens kept (llama.cpp's limits).
const MAX_BREAKER_BYTES: usize = 40;
const MAX_TAIL_TOKENS: usize = 20;

/// `log(f32::MAX)`: the exponent is clamped so that `base^exp` stays finite.
const F32_MAX_LN: f32 = 88.72284;

impl DryParams {
    /// llama-server's default sequence breakers.
    pub const DEFAULT_BREAKERS: [&'static str; 4] = ["\n", ":", "\"", "*"];

    /// Whether the penalty can change anything.
    pub fn enabled(&self) -> bool {
        self.multiplier != 0.0 && self.base >= 1.0 && self.penalty_last_n != Some(0)
    }

    /// The breakers of the strings `breakers` as llama.cpp derives them from the vocabulary:
    /// every token whose text holds a breaker is a one-token breaker; a token whose text ends
    /// with the start of a breaker is a head whose tail is the rest of the breaker, tokenized
    /// by `encode`. `token_text(id)` is a token's text; strings are cut to 40 bytes, tails to
    /// 20 tokens, empty strings skipped.
    pub fn breakers_of(
        breakers: &[String],
        n_vocab: usize,
        token_text: impl Fn(u32) -> Vec<u8>,
        encode: impl Fn(&[u8]) -> Vec<u32>,
    ) -> Vec<(u32, Vec<u32>)> {
        let strings: Vec<&[u8]> = breakers
            .iter()
            .map(|s| &s.as_bytes()[..s.len().min(MAX_BREAKER_BYTES)])
            .filter(|s| !s.is_empty())
            .collect();
        let mut out: Vec<(u32, Vec<u32>)> = Vec::new();
        if strings.is_empty() {
            return out;
        }
        for id in 0..n_vocab as u32 {
            let word = token_text(id);
            for s in &strings {
                if contains(&word, s) {
                    push_unique(&mut out, id, Vec::new());
                    continue;
                }
                // Each place the word's end overlaps the breaker's start.
                for pos in (0..word.len()).filter(|&p| word[p] == s[0]) {
                    let n = (word.len() - pos).min(s.len());
                    if word[pos..pos + n] == s[..n] {
                        let mut tail = encode(&s[n..]);
                        tail.truncate(MAX_TAIL_TOKENS);
                        push_unique(&mut out, id, tail);
                    }
                }
            }
        }
        out
    }

    /// Subtracts the penalty from the logits of `cand`, given the context `history` (oldest
    /// first; the last `penalty_last_n` count).
    pub(crate) fn apply(&self, history: &[u32], cand: &mut [(u32, f32)]) {
        if !self.enabled() {
            return;
        }
        let n = self
            .penalty_last_n
            .map_or(history.len(), |l| l.min(history.len()));
        let allowed = self.allowed_length;
        if n <= allowed {
            return;
        }
        // Most recent first.
        let rev: Vec<u32> = history[history.len() - n..].iter().rev().copied().collect();
        let mut heads: HashMap<u32, Vec<&[u32]>> = HashMap::new();
        for (head, tail) in &self.breakers {
            heads.entry(*head).or_default().push(tail);
        }
        let limit = repeat_limit(&rev, &heads);
        if limit < allowed {
            return;
        }
        // z[k]: how many of the latest tokens also end k tokens earlier.
        let z = z_array(&rev);
        let mut longest: HashMap<u32, usize> = HashMap::new();
        for (k, &len) in z.iter().enumerate().skip(1) {
            let len = len.min(limit);
            if len < allowed {
                continue;
            }
            // The token that followed that earlier occurrence would extend the repeat.
            let e = longest.entry(rev[k - 1]).or_default();
            *e = (*e).max(len);
        }
        if longest.is_empty() {
            return;
        }
        let max_exp = if self.base > 1.000001 {
            (F32_MAX_LN / self.base.ln()) as usize
        } else {
            0
        };
        for c in cand.iter_mut() {
            let Some(&len) = longest.get(&c.0) else {
                continue;
            };
            let breaker = heads
                .get(&c.0)
                .is_some_and(|t| t.iter().any(|t| t.is_empty()));
            if breaker {
                continue;
            }
            let mut exp = len - allowed;
            if max_exp > 0 {
                exp = exp.min(max_exp);
            }
            c.1 -= self.multiplier * self.base.powi(exp as i32);
        }
    }
}

/// How far back a repeat may reach in `rev` (most recent first): up to the most recent
/// sequence breaker (the longest one ending there; `heads` maps a head token to its tails),
/// else the whole window.
fn repeat_limit(rev: &[u32], heads: &HashMap<u32, Vec<&[u32]>>) -> usize {
    for (i, t) in rev.iter().enumerate() {
        let Some(tails) = heads.get(t) else { continue };
        let mut best: Option<usize> = None;
        for tail in tails {
            let len = tail.len();
            let matches = len <= i
                && best.is_none_or(|b| len > b)
                && (0..len).all(|o| tail[o] == rev[i - o - 1]);
            if matches {
                best = Some(len);
            }
        }
        if let Some(len) = best {
            return i - len;
        }
    }
    rev.len()
}

fn contains(word: &[u8], s: &[u8]) -> bool {
    word.windows(s.len()).any(|w| w == s)
}

fn push_unique(out: &mut Vec<(u32, Vec<u32>)>, id: u32, tail: Vec<u32>) {
    // Ids come in order: the entries of `id` are the last ones.
    let mut same = out.iter().rev().take_while(|(h, _)| *h == id);
    if !same.any(|(_, t)| *t == tail) {
        out.push((id, tail));
    }
}

/// The Z-array of `s`: `z[k]` is the length of the longest common prefix of `s` and `s[k..]`
/// (`z[0]` is 0). Linear time.
fn z_array(s: &[u32]) -> Vec<usize> {
    let n = s.len();
    let mut z = vec![0; n];
    let (mut l, mut r) = (0, 0);
    for k in 1..n {
        let mut len = if k < r { z[k - l].min(r - k) } else { 0 };
        while k + len < n && s[len] == s[k + len] {
            len += 1;
        }
        z[k] = len;
        if k + len > r {
            (l, r) = (k, k + len);
        }
    }
    z
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dry(allowed: usize, breakers: Vec<(u32, Vec<u32>)>) -> DryParams {
        DryParams {
            multiplier: 1.0,
            base: 2.0,
            allowed_length: allowed,
            penalty_last_n: None,
            breakers,
        }
    }

    fn penalties(p: &DryParams, history: &[u32], n_vocab: u32) -> Vec<f32> {
        let mut cand: Vec<(u32, f32)> = (0..n_vocab).map(|i| (i, 0.0)).collect();
        p.apply(history, &mut cand);
        cand.into_iter().map(|c| -c.1).collect()
    }

    #[test]
    fn z_array_is_the_longest_common_prefix() {
        assert_eq!(z_array(&[1, 2, 1, 2, 1, 3]), vec![0, 0, 3, 0, 1, 0]);
        let s = [5u32, 5, 5, 5];
        assert_eq!(z_array(&s), vec![0, 3, 2, 1]);
    }

    #[test]
    fn a_token_extending_a_repeat_is_penalised() {
        // 0 1 2 3 | 0 1 2: emitting 3 repeats "0 1 2 3" (the repeat so far is 3 tokens);
        // allowed 2 -> 1 × 2^(3-2) = 2. No other token continues a repeat.
        let p = dry(2, Vec::new());
        assert_eq!(
            penalties(&p, &[0, 1, 2, 3, 0, 1, 2], 5),
            vec![0.0, 0.0, 0.0, 2.0, 0.0]
        );
        // Allowed 3: 2^0 = 1; allowed 4: nothing.
        assert_eq!(
            penalties(&dry(3, Vec::new()), &[0, 1, 2, 3, 0, 1, 2], 5)[3],
            1.0
        );
        assert!(penalties(&dry(4, Vec::new()), &[0, 1, 2, 3, 0, 1, 2], 5)
            .iter()
            .all(|&x| x == 0.0));
        // A window too short to see the first occurrence: nothing.
        let short = DryParams {
            penalty_last_n: Some(4),
            ..dry(2, Vec::new())
        };
        assert!(penalties(&short, &[0, 1, 2, 3, 0, 1, 2], 5)
            .iter()
            .all(|&x| x == 0.0));
    }

    #[test]
    fn breakers_bound_the_repeat_and_are_never_penalised() {
        // "9 0 1" repeats, so 7 would extend a 3-token repeat (2^1); with 9 a breaker the
        // repeat reaches back to it only, 2 tokens (2^0).
        let h = [9, 0, 1, 7, 9, 0, 1];
        assert_eq!(penalties(&dry(2, Vec::new()), &h, 10)[7], 2.0);
        let cut = dry(2, vec![(9, Vec::new())]);
        assert_eq!(penalties(&cut, &h, 10)[7], 1.0);
        // The breaker itself, were it to extend a repeat, is not penalised.
        let h = [1, 2, 9, 5, 1, 2];
        assert_eq!(penalties(&dry(2, Vec::new()), &h, 10)[9], 1.0);
        assert_eq!(penalties(&dry(2, vec![(9, Vec::new())]), &h, 10)[9], 0.0);
    }

    #[test]
    fn breakers_from_the_vocabulary() {
        // Tokens: 0 "a", 1 "b:", 2 "x\n", 3 "\"", 4 "q*".
        let words: [&[u8]; 5] = [b"a", b"b:", b"x\n", b"\"", b"q*"];
        let b = DryParams::breakers_of(
            &[":".into(), "x\ny".into(), String::new()],
            words.len(),
            |id| words[id as usize].to_vec(),
            |s| s.iter().map(|&c| c as u32 + 100).collect(),
        );
        // ":" is in token 1; "x\ny" starts at the end of token 2 with tail "y".
        assert_eq!(b, vec![(1, vec![]), (2, vec![b'y' as u32 + 100])]);
    }
}
