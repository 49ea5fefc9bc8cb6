//! Errors of the planner.

use crate::device::DeviceId;

/// Everything that can go wrong while reading flags or planning.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlacementError {
    /// An `-ot` item without `=`, or with an empty pattern or device.
    #[error("-ot: `{0}` is not of the form REGEX=DEV")]
    BadOverrideSyntax(String),
    /// An `-ot` pattern that is not a valid regular expression.
    #[error("-ot: bad regular expression `{pattern}`: {message}")]
    BadRegex {
        /// The pattern as given.
        pattern: String,
        /// The regex engine's explanation.
        message: String,
    },
    /// An `-ot` device that is not one of the configured devices.
    #[error("-ot: unknown device `{device}`; valid devices: {valid}")]
    UnknownDevice {
        /// The device name as given.
        device: String,
        /// The valid names, comma separated.
        valid: String,
    },
    /// An `-ngl` value that is neither a number nor `auto`/`all`.
    #[error("-ngl: bad value `{0}`: expected a number of layers, `auto` or `all`")]
    BadGpuLayers(String),
    /// A `-ctk`/`-ctv` value that is not a supported KV cache type.
    #[error(
        "unsupported KV cache type `{0}`; supported: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1"
    )]
    BadCacheType(String),
    /// A memory size that cannot be parsed.
    #[error(
        "bad memory size `{0}`: expected a number and a unit (B, KiB, MiB, GiB, TiB, KB, MB, \
         GB, TB, K, M, G, T; no unit = MiB)"
    )]
    BadSize(String),
    /// A setting out of range (`-ub 0`, `-np 0`, ...).
    #[error("invalid setting: {0}")]
    Invalid(String),
    /// The model description is incomplete or inconsistent.
    #[error("model shape: {0}")]
    Shape(String),
    /// `--fit` found no configuration that leaves the margin on every device.
    #[error("{}", fmt_shortfalls(.0))]
    DoesNotFit(Vec<Shortfall>),
}

/// How much memory one device lacks in the best configuration the fit search found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// The device.
    pub device: DeviceId,
    /// Bytes the plan would use on it.
    pub projected: u64,
    /// Bytes free on it.
    pub free: u64,
    /// Bytes that must stay free (`--fit-target`).
    pub margin: u64,
}

impl Shortfall {
    /// Bytes missing: `projected + margin - free`.
    pub fn missing(&self) -> u64 {
        (self.projected + self.margin).saturating_sub(self.free)
    }
}

fn mib(b: u64) -> String {
    format!("{:.0} MiB", b as f64 / (1024.0 * 1024.0))
}

fn fmt_shortfalls(s: &[Shortfall]) -> String {
    let parts: Vec<String> = s
        .iter()
        .map(|s| {
            format!(
                "{} needs {} more (projected use {} + margin {} > free {})",
                s.device,
                mib(s.missing()),
                mib(s.projected),
                mib(s.margin),
                mib(s.free)
            )
        })
        .collect();
    format!(
        "the model does not fit even with the smallest allowed context and every movable \
         expert on the CPU: {}",
        parts.join("; ")
    )
}
