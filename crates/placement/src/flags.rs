//! The user's placement flags, with llama.cpp's meaning, and the parsers for their values.

use hmoe_quant::GgmlType;

use crate::error::PlacementError;

/// The regex `--cpu-moe` uses (llama.cpp `LLM_FFN_EXPS_REGEX`): unanchored, so the expert
/// biases match too; the router `ffn_gate_inp` and shared experts `_shexp` do not.
pub const FFN_EXPS_REGEX: &str = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps";

/// `-ngl`: how many layers (counted from the end, the output head being one) go to the GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuLayers {
    /// Not given: `--fit` chooses; without fit, every layer.
    Auto,
    /// `all`: every layer and the output head.
    All,
    /// The last `n` layers (output head included); values above `n_layer + 1` mean all.
    Count(u32),
}

impl GpuLayers {
    /// Parses `N`, `auto` or `all`.
    pub fn parse(s: &str) -> Result<GpuLayers, PlacementError> {
        match s.trim() {
            "auto" => Ok(GpuLayers::Auto),
            "all" => Ok(GpuLayers::All),
            t => t
                .parse::<u32>()
                .map(GpuLayers::Count)
                .map_err(|_| PlacementError::BadGpuLayers(s.to_string())),
        }
    }
}

/// One tensor-placement rule, in command-line order. The first rule whose pattern matches a
/// tensor's name decides its device (llama.cpp's override list: `-ot`, `--cpu-moe` and
/// `--n-cpu-moe` all append to it as they appear).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorRule {
    /// `-ot REGEX=DEV`: tensors whose name contains a match of `pattern` go to `device`
    /// (`CPU`, `CUDA0`, ...).
    Override {
        /// Regular expression, searched unanchored in the tensor name.
        pattern: String,
        /// Device name as given.
        device: String,
    },
    /// `--cpu-moe`: every expert tensor to the CPU.
    CpuMoe,
    /// `--n-cpu-moe N`: expert tensors of layers `0..N` to the CPU.
    NCpuMoe(u32),
}

impl TensorRule {
    /// The rule as command-line arguments (already shell-quoted where needed).
    pub fn to_args(&self) -> String {
        match self {
            TensorRule::Override { pattern, device } => {
                format!("-ot {}", shell_quote(&format!("{pattern}={device}")))
            }
            TensorRule::CpuMoe => "--cpu-moe".to_string(),
            TensorRule::NCpuMoe(n) => format!("--n-cpu-moe {n}"),
        }
    }
}

/// Parses one `-ot` value, `REGEX=DEV[,REGEX=DEV...]`: split on `,`, then on the first `=`
/// (as llama.cpp does; a regex therefore cannot contain a comma). Device names are checked
/// later, against the configured devices.
pub fn parse_override_list(s: &str) -> Result<Vec<TensorRule>, PlacementError> {
    s.split(',')
        .map(|item| match item.split_once('=') {
            Some((p, d)) if !p.is_empty() && !d.is_empty() => Ok(TensorRule::Override {
                pattern: p.to_string(),
                device: d.to_string(),
            }),
            _ => Err(PlacementError::BadOverrideSyntax(item.to_string())),
        })
        .collect()
}

/// Parses a KV cache type as `-ctk`/`-ctv` take it: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0,
/// q5_1 (case-insensitive).
pub fn parse_cache_type(s: &str) -> Result<GgmlType, PlacementError> {
    match GgmlType::from_name(s.trim()) {
        Some(
            t @ (GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1),
        ) => Ok(t),
        _ => Err(PlacementError::BadCacheType(s.to_string())),
    }
}

/// Parses a memory size: a number (decimals allowed) and a unit. Binary units: `KiB`, `MiB`,
/// `GiB`, `TiB` and the short `K`, `M`, `G`, `T`; decimal: `KB`, `MB`, `GB`, `TB`; `B` = bytes;
/// no unit = MiB (like `--fit-target`). Case-insensitive, spaces allowed before the unit.
pub fn parse_size(s: &str) -> Result<u64, PlacementError> {
    let bad = || PlacementError::BadSize(s.to_string());
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| bad())?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "m" | "mib" => 1024.0 * 1024.0,
        "b" => 1.0,
        "k" | "kib" => 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    let bytes = (value * mult).round();
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// Quotes `s` for a POSIX shell when it has characters the shell would interpret.
pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_=.,:/+@%".contains(&b));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Everything the user said about placement and memory, with llama.cpp's defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementFlags {
    /// `-ngl` (default `auto`).
    pub n_gpu_layers: GpuLayers,
    /// `-ot`, `--cpu-moe`, `--n-cpu-moe` in command-line order; the first match wins.
    pub rules: Vec<TensorRule>,
    /// `-c`: `None` when not given (the trained context, which `--fit` may reduce); `Some(0)`
    /// pins the trained context; `Some(n)` pins `n` (padded up to a multiple of 256).
    pub ctx_size: Option<u32>,
    /// `-ctk` (default f16).
    pub cache_type_k: GgmlType,
    /// `-ctv` (default f16).
    pub cache_type_v: GgmlType,
    /// `-b` logical batch (default 2048).
    pub batch_size: u32,
    /// `-ub` physical batch (default 512); the compute buffers are sized for it.
    pub ubatch_size: u32,
    /// `-np` parallel sequences (default 1); the KV cache is one unified pool for all of them.
    pub n_parallel: u32,
    /// `--fit on|off` (default on).
    pub fit: bool,
    /// `--fit-target` in MiB per GPU; one value applies to every GPU, a missing one repeats
    /// the last (default 1024).
    pub fit_target_mib: Vec<u64>,
    /// `--fit-ctx`: the smallest context fit may choose (default 4096).
    pub fit_ctx: u32,
    /// Op offload (default on; `--no-op-offload` turns it off): for ubatches of at least
    /// [`OP_OFFLOAD_MIN_BATCH`] tokens, matmuls whose weights live on the CPU run on a GPU, which
    /// then needs a staging buffer for those weights.
    pub op_offload: bool,
    /// `--moe-cache MiB` in bytes (0: not asked for, or `auto`): the device expert cache the
    /// user asked for on the first GPU. The plan counts it when some layer's experts stay on
    /// the CPU, and `--fit` may shrink it (it is elastic, like the op-offload ring).
    pub moe_cache: u64,
}

