//! A CUDA device with the kernels loaded: buffers, transfers and the ops of the device contract.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchArgs, LaunchConfig, PinnedHostSlice, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use hmoe_backend::{AttnParams, KvLayout, RopeParams};
use hmoe_quant::GgmlType;

use crate::error::{ensure, guarded, CudaError};
use crate::kernels::{
    self, PtxOrigin, ATT_MAX_HEAD_DIM, ATT_WARPS, MM_TOKENS, MOE_MAX_EXPERTS, ROW_WARPS, TILE_ROWS,
    TILE_SLOTS,
};
use crate::probe::{info_of, GpuInfo};
use crate::staging::Staging;

mod ext;
mod lowbit;

/// Batches of at least this many tokens multiply F16/BF16 weights with cuBLAS (when libcublas
/// is present); smaller ones (decode) use the GEMV kernel. F32 weights (gpt-oss's router, the
/// small test models) always use the GEMV kernel, which sums in the CPU engine's order: a
/// router's logits summed in another order can flip an expert choice.
pub const CUBLAS_MIN_TOKENS: usize = 16;

/// Largest grid y dimension CUDA allows (tokens or expert slots per launch).
const MAX_GRID_Y: usize = 65_535;

/// Expert slots (tokens × experts per token) from which Q8_0/MXFP4 experts use the tiled
/// kernels (a weight row read once per tile of an expert's slots) instead of a warp per slot
/// and row.
const MOE_TILED_MIN_SLOTS: usize = 64;
/// Tokens from which Q8_0/MXFP4 matmuls use the tiled kernel instead of the GEMV kernel.
const MM_TILED_MIN_TOKENS: usize = 32;

/// The weight types the kernels dequantise and multiply (`matmul`, `matmul_heads`,
/// `get_rows`, expert sets): F32, F16, BF16, Q8_0 and MXFP4, and the low-bit types
/// of GGUF files ([`LOWBIT_TYPES`]).
pub const SUPPORTED_TYPES: [GgmlType; 14] = hmoe_quant::WEIGHT_TYPES;

pub use lowbit::LOWBIT_TYPES;

/// A 2-D weight matrix on the device in its GGUF encoding: `rows` rows of `cols` elements,
/// each row `ty.row_bytes(cols)` contiguous bytes.
pub struct DeviceMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: CudaSlice<u8>,
}

impl DeviceMatrix {
    /// The element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Rows (outputs of a matmul).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns (inputs of a matmul).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// The expert tensors of one MoE weight: `n_expert` matrices of `rows × cols` (GGUF
/// `[E, rows, cols]`, e.g. `ffn_gate_exps` with rows = n_ff, cols = n_embd), back to back.
pub struct DeviceExperts {
    ty: GgmlType,
    n_expert: usize,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: CudaSlice<u8>,
}

impl DeviceExperts {
    /// The element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Number of experts.
    pub fn n_expert(&self) -> usize {
        self.n_expert
    }
    /// Rows of each expert's matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns of each expert's matrix.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.n_expert * self.rows * self.row_bytes
    }
    /// The experts' GGUF bytes on the device, expert after expert.
    pub fn data(&self) -> &CudaSlice<u8> {
        &self.data
    }
}

/// The gated activation the MoE kernels compute (`ACT_*` in the source).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertAct {
    /// gpt-oss's clamped SwiGLU (alpha 1.702, limit 7).
    ClampedSwiglu = 0,
    /// SwiGLU `silu(g)·u`, every F32 product in `vec_dot` order (Qwen3-MoE, DeepSeek).
    Silu = 1,
}

/// One layer's MoE experts (gpt-oss): gate and up `[E, ff, d]`, down `[E, d, ff]`, and the
/// optional biases `[E, ff]`, `[E, ff]`, `[E, d]` (gate and up biases come together).
pub struct MoeWeights {
    /// `ffn_gate_exps`.
    pub gate: DeviceExperts,
    /// `ffn_up_exps`.
    pub up: DeviceExperts,
    /// `ffn_down_exps`.
    pub down: DeviceExperts,
    /// `ffn_gate_exps.bias`, `n_expert × ff`.
    pub gate_bias: Option<CudaSlice<f32>>,
    /// `ffn_up_exps.bias`, `n_expert × ff`.
    pub up_bias: Option<CudaSlice<f32>>,
    /// `ffn_down_exps.bias`, `n_expert × d`.
    pub down_bias: Option<CudaSlice<f32>>,
}

/// A CUDA device with a stream, the compiled kernels and (when libcublas loads) a cuBLAS
/// handle. Every op is queued on the one stream; [`CudaDevice::synchronize`] waits for them,
/// and the downloads wait by themselves. Op offload's uploads go on a second stream, so that
/// they overlap the work queued before them; cudarc's events order every buffer's use
/// across the two streams.
pub struct CudaDevice {
    info: GpuInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    copy_stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: Option<CudaBlas>,
    ptx_origin: PtxOrigin,
    /// One f32 handed to kernels in place of an absent optional buffer.
    dummy: CudaSlice<f32>,
    /// Pinned buffers for uploads from the file mapping, allocated at the first such upload.
    staging: Mutex<Option<Staging>>,
}

/// The K/V ring types of K/V pairs the attention kernels read (`attn_row`, `attn_flash`);
/// `kv_store` also stores the other types of [`K_ONLY_TYPES`].
pub const KV_TYPES: [GgmlType; 4] = [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0];

/// Whether [`CudaDevice::moe`] takes experts with gate, up and down of these types: one type
/// of [`SUPPORTED_TYPES`], or each of [`LOWBIT_TYPES`] or Q8_0.
pub fn expert_types_supported(gate: GgmlType, up: GgmlType, down: GgmlType) -> bool {
    let types = [gate, up, down];
    let lowbit_set = |ty: GgmlType| lowbit::is_lowbit(ty) || ty == GgmlType::Q8_0;
    let one = types.iter().all(|&ty| ty == gate) && SUPPORTED_TYPES.contains(&gate);
    one || types.iter().any(|&ty| lowbit::is_lowbit(ty)) && types.into_iter().all(lowbit_set)
}

/// Whether the attention kernels read keys of `k` with values of `v`: both of [`KV_TYPES`]
/// (f32/f16 values by the row kernel, Q8_0/Q4_0 values by flash attention, as the CPU engine
/// chooses its path by the value type; keys of every type in both).
pub fn kv_pair_supported(k: GgmlType, v: GgmlType) -> bool {
    KV_TYPES.contains(&v) && KV_TYPES.contains(&k)
}

/// The types of K-only (latent) rings the kernels attend over
/// ([`hmoe_backend::Backend::k_only_types`]): every K/V type of the contract
/// ([`hmoe_backend::KV_TYPES`]). `kv_store` stores rings of all of them (the device's
/// `kv_types`); [`KV_TYPES`] are those of K/V pairs.
pub const K_ONLY_TYPES: [GgmlType; 8] = hmoe_backend::KV_TYPES;

