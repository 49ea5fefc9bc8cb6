//! The IQ ("importance") types of ggml: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
//! IQ4_XS (super-blocks of 256, Q8_K activations) and IQ4_NL (blocks of 32, Q8_0 activations):
//! layouts, scalar dequantisation and the scalar reference dot products.
//!
//! Layouts (little-endian, `d: f16`; "group" = 8 elements sharing one grid row unless noted):
//! * IQ2_XXS (66 bytes): `d`, then per 32 elements two u32: four 8-bit grid indices, and four
//!   7-bit sign codes + a 4-bit scale `s` (top bits); value `d·(0.5+s)·0.25·grid·sign`.
//! * IQ2_XS (74): `d`, `qs[32]: u16` (9-bit grid index, 7-bit sign code), `scales[8]` (a nibble
//!   per 16 elements); value as IQ2_XXS.
//! * IQ2_S (82): `d`, `qs[32]` (grid index low bytes), `signs[32]` (a sign byte per group),
//!   `qh[8]` (2 high index bits per group), `scales[8]`; value as IQ2_XXS.
//! * IQ3_XXS (98): `d`, `qs[64]` (a grid index per 4 elements), per 32 elements a u32 of four
//!   7-bit sign codes + 4-bit scale; value `d·(0.5+s)·0.5·grid·sign`.
//! * IQ3_S (110): `d`, `qs[64]`, `qh[8]` (9th index bit per 4 elements), `signs[32]`,
//!   `scales[4]` (a nibble per 32 elements); value `d·(1+2s)·grid·sign`.
//! * IQ1_S (50): `d`, `qs[32]`, `qh[8]: u16` per 32 elements (3 high index bits per group, 3-bit
//!   scale, delta sign); value `d·(2s+1)·(grid ± 0.125)`.
//! * IQ1_M (56): `qs[32]`, `qh[16]` (a nibble per group: 3 index bits, delta sign),
//!   `scales[8]` (3-bit scale per 16 elements; `d` in the four top nibbles); value as IQ1_S.
//! * IQ4_NL (18, 32 elements): `d`, `qs[16]` nibbles into the 16 non-linear values;
//!   value `d·kv`.
//! * IQ4_XS (136): `d`, `scales_h: u16`, `scales_l[4]`, `qs[128]`: 6-bit scale per 32
//!   elements (offset 32), nibbles as IQ4_NL; value `d·(s-32)·kv`.
//!
//! Grid and sign tables are ggml's (see `iq_grids.rs`). Dequantisation multiplies in ggml's
//! order (the scale product first, then grid and sign). The dot products mirror ggml's AVX2
//! kernels: per super-block the integer products, each scaled by its sub-block's integer scale,
//! gather into eight int32 lanes (element `e` goes to lane `(e % 32) / 4`), whose f32 values are
//! fused-multiply-added into one 8-lane accumulator with `d_w·d_a` and summed by halving at the
//! end, then multiplied by the type's constant (1/8 for IQ2, 1/4 for IQ3_XXS). Signs are applied
//! to the activation byte as `_mm256_sign_epi8` does (so -128 stays -128). IQ1_S adds its delta
//! term from the Q8_K block sums in a scalar fused-multiply-add chain, IQ1_M in a second 8-lane
//! accumulator; IQ4_NL uses two accumulators for even and odd blocks and a scalar tail block.

use crate::scalar::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
    KVALUES_IQ4NL,
};
use crate::scalar::kquants::{fma_lanes, q8k_bsum, q8k_q, superblocks, QK_K};
use crate::scalar::shared::{f16_to_f32, hsum8, rd_f32, rd_u16, Q8_0_BYTES, QK};
use crate::GgmlType;

/// The delta of IQ1_S and IQ1_M grid values (ggml's `IQ1S_DELTA`, `IQ1M_DELTA`).
const IQ1_DELTA: f32 = 0.125;
/// Bytes of an IQ4_NL block.
pub(crate) const IQ4_NL_BYTES: usize = 18;

/// One decoded super-block: the signed grid value of each element, the integer scale of each
/// 16 elements as the dot products multiply it, and (IQ1 only) whether each element's delta is
/// negative.
struct Decoded {
    q: [i8; QK_K],
    ls: [i32; 16],
    dneg: [bool; QK_K],
}

