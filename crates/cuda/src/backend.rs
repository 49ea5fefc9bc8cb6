//! The ops [`crate::GpuGptOss`] runs, as a trait: [`CudaDevice`] implements it with the CUDA
//! kernels, [`crate::RefBackend`] in plain Rust with the kernels' semantics, so that the
//! executor's own logic (shapes, order of ops, K/V rings, the host round trip, op offload) is
//! tested on any machine.

use std::ops::Range;

use cudarc::driver::{CudaSlice, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};
use hmoe_model::hybrid::ExpertTensors;
use hmoe_quant::GgmlType;

use crate::device::{AttnParams, CudaDevice, DeviceMatrix, MoeWeights, RopeParams};
use crate::error::CudaError;

/// An element type of device buffers: f32 activations, i32 ids, u16 f16 bits, u8 bytes.
pub trait Elem:
    DeviceRepr + ValidAsZeroBits + Default + Copy + Send + Sync + std::fmt::Debug + 'static
{
}
impl Elem for f32 {}
impl Elem for i32 {}
impl Elem for u16 {}
impl Elem for u8 {}

/// The host side of one round trip: the inputs brought down and the output to send up.
pub struct StagedIo<'s> {
    /// Normed hidden state, `n × d`.
    pub h: &'s [f32],
    /// Chosen experts, `n × k`.
    pub sel: &'s [i32],
    /// Their weights, `n × k`.
    pub w: &'s [f32],
    /// The expert sum to send up, `n × d`.
    pub out: &'s mut [f32],
}

/// A device that runs gpt-oss's ops. Every op is queued in order; downloads wait for what
/// was queued before them. Shapes follow [`CudaDevice`]'s methods of the same names.
pub trait Backend: Send + Sync {
    /// A buffer of `T` on the device.
    type Buf<T: Elem>: Send + Sync;
    /// A weight matrix in its file encoding.
    type Matrix: Send + Sync;
    /// One layer's routed experts (all, or a subset renumbered `0..m`).
    type Moe: Send + Sync;
    /// Host buffers of the round trip.
    type Staging: Send;

