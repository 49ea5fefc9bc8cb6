//! [`CudaDevice`] as a device of the contract ([`hmoe_backend::Backend`]): each op is the
//! CUDA kernel of the same name (see [`CudaDevice`]'s methods), errors become
//! [`BackendError`]s. While a recorded segment replays its CUDA graph (`graphs.rs`), the ops
//! issued return at once (`replayed!`): the graph runs them.

use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaView, PinnedHostSlice};
use hmoe_backend::{
    shapes, Backend, BackendError, Elem, ExpertMatrix, ExpertTensors, GatedAct, Gating,
    KOnlyAttnParams, KvRing, PackedDown, Routing, RowCopy, StagedIo,
};
use hmoe_quant::GgmlType;

use crate::device::{CudaDevice, DeviceMatrix, ExpertAct, MoeWeights};
use crate::error::CudaError;
use crate::{AttnParams, RopeParams};

/// Returns `Ok(())` from an op while a segment replays its graph: the graph runs the op.
macro_rules! replayed {
    ($dev:expr) => {
        if $dev.graphs.replaying() {
            return Ok(());
        }
    };
}

/// The first position of a call, `positions[first]`, as the view the kernels read it from.
fn position_at<'p>(
    op: &'static str,
    positions: &'p CudaSlice<i32>,
    first: usize,
) -> Result<CudaView<'p, i32>, BackendError> {
    (positions.try_slice(first..first + 1)).ok_or_else(|| BackendError::Shape {
        op,
        what: format!("position {first} of {}", positions.len()),
    })
}

/// The clamped SwiGLU the MoE kernels compute: alpha 1.702, limit 7.
const KERNEL_CLAMPED: GatedAct = GatedAct::ClampedSwiglu {
    alpha: 1.702,
    limit: 7.0,
};

/// Buffers of the CUDA round trip: the inputs packed side by side on the device
/// ([`PackedDown`]) and the pinned buffer the one copy brings them down into, the ids read
/// back out of it, and the pinned expert sum to send up.
pub struct PinnedIo {
    layout: PackedDown,
    packed: CudaSlice<f32>,
    down: PinnedHostSlice<f32>,
    sel: Vec<i32>,
    out: PinnedHostSlice<f32>,
}

impl Backend for CudaDevice {
    type Buf<T: Elem> = CudaSlice<T>;
    type Matrix = DeviceMatrix;
    type Moe = MoeWeights;
    type Staging = PinnedIo;

