//! The device contract of hmoe (`docs/architecture.md`, the `backend` layer): the [`Backend`] trait,
//! which a device implements to hold weights and buffers and run the ops of a forward pass
//! over them, its element and parameter types, and [`Ref0`], a reference device in plain Rust
//! that behaves like a GPU (its own memory with a byte budget, every transfer counted).
//!
//! The contract knows no architecture: it names tensors by role (a weight matrix in its file
//! encoding, one layer's stacked routed experts), never by model. The architectures (crate
//! `hmoe-model`) are written over it; the devices (`hmoe-cuda`'s `CudaDevice`, [`Ref0`])
//! implement it. Dependencies run one way: `gguf → quant → backend → model`, and
//! `backend → cuda`.
//!
//! Every op is queued in order on the device; downloads wait for what was queued before them.
#![warn(missing_docs)]

pub mod attention_scratch;
mod capabilities;
mod error;
mod experts;
pub mod host_ops;
mod kv_ring;
mod kv_type;
pub mod numerics;
pub mod packed_staging;
mod params;
mod ref0;
mod ref0_kv;
pub mod routing;
pub mod shapes;
mod shared_bytes;
mod top_k;

use std::ops::Range;

use hmoe_quant::GgmlType;

pub use capabilities::Capabilities;
pub use error::BackendError;
pub use experts::{ExpertMatrix, ExpertTensors, ExpertView};
pub use host_ops::HostStaging;
pub use kv_ring::{kv_row_count, kv_rows_range, KvLayout, KvRing, KV_TYPES};
pub use kv_type::{CacheType, FlashAttn, KvType, KvTypeError};
pub use packed_staging::PackedDown;
pub use params::{AttnParams, FreqFactors, KOnlyAttnParams, RopeParams, RowCopy, MAX_ROPE_PAIRS};
pub use ref0::{
    Ref0, Ref0Event, RefBuf, RefMatrix, RefMoe, ReplayStats, QUANT_KERNEL_TYPES, REF0_CAPABILITIES,
    REF0_NAME, REF0_TYPES,
};
pub use routing::{Gating, Routing};
pub use shared_bytes::{PageRelease, SharedBytes};
pub use top_k::{
    top_k_chunked, top_k_chunked_scratch, top_k_key, top_k_key_id, top_k_rank, top_k_rows,
    top_k_shape, TOP_K_CHUNK, TOP_K_MAX,
};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for i32 {}
    impl Sealed for u16 {}
    impl Sealed for u8 {}
}

/// An element type of device buffers: f32 activations, i32 ids and positions, u16 f16 bits,
/// u8 bytes (K/V rings). Sealed: these four are the types every device supports; generic
/// code reaches the device's method for each through [`Backend::upload`], [`Backend::alloc`],
/// [`Backend::alloc_scratch`], [`Backend::upload_into`] and [`Backend::download`].
pub trait Elem:
    Copy + Default + PartialEq + Send + Sync + std::fmt::Debug + 'static + sealed::Sealed
{
    /// Bytes per element.
    const BYTES: usize;
    /// What [`Ref0`] fills a [`Backend::alloc_scratch`] buffer with, so that an op that
    /// reads scratch it did not write first shows in its results: a quiet NaN for f32 (and
    /// its bits for u16, an f16 NaN), an expert id and a position no buffer holds for i32,
    /// 0xFF for bytes.
    const POISON: Self;
    /// `b`'s upload for this type.
    fn upload_to<B: Backend + ?Sized>(b: &B, src: &[Self]) -> Result<B::Buf<Self>, BackendError>;
    /// `b`'s zeroed allocation for this type.
    fn alloc_on<B: Backend + ?Sized>(b: &B, len: usize) -> Result<B::Buf<Self>, BackendError>;
    /// `b`'s scratch allocation for this type (contents unspecified).
    fn scratch_on<B: Backend + ?Sized>(b: &B, len: usize) -> Result<B::Buf<Self>, BackendError>;
    /// `b`'s copy of `src` into an existing buffer for this type.
    fn upload_into_on<B: Backend + ?Sized>(
        b: &B,
        dst: &mut B::Buf<Self>,
        src: &[Self],
    ) -> Result<(), BackendError>;
    /// `b`'s download for this type.
    fn download_from<B: Backend + ?Sized>(
        b: &B,
        src: &B::Buf<Self>,
    ) -> Result<Vec<Self>, BackendError>;
}

