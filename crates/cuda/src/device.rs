//! A CUDA device with the kernels loaded: the device, its weight types and the launch helpers
//! the ops share. The ops of the device contract live in the files beside it, one per family:
//! buffers and transfers (`transfers`), per-row and element-wise ops (`rowwise`), products
//! (`matmul`, the low-bit types' in `lowbit`), the K/V rings (`kv_ring`), attention over K/V
//! pairs (`attention`) and over K-only latent rings (`latent_attention`), expert choice
//! (`routing`) and the MoE expert block (`experts`); what the kernels support is in
//! `capabilities`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchArgs, LaunchConfig};
use cudarc::nvrtc::Ptx;
use hmoe_quant::GgmlType;

use crate::error::{ensure, guarded, CudaError};
use crate::graphs::{graphs_requested, SegmentGraphs};
use crate::host_slots::HostSlots;
use crate::kernels::{self, PtxOrigin};
use crate::mem_pool::KeptPool;
use crate::probe::{info_of, GpuInfo};
use crate::profile::{self, Profile};
use crate::staging::{CopyUpload, Staging};

mod attention;
mod attention_chunked;
mod capabilities;
mod experts;
mod kv_ring;
mod latent_attention;
mod lowbit;
mod matmul;
mod routing;
mod rowwise;
mod top_k;
mod transfers;

pub use attention_chunked::ChunkedShape;
pub use capabilities::{
    expert_types_supported, kv_pair_supported, CAPABILITIES, KV_TYPES, K_ONLY_TYPES, LOWBIT_TYPES,
    SUPPORTED_TYPES,
};
pub use matmul::CUBLAS_MIN_TOKENS;
pub use routing::ROUTER_FUSED_MAX_TOKENS;

/// Largest grid y dimension CUDA allows (tokens or expert slots per launch).
const MAX_GRID_Y: usize = 65_535;

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
    /// For experts uploaded on the copy stream: its order with the compute stream. Declared
    /// before `data`, so that it is dropped first (the copy stream waits for the compute
    /// stream before `data` is freed there).
    upload: Option<CopyUpload>,
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
    /// Makes the compute stream wait for the copies of experts uploaded on the copy stream
    /// (nothing for others): before a kernel reads them.
    fn wait_uploaded(&self) -> Result<(), CudaError> {
        self.upload.as_ref().map_or(Ok(()), CopyUpload::wait_on)
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
///
/// Uploaded by the contract's `upload_moe`, everything lives on the copy stream: the biases
/// are uploaded first, then gate, up and down, each of which records its [`CopyUpload`]
/// after its copies (so each one's covers the biases too), and the fields drop in order, the
/// matrices (whose drops make the copy stream wait for the compute stream) before the biases.
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
/// and the downloads wait by themselves. Expert uploads (`upload_moe`: op offload, the
/// device expert cache, experts at load) go on a second stream, the copy stream, so that they
/// overlap the work queued before them.
///
/// **Stream order.** cudarc's per-buffer event tracking is off (it is switched off before
/// anything is allocated): with two streams it would create two events per buffer and wait
/// on and record them at every launch, about 1,500 driver calls per decoded token. The
/// streams are ordered by hand instead, and these invariants keep that sound:
///
/// 1. Every buffer but the experts of `upload_moe` is allocated, used and freed on the
///    compute stream, so the stream's order is their order: a buffer freed (`cuMemFreeAsync`)
///    or handed to another op (the executor's scratch arena) is only reused by work queued
///    after everything that used it.
/// 2. The experts of `upload_moe` are allocated, written and freed on the copy stream.
///    Their [`CopyUpload`] makes the compute stream wait for their copies before the `moe`
///    op reads them, and the copy stream wait for the compute stream before they are freed
///    (`staging.rs`).
/// 3. Pinned host buffers carry their own events: the round trip's (`PinnedIo`, cudarc
///    records and waits on a pinned slice's event whatever the tracking), the upload ring's
///    slots (`Staging`, one event per slot) and the step's small copies (`HostSlots`, one
///    event per slot): the host waits for a buffer's event before it writes or reads it.
/// 4. cuBLAS is bound to the compute stream.
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
    /// The blocks of `router_logits_topk_*` that have finished (`routing.rs`): 0 between
    /// launches, which leave it at 0; allocated once, so that a CUDA graph's replays find it.
    router_done: CudaSlice<u32>,
    /// Pinned buffers for uploads from the file mapping, allocated at the first such upload.
    staging: Mutex<Option<Staging>>,
    /// Kernel times, when `HMOE_CUDA_PROFILE` asks for them.
    profile: Option<Profile>,
    /// Pinned buffers for a step's small copies: ids and positions up, logits down.
    host_slots: Mutex<HostSlots>,
    /// The CUDA graphs of recorded segments (`graphs.rs`).
    pub(crate) graphs: SegmentGraphs,
    /// The default memory pool, keeping freed memory (`mem_pool.rs`); `None` where the
    /// device does not allocate stream-ordered or `HMOE_CUDA_POOL_KEEP=0`.
    pool: Option<KeptPool>,
}

