//! [`Ref0`]: the reference device, the ops of [`Backend`] in plain Rust on the host with the
//! semantics of hmoe's GPU kernels, behaving like a GPU: it owns copies of everything it is
//! given (weights in their file encoding, buffers), within a byte budget (`--gpu-mem`), and
//! counts every host ↔ device transfer and every allocation of its memory. Scratch buffers
//! ([`Backend::alloc_scratch`]) come filled with [`Elem::POISON`] (NaN for f32), so that an
//! op or an executor relying on zeros in them fails its tests. It is selectable from the command line as `REF0`
//! (`-dev REF0`) so that every placement path runs on a machine without a GPU; it is a testing
//! device, not a fast path. In replay mode ([`Ref0::with_replay`]) it records the segments
//! of a step and replays them as a CUDA graph would (`ref0/ref0_replay.rs`).
//!
//! The numerics are the CPU device's (ggml's CPU backend's), step for step as the CUDA kernels
//! compute them, so that on the gpt-oss fixtures its logits are the CPU device's bit for bit:
//!
//! - Products (`matmul` and the experts): each activation row is converted once to ggml's
//!   `vec_dot_type` of the weights ([`hmoe_quant::vec_dot_type`]): Q8_0 blocks for Q8_0 and
//!   MXFP4 weights ([`hmoe_quant::quantize_row`]), f16- or bf16-rounded values for F16 or
//!   BF16 weights, f32 for F32. Q8_0 products sum in ggml's `vec_dot` order (`dot_q8_0`),
//!   MXFP4 in llama.cpp's block-wise order (`dot_mxfp4`), F32 in `vec_dot_f32` order for one
//!   token (and for an expert only one slot routes to, and for every SiLU expert), else in
//!   tinyBLAS's 16 lanes
//!   (`F32Order`). F16 and BF16 products sum in f64 here (not the CPU's order). The other
//!   types the CPU device loads (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K … Q6_K) are multiplied with
//!   hmoe-quant's own kernels, the one the CPU device picks for the matrix
//!   ([`hmoe_quant::DotKernel::for_matrix`], repacked Q4_0/Q4_K included), over activations
//!   quantized by [`hmoe_quant::quantize_row`]: `dot` for one token, `dot_tokens` (the tiled
//!   K-quant and grouped repacked orders) for a batch, exactly as the CPU device's `matmul`;
//!   the experts (`moe`) take them too, each expert's rows multiplied together in the order
//!   of the CPU device's expert matmul (`BatchKind::Expert`: tiled K-quants from 8 rows routed
//!   to the expert), and an expert set's gate, up and down may be of different types (as in
//!   Q4_K_M files); `matmul_heads` multiplies each head's rows with the head's inputs of
//!   every token together, as the CPU device's MLA does (`dot_tokens` of the `Dense` kind for contiguous
//!   inputs, of the `Expert` kind, `vec_dot`'s order, for strided ones).
//! - The experts (`moe`) run as the CPU device's host experts do: each expert's routed rows
//!   together, then every token's slot outputs weighted and added in slot order from zero.
//! - K/V rings of every type of [`crate::KV_TYPES`] are stored and attended over as the CPU
//!   engine's cache and attention do (see `ref0_kv.rs`): the row kernel with ggml's `expf`
//!   ([`crate::numerics::expf_ggml`]) over f32/f16/bf16 values, flash attention over
//!   block-quantized ones; K-only (latent) rings of every type with the row kernel, values
//!   read from the keys.
//! - The router's softmax and the gated activation call f32 `exp` (libm), as the CPU device
//!   does.

mod ref0_memory;
mod ref0_op_log;
mod ref0_products;
mod ref0_replay;

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hmoe_quant::GgmlType;

use crate::error::ensure;
use crate::{AttnParams, Gating, HostStaging, KOnlyAttnParams, RopeParams, Routing, RowCopy};
use crate::{
    Backend, BackendError, Elem, ExpertMatrix, ExpertTensors, GatedAct, KvRing, StagedIo,
    TransferCounts,
};

use ref0_memory::{Charge, Memory};
pub use ref0_memory::{RefBuf, RefMatrix, RefMoe};
use ref0_op_log::OpLog;
pub use ref0_op_log::Ref0Event;
use ref0_products::{
    acts, expert_products, kernel_products, kernel_products_of, matrix, row_dot, F32Order,
};
pub use ref0_products::{QUANT_KERNEL_TYPES, REF0_TYPES};
pub use ref0_replay::ReplayStats;
use ref0_replay::{Ident, Replay};

/// The reference device's name in device lists and messages.
pub const REF0_NAME: &str = "REF0";

