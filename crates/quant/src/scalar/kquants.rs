//! The K-quant super-blocks Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and their activation format Q8_K:
//! layouts, scalar dequantisation, the Q8_K quantiser and the scalar reference dot products.
//!
//! Each super-block holds 256 elements. Layouts (little-endian, `f16` = IEEE binary16):
//! * Q2_K (84 bytes): `scales[16]` (low nibble scale, high nibble min, per 16 elements),
//!   `qs[64]` (2 bits), `d: f16`, `dmin: f16`; value `d·sc·q - dmin·m`.
//! * Q3_K (110 bytes): `hmask[32]` (third bit), `qs[64]` (low 2 bits), `scales[12]` (16 6-bit
//!   scales, offset 32), `d: f16`; value `d·(sc-32)·(q - (hbit ? 0 : 4))`.
//! * Q4_K (144 bytes): `d: f16`, `dmin: f16`, `scales[12]` (8 6-bit scales and 8 6-bit mins,
//!   per 32 elements), `qs[128]` (nibbles); value `d·sc·q - dmin·m`.
//! * Q5_K (176 bytes): as Q4_K with `qh[32]` (fifth bits) before `qs[128]`.
//! * Q6_K (210 bytes): `ql[128]` (low nibbles), `qh[64]` (2 high bits), `scales[16]` (int8,
//!   per 16 elements), `d: f16`; value `d·sc·(q - 32)`.
//! * Q8_K (292 bytes): `d: f32`, `qs[256]` (int8), `bsums[16]: i16` (sums of 16 quants).
//!
//! Element `e` of a 2-bit/3-bit/6-bit super-block lives in 128-element halves `e / 128`, each
//! made of four 32-element groups sharing one 32-byte run of low bits at different shifts; 4-bit
//! and 5-bit ones pair 32-element groups on the nibbles of one 32-byte run.
//!
//! The dot products mirror ggml's AVX2 kernels: per super-block the integer products are
//! gathered into eight int32 lanes, lane `l` taking bytes `4l..4l+4` of every 32-byte run
//! (element `e` goes to lane `(e % 32) / 4`), converted to f32 and fused-multiply-added into one
//! 8-lane accumulator with `d_w·d_a`. The min corrections use `bsums`: Q2_K adds them into the
//! same accumulator first, Q4_K into a 4-lane accumulator summed at the end, Q5_K into a scalar
//! fused-multiply-add chain, Q6_K subtracts `32·Σ sc·bsum` (two sub-blocks per lane) from the
//! integer lanes.

use crate::scalar::shared::{f16_to_f32, f32_to_f16, hsum8, rd_f32, rd_u16};

/// Elements per super-block.
pub(crate) const QK_K: usize = 256;
/// Bytes per Q2_K super-block.
pub(crate) const Q2_K_BYTES: usize = 84;
/// Bytes per Q3_K super-block.
pub(crate) const Q3_K_BYTES: usize = 110;
/// Bytes per Q4_K super-block.
pub(crate) const Q4_K_BYTES: usize = 144;
/// Bytes per Q5_K super-block.
pub(crate) const Q5_K_BYTES: usize = 176;
/// Bytes per Q6_K super-block.
pub(crate) const Q6_K_BYTES: usize = 210;
/// Bytes per Q8_K super-block.
pub(crate) const Q8_K_BYTES: usize = 292;
/// Offset of `qs` in a Q8_K super-block.
pub(crate) const Q8_K_QS: usize = 4;
/// Offset of `bsums` in a Q8_K super-block.
pub(crate) const Q8_K_BSUMS: usize = 260;

/// The accumulator lane of element `e` in the SIMD kernels.
#[inline(always)]
fn lane(e: usize) -> usize {
    (e % 32) / 4
}

/// `bsums[i]` of a Q8_K super-block.
#[inline(always)]
pub(crate) fn q8k_bsum(b: &[u8], i: usize) -> i16 {
    i16::from_le_bytes([b[Q8_K_BSUMS + 2 * i], b[Q8_K_BSUMS + 2 * i + 1]])
}

