//! K-quant products in the order of llama.cpp's tiled CPU matmul, and the choice of order for
//! each token of a batch ([`DotKernel::dot_tokens`]).
//!
//! Recent llama.cpp multiplies K-quant weights (Q2_K … Q6_K) that are not repacked with a tiled
//! kernel whenever a matmul has at least 8 tokens (for expert matmuls: 8 tokens routed to the
//! expert). Per 256-element super-block it forms two exact integers, `s1 = Σ_s sc_s · Σ q·a`
//! over the sub-blocks (signed quant values, signed or unsigned scales as the format has them)
//! and, for formats with mins, `s2 = Σ_s m_s · Σ a`, then
//!
//! ```text
//! r   = f32(s1) · d_w              (one rounding)
//! r   = fma(−dmin_w, f32(s2), r)   (formats with mins)
//! acc = fma(r, d_a, acc)           (super-blocks in order, acc starting at 0)
//! ```
//!
//! where `d_a` is the activation block's Q8_K scale. Fewer tokens go through `vec_dot`
//! ([`DotKernel::dot`]).

use crate::scalar::kquants::{
    k4_scales_mins, q2k_q, q3k_q, q3k_scales, q4k_q, q5k_q, q6k_q, q8k_bsum, Q2_K_BYTES,
    Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BYTES, Q8_K_QS, QK_K,
};
use crate::scalar::shared::{f16_to_f32, rd_f32, rd_u16};
use crate::{DotKernel, GgmlType, Isa};

/// Tokens from which llama.cpp switches K-quant matmuls to its tiled kernel.
pub const TILED_MIN_TOKENS: usize = 8;

/// Which ggml operation a batched product belongs to (their kernels differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchKind {
    /// A dense `mul_mat` (attention and FFN projections, the output head).
    Dense,
    /// An expert matmul (`mul_mat_id`); the token count is the number routed to the expert.
    Expert,
}

impl DotKernel {
    /// Dots one weight row with each of `out.len()` activation rows stored back to back in
    /// `acts`, in the order llama.cpp's CPU backend uses for a `kind` matmul of that many
    /// tokens: the tiled order for K-quants from [`TILED_MIN_TOKENS`] tokens on, the GEMM
    /// order of repacked Q4_K for a dense matmul's complete groups of four tokens, and
    /// [`DotKernel::dot`] otherwise. Same length contract as [`DotKernel::dot`] per row.
    pub fn dot_tokens(
        &self,
        kind: BatchKind,
        n: usize,
        weight_row: &[u8],
        acts: &[u8],
        out: &mut [f32],
    ) {
        let n_tokens = out.len();
        let ab = self.act_row_bytes(n);
        if self.is_repacked() {
            let grouped = match kind {
                BatchKind::Dense => n_tokens - n_tokens % 4,
                BatchKind::Expert => 0,
            };
            for (t, o) in out.iter_mut().enumerate() {
                let a = &acts[t * ab..(t + 1) * ab];
                *o = if t < grouped {
                    self.dot_repacked_grouped(n, weight_row, a)
                } else {
                    self.dot(n, weight_row, a)
                };
            }
            return;
        }
        match SuperBlockFormat::of(self.weight_type()) {
            Some(format) if n_tokens >= TILED_MIN_TOKENS => {
                let wb = self.weight_row_bytes(n);
                tiled_row(
                    format,
                    self.isa(),
                    &weight_row[..wb],
                    &acts[..n_tokens * ab],
                    out,
                );
            }
            _ => {
                for (t, o) in out.iter_mut().enumerate() {
                    *o = self.dot(n, weight_row, &acts[t * ab..(t + 1) * ab]);
                }
            }
        }
    }
}

