//! [`Ref0`]: the reference device, the ops of [`Backend`] in plain Rust on the host with the
//! semantics of hmoe's GPU kernels, behaving like a GPU: it owns copies of everything it is
//! given (weights in their file encoding, buffers), within a byte budget (`--gpu-mem`), and
//! counts every host ↔ device transfer. It is selectable from the command line as `REF0`
//! (`-dev REF0`) so that every placement path runs on a machine without a GPU; it is a testing
//! device, not a fast path.
//!
//! The numerics are the CPU engine's (ggml's CPU backend's), step for step as the CUDA kernels
//! compute them, so that on the gpt-oss fixtures its logits are the CPU engine's bit for bit:
//!
//! - Products (`matmul` and the experts): each activation row is converted once to ggml's
//!   `vec_dot_type` of the weights ([`hmoe_quant::vec_dot_type`]): Q8_0 blocks for Q8_0 and
//!   MXFP4 weights ([`hmoe_quant::quantize_row`]), f16- or bf16-rounded values for F16 or
//!   BF16 weights, f32 for F32. Q8_0 products sum in ggml's `vec_dot` order (`dot_q8_0`),
//!   MXFP4 in llama.cpp's block-wise order (`dot_mxfp4`), F32 in `vec_dot_f32` order for one
//!   token (and for an expert only one slot routes to, and for every SiLU expert), else in
//!   tinyBLAS's 16 lanes
//!   (`F32Order`). F16 and BF16 products sum in f64 here (not the CPU's order). The other
//!   types the CPU engine loads (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K … Q6_K) are multiplied with
//!   hmoe-quant's own kernels, the one the CPU engine picks for the matrix
//!   ([`hmoe_quant::DotKernel::for_matrix`], repacked Q4_0/Q4_K included), over activations
//!   quantized by [`hmoe_quant::quantize_row`]: `dot` for one token, `dot_tokens` (the tiled
//!   K-quant and grouped repacked orders) for a batch, exactly as the CPU engine's `matmul`;
//!   the experts (`moe`) take them too, each expert's rows multiplied together in the order
//!   of the CPU engine's expert matmul (`BatchKind::Expert`: tiled K-quants from 8 rows routed
//!   to the expert), and an expert set's gate, up and down may be of different types (as in
//!   Q4_K_M files); `matmul_heads` multiplies each head's rows with the head's inputs of
//!   every token together, as the CPU engine's MLA does (`dot_tokens` of the `Dense` kind for contiguous
//!   inputs, of the `Expert` kind, `vec_dot`'s order, for strided ones).
//! - The experts (`moe`) run as the CPU engine's host experts do: each expert's routed rows
//!   together, then every token's slot outputs weighted and added in slot order from zero.
//! - K/V rings of every type of [`crate::KV_TYPES`] are stored and attended over as the CPU
//!   engine's cache and attention do (see `ref0_kv.rs`): the row kernel with ggml's `expf`
//!   ([`crate::numerics::expf_ggml`]) over f32/f16/bf16 values, flash attention over
//!   block-quantized ones; K-only (latent) rings of every type with the row kernel, values
//!   read from the keys.
//! - The router's softmax and the gated activation call f32 `exp` (libm), as the CPU engine
//!   does.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use half::{bf16, f16};
use hmoe_quant::GgmlType;

use crate::error::ensure;
use crate::numerics::hsum16;
use crate::{AttnParams, Gating, HostStaging, KOnlyAttnParams, RopeParams, Routing, RowCopy};
use crate::{
    Backend, BackendError, Elem, ExpertMatrix, ExpertTensors, GatedAct, KvRing, StagedIo,
    TransferCounts,
};

/// The reference device's name in device lists and messages.
pub const REF0_NAME: &str = "REF0";

/// The weight types the reference device multiplies: those of the CUDA kernels (F32, F16,
/// BF16, Q8_0, MXFP4), with its own code in the CPU engine's orders, and every other type the
/// CPU engine loads, with hmoe-quant's kernels ([`QUANT_KERNEL_TYPES`]).
pub const REF0_TYPES: [GgmlType; 14] = hmoe_quant::WEIGHT_TYPES;

