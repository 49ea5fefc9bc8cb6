//! A step's best logits alone ([`crate::LanguageModel::forward_multi_top`]): when every row a
//! step brings down is a last token's that asks for its `k` best logits, they are ranked on
//! the device ([`Backend::top_k`], its scratch from the arena) and only the `k` best values
//! and ids of each row cross the bus, not the `n_vocab` logits. A row whose best logit is NaN
//! or zero (where the sampler's greedy maximum and the rank order can disagree) comes down
//! whole.

use hmoe_backend::Backend;

use super::{DeviceModel, Segments, StepState};
use crate::error::ModelError;
use crate::executor::step::Member;
use crate::language_model::{LogitsWanted, TokenLogits};

/// The `k` to rank each row by when every member that wants logits wants a last token's
/// best ones alone, at most [`hmoe_backend::TOP_K_MAX`] (each at most `n_vocab`, the largest
/// of them), else `None`.
pub(super) fn top_k_of(members: &[Member<'_>], n_vocab: usize) -> Option<usize> {
    let mut k = 0;
    for m in members.iter().filter(|m| m.want.is_some()) {
        match (m.want, m.top) {
            (Some(LogitsWanted::Last), Some(t)) if (1..=hmoe_backend::TOP_K_MAX).contains(&t) => {
                k = k.max(t.min(n_vocab))
            }
            _ => return None,
        }
    }
    (k > 0).then_some(k)
}

/// Whether a row whose best logit is `best` comes down whole.
fn whole_row(best: f32) -> bool {
    best.is_nan() || best == 0.0
}

impl<B: Backend> DeviceModel<B> {
    /// The `k` best of each of the `n_rows` rows of `logits` (one per member that wants
    /// logits, in order), brought down as values and ids; each member gets its own count of
    /// them ([`TokenLogits::Top`]), or its whole row ([`whole_row`]).
    pub(super) fn top_logits(
        &self,
        members: &[Member<'_>],
        logits: &B::Buf<f32>,
        n_rows: usize,
        k: usize,
        segments: &mut Segments,
        st: &mut StepState<'_, B>,
    ) -> Result<Vec<TokenLogits>, ModelError> {
        let (dev, arena) = (&self.dev, &self.scratch);
        let n_vocab = self.arch.dims().n_vocab;
        let mut scratch = arena.take::<i32>(dev, dev.top_k_scratch(n_rows, n_vocab, k))?;
        let mut values = arena.take::<f32>(dev, n_rows * k)?;
        let mut ids = arena.take::<i32>(dev, n_rows * k)?;
        dev.top_k(logits, n_vocab, k, &mut scratch, &mut values, &mut ids)?;
        segments.end(dev)?;
        // The other micro-batch in flight queues its work before the host waits.
        st.hand_over();
        let values = dev.download::<f32>(&values)?;
        let ids = dev.download::<i32>(&ids)?;
        let rows_whole = (0..n_rows).any(|r| whole_row(values[r * k]));
        let all = match rows_whole {
            true => Some(dev.download::<f32>(logits)?),
            false => None,
        };
        let mut row = 0;
        let mut out = Vec::with_capacity(members.len());
        for m in members {
            let Some(want) = m.top.filter(|_| m.want.is_some()) else {
                out.push(TokenLogits::Full(Vec::new()));
                continue;
            };
            let r = row;
            row += 1;
            out.push(match &all {
                Some(all) if whole_row(values[r * k]) => {
                    TokenLogits::Full(all[r * n_vocab..][..n_vocab].to_vec())
                }
                _ => TokenLogits::Top(
                    (0..want.min(k))
                        .map(|j| (ids[r * k + j] as u32, values[r * k + j]))
                        .collect(),
                ),
            });
        }
        Ok(out)
    }
}