impl Decoded {
    fn new() -> Decoded {
        Decoded {
            q: [0; QK_K],
            ls: [0; 16],
            dneg: [false; QK_K],
        }
    }

    /// Sets the 8 elements from `e0` to the bytes of `grid` (magnitudes) with the sign bits of
    /// `signs` (bit j negates element j).
    #[inline(always)]
    fn put8(&mut self, e0: usize, grid: u64, signs: u8) {
        for j in 0..8 {
            let m = (grid >> (8 * j)) as u8 as i8;
            self.q[e0 + j] = if signs >> j & 1 == 1 { -m } else { m };
        }
    }

    /// Sets the 2 scales of 32 elements from `ib` to `ls`.
    #[inline(always)]
    fn scale32(&mut self, ib: usize, ls: i32) {
        self.ls[2 * ib] = ls;
        self.ls[2 * ib + 1] = ls;
    }
}

/// Little-endian u32 at byte `o`.
#[inline(always)]
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// Little-endian u16 at byte `o`.
#[inline(always)]
fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

/// The two 4-bit scales `2s+1` of the 16-element halves of 32-element block `ib` from a nibble
/// pair byte.
#[inline(always)]
fn nibble_scales(d: &mut Decoded, ib: usize, byte: u8) {
    d.ls[2 * ib] = 2 * (byte & 0x0f) as i32 + 1;
    d.ls[2 * ib + 1] = 2 * (byte >> 4) as i32 + 1;
}

fn decode_iq2_xxs(b: &[u8], d: &mut Decoded) {
    for ib in 0..8 {
        let o = 2 + 8 * ib;
        let aux = u32_at(b, o + 4);
        d.scale32(ib, 2 * (aux >> 28) as i32 + 1);
        for l in 0..4 {
            let signs = KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize];
            d.put8(32 * ib + 8 * l, IQ2XXS_GRID[b[o + l] as usize], signs);
        }
    }
}

fn decode_iq2_xs(b: &[u8], d: &mut Decoded) {
    for ib in 0..8 {
        nibble_scales(d, ib, b[66 + ib]);
        for l in 0..4 {
            let v = u16_at(b, 2 + 2 * (4 * ib + l));
            let signs = KSIGNS_IQ2XS[(v >> 9) as usize];
            d.put8(32 * ib + 8 * l, IQ2XS_GRID[(v & 511) as usize], signs);
        }
    }
}

fn decode_iq2_s(b: &[u8], d: &mut Decoded) {
    for ib in 0..8 {
        nibble_scales(d, ib, b[74 + ib]);
        let qh = b[66 + ib] as usize;
        for l in 0..4 {
            let idx = b[2 + 4 * ib + l] as usize | ((qh << (8 - 2 * l)) & 0x300);
            d.put8(32 * ib + 8 * l, IQ2S_GRID[idx], b[34 + 4 * ib + l]);
        }
    }
}

fn decode_iq3_xxs(b: &[u8], d: &mut Decoded) {
    for ib in 0..8 {
        let aux = u32_at(b, 66 + 4 * ib);
        d.scale32(ib, 2 * (aux >> 28) as i32 + 1);
        for l in 0..4 {
            let signs = KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize];
            let g1 = IQ3XXS_GRID[b[2 + 8 * ib + 2 * l] as usize] as u64;
            let g2 = IQ3XXS_GRID[b[2 + 8 * ib + 2 * l + 1] as usize] as u64;
            d.put8(32 * ib + 8 * l, g1 | g2 << 32, signs);
        }
    }
}

fn decode_iq3_s(b: &[u8], d: &mut Decoded) {
    for ib in 0..8 {
        let raw = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0f;
        d.scale32(ib, 1 + 2 * raw as i32);
        let qh = b[66 + ib] as usize;
        for l in 0..4 {
            let idx = |k: usize| b[2 + 8 * ib + k] as usize | ((qh >> k & 1) << 8);
            let g1 = IQ3S_GRID[idx(2 * l)] as u64;
            let g2 = IQ3S_GRID[idx(2 * l + 1)] as u64;
            d.put8(32 * ib + 8 * l, g1 | g2 << 32, b[74 + 4 * ib + l]);
        }
    }
}