/// The weight types of [`REF0_TYPES`] that the reference device multiplies with hmoe-quant's
/// kernels (the CPU engine's, chosen per matrix): `matmul`, `matmul_heads`, `get_rows` and
/// expert sets take them.
pub const QUANT_KERNEL_TYPES: [GgmlType; 9] = hmoe_quant::LOWBIT_TYPES;

/// What the reference device keeps and computes: every weight type of [`REF0_TYPES`] and every
/// K/V type of the contract, in pairs and K-only rings alike.
pub const REF0_CAPABILITIES: crate::Capabilities = crate::Capabilities {
    weight_types: &REF0_TYPES,
    kv_types: &crate::KV_TYPES,
    kv_pair_types: &crate::KV_TYPES,
    k_only_types: &crate::KV_TYPES,
};

/// The device's memory: bytes held now, the most ever held, and the budget.
#[derive(Debug)]
struct Memory {
    budget: Option<u64>,
    held: Mutex<(u64, u64)>,
}

impl Memory {
    fn lock(&self) -> MutexGuard<'_, (u64, u64)> {
        // Only counters live behind the lock; a panic elsewhere leaves them consistent.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Bytes of device memory taken by one allocation, given back when it is dropped.
#[derive(Debug)]
struct Charge {
    mem: Arc<Memory>,
    bytes: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut h = self.mem.lock();
        h.0 = h.0.saturating_sub(self.bytes);
    }
}

/// A buffer in the reference device's memory.
#[derive(Debug)]
pub struct RefBuf<T> {
    data: Vec<T>,
    _charge: Charge,
}

impl<T> std::ops::Deref for RefBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<'a, T> IntoIterator for &'a RefBuf<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.data.iter()
    }
}

impl<T> std::ops::DerefMut for RefBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}

/// A weight matrix in its file encoding: `rows` rows of `row_bytes` bytes (in the device's
/// memory when uploaded on its own; an expert's matrix is charged with its [`RefMoe`]).
pub struct RefMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
    /// The CPU engine's kernel for a matrix of [`QUANT_KERNEL_TYPES`].
    kernel: Option<hmoe_quant::DotKernel>,
    _charge: Option<Charge>,
}

impl RefMatrix {
    /// Row `r`'s bytes.
    fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
}

/// One layer's experts in their file encoding: gate and up `[E][ff][d]`, down `[E][d][ff]`
/// (each expert's matrix a [`RefMatrix`] of its rows, of its tensor's type), in the device's
/// memory.
pub struct RefMoe {
    n_expert: usize,
    d: usize,
    ff: usize,
    bytes: usize,
    gate: Vec<RefMatrix>,
    up: Vec<RefMatrix>,
    down: Vec<RefMatrix>,
    gate_bias: Vec<f32>,
    up_bias: Vec<f32>,
    down_bias: Vec<f32>,
    _charge: Option<Charge>,
}

/// The reference device `REF0` (see the module docs).
pub struct Ref0 {
    mem: Arc<Memory>,
    counts: Mutex<TransferCounts>,
    trips: Mutex<u64>,
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
        }
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

    /// Takes `bytes` of device memory for `what`, or [`BackendError::OutOfMemory`].
    fn charge(&self, what: &'static str, bytes: u64) -> Result<Charge, BackendError> {
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

    fn count_up(&self, bytes: usize) {
        let mut c = self.count();
        c.uploads += 1;
        c.upload_bytes += bytes as u64;
    }

    fn count_down(&self, bytes: usize) {
        let mut c = self.count();
        c.downloads += 1;
        c.download_bytes += bytes as u64;
    }

    fn upload_any<T: Elem>(&self, src: &[T]) -> Result<RefBuf<T>, BackendError> {
        let b = self.buf("upload", src.to_vec())?;
        self.count_up(std::mem::size_of_val(src));
        Ok(b)
    }

    fn alloc_any<T: Elem>(&self, len: usize) -> Result<RefBuf<T>, BackendError> {
        self.buf("alloc", vec![T::default(); len])
    }

    fn download_any<T: Elem>(&self, src: &RefBuf<T>) -> Result<Vec<T>, BackendError> {
        self.count_down(src.data.len() * T::BYTES);
        Ok(src.data.clone())
    }
}

