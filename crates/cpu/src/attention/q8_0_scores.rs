//! Attention scores of Q8_0 queries against Q8_0 keys scattered through a KV cache, many
//! queries × many keys per call, bit-identical to [`DotKernel::dot`] per (key, query) pair.
//!
//! `DotKernel::dot_rows` reads weight rows that lie one after another; attention instead
//! dots a handful of query heads with keys at arbitrary offsets (a ring cache, interleaved
//! heads), a few blocks each, and per-call overhead dominates. Here sixteen keys share the
//! lanes of one register: their bytes are gathered once into "group" vectors (lane `i` holds
//! bytes `4g..4g+4` of key `i`'s block) and every query then needs one `vpdpbusd` per group.
//! The per-group integer sums, the FMA chain over blocks and the final halving sum are those of
//! ggml's 8-lane `vec_dot_q8_0_q8_0`, so the scores are the same bits.

use hmoe_quant::{DotKernel, GgmlType};

/// Bytes of one Q8_0 block: an f16 scale and 32 signed bytes.
const BLOCK_BYTES: usize = 34;
/// Most blocks per head the vector kernel handles (heads of up to 256 elements).
#[cfg(target_arch = "x86_64")]
const MAX_BLOCKS: usize = 8;

/// AVX-512 F/BW/VL with VNNI (`vpdpbusd`): what the `vnni` kernel needs.
#[cfg(target_arch = "x86_64")]
fn has_avx512_vnni() -> bool {
    hmoe_quant::Isa::Avx512.is_available() && is_x86_feature_detected!("avx512vnni")
}

/// Q8_0 query heads prepared for [`Q8_0Queries::scores`].
#[derive(Debug, Clone)]
pub struct Q8_0Queries {
    /// Blocks per head.
    blocks: usize,
    /// The query heads as given (Q8_0 rows).
    raw: Vec<u8>,
    /// Per query and block: the scale as f32.
    scale: Vec<f32>,
    /// Per query, block and group of four bytes: the bytes as one little-endian word.
    words: Vec<i32>,
    /// Per query, block and group: `-128 · Σ` of the group's bytes, which removes the bias of
    /// the keys' bytes being read as unsigned (`k + 128`).
    unbias: Vec<i32>,
    /// The scalar fallback: Q8_0 × Q8_0 `vec_dot`.
    kernel: DotKernel,
}

impl Q8_0Queries {
    /// Prepares `queries` (whole Q8_0 rows of `n` elements each, `n` a multiple of 32).
    ///
    /// # Panics
    /// If `n` is not a positive multiple of 32 or `queries` is not whole rows.
    pub fn new(n: usize, queries: &[u8]) -> Q8_0Queries {
        assert!(
            n > 0 && n.is_multiple_of(32),
            "heads of {n} are not whole Q8_0 blocks"
        );
        let blocks = n / 32;
        let row = blocks * BLOCK_BYTES;
        assert!(
            queries.len().is_multiple_of(row),
            "queries are not whole rows"
        );
        let n_blocks = queries.len() / BLOCK_BYTES;
        let mut scale = Vec::with_capacity(n_blocks);
        let mut words = Vec::with_capacity(n_blocks * 8);
        let mut unbias = Vec::with_capacity(n_blocks * 8);
        for block in queries.chunks_exact(BLOCK_BYTES) {
            scale.push(half::f16::from_le_bytes([block[0], block[1]]).to_f32());
            for g in block[2..].chunks_exact(4) {
                words.push(i32::from_le_bytes([g[0], g[1], g[2], g[3]]));
                unbias.push(-128 * g.iter().map(|&b| b as i8 as i32).sum::<i32>());
            }
        }
        Q8_0Queries {
            blocks,
            raw: queries.to_vec(),
            scale,
            words,
            unbias,
            kernel: DotKernel::best(GgmlType::Q8_0).expect("Q8_0 has a dot kernel"),
        }
    }

    /// Number of query heads.
    pub fn len(&self) -> usize {
        self.scale.len() / self.blocks
    }

    /// Whether there are no queries.
    pub fn is_empty(&self) -> bool {
        self.scale.is_empty()
    }

