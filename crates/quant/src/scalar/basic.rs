//! Reference kernels of the base types: F32, F16, BF16 (quantise, dequantise, dot), Q8_0 and
//! MXFP4. Like every scalar kernel they emulate the SIMD lanes and accumulation order of ggml's
//! x86 kernels (see the crate docs), and `mul_add` stands for a fused multiply-add.

use crate::scalar::shared::{
    bf16_to_f32, cvt_pack_i8, e8m0_to_f32_half, f16_to_f32, f32_to_bf16, f32_to_f16, hsum16, hsum8,
    q8_0_amax, rd_f32, rd_u16, sign_i8, E8M0_HALF, KVALUES_MXFP4, MXFP4_BYTES, Q8_0_BYTES, QK,
};

/// Quantises one block of 32 values to Q8_0 exactly as ggml's x86 `quantize_row_q8_0`.
#[inline(always)]
pub(crate) fn quantize_block_q8_0(x: &[f32], out: &mut [u8]) {
    let amax = q8_0_amax(x);
    let d = amax / 127.0;
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for (o, &v) in out[2..2 + QK].iter_mut().zip(x) {
        *o = cvt_pack_i8((v * id).round_ties_even()) as u8;
    }
}

/// ggml's `best_index_mxfp4`: the first table entry with the smallest |kv*d - x|.
#[inline(always)]
fn best_index_mxfp4(x: f32, d: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = (KVALUES_MXFP4[0] as f32 * d - x).abs();
    for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
        let err = (k as f32 * d - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

/// Quantises one block to MXFP4 as ggml's `quantize_row_mxfp4_ref`: the exponent is
/// `floor(log2(amax)) - 2 + 127` (0 for an all-zero block), then each value takes the nearest
/// table entry. Where ggml's float-to-u8 cast is undefined (amax below 2^-125, or infinite) the
/// exponent saturates to 0 or 255.
fn quantize_block_mxfp4(x: &[f32], out: &mut [u8]) {
    let mut amax = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
        }
    }
    let e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0) as u8
    } else {
        0
    };
    let d = e8m0_to_f32_half(e);
    out[0] = e;
    for j in 0..QK / 2 {
        out[1 + j] = best_index_mxfp4(x[j], d) | (best_index_mxfp4(x[j + QK / 2], d) << 4);
    }
}

// ----------------------------------------------------------------------------------------------
// quantise / dequantise

pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (d, &s) in dst.chunks_exact_mut(2).zip(src) {
        d.copy_from_slice(&f32_to_f16(s).to_le_bytes());
    }
}

/// BF16 quantiser; also used by the SIMD tables (ggml converts BF16 activations in scalar code).
pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (d, &s) in dst.chunks_exact_mut(2).zip(src) {
        d.copy_from_slice(&f32_to_bf16(s).to_le_bytes());
    }
}

pub(crate) fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q8_0_BYTES)) {
        quantize_block_q8_0(x, out);
    }
}

/// MXFP4 reference quantiser; also used by the SIMD tables.
pub(crate) fn quantize_mxfp4(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(MXFP4_BYTES)) {
        quantize_block_mxfp4(x, out);
    }
}

/// F32 dequantiser (a little-endian copy); also used by the SIMD tables.
pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (i, d) in dst.iter_mut().enumerate() {
        *d = f16_to_f32(rd_u16(src, i));
    }
}

pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (i, d) in dst.iter_mut().enumerate() {
        *d = bf16_to_f32(rd_u16(src, i));
    }
}

pub(crate) fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_0_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(rd_u16(b, 0));
        for (y, &q) in y.iter_mut().zip(&b[2..]) {
            *y = (q as i8) as f32 * d;
        }
    }
}

pub(crate) fn dequantize_mxfp4(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(MXFP4_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = E8M0_HALF[b[0] as usize];
        for j in 0..QK / 2 {
            y[j] = KVALUES_MXFP4[(b[1 + j] & 0x0f) as usize] as f32 * d;
            y[j + QK / 2] = KVALUES_MXFP4[(b[1 + j] >> 4) as usize] as f32 * d;
        }
    }
}

// ----------------------------------------------------------------------------------------------
// dot products

/// Four 16-lane FMA accumulators over 64-element steps, reduced as ggml's `GGML_F32_VEC_REDUCE`
/// (s0+s2, s1+s3, then s0+s1, then a halving horizontal sum). Returns the reduced sum of the
/// first `n & !63` elements.
#[inline(always)]
fn fma_64<L: Fn(&[u8], usize) -> f32>(n: usize, w: &[u8], a: &[u8], load: L) -> f32 {
    let np = n & !63;
    let mut acc = [[0.0f32; 16]; 4];
    for base in (0..np).step_by(64) {
        for (j, acc) in acc.iter_mut().enumerate() {
            for (l, s) in acc.iter_mut().enumerate() {
                let i = base + 16 * j + l;
                *s = load(w, i).mul_add(load(a, i), *s);
            }
        }
    }
    let [mut s0, mut s1, s2, s3] = acc;
    for l in 0..16 {
        s0[l] += s2[l];
        s1[l] += s3[l];
    }
    for l in 0..16 {
        s0[l] += s1[l];
    }
    hsum16(&s0)
}