/// Quant `e` of a Q8_K super-block.
#[inline(always)]
pub(crate) fn q8k_q(b: &[u8], e: usize) -> i32 {
    (b[Q8_K_QS + e] as i8) as i32
}

// ----------------------------------------------------------------------------------------------
// element access

/// The 2-bit field of element `e` from the 64 bytes at `qs` (2-bit and 3-bit layouts).
#[inline(always)]
fn low2(b: &[u8], qs: usize, e: usize) -> u8 {
    let (half, group, t) = (e / 128, (e % 128) / 32, e % 32);
    (b[qs + 32 * half + t] >> (2 * group)) & 3
}

/// Q2_K quant of element `e` (0..4).
#[inline(always)]
pub(crate) fn q2k_q(b: &[u8], e: usize) -> u8 {
    low2(b, 16, e)
}

/// Q3_K quant of element `e` (-4..4): the low two bits minus 4 where the `hmask` bit is clear.
#[inline(always)]
pub(crate) fn q3k_q(b: &[u8], e: usize) -> i8 {
    let hbit = (b[e % 32] >> (e / 32)) & 1;
    low2(b, 32, e) as i8 - if hbit == 0 { 4 } else { 0 }
}

/// The 16 Q3_K scales, 32 already subtracted.
#[inline(always)]
pub(crate) fn q3k_scales(b: &[u8]) -> [i8; 16] {
    let r = &b[96..108];
    let mut s = [0i8; 16];
    for (i, s) in s.iter_mut().enumerate() {
        let low = if i < 8 { r[i] & 0x0f } else { r[i - 8] >> 4 };
        let high = (r[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = (low | (high << 4)) as i8 - 32;
    }
    s
}

/// The 8 scales and 8 mins of a Q4_K/Q5_K super-block (ggml's `get_scale_min_k4`).
#[inline(always)]
pub(crate) fn k4_scales_mins(b: &[u8]) -> ([u8; 8], [u8; 8]) {
    let q = &b[4..16];
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        if j < 4 {
            sc[j] = q[j] & 63;
            mn[j] = q[j + 4] & 63;
        } else {
            sc[j] = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
            mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }
    (sc, mn)
}

/// Nibble of element `e` from the 128 bytes at `qs` (4-bit and 5-bit layouts).
#[inline(always)]
fn nib4(b: &[u8], qs: usize, e: usize) -> u8 {
    (b[qs + 32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 0x0f
}

/// Q4_K quant of element `e` (0..16).
#[inline(always)]
pub(crate) fn q4k_q(b: &[u8], e: usize) -> u8 {
    nib4(b, 16, e)
}

/// Q5_K quant of element `e` (0..32).
#[inline(always)]
pub(crate) fn q5k_q(b: &[u8], e: usize) -> u8 {
    nib4(b, 48, e) | (((b[16 + e % 32] >> (e / 32)) & 1) << 4)
}

/// Q6_K quant of element `e`, unsigned (0..64; the value is this minus 32).
#[inline(always)]
pub(crate) fn q6k_q(b: &[u8], e: usize) -> u8 {
    let (half, group, t) = (e / 128, (e % 128) / 32, e % 32);
    let low = (b[64 * half + 32 * (group & 1) + t] >> (4 * (group >> 1))) & 0x0f;
    let high = (b[128 + 32 * half + t] >> (2 * group)) & 3;
    low | (high << 4)
}

// ----------------------------------------------------------------------------------------------
// dequantise (ggml's `dequantize_row_*`, products rounded one at a time as its base library)

pub(crate) fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q2_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(rd_u16(b, 40));
        let min = f16_to_f32(rd_u16(b, 41));
        for (e, y) in y.iter_mut().enumerate() {
            let sc = b[e / 16];
            let (dl, ml) = (d * (sc & 0x0f) as f32, min * (sc >> 4) as f32);
            *y = dl * q2k_q(b, e) as f32 - ml;
        }
    }
}

pub(crate) fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q3_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(rd_u16(b, 54));
        let sc = q3k_scales(b);
        for (e, y) in y.iter_mut().enumerate() {
            *y = (d * sc[e / 16] as f32) * q3k_q(b, e) as f32;
        }
    }
}