/// What the reference device keeps and computes: every weight type of [`REF0_TYPES`] and every
/// K/V type of the contract, in pairs and K-only rings alike.
pub const REF0_CAPABILITIES: crate::Capabilities = crate::Capabilities {
    weight_types: &REF0_TYPES,
    kv_types: &crate::KV_TYPES,
    kv_pair_types: &crate::KV_TYPES,
    k_only_types: &crate::KV_TYPES,
    rope_freq_factors: true,
};

/// The reference device `REF0` (see the module docs).
pub struct Ref0 {
    mem: Arc<Memory>,
    counts: Mutex<TransferCounts>,
    trips: Mutex<u64>,
    allocations: AtomicU64,
    /// Segments recorded and replayed ([`Ref0::with_replay`]).
    replay: Replay,
    /// The order of ops and round trips ([`Ref0::with_op_log`]).
    log: OpLog,
}

/// A buffer as a recording names it.
fn id<T>(b: &RefBuf<T>) -> Ident {
    (b.data.as_ptr() as usize, b.data.len())
}

/// An optional buffer as a recording names it (none: address 0).
fn id_opt<T>(b: Option<&RefBuf<T>>) -> Ident {
    b.map_or((0, 0), id)
}

/// A matrix as a recording names it.
fn mat_id(m: &RefMatrix) -> Ident {
    (m.data.as_ptr() as usize, m.data.len())
}

impl Default for Ref0 {
    fn default() -> Self {
        Ref0::new()
    }
}

impl Ref0 {
    /// A reference device without a memory limit.
    pub fn new() -> Ref0 {
        Ref0::with_budget_opt(None)
    }

    /// A reference device with `bytes` of memory: an allocation beyond it is
    /// [`BackendError::OutOfMemory`], and [`Backend::free_memory`] reports what is left.
    pub fn with_budget(bytes: u64) -> Ref0 {
        Ref0::with_budget_opt(Some(bytes))
    }

    fn with_budget_opt(budget: Option<u64>) -> Ref0 {
        Ref0 {
            mem: Arc::new(Memory {
                budget,
                held: Mutex::new((0, 0)),
            }),
            counts: Mutex::new(TransferCounts::default()),
            trips: Mutex::new(0),
            allocations: AtomicU64::new(0),
            replay: Replay::new(false),
            log: OpLog::new(false),
        }
    }

    /// This device in replay mode: the segments of a step ([`Backend::begin_segment`]) are
    /// recorded the first time their key is seen and replayed after, with the recording's
    /// by-value arguments, as a CUDA graph replays its kernels (see `ref0_replay.rs`), so
    /// that a value a graph would freeze changes the results here.
    pub fn with_replay(self) -> Ref0 {
        Ref0 {
            replay: Replay::new(true),
            ..self
        }
    }

    /// This device with an op log: every op queued and every round trip's copy down, wait
    /// and copy up, in order ([`Ref0::take_op_log`]; `ref0/ref0_op_log.rs`).
    pub fn with_op_log(self) -> Ref0 {
        Ref0 {
            log: OpLog::new(true),
            ..self
        }
    }

    /// The op log since the last call (empty unless [`Ref0::with_op_log`]).
    pub fn take_op_log(&self) -> Vec<Ref0Event> {
        self.log.take()
    }