/// Checks `data` as `rows` rows of `cols` elements of `ty` and keeps it.
fn matrix(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Result<RefMatrix, BackendError> {
    const OP: &str = "reference upload";
    if !REF0_TYPES.contains(&ty) {
        return Err(BackendError::UnsupportedType { ty, op: OP });
    }
    let rb = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
    ensure(rb > 0 && data.len() == rows * rb, OP, || {
        format!("{} bytes for {rows} rows of {cols} {ty}", data.len())
    })?;
    let kernel = QUANT_KERNEL_TYPES
        .contains(&ty)
        .then(|| hmoe_quant::DotKernel::for_matrix(ty, rows))
        .transpose()
        .map_err(quant_err(OP))?;
    Ok(RefMatrix {
        ty,
        rows,
        cols,
        row_bytes: rb,
        data: data.to_vec(),
        kernel,
        _charge: None,
    })
}

/// `y[i] = W·rows[i]` for a matrix of [`QUANT_KERNEL_TYPES`] with the CPU engine's kernel `k`
/// for it, as the CPU engine's `matmul` (`kind` [`hmoe_quant::BatchKind::Dense`]) or expert
/// matmul (`Expert`, the rows routed to one expert) computes it: every row quantized to the
/// kernel's activation type, then `dot_tokens` over them all (for one row: `dot`; for a batch:
/// the tiled K-quant and grouped repacked orders where the kind takes them).
fn kernel_products(
    k: &hmoe_quant::DotKernel,
    w: &RefMatrix,
    kind: hmoe_quant::BatchKind,
    rows: &[&[f32]],
    y: &mut [f32],
) -> Result<(), BackendError> {
    kernel_products_of(k, w, 0..w.rows, kind, rows, y, "matmul")
}

/// [`kernel_products`] over the weight rows `range` only: `y[i][r - range.start] =
/// W[r]·rows[i]` (`y` rows of `range.len()`), with `op` named in errors.
fn kernel_products_of(
    k: &hmoe_quant::DotKernel,
    w: &RefMatrix,
    range: Range<usize>,
    kind: hmoe_quant::BatchKind,
    rows: &[&[f32]],
    y: &mut [f32],
    op: &'static str,
) -> Result<(), BackendError> {
    let at = k.act_type();
    let arb = at.row_bytes(w.cols as u64).unwrap_or(0) as usize;
    ensure(arb > 0, op, || format!("{} values in {at} blocks", w.cols))?;
    if rows.is_empty() {
        return Ok(());
    }
    let mut a = vec![0u8; rows.len() * arb];
    for (x, dst) in rows.iter().zip(a.chunks_exact_mut(arb)) {
        hmoe_quant::quantize_row(at, &x[..w.cols], dst).map_err(quant_err(op))?;
    }
    let mut col = vec![0f32; rows.len()];
    let n_out = range.len();
    for (i, r) in range.enumerate() {
        k.dot_tokens(kind, w.cols, w.row(r), &a, &mut col);
        for (t, &v) in col.iter().enumerate() {
            y[t * n_out + i] = v;
        }
    }
    Ok(())
}

/// `y[i] = W·rows[i]` for the rows routed to one expert (`rows.len()` of them), as the CPU
/// engine's expert matmul computes it: [`kernel_products`] for a matrix of
/// [`QUANT_KERNEL_TYPES`], else each row converted by [`acts`] and summed by [`row_dot`] in
/// `order` (the F32 order).
fn expert_products(
    w: &RefMatrix,
    rows: &[&[f32]],
    order: F32Order,
    y: &mut [f32],
) -> Result<(), BackendError> {
    if let Some(k) = &w.kernel {
        return kernel_products(k, w, hmoe_quant::BatchKind::Expert, rows, y);
    }
    for (x, dst) in rows.iter().zip(y.chunks_exact_mut(w.rows)) {
        let a = acts(w.ty, x)?;
        for (r, d) in dst.iter_mut().enumerate() {
            *d = row_dot(w.ty, w.row(r), &a, order);
        }
    }
    Ok(())
}

/// A quantizer error as a shape error of `op`.
fn quant_err(op: &'static str) -> impl Fn(hmoe_quant::QuantError) -> BackendError {
    move |e| BackendError::Shape {
        op,
        what: e.to_string(),
    }
}

/// Elements per Q8_0 / MXFP4 block.
const QK: usize = 32;
/// Bytes of a Q8_0 block: f16 scale, 32 int8.
const Q8_0_BYTES: usize = 34;
/// Bytes of an MXFP4 block: E8M0 exponent, 16 bytes of nibbles.
const MXFP4_BYTES: usize = 17;

/// The MXFP4 table value of a nibble: the E2M1 values doubled to integers
/// {0, 1, 2, 3, 4, 6, 8, 12}, sign in bit 3 (ggml's `kvalues_mxfp4`); the kernels read the
/// magnitudes from the same packed nibbles.
fn mxfp4_int(nib: u8) -> i32 {
    let v = ((0xC864_3210u32 >> (4 * (nib & 7) as u32)) & 15) as i32;
    if nib & 8 != 0 {
        -v
    } else {
        v
    }
}

/// Half the E8M0 scale, `2^(e-128)`, exact for every byte (it goes with the doubled values).
fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// The little-endian f16 at element `i` of `b`, as f32.
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32()
}