/// An IQ1 grid row (signed bytes) for 8 elements from `e0`, delta sign `dneg`.
#[inline(always)]
fn put_iq1(d: &mut Decoded, e0: usize, idx: usize, dneg: bool) {
    let g = IQ1S_GRID[idx];
    for j in 0..8 {
        d.q[e0 + j] = (g >> (8 * j)) as u8 as i8;
        d.dneg[e0 + j] = dneg;
    }
}

fn decode_iq1_s(b: &[u8], d: &mut Decoded) {
    for ib in 0..8 {
        let qh = u16_at(b, 34 + 2 * ib) as usize;
        d.scale32(ib, 2 * ((qh >> 12) & 7) as i32 + 1);
        for l in 0..4 {
            let idx = b[2 + 4 * ib + l] as usize | ((qh >> (3 * l)) & 7) << 8;
            put_iq1(d, 32 * ib + 8 * l, idx, qh & 0x8000 != 0);
        }
    }
}

/// The f16 scale of an IQ1_M super-block, spread over the top nibbles of its four scale words.
pub(crate) fn iq1_m_d(b: &[u8]) -> f32 {
    let sc = |k: usize| u16_at(b, 48 + 2 * k);
    let bits = (sc(0) >> 12) | ((sc(1) >> 8) & 0x00f0) | ((sc(2) >> 4) & 0x0f00) | (sc(3) & 0xf000);
    f16_to_f32(bits)
}

fn decode_iq1_m(b: &[u8], d: &mut Decoded) {
    for ib in 0..8 {
        let sc = u16_at(b, 48 + 2 * (ib / 2));
        for h in 0..2 {
            d.ls[2 * ib + h] = 2 * ((sc >> (6 * (ib % 2) + 3 * h)) & 7) as i32 + 1;
        }
        for l in 0..4 {
            let nib = (b[32 + 2 * ib + l / 2] >> (4 * (l % 2))) as usize & 0x0f;
            let idx = b[4 * ib + l] as usize | (nib & 7) << 8;
            put_iq1(d, 32 * ib + 8 * l, idx, nib & 8 != 0);
        }
    }
}

/// The 32 non-linear values of 16 nibble bytes: low nibbles first, then high nibbles.
#[inline(always)]
fn iq4_values(qs: &[u8], out: &mut [i8]) {
    for j in 0..16 {
        out[j] = KVALUES_IQ4NL[(qs[j] & 0x0f) as usize];
        out[j + 16] = KVALUES_IQ4NL[(qs[j] >> 4) as usize];
    }
}

fn decode_iq4_xs(b: &[u8], d: &mut Decoded) {
    let sh = u16_at(b, 2);
    for ib in 0..8 {
        let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0f;
        let hi = ((sh >> (2 * ib)) & 3) as u8;
        d.scale32(ib, (lo | hi << 4) as i32 - 32);
        iq4_values(
            &b[8 + 16 * ib..24 + 16 * ib],
            &mut d.q[32 * ib..32 * ib + 32],
        );
    }
}

/// How one super-block IQ type is decoded and scaled.
struct Layout {
    bytes: usize,
    decode: fn(&[u8], &mut Decoded),
    /// The super-block's f16 scale.
    d: fn(&[u8]) -> f32,
    /// The dequantisation scale of 16 elements from `d` and the integer scale `ls`, in ggml's
    /// order of operations.
    db: fn(f32, i32) -> f32,
    /// The constant ggml multiplies the dot product by at the end.
    c: f32,
    /// The IQ1 shift: values are `db·(grid ± 0.125)`.
    delta: Delta,
}

/// Where an IQ1 type's ±1/8 shift goes in the dot product.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Delta {
    /// No shift (IQ2, IQ3, IQ4_XS).
    None,
    /// IQ1_S: from the Q8_K block sums, a scalar fused-multiply-add chain.
    BlockSums,
    /// IQ1_M: `Σ ls·(±y)` in a second 8-lane accumulator.
    Lanes,
}