    /// An op `op` over `bufs` with the by-value arguments `scalars`, logged, through the
    /// replay mode (the arguments it runs with: [`Replay::op`]).
    fn op<S: Clone + PartialEq + Send + 'static>(
        &self,
        op: &'static str,
        bufs: &[Ident],
        scalars: S,
    ) -> Result<S, BackendError> {
        self.log.note(Ref0Event::Op(op));
        self.replay.op(op, bufs, scalars)
    }

    /// What replay mode counted (all zero when it is off).
    pub fn replay_stats(&self) -> ReplayStats {
        self.replay.stats()
    }

    /// The memory budget (`None`: unlimited).
    pub fn budget(&self) -> Option<u64> {
        self.mem.budget
    }

    /// Bytes of device memory held now.
    pub fn bytes_held(&self) -> u64 {
        self.mem.lock().0
    }

    /// The most bytes of device memory held at once so far.
    pub fn peak_bytes(&self) -> u64 {
        self.mem.lock().1
    }

    /// Round trips staged so far (calls of `stage_down`).
    pub fn round_trips(&self) -> u64 {
        *self.trips.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Allocations of device memory so far: every buffer (uploaded, zeroed, scratch, or a
    /// copy), K/V ring, matrix and expert set, each counted once when it is made.
    pub fn allocations(&self) -> u64 {
        self.allocations.load(Ordering::Relaxed)
    }

    /// Takes `bytes` of device memory for `what` (one allocation), or
    /// [`BackendError::OutOfMemory`].
    fn charge(&self, what: &'static str, bytes: u64) -> Result<Charge, BackendError> {
        self.replay.outside("an allocation")?;
        let mut h = self.mem.lock();
        if let Some(total) = self.mem.budget {
            let free = total.saturating_sub(h.0);
            if bytes > free {
                return Err(BackendError::OutOfMemory {
                    device: REF0_NAME.into(),
                    what,
                    requested: bytes,
                    free,
                    total,
                });
            }
        }
        h.0 += bytes;
        h.1 = h.1.max(h.0);
        self.allocations.fetch_add(1, Ordering::Relaxed);
        Ok(Charge {
            mem: Arc::clone(&self.mem),
            bytes,
        })
    }

    /// A device buffer of `data` (charged).
    fn buf<T: Elem>(&self, what: &'static str, data: Vec<T>) -> Result<RefBuf<T>, BackendError> {
        let charge = self.charge(what, (data.len() * T::BYTES) as u64)?;
        Ok(RefBuf {
            data,
            _charge: charge,
        })
    }

    fn count(&self) -> MutexGuard<'_, TransferCounts> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn count_up(&self, bytes: usize) -> Result<(), BackendError> {
        self.replay.outside("an upload")?;
        let mut c = self.count();
        c.uploads += 1;
        c.upload_bytes += bytes as u64;
        Ok(())
    }

    fn count_down(&self, bytes: usize) -> Result<(), BackendError> {
        self.replay.outside("a download")?;
        let mut c = self.count();
        c.downloads += 1;
        c.download_bytes += bytes as u64;
        Ok(())
    }

    fn upload_any<T: Elem>(&self, src: &[T]) -> Result<RefBuf<T>, BackendError> {
        let b = self.buf("upload", src.to_vec())?;
        self.count_up(std::mem::size_of_val(src))?;
        Ok(b)
    }

    fn alloc_any<T: Elem>(&self, len: usize) -> Result<RefBuf<T>, BackendError> {
        self.buf("alloc", vec![T::default(); len])
    }

    fn scratch_any<T: Elem>(&self, len: usize) -> Result<RefBuf<T>, BackendError> {
        self.buf("alloc_scratch", vec![T::POISON; len])
    }

    fn upload_into_any<T: Elem>(&self, dst: &mut RefBuf<T>, src: &[T]) -> Result<(), BackendError> {
        crate::check_upload_into(src.len(), dst.data.len())?;
        self.count_up(std::mem::size_of_val(src))?;
        dst.data.copy_from_slice(src);
        Ok(())
    }

    /// Attention from position `pos0` (after the replay hook of `attention` or `attention_at`).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        p: &AttnParams,
        q: &RefBuf<f32>,
        k: &KvRing<Ref0>,
        v: &KvRing<Ref0>,
        sinks: Option<&RefBuf<f32>>,
        n_tokens: usize,
        pos0: usize,
        out: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        crate::ref0_kv::attention(
            p,
            q,
            (&k.layout, &k.data),
            (&v.layout, &v.data),
            sinks.map(|s| &s[..]),
            n_tokens,
            pos0,
            out,
        )
    }

    /// K-only attention from position `pos0` (after the replay hook).
    fn attend_k_only(
        &self,
        p: &KOnlyAttnParams,
        q: &RefBuf<f32>,
        k_ring: &KvRing<Ref0>,
        n_tokens: usize,
        pos0: usize,
        out: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        crate::shapes::attention_k_only(p, q.len(), &k_ring.layout, out.len(), n_tokens, pos0)?;
        crate::ref0_kv::attention_k_only(p, q, (&k_ring.layout, &k_ring.data), n_tokens, pos0, out)
    }

    fn download_any<T: Elem>(&self, src: &RefBuf<T>) -> Result<Vec<T>, BackendError> {
        self.count_down(src.data.len() * T::BYTES)?;
        Ok(src.data.clone())
    }
}

fn shape(op: &'static str, ok: bool, what: impl FnOnce() -> String) -> Result<(), BackendError> {
    ensure(ok, op, what)
}

impl Backend for Ref0 {
    type Buf<T: Elem> = RefBuf<T>;
    type Matrix = RefMatrix;
    type Moe = RefMoe;
    type Staging = HostStaging;

