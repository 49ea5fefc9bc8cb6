//! Single-precision `e^x`, bit-identical to glibc's `expf` on x86-64 CPUs with FMA (the
//! `__expf_fma` build that glibc's ifunc picks there and that Rust's `f32::exp` calls), in a
//! scalar form ([`expf`]) and a vectorised in-place form ([`expf_slice`]).
//!
//! # Algorithm
//! The ARM optimized-routines `expf` that glibc ships (`sysdeps/ieee754/flt-32/e_expf.c`), as
//! GCC compiles it with FMA contraction (checked against the disassembly of glibc 2.36):
//! with `xd = x as f64`, `N = 32`,
//! * `kds = fma(N/ln2, xd, 0x1.8p52)`: `k = round(x·N/ln2)` sits in the low mantissa bits;
//!   `kd = kds − 0x1.8p52` is `k` as a double;
//! * `r = fma(N/ln2, xd, −kd)`, so `x·N/ln2 = k + r` with `|r| ≤ 1/2` (the product `N/ln2·xd`
//!   is never rounded on its own);
//! * `s = 2^(k/N)` as the bits `T[k mod 32] + (bits(kds) << 47)` (wrapping 64-bit add);
//! * `y = fma(fma(C0, r, C1), r·r, fma(C2, r, 1))`, result `(y·s) as f32`.
//!
//! Special inputs (`|x| ≥ 88` or NaN): `−∞ → +0`, NaN and `+∞ → x + x`,
//! `x > 0x1.62e42ep6 → +∞`, `x < −0x1.9fe368p6 → +0`, `x < −0x1.9d1d9ep6 → 2^−149` (the
//! smallest subnormal; glibc reports the possible underflow this way), every other input takes
//! the main path. `errno` is never set here (glibc sets `ERANGE` on overflow and underflow).
//!
//! On CPUs without FMA glibc runs a non-FMA build of the same source, whose results differ
//! from these in rare last-bit cases; [`expf`] always computes the FMA variant, so its results
//! do not depend on the machine.
//!
//! # Vector paths
//! [`expf_slice`] converts eight floats to doubles at a time (one zmm on AVX-512F, two ymm on
//! AVX2+FMA), runs the same operations lane by lane (FMA where the scalar code has
//! `mul_add`), looks the table up with two `vpermt2q` and a blend (AVX-512) or a gather (AVX2),
//! and converts back with round-to-nearest. A vector with any lane `|x| ≥ 88` or NaN also
//! computes the special cases above with compares and blends. Every path is bit-identical to
//! [`expf`] for every input.
//!
//! # ggml's exponential
//! [`expf_ggml`] is the other `e^x`: ggml's vectorised polynomial after range reduction
//! (≤ 1.5 ulp from the true value), which softmax in ggml's attention and SiLU use;
//! [`expf_ggml_slice`] computes it sixteen (AVX-512) or eight (AVX2) at a time, with the bits
//! of the scalar function.

use crate::error::check_isa;
use crate::{Isa, QuantError};

/// `2^(i/32)` as f64 bits, minus `i << 47` so that adding `k << 47` for `k ≡ i (mod 32)`
/// gives `2^(k/32)` (glibc's `__exp2f_data.tab`).
const TAB: [u64; 32] = [
    0x3ff0_0000_0000_0000,
    0x3fef_d9b0_d315_8574,
    0x3fef_b558_6cf9_890f,
    0x3fef_9301_d012_5b51,
    0x3fef_72b8_3c7d_517b,
    0x3fef_5487_3168_b9aa,
    0x3fef_387a_6e75_6238,
    0x3fef_1e9d_f51f_dee1,
    0x3fef_06fe_0a31_b715,
    0x3fee_f1a7_373a_a9cb,
    0x3fee_dea6_4c12_3422,
    0x3fee_ce08_6061_892d,
    0x3fee_bfda_d536_2a27,
    0x3fee_b42b_569d_4f82,
    0x3fee_ab07_dd48_5429,
    0x3fee_a47e_b03a_5585,
    0x3fee_a09e_667f_3bcd,
    0x3fee_9f75_e8ec_5f74,
    0x3fee_a114_73eb_0187,
    0x3fee_a589_994c_ce13,
    0x3fee_ace5_422a_a0db,
    0x3fee_b737_b0cd_c5e5,
    0x3fee_c491_82a3_f090,
    0x3fee_d503_b23e_255d,
    0x3fee_e89f_995a_d3ad,
    0x3fee_ff76_f2fb_5e47,
    0x3fef_199b_dd85_529c,
    0x3fef_3720_dcef_9069,
    0x3fef_5818_dcfb_a487,
    0x3fef_7c97_337b_9b5f,
    0x3fef_a4af_a2a4_90da,
    0x3fef_d076_5b6e_4540,
];

