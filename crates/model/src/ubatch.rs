//! What the CPU engine's architectures do with a [`KvCache`] around a forward pass: check a
//! batch against the vocabulary, the context and the cache types, and run it one micro-batch
//! at a time.

use std::sync::atomic::Ordering;

use hmoe_cpu::kv_cache::{CacheType, KvCache};

use crate::{LogitsWanted, ModelError};

/// The model-side checks and micro-batch loop of a [`KvCache`].
pub(crate) trait Ubatches {
    /// Checks that heads of `k_head` (keys) and `v_head` (values) elements are whole blocks
    /// of the cache types, as llama.cpp requires of block-quantized caches.
    fn check_heads(&self, k_head: usize, v_head: usize) -> Result<(), ModelError>;
    /// Checks `tokens` against the vocabulary and the context, then runs them through `step`
    /// one micro-batch at a time (`step(cache, chunk, wanted)` must advance the cache by the
    /// chunk and return the logits it was asked for), concatenating the logits.
    fn run_ubatches(
        &mut self,
        tokens: &[u32],
        wanted: LogitsWanted,
        n_vocab: usize,
        step: impl FnMut(&mut KvCache, &[u32], Option<LogitsWanted>) -> Vec<f32>,
    ) -> Result<Vec<f32>, ModelError>;
}

impl Ubatches for KvCache {
    fn check_heads(&self, k_head: usize, v_head: usize) -> Result<(), ModelError> {
        let v_head = if self.is_k_only() { 0 } else { v_head };
        for (which, ty, n) in [("K", self.ty.k(), k_head), ("V", self.ty.v(), v_head)] {
            if !n.is_multiple_of(ty.block_elems()) {
                return Err(misaligned(which, ty, n));
            }
        }
        Ok(())
    }

    fn run_ubatches(
        &mut self,
        tokens: &[u32],
        wanted: LogitsWanted,
        n_vocab: usize,
        mut step: impl FnMut(&mut KvCache, &[u32], Option<LogitsWanted>) -> Vec<f32>,
    ) -> Result<Vec<f32>, ModelError> {
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(ModelError::BadToken { id, n_vocab });
        }
        if self.n_past() + tokens.len() > self.n_ctx() {
            return Err(ModelError::ContextFull {
                pos: self.n_past(),
                n_tokens: tokens.len(),
                n_ctx: self.n_ctx(),
            });
        }
        // Whole rows must be whole blocks; heads are checked by attention (`refused`).
        for (which, ty, n) in [
            ("K", self.ty.k(), self.width),
            ("V", self.ty.v(), self.v_width),
        ] {
            if !n.is_multiple_of(ty.block_elems()) {
                return Err(misaligned(which, ty, 0));
            }
        }
        let mut logits = Vec::new();
        let n_chunks = tokens.len().div_ceil(self.n_ubatch());
        for (i, chunk) in tokens.chunks(self.n_ubatch()).enumerate() {
            let want = match wanted {
                LogitsWanted::All => Some(LogitsWanted::All),
                LogitsWanted::Last if i + 1 == n_chunks => Some(LogitsWanted::Last),
                LogitsWanted::Last => None,
            };
            logits.extend(step(self, chunk, want));
            if self
                .layers
                .iter()
                .any(|l| l.refused.swap(false, Ordering::Relaxed))
            {
                let (which, ty) = match self.ty.k().is_quantized() {
                    true => ("K", self.ty.k()),
                    false => ("V", self.ty.v()),
                };
                return Err(misaligned(which, ty, 0));
            }
        }
        Ok(logits)
    }
}

/// The error for heads that are not whole blocks of a block-quantized cache type (`n` = 0:
/// head size not known here).
fn misaligned(which: &str, ty: CacheType, n: usize) -> ModelError {
    ModelError::BadParam {
        key: format!("{which} cache type"),
        value: if n > 0 {
            format!("{ty} (head size {n}, block size {})", ty.block_elems())
        } else {
            format!("{ty} (block size {})", ty.block_elems())
        },
        why: "attention heads must be a whole number of blocks of the cache type (llama.cpp refuses this too)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_cpu::kv_cache::{FlashAttn, KvType};

    #[test]
    fn heads_that_are_not_whole_blocks_are_refused() {
        let ty = KvType::new(CacheType::Q8_0, CacheType::Q4_0, FlashAttn::On).unwrap();
        let cache = KvCache::new(ty, 16, 4, 64, &[None, Some(4)]);
        assert!(cache.check_heads(64, 64).is_ok());
        let err = cache.check_heads(16, 16).unwrap_err();
        assert!(err.to_string().contains("head size 16"), "{err}");
    }
}
