//! Each layer's routed experts where the placement put them at load: uploaded to the device,
//! or kept in the file mapping for the host ([`LayerExperts`]).

use hmoe_backend::{Backend, ExpertTensors};
use hmoe_gguf::GgufModel;

use super::device_weights::{expert_order_varies, upload_experts};
use super::host_experts::HostExperts;
use crate::error::ModelError;
use crate::expert_placement::{ExpertHome, ExpertPlacement};

/// The routed experts of every layer, where the placement puts them.
pub(crate) struct LayerExperts<B: Backend> {
    /// The experts of each [`ExpertHome::Device`] layer, on the device.
    pub(crate) device: Vec<Option<B::Moe>>,
    /// The experts of each [`ExpertHome::Host`] layer, on the CPU.
    pub(crate) host: HostExperts,
    /// Whether each layer's routed experts have a matrix whose products' order varies with
    /// the rows routed together ([`expert_order_varies`]).
    pub(crate) split: Vec<bool>,
    /// Where each layer's experts run.
    pub(crate) homes: Vec<ExpertHome>,
    /// Bytes of the device's experts.
    pub(crate) bytes: u64,
}

impl<B: Backend> LayerExperts<B> {
    /// Each layer's experts `experts(l)` (read from `g`; `None`: a layer without) where
    /// `placement` puts them.
    pub(crate) fn load<'t>(
        dev: &B,
        g: &GgufModel,
        placement: &ExpertPlacement,
        experts: impl Fn(usize) -> Option<ExpertTensors<'t>>,
    ) -> Result<LayerExperts<B>, ModelError> {
        let n_layer = placement.layers.len();
        let mut out = LayerExperts {
            device: Vec::with_capacity(n_layer),
            host: HostExperts::new(),
            split: Vec::with_capacity(n_layer),
            homes: placement.layers.clone(),
            bytes: 0,
        };
        for (l, home) in placement.layers.iter().enumerate() {
            let t = experts(l);
            out.split.push(t.as_ref().is_some_and(|t| {
                [t.gate.ty, t.up.ty, t.down.ty]
                    .into_iter()
                    .any(expert_order_varies)
            }));
            let moe = match (home, &t) {
                (ExpertHome::Device, Some(t)) => Some(upload_experts(dev, g, l, t)?),
                _ => None,
            };
            out.bytes += moe.as_ref().map_or(0, |m| B::moe_bytes(m) as u64);
            out.device.push(moe);
            let host = t.as_ref().filter(|_| *home == ExpertHome::Host);
            out.host.push(g, l, host)?;
        }
        Ok(out)
    }
}
