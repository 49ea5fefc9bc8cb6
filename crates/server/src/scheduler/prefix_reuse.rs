//! Which cached prompt positions a new request may reuse without changing its results.

use hmoe_model::{KvType, LanguageModel, SeqBatch};

/// Which cached positions a new request may reuse without changing its results, as measured on
/// the model when the slots start ([`measure_reuse`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reuse {
    /// Every cached position: splitting a prompt and one-token passes change no bit.
    All,
    /// Positions computed in prompt chunks of two or more tokens: splitting a prompt changes
    /// nothing, one-token passes do.
    PromptChunks,
    /// Whole micro-batches counted from position 0 only (a token's result depends on the size
    /// of its pass).
    Aligned,
}

/// Measures which splits of a prompt leave `model`'s results unchanged, bit for bit, in caches
/// of the slots' geometry: one prefill of 40 tokens against the same tokens split in two at
/// three points (chunks of 2 to 38 tokens, across the kernels' tile sizes), and against a
/// prefill followed by four one-token passes. Any error or a context under 16 positions gives
/// [`Reuse::Aligned`], which never changes results.
pub fn measure_reuse(
    model: &dyn LanguageModel,
    kv_type: KvType,
    n_ctx: usize,
    n_ubatch: usize,
) -> Reuse {
    let n = 40.min(n_ctx.saturating_sub(1));
    if n < 16 || model.n_vocab() == 0 {
        return Reuse::Aligned;
    }
    let n_vocab = model.n_vocab() as u64;
    let tokens: Vec<u32> = (0..n as u64)
        .map(|i| ((i * 7919 + 13) % n_vocab) as u32)
        .collect();
    let last_logits = |parts: &[&[u32]]| -> Option<Vec<f32>> {
        let mut cache = model.new_cache(kv_type, n_ctx, n_ubatch);
        let mut logits = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let mut seq = [SeqBatch {
                cache: &mut cache,
                tokens: part,
                logits: i + 1 == parts.len(),
            }];
            logits = model.forward_multi(&mut seq).ok()?.pop()?;
        }
        Some(logits)
    };
    let Some(cold) = last_logits(&[&tokens]) else {
        return Reuse::Aligned;
    };
    let same = |l: Option<Vec<f32>>| {
        l.is_some_and(|l| {
            l.len() == cold.len() && l.iter().zip(&cold).all(|(a, b)| a.to_bits() == b.to_bits())
        })
    };
    let splits_free = [3, 17, n - 2]
        .into_iter()
        .all(|k| same(last_logits(&[&tokens[..k], &tokens[k..]])));
    if !splits_free {
        return Reuse::Aligned;
    }
    let m = n - 4;
    let mut parts: Vec<&[u32]> = vec![&tokens[..m]];
    parts.extend(tokens[m..].chunks(1));
    match same(last_logits(&parts)) {
        true => Reuse::All,
        false => Reuse::PromptChunks,
    }
}

/// Length of the common prefix of two token sequences.
pub(super) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn common_prefixes() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
    }
}