fn d_first(b: &[u8]) -> f32 {
    f16_to_f32(rd_u16(b, 0))
}

/// IQ2: `d·(0.5 + s)·0.25` with `ls = 2s + 1`.
fn db_iq2(d: f32, ls: i32) -> f32 {
    d * (0.5 + ((ls - 1) / 2) as f32) * 0.25
}

/// IQ3_XXS: `d·(0.5 + s)·0.5` with `ls = 2s + 1`.
fn db_iq3_xxs(d: f32, ls: i32) -> f32 {
    d * (0.5 + ((ls - 1) / 2) as f32) * 0.5
}

/// IQ3_S, IQ1, IQ4_XS: `d·ls`.
fn db_int(d: f32, ls: i32) -> f32 {
    d * ls as f32
}

fn layout(ty: GgmlType) -> Option<Layout> {
    let l = |bytes, decode, db, c| Layout {
        bytes,
        decode,
        d: d_first,
        db,
        c,
        delta: Delta::None,
    };
    Some(match ty {
        GgmlType::IQ2_XXS => l(66, decode_iq2_xxs, db_iq2, 0.125),
        GgmlType::IQ2_XS => l(74, decode_iq2_xs, db_iq2, 0.125),
        GgmlType::IQ2_S => l(82, decode_iq2_s, db_iq2, 0.125),
        GgmlType::IQ3_XXS => l(98, decode_iq3_xxs, db_iq3_xxs, 0.25),
        GgmlType::IQ3_S => l(110, decode_iq3_s, db_int, 1.0),
        GgmlType::IQ4_XS => l(136, decode_iq4_xs, db_int, 1.0),
        GgmlType::IQ1_S => Layout {
            delta: Delta::BlockSums,
            ..l(50, decode_iq1_s, db_int, 1.0)
        },
        GgmlType::IQ1_M => Layout {
            d: iq1_m_d,
            delta: Delta::Lanes,
            ..l(56, decode_iq1_m, db_int, 1.0)
        },
        _ => return None,
    })
}

/// Dequantises super-blocks of type `lay`.
fn dequantize_super(lay: &Layout, src: &[u8], dst: &mut [f32]) {
    let mut dec = Decoded::new();
    for (b, y) in src.chunks_exact(lay.bytes).zip(dst.chunks_exact_mut(QK_K)) {
        (lay.decode)(b, &mut dec);
        let d = (lay.d)(b);
        for (g, y) in y.chunks_exact_mut(16).enumerate() {
            let db = (lay.db)(d, dec.ls[g]);
            for (j, y) in y.iter_mut().enumerate() {
                let e = 16 * g + j;
                let q = dec.q[e] as f32;
                *y = if lay.delta != Delta::None {
                    let delta = if dec.dneg[e] { -IQ1_DELTA } else { IQ1_DELTA };
                    db * (q + delta)
                } else {
                    db * q
                };
            }
        }
    }
}

/// `q·y` as ggml's SIMD kernels compute it: `|q|` times `y` with `q`'s sign applied the way
/// `_mm256_sign_epi8` does (wrapping, so -128 stays -128).
#[inline(always)]
fn signed_product(q: i8, y: i8) -> i32 {
    let y = if q < 0 { y.wrapping_neg() } else { y };
    q.unsigned_abs() as i32 * y as i32
}

/// The 8 int32 lanes of one super-block: `Σ ls·q·y` with element `e` in lane `(e % 32) / 4`.
#[inline(always)]
fn super_lanes(dec: &Decoded, yb: &[u8], q: impl Fn(usize) -> i8) -> [i32; 8] {
    let mut s = [0i32; 8];
    for e in 0..QK_K {
        let p = signed_product(q(e), q8k_q(yb, e) as i8);
        s[(e % 32) / 4] += dec.ls[e / 16] * p;
    }
    s
}

