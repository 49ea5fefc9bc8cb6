//! The devices a run may use: the CUDA GPUs this machine has, the reference device `REF0`,
//! which of them `--device` selects, and the memory budget of each.

use hmoe_placement::{DeviceBudget, GpuBudget};

use crate::error::EngineError;

/// Memory of the reference device `REF0` without `--gpu-mem`.
pub const REF0_DEFAULT_BYTES: u64 = 16 << 30;

/// A device `--device` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selected {
    /// A probed CUDA GPU: its position in [`Probed::gpus`].
    Cuda(usize),
    /// The reference device `REF0`.
    Ref0,
}

/// The CUDA devices of this machine, or none and why (no driver, no device).
#[derive(Clone, Debug, Default)]
pub struct Probed {
    /// The devices, `CUDA0` first.
    pub gpus: Vec<hmoe_cuda::GpuInfo>,
    /// Why there are none, when the probe failed.
    pub why_none: Option<String>,
}

impl Probed {
    /// Probes the driver (an empty list with the reason when CUDA is absent).
    pub fn now() -> Probed {
        match hmoe_cuda::probe() {
            Ok(gpus) => Probed {
                why_none: gpus.is_empty().then(|| "no CUDA device found".to_string()),
                gpus,
            },
            Err(e) => Probed {
                gpus: Vec::new(),
                why_none: Some(e.to_string()),
            },
        }
    }

    fn names(&self) -> String {
        let cuda = if self.gpus.is_empty() {
            format!(
                "no CUDA device ({})",
                self.why_none.as_deref().unwrap_or("no CUDA device found")
            )
        } else {
            self.gpus
                .iter()
                .map(hmoe_cuda::GpuInfo::device_name)
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "{cuda}; {} (reference device, for testing)",
            hmoe_backend::REF0_NAME
        )
    }

    /// The name of a selected device (`CUDA0`, `REF0`).
    pub fn name_of(&self, d: Selected) -> String {
        match d {
            Selected::Cuda(i) => self.gpus[i].device_name(),
            Selected::Ref0 => hmoe_backend::REF0_NAME.to_string(),
        }
    }
}

/// Parses a `--device` list against the probed GPUs: the named devices in the order given
/// (`REF0` is always there), empty for `none`.
pub fn parse_device_list(list: &str, probed: &Probed) -> Result<Vec<Selected>, EngineError> {
    let list = list.trim();
    if list.eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for name in list.split(',').map(str::trim) {
        let dev = if name.eq_ignore_ascii_case(hmoe_backend::REF0_NAME) {
            Selected::Ref0
        } else {
            probed
                .gpus
                .iter()
                .position(|g| g.device_name().eq_ignore_ascii_case(name))
                .map(Selected::Cuda)
                .ok_or_else(|| EngineError::UnknownDevice {
                    name: name.to_string(),
                    available: probed.names(),
                })?
        };
        if out.contains(&dev) {
            return Err(EngineError::ListedTwice(name.to_string()));
        }
        out.push(dev);
    }
    Ok(out)
}

/// The devices a `--device` list names (in the order given), or `None` without the flag.
pub fn selected_devices(
    list: Option<&str>,
    probed: &Probed,
) -> Result<Option<Vec<Selected>>, EngineError> {
    list.map(|l| parse_device_list(l, probed)).transpose()
}

/// The GPUs a plan may use (default runtime overhead each), no host figure: `gpu_mem` bytes
/// each when given, else the free memory of the `selected` devices (`REF0` has
/// [`REF0_DEFAULT_BYTES`]), or of every probed GPU without a selection; an empty selection
/// (`--device none`) means no GPU even with `gpu_mem`.
pub fn device_budget(
    selected: Option<&[Selected]>,
    gpu_mem: &[u64],
    probed: &Probed,
) -> DeviceBudget {
    let gpus = if selected.is_some_and(<[Selected]>::is_empty) {
        Vec::new()
    } else if !gpu_mem.is_empty() {
        gpu_mem.iter().map(|&b| GpuBudget::new(b)).collect()
    } else {
        let all: Vec<Selected> = (0..probed.gpus.len()).map(Selected::Cuda).collect();
        selected
            .unwrap_or(&all)
            .iter()
            .map(|&d| match d {
                Selected::Cuda(i) => GpuBudget::new(probed.gpus[i].free_bytes),
                Selected::Ref0 => GpuBudget::new(REF0_DEFAULT_BYTES),
            })
            .collect()
    };
    DeviceBudget {
        gpus,
        host_free: None,
    }
}