pub(crate) fn dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = fma_64(n, w, a, rd_f32);
    for i in n & !63..n {
        sum = rd_f32(w, i).mul_add(rd_f32(a, i), sum);
    }
    sum
}

pub(crate) fn dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let ld = |b: &[u8], i: usize| f16_to_f32(rd_u16(b, i));
    let mut sum = fma_64(n, w, a, ld) as f64;
    for i in n & !63..n {
        sum += (ld(w, i) * ld(a, i)) as f64;
    }
    sum as f32
}

pub(crate) fn dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let ld = |b: &[u8], i: usize| bf16_to_f32(rd_u16(b, i));
    let np = n & !31;
    let mut c1 = [0.0f32; 16];
    let mut c2 = [0.0f32; 16];
    for base in (0..np).step_by(32) {
        for l in 0..16 {
            c1[l] += ld(w, base + l) * ld(a, base + l);
            c2[l] += ld(w, base + 16 + l) * ld(a, base + 16 + l);
        }
    }
    let mut sum = 0.0f64;
    sum += hsum16(&c1) as f64;
    sum += hsum16(&c2) as f64;
    for i in np..n {
        sum += (ld(w, i) * ld(a, i)) as f64;
    }
    sum as f32
}

pub(crate) fn dot_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK;
    let mut acc = [0.0f32; 8];
    for (xb, yb) in w
        .chunks_exact(Q8_0_BYTES)
        .zip(a.chunks_exact(Q8_0_BYTES))
        .take(nb)
    {
        let d = f16_to_f32(rd_u16(xb, 0)) * f16_to_f32(rd_u16(yb, 0));
        for (k, acc) in acc.iter_mut().enumerate() {
            let mut s = 0i32;
            for j in 4 * k..4 * k + 4 {
                let (x, y) = (xb[2 + j] as i8, yb[2 + j] as i8);
                s += x.unsigned_abs() as i32 * sign_i8(y, x) as i32;
            }
            *acc = d.mul_add(s as f32, *acc);
        }
    }
    hsum8(&acc)
}

/// Element `j` of an MXFP4 block as a table value.
#[inline(always)]
fn mxfp4_elem(b: &[u8], j: usize) -> i32 {
    let byte = b[1 + (j % 16)];
    let nib = if j < 16 { byte & 0x0f } else { byte >> 4 };
    KVALUES_MXFP4[nib as usize] as i32
}

/// One MXFP4 block times one Q8_0 block into 8 lanes: lane k sums elements 4k..4k+4 of
/// `|x|·sign(y, x)` (ggml's `mul_add_epi8`, whose sign trick flips `x < 0, y = -128`).
#[inline(always)]
fn mxfp4_block_lanes(xb: &[u8], yb: &[u8], acc: &mut [f32; 8]) {
    let s = f16_to_f32(rd_u16(yb, 0)) * E8M0_HALF[xb[0] as usize];
    for (k, acc) in acc.iter_mut().enumerate() {
        let mut p = 0i32;
        for j in 4 * k..4 * k + 4 {
            let x = mxfp4_elem(xb, j) as i8;
            p += x.unsigned_abs() as i32 * sign_i8(yb[2 + j] as i8, x) as i32;
        }
        *acc = s.mul_add(p as f32, *acc);
    }
}

/// The odd trailing MXFP4 block, added to `sum` as ggml's scalar tail does (exact products).
#[inline(always)]
pub(crate) fn mxfp4_tail(xb: &[u8], yb: &[u8], sum: f32) -> f32 {
    let d = f16_to_f32(rd_u16(yb, 0)) * E8M0_HALF[xb[0] as usize];
    let mut sumi = 0i32;
    for j in 0..QK {
        sumi += mxfp4_elem(xb, j) * (yb[2 + j] as i8) as i32;
    }
    d.mul_add(sumi as f32, sum)
}

pub(crate) fn dot_mxfp4(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK;
    let (mut acc1, mut acc2) = ([0.0f32; 8], [0.0f32; 8]);
    let mut ib = 0;
    while ib + 1 < nb {
        let x = &w[ib * MXFP4_BYTES..];
        let y = &a[ib * Q8_0_BYTES..];
        mxfp4_block_lanes(x, y, &mut acc1);
        mxfp4_block_lanes(&x[MXFP4_BYTES..], &y[Q8_0_BYTES..], &mut acc2);
        ib += 2;
    }
    let mut s = [0.0f32; 8];
    for l in 0..8 {
        s[l] = acc1[l] + acc2[l];
    }
    let mut sum = hsum8(&s);
    if ib < nb {
        sum = mxfp4_tail(&w[ib * MXFP4_BYTES..], &a[ib * Q8_0_BYTES..], sum);
    }
    sum
}
