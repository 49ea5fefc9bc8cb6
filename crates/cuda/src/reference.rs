//! [`RefBackend`]: the ops of [`Backend`] in plain Rust on the host, with the semantics of the
//! CUDA kernels (weights in their file encoding, activations converted to the weight type's
//! `vec_dot_type` as ggml does, f16 K/V rings, sinks, sliding window, top-k then softmax, the
//! clamped SwiGLU experts). It lets the executor ([`crate::GpuGptOss`]) run and be compared
//! with the CPU engine on a machine without a GPU; it is a test stand-in, not a fast path.
//!
//! The numerics are the CPU engine's (ggml's CPU backend's), step for step as `kernels.cu`
//! computes them, so that on the gpt-oss fixtures this backend's logits are the CPU engine's
//! bit for bit:
//!
//! - Products (`matmul` and the experts): each activation row is converted once to ggml's
//!   `vec_dot_type` of the weights ([`hmoe_quant::vec_dot_type`]): Q8_0 blocks for Q8_0 and
//!   MXFP4 weights ([`hmoe_quant::quantize_row`]; the kernels' `quantize_q8_0`), f16- or
//!   bf16-rounded values for F16 or BF16 weights, f32 for F32. Q8_0 products sum in ggml's
//!   `vec_dot` order (`dot_q8_0`), MXFP4 in llama.cpp's block-wise order (`dot_mxfp4`),
//!   F32 in `vec_dot_f32` order for one token (and for an expert only one slot routes to),
//!   else in tinyBLAS's 16 lanes (`F32Order`). F16 and BF16 products sum in f64 here and in
//!   lane order on the GPU (not the CPU's order).
//! - Attention rounds the query and the probabilities to f16, scores and sums in the CPU
//!   engine's orders with ggml's `expf` ([`hmoe_model::ops::expf_ggml`]).
//! - The router's softmax and the SwiGLU call f32 `exp` (libm), as the CPU engine does; the
//!   kernels round the f64 `exp` there, which can differ from glibc's `expf` in the last bit.

use std::ops::Range;
use std::sync::Mutex;

use half::{bf16, f16};
use hmoe_model::hybrid::{ExpertMatrix, ExpertTensors};
use hmoe_quant::GgmlType;

use crate::backend::{Backend, Elem, StagedIo};
use crate::device::{AttnParams, RopeParams, SUPPORTED_TYPES};
use crate::error::{ensure, CudaError};

/// A weight matrix in its file encoding: `rows` rows of `row_bytes` bytes.
pub struct RefMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
}

impl RefMatrix {
    /// Row `r`'s bytes.
    fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
}

/// One layer's experts in their file encoding: gate and up `[E][ff][d]`, down `[E][d][ff]`
/// (each expert's matrix a [`RefMatrix`] of its rows).
pub struct RefMoe {
    ty: GgmlType,
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
}

/// Host buffers of the round trip.
pub struct RefStaging {
    h: Vec<f32>,
    sel: Vec<i32>,
    w: Vec<f32>,
    out: Vec<f32>,
}

/// The reference backend; counts the round trips it stages.
#[derive(Default)]
pub struct RefBackend {
    staged: Mutex<u64>,
    free_memory: Option<u64>,
}

impl RefBackend {
    /// A new reference backend (no memory limit).
    pub fn new() -> RefBackend {
        RefBackend::default()
    }

    /// A reference backend that reports `bytes` of free device memory (buffers take none of
    /// it), for the executor's decisions that depend on room.
    pub fn with_free_memory(bytes: u64) -> RefBackend {
        RefBackend {
            free_memory: Some(bytes),
            ..RefBackend::default()
        }
    }

