//! Q5_0 × Q8_0 rows for a single token with AVX-512 VNNI (decode's mat-vec: the Qwen2.5 files
//! store their 896-wide matrices as Q5_0): the 5-bit quants `q` (0..=31, the value being
//! `q − 16`) go straight into `vpdpbusd` as unsigned bytes, whose accumulator starts at the
//! activation block's `−16 · Σ y` over each group of four, prepared once per activation row.
//! Each int32 lane then holds exactly the integer sum of ggml's sign-trick kernel
//! (`|x| · sign(y, x)` with `x = q − 16`, [`crate::x86::avx2::lowbit`]'s `signed_rows`), and
//! the FMA chain per row is the same block by block, so the result is bit-identical. The fifth
//! bits come from a mask register (`kmovd`) instead of a byte shuffle and compare, and the
//! nibbles from a broadcast load and a per-half shift: about half the instructions per block.
//!
//! An activation holding -128 (whose product the sign trick wraps; no quantiser emits it) or a
//! row longer than [`PREP_BLOCKS`] blocks takes the sign-trick kernel.
//!
//! Safety: every `unsafe fn` here needs AVX-512 F/BW/VL/VNNI plus AVX2, FMA and F16C, and
//! pointers valid for the whole blocks it reads.

use core::arch::x86_64::*;
use core::mem::MaybeUninit;

use crate::cache_hint::prefetch_l2;
use crate::scalar::legacy::Q5_0_BYTES;
use crate::scalar::shared::{Q8_0_BYTES, QK};
use crate::x86::avx2::dot::{f16_at, hsum8};

/// Most blocks per row that [`rows_prepared`] prepares on the stack (longer rows take the
/// sign-trick kernel).
const PREP_BLOCKS: usize = 256;

/// One Q8_0 activation row prepared for [`q5_0_rows_biased`], for its first `nb` blocks (the
/// rest is never written nor read, so it is left uninitialised).
struct Prep {
    /// Per block, `−16 · Σ y` over each group of four quants (what the unsigned quants add).
    neg_bias: [MaybeUninit<__m256i>; PREP_BLOCKS],
    /// Per block, the activation scale as f32.
    d: [MaybeUninit<f32>; PREP_BLOCKS],
}

/// Prepares the `nb` blocks of `a`; `false` (nothing usable) where a quant is -128.
#[inline(always)]
unsafe fn prepare(nb: usize, a: *const u8, prep: &mut Prep) -> bool {
    let m128 = _mm256_set1_epi8(i8::MIN);
    let sixteen = _mm256_set1_epi8(16);
    let mut bad = 0u32;
    for ib in 0..nb {
        let ab = a.add(ib * Q8_0_BYTES);
        let y = _mm256_loadu_si256(ab.add(2).cast());
        bad |= _mm256_cmpeq_epi8_mask(y, m128);
        let c = _mm256_dpbusd_epi32(_mm256_setzero_si256(), sixteen, y);
        prep.neg_bias[ib].write(_mm256_sub_epi32(_mm256_setzero_si256(), c));
        prep.d[ib].write(f16_at(ab));
    }
    bad == 0
}

/// The unsigned quants of the Q5_0 block at `wb`: element `j` in byte `j` (low nibbles of
/// bytes 6..22 first, then their high nibbles), plus 16 where bit `j` of `qh` is set (an add,
/// as the nibbles are below 16).
#[inline(always)]
unsafe fn quants(wb: *const u8) -> __m256i {
    let qs = _mm256_broadcastsi128_si256(_mm_loadu_si128(wb.add(6).cast()));
    let nib = _mm256_and_si256(
        _mm256_srlv_epi64(qs, _mm256_setr_epi64x(0, 0, 4, 4)),
        _mm256_set1_epi8(0x0f),
    );
    let qh = _cvtu32_mask32(wb.add(2).cast::<u32>().read_unaligned());
    _mm256_mask_add_epi8(nib, qh, nib, _mm256_set1_epi8(16))
}

