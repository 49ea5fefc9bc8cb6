//! The architectures, one file each, written over the executor's shared blocks and the
//! device contract's ops: [`gpt_oss`], [`qwen3_moe`], [`deepseek2`] and the dense Llama family
//! ([`llama`]). [`ARCHS`] is the one table of them: a file's `general.architecture` name, how
//! its hyperparameters are read and its layers built, and whether its cache keeps keys only.
//! [`model_shape`] gives the placement planner the hyperparameters the forward pass reads.

pub mod deepseek2;
pub mod gpt_oss;
mod hparams;
pub mod llama;
pub mod qwen3_moe;
pub mod rope;

use hmoe_backend::Backend;
use hmoe_backend::CacheType;
use hmoe_gguf::{GgufModel, Metadata};
use hmoe_placement::ModelShape;
use hmoe_quant::GgmlType;

use crate::error::ModelError;
use crate::executor::step::DeviceLayers;
use crate::executor::DeviceModel;
use crate::expert_placement::{ExpertHome, ExpertPlacement};
use crate::weights::n_vocab;

/// How an architecture's layers are built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layers {
    GptOss,
    Qwen3Moe,
    Deepseek2,
    Dense(llama::DenseArch),
}

/// One architecture the executor runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch {
    /// Its `general.architecture` name.
    pub name: &'static str,
    /// Whether its cache keeps keys only (DeepSeek's latent cache: `-ctk` is its type, `-ctv`
    /// is not used).
    pub k_only: bool,
    layers: Layers,
}

/// Every architecture the executor runs.
pub const ARCHS: &[Arch] = &[
    Arch {
        name: "gpt-oss",
        k_only: false,
        layers: Layers::GptOss,
    },
    Arch {
        name: "deepseek2",
        k_only: true,
        layers: Layers::Deepseek2,
    },
    Arch {
        name: "qwen3moe",
        k_only: false,
        layers: Layers::Qwen3Moe,
    },
    Arch {
        name: "llama",
        k_only: false,
        layers: Layers::Dense(llama::DenseArch::Llama),
    },
    Arch {
        name: "qwen2",
        k_only: false,
        layers: Layers::Dense(llama::DenseArch::Qwen2),
    },
];

impl Arch {
    /// The architecture named `name` (`general.architecture`).
    pub fn named(name: &str) -> Option<&'static Arch> {
        ARCHS.iter().find(|a| a.name == name)
    }

    /// The placement planner's shape of a file of this architecture with metadata `meta` and
    /// `n_vocab` embedding rows: its hyperparameters read (and checked) as loading reads them.
    fn shape(&self, meta: &Metadata, n_vocab: usize) -> Result<ModelShape, ModelError> {
        Ok(match self.layers {
            Layers::GptOss => gpt_oss::GptOssParams::from_metadata(meta, n_vocab)?.shape(),
            Layers::Qwen3Moe => qwen3_moe::Qwen3MoeParams::from_metadata(meta, n_vocab)?.shape(),
            Layers::Deepseek2 => deepseek2::Deepseek2Params::from_metadata(meta, n_vocab)?.shape(),
            Layers::Dense(arch) => llama::DenseParams::from_metadata(meta, arch, n_vocab)?.shape(),
        })
    }

    /// Its layers of `gguf`, loaded onto `dev`.
    fn load<B: Backend + 'static>(
        &self,
        gguf: GgufModel,
        dev: &B,
    ) -> Result<Box<dyn DeviceLayers<B>>, ModelError> {
        Ok(match self.layers {
            Layers::GptOss => Box::new(gpt_oss::load(gguf, dev)?),
            Layers::Qwen3Moe => Box::new(qwen3_moe::load(gguf, dev)?),
            Layers::Deepseek2 => Box::new(deepseek2::Deepseek2::load(gguf, dev)?),
            Layers::Dense(arch) => Box::new(llama::Dense::load(gguf, arch, dev)?),
        })
    }
}

/// The names in [`ARCHS`] of the architectures with `k_only` as given (all with `None`).
const fn names<const N: usize>(k_only: Option<bool>) -> [&'static str; N] {
    let mut out = [""; N];
    let (mut i, mut n) = (0, 0);
    while i < ARCHS.len() {
        let keep = match k_only {
            Some(k) => ARCHS[i].k_only == k,
            None => true,
        };
        if keep {
            out[n] = ARCHS[i].name;
            n += 1;
        }
        i += 1;
    }
    out
}

/// How many architectures of [`ARCHS`] keep keys only.
const fn n_k_only() -> usize {
    let (mut i, mut n) = (0, 0);
    while i < ARCHS.len() {
        n += ARCHS[i].k_only as usize;
        i += 1;
    }
    n
}