/// `v` as a kernel's `int` argument, or a shape error of `op` naming `what`.
fn i32_of(op: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        what: format!("{what} = {v} exceeds i32"),
    })
}

/// `v` as a launch dimension, or a shape error of `op` naming `what`.
fn u32_of(op: &'static str, what: &str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        what: format!("{what} = {v} exceeds u32"),
    })
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

/// A launch of a thread per element of `n`, in blocks of 256.
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
            // SAFETY: nothing has been allocated in the context yet, so no buffer tracks
            // events; every buffer from now on is ordered by hand as the invariants of
            // `CudaDevice`'s docs say (one stream for all but the copy stream's experts,
            // whose `CopyUpload` orders them).
            unsafe { ctx.disable_event_tracking() };
            // Without it the device works as before: freed memory goes back at each wait.
            let pool = KeptPool::new(&ctx).unwrap_or_else(|e| {
                tracing::warn!("the CUDA memory pool keeps nothing freed: {e}");
                None
            });
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
            let router_done = stream.alloc_zeros::<u32>(1)?;
            let profile = profile::requested().then(Profile::default);
            // Graphs hold the ops' temporaries as memory nodes (stream-ordered allocation);
            // the profile's timing events cannot be captured.
            let graphs_on = graphs_requested() && ctx.has_async_alloc() && profile.is_none();
            Ok(CudaDevice {
                info,
                ctx,
                stream,
                copy_stream,
                funcs,
                blas,
                ptx_origin,
                dummy,
                router_done,
                staging: Mutex::new(None),
                profile,
                host_slots: Mutex::new(HostSlots::default()),
                graphs: SegmentGraphs::new(graphs_on),
                pool,
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

    /// Whether decode steps' recorded segments run as CUDA graphs (`graphs.rs`: on where the
    /// device allocates stream-ordered, unless `HMOE_CUDA_GRAPHS=0` or the profile is on, and
    /// until a capture fails).
    pub fn graphs_on(&self) -> bool {
        self.graphs.on()
    }

    /// Whether batched F16/BF16 matmuls go through cuBLAS.
    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// `(free, total)` device memory in bytes now. Free counts what the memory pool keeps
    /// unused (`mem_pool.rs`): the driver reports it as taken, but the next allocation gets it.
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        let (free, total) = self.ctx.mem_get_info()?;
        let kept = match &self.pool {
            Some(pool) => pool.idle_bytes()?,
            None => 0,
        };
        Ok((
            (free as u64).saturating_add(kept).min(total as u64),
            total as u64,
        ))
    }

    /// The stream every op is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits until every queued op has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    fn func(&self, name: &'static str) -> &CudaFunction {
        // Every name in KERNELS was loaded by `new`, and callers only pass names from it.
        &self.funcs[name]
    }

    /// A launch of kernel `name` on the op stream (timed when the profile is on).
    fn builder(&self, name: &'static str) -> Launch<'_> {
        let mut args = self.stream.launch_builder(self.func(name));
        if self.profile.is_some() {
            args.record_kernel_launch(CUevent_flags::CU_EVENT_DEFAULT);
        }
        Launch {
            args,
            name,
            profile: self.profile.as_ref(),
        }
    }

    /// The `HMOE_CUDA_PROFILE` table so far (`None` when the profile is off); waits for the
    /// queued work.
    pub fn profile_report(&self) -> Option<String> {
        let p = self.profile.as_ref()?;
        let _ = self.stream.synchronize();
        let _ = p.settle();
        Some(p.report())
    }
}

/// A kernel launch being built: cudarc's builder (arguments are pushed through it) and, when
/// the profile is on, where the launch's timing events go.
struct Launch<'a> {
    args: LaunchArgs<'a>,
    name: &'static str,
    profile: Option<&'a Profile>,
}

impl<'a> std::ops::Deref for Launch<'a> {
    type Target = LaunchArgs<'a>;
    fn deref(&self) -> &LaunchArgs<'a> {
        &self.args
    }
}

impl std::ops::DerefMut for Launch<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.args
    }
}

impl Launch<'_> {
    /// Queues the kernel with `cfg` (and hands its events to the profile).
    ///
    /// # Safety
    /// As [`LaunchArgs::launch`]: the pushed arguments match the kernel's parameters and
    /// every buffer they name is large enough for the launch.
    unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), cudarc::driver::DriverError> {
        // SAFETY: the caller's contract above is LaunchArgs::launch's.
        let events = unsafe { self.args.launch(cfg) }?;
        if let (Some(p), Some((start, end))) = (self.profile, events) {
            p.launched(self.name, start, end);
        }
        Ok(())
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if let Some(report) = self.profile_report() {
            eprint!("{report}");
        }
    }
}
