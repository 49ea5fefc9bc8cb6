//! The kernel signatures every ISA implements, and the macros that define the
//! `#[target_feature]` entry points of the SIMD kernels.
//!
//! Every kernel is an `unsafe fn` with the same contract:
//! * the CPU supports the ISA the kernel was compiled for (the public API checks
//!   [`crate::Isa::is_available`] before resolving a kernel);
//! * slices are exactly as long as the element count implies (whole blocks), except
//!   `DotRowsFn`'s weight slice which holds `out.len()` rows `stride` bytes apart.

/// Defines a `#[target_feature]` single-row `dot` and multi-row `rows` entry point around an
/// `R`-row kernel, using `$r` rows per pass and single rows for the rest. `$extra` is an
/// optional further const argument of the kernel (the AVX-512 VNNI switch).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_macros))]
macro_rules! entry_points {
    ($features:literal, $dot:ident, $rows:ident, $kernel:ident, $r:literal $(, $extra:literal)?) => {
        /// # Safety
        /// The CPU has the enabled features; `w` and `a` hold the blocks of `n` elements.
        #[target_feature(enable = $features)]
        unsafe fn $dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
            let mut out = [0.0f32; 1];
            $kernel::<1 $(, $extra)?>(n, w.as_ptr(), 0, a.as_ptr(), out.as_mut_ptr());
            out[0]
        }

        /// # Safety
        /// The CPU has the enabled features; `w` holds `out.len()` rows `stride` bytes apart and
        /// `a` the blocks of `n` elements.
        #[target_feature(enable = $features)]
        unsafe fn $rows(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
            let rows = out.len();
            let mut r = 0;
            while rows - r >= $r {
                $kernel::<$r $(, $extra)?>(n, w.as_ptr().add(r * stride), stride, a.as_ptr(), out.as_mut_ptr().add(r));
                r += $r;
            }
            while r < rows {
                $kernel::<1 $(, $extra)?>(n, w.as_ptr().add(r * stride), stride, a.as_ptr(), out.as_mut_ptr().add(r));
                r += 1;
            }
        }
    };
}

/// Defines a `#[target_feature]` `GemmFn` named `$name` around the `#[inline(always)]` GEMM
/// `$kernel`, which takes `(n, w, acts, bias, n_tokens, out)` with the `bias` marker,
/// `(n, w, acts, blocks, n_tokens, out)` with `blocks`, or else `(n, w, acts, n_tokens, out)`
/// (see `gemm_layout::ActBlocks`).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_macros))]
macro_rules! gemm_entry {
    ($features:literal, $name:ident, $kernel:expr $(, $bias:ident)?) => {
        /// # Safety
        /// The CPU has the enabled features; slices as in `GemmFn`.
        #[target_feature(enable = $features)]
        unsafe fn $name(
            n: usize,
            w: &[u8],
            acts: &[u8],
            blocks: &$crate::gemm_layout::ActBlocks,
            n_tokens: usize,
            out: &mut [f32],
        ) {
            gemm_entry!(@call $kernel, n, w, acts, blocks, n_tokens, out $(, $bias)?)
        }
    };
    (@call $kernel:expr, $n:ident, $w:ident, $a:ident, $b:ident, $t:ident, $o:ident, bias) => {
        $kernel($n, $w, $a, &$b.bias, $t, $o)
    };
    (@call $kernel:expr, $n:ident, $w:ident, $a:ident, $b:ident, $t:ident, $o:ident, blocks) => {
        $kernel($n, $w, $a, $b, $t, $o)
    };
    (@call $kernel:expr, $n:ident, $w:ident, $a:ident, $b:ident, $t:ident, $o:ident) => {{
        let _ = $b;
        $kernel($n, $w, $a, $t, $o)
    }};
}

/// A [`DotFns`] around a safe single-row dot (a scalar kernel, no ISA requirement): `rows` is
/// one `dot` per row.
macro_rules! scalar_kernel {
    ($name:literal, $dot:path) => {{
        fn rows(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
            for (r, o) in out.iter_mut().enumerate() {
                *o = $dot(n, &w[r * stride..r * stride + stride], a);
            }
        }
        $crate::kernel_fns::DotFns {
            name: $name,
            dot: $dot,
            rows,
        }
    }};
}

/// Dot of `n` elements: one weight row with one activation row.
pub(crate) type DotFn = unsafe fn(n: usize, w: &[u8], a: &[u8]) -> f32;
/// Dot of `out.len()` weight rows, `stride` bytes apart, with one activation row.
pub(crate) type DotRowsFn = unsafe fn(n: usize, w: &[u8], stride: usize, a: &[u8], out: &mut [f32]);
/// Quantise a row of f32 into its blocks.
pub(crate) type QuantFn = unsafe fn(src: &[f32], dst: &mut [u8]);
/// Dequantise a row of blocks into f32.
pub(crate) type DequantFn = unsafe fn(src: &[u8], dst: &mut [f32]);

/// A resolved dot kernel: single-row and multi-row entry points plus a name for logs.
#[derive(Clone, Copy)]
pub(crate) struct DotFns {
    pub name: &'static str,
    pub dot: DotFn,
    pub rows: DotRowsFn,
}