    /// Bytes of one head (query or key).
    pub fn row_bytes(&self) -> usize {
        self.blocks * BLOCK_BYTES
    }

    /// `out[q · stride + i] = scale · dot(key i, query q)` for every query `q` and every key
    /// `i`, the key's head being the Q8_0 row at byte `key_at[i]` of `keys`. Each dot is the
    /// bits of [`DotKernel::dot`] (Q8_0 keys as the weight row, the query as the activation).
    ///
    /// # Panics
    /// If a key runs past `keys`, `stride < key_at.len()`, or `out` is too short.
    pub fn scores(
        &self,
        keys: &[u8],
        key_at: &[usize],
        scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        let row = self.row_bytes();
        assert!(stride >= key_at.len(), "score rows overlap");
        if self.is_empty() || key_at.is_empty() {
            return;
        }
        assert!(
            out.len() >= (self.len() - 1) * stride + key_at.len(),
            "score buffer too short"
        );
        assert!(
            key_at
                .iter()
                .all(|&at| at.checked_add(row).is_some_and(|end| end <= keys.len())),
            "a key runs past the cache"
        );
        #[cfg(target_arch = "x86_64")]
        if has_avx512_vnni() && self.blocks <= MAX_BLOCKS && i32::try_from(keys.len()).is_ok() {
            // SAFETY: the CPU has AVX-512 F/BW/VL + VNNI (checked above); every key row lies
            // inside `keys` and its offsets fit in i32; `out` holds every row written.
            unsafe { vnni::scores(self, keys, key_at, scale, out, stride) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if hmoe_quant::Isa::Avx2.is_available() && self.blocks <= MAX_BLOCKS {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above); every key row lies
            // inside `keys`; `out` holds every row written.
            unsafe { avx2::scores(self, keys, key_at, scale, out, stride) };
            return;
        }
        self.scores_scalar(keys, key_at, scale, out, stride);
    }

    /// [`Q8_0Queries::scores`] one pair at a time through [`DotKernel::dot`].
    fn scores_scalar(
        &self,
        keys: &[u8],
        key_at: &[usize],
        scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        let (row, n) = (self.row_bytes(), self.blocks * 32);
        for (q, out) in self.raw.chunks_exact(row).zip(out.chunks_mut(stride)) {
            for (o, &at) in out.iter_mut().zip(key_at) {
                *o = self.kernel.dot(n, &keys[at..at + row], q) * scale;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use core::arch::x86_64::*;

    use super::{Q8_0Queries, BLOCK_BYTES, MAX_BLOCKS};

    /// Sixteen keys per pass; the last pass repeats its last key in the unused lanes and
    /// stores only the used ones.
    ///
    /// Safety: AVX-512 F/BW/VL + VNNI present; every `key_at[i] + row_bytes ≤ keys.len()`
    /// and `keys.len() ≤ i32::MAX`; `out` holds `(len − 1) · stride + key_at.len()` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn scores(
        qs: &Q8_0Queries,
        keys: &[u8],
        key_at: &[usize],
        scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        let nb = qs.blocks;
        let base = keys.as_ptr();
        let flip = _mm512_set1_epi8(-128);
        let mut dk = [_mm512_setzero_ps(); MAX_BLOCKS];
        let mut ku = [_mm512_setzero_si512(); MAX_BLOCKS * 8];
        for (c, chunk) in key_at.chunks(16).enumerate() {
            let mut lanes = [0i32; 16];
            for (l, lane) in lanes.iter_mut().enumerate() {
                // In range: `keys.len() ≤ i32::MAX` (checked by the caller).
                *lane = chunk[l.min(chunk.len() - 1)] as i32;
            }
            let idx = _mm512_loadu_si512(lanes.as_ptr().cast());
            for b in 0..nb {
                let at = base.add(b * BLOCK_BYTES);
                // The f16 scale is the low half of the word at the block's start.
                let d = _mm512_i32gather_epi32::<1>(idx, at.cast());
                dk[b] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
                let groups = super::transpose_groups(|i| at.add(lanes[i] as usize + 2));
                for (g, w) in groups.into_iter().enumerate() {
                    ku[b * 8 + g] = _mm512_xor_si512(w, flip);
                }
            }
            let mask: __mmask16 = if chunk.len() == 16 {
                0xffff
            } else {
                (1u16 << chunk.len()) - 1
            };
            for q in 0..qs.len() {
                let mut acc = [_mm512_setzero_ps(); 8];
                for b in 0..nb {
                    let at = (q * nb + b) * 8;
                    let d =
                        _mm512_mul_ps(dk[b], _mm512_set1_ps(*qs.scale.get_unchecked(q * nb + b)));
                    for (g, acc) in acc.iter_mut().enumerate() {
                        let sum = _mm512_dpbusd_epi32(
                            _mm512_set1_epi32(*qs.unbias.get_unchecked(at + g)),
                            ku[b * 8 + g],
                            _mm512_set1_epi32(*qs.words.get_unchecked(at + g)),
                        );
                        *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sum), *acc);
                    }
                }
                // ggml's `hsum_float_8` over the eight group lanes of each key.
                let lo =
                    _mm512_add_ps(_mm512_add_ps(acc[0], acc[4]), _mm512_add_ps(acc[2], acc[6]));
                let hi =
                    _mm512_add_ps(_mm512_add_ps(acc[1], acc[5]), _mm512_add_ps(acc[3], acc[7]));
                let s = _mm512_mul_ps(_mm512_add_ps(lo, hi), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(q * stride + c * 16), mask, s);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use core::arch::x86_64::*;

    use super::{Q8_0Queries, BLOCK_BYTES, MAX_BLOCKS};

    /// Eight keys per pass, one per lane, as [`super::vnni::scores`] does sixteen; each group's
    /// products are ggml's AVX2 ones, `maddubs(|k|, sign(q, k))` summed in pairs (the same
    /// 16-bit intermediates as the one-pair kernel, so the same sums). The last pass repeats
    /// its last key in the unused lanes and stores only the used ones.
    ///
    /// Safety: AVX2, FMA and F16C present; every `key_at[i] + row_bytes ≤ keys.len()`; `out`
    /// holds `(len − 1) · stride + key_at.len()` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores(
        qs: &Q8_0Queries,
        keys: &[u8],
        key_at: &[usize],
        scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        let nb = qs.blocks;
        let base = keys.as_ptr();
        let ones = _mm256_set1_epi16(1);
        let mut dk = [_mm256_setzero_ps(); MAX_BLOCKS];
        // Per block and group: the keys' bytes, and their absolute values.
        let mut kb = [_mm256_setzero_si256(); MAX_BLOCKS * 8];
        let mut ka = [_mm256_setzero_si256(); MAX_BLOCKS * 8];
        for (c, chunk) in key_at.chunks(8).enumerate() {
            let n = chunk.len();
            for b in 0..nb {
                let block = |i: usize| base.add(chunk[i.min(n - 1)] + b * BLOCK_BYTES);
                let d: [u16; 8] = core::array::from_fn(|i| block(i).cast::<u16>().read_unaligned());
                dk[b] = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().cast()));
                let groups = transpose8(|i| block(i).add(2));
                for (g, w) in groups.into_iter().enumerate() {
                    kb[b * 8 + g] = w;
                    ka[b * 8 + g] = _mm256_sign_epi8(w, w);
                }
            }
            let mask = _mm256_cmpgt_epi32(
                _mm256_set1_epi32(n as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            for q in 0..qs.len() {
                let mut acc = [_mm256_setzero_ps(); 8];
                for b in 0..nb {
                    let at = (q * nb + b) * 8;
                    let d =
                        _mm256_mul_ps(dk[b], _mm256_set1_ps(*qs.scale.get_unchecked(q * nb + b)));
                    for (g, acc) in acc.iter_mut().enumerate() {
                        let qw = _mm256_set1_epi32(*qs.words.get_unchecked(at + g));
                        let signed = _mm256_sign_epi8(qw, kb[b * 8 + g]);
                        let sum =
                            _mm256_madd_epi16(_mm256_maddubs_epi16(ka[b * 8 + g], signed), ones);
                        *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sum), *acc);
                    }
                }
                // ggml's `hsum_float_8` over the eight group lanes of each key.
                let lo =
                    _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
                let hi =
                    _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
                let s = _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale));
                _mm256_maskstore_ps(out.as_mut_ptr().add(q * stride + c * 8), mask, s);
            }
        }
    }

    /// The eight 4-byte groups of eight 32-byte rows (`row(i)` for key `i`), transposed:
    /// output `g` holds group `g` of key `i` in lane `i`.
    ///
    /// Safety: AVX2 present; every `row(i)` valid for 32 bytes.
    #[inline(always)]
    unsafe fn transpose8(row: impl Fn(usize) -> *const u8) -> [__m256i; 8] {
        let r: [__m256i; 8] = core::array::from_fn(|i| _mm256_loadu_si256(row(i).cast()));
        // u[4h + m]: keys 4h..4h+4 of group m (low lane) and m + 4 (high lane).
        let u = super::interleave_groups(
            r,
            [
                |a, b| _mm256_unpacklo_epi32(a, b),
                |a, b| _mm256_unpackhi_epi32(a, b),
            ],
            [
                |a, b| _mm256_unpacklo_epi64(a, b),
                |a, b| _mm256_unpackhi_epi64(a, b),
            ],
        );
        core::array::from_fn(|g| {
            let (lo, hi) = (u[g % 4], u[4 + g % 4]);
            if g < 4 {
                _mm256_permute2x128_si256::<0x20>(lo, hi)
            } else {
                _mm256_permute2x128_si256::<0x31>(lo, hi)
            }
        })
    }
}