macro_rules! elem {
    ($t:ty, $poison:expr, $up:ident, $alloc:ident, $scratch:ident, $into:ident, $down:ident) => {
        impl Elem for $t {
            const BYTES: usize = std::mem::size_of::<$t>();
            const POISON: $t = $poison;
            fn upload_to<B: Backend + ?Sized>(
                b: &B,
                src: &[$t],
            ) -> Result<B::Buf<$t>, BackendError> {
                b.$up(src)
            }
            fn alloc_on<B: Backend + ?Sized>(
                b: &B,
                len: usize,
            ) -> Result<B::Buf<$t>, BackendError> {
                b.$alloc(len)
            }
            fn scratch_on<B: Backend + ?Sized>(
                b: &B,
                len: usize,
            ) -> Result<B::Buf<$t>, BackendError> {
                b.$scratch(len)
            }
            fn upload_into_on<B: Backend + ?Sized>(
                b: &B,
                dst: &mut B::Buf<$t>,
                src: &[$t],
            ) -> Result<(), BackendError> {
                b.$into(dst, src)
            }
            fn download_from<B: Backend + ?Sized>(
                b: &B,
                src: &B::Buf<$t>,
            ) -> Result<Vec<$t>, BackendError> {
                b.$down(src)
            }
        }
    };
}
elem!(
    f32,
    f32::NAN,
    upload_f32,
    alloc_f32,
    alloc_scratch_f32,
    upload_into_f32,
    download_f32
);
elem!(
    i32,
    i32::MIN,
    upload_i32,
    alloc_i32,
    alloc_scratch_i32,
    upload_into_i32,
    download_i32
);
elem!(
    u16,
    0x7E00,
    upload_u16,
    alloc_u16,
    alloc_scratch_u16,
    upload_into_u16,
    download_u16
);
elem!(
    u8,
    0xFF,
    upload_u8,
    alloc_u8,
    alloc_scratch_u8,
    upload_into_u8,
    download_u8
);

/// The shape error of [`Backend::upload_into`] when `src_len` elements do not fill a buffer
/// of `dst_len`.
pub fn check_upload_into(src_len: usize, dst_len: usize) -> Result<(), BackendError> {
    error::ensure(src_len == dst_len, "upload_into", || {
        format!("{src_len} values into a buffer of {dst_len}")
    })
}

/// The elements `dst[at..at + src_len]` that [`Backend::copy_into`] writes, or the shape
/// error for a destination of `dst_len` elements that does not hold them.
pub fn copy_into_range(
    src_len: usize,
    dst_len: usize,
    at: usize,
) -> Result<Range<usize>, BackendError> {
    match at.checked_add(src_len).filter(|&end| end <= dst_len) {
        Some(end) => Ok(at..end),
        None => Err(BackendError::Shape {
            op: "copy_into",
            what: format!("{src_len} values at {at} of {dst_len}"),
        }),
    }
}

/// The host side of one round trip at the expert boundary: the inputs brought down and the
/// output to send up.
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

/// Host ↔ device copies a device counted (every upload and download, weights included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferCounts {
    /// Host → device copies (buffers, weight matrices, expert sets, staged expert sums).
    pub uploads: u64,
    /// Their bytes.
    pub upload_bytes: u64,
    /// Device → host copies (buffers, and each staged round trip's inputs as one).
    pub downloads: u64,
    /// Their bytes.
    pub download_bytes: u64,
}

/// The gated activation of a routed expert, `h = act(gate·x + bg, up·x + bu)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GatedAct {
    /// The clamped SwiGLU with the input-scaled sigmoid:
    /// `g = min(g, limit)`, `u = clamp(u, −limit, limit)`, `h = g·σ(alpha·g)·(u + 1)`.
    ClampedSwiglu {
        /// The sigmoid's input scale.
        alpha: f32,
        /// The clamp.
        limit: f32,
    },
    /// SwiGLU, `h = silu(g)·u`, as the CPU device's SwiGLU experts compute it (Qwen3-MoE,
    /// DeepSeek): [`numerics::swiglu_row`] over each expert row of `ff` values, and every
    /// product of F32 experts in `vec_dot` order (ggml's `mul_mat_id`), however many slots
    /// route to the expert.
    Silu,
}

impl GatedAct {
    /// `act(gate, up)` of one element in f32 with libm's `exp`, as the CPU device computes it
    /// (for [`GatedAct::Silu`]: an element past a row's last whole 16-block; see
    /// [`GatedAct::apply_row`]).
    pub fn apply(self, gate: f32, up: f32) -> f32 {
        match self {
            GatedAct::ClampedSwiglu { alpha, limit } => {
                let x = gate.min(limit);
                let y = up.clamp(-limit, limit);
                x / (1.0 + (-alpha * x).exp()) * (y + 1.0)
            }
            GatedAct::Silu => gate / (1.0 + (-gate).exp()) * up,
        }
    }

    /// `gate[i] = act(gate[i], up[i])` over one expert row, as the CPU device computes it.
    pub fn apply_row(self, gate: &mut [f32], up: &[f32]) {
        match self {
            GatedAct::ClampedSwiglu { .. } => {
                for (g, &u) in gate.iter_mut().zip(up) {
                    *g = self.apply(*g, u);
                }
            }
            GatedAct::Silu => numerics::swiglu_row(gate, up),
        }
    }
}