/// Q4_K / Q5_K: `(d·sc)·q - dmin·m` per 32-element group.
fn dequant_k4(src: &[u8], dst: &mut [f32], bytes: usize, q: fn(&[u8], usize) -> u8) {
    for (b, y) in src.chunks_exact(bytes).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(rd_u16(b, 0));
        let min = f16_to_f32(rd_u16(b, 1));
        let (sc, mn) = k4_scales_mins(b);
        for (e, y) in y.iter_mut().enumerate() {
            let (dl, ml) = (d * sc[e / 32] as f32, min * mn[e / 32] as f32);
            *y = dl * q(b, e) as f32 - ml;
        }
    }
}

pub(crate) fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    dequant_k4(src, dst, Q4_K_BYTES, q4k_q);
}

pub(crate) fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    dequant_k4(src, dst, Q5_K_BYTES, q5k_q);
}

pub(crate) fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q6_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(rd_u16(b, 104));
        for (e, y) in y.iter_mut().enumerate() {
            let sc = b[192 + e / 16] as i8;
            *y = d * sc as f32 * (q6k_q(b, e) as i32 - 32) as f32;
        }
    }
}

/// Q8_K: `d·q` (ggml's `dequantize_row_q8_K`).
pub(crate) fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = rd_f32(b, 0);
        for (e, y) in y.iter_mut().enumerate() {
            *y = d * q8k_q(b, e) as f32;
        }
    }
}

// ----------------------------------------------------------------------------------------------
// quantise

/// ggml's `nearest_int`: add 1.5·2^23 and read the low mantissa bits (round half to even for
/// |x| < 2^22; the same bit trick for anything else, NaNs included).
#[inline(always)]
fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Quantises one super-block to Q8_K as ggml's `quantize_row_q8_K_ref` (which x86 uses):
/// `iscale = -127/max` for the first value of largest magnitude, `q = min(127, nearest_int(
/// iscale·x))`, `d = 1/iscale`, 16-element sums. An all-zero block gets `d = 0`, zero quants
/// and zero sums (ggml leaves its sums unwritten).
pub(crate) fn quantize_block_q8_k(x: &[f32], out: &mut [u8]) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        out.fill(0);
        return;
    }
    let iscale = -127.0 / max;
    for (o, &v) in out[Q8_K_QS..Q8_K_QS + QK_K].iter_mut().zip(x) {
        *o = nearest_int(iscale * v).min(127) as u8;
    }
    for j in 0..QK_K / 16 {
        let s: i32 = (0..16).map(|i| q8k_q(out, 16 * j + i)).sum();
        out[Q8_K_BSUMS + 2 * j..Q8_K_BSUMS + 2 * j + 2].copy_from_slice(&(s as i16).to_le_bytes());
    }
    out[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

pub(crate) fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q8_K_BYTES)) {
        quantize_block_q8_k(x, out);
    }
}

/// The f16 bits of the smallest f16 at least `v` (finite, non-negative).
fn f16_at_least(v: f32) -> u16 {
    let h = f32_to_f16(v);
    if f16_to_f32(h) < v {
        h + 1
    } else {
        h
    }
}

/// `num / den` rounded up to an integer in `0..=63` (0 where `den` is 0).
fn ceil_6bit(num: f32, den: f32) -> u8 {
    if den > 0.0 {
        (num / den).ceil().clamp(0.0, 63.0) as u8
    } else {
        0
    }
}

