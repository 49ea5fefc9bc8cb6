//! Byte-level BPE merges, run on token ids.
//!
//! A word starts as one symbol per byte (the token of that byte's character). The adjacent pair
//! with the lowest merge rank is merged, ties going to the leftmost pair, until no adjacent pair has
//! a merge. This is the order llama.cpp's priority queue produces.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::fxhash::FxHashMap;

/// Marks a byte without a token.
pub(crate) const NO_TOKEN: u32 = u32::MAX;

/// Words longer than this use the heap; shorter ones rescan the pairs (cheaper when short).
const HEAP_THRESHOLD: usize = 48;

/// Merge tables of a byte-level BPE vocabulary.
#[derive(Debug)]
pub(crate) struct BpeModel {
    /// Token of each byte's character, or [`NO_TOKEN`].
    pub byte_ids: [u32; 256],
    /// `(left << 32) | right` → `(rank, merged token)`.
    pub merges: FxHashMap<u64, (u32, u32)>,
    /// Decoded bytes of every normal token → id, when whole words are looked up first.
    pub whole_words: Option<FxHashMap<Box<[u8]>, u32>>,
}

/// Reusable buffers for [`BpeModel::encode_word`], and a small cache of recent words.
#[derive(Default)]
pub(crate) struct BpeScratch {
    syms: Vec<u32>,
    ranks: Vec<(u32, u32)>,
    prev: Vec<u32>,
    next: Vec<u32>,
    heap: BinaryHeap<Reverse<(u32, u32, u32, u32)>>,
    /// Which model the cache belongs to.
    owner: u64,
    cache: Vec<CacheEntry>,
}

/// Words up to this many bytes are cached.
const CACHE_WORD: usize = 22;
/// Results up to this many tokens are cached.
const CACHE_IDS: usize = 4;
/// Cache slots (direct-mapped; ~256 KiB, fits in L2 unlike the vocabulary tables).
const CACHE_SLOTS: usize = 4096;

/// One cached word → tokens.
#[derive(Clone, Copy, Default)]
struct CacheEntry {
    len: u8,
    n_ids: u8,
    word: [u8; CACHE_WORD],
    ids: [u32; CACHE_IDS],
}

#[inline]
fn word_hash(word: &[u8]) -> usize {
    use std::hash::Hasher;
    let mut h = crate::fxhash::FxHasher::default();
    h.write(word);
    (h.finish() >> 20) as usize
}

impl BpeScratch {
    /// Empties the cache when it was filled by another model.
    pub(crate) fn claim(&mut self, owner: u64) {
        if self.owner != owner || self.cache.is_empty() {
            self.owner = owner;
            self.cache.clear();
            self.cache.resize(CACHE_SLOTS, CacheEntry::default());
        }
    }
}

const NONE: (u32, u32) = (u32::MAX, u32::MAX);