/// A device that holds weights and buffers and runs the ops of a forward pass over them.
/// Shapes are row-major: `n` tokens of `width` values are `n × width` consecutive elements.
///
/// Buffers are typed by [`Elem`]; a device implements the per-type `upload_*`, `alloc_*` and
/// `download_*` methods (and may implement `alloc_scratch_*` and `upload_into_*`, whose
/// defaults allocate), and generic code calls [`Backend::upload`], [`Backend::alloc`],
/// [`Backend::alloc_scratch`], [`Backend::upload_into`] and [`Backend::download`].
pub trait Backend: Send + Sync {
    /// A buffer of `T` on the device.
    type Buf<T: Elem>: Send + Sync;
    /// A weight matrix in its file encoding.
    type Matrix: Send + Sync;
    /// One layer's routed experts (all, or a subset renumbered `0..m`).
    type Moe: Send + Sync;
    /// Host buffers of the expert-boundary round trip.
    type Staging: Send;

    /// A name for messages and device lists (`CUDA0`, `REF0`).
    fn name(&self) -> String;
    /// Device memory free now, in bytes; `None` where there is no limit to respect.
    fn free_memory(&self) -> Result<Option<u64>, BackendError>;
    /// Host ↔ device copies counted so far; `None` for a device that does not count them.
    fn transfers(&self) -> Option<TransferCounts> {
        None
    }
    /// Whether the device is the host itself (the CPU): its memory is RAM, no bus between.
    fn is_host(&self) -> bool {
        false
    }

    /// A buffer holding a copy of `src`.
    fn upload<T: Elem>(&self, src: &[T]) -> Result<Self::Buf<T>, BackendError> {
        T::upload_to(self, src)
    }
    /// A zeroed buffer of `len` elements.
    fn alloc<T: Elem>(&self, len: usize) -> Result<Self::Buf<T>, BackendError> {
        T::alloc_on(self, len)
    }
    /// A buffer of `len` elements whose contents are unspecified: scratch that the ops
    /// writing it overwrite whole before anything reads it (every op's output is written
    /// whole, see each op), so a device need not clear it (CUDA: no memset). [`Ref0`] fills
    /// it with [`Elem::POISON`], so that a reader relying on zeros fails its tests; a device
    /// without a cheaper way gives a zeroed buffer ([`Backend::alloc`], the default).
    fn alloc_scratch<T: Elem>(&self, len: usize) -> Result<Self::Buf<T>, BackendError> {
        T::scratch_on(self, len)
    }
    /// Copies `src` into `dst`, which holds exactly `src.len()` elements (else the shape
    /// error of [`check_upload_into`]): [`Backend::upload`] into a buffer the caller keeps,
    /// counted as an upload, allocating nothing on a device that implements it (by default
    /// `dst` is replaced by a new upload).
    fn upload_into<T: Elem>(&self, dst: &mut Self::Buf<T>, src: &[T]) -> Result<(), BackendError> {
        T::upload_into_on(self, dst, src)
    }
    /// The contents of `src`.
    fn download<T: Elem>(&self, src: &Self::Buf<T>) -> Result<Vec<T>, BackendError> {
        T::download_from(self, src)
    }
    /// [`Backend::upload`] of f32.
    fn upload_f32(&self, src: &[f32]) -> Result<Self::Buf<f32>, BackendError>;
    /// [`Backend::upload`] of i32.
    fn upload_i32(&self, src: &[i32]) -> Result<Self::Buf<i32>, BackendError>;
    /// [`Backend::upload`] of u16.
    fn upload_u16(&self, src: &[u16]) -> Result<Self::Buf<u16>, BackendError>;
    /// [`Backend::upload`] of u8.
    fn upload_u8(&self, src: &[u8]) -> Result<Self::Buf<u8>, BackendError>;
    /// [`Backend::alloc`] of f32.
    fn alloc_f32(&self, len: usize) -> Result<Self::Buf<f32>, BackendError>;
    /// [`Backend::alloc`] of i32.
    fn alloc_i32(&self, len: usize) -> Result<Self::Buf<i32>, BackendError>;
    /// [`Backend::alloc`] of u16.
    fn alloc_u16(&self, len: usize) -> Result<Self::Buf<u16>, BackendError>;
    /// [`Backend::alloc`] of u8.
    fn alloc_u8(&self, len: usize) -> Result<Self::Buf<u8>, BackendError>;
    /// [`Backend::alloc_scratch`] of f32 (by default zeroed).
    fn alloc_scratch_f32(&self, len: usize) -> Result<Self::Buf<f32>, BackendError> {
        self.alloc_f32(len)
    }
    /// [`Backend::alloc_scratch`] of i32 (by default zeroed).
    fn alloc_scratch_i32(&self, len: usize) -> Result<Self::Buf<i32>, BackendError> {
        self.alloc_i32(len)
    }
    /// [`Backend::alloc_scratch`] of u16 (by default zeroed).
    fn alloc_scratch_u16(&self, len: usize) -> Result<Self::Buf<u16>, BackendError> {
        self.alloc_u16(len)
    }
    /// [`Backend::alloc_scratch`] of u8 (by default zeroed).
    fn alloc_scratch_u8(&self, len: usize) -> Result<Self::Buf<u8>, BackendError> {
        self.alloc_u8(len)
    }
    /// [`Backend::upload_into`] of f32 (by default a new upload replaces `dst`).
    fn upload_into_f32(&self, dst: &mut Self::Buf<f32>, src: &[f32]) -> Result<(), BackendError> {
        check_upload_into(src.len(), Self::buf_len(dst))?;
        *dst = self.upload_f32(src)?;
        Ok(())
    }
    /// [`Backend::upload_into`] of i32 (by default a new upload replaces `dst`).
    fn upload_into_i32(&self, dst: &mut Self::Buf<i32>, src: &[i32]) -> Result<(), BackendError> {
        check_upload_into(src.len(), Self::buf_len(dst))?;
        *dst = self.upload_i32(src)?;
        Ok(())
    }
    /// [`Backend::upload_into`] of u16 (by default a new upload replaces `dst`).
    fn upload_into_u16(&self, dst: &mut Self::Buf<u16>, src: &[u16]) -> Result<(), BackendError> {
        check_upload_into(src.len(), Self::buf_len(dst))?;
        *dst = self.upload_u16(src)?;
        Ok(())
    }
    /// [`Backend::upload_into`] of u8 (by default a new upload replaces `dst`).
    fn upload_into_u8(&self, dst: &mut Self::Buf<u8>, src: &[u8]) -> Result<(), BackendError> {
        check_upload_into(src.len(), Self::buf_len(dst))?;
        *dst = self.upload_u8(src)?;
        Ok(())
    }
    /// [`Backend::download`] of f32.
    fn download_f32(&self, src: &Self::Buf<f32>) -> Result<Vec<f32>, BackendError>;
    /// [`Backend::download`] of i32.
    fn download_i32(&self, src: &Self::Buf<i32>) -> Result<Vec<i32>, BackendError>;
    /// [`Backend::download`] of u16.
    fn download_u16(&self, src: &Self::Buf<u16>) -> Result<Vec<u16>, BackendError>;
    /// [`Backend::download`] of u8.
    fn download_u8(&self, src: &Self::Buf<u8>) -> Result<Vec<u8>, BackendError>;

