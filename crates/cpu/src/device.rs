//! [`Cpu`]: the device contract ([`Backend`]) on the host, over the CPU engine's own kernels
//! (this crate's [`crate::ops`], [`crate::attention`] and [`crate::kv_storage`], multithreaded
//! with the hmoe-pool thread pool), so that the device executor running on it computes what
//! the CPU engine computes, bit for bit.
//!
//! - Buffers are host vectors; nothing is transferred and nothing is counted
//!   ([`Backend::transfers`] is `None`), and there is no memory limit to report
//!   ([`Backend::free_memory`] is `None`).
//! - Weights stay where they are: [`Backend::upload_matrix_shared`] keeps the handle to the
//!   file mapping ([`SharedBytes`]), so a model is never copied; [`Backend::upload_matrix`]
//!   (bytes without an owner) copies. Each matrix multiplies with the kernel the CPU engine
//!   chooses for it ([`DotKernel::for_matrix`]).
//! - K/V rings are the CPU engine's cache storage ([`Cells`]), stored and attended over by the
//!   CPU engine's code: `kv_store` is its `set_rows` conversion (rotation included), attention
//!   its row kernel or flash attention as [`AttnParams`] asks.
//! - Expert sets stay where they are too ([`Backend::upload_moe_shared`] keeps the handles to
//!   the stacked matrices in the mapping; [`Backend::upload_moe`] copies the chosen experts),
//!   and `moe` runs the CPU engine's expert kernels over them ([`crate::experts`]), so that a
//!   layer's experts are "on the device" with no round trip. The executor's host path
//!   ([`Backend::staging`] being plain host buffers) computes the same.

use std::ops::{Deref, DerefMut, Range};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use hmoe_backend::{
    AttnParams, Backend, BackendError, Elem, ExpertMatrix, ExpertTensors, ExpertView, GatedAct,
    Gating, HostStaging, KOnlyAttnParams, KvLayout, KvRing, RopeParams, Routing, RowCopy,
    SharedBytes, StagedIo, KV_TYPES,
};
use hmoe_quant::{DotKernel, GemmKernel, GgmlType};

use crate::attention::{attention, attention_ext, AttnLayout, AttnShape};
use crate::experts::{self, ExpertBatch, ExpertKernels, ExpertScratch};
use crate::kv_storage::{Cells, LayerCache};
use crate::ops::{self, QuantizedActs};

/// The CPU device's name in device lists and messages.
pub const CPU_NAME: &str = "CPU";

/// A buffer of the CPU device: a host vector, or (for a K/V ring) the CPU engine's cache
/// storage of the ring's type.
pub struct CpuBuf<T> {
    data: Vec<T>,
    ring: Option<Box<Ring>>,
}

/// A K/V ring's storage and its size in bytes.
struct Ring {
    cells: Mutex<Cells>,
    bytes: usize,
}

impl<T> CpuBuf<T> {
    fn host(data: Vec<T>) -> CpuBuf<T> {
        CpuBuf { data, ring: None }
    }
}

impl<T> Deref for CpuBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<T> DerefMut for CpuBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}

/// Where a matrix's bytes live.
enum MatrixBytes {
    /// A copy (bytes uploaded without an owner).
    Owned(Vec<u8>),
    /// The file mapping, kept alive by the handle.
    Shared(SharedBytes),
}

/// A weight matrix in its file encoding, with the CPU engine's kernel for it.
pub struct CpuMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    bytes: MatrixBytes,
    kernel: DotKernel,
}

impl CpuMatrix {
    fn data(&self) -> &[u8] {
        match &self.bytes {
            MatrixBytes::Owned(v) => v,
            MatrixBytes::Shared(s) => s.bytes(),
        }
    }

    fn row(&self, r: usize) -> &[u8] {
        &self.data()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
}

/// One stacked expert matrix of an expert set: its shape and where its bytes live.
struct StackedBytes {
    ty: GgmlType,
    n_in: usize,
    n_out: usize,
    bytes: MatrixBytes,
}

impl StackedBytes {
    fn matrix(&self) -> ExpertMatrix<'_> {
        let data = match &self.bytes {
            MatrixBytes::Owned(v) => &v[..],
            MatrixBytes::Shared(s) => s.bytes(),
        };
        ExpertMatrix {
            ty: self.ty,
            n_in: self.n_in,
            n_out: self.n_out,
            data,
        }
    }
}

/// An expert set of the CPU device: the stacked gate, up and down matrices (the file's, kept in
/// place, or a copy of the chosen experts), the chosen experts' biases, and the CPU engine's
/// kernels for the matrices.
pub struct CpuMoe {
    d: usize,
    ff: usize,
    /// Expert `e` of the set is expert `stored[e]` of the stacked matrices.
    stored: Vec<usize>,
    /// Gate, up and down.
    mats: [StackedBytes; 3],
    /// Gate, up and down biases of the set's experts in set order (empty: none).
    biases: [Vec<f32>; 3],
    kernels: ExpertKernels,
    bytes: usize,
}

impl CpuMoe {
    /// Expert `e` of the set.
    fn view(&self, e: usize) -> Option<ExpertView<'_>> {
        let i = *self.stored.get(e)?;
        let [g, u, dn] = &self.mats;
        fn bias(b: &[f32], e: usize, n: usize) -> Option<&[f32]> {
            match b.is_empty() {
                true => Some(b),
                false => b.get(e * n..(e + 1) * n),
            }
        }
        Some(ExpertView {
            gate: g.matrix().expert(i)?,
            up: u.matrix().expert(i)?,
            down: dn.matrix().expert(i)?,
            gate_bias: bias(&self.biases[0], e, self.ff)?,
            up_bias: bias(&self.biases[1], e, self.ff)?,
            down_bias: bias(&self.biases[2], e, self.d)?,
        })
    }
}