    /// A name for messages (`CUDA0`).
    fn name(&self) -> String;
    /// Device memory free now, in bytes; `None` where there is no limit to respect.
    fn free_memory(&self) -> Result<Option<u64>, CudaError>;
    /// A buffer holding a copy of `src`.
    fn upload<T: Elem>(&self, src: &[T]) -> Result<Self::Buf<T>, CudaError>;
    /// A zeroed buffer of `len` elements.
    fn alloc<T: Elem>(&self, len: usize) -> Result<Self::Buf<T>, CudaError>;
    /// The contents of `src`.
    fn download<T: Elem>(&self, src: &Self::Buf<T>) -> Result<Vec<T>, CudaError>;
    /// Elements in `b`.
    fn buf_len<T: Elem>(b: &Self::Buf<T>) -> usize;
    /// A new buffer holding `src[range]`.
    fn copy_range(
        &self,
        src: &Self::Buf<f32>,
        range: Range<usize>,
    ) -> Result<Self::Buf<f32>, CudaError>;
    /// Waits for everything queued.
    fn synchronize(&self) -> Result<(), CudaError>;
    /// Uploads `rows` rows of `cols` elements of `ty`.
    fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Self::Matrix, CudaError>;
    /// Bytes a matrix occupies.
    fn matrix_bytes(m: &Self::Matrix) -> usize;
    /// Uploads the experts `ids` of `t` (every expert when `None`), renumbered `0..ids.len()`.
    fn upload_moe(
        &self,
        t: &ExpertTensors<'_>,
        ids: Option<&[usize]>,
    ) -> Result<Self::Moe, CudaError>;
    /// Bytes an expert set occupies.
    fn moe_bytes(m: &Self::Moe) -> usize;
    /// Embedding rows.
    fn get_rows(
        &self,
        table: &Self::Matrix,
        ids: &Self::Buf<i32>,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), CudaError>;
    /// RMSNorm of every row.
    fn rms_norm(
        &self,
        x: &Self::Buf<f32>,
        weight: &Self::Buf<f32>,
        eps: f32,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), CudaError>;
    /// `y = W·x` for `n` tokens.
    fn matmul(
        &self,
        w: &Self::Matrix,
        x: &Self::Buf<f32>,
        n: usize,
        y: &mut Self::Buf<f32>,
    ) -> Result<(), CudaError>;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Buf<f32>, y: &Self::Buf<f32>) -> Result<(), CudaError>;
    /// `x[r] += bias` for every row.
    fn add_bias(&self, x: &mut Self::Buf<f32>, bias: &Self::Buf<f32>) -> Result<(), CudaError>;
    /// NeoX RoPE in place.
    fn rope_neox(
        &self,
        x: &mut Self::Buf<f32>,
        positions: &Self::Buf<i32>,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), CudaError>;
    /// K or V rows into an f16 ring.
    fn kv_store_f16(
        &self,
        src: &Self::Buf<f32>,
        cache: &mut Self::Buf<u16>,
        n_tokens: usize,
        width: usize,
        cells: usize,
        pos0: usize,
    ) -> Result<(), CudaError>;
    /// Attention over the f16 rings.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        p: &AttnParams,
        q: &Self::Buf<f32>,
        k_cache: &Self::Buf<u16>,
        v_cache: &Self::Buf<u16>,
        sinks: Option<&Self::Buf<f32>>,
        n_tokens: usize,
        pos0: usize,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), CudaError>;
    /// Top-k of the router logits and the softmax over them.
    fn router_top_k(
        &self,
        logits: &Self::Buf<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut Self::Buf<i32>,
        weights: &mut Self::Buf<f32>,
    ) -> Result<(), CudaError>;
    /// The weighted expert sum of a layer.
    fn moe(
        &self,
        w: &Self::Moe,
        x: &Self::Buf<f32>,
        selected: &Self::Buf<i32>,
        weights: &Self::Buf<f32>,
        k: usize,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), CudaError>;
    /// Host buffers for a round trip of `n_d` hidden values and `n_k` expert slots.
    fn staging(&self, n_d: usize, n_k: usize) -> Result<Self::Staging, CudaError>;
    /// Queues the copies of `h`, `sel` and `w` down into `st`.
    fn stage_down(
        &self,
        st: &mut Self::Staging,
        h: &Self::Buf<f32>,
        sel: &Self::Buf<i32>,
        w: &Self::Buf<f32>,
    ) -> Result<(), CudaError>;
    /// The staged inputs (waiting for their copies) and the output buffer.
    fn staged<'s>(&self, st: &'s mut Self::Staging) -> Result<StagedIo<'s>, CudaError>;
    /// Queues the copy of the staged output up into `out`.
    fn stage_up(&self, st: &Self::Staging, out: &mut Self::Buf<f32>) -> Result<(), CudaError>;
}