/// `R` rows `stride` bytes apart against the prepared activation row, 8 blocks per step: the
/// rows' 8 scales gathered and multiplied by the activation's, then the 8 blocks' products.
#[inline(always)]
unsafe fn q5_0_rows_biased<const R: usize>(
    nb: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    prep: &Prep,
    out: *mut f32,
) {
    let da = prep.d.as_ptr().cast::<f32>();
    let offsets = _mm256_setr_epi32(0, 22, 44, 66, 88, 110, 132, 154);
    let mut acc = [_mm256_setzero_ps(); R];
    // Prefetch the next R rows into L2 as this group runs (the hardware prefetchers miss the
    // R streams), the share of them that matches this step's blocks.
    let next = w.wrapping_add(R * stride);
    let mut scale = [[0f32; 8]; R];
    let mut ib0 = 0;
    while ib0 < nb {
        let len = (nb - ib0).min(8);
        if R > 1 {
            prefetch_l2(
                next.wrapping_add(ib0 * R * Q5_0_BYTES),
                len * R * Q5_0_BYTES,
            );
        }
        // The step's blocks (a short last step masks the rest off: nothing past it is read).
        let m = (0xffu32 >> (8 - len)) as __mmask8;
        let d_a = _mm256_maskz_loadu_ps(m, da.add(ib0));
        for (r, scale) in scale.iter_mut().enumerate() {
            let row = w.add(r * stride + ib0 * Q5_0_BYTES);
            // Four bytes from each block start: the f16 scale and 2 bytes of `qh`.
            let g =
                _mm256_mmask_i32gather_epi32::<1>(_mm256_setzero_si256(), m, offsets, row.cast());
            let d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(g));
            _mm256_storeu_ps(scale.as_mut_ptr(), _mm256_mul_ps(d, d_a));
        }
        for (k, c) in prep.neg_bias[ib0..ib0 + len].iter().enumerate() {
            let ib = ib0 + k;
            let y = _mm256_loadu_si256(a.add(ib * Q8_0_BYTES + 2).cast());
            let c = c.assume_init();
            for (r, acc) in acc.iter_mut().enumerate() {
                let q = quants(w.add(r * stride + ib * Q5_0_BYTES));
                let p = _mm256_dpbusd_epi32(c, q, y);
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(scale[r][k]), _mm256_cvtepi32_ps(p), *acc);
            }
        }
        ib0 += len;
    }
    for (r, acc) in acc.iter().enumerate() {
        *out.add(r) = hsum8(*acc);
    }
}

/// Q5_0 rows with VNNI: [`q5_0_rows_biased`] where the activation row can be prepared, else
/// the sign-trick kernel `fallback`.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; `w` holds `out.len()` rows `stride`
/// bytes apart and `a` the blocks of `n` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn rows_prepared(
    n: usize,
    w: &[u8],
    stride: usize,
    a: &[u8],
    out: &mut [f32],
    fallback: crate::kernel_fns::DotRowsFn,
) {
    let nb = n / QK;
    let mut prep = Prep {
        neg_bias: [MaybeUninit::uninit(); PREP_BLOCKS],
        d: [MaybeUninit::uninit(); PREP_BLOCKS],
    };
    if nb > PREP_BLOCKS || !prepare(nb, a.as_ptr(), &mut prep) {
        return fallback(n, w, stride, a, out);
    }
    let rows = out.len();
    let (w, a, o) = (w.as_ptr(), a.as_ptr(), out.as_mut_ptr());
    let mut r = 0;
    while rows - r >= 4 {
        q5_0_rows_biased::<4>(nb, w.add(r * stride), stride, a, &prep, o.add(r));
        r += 4;
    }
    while r < rows {
        q5_0_rows_biased::<1>(nb, w.add(r * stride), stride, a, &prep, o.add(r));
        r += 1;
    }
}