/// The little-endian f32 at element `i` of `b`.
fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// An activation row in the `vec_dot_type` of a weight type.
enum Acts {
    /// F32 weights: the row itself; F16/BF16 weights: the row rounded to that type.
    Float(Vec<f32>),
    /// Q8_0/MXFP4 weights: the row as Q8_0 blocks.
    Q8_0(Vec<u8>),
}

/// `x` converted for a product with weights of type `ty`, as ggml converts it (the kernels:
/// `quantize_q8_0`, and the rounding in `warp_dot_rounded`).
fn acts(ty: GgmlType, x: &[f32]) -> Result<Acts, BackendError> {
    const OP: &str = "reference activations";
    let vt = hmoe_quant::vec_dot_type(ty);
    match vt {
        GgmlType::F32 => Ok(Acts::Float(x.to_vec())),
        GgmlType::F16 => Ok(Acts::Float(
            x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        )),
        GgmlType::BF16 => Ok(Acts::Float(
            x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        )),
        GgmlType::Q8_0 => {
            let rb = vt.row_bytes(x.len() as u64).unwrap_or(0) as usize;
            ensure(rb > 0, OP, || format!("{} values in Q8_0 blocks", x.len()))?;
            let mut q = vec![0u8; rb];
            hmoe_quant::quantize_row(vt, x, &mut q).map_err(quant_err(OP))?;
            Ok(Acts::Q8_0(q))
        }
        other => Err(BackendError::UnsupportedType { ty: other, op: OP }),
    }
}

/// The order in which F32 products are summed (the two orders of ggml's CPU backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum F32Order {
    /// `vec_dot_f32`: one token of a dense matmul, and every expert product.
    VecDot,
    /// tinyBLAS's 16 lanes: dense matmuls of several tokens.
    Lanes16,
}

/// Q8_0 × Q8_0 in ggml's `vec_dot` order (hmoe_quant's `dot_q8_0`): eight accumulators; for
/// each block in order `d = d_w · d_a` and accumulator `k` takes `fma(d, s_k, acc_k)`, `s_k`
/// the integer sum of elements `4k..4k+4`; then `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))`.
/// (ggml forms each product as `|w| · sign(a, w)`, which differs from `w · a` only for an
/// activation of -128, which the quantizer gives only for NaN.)
fn dot_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for (wb, ab) in w.chunks_exact(Q8_0_BYTES).zip(a.chunks_exact(Q8_0_BYTES)) {
        let d = f16_at(wb, 0) * f16_at(ab, 0);
        for (k, acc) in acc.iter_mut().enumerate() {
            let s: i32 = (4 * k..4 * k + 4)
                .map(|j| wb[2 + j] as i8 as i32 * ab[2 + j] as i8 as i32)
                .sum();
            *acc = d.mul_add(s as f32, *acc);
        }
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// MXFP4 × Q8_0 in llama.cpp's block-wise order (hmoe_quant's GEMM order, which the CPU
/// engine uses for every MXFP4 product): for each block in order
/// `acc = fma(isum, 2^(e-128) · d_a, acc)`, `isum` the exact integer sum of the table values
/// times the activation's int8.
fn dot_mxfp4(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (wb, ab) in w.chunks_exact(MXFP4_BYTES).zip(a.chunks_exact(Q8_0_BYTES)) {
        let scale = e8m0_half(wb[0]) * f16_at(ab, 0);
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            let q = wb[1 + j];
            isum += mxfp4_int(q & 15) * ab[2 + j] as i8 as i32;
            isum += mxfp4_int(q >> 4) * ab[2 + QK / 2 + j] as i8 as i32;
        }
        acc = (isum as f32).mul_add(scale, acc);
    }
    acc
}

