//! Placement flags shared by `run`, `serve` and `fit`, spelled as llama.cpp spells them.
//!
//! `-ot`, `--cpu-moe` and `--n-cpu-moe` form one ordered rule list in llama.cpp (the first
//! matching rule wins), so their relative order on the command line matters. A derived
//! `FromArgMatches` cannot see that order; [`PlacementArgs`] therefore implements `clap::Args`
//! by hand around the derived [`PlacementFlagArgs`] and reads the positions from the matches.
//! Flatten it with `#[command(flatten)] placement: PlacementArgs`.

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, FromArgMatches};
use std::path::PathBuf;

use hmoe_engine::{EngineConfig, MoeCacheFlag, Probed, Selected};
use hmoe_gguf::LoadOptions;
use hmoe_model::KvType;
use hmoe_placement::{
    parse_cache_type, parse_override_list, parse_size, DeviceBudget, GpuLayers, PlacementFlags,
    TensorRule,
};

/// The placement flags as clap parses them (values still strings where llama.cpp accepts words).
#[derive(Args, Debug, Clone)]
pub struct PlacementFlagArgs {
    /// Layers on the GPU, counted from the last (the output head is one): N, `auto` or `all`.
    #[arg(
        long = "n-gpu-layers",
        visible_alias = "ngl",
        value_name = "N|auto|all",
        default_value = "auto"
    )]
    pub n_gpu_layers: String,
    /// Keep every MoE expert tensor on the CPU (`-cmoe`).
    #[arg(long = "cpu-moe", visible_alias = "cmoe")]
    pub cpu_moe: bool,
    /// Keep the expert tensors of the first N layers on the CPU (`-ncmoe`).
    #[arg(long = "n-cpu-moe", visible_alias = "ncmoe", value_name = "N")]
    pub n_cpu_moe: Option<u32>,
    /// Tensor placement rules REGEX=DEV[,REGEX=DEV...] (`-ot`, repeatable; DEV is CPU, CUDA0, ...).
    /// Rules and --cpu-moe/--n-cpu-moe apply in command-line order; the first match wins.
    #[arg(
        long = "override-tensor",
        visible_alias = "ot",
        value_name = "REGEX=DEV,..."
    )]
    pub override_tensor: Vec<String>,
    /// Context size in tokens (0 = the model's trained context). Unset: the trained context,
    /// which --fit may reduce.
    #[arg(
        short = 'c',
        long = "ctx-size",
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub ctx_size: Option<u32>,
    /// KV cache type for K (`-ctk`): f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1.
    #[arg(long = "cache-type-k", visible_alias = "ctk", default_value = "f16")]
    pub cache_type_k: String,
    /// KV cache type for V (`-ctv`).
    #[arg(long = "cache-type-v", visible_alias = "ctv", default_value = "f16")]
    pub cache_type_v: String,
    /// Logical batch size.
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048)]
    pub batch_size: u32,
    /// Physical batch size (`-ub`); compute buffers are sized for it.
    #[arg(long = "ubatch-size", visible_alias = "ub", default_value_t = 512)]
    pub ubatch_size: u32,
    /// Parallel sequences (`-np`), at least 1; -1 (llama.cpp's "auto") is the default: 4 for
    /// `serve` (as llama-server), 1 elsewhere. 0 here means auto.
    #[arg(long = "parallel", visible_alias = "np", default_value = "-1",
          allow_negative_numbers = true, value_parser = parse_parallel)]
    pub parallel: u32,
    /// Adjust unset flags so every GPU keeps --fit-target free: on or off.
    #[arg(long = "fit", value_parser = ["on", "off"], default_value = "on")]
    pub fit: String,
    /// MiB to keep free per GPU (comma separated per GPU; one value for all).
    #[arg(
        long = "fit-target",
        visible_alias = "fitt",
        value_name = "MiB[,MiB...]",
        default_value = "1024"
    )]
    pub fit_target: String,
    /// Smallest context --fit may choose.
    #[arg(
        long = "fit-ctx",
        visible_alias = "fitc",
        value_name = "N",
        default_value_t = 4096
    )]
    pub fit_ctx: u32,
    /// Free memory of one GPU (repeatable: CUDA0, CUDA1, ...), e.g. 8GiB, 7.5G, 8000MB.
    #[arg(long = "gpu-mem", value_name = "SIZE")]
    pub gpu_mem: Vec<String>,
    /// Never run matmuls of CPU-resident weights on a GPU for large batches.
    #[arg(long = "no-op-offload")]
    pub no_op_offload: bool,
    /// Op offload: micro-batches of at least N tokens run the experts of CPU layers on the
    /// GPU (llama.cpp's GGML_OP_OFFLOAD_MIN_BATCH, default 32).
    #[arg(
        long = "op-offload-min-batch",
        value_name = "N",
        default_value_t = hmoe_model::OP_OFFLOAD_MIN_BATCH as u64,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub op_offload_min_batch: u64,
    /// GPUs to use (`-dev`): a comma list of CUDA0, CUDA1, ..., REF0 (the reference device,
    /// for testing: plain Rust on the host, used as a GPU; --gpu-mem sets its memory) or
    /// `none` (CPU only). Default: every CUDA GPU found. `hmoe --list-devices` shows them.
    #[arg(long = "device", value_name = "CUDA0,...|REF0|none")]
    pub device: Option<String>,
    /// Device expert cache for the layers whose experts stay on the CPU: the device keeps
    /// their most recently used experts (one LRU per layer) and runs the routed experts it
    /// holds. MiB, or `auto` for what the placement leaves free beyond --fit-target; 0 or
    /// unset: off (not yet the default: it has not been measured on a GPU).
    #[arg(long = "moe-cache", value_name = "MiB|auto", value_parser = parse_moe_cache)]
    pub moe_cache: Option<MoeCacheFlag>,
}

