//! Scalar reference kernels. These define the numbers: the SIMD paths must reproduce them bit
//! for bit, so the dot products emulate the SIMD lanes and accumulation order of ggml's x86
//! kernels (see the crate docs), and `mul_add` stands for a fused multiply-add.

use half::f16;

use crate::kernels::{DequantFn, DotFns, QuantFn};
use crate::{kquants, legacy, GgmlType};

/// Elements per Q8_0 / MXFP4 block.
pub(crate) const QK: usize = 32;
/// Bytes per Q8_0 block: f16 scale + 32 int8.
pub(crate) const Q8_0_BYTES: usize = 34;
/// Bytes per MXFP4 block: E8M0 exponent + 16 bytes of nibbles.
pub(crate) const MXFP4_BYTES: usize = 17;

/// MXFP4 (E2M1) values, doubled so they are integers; the scale is halved to match.
pub(crate) const KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// ggml's `GGML_E8M0_TO_FP32_HALF`: 2^(e-128), exact for every `e` (e < 2 gives subnormals).
pub(crate) const fn e8m0_to_f32_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// [`e8m0_to_f32_half`] for every byte.
pub(crate) static E8M0_HALF: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e8m0_to_f32_half(i as u8);
        i += 1;
    }
    t
};

/// IEEE binary16 bits to f32 (exact).
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    f16::from_bits(h).to_f32_const()
}

/// f32 to IEEE binary16 bits, round to nearest even (as F16C `vcvtps2ph` with imm 0).
#[inline(always)]
pub(crate) fn f32_to_f16(x: f32) -> u16 {
    f16::from_f32_const(x).to_bits()
}

/// bfloat16 bits to f32 (exact).
#[inline(always)]
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 to bfloat16 bits, round to nearest even, NaNs made quiet (ggml's `GGML_FP32_TO_BF16`).
#[inline(always)]
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        ((u >> 16) | 64) as u16
    } else {
        ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
    }
}

/// The little-endian u16 at element `i` (byte `2 * i`).
#[inline(always)]
pub(crate) fn rd_u16(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[2 * i], b[2 * i + 1]])
}

/// The little-endian f32 at element `i` (byte `4 * i`).
#[inline(always)]
pub(crate) fn rd_f32(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// Horizontal sum of 8 lanes by halving: (a0+a4, ..) then (b0+b2, b1+b3) then c0+c1, the order
/// of ggml's `hsum_float_8`.
#[inline(always)]
pub(crate) fn hsum8(a: &[f32; 8]) -> f32 {
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let c = [b[0] + b[2], b[1] + b[3]];
    c[0] + c[1]
}

/// Horizontal sum of 16 lanes by halving, the order of `_mm512_reduce_add_ps`.
#[inline(always)]
pub(crate) fn hsum16(a: &[f32; 16]) -> f32 {
    let mut h = [0.0f32; 8];
    for i in 0..8 {
        h[i] = a[i] + a[i + 8];
    }
    hsum8(&h)
}

/// x86 `maxps` semantics: the second operand unless the first is strictly greater (so a NaN in
/// either gives the second).
#[inline(always)]
fn maxps(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// x86 float-to-int32 conversion of an integral value (`vcvtps2dq` after rounding, or
/// `cvttss2si`, which truncates): `i32::MIN` for NaN and out-of-range values.
#[inline(always)]
pub(crate) fn cvt_i32(r: f32) -> i32 {
    if r.is_nan() || !(-2_147_483_648.0..2_147_483_648.0).contains(&r) {
        i32::MIN
    } else {
        r as i32
    }
}

/// `vcvtps2dq` of an already rounded value, then the two signed saturating packs to int8.
#[inline(always)]
pub(crate) fn cvt_pack_i8(r: f32) -> i8 {
    cvt_i32(r).clamp(-128, 127) as i8
}

/// The absolute maximum of a Q8_0 block, reduced in the lane order of ggml's AVX2 quantiser.
#[inline(always)]
pub(crate) fn q8_0_amax(x: &[f32]) -> f32 {
    let mut m = [0.0f32; 8];
    for (l, m) in m.iter_mut().enumerate() {
        let mut v = x[l].abs();
        v = maxps(v, x[8 + l].abs());
        v = maxps(v, x[16 + l].abs());
        *m = maxps(v, x[24 + l].abs());
    }
    let m4 = [
        maxps(m[4], m[0]),
        maxps(m[5], m[1]),
        maxps(m[6], m[2]),
        maxps(m[7], m[3]),
    ];
    let m2 = [maxps(m4[0], m4[2]), maxps(m4[1], m4[3])];
    maxps(m2[0], m2[1])
}

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

fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

fn quantize_f16(src: &[f32], dst: &mut [u8]) {
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

fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
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

fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (i, d) in dst.iter_mut().enumerate() {
        *d = f16_to_f32(rd_u16(src, i));
    }
}

fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (i, d) in dst.iter_mut().enumerate() {
        *d = bf16_to_f32(rd_u16(src, i));
    }
}

fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_0_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(rd_u16(b, 0));
        for (y, &q) in y.iter_mut().zip(&b[2..]) {
            *y = (q as i8) as f32 * d;
        }
    }
}

