//! The expert boundary of hybrid execution (DESIGN.md §1): where each layer's routed experts
//! live ([`ExpertPlacement`], read off the placement plan's tensor devices), the batch that
//! crosses the boundary ([`ExpertBatch`]: the normed hidden state with the router's choices and
//! weights), and each layer's experts as the file stores them ([`HostExperts`]: what a device
//! uploads, and what a layer whose experts stay in RAM runs on the host with the CPU's expert
//! kernels of `hmoe_cpu::experts`).
//!
//! For each token `t` of the batch the host computes
//! `out[t] = Σ_s w[t,s] · expert_{sel[t,s]}(h[t])`, the slots `s` summed in order (highest
//! router score first) starting from zero, tokens grouped by expert as llama.cpp's CPU backend
//! does. The device side of the boundary is [`crate::DeviceModel`]'s.

use hmoe_backend::{ExpertView, GatedAct};
use hmoe_cpu::experts::{host_experts, ExpertKernels, ExpertScratch};
pub use hmoe_cpu::experts::{ExpertBatch, ExpertDeviceError, ExpertMatrix, ExpertTensors};
use hmoe_cpu::ops::QuantizedActs;
use hmoe_gguf::GgufModel;

use crate::weights::{load_f32, Mat};
use crate::ModelError;

/// One layer's routed experts as the file stores them (views of the mapping; gpt-oss's
/// biases dequantized), with the kernels and the gated activation the host runs them with:
/// what a device uploads, and what a layer whose experts stay on the host runs.
pub(crate) struct HostExperts {
    n_expert: usize,
    gate: Mat,
    up: Mat,
    down: Mat,
    /// Biases of gate, up and down (empty: none).
    biases: [Vec<f32>; 3],
    act: GatedAct,
}

impl HostExperts {
    /// Layer `l`'s `ffn_{gate,up,down}_exps` of `n_expert` experts over `n_embd` inputs and
    /// `n_ff` hidden values, with their `.bias` tensors when `biases`.
    pub fn load(
        g: &GgufModel,
        l: usize,
        (n_embd, n_ff, n_expert): (usize, usize, usize),
        act: GatedAct,
        biases: bool,
    ) -> Result<HostExperts, ModelError> {
        let n = |s: &str| format!("blk.{l}.ffn_{s}_exps.weight");
        let b = |s: &str| format!("blk.{l}.ffn_{s}_exps.bias");
        let (d, ff, ne) = (n_embd as u64, n_ff as u64, n_expert as u64);
        let biases = match biases {
            true => [
                load_f32(g, &b("gate"), &[ff, ne])?,
                load_f32(g, &b("up"), &[ff, ne])?,
                load_f32(g, &b("down"), &[d, ne])?,
            ],
            false => Default::default(),
        };
        Ok(HostExperts {
            n_expert,
            gate: Mat::load(g, &n("gate"), &[d, ff, ne])?,
            up: Mat::load(g, &n("up"), &[d, ff, ne])?,
            down: Mat::load(g, &n("down"), &[ff, d, ne])?,
            biases,
            act,
        })
    }

    /// The experts as the device contract takes them.
    pub fn tensors<'g>(&'g self, g: &'g GgufModel) -> ExpertTensors<'g> {
        let [gate_bias, up_bias, down_bias] = &self.biases;
        ExpertTensors {
            n_expert: self.n_expert,
            gate: self.gate.expert_matrix(g),
            up: self.up.expert_matrix(g),
            down: self.down.expert_matrix(g),
            gate_bias,
            up_bias,
            down_bias,
        }
    }

    /// `out[t] = Σ_s w[t,s] · expert_{sel[t,s]}(h[t])` for every token of `batch` (layer
    /// `layer`), on the host over the file mapping with the CPU's expert kernels: gpt-oss's
    /// clamped SwiGLU through [`host_experts`], SiLU experts one sequence (`batch.groups`) at a
    /// time, as the CPU sums them.
    pub fn run(
        &self,
        layer: usize,
        g: &GgufModel,
        batch: &ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let kernels = ExpertKernels::new(self.gate.kernel, self.up.kernel, self.down.kernel);
        let t = self.tensors(g);
        if let GatedAct::ClampedSwiglu { .. } = self.act {
            let mut scratch = ExpertScratch::default();
            host_experts(layer, &kernels, self.act, &t, batch, &mut scratch, out)?;
            return Ok(());
        }
        let (d, ff, k) = (self.gate.n_in, self.gate.n_out, batch.n_used);
        let view = |e: usize| {
            Some(ExpertView {
                gate: t.gate.expert(e)?,
                up: t.up.expert(e)?,
                down: t.down.expert(e)?,
                gate_bias: &[],
                up_bias: &[],
                down_bias: &[],
            })
        };
        let mut acts = QuantizedActs::default();
        for r in batch.groups {
            let sel: Vec<usize> = batch.selected[r.start * k..r.end * k]
                .iter()
                .map(|&e| e as usize)
                .collect();
            let y = hmoe_cpu::experts::moe_swiglu(
                &kernels,
                (d, ff, self.n_expert),
                view,
                &batch.h[r.start * d..r.end * d],
                &sel,
                &batch.weights[r.start * k..r.end * k],
                k,
                &mut acts,
            );
            out[r.start * d..r.end * d].copy_from_slice(&y);
        }
        Ok(())
    }
}