/// The K-quant formats and how their super-blocks decode for the tiled kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SuperBlockFormat {
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl SuperBlockFormat {
    pub(crate) fn of(ty: GgmlType) -> Option<SuperBlockFormat> {
        match ty {
            GgmlType::Q2_K => Some(SuperBlockFormat::Q2K),
            GgmlType::Q3_K => Some(SuperBlockFormat::Q3K),
            GgmlType::Q4_K => Some(SuperBlockFormat::Q4K),
            GgmlType::Q5_K => Some(SuperBlockFormat::Q5K),
            GgmlType::Q6_K => Some(SuperBlockFormat::Q6K),
            _ => None,
        }
    }

    pub(crate) fn bytes(self) -> usize {
        match self {
            SuperBlockFormat::Q2K => Q2_K_BYTES,
            SuperBlockFormat::Q3K => Q3_K_BYTES,
            SuperBlockFormat::Q4K => Q4_K_BYTES,
            SuperBlockFormat::Q5K => Q5_K_BYTES,
            SuperBlockFormat::Q6K => Q6_K_BYTES,
        }
    }
}

/// One weight super-block decoded for the integer products: unsigned quant codes (value +
/// `bias`), the scale and min of each 16-element group, and the two float scales.
pub(crate) struct Decoded {
    /// Quant codes of the 256 elements, `value + bias` (0..64).
    pub codes: [u8; QK_K],
    /// Offset of the codes: 32 for Q6_K, 4 for Q3_K, 0 otherwise.
    pub bias: i32,
    /// Scale of each 16-element group (a 32-element sub-block's scale appears twice).
    pub sc: [i16; 16],
    /// Min of each 16-element group (0 for formats without mins).
    pub m: [i16; 16],
    /// `d` of the super-block.
    pub d: f32,
    /// `dmin` of the super-block (formats with mins).
    pub dmin: f32,
    /// Whether the format has mins.
    pub has_min: bool,
}

impl Decoded {
    /// The super-block `b` of `format` decoded.
    pub(crate) fn new(format: SuperBlockFormat, b: &[u8]) -> Decoded {
        let mut out = Decoded::scales(format, b);
        let code: fn(&[u8], usize) -> u8 = match format {
            SuperBlockFormat::Q2K => q2k_q,
            SuperBlockFormat::Q3K => |b, e| (q3k_q(b, e) + 4) as u8,
            SuperBlockFormat::Q4K => q4k_q,
            SuperBlockFormat::Q5K => q5k_q,
            SuperBlockFormat::Q6K => q6k_q,
        };
        for (e, q) in out.codes.iter_mut().enumerate() {
            *q = code(b, e);
        }
        out
    }

    /// Everything of the super-block `b` of `format` but its codes (left zero).
    pub(crate) fn scales(format: SuperBlockFormat, b: &[u8]) -> Decoded {
        let mut out = Decoded {
            codes: [0; QK_K],
            bias: 0,
            sc: [0; 16],
            m: [0; 16],
            d: 0.0,
            dmin: 0.0,
            has_min: false,
        };
        match format {
            SuperBlockFormat::Q2K => {
                for ((s, m), &b) in out.sc.iter_mut().zip(&mut out.m).zip(&b[..16]) {
                    (*s, *m) = ((b & 0x0f) as i16, (b >> 4) as i16);
                }
                out.d = f16_to_f32(rd_u16(b, 40));
                out.dmin = f16_to_f32(rd_u16(b, 41));
                out.has_min = true;
            }
            SuperBlockFormat::Q3K => {
                out.bias = 4;
                for (s, &v) in out.sc.iter_mut().zip(&q3k_scales(b)) {
                    *s = v as i16;
                }
                out.d = f16_to_f32(rd_u16(b, 54));
            }
            SuperBlockFormat::Q4K | SuperBlockFormat::Q5K => {
                let (sc, mn) = k4_scales_mins(b);
                for g in 0..16 {
                    out.sc[g] = sc[g / 2] as i16;
                    out.m[g] = mn[g / 2] as i16;
                }
                out.d = f16_to_f32(rd_u16(b, 0));
                out.dmin = f16_to_f32(rd_u16(b, 1));
                out.has_min = true;
            }
            SuperBlockFormat::Q6K => {
                out.bias = 32;
                for (s, &b) in out.sc.iter_mut().zip(&b[192..208]) {
                    *s = b as i8 as i16;
                }
                out.d = f16_to_f32(rd_u16(b, 104));
            }
        }
        out
    }

