//! The scalar GEMM: one reference dot per output, MXFP4 in the block-wise order the SIMD GEMMs
//! reproduce, F32 in tinyBLAS's 16 lanes, Q8_0 and Q4_0/Q4_1/Q5_0/Q5_1 in `vec_dot`'s order.

use crate::gemm_layout::{ActBlocks, GemmFn};
use crate::scalar::shared::{
    f16_to_f32, hsum16, rd_f32, rd_u16, E8M0_HALF, KVALUES_MXFP4, MXFP4_BYTES, Q8_0_BYTES, QK,
};
use crate::{vec_dot_type, GgmlType};

/// MXFP4 × Q8_0 in the block-wise order (the definition the SIMD kernels reproduce).
pub(crate) fn mxfp4_blockwise(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (wb, ab) in w.chunks_exact(MXFP4_BYTES).zip(a.chunks_exact(Q8_0_BYTES)) {
        let scale = E8M0_HALF[wb[0] as usize] * f16_to_f32(rd_u16(ab, 0));
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            let q = wb[1 + j];
            isum += KVALUES_MXFP4[(q & 15) as usize] as i32 * ab[2 + j] as i8 as i32;
            isum += KVALUES_MXFP4[(q >> 4) as usize] as i32 * ab[2 + QK / 2 + j] as i8 as i32;
        }
        acc = (isum as f32).mul_add(scale, acc);
    }
    acc
}

/// F32 × F32 in 16 FMA lanes (lane `i % 16`), summed by halving.
pub(crate) fn f32_lanes(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut lanes = [0f32; 16];
    for i in 0..n {
        lanes[i % 16] = rd_f32(w, i).mul_add(rd_f32(a, i), lanes[i % 16]);
    }
    hsum16(&lanes)
}

/// The scalar GEMM for `weight`: one reference dot per output.
pub(crate) fn scalar_fn(weight: GgmlType) -> (&'static str, GemmFn) {
    fn run(
        n: usize,
        w: &[u8],
        acts: &[u8],
        n_tokens: usize,
        out: &mut [f32],
        ty: GgmlType,
        dot: impl Fn(&[u8], &[u8]) -> f32,
    ) {
        let wb = ty.block_bytes() * n / ty.block_elems();
        let act = vec_dot_type(ty);
        let ab = act.block_bytes() * n / act.block_elems();
        for (r, o) in out.chunks_exact_mut(n_tokens).enumerate() {
            let wr = &w[r * wb..(r + 1) * wb];
            for (t, o) in o.iter_mut().enumerate() {
                *o = dot(wr, &acts[t * ab..(t + 1) * ab]);
            }
        }
    }
    fn mxfp4(n: usize, w: &[u8], acts: &[u8], _: &ActBlocks, n_tokens: usize, out: &mut [f32]) {
        run(n, w, acts, n_tokens, out, GgmlType::MXFP4, mxfp4_blockwise);
    }
    fn q8_0(n: usize, w: &[u8], acts: &[u8], _: &ActBlocks, n_tokens: usize, out: &mut [f32]) {
        run(n, w, acts, n_tokens, out, GgmlType::Q8_0, |w, a| {
            crate::scalar::basic::dot_q8_0(n, w, a)
        });
    }
    /// The `vec_dot` reference of a Q4_0/Q4_1/Q5_0/Q5_1 type (what the SIMD GEMMs equal).
    macro_rules! lowbit {
        ($name:ident, $ty:ident, $dot:path) => {
            fn $name(
                n: usize,
                w: &[u8],
                acts: &[u8],
                _: &ActBlocks,
                n_tokens: usize,
                out: &mut [f32],
            ) {
                run(n, w, acts, n_tokens, out, GgmlType::$ty, |w, a| {
                    $dot(n, w, a)
                });
            }
        };
    }
    lowbit!(q4_0, Q4_0, crate::scalar::legacy::dot_q4_0);
    lowbit!(q4_1, Q4_1, crate::scalar::legacy::dot_q4_1);
    lowbit!(q5_0, Q5_0, crate::scalar::legacy::dot_q5_0);
    lowbit!(q5_1, Q5_1, crate::scalar::legacy::dot_q5_1);
    fn f32(n: usize, w: &[u8], acts: &[u8], _: &ActBlocks, n_tokens: usize, out: &mut [f32]) {
        run(n, w, acts, n_tokens, out, GgmlType::F32, |w, a| {
            f32_lanes(n, w, a)
        });
    }
    match weight {
        GgmlType::MXFP4 => ("mxfp4*q8_0 blockwise/scalar", mxfp4),
        GgmlType::Q8_0 => ("q8_0*q8_0 gemm/scalar", q8_0),
        GgmlType::Q4_0 => ("q4_0*q8_0 gemm/scalar", q4_0),
        GgmlType::Q4_1 => ("q4_1*q8_1 gemm/scalar", q4_1),
        GgmlType::Q5_0 => ("q5_0*q8_0 gemm/scalar", q5_0),
        GgmlType::Q5_1 => ("q5_1*q8_1 gemm/scalar", q5_1),
        _ => ("f32*f32 lanes16/scalar", f32),
    }
}
