//! The 32-element "legacy" formats Q4_0, Q4_1, Q5_0 and Q5_1, and Q8_1, the activation format of
//! Q4_1/Q5_1: block layouts, scalar dequantisation, ggml's reference quantisers, the Q8_1
//! activation quantiser and the scalar reference dot products.
//!
//! Layouts (little-endian, `f16` = IEEE binary16):
//! * Q4_0 (18 bytes): `d: f16`, 16 bytes of nibbles; value `(q - 8)·d`.
//! * Q4_1 (20 bytes): `d: f16`, `m: f16`, 16 bytes of nibbles; value `q·d + m`.
//! * Q5_0 (22 bytes): `d: f16`, `qh: u32` (fifth bits), 16 bytes of nibbles; value `(q - 16)·d`.
//! * Q5_1 (24 bytes): `d: f16`, `m: f16`, `qh: u32`, 16 bytes of nibbles; value `q·d + m`.
//! * Q8_1 (36 bytes): `d: f16`, `s: f16` (= `d·Σq`), 32 int8; value `q·d`.
//!
//! Element `j < 16` is the low nibble of byte `j`, element `j + 16` its high nibble; the fifth
//! bit of element `j` is bit `j` of `qh`.
//!
//! The dot products mirror ggml's AVX2 kernels: per block, eight int32 lanes (lane `k` sums
//! elements `4k..4k+4`) are converted to f32 and fused-multiply-added into one 8-lane
//! accumulator with the block's scale product; Q4_1/Q5_1 add the `m·s` terms in a scalar
//! fused-multiply-add chain (GCC contracts ggml's `summs += m*s`), summed last.

use crate::scalar::shared::{
    cvt_i32, f16_to_f32, f32_to_f16, hsum8, q8_0_amax, rd_u16, sign_i8, Q8_0_BYTES, QK,
};

/// Bytes per Q4_0 block.
pub(crate) const Q4_0_BYTES: usize = 18;
/// Bytes per Q4_1 block.
pub(crate) const Q4_1_BYTES: usize = 20;
/// Bytes per Q5_0 block.
pub(crate) const Q5_0_BYTES: usize = 22;
/// Bytes per Q5_1 block.
pub(crate) const Q5_1_BYTES: usize = 24;
/// Bytes per Q8_1 block.
pub(crate) const Q8_1_BYTES: usize = 36;

/// Nibble of element `j` from the 16 bytes at `qs`.
#[inline(always)]
fn nib(b: &[u8], qs: usize, j: usize) -> u8 {
    let byte = b[qs + (j & 15)];
    if j < 16 {
        byte & 0x0f
    } else {
        byte >> 4
    }
}

/// Fifth bit of element `j` from the little-endian u32 at `qh`.
#[inline(always)]
fn high_bit(b: &[u8], qh: usize, j: usize) -> u8 {
    (b[qh + j / 8] >> (j % 8)) & 1
}

/// Element `j` of a Q4_0 block, in -8..8.
#[inline(always)]
pub(crate) fn q4_0_elem(b: &[u8], j: usize) -> i8 {
    nib(b, 2, j) as i8 - 8
}

/// Element `j` of a Q4_1 block, in 0..16.
#[inline(always)]
pub(crate) fn q4_1_elem(b: &[u8], j: usize) -> u8 {
    nib(b, 4, j)
}

/// Element `j` of a Q5_0 block, in -16..16.
#[inline(always)]
pub(crate) fn q5_0_elem(b: &[u8], j: usize) -> i8 {
    (nib(b, 6, j) | (high_bit(b, 2, j) << 4)) as i8 - 16
}

/// Element `j` of a Q5_1 block, in 0..32.
#[inline(always)]
pub(crate) fn q5_1_elem(b: &[u8], j: usize) -> u8 {
    nib(b, 8, j) | (high_bit(b, 4, j) << 4)
}

// ----------------------------------------------------------------------------------------------
// dequantise

/// Q4_0 / Q5_0: `q·d` (ggml's `dequantize_row_q4_0` / `_q5_0`).
fn dequant_signed<const BYTES: usize>(src: &[u8], dst: &mut [f32], elem: fn(&[u8], usize) -> i8) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(rd_u16(b, 0));
        for (j, y) in y.iter_mut().enumerate() {
            *y = elem(b, j) as f32 * d;
        }
    }
}