/// `32 / ln 2` (`invln2_scaled`, `0x1.71547652b82fep0 · 32`).
const INV_LN2_N: f64 = f64::from_bits(0x4047_1547_652b_82fe);
/// `0x1.8p52`: adding it rounds a double of magnitude below 2^51 to an integer in the low bits.
const SHIFT: f64 = f64::from_bits(0x4338_0000_0000_0000);
/// Cubic coefficient of `2^(r/32)` (`poly_scaled[0]`, `0x1.c6af84b912394p-5 / 32^3`).
const C0: f64 = f64::from_bits(0x3ebc_6af8_4b91_2394);
/// Quadratic coefficient (`poly_scaled[1]`, `0x1.ebfce50fac4f3p-3 / 32^2`).
const C1: f64 = f64::from_bits(0x3f2e_bfce_50fa_c4f3);
/// Linear coefficient (`poly_scaled[2]`, `0x1.62e42ff0c52d6p-1 / 32`).
const C2: f64 = f64::from_bits(0x3f96_2e42_ff0c_52d6);

/// `|x|` bits from which the special-case checks run (`88.0`, low 20 bits cleared).
const SPECIAL_ABS: u32 = 0x42b0_0000;
/// `|x|` bits of infinity; above are NaNs.
const INF_ABS: u32 = 0x7f80_0000;
/// Above this `e^x` overflows to infinity (`0x1.62e42ep6 ≈ 88.72`).
const OFLOW: f32 = f32::from_bits(0x42b1_7217);
/// Below this `e^x` underflows to +0 (`−0x1.9fe368p6 ≈ −103.97`).
const UFLOW: f32 = f32::from_bits(0xc2cf_f1b4);
/// Below this (and not below [`UFLOW`]) the result is the smallest subnormal
/// (`−0x1.9d1d9ep6 ≈ −103.28`).
const MAY_UFLOW: f32 = f32::from_bits(0xc2ce_8ecf);
/// The smallest positive subnormal, `2^−149`.
const MIN_SUBNORMAL: f32 = f32::from_bits(1);

/// `e^x` rounded to f32, bit-identical to glibc's `expf` on x86-64 with FMA (what
/// `f32::exp` returns there), on any target.
///
/// Portable: without the `fma` target feature `f64::mul_add` is a call to the C library's
/// `fma`, so prefer [`expf_slice`] for throughput.
#[inline]
pub fn expf(x: f32) -> f32 {
    expf_inline(x)
}

/// [`expf`] for inlining into the `#[target_feature]` kernels, where `mul_add` becomes one
/// FMA instruction.
#[inline(always)]
fn expf_inline(x: f32) -> f32 {
    let bits = x.to_bits();
    let abs = bits & 0x7fff_ffff;
    if abs >= SPECIAL_ABS {
        if bits == f32::NEG_INFINITY.to_bits() {
            return 0.0;
        }
        if abs >= INF_ABS {
            return x + x;
        }
        if x > OFLOW {
            return f32::INFINITY;
        }
        if x < UFLOW {
            return 0.0;
        }
        if x < MAY_UFLOW {
            return MIN_SUBNORMAL;
        }
    }
    let xd = f64::from(x);
    let kds = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kds.to_bits();
    let kd = kds - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(TAB[(ki % 32) as usize].wrapping_add(ki << 47));
    let z = C0.mul_add(r, C1);
    let r2 = r * r;
    let y = C2.mul_add(r, 1.0);
    let y = z.mul_add(r2, y);
    (y * s) as f32
}

/// Replaces every element of `xs` by [`expf`] of it, on [`Isa::best`]: AVX-512F, else
/// AVX2+FMA, else scalar. Bit-identical to [`expf`] (and so to glibc's `expf`) on every path;
/// fastest when no element has `|x| ≥ 88` or is NaN (softmax arguments `x − max`).
pub fn expf_slice(xs: &mut [f32]) {
    run(Isa::best(), xs);
}

