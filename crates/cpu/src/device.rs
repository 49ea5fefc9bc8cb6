//! [`Cpu`]: the device contract ([`Backend`]) on the host, over this crate's kernels
//! ([`crate::ops`], [`crate::attention`] and [`crate::kv_storage`], multithreaded
//! with the hmoe-pool thread pool).
//!
//! - Buffers are host vectors; nothing is transferred and nothing is counted
//!   ([`Backend::transfers`] is `None`), and there is no memory limit to report
//!   ([`Backend::free_memory`] is `None`).
//! - Weights stay where they are: [`Backend::upload_matrix_shared`] keeps the handle to the
//!   file mapping ([`SharedBytes`]), so a model is never copied; [`Backend::upload_matrix`]
//!   (bytes without an owner) copies. Each matrix multiplies with the kernel the CPU device
//!   chooses for it ([`hmoe_quant::DotKernel::for_matrix`]).
//! - K/V rings are the CPU device's cache storage ([`Cells`]), stored and attended over by the
//!   CPU device's code: `kv_store` is its `set_rows` conversion (rotation included), attention
//!   its row kernel or flash attention as [`AttnParams`] asks.
//! - Expert sets stay where they are too ([`Backend::upload_moe_shared`] keeps the handles to
//!   the stacked matrices in the mapping; [`Backend::upload_moe`] copies the chosen experts),
//!   and `moe` runs the CPU device's expert kernels over them ([`crate::experts`]), so that a
//!   layer's experts are "on the device" with no round trip. The executor's host path
//!   ([`Backend::staging`] being plain host buffers) computes the same.

mod cpu_buffers;

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use hmoe_backend::{
    AttnParams, Backend, BackendError, Elem, ExpertTensors, GatedAct, Gating, HostStaging,
    KOnlyAttnParams, KvLayout, KvRing, RopeParams, Routing, RowCopy, SharedBytes, StagedIo,
    KV_TYPES,
};
use hmoe_quant::GgmlType;

use crate::attention::{attention, attention_ext, AttnLayout, AttnShape};
use crate::experts::{self, ExpertBatch, ExpertScratch};
use crate::kv_storage::{Cells, LayerCache};
use crate::ops::{self, QuantizedActs};

use cpu_buffers::*;
pub use cpu_buffers::{
    host_memory, set_expert_interleaving, CpuBuf, CpuMatrix, CpuMoe, HostMemory,
};