/// What the CUDA device keeps and computes, known without opening one: the weight types of
/// [`SUPPORTED_TYPES`], rings of every type of [`K_ONLY_TYPES`], K/V pairs of [`KV_TYPES`]
/// ([`kv_pair_supported`]).
pub const CAPABILITIES: hmoe_backend::Capabilities = hmoe_backend::Capabilities {
    weight_types: &SUPPORTED_TYPES,
    kv_types: &K_ONLY_TYPES,
    kv_pair_types: &KV_TYPES,
    k_only_types: &K_ONLY_TYPES,
};

/// Whether a ring of `l` is one the kernels store and read: a type of [`K_ONLY_TYPES`] (which
/// holds [`KV_TYPES`]; the attention kernels also check the pair, [`kv_pair_supported`]),
/// rotated only when block-quantized, in chunks of at most [`ATT_MAX_HEAD_DIM`].
fn kv_type_ok(l: &KvLayout) -> bool {
    let block = !matches!(l.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    K_ONLY_TYPES.contains(&l.ty) && (l.rot == 0 || block && l.rot <= ATT_MAX_HEAD_DIM)
}

/// The store kernel of a block-quantized K/V type.
fn kv_store_kernel(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::Q4_0 => "kv_store_q4_0",
        GgmlType::Q4_1 => "kv_store_q4_1",
        GgmlType::Q5_0 => "kv_store_q5_0",
        GgmlType::Q5_1 => "kv_store_q5_1",
        _ => "kv_store_q8_0",
    }
}

/// ggml's id of a type, as the kernels name them (`TY_*`).
fn ggml_id(ty: GgmlType) -> i32 {
    ty.id() as i32
}

/// Threads of one warp (the flash attention kernel's block).
const WARP_THREADS: u32 = 32;

fn i32_of(op: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        what: format!("{what} = {v} exceeds i32"),
    })
}

fn u32_of(op: &'static str, what: &str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        what: format!("{what} = {v} exceeds u32"),
    })
}

fn check_type(ty: GgmlType, op: &'static str) -> Result<(), CudaError> {
    if SUPPORTED_TYPES.contains(&ty) {
        Ok(())
    } else {
        Err(CudaError::UnsupportedType { ty, op })
    }
}

/// Bytes of a row of `cols` elements of `ty`, or a shape error for a partial block.
fn row_bytes(ty: GgmlType, cols: usize, op: &'static str) -> Result<usize, CudaError> {
    let block = ty.block_elems();
    ensure(cols.is_multiple_of(block) && cols > 0, op, || {
        format!("{cols} columns is not a positive whole number of {ty} blocks of {block}")
    })?;
    Ok(cols / block * ty.block_bytes())
}

