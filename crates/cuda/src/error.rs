//! The crate's error type.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;
use hmoe_quant::GgmlType;

/// Everything that can go wrong in the CUDA backend. None of these is a panic: a machine
/// without CUDA gets [`CudaError::NoDriver`] from every entry point.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda.so` could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver (libcuda not found)")]
    NoDriver,
    /// `libnvrtc.so` (the runtime compiler, part of the CUDA toolkit) could not be loaded.
    #[error("no NVRTC (libnvrtc not found; put the CUDA toolkit's lib64 on LD_LIBRARY_PATH)")]
    NoNvrtc,
    /// The driver is present but reports no device with this ordinal.
    #[error("no CUDA device {ordinal} ({count} present)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    /// cuBLAS failed.
    #[error("cuBLAS: {0:?}")]
    Cublas(CublasError),
    /// NVRTC could not compile the kernels (the log says why).
    #[error("NVRTC compile failed: {message}\n{log}")]
    Compile {
        /// NVRTC's status and options.
        message: String,
        /// The compiler log.
        log: String,
    },
    /// The CUDA libraries panicked (for example a symbol missing from an old driver); the
    /// panic was caught and turned into this error.
    #[error("CUDA library failure: {0}")]
    Library(String),
    /// A weight type the kernels do not handle.
    #[error("{ty} weights are not supported by the CUDA kernels for {op}")]
    UnsupportedType {
        /// The type.
        ty: GgmlType,
        /// The operation.
        op: &'static str,
    },
    /// A recorded segment could not be captured into a CUDA graph (graphs are off from then
    /// on; the step runs again as issued).
    #[error("CUDA graph capture: {0}")]
    Capture(String),
    /// Buffer sizes or dimensions do not agree.
    #[error("{op}: {what}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What does not fit.
        what: String,
    },
}

impl From<CublasError> for CudaError {
    fn from(e: CublasError) -> Self {
        CudaError::Cublas(e)
    }
}

/// `Err(CudaError::Shape)` unless `cond`.
pub(crate) fn ensure(
    cond: bool,
    op: &'static str,
    what: impl FnOnce() -> String,
) -> Result<(), CudaError> {
    if cond {
        Ok(())
    } else {
        Err(CudaError::Shape { op, what: what() })
    }
}

/// Runs `f`, turning a panic inside the CUDA libraries into [`CudaError::Library`].
pub(crate) fn guarded<T>(f: impl FnOnce() -> Result<T, CudaError>) -> Result<T, CudaError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(CudaError::Library(msg))
        }
    }
}

impl From<CudaError> for hmoe_backend::BackendError {
    fn from(e: CudaError) -> hmoe_backend::BackendError {
        use hmoe_backend::BackendError;
        match e {
            CudaError::Shape { op, what } => BackendError::Shape { op, what },
            CudaError::UnsupportedType { ty, op } => BackendError::UnsupportedType { ty, op },
            other => BackendError::Device {
                device: "CUDA".into(),
                message: other.to_string(),
            },
        }
    }
}