/// Dot of `n` elements of super-block type `lay` with Q8_K activations.
fn dot_super(lay: &Layout, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut dec = Decoded::new();
    let (mut acc, mut acc2) = ([0.0f32; 8], [0.0f32; 8]);
    let mut acc1 = 0.0f32;
    for (xb, yb) in superblocks(n, w, a, lay.bytes) {
        (lay.decode)(xb, &mut dec);
        let d = (lay.d)(xb) * rd_f32(yb, 0);
        fma_lanes(&mut acc, d, &super_lanes(&dec, yb, |e| dec.q[e]));
        if lay.delta == Delta::Lanes {
            let delta = |e: usize| if dec.dneg[e] { -1 } else { 1 };
            fma_lanes(&mut acc2, d, &super_lanes(&dec, yb, delta));
        } else if lay.delta == Delta::BlockSums {
            // IQ1_S: Σ over 32-element blocks of (bsum pair)·(±1)·ls, one scalar FMA.
            let mut sumi1 = 0i32;
            for ib in 0..8 {
                let bs = q8k_bsum(yb, 2 * ib) as i32 + q8k_bsum(yb, 2 * ib + 1) as i32;
                let sign = if dec.dneg[32 * ib] { -1 } else { 1 };
                sumi1 += bs * sign * dec.ls[2 * ib];
            }
            acc1 = d.mul_add(sumi1 as f32, acc1);
        }
    }
    let main = lay.c * hsum8(&acc);
    match lay.delta {
        Delta::None => main,
        Delta::BlockSums => main + IQ1_DELTA * acc1,
        Delta::Lanes => main + IQ1_DELTA * hsum8(&acc2),
    }
}

fn dequantize_iq4_nl(src: &[u8], dst: &mut [f32]) {
    let mut v = [0i8; QK];
    for (b, y) in src.chunks_exact(IQ4_NL_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(rd_u16(b, 0));
        iq4_values(&b[2..], &mut v);
        for (y, &q) in y.iter_mut().zip(&v) {
            *y = d * q as f32;
        }
    }
}

/// IQ4_NL × Q8_0: ggml's AVX2 kernel takes blocks in pairs, even blocks into one 8-lane
/// accumulator and odd ones into another (lane `k` sums elements `4k..4k+4`), adds the two and
/// sums by halving; an odd last block is added with a scalar fused multiply-add.
fn dot_iq4_nl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK;
    let mut acc = [[0.0f32; 8]; 2];
    let mut v = [0i8; QK];
    let block = |ib: usize, v: &mut [i8; QK]| {
        let (xb, yb) = (&w[ib * IQ4_NL_BYTES..], &a[ib * Q8_0_BYTES..]);
        iq4_values(&xb[2..], v);
        let d = f16_to_f32(rd_u16(yb, 0)) * f16_to_f32(rd_u16(xb, 0));
        (d, yb)
    };
    for ib in 0..nb / 2 * 2 {
        let (d, yb) = block(ib, &mut v);
        let mut s = [0i32; 8];
        for (e, &q) in v.iter().enumerate() {
            s[e / 4] += signed_product(q, yb[2 + e] as i8);
        }
        fma_lanes(&mut acc[ib % 2], d, &s);
    }
    let mut sum = [0.0f32; 8];
    for (k, s) in sum.iter_mut().enumerate() {
        *s = acc[0][k] + acc[1][k];
    }
    let sumf = hsum8(&sum);
    if nb % 2 == 1 {
        let o = nb - 1;
        return iq4_nl_last_block(&w[o * IQ4_NL_BYTES..], &a[o * Q8_0_BYTES..], sumf);
    }
    sumf
}

/// `sumf` plus the odd last block of an IQ4_NL row (`xb`) times its Q8_0 block (`yb`): the
/// plain integer dot product, added with one fused multiply-add (ggml's scalar tail).
pub(crate) fn iq4_nl_last_block(xb: &[u8], yb: &[u8], sumf: f32) -> f32 {
    let mut v = [0i8; QK];
    iq4_values(&xb[2..18], &mut v);
    let d = f16_to_f32(rd_u16(yb, 0)) * f16_to_f32(rd_u16(xb, 0));
    let s: i32 = v
        .iter()
        .enumerate()
        .map(|(e, &q)| q as i32 * (yb[2 + e] as i8) as i32)
        .sum();
    d.mul_add(s as f32, sumf)
}

