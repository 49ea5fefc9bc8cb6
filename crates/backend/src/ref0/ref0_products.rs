//! The reference device's products: weight matrices checked on upload, activations in the
//! weights' `vec_dot_type` and the row dots in ggml's orders (see the module docs of `ref0`).

use std::ops::Range;

use half::{bf16, f16};
use hmoe_quant::GgmlType;

use super::ref0_memory::RefMatrix;
use crate::error::ensure;
use crate::numerics::hsum16;
use crate::BackendError;

/// The weight types the reference device multiplies: those of the CUDA kernels (F32, F16,
/// BF16, Q8_0, MXFP4), with its own code in the CPU device's orders, and every other type the
/// CPU device loads, with hmoe-quant's kernels ([`QUANT_KERNEL_TYPES`]).
pub const REF0_TYPES: [GgmlType; 23] = concat(hmoe_quant::WEIGHT_TYPES, hmoe_quant::IQ_TYPES);

/// The weight types of [`REF0_TYPES`] that the reference device multiplies with hmoe-quant's
/// kernels (the CPU device's, chosen per matrix): `matmul`, `matmul_heads`, `get_rows` and
/// expert sets take them. The low-bit types and the IQ types.
pub const QUANT_KERNEL_TYPES: [GgmlType; 18] =
    concat(hmoe_quant::LOWBIT_TYPES, hmoe_quant::IQ_TYPES);

/// `a` then `b` (`C` must be `A + B`).
const fn concat<const A: usize, const B: usize, const C: usize>(
    a: [GgmlType; A],
    b: [GgmlType; B],
) -> [GgmlType; C] {
    assert!(A + B == C);
    let mut out = [GgmlType::F32; C];
    let mut i = 0;
    while i < C {
        out[i] = if i < A { a[i] } else { b[i - A] };
        i += 1;
    }
    out
}

/// Checks `data` as `rows` rows of `cols` elements of `ty` and keeps it.
pub(super) fn matrix(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: &[u8],
) -> Result<RefMatrix, BackendError> {
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

/// `y[i] = W·rows[i]` for a matrix of [`QUANT_KERNEL_TYPES`] with the CPU device's kernel `k`
/// for it, as the CPU device's `matmul` (`kind` [`hmoe_quant::BatchKind::Dense`]) or expert
/// matmul (`Expert`, the rows routed to one expert) computes it: every row quantized to the
/// kernel's activation type, then `dot_tokens` over them all (for one row: `dot`; for a batch:
/// the tiled K-quant and grouped repacked orders where the kind takes them).
pub(super) fn kernel_products(
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
pub(super) fn kernel_products_of(
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
pub(super) fn expert_products(
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
pub(super) fn quant_err(op: &'static str) -> impl Fn(hmoe_quant::QuantError) -> BackendError {
    move |e| BackendError::Shape {
        op,
        what: e.to_string(),
    }
}

/// Elements per Q8_0 / MXFP4 block.
pub(super) const QK: usize = 32;
/// Bytes of a Q8_0 block: f16 scale, 32 int8.
pub(super) const Q8_0_BYTES: usize = 34;
/// Bytes of an MXFP4 block: E8M0 exponent, 16 bytes of nibbles.
pub(super) const MXFP4_BYTES: usize = 17;

/// The MXFP4 table value of a nibble: the E2M1 values doubled to integers
/// {0, 1, 2, 3, 4, 6, 8, 12}, sign in bit 3 (ggml's `kvalues_mxfp4`); the kernels read the
/// magnitudes from the same packed nibbles.
pub(super) fn mxfp4_int(nib: u8) -> i32 {
    let v = ((0xC864_3210u32 >> (4 * (nib & 7) as u32)) & 15) as i32;
    if nib & 8 != 0 {
        -v
    } else {
        v
    }
}

/// Half the E8M0 scale, `2^(e-128)`, exact for every byte (it goes with the doubled values).
pub(super) fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// The little-endian f16 at element `i` of `b`, as f32.
pub(super) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32()
}

/// The little-endian f32 at element `i` of `b`.
pub(super) fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// An activation row in the `vec_dot_type` of a weight type.
pub(super) enum Acts {
    /// F32 weights: the row itself; F16/BF16 weights: the row rounded to that type.
    Float(Vec<f32>),
    /// Q8_0/MXFP4 weights: the row as Q8_0 blocks.
    Q8_0(Vec<u8>),
}

/// `x` converted for a product with weights of type `ty`, as ggml converts it (the kernels:
/// `quantize_q8_0`, and the rounding in `warp_dot_rounded`).
pub(super) fn acts(ty: GgmlType, x: &[f32]) -> Result<Acts, BackendError> {
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
pub(super) enum F32Order {
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
pub(super) fn dot_q8_0(w: &[u8], a: &[u8]) -> f32 {
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
pub(super) fn dot_mxfp4(w: &[u8], a: &[u8]) -> f32 {
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
pub(super) fn dot_f32_vec(w: &[u8], x: &[f32]) -> f32 {
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
pub(super) fn vec_dot_head(np: usize, pair: impl Fn(usize) -> (f32, f32)) -> f32 {
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
pub(super) fn dot_f32_lanes(w: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    for (i, &xv) in x.iter().enumerate() {
        lanes[i % 16] = f32_at(w, i).mul_add(xv, lanes[i % 16]);
    }
    hsum16(&lanes)
}

/// One weight row (file encoding `ty`) times an activation row converted by [`acts`] for
/// `ty`, in the CPU device's order for Q8_0, MXFP4 and F32 (`order`); F16 and BF16 products
/// (exact in f32) are summed in f64, which is not the CPU's order.
pub(super) fn row_dot(ty: GgmlType, row: &[u8], a: &Acts, order: F32Order) -> f32 {
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
