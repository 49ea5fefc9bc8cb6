//! Unit tests of the kernels (`kernel_tests`: base types; `lowbit_tests`; `gemm_tests`;
//! `decode_rows_tests`: the single-token row kernels on every path; `iq_batch_tests`: the
//! AVX-512 IQ batches with and without VBMI) and
//! what they share: a deterministic generator, random f16 values, bit equality.

mod decode_rows_tests;
mod gemm_tests;
#[cfg(target_arch = "x86_64")]
mod iq_batch_tests;
mod kernel_tests;
mod lowbit_tests;

/// splitmix64: a tiny deterministic generator, so tests need no dependency.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.u64() % n
    }
    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// A value with a random sign and magnitude spread over 2^-8..2^8.
    pub(crate) fn spread(&mut self) -> f32 {
        self.unit() * 2f32.powi(self.below(17) as i32 - 8)
    }
    pub(crate) fn byte(&mut self) -> u8 {
        self.u64() as u8
    }
}

/// A random f16 with exponent field in `lo..=hi` (0 = subnormals), random sign and mantissa.
pub(crate) fn rand_f16(rng: &mut Rng, lo: u16, hi: u16) -> u16 {
    let e = lo + rng.below((hi - lo + 1) as u64) as u16;
    ((rng.byte() as u16 & 1) << 15) | (e << 10) | (rng.u64() as u16 & 0x3ff)
}

/// Equal bits, or both NaN.
pub(crate) fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// [`crate::DotKernel::dot_rows`] of `nrows` weight rows gives, row by row, the bits of
/// [`crate::DotKernel::dot`].
pub(crate) fn assert_rows_equal_dots(
    k: &crate::DotKernel,
    n: usize,
    rows: &[u8],
    a: &[u8],
    nrows: usize,
) {
    let mut out = vec![f32::NAN; nrows];
    k.dot_rows(n, rows, a, &mut out);
    let rb = k.weight_row_bytes(n);
    for (r, o) in out.iter().enumerate() {
        let want = k.dot(n, &rows[r * rb..(r + 1) * rb], a);
        assert!(same(*o, want), "{} n={n} row {r}/{nrows}", k.name());
    }
}