/// The expert set `ids` (every expert when `None`) of `t`: the stacked matrices `shared` when
/// given (the set indexes into them), else a copy of the chosen experts.
fn expert_set(
    t: &ExpertTensors<'_>,
    shared: Option<&[SharedBytes; 3]>,
    ids: Option<&[usize]>,
    interleave: bool,
) -> Result<CpuMoe, BackendError> {
    const OP: &str = "upload_moe";
    let (d, ff) = t.validate()?;
    let all: Vec<usize> = (0..t.n_expert).collect();
    let ids = ids.unwrap_or(&all);
    ensure(OP, ids.iter().all(|&e| e < t.n_expert), || {
        format!("experts {ids:?} of {}", t.n_expert)
    })?;
    let kernels = ExpertKernels::for_tensors(t).map_err(|_| BackendError::UnsupportedType {
        ty: t.gate.ty,
        op: OP,
    })?;
    let srcs = [&t.gate, &t.up, &t.down];
    let bytes = ids.len() * t.expert_bytes() as usize;
    let interleaved = interleave
        .then(|| kernels.interleavable(srcs.map(|m| m.n_out)))
        .flatten()
        .filter(|_| room_for_copy(bytes));
    if let Some(shared) = shared {
        for (m, s) in srcs.iter().zip(shared) {
            ensure(OP, s.bytes().len() == m.data.len(), || {
                format!(
                    "{} shared bytes for {} of experts",
                    s.bytes().len(),
                    m.data.len()
                )
            })?;
        }
    }
    let (stored, mats, kernels) = match (interleaved, shared) {
        (Some(gemm), _) => {
            let copy = |i: usize| -> Result<StackedBytes, BackendError> {
                let m = srcs[i];
                let shared = shared.map(|s| &s[i]);
                Ok(StackedBytes {
                    ty: m.ty,
                    n_in: m.n_in,
                    n_out: m.n_out,
                    bytes: MatrixBytes::Owned(interleaved_copy(gemm, m, ids, shared)?),
                })
            };
            let [g, u, d] = [0, 1, 2].map(copy);
            let mats = [g?, u?, d?];
            (
                (0..ids.len()).collect(),
                mats,
                kernels.over_interleaved(gemm),
            )
        }
        (None, Some(shared)) => {
            let mats = std::array::from_fn(|i| StackedBytes {
                ty: srcs[i].ty,
                n_in: srcs[i].n_in,
                n_out: srcs[i].n_out,
                bytes: MatrixBytes::Shared(shared[i].clone()),
            });
            (ids.to_vec(), mats, kernels)
        }
        (None, None) => {
            let copy = |m: &ExpertMatrix<'_>| {
                let bytes = ids.iter().filter_map(|&e| m.expert(e)).flatten().copied();
                StackedBytes {
                    ty: m.ty,
                    n_in: m.n_in,
                    n_out: m.n_out,
                    bytes: MatrixBytes::Owned(bytes.collect()),
                }
            };
            ((0..ids.len()).collect(), srcs.map(copy), kernels)
        }
    };
    let pick = |b: &[f32], n: usize| -> Vec<f32> {
        match b.is_empty() {
            true => Vec::new(),
            false => ids
                .iter()
                .flat_map(|&e| &b[e * n..(e + 1) * n])
                .copied()
                .collect(),
        }
    };
    let biases = [
        pick(t.gate_bias, ff),
        pick(t.up_bias, ff),
        pick(t.down_bias, d),
    ];
    Ok(CpuMoe {
        d,
        ff,
        stored,
        mats,
        biases,
        kernels,
        bytes,
    })
}

/// The chosen experts `ids` of `m`, in that order, with their rows interleaved for `gemm`
/// (whole groups of 16 rows: an expert's rows never share a group with another's), converted
/// by the pool's threads. Where `m`'s bytes are `shared` (the file's mapping), each expert's
/// pages are given back once copied, so the copy takes their place in the resident size.
fn interleaved_copy(
    gemm: GemmKernel,
    m: &ExpertMatrix<'_>,
    ids: &[usize],
    shared: Option<&SharedBytes>,
) -> Result<Vec<u8>, BackendError> {
    let err = |e: String| BackendError::Shape {
        op: "upload_moe",
        what: format!("interleaving the experts' rows: {e}"),
    };
    let row = m.ty.row_bytes(m.n_in as u64);
    let group = 16 * row.ok_or_else(|| err(format!("rows of {}", m.n_in)))? as usize;
    let expert = group / 16 * m.n_out;
    let mut out = vec![0u8; ids.len() * expert];
    let result = Mutex::new(Ok(()));
    // One expert per task.
    hmoe_pool::global().for_each_chunk_mut(&mut out, expert, |i, dst| {
        let src = m.expert(ids[i]).unwrap_or_default();
        populate(dst);
        if let Err(e) = gemm.interleave_into(m.n_in, src, dst) {
            *result.lock().unwrap_or_else(PoisonError::into_inner) = Err(err(e.to_string()));
        }
        if let Some(s) = shared {
            s.release_pages(src);
        }
    });
    result
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)?;
    // Every expert copied: also the pages that two experts' bytes share.
    if let (Some(s), true) = (shared, ids.len() * expert == m.data.len()) {
        s.release_pages(m.data);
    }
    Ok(out)
}