/// The first two steps of an 8×8 dword transpose in every 128-bit lane of eight rows `r`,
/// given a vector type's dword and qword unpacks (`[low halves, high halves]`): pairs of rows
/// interleaved by dword, then by qword, so that output `4h + m` holds dword `m` of each
/// 128-bit lane of rows `4h..4h + 4`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn interleave_groups<V: Copy, F: Fn(V, V) -> V>(
    r: [V; 8],
    unpack32: [F; 2],
    unpack64: [impl Fn(V, V) -> V; 2],
) -> [V; 8] {
    let t: [V; 8] = core::array::from_fn(|k| unpack32[k % 2](r[k / 2 * 2], r[k / 2 * 2 + 1]));
    core::array::from_fn(|k| {
        let (h, m) = (k / 4, k % 4);
        unpack64[m % 2](t[4 * h + m / 2], t[4 * h + m / 2 + 2])
    })
}

/// The eight 4-byte groups of sixteen 32-byte rows (`row(i)` for key `i`), transposed: output
/// `g` holds group `g` of key `i` in lane `i`. Keys `i` and `i + 8` share a register, and an
/// 8×8 transpose runs in both 256-bit halves at once.
///
/// Safety: AVX-512 F present; every `row(i)` valid for 32 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
#[inline]
unsafe fn transpose_groups(row: impl Fn(usize) -> *const u8) -> [core::arch::x86_64::__m512i; 8] {
    use core::arch::x86_64::*;
    let r: [__m512i; 8] = core::array::from_fn(|i| {
        let lo = _mm512_castsi256_si512(_mm256_loadu_si256(row(i).cast()));
        _mm512_inserti64x4::<1>(lo, _mm256_loadu_si256(row(i + 8).cast()))
    });
    // u[4h + m]: keys 4h..4h+4 of group m (128-bit lane 0) and m + 4 (lane 1), per half.
    let u = interleave_groups(
        r,
        [
            |a, b| _mm512_unpacklo_epi32(a, b),
            |a, b| _mm512_unpackhi_epi32(a, b),
        ],
        [
            |a, b| _mm512_unpacklo_epi64(a, b),
            |a, b| _mm512_unpackhi_epi64(a, b),
        ],
    );
    let first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    core::array::from_fn(|g| {
        let idx = if g < 4 { first } else { second };
        _mm512_permutex2var_epi64(u[g % 4], idx, u[4 + g % 4])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_quant::quantize_row;

    /// Deterministic values with a wide spread of magnitudes.
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                u * (1.0 + (x & 7) as f32)
            })
            .collect()
    }

    fn q8(v: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; v.len() / 32 * BLOCK_BYTES];
        quantize_row(GgmlType::Q8_0, v, &mut out).unwrap();
        out
    }

    #[test]
    fn scores_equal_vec_dot_for_every_head_size_and_key_count() {
        let kernel = DotKernel::best(GgmlType::Q8_0).unwrap();
        for (n, n_q, n_keys) in [
            (32, 3, 1),
            (64, 8, 16),
            (64, 16, 33),
            (128, 5, 31),
            (256, 2, 17),
        ] {
            let queries = q8(&noise(n as u64, n * n_q));
            let cells = 40;
            let keys = q8(&noise(7 + n as u64, n * cells));
            let row = n / 32 * BLOCK_BYTES;
            // Keys in a scrambled order, one repeated, as a ring cache hands them out.
            let key_at: Vec<usize> = (0..n_keys).map(|i| (i * 7 + 3) % cells * row).collect();
            let prepared = Q8_0Queries::new(n, &queries);
            assert_eq!(prepared.len(), n_q);
            let stride = n_keys + 3;
            let mut out = vec![f32::NAN; n_q * stride];
            prepared.scores(&keys, &key_at, 0.125, &mut out, stride);
            let mut scalar = vec![f32::NAN; n_q * stride];
            prepared.scores_scalar(&keys, &key_at, 0.125, &mut scalar, stride);
            // The AVX2 kernel too where the CPU has it (the dispatch prefers VNNI).
            let mut eight = vec![f32::NAN; n_q * stride];
            #[cfg(target_arch = "x86_64")]
            if hmoe_quant::Isa::Avx2.is_available() {
                // SAFETY: AVX2, FMA and F16C present; the keys lie in `keys` (built so) and
                // `eight` holds every score row.
                unsafe { avx2::scores(&prepared, &keys, &key_at, 0.125, &mut eight, stride) };
            } else {
                eight.copy_from_slice(&scalar);
            }
            #[cfg(not(target_arch = "x86_64"))]
            eight.copy_from_slice(&scalar);
            for q in 0..n_q {
                for (i, &at) in key_at.iter().enumerate() {
                    let want = kernel.dot(n, &keys[at..at + row], &queries[q * row..(q + 1) * row])
                        * 0.125;
                    let got = out[q * stride + i];
                    assert_eq!(got.to_bits(), want.to_bits(), "n {n}, query {q}, key {i}");
                    assert_eq!(scalar[q * stride + i].to_bits(), want.to_bits());
                    assert_eq!(eight[q * stride + i].to_bits(), want.to_bits());
                }
                assert!(eight[q * stride + n_keys..(q + 1) * stride]
                    .iter()
                    .all(|v| v.is_nan()));
                // The gaps between score rows are left alone.
                assert!(out[q * stride + n_keys..(q + 1) * stride]
                    .iter()
                    .all(|v| v.is_nan()));
            }
        }
    }

    #[test]
    fn extreme_bytes_are_exact() {
        // Keys and queries of ±127 (the bias trick's largest sums) and a block of zeros.
        let n = 64;
        let mut v = vec![1.0f32; n];
        v[32..]
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = if i % 2 == 0 { -1.0 } else { 0.0 });
        let keys = q8(&v);
        let queries = q8(&v.iter().map(|x| -x).collect::<Vec<_>>());
        let prepared = Q8_0Queries::new(n, &queries);
        let mut out = [0f32; 1];
        prepared.scores(&keys, &[0], 1.0, &mut out, 1);
        let want = DotKernel::best(GgmlType::Q8_0)
            .unwrap()
            .dot(n, &keys, &queries);
        assert_eq!(out[0].to_bits(), want.to_bits());
        assert!(want < 0.0);
    }

    #[test]
    #[should_panic(expected = "runs past")]
    fn a_key_past_the_cache_is_refused() {
        let queries = q8(&noise(1, 64));
        let keys = q8(&noise(2, 64));
        Q8_0Queries::new(64, &queries).scores(&keys, &[1], 1.0, &mut [0.0], 1);
    }
}
