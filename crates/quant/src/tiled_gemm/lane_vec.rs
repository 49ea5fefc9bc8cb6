//! The vector operations of the token-lanes kernel (`lanes.rs`) for its two widths: a 512-bit
//! vector holds a whole tile of 16 tokens, a 256-bit one its first 8 (a batch's last tile
//! when at most 8 tokens are left: half the instructions for it, and on CPUs that run
//! 256-bit VNNI on two ports as fast per token).
//!
//! Safety: every function needs AVX2, FMA and AVX-512 F/BW/VL/VNNI; the loads and stores read
//! or write `LANES` elements at the pointer.

use std::arch::x86_64::*;

/// One vector of int32 lanes (a token each) and its float counterpart.
pub(super) trait LaneVec: Copy {
    /// The float vector of as many lanes.
    type F: Copy;
    /// All lanes zero.
    unsafe fn zero() -> Self;
    /// Every lane `x`.
    unsafe fn splat(x: i32) -> Self;
    /// The lanes at `p`.
    unsafe fn load(p: *const u32) -> Self;
    /// `vpdpbusd`: `acc + Σ` of the four unsigned bytes of `a` times the signed ones of `b`.
    unsafe fn dpbusd(acc: Self, a: Self, b: Self) -> Self;
    /// `vpdpwssd`: `acc +` the two i16 products of `a` and `b`.
    unsafe fn dpwssd(acc: Self, a: Self, b: Self) -> Self;
    /// Wrapping `a + b`.
    unsafe fn add(a: Self, b: Self) -> Self;
    /// Wrapping `a − b`.
    unsafe fn sub(a: Self, b: Self) -> Self;
    /// Wrapping `a · b` (low 32 bits).
    unsafe fn mullo(a: Self, b: Self) -> Self;
    /// `a << count` (the count in the low 64 bits).
    unsafe fn sll(a: Self, count: __m128i) -> Self;
    /// Per lane the low i16 of `lo` and, above it, the low i16 of `hi` (`vpermt2w`).
    unsafe fn low_words(lo: Self, hi: Self) -> Self;
    /// To float, per lane (exact below 2^24, rounded to nearest even above).
    unsafe fn to_f32(a: Self) -> Self::F;
    /// Every lane `x`.
    unsafe fn fsplat(x: f32) -> Self::F;
    /// The floats at `p`.
    unsafe fn fload(p: *const f32) -> Self::F;
    /// Stores `v` at `p`.
    unsafe fn fstore(p: *mut f32, v: Self::F);
    /// `a · b`, rounded.
    unsafe fn fmul(a: Self::F, b: Self::F) -> Self::F;
    /// `a · b + c`, one rounding.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
}

/// The `vpermt2w` indices of [`LaneVec::low_words`] over `N` dwords: word `2i` is word `2i`
/// of the first vector, word `2i + 1` word `2i` of the second (index `2N + 2i`).
const fn low_word_idx<const W: usize>() -> [i16; W] {
    let mut idx = [0i16; W];
    let mut i = 0;
    while i < W / 2 {
        idx[2 * i] = (2 * i) as i16;
        idx[2 * i + 1] = (W + 2 * i) as i16;
        i += 1;
    }
    idx
}

const IDX512: [i16; 32] = low_word_idx::<32>();
const IDX256: [i16; 16] = low_word_idx::<16>();

impl LaneVec for __m512i {
    type F = __m512;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm512_setzero_si512()
    }
    #[inline(always)]
    unsafe fn splat(x: i32) -> Self {
        _mm512_set1_epi32(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const u32) -> Self {
        _mm512_loadu_si512(p.cast())
    }
    #[inline(always)]
    unsafe fn dpbusd(acc: Self, a: Self, b: Self) -> Self {
        _mm512_dpbusd_epi32(acc, a, b)
    }
    #[inline(always)]
    unsafe fn dpwssd(acc: Self, a: Self, b: Self) -> Self {
        _mm512_dpwssd_epi32(acc, a, b)
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        _mm512_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        _mm512_sub_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn mullo(a: Self, b: Self) -> Self {
        _mm512_mullo_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sll(a: Self, count: __m128i) -> Self {
        _mm512_sll_epi32(a, count)
    }
    #[inline(always)]
    unsafe fn low_words(lo: Self, hi: Self) -> Self {
        let idx = _mm512_loadu_si512(IDX512.as_ptr().cast());
        _mm512_permutex2var_epi16(lo, idx, hi)
    }
    #[inline(always)]
    unsafe fn to_f32(a: Self) -> __m512 {
        _mm512_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn fsplat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn fload(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn fstore(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn fmul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
}

impl LaneVec for __m256i {
    type F = __m256;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm256_setzero_si256()
    }
    #[inline(always)]
    unsafe fn splat(x: i32) -> Self {
        _mm256_set1_epi32(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const u32) -> Self {
        _mm256_loadu_si256(p.cast())
    }
    #[inline(always)]
    unsafe fn dpbusd(acc: Self, a: Self, b: Self) -> Self {
        _mm256_dpbusd_epi32(acc, a, b)
    }
    #[inline(always)]
    unsafe fn dpwssd(acc: Self, a: Self, b: Self) -> Self {
        _mm256_dpwssd_epi32(acc, a, b)
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        _mm256_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        _mm256_sub_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn mullo(a: Self, b: Self) -> Self {
        _mm256_mullo_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sll(a: Self, count: __m128i) -> Self {
        _mm256_sll_epi32(a, count)
    }
    #[inline(always)]
    unsafe fn low_words(lo: Self, hi: Self) -> Self {
        let idx = _mm256_loadu_si256(IDX256.as_ptr().cast());
        _mm256_permutex2var_epi16(lo, idx, hi)
    }
    #[inline(always)]
    unsafe fn to_f32(a: Self) -> __m256 {
        _mm256_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn fsplat(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn fload(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn fstore(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn fmul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
}