/// [`expf_slice`] on a chosen ISA (all give identical results); errors if this CPU lacks it.
pub fn expf_slice_with(isa: Isa, xs: &mut [f32]) -> Result<(), QuantError> {
    check_isa(isa)?;
    run(isa, xs);
    Ok(())
}

/// Dispatch for an ISA already known to be available.
fn run(isa: Isa, xs: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers pass only ISAs this CPU has (`Isa::best` or `check_isa`), and
        // `Isa::Avx512` implies AVX-512F, AVX2 and FMA.
        Isa::Avx512 => unsafe { x86::expf_slice_avx512(xs) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; `Isa::Avx2` implies AVX2 and FMA.
        Isa::Avx2 => unsafe { x86::expf_slice_avx2(xs) },
        _ => xs.iter_mut().for_each(|x| *x = expf(*x)),
    }
}

/// The AVX2 and AVX-512 kernels. Helpers are `#[inline(always)]` and only called from the two
/// `#[target_feature]` entry points, into which they are inlined.
///
/// Safety: every `unsafe fn` here needs AVX2 and FMA (and AVX-512F for the `avx512` ones).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use super::*;

    /// Bit mask of the lanes of `x` that need the special cases (`|x| ≥ 88` or NaN).
    #[inline(always)]
    unsafe fn special_lanes(x: __m256) -> i32 {
        let abs = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fff_ffff));
        let big = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(SPECIAL_ABS as i32 - 1));
        _mm256_movemask_ps(_mm256_castsi256_ps(big))
    }

    /// `y` with the lanes whose `x` is special replaced as [`expf`] does; other lanes (also
    /// those with `88 ≤ |x|` that take the main path) keep their main-path value.
    #[inline(always)]
    unsafe fn fix_special(x: __m256, y: __m256) -> __m256 {
        let below_uflow = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(UFLOW));
        let below_may = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(MAY_UFLOW));
        let over = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(OFLOW));
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        let y = _mm256_blendv_ps(y, _mm256_set1_ps(MIN_SUBNORMAL), below_may);
        let y = _mm256_andnot_ps(below_uflow, y);
        let y = _mm256_blendv_ps(y, _mm256_set1_ps(f32::INFINITY), over);
        _mm256_blendv_ps(y, _mm256_add_ps(x, x), nan)
    }

    /// `e^x` of four doubles converted from f32, before the final rounding (AVX2+FMA; the
    /// table lookup is a gather).
    #[inline(always)]
    unsafe fn exp4_pd(xd: __m256d) -> __m256d {
        let inv = _mm256_set1_pd(INV_LN2_N);
        let shift = _mm256_set1_pd(SHIFT);
        let kds = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(kds);
        let kd = _mm256_sub_pd(kds, shift);
        let r = _mm256_fmsub_pd(inv, xd, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // In bounds: `idx` is masked to 0..32, the length of `TAB`.
        let t = _mm256_i64gather_epi64::<8>(TAB.as_ptr().cast::<i64>(), idx);
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(_mm256_set1_pd(C0), r, _mm256_set1_pd(C1));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(_mm256_set1_pd(C2), r, _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, r2, y);
        _mm256_mul_pd(y, s)
    }

    /// Eight lanes of [`expf`] at a time.
    trait Exp8: Copy {
        /// [`expf`] of each lane of `x`.
        unsafe fn exp8(self, x: __m256) -> __m256;
    }

    /// The AVX2+FMA kernel.
    #[derive(Clone, Copy)]
    struct Avx2;

    impl Exp8 for Avx2 {
        #[inline(always)]
        unsafe fn exp8(self, x: __m256) -> __m256 {
            let lo = _mm256_cvtpd_ps(exp4_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
            let hi = _mm256_cvtpd_ps(exp4_pd(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x))));
            let y = _mm256_set_m128(hi, lo);
            if special_lanes(x) != 0 {
                fix_special(x, y)
            } else {
                y
            }
        }
    }

    /// The AVX-512F kernel, holding the table as four zmm of eight entries.
    #[derive(Clone, Copy)]
    struct Tab512([__m512i; 4]);

    impl Tab512 {
        #[inline(always)]
        unsafe fn load() -> Tab512 {
            let p = TAB.as_ptr();
            Tab512([
                _mm512_loadu_si512(p.cast()),
                _mm512_loadu_si512(p.add(8).cast()),
                _mm512_loadu_si512(p.add(16).cast()),
                _mm512_loadu_si512(p.add(24).cast()),
            ])
        }

        /// `TAB[ki mod 32]` per lane: bits 0..4 of `ki` index two 16-entry permutes, bit 4
        /// picks between them.
        #[inline(always)]
        unsafe fn lookup(self, ki: __m512i) -> __m512i {
            let [t0, t1, t2, t3] = self.0;
            let lo = _mm512_permutex2var_epi64(t0, ki, t1);
            let hi = _mm512_permutex2var_epi64(t2, ki, t3);
            let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
            _mm512_mask_blend_epi64(upper, lo, hi)
        }
    }

    impl Exp8 for Tab512 {
        /// Computed in one zmm of doubles (AVX-512F).
        #[inline(always)]
        unsafe fn exp8(self, x: __m256) -> __m256 {
            let xd = _mm512_cvtps_pd(x);
            let inv = _mm512_set1_pd(INV_LN2_N);
            let shift = _mm512_set1_pd(SHIFT);
            let kds = _mm512_fmadd_pd(inv, xd, shift);
            let ki = _mm512_castpd_si512(kds);
            let kd = _mm512_sub_pd(kds, shift);
            let r = _mm512_fmsub_pd(inv, xd, kd);
            let t = self.lookup(ki);
            let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
            let z = _mm512_fmadd_pd(_mm512_set1_pd(C0), r, _mm512_set1_pd(C1));
            let r2 = _mm512_mul_pd(r, r);
            let y = _mm512_fmadd_pd(_mm512_set1_pd(C2), r, _mm512_set1_pd(1.0));
            let y = _mm512_fmadd_pd(z, r2, y);
            let y = _mm512_cvtpd_ps(_mm512_mul_pd(y, s));
            if special_lanes(x) != 0 {
                fix_special(x, y)
            } else {
                y
            }
        }
    }

    /// Applies `exp8` to every run of eight elements of `xs`, and to the last partial run
    /// through a zero-padded copy.
    #[inline(always)]
    unsafe fn for_each8<K: Exp8>(xs: &mut [f32], k: K) {
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            let p = c.as_mut_ptr();
            _mm256_storeu_ps(p, k.exp8(_mm256_loadu_ps(p)));
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let mut buf = [0.0f32; 8];
            buf[..rest.len()].copy_from_slice(rest);
            let p = buf.as_mut_ptr();
            _mm256_storeu_ps(p, k.exp8(_mm256_loadu_ps(p)));
            rest.copy_from_slice(&buf[..rest.len()]);
        }
    }

    /// [`expf_slice`] on AVX2+FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn expf_slice_avx2(xs: &mut [f32]) {
        for_each8(xs, Avx2);
    }

    /// [`expf_slice`] on AVX-512F.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn expf_slice_avx512(xs: &mut [f32]) {
        for_each8(xs, Tab512::load());
    }
}