/// Q4_1 / Q5_1: `q·d + m`, rounded after the product (ggml's base library has no FMA).
fn dequant_min<const BYTES: usize>(src: &[u8], dst: &mut [f32], elem: fn(&[u8], usize) -> u8) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(rd_u16(b, 0));
        let m = f16_to_f32(rd_u16(b, 1));
        for (j, y) in y.iter_mut().enumerate() {
            *y = elem(b, j) as f32 * d + m;
        }
    }
}

pub(crate) fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    dequant_signed::<Q4_0_BYTES>(src, dst, q4_0_elem);
}

pub(crate) fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    dequant_signed::<Q5_0_BYTES>(src, dst, q5_0_elem);
}

pub(crate) fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    dequant_min::<Q4_1_BYTES>(src, dst, q4_1_elem);
}

pub(crate) fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    dequant_min::<Q5_1_BYTES>(src, dst, q5_1_elem);
}

/// Q8_1: `q·d` (not in ggml's table; `s` is ignored).
pub(crate) fn dequantize_q8_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_1_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(rd_u16(b, 0));
        for (y, &q) in y.iter_mut().zip(&b[4..]) {
            *y = (q as i8) as f32 * d;
        }
    }
}

// ----------------------------------------------------------------------------------------------
// quantise

/// Quantises one block of 32 values to Q8_1 exactly as ggml's x86 `quantize_row_q8_1`: the
/// Q8_0 quantisation plus `s = f16(d · Σq)`, where `d` is the unrounded `amax/127` and the sum
/// is taken over the int32 values before they saturate to int8.
pub(crate) fn quantize_block_q8_1(x: &[f32], out: &mut [u8]) {
    let amax = q8_0_amax(x);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (o, &v) in out[4..4 + QK].iter_mut().zip(x) {
        let i = cvt_i32((v * id).round_ties_even());
        sum = sum.wrapping_add(i);
        *o = i.clamp(-128, 127) as i8 as u8;
    }
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    out[2..4].copy_from_slice(&f32_to_f16(d * sum as f32).to_le_bytes());
}

pub(crate) fn quantize_q8_1(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q8_1_BYTES)) {
        quantize_block_q8_1(x, out);
    }
}

/// The first value of largest magnitude (ggml's `amax < |v|` scan), and that magnitude.
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// The minimum and maximum as ggml's `v < min` / `v > max` scans from ±FLT_MAX compute them.
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// C's `(int8_t)f` on x86 (`cvttss2si`, then the low byte).
#[inline(always)]
fn trunc_i8(f: f32) -> i8 {
    cvt_i32(f.trunc()) as i8
}

/// C's `(uint8_t)f` on x86 (`cvttss2si`, then the low byte).
#[inline(always)]
fn trunc_u8(f: f32) -> u8 {
    cvt_i32(f.trunc()) as u8
}

/// ggml's `quantize_row_q4_0_ref` (`q = min(15, (int8)(x/d + 8.5))`, `d = max/-8`).
pub(crate) fn quantize_q4_0(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q4_0_BYTES)) {
        let (_, max) = signed_max(x);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
        for j in 0..QK / 2 {
            let q0 = (trunc_i8(x[j] * id + 8.5) as i32).min(15) as u8;
            let q1 = (trunc_i8(x[j + 16] * id + 8.5) as i32).min(15) as u8;
            out[2 + j] = q0 | (q1 << 4);
        }
    }
}

/// ggml's `quantize_row_q5_0_ref` (`q = min(31, (int8)(x/d + 16.5))`, `d = max/-16`).
pub(crate) fn quantize_q5_0(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q5_0_BYTES)) {
        let (_, max) = signed_max(x);
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let q0 = (trunc_i8(x[j] * id + 16.5) as i32).min(31) as u8;
            let q1 = (trunc_i8(x[j + 16] * id + 16.5) as i32).min(31) as u8;
            out[6 + j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
            qh |= (((q0 & 0x10) >> 4) as u32) << j;
            qh |= (((q1 & 0x10) >> 4) as u32) << (j + 16);
        }
        out[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

/// ggml's `quantize_row_q4_1_ref` (`d = (max-min)/15`, `q = min(15, (int8)((x-min)/d + 0.5))`).
pub(crate) fn quantize_q4_1(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q4_1_BYTES)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
        out[2..4].copy_from_slice(&f32_to_f16(min).to_le_bytes());
        for j in 0..QK / 2 {
            let q0 = (trunc_i8((x[j] - min) * id + 0.5) as i32).min(15) as u8;
            let q1 = (trunc_i8((x[j + 16] - min) * id + 0.5) as i32).min(15) as u8;
            out[4 + j] = q0 | (q1 << 4);
        }
    }
}

