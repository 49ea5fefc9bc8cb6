//! The CUDA C source of the kernels, its entry points, and its compilation by NVRTC (with the
//! on-disk PTX cache).

use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use crate::cache;
use crate::error::CudaError;

/// The kernels' CUDA C source (header-free; see the comment at the top of `kernels/common.cu`):
/// the files of `kernels/` in dependency order, one translation unit for NVRTC and the host
/// emulator.
pub const SOURCE: &str = concat!(
    include_str!("kernels/common.cu"),
    include_str!("kernels/lowbit_blocks.cu"),
    include_str!("kernels/rows.cu"),
    include_str!("kernels/gemv.cu"),
    include_str!("kernels/gemv_dp4a.cu"),
    include_str!("kernels/elementwise.cu"),
    include_str!("kernels/attention.cu"),
    include_str!("kernels/router.cu"),
    include_str!("kernels/moe.cu"),
    include_str!("kernels/moe_dp4a.cu"),
    include_str!("kernels/tiled.cu"),
    include_str!("kernels/lowbit_products.cu"),
    include_str!("kernels/rows_heads.cu"),
    include_str!("kernels/latent_attention.cu"),
    include_str!("kernels/latent_split.cu"),
    include_str!("kernels/routing.cu"),
    include_str!("kernels/attention_chunked.cu"),
    include_str!("kernels/mma.cu"),
    include_str!("kernels/mma_kquants.cu"),
    include_str!("kernels/top_k.cu"),
);

/// Every `extern "C"` entry point in [`SOURCE`] that the Rust side launches.
pub const KERNELS: &[&str] = &[
    "get_rows_f32",
    "get_rows_f16",
    "get_rows_bf16",
    "get_rows_q8_0",
    "get_rows_mxfp4",
    "rms_norm_f32",
    "add_rms_norm_f32",
    "rms_norm_q8_0_f32",
    "add_rms_norm_q8_0_f32",
    "quantize_q8_0",
    "matmul_f32",
    "matmul_f16",
    "matmul_bf16",
    "matmul_dp4a_q8_0",
    "matmul_dp4a_mxfp4",
    "add_inplace_f32",
    "add_bias_f32",
    "f32_to_f16",
    "f32_to_bf16",
    "rope_neox_f32",
    "kv_store",
    "attn_row",
    "attn_chunked",
    "attn_chunked_fold",
    "router_topk_softmax",
    "router_logits_topk_f32",
    "router_logits_topk_f16",
    "router_logits_topk_bf16",
    "moe_dp4a_gate_up_q8_0",
    "moe_dp4a_down_q8_0",
    "moe_dp4a_gate_up_mxfp4",
    "moe_dp4a_down_mxfp4",
    "moe_gate_up_f16",
    "moe_down_f16",
    "moe_gate_up_bf16",
    "moe_down_bf16",
    "moe_gate_up_f32",
    "moe_down_f32",
    "moe_combine",
    "moe_group",
    "moe_mm_mxfp4",
    "moe_mm_q8_0",
    "matmul_tiled_q8_0",
    "matmul_tiled_mxfp4",
    "moe_swiglu",
    "moe_down_bias",
    "copy_rows_f32",
    "rope_norm_f32",
    "matmul_heads_f32",
    "matmul_heads_f16",
    "matmul_heads_bf16",
    "matmul_heads_q8_0",
    "matmul_heads_mxfp4",
    "swiglu_f32",
    "attn_k_only_f32",
    "attn_k_only_f16",
    "attn_k_only_bf16",
    "attn_k_only_q8_0",
    "attn_k_only_q4_0",
    "attn_k_only_q4_1",
    "attn_k_only_q5_0",
    "attn_k_only_q5_1",
    "attn_k_only_scores_f32",
    "attn_k_only_scores_f16",
    "attn_k_only_scores_bf16",
    "attn_k_only_scores_q8_0",
    "attn_k_only_scores_q4_0",
    "attn_k_only_scores_q4_1",
    "attn_k_only_scores_q5_0",
    "attn_k_only_scores_q5_1",
    "attn_k_only_weights_f32",
    "attn_k_only_weights_f16",
    "attn_k_only_weights_bf16",
    "attn_k_only_values_f32",
    "attn_k_only_values_f16",
    "attn_k_only_values_bf16",
    "attn_k_only_values_q8_0",
    "attn_k_only_values_q4_0",
    "attn_k_only_values_q4_1",
    "attn_k_only_values_q5_0",
    "attn_k_only_values_q5_1",
    "route_f32",
    "quantize_q8_1",
    "quantize_q8_k",
    "get_rows_q4_0",
    "get_rows_q4_1",
    "get_rows_q5_0",
    "get_rows_q5_1",
    "get_rows_q2_k",
    "get_rows_q3_k",
    "get_rows_q4_k",
    "get_rows_q5_k",
    "get_rows_q6_k",
    "matmul_q4_0",
    "matmul_q4_1",
    "matmul_q5_0",
    "matmul_q5_1",
    "matmul_q2_k",
    "matmul_q3_k",
    "matmul_q4_k",
    "matmul_q5_k",
    "matmul_q6_k",
    "moe_lowbit_q4_0",
    "moe_lowbit_q4_1",
    "moe_lowbit_q5_0",
    "moe_lowbit_q5_1",
    "moe_lowbit_q2_k",
    "moe_lowbit_q3_k",
    "moe_lowbit_q4_k",
    "moe_lowbit_q5_k",
    "moe_lowbit_q6_k",
    "moe_lowbit_q8_0",
    "matmul_heads_q4_0",
    "matmul_heads_q4_1",
    "matmul_heads_q5_0",
    "matmul_heads_q5_1",
    "matmul_heads_q2_k",
    "matmul_heads_q3_k",
    "matmul_heads_q4_k",
    "matmul_heads_q5_k",
    "matmul_heads_q6_k",
    "matmul_mma_q8_0",
    "matmul_mma_mxfp4",
    "moe_mm_mma_q8_0",
    "moe_mm_mma_mxfp4",
    "moe_tiles",
    "matmul_mma_q2_k",
    "matmul_mma_q3_k",
    "matmul_mma_q4_k",
    "matmul_mma_q5_k",
    "matmul_mma_q6_k",
    "moe_mm_mma_q2_k",
    "moe_mm_mma_q3_k",
    "moe_mm_mma_q4_k",
    "moe_mm_mma_q5_k",
    "moe_mm_mma_q6_k",
    "top_k_chunks",
    "top_k_merge",
];