/// The sequences run at once when `-np` is not given, or is -1, except by `serve` (which
/// serves [`SERVE_DEFAULT_PARALLEL`]).
const DEFAULT_PARALLEL: u32 = 1;

/// The slots `hmoe serve` runs when `-np` is not given, or is -1: llama-server's "auto".
pub const SERVE_DEFAULT_PARALLEL: u32 = 4;

/// `-np N`: N ≥ 1, or -1 for the default (llama.cpp's "auto"), kept as 0 ([`PlacementArgs::
/// parallel`] resolves it per command).
fn parse_parallel(s: &str) -> Result<u32, String> {
    match s.trim().parse::<i64>() {
        Ok(-1) => Ok(0),
        Ok(n) if n >= 1 => u32::try_from(n).map_err(|_| format!("{n} sequences is too many")),
        _ => Err(format!(
            "`{s}` is not a number of sequences (1 or more, or -1 for the default)"
        )),
    }
}

fn parse_moe_cache(s: &str) -> Result<MoeCacheFlag, String> {
    match s {
        "auto" => Ok(MoeCacheFlag::Auto),
        _ => s
            .parse()
            .map(MoeCacheFlag::Mib)
            .map_err(|_| format!("expected MiB or `auto`, got `{s}`")),
    }
}

/// The placement flags plus the command-line order of the rule flags.
#[derive(Debug, Clone)]
pub struct PlacementArgs {
    /// The parsed values.
    pub args: PlacementFlagArgs,
    /// `-ot`, `--cpu-moe` and `--n-cpu-moe` in command-line order.
    rules: Vec<TensorRule>,
}

impl PlacementArgs {
    /// The library's flags: every value parsed and checked (devices and regexes are checked
    /// by the planner, which knows the configured GPUs).
    pub fn to_flags(&self) -> anyhow::Result<PlacementFlags> {
        let a = &self.args;
        let fit_target_mib = a
            .fit_target
            .split(',')
            .map(|s| {
                s.trim()
                    .parse::<u64>()
                    .with_context(|| format!("--fit-target: `{s}` is not a number of MiB"))
            })
            .collect::<anyhow::Result<Vec<u64>>>()?;
        Ok(PlacementFlags {
            n_gpu_layers: GpuLayers::parse(&a.n_gpu_layers)?,
            rules: self.rules.clone(),
            ctx_size: a.ctx_size,
            cache_type_k: parse_cache_type(&a.cache_type_k)?,
            cache_type_v: parse_cache_type(&a.cache_type_v)?,
            batch_size: a.batch_size,
            ubatch_size: a.ubatch_size,
            n_parallel: self.parallel(DEFAULT_PARALLEL),
            fit: a.fit == "on",
            fit_target_mib,
            fit_ctx: a.fit_ctx,
            op_offload: !a.no_op_offload,
            moe_cache: match a.moe_cache {
                Some(MoeCacheFlag::Mib(m)) => m.saturating_mul(1 << 20),
                _ => 0,
            },
        })
    }

    /// `-np`, or `auto` when it was not given (or was -1).
    pub fn parallel(&self, auto: u32) -> u32 {
        match self.args.parallel {
            0 => auto,
            n => n,
        }
    }

