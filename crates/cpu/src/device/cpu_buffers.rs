//! What the CPU device holds: buffers (host vectors, K/V rings of the CPU's cache storage),
//! weight matrices and expert sets kept in the file mapping or copied, and the host memory
//! they may take.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use hmoe_backend::{BackendError, ExpertMatrix, ExpertTensors, ExpertView, SharedBytes};
use hmoe_quant::{DotKernel, GemmKernel, GgmlType};

use crate::experts::ExpertKernels;
use crate::kv_storage::Cells;

/// A buffer of the CPU device: a host vector, or (for a K/V ring) the CPU device's cache
/// storage of the ring's type.
pub struct CpuBuf<T> {
    pub(super) data: Vec<T>,
    pub(super) ring: Option<Box<Ring>>,
}

/// A K/V ring's storage and its size in bytes.
pub(super) struct Ring {
    pub(super) cells: Mutex<Cells>,
    pub(super) bytes: usize,
}

impl<T> CpuBuf<T> {
    pub(super) fn host(data: Vec<T>) -> CpuBuf<T> {
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
pub(super) enum MatrixBytes {
    /// A copy (bytes uploaded without an owner).
    Owned(Vec<u8>),
    /// The file mapping, kept alive by the handle.
    Shared(SharedBytes),
}

/// A weight matrix in its file encoding, with the CPU device's kernel for it.
pub struct CpuMatrix {
    pub(super) ty: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) row_bytes: usize,
    pub(super) bytes: MatrixBytes,
    pub(super) kernel: DotKernel,
}

impl CpuMatrix {
    pub(super) fn data(&self) -> &[u8] {
        match &self.bytes {
            MatrixBytes::Owned(v) => v,
            MatrixBytes::Shared(s) => s.bytes(),
        }
    }

    pub(super) fn row(&self, r: usize) -> &[u8] {
        &self.data()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
}

/// One stacked expert matrix of an expert set: its shape and where its bytes live.
pub(super) struct StackedBytes {
    pub(super) ty: GgmlType,
    pub(super) n_in: usize,
    pub(super) n_out: usize,
    pub(super) bytes: MatrixBytes,
}

impl StackedBytes {
    pub(super) fn matrix(&self) -> ExpertMatrix<'_> {
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
/// place, or a copy of the chosen experts), the chosen experts' biases, and the CPU device's
/// kernels for the matrices.
pub struct CpuMoe {
    pub(super) d: usize,
    pub(super) ff: usize,
    /// Expert `e` of the set is expert `stored[e]` of the stacked matrices.
    pub(super) stored: Vec<usize>,
    /// Gate, up and down.
    pub(super) mats: [StackedBytes; 3],
    /// Gate, up and down biases of the set's experts in set order (empty: none).
    pub(super) biases: [Vec<f32>; 3],
    pub(super) kernels: ExpertKernels,
    pub(super) bytes: usize,
}

impl CpuMoe {
    /// Expert `e` of the set.
    pub(super) fn view(&self, e: usize) -> Option<ExpertView<'_>> {
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
pub(super) fn expert_set(
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
pub(super) fn interleaved_copy(
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
pub(super) fn populate(buf: &mut [u8]) {
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
pub(super) fn room_for_copy(bytes: usize) -> bool {
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
pub(super) static INTERLEAVE_EXPERTS: AtomicBool = AtomicBool::new(true);

/// Whether `Cpu` devices made after this call keep MXFP4 expert rows interleaved in groups
/// of 16 (a copy, where the CPU has the kernel and memory allows; faster products, the same
/// bits) or in the file's mapping: the process-wide default, `--no-repack` turns it off.
pub fn set_expert_interleaving(on: bool) {
    INTERLEAVE_EXPERTS.store(on, Ordering::Relaxed);
}

pub(super) fn ensure(
    op: &'static str,
    ok: bool,
    what: impl FnOnce() -> String,
) -> Result<(), BackendError> {
    match ok {
        true => Ok(()),
        false => Err(BackendError::Shape { op, what: what() }),
    }
}

/// The matrix `data` of `rows × cols` values of `ty`, checked, with its kernel.
pub(super) fn matrix(
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
