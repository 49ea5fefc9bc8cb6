//! The host side of the expert boundary: the staging buffers of the round trip
//! ([`staging_for`]) and the routed experts of the host layers, which run over the file
//! mapping on the CPU device's `moe` op ([`HostExperts`]).

use std::ops::Range;
use std::time::Duration;

use hmoe_backend::{Backend, ExpertTensors, GatedAct};
use hmoe_cpu::{Cpu, CpuMoe};
use hmoe_gguf::GgufModel;
use hmoe_pool::SpinBoost;
use hmoe_quant::GgmlType;

use super::device_weights::{expert_order_varies, upload_experts};
use crate::error::ModelError;

/// Staging buffers of the host round trip, for micro-batches of `n` tokens.
pub(crate) struct HostIo<B: Backend> {
    n: usize,
    io: B::Staging,
}

/// The staging buffers of the host round trip for `n` tokens of width `d` and `k` slots,
/// made anew when the batch size changed.
pub(crate) fn staging_for<'a, B: Backend>(
    io: &'a mut Option<HostIo<B>>,
    dev: &B,
    n: usize,
    d: usize,
    k: usize,
) -> Result<&'a mut B::Staging, ModelError> {
    if io.as_ref().is_none_or(|io| io.n != n) {
        *io = None;
        *io = Some(HostIo {
            n,
            io: dev.staging(n * d, n * k)?,
        });
    }
    match io.as_mut() {
        Some(HostIo { io, .. }) => Ok(io),
        None => Err(ModelError::Cache("no staging buffers".into())),
    }
}

/// A layer's routed batch on the host: `n` tokens' normed hidden state, their chosen experts
/// and weights, and which tokens belong to which sequence.
pub(crate) struct HostBatch<'a> {
    /// Normed hidden state, `n × n_embd`.
    pub h: &'a [f32],
    /// Chosen experts, `n × k`, each row highest router score first.
    pub sel: &'a [i32],
    /// Their weights, `n × k`.
    pub w: &'a [f32],
    /// Experts per token.
    pub k: usize,
    /// The tokens of each sequence (consecutive, from token 0).
    pub groups: &'a [Range<usize>],
}

/// One host layer's experts on the CPU.
struct HostSet {
    moe: CpuMoe,
    n_embd: usize,
    /// Whether a matrix is F32, whose products the CPU sums in another order for a batch
    /// than for one token.
    f32_weights: bool,
    /// Whether a matrix's products are summed in an order that depends on the rows routed
    /// to an expert together ([`expert_order_varies`]).
    order_varies: bool,
}

/// How long the CPU's idle pool workers poll before they park while a model has host layers:
/// longer than a layer's device phase in hybrid decode (attention and router, a few hundred
/// microseconds at most), so that the workers are still polling when the layer's experts
/// arrive and no layer begins with a futex wake (`HMOE_POOL_SPIN_US` overrides it).
pub(crate) const HYBRID_SPIN: Duration = Duration::from_millis(2);

/// The routed experts of the host layers ([`crate::ExpertHome::Host`]) on the CPU device,
/// kept where the file mapping has them (no copy, rows in the file's layout), run with the
/// device's `moe` op: `out[t] = Σ_s w[t,s] · expert_{sel[t,s]}(h[t])`, slots summed in
/// order from zero, tokens grouped by expert.
pub(crate) struct HostExperts {
    cpu: Cpu,
    sets: Vec<Option<HostSet>>,
    /// The global pool's [`HYBRID_SPIN`] while there is a host layer.
    spin: Option<SpinBoost<'static>>,
}

impl HostExperts {
    /// No layer's experts on the host yet.
    pub(crate) fn new() -> HostExperts {
        HostExperts {
            // The file's layout: interleaving would copy the experts.
            cpu: Cpu::with_expert_interleaving(false),
            sets: Vec::new(),
            spin: None,
        }
    }

    /// Adds the next layer: its experts `t` (read from `g`) when it is a host layer, or none.
    pub(crate) fn push(
        &mut self,
        g: &GgufModel,
        layer: usize,
        t: Option<&ExpertTensors<'_>>,
    ) -> Result<(), ModelError> {
        let set = match t {
            Some(t) => Some(HostSet {
                moe: upload_experts(&self.cpu, g, layer, t)?,
                n_embd: t.gate.n_in,
                f32_weights: [t.gate.ty, t.up.ty, t.down.ty].contains(&GgmlType::F32),
                order_varies: [t.gate.ty, t.up.ty, t.down.ty]
                    .into_iter()
                    .any(expert_order_varies),
            }),
            None => None,
        };
        if set.is_some() && self.spin.is_none() {
            self.spin = Some(hmoe_pool::global().boost_spin(HYBRID_SPIN));
        }
        self.sets.push(set);
        Ok(())
    }

    /// Whether a layer's experts run on the host.
    pub(crate) fn any(&self) -> bool {
        self.sets.iter().any(Option::is_some)
    }

    /// Whether the products of layer `layer`'s host experts are summed in an order that
    /// depends on the rows routed to an expert together (so that each sequence's rows of an
    /// expert run apart).
    pub(crate) fn order_varies(&self, layer: usize) -> bool {
        matches!(self.sets.get(layer), Some(Some(s)) if s.order_varies)
    }

    /// `out = Σ_s w · expert(h)` for every token of `batch` over layer `layer`'s experts with
    /// activation `act`, the rows the CPU multiplies together as it does for each activation:
    /// SiLU experts one sequence at a time, gpt-oss's clamped SwiGLU the whole batch at once
    /// unless a matrix is F32.
    pub(crate) fn run(
        &self,
        layer: usize,
        act: GatedAct,
        batch: &HostBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let Some(Some(set)) = self.sets.get(layer) else {
            return Err(ModelError::Placement(format!(
                "layer {layer} has no experts on the host"
            )));
        };
        let (d, k) = (set.n_embd, batch.k);
        let whole = 0..batch.groups.last().map_or(0, |g| g.end);
        let per_seq = matches!(act, GatedAct::Silu) || set.f32_weights;
        let parts = match per_seq {
            true => batch.groups,
            false => std::slice::from_ref(&whole),
        };
        let cpu = &self.cpu;
        for g in parts {
            let h = cpu.upload(&batch.h[g.start * d..g.end * d])?;
            let sel = cpu.upload(&batch.sel[g.start * k..g.end * k])?;
            let w = cpu.upload(&batch.w[g.start * k..g.end * k])?;
            let mut y = cpu.alloc::<f32>(g.len() * d)?;
            cpu.moe(&set.moe, act, &h, &sel, &w, k, &mut y)?;
            out[g.start * d..g.end * d].copy_from_slice(&y);
        }
        Ok(())
    }
}