/// Quantises one super-block to Q5_K (ggml's layout: `d·sc·q − dmin·m` per 32 elements, 6-bit
/// `sc`, `m` and 5-bit `q`), by range rather than ggml's iterative fit: per 32 elements the
/// offset `dmin·m` covers the most negative value and `d·sc·31` the largest after the offset
/// (`d`, `dmin` rounded up to f16, `sc`, `m` up to integers), so each value only rounds to its
/// nearest quant: the error is at most half of `d·sc` (plus float rounding).
pub(crate) fn quantize_block_q5_k(x: &[f32], out: &mut [u8]) {
    out.fill(0);
    let lo: [f32; 8] =
        core::array::from_fn(|j| x[32 * j..32 * j + 32].iter().fold(0f32, |m, &v| m.min(v)));
    let hi: [f32; 8] =
        core::array::from_fn(|j| x[32 * j..32 * j + 32].iter().fold(0f32, |m, &v| m.max(v)));
    let dmin_h = f16_at_least(lo.iter().fold(0f32, |m, &v| m.max(-v)) / 63.0);
    let dmin = f16_to_f32(dmin_h);
    let mn: [u8; 8] = core::array::from_fn(|j| ceil_6bit(-lo[j], dmin));
    let top: [f32; 8] = core::array::from_fn(|j| hi[j] + dmin * mn[j] as f32);
    let d_h = f16_at_least(top.iter().fold(0f32, |m, &v| m.max(v)) / (31.0 * 63.0));
    let d = f16_to_f32(d_h);
    let sc: [u8; 8] = core::array::from_fn(|j| ceil_6bit(top[j], 31.0 * d));
    out[..2].copy_from_slice(&d_h.to_le_bytes());
    out[2..4].copy_from_slice(&dmin_h.to_le_bytes());
    for j in 0..4 {
        out[4 + j] = sc[j] | (sc[j + 4] >> 4) << 6;
        out[8 + j] = mn[j] | (mn[j + 4] >> 4) << 6;
        out[12 + j] = (sc[j + 4] & 15) | (mn[j + 4] & 15) << 4;
    }
    for (e, &v) in x.iter().enumerate() {
        let (step, off) = (d * sc[e / 32] as f32, dmin * mn[e / 32] as f32);
        let q = if step > 0.0 {
            ((v + off) / step).round().clamp(0.0, 31.0) as u8
        } else {
            0
        };
        out[48 + 32 * (e / 64) + e % 32] |= (q & 15) << (4 * ((e / 32) % 2));
        out[16 + e % 32] |= (q >> 4) << (e / 32);
    }
}

pub(crate) fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q5_K_BYTES)) {
        quantize_block_q5_k(x, out);
    }
}

// ----------------------------------------------------------------------------------------------
// dot products

/// `Σ sc(e)·q(e)·y(e)` per accumulator lane over one super-block, in wrapping int32.
#[inline(always)]
fn lanes(yb: &[u8], prod: impl Fn(usize) -> i32) -> [i32; 8] {
    let mut s = [0i32; 8];
    for e in 0..QK_K {
        let l = lane(e);
        s[l] = s[l].wrapping_add(prod(e).wrapping_mul(q8k_q(yb, e)));
    }
    s
}

/// `fma(d, lanes, acc)` for each lane.
#[inline(always)]
pub(crate) fn fma_lanes(acc: &mut [f32; 8], d: f32, s: &[i32; 8]) {
    for (acc, &s) in acc.iter_mut().zip(s) {
        *acc = d.mul_add(s as f32, *acc);
    }
}

/// The super-block pairs of a K-quant row and its Q8_K activations.
#[inline(always)]
pub(crate) fn superblocks<'a>(
    n: usize,
    w: &'a [u8],
    a: &'a [u8],
    bytes: usize,
) -> impl Iterator<Item = (&'a [u8], &'a [u8])> {
    w.chunks_exact(bytes)
        .zip(a.chunks_exact(Q8_K_BYTES))
        .take(n / QK_K)
}

pub(crate) fn dot_q2_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (xb, yb) in superblocks(n, w, a, Q2_K_BYTES) {
        let yd = rd_f32(yb, 0);
        let d = yd * f16_to_f32(rd_u16(xb, 40));
        let dmin = -yd * f16_to_f32(rd_u16(xb, 41));
        // Mins: lane l pairs sub-blocks 2l and 2l+1.
        let mut prod = [0i32; 8];
        for (l, p) in prod.iter_mut().enumerate() {
            let m = |i: usize| (xb[i] >> 4) as i32 * q8k_bsum(yb, i) as i32;
            *p = m(2 * l) + m(2 * l + 1);
        }
        fma_lanes(&mut acc, dmin, &prod);
        let s = lanes(yb, |e| (xb[e / 16] & 0x0f) as i32 * q2k_q(xb, e) as i32);
        fma_lanes(&mut acc, d, &s);
    }
    hsum8(&acc)
}

