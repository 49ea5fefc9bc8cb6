//! The instruction sets the kernels are compiled for, and whether the AMX tiles run here.

use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
use crate::x86::features;

/// An instruction-set level the kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, the reference every other path must reproduce.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL (plus AVX2/FMA/F16C); VNNI is used when the CPU has it.
    Avx512,
}

impl Isa {
    /// The fastest ISA this CPU supports (detected once, then cached).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            if Isa::Avx512.is_available() {
                Isa::Avx512
            } else if Isa::Avx2.is_available() {
                Isa::Avx2
            } else {
                Isa::Scalar
            }
        })
    }

    /// Every ISA this CPU supports, slowest first (always starts with [`Isa::Scalar`]).
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.is_available())
            .collect()
    }

    /// Whether this CPU can run kernels of this ISA.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => features::has_avx2(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => features::has_avx512(),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }

    /// Short lower-case name (`scalar`, `avx2`, `avx512`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether AMX-INT8 runs here, and if not, why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AmxStatus {
    /// Tile permission granted and a tile multiply gave the right result: batched MXFP4
    /// products use AMX (see [`crate::amx_in_use`]).
    Usable,
    /// The CPU does not report AMX-TILE and AMX-INT8 (or AVX-512 VNNI/VBMI, which the
    /// kernel's fallbacks need).
    NotReported,
    /// `HMOE_AMX=0` turned it off.
    Disabled,
    /// The kernel refused the tile permission (the errno).
    PermissionDenied(i32),
    /// The probe's tile instructions faulted or computed the wrong result.
    ProbeFailed(String),
}

impl std::fmt::Display for AmxStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AmxStatus::Usable => {
                f.write_str("amx-int8 runs (tile permission granted, probe passed)")
            }
            AmxStatus::NotReported => f.write_str("no amx (not reported by the CPU)"),
            AmxStatus::Disabled => f.write_str("no amx (HMOE_AMX=0)"),
            AmxStatus::PermissionDenied(e) => {
                write!(f, "no amx (tile permission refused, errno {e})")
            }
            AmxStatus::ProbeFailed(why) => write!(f, "no amx ({why})"),
        }
    }
}
