//! The contract's error type.

use hmoe_quant::GgmlType;

/// What a device can report. None of these is a panic: bad shapes, unsupported types and a
/// full device are errors the caller can show.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// Buffer sizes or dimensions do not agree.
    #[error("{op}: {what}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What does not fit.
        what: String,
    },
    /// A weight type the device has no kernel for.
    #[error("{ty} weights are not supported by this device for {op}")]
    UnsupportedType {
        /// The type.
        ty: GgmlType,
        /// The operation.
        op: &'static str,
    },
    /// An op variant the device does not implement.
    #[error("{op}: {what} is not supported by this device")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// The variant asked for.
        what: String,
    },
    /// An allocation beyond the device's memory.
    #[error(
        "{device}: out of memory: {what} needs {:.1} MiB, {:.1} MiB free of {:.1} MiB \
         ({:.1} MiB missing; raise --gpu-mem or keep more on the CPU)",
        mib(*requested), mib(*free), mib(*total), mib(requested.saturating_sub(*free))
    )]
    OutOfMemory {
        /// The device's name.
        device: String,
        /// What was being allocated.
        what: &'static str,
        /// Bytes asked for.
        requested: u64,
        /// Bytes free at the time.
        free: u64,
        /// The device's memory.
        total: u64,
    },
    /// The device itself failed (a driver or runtime error).
    #[error("{device}: {message}")]
    Device {
        /// The device's name.
        device: String,
        /// What the device reported.
        message: String,
    },
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// `Err(BackendError::Shape)` unless `cond`.
pub(crate) fn ensure(
    cond: bool,
    op: &'static str,
    what: impl FnOnce() -> String,
) -> Result<(), BackendError> {
    if cond {
        Ok(())
    } else {
        Err(BackendError::Shape { op, what: what() })
    }
}