    fn name(&self) -> String {
        self.info().device_name()
    }
    fn free_memory(&self) -> Result<Option<u64>, BackendError> {
        Ok(Some(self.mem_info()?.0))
    }
    fn upload_f32(&self, src: &[f32]) -> Result<CudaSlice<f32>, BackendError> {
        Ok(CudaDevice::upload(self, src)?)
    }
    fn upload_i32(&self, src: &[i32]) -> Result<CudaSlice<i32>, BackendError> {
        Ok(CudaDevice::upload(self, src)?)
    }
    fn upload_u16(&self, src: &[u16]) -> Result<CudaSlice<u16>, BackendError> {
        Ok(CudaDevice::upload(self, src)?)
    }
    fn upload_u8(&self, src: &[u8]) -> Result<CudaSlice<u8>, BackendError> {
        Ok(CudaDevice::upload(self, src)?)
    }
    fn alloc_f32(&self, len: usize) -> Result<CudaSlice<f32>, BackendError> {
        Ok(self.alloc_zeros(len)?)
    }
    fn alloc_i32(&self, len: usize) -> Result<CudaSlice<i32>, BackendError> {
        Ok(self.alloc_zeros(len)?)
    }
    fn alloc_u16(&self, len: usize) -> Result<CudaSlice<u16>, BackendError> {
        Ok(self.alloc_zeros(len)?)
    }
    fn alloc_u8(&self, len: usize) -> Result<CudaSlice<u8>, BackendError> {
        Ok(self.alloc_zeros(len)?)
    }
    fn alloc_scratch_f32(&self, len: usize) -> Result<CudaSlice<f32>, BackendError> {
        Ok(CudaDevice::alloc_scratch(self, len)?)
    }
    fn alloc_scratch_i32(&self, len: usize) -> Result<CudaSlice<i32>, BackendError> {
        Ok(CudaDevice::alloc_scratch(self, len)?)
    }
    fn alloc_scratch_u16(&self, len: usize) -> Result<CudaSlice<u16>, BackendError> {
        Ok(CudaDevice::alloc_scratch(self, len)?)
    }
    fn alloc_scratch_u8(&self, len: usize) -> Result<CudaSlice<u8>, BackendError> {
        Ok(CudaDevice::alloc_scratch(self, len)?)
    }
    fn upload_into_f32(&self, dst: &mut CudaSlice<f32>, src: &[f32]) -> Result<(), BackendError> {
        hmoe_backend::check_upload_into(src.len(), dst.len())?;
        Ok(self.upload_into_pinned(src, dst)?)
    }
    fn upload_into_i32(&self, dst: &mut CudaSlice<i32>, src: &[i32]) -> Result<(), BackendError> {
        hmoe_backend::check_upload_into(src.len(), dst.len())?;
        Ok(self.upload_into_pinned(src, dst)?)
    }
    fn upload_into_u16(&self, dst: &mut CudaSlice<u16>, src: &[u16]) -> Result<(), BackendError> {
        hmoe_backend::check_upload_into(src.len(), dst.len())?;
        Ok(self.upload_into_pinned(src, dst)?)
    }
    fn upload_into_u8(&self, dst: &mut CudaSlice<u8>, src: &[u8]) -> Result<(), BackendError> {
        hmoe_backend::check_upload_into(src.len(), dst.len())?;
        Ok(self.upload_into_pinned(src, dst)?)
    }
    fn download_f32(&self, src: &CudaSlice<f32>) -> Result<Vec<f32>, BackendError> {
        Ok(self.download_pinned(src)?)
    }
    fn download_i32(&self, src: &CudaSlice<i32>) -> Result<Vec<i32>, BackendError> {
        Ok(self.download_pinned(src)?)
    }
    fn download_u16(&self, src: &CudaSlice<u16>) -> Result<Vec<u16>, BackendError> {
        Ok(self.download_pinned(src)?)
    }
    fn download_u8(&self, src: &CudaSlice<u8>) -> Result<Vec<u8>, BackendError> {
        Ok(self.download_pinned(src)?)
    }
    fn buf_len<T: Elem>(b: &CudaSlice<T>) -> usize {
        b.len()
    }
    fn copy_range(
        &self,
        src: &CudaSlice<f32>,
        range: Range<usize>,
    ) -> Result<CudaSlice<f32>, BackendError> {
        Ok(CudaDevice::copy_range(self, src, range)?)
    }
    fn copy_into(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        at: usize,
    ) -> Result<(), BackendError> {
        replayed!(self);
        let range = hmoe_backend::copy_into_range(src.len(), dst.len(), at)?;
        self.stream()
            .memcpy_dtod(src, &mut dst.slice_mut(range))
            .map_err(CudaError::from)?;
        Ok(())
    }
    fn synchronize(&self) -> Result<(), BackendError> {
        Ok(CudaDevice::synchronize(self)?)
    }
    fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<DeviceMatrix, BackendError> {
        Ok(CudaDevice::upload_matrix(self, ty, rows, cols, data)?)
    }
    fn matrix_bytes(m: &DeviceMatrix) -> usize {
        m.bytes()
    }
    fn upload_moe(
        &self,
        t: &ExpertTensors<'_>,
        ids: Option<&[usize]>,
    ) -> Result<MoeWeights, BackendError> {
        let (d, ff) = (t.gate.n_in, t.gate.n_out);
        let all: Vec<usize>;
        let ids = match ids {
            Some(ids) => ids,
            None => {
                all = (0..t.n_expert).collect();
                &all
            }
        };
        let bad = |what: &str| BackendError::Shape {
            op: "upload_moe",
            what: format!("expert {what} missing from the tensors"),
        };
        let parts = |m: &ExpertMatrix<'_>, rows: usize, cols: usize| -> Result<_, BackendError> {
            let mut p = Vec::with_capacity(ids.len());
            for &e in ids {
                p.push(m.expert(e).ok_or_else(|| bad("matrix"))?);
            }
            Ok(self.upload_experts_from(m.ty, rows, cols, &p)?)
        };
        let biases = |b: &[f32], w: usize| -> Result<CudaSlice<f32>, BackendError> {
            let mut v = Vec::with_capacity(ids.len() * w);
            for &e in ids {
                v.extend_from_slice(b.get(e * w..(e + 1) * w).ok_or_else(|| bad("bias"))?);
            }
            Ok(self.upload_for_offload(&v)?)
        };
        if !crate::expert_types_supported(t.gate.ty, t.up.ty, t.down.ty) {
            return Err(BackendError::Unsupported {
                op: "upload_moe",
                what: format!(
                    "experts of {} / {} / {} (one type, or low-bit types with Q8_0)",
                    t.gate.ty, t.up.ty, t.down.ty
                ),
            });
        }
        let has = t.has_biases();
        // The biases first: the experts' `CopyUpload`s, recorded after their own copies on
        // the same copy stream, then cover the biases' copies too (`MoeWeights`' docs).
        let gate_bias = has.then(|| biases(t.gate_bias, ff)).transpose()?;
        let up_bias = has.then(|| biases(t.up_bias, ff)).transpose()?;
        let down_bias = has.then(|| biases(t.down_bias, d)).transpose()?;
        Ok(MoeWeights {
            gate: parts(&t.gate, ff, d)?,
            up: parts(&t.up, ff, d)?,
            down: parts(&t.down, d, ff)?,
            gate_bias,
            up_bias,
            down_bias,
        })
    }
    fn moe_bytes(m: &MoeWeights) -> usize {
        let biases = [&m.gate_bias, &m.up_bias, &m.down_bias]
            .iter()
            .map(|b| b.as_ref().map_or(0, |b| 4 * b.len()))
            .sum::<usize>();
        m.gate.bytes() + m.up.bytes() + m.down.bytes() + biases
    }
    fn get_rows(
        &self,
        table: &DeviceMatrix,
        ids: &CudaSlice<i32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::get_rows(self, table, ids, out)?)
    }
    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::rms_norm(self, x, weight, eps, out)?)
    }
    fn matmul(
        &self,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::matmul(self, w, x, n, y)?)
    }
    fn matmul_shared(
        &self,
        ws: &[&DeviceMatrix],
        biases: &[Option<&CudaSlice<f32>>],
        x: &CudaSlice<f32>,
        n: usize,
        ys: &mut [&mut CudaSlice<f32>],
    ) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::matmul_shared(self, ws, biases, x, n, ys)?)
    }
    fn add_assign(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::add_assign(self, x, y)?)
    }
    fn add_rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::add_rms_norm(self, x, y, weight, eps, out)?)
    }
    fn norm_matmul_shared(
        &self,
        x: &mut CudaSlice<f32>,
        pending: Option<&CudaSlice<f32>>,
        norm: (&CudaSlice<f32>, f32),
        h: &mut CudaSlice<f32>,
        ws: &[&DeviceMatrix],
        biases: &[Option<&CudaSlice<f32>>],
        n: usize,
        ys: &mut [&mut CudaSlice<f32>],
    ) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::norm_matmul_shared(
            self, x, pending, norm, h, ws, biases, n, ys,
        )?)
    }
    fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::add_bias(self, x, bias)?)
    }
    fn rope_neox(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<i32>,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), BackendError> {
        replayed!(self);
        no_freq_factors("rope_neox", p)?;
        Ok(CudaDevice::rope_neox(
            self, x, positions, n_heads, head_dim, p,
        )?)
    }
    fn rope_neox_qk(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        positions: &CudaSlice<i32>,
        (n_head, n_head_kv): (usize, usize),
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), BackendError> {
        replayed!(self);
        no_freq_factors("rope_neox", p)?;
        let (q, k) = ((q, n_head), Some((k, n_head_kv)));
        Ok(CudaDevice::rope_neox_pair(
            self, q, k, positions, head_dim, p,
        )?)
    }
    fn kv_types(&self) -> &'static [GgmlType] {
        // Every type `kv_store` stores (K-only rings included); pairs: `supports_kv`.
        &crate::K_ONLY_TYPES
    }
    fn supports_kv(&self, k: GgmlType, v: GgmlType) -> bool {
        crate::kv_pair_supported(k, v)
    }
    fn k_only_types(&self) -> &'static [GgmlType] {
        &crate::K_ONLY_TYPES
    }
    fn kv_read(
        &self,
        ring: &KvRing<CudaDevice>,
        cells: Range<usize>,
    ) -> Result<Vec<u8>, BackendError> {
        let bytes = hmoe_backend::kv_rows_range(&ring.layout, cells.start, cells.len())?;
        Ok(CudaDevice::download_range(self, &ring.data, bytes)?)
    }
    fn kv_write(
        &self,
        ring: &mut KvRing<CudaDevice>,
        cell0: usize,
        rows: &[u8],
    ) -> Result<(), BackendError> {
        let n = hmoe_backend::kv_row_count(&ring.layout, rows.len())?;
        let bytes = hmoe_backend::kv_rows_range(&ring.layout, cell0, n)?;
        Ok(CudaDevice::upload_at(
            self,
            rows,
            &mut ring.data,
            bytes.start,
        )?)
    }
    fn kv_store_at(
        &self,
        src: &CudaSlice<f32>,
        ring: &mut KvRing<CudaDevice>,
        n_tokens: usize,
        positions: &CudaSlice<i32>,
        first: usize,
    ) -> Result<(), BackendError> {
        replayed!(self);
        let layout = ring.layout;
        let at = position_at("kv_store", positions, first)?;
        Ok(CudaDevice::kv_store(
            self,
            src,
            &mut ring.data,
            &layout,
            n_tokens,
            &at,
        )?)
    }
    fn kv_store_pair_at(
        &self,
        (k, k_ring): (&CudaSlice<f32>, &mut KvRing<CudaDevice>),
        (v, v_ring): (&CudaSlice<f32>, &mut KvRing<CudaDevice>),
        n_tokens: usize,
        positions: &CudaSlice<i32>,
        first: usize,
    ) -> Result<(), BackendError> {
        replayed!(self);
        let (kl, vl) = (k_ring.layout, v_ring.layout);
        let at = position_at("kv_store", positions, first)?;
        let (k, v) = ((k, &mut k_ring.data, &kl), (v, &mut v_ring.data, &vl));
        Ok(CudaDevice::kv_store_pair(self, k, Some(v), n_tokens, &at)?)
    }
    fn attention_at(
        &self,
        p: &AttnParams,
        q: &CudaSlice<f32>,
        k: &KvRing<CudaDevice>,
        v: &KvRing<CudaDevice>,
        sinks: Option<&CudaSlice<f32>>,
        n_tokens: usize,
        positions: &CudaSlice<i32>,
        first: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        let at = position_at("attention", positions, first)?;
        Ok(CudaDevice::attention(
            self,
            p,
            q,
            (&k.data, &k.layout),
            (&v.data, &v.layout),
            sinks,
            n_tokens,
            &at,
            out,
        )?)
    }
    fn router_top_k(
        &self,
        logits: &CudaSlice<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::router_top_k(
            self, logits, n_expert, k, selected, weights,
        )?)
    }
    fn router_top_k_logits(
        &self,
        w: &DeviceMatrix,
        bias: Option<&CudaSlice<f32>>,
        x: &CudaSlice<f32>,
        n: usize,
        shape: (usize, usize),
        logits: &mut CudaSlice<f32>,
        selected: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::router_top_k_logits(
            self, w, bias, x, n, shape, logits, selected, weights,
        )?)
    }
    fn top_k(
        &self,
        logits: &CudaSlice<f32>,
        n_vocab: usize,
        k: usize,
        scratch: &mut CudaSlice<i32>,
        values: &mut CudaSlice<f32>,
        ids: &mut CudaSlice<i32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        Ok(CudaDevice::top_k(
            self, logits, n_vocab, k, scratch, values, ids,
        )?)
    }
    fn top_k_scratch(&self, n_rows: usize, n_vocab: usize, k: usize) -> usize {
        hmoe_backend::top_k_chunked_scratch(n_rows, n_vocab, k)
    }
    fn moe(
        &self,
        w: &MoeWeights,
        act: GatedAct,
        x: &CudaSlice<f32>,
        selected: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        k: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        let act = match act {
            GatedAct::Silu => ExpertAct::Silu,
            a if a == KERNEL_CLAMPED => ExpertAct::ClampedSwiglu,
            other => {
                return Err(BackendError::Unsupported {
                    op: "moe",
                    what: format!("{other:?} (the kernels compute {KERNEL_CLAMPED:?} and SiLU)"),
                })
            }
        };
        Ok(CudaDevice::moe(self, w, act, x, selected, weights, k, out)?)
    }
    fn copy_rows(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        c: &RowCopy,
    ) -> Result<(), BackendError> {
        replayed!(self);
        c.check(src.len(), dst.len())?;
        Ok(CudaDevice::copy_rows(self, src, dst, c)?)
    }
    fn rope_norm(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<i32>,
        n_heads: usize,
        head_dim: usize,
        first: usize,
        p: &RopeParams,
    ) -> Result<(), BackendError> {
        replayed!(self);
        shapes::rope_norm(x.len(), positions.len(), n_heads, head_dim, first, p.n_dims)?;
        no_freq_factors("rope_norm", p)?;
        Ok(CudaDevice::rope_norm(
            self, x, positions, n_heads, head_dim, first, p,
        )?)
    }
    fn matmul_heads(
        &self,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        n_heads: usize,
        x_stride: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        let out = shapes::matmul_heads(w.rows(), w.cols(), n, n_heads, x_stride, x.len(), y.len())?;
        Ok(CudaDevice::matmul_heads(
            self, w, x, n, n_heads, x_stride, out, y,
        )?)
    }
    fn swiglu(
        &self,
        gate: &mut CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), BackendError> {
        replayed!(self);
        shapes::swiglu(gate.len(), up.len(), n)?;
        Ok(CudaDevice::swiglu(self, gate, up, n)?)
    }
    fn attention_k_only_at(
        &self,
        p: &KOnlyAttnParams,
        q: &CudaSlice<f32>,
        k_cache: &KvRing<Self>,
        n_tokens: usize,
        positions: &CudaSlice<i32>,
        first: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        let at = position_at("attention_k_only", positions, first)?;
        let ty = k_cache.layout.ty;
        if !self.k_only_types().contains(&ty) {
            return Err(BackendError::UnsupportedType {
                ty,
                op: "attention_k_only",
            });
        }
        // The shape (the position is read on the device; the kernel writes nothing for a batch
        // that would see past the ring).
        shapes::attention_k_only(p, q.len(), &k_cache.layout, out.len(), n_tokens, 0)?;
        // The kernels read latent rings as the executor lays them out: not rotated.
        if k_cache.layout.rot != 0 {
            return Err(BackendError::Shape {
                op: "attention_k_only",
                what: format!("a K-only ring rotated in chunks of {}", k_cache.layout.rot),
            });
        }
        Ok(CudaDevice::attention_k_only(
            self,
            p,
            q,
            ty,
            &k_cache.data,
            n_tokens,
            &at,
            out,
        )?)
    }
    fn route(
        &self,
        logits: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        gating: Gating,
        routing: &Routing,
        n_expert: usize,
        selected: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        replayed!(self);
        shapes::route(
            routing,
            n_expert,
            logits.len(),
            bias.map(|b| b.len()),
            selected.len(),
            weights.len(),
        )?;
        Ok(CudaDevice::route(
            self, logits, bias, gating, routing, n_expert, selected, weights,
        )?)
    }
    fn staging(&self, n_d: usize, n_k: usize) -> Result<PinnedIo, BackendError> {
        let layout = PackedDown { n_d, n_k };
        Ok(PinnedIo {
            layout,
            packed: self.alloc_zeros::<f32>(layout.words())?,
            down: self.alloc_pinned(layout.words())?,
            sel: vec![0; n_k],
            out: self.alloc_pinned(n_d)?,
        })
    }
    fn stage_down(
        &self,
        st: &mut PinnedIo,
        h: &CudaSlice<f32>,
        sel: &CudaSlice<i32>,
        w: &CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        let l = st.layout;
        l.check(h.len(), sel.len(), w.len())?;
        let s = self.stream();
        // Packed on the device (copies within device memory), then one copy down.
        s.memcpy_dtod(h, &mut st.packed.slice_mut(l.h()))
            .map_err(CudaError::from)?;
        s.memcpy_dtod(w, &mut st.packed.slice_mut(l.w()))
            .map_err(CudaError::from)?;
        // SAFETY: i32 and f32 have the same size and alignment and every bit pattern is a
        // valid f32; the view covers exactly `sel`'s `n_k` elements, and the bits are only
        // moved (a device copy), never computed with.
        let ids = unsafe { sel.transmute::<f32>(l.n_k) }.ok_or_else(|| BackendError::Shape {
            op: "stage_down",
            what: format!("ids of {} as {} words", sel.len(), l.n_k),
        })?;
        s.memcpy_dtod(&ids, &mut st.packed.slice_mut(l.sel()))
            .map_err(CudaError::from)?;
        Ok(self.download_async(&st.packed, &mut st.down)?)
    }
    fn staged<'s>(&self, st: &'s mut PinnedIo) -> Result<StagedIo<'s>, BackendError> {
        let l = st.layout;
        // `as_slice` waits for the one copy down; `as_mut_slice` for the last copy up.
        let down = st.down.as_slice().map_err(CudaError::from)?;
        l.unpack_sel(down, &mut st.sel);
        Ok(StagedIo {
            h: &down[l.h()],
            sel: &st.sel,
            w: &down[l.w()],
            out: st.out.as_mut_slice().map_err(CudaError::from)?,
        })
    }
    fn stage_up(&self, st: &PinnedIo, out: &mut CudaSlice<f32>) -> Result<(), BackendError> {
        Ok(self.upload_async(&st.out, out)?)
    }
    fn begin_segment(&self, key: u64) -> Result<(), BackendError> {
        Ok(self.graphs.begin(self.stream(), key)?)
    }
    fn end_segment(&self) -> Result<(), BackendError> {
        Ok(self.graphs.end(self.stream())?)
    }
    fn forget_segments(&self) {
        self.graphs.forget(self.stream());
    }
}

/// The RoPE kernels take no frequency factors ([`crate::CAPABILITIES`] says so, and the engine
/// runs files with `rope_freqs.weight` on the CPU).
fn no_freq_factors(op: &'static str, p: &RopeParams) -> Result<(), BackendError> {
    match p.freq_factors {
        Some(_) => Err(BackendError::Unsupported {
            op,
            what: "RoPE frequency factors".into(),
        }),
        None => Ok(()),
    }
}