/// Faults in the whole pages of `buf` (fresh zeroed memory about to be written) in one call
/// (`MADV_POPULATE_WRITE`, Linux 5.14+) instead of one page fault per 4 KiB page as the
/// writes reach them; elsewhere, or where the kernel refuses, the writes fault them in.
fn populate(buf: &mut [u8]) {
    #[cfg(target_os = "linux")]
    if let Some(pages) = hmoe_quant::whole_pages(buf) {
        // SAFETY: `pages` lies inside `buf`, memory this process owns and holds exclusively
        // here; populating for write only faults its pages in, their contents unchanged.
        unsafe {
            libc::madvise(
                pages.start as *mut libc::c_void,
                pages.len(),
                libc::MADV_POPULATE_WRITE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

/// Whether a copy of `bytes` leaves the machine room: the kernel's estimate of the memory
/// available without swapping (`MemAvailable`, which counts the file's cached pages that the
/// copy replaces) exceeds it by at least 2 GiB and a sixteenth of the RAM. An expert set that
/// does not fit stays in the file mapping, whose pages the kernel can drop and read again.
fn room_for_copy(bytes: usize) -> bool {
    host_memory().is_some_and(|m| {
        let reserve = (2u64 << 30) + m.total / 16;
        m.available >= reserve.saturating_add(bytes as u64)
    })
}

/// The host's RAM, from `/proc/meminfo` (Linux).
#[derive(Clone, Copy, Debug)]
pub struct HostMemory {
    /// `MemTotal`, bytes.
    pub total: u64,
    /// `MemAvailable`: what the kernel estimates can be allocated without swapping, bytes.
    pub available: u64,
}

/// The host's RAM, or `None` where `/proc/meminfo` cannot be read.
pub fn host_memory() -> Option<HostMemory> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let bytes = |key: &str| -> Option<u64> {
        let line = info.lines().find(|l| l.starts_with(key))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    };
    Some(HostMemory {
        total: bytes("MemTotal:")?,
        available: bytes("MemAvailable:")?,
    })
}

/// Whether devices interleave expert rows by default ([`set_expert_interleaving`]).
static INTERLEAVE_EXPERTS: AtomicBool = AtomicBool::new(true);

/// Whether [`Cpu`] devices made after this call keep MXFP4 expert rows interleaved in groups
/// of 16 (a copy, where the CPU has the kernel and memory allows; faster products, the same
/// bits) or in the file's mapping: the process-wide default, `--no-repack` turns it off.
pub fn set_expert_interleaving(on: bool) {
    INTERLEAVE_EXPERTS.store(on, Ordering::Relaxed);
}

/// The CPU as a device of the contract (see the module docs).
pub struct Cpu {
    /// Activations converted for a product, reused between calls.
    acts: Mutex<QuantizedActs>,
    /// Buffers of the `moe` op, reused between calls.
    experts: Mutex<ExpertScratch>,
    /// Whether expert sets are interleaved where they can be ([`set_expert_interleaving`]).
    interleave_experts: bool,
}

impl Default for Cpu {
    fn default() -> Cpu {
        Cpu::new()
    }
}

impl Cpu {
    /// The CPU device, interleaving expert rows as [`set_expert_interleaving`] last said.
    pub fn new() -> Cpu {
        Cpu::with_expert_interleaving(INTERLEAVE_EXPERTS.load(Ordering::Relaxed))
    }

    /// The CPU device, interleaving expert rows where it can (`on`) or never.
    pub fn with_expert_interleaving(on: bool) -> Cpu {
        Cpu {
            acts: Mutex::default(),
            experts: Mutex::default(),
            interleave_experts: on,
        }
    }

    fn acts(&self) -> MutexGuard<'_, QuantizedActs> {
        self.acts.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn ensure(op: &'static str, ok: bool, what: impl FnOnce() -> String) -> Result<(), BackendError> {
    match ok {
        true => Ok(()),
        false => Err(BackendError::Shape { op, what: what() }),
    }
}

fn quant_err(op: &'static str) -> impl Fn(hmoe_quant::QuantError) -> BackendError {
    move |e| BackendError::Shape {
        op,
        what: e.to_string(),
    }
}

/// The matrix `data` of `rows × cols` values of `ty`, checked, with its kernel.
fn matrix(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    len: usize,
    bytes: MatrixBytes,
) -> Result<CpuMatrix, BackendError> {
    const OP: &str = "upload_matrix";
    let kernel = DotKernel::for_matrix(ty, rows)
        .map_err(|_| BackendError::UnsupportedType { ty, op: OP })?;
    let row_bytes = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
    ensure(OP, row_bytes > 0 && len == rows * row_bytes, || {
        format!("{len} bytes for {rows} rows of {cols} {ty}")
    })?;
    Ok(CpuMatrix {
        ty,
        rows,
        cols,
        row_bytes,
        bytes,
        kernel,
    })
}

/// The ring's storage, or the shape error of a buffer that is not a ring.
fn ring_cells<'r>(
    ring: &'r KvRing<Cpu>,
    op: &'static str,
) -> Result<MutexGuard<'r, Cells>, BackendError> {
    let r = ring.data.ring.as_ref().ok_or_else(|| BackendError::Shape {
        op,
        what: "a buffer that is not a K/V ring".into(),
    })?;
    Ok(r.cells.lock().unwrap_or_else(PoisonError::into_inner))
}

/// Runs `f` over a [`LayerCache`] made of the rings' storage (moved in and back out, no
/// copy); the shape error when the kernel refused the heads.
fn with_layer(
    op: &'static str,
    k: &mut Cells,
    v: Option<&mut Cells>,
    (cells, window, flash): (usize, Option<usize>, bool),
    f: impl FnOnce(&LayerCache),
) -> Result<(), BackendError> {
    let empty = || Cells::F32(Vec::new());
    let mut spare = empty();
    let v = v.unwrap_or(&mut spare);
    let layer = LayerCache {
        k: std::mem::replace(k, empty()),
        v: std::mem::replace(v, empty()),
        cells,
        window,
        flash,
        refused: AtomicBool::new(false),
    };
    f(&layer);
    let refused = layer.refused.load(Ordering::Relaxed);
    *k = layer.k;
    *v = layer.v;
    ensure(op, !refused, || {
        "heads that are not whole blocks of the cache type".into()
    })
}

impl Backend for Cpu {
    type Buf<T: Elem> = CpuBuf<T>;
    type Matrix = CpuMatrix;
    type Moe = CpuMoe;
    type Staging = HostStaging;

    fn name(&self) -> String {
        CPU_NAME.into()
    }
    fn free_memory(&self) -> Result<Option<u64>, BackendError> {
        Ok(None)
    }
    fn is_host(&self) -> bool {
        true
    }
    fn upload_f32(&self, src: &[f32]) -> Result<CpuBuf<f32>, BackendError> {
        Ok(CpuBuf::host(src.to_vec()))
    }
    fn upload_i32(&self, src: &[i32]) -> Result<CpuBuf<i32>, BackendError> {
        Ok(CpuBuf::host(src.to_vec()))
    }
    fn upload_u16(&self, src: &[u16]) -> Result<CpuBuf<u16>, BackendError> {
        Ok(CpuBuf::host(src.to_vec()))
    }
    fn upload_u8(&self, src: &[u8]) -> Result<CpuBuf<u8>, BackendError> {
        Ok(CpuBuf::host(src.to_vec()))
    }
    fn alloc_f32(&self, len: usize) -> Result<CpuBuf<f32>, BackendError> {
        Ok(CpuBuf::host(vec![0.0; len]))
    }
    fn alloc_i32(&self, len: usize) -> Result<CpuBuf<i32>, BackendError> {
        Ok(CpuBuf::host(vec![0; len]))
    }
    fn alloc_u16(&self, len: usize) -> Result<CpuBuf<u16>, BackendError> {
        Ok(CpuBuf::host(vec![0; len]))
    }
    fn alloc_u8(&self, len: usize) -> Result<CpuBuf<u8>, BackendError> {
        Ok(CpuBuf::host(vec![0; len]))
    }
    fn download_f32(&self, src: &CpuBuf<f32>) -> Result<Vec<f32>, BackendError> {
        Ok(src.data.clone())
    }
    fn download_i32(&self, src: &CpuBuf<i32>) -> Result<Vec<i32>, BackendError> {
        Ok(src.data.clone())
    }
    fn download_u16(&self, src: &CpuBuf<u16>) -> Result<Vec<u16>, BackendError> {
        Ok(src.data.clone())
    }
    fn download_u8(&self, src: &CpuBuf<u8>) -> Result<Vec<u8>, BackendError> {
        Ok(match &src.ring {
            Some(r) => r
                .cells
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .to_bytes(),
            None => src.data.clone(),
        })
    }
    fn buf_len<T: Elem>(b: &CpuBuf<T>) -> usize {
        b.data.len() + b.ring.as_ref().map_or(0, |r| r.bytes)
    }
    fn copy_range(
        &self,
        src: &CpuBuf<f32>,
        range: Range<usize>,
    ) -> Result<CpuBuf<f32>, BackendError> {
        let data = src.get(range.clone()).ok_or_else(|| BackendError::Shape {
            op: "copy_range",
            what: format!("{range:?} of {}", src.len()),
        })?;
        Ok(CpuBuf::host(data.to_vec()))
    }
    fn copy_into(
        &self,
        src: &CpuBuf<f32>,
        dst: &mut CpuBuf<f32>,
        at: usize,
    ) -> Result<(), BackendError> {
        let range = hmoe_backend::copy_into_range(src.len(), dst.len(), at)?;
        dst[range].copy_from_slice(src);
        Ok(())
    }
    fn synchronize(&self) -> Result<(), BackendError> {
        Ok(())
    }
    fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<CpuMatrix, BackendError> {
        matrix(
            ty,
            rows,
            cols,
            data.len(),
            MatrixBytes::Owned(data.to_vec()),
        )
    }
    fn upload_matrix_shared(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &SharedBytes,
    ) -> Result<CpuMatrix, BackendError> {
        let len = data.bytes().len();
        matrix(ty, rows, cols, len, MatrixBytes::Shared(data.clone()))
    }
    fn matrix_bytes(m: &CpuMatrix) -> usize {
        m.data().len()
    }
    fn upload_moe(
        &self,
        t: &ExpertTensors<'_>,
        ids: Option<&[usize]>,
    ) -> Result<CpuMoe, BackendError> {
        expert_set(t, None, ids, self.interleave_experts)
    }
    fn upload_moe_shared(
        &self,
        t: &ExpertTensors<'_>,
        data: &[SharedBytes; 3],
        ids: Option<&[usize]>,
    ) -> Result<CpuMoe, BackendError> {
        expert_set(t, Some(data), ids, self.interleave_experts)
    }
    fn moe_bytes(m: &CpuMoe) -> usize {
        m.bytes
    }
    fn get_rows(
        &self,
        t: &CpuMatrix,
        ids: &CpuBuf<i32>,
        out: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        ensure("get_rows", out.len() >= ids.len() * t.cols, || {
            format!("out {} for {} rows of {}", out.len(), ids.len(), t.cols)
        })?;
        for (i, &id) in ids.iter().enumerate() {
            let dst = &mut out[i * t.cols..(i + 1) * t.cols];
            match usize::try_from(id).ok().filter(|&r| r < t.rows) {
                Some(r) => hmoe_quant::dequantize_row(t.ty, t.row(r), dst)
                    .map_err(quant_err("get_rows"))?,
                None => dst.fill(0.0),
            }
        }
        Ok(())
    }
    fn rms_norm(
        &self,
        x: &CpuBuf<f32>,
        weight: &CpuBuf<f32>,
        eps: f32,
        out: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        let n = weight.len();
        ensure(
            "rms_norm",
            n > 0 && x.len().is_multiple_of(n) && out.len() >= x.len(),
            || format!("x {} / weight {n} / out {}", x.len(), out.len()),
        )?;
        ops::rms_norm(x, weight, eps, &mut out[..x.len()]);
        Ok(())
    }
    fn matmul(
        &self,
        w: &CpuMatrix,
        x: &CpuBuf<f32>,
        n: usize,
        y: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        ensure(
            "matmul",
            x.len() >= n * w.cols && y.len() >= n * w.rows,
            || format!("x {} / y {} for {n} tokens", x.len(), y.len()),
        )?;
        let mut acts = self.acts();
        acts.quantize(w.kernel.act_type(), &x[..n * w.cols], w.cols);
        let y = &mut y[..n * w.rows];
        ops::matmul(w.kernel, w.data(), w.cols, w.rows, &acts, y);
        Ok(())
    }
    fn add_assign(&self, x: &mut CpuBuf<f32>, y: &CpuBuf<f32>) -> Result<(), BackendError> {
        ensure("add_assign", y.len() >= x.len(), || "lengths".into())?;
        x.iter_mut().zip(y.iter()).for_each(|(a, &b)| *a += b);
        Ok(())
    }
    fn add_bias(&self, x: &mut CpuBuf<f32>, bias: &CpuBuf<f32>) -> Result<(), BackendError> {
        let c = bias.len();
        ensure("add_bias", c > 0 && x.len().is_multiple_of(c), || {
            "lengths".into()
        })?;
        ops::add_bias(x, bias);
        Ok(())
    }
    fn rope_neox(
        &self,
        x: &mut CpuBuf<f32>,
        positions: &CpuBuf<i32>,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), BackendError> {
        hmoe_backend::host::rope_neox(x, positions, n_heads, head_dim, p)
    }
    fn kv_types(&self) -> &'static [GgmlType] {
        &KV_TYPES
    }
    fn kv_alloc(&self, layout: KvLayout) -> Result<KvRing<Cpu>, BackendError> {
        let cells = Cells::for_layout(&layout).ok_or(BackendError::UnsupportedType {
            ty: layout.ty,
            op: "kv_alloc",
        })?;
        let ring = Ring {
            cells: Mutex::new(cells),
            bytes: layout.bytes(),
        };
        Ok(KvRing {
            data: CpuBuf {
                data: Vec::new(),
                ring: Some(Box::new(ring)),
            },
            layout,
        })
    }
    fn kv_store(
        &self,
        src: &CpuBuf<f32>,
        ring: &mut KvRing<Cpu>,
        n_tokens: usize,
        pos0: usize,
    ) -> Result<(), BackendError> {
        let (w, n_cells) = (ring.layout.width, ring.layout.cells);
        ensure("kv_store", src.len() >= n_tokens * w && n_cells > 0, || {
            format!("{} values for {n_tokens} rows of {w}", src.len())
        })?;
        let mut cells = ring_cells(ring, "kv_store")?;
        // The CPU engine's `LayerCache::store`: one row per token, converted as `set_rows`.
        for (t, row) in src.chunks_exact(w).take(n_tokens).enumerate() {
            cells.store((pos0 + t) % n_cells * w, row);
        }
        Ok(())
    }
    fn attention(
        &self,
        p: &AttnParams,
        q: &CpuBuf<f32>,
        k: &KvRing<Cpu>,
        v: &KvRing<Cpu>,
        sinks: Option<&CpuBuf<f32>>,
        n_tokens: usize,
        pos0: usize,
        out: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        const OP: &str = "attention";
        let (nh, nkv, hd) = (p.n_head, p.n_head_kv, p.head_dim);
        let n_q = n_tokens * nh * hd;
        ensure(
            OP,
            nkv > 0
                && nh.is_multiple_of(nkv)
                && q.len() >= n_q
                && out.len() >= n_q
                && sinks.is_none_or(|s| s.len() >= nh)
                && [&k.layout, &v.layout]
                    .iter()
                    .all(|l| l.width == nkv * hd && l.cells == p.cells)
                && p.keys_seen(n_tokens, pos0) <= p.cells.max(usize::from(n_tokens == 0)),
            || format!("{p:?} over K {:?} / V {:?}", k.layout, v.layout),
        )?;
        if n_tokens == 0 {
            return Ok(());
        }
        let (q, out) = (&q[..n_q], &mut out[..n_q]);
        let mut kc = ring_cells(k, OP)?;
        let mut vc = ring_cells(v, OP)?;
        let ring = (p.cells, p.window, p.flash);
        match (p.value_chains, sinks) {
            // gpt-oss's attention: one value chain, sinks or not.
            (1, sinks) => {
                let shape = AttnShape {
                    n_head: nh,
                    n_head_kv: nkv,
                    head_dim: hd,
                    scale: p.scale,
                };
                let sinks = sinks.map(|s| &s[..nh]);
                with_layer(OP, &mut kc, Some(&mut vc), ring, |l| {
                    attention(l, &shape, q, pos0, sinks, out)
                })
            }
            // Llama-style blocks' and Qwen3-MoE's: `vec_dot`'s four chains, no sinks.
            (hmoe_backend::numerics::VEC_DOT_CHAINS, None) => {
                let shape = AttnLayout {
                    n_head: nh,
                    n_head_kv: nkv,
                    k_dim: hd,
                    v_dim: hd,
                    v_in_k: false,
                    scale: p.scale,
                };
                with_layer(OP, &mut kc, Some(&mut vc), ring, |l| {
                    attention_ext(l, &shape, q, pos0, out)
                })
            }
            (chains, sinks) => Err(BackendError::Unsupported {
                op: OP,
                what: format!(
                    "{chains} value chains with{} sinks",
                    if sinks.is_some() { "" } else { "out" }
                ),
            }),
        }
    }
    fn router_top_k(
        &self,
        logits: &CpuBuf<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut CpuBuf<i32>,
        weights: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        ensure(
            "router_top_k",
            n_expert > 0 && k > 0 && k <= n_expert && logits.len().is_multiple_of(n_expert),
            || "shape".into(),
        )?;
        let n = logits.len() / n_expert;
        ensure(
            "router_top_k",
            selected.len() >= n * k && weights.len() >= n * k,
            || "lengths".into(),
        )?;
        // The CPU engine's gpt-oss routing: top-k, then the softmax over the chosen scores.
        let (mut top, mut w) = (Vec::with_capacity(n_expert), Vec::with_capacity(k));
        for (t, row) in logits.chunks_exact(n_expert).enumerate() {
            hmoe_backend::routing::top_k(row, k, &mut top);
            w.clear();
            w.extend(top.iter().map(|&e| row[e]));
            ops::softmax(&mut w);
            for (j, (&e, &wv)) in top.iter().zip(&w).enumerate() {
                selected[t * k + j] = e as i32;
                weights[t * k + j] = wv;
            }
        }
        Ok(())
    }
    fn moe(
        &self,
        w: &CpuMoe,
        act: GatedAct,
        x: &CpuBuf<f32>,
        selected: &CpuBuf<i32>,
        weights: &CpuBuf<f32>,
        k: usize,
        out: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        const OP: &str = "moe";
        let (d, ff, n_expert) = (w.d, w.ff, w.stored.len());
        ensure(OP, k > 0 && x.len().is_multiple_of(d), || {
            format!("x {} for rows of {d}, {k} slots", x.len())
        })?;
        let n = x.len() / d;
        ensure(
            OP,
            selected.len() >= n * k && weights.len() >= n * k && out.len() >= n * d,
            || "lengths".into(),
        )?;
        let (h, wts, out) = (&x[..], &weights[..n * k], &mut out[..n * d]);
        let err = |e: experts::ExpertDeviceError| BackendError::Shape {
            op: OP,
            what: e.to_string(),
        };
        // The CPU engine's expert sum over the whole batch (the executor splits the batch
        // where the order of the products depends on it).
        match act {
            GatedAct::Silu => {
                let sel: Vec<usize> = selected[..n * k]
                    .iter()
                    .map(|&e| usize::try_from(e).unwrap_or(usize::MAX))
                    .collect();
                let mut acts = QuantizedActs::default();
                let y = experts::moe_swiglu(
                    &w.kernels,
                    (d, ff, n_expert),
                    |e| w.view(e),
                    h,
                    &sel,
                    wts,
                    k,
                    &mut acts,
                );
                out.copy_from_slice(&y);
                Ok(())
            }
            GatedAct::ClampedSwiglu { .. } => {
                // gpt-oss's kernels refuse ids outside the set rather than skip them.
                let sel: Vec<u32> = selected[..n * k]
                    .iter()
                    .map(|&e| u32::try_from(e).unwrap_or(u32::MAX))
                    .collect();
                let whole = 0..n;
                let batch = ExpertBatch {
                    h,
                    selected: &sel,
                    weights: wts,
                    n_used: k,
                    groups: std::slice::from_ref(&whole),
                };
                let mut scratch = self.experts.lock().unwrap_or_else(PoisonError::into_inner);
                experts::expert_sum(
                    0,
                    &w.kernels,
                    act,
                    (d, ff, n_expert),
                    &batch,
                    |e| w.view(e),
                    &mut scratch,
                    out,
                )
                .map_err(err)
            }
        }
    }
    fn copy_rows(
        &self,
        src: &CpuBuf<f32>,
        dst: &mut CpuBuf<f32>,
        c: &RowCopy,
    ) -> Result<(), BackendError> {
        hmoe_backend::host::copy_rows(src, dst, c)
    }
    fn rope_norm(
        &self,
        x: &mut CpuBuf<f32>,
        positions: &CpuBuf<i32>,
        n_heads: usize,
        head_dim: usize,
        first: usize,
        p: &RopeParams,
    ) -> Result<(), BackendError> {
        hmoe_backend::host::rope_norm(x, positions, n_heads, head_dim, first, p)
    }
    fn matmul_heads(
        &self,
        w: &CpuMatrix,
        x: &CpuBuf<f32>,
        n: usize,
        n_heads: usize,
        x_stride: usize,
        y: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        let out = hmoe_backend::shapes::matmul_heads(
            w.rows,
            w.cols,
            n,
            n_heads,
            x_stride,
            x.len(),
            y.len(),
        )?;
        // As the CPU engine's MLA: per head, the head's inputs of every token gathered, then
        // `matmul` (whole rows) or `matmul_vec_dot` (a non-contiguous activation).
        let mut acts = self.acts();
        let mut xs = vec![0f32; n * w.cols];
        let mut ys = vec![0f32; n * out];
        let head_bytes = out * w.row_bytes;
        for h in 0..n_heads {
            for (t, dst) in xs.chunks_exact_mut(w.cols).enumerate() {
                dst.copy_from_slice(&x[(t * n_heads + h) * x_stride..][..w.cols]);
            }
            acts.quantize(w.kernel.act_type(), &xs, w.cols);
            let wh = &w.data()[h * head_bytes..(h + 1) * head_bytes];
            match x_stride == w.cols {
                true => ops::matmul(w.kernel, wh, w.cols, out, &acts, &mut ys),
                false => ops::matmul_vec_dot(w.kernel, wh, w.cols, out, &acts, &mut ys),
            }
            for (t, src) in ys.chunks_exact(out).enumerate() {
                y[(t * n_heads + h) * out..][..out].copy_from_slice(src);
            }
        }
        Ok(())
    }
    fn swiglu(
        &self,
        gate: &mut CpuBuf<f32>,
        up: &CpuBuf<f32>,
        n: usize,
    ) -> Result<(), BackendError> {
        hmoe_backend::shapes::swiglu(gate.len(), up.len(), n)?;
        ops::swiglu(gate, up, n);
        Ok(())
    }
    fn k_only_types(&self) -> &'static [GgmlType] {
        // The CPU engine's latent cache in every `-ctk` type, never rotated (the executor's
        // K-only layouts have rotation 0).
        &KV_TYPES
    }
    fn attention_k_only(
        &self,
        p: &KOnlyAttnParams,
        q: &CpuBuf<f32>,
        k_ring: &KvRing<Cpu>,
        n_tokens: usize,
        pos0: usize,
        out: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        const OP: &str = "attention_k_only";
        hmoe_backend::shapes::attention_k_only(
            p,
            q.len(),
            &k_ring.layout,
            out.len(),
            n_tokens,
            pos0,
        )?;
        if n_tokens == 0 {
            return Ok(());
        }
        let shape = AttnLayout {
            n_head: p.n_head,
            n_head_kv: 1,
            k_dim: p.k_dim,
            v_dim: p.v_dim,
            v_in_k: true,
            scale: p.scale,
        };
        let q = &q[..n_tokens * p.n_head * p.k_dim];
        let out = &mut out[..n_tokens * p.n_head * p.v_dim];
        let mut kc = ring_cells(k_ring, OP)?;
        // DeepSeek's latent cache: values inside the keys, the row kernel whatever `-fa` says.
        with_layer(OP, &mut kc, None, (p.cells, None, false), |l| {
            attention_ext(l, &shape, q, pos0, out)
        })
    }
    fn route(
        &self,
        logits: &CpuBuf<f32>,
        bias: Option<&CpuBuf<f32>>,
        gating: Gating,
        routing: &Routing,
        n_expert: usize,
        selected: &mut CpuBuf<i32>,
        weights: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        let bias = bias.map(|b| &b[..]);
        hmoe_backend::host::route(logits, bias, gating, routing, n_expert, selected, weights)
    }
    fn staging(&self, n_d: usize, n_k: usize) -> Result<HostStaging, BackendError> {
        Ok(HostStaging::new(n_d, n_k))
    }
    fn stage_down(
        &self,
        st: &mut HostStaging,
        h: &CpuBuf<f32>,
        sel: &CpuBuf<i32>,
        w: &CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        st.fill(h, sel, w)
    }
    fn staged<'s>(&self, st: &'s mut HostStaging) -> Result<StagedIo<'s>, BackendError> {
        Ok(st.io())
    }
    fn stage_up(&self, st: &HostStaging, out: &mut CpuBuf<f32>) -> Result<(), BackendError> {
        st.send_up(out).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// `populate` leaves every byte as it was, whatever the buffer's alignment and size, on
    /// fresh zeroed memory (the interleaved copy's case) and on written memory, and the
    /// memory stays writable.
    #[test]
    fn populate_keeps_contents() {
        let mut fresh = vec![0u8; 64 << 20];
        populate(&mut fresh[100..]);
        assert!(fresh.iter().all(|&b| b == 0));
        fresh[(64 << 20) - 1] = 1;
        let mut written: Vec<u8> = (0..3 * 4096 + 100).map(|i| i as u8).collect();
        populate(&mut written[1..]);
        populate(&mut written[5..9]);
        populate(&mut []);
        assert!(written.iter().enumerate().all(|(i, &b)| b == i as u8));
    }

    #[test]
    fn shared_weights_are_kept_in_place_and_multiply_like_a_copy() {
        let (rows, cols) = (3, 32);
        let vals: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.1).sin()).collect();
        let mut q = vec![0u8; GgmlType::Q8_0.row_bytes((rows * cols) as u64).unwrap() as usize];
        hmoe_quant::quantize_row(GgmlType::Q8_0, &vals, &mut q).unwrap();
        let owner: Arc<Vec<u8>> = Arc::new(q.clone());
        let shared = SharedBytes::new(owner.clone(), 0..q.len()).unwrap();
        let cpu = Cpu::new();
        let m = cpu
            .upload_matrix_shared(GgmlType::Q8_0, rows, cols, &shared)
            .unwrap();
        assert_eq!(m.data().as_ptr(), owner.as_ptr(), "no copy of the weights");
        let copy = cpu.upload_matrix(GgmlType::Q8_0, rows, cols, &q).unwrap();
        assert_ne!(copy.data().as_ptr(), owner.as_ptr());
        let x = cpu.upload(&vals[..2 * cols]).unwrap();
        let (mut a, mut b) = (cpu.alloc(2 * rows).unwrap(), cpu.alloc(2 * rows).unwrap());
        cpu.matmul(&m, &x, 2, &mut a).unwrap();
        cpu.matmul(&copy, &x, 2, &mut b).unwrap();
        assert_eq!(cpu.download(&a).unwrap(), cpu.download(&b).unwrap());
        assert!(cpu
            .upload_matrix_shared(GgmlType::Q8_0, rows + 1, cols, &shared)
            .is_err());
    }

    #[test]
    fn shared_expert_sets_are_kept_in_place_and_sum_like_a_copy() {
        let (d, n_expert) = (32usize, 3usize);
        let row = GgmlType::Q8_0.row_bytes(d as u64).unwrap() as usize;
        let mut data = vec![0u8; n_expert * d * row];
        for (i, r) in data.chunks_exact_mut(row).enumerate() {
            let vals: Vec<f32> = (0..d)
                .map(|j| ((i * 7 + j * 3) % 11) as f32 * 0.1 - 0.5)
                .collect();
            hmoe_quant::quantize_row(GgmlType::Q8_0, &vals, r).unwrap();
        }
        let owner: Arc<Vec<u8>> = Arc::new(data.clone());
        let shared = SharedBytes::new(owner.clone(), 0..data.len()).unwrap();
        let bias: Vec<f32> = (0..n_expert * d).map(|i| i as f32 * 0.01).collect();
        let m = ExpertMatrix {
            ty: GgmlType::Q8_0,
            n_in: d,
            n_out: d,
            data: &data,
        };
        let t = ExpertTensors {
            n_expert,
            gate: m,
            up: m,
            down: m,
            gate_bias: &bias,
            up_bias: &bias,
            down_bias: &bias,
        };
        let cpu = Cpu::new();
        let three = [shared.clone(), shared.clone(), shared];
        let ids = [2usize, 0];
        let kept = cpu.upload_moe_shared(&t, &three, Some(&ids)).unwrap();
        let copy = cpu.upload_moe(&t, Some(&ids)).unwrap();
        let expert_bytes = d * row;
        let kept_gate = kept.view(0).unwrap().gate.as_ptr();
        assert_eq!(kept_gate, owner[2 * expert_bytes..].as_ptr(), "no copy");
        assert_eq!(Cpu::moe_bytes(&kept), Cpu::moe_bytes(&copy));
        let x: Vec<f32> = (0..2 * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let x = cpu.upload(&x).unwrap();
        let sel = cpu.upload(&[0i32, 1, 1, 0]).unwrap();
        let wts = cpu.upload(&[0.6f32, 0.4, 0.7, 0.3]).unwrap();
        for act in [
            GatedAct::Silu,
            GatedAct::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            },
        ] {
            let (mut a, mut b) = (cpu.alloc(2 * d).unwrap(), cpu.alloc(2 * d).unwrap());
            cpu.moe(&kept, act, &x, &sel, &wts, 2, &mut a).unwrap();
            cpu.moe(&copy, act, &x, &sel, &wts, 2, &mut b).unwrap();
            let (a, b) = (cpu.download(&a).unwrap(), cpu.download(&b).unwrap());
            assert!(a.iter().any(|&v| v != 0.0), "{act:?}");
            assert_eq!(a, b, "{act:?}");
        }
        assert!(cpu.upload_moe(&t, Some(&[3])).is_err());
    }

    /// MXFP4 experts interleaved for the AVX2/AVX-512 kernels (copies, shared or not, any subset of
    /// experts) sum to the same bits as the file's layout, for one token (the decode path) and
    /// a batch, with both activations.
    #[test]
    fn interleaved_mxfp4_experts_sum_like_the_files_layout() {
        let (d, ff, n_expert) = (64usize, 96usize, 4usize);
        let mut rnd = Stream(0x1667);
        let mut mat = |rows: usize, cols: usize| -> Vec<u8> {
            let vals: Vec<f32> = (0..n_expert * rows * cols)
                .map(|_| rnd.value(1.0))
                .collect();
            let mut q = vec![0u8; GgmlType::MXFP4.row_bytes(cols as u64).unwrap() as usize];
            q.resize(q.len() * n_expert * rows, 0);
            hmoe_quant::quantize_row(GgmlType::MXFP4, &vals, &mut q).unwrap();
            q
        };
        let (gate, up, down) = (mat(ff, d), mat(ff, d), mat(d, ff));
        let bias: Vec<f32> = (0..n_expert * ff).map(|i| (i % 7) as f32 * 0.01).collect();
        let m = |data, n_in, n_out| ExpertMatrix {
            ty: GgmlType::MXFP4,
            n_in,
            n_out,
            data,
        };
        let t = ExpertTensors {
            n_expert,
            gate: m(&gate, d, ff),
            up: m(&up, d, ff),
            down: m(&down, ff, d),
            gate_bias: &bias,
            up_bias: &bias,
            down_bias: &bias[..n_expert * d],
        };
        let shared = [&gate, &up, &down].map(|v| {
            let owner = Arc::new(v.clone());
            SharedBytes::new(owner, 0..v.len()).unwrap()
        });
        let (on, off) = (
            Cpu::with_expert_interleaving(true),
            Cpu::with_expert_interleaving(false),
        );
        let ids = [3usize, 1, 2];
        let sets = [
            on.upload_moe_shared(&t, &shared, Some(&ids)).unwrap(),
            on.upload_moe(&t, Some(&ids)).unwrap(),
            off.upload_moe_shared(&t, &shared, Some(&ids)).unwrap(),
        ];
        let interleaved = hmoe_quant::GemmKernel::interleaved(hmoe_quant::Isa::best()).is_some();
        let first_gate = sets[0].view(0).unwrap().gate;
        assert_eq!(first_gate != t.gate.expert(3).unwrap(), interleaved);
        assert_eq!(Cpu::moe_bytes(&sets[0]), Cpu::moe_bytes(&sets[2]));
        for n in [1usize, 5] {
            let x: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.37).sin()).collect();
            let x = off.upload(&x).unwrap();
            let sel: Vec<i32> = (0..2 * n as i32).map(|i| (i * 5 + 1) % 3).collect();
            let sel = off.upload(&sel).unwrap();
            let wts: Vec<f32> = (0..2 * n).map(|i| 0.3 + (i % 3) as f32 * 0.2).collect();
            let wts = off.upload(&wts).unwrap();
            for act in [
                GatedAct::Silu,
                GatedAct::ClampedSwiglu {
                    alpha: 1.702,
                    limit: 7.0,
                },
            ] {
                let outs: Vec<Vec<f32>> = sets
                    .iter()
                    .map(|set| {
                        let mut y = off.alloc(n * d).unwrap();
                        off.moe(set, act, &x, &sel, &wts, 2, &mut y).unwrap();
                        off.download(&y).unwrap()
                    })
                    .collect();
                assert!(outs[2].iter().any(|&v| v != 0.0), "{act:?}");
                for o in &outs[..2] {
                    let same = o
                        .iter()
                        .zip(&outs[2])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "n={n} {act:?}");
                }
            }
        }
    }

    /// A deterministic stream of pseudo-random values (xorshift64*).
    struct Stream(u64);

    impl Stream {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        /// A value uniform in `[-scale, scale)`.
        fn value(&mut self, scale: f32) -> f32 {
            ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        }
    }

    /// `rows × cols` weights of a type REF0 multiplies with hmoe-quant's kernels: the legacy
    /// types quantized from noise, the K-quants random bytes with small f16 scales.
    fn quant_weights(s: &mut Stream, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
        let rb = ty.row_bytes(cols as u64).unwrap() as usize;
        let mut q = vec![0u8; rows * rb];
        // The byte offsets of a K-quant super-block's f16 scales (d, and dmin where it has one).
        let scales: &[usize] = match ty {
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            GgmlType::Q6_K => &[208],
            _ => {
                for row in q.chunks_exact_mut(rb) {
                    let vals: Vec<f32> = (0..cols).map(|_| s.value(1.0)).collect();
                    hmoe_quant::quantize_row(ty, &vals, row).unwrap();
                }
                return q;
            }
        };
        q.iter_mut().for_each(|b| *b = s.next() as u8);
        for block in q.chunks_exact_mut(ty.block_bytes()) {
            for &at in scales {
                let v = half::f16::from_f32(0.001 + s.value(1.0).abs() * 0.009);
                block[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        q
    }

    /// REF0's per-head products of the types it multiplies with hmoe-quant's kernels (MLA's
    /// `attn_k_b`/`attn_v_b` in low-bit files) are the CPU's bits: contiguous inputs (each
    /// head's batch in `matmul`'s order: repacked Q4_0/Q4_K for a matrix of rows in multiples
    /// of 8, the grouped Q4_K order from 4 tokens, tiled K-quants from 8) and strided ones
    /// (`vec_dot`'s order), one token and batches.
    #[test]
    fn ref0_matmul_heads_of_quant_kernel_types_is_the_cpus_bits() {
        let mut s = Stream(0x9e37_79b9_7f4a_7c15);
        let (cpu, ref0) = (Cpu::new(), hmoe_backend::Ref0::new());
        for ty in hmoe_backend::QUANT_KERNEL_TYPES {
            let cols = ty.block_elems().max(64);
            // 3 heads of 8 rows (a multiple of 8 in all), and 3 of 5.
            for (nh, out) in [(3, 8), (3, 5)] {
                let q = quant_weights(&mut s, ty, nh * out, cols);
                let mc = cpu.upload_matrix(ty, nh * out, cols, &q).unwrap();
                let mr = ref0.upload_matrix(ty, nh * out, cols, &q).unwrap();
                for (stride, n) in [
                    (cols, 1),
                    (cols, 5),
                    (cols, 9),
                    (cols + 32, 1),
                    (cols + 32, 9),
                ] {
                    let x: Vec<f32> = (0..n * nh * stride).map(|_| s.value(3.0)).collect();
                    let mut yc = cpu.alloc::<f32>(n * nh * out).unwrap();
                    let xc = cpu.upload(&x).unwrap();
                    cpu.matmul_heads(&mc, &xc, n, nh, stride, &mut yc).unwrap();
                    let mut yr = ref0.alloc::<f32>(n * nh * out).unwrap();
                    let xr = ref0.upload(&x).unwrap();
                    ref0.matmul_heads(&mr, &xr, n, nh, stride, &mut yr).unwrap();
                    let (want, got) = (cpu.download(&yc).unwrap(), ref0.download(&yr).unwrap());
                    let what = format!("{ty} {nh}x{out}x{cols} stride {stride} n {n}");
                    assert!(want.iter().all(|v| v.is_finite()), "{what}: finite");
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{what}");
                }
            }
        }
    }

    #[test]
    fn rings_store_as_the_cpu_cache_and_download_its_bytes() {
        let cpu = Cpu::new();
        let layout = KvLayout::new(GgmlType::F16, 4, 2, 0).unwrap();
        let mut ring = cpu.kv_alloc(layout).unwrap();
        assert_eq!(Cpu::buf_len(&ring.data), layout.bytes());
        let src = cpu
            .upload(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
            .unwrap();
        // Positions 1 and 2 go to cells 1 and 0.
        cpu.kv_store(&src, &mut ring, 2, 1).unwrap();
        let bytes = cpu.download(&ring.data).unwrap();
        let f16_at = |i: usize| half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
        assert_eq!(f16_at(0).to_f32(), 5.0);
        assert_eq!(f16_at(4).to_f32(), 1.0);
        let mut not_a_ring = KvRing {
            data: cpu.alloc::<u8>(layout.bytes()).unwrap(),
            layout,
        };
        assert!(cpu.kv_store(&src, &mut not_a_ring, 2, 0).is_err());
    }
}
