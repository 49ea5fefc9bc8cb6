//! Q4_K × Q8_K for eight weight rows at a time in the order of llama.cpp's repacked GEMV (see
//! `repack.rs`): per super-block the exact integers `isum` and `imin` of each row, then one
//! FMA per row into each of the two chains, `acc = fma(isum, d_w·d_a, acc)` and
//! `acc_min = fma(imin, dmin_w·d_a, acc_min)`, result `acc − acc_min`. The eight rows' chains
//! are the eight lanes of one vector, so every float operation is the scalar one, lane by lane:
//! bit-identical to `dot_q4_k_blockwise`. The integer sums come from the AVX2 pair
//! `vpmaddubsw` + `vpmaddwd`, or with AVX-512 VNNI from 512-bit `vpmaddubsw` + `vpdpwssd`
//! (each register two sub-blocks, the activation's runs paired to match once per
//! super-block). Rows past the last whole group of eight take the one-row kernel.
//!
//! Safety: every `unsafe fn` here needs AVX2, FMA and F16C (and AVX-512 F/BW/VL/VNNI for the
//! VNNI kernel), and pointers valid for the whole blocks it reads.

use core::arch::x86_64::*;

use super::avx2::q4_k_row;
use crate::cache_hint::prefetch_l2;
use crate::scalar::kquants::{Q4_K_BYTES, Q8_K_BYTES, Q8_K_QS, QK_K};
use crate::x86::avx2::lowbit::{hsum_8x8, k4_min_prod, k4_scales_mins, k4_sumi};

/// Rows per pass: one float lane each.
const R: usize = 8;

/// Lane `i` is the wrapping sum of the four lanes of `v[i]`.
#[inline(always)]
unsafe fn hsum_8x4(v: &[__m128i; R]) -> __m256i {
    let half =
        |v: &[__m128i]| _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]));
    _mm256_set_m128i(half(&v[4..]), half(&v[..4]))
}

/// The activation runs of one super-block paired as the weight nibbles of a 64-byte load of
/// `qs` are: register `2c` holds runs `4c` and `4c + 2` (the low nibbles of `qs[64c..]`),
/// register `2c + 1` runs `4c + 1` and `4c + 3` (the high nibbles).
#[inline(always)]
unsafe fn paired_runs(ab: *const u8) -> [__m512i; 4] {
    let run = |j: usize| _mm256_loadu_si256(ab.add(Q8_K_QS + 32 * j).cast());
    let pair = |j: usize| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(run(j)), run(j + 2));
    [pair(0), pair(1), pair(4), pair(5)]
}

/// `vpermw` indices putting the scales of the runs of [`paired_runs`] register `i` in its
/// two halves.
#[inline(always)]
unsafe fn paired_scale_idx() -> [__m512i; 4] {
    let runs = [(0i16, 2i16), (1, 3), (4, 6), (5, 7)];
    runs.map(|(lo, hi)| {
        _mm512_mask_blend_epi16(0xffff_0000, _mm512_set1_epi16(lo), _mm512_set1_epi16(hi))
    })
}

/// How the integer sum `isum` of a row's super-block is formed: prepared once per activation
/// super-block, then asked for each row.
trait Isum: Sized {
    /// Prepares the activation super-block at `ab`.
    unsafe fn prepare(ab: *const u8) -> Self;
    /// `isum` of the weight super-block `wb` (its scales and mins `sm` from
    /// `k4_scales_mins`) in int32 lanes.
    unsafe fn lanes(&self, wb: *const u8, ab: *const u8, sm: __m256i) -> __m256i;
}

/// AVX2's `vpmaddubsw` + `vpmaddwd` (`k4_sumi`).
struct Avx2;

impl Isum for Avx2 {
    #[inline(always)]
    unsafe fn prepare(_: *const u8) -> Avx2 {
        Avx2
    }

    #[inline(always)]
    unsafe fn lanes(&self, wb: *const u8, ab: *const u8, sm: __m256i) -> __m256i {
        k4_sumi::<false>(wb, ab, sm)
    }
}

/// 512-bit `vpmaddubsw` + `vpdpwssd` over the activation's [`paired_runs`].
struct Vnni {
    acts: [__m512i; 4],
    idx: [__m512i; 4],
}