macro_rules! iq_super_fns {
    ($($ty:ident, $dq:ident, $dot:ident;)*) => {
        $(
            pub(crate) fn $dq(src: &[u8], dst: &mut [f32]) {
                dequantize_super(&layout(GgmlType::$ty).expect("IQ layout"), src, dst);
            }

            pub(crate) fn $dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
                dot_super(&layout(GgmlType::$ty).expect("IQ layout"), n, w, a)
            }
        )*
    };
}

iq_super_fns! {
    IQ1_S, dequantize_iq1_s, dot_iq1_s;
    IQ1_M, dequantize_iq1_m, dot_iq1_m;
    IQ2_XXS, dequantize_iq2_xxs, dot_iq2_xxs;
    IQ2_XS, dequantize_iq2_xs, dot_iq2_xs;
    IQ2_S, dequantize_iq2_s, dot_iq2_s;
    IQ3_XXS, dequantize_iq3_xxs, dot_iq3_xxs;
    IQ3_S, dequantize_iq3_s, dot_iq3_s;
    IQ4_XS, dequantize_iq4_xs, dot_iq4_xs;
}

/// Writes the f16 scale `d` (its bits) of one block of IQ type `ty`: at byte 0, or for IQ1_M
/// into the top nibbles of its four scale words. `false` (nothing written) for other types or a
/// block of the wrong size.
pub fn set_iq_block_scale(ty: GgmlType, block: &mut [u8], d: u16) -> bool {
    if !crate::IQ_TYPES.contains(&ty) || block.len() != ty.block_bytes() {
        return false;
    }
    if ty == GgmlType::IQ1_M {
        for k in 0..4 {
            let o = 48 + 2 * k + 1;
            block[o] = (block[o] & 0x0f) | (((d >> (4 * k)) & 0x0f) as u8) << 4;
        }
    } else {
        block[..2].copy_from_slice(&d.to_le_bytes());
    }
    true
}

/// The scalar dot kernel of an IQ type (`None` for other types): the reference whose bits the
/// AVX2 kernels (`x86/avx2/iquants.rs`, also used on AVX-512) reproduce.
pub(crate) fn dot_fns(ty: GgmlType) -> Option<crate::kernel_fns::DotFns> {
    Some(match ty {
        GgmlType::IQ1_S => scalar_kernel!("iq1_s*q8_k/scalar", dot_iq1_s),
        GgmlType::IQ1_M => scalar_kernel!("iq1_m*q8_k/scalar", dot_iq1_m),
        GgmlType::IQ2_XXS => scalar_kernel!("iq2_xxs*q8_k/scalar", dot_iq2_xxs),
        GgmlType::IQ2_XS => scalar_kernel!("iq2_xs*q8_k/scalar", dot_iq2_xs),
        GgmlType::IQ2_S => scalar_kernel!("iq2_s*q8_k/scalar", dot_iq2_s),
        GgmlType::IQ3_XXS => scalar_kernel!("iq3_xxs*q8_k/scalar", dot_iq3_xxs),
        GgmlType::IQ3_S => scalar_kernel!("iq3_s*q8_k/scalar", dot_iq3_s),
        GgmlType::IQ4_NL => scalar_kernel!("iq4_nl*q8_0/scalar", dot_iq4_nl),
        GgmlType::IQ4_XS => scalar_kernel!("iq4_xs*q8_k/scalar", dot_iq4_xs),
        _ => return None,
    })
}

/// The scalar dequantiser of an IQ type (`None` for other types).
pub(crate) fn dequantize_fn(ty: GgmlType) -> Option<crate::kernel_fns::DequantFn> {
    Some(match ty {
        GgmlType::IQ1_S => dequantize_iq1_s,
        GgmlType::IQ1_M => dequantize_iq1_m,
        GgmlType::IQ2_XXS => dequantize_iq2_xxs,
        GgmlType::IQ2_XS => dequantize_iq2_xs,
        GgmlType::IQ2_S => dequantize_iq2_s,
        GgmlType::IQ3_XXS => dequantize_iq3_xxs,
        GgmlType::IQ3_S => dequantize_iq3_s,
        GgmlType::IQ4_NL => dequantize_iq4_nl,
        GgmlType::IQ4_XS => dequantize_iq4_xs,
        _ => return None,
    })
}