const ALL_NAMES: [&str; ARCHS.len()] = names(None);
const K_ONLY_NAMES: [&str; n_k_only()] = names(Some(true));

/// The architectures (`general.architecture`) the executor runs: the names of [`ARCHS`].
pub const DEVICE_ARCHS: &[&str] = &ALL_NAMES;

/// Architectures whose cache is K-only (DeepSeek's latent cache: `-ctk` is its type, `-ctv`
/// is not used).
pub const K_ONLY_ARCHS: &[&str] = &K_ONLY_NAMES;

/// Whether [`DeviceModel::load`] runs the architecture `arch` (`general.architecture`).
pub fn device_arch(arch: Option<&str>) -> bool {
    arch.and_then(Arch::named).is_some()
}

/// Whether the executor keeps a cache of K type `k` for architecture `arch` on a device whose
/// K-only attention reads `k_only_types` ([`Backend::k_only_types`]; a device that keeps the
/// K/V pair, [`Backend::supports_kv`]): any for an architecture with K and V, one of
/// `k_only_types` for a K-only cache.
pub fn arch_keeps_kv(arch: Option<&str>, k: CacheType, k_only_types: &[GgmlType]) -> bool {
    let k_only = arch.and_then(Arch::named).is_some_and(|a| a.k_only);
    !k_only || k_only_types.contains(&k.ggml_type())
}

impl<B: Backend + 'static> DeviceModel<B> {
    /// Loads `gguf` (every tensor checked against the hyperparameters) onto `dev`, whichever
    /// architecture of [`ARCHS`] it is: every dense weight, and the routed experts of the
    /// layers `placement` puts on the device. The experts of the other layers stay in the
    /// file mapping and run on the host.
    pub fn load(
        gguf: GgufModel,
        dev: B,
        placement: &ExpertPlacement,
    ) -> Result<DeviceModel<B>, ModelError> {
        let layers = load_layers(gguf, &dev)?;
        Self::with_layers(layers, dev, placement)
    }

    /// Loads `gguf` onto `dev` with every layer's routed experts on the device and no op
    /// offload: how the CPU runs a model ([`crate::load`] over [`hmoe_cpu::Cpu`]).
    pub fn load_whole(gguf: GgufModel, dev: B) -> Result<DeviceModel<B>, ModelError> {
        let layers = load_layers(gguf, &dev)?;
        let placement =
            ExpertPlacement::all(layers.dims().n_layer, ExpertHome::Device).with_op_offload(None);
        Self::with_layers(layers, dev, &placement)
    }
}

/// The layers of the architecture `gguf` names, loaded onto `dev`.
fn load_layers<B: Backend + 'static>(
    gguf: GgufModel,
    dev: &B,
) -> Result<Box<dyn DeviceLayers<B>>, ModelError> {
    arch_of(gguf.metadata())?.load(gguf, dev)
}

/// The architecture of [`ARCHS`] that `meta` names (`general.architecture`).
fn arch_of(meta: &Metadata) -> Result<&'static Arch, ModelError> {
    let name = meta.architecture();
    name.and_then(Arch::named).ok_or_else(|| {
        ModelError::UnsupportedArch(format!(
            "{} (no device executor for it)",
            name.unwrap_or("<missing general.architecture>")
        ))
    })
}

/// The placement planner's hyperparameters of `gguf` ([`ModelShape`]), read from its metadata
/// by the architecture it names, with the defaults and checks of loading it, and the
/// vocabulary the rows of its embedding (`token_embd.weight`). An architecture outside
/// [`ARCHS`], a missing required key or a value the forward pass rejects is an error.
pub fn model_shape(gguf: &GgufModel) -> Result<ModelShape, ModelError> {
    let meta = gguf.metadata();
    arch_of(meta)?.shape(meta, n_vocab(gguf)?)
}

#[cfg(test)]
mod shape_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_answers_the_queries() {
        assert_eq!(
            DEVICE_ARCHS,
            ["gpt-oss", "deepseek2", "qwen3moe", "llama", "qwen2"]
        );
        assert_eq!(K_ONLY_ARCHS, ["deepseek2"]);
        assert!(device_arch(Some("qwen2")) && !device_arch(Some("mixtral")) && !device_arch(None));
        let f16 = [GgmlType::F16];
        assert!(arch_keeps_kv(Some("deepseek2"), CacheType::F16, &f16));
        assert!(!arch_keeps_kv(Some("deepseek2"), CacheType::Q8_0, &f16));
        assert!(arch_keeps_kv(Some("gpt-oss"), CacheType::Q8_0, &f16));
    }
}
