//! Devices and their memory budgets.

use std::fmt;

/// Where a tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceId {
    /// Host memory (the CPU backend).
    Cpu,
    /// GPU number `n`, named `CUDAn` as in llama.cpp.
    Gpu(usize),
}

impl DeviceId {
    /// Whether this is a GPU.
    pub fn is_gpu(self) -> bool {
        matches!(self, DeviceId::Gpu(_))
    }

    /// Parses a device name as `-ot` takes it: `CPU` or `CUDA<n>` for a configured GPU
    /// (exact spelling, as llama.cpp's buffer-type names). `None` when unknown.
    pub fn parse(name: &str, n_gpus: usize) -> Option<DeviceId> {
        if name == "CPU" {
            return Some(DeviceId::Cpu);
        }
        let n = name.strip_prefix("CUDA")?;
        if n.is_empty()
            || !n.bytes().all(|b| b.is_ascii_digit())
            || (n.len() > 1 && n.starts_with('0'))
        {
            return None;
        }
        let i: usize = n.parse().ok()?;
        (i < n_gpus).then_some(DeviceId::Gpu(i))
    }

    /// The device's name with GPU `i` called `names[i]` where given, else as [`fmt::Display`]
    /// writes it (`CPU`, `CUDA<i>`).
    pub fn name_in(self, names: &[String]) -> String {
        match self {
            DeviceId::Gpu(i) if i < names.len() => names[i].clone(),
            other => other.to_string(),
        }
    }

    /// The names `parse` accepts for `n_gpus` GPUs, comma separated.
    pub fn valid_names(n_gpus: usize) -> String {
        let mut v = vec!["CPU".to_string()];
        v.extend((0..n_gpus).map(|i| format!("CUDA{i}")));
        v.join(", ")
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceId::Cpu => f.write_str("CPU"),
            DeviceId::Gpu(i) => write!(f, "CUDA{i}"),
        }
    }
}

/// Memory a GPU offers to the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuBudget {
    /// Free bytes (from the driver, or `--gpu-mem`).
    pub free: u64,
    /// Bytes the runtime itself takes after `free` was measured (CUDA context growth, cuBLAS
    /// workspace, kernel images loaded lazily). Counted as "overhead" in the plan.
    pub overhead: u64,
}

impl GpuBudget {
    /// A GPU with `free` bytes and the default runtime overhead.
    pub fn new(free: u64) -> GpuBudget {
        GpuBudget {
            free,
            overhead: DEFAULT_GPU_OVERHEAD,
        }
    }
}

/// Default runtime overhead per GPU: 256 MiB. This is an allowance, not a measurement: the
/// CUDA backend issue should replace it by the measured growth of device memory from the
/// moment free memory is read to the first decoded token, excluding the buffers counted here.
pub const DEFAULT_GPU_OVERHEAD: u64 = 256 << 20;

/// The devices a plan may use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceBudget {
    /// GPUs in order: `CUDA0`, `CUDA1`, ...
    pub gpus: Vec<GpuBudget>,
    /// Free host memory, for the report only: host weights are memory-mapped and paged by the
    /// kernel, so the planner never treats the host as a constraint.
    pub host_free: Option<u64>,
}

impl DeviceBudget {
    /// A budget with GPUs of the given free bytes (default overhead) and no host figure.
    pub fn with_gpus(free: &[u64]) -> DeviceBudget {
        DeviceBudget {
            gpus: free.iter().map(|&f| GpuBudget::new(f)).collect(),
            host_free: None,
        }
    }

    /// Every device: the CPU first, then the GPUs.
    pub fn ids(&self) -> Vec<DeviceId> {
        let mut v = vec![DeviceId::Cpu];
        v.extend((0..self.gpus.len()).map(DeviceId::Gpu));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_names_exactly() {
        assert_eq!(DeviceId::parse("CPU", 0), Some(DeviceId::Cpu));
        assert_eq!(DeviceId::parse("CUDA0", 2), Some(DeviceId::Gpu(0)));
        assert_eq!(DeviceId::parse("CUDA1", 2), Some(DeviceId::Gpu(1)));
        assert_eq!(DeviceId::parse("CUDA2", 2), None);
        assert_eq!(DeviceId::parse("CUDA0", 0), None);
        assert_eq!(DeviceId::parse("cpu", 1), None);
        assert_eq!(DeviceId::parse("CUDA", 1), None);
        assert_eq!(DeviceId::parse("CUDA01", 2), None);
        assert_eq!(DeviceId::parse("CUDA_Host", 1), None);
        assert_eq!(DeviceId::valid_names(2), "CPU, CUDA0, CUDA1");
        let names = ["REF0".to_string()];
        assert_eq!(DeviceId::Gpu(0).name_in(&names), "REF0");
        assert_eq!(DeviceId::Gpu(1).name_in(&names), "CUDA1");
        assert_eq!(DeviceId::Cpu.name_in(&names), "CPU");
        assert_eq!(DeviceId::Gpu(3).to_string(), "CUDA3");
    }
}
