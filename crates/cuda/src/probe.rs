//! Which GPUs this machine has: name, memory, compute capability.

use cudarc::driver::{sys, CudaContext, DriverError};

use crate::error::{guarded, CudaError};

/// One CUDA device as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// Ordinal: `CUDA{index}` in device lists.
    pub index: usize,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Device memory in bytes.
    pub total_bytes: u64,
    /// Free device memory in bytes at probe time (`cuMemGetInfo`).
    pub free_bytes: u64,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)` for Hopper.
    pub compute_capability: (u32, u32),
}

impl GpuInfo {
    /// The device's name in `-dev`/`-ot` lists: `CUDA0`, `CUDA1`, ...
    pub fn device_name(&self) -> String {
        format!("CUDA{}", self.index)
    }
}

/// Whether `libcuda` can be loaded. Every CUDA call must be behind this check: cudarc panics
/// on the first call when the library is missing.
pub fn driver_present() -> bool {
    // SAFETY: only dlopens libcuda (running its initialisers, as any CUDA program does).
    unsafe { sys::is_culib_present() }
}

/// Whether `libnvrtc` (the kernel compiler) can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: as for `driver_present`, for libnvrtc.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether `libcublas` can be loaded.
pub fn cublas_present() -> bool {
    // SAFETY: as for `driver_present`, for libcublas.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// Number of CUDA devices: `Err(NoDriver)` without a driver, 0 when the driver finds none.
pub fn device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    guarded(|| match CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        Err(DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(e) => Err(e.into()),
    })
}

/// Every CUDA device with its memory and compute capability. Without a driver:
/// `Err(CudaError::NoDriver)` ("no CUDA driver (libcuda not found)"); with a driver and no
/// device: `Ok` of an empty list. Creates (retains) each device's primary context to read
/// its free memory.
pub fn probe() -> Result<Vec<GpuInfo>, CudaError> {
    let n = device_count()?;
    (0..n).map(probe_one).collect()
}

/// [`GpuInfo`] of device `index` (retains its primary context).
pub fn probe_one(index: usize) -> Result<GpuInfo, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    guarded(|| {
        let ctx = CudaContext::new(index)?;
        info_of(&ctx)
    })
}

/// [`GpuInfo`] of the device a context lives on.
pub(crate) fn info_of(ctx: &CudaContext) -> Result<GpuInfo, CudaError> {
    let (major, minor) = ctx.compute_capability()?;
    let (free, total) = ctx.mem_get_info()?;
    Ok(GpuInfo {
        index: ctx.ordinal(),
        name: ctx.name()?,
        total_bytes: total as u64,
        free_bytes: free as u64,
        compute_capability: (major.max(0) as u32, minor.max(0) as u32),
    })
}
