//! [`DotKernel`]: one weight type's dot product on one ISA, resolved once.

use crate::dispatch::dot_fns;
use crate::error::check_isa;
use crate::kernel_fns::{DotFn, DotFns, DotRowsFn};
use crate::{vec_dot_type, GgmlType, Isa, QuantError};

/// A resolved dot-product kernel for one weight type on one ISA: cheap to copy, `Send + Sync`,
/// call per row from any thread.
#[derive(Clone, Copy)]
pub struct DotKernel {
    weight: GgmlType,
    act: GgmlType,
    isa: Isa,
    name: &'static str,
    /// Elements per weight block (1 for float types).
    block: usize,
    w_block_bytes: usize,
    a_block_bytes: usize,
    dot: DotFn,
    rows: DotRowsFn,
}

impl std::fmt::Debug for DotKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DotKernel")
            .field("weight", &self.weight)
            .field("act", &self.act)
            .field("name", &self.name)
            .finish()
    }
}

impl DotKernel {
    /// The kernel for weights of type `weight` on `isa`; errors for unsupported types or an
    /// ISA this CPU lacks.
    pub fn new(weight: GgmlType, isa: Isa) -> Result<DotKernel, QuantError> {
        Self::resolve(weight, isa, true)
    }

    /// [`DotKernel::new`] with `allow_vnni = false` forcing the AVX-512 kernels that do not use
    /// VNNI (for tests on VNNI machines).
    pub(crate) fn resolve(
        weight: GgmlType,
        isa: Isa,
        allow_vnni: bool,
    ) -> Result<DotKernel, QuantError> {
        check_isa(isa)?;
        let fns = dot_fns(isa, weight, allow_vnni).ok_or(QuantError::Unsupported {
            ty: weight,
            op: "dot",
        })?;
        Ok(DotKernel::from_fns(weight, isa, fns))
    }

    /// The kernel of `fns` for weights of type `weight` on `isa` (which the caller checked).
    pub(crate) fn from_fns(weight: GgmlType, isa: Isa, fns: DotFns) -> DotKernel {
        let act = vec_dot_type(weight);
        DotKernel {
            weight,
            act,
            isa,
            name: fns.name,
            block: weight.block_elems(),
            w_block_bytes: weight.block_bytes(),
            a_block_bytes: act.block_bytes(),
            dot: fns.dot,
            rows: fns.rows,
        }
    }

    /// The kernel for `weight` on [`Isa::best`].
    pub fn best(weight: GgmlType) -> Result<DotKernel, QuantError> {
        Self::new(weight, Isa::best())
    }

    /// The weight type.
    pub fn weight_type(&self) -> GgmlType {
        self.weight
    }

    /// The activation type ([`vec_dot_type`] of the weight type).
    pub fn act_type(&self) -> GgmlType {
        self.act
    }

    /// The ISA the kernel runs on.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// A name for logs, e.g. `mxfp4*q8_0/avx512vnni`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Bytes of one weight row of `n` elements (`n` a multiple of the block size).
    pub fn weight_row_bytes(&self, n: usize) -> usize {
        n / self.block * self.w_block_bytes
    }

    /// Bytes of one activation row of `n` elements (`n` a multiple of the block size).
    pub fn act_row_bytes(&self, n: usize) -> usize {
        n / self.block * self.a_block_bytes
    }

    /// Dot of one weight row (`n` elements, weight format) with one activation row (`n`
    /// elements, activation format).
    ///
    /// Lengths are the caller's contract (checked by `debug_assert`). In release builds a
    /// partial trailing block is ignored and a too-short slice panics; never undefined behaviour.
    #[inline]
    pub fn dot(&self, n: usize, weight_row: &[u8], act_row: &[u8]) -> f32 {
        debug_assert_eq!(n % self.block, 0, "{n} is not a multiple of the block size");
        let wb = self.weight_row_bytes(n);
        let ab = self.act_row_bytes(n);
        debug_assert_eq!(weight_row.len(), wb, "weight row length");
        debug_assert_eq!(act_row.len(), ab, "activation row length");
        let w = &weight_row[..wb];
        let a = &act_row[..ab];
        // SAFETY: the ISA was checked in `resolve`; `w` and `a` hold exactly
        // `n / block` blocks each (block-rounded `n` is passed).
        unsafe { (self.dot)(n / self.block * self.block, w, a) }
    }

    /// Dots `out.len()` weight rows (contiguous, `weight_row_bytes(n)` apart) with one activation
    /// row, writing one result per row. Bit-identical to calling [`DotKernel::dot`] per row; the
    /// SIMD kernels process several rows per pass so each activation block is loaded once.
    ///
    /// Same length contract as [`DotKernel::dot`]; `weight_rows` holds exactly `out.len()` rows.
    #[inline]
    pub fn dot_rows(&self, n: usize, weight_rows: &[u8], act_row: &[u8], out: &mut [f32]) {
        debug_assert_eq!(n % self.block, 0, "{n} is not a multiple of the block size");
        let rb = self.weight_row_bytes(n);
        let ab = self.act_row_bytes(n);
        let total = rb.saturating_mul(out.len());
        debug_assert_eq!(weight_rows.len(), total, "weight rows length");
        debug_assert_eq!(act_row.len(), ab, "activation row length");
        let w = &weight_rows[..total];
        let a = &act_row[..ab];
        // SAFETY: the ISA was checked in `resolve`; `w` holds `out.len()` rows of `rb` bytes and
        // `a` one activation row, all of `n / block` whole blocks.
        unsafe { (self.rows)(n / self.block * self.block, w, rb, a, out) }
    }
}