/// Warps per block of the one-warp-per-row kernels (`ROW_WARPS` in the source).
pub(crate) const ROW_WARPS: u32 = 4;
/// Tokens per block of the matmul kernel (`MM_TOKENS` in the source).
pub(crate) const MM_TOKENS: u32 = 8;
/// Weight rows per warp of the Q8_0 GEMV kernel (`DP4A_Q8_0_ROWS` in the source).
pub(crate) const DP4A_Q8_0_ROWS: u32 = 4;
/// Weight rows per warp of the MXFP4 GEMV kernel (`DP4A_MXFP4_ROWS` in the source).
pub(crate) const DP4A_MXFP4_ROWS: u32 = 8;
/// Tokens per block of the Q8_0/MXFP4 GEMV kernels (`DP4A_TOKENS` in the source).
pub(crate) const DP4A_TOKENS: u32 = 8;
/// Rows of ff per block of the Q8_0/MXFP4 experts' gate/up kernel, one Q8_0 block of its
/// output (`MOE_H_ROWS` in the source).
pub(crate) const MOE_H_ROWS: u32 = 32;
/// Weight rows per block of the tiled Q8_0/MXFP4 products (`TILE_ROWS` in the source).
pub(crate) const TILE_ROWS: u32 = 64;
/// Tokens (or expert slots) per tile of the tiled products (`TILE_SLOTS` in the source).
pub(crate) const TILE_SLOTS: u32 = 32;
/// Warps per block of the int8 tensor-core products (`MMA_WARPS` in the source).
pub(crate) const MMA_WARPS: u32 = 8;
/// Weight rows per block of the tensor-core MXFP4 products (`MMA_ROWS_MXFP4` in the source).
pub(crate) const MMA_ROWS_MXFP4: u32 = 128;
/// Weight rows per block of the tensor-core Q8_0 products (`MMA_ROWS_Q8_0` in the source).
pub(crate) const MMA_ROWS_Q8_0: u32 = 64;
/// Weight rows per block of the tensor-core K-quant products (`MMA_ROWS_KQ` in the source).
pub(crate) const MMA_ROWS_KQ: u32 = 32;
/// Tokens (or expert slots) per warp of the low-bit products (`LB_TOKENS` in the source).
pub(crate) const LB_TOKENS: u32 = 8;
/// The most experts `moe_group` handles (`MOE_MAX_EXPERTS` in the source).
pub(crate) const MOE_MAX_EXPERTS: usize = 1024;
/// Warps per block of the attention kernel (`ATT_WARPS` in the source).
pub(crate) const ATT_WARPS: u32 = 8;
/// Largest head dimension the attention kernel handles (`ATT_MAX_PER_LANE` × 32).
pub(crate) const ATT_MAX_HEAD_DIM: usize = 256;