    /// Elements in `b`.
    fn buf_len<T: Elem>(b: &Self::Buf<T>) -> usize;
    /// A new buffer holding `src[range]` (a copy on the device).
    fn copy_range(
        &self,
        src: &Self::Buf<f32>,
        range: Range<usize>,
    ) -> Result<Self::Buf<f32>, BackendError>;
    /// Copies all of `src` into `dst` from element `at` on (a copy on the device): with
    /// [`Backend::copy_range`], how per-sequence results are gathered into a batch.
    fn copy_into(
        &self,
        src: &Self::Buf<f32>,
        dst: &mut Self::Buf<f32>,
        at: usize,
    ) -> Result<(), BackendError>;
    /// Waits for everything queued.
    fn synchronize(&self) -> Result<(), BackendError>;
    /// Uploads `rows` rows of `cols` elements of `ty` in their file encoding.
    fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Self::Matrix, BackendError>;
    /// [`Backend::upload_matrix`] of bytes that stay in place while `data` lives (a tensor in
    /// the file mapping): a device on the host keeps the handle and never copies the weights;
    /// by default a copy is uploaded.
    fn upload_matrix_shared(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &SharedBytes,
    ) -> Result<Self::Matrix, BackendError> {
        self.upload_matrix(ty, rows, cols, data.bytes())
    }
    /// Bytes a matrix occupies.
    fn matrix_bytes(m: &Self::Matrix) -> usize;
    /// Uploads the experts `ids` of `t` (every expert when `None`), renumbered `0..ids.len()`.
    fn upload_moe(
        &self,
        t: &ExpertTensors<'_>,
        ids: Option<&[usize]>,
    ) -> Result<Self::Moe, BackendError>;
    /// [`Backend::upload_moe`] of experts whose three stacked matrices stay in place while
    /// `data` lives: `data` holds the bytes of `t.gate.data`, `t.up.data` and `t.down.data`, in
    /// that order (tensors in the file mapping), so that a device on the host keeps the
    /// handles and never copies the experts; by default a copy is uploaded.
    fn upload_moe_shared(
        &self,
        t: &ExpertTensors<'_>,
        data: &[SharedBytes; 3],
        ids: Option<&[usize]>,
    ) -> Result<Self::Moe, BackendError> {
        let _ = data;
        self.upload_moe(t, ids)
    }
    /// Bytes an expert set occupies.
    fn moe_bytes(m: &Self::Moe) -> usize;
    /// Embedding rows: row `ids[i]` of `table`, dequantized to f32, into row `i` of `out`.
    fn get_rows(
        &self,
        table: &Self::Matrix,
        ids: &Self::Buf<i32>,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError>;
    /// RMSNorm of every row of `x` (rows of `weight`'s length), times `weight`.
    fn rms_norm(
        &self,
        x: &Self::Buf<f32>,
        weight: &Self::Buf<f32>,
        eps: f32,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError>;
    /// `y = W·x` for `n` tokens, activations converted to the weight type's `vec_dot_type`.
    fn matmul(
        &self,
        w: &Self::Matrix,
        x: &Self::Buf<f32>,
        n: usize,
        y: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError>;
    /// `ys[i] = ws[i]·x + biases[i]` for `n` tokens: [`Backend::matmul`] of each matrix with
    /// the same activations (Q, K and V from one normed row), then its bias (of the matrix's
    /// rows) as [`Backend::add_bias`] adds it, where it has one; with their bits. A device may
    /// convert the activations once for all of them and run the products and biases as one
    /// kernel.
    fn matmul_shared(
        &self,
        ws: &[&Self::Matrix],
        biases: &[Option<&Self::Buf<f32>>],
        x: &Self::Buf<f32>,
        n: usize,
        ys: &mut [&mut Self::Buf<f32>],
    ) -> Result<(), BackendError> {
        error::ensure(
            ws.len() == ys.len() && ws.len() == biases.len(),
            "matmul_shared",
            || {
                format!(
                    "{} matrices for {} outputs and {} biases",
                    ws.len(),
                    ys.len(),
                    biases.len()
                )
            },
        )?;
        for ((w, y), bias) in ws.iter().zip(ys.iter_mut()).zip(biases) {
            self.matmul(w, x, n, y)?;
            if let Some(bias) = bias {
                self.add_bias(y, bias)?;
            }
        }
        Ok(())
    }
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Buf<f32>, y: &Self::Buf<f32>) -> Result<(), BackendError>;
    /// The residual add and the next norm: `x += y` ([`Backend::add_assign`]), then
    /// [`Backend::rms_norm`] of the new `x` (rows of `weight`'s length) into `out`, with their
    /// bits. A device may run both as one kernel.
    fn add_rms_norm(
        &self,
        x: &mut Self::Buf<f32>,
        y: &Self::Buf<f32>,
        weight: &Self::Buf<f32>,
        eps: f32,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError> {
        self.add_assign(x, y)?;
        self.rms_norm(x, weight, eps, out)
    }
    /// A norm and the products that read it: [`Backend::rms_norm`] of `x` (rows of
    /// `weight`'s length) into `h`, after `x += pending` where there is one
    /// ([`Backend::add_rms_norm`]), then [`Backend::matmul_shared`] of `h` (`ys[i] = ws[i]·h +
    /// biases[i]` for `n` tokens), with their bits. A device may write the products'
    /// converted activations (Q8_0 blocks of `h`) in the norm's kernel.
    #[allow(clippy::too_many_arguments)]
    fn norm_matmul_shared(
        &self,
        x: &mut Self::Buf<f32>,
        pending: Option<&Self::Buf<f32>>,
        (weight, eps): (&Self::Buf<f32>, f32),
        h: &mut Self::Buf<f32>,
        ws: &[&Self::Matrix],
        biases: &[Option<&Self::Buf<f32>>],
        n: usize,
        ys: &mut [&mut Self::Buf<f32>],
    ) -> Result<(), BackendError> {
        match pending {
            Some(y) => self.add_rms_norm(x, y, weight, eps, h)?,
            None => self.rms_norm(x, weight, eps, h)?,
        }
        self.matmul_shared(ws, biases, h, n, ys)
    }
    /// `x[r] += bias` for every row `r`.
    fn add_bias(&self, x: &mut Self::Buf<f32>, bias: &Self::Buf<f32>) -> Result<(), BackendError>;
    /// NeoX RoPE (rotate halves) in place, heads of `head_dim`, one position per token.
    fn rope_neox(
        &self,
        x: &mut Self::Buf<f32>,
        positions: &Self::Buf<i32>,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), BackendError>;
    /// [`Backend::rope_neox`] of the queries `q` (`n_head` heads) and of the keys `k`
    /// (`n_head_kv` heads) at the same positions, with its bits; a device may rotate both in
    /// one kernel.
    fn rope_neox_qk(
        &self,
        q: &mut Self::Buf<f32>,
        k: &mut Self::Buf<f32>,
        positions: &Self::Buf<i32>,
        (n_head, n_head_kv): (usize, usize),
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), BackendError> {
        self.rope_neox(q, positions, n_head, head_dim, p)?;
        self.rope_neox(k, positions, n_head_kv, head_dim, p)
    }
    /// The K/V types ([`KV_TYPES`]) this device stores in rings.
    fn kv_types(&self) -> &'static [GgmlType];
    /// Whether [`Backend::attention`] reads keys of type `k` with values of type `v` (by
    /// default: whenever the device stores both).
    fn supports_kv(&self, k: GgmlType, v: GgmlType) -> bool {
        self.kv_types().contains(&k) && self.kv_types().contains(&v)
    }
    /// A zeroed ring of `layout`, or [`BackendError::UnsupportedType`] for a type the device
    /// does not keep ([`Backend::kv_types`]).
    fn kv_alloc(&self, layout: KvLayout) -> Result<KvRing<Self>, BackendError> {
        if !self.kv_types().contains(&layout.ty) {
            return Err(BackendError::UnsupportedType {
                ty: layout.ty,
                op: "kv_alloc",
            });
        }
        Ok(KvRing {
            data: self.alloc::<u8>(layout.bytes())?,
            layout,
        })
    }
    /// Rows of `n_tokens` tokens (`ring.layout.width` values each) into `ring` from position
    /// `pos0` (position `p` in cell `p % cells`), rotated and converted as the layout says
    /// (as the CPU device's cache stores them: f16/bf16 rounded to nearest even, block types
    /// by hmoe-quant's quantizers).
    ///
    /// A convenience over [`Backend::kv_store_at`] (the position uploaded into a buffer of
    /// its own): the executor's steps call that one, which a recorded segment can replay.
    /// Devices implement only the `_at` ops; the by-value ones are not overridden.
    fn kv_store(
        &self,
        src: &Self::Buf<f32>,
        ring: &mut KvRing<Self>,
        n_tokens: usize,
        pos0: usize,
    ) -> Result<(), BackendError> {
        let pos = self.upload::<i32>(&[position_i32("kv_store", pos0)?])?;
        self.kv_store_at(src, ring, n_tokens, &pos, 0)
    }
    /// [`Backend::kv_store`] from the position `positions[first]`, read on the device (the
    /// tokens at `positions[first]` and on, one apart): nothing of the call depends on the
    /// position's value, so a recorded segment ([`Backend::begin_segment`]) replays it for
    /// the next token once the step's positions are uploaded.
    fn kv_store_at(
        &self,
        src: &Self::Buf<f32>,
        ring: &mut KvRing<Self>,
        n_tokens: usize,
        positions: &Self::Buf<i32>,
        first: usize,
    ) -> Result<(), BackendError>;
    /// [`Backend::kv_store_at`] of a layer's keys `k` into `k_ring` and its values `v` into
    /// `v_ring`, with its bits; a device may store both in one kernel.
    fn kv_store_pair_at(
        &self,
        (k, k_ring): (&Self::Buf<f32>, &mut KvRing<Self>),
        (v, v_ring): (&Self::Buf<f32>, &mut KvRing<Self>),
        n_tokens: usize,
        positions: &Self::Buf<i32>,
        first: usize,
    ) -> Result<(), BackendError> {
        self.kv_store_at(k, k_ring, n_tokens, positions, first)?;
        self.kv_store_at(v, v_ring, n_tokens, positions, first)
    }
    /// The bytes of rows `cells` of `ring` as [`KvLayout`] lays them out (the rows alone,
    /// [`kv_rows_range`] of the ring): what a saved sequence keeps of its K/V
    /// (llama-server's slot files), readable by any device of the contract.
    fn kv_read(&self, ring: &KvRing<Self>, cells: Range<usize>) -> Result<Vec<u8>, BackendError>;
    /// Writes whole rows (bytes of [`KvLayout::row_bytes`] each, as [`Backend::kv_read`]
    /// gives them) into `ring` from cell `cell0` on, in place: a saved sequence's K/V
    /// restored. Rows that are not whole or do not fit the ring are a shape error
    /// ([`kv_row_count`], [`kv_rows_range`]).
    fn kv_write(
        &self,
        ring: &mut KvRing<Self>,
        cell0: usize,
        rows: &[u8],
    ) -> Result<(), BackendError>;
    /// Attention of `n_tokens` queries at positions `pos0..` over the K and V rings (causal,
    /// sliding window, GQA, and one sink logit per head when `sinks` is given), with the CPU
    /// engine's numerics for the rings' types: the row kernel (softmax, then the value sum)
    /// over f32/f16/bf16 values (one query token's f32/f16 values without sinks summed in
    /// `vec_dot`'s four chains, as the CPU device's `attention_ext`; with sinks in one, as its
    /// gpt-oss attention), with [`AttnParams::flash`] and over block-quantized values the
    /// chunked flash kernel (online softmax over chunks of
    /// [`numerics::FLASH_CHUNK`] positions); the query rotated like the keys and the output
    /// rotated back like the values.
    ///
    /// A convenience over [`Backend::attention_at`], as [`Backend::kv_store`] is.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        p: &AttnParams,
        q: &Self::Buf<f32>,
        k: &KvRing<Self>,
        v: &KvRing<Self>,
        sinks: Option<&Self::Buf<f32>>,
        n_tokens: usize,
        pos0: usize,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError> {
        let pos = self.upload::<i32>(&[position_i32("attention", pos0)?])?;
        self.attention_at(p, q, k, v, sinks, n_tokens, &pos, 0, out)
    }
    /// [`Backend::attention`] of queries from the position `positions[first]` on, read on
    /// the device (see [`Backend::kv_store_at`]): the launch does not depend on it.
    #[allow(clippy::too_many_arguments)]
    fn attention_at(
        &self,
        p: &AttnParams,
        q: &Self::Buf<f32>,
        k: &KvRing<Self>,
        v: &KvRing<Self>,
        sinks: Option<&Self::Buf<f32>>,
        n_tokens: usize,
        positions: &Self::Buf<i32>,
        first: usize,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError>;
    /// Top-`k` of each row of router logits (ties to the lower id) and the softmax over them.
    fn router_top_k(
        &self,
        logits: &Self::Buf<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut Self::Buf<i32>,
        weights: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError>;
    /// The router's logits and its choice: `logits = w·x + bias` for `n` tokens
    /// ([`Backend::matmul_shared`] of the one matrix `w`, of `n_expert` rows, with its bias),
    /// then [`Backend::router_top_k`] of them into `selected` and `weights`, with their bits.
    /// A device may run both as one kernel. Callers use it where `w`'s product runs over the
    /// whole batch at once (as [`Backend::matmul_shared`] runs it).
    #[allow(clippy::too_many_arguments)]
    fn router_top_k_logits(
        &self,
        w: &Self::Matrix,
        bias: Option<&Self::Buf<f32>>,
        x: &Self::Buf<f32>,
        n: usize,
        (n_expert, k): (usize, usize),
        logits: &mut Self::Buf<f32>,
        selected: &mut Self::Buf<i32>,
        weights: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError> {
        self.matmul_shared(&[w], &[bias], x, n, &mut [&mut *logits])?;
        self.router_top_k(logits, n_expert, k, selected, weights)
    }
    /// The `k` best logits of each row of `logits` (rows of `n_vocab`; `1 ≤ k ≤
    /// min(n_vocab, TOP_K_MAX)`), best first in [`top_k_key`]'s order (the host sampler's,
    /// NaNs first; ties to the lower id): their values (the logits' bits) into `values` and
    /// their ids into `ids`, `k` per row. `scratch` holds at least [`Backend::top_k_scratch`]
    /// elements of unspecified contents, which the op may overwrite. What a sampler whose
    /// chain needs no more brings down in place of the row.
    fn top_k(
        &self,
        logits: &Self::Buf<f32>,
        n_vocab: usize,
        k: usize,
        scratch: &mut Self::Buf<i32>,
        values: &mut Self::Buf<f32>,
        ids: &mut Self::Buf<i32>,
    ) -> Result<(), BackendError>;
    /// The scratch elements [`Backend::top_k`] needs for `n_rows` rows (by default none).
    fn top_k_scratch(&self, n_rows: usize, n_vocab: usize, k: usize) -> usize {
        let _ = (n_rows, n_vocab, k);
        0
    }
    /// The weighted expert sum of a layer, `out[t] = Σ_s weights[t,s] ·
    /// expert_{selected[t,s]}(x[t])`, slots in order, each expert
    /// `down·act(gate·x + bg, up·x + bu) + bd`; ids outside the set give nothing.
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        w: &Self::Moe,
        act: GatedAct,
        x: &Self::Buf<f32>,
        selected: &Self::Buf<i32>,
        weights: &Self::Buf<f32>,
        k: usize,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError>;
    /// Strided copy of rows from `src` into `dst` (a copy on the device), as `c` describes:
    /// how heads are split out of and gathered into wider rows.
    fn copy_rows(
        &self,
        src: &Self::Buf<f32>,
        dst: &mut Self::Buf<f32>,
        c: &RowCopy,
    ) -> Result<(), BackendError>;
    /// Normal-style RoPE (rotating adjacent pairs `(2i, 2i+1)`) in place over dims
    /// `first .. first + p.n_dims` of every head of `head_dim`, one position per token; the
    /// other dims are left as they are.
    fn rope_norm(
        &self,
        x: &mut Self::Buf<f32>,
        positions: &Self::Buf<i32>,
        n_heads: usize,
        head_dim: usize,
        first: usize,
        p: &RopeParams,
    ) -> Result<(), BackendError>;
    /// One matrix per head: `w` holds `n_heads` stacked matrices of `w.rows / n_heads` rows,
    /// and `y[(t·n_heads + h)·out + r] = W_h[r] · x[(t·n_heads + h)·x_stride ..][..cols]` for
    /// `n` tokens (the head's input the first `cols` of its `x_stride` values). Summed as
    /// [`Backend::matmul`] sums a batch of `n` tokens when every head's input is its whole row
    /// (`x_stride == cols`), else as one token each (ggml's order for a non-contiguous
    /// activation).
    fn matmul_heads(
        &self,
        w: &Self::Matrix,
        x: &Self::Buf<f32>,
        n: usize,
        n_heads: usize,
        x_stride: usize,
        y: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError>;
    /// `gate[i] = silu(gate[i]) · up[i]` in place, rows of `n` values (the dense SwiGLU
    /// feed-forward's activation; the CPU device's `exp` per position in the row).
    fn swiglu(
        &self,
        gate: &mut Self::Buf<f32>,
        up: &Self::Buf<f32>,
        n: usize,
    ) -> Result<(), BackendError>;
    /// The K/V types of the K-only rings [`Backend::attention_k_only`] reads (by default:
    /// f16).
    fn k_only_types(&self) -> &'static [GgmlType] {
        &[GgmlType::F16]
    }
    /// Attention of `n_tokens` queries at positions `pos0..` over a K-only ring of one of
    /// [`Backend::k_only_types`] (causal, every query head against the one key head; values
    /// are the first `p.v_dim` elements of each key, whole blocks of the ring's type): `out`
    /// holds `p.v_dim` values per query head, with the CPU device's numerics for the type (its
    /// row kernel with values in the keys; the query rotated like the keys and the output
    /// rotated back). A ring of another type is an [`BackendError::UnsupportedType`].
    ///
    /// A convenience over [`Backend::attention_k_only_at`], as [`Backend::kv_store`] is.
    fn attention_k_only(
        &self,
        p: &KOnlyAttnParams,
        q: &Self::Buf<f32>,
        k_cache: &KvRing<Self>,
        n_tokens: usize,
        pos0: usize,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError> {
        let pos = self.upload::<i32>(&[position_i32("attention_k_only", pos0)?])?;
        self.attention_k_only_at(p, q, k_cache, n_tokens, &pos, 0, out)
    }
    /// [`Backend::attention_k_only`] of queries from the position `positions[first]` on,
    /// read on the device (see [`Backend::kv_store_at`]).
    #[allow(clippy::too_many_arguments)]
    fn attention_k_only_at(
        &self,
        p: &KOnlyAttnParams,
        q: &Self::Buf<f32>,
        k_cache: &KvRing<Self>,
        n_tokens: usize,
        positions: &Self::Buf<i32>,
        first: usize,
        out: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError>;
    /// Expert choice of each row of router logits (`n_expert` a row): gate probabilities by
    /// `gating`, then [`Routing::select`] with the selection-only `bias` (groups, top-k,
    /// renormalisation, scale): `selected` and `weights` get `routing.k` per row.
    #[allow(clippy::too_many_arguments)]
    fn route(
        &self,
        logits: &Self::Buf<f32>,
        bias: Option<&Self::Buf<f32>>,
        gating: Gating,
        routing: &Routing,
        n_expert: usize,
        selected: &mut Self::Buf<i32>,
        weights: &mut Self::Buf<f32>,
    ) -> Result<(), BackendError>;
    /// Host buffers for a round trip of `n_d` hidden values and `n_k` expert slots.
    fn staging(&self, n_d: usize, n_k: usize) -> Result<Self::Staging, BackendError>;
    /// Queues `h`, `sel` and `w` down into `st` as one transfer: packed side by side on the
    /// device as [`PackedDown`] lays them out, then one copy of the packed buffer.
    fn stage_down(
        &self,
        st: &mut Self::Staging,
        h: &Self::Buf<f32>,
        sel: &Self::Buf<i32>,
        w: &Self::Buf<f32>,
    ) -> Result<(), BackendError>;
    /// The staged inputs (waiting for the one copy down) and the output buffer.
    fn staged<'s>(&self, st: &'s mut Self::Staging) -> Result<StagedIo<'s>, BackendError>;
    /// Queues the copy of the staged output up into `out`.
    fn stage_up(&self, st: &Self::Staging, out: &mut Self::Buf<f32>) -> Result<(), BackendError>;

    /// Opens segment `key` of a step: the ops queued until [`Backend::end_segment`] may be
    /// recorded the first time a key is seen (CUDA: captured into a graph) and replayed
    /// instead of run as issued when it is seen again, with the by-value arguments and the
    /// buffers of the recording: the caller issues the same ops over the same buffers each
    /// time, with everything that varies (ids, positions) in device buffers written before
    /// the segment opens ([`Backend::upload_into`]), and no allocation, transfer or wait
    /// inside. By default (a device that does not record) nothing happens.
    fn begin_segment(&self, key: u64) -> Result<(), BackendError> {
        let _ = key;
        Ok(())
    }
    /// Closes the segment [`Backend::begin_segment`] opened (a replayed one runs now).
    fn end_segment(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Drops every recording and closes a segment left open (after an error, or before a
    /// buffer that recordings name may be freed).
    fn forget_segments(&self) {}
}

/// `pos` as a device position, or the shape error of `op`.
fn position_i32(op: &'static str, pos: usize) -> Result<i32, BackendError> {
    i32::try_from(pos).map_err(|_| BackendError::Shape {
        op,
        what: format!("position {pos} exceeds i32"),
    })
}

/// The position `positions[first]` that an op of [`Backend::kv_store_at`]'s family reads,
/// from a buffer on the host (REF0, the CPU), or the shape error of `op`.
pub fn first_position(
    op: &'static str,
    positions: &[i32],
    first: usize,
) -> Result<usize, BackendError> {
    let p = positions.get(first).copied();
    p.and_then(|p| usize::try_from(p).ok())
        .ok_or_else(|| BackendError::Shape {
            op,
            what: format!("position {p:?} at {first} of {} positions", positions.len()),
        })
}
