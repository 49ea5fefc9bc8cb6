//! How a model file becomes a model to serve: the loader hook ([`ModelLoader`]) the CLI fills
//! in with its placement plan and engine choice (the executor on a GPU or `REF0`, else on
//! the CPU device), and the report of where the model went ([`Placement`]), shown at start-up,
//! in `/props` and in `/metrics`.

use std::path::Path;
use std::sync::Arc;

use hmoe_gguf::GgufModel;
use hmoe_model::LanguageModel;
use serde_json::{json, Value};

/// Loads an opened model file (the path is for messages): the model and where it was placed,
/// or why it could not be loaded (a device short of memory names itself and the missing MiB).
pub type ModelLoader = Arc<dyn Fn(GgufModel, &Path) -> Result<LoadedModel, String> + Send + Sync>;

/// A loaded model and its placement.
pub struct LoadedModel {
    /// The model.
    pub model: Arc<dyn LanguageModel>,
    /// Where it runs.
    pub placement: Placement,
}

/// Where a model runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// The engine: the device the executor runs on (`CUDA0`, `REF0`), or `CPU`.
    pub engine: String,
    /// Why the model runs on the CPU device (`None` on a GPU or `REF0`).
    pub why_cpu: Option<String>,
    /// Memory per device, as the placement plan estimates it.
    pub devices: Vec<DevicePlacement>,
    /// The total context the plan was made for when the loader chose it (`--fit` may have cut
    /// it); `None`: the server's `-c`, or the trained context for `-c 0`.
    pub n_ctx: Option<usize>,
    /// Why that context, e.g. `-c 0: the trained context` (for the start-up lines).
    pub n_ctx_why: Option<String>,
}

/// One device's share of a model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DevicePlacement {
    /// `CUDA0`, `REF0` or `CPU`.
    pub name: String,
    /// Layers whose dense part (attention, router, norms) is on it.
    pub layers: u32,
    /// Layers whose routed experts are on it.
    pub expert_layers: u32,
    /// Bytes of weights.
    pub weight_bytes: u64,
    /// Bytes of K/V cache (every slot's).
    pub kv_bytes: u64,
    /// Bytes of compute buffers.
    pub compute_bytes: u64,
}

impl Placement {
    /// The `placement` object of `/props`.
    pub fn to_json(&self) -> Value {
        let devices: Vec<Value> = (self.devices.iter())
            .map(|d| {
                json!({
                    "name": d.name,
                    "layers": d.layers,
                    "expert_layers": d.expert_layers,
                    "weight_bytes": d.weight_bytes,
                    "kv_bytes": d.kv_bytes,
                    "compute_bytes": d.compute_bytes,
                })
            })
            .collect();
        json!({
            "engine": self.engine,
            "why_cpu": self.why_cpu,
            "n_ctx": self.n_ctx,
            "devices": devices,
        })
    }
}

/// The default loader: the executor on the CPU ([`hmoe_model::load`]), every layer on the CPU.
pub fn cpu_loader() -> ModelLoader {
    Arc::new(|gguf: GgufModel, _path: &Path| {
        let weight_bytes = gguf.total_tensor_bytes();
        let layers = gguf
            .metadata()
            .architecture()
            .and_then(|a| gguf.metadata().get_u64(&format!("{a}.block_count")))
            .unwrap_or(0) as u32;
        let model = hmoe_model::load(gguf).map_err(|e| e.to_string())?;
        Ok(LoadedModel {
            model: Arc::from(model),
            placement: Placement {
                engine: "CPU".into(),
                why_cpu: Some(
                    "the server's default loader runs the model on the CPU device".into(),
                ),
                devices: vec![DevicePlacement {
                    name: "CPU".into(),
                    layers,
                    expert_layers: layers,
                    weight_bytes,
                    ..DevicePlacement::default()
                }],
                n_ctx: None,
                n_ctx_why: None,
            },
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_json_names_each_device() {
        let p = Placement {
            engine: "REF0".into(),
            devices: vec![
                DevicePlacement {
                    name: "CPU".into(),
                    expert_layers: 2,
                    weight_bytes: 10,
                    ..DevicePlacement::default()
                },
                DevicePlacement {
                    name: "REF0".into(),
                    layers: 4,
                    expert_layers: 2,
                    weight_bytes: 20,
                    kv_bytes: 30,
                    compute_bytes: 40,
                },
            ],
            n_ctx: Some(4096),
            ..Placement::default()
        };
        let j = p.to_json();
        assert_eq!(j["engine"], "REF0");
        assert_eq!(j["why_cpu"], Value::Null);
        assert_eq!(j["n_ctx"], 4096);
        assert_eq!(j["devices"][1]["name"], "REF0");
        assert_eq!(j["devices"][1]["layers"], 4);
        assert_eq!(j["devices"][1]["kv_bytes"], 30);
        assert_eq!(j["devices"][0]["expert_layers"], 2);
    }
}