/// F32 × F32 in ggml's `vec_dot_f32` order (hmoe_quant's `dot_f32`): [`vec_dot_head`], then
/// the last `n % 64` elements fused in one by one.
fn dot_f32_vec(w: &[u8], x: &[f32]) -> f32 {
    let np = x.len() / 64 * 64;
    let mut sum = vec_dot_head(np, |i| (f32_at(w, i), x[i]));
    for (i, &xv) in x.iter().enumerate().skip(np) {
        sum = f32_at(w, i).mul_add(xv, sum);
    }
    sum
}

/// The whole 64-element steps of ggml's `vec_dot_f32`/`vec_dot_f16` over the first `np`
/// elements (`pair(i)` gives element `i` of both operands): four 16-lane FMA accumulators
/// (element `64i + 16j + l` into accumulator `j`, lane `l`), folded per lane as
/// `(s0 + s2) + (s1 + s3)`, summed by [`hsum16`].
fn vec_dot_head(np: usize, pair: impl Fn(usize) -> (f32, f32)) -> f32 {
    let mut s = [[0f32; 16]; 4];
    for base in (0..np).step_by(64) {
        for (j, acc) in s.iter_mut().enumerate() {
            for (l, acc) in acc.iter_mut().enumerate() {
                let (a, b) = pair(base + 16 * j + l);
                *acc = a.mul_add(b, *acc);
            }
        }
    }
    let mut folded = [0f32; 16];
    for (l, f) in folded.iter_mut().enumerate() {
        *f = (s[0][l] + s[2][l]) + (s[1][l] + s[3][l]);
    }
    hsum16(&folded)
}

/// F32 × F32 in tinyBLAS's order (hmoe_quant's `f32_lanes`): element `i` fused into lane
/// `i % 16`, then [`hsum16`].
fn dot_f32_lanes(w: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    for (i, &xv) in x.iter().enumerate() {
        lanes[i % 16] = f32_at(w, i).mul_add(xv, lanes[i % 16]);
    }
    hsum16(&lanes)
}