/// ggml's `quantize_row_q5_1_ref` (`d = (max-min)/31`, `q = (uint8)((x-min)/d + 0.5)`).
pub(crate) fn quantize_q5_1(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q5_1_BYTES)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
        out[2..4].copy_from_slice(&f32_to_f16(min).to_le_bytes());
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let q0 = trunc_u8((x[j] - min) * id + 0.5);
            let q1 = trunc_u8((x[j + 16] - min) * id + 0.5);
            out[8 + j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
            qh |= (((q0 & 0x10) >> 4) as u32) << j;
            qh |= (((q1 & 0x10) >> 4) as u32) << (j + 16);
        }
        out[4..8].copy_from_slice(&qh.to_le_bytes());
    }
}

// ----------------------------------------------------------------------------------------------
// dot products

/// Eight int32 lanes of a signed-weight block: lane `k` sums `|x|·sign(y, x)` over elements
/// `4k..4k+4` (ggml's `_mm256_sign_epi8` product, which flips the sign of `x < 0, y = -128`).
#[inline(always)]
fn lanes_signed(x: impl Fn(usize) -> i8, y: &[u8]) -> [i32; 8] {
    let mut s = [0i32; 8];
    for (j, &y) in y[..QK].iter().enumerate() {
        let x = x(j);
        s[j / 4] += x.unsigned_abs() as i32 * sign_i8(y as i8, x) as i32;
    }
    s
}

/// Eight int32 lanes of an unsigned-weight block: lane `k` sums `x·y` over elements `4k..4k+4`.
#[inline(always)]
fn lanes_unsigned(x: impl Fn(usize) -> u8, y: &[u8]) -> [i32; 8] {
    let mut s = [0i32; 8];
    for (j, &y) in y[..QK].iter().enumerate() {
        s[j / 4] += x(j) as i32 * (y as i8) as i32;
    }
    s
}

/// Q4_0 / Q5_0 times Q8_0: `acc = fma(d_w·d_a, lanes, acc)` per block, then a halving sum.
fn dot_signed<const BYTES: usize>(
    n: usize,
    w: &[u8],
    a: &[u8],
    elem: fn(&[u8], usize) -> i8,
) -> f32 {
    let mut acc = [0.0f32; 8];
    for (xb, yb) in w
        .chunks_exact(BYTES)
        .zip(a.chunks_exact(Q8_0_BYTES))
        .take(n / QK)
    {
        let d = f16_to_f32(rd_u16(xb, 0)) * f16_to_f32(rd_u16(yb, 0));
        let s = lanes_signed(|j| elem(xb, j), &yb[2..]);
        for (acc, &s) in acc.iter_mut().zip(&s) {
            *acc = d.mul_add(s as f32, *acc);
        }
    }
    hsum8(&acc)
}

/// Q4_1 / Q5_1 times Q8_1: `acc = fma(d_w·d_a, lanes, acc)` per block and `summs = fma(m, s,
/// summs)`; the result is the halving sum of `acc` plus `summs`.
fn dot_min<const BYTES: usize>(n: usize, w: &[u8], a: &[u8], elem: fn(&[u8], usize) -> u8) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut summs = 0.0f32;
    for (xb, yb) in w
        .chunks_exact(BYTES)
        .zip(a.chunks_exact(Q8_1_BYTES))
        .take(n / QK)
    {
        let (dx, mx) = (f16_to_f32(rd_u16(xb, 0)), f16_to_f32(rd_u16(xb, 1)));
        let (dy, sy) = (f16_to_f32(rd_u16(yb, 0)), f16_to_f32(rd_u16(yb, 1)));
        summs = mx.mul_add(sy, summs);
        let d = dx * dy;
        let s = lanes_unsigned(|j| elem(xb, j), &yb[4..]);
        for (acc, &s) in acc.iter_mut().zip(&s) {
            *acc = d.mul_add(s as f32, *acc);
        }
    }
    hsum8(&acc) + summs
}

pub(crate) fn dot_q4_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_signed::<Q4_0_BYTES>(n, w, a, q4_0_elem)
}

pub(crate) fn dot_q5_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_signed::<Q5_0_BYTES>(n, w, a, q5_0_elem)
}

pub(crate) fn dot_q4_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_min::<Q4_1_BYTES>(n, w, a, q4_1_elem)
}

pub(crate) fn dot_q5_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_min::<Q5_1_BYTES>(n, w, a, q5_1_elem)
}
