//! IQ2_XXS × Q8_K rows with AVX-512 VBMI, BITALG and VNNI: a whole super-block decoded with a
//! few vector instructions instead of 32 grid-row and 32 sign-row loads.
//!
//! Every IQ2_XXS grid byte is one of three magnitudes (8, 25, 43), so a grid row is a 16-bit
//! code of eight 2-bit levels ([`GRID_CODES`]). A super-block's 32 grid indices become 32
//! codes by `vpermi2w` lookups over the 256-code table held in eight registers; each code is
//! spread over the eight bytes of its grid row by `vpmultishiftqb` and turned into magnitudes
//! by `vpshufb`. The 7-bit sign codes are cut out of the `aux` words by `vpmultishiftqb` too and
//! completed with their parity (`vpopcntb`), which gives one sign bit per element: the mask of
//! a masked `vpsubb` that negates the activations. `vpmaddubsw` pairs the products and
//! `vpdpwssd` adds each pair sum times its block's scale.
//!
//! Two 32-element blocks share a register, so element `e` of block `ib` lands in int32 lane
//! `(e % 32) / 4` of half `ib % 2`; the halves are added at the end of the super-block, which
//! leaves each of the eight lanes holding exactly the integer of the AVX2 kernel
//! (`avx2/iquants.rs`, no 16-bit sum saturates: magnitudes ≤ 43, activations ≤ 128). The float
//! steps are that kernel's: one fused multiply-add per super-block with `d_w·d_a`, the halving
//! sum, the factor 1/8. Bit-identical results; `tests/iq_dot.rs` checks them on every ISA.
//!
//! Safety: every `unsafe fn` here needs AVX-512 F/BW/VL/VBMI/VNNI/BITALG, AVX2, FMA and F16C
//! ([`has_features`]) and pointers valid for the
//! whole blocks it reads (the contract in `kernel_fns.rs`).

use core::arch::x86_64::*;

use crate::kernel_fns::DotFns;
use crate::scalar::iq_grids::IQ2XXS_GRID;
use crate::scalar::kquants::{Q8_K_BYTES, Q8_K_QS, QK_K};
use crate::x86::avx2::dot::{f16_at, hsum8};

/// Bytes of an IQ2_XXS super-block: the f16 scale and 8 blocks of 4 grid indices and a
/// 32-bit word of four 7-bit sign codes and the 4-bit block scale.
const BYTES: usize = 66;

/// The 2-bit level (0, 1, 2 for the magnitudes 8, 25, 43) of each byte of a grid row, packed
/// low byte first.
const fn grid_code(row: u64) -> u16 {
    let mut code = 0u16;
    let mut e = 0;
    while e < 8 {
        let level = match (row >> (8 * e)) as u8 {
            0x08 => 0,
            0x19 => 1,
            0x2b => 2,
            _ => panic!("an IQ2_XXS grid byte that is not 8, 25 or 43"),
        };
        code |= level << (2 * e);
        e += 1;
    }
    code
}

const fn grid_codes(grid: &[u64; 256]) -> [u16; 256] {
    let mut out = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        out[i] = grid_code(grid[i]);
        i += 1;
    }
    out
}

/// [`IQ2XXS_GRID`] as 16-bit codes of 2-bit levels.
static GRID_CODES: [u16; 256] = grid_codes(&IQ2XXS_GRID);

/// The constants of the decode, loaded once per call.
struct Consts {
    /// [`GRID_CODES`] in eight registers of 32 codes.
    table: [__m512i; 8],
    /// `vpermb` indices gathering the 32 grid indices (bytes 0–3 of each 8-byte block).
    index_bytes: __m512i,
    /// Bit offsets of the eight 2-bit levels of a code in its qword.
    level_shifts: __m512i,
    /// Bit offsets of the four 7-bit sign codes in the `aux` word (the qword's high half).
    sign_shifts: __m512i,
    /// The magnitudes of the three levels, per 128-bit lane.
    magnitudes: __m512i,
    /// `vpermw` indices broadcasting block `2p`'s and `2p + 1`'s scale words over the halves.
    scale_words: [__m512i; 4],
}

impl Consts {
    #[inline(always)]
    unsafe fn new() -> Consts {
        let t = GRID_CODES.as_ptr();
        let table = core::array::from_fn(|k| _mm512_loadu_si512(t.add(32 * k).cast()));
        let index_bytes = _mm512_set_epi64(
            0,
            0,
            0,
            0,
            0x3b3a_3938_3332_3130,
            0x2b2a_2928_2322_2120,
            0x1b1a_1918_1312_1110,
            0x0b0a_0908_0302_0100,
        );
        let level_shifts = _mm512_set1_epi64(0x0e0c_0a08_0604_0200);
        let sign_shifts = _mm512_set1_epi64(0x352e_2720);
        let magnitudes = _mm512_broadcast_i32x4(_mm_setr_epi8(
            8, 25, 43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ));
        let scale_words = core::array::from_fn(|p| {
            let (lo, hi) = (8 * p as i16, 8 * p as i16 + 4);
            _mm512_inserti64x4::<1>(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi))
        });
        Consts {
            table,
            index_bytes,
            level_shifts,
            sign_shifts,
            magnitudes,
            scale_words,
        }
    }
}