    /// Whether the flags ask for GPU offload explicitly (`-ngl` other than auto or 0,
    /// `--gpu-mem`, or `--device` other than none): a CPU run then warns why.
    pub fn asks_for_gpu(&self) -> bool {
        let a = &self.args;
        !matches!(a.n_gpu_layers.as_str(), "auto" | "0")
            || !a.gpu_mem.is_empty()
            || a.device
                .as_deref()
                .is_some_and(|d| !d.eq_ignore_ascii_case("none"))
    }

    /// The op offload threshold: `--op-offload-min-batch`, or `None` with `--no-op-offload`.
    pub fn op_offload(&self) -> Option<usize> {
        let n = usize::try_from(self.args.op_offload_min_batch).unwrap_or(usize::MAX);
        (!self.args.no_op_offload).then_some(n)
    }

    /// The GPUs the plan may use (default runtime overhead each), no host figure: those of
    /// `--gpu-mem` when given, else the free memory (`cuMemGetInfo`) of the GPUs found, limited
    /// to `--device`. Probes the driver only when it needs to (no `--gpu-mem`, or `--device`).
    pub fn gpu_budget(&self) -> anyhow::Result<DeviceBudget> {
        let probed = if self.args.gpu_mem.is_empty() || self.args.device.is_some() {
            Probed::now()
        } else {
            Probed::default()
        };
        self.gpu_budget_with(&probed)
    }

    /// [`PlacementArgs::gpu_budget`] against already probed GPUs. With `--device`, the plan's
    /// GPU k is the k-th device listed (`REF0` has [`hmoe_engine::REF0_DEFAULT_BYTES`] without
    /// `--gpu-mem`); `--device none` means no GPU even with `--gpu-mem`.
    pub fn gpu_budget_with(&self, probed: &Probed) -> anyhow::Result<DeviceBudget> {
        let selected = self.selected_devices(probed)?;
        let gpu_mem = match &selected {
            Some(s) if s.is_empty() => Vec::new(),
            _ => self.gpu_mem_bytes()?,
        };
        Ok(hmoe_engine::device_budget(
            selected.as_deref(),
            &gpu_mem,
            probed,
        ))
    }

    /// `--gpu-mem` in bytes, one per GPU of the plan.
    fn gpu_mem_bytes(&self) -> anyhow::Result<Vec<u64>> {
        (self.args.gpu_mem.iter())
            .map(|s| parse_size(s))
            .collect::<Result<Vec<_>, _>>()
            .context("--gpu-mem")
    }

    /// The devices `--device` names (in the order given), or `None` without the flag.
    pub fn selected_devices(&self, probed: &Probed) -> anyhow::Result<Option<Vec<Selected>>> {
        Ok(hmoe_engine::selected_devices(
            self.args.device.as_deref(),
            probed,
        )?)
    }

    /// The engine's configuration for `model`, opened as `load` says, with the K/V cache `kv`
    /// and these flags (every value parsed and checked as [`PlacementArgs::to_flags`] does).
    pub fn engine_config(
        &self,
        model: PathBuf,
        load: LoadOptions,
        kv: KvType,
    ) -> anyhow::Result<EngineConfig> {
        let none =
            (self.args.device.as_deref()).is_some_and(|d| d.trim().eq_ignore_ascii_case("none"));
        Ok(EngineConfig {
            model,
            load,
            kv,
            devices: self.args.device.clone(),
            gpu_mem: if none {
                Vec::new()
            } else {
                self.gpu_mem_bytes()?
            },
            flags: self.to_flags()?,
            op_offload: self.op_offload(),
            moe_cache: self.args.moe_cache,
            asks_for_gpu: self.asks_for_gpu(),
            kv_offload: true,
        })
    }

    fn ordered_rules(
        m: &ArgMatches,
        args: &PlacementFlagArgs,
    ) -> Result<Vec<TensorRule>, clap::Error> {
        let mut at: Vec<(usize, TensorRule)> = Vec::new();
        if let Some(idx) = m.indices_of("override_tensor") {
            for (i, v) in idx.zip(&args.override_tensor) {
                let invalid = |msg: String| {
                    clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{msg}\n"))
                };
                let rules = parse_override_list(v).map_err(|e| invalid(e.to_string()))?;
                for r in &rules {
                    if let TensorRule::Override { pattern, .. } = r {
                        regex::Regex::new(pattern).map_err(|e| {
                            // The regex crate's message spans lines (pattern, caret, reason).
                            let text = e.to_string();
                            let why = text.lines().last().unwrap_or("").trim();
                            let why = why.strip_prefix("error: ").unwrap_or(why);
                            invalid(format!(
                                "--override-tensor: `{pattern}` is not a valid regular expression ({why})"
                            ))
                        })?;
                    }
                }
                at.extend(rules.into_iter().map(|r| (i, r)));
            }
        }
        if args.cpu_moe && m.value_source("cpu_moe") == Some(ValueSource::CommandLine) {
            at.push((
                m.index_of("cpu_moe").unwrap_or(usize::MAX),
                TensorRule::CpuMoe,
            ));
        }
        if let Some(n) = args.n_cpu_moe {
            at.push((
                m.index_of("n_cpu_moe").unwrap_or(usize::MAX),
                TensorRule::NCpuMoe(n),
            ));
        }
        at.sort_by_key(|(i, _)| *i);
        Ok(at.into_iter().map(|(_, r)| r).collect())
    }
}

