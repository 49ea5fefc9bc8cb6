//! The temporaries a device's attention may take beyond its inputs and outputs, as the
//! contract bounds them, so that the placement can count them without knowing the device: a
//! device that splits attention over positions (flash-decoding) keeps the chunk states of a
//! call over a K/V pair (at most [`CHUNK_STATES_MAX_BYTES`]), or the scores of a call over a
//! K-only (latent) ring ([`K_ONLY_SCORES_MAX`], [`K_ONLY_DECODE_SCORES_MAX`]); beyond those
//! bounds it attends without them. [`attention_scratch_bound`] is what the plan counts.

use crate::numerics::FLASH_CHUNK;

/// The most bytes of chunk states (f32, [`chunk_states_len`]) one call over a K/V pair may
/// keep; a call that would need more folds its chunks without them.
pub const CHUNK_STATES_MAX_BYTES: usize = 64 << 20;

/// The most scores (`n_tokens × n_head × cells`, f32) one call of several tokens over a
/// K-only ring may keep (64 MiB); larger calls (long prefill) keep none.
pub const K_ONLY_SCORES_MAX: usize = 16 << 20;

/// The most scores one single-token call (decode) over a K-only ring may keep: 256 MiB, so
/// that DeepSeek-V3's 128 heads over its whole 163,840-position context (`-c 0`: 84 MB)
/// decode split too.
pub const K_ONLY_DECODE_SCORES_MAX: usize = 64 << 20;

/// The chunks of [`FLASH_CHUNK`] positions that `n_tokens` queries can see in a ring of
/// `cells` (positions within `window` of the query, where there is one), plus one for a span
/// that straddles a chunk boundary: fixed by the ring's capacity, not the position.
pub fn chunk_slots(cells: usize, window: Option<usize>, n_tokens: usize) -> usize {
    let span = window.map_or(cells, |w| (w + n_tokens.saturating_sub(1)).min(cells));
    span.div_ceil(FLASH_CHUNK) + 1
}

/// f32s of the chunk states of a call split over `slots` chunks: a record of `head_dim + 2`
/// (the partial value sum, its maximum and its sum of weights) per chunk, token and head.
pub fn chunk_states_len(slots: usize, n_tokens: usize, n_head: usize, head_dim: usize) -> usize {
    slots
        .saturating_mul(n_tokens)
        .saturating_mul(n_head)
        .saturating_mul(head_dim + 2)
}

/// The shape of the attention calls the bound is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchShape {
    /// Query heads.
    pub n_head: usize,
    /// Values per head of the output (the chunk records' width).
    pub head_dim_v: usize,
    /// Cells of the ring.
    pub cells: usize,
    /// Sliding window, if the layer has one.
    pub window: Option<usize>,
    /// Whether the ring is K-only (latent attention, whose split keeps scores).
    pub k_only: bool,
}

/// The most bytes of temporaries any attention call of at most `n_tokens` queries with `s`
/// may take on a device that keeps to this module's bounds: the largest call within them.
pub fn attention_scratch_bound(s: &ScratchShape, n_tokens: usize) -> usize {
    let most_tokens = n_tokens.max(1);
    if s.k_only {
        let per_token = s.n_head.saturating_mul(s.cells);
        let decode = match per_token <= K_ONLY_DECODE_SCORES_MAX {
            true => per_token,
            false => 0,
        };
        let t = most_tokens.min(K_ONLY_SCORES_MAX / per_token.max(1));
        let several = if t >= 2 { t * per_token } else { 0 };
        return 4 * decode.max(several);
    }
    let bytes = |t: usize| {
        let slots = chunk_slots(s.cells, s.window, t);
        chunk_states_len(slots, t, s.n_head, s.head_dim_v).saturating_mul(4)
    };
    // The states grow with the tokens of a call: the most tokens whose states fit the cap.
    let (mut lo, mut hi) = (0, most_tokens);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        match bytes(mid) <= CHUNK_STATES_MAX_BYTES {
            true => lo = mid,
            false => hi = mid - 1,
        }
    }
    if lo == 0 {
        0
    } else {
        bytes(lo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt_oss(cells: usize, window: Option<usize>) -> ScratchShape {
        ScratchShape {
            n_head: 64,
            head_dim_v: 64,
            cells,
            window,
            k_only: false,
        }
    }

    #[test]
    fn a_decode_step_keeps_a_record_per_chunk_and_head() {
        // gpt-oss-120b at its whole context: 513 slots of 64 heads' 66 floats, 8.7 MB.
        let full = attention_scratch_bound(&gpt_oss(131_072, None), 1);
        assert_eq!(full, 4 * 513 * 64 * 66);
        // The sliding layers see 128 positions: one chunk, or two across a boundary.
        assert_eq!(chunk_slots(131_072, Some(128), 1), 2);
        let swa = attention_scratch_bound(&gpt_oss(131_072, Some(128)), 1);
        assert_eq!(swa, 4 * 2 * 64 * 66);
    }

    #[test]
    fn batches_stay_within_the_cap() {
        // 8.7 MB a token at the whole context: at most 7 tokens' states fit 64 MiB.
        let s = gpt_oss(131_072, None);
        assert_eq!(attention_scratch_bound(&s, 512), 7 * 4 * 513 * 64 * 66);
        assert!(attention_scratch_bound(&s, 512) <= CHUNK_STATES_MAX_BYTES);
        let small = gpt_oss(4096, None);
        assert_eq!(attention_scratch_bound(&small, 2), 4 * 17 * 2 * 64 * 66);
    }

    #[test]
    fn latent_attention_keeps_scores_within_its_bounds() {
        let ds = |cells| ScratchShape {
            n_head: 128,
            head_dim_v: 512,
            cells,
            window: None,
            k_only: true,
        };
        // DeepSeek-V3 at -c 32768: 16 MiB of decode scores; a batch keeps at most 64 MiB.
        assert_eq!(attention_scratch_bound(&ds(32_768), 1), 16 << 20);
        assert_eq!(attention_scratch_bound(&ds(32_768), 512), 64 << 20);
        // At its whole context the decode scores are 84 MB, and any batch's pass the cap.
        assert_eq!(attention_scratch_bound(&ds(163_840), 1), 4 * 128 * 163_840);
        assert_eq!(attention_scratch_bound(&ds(163_840), 4), 4 * 128 * 163_840);
        // Past the decode bound a call keeps no scores.
        assert_eq!(attention_scratch_bound(&ds(1 << 20), 1), 0);
    }
}