pub(crate) fn dot_q3_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (xb, yb) in superblocks(n, w, a, Q3_K_BYTES) {
        let d = rd_f32(yb, 0) * f16_to_f32(rd_u16(xb, 54));
        let sc = q3k_scales(xb);
        let s = lanes(yb, |e| sc[e / 16] as i32 * q3k_q(xb, e) as i32);
        fma_lanes(&mut acc, d, &s);
    }
    hsum8(&acc)
}

/// The four min products of a Q4_K/Q5_K super-block: lane `k` is `m[2k]·(b[4k]+b[4k+1]) +
/// m[2k+1]·(b[4k+2]+b[4k+3])` with the pair sums in wrapping int16 (`_mm_hadd_epi16`).
#[inline(always)]
fn k4_min_prod(mn: &[u8; 8], yb: &[u8]) -> [i32; 4] {
    let pair = |i: usize| q8k_bsum(yb, 2 * i).wrapping_add(q8k_bsum(yb, 2 * i + 1)) as i32;
    let mut p = [0i32; 4];
    for (k, p) in p.iter_mut().enumerate() {
        *p = mn[2 * k] as i32 * pair(2 * k) + mn[2 * k + 1] as i32 * pair(2 * k + 1);
    }
    p
}

pub(crate) fn dot_q4_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut acc_m = [0.0f32; 4];
    for (xb, yb) in superblocks(n, w, a, Q4_K_BYTES) {
        let yd = rd_f32(yb, 0);
        let d = yd * f16_to_f32(rd_u16(xb, 0));
        let dmin = -yd * f16_to_f32(rd_u16(xb, 1));
        let (sc, mn) = k4_scales_mins(xb);
        for (acc, &p) in acc_m.iter_mut().zip(&k4_min_prod(&mn, yb)) {
            *acc = dmin.mul_add(p as f32, *acc);
        }
        let s = lanes(yb, |e| sc[e / 32] as i32 * q4k_q(xb, e) as i32);
        fma_lanes(&mut acc, d, &s);
    }
    let m = (acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]);
    hsum8(&acc) + m
}

pub(crate) fn dot_q5_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut summs = 0.0f32;
    for (xb, yb) in superblocks(n, w, a, Q5_K_BYTES) {
        let yd = rd_f32(yb, 0);
        let d = yd * f16_to_f32(rd_u16(xb, 0));
        let dmin = -yd * f16_to_f32(rd_u16(xb, 1));
        let (sc, mn) = k4_scales_mins(xb);
        let p = k4_min_prod(&mn, yb);
        let psum = p.iter().fold(0i32, |s, &p| s.wrapping_add(p));
        summs = dmin.mul_add(psum as f32, summs);
        let s = lanes(yb, |e| sc[e / 32] as i32 * q5k_q(xb, e) as i32);
        fma_lanes(&mut acc, d, &s);
    }
    hsum8(&acc) + summs
}

pub(crate) fn dot_q6_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (xb, yb) in superblocks(n, w, a, Q6_K_BYTES) {
        let d = rd_f32(yb, 0) * f16_to_f32(rd_u16(xb, 104));
        let sc = |i: usize| (xb[192 + i] as i8) as i32;
        let mut s = lanes(yb, |e| sc(e / 16) * q6k_q(xb, e) as i32);
        for (l, s) in s.iter_mut().enumerate() {
            let b = |i: usize| q8k_bsum(yb, i) as i32 * sc(i);
            let sub = (b(2 * l) + b(2 * l + 1)).wrapping_shl(5);
            *s = s.wrapping_sub(sub);
        }
        fma_lanes(&mut acc, d, &s);
    }
    hsum8(&acc)
}