/// Threads per block of the chunked flash attention kernel (`CH_THREADS` in the source).
pub(crate) const CH_THREADS: u32 = 256;
/// Most (head, token) rows one block of the chunked kernel serves (`CH_MAX_ROWS`).
pub(crate) const CH_MAX_ROWS: usize = 64;
/// Most values of those rows' heads together (`CH_MAX_ROWDIMS`).
pub(crate) const CH_MAX_ROWDIMS: usize = 1024;

/// Threads per block of the K-only attention kernel (`KO_THREADS` in the source).
pub(crate) const KO_THREADS: u32 = 256;
/// Longest key the K-only attention kernel handles (`KO_MAX_K` in the source).
pub(crate) const KO_MAX_K: usize = 1024;
/// Longest value the K-only attention kernel handles (`KO_THREADS × KO_DIMS_PER_THREAD`).
pub(crate) const KO_MAX_V: usize = 512;
/// Query heads per block of the split K-only kernels' scores and values (`KS_HEADS`).
pub(crate) const KS_HEADS: usize = 8;
/// Positions per block of the split K-only scores kernel (`KS_POS`: `KO_THREADS / KS_HEADS`).
pub(crate) const KS_POS: usize = 32;
/// Most blocks per (head group, token) of the split K-only scores kernel (`KS_MAX_TILES`).
pub(crate) const KS_MAX_TILES: usize = 256;
/// Value dimensions per block of the split K-only values kernel (`KV_DIMS`:
/// `KO_THREADS / KS_HEADS`).
pub(crate) const KV_DIMS: usize = 32;
/// Most experts the routing kernel handles (`ROUTE_MAX_EXPERTS` in the source).
pub(crate) const ROUTE_MAX_EXPERTS: usize = 512;
/// Most expert groups the routing kernel handles (`ROUTE_MAX_GROUPS` in the source).
pub(crate) const ROUTE_MAX_GROUPS: usize = 64;

/// Threads per block of the top-k kernels (`TK_THREADS` in the source).
pub(crate) const TK_THREADS: u32 = 256;
/// Logits per block of `top_k_chunks` (`TK_CHUNK`; [`hmoe_backend::TOP_K_CHUNK`]).
pub(crate) const TK_CHUNK: usize = hmoe_backend::TOP_K_CHUNK;

/// NVRTC's virtual architecture for a compute capability: `compute_90` for 9.0.
pub fn arch_for(compute_capability: (u32, u32)) -> String {
    format!("compute_{}{}", compute_capability.0, compute_capability.1)
}

/// The NVRTC options for `arch`: the target, and no implicit multiply-add contraction (the
/// source writes its FMAs, so rounding follows the CPU device where it matters).
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--fmad=false".into()]
}

/// NVRTC's version `(major, minor)`. Needs libnvrtc ([`crate::nvrtc_present`]).
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    if !crate::nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc is loadable (checked above); nvrtcVersion writes two ints.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    match status {
        cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS => Ok((major, minor)),
        other => Err(CudaError::Compile {
            message: format!("nvrtcVersion: {other:?}"),
            log: String::new(),
        }),
    }
}

/// Where the PTX came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PtxOrigin {
    /// Read from this cache file.
    Cache(std::path::PathBuf),
    /// Compiled now (and stored in the cache when it has a directory).
    Compiled,
}