/// One weight row (file encoding `ty`) times an activation row converted by [`acts`] for
/// `ty`, in the CPU engine's order for Q8_0, MXFP4 and F32 (`order`); F16 and BF16 products
/// (exact in f32) are summed in f64, which is not the CPU's order.
fn row_dot(ty: GgmlType, row: &[u8], a: &Acts, order: F32Order) -> f32 {
    match (ty, a) {
        (GgmlType::Q8_0, Acts::Q8_0(q)) => dot_q8_0(row, q),
        (GgmlType::MXFP4, Acts::Q8_0(q)) => dot_mxfp4(row, q),
        (GgmlType::F32, Acts::Float(x)) => match order {
            F32Order::VecDot => dot_f32_vec(row, x),
            F32Order::Lanes16 => dot_f32_lanes(row, x),
        },
        (GgmlType::F16, Acts::Float(x)) => (0..x.len())
            .map(|i| f16_at(row, i) as f64 * x[i] as f64)
            .sum::<f64>() as f32,
        (_, Acts::Float(x)) => (0..x.len())
            .map(|i| {
                let bits = u16::from_le_bytes([row[2 * i], row[2 * i + 1]]);
                bf16::from_bits(bits).to_f32() as f64 * x[i] as f64
            })
            .sum::<f64>() as f32,
        // `acts` gives Q8_0 blocks exactly for Q8_0 and MXFP4 weights.
        (_, Acts::Q8_0(_)) => f32::NAN,
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
        let range = crate::copy_into_range(src.len(), dst.len(), at)?;
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
    ) -> Result<RefMatrix, BackendError> {
        let mut m = matrix(ty, rows, cols, data)?;
        m._charge = Some(self.charge("upload_matrix", data.len() as u64)?);
        self.count_up(data.len());
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
        self.count_up(m.bytes);
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
        shape("get_rows", out.len() >= ids.len() * t.cols, || {
            format!("out {}", out.len())
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
        x: &RefBuf<f32>,
        weight: &RefBuf<f32>,
        eps: f32,
        out: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
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
        shape("add_assign", y.len() >= x.len(), || "lengths".into())?;
        x.iter_mut().zip(y).for_each(|(a, &b)| *a += b);
        Ok(())
    }
    fn add_bias(&self, x: &mut RefBuf<f32>, bias: &RefBuf<f32>) -> Result<(), BackendError> {
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
        crate::host::rope_neox(x, positions, n_heads, head_dim, p)
    }
    fn kv_types(&self) -> &'static [GgmlType] {
        &crate::KV_TYPES
    }
    fn kv_store(
        &self,
        src: &RefBuf<f32>,
        ring: &mut KvRing<Ref0>,
        n_tokens: usize,
        pos0: usize,
    ) -> Result<(), BackendError> {
        crate::ref0_kv::store(&ring.layout, src, &mut ring.data, n_tokens, pos0)
    }
    fn attention(
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
    fn router_top_k(
        &self,
        logits: &RefBuf<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut RefBuf<i32>,
        weights: &mut RefBuf<f32>,
    ) -> Result<(), BackendError> {
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
        crate::host::copy_rows(src, dst, c)
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
        crate::host::rope_norm(x, positions, n_heads, head_dim, first, p)
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
        let out =
            crate::shapes::matmul_heads(w.rows, w.cols, n, n_heads, x_stride, x.len(), y.len())?;
        if n == 0 || out == 0 {
            return Ok(());
        }
        if let Some(k) = &w.kernel {
            // As the CPU engine's MLA: per head, the head's inputs of every token together,
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
        crate::shapes::swiglu(gate.len(), up.len(), n)?;
        for (r, g) in gate.chunks_exact_mut(n).enumerate() {
            crate::numerics::swiglu_row(g, &up[r * n..(r + 1) * n]);
        }
        Ok(())
    }
    fn k_only_types(&self) -> &'static [GgmlType] {
        &crate::KV_TYPES
    }
    fn attention_k_only(
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
        let bias = bias.map(|b| &b[..]);
        crate::host::route(logits, bias, gating, routing, n_expert, selected, weights)
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
        st.fill(h, sel, w)?;
        self.count_down(4 * (h.len() + sel.len() + w.len()));
        *self.trips.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        Ok(())
    }
    fn staged<'s>(&self, st: &'s mut HostStaging) -> Result<StagedIo<'s>, BackendError> {
        Ok(st.io())
    }
    fn stage_up(&self, st: &HostStaging, out: &mut RefBuf<f32>) -> Result<(), BackendError> {
        let n = st.send_up(out)?;
        self.count_up(4 * n);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_enforced_and_freed_on_drop() {
        let dev = Ref0::with_budget(1000);
        assert_eq!(dev.free_memory().unwrap(), Some(1000));
        let a = dev.alloc::<f32>(200).unwrap();
        assert_eq!(
            (dev.bytes_held(), dev.free_memory().unwrap()),
            (800, Some(200))
        );
        let err = match dev.upload(&[0u16; 101]) {
            Err(e) => e,
            Ok(_) => panic!("202 bytes fit in 200"),
        };
        assert!(
            matches!(&err, BackendError::OutOfMemory { device, requested: 202, free: 200, total: 1000, .. } if device == "REF0"),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.starts_with("REF0: out of memory") && msg.contains("MiB missing"),
            "{msg}"
        );
        drop(a);
        assert_eq!(dev.bytes_held(), 0);
        assert_eq!(dev.peak_bytes(), 800);
        let q = vec![0u8; 34 * 4];
        let m = dev.upload_matrix(GgmlType::Q8_0, 4, 32, &q).unwrap();
        assert_eq!(dev.bytes_held(), 136);
        drop(m);
        assert_eq!(dev.bytes_held(), 0);
        assert_eq!(Ref0::new().free_memory().unwrap(), None);
    }

    #[test]
    fn capabilities_agree_with_the_open_device() {
        let dev = Ref0::new();
        let caps = REF0_CAPABILITIES;
        assert_eq!(caps.kv_types, dev.kv_types());
        assert_eq!(caps.k_only_types, dev.k_only_types());
        for k in crate::KV_TYPES {
            for v in crate::KV_TYPES {
                assert_eq!(caps.keeps_kv(k, v), dev.supports_kv(k, v), "{k} {v}");
            }
        }
        assert!(caps.multiplies(GgmlType::Q4_K) && !caps.multiplies(GgmlType::Q8_1));
    }

    #[test]
    fn every_transfer_is_counted() {
        let dev = Ref0::new();
        let x = dev.upload(&[1.0f32, 2.0, 3.0]).unwrap();
        let y = dev.alloc::<f32>(3).unwrap();
        assert_eq!(dev.download(&x).unwrap(), vec![1.0, 2.0, 3.0]);
        let c = dev.transfers().unwrap();
        assert_eq!(
            (c.uploads, c.upload_bytes, c.downloads, c.download_bytes),
            (1, 12, 1, 12)
        );
        let sel = dev.upload(&[0i32, 1, 2]).unwrap();
        let mut st = dev.staging(3, 3).unwrap();
        dev.stage_down(&mut st, &x, &sel, &y).unwrap();
        let io = dev.staged(&mut st).unwrap();
        assert_eq!(io.h, &[1.0, 2.0, 3.0]);
        io.out.copy_from_slice(&[4.0, 5.0, 6.0]);
        let mut out = dev.alloc::<f32>(3).unwrap();
        dev.stage_up(&st, &mut out).unwrap();
        assert_eq!(&out[..], &[4.0, 5.0, 6.0]);
        let c = dev.transfers().unwrap();
        assert_eq!(
            (c.uploads, c.downloads),
            (3, 2),
            "stage_down is one transfer"
        );
        assert_eq!(c.download_bytes, 12 + 36);
        assert_eq!(dev.round_trips(), 1);
    }

    /// `copy_into` writes `src` at its offset on the device (no transfer counted) and refuses
    /// a destination too short, even by an overflowing offset.
    #[test]
    fn copy_into_writes_at_the_offset_on_the_device() {
        let dev = Ref0::new();
        let src = dev.upload(&[1.0f32, 2.0]).unwrap();
        let mut dst = dev.alloc::<f32>(5).unwrap();
        let before = dev.transfers();
        dev.copy_into(&src, &mut dst, 3).unwrap();
        assert_eq!(dev.transfers(), before);
        assert_eq!(dev.download(&dst).unwrap(), [0.0, 0.0, 0.0, 1.0, 2.0]);
        for at in [4, usize::MAX] {
            let e = dev.copy_into(&src, &mut dst, at).unwrap_err().to_string();
            assert!(e.starts_with("copy_into: 2 values at"), "{e}");
        }
    }

    #[test]
    fn bad_shapes_and_types_are_errors() {
        let dev = Ref0::new();
        assert!(matches!(
            dev.upload_matrix(GgmlType::Q8_K, 1, 256, &[0; 292]),
            Err(BackendError::UnsupportedType { .. })
        ));
        // Q4_K multiplies (`matmul`), and as experts, beside experts of other types.
        assert!(dev.upload_matrix(GgmlType::Q4_K, 1, 256, &[0; 144]).is_ok());
        let (q4k, q8) = (vec![0u8; 256 * 144], vec![0u8; 256 * 8 * 34]);
        let m = |ty, data| ExpertMatrix {
            ty,
            n_in: 256,
            n_out: 256,
            data,
        };
        let t = ExpertTensors {
            n_expert: 1,
            gate: m(GgmlType::Q4_K, &q4k),
            up: m(GgmlType::Q4_K, &q4k),
            down: m(GgmlType::Q8_0, &q8),
            gate_bias: &[],
            up_bias: &[],
            down_bias: &[],
        };
        assert!(dev.upload_moe(&t, None).is_ok());
        let q8k = vec![0u8; 256 * 292];
        let t = ExpertTensors {
            down: m(GgmlType::Q8_K, &q8k),
            ..t
        };
        assert!(matches!(
            dev.upload_moe(&t, None),
            Err(BackendError::UnsupportedType { .. })
        ));
        assert!(matches!(
            dev.upload_matrix(GgmlType::Q8_0, 2, 32, &[0; 34]),
            Err(BackendError::Shape { .. })
        ));
        let x = dev.upload(&[1.0f32; 4]).unwrap();
        assert!(dev.copy_range(&x, 2..6).is_err());
    }
}