/// e^x as ggml's vectorised exponential computes it (a polynomial after range reduction,
/// ≤ 1.5 ulp from the true value; softmax in ggml's attention uses it).
#[inline]
pub fn expf_ggml(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 1.5 · 2^23: rounds to an integer when added
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // x · log2(e) + r
    let n = z - r;
    let b = (-n).mul_add(f32::from_bits(0x3f31_7200), x); // x − n·ln2_hi
    let b = (-n).mul_add(f32::from_bits(0x35bf_be8e), b); // … − n·ln2_lo
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let p45 = f32::from_bits(0x3c07_2010).mul_add(b, f32::from_bits(0x3d2b_9f17));
    let p23 = f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb));
    let p01 = f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0);
    let j = p45.mul_add(u, p23).mul_add(u, p01);
    // `j · 2^n` without intermediate overflow (as `vscalefps`): |n| ≤ 192, so at most one
    // multiply by 2^127 or 2^-126 comes first.
    let mut j = j;
    let mut n = n as i32;
    if n > 127 {
        j *= f32::from_bits(0x7f00_0000);
        n -= 127;
    } else if n < -126 {
        j *= f32::from_bits(0x0080_0000);
        n += 126;
    }
    j * f32::from_bits(((n + 127) as u32) << 23)
}