/// PTX of [`SOURCE`] for a device of `compute_capability`: from the disk cache when it holds
/// it, else compiled by NVRTC and stored.
pub fn ptx_for(compute_capability: (u32, u32)) -> Result<(String, PtxOrigin), CudaError> {
    let arch = arch_for(compute_capability);
    let options = compile_options(&arch);
    let version = nvrtc_version()?;
    let key = cache::cache_key(SOURCE, &arch, version, &options);
    let dir = cache::cache_dir();
    if let Some(dir) = &dir {
        if let Some(ptx) = cache::load(dir, &key) {
            return Ok((ptx, PtxOrigin::Cache(dir.join(format!("{key}.ptx")))));
        }
    }
    let ptx = compile(&options)?;
    if let Some(dir) = &dir {
        if let Err(e) = cache::store(dir, &key, &ptx) {
            tracing_free_warn(&format!("could not cache PTX in {}: {e}", dir.display()));
        }
    }
    Ok((ptx, PtxOrigin::Compiled))
}

/// A cache write failure is not an error; it is said once on stderr.
fn tracing_free_warn(msg: &str) {
    eprintln!("hmoe-cuda: warning: {msg}");
}

/// Compiles [`SOURCE`] with `options` and returns the PTX text.
fn compile(options: &[String]) -> Result<String, CudaError> {
    let opts = CompileOptions {
        options: options.to_vec(),
        name: Some("hmoe_kernels.cu".into()),
        ..Default::default()
    };
    let ptx: Ptx = compile_ptx_with_opts(SOURCE, opts).map_err(|e| match e {
        CompileError::CompileError {
            nvrtc,
            options,
            log,
        } => CudaError::Compile {
            message: format!("{nvrtc:?} with {options:?}"),
            log: log.to_string_lossy().into_owned(),
        },
        other => CudaError::Compile {
            message: format!("{other:?}"),
            log: String::new(),
        },
    })?;
    Ok(ptx.to_src())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel is defined directly or by a macro instantiation (`MOE_WRAPPERS(SUFFIX, ...)`
    /// for `moe_gate_up_*`/`moe_down_*`, `MOE_DP4A`, `MATMUL_TILED`, `MOE_MM`, `GET_ROWS`,
    /// `ROUTER_LOGITS` and `LOWBIT` likewise).
    fn defined(name: &str) -> bool {
        if SOURCE.contains(&format!("extern \"C\" __global__ void {name}(")) {
            return true;
        }
        [
            ("moe_gate_up_", "MOE_WRAPPERS"),
            ("moe_down_", "MOE_WRAPPERS"),
            ("moe_dp4a_gate_up_", "MOE_DP4A"),
            ("moe_dp4a_down_", "MOE_DP4A"),
            ("matmul_tiled_", "MATMUL_TILED"),
            ("matmul_mma_", "MATMUL_MMA"),
            ("moe_mm_mma_", "MOE_MM_MMA"),
            ("matmul_mma_", "KQ_MMA"),
            ("moe_mm_mma_", "KQ_MMA"),
            ("moe_mm_", "MOE_MM"),
            ("matmul_heads_", "MATMUL_HEADS"),
            ("matmul_heads_", "HEADS_LOWBIT"),
            ("attn_k_only_", "K_ONLY"),
            ("attn_k_only_scores_", "K_ONLY_SPLIT"),
            ("attn_k_only_values_", "K_ONLY_SPLIT"),
            ("attn_k_only_weights_", "K_ONLY_WEIGHTS"),
            ("get_rows_", "GET_ROWS"),
            ("router_logits_topk_", "ROUTER_LOGITS"),
            ("matmul_", "MATMUL"),
            ("matmul_", "LOWBIT"),
            ("moe_lowbit_", "LOWBIT"),
        ]
        .iter()
        .any(|(prefix, instantiation)| {
            name.strip_prefix(prefix)
                .is_some_and(|suffix| SOURCE.contains(&format!("\n{instantiation}({suffix}, ")))
        })
    }

    #[test]
    fn every_launched_kernel_is_in_the_source() {
        for name in KERNELS {
            assert!(defined(name), "{name} is not defined in kernels/*.cu");
        }
        // And every directly defined entry point is launched from Rust.
        for line in SOURCE.lines() {
            if let Some(rest) = line.strip_prefix("extern \"C\" __global__ void ") {
                let name = rest.split('(').next().unwrap();
                assert!(KERNELS.contains(&name), "{name} is never launched");
            }
        }
    }

    #[test]
    fn source_is_header_free_and_balanced() {
        assert!(
            !SOURCE.contains("#include"),
            "NVRTC has no include path here"
        );
        let count = |c: char| SOURCE.chars().filter(|&x| x == c).count();
        assert_eq!(count('{'), count('}'));
        assert_eq!(count('('), count(')'));
        assert_eq!(count('['), count(']'));
        assert!(!SOURCE.contains('\0'), "NVRTC takes a C string");
    }

    /// A 16-bit inline-asm output ("=h") made ptxas 13.0 store stale registers for the low
    /// byte of f2h's result on an H200 (wrong Q8_1/Q4_0 scales; see f2h in kernels/common.cu); the
    /// host emulation cannot see that, so the source keeps asm outputs 32 bits wide.
    #[test]
    fn no_16_bit_asm_outputs() {
        assert!(
            !SOURCE.contains("\"=h\""),
            "widen 16-bit asm outputs to 32 bits"
        );
    }

    #[test]
    fn source_constants_match_the_launch_code() {
        for (name, value) in [
            ("ROW_WARPS", ROW_WARPS as usize),
            ("MM_TOKENS", MM_TOKENS as usize),
            ("DP4A_Q8_0_ROWS", DP4A_Q8_0_ROWS as usize),
            ("DP4A_MXFP4_ROWS", DP4A_MXFP4_ROWS as usize),
            ("DP4A_TOKENS", DP4A_TOKENS as usize),
            ("MOE_H_ROWS", MOE_H_ROWS as usize),
            ("TILE_ROWS", TILE_ROWS as usize),
            ("TILE_SLOTS", TILE_SLOTS as usize),
            ("MMA_WARPS", MMA_WARPS as usize),
            ("MMA_ROWS_MXFP4", MMA_ROWS_MXFP4 as usize),
            ("MMA_ROWS_Q8_0", MMA_ROWS_Q8_0 as usize),
            ("MMA_ROWS_KQ", MMA_ROWS_KQ as usize),
            ("MOE_MAX_EXPERTS", MOE_MAX_EXPERTS),
            ("LB_TOKENS", LB_TOKENS as usize),
            ("ATT_WARPS", ATT_WARPS as usize),
            ("ATT_MAX_PER_LANE", ATT_MAX_HEAD_DIM / 32),
            ("KV_MAX_CHUNK", ATT_MAX_HEAD_DIM),
            ("CH_THREADS", CH_THREADS as usize),
            ("CH_MAX_ROWS", CH_MAX_ROWS),
            ("CH_MAX_ROWDIMS", CH_MAX_ROWDIMS),
            ("CH_CHUNK", hmoe_backend::numerics::FLASH_CHUNK),
            ("CH_BLOCK", hmoe_backend::numerics::FLASH_BLOCK),
            ("CH_MAX_HD", ATT_MAX_HEAD_DIM),
            ("KO_THREADS", KO_THREADS as usize),
            ("KO_MAX_K", KO_MAX_K),
            ("KO_DIMS_PER_THREAD", KO_MAX_V / KO_THREADS as usize),
            ("KS_HEADS", KS_HEADS),
            ("KS_POS", KS_POS),
            ("KS_MAX_TILES", KS_MAX_TILES),
            ("KV_DIMS", KV_DIMS),
            ("ROUTE_MAX_EXPERTS", ROUTE_MAX_EXPERTS),
            ("ROUTE_MAX_GROUPS", ROUTE_MAX_GROUPS),
            ("TK_THREADS", TK_THREADS as usize),
            ("TK_CHUNK", TK_CHUNK),
            ("TK_MAX_K", hmoe_backend::TOP_K_MAX),
        ] {
            assert!(
                SOURCE.contains(&format!("#define {name} {value}\n")),
                "{name} should be {value} in kernels/*.cu"
            );
        }
    }

    #[test]
    fn arch_and_options() {
        assert_eq!(arch_for((9, 0)), "compute_90");
        assert_eq!(arch_for((12, 1)), "compute_121");
        let o = compile_options("compute_90");
        assert!(o.contains(&"--gpu-architecture=compute_90".to_string()));
        assert!(o.contains(&"--fmad=false".to_string()));
    }
}