/// The tokens one generation run processes: the prompt in micro-batches of at most `-ub`
/// tokens, then one token per step, with the logits of the last token only.
///
/// The hmoe engine allocates its CPU KV cache zeroed and untouched, so a run holds only the
/// pages of the cells it writes; given these counts ([`crate::plan_run`]) the CPU estimate is
/// what the run's resident memory grows by, not the allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunTokens {
    /// Tokens of the prompt (its first micro-batch is the largest one the run computes).
    pub prompt: u32,
    /// Tokens whose keys and values reach the cache: prompt plus generated steps fed back.
    pub total: u32,
}

/// Smallest ubatch for which op offload happens (llama.cpp's `GGML_OP_OFFLOAD_MIN_BATCH`).
pub const OP_OFFLOAD_MIN_BATCH: u32 = 32;

impl Default for PlacementFlags {
    fn default() -> Self {
        PlacementFlags {
            n_gpu_layers: GpuLayers::Auto,
            rules: Vec::new(),
            ctx_size: None,
            cache_type_k: GgmlType::F16,
            cache_type_v: GgmlType::F16,
            batch_size: 2048,
            ubatch_size: 512,
            n_parallel: 1,
            fit: true,
            fit_target_mib: vec![1024],
            fit_ctx: 4096,
            op_offload: true,
            moe_cache: 0,
        }
    }
}

impl PlacementFlags {
    /// The margin in bytes `--fit` keeps free on GPU `i`.
    pub fn fit_target_bytes(&self, i: usize) -> u64 {
        let mib = self
            .fit_target_mib
            .get(i)
            .or(self.fit_target_mib.last())
            .copied()
            .unwrap_or(1024);
        mib.saturating_mul(1024 * 1024)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_layers_values() {
        assert_eq!(GpuLayers::parse("auto"), Ok(GpuLayers::Auto));
        assert_eq!(GpuLayers::parse("all"), Ok(GpuLayers::All));
        assert_eq!(GpuLayers::parse("999"), Ok(GpuLayers::Count(999)));
        assert_eq!(GpuLayers::parse("0"), Ok(GpuLayers::Count(0)));
        assert!(matches!(
            GpuLayers::parse("-3"),
            Err(PlacementError::BadGpuLayers(_))
        ));
        assert!(GpuLayers::parse("most").is_err());
    }

    #[test]
    fn override_lists_split_like_llama_cpp() {
        let r = parse_override_list(r"blk\.1\.ffn=CPU,exps=CUDA0").unwrap();
        assert_eq!(
            r,
            vec![
                TensorRule::Override {
                    pattern: r"blk\.1\.ffn".into(),
                    device: "CPU".into()
                },
                TensorRule::Override {
                    pattern: "exps".into(),
                    device: "CUDA0".into()
                }
            ]
        );
        // Only the first `=` splits.
        let r = parse_override_list("a=b=CPU").unwrap();
        assert_eq!(
            r[0],
            TensorRule::Override {
                pattern: "a".into(),
                device: "b=CPU".into()
            }
        );
        for bad in ["nodevice", "=CPU", "x=", "a=CPU,", ""] {
            assert!(
                matches!(
                    parse_override_list(bad),
                    Err(PlacementError::BadOverrideSyntax(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn cache_types() {
        for (s, t) in [
            ("f32", GgmlType::F32),
            ("f16", GgmlType::F16),
            ("bf16", GgmlType::BF16),
            ("q8_0", GgmlType::Q8_0),
            ("Q4_0", GgmlType::Q4_0),
            ("q4_1", GgmlType::Q4_1),
            ("q5_0", GgmlType::Q5_0),
            ("q5_1", GgmlType::Q5_1),
        ] {
            assert_eq!(parse_cache_type(s), Ok(t));
        }
        for bad in ["q4_k", "mxfp4", "f8", ""] {
            assert!(parse_cache_type(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("8G"), Ok(8 << 30));
        assert_eq!(parse_size("8 gib"), Ok(8 << 30));
        assert_eq!(parse_size("8GB"), Ok(8_000_000_000));
        assert_eq!(parse_size("1024"), Ok(1 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("100B"), Ok(100));
        for bad in ["", "GiB", "8XB", "-1G", "1.2.3G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn quoting_and_rule_args() {
        assert_eq!(shell_quote("CPU"), "CPU");
        assert_eq!(shell_quote(r"a\.b"), r"'a\.b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(TensorRule::NCpuMoe(3).to_args(), "--n-cpu-moe 3");
        assert_eq!(
            TensorRule::Override {
                pattern: r"exps".into(),
                device: "CPU".into()
            }
            .to_args(),
            "-ot exps=CPU"
        );
    }

    #[test]
    fn fit_targets_repeat_the_last() {
        let mut f = PlacementFlags::default();
        assert_eq!(f.fit_target_bytes(3), 1 << 30);
        f.fit_target_mib = vec![512, 2048];
        assert_eq!(f.fit_target_bytes(0), 512 << 20);
        assert_eq!(f.fit_target_bytes(1), 2048 << 20);
        assert_eq!(f.fit_target_bytes(5), 2048 << 20);
    }
}
