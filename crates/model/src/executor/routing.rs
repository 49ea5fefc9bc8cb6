//! The router of a routed-MoE layer as the executor runs it ([`Router`]: how the chosen
//! experts and their weights come from the router logits) and a layer's routed batch on the
//! device ([`Routed`]), what crosses the expert boundary.

use hmoe_backend::{Backend, BackendError, GatedAct};

/// How a routed-MoE block turns router logits into chosen experts and their weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Gating {
    /// The top `k` logits (ties to the lower id), softmax over them (gpt-oss).
    TopKSoftmax,
    /// Gate probabilities of every expert (softmax or sigmoid), then the contract's
    /// [`hmoe_backend::Routing`] (a selection-only bias, expert groups, renormalised and
    /// scaled weights; the `route` op).
    Scored(hmoe_backend::Gating, hmoe_backend::Routing),
}

/// A layer's router as the executor runs it: `n_expert` logits per token, `k` chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Router {
    /// Experts of the layer.
    pub n_expert: usize,
    /// Experts per token.
    pub k: usize,
    /// How the choice and the weights come from the logits.
    pub gating: Gating,
}

impl Router {
    /// The chosen experts `sel` and their weights `wts` (`k` per token) of router logits
    /// `scores`, on the device (`bias`: the selection bias of [`Gating::Scored`]).
    pub(crate) fn route<B: Backend>(
        &self,
        dev: &B,
        scores: &B::Buf<f32>,
        bias: Option<&B::Buf<f32>>,
        sel: &mut B::Buf<i32>,
        wts: &mut B::Buf<f32>,
    ) -> Result<(), BackendError> {
        match self.gating {
            Gating::TopKSoftmax => dev.router_top_k(scores, self.n_expert, self.k, sel, wts),
            Gating::Scored(gating, routing) => {
                dev.route(scores, bias, gating, &routing, self.n_expert, sel, wts)
            }
        }
    }
}

/// Which rows the executor on the CPU multiplies together by a layer's experts whose products it sums
/// in another order when several rows route to one expert ([`expert_order_varies`]): the
/// `moe` op then runs on each such set of rows alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpertSplit {
    /// One sequence's tokens (gpt-oss's host experts group a sequence's rows per expert).
    PerSequence,
}

/// A layer's expert inputs on the device for a micro-batch: normed hidden state, router
/// logits, chosen experts and their weights (of every token), the router, the experts'
/// activation, and how F32 experts split the batch.
pub(crate) struct Routed<'a, B: Backend> {
    /// Normed hidden state, `n × n_embd`.
    pub h: &'a B::Buf<f32>,
    /// Router logits, `n × n_expert` (routed again per part when the batch is split).
    pub scores: &'a B::Buf<f32>,
    /// The router's selection bias ([`Gating::Scored`]).
    pub bias: Option<&'a B::Buf<f32>>,
    /// Chosen experts, `n × k`.
    pub sel: &'a B::Buf<i32>,
    /// Their weights, `n × k`.
    pub wts: &'a B::Buf<f32>,
    /// The layer's router.
    pub router: Router,
    /// The experts' gated activation.
    pub act: GatedAct,
    /// How F32 experts split the batch.
    pub split: ExpertSplit,
}