    /// Round trips staged so far (calls of `stage_down`).
    pub fn round_trips(&self) -> u64 {
        *self
            .staged
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Checks `data` as `rows` rows of `cols` elements of `ty` and keeps it.
fn matrix(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Result<RefMatrix, CudaError> {
    const OP: &str = "reference upload";
    ensure(SUPPORTED_TYPES.contains(&ty), OP, || format!("type {ty}"))?;
    let rb = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
    ensure(rb > 0 && data.len() == rows * rb, OP, || {
        format!("{} bytes for {rows} rows of {cols} {ty}", data.len())
    })?;
    Ok(RefMatrix {
        ty,
        rows,
        cols,
        row_bytes: rb,
        data: data.to_vec(),
    })
}

fn quant_err(op: &'static str) -> impl Fn(hmoe_quant::QuantError) -> CudaError {
    move |e| CudaError::Shape {
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
fn acts(ty: GgmlType, x: &[f32]) -> Result<Acts, CudaError> {
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
        other => Err(CudaError::UnsupportedType { ty: other, op: OP }),
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

/// The 16-lane horizontal sum by halving: lanes `i` and `i + 8`, then `+ 4`, `+ 2`, `+ 1`
/// (`_mm512_reduce_add_ps`; the kernels' `__shfl_xor_sync` steps 8, 4, 2, 1).
fn hsum16(a: &[f32; 16]) -> f32 {
    let mut h = *a;
    for step in [8, 4, 2, 1] {
        for i in 0..step {
            h[i] += h[i + step];
        }
    }
    h[0]
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

/// An attention score in ggml's `vec_dot_f16` order (one query token): the rounded query
/// against f16 key bits as [`vec_dot_head`], then the last `n % 64` products (rounded to f32)
/// added in f64.
fn score_vec_dot(q16: &[f32], k: &[u16]) -> f32 {
    let np = q16.len() / 64 * 64;
    let kv = |i: usize| f16::from_bits(k[i]).to_f32();
    let mut sum = vec_dot_head(np, |i| (q16[i], kv(i))) as f64;
    for (i, &qv) in q16.iter().enumerate().skip(np) {
        sum += (qv * kv(i)) as f64;
    }
    sum as f32
}

/// An attention score in tinyBLAS's order (several query tokens): element `i` fused into lane
/// `i % 16`, then [`hsum16`].
fn score_lanes(q16: &[f32], k: &[u16]) -> f32 {
    let mut lanes = [0f32; 16];
    for (i, (&qv, &kb)) in q16.iter().zip(k).enumerate() {
        lanes[i % 16] = qv.mul_add(f16::from_bits(kb).to_f32(), lanes[i % 16]);
    }
    hsum16(&lanes)
}

fn swiglu_oai(g: f32, u: f32) -> f32 {
    let x = g.min(7.0);
    let y = u.clamp(-7.0, 7.0);
    x / (1.0 + (-1.702 * x).exp()) * (y + 1.0)
}

fn shape(op: &'static str, ok: bool, what: impl FnOnce() -> String) -> Result<(), CudaError> {
    ensure(ok, op, what)
}

impl Backend for RefBackend {
    type Buf<T: Elem> = Vec<T>;
    type Matrix = RefMatrix;
    type Moe = RefMoe;
    type Staging = RefStaging;

    fn name(&self) -> String {
        "reference".into()
    }
    fn free_memory(&self) -> Result<Option<u64>, CudaError> {
        Ok(self.free_memory)
    }
    fn upload<T: Elem>(&self, src: &[T]) -> Result<Vec<T>, CudaError> {
        Ok(src.to_vec())
    }
    fn alloc<T: Elem>(&self, len: usize) -> Result<Vec<T>, CudaError> {
        Ok(vec![T::default(); len])
    }
    fn download<T: Elem>(&self, src: &Vec<T>) -> Result<Vec<T>, CudaError> {
        Ok(src.clone())
    }
    fn buf_len<T: Elem>(b: &Vec<T>) -> usize {
        b.len()
    }
    fn copy_range(&self, src: &Vec<f32>, range: Range<usize>) -> Result<Vec<f32>, CudaError> {
        src.get(range.clone())
            .map(<[f32]>::to_vec)
            .ok_or_else(|| CudaError::Shape {
                op: "copy_range",
                what: format!("{range:?} of {}", src.len()),
            })
    }
    fn synchronize(&self) -> Result<(), CudaError> {
        Ok(())
    }
    fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<RefMatrix, CudaError> {
        matrix(ty, rows, cols, data)
    }
    fn matrix_bytes(m: &RefMatrix) -> usize {
        m.data.len()
    }
    fn upload_moe(
        &self,
        t: &ExpertTensors<'_>,
        ids: Option<&[usize]>,
    ) -> Result<RefMoe, CudaError> {
        let (d, ff) = (t.gate.n_in, t.gate.n_out);
        let all: Vec<usize> = (0..t.n_expert).collect();
        let ids = ids.unwrap_or(&all);
        let missing = || CudaError::Shape {
            op: "upload_moe",
            what: "expert missing from the tensors".into(),
        };
        ensure(
            t.up.ty == t.gate.ty && t.down.ty == t.gate.ty,
            "upload_moe",
            || {
                format!(
                    "gate {}, up {}, down {}: the experts' matrices must share one type",
                    t.gate.ty, t.up.ty, t.down.ty
                )
            },
        )?;
        let mut m = RefMoe {
            ty: t.gate.ty,
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
            for (dst, src, w) in [
                (&mut m.gate_bias, t.gate_bias, ff),
                (&mut m.up_bias, t.up_bias, ff),
                (&mut m.down_bias, t.down_bias, d),
            ] {
                dst.extend_from_slice(src.get(e * w..(e + 1) * w).ok_or_else(missing)?);
                m.bytes += 4 * w;
            }
        }
        Ok(m)
    }
    fn moe_bytes(m: &RefMoe) -> usize {
        m.bytes
    }
    fn get_rows(&self, t: &RefMatrix, ids: &Vec<i32>, out: &mut Vec<f32>) -> Result<(), CudaError> {
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
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
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
        x: &Vec<f32>,
        n: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        shape(
            "matmul",
            x.len() >= n * w.cols && y.len() >= n * w.rows,
            || format!("x {} / y {} for {n} tokens", x.len(), y.len()),
        )?;
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
    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<(), CudaError> {
        shape("add_assign", y.len() >= x.len(), || "lengths".into())?;
        x.iter_mut().zip(y).for_each(|(a, &b)| *a += b);
        Ok(())
    }
    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>) -> Result<(), CudaError> {
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
        x: &mut Vec<f32>,
        positions: &Vec<i32>,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        shape(
            "rope_neox",
            x.len() >= positions.len() * n_heads * head_dim && p.n_dims <= head_dim,
            || "lengths".into(),
        )?;
        let half = p.n_dims / 2;
        for (t, &pos) in positions.iter().enumerate() {
            for h in 0..n_heads {
                let head = &mut x[(t * n_heads + h) * head_dim..][..head_dim];
                for i in 0..half {
                    let (c, s) = p.cos_sin(pos, i);
                    let (x0, x1) = (head[i], head[i + half]);
                    head[i] = x0.mul_add(c, -(x1 * s));
                    head[i + half] = x0.mul_add(s, x1 * c);
                }
            }
        }
        Ok(())
    }
    fn kv_store_f16(
        &self,
        src: &Vec<f32>,
        cache: &mut Vec<u16>,
        n_tokens: usize,
        width: usize,
        cells: usize,
        pos0: usize,
    ) -> Result<(), CudaError> {
        shape(
            "kv_store_f16",
            cells > 0 && src.len() >= n_tokens * width && cache.len() >= cells * width,
            || "lengths".into(),
        )?;
        for t in 0..n_tokens {
            let cell = (pos0 + t) % cells;
            for c in 0..width {
                cache[cell * width + c] = f16::from_f32(src[t * width + c]).to_bits();
            }
        }
        Ok(())
    }
    fn attention(
        &self,
        p: &AttnParams,
        q: &Vec<f32>,
        k_cache: &Vec<u16>,
        v_cache: &Vec<u16>,
        sinks: Option<&Vec<f32>>,
        n_tokens: usize,
        pos0: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        let (hd, nh, nkv) = (p.head_dim, p.n_head, p.n_head_kv);
        let kvw = nkv * hd;
        shape(
            "attention",
            nkv > 0
                && nh.is_multiple_of(nkv)
                && q.len() >= n_tokens * nh * hd
                && out.len() >= n_tokens * nh * hd
                && k_cache.len() >= p.cells * kvw
                && v_cache.len() >= p.cells * kvw,
            || format!("{p:?}"),
        )?;
        let span = p
            .window
            .map_or(usize::MAX, |w| w + n_tokens.saturating_sub(1))
            .min(pos0 + n_tokens);
        shape("attention", span <= p.cells || n_tokens == 0, || {
            format!("{} cells for {span} keys", p.cells)
        })?;
        let h16 = |b: u16| f16::from_bits(b).to_f32();
        let single = n_tokens == 1;
        for t in 0..n_tokens {
            let pos = pos0 + t;
            let first = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            // Positions in chunks of 16 from `first` rounded down to a multiple of 16; those
            // before `first` weigh 0.
            let chunk_start = first / 16 * 16;
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let base = |pp: usize| (pp % p.cells) * kvw + kvh * hd;
                // The query rounded to f16, as ggml converts it for the f16 keys.
                let q16: Vec<f32> = q[(t * nh + h) * hd..][..hd]
                    .iter()
                    .map(|&v| f16::from_f32(v).to_f32())
                    .collect();
                let scores: Vec<f32> = (chunk_start..=pos)
                    .map(|pp| {
                        if pp < first {
                            return 0.0;
                        }
                        let k = &k_cache[base(pp)..][..hd];
                        let s = if single {
                            score_vec_dot(&q16, k)
                        } else {
                            score_lanes(&q16, k)
                        };
                        s * p.scale
                    })
                    .collect();
                let sink = sinks.map(|s| s[h]);
                let m = scores[first - chunk_start..]
                    .iter()
                    .copied()
                    .chain(sink)
                    .fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| {
                        if chunk_start + i < first {
                            0.0
                        } else {
                            hmoe_model::ops::expf_ggml(s - m)
                        }
                    })
                    .collect();
                let mut sum = 0f64;
                for chunk in e.chunks(16) {
                    let mut lanes = [0f32; 16];
                    lanes[..chunk.len()].copy_from_slice(chunk);
                    sum += hsum16(&lanes) as f64;
                }
                if let Some(s) = sink {
                    sum += (s - m).exp() as f64;
                }
                let inv = (1.0 / sum) as f32;
                // Probabilities rounded to f16, as ggml converts them for the f16 values;
                // lane `i` of a value dimension takes position `i` of every chunk.
                let mut acc = vec![[0f32; 16]; hd];
                for (i, &ev) in e.iter().enumerate() {
                    let pp = chunk_start + i;
                    if pp < first {
                        continue;
                    }
                    let w = f16::from_f32(ev * inv).to_f32();
                    for (a, &v) in acc.iter_mut().zip(&v_cache[base(pp)..][..hd]) {
                        a[i % 16] = h16(v).mul_add(w, a[i % 16]);
                    }
                }
                let o = &mut out[(t * nh + h) * hd..][..hd];
                for (ov, a) in o.iter_mut().zip(&acc) {
                    *ov = hsum16(a);
                }
            }
        }
        Ok(())
    }
    fn router_top_k(
        &self,
        logits: &Vec<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut Vec<i32>,
        weights: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
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
        x: &Vec<f32>,
        selected: &Vec<i32>,
        weights: &Vec<f32>,
        k: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
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
        // ggml multiplies each expert's tokens as one batch: F32 products of an expert that
        // several slots of the micro-batch route to take the 16-lane order.
        let mut routed = vec![0usize; w.n_expert];
        for e in (0..n * k).filter_map(expert) {
            routed[e] += 1;
        }
        let mut h = vec![0f32; ff];
        for t in 0..n {
            let o = &mut out[t * d..(t + 1) * d];
            o.fill(0.0);
            // The token's row, converted once for every expert it goes to.
            let xa = acts(w.ty, &x[t * d..(t + 1) * d])?;
            for j in 0..k {
                let Some(e) = expert(t * k + j) else {
                    continue;
                };
                let order = if routed[e] == 1 {
                    F32Order::VecDot
                } else {
                    F32Order::Lanes16
                };
                let (gate, up, down) = (&w.gate[e], &w.up[e], &w.down[e]);
                for (r, hv) in h.iter_mut().enumerate() {
                    let g = row_dot(w.ty, gate.row(r), &xa, order) + w.gate_bias[e * ff + r];
                    let u = row_dot(w.ty, up.row(r), &xa, order) + w.up_bias[e * ff + r];
                    *hv = swiglu_oai(g, u);
                }
                let ha = acts(w.ty, &h)?;
                let wt = weights[t * k + j];
                for (r, ov) in o.iter_mut().enumerate() {
                    let y = row_dot(w.ty, down.row(r), &ha, order) + w.down_bias[e * d + r];
                    *ov += y * wt;
                }
            }
        }
        Ok(())
    }
    fn staging(&self, n_d: usize, n_k: usize) -> Result<RefStaging, CudaError> {
        Ok(RefStaging {
            h: vec![0.0; n_d],
            sel: vec![0; n_k],
            w: vec![0.0; n_k],
            out: vec![0.0; n_d],
        })
    }
    fn stage_down(
        &self,
        st: &mut RefStaging,
        h: &Vec<f32>,
        sel: &Vec<i32>,
        w: &Vec<f32>,
    ) -> Result<(), CudaError> {
        shape(
            "stage_down",
            st.h.len() == h.len() && st.sel.len() == sel.len() && st.w.len() == w.len(),
            || "lengths".into(),
        )?;
        st.h.copy_from_slice(h);
        st.sel.copy_from_slice(sel);
        st.w.copy_from_slice(w);
        *self
            .staged
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
        Ok(())
    }
    fn staged<'s>(&self, st: &'s mut RefStaging) -> Result<StagedIo<'s>, CudaError> {
        Ok(StagedIo {
            h: &st.h,
            sel: &st.sel,
            w: &st.w,
            out: &mut st.out,
        })
    }
    fn stage_up(&self, st: &RefStaging, out: &mut Vec<f32>) -> Result<(), CudaError> {
        shape("stage_up", out.len() >= st.out.len(), || "lengths".into())?;
        out[..st.out.len()].copy_from_slice(&st.out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// `rows × cols` weights of `ty` quantized from noise.
    fn weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
        let rb = ty.row_bytes(cols as u64).unwrap() as usize;
        let mut q = vec![0u8; rows * rb];
        for row in q.chunks_exact_mut(rb) {
            let src: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            hmoe_quant::quantize_row(ty, &src, row).unwrap();
        }
        q
    }

    /// The reference backend's products are the CPU engine's, bit for bit, for the types whose
    /// order it follows (Q8_0, MXFP4, F32 one token and batches), including F32 rows with a
    /// tail after the last 64 elements.
    #[test]
    fn matmul_is_the_cpu_engines_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(11);
        let be = RefBackend::new();
        for ty in [GgmlType::Q8_0, GgmlType::MXFP4, GgmlType::F32] {
            for (rows, cols) in [(37, 256), (9, 160), (5, 2880)] {
                let q = weights(&mut rng, ty, rows, cols);
                let m = be.upload_matrix(ty, rows, cols, &q).unwrap();
                for n in [1usize, 3, 9] {
                    let x: Vec<f32> = (0..n * cols)
                        .map(|_| rng.random_range(-3.0f32..3.0))
                        .collect();
                    let mut got = vec![0f32; n * rows];
                    be.matmul(&m, &x, n, &mut got).unwrap();
                    let kernel = hmoe_quant::DotKernel::best(ty).unwrap();
                    let mut qa = hmoe_model::ops::QuantizedActs::default();
                    qa.quantize(kernel.act_type(), &x, cols);
                    let mut want = vec![0f32; n * rows];
                    hmoe_model::ops::matmul(kernel, &q, cols, rows, &qa, &mut want);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{ty} {rows}x{cols} n={n} [{i}]: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}