/// A decoded super-block: the magnitudes of block pair `p` (blocks `2p`, `2p + 1`) in
/// `m[p]`, its sign bits (1: negative) in `neg[p]`, and its blocks' scales (`2·s + 1`) on the
/// int16 lanes of each half in `ls[p]`.
struct Decoded {
    m: [__m512i; 4],
    neg: [u64; 4],
    ls: [__m512i; 4],
}

/// Super-block `b` decoded.
#[inline(always)]
unsafe fn decode(c: &Consts, b: *const u8) -> Decoded {
    let q = _mm512_loadu_si512(b.add(2).cast());
    // The 32 grid indices, as words, and their codes.
    let idx = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_permutexvar_epi8(
        c.index_bytes,
        q,
    )));
    let t = &c.table;
    let r0 = _mm512_permutex2var_epi16(t[0], idx, t[1]);
    let r1 = _mm512_permutex2var_epi16(t[2], idx, t[3]);
    let r2 = _mm512_permutex2var_epi16(t[4], idx, t[5]);
    let r3 = _mm512_permutex2var_epi16(t[6], idx, t[7]);
    let b6 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(64));
    let b7 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(128));
    let codes = _mm512_mask_blend_epi16(
        b7,
        _mm512_mask_blend_epi16(b6, r0, r1),
        _mm512_mask_blend_epi16(b6, r2, r3),
    );
    let three = _mm512_set1_epi8(3);
    let level_rows = |x: __m128i| {
        let spread = _mm512_multishift_epi64_epi8(c.level_shifts, _mm512_cvtepu16_epi64(x));
        _mm512_shuffle_epi8(c.magnitudes, _mm512_and_si512(spread, three))
    };
    let m = [
        level_rows(_mm512_extracti32x4_epi32::<0>(codes)),
        level_rows(_mm512_extracti32x4_epi32::<1>(codes)),
        level_rows(_mm512_extracti32x4_epi32::<2>(codes)),
        level_rows(_mm512_extracti32x4_epi32::<3>(codes)),
    ];
    // Sign bytes: each 7-bit code and its parity as the top bit; block `ib`'s four in the low
    // dword of qword `ib`, then the eight dwords side by side.
    let codes7 = _mm512_and_si512(
        _mm512_multishift_epi64_epi8(c.sign_shifts, q),
        _mm512_set1_epi8(0x7f),
    );
    let parity = _mm512_and_si512(_mm512_popcnt_epi8(codes7), _mm512_set1_epi8(1));
    let signs = _mm512_or_si512(codes7, _mm512_slli_epi16::<7>(parity));
    let signs = _mm512_cvtepi64_epi32(signs);
    let neg = [
        _mm256_extract_epi64::<0>(signs) as u64,
        _mm256_extract_epi64::<1>(signs) as u64,
        _mm256_extract_epi64::<2>(signs) as u64,
        _mm256_extract_epi64::<3>(signs) as u64,
    ];
    // Block scales `2·(aux >> 28) + 1` in the low word of each qword.
    let s = _mm512_or_si512(
        _mm512_slli_epi64::<1>(_mm512_srli_epi64::<60>(q)),
        _mm512_set1_epi64(1),
    );
    let ls = core::array::from_fn(|p| _mm512_permutexvar_epi16(c.scale_words[p], s));
    Decoded { m, neg, ls }
}

/// The eight int32 lanes of the decoded super-block times the Q8_K super-block at `ab`.
#[inline(always)]
unsafe fn lanes(dec: &Decoded, ab: *const u8) -> __m256i {
    let zero = _mm512_setzero_si512();
    let mut s = zero;
    for p in 0..4 {
        let y = _mm512_loadu_si512(ab.add(Q8_K_QS + 64 * p).cast());
        let sy = _mm512_mask_sub_epi8(y, dec.neg[p], zero, y);
        s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(dec.m[p], sy), dec.ls[p]);
    }
    _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64::<1>(s))
}

/// `R` rows (`stride` bytes apart) times the Q8_K row `a`.
#[inline(always)]
unsafe fn iq2_xxs_rows<const R: usize>(
    n: usize,
    w: *const u8,
    stride: usize,
    a: *const u8,
    out: *mut f32,
) {
    let c = Consts::new();
    for r in 0..R {
        let w = w.add(r * stride);
        let mut acc = _mm256_setzero_ps();
        for i in 0..n / QK_K {
            let b = w.add(i * BYTES);
            let ab = a.add(i * Q8_K_BYTES);
            let d = f16_at(b) * ab.cast::<f32>().read_unaligned();
            let s = lanes(&decode(&c, b), ab);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s), acc);
        }
        *out.add(r) = 0.125 * hsum8(acc);
    }
}

entry_points!(
    "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx512bitalg,avx2,fma,f16c",
    dot_iq2_xxs,
    rows_iq2_xxs,
    iq2_xxs_rows,
    1
);

/// Whether the CPU has what the kernels here need.
pub(crate) fn has_features() -> bool {
    crate::x86::features::has_avx512_vnni()
        && crate::x86::features::has_avx512_vbmi()
        && is_x86_feature_detected!("avx512bitalg")
}

/// The kernels here for `ty`, on a CPU with [`has_features`] (the caller checked).
pub(crate) fn dot_fns(ty: crate::GgmlType) -> Option<DotFns> {
    match ty {
        crate::GgmlType::IQ2_XXS => Some(DotFns {
            name: "iq2_xxs*q8_k/avx512vbmi",
            dot: dot_iq2_xxs,
            rows: rows_iq2_xxs,
        }),
        _ => None,
    }
}
