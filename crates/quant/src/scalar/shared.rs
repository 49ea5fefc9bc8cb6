//! Block sizes, byte readers, float conversions and the scalar emulation of x86 lane
//! operations (`maxps`, `vcvtps2dq`, `_mm256_sign_epi8`, halving sums) that the reference kernels
//! and every ISA's kernels share.

use half::f16;

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

/// `_mm256_sign_epi8(y, x)` for one byte: -y (wrapping) where x < 0, 0 where x == 0, else y.
#[inline(always)]
pub(crate) fn sign_i8(y: i8, x: i8) -> i8 {
    match x {
        0 => 0,
        x if x < 0 => y.wrapping_neg(),
        _ => y,
    }
}