/// The CPU device's name in device lists and messages.
pub const CPU_NAME: &str = "CPU";

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
    // Scratch (`alloc_scratch_*`) is the zeroed default: `vec![0; n]` is calloc'd pages
    // that cost nothing until written.
    fn upload_into_f32(&self, dst: &mut CpuBuf<f32>, src: &[f32]) -> Result<(), BackendError> {
        hmoe_backend::check_upload_into(src.len(), dst.data.len())?;
        dst.data.copy_from_slice(src);
        Ok(())
    }
    fn upload_into_i32(&self, dst: &mut CpuBuf<i32>, src: &[i32]) -> Result<(), BackendError> {
        hmoe_backend::check_upload_into(src.len(), dst.data.len())?;
        dst.data.copy_from_slice(src);
        Ok(())
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
        hmoe_backend::host_ops::get_rows((t.ty, t.rows, t.cols), |r| t.row(r), ids, out)
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
        hmoe_backend::host_ops::add_assign(x, y)
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
        hmoe_backend::host_ops::rope_neox(x, positions, n_heads, head_dim, p)
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
    fn kv_store_at(
        &self,
        src: &CpuBuf<f32>,
        ring: &mut KvRing<Cpu>,
        n_tokens: usize,
        positions: &CpuBuf<i32>,
        first: usize,
    ) -> Result<(), BackendError> {
        let pos0 = hmoe_backend::first_position("kv_store", positions, first)?;
        Self::store_from(src, ring, n_tokens, pos0)
    }
    fn kv_read(&self, ring: &KvRing<Cpu>, cells: Range<usize>) -> Result<Vec<u8>, BackendError> {
        let bytes = hmoe_backend::kv_rows_range(&ring.layout, cells.start, cells.len())?;
        Ok(ring_cells(ring, "kv_read")?.read_bytes(bytes))
    }
    fn kv_write(
        &self,
        ring: &mut KvRing<Cpu>,
        cell0: usize,
        rows: &[u8],
    ) -> Result<(), BackendError> {
        let n = hmoe_backend::kv_row_count(&ring.layout, rows.len())?;
        let bytes = hmoe_backend::kv_rows_range(&ring.layout, cell0, n)?;
        ring_cells(ring, "kv_write")?.write_bytes(bytes.start, rows);
        Ok(())
    }
    fn attention_at(
        &self,
        p: &AttnParams,
        q: &CpuBuf<f32>,
        k: &KvRing<Cpu>,
        v: &KvRing<Cpu>,
        sinks: Option<&CpuBuf<f32>>,
        n_tokens: usize,
        positions: &CpuBuf<i32>,
        first: usize,
        out: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        let pos0 = hmoe_backend::first_position("attention", positions, first)?;
        self.attend_from(p, q, k, v, sinks, n_tokens, pos0, out)
    }
    fn top_k(
        &self,
        logits: &CpuBuf<f32>,
        n_vocab: usize,
        k: usize,
        _scratch: &mut CpuBuf<i32>,
        values: &mut CpuBuf<f32>,
        ids: &mut CpuBuf<i32>,
    ) -> Result<(), BackendError> {
        hmoe_backend::top_k_rows(logits, n_vocab, k, values, ids)
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
        // The CPU device's gpt-oss routing: top-k, then the softmax over the chosen scores.
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
        // The CPU device's expert sum over the whole batch (the executor splits the batch
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
        hmoe_backend::host_ops::copy_rows(src, dst, c)
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
        hmoe_backend::host_ops::rope_norm(x, positions, n_heads, head_dim, first, p)
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
        // As the CPU device's MLA: per head, the head's inputs of every token gathered, then
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
        // The CPU device's latent cache in every `-ctk` type, never rotated (the executor's
        // K-only layouts have rotation 0).
        &KV_TYPES
    }
    fn attention_k_only_at(
        &self,
        p: &KOnlyAttnParams,
        q: &CpuBuf<f32>,
        k_ring: &KvRing<Cpu>,
        n_tokens: usize,
        positions: &CpuBuf<i32>,
        first: usize,
        out: &mut CpuBuf<f32>,
    ) -> Result<(), BackendError> {
        let pos0 = hmoe_backend::first_position("attention_k_only", positions, first)?;
        self.attend_k_only_from(p, q, k_ring, n_tokens, pos0, out)
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
        hmoe_backend::host_ops::route(logits, bias, gating, routing, n_expert, selected, weights)
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
        st.fill(h, sel, w).map(drop)
    }
    fn staged<'s>(&self, st: &'s mut HostStaging) -> Result<StagedIo<'s>, BackendError> {
        Ok(st.io())
    }
    fn stage_up(&self, st: &HostStaging, out: &mut CpuBuf<f32>) -> Result<(), BackendError> {
        st.send_up(out).map(drop)
    }
}

/// The position-by-value bodies of the K/V store and attention ops, which the `_at` ops call
/// once they have read the position.
impl Cpu {
    /// The rows of [`Backend::kv_store_at`] from position `pos0`.
    fn store_from(
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
        // The CPU device's `LayerCache::store`: one row per token, converted as `set_rows`.
        for (t, row) in src.chunks_exact(w).take(n_tokens).enumerate() {
            cells.store((pos0 + t) % n_cells * w, row);
        }
        Ok(())
    }
    /// [`Backend::attention_at`] from position `pos0`.
    #[allow(clippy::too_many_arguments)]
    fn attend_from(
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
    /// [`Backend::attention_k_only_at`] from position `pos0`.
    fn attend_k_only_from(
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
}

#[cfg(test)]
#[path = "device/device_tests.rs"]
mod tests;