    /// `(s1, s2)` of this super-block with one Q8_K activation block (scalar reference):
    /// `s1 = Σ_g sc_g · (Σ code·a − bias · bsum_g)`, `s2 = Σ_g m_g · bsum_g`.
    pub(crate) fn sums(&self, a: &[u8]) -> (i32, i32) {
        let (mut s1, mut s2) = (0i32, 0i32);
        for g in 0..16 {
            let bsum = q8k_bsum(a, g) as i32;
            let group: i32 = (0..16)
                .map(|i| self.codes[16 * g + i] as i32 * a[Q8_K_QS + 16 * g + i] as i8 as i32)
                .sum();
            s1 += self.sc[g] as i32 * (group - self.bias * bsum);
            s2 += self.m[g] as i32 * bsum;
        }
        (s1, s2)
    }

    /// Folds one super-block's sums into the output, as the tiled kernel does.
    #[inline(always)]
    pub(crate) fn accumulate(&self, s1: i32, s2: i32, d_a: f32, acc: f32) -> f32 {
        let mut r = s1 as f32 * self.d;
        if self.has_min {
            r = (-self.dmin).mul_add(s2 as f32, r);
        }
        r.mul_add(d_a, acc)
    }
}

/// One weight row against `out.len()` activation rows in the tiled order.
fn tiled_row(format: SuperBlockFormat, isa: Isa, w: &[u8], acts: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        // SAFETY: the kernel's ISA was checked when it was made (AVX2 is part of both).
        return unsafe { avx2::tiled_row(format, w, acts, out) };
    }
    let _ = isa;
    tiled_row_scalar(format, w, acts, out);
}