/// SwiGLU constants of gpt-oss experts (fixed by the architecture, not stored in GGUF).
pub(crate) const SWIGLU_ALPHA: f32 = 1.702;
pub(crate) const SWIGLU_LIMIT: f32 = 7.0;

/// Smallest micro-batch (tokens) for which op offload happens by default (llama.cpp's
/// `GGML_OP_OFFLOAD_MIN_BATCH`).
pub const OP_OFFLOAD_MIN_BATCH: usize = 32;

/// Which side of the boundary holds one layer's routed experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertHome {
    /// Host memory: the experts run over the mapped file where the dense part runs.
    Host,
    /// The device that holds the layer's dense part: its experts are uploaded there once at
    /// load and run there.
    Device,
}

/// Where every layer's routed experts live, and when host layers are offloaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertPlacement {
    /// Home of the experts of each layer (index = layer).
    pub layers: Vec<ExpertHome>,
    /// Op offload: a micro-batch of at least this many tokens runs the routed experts of host
    /// layers on the device (copied there for the batch). `None` disables it.
    pub op_offload_min_batch: Option<usize>,
}

impl ExpertPlacement {
    /// Every layer's experts on `home`, op offload at the default threshold.
    pub fn all(n_layer: usize, home: ExpertHome) -> ExpertPlacement {
        ExpertPlacement {
            layers: vec![home; n_layer],
            op_offload_min_batch: Some(OP_OFFLOAD_MIN_BATCH),
        }
    }

    /// The placement a plan's tensor table implies: `tensors` yields every tensor's name and
    /// whether the plan put it on a device (not the CPU). A layer's experts are on the device
    /// when its routed-expert tensors (`blk.N.ffn_{gate,up,down}_exps.{weight,bias}`) all are,
    /// on the host when none is; a layer split between both is an error (the expert boundary
    /// is per layer). Op offload at the default threshold.
    pub fn from_tensor_devices<'a>(
        n_layer: usize,
        tensors: impl IntoIterator<Item = (&'a str, bool)>,
    ) -> Result<ExpertPlacement, ExpertDeviceError> {
        // Per layer: (tensors on the device, tensors on the host).
        let mut seen = vec![(0usize, 0usize); n_layer];
        for (name, on_device) in tensors {
            let Some(layer) = routed_expert_layer(name) else {
                continue;
            };
            let slot = seen.get_mut(layer).ok_or_else(|| {
                ExpertDeviceError::Placement(format!(
                    "tensor {name} names layer {layer} of a {n_layer}-layer model"
                ))
            })?;
            if on_device {
                slot.0 += 1;
            } else {
                slot.1 += 1;
            }
        }
        let layers = seen
            .iter()
            .enumerate()
            .map(|(l, &(dev, host))| match (dev, host) {
                (0, _) => Ok(ExpertHome::Host),
                (_, 0) => Ok(ExpertHome::Device),
                _ => Err(ExpertDeviceError::Placement(format!(
                    "layer {l}'s expert tensors are split between host and device \
                     ({dev} on the device, {host} on the host); a layer's experts move as a unit"
                ))),
            })
            .collect::<Result<_, _>>()?;
        Ok(ExpertPlacement {
            layers,
            op_offload_min_batch: Some(OP_OFFLOAD_MIN_BATCH),
        })
    }

    /// The same placement with op offload from `min_batch` tokens (`None` disables it).
    pub fn with_op_offload(mut self, min_batch: Option<usize>) -> ExpertPlacement {
        self.op_offload_min_batch = min_batch;
        self
    }

    /// Number of layers whose experts live on the device.
    pub fn device_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|&&h| h == ExpertHome::Device)
            .count()
    }
}

/// The layer of a routed-expert tensor name (`blk.N.ffn_{gate,up,down}_exps.*`).
fn routed_expert_layer(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    ["ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps."]
        .iter()
        .any(|p| tail.starts_with(p))
        .then_some(layer)
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // slices of token ranges, one sequence each
mod tests {
    use super::*;

    #[test]
    fn placement_from_tensor_table() {
        let names = |l: usize| {
            ["gate", "up", "down"].into_iter().flat_map(move |m| {
                ["weight", "bias"]
                    .into_iter()
                    .map(move |s| format!("blk.{l}.ffn_{m}_exps.{s}"))
            })
        };
        let mut table: Vec<(String, bool)> = vec![("blk.0.attn_q.weight".into(), true)];
        table.extend(names(0).map(|n| (n, false)));
        table.extend(names(1).map(|n| (n, true)));
        let p =
            ExpertPlacement::from_tensor_devices(2, table.iter().map(|(n, d)| (n.as_str(), *d)))
                .unwrap();
        assert_eq!(p.layers, vec![ExpertHome::Host, ExpertHome::Device]);
        assert_eq!(p.device_layers(), 1);
        assert_eq!(p.op_offload_min_batch, Some(OP_OFFLOAD_MIN_BATCH));
        table[1].1 = true;
        assert!(ExpertPlacement::from_tensor_devices(
            2,
            table.iter().map(|(n, d)| (n.as_str(), *d))
        )
        .is_err());
        assert!(
            ExpertPlacement::from_tensor_devices(1, [("blk.3.ffn_up_exps.weight", true)]).is_err()
        );
    }
}