    fn name(&self) -> String {
        REF0_NAME.into()
    }
    fn free_memory(&self) -> Result<Option<u64>, BackendError> {
        Ok(self.mem.budget.map(|b| b.saturating_sub(self.bytes_held())))
    }
    fn transfers(&self) -> Option<TransferCounts> {
        Some(*self.count())
    }
    fn upload_f32(&self, src: &[f32]) -> Result<RefBuf<f32>, BackendError> {
        self.upload_any(src)
    }
    fn upload_i32(&self, src: &[i32]) -> Result<RefBuf<i32>, BackendError> {
        self.upload_any(src)
    }
    fn upload_u16(&self, src: &[u16]) -> Result<RefBuf<u16>, BackendError> {
        self.upload_any(src)
    }
    fn upload_u8(&self, src: &[u8]) -> Result<RefBuf<u8>, BackendError> {
        self.upload_any(src)
    }
    fn alloc_f32(&self, len: usize) -> Result<RefBuf<f32>, BackendError> {
        self.alloc_any(len)
    }
    fn alloc_i32(&self, len: usize) -> Result<RefBuf<i32>, BackendError> {
        self.alloc_any(len)
    }
    fn alloc_u16(&self, len: usize) -> Result<RefBuf<u16>, BackendError> {
        self.alloc_any(len)
    }
    fn alloc_u8(&self, len: usize) -> Result<RefBuf<u8>, BackendError> {
        self.alloc_any(len)
    }
    fn alloc_scratch_f32(&self, len: usize) -> Result<RefBuf<f32>, BackendError> {
        self.scratch_any(len)
    }
    fn alloc_scratch_i32(&self, len: usize) -> Result<RefBuf<i32>, BackendError> {
        self.scratch_any(len)
    }
    fn alloc_scratch_u16(&self, len: usize) -> Result<RefBuf<u16>, BackendError> {
        self.scratch_any(len)
    }
    fn alloc_scratch_u8(&self, len: usize) -> Result<RefBuf<u8>, BackendError> {
        self.scratch_any(len)
    }
    fn upload_into_f32(&self, dst: &mut RefBuf<f32>, src: &[f32]) -> Result<(), BackendError> {
        self.upload_into_any(dst, src)
    }
    fn upload_into_i32(&self, dst: &mut RefBuf<i32>, src: &[i32]) -> Result<(), BackendError> {
        self.upload_into_any(dst, src)
    }
    fn upload_into_u16(&self, dst: &mut RefBuf<u16>, src: &[u16]) -> Result<(), BackendError> {
        self.upload_into_any(dst, src)
    }
    fn upload_into_u8(&self, dst: &mut RefBuf<u8>, src: &[u8]) -> Result<(), BackendError> {
        self.upload_into_any(dst, src)
    }
    fn download_f32(&self, src: &RefBuf<f32>) -> Result<Vec<f32>, BackendError> {
        self.download_any(src)
    }
    fn download_i32(&self, src: &RefBuf<i32>) -> Result<Vec<i32>, BackendError> {
        self.download_any(src)
    }
    fn download_u16(&self, src: &RefBuf<u16>) -> Result<Vec<u16>, BackendError> {
        self.download_any(src)
    }
    fn download_u8(&self, src: &RefBuf<u8>) -> Result<Vec<u8>, BackendError> {
        self.download_any(src)
    }
    fn buf_len<T: Elem>(b: &RefBuf<T>) -> usize {
        b.data.len()
    }
    fn copy_range(
        &self,
        src: &RefBuf<f32>,
        range: Range<usize>,
    ) -> Result<RefBuf<f32>, BackendError> {
        let data = src
            .data
            .get(range.clone())
            .map(<[f32]>::to_vec)
            .ok_or_else(|| BackendError::Shape {
                op: "copy_range",
                what: format!("{range:?} of {}", src.data.len()),
            })?;
        self.buf("copy_range", data)
    }
    fn copy_into(
        &self,
        src: &RefBuf<f32>,
        dst: &mut RefBuf<f32>,
        at: usize,
    ) -> Result<(), BackendError> {
        let at = self.op("copy_into", &[id(src), id(dst)], at)?;
        let range = crate::copy_into_range(src.len(), dst.len(), at)?;
        dst[range].copy_from_slice(src);
        Ok(())
    }
    fn synchronize(&self) -> Result<(), BackendError> {
        self.replay.outside("a wait")
    }
    fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<RefMatrix, BackendError> {
        let mut m = matrix(ty, rows, cols, data)?;
        m._charge = Some(self.charge("upload_matrix", data.len() as u64)?);
        self.count_up(data.len())?;
        Ok(m)
    }
    fn matrix_bytes(m: &RefMatrix) -> usize {
        m.data.len()
    }
    fn upload_moe(
        &self,
        t: &ExpertTensors<'_>,
        ids: Option<&[usize]>,
    ) -> Result<RefMoe, BackendError> {
        let (d, ff) = (t.gate.n_in, t.gate.n_out);
        let all: Vec<usize> = (0..t.n_expert).collect();
        let ids = ids.unwrap_or(&all);
        let missing = || BackendError::Shape {
            op: "upload_moe",
            what: "expert missing from the tensors".into(),
        };
        let mut m = RefMoe {
            n_expert: ids.len(),
            d,
            ff,
            bytes: 0,
            gate: Vec::new(),
            up: Vec::new(),
            down: Vec::new(),
            gate_bias: Vec::new(),
            up_bias: Vec::new(),
            down_bias: Vec::new(),
            _charge: None,
        };
        for &e in ids {
            let pairs: [(&mut Vec<RefMatrix>, &ExpertMatrix<'_>, usize, usize); 3] = [
                (&mut m.gate, &t.gate, ff, d),
                (&mut m.up, &t.up, ff, d),
                (&mut m.down, &t.down, d, ff),
            ];
            for (dst, src, rows, cols) in pairs {
                let data = src.expert(e).ok_or_else(missing)?;
                m.bytes += data.len();
                dst.push(matrix(src.ty, rows, cols, data)?);
            }
            if !t.has_biases() {
                continue;
            }
            for (dst, src, w) in [
                (&mut m.gate_bias, t.gate_bias, ff),
                (&mut m.up_bias, t.up_bias, ff),
                (&mut m.down_bias, t.down_bias, d),
            ] {
                dst.extend_from_slice(src.get(e * w..(e + 1) * w).ok_or_else(missing)?);
                m.bytes += 4 * w;
            }
        }
        m._charge = Some(self.charge("upload_moe", m.bytes as u64)?);
        self.count_up(m.bytes)?;
        Ok(m)
    }
    fn moe_bytes(m: &RefMoe) -> usize {
        m.bytes
    }
    fn get_rows(
        &self,
        t: &RefMatrix,
        ids: &RefBuf<i32>,
        out: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        self.op("get_rows", &[mat_id(t), id(ids), id(out)], ())?;
        crate::host_ops::get_rows((t.ty, t.rows, t.cols), |r| t.row(r), ids, out)
    }
    fn rms_norm(
        &self,
        x: &RefBuf<f32>,
        weight: &RefBuf<f32>,
        eps: f32,
        out: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        let eps = self.op("rms_norm", &[id(x), id(weight), id(out)], eps)?;
        let n = weight.len();
        shape(
            "rms_norm",
            n > 0 && x.len().is_multiple_of(n) && out.len() >= x.len(),
            || format!("x {} / weight {n}", x.len()),
        )?;
        for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            let ss: f64 = row.iter().map(|&v| (v * v) as f64).sum();
            let scale = 1.0 / ((ss / n as f64) as f32 + eps).sqrt();
            for ((o, &v), &w) in o.iter_mut().zip(row).zip(weight) {
                *o = v * scale * w;
            }
        }
        Ok(())
    }
    fn matmul(
        &self,
        w: &RefMatrix,
        x: &RefBuf<f32>,
        n: usize,
        y: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        let n = self.op("matmul", &[mat_id(w), id(x), id(y)], n)?;
        shape(
            "matmul",
            x.len() >= n * w.cols && y.len() >= n * w.rows,
            || format!("x {} / y {} for {n} tokens", x.len(), y.len()),
        )?;
        if let Some(k) = &w.kernel {
            let rows: Vec<&[f32]> = x[..n * w.cols].chunks_exact(w.cols).collect();
            return kernel_products(k, w, hmoe_quant::BatchKind::Dense, &rows, y);
        }
        // ggml sums one token's F32 products in `vec_dot` order and a batch's in 16 lanes.
        let order = if n == 1 {
            F32Order::VecDot
        } else {
            F32Order::Lanes16
        };
        for t in 0..n {
            let a = acts(w.ty, &x[t * w.cols..(t + 1) * w.cols])?;
            for r in 0..w.rows {
                y[t * w.rows + r] = row_dot(w.ty, w.row(r), &a, order);
            }
        }
        Ok(())
    }
    fn add_assign(&self, x: &mut RefBuf<f32>, y: &RefBuf<f32>) -> Result<(), BackendError> {
        self.op("add_assign", &[id(x), id(y)], ())?;
        crate::host_ops::add_assign(x, y)
    }
    fn add_bias(&self, x: &mut RefBuf<f32>, bias: &RefBuf<f32>) -> Result<(), BackendError> {
        self.op("add_bias", &[id(x), id(bias)], ())?;
        let c = bias.len();
        shape("add_bias", c > 0 && x.len().is_multiple_of(c), || {
            "lengths".into()
        })?;
        for row in x.chunks_exact_mut(c) {
            row.iter_mut().zip(bias).for_each(|(a, &b)| *a += b);
        }
        Ok(())
    }
    fn rope_neox(
        &self,
        x: &mut RefBuf<f32>,
        positions: &RefBuf<i32>,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), BackendError> {
        let bufs = [id(x), id(positions)];
        let (n_heads, head_dim, p) = self.op("rope_neox", &bufs, (n_heads, head_dim, *p))?;
        crate::host_ops::rope_neox(x, positions, n_heads, head_dim, &p)
    }
    fn kv_types(&self) -> &'static [GgmlType] {
        &crate::KV_TYPES
    }
    fn kv_store_at(
        &self,
        src: &RefBuf<f32>,
        ring: &mut KvRing<Ref0>,
        n_tokens: usize,
        positions: &RefBuf<i32>,
        first: usize,
    ) -> Result<(), BackendError> {
        let bufs = [id(src), id(&ring.data), id(positions)];
        let (n_tokens, first) = self.op("kv_store_at", &bufs, (n_tokens, first))?;
        let pos0 = crate::first_position("kv_store", positions, first)?;
        crate::ref0_kv::store(&ring.layout, src, &mut ring.data, n_tokens, pos0)
    }
    fn kv_read(&self, ring: &KvRing<Ref0>, cells: Range<usize>) -> Result<Vec<u8>, BackendError> {
        self.replay.outside("a download")?;
        Ok(ring.data[crate::kv_rows_range(&ring.layout, cells.start, cells.len())?].to_vec())
    }
    fn kv_write(
        &self,
        ring: &mut KvRing<Ref0>,
        cell0: usize,
        rows: &[u8],
    ) -> Result<(), BackendError> {
        self.replay.outside("an upload")?;
        let n = crate::kv_row_count(&ring.layout, rows.len())?;
        let bytes = crate::kv_rows_range(&ring.layout, cell0, n)?;
        ring.data[bytes].copy_from_slice(rows);
        Ok(())
    }
    fn attention_at(
        &self,
        p: &AttnParams,
        q: &RefBuf<f32>,
        k: &KvRing<Ref0>,
        v: &KvRing<Ref0>,
        sinks: Option<&RefBuf<f32>>,
        n_tokens: usize,
        positions: &RefBuf<i32>,
        first: usize,
        out: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        let bufs = [
            id(q),
            id(&k.data),
            id(&v.data),
            id_opt(sinks),
            id(positions),
            id(out),
        ];
        let (p, n_tokens, first) = self.op("attention_at", &bufs, (*p, n_tokens, first))?;
        let pos0 = crate::first_position("attention", positions, first)?;
        self.attend(&p, q, k, v, sinks, n_tokens, pos0, out)
    }
    fn router_top_k(
        &self,
        logits: &RefBuf<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut RefBuf<i32>,
        weights: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        let bufs = [id(logits), id(selected), id(weights)];
        let (n_expert, k) = self.op("router_top_k", &bufs, (n_expert, k))?;
        shape(
            "router_top_k",
            n_expert > 0 && k > 0 && k <= n_expert && logits.len().is_multiple_of(n_expert),
            || "shape".into(),
        )?;
        let n = logits.len() / n_expert;
        shape(
            "router_top_k",
            selected.len() >= n * k && weights.len() >= n * k,
            || "lengths".into(),
        )?;
        for t in 0..n {
            let row = &logits[t * n_expert..(t + 1) * n_expert];
            let mut idx: Vec<usize> = (0..n_expert).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let mx = row[idx[0]];
            let e: Vec<f32> = idx[..k].iter().map(|&i| (row[i] - mx).exp()).collect();
            let sum: f64 = e.iter().map(|&v| v as f64).sum();
            let inv = (1.0 / sum) as f32;
            for j in 0..k {
                selected[t * k + j] = idx[j] as i32;
                weights[t * k + j] = e[j] * inv;
            }
        }
        Ok(())
    }
    fn top_k(
        &self,
        logits: &RefBuf<f32>,
        n_vocab: usize,
        k: usize,
        scratch: &mut RefBuf<i32>,
        values: &mut RefBuf<f32>,
        ids: &mut RefBuf<i32>,
    ) -> Result<(), BackendError> {
        let bufs = [id(logits), id(scratch), id(values), id(ids)];
        let (n_vocab, k) = self.replay.op("top_k", &bufs, (n_vocab, k))?;
        // As a GPU runs it: through scratch it must not rely on (poisoned here).
        crate::top_k_chunked(logits, n_vocab, k, scratch, values, ids)
    }
    fn top_k_scratch(&self, n_rows: usize, n_vocab: usize, k: usize) -> usize {
        crate::top_k_chunked_scratch(n_rows, n_vocab, k)
    }
    fn moe(
        &self,
        w: &RefMoe,
        act: GatedAct,
        x: &RefBuf<f32>,
        selected: &RefBuf<i32>,
        weights: &RefBuf<f32>,
        k: usize,
        out: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        let bufs = [
            (w.gate.as_ptr() as usize, w.n_expert),
            id(x),
            id(selected),
            id(weights),
            id(out),
        ];
        let (act, k) = self.op("moe", &bufs, (act, k))?;
        let (d, ff) = (w.d, w.ff);
        shape("moe", k > 0 && x.len().is_multiple_of(d), || "x".into())?;
        let n = x.len() / d;
        shape(
            "moe",
            selected.len() >= n * k && weights.len() >= n * k && out.len() >= n * d,
            || "lengths".into(),
        )?;
        let expert = |slot: usize| {
            usize::try_from(selected[slot])
                .ok()
                .filter(|&e| e < w.n_expert)
        };
        // Each expert's slots in order: ggml multiplies an expert's rows as one batch.
        let mut slots_of = vec![Vec::new(); w.n_expert];
        for s in 0..n * k {
            if let Some(e) = expert(s) {
                slots_of[e].push(s);
            }
        }
        // Bias `r` of expert `e` in `b` (rows of `len`), if the experts have biases.
        let bias = |b: &[f32], len: usize, e: usize, r: usize| b.get(e * len + r).copied();
        let with_bias = |v: f32, b: Option<f32>| b.map_or(v, |b| v + b);
        // Every routed slot's expert output, `n·k × d`.
        let mut per_slot = vec![0f32; n * k * d];
        for (e, slots) in slots_of.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
            let m = slots.len();
            // F32 products of an expert several slots route to take the 16-lane order
            // (gpt-oss's experts); SiLU experts' always `vec_dot`'s.
            let order = if m == 1 || act == GatedAct::Silu {
                F32Order::VecDot
            } else {
                F32Order::Lanes16
            };
            let xs: Vec<&[f32]> = slots.iter().map(|&s| &x[(s / k) * d..][..d]).collect();
            let (mut h, mut u) = (vec![0f32; m * ff], vec![0f32; m * ff]);
            expert_products(&w.gate[e], &xs, order, &mut h)?;
            expert_products(&w.up[e], &xs, order, &mut u)?;
            for (hr, ur) in h.chunks_exact_mut(ff).zip(u.chunks_exact_mut(ff)) {
                for (r, (hv, uv)) in hr.iter_mut().zip(ur.iter_mut()).enumerate() {
                    *hv = with_bias(*hv, bias(&w.gate_bias, ff, e, r));
                    *uv = with_bias(*uv, bias(&w.up_bias, ff, e, r));
                }
                act.apply_row(hr, ur);
            }
            let hs: Vec<&[f32]> = h.chunks_exact(ff).collect();
            let mut y = vec![0f32; m * d];
            expert_products(&w.down[e], &hs, order, &mut y)?;
            for (yr, &s) in y.chunks_exact(d).zip(slots) {
                for (r, (p, &v)) in per_slot[s * d..][..d].iter_mut().zip(yr).enumerate() {
                    *p = with_bias(v, bias(&w.down_bias, d, e, r));
                }
            }
        }
        for (t, o) in out[..n * d].chunks_exact_mut(d).enumerate() {
            o.fill(0.0);
            for j in (0..k).filter(|&j| expert(t * k + j).is_some()) {
                let wt = weights[t * k + j];
                for (ov, &y) in o.iter_mut().zip(&per_slot[(t * k + j) * d..][..d]) {
                    *ov += y * wt;
                }
            }
        }
        Ok(())
    }
    fn copy_rows(
        &self,
        src: &RefBuf<f32>,
        dst: &mut RefBuf<f32>,
        c: &RowCopy,
    ) -> Result<(), BackendError> {
        let c = self.op("copy_rows", &[id(src), id(dst)], *c)?;
        crate::host_ops::copy_rows(src, dst, &c)
    }
    fn rope_norm(
        &self,
        x: &mut RefBuf<f32>,
        positions: &RefBuf<i32>,
        n_heads: usize,
        head_dim: usize,
        first: usize,
        p: &RopeParams,
    ) -> Result<(), BackendError> {
        let bufs = [id(x), id(positions)];
        let scalars = (n_heads, head_dim, first, *p);
        let (n_heads, head_dim, first, p) = self.op("rope_norm", &bufs, scalars)?;
        crate::host_ops::rope_norm(x, positions, n_heads, head_dim, first, &p)
    }
    fn matmul_heads(
        &self,
        w: &RefMatrix,
        x: &RefBuf<f32>,
        n: usize,
        n_heads: usize,
        x_stride: usize,
        y: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        let bufs = [mat_id(w), id(x), id(y)];
        let (n, n_heads, x_stride) = self.op("matmul_heads", &bufs, (n, n_heads, x_stride))?;
        let out =
            crate::shapes::matmul_heads(w.rows, w.cols, n, n_heads, x_stride, x.len(), y.len())?;
        if n == 0 || out == 0 {
            return Ok(());
        }
        if let Some(k) = &w.kernel {
            // As the CPU device's MLA: per head, the head's inputs of every token together,
            // then its rows in `matmul`'s order (contiguous inputs) or `vec_dot`'s (strided:
            // `matmul_vec_dot`, the expert matmul's order).
            let kind = if x_stride == w.cols {
                hmoe_quant::BatchKind::Dense
            } else {
                hmoe_quant::BatchKind::Expert
            };
            let mut yh = vec![0f32; n * out];
            for h in 0..n_heads {
                let rows: Vec<&[f32]> = (0..n)
                    .map(|t| &x[(t * n_heads + h) * x_stride..][..w.cols])
                    .collect();
                let range = h * out..(h + 1) * out;
                kernel_products_of(k, w, range, kind, &rows, &mut yh, "matmul_heads")?;
                for (t, src) in yh.chunks_exact(out).enumerate() {
                    y[(t * n_heads + h) * out..][..out].copy_from_slice(src);
                }
            }
            return Ok(());
        }
        let order = if x_stride == w.cols && n > 1 {
            F32Order::Lanes16
        } else {
            F32Order::VecDot
        };
        for t in 0..n {
            for h in 0..n_heads {
                let a = acts(w.ty, &x[(t * n_heads + h) * x_stride..][..w.cols])?;
                let dst = &mut y[(t * n_heads + h) * out..][..out];
                for (r, d) in dst.iter_mut().enumerate() {
                    *d = row_dot(w.ty, w.row(h * out + r), &a, order);
                }
            }
        }
        Ok(())
    }
    fn swiglu(
        &self,
        gate: &mut RefBuf<f32>,
        up: &RefBuf<f32>,
        n: usize,
    ) -> Result<(), BackendError> {
        let n = self.op("swiglu", &[id(gate), id(up)], n)?;
        crate::shapes::swiglu(gate.len(), up.len(), n)?;
        for (r, g) in gate.chunks_exact_mut(n).enumerate() {
            crate::numerics::swiglu_row(g, &up[r * n..(r + 1) * n]);
        }
        Ok(())
    }
    fn k_only_types(&self) -> &'static [GgmlType] {
        &crate::KV_TYPES
    }
    fn attention_k_only_at(
        &self,
        p: &KOnlyAttnParams,
        q: &RefBuf<f32>,
        k_ring: &KvRing<Ref0>,
        n_tokens: usize,
        positions: &RefBuf<i32>,
        first: usize,
        out: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        let bufs = [id(q), id(&k_ring.data), id(positions), id(out)];
        let scalars = (*p, n_tokens, first);
        let (p, n_tokens, first) = self.op("attention_k_only_at", &bufs, scalars)?;
        let pos0 = crate::first_position("attention_k_only", positions, first)?;
        self.attend_k_only(&p, q, k_ring, n_tokens, pos0, out)
    }
    fn route(
        &self,
        logits: &RefBuf<f32>,
        bias: Option<&RefBuf<f32>>,
        gating: Gating,
        routing: &Routing,
        n_expert: usize,
        selected: &mut RefBuf<i32>,
        weights: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
        let bufs = [id(logits), id_opt(bias), id(selected), id(weights)];
        let scalars = (gating, *routing, n_expert);
        let (gating, routing, n_expert) = self.op("route", &bufs, scalars)?;
        let routing = &routing;
        let bias = bias.map(|b| &b[..]);
        crate::host_ops::route(logits, bias, gating, routing, n_expert, selected, weights)
    }
    fn staging(&self, n_d: usize, n_k: usize) -> Result<HostStaging, BackendError> {
        Ok(HostStaging::new(n_d, n_k))
    }
    fn stage_down(
        &self,
        st: &mut HostStaging,
        h: &RefBuf<f32>,
        sel: &RefBuf<i32>,
        w: &RefBuf<f32>,
    ) -> Result<(), BackendError> {
        self.replay.outside("a download")?;
        self.log.note(Ref0Event::StageDown(st.id()));
        let bytes = st.fill(h, sel, w)?;
        self.count_down(bytes)?;
        *self.trips.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        Ok(())
    }
    fn staged<'s>(&self, st: &'s mut HostStaging) -> Result<StagedIo<'s>, BackendError> {
        self.replay.outside("a wait")?;
        self.log.note(Ref0Event::Staged(st.id()));
        Ok(st.io())
    }
    fn begin_segment(&self, key: u64) -> Result<(), BackendError> {
        self.replay.begin(key)
    }
    fn end_segment(&self) -> Result<(), BackendError> {
        self.replay.end()
    }
    fn forget_segments(&self) {
        self.replay.forget();
    }
    fn stage_up(&self, st: &HostStaging, out: &mut RefBuf<f32>) -> Result<(), BackendError> {
        self.replay.outside("an upload")?;
        self.log.note(Ref0Event::StageUp(st.id()));
        let n = st.send_up(out)?;
        self.count_up(4 * n)?;
        Ok(())
    }
}

#[cfg(test)]
#[path = "ref0/ref0_tests.rs"]
mod tests;