fn dequantize_mxfp4(src: &[u8], dst: &mut [f32]) {
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

fn dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = fma_64(n, w, a, rd_f32);
    for i in n & !63..n {
        sum = rd_f32(w, i).mul_add(rd_f32(a, i), sum);
    }
    sum
}

fn dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let ld = |b: &[u8], i: usize| f16_to_f32(rd_u16(b, i));
    let mut sum = fma_64(n, w, a, ld) as f64;
    for i in n & !63..n {
        sum += (ld(w, i) * ld(a, i)) as f64;
    }
    sum as f32
}

fn dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
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

/// `_mm256_sign_epi8(y, x)` for one byte: -y (wrapping) where x < 0, 0 where x == 0, else y.
#[inline(always)]
pub(crate) fn sign_i8(y: i8, x: i8) -> i8 {
    match x {
        0 => 0,
        x if x < 0 => y.wrapping_neg(),
        _ => y,
    }
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

fn dot_mxfp4(n: usize, w: &[u8], a: &[u8]) -> f32 {
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

/// A scalar [`DotFns`] around a single-row dot: `rows` is one `dot` per row.
macro_rules! scalar_kernel {
    ($name:literal, $dot:path) => {{
        fn rows(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
            for (r, o) in out.iter_mut().enumerate() {
                *o = $dot(n, &w[r * stride..r * stride + stride], a);
            }
        }
        DotFns {
            name: $name,
            dot: $dot,
            rows,
        }
    }};
}

pub(crate) fn dot_fns(ty: GgmlType) -> Option<DotFns> {
    Some(match ty {
        GgmlType::F32 => scalar_kernel!("f32*f32/scalar", dot_f32),
        GgmlType::F16 => scalar_kernel!("f16*f16/scalar", dot_f16),
        GgmlType::BF16 => scalar_kernel!("bf16*bf16/scalar", dot_bf16),
        GgmlType::Q8_0 => scalar_kernel!("q8_0*q8_0/scalar", dot_q8_0),
        GgmlType::MXFP4 => scalar_kernel!("mxfp4*q8_0/scalar", dot_mxfp4),
        GgmlType::Q4_0 => scalar_kernel!("q4_0*q8_0/scalar", legacy::dot_q4_0),
        GgmlType::Q4_1 => scalar_kernel!("q4_1*q8_1/scalar", legacy::dot_q4_1),
        GgmlType::Q5_0 => scalar_kernel!("q5_0*q8_0/scalar", legacy::dot_q5_0),
        GgmlType::Q5_1 => scalar_kernel!("q5_1*q8_1/scalar", legacy::dot_q5_1),
        GgmlType::Q2_K => scalar_kernel!("q2_k*q8_k/scalar", kquants::dot_q2_k),
        GgmlType::Q3_K => scalar_kernel!("q3_k*q8_k/scalar", kquants::dot_q3_k),
        GgmlType::Q4_K => scalar_kernel!("q4_k*q8_k/scalar", kquants::dot_q4_k),
        GgmlType::Q5_K => scalar_kernel!("q5_k*q8_k/scalar", kquants::dot_q5_k),
        GgmlType::Q6_K => scalar_kernel!("q6_k*q8_k/scalar", kquants::dot_q6_k),
        GgmlType::Q8_1 | GgmlType::Q8_K => return None,
    })
}

pub(crate) fn quantize_fn(ty: GgmlType) -> Option<QuantFn> {
    Some(match ty {
        GgmlType::F32 => quantize_f32,
        GgmlType::F16 => quantize_f16,
        GgmlType::BF16 => quantize_bf16,
        GgmlType::Q8_0 => quantize_q8_0,
        GgmlType::MXFP4 => quantize_mxfp4,
        GgmlType::Q4_0 => legacy::quantize_q4_0,
        GgmlType::Q4_1 => legacy::quantize_q4_1,
        GgmlType::Q5_0 => legacy::quantize_q5_0,
        GgmlType::Q5_1 => legacy::quantize_q5_1,
        GgmlType::Q8_1 => legacy::quantize_q8_1,
        GgmlType::Q8_K => kquants::quantize_q8_k,
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            return None
        }
    })
}

pub(crate) fn dequantize_fn(ty: GgmlType) -> Option<DequantFn> {
    Some(match ty {
        GgmlType::F32 => dequantize_f32,
        GgmlType::F16 => dequantize_f16,
        GgmlType::BF16 => dequantize_bf16,
        GgmlType::Q8_0 => dequantize_q8_0,
        GgmlType::MXFP4 => dequantize_mxfp4,
        GgmlType::Q4_0 => legacy::dequantize_q4_0,
        GgmlType::Q4_1 => legacy::dequantize_q4_1,
        GgmlType::Q5_0 => legacy::dequantize_q5_0,
        GgmlType::Q5_1 => legacy::dequantize_q5_1,
        GgmlType::Q8_1 => legacy::dequantize_q8_1,
        GgmlType::Q2_K => kquants::dequantize_q2_k,
        GgmlType::Q3_K => kquants::dequantize_q3_k,
        GgmlType::Q4_K => kquants::dequantize_q4_k,
        GgmlType::Q5_K => kquants::dequantize_q5_k,
        GgmlType::Q6_K => kquants::dequantize_q6_k,
        GgmlType::Q8_K => kquants::dequantize_q8_k,
    })
}