/// Pinned buffers of the CUDA round trip.
pub struct PinnedIo {
    h: PinnedHostSlice<f32>,
    sel: PinnedHostSlice<i32>,
    w: PinnedHostSlice<f32>,
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
    fn free_memory(&self) -> Result<Option<u64>, CudaError> {
        Ok(Some(self.mem_info()?.0))
    }
    fn upload<T: Elem>(&self, src: &[T]) -> Result<CudaSlice<T>, CudaError> {
        CudaDevice::upload(self, src)
    }
    fn alloc<T: Elem>(&self, len: usize) -> Result<CudaSlice<T>, CudaError> {
        self.alloc_zeros(len)
    }
    fn download<T: Elem>(&self, src: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
        CudaDevice::download(self, src)
    }
    fn buf_len<T: Elem>(b: &CudaSlice<T>) -> usize {
        b.len()
    }
    fn copy_range(
        &self,
        src: &CudaSlice<f32>,
        range: Range<usize>,
    ) -> Result<CudaSlice<f32>, CudaError> {
        CudaDevice::copy_range(self, src, range)
    }
    fn synchronize(&self) -> Result<(), CudaError> {
        CudaDevice::synchronize(self)
    }
    fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<DeviceMatrix, CudaError> {
        CudaDevice::upload_matrix(self, ty, rows, cols, data)
    }
    fn matrix_bytes(m: &DeviceMatrix) -> usize {
        m.bytes()
    }
    fn upload_moe(
        &self,
        t: &ExpertTensors<'_>,
        ids: Option<&[usize]>,
    ) -> Result<MoeWeights, CudaError> {
        let (d, ff) = (t.gate.n_in, t.gate.n_out);
        let all: Vec<usize>;
        let ids = match ids {
            Some(ids) => ids,
            None => {
                all = (0..t.n_expert).collect();
                &all
            }
        };
        let bad = |what: &str| CudaError::Shape {
            op: "upload_moe",
            what: format!("expert {what} missing from the tensors"),
        };
        let parts = |m: &hmoe_model::hybrid::ExpertMatrix<'_>, rows: usize, cols: usize| {
            let mut p = Vec::with_capacity(ids.len());
            for &e in ids {
                p.push(m.expert(e).ok_or_else(|| bad("matrix"))?);
            }
            self.upload_experts_from(m.ty, rows, cols, &p)
        };
        let biases = |b: &[f32], w: usize| -> Result<CudaSlice<f32>, CudaError> {
            let mut v = Vec::with_capacity(ids.len() * w);
            for &e in ids {
                v.extend_from_slice(b.get(e * w..(e + 1) * w).ok_or_else(|| bad("bias"))?);
            }
            self.upload_for_offload(&v)
        };
        Ok(MoeWeights {
            gate: parts(&t.gate, ff, d)?,
            up: parts(&t.up, ff, d)?,
            down: parts(&t.down, d, ff)?,
            gate_bias: Some(biases(t.gate_bias, ff)?),
            up_bias: Some(biases(t.up_bias, ff)?),
            down_bias: Some(biases(t.down_bias, d)?),
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
    ) -> Result<(), CudaError> {
        CudaDevice::get_rows(self, table, ids, out)
    }
    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        CudaDevice::rms_norm(self, x, weight, eps, out)
    }
    fn matmul(
        &self,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        CudaDevice::matmul(self, w, x, n, y)
    }
    fn add_assign(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<(), CudaError> {
        CudaDevice::add_assign(self, x, y)
    }
    fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>) -> Result<(), CudaError> {
        CudaDevice::add_bias(self, x, bias)
    }
    fn rope_neox(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<i32>,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        CudaDevice::rope_neox(self, x, positions, n_heads, head_dim, p)
    }
    fn kv_store_f16(
        &self,
        src: &CudaSlice<f32>,
        cache: &mut CudaSlice<u16>,
        n_tokens: usize,
        width: usize,
        cells: usize,
        pos0: usize,
    ) -> Result<(), CudaError> {
        CudaDevice::kv_store_f16(self, src, cache, n_tokens, width, cells, pos0)
    }
    fn attention(
        &self,
        p: &AttnParams,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        sinks: Option<&CudaSlice<f32>>,
        n_tokens: usize,
        pos0: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        CudaDevice::attention(self, p, q, k_cache, v_cache, sinks, n_tokens, pos0, out)
    }
    fn router_top_k(
        &self,
        logits: &CudaSlice<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        CudaDevice::router_top_k(self, logits, n_expert, k, selected, weights)
    }
    fn moe(
        &self,
        w: &MoeWeights,
        x: &CudaSlice<f32>,
        selected: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        k: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        CudaDevice::moe(self, w, x, selected, weights, k, out)
    }
    fn staging(&self, n_d: usize, n_k: usize) -> Result<PinnedIo, CudaError> {
        Ok(PinnedIo {
            h: self.alloc_pinned(n_d)?,
            sel: self.alloc_pinned(n_k)?,
            w: self.alloc_pinned(n_k)?,
            out: self.alloc_pinned(n_d)?,
        })
    }
    fn stage_down(
        &self,
        st: &mut PinnedIo,
        h: &CudaSlice<f32>,
        sel: &CudaSlice<i32>,
        w: &CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.download_async(h, &mut st.h)?;
        self.download_async(sel, &mut st.sel)?;
        self.download_async(w, &mut st.w)
    }
    fn staged<'s>(&self, st: &'s mut PinnedIo) -> Result<StagedIo<'s>, CudaError> {
        // `as_slice` waits for the copies into each buffer.
        Ok(StagedIo {
            h: st.h.as_slice()?,
            sel: st.sel.as_slice()?,
            w: st.w.as_slice()?,
            out: st.out.as_mut_slice()?,
        })
    }
    fn stage_up(&self, st: &PinnedIo, out: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        self.upload_async(&st.out, out)
    }
}