/// [`expf_ggml`] of every element of `xs`, in place (the same bits on every ISA).
pub fn expf_ggml_slice(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::best() == crate::Isa::Avx512 {
        // SAFETY: `Isa::Avx512` means AVX-512 F and FMA are present.
        unsafe { ggml_avx512::expf_ggml_slice(xs) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::best() == crate::Isa::Avx2 {
        // SAFETY: `Isa::Avx2` means AVX2 and FMA are present.
        unsafe { ggml_avx2::expf_ggml_slice(xs) };
        return;
    }
    xs.iter_mut().for_each(|x| *x = expf_ggml(*x));
}

/// The AVX-512 [`expf_ggml_slice`] (sixteen lanes, the same operations as the scalar code).
#[cfg(target_arch = "x86_64")]
mod ggml_avx512 {
    use core::arch::x86_64::*;

    /// Mask of the first `m` (≤ 16) lanes.
    #[inline(always)]
    fn first_lanes(m: usize) -> __mmask16 {
        if m >= 16 {
            0xffff
        } else {
            (1u16 << m) - 1
        }
    }

    /// [`super::expf_ggml`] of sixteen lanes: the same operations lane by lane, the special
    /// cases selected by masks.
    #[inline(always)]
    unsafe fn expf_ggml16(x: __m512) -> __m512 {
        let c = |bits: u32| _mm512_set1_ps(f32::from_bits(bits));
        let r = c(0x4b40_0000);
        let z = _mm512_fmadd_ps(x, c(0x3fb8_aa3b), r);
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(n, c(0x3f31_7200), x);
        let b = _mm512_fnmadd_ps(n, c(0x35bf_be8e), b);
        let u = _mm512_mul_ps(b, b);
        let p45 = _mm512_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17));
        let p23 = _mm512_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb));
        let p01 = _mm512_fmadd_ps(c(0x3f7f_fff6), b, _mm512_set1_ps(1.0));
        let j = _mm512_fmadd_ps(_mm512_fmadd_ps(p45, u, p23), u, p01);
        // |n| ≤ 192 here (the others are replaced below): at most one pre-scaling.
        let ni = _mm512_cvtps_epi32(n);
        let over = _mm512_cmpgt_epi32_mask(ni, _mm512_set1_epi32(127));
        let under = _mm512_cmplt_epi32_mask(ni, _mm512_set1_epi32(-126));
        let pre = _mm512_mask_blend_ps(
            over,
            _mm512_mask_blend_ps(under, _mm512_set1_ps(1.0), c(0x0080_0000)),
            c(0x7f00_0000),
        );
        let ni = _mm512_mask_sub_epi32(ni, over, ni, _mm512_set1_epi32(127));
        let ni = _mm512_mask_add_epi32(ni, under, ni, _mm512_set1_epi32(126));
        let pow = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
            ni,
            _mm512_set1_epi32(127),
        )));
        let y = _mm512_mul_ps(_mm512_mul_ps(j, pre), pow);
        // NaN lanes: the scalar code scales by 2^0 (`NaN as i32` is 0).
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(n, n);
        let y = _mm512_mask_blend_ps(nan, y, j);
        let abs = _mm512_castsi512_ps(_mm512_and_si512(
            _mm512_castps_si512(n),
            _mm512_set1_epi32(0x7fff_ffff),
        ));
        let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(abs, _mm512_set1_ps(192.0));
        let nonpos = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
        let limit =
            _mm512_mask_blend_ps(nonpos, _mm512_set1_ps(f32::INFINITY), _mm512_setzero_ps());
        _mm512_mask_blend_ps(big, y, limit)
    }

    /// [`super::expf_ggml_slice`].
    ///
    /// Safety: AVX-512 F and FMA present.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn expf_ggml_slice(xs: &mut [f32]) {
        for chunk in xs.chunks_mut(16) {
            let mask = first_lanes(chunk.len());
            let p = chunk.as_mut_ptr();
            let y = expf_ggml16(_mm512_maskz_loadu_ps(mask, p));
            _mm512_mask_storeu_ps(p, mask, y);
        }
    }
}

/// The AVX2 exponential (8 lanes, the same operations as the AVX-512 one and the scalar code).
#[cfg(target_arch = "x86_64")]
mod ggml_avx2 {
    use core::arch::x86_64::*;