#[inline]
fn key(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

impl BpeModel {
    #[inline]
    fn merge_of(&self, a: u32, b: u32) -> (u32, u32) {
        if a == NO_TOKEN || b == NO_TOKEN {
            return NONE;
        }
        self.merges.get(&key(a, b)).copied().unwrap_or(NONE)
    }

    /// Appends the tokens of one pre-tokenized word (through the word cache when `s` was
    /// claimed for this model).
    pub(crate) fn encode_word(&self, word: &[u8], out: &mut Vec<u32>, s: &mut BpeScratch) {
        match word.len() {
            0 => return,
            1 => {
                push_known(out, self.byte_ids[word[0] as usize]);
                return;
            }
            n if n <= CACHE_WORD && !s.cache.is_empty() => {
                let slot = word_hash(word) % CACHE_SLOTS;
                let e = &s.cache[slot];
                if usize::from(e.len) == n && &e.word[..n] == word {
                    out.extend_from_slice(&e.ids[..usize::from(e.n_ids)]);
                    return;
                }
                let start = out.len();
                self.encode_uncached(word, out, s);
                let ids = &out[start..];
                if ids.len() <= CACHE_IDS {
                    let mut e = CacheEntry {
                        len: n as u8,
                        n_ids: ids.len() as u8,
                        ..CacheEntry::default()
                    };
                    e.word[..n].copy_from_slice(word);
                    e.ids[..ids.len()].copy_from_slice(ids);
                    s.cache[slot] = e;
                }
                return;
            }
            _ => {}
        }
        self.encode_uncached(word, out, s);
    }

    fn encode_uncached(&self, word: &[u8], out: &mut Vec<u32>, s: &mut BpeScratch) {
        if let Some(whole) = &self.whole_words {
            if let Some(&id) = whole.get(word) {
                out.push(id);
                return;
            }
        }
        s.syms.clear();
        s.syms
            .extend(word.iter().map(|&b| self.byte_ids[b as usize]));
        if word.len() <= HEAP_THRESHOLD {
            self.merge_scan(s);
            for &id in &s.syms {
                push_known(out, id);
            }
        } else {
            self.merge_heap(s, out);
        }
    }

    /// Rescans pair ranks after every merge: O(n²) but tiny constants for short words.
    fn merge_scan(&self, s: &mut BpeScratch) {
        let syms = &mut s.syms;
        let ranks = &mut s.ranks;
        ranks.clear();
        ranks.extend(syms.windows(2).map(|w| self.merge_of(w[0], w[1])));
        loop {
            let mut best = u32::MAX;
            let mut at = usize::MAX;
            for (i, r) in ranks.iter().enumerate() {
                if r.0 < best {
                    best = r.0;
                    at = i;
                }
            }
            if at == usize::MAX {
                break;
            }
            syms[at] = ranks[at].1;
            syms.remove(at + 1);
            ranks.remove(at);
            if at < ranks.len() {
                ranks[at] = self.merge_of(syms[at], syms[at + 1]);
            }
            if at > 0 {
                ranks[at - 1] = self.merge_of(syms[at - 1], syms[at]);
            }
        }
    }

    /// Linked symbols + a min-heap of candidate pairs with lazy invalidation: O(n log n).
    fn merge_heap(&self, s: &mut BpeScratch, out: &mut Vec<u32>) {
        let n = s.syms.len();
        s.prev.clear();
        s.next.clear();
        s.prev.extend((0..n as u32).map(|i| i.wrapping_sub(1)));
        s.next.extend(1..=n as u32);
        s.heap.clear();
        for i in 0..n - 1 {
            let (rank, _) = self.merge_of(s.syms[i], s.syms[i + 1]);
            if rank != u32::MAX {
                s.heap
                    .push(Reverse((rank, i as u32, s.syms[i], s.syms[i + 1])));
            }
        }
        let n32 = n as u32;
        while let Some(Reverse((rank, left, lid, rid))) = s.heap.pop() {
            let l = left as usize;
            let r = s.next[l];
            if s.syms[l] != lid || r >= n32 || s.syms[r as usize] != rid {
                continue;
            }
            let r = r as usize;
            let (_, merged) = self.merge_of(lid, rid);
            debug_assert_eq!(self.merge_of(lid, rid).0, rank);
            s.syms[l] = merged;
            s.syms[r] = NO_TOKEN;
            let after = s.next[r];
            s.next[l] = after;
            if after < n32 {
                s.prev[after as usize] = left;
                let (rk, _) = self.merge_of(merged, s.syms[after as usize]);
                if rk != u32::MAX {
                    s.heap
                        .push(Reverse((rk, left, merged, s.syms[after as usize])));
                }
            }
            let before = s.prev[l];
            if before < n32 {
                let (rk, _) = self.merge_of(s.syms[before as usize], merged);
                if rk != u32::MAX {
                    s.heap
                        .push(Reverse((rk, before, s.syms[before as usize], merged)));
                }
            }
        }
        let mut i = 0u32;
        while i < n32 {
            push_known(out, s.syms[i as usize]);
            i = s.next[i as usize];
        }
    }
}

#[inline]
fn push_known(out: &mut Vec<u32>, id: u32) {
    if id != NO_TOKEN {
        out.push(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vocabulary: bytes a=0 b=1 c=2; merges (a,b)->3 rank 0, (3,c)->4 rank 1, (b,c)->5 rank 2,
    /// (a,a)->6 rank 3.
    fn model() -> BpeModel {
        let mut byte_ids = [NO_TOKEN; 256];
        byte_ids[b'a' as usize] = 0;
        byte_ids[b'b' as usize] = 1;
        byte_ids[b'c' as usize] = 2;
        let mut merges = FxHashMap::default();
        merges.insert(key(0, 1), (0, 3));
        merges.insert(key(3, 2), (1, 4));
        merges.insert(key(1, 2), (2, 5));
        merges.insert(key(0, 0), (3, 6));
        BpeModel {
            byte_ids,
            merges,
            whole_words: None,
        }
    }

    fn both(m: &BpeModel, word: &[u8]) -> Vec<u32> {
        let mut s = BpeScratch::default();
        let mut scan = Vec::new();
        s.syms = word.iter().map(|&b| m.byte_ids[b as usize]).collect();
        m.merge_scan(&mut s);
        scan.extend(s.syms.iter().copied().filter(|&t| t != NO_TOKEN));
        let mut heap = Vec::new();
        s.syms = word.iter().map(|&b| m.byte_ids[b as usize]).collect();
        m.merge_heap(&mut s, &mut heap);
        assert_eq!(
            scan,
            heap,
            "scan and heap disagree on {:?}",
            String::from_utf8_lossy(word)
        );
        scan
    }

    #[test]
    fn merges_by_rank_then_leftmost() {
        let m = model();
        assert_eq!(both(&m, b"abc"), [4]);
        assert_eq!(both(&m, b"bc"), [5]);
        assert_eq!(both(&m, b"aaa"), [6, 0]);
        assert_eq!(both(&m, b"aaaa"), [6, 6]);
        assert_eq!(both(&m, b"abcabcx"), [4, 4]);
        let long: Vec<u8> = b"abcaab".iter().cycle().take(200).copied().collect();
        both(&m, &long);
    }
}
