//! Where each layer's routed experts live ([`ExpertPlacement`], read off the placement
//! plan's tensor devices): on the device that runs the layer's dense part, or in host memory,
//! where they run over the file mapping on the CPU (the executor's expert boundary, see
//! `docs/architecture.md`, "Expert boundary").

use crate::error::ModelError;

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
    ) -> Result<ExpertPlacement, ModelError> {
        // Per layer: (tensors on the device, tensors on the host).
        let mut seen = vec![(0usize, 0usize); n_layer];
        for (name, on_device) in tensors {
            let Some(layer) = routed_expert_layer(name) else {
                continue;
            };
            let slot = seen.get_mut(layer).ok_or_else(|| {
                ModelError::Placement(format!(
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
                _ => Err(ModelError::Placement(format!(
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
