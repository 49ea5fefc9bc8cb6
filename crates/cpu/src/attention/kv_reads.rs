//! Reading the K/V cells for attention: block types' `vec_dot` kernels and dequantisation,
//! heads that fit the block size, the dot products of the row kernels, undoing the stored
//! rotation on the output, and scratch buffers sized to the call.

use half::bf16;
use hmoe_backend::numerics::{dot_vec, fwht, hsum16};
use hmoe_quant::{DotKernel, GgmlType};

use crate::kv_storage::{Cells, LayerCache};

/// Lanes of ggml's 16-wide FMA chains (tinyBLAS's score and value sums, the softmax's
/// chunks of positions).
pub(super) const LANES: usize = 16;

/// A score as tinyBLAS sums it (one 16-lane FMA accumulator, then halving), for f16 keys
/// converted to f32 and a query already rounded to f16 (as ggml converts it).
pub(super) fn dot_lanes(q16: &[f32], k: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let (mut qc, mut kc) = (q16.chunks_exact(LANES), k.chunks_exact(LANES));
    for (cq, ck) in (&mut qc).zip(&mut kc) {
        for i in 0..LANES {
            lanes[i] = cq[i].mul_add(ck[i], lanes[i]);
        }
    }
    for (i, (&a, &b)) in qc.remainder().iter().zip(kc.remainder()).enumerate() {
        lanes[i] = a.mul_add(b, lanes[i]);
    }
    hsum16(&lanes)
}

pub(super) fn dot_vec_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_vec(a, b, |v| v, false)
}

/// Undoes the rotation of the stored values on the attention output (the Walsh–Hadamard
/// transform is its own inverse); `rot` 0: not rotated.
pub(super) fn rotate_back(out: &mut [f32], rot: usize) {
    if rot > 0 {
        hmoe_pool::global().for_each_chunk_mut(out, rot, |_, chunk| fwht(chunk));
    }
}

/// Whether V cells can only be read by flash attention: block-quantized values, which ggml
/// cannot store transposed for the non-flash product.
pub(super) fn needs_flash(v: &Cells) -> bool {
    matches!(v, Cells::Blocks { ty, .. } if *ty != GgmlType::BF16)
}

/// Whether key heads of `kd` and value heads of `vd` elements are whole blocks of the cache
/// types (values stored in the keys when `v_in_k`).
pub(super) fn heads_fit(cache: &LayerCache, kd: usize, vd: usize, v_in_k: bool) -> bool {
    let v_block = if v_in_k {
        cache.k.block_elems()
    } else {
        cache.v.block_elems()
    };
    kd.is_multiple_of(cache.k.block_elems()) && vd.is_multiple_of(v_block)
}

/// K's `vec_dot` kernel for block-typed keys; `None` for f32/f16 keys.
pub(super) fn block_kernel(k: &Cells) -> Option<DotKernel> {
    match k {
        Cells::Blocks { ty, .. } => {
            Some(DotKernel::best(*ty).expect("every cache type has a dot kernel"))
        }
        _ => None,
    }
}

/// Bytes of the `n` elements from element `at` of block-typed cells.
pub(super) fn block_range(ty: GgmlType, at: usize, n: usize) -> std::ops::Range<usize> {
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    at / be * bb..(at + n) / be * bb
}

/// K's `vec_dot` of the `n` keys from element `at` with a converted query.
pub(super) fn block_dot(
    kernel: Option<&DotKernel>,
    ty: GgmlType,
    data: &[u8],
    at: usize,
    n: usize,
    q: &[u8],
) -> f32 {
    kernel.map_or(0.0, |k| k.dot(n, &data[block_range(ty, at, n)], q))
}

/// Dequantizes `out.len()` values from element `at` (ggml's `to_float`).
pub(super) fn dequantize_at(ty: GgmlType, data: &[u8], at: usize, out: &mut [f32]) {
    hmoe_quant::dequantize_row(ty, &data[block_range(ty, at, out.len())], out)
        .expect("heads are whole blocks (checked)");
}

/// A probability as ggml's non-flash product sees it against values of type `ty`: rounded
/// to bf16 for bf16 values (the activation type of a bf16 matmul).
pub(super) fn round_weight(ty: GgmlType, w: f32) -> f32 {
    if ty == GgmlType::BF16 {
        bf16::from_f32(w).to_f32()
    } else {
        w
    }
}

/// `v` resized to `n` elements (contents unspecified), its capacity kept.
pub(super) fn fit<T: Copy + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}