/// A launch over `rows` in blocks of `rows_per_block` (grid x) and `n` tokens (or expert
/// slots) in blocks of `tokens_per_block` (grid y), `threads` per block.
fn rows_by_tokens(
    op: &'static str,
    (rows, rows_per_block): (usize, u32),
    (n, tokens_per_block): (usize, u32),
    threads: u32,
) -> Result<LaunchConfig, CudaError> {
    let gy = n.div_ceil(tokens_per_block as usize);
    ensure(gy <= MAX_GRID_Y, op, || format!("{n} tokens in one call"))?;
    Ok(LaunchConfig {
        grid_dim: (
            u32_of(op, "row blocks", rows.div_ceil(rows_per_block as usize))?,
            gy as u32,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn grid_1d(n: usize, op: &'static str) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (u32_of(op, "elements / 256", n.div_ceil(256))?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl CudaDevice {
    /// Opens device `ordinal`: creates its context and stream, loads the kernels (PTX from
    /// the disk cache or compiled by NVRTC for its compute capability) and cuBLAS if present.
    /// Without a driver: `Err(NoDriver)`; without NVRTC: `Err(NoNvrtc)`; never panics.
    pub fn new(ordinal: usize) -> Result<CudaDevice, CudaError> {
        let count = crate::device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        if !crate::nvrtc_present() {
            return Err(CudaError::NoNvrtc);
        }
        guarded(|| {
            let ctx = CudaContext::new(ordinal)?;
            let info = info_of(&ctx)?;
            let (ptx, ptx_origin) = kernels::ptx_for(info.compute_capability)?;
            let module = ctx.load_module(Ptx::from_src(ptx))?;
            let mut funcs = HashMap::new();
            for &name in kernels::KERNELS {
                funcs.insert(name, module.load_function(name)?);
            }
            let stream = ctx.new_stream()?;
            let copy_stream = ctx.new_stream()?;
            let blas = if crate::cublas_present() {
                Some(CudaBlas::new(stream.clone())?)
            } else {
                None
            };
            let dummy = stream.alloc_zeros::<f32>(1)?;
            Ok(CudaDevice {
                info,
                ctx,
                stream,
                copy_stream,
                funcs,
                blas,
                ptx_origin,
                dummy,
                staging: Mutex::new(None),
            })
        })
    }

    /// The device as probed when it was opened.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Whether the kernels' PTX came from the disk cache or was compiled now.
    pub fn ptx_origin(&self) -> &PtxOrigin {
        &self.ptx_origin
    }

    /// Whether batched F16/BF16 matmuls go through cuBLAS.
    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// `(free, total)` device memory in bytes now.
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        let (free, total) = self.ctx.mem_get_info()?;
        Ok((free as u64, total as u64))
    }

    /// The stream every op is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits until every queued op has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    // ---------------------------------------------------------------------------------------
    // Buffers and transfers.

    /// A new device buffer holding a copy of `src`.
    pub fn upload<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_htod(src)?)
    }

    /// [`CudaDevice::upload`] on the copy stream, for op offload: a copy from pageable memory
    /// waits for its stream's earlier work, which on the compute stream would hold the host
    /// until the layers queued before had run.
    pub fn upload_for_offload<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.copy_stream.clone_htod(src)?)
    }

    /// Copies `src` into the start of `dst` (queued on the stream; `src` is read before this
    /// returns for pageable memory).
    pub fn upload_into<T: DeviceRepr>(
        &self,
        src: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        ensure(dst.len() >= src.len(), "upload_into", || {
            format!("{} elements into a buffer of {}", src.len(), dst.len())
        })?;
        Ok(self.stream.memcpy_htod(src, dst)?)
    }

    /// A new device buffer holding a copy of `src[range]` (queued on the stream).
    pub fn copy_range<T: DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        range: std::ops::Range<usize>,
    ) -> Result<CudaSlice<T>, CudaError> {
        ensure(
            range.start < range.end && range.end <= src.len(),
            "copy_range",
            || format!("range {range:?} of a buffer of {}", src.len()),
        )?;
        Ok(self.stream.clone_dtod(&src.slice(range))?)
    }

    /// A new zeroed device buffer of `len` elements.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros(len)?)
    }

    /// The contents of `src` (waits for the queued ops that write it).
    pub fn download<T: DeviceRepr + Clone + Default>(
        &self,
        src: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        let mut out = vec![T::default(); src.len()];
        self.stream.memcpy_dtoh(src, &mut out)?;
        self.stream.synchronize()?;
        Ok(out)
    }

    /// A zeroed page-locked host buffer of `len` elements, for asynchronous copies.
    pub fn alloc_pinned<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<PinnedHostSlice<T>, CudaError> {
        // SAFETY: the memory is filled with zero bits (valid for T) before anyone reads it.
        let mut buf = unsafe {
            self.ctx
                .alloc_pinned_with_flags::<T>(len, cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE)
        }?;
        let bytes = buf.num_bytes();
        let ptr = buf.as_mut_ptr()?;
        // SAFETY: `ptr` points to `bytes` bytes of host memory owned by `buf`.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        Ok(buf)
    }

    /// An event without timing, recorded by the caller to know when queued work has run.
    pub(crate) fn new_event(&self) -> Result<CudaEvent, CudaError> {
        Ok(self.ctx.new_event(Some(
            cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
        ))?)
    }

    /// Queues a copy from pinned host memory to `dst` and returns at once; cudarc's events
    /// keep `src` from being reused before the copy has run.
    pub fn upload_async<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        src: &PinnedHostSlice<T>,
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        ensure(dst.len() >= src.len(), "upload_async", || {
            format!("{} elements into a buffer of {}", src.len(), dst.len())
        })?;
        Ok(self.stream.memcpy_htod(src, dst)?)
    }

    /// Queues a copy from `src` into pinned host memory and returns at once; reading `dst`
    /// (`as_slice`) waits for the copy.
    pub fn download_async<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        src: &CudaSlice<T>,
        dst: &mut PinnedHostSlice<T>,
    ) -> Result<(), CudaError> {
        ensure(dst.len() >= src.len(), "download_async", || {
            format!("{} elements into a buffer of {}", src.len(), dst.len())
        })?;
        Ok(self.stream.memcpy_dtoh(src, dst)?)
    }

    /// Uploads a weight matrix: `data` is `rows` GGUF rows of `cols` elements of `ty`.
    pub fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<DeviceMatrix, CudaError> {
        check_type(ty, "upload_matrix")?;
        let rb = row_bytes(ty, cols, "upload_matrix")?;
        ensure(rows > 0 && data.len() == rows * rb, "upload_matrix", || {
            format!(
                "{rows} rows of {cols} {ty} need {} bytes, got {}",
                rows * rb,
                data.len()
            )
        })?;
        Ok(DeviceMatrix {
            ty,
            rows,
            cols,
            row_bytes: rb,
            data: self.upload(data)?,
        })
    }

    /// Uploads an expert tensor `[n_expert, rows, cols]` of `ty`.
    pub fn upload_experts(
        &self,
        ty: GgmlType,
        n_expert: usize,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<DeviceExperts, CudaError> {
        check_type(ty, "upload_experts")?;
        let rb = row_bytes(ty, cols, "upload_experts")?;
        let want = n_expert * rows * rb;
        ensure(
            n_expert > 0 && rows > 0 && data.len() == want,
            "upload_experts",
            || {
                format!(
                    "{n_expert}×{rows} rows of {cols} {ty} need {want} bytes, got {}",
                    data.len()
                )
            },
        )?;
        Ok(DeviceExperts {
            ty,
            n_expert,
            rows,
            cols,
            row_bytes: rb,
            data: self.upload(data)?,
        })
    }

    /// Uploads an expert tensor from per-expert parts: expert `i` of the result is `parts[i]`,
    /// `rows` rows of `cols` elements of `ty`, gathered from where it lies (the file mapping)
    /// by the CPU pool into pinned buffers that the copies drain as they fill
    /// ([`Staging`]). For op offload of the experts a batch routes to.
    pub fn upload_experts_from(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        parts: &[&[u8]],
    ) -> Result<DeviceExperts, CudaError> {
        const OP: &str = "upload_experts_from";
        check_type(ty, OP)?;
        let rb = row_bytes(ty, cols, OP)?;
        let eb = rows * rb;
        ensure(
            !parts.is_empty() && rows > 0 && parts.iter().all(|p| p.len() == eb),
            OP,
            || {
                format!(
                    "{} parts of {rows} rows of {cols} {ty} ({eb} bytes each)",
                    parts.len()
                )
            },
        )?;
        // SAFETY: every byte is written by the staged copies below before any kernel reads it
        // (kernels on the compute stream wait for the buffer's write event).
        let mut data = unsafe { self.copy_stream.alloc::<u8>(parts.len() * eb) }?;
        let mut staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        let ring = match staging.take() {
            Some(ring) => ring,
            None => Staging::new(self)?,
        };
        staging
            .insert(ring)
            .upload(&self.copy_stream, parts, eb, &mut data)?;
        Ok(DeviceExperts {
            ty,
            n_expert: parts.len(),
            rows,
            cols,
            row_bytes: rb,
            data,
        })
    }

    fn func(&self, name: &'static str) -> &CudaFunction {
        // Every name in KERNELS was loaded by `new`, and callers only pass names from it.
        &self.funcs[name]
    }

    fn builder(&self, name: &'static str) -> LaunchArgs<'_> {
        self.stream.launch_builder(self.func(name))
    }

    // ---------------------------------------------------------------------------------------
    // Ops.

    /// Embedding lookup: `out[t] = table[ids[t]]` dequantised to f32 (`out`: `ids.len() ×
    /// cols`). Ids outside the table give zero rows.
    pub fn get_rows(
        &self,
        table: &DeviceMatrix,
        ids: &CudaSlice<i32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "get_rows";
        let n = ids.len();
        ensure(out.len() >= n * table.cols, OP, || {
            format!("out holds {} values, need {n}×{}", out.len(), table.cols)
        })?;
        if n == 0 {
            return Ok(());
        }
        let name = match table.ty {
            GgmlType::F32 => "get_rows_f32",
            GgmlType::F16 => "get_rows_f16",
            GgmlType::BF16 => "get_rows_bf16",
            GgmlType::Q8_0 => "get_rows_q8_0",
            GgmlType::MXFP4 => "get_rows_mxfp4",
            ty => lowbit::get_rows_kernel(ty).ok_or(CudaError::UnsupportedType { ty, op: OP })?,
        };
        let row_bytes = table.row_bytes as u64;
        let n_rows = i32_of(OP, "rows", table.rows)?;
        let n_tokens = i32_of(OP, "tokens", n)?;
        let cols = i32_of(OP, "cols", table.cols)?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "tokens", n)?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder(name);
        b.arg(&table.data)
            .arg(&row_bytes)
            .arg(&n_rows)
            .arg(ids)
            .arg(out)
            .arg(&n_tokens)
            .arg(&cols);
        // SAFETY: argument types match `get_rows_*` in kernels.cu; `out` holds n × cols
        // values (checked), `table.data` rows × row_bytes bytes, ids are bounds-checked in
        // the kernel.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// RMSNorm of every row of `x` (rows of `weight.len()`): `out = x / sqrt(mean(x²) + eps) ·
    /// weight`. Squares in f32, summed in f64 as the CPU engine does.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "rms_norm";
        let n = weight.len();
        ensure(
            n > 0 && x.len().is_multiple_of(n) && out.len() >= x.len(),
            OP,
            || format!("x {} / weight {n} / out {}", x.len(), out.len()),
        )?;
        let rows = x.len() / n;
        if rows == 0 {
            return Ok(());
        }
        let (n_rows, n_i) = (i32_of(OP, "rows", rows)?, i32_of(OP, "n", n)?);
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "rows", rows)?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("rms_norm_f32");
        b.arg(x)
            .arg(weight)
            .arg(out)
            .arg(&n_rows)
            .arg(&n_i)
            .arg(&eps);
        // SAFETY: argument types match `rms_norm_f32`; x and out hold rows × n values, weight n.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `y[t] = W · x[t]` for `n` tokens: `x` is `n × w.cols()`, `y` is `n × w.rows()`.
    /// Activations are converted as ggml converts them (Q8_0 blocks for Q8_0 and MXFP4
    /// weights, [`CudaDevice::quantize_q8_0`]; f16/bf16 for F16/BF16; f32 for F32; the
    /// low-bit types' as [`CudaDevice::quantize_acts`] says, products in the CPU engine's
    /// kernel's order for the matrix and batch, see `lowbit.rs`), and the
    /// GEMV kernel sums Q8_0, MXFP4 and F32 products in the CPU engine's order (F32: one
    /// token in `vec_dot` order, several in 16 lanes), so those results are the CPU engine's
    /// bits. Batches of [`CUBLAS_MIN_TOKENS`] or more with F16/BF16 weights use cuBLAS instead
    /// (activations rounded to the weight's 16-bit type, f32 accumulation in cuBLAS's order).
    pub fn matmul(
        &self,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul";
        ensure(x.len() >= n * w.cols && y.len() >= n * w.rows, OP, || {
            format!(
                "x {} / y {} for {n} tokens of a {}×{} matrix",
                x.len(),
                y.len(),
                w.rows,
                w.cols
            )
        })?;
        if n == 0 {
            return Ok(());
        }
        if lowbit::is_lowbit(w.ty) {
            return self.matmul_lowbit(w, x, n, y);
        }
        let half = matches!(w.ty, GgmlType::F16 | GgmlType::BF16);
        if half && n >= CUBLAS_MIN_TOKENS {
            if let Some(blas) = &self.blas {
                return self.matmul_cublas(blas, w, x, n, y);
            }
        }
        let quantized = matches!(w.ty, GgmlType::Q8_0 | GgmlType::MXFP4);
        if quantized && n >= MM_TILED_MIN_TOKENS {
            return self.matmul_tiled(w, x, n, y);
        }
        let name = match w.ty {
            GgmlType::F32 => "matmul_f32",
            GgmlType::F16 => "matmul_f16",
            GgmlType::BF16 => "matmul_bf16",
            GgmlType::Q8_0 => "matmul_q8_0",
            _ => "matmul_mxfp4",
        };
        let row_bytes = w.row_bytes as u64;
        let (rows, cols, n_i) = (
            i32_of(OP, "rows", w.rows)?,
            i32_of(OP, "cols", w.cols)?,
            i32_of(OP, "tokens", n)?,
        );
        let cfg = rows_by_tokens(OP, (w.rows, ROW_WARPS), (n, MM_TOKENS), ROW_WARPS * 32)?;
        let quantized = if quantized {
            Some(self.quantize_q8_0(x, n * w.cols)?)
        } else {
            None
        };
        let mut b = self.builder(name);
        b.arg(&w.data).arg(&row_bytes);
        match &quantized {
            Some(xq) => b.arg(xq),
            None => b.arg(x),
        };
        b.arg(y).arg(&rows).arg(&cols).arg(&n_i);
        // SAFETY: argument types match `matmul_*` (x as Q8_0 blocks for Q8_0/MXFP4 weights,
        // f32 otherwise); sizes checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The first `len` values of `x` (a multiple of 32) as Q8_0 blocks, exactly as
    /// `hmoe_quant::quantize_row(Q8_0, …)` (ggml's x86 quantiser) makes them from finite
    /// values: the activations of Q8_0 and MXFP4 products.
    pub fn quantize_q8_0(
        &self,
        x: &CudaSlice<f32>,
        len: usize,
    ) -> Result<CudaSlice<u8>, CudaError> {
        const OP: &str = "quantize_q8_0";
        ensure(len.is_multiple_of(32) && len <= x.len(), OP, || {
            format!("{len} values of a buffer of {} in blocks of 32", x.len())
        })?;
        let blocks = len / 32;
        // SAFETY: every byte is written by the kernel below before it is read.
        let mut out = unsafe { self.stream.alloc::<u8>(blocks * 34) }?;
        if blocks == 0 {
            return Ok(out);
        }
        let n_blocks = blocks as u64;
        let mut b = self.builder("quantize_q8_0");
        b.arg(x).arg(&mut out).arg(&n_blocks);
        // SAFETY: argument types match `quantize_q8_0`; x holds at least 32 × blocks values
        // and out 34 × blocks bytes.
        unsafe { b.launch(grid_1d(blocks, OP)?) }?;
        Ok(out)
    }

    /// [`CudaDevice::matmul`] for a batch of Q8_0 or MXFP4 weights (checked there): the tiled
    /// kernel, TILE_ROWS rows × TILE_SLOTS tokens per block, with the GEMV kernel's bits.
    fn matmul_tiled(
        &self,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul";
        let name = match w.ty {
            GgmlType::MXFP4 => "matmul_tiled_mxfp4",
            _ => "matmul_tiled_q8_0",
        };
        let (rows, nb, n_i) = (
            i32_of(OP, "rows", w.rows)?,
            i32_of(OP, "blocks per row", w.cols / 32)?,
            i32_of(OP, "tokens", n)?,
        );
        let cfg = rows_by_tokens(OP, (w.rows, TILE_ROWS), (n, TILE_SLOTS), 256)?;
        let xq = self.quantize_q8_0(x, n * w.cols)?;
        let row_bytes = w.row_bytes as u64;
        let mut b = self.builder(name);
        b.arg(&w.data)
            .arg(&row_bytes)
            .arg(&rows)
            .arg(&nb)
            .arg(&xq)
            .arg(&n_i)
            .arg(y);
        // SAFETY: argument types match `matmul_tiled_*`; x holds n rows of w.cols (so xq n
        // rows of nb Q8_0 blocks) and y n rows of w.rows (checked by the caller).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn matmul_cublas(
        &self,
        blas: &CudaBlas,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul (cuBLAS)";
        use blas_sys::cudaDataType_t as Dt;
        // Row-major W [rows × cols] is column-major [cols × rows]: C = Wᵀ·X in cuBLAS terms,
        // with X column-major [cols × n] and Y column-major [rows × n].
        let (m, k, nn) = (
            i32_of(OP, "rows", w.rows)?,
            i32_of(OP, "cols", w.cols)?,
            i32_of(OP, "tokens", n)?,
        );
        // The activations in the weight's 16-bit type (F16 or BF16: `matmul` sends only those).
        let (name, dt) = if w.ty == GgmlType::F16 {
            ("f32_to_f16", Dt::CUDA_R_16F)
        } else {
            ("f32_to_bf16", Dt::CUDA_R_16BF)
        };
        let len = n * w.cols;
        // SAFETY: every element is written by the conversion kernel before use.
        let mut converted = unsafe { self.stream.alloc::<u16>(len) }?;
        let len64 = len as u64;
        let mut b = self.builder(name);
        b.arg(x).arg(&mut converted).arg(&len64);
        // SAFETY: argument types match `f32_to_f16`/`f32_to_bf16`; both hold `len`.
        unsafe { b.launch(grid_1d(len, OP)?) }?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _wg) = w.data.device_ptr(&self.stream);
        let (xp, _xg) = converted.device_ptr(&self.stream);
        let (yp, _yg) = y.device_ptr_mut(&self.stream);
        // SAFETY: the pointers are live device buffers of the sizes checked by `matmul`
        // (W rows × cols of `dt`, X n × cols of `dt`, Y n × rows f32); the guards keep the
        // stream ordering for the duration of the call; the handle is bound to our stream.
        unsafe {
            blas_result::gemm_ex(
                *blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                nn,
                k,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                dt,
                k,
                xp as *const _,
                dt,
                k,
                (&beta) as *const f32 as *const _,
                yp as *mut _,
                Dt::CUDA_R_32F,
                m,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    /// `x += y` element-wise (the residual add).
    pub fn add_assign(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<(), CudaError> {
        const OP: &str = "add_assign";
        ensure(y.len() >= x.len(), OP, || {
            format!("x {} / y {}", x.len(), y.len())
        })?;
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.builder("add_inplace_f32");
        b.arg(&mut *x).arg(y).arg(&n64);
        // SAFETY: argument types match `add_inplace_f32`; both hold at least n values.
        unsafe { b.launch(grid_1d(n, OP)?) }?;
        Ok(())
    }

    /// Adds `bias` to every row of `x` (rows of `bias.len()`).
    pub fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>) -> Result<(), CudaError> {
        const OP: &str = "add_bias";
        let cols = bias.len();
        ensure(cols > 0 && x.len().is_multiple_of(cols), OP, || {
            format!("x {} is not rows of bias {cols}", x.len())
        })?;
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let (n64, cols_i) = (n as u64, i32_of(OP, "cols", cols)?);
        let mut b = self.builder("add_bias_f32");
        b.arg(&mut *x).arg(bias).arg(&n64).arg(&cols_i);
        // SAFETY: argument types match `add_bias_f32`; x holds n values, bias cols.
        unsafe { b.launch(grid_1d(n, OP)?) }?;
        Ok(())
    }

    /// NeoX RoPE (with YaRN per `p`) in place on `x`: `positions.len()` tokens of `n_heads`
    /// heads of `head_dim` values; token t is at `positions[t]`.
    pub fn rope_neox(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<i32>,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope_neox";
        let n = positions.len();
        ensure(x.len() >= n * n_heads * head_dim, OP, || {
            format!(
                "x {} for {n} tokens × {n_heads} heads × {head_dim}",
                x.len()
            )
        })?;
        ensure(
            p.n_dims <= head_dim && p.n_dims.is_multiple_of(2) && p.n_dims > 0,
            OP,
            || format!("n_dims {} with head_dim {head_dim}", p.n_dims),
        )?;
        if n == 0 || n_heads == 0 {
            return Ok(());
        }
        ensure(n <= MAX_GRID_Y, OP, || format!("{n} tokens in one call"))?;
        let (n_i, nh, hd, nd) = (
            i32_of(OP, "tokens", n)?,
            i32_of(OP, "heads", n_heads)?,
            i32_of(OP, "head_dim", head_dim)?,
            i32_of(OP, "n_dims", p.n_dims)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "heads", n_heads)?, n as u32, 1),
            block_dim: (((p.n_dims / 2).clamp(32, 256)) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("rope_neox_f32");
        b.arg(&mut *x)
            .arg(positions)
            .arg(&n_i)
            .arg(&nh)
            .arg(&hd)
            .arg(&nd)
            .arg(&p.theta_scale)
            .arg(&p.freq_scale)
            .arg(&p.ext_factor)
            .arg(&p.attn_factor)
            .arg(&p.corr_dims[0])
            .arg(&p.corr_dims[1]);
        // SAFETY: argument types match `rope_neox_f32`; x holds n × heads × head_dim values.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Writes `n_tokens` rows of `layout.width` f32 values from `src` into the K/V ring
    /// `ring` of `layout` (one of [`K_ONLY_TYPES`]): token t goes to cell `(pos0 + t) % cells`,
    /// converted as the CPU engine's cache converts it (see `kv_store_*` in the kernels).
    pub fn kv_store(
        &self,
        src: &CudaSlice<f32>,
        ring: &mut CudaSlice<u8>,
        layout: &KvLayout,
        n_tokens: usize,
        pos0: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "kv_store";
        let (width, cells) = (layout.width, layout.cells);
        ensure(kv_type_ok(layout), OP, || {
            format!("{} K/V rings (rotation {})", layout.ty, layout.rot)
        })?;
        ensure(
            cells > 0 && src.len() >= n_tokens * width && ring.len() >= layout.bytes(),
            OP,
            || {
                format!(
                    "src {} / ring {} bytes for {n_tokens}×{width} into {cells} cells",
                    src.len(),
                    ring.len()
                )
            },
        )?;
        let total = n_tokens * width;
        if total == 0 {
            return Ok(());
        }
        let (n_i, w_i, c_i) = (
            i32_of(OP, "tokens", n_tokens)?,
            i32_of(OP, "width", width)?,
            i32_of(OP, "cells", cells)?,
        );
        // pos0 + n_tokens fits in i32, so pos0 does too.
        let pos0_i = i32_of(OP, "pos0 + tokens", pos0 + n_tokens)? - n_i;
        let (kernel, grid) = match layout.ty {
            GgmlType::F16 => ("kv_store_f16", grid_1d(total, OP)?),
            GgmlType::F32 => ("kv_store_f32", grid_1d(total, OP)?),
            GgmlType::BF16 => ("kv_store_bf16", grid_1d(total, OP)?),
            // One thread per rotation chunk (or block when not rotated).
            ty => {
                let chunk = layout.rot.max(ty.block_elems());
                (kv_store_kernel(ty), grid_1d(total / chunk, OP)?)
            }
        };
        let rot = i32_of(OP, "rotation", layout.rot)?;
        let mut b = self.builder(kernel);
        b.arg(src)
            .arg(ring)
            .arg(&n_i)
            .arg(&w_i)
            .arg(&c_i)
            .arg(&pos0_i);
        if !matches!(layout.ty, GgmlType::F16 | GgmlType::F32 | GgmlType::BF16) {
            b.arg(&rot);
        }
        // SAFETY: argument types match the `kv_store_*` kernel of the type; the ring holds
        // `cells` rows of the type's `row_bytes(width)` (checked above); writes land in cells
        // < `cells`.
        unsafe { b.launch(grid) }?;
        Ok(())
    }

    /// Attention for `n_tokens` queries at positions `pos0..pos0 + n_tokens` (their K/V
    /// already stored) over the K and V rings of `kl` and `vl`, with GQA, the window of `p`
    /// and optional per-head `sinks` (`n_head` logits). `q` and `out`:
    /// `n_tokens × n_head × head_dim`. The CPU engine's numerics for the rings' types (see
    /// `attn_row` and `attn_flash` in the kernels): f16/f32 values take the row kernel (for
    /// f16 the query and the probabilities rounded to f16), block-quantized values flash
    /// attention; the query is rotated like the keys and the output back like the values.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        p: &AttnParams,
        q: &CudaSlice<f32>,
        k: (&CudaSlice<u8>, &KvLayout),
        v: (&CudaSlice<u8>, &KvLayout),
        sinks: Option<&CudaSlice<f32>>,
        n_tokens: usize,
        pos0: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "attention";
        let ((k_ring, kl), (v_ring, vl)) = (k, v);
        let qw = p.n_head * p.head_dim;
        let kvw = p.n_head_kv * p.head_dim;
        ensure(
            p.head_dim.is_multiple_of(16)
                && p.head_dim > 0
                && p.head_dim <= ATT_MAX_HEAD_DIM
                && p.n_head_kv > 0
                && p.n_head.is_multiple_of(p.n_head_kv)
                && p.cells > 0
                && p.head_dim.is_multiple_of(kl.ty.block_elems())
                && p.head_dim.is_multiple_of(vl.ty.block_elems())
                && kv_pair_supported(kl.ty, vl.ty)
                && matches!(p.value_chains, 1 | 4),
            OP,
            || format!("unsupported shape {p:?} for K {} / V {}", kl.ty, vl.ty),
        )?;
        for (which, l) in [("K", kl), ("V", vl)] {
            ensure(
                kv_type_ok(l)
                    && l.width == kvw
                    && l.cells == p.cells
                    && (l.rot == 0 || p.head_dim.is_multiple_of(l.rot)),
                OP,
                || format!("{which} ring {l:?} for {p:?}"),
            )?;
        }
        ensure(
            q.len() >= n_tokens * qw
                && out.len() >= n_tokens * qw
                && k_ring.len() >= kl.bytes()
                && v_ring.len() >= vl.bytes()
                && sinks.is_none_or(|s| s.len() >= p.n_head),
            OP,
            || {
                format!(
                    "q {} / out {} / k {} / v {} bytes for {n_tokens} tokens, {} cells",
                    q.len(),
                    out.len(),
                    k_ring.len(),
                    v_ring.len(),
                    p.cells
                )
            },
        )?;
        // Every key the batch's queries see must still be in the ring.
        let span = p.keys_seen(n_tokens, pos0);
        ensure(span <= p.cells || n_tokens == 0, OP, || {
            format!(
                "{} cells cannot hold the {span} keys this batch sees",
                p.cells
            )
        })?;
        if n_tokens == 0 {
            return Ok(());
        }
        ensure(n_tokens <= MAX_GRID_Y, OP, || {
            format!("{n_tokens} tokens in one call")
        })?;
        let has_sinks = i32::from(sinks.is_some());
        let sinks = sinks.unwrap_or(&self.dummy);
        let window = i32_of(OP, "window", p.window.unwrap_or(0))?;
        let (n_i, nh, nkv, hd, cells) = (
            i32_of(OP, "tokens", n_tokens)?,
            i32_of(OP, "heads", p.n_head)?,
            i32_of(OP, "kv heads", p.n_head_kv)?,
            i32_of(OP, "head_dim", p.head_dim)?,
            i32_of(OP, "cells", p.cells)?,
        );
        let pos0_i = i32_of(OP, "pos0 + tokens", pos0 + n_tokens)? - n_i;
        let (k_ty, v_ty) = (ggml_id(kl.ty), ggml_id(vl.ty));
        let (k_rot, v_rot) = (
            i32_of(OP, "rotation", kl.rot)?,
            i32_of(OP, "rotation", vl.rot)?,
        );
        let value_chains = i32_of(OP, "value chains", p.value_chains)?;
        let flash = !matches!(vl.ty, GgmlType::F16 | GgmlType::F32);
        let (kernel, block) = if flash {
            ("attn_flash", WARP_THREADS)
        } else {
            ("attn_row", ATT_WARPS * 32)
        };
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "heads", p.n_head)?, n_tokens as u32, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder(kernel);
        b.arg(q)
            .arg(k_ring)
            .arg(v_ring)
            .arg(sinks)
            .arg(&has_sinks)
            .arg(out)
            .arg(&n_i)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&cells)
            .arg(&pos0_i)
            .arg(&window)
            .arg(&p.scale)
            .arg(&k_ty)
            .arg(&v_ty)
            .arg(&k_rot)
            .arg(&v_rot);
        // The row kernel's last argument (flash attention sums values in its own order).
        if !flash {
            b.arg(&value_chains);
        }
        // SAFETY: argument types match the kernel; sizes checked above; cells are indexed
        // modulo `cells`; the types are those the kernels read (`kv_type_ok`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Router: for each of the `logits.len() / n_expert` tokens, the `k` largest logits
    /// (ties: lower expert first) into `selected` and the softmax over those `k` into
    /// `weights` (both `n × k`).
    pub fn router_top_k(
        &self,
        logits: &CudaSlice<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "router_top_k";
        ensure(
            n_expert > 0 && logits.len().is_multiple_of(n_expert) && k > 0 && k <= n_expert,
            OP,
            || format!("logits {} / n_expert {n_expert} / k {k}", logits.len()),
        )?;
        let n = logits.len() / n_expert;
        ensure(
            selected.len() >= n * k && weights.len() >= n * k,
            OP,
            || {
                format!(
                    "selected {} / weights {} for {n}×{k}",
                    selected.len(),
                    weights.len()
                )
            },
        )?;
        if n == 0 {
            return Ok(());
        }
        let (n_i, ne, k_i) = (
            i32_of(OP, "tokens", n)?,
            i32_of(OP, "experts", n_expert)?,
            i32_of(OP, "k", k)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "tokens", n.div_ceil(ROW_WARPS as usize))?, 1, 1),
            block_dim: (ROW_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("router_topk_softmax");
        b.arg(logits)
            .arg(selected)
            .arg(weights)
            .arg(&n_i)
            .arg(&ne)
            .arg(&k_i);
        // SAFETY: argument types match `router_topk_softmax`; sizes checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// gpt-oss MoE for one layer: for each token t (rows of `x`, `n × d`) and slot j < k with
    /// expert `e = selected[t·k + j]` and weight `w = weights[t·k + j]`,
    /// `out[t] = Σ_j w · (down_e · swiglu_oai(gate_e·x + bg_e, up_e·x + bu_e) + bd_e)` with
    /// swiglu_oai(g, u) = min(g,7)·σ(1.702·min(g,7))·(clamp(u,−7,7)+1). Slots add in order.
    /// Expert ids out of range contribute nothing. Each slot reads its expert's rows once
    /// (tokens are not grouped by expert: right for decode, wasteful for large batches).
    /// Numerics as [`CudaDevice::matmul`]'s GEMV: activations (`x`, and each slot's SwiGLU
    /// output) converted as ggml converts them, Q8_0/MXFP4/F32 products in the CPU engine's
    /// order (F32: `vec_dot` order for an expert only one slot routes to, else 16 lanes).
    /// Gate, up and down are of one type, or (sets with low-bit experts, as in Q4_K_M files)
    /// each of [`LOWBIT_TYPES`] or Q8_0: then every product is in the order of the CPU
    /// engine's expert matmul for as many slots as route to the expert (`lowbit.rs`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe(
        &self,
        w: &MoeWeights,
        act: ExpertAct,
        x: &CudaSlice<f32>,
        selected: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        k: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe";
        let (d, ff, ne) = (w.gate.cols, w.gate.rows, w.gate.n_expert);
        ensure(
            w.up.cols == d
                && w.up.rows == ff
                && w.down.cols == ff
                && w.down.rows == d
                && w.up.n_expert == ne
                && w.down.n_expert == ne,
            OP,
            || "gate/up must be [E, ff, d] and down [E, d, ff]".into(),
        )?;
        let lowbit = [&w.gate, &w.up, &w.down]
            .iter()
            .any(|m| lowbit::is_lowbit(m.ty));
        if let Some(m) = [&w.up, &w.down].iter().find(|m| m.ty != w.gate.ty) {
            if !lowbit {
                return Err(CudaError::UnsupportedType { ty: m.ty, op: OP });
            }
        }
        // The row-per-warp kernels of one type's experts (the low-bit ones have their own).
        let unsupported = CudaError::UnsupportedType {
            ty: w.gate.ty,
            op: OP,
        };
        let kernels = match w.gate.ty {
            GgmlType::MXFP4 => Some(("moe_gate_up_mxfp4", "moe_down_mxfp4")),
            GgmlType::Q8_0 => Some(("moe_gate_up_q8_0", "moe_down_q8_0")),
            GgmlType::F16 => Some(("moe_gate_up_f16", "moe_down_f16")),
            GgmlType::BF16 => Some(("moe_gate_up_bf16", "moe_down_bf16")),
            GgmlType::F32 => Some(("moe_gate_up_f32", "moe_down_f32")),
            _ => None,
        };
        if kernels.is_none() && !lowbit {
            return Err(unsupported);
        }
        ensure(
            w.gate_bias.is_some() == w.up_bias.is_some()
                && w.gate_bias.as_ref().is_none_or(|b| b.len() >= ne * ff)
                && w.up_bias.as_ref().is_none_or(|b| b.len() >= ne * ff)
                && w.down_bias.as_ref().is_none_or(|b| b.len() >= ne * d),
            OP,
            || "biases: gate and up together, [E, ff] and [E, d]".into(),
        )?;
        ensure(k > 0 && x.len().is_multiple_of(d), OP, || {
            format!("x {} is not rows of {d}", x.len())
        })?;
        let n = x.len() / d;
        let slots = n * k;
        ensure(
            selected.len() >= slots && weights.len() >= slots && out.len() >= n * d,
            OP,
            || {
                format!(
                    "selected {} / weights {} / out {} for {n}×{k}",
                    selected.len(),
                    weights.len(),
                    out.len()
                )
            },
        )?;
        if n == 0 {
            return Ok(());
        }
        ensure(slots <= MAX_GRID_Y, OP, || {
            format!("{slots} expert slots in one call")
        })?;
        let (k_i, d_i) = (i32_of(OP, "k", k)?, i32_of(OP, "d", d)?);
        let act_i = act as i32;
        let tiled = matches!(w.gate.ty, GgmlType::MXFP4 | GgmlType::Q8_0)
            && slots >= MOE_TILED_MIN_SLOTS
            && ne <= MOE_MAX_EXPERTS;
        let y = if lowbit {
            self.moe_products_lowbit(w, act, x, selected, k)?
        } else if tiled {
            self.moe_products_tiled(w, act, x, selected, k)?
        } else {
            let (gate_up, down) = kernels.ok_or(unsupported)?;
            // SAFETY: every element of both scratch buffers is written by the kernels below
            // before it is read.
            let mut h = unsafe { self.stream.alloc::<f32>(slots * ff) }?;
            // SAFETY: as above.
            let mut y = unsafe { self.stream.alloc::<f32>(slots * d) }?;
            let (slots_i, ne_i, ff_i) = (
                i32_of(OP, "slots", slots)?,
                i32_of(OP, "experts", ne)?,
                i32_of(OP, "ff", ff)?,
            );
            let has_gu_bias = i32::from(w.gate_bias.is_some());
            let has_d_bias = i32::from(w.down_bias.is_some());
            let bg = w.gate_bias.as_ref().unwrap_or(&self.dummy);
            let bu = w.up_bias.as_ref().unwrap_or(&self.dummy);
            let bd = w.down_bias.as_ref().unwrap_or(&self.dummy);
            let rb_d = w.gate.row_bytes as u64;
            let rb_ff = w.down.row_bytes as u64;
            let cfg = rows_by_tokens(OP, (ff, ROW_WARPS), (slots, 1), ROW_WARPS * 32)?;
            let quantized = matches!(w.gate.ty, GgmlType::Q8_0 | GgmlType::MXFP4);
            let xq = if quantized {
                Some(self.quantize_q8_0(x, n * d)?)
            } else {
                None
            };
            let mut b = self.builder(gate_up);
            b.arg(&w.gate.data)
                .arg(&w.up.data)
                .arg(bg)
                .arg(bu)
                .arg(&has_gu_bias);
            match &xq {
                Some(xq) => b.arg(xq),
                None => b.arg(x),
            };
            b.arg(selected)
                .arg(&mut h)
                .arg(&slots_i)
                .arg(&k_i)
                .arg(&ne_i)
                .arg(&d_i)
                .arg(&ff_i)
                .arg(&rb_d)
                .arg(&act_i);
            // SAFETY: argument types match `moe_gate_up_*` (x as Q8_0 blocks for Q8_0/MXFP4
            // experts, f32 otherwise); expert ids are range-checked in the kernel; h holds
            // slots × ff values; shapes checked above.
            unsafe { b.launch(cfg) }?;

            let cfg = rows_by_tokens(OP, (d, ROW_WARPS), (slots, 1), ROW_WARPS * 32)?;
            let hq = if quantized {
                Some(self.quantize_q8_0(&h, slots * ff)?)
            } else {
                None
            };
            let mut b = self.builder(down);
            b.arg(&w.down.data).arg(bd).arg(&has_d_bias);
            match &hq {
                Some(hq) => b.arg(hq),
                None => b.arg(&h),
            };
            b.arg(selected)
                .arg(&mut y)
                .arg(&slots_i)
                .arg(&ne_i)
                .arg(&d_i)
                .arg(&ff_i)
                .arg(&rb_ff)
                .arg(&act_i);
            // SAFETY: argument types match `moe_down_*` (h as Q8_0 blocks for Q8_0/MXFP4
            // experts, f32 otherwise); y holds slots × d values.
            unsafe { b.launch(cfg) }?;

            y
        };
        let n_i = i32_of(OP, "tokens", n)?;
        let mut b = self.builder("moe_combine");
        b.arg(&y)
            .arg(weights)
            .arg(out)
            .arg(&n_i)
            .arg(&k_i)
            .arg(&d_i);
        // SAFETY: argument types match `moe_combine`; out holds n × d values.
        unsafe { b.launch(grid_1d(n * d, OP)?) }?;
        Ok(())
    }

    /// The expert products of [`CudaDevice::moe`] for a large batch of Q8_0 or MXFP4 experts
    /// (shapes checked there): the slots grouped by expert (`moe_group`), tiled products
    /// (`moe_mm_*`) for gate, up and down, the SwiGLU and the down biases. Returns y,
    /// `[slots][d]`, with the bits of the row-per-warp kernels.
    fn moe_products_tiled(
        &self,
        w: &MoeWeights,
        act: ExpertAct,
        x: &CudaSlice<f32>,
        selected: &CudaSlice<i32>,
        k: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        const OP: &str = "moe";
        let (d, ff, ne) = (w.gate.cols, w.gate.rows, w.gate.n_expert);
        let n = x.len() / d;
        let slots = n * k;
        let (slots_i, ne_i) = (i32_of(OP, "slots", slots)?, i32_of(OP, "experts", ne)?);
        // SAFETY: moe_group writes all ne + 1 offsets and an order entry for every slot with a
        // valid expert, which are the only entries moe_mm_mxfp4 reads.
        let mut offsets = unsafe { self.stream.alloc::<i32>(ne + 1) }?;
        // SAFETY: as above.
        let mut order = unsafe { self.stream.alloc::<i32>(slots) }?;
        let mut b = self.builder("moe_group");
        b.arg(selected)
            .arg(&slots_i)
            .arg(&ne_i)
            .arg(&mut offsets)
            .arg(&mut order);
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match `moe_group`; ne <= MOE_MAX_EXPERTS (checked by the
        // caller), the size of its shared counts.
        unsafe { b.launch(one_block) }?;

        let xq = self.quantize_q8_0(x, n * d)?;
        // SAFETY: moe_mm writes the rows of every slot with a valid expert, the only ones
        // moe_swiglu reads.
        let mut g = unsafe { self.stream.alloc::<f32>(slots * ff) }?;
        // SAFETY: as above.
        let mut u = unsafe { self.stream.alloc::<f32>(slots * ff) }?;
        self.moe_mm(&w.gate, &xq, k, (&offsets, &order), &mut g)?;
        self.moe_mm(&w.up, &xq, k, (&offsets, &order), &mut u)?;
        let h = self.moe_gated(w, act, (&g, &u), selected, slots)?;

        let hq = self.quantize_q8_0(&h, slots * ff)?;
        // SAFETY: moe_mm writes the slots with a valid expert and moe_down_bias zeroes the
        // others.
        let mut y = unsafe { self.stream.alloc::<f32>(slots * d) }?;
        self.moe_mm(&w.down, &hq, 1, (&offsets, &order), &mut y)?;
        self.moe_add_down_bias(w, &mut y, selected, slots)?;
        Ok(y)
    }

    /// `h[s] = act(g[s] + bg[e], u[s] + bu[e])` for every slot s of expert `e = selected[s]`
    /// (0 for an expert id out of range), `[slots][ff]` (`moe_swiglu`; shapes checked by
    /// [`CudaDevice::moe`]).
    fn moe_gated(
        &self,
        w: &MoeWeights,
        act: ExpertAct,
        (g, u): (&CudaSlice<f32>, &CudaSlice<f32>),
        selected: &CudaSlice<i32>,
        slots: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        const OP: &str = "moe";
        let (ff, ne) = (w.gate.rows, w.gate.n_expert);
        let (slots_i, ne_i, ff_i) = (
            i32_of(OP, "slots", slots)?,
            i32_of(OP, "experts", ne)?,
            i32_of(OP, "ff", ff)?,
        );
        // SAFETY: moe_swiglu writes every element.
        let mut h = unsafe { self.stream.alloc::<f32>(slots * ff) }?;
        let has_gu_bias = i32::from(w.gate_bias.is_some());
        let act_i = act as i32;
        let mut b = self.builder("moe_swiglu");
        b.arg(g)
            .arg(u)
            .arg(w.gate_bias.as_ref().unwrap_or(&self.dummy))
            .arg(w.up_bias.as_ref().unwrap_or(&self.dummy))
            .arg(&has_gu_bias)
            .arg(selected)
            .arg(&mut h)
            .arg(&slots_i)
            .arg(&ne_i)
            .arg(&ff_i)
            .arg(&act_i);
        // SAFETY: argument types match `moe_swiglu`; g and u hold slots × ff values, the
        // biases ne × ff when present (checked by the caller).
        unsafe { b.launch(grid_1d(slots * ff, OP)?) }?;
        Ok(h)
    }

    /// Adds the down biases to `y` (`[slots][d]`) and zeroes the slots whose expert id is out
    /// of range (`moe_down_bias`; shapes checked by [`CudaDevice::moe`]).
    fn moe_add_down_bias(
        &self,
        w: &MoeWeights,
        y: &mut CudaSlice<f32>,
        selected: &CudaSlice<i32>,
        slots: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe";
        let (d, ne) = (w.down.rows, w.down.n_expert);
        let (slots_i, ne_i, d_i) = (
            i32_of(OP, "slots", slots)?,
            i32_of(OP, "experts", ne)?,
            i32_of(OP, "d", d)?,
        );
        let has_d_bias = i32::from(w.down_bias.is_some());
        let mut b = self.builder("moe_down_bias");
        b.arg(y)
            .arg(w.down_bias.as_ref().unwrap_or(&self.dummy))
            .arg(&has_d_bias)
            .arg(selected)
            .arg(&slots_i)
            .arg(&ne_i)
            .arg(&d_i);
        // SAFETY: argument types match `moe_down_bias`; y holds slots × d values, the bias
        // ne × d when present (checked by the caller).
        unsafe { b.launch(grid_1d(slots * d, OP)?) }?;
        Ok(())
    }

    /// `out[slot] = experts[e] · act[slot / act_div]` for every slot grouped under expert `e`
    /// by `moe_group` (`groups` = its offsets and order); act: Q8_0 rows of `experts.cols`.
    fn moe_mm(
        &self,
        experts: &DeviceExperts,
        act: &CudaSlice<u8>,
        act_div: usize,
        (offsets, order): (&CudaSlice<i32>, &CudaSlice<i32>),
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe_mm";
        let name = match experts.ty {
            GgmlType::MXFP4 => "moe_mm_mxfp4",
            GgmlType::Q8_0 => "moe_mm_q8_0",
            ty => return Err(CudaError::UnsupportedType { ty, op: OP }),
        };
        let rows_i = i32_of(OP, "rows", experts.rows)?;
        let nb_i = i32_of(OP, "blocks per row", experts.cols / 32)?;
        let act_div_i = i32_of(OP, "act_div", act_div)?;
        let row_bytes = experts.row_bytes as u64;
        let cfg = LaunchConfig {
            grid_dim: (
                u32_of(OP, "row tiles", experts.rows.div_ceil(TILE_ROWS as usize))?,
                u32_of(OP, "experts", experts.n_expert)?,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder(name);
        b.arg(&experts.data)
            .arg(&row_bytes)
            .arg(&rows_i)
            .arg(&nb_i)
            .arg(act)
            .arg(&act_div_i)
            .arg(offsets)
            .arg(order)
            .arg(out);
        // SAFETY: argument types match `moe_mm_*`; experts holds n_expert × rows rows of
        // row_bytes, act the Q8_0 rows its slots name and out a row of `rows` per slot (sizes
        // from CudaDevice::moe's checks).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