/// [`tiled_row`]'s scalar reference.
pub(crate) fn tiled_row_scalar(format: SuperBlockFormat, w: &[u8], acts: &[u8], out: &mut [f32]) {
    out.fill(0.0);
    let row_bytes = w.len() / format.bytes() * Q8_K_BYTES;
    for (b, wb) in w.chunks_exact(format.bytes()).enumerate() {
        let dec = Decoded::new(format, wb);
        for (t, o) in out.iter_mut().enumerate() {
            let a = &acts[t * row_bytes + b * Q8_K_BYTES..][..Q8_K_BYTES];
            let (s1, s2) = dec.sums(a);
            *o = dec.accumulate(s1, s2, rd_f32(a, 0), *o);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Decoded, SuperBlockFormat};
    use crate::scalar::kquants::{Q8_K_BSUMS, Q8_K_BYTES, Q8_K_QS};
    use crate::scalar::shared::rd_f32;

    /// Sum of the eight i32 lanes.
    #[inline(always)]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; `w` holds whole super-blocks of `format` and `acts` holds
    /// `out.len()` Q8_K rows of as many blocks.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tiled_row(
        format: SuperBlockFormat,
        w: &[u8],
        acts: &[u8],
        out: &mut [f32],
    ) {
        out.fill(0.0);
        let n_sb = w.len() / format.bytes();
        let row_bytes = n_sb * Q8_K_BYTES;
        assert!(acts.len() >= out.len() * row_bytes, "activation rows");
        for (b, wb) in w.chunks_exact(format.bytes()).enumerate() {
            let dec = Decoded::new(format, wb);
            // Group scales as i16 pairs for `vpmaddwd`: chunk c covers groups 2c and 2c+1.
            let scv: [__m256i; 8] = std::array::from_fn(|c| {
                let (lo, hi) = (
                    _mm_set1_epi16(dec.sc[2 * c]),
                    _mm_set1_epi16(dec.sc[2 * c + 1]),
                );
                _mm256_set_m128i(hi, lo)
            });
            let sc16 = _mm256_loadu_si256(dec.sc.as_ptr() as *const __m256i);
            let m16 = _mm256_loadu_si256(dec.m.as_ptr() as *const __m256i);
            let codes = dec.codes.as_ptr();
            for (t, o) in out.iter_mut().enumerate() {
                let a = acts.as_ptr().add(t * row_bytes + b * Q8_K_BYTES);
                // SAFETY: the block is in bounds (asserted above); unaligned loads.
                let mut acc = _mm256_setzero_si256();
                for (c, sv) in scv.iter().enumerate() {
                    let q = _mm256_loadu_si256(codes.add(32 * c) as *const __m256i);
                    let y = _mm256_loadu_si256(a.add(Q8_K_QS + 32 * c) as *const __m256i);
                    // code ≤ 63, so pair sums ≤ 2·63·128 fit i16.
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), *sv));
                }
                let bsums = _mm256_loadu_si256(a.add(Q8_K_BSUMS) as *const __m256i);
                let corr = hsum_i32(_mm256_madd_epi16(bsums, sc16));
                let s1 = hsum_i32(acc) - dec.bias * corr;
                let s2 = if dec.has_min {
                    hsum_i32(_mm256_madd_epi16(bsums, m16))
                } else {
                    0
                };
                let d_a = rd_f32(std::slice::from_raw_parts(a, 4), 0);
                *o = dec.accumulate(s1, s2, d_a, *o);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    /// Random K-quant rows with small finite scales.
    pub(crate) fn weights(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
        let format = SuperBlockFormat::of(ty).unwrap();
        let mut w = bytes(ty.row_bytes(n as u64).unwrap() as usize, seed);
        let half = |x: f32| half::f16::from_f32(x).to_bits();
        for (i, b) in w.chunks_exact_mut(format.bytes()).enumerate() {
            let (d, dmin) = (half(0.002 + 0.0005 * (i % 5) as f32), half(0.001));
            let (at_d, at_dmin) = match format {
                SuperBlockFormat::Q2K => (80, Some(82)),
                SuperBlockFormat::Q3K => (108, None),
                SuperBlockFormat::Q4K | SuperBlockFormat::Q5K => (0, Some(2)),
                SuperBlockFormat::Q6K => (208, None),
            };
            b[at_d..at_d + 2].copy_from_slice(&d.to_le_bytes());
            if let Some(o) = at_dmin {
                b[o..o + 2].copy_from_slice(&dmin.to_le_bytes());
            }
        }
        w
    }

    pub(crate) fn acts(n: usize, tokens: usize, seed: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for t in 0..tokens {
            let x: Vec<f32> = bytes(n, seed + t as u64)
                .iter()
                .map(|&b| (b as f32 - 127.5) / 40.0)
                .collect();
            let mut a = vec![0u8; GgmlType::Q8_K.row_bytes(n as u64).unwrap() as usize];
            crate::quantize_row(GgmlType::Q8_K, &x, &mut a).unwrap();
            out.extend(a);
        }
        out
    }

    pub(crate) const TYPES: [GgmlType; 5] = [
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    #[test]
    fn tiled_sums_equal_the_dequantized_products() {
        let n = 512;
        for ty in TYPES {
            let w = weights(ty, n, 3);
            let a = acts(n, 1, 9);
            let mut out = [0f32];
            tiled_row_scalar(SuperBlockFormat::of(ty).unwrap(), &w, &a, &mut out);
            let (mut wf, mut af) = (vec![0f32; n], vec![0f32; n]);
            crate::dequantize_row(ty, &w, &mut wf).unwrap();
            crate::dequantize_row(GgmlType::Q8_K, &a, &mut af).unwrap();
            let exact: f64 = wf.iter().zip(&af).map(|(x, y)| *x as f64 * *y as f64).sum();
            let mag: f64 = wf
                .iter()
                .zip(&af)
                .map(|(x, y)| (*x as f64 * *y as f64).abs())
                .sum();
            assert!(
                (out[0] as f64 - exact).abs() <= 1e-5 * mag,
                "{ty:?}: {} vs {exact}",
                out[0]
            );
            // vec_dot sums the same products in another order.
            let k = DotKernel::best(ty).unwrap();
            assert!((k.dot(n, &w, &a) - out[0]).abs() <= 1e-5 * mag as f32);
        }
    }

    #[test]
    fn every_isa_matches_the_scalar_tiled_order() {
        let n = 768;
        for ty in TYPES {
            let format = SuperBlockFormat::of(ty).unwrap();
            let w = weights(ty, n, 5);
            let a = acts(n, 9, 17);
            let mut want = [0f32; 9];
            tiled_row_scalar(format, &w, &a, &mut want);
            for isa in Isa::available() {
                let k = DotKernel::new(ty, isa).unwrap();
                let mut got = [0f32; 9];
                k.dot_tokens(BatchKind::Dense, n, &w, &a, &mut got);
                assert_eq!(
                    got.map(f32::to_bits),
                    want.map(f32::to_bits),
                    "{ty:?} {isa}"
                );
                k.dot_tokens(BatchKind::Expert, n, &w, &a, &mut got);
                assert_eq!(
                    got.map(f32::to_bits),
                    want.map(f32::to_bits),
                    "{ty:?} {isa}"
                );
            }
        }
    }

    #[test]
    fn small_batches_use_vec_dot() {
        let n = 256;
        for ty in TYPES {
            let w = weights(ty, n, 7);
            let a = acts(n, TILED_MIN_TOKENS - 1, 1);
            let k = DotKernel::best(ty).unwrap();
            let mut got = [0f32; TILED_MIN_TOKENS - 1];
            k.dot_tokens(BatchKind::Dense, n, &w, &a, &mut got);
            let ab = k.act_row_bytes(n);
            for (t, &g) in got.iter().enumerate() {
                assert_eq!(
                    g.to_bits(),
                    k.dot(n, &w, &a[t * ab..(t + 1) * ab]).to_bits()
                );
            }
        }
    }

    #[test]
    fn super_block_order_by_hand() {
        // Q6_K, 2 super-blocks: every code 33 (value +1), scales 1, d = 0.5 then 0.25;
        // activations all 1, quantized to q = -127 with d_a = -1/127 → s1 = -127·256.
        let mut w = vec![0u8; 2 * Q6_K_BYTES];
        for (i, b) in w.chunks_exact_mut(Q6_K_BYTES).enumerate() {
            b[..128].fill(0x11); // low nibbles 1
            b[128..192].fill(0xaa); // high bits 2 → code 1 | 2 << 4 = 33
            b[192..208].fill(1);
            let d = half::f16::from_f32(0.5 / (i + 1) as f32).to_bits();
            b[208..210].copy_from_slice(&d.to_le_bytes());
        }
        let x = vec![1f32; 512];
        let mut one = vec![0u8; 2 * Q8_K_BYTES];
        crate::quantize_row(GgmlType::Q8_K, &x, &mut one).unwrap();
        let a: Vec<u8> = (0..8).flat_map(|_| one.clone()).collect();
        let mut out = [0f32; 8];
        DotKernel::best(GgmlType::Q6_K).unwrap().dot_tokens(
            BatchKind::Dense,
            512,
            &w,
            &a,
            &mut out,
        );
        let d_a = rd_f32(&one, 0);
        let s1 = -127f32 * 256.0;
        let want = (s1 * 0.25).mul_add(d_a, (s1 * 0.5) * d_a);
        assert_eq!(out, [want; 8]);
        assert!((out[0] - 192.0).abs() < 0.01);
    }
}