    /// [`super::expf_ggml`] of eight lanes: the same operations lane by lane, the special
    /// cases selected by blends.
    #[inline(always)]
    unsafe fn expf_ggml8(x: __m256) -> __m256 {
        let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
        let r = c(0x4b40_0000);
        let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, c(0x3f31_7200), x);
        let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), b);
        let u = _mm256_mul_ps(b, b);
        let p45 = _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17));
        let p23 = _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb));
        let p01 = _mm256_fmadd_ps(c(0x3f7f_fff6), b, _mm256_set1_ps(1.0));
        let j = _mm256_fmadd_ps(_mm256_fmadd_ps(p45, u, p23), u, p01);
        // |n| ≤ 192 here (the others are replaced below): at most one pre-scaling.
        let ni = _mm256_cvtps_epi32(n);
        let over = _mm256_cmpgt_epi32(ni, _mm256_set1_epi32(127));
        let under = _mm256_cmpgt_epi32(_mm256_set1_epi32(-126), ni);
        let pre = _mm256_blendv_ps(
            _mm256_blendv_ps(
                _mm256_set1_ps(1.0),
                c(0x0080_0000),
                _mm256_castsi256_ps(under),
            ),
            c(0x7f00_0000),
            _mm256_castsi256_ps(over),
        );
        let ni = _mm256_sub_epi32(ni, _mm256_and_si256(over, _mm256_set1_epi32(127)));
        let ni = _mm256_add_epi32(ni, _mm256_and_si256(under, _mm256_set1_epi32(126)));
        let pow = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            ni,
            _mm256_set1_epi32(127),
        )));
        let y = _mm256_mul_ps(_mm256_mul_ps(j, pre), pow);
        // NaN lanes: the scalar code scales by 2^0 (`NaN as i32` is 0).
        let y = _mm256_blendv_ps(y, j, _mm256_cmp_ps::<_CMP_UNORD_Q>(n, n));
        let abs = _mm256_and_ps(n, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)));
        let big = _mm256_cmp_ps::<_CMP_GT_OQ>(abs, _mm256_set1_ps(192.0));
        let nonpos = _mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps());
        let limit = _mm256_blendv_ps(_mm256_set1_ps(f32::INFINITY), _mm256_setzero_ps(), nonpos);
        _mm256_blendv_ps(y, limit, big)
    }

    /// [`super::expf_ggml_slice`].
    ///
    /// Safety: AVX2 and FMA present.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn expf_ggml_slice(xs: &mut [f32]) {
        let mut chunks = xs.chunks_exact_mut(8);
        for chunk in &mut chunks {
            let p = chunk.as_mut_ptr();
            _mm256_storeu_ps(p, expf_ggml8(_mm256_loadu_ps(p)));
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let mut tmp = [0f32; 8];
            tmp[..rest.len()].copy_from_slice(rest);
            let y = expf_ggml8(_mm256_loadu_ps(tmp.as_ptr()));
            _mm256_storeu_ps(tmp.as_mut_ptr(), y);
            rest.copy_from_slice(&tmp[..rest.len()]);
        }
    }
}

#[cfg(test)]
mod ggml_tests {
    use super::*;

    /// Deterministic values in [-1, 1) times `scale`.
    fn noise(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
            })
            .collect()
    }

    #[test]
    fn expf_ggml_slice_equals_the_scalar_function() {
        let mut xs: Vec<f32> = noise(1, 4000, 100.0);
        xs.extend(noise(2, 1000, 200.0));
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            88.72,
            88.73,
            -87.33,
            -87.34,
            -103.9,
            -104.0,
            -133.0,
            133.0,
            f32::MAX,
            f32::MIN,
            1e-30,
        ]);
        let mut got = xs.clone();
        expf_ggml_slice(&mut got);
        for (&x, &y) in xs.iter().zip(&got) {
            let want = expf_ggml(x);
            assert!(
                y.to_bits() == want.to_bits() || (y.is_nan() && want.is_nan()),
                "expf_ggml({x:e}) = {want:e}, vector {y:e}"
            );
        }
        // Within 2 ulp of the true exponential where it is a normal float.
        for x in [-80.0f32, -10.0, -1.0, -0.3, 0.0, 0.5, 3.0, 40.0, 80.0] {
            let (a, b) = (expf_ggml(x), x.exp());
            assert!((a.to_bits() as i64 - b.to_bits() as i64).abs() <= 2, "{x}");
        }
    }
}