impl Isum for Vnni {
    #[inline(always)]
    unsafe fn prepare(ab: *const u8) -> Vnni {
        Vnni {
            acts: paired_runs(ab),
            idx: paired_scale_idx(),
        }
    }

    #[inline(always)]
    unsafe fn lanes(&self, wb: *const u8, _: *const u8, sm: __m256i) -> __m256i {
        let m4 = _mm512_set1_epi8(0x0f);
        let scales = _mm512_castsi256_si512(sm);
        let mut sum = _mm512_setzero_si512();
        for c in 0..2 {
            let q = _mm512_loadu_si512(wb.add(16 + 64 * c).cast());
            let nibbles = [
                _mm512_and_si512(q, m4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4),
            ];
            for (h, x) in nibbles.into_iter().enumerate() {
                let i = 2 * c + h;
                // Pair sums ≤ 2·15·128 fit i16; scaled by ≤ 63 and summed in i32.
                let p = _mm512_maddubs_epi16(x, self.acts[i]);
                let sc = _mm512_permutexvar_epi16(self.idx[i], scales);
                sum = _mm512_dpwssd_epi32(sum, p, sc);
            }
        }
        _mm256_add_epi32(
            _mm512_castsi512_si256(sum),
            _mm512_extracti64x4_epi64::<1>(sum),
        )
    }
}

/// Eight rows `stride` bytes apart against the activation row `a`, into `out[..8]`.
#[inline(always)]
unsafe fn q4_k_rows8<I: Isum>(n: usize, w: *const u8, stride: usize, a: *const u8, out: *mut f32) {
    let mut acc = _mm256_setzero_ps();
    let mut acc_min = _mm256_setzero_ps();
    // The next eight rows go into L2 as this group runs (the hardware prefetchers miss eight
    // streams): per super-block the share of them that matches (a hint: addresses past the
    // rows are never read).
    let next = w.wrapping_add(R * stride);
    for i in 0..n / QK_K {
        prefetch_l2(next.wrapping_add(i * R * Q4_K_BYTES), R * Q4_K_BYTES);
        let ab = a.add(i * Q8_K_BYTES);
        let prep = I::prepare(ab);
        let mut isum = [_mm256_setzero_si256(); R];
        let mut imin = [_mm_setzero_si128(); R];
        let (mut d_w, mut dmin_w) = ([0u16; R], [0u16; R]);
        for r in 0..R {
            let wb = w.add(r * stride + i * Q4_K_BYTES);
            let sm = k4_scales_mins(wb);
            imin[r] = k4_min_prod(sm, ab);
            isum[r] = prep.lanes(wb, ab, sm);
            d_w[r] = wb.cast::<u16>().read_unaligned();
            dmin_w[r] = wb.add(2).cast::<u16>().read_unaligned();
        }
        let d_a = _mm256_set1_ps(ab.cast::<f32>().read_unaligned());
        let d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(d_w.as_ptr().cast())), d_a);
        let dmin = _mm256_mul_ps(
            _mm256_cvtph_ps(_mm_loadu_si128(dmin_w.as_ptr().cast())),
            d_a,
        );
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum_8x8(&isum)), d, acc);
        acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum_8x4(&imin)), dmin, acc_min);
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc, acc_min));
}

/// The rows of `w` in groups of eight, the rest one at a time.
#[inline(always)]
unsafe fn rows<I: Isum>(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
    let groups = out.len() / R * R;
    for r in (0..groups).step_by(R) {
        q4_k_rows8::<I>(
            n,
            w.as_ptr().add(r * stride),
            stride,
            a.as_ptr(),
            out.as_mut_ptr().add(r),
        );
    }
    for (r, o) in out.iter_mut().enumerate().skip(groups) {
        *o = q4_k_row(n, w.as_ptr().add(r * stride), a.as_ptr());
    }
}

/// # Safety
/// The CPU has AVX2/FMA/F16C; `w` holds `out.len()` rows `stride` bytes apart, `a` the blocks
/// of `n` elements.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_q4_k_avx2(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
    rows::<Avx2>(n, w, stride, a, out)
}

/// # Safety
/// The CPU has AVX2/FMA/F16C and AVX-512 F/BW/VL/VNNI; `w` holds `out.len()` rows `stride`
/// bytes apart, `a` the blocks of `n` elements.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn rows_q4_k_vnni(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
    rows::<Vnni>(n, w, stride, a, out)
}