impl FromArgMatches for PlacementArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let args = PlacementFlagArgs::from_arg_matches(m)?;
        let rules = Self::ordered_rules(m, &args)?;
        Ok(PlacementArgs { args, rules })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        self.args.update_from_arg_matches(m)?;
        self.rules = Self::ordered_rules(m, &self.args)?;
        Ok(())
    }
}

impl Args for PlacementArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        PlacementFlagArgs::augment_args(cmd)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        PlacementFlagArgs::augment_args_for_update(cmd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use hmoe_quant::GgmlType;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        p: PlacementArgs,
    }

    fn parse(args: &[&str]) -> PlacementArgs {
        T::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
            .p
    }

    fn flags(args: &[&str]) -> PlacementFlags {
        parse(args).to_flags().unwrap()
    }

    #[test]
    fn defaults_are_llama_cpp_defaults() {
        assert_eq!(flags(&[]), PlacementFlags::default());
    }

    #[test]
    fn every_flag_parses() {
        let f = flags(&[
            "--ngl",
            "20",
            "-c",
            "8192",
            "--ctk",
            "q8_0",
            "--ctv",
            "q4_0",
            "-b",
            "1024",
            "--ub",
            "256",
            "--np",
            "4",
            "--fit",
            "off",
            "--fit-target",
            "512,2048",
            "--fit-ctx",
            "8192",
            "--no-op-offload",
        ]);
        assert_eq!(f.n_gpu_layers, GpuLayers::Count(20));
        assert_eq!(f.ctx_size, Some(8192));
        assert_eq!(
            (f.cache_type_k, f.cache_type_v),
            (GgmlType::Q8_0, GgmlType::Q4_0)
        );
        assert_eq!((f.batch_size, f.ubatch_size, f.n_parallel), (1024, 256, 4));
        assert!(!f.fit);
        assert_eq!(f.fit_target_mib, vec![512, 2048]);
        assert_eq!(f.fit_ctx, 8192);
        assert!(!f.op_offload);
        assert_eq!(
            flags(&["--n-gpu-layers", "all"]).n_gpu_layers,
            GpuLayers::All
        );
        assert_eq!(flags(&["-c", "0"]).ctx_size, Some(0));
    }

    #[test]
    fn op_offload_flags() {
        assert_eq!(parse(&[]).op_offload(), Some(32));
        assert_eq!(
            parse(&["--op-offload-min-batch", "64"]).op_offload(),
            Some(64)
        );
        assert_eq!(parse(&["--no-op-offload"]).op_offload(), None);
        assert_eq!(
            parse(&["--no-op-offload", "--op-offload-min-batch", "8"]).op_offload(),
            None
        );
        assert!(!flags(&["--no-op-offload"]).op_offload);
        for bad in ["0", "-1", "many"] {
            assert!(
                T::try_parse_from(["t", "--op-offload-min-batch", bad]).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn rule_flags_keep_command_line_order() {
        let f = flags(&["--ot", r"blk\.0\.ffn_up_exps=CUDA0", "--cpu-moe"]);
        assert_eq!(
            f.rules,
            vec![
                TensorRule::Override {
                    pattern: r"blk\.0\.ffn_up_exps".into(),
                    device: "CUDA0".into()
                },
                TensorRule::CpuMoe
            ]
        );
        let f = flags(&[
            "--cmoe",
            "--override-tensor",
            "a=CPU,b=CUDA0",
            "--ot",
            "c=CPU",
        ]);
        assert_eq!(f.rules[0], TensorRule::CpuMoe);
        assert_eq!(f.rules.len(), 4);
        assert!(matches!(&f.rules[3], TensorRule::Override { pattern, .. } if pattern == "c"));
        let f = flags(&["--ot", "a=CPU", "--ncmoe", "3", "--ot", "b=CPU"]);
        assert_eq!(f.rules[1], TensorRule::NCpuMoe(3));
        assert_eq!(
            flags(&["--n-cpu-moe", "2"]).rules,
            vec![TensorRule::NCpuMoe(2)]
        );
    }

    #[test]
    fn bad_values_are_errors() {
        assert!(parse(&["--ngl", "lots"]).to_flags().is_err());
        assert!(parse(&["--ctk", "q4_k"]).to_flags().is_err());
        assert!(parse(&["--fit-target", "1G"]).to_flags().is_err());
        assert!(parse(&["--gpu-mem", "eight"]).gpu_budget().is_err());
        for bad in [&["--ot", "noequals"][..], &["--fit", "maybe"], &["--ngl"]] {
            assert!(
                T::try_parse_from(std::iter::once("t").chain(bad.iter().copied())).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn gpu_mem_is_repeatable() {
        let b = parse(&["--gpu-mem", "8GiB", "--gpu-mem", "24G"])
            .gpu_budget()
            .unwrap();
        assert_eq!(b.gpus.len(), 2);
        assert_eq!(b.gpus[0].free, 8 << 30);
        assert_eq!(b.gpus[1].free, 24 << 30);
        assert!(parse(&[])
            .gpu_budget_with(&Probed::default())
            .unwrap()
            .gpus
            .is_empty());
    }

    fn gpu(index: usize, free_gib: u64) -> hmoe_cuda::GpuInfo {
        hmoe_cuda::GpuInfo {
            index,
            name: format!("Test GPU {index}"),
            total_bytes: 80 << 30,
            free_bytes: free_gib << 30,
            compute_capability: (9, 0),
        }
    }

    #[test]
    fn budget_defaults_to_the_probed_free_memory() {
        let probed = Probed {
            gpus: vec![gpu(0, 70), gpu(1, 20)],
            why_none: None,
        };
        let free = |args: &[&str]| -> Vec<u64> {
            parse(args)
                .gpu_budget_with(&probed)
                .unwrap()
                .gpus
                .iter()
                .map(|g| g.free >> 30)
                .collect()
        };
        assert_eq!(free(&[]), vec![70, 20]);
        assert_eq!(free(&["--device", "CUDA1"]), vec![20]);
        assert_eq!(free(&["--device", "cuda1,CUDA0"]), vec![20, 70]);
        assert_eq!(free(&["--device", "none"]), Vec::<u64>::new());
        assert_eq!(free(&["--gpu-mem", "8GiB"]), vec![8], "--gpu-mem wins");
        assert_eq!(
            free(&["--gpu-mem", "8GiB", "--device", "none"]),
            Vec::<u64>::new()
        );
    }

    #[test]
    fn unknown_devices_list_the_valid_ones() {
        let probed = Probed {
            gpus: vec![gpu(0, 70)],
            why_none: None,
        };
        let err = parse(&["--device", "CUDA3"])
            .gpu_budget_with(&probed)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("'CUDA3'") && err.contains("available: CUDA0; REF0"),
            "{err}"
        );
        assert!(parse(&["--device", "CUDA0,CUDA0"])
            .gpu_budget_with(&probed)
            .is_err());
        let none = Probed {
            gpus: Vec::new(),
            why_none: Some("no CUDA driver (libcuda not found)".into()),
        };
        let err = parse(&["--device", "CUDA0"])
            .gpu_budget_with(&none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no CUDA device (no CUDA driver"), "{err}");
        assert!(parse(&["--device", "none"]).gpu_budget_with(&none).is_ok());
    }

    #[test]
    fn ref0_is_a_gpu_of_the_plan() {
        let none = Probed::default();
        let sel = |args: &[&str]| parse(args).selected_devices(&none).unwrap();
        assert_eq!(sel(&["--device", "REF0"]), Some(vec![Selected::Ref0]));
        assert_eq!(sel(&["--device", "ref0"]), Some(vec![Selected::Ref0]));
        assert!(parse(&["--device", "REF0,REF0"])
            .selected_devices(&none)
            .is_err());
        let free = |args: &[&str], probed: &Probed| -> Vec<u64> {
            let b = parse(args).gpu_budget_with(probed).unwrap();
            b.gpus.iter().map(|g| g.free >> 20).collect()
        };
        assert_eq!(free(&["--device", "REF0"], &none), vec![16 << 10]);
        assert_eq!(
            free(&["--device", "REF0", "--gpu-mem", "64MiB"], &none),
            vec![64]
        );
        assert_eq!(
            free(&[], &none),
            Vec::<u64>::new(),
            "never without --device"
        );
        let one = Probed {
            gpus: vec![gpu(0, 70)],
            why_none: None,
        };
        assert_eq!(
            free(&["--device", "CUDA0,REF0"], &one),
            vec![70 << 10, 16 << 10]
        );
        assert_eq!(one.name_of(Selected::Ref0), "REF0");
    }
}
