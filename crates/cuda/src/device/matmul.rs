//! Products of weight matrices and activations: `matmul` (the GEMV kernels, dp4a ones for
//! Q8_0/MXFP4 weights; the tiled kernel for batches of Q8_0/MXFP4 weights, cuBLAS for batches
//! of F16/BF16 weights), the Q8_0 activation
//! quantizer and per-head products (`matmul_heads`). The low-bit types' products are in
//! `lowbit`.

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig, PushKernelArg};
use hmoe_quant::GgmlType;

use super::capabilities::{is_lowbit, tiled_kernel};
use super::{grid_1d, i32_of, rows_by_tokens, u32_of, CudaDevice, DeviceMatrix, MAX_GRID_Y};
use crate::error::{ensure, CudaError};
use crate::kernels::{
    DP4A_MXFP4_ROWS, DP4A_Q8_0_ROWS, DP4A_TOKENS, MM_TOKENS, ROW_WARPS, TILE_SLOTS,
};

/// Batches of at least this many tokens multiply F16/BF16 weights with cuBLAS (when libcublas
/// is present); smaller ones (decode) use the GEMV kernel. F32 weights (gpt-oss's router, the
/// small test models) always use the GEMV kernel, which sums in the CPU device's order: a
/// router's logits summed in another order can flip an expert choice.
pub const CUBLAS_MIN_TOKENS: usize = 16;

/// Tokens from which Q8_0/MXFP4 matmuls use the tiled kernel instead of the GEMV kernel.
const MM_TILED_MIN_TOKENS: usize = 32;

/// Matrices one launch of the dp4a GEMV kernel multiplies (`kernels/gemv_dp4a.cu`: Q, K and V).
const DP4A_GROUP: usize = 3;

/// The null device pointer the GEMV kernels read as "no bias".
pub(super) const NO_BIAS: u64 = 0;

/// Pushes the activations of a product kernel: `quantized` (Q8_0 blocks, for Q8_0/MXFP4
/// weights) when there are any, else the f32 values `x`.
fn push_acts<'a>(
    b: &mut LaunchArgs<'a>,
    quantized: Option<&'a CudaSlice<u8>>,
    x: &'a CudaSlice<f32>,
) {
    match quantized {
        Some(q) => b.arg(q),
        None => b.arg(x),
    };
}

/// Whether `w`'s products take Q8_0 activations through the dp4a/tiled kernels (Q8_0 and
/// MXFP4 weights).
fn takes_q8_0(w: &DeviceMatrix) -> bool {
    matches!(w.ty, GgmlType::Q8_0 | GgmlType::MXFP4)
}

/// `x` and `y` hold `n` tokens of `w`'s inputs and outputs.
pub(super) fn check_shape(
    op: &'static str,
    w: &DeviceMatrix,
    x: &CudaSlice<f32>,
    n: usize,
    y: &CudaSlice<f32>,
) -> Result<(), CudaError> {
    ensure(x.len() >= n * w.cols && y.len() >= n * w.rows, op, || {
        format!(
            "x {} / y {} for {n} tokens of a {}×{} matrix",
            x.len(),
            y.len(),
            w.rows,
            w.cols
        )
    })
}

/// The matrices, biases and `n_ys` outputs of a shared-input product agree: one output and
/// one bias (or none) per matrix, each bias one value per row.
pub(super) fn check_shared(
    op: &'static str,
    ws: &[&DeviceMatrix],
    biases: &[Option<&CudaSlice<f32>>],
    n_ys: usize,
) -> Result<(), CudaError> {
    ensure(ws.len() == n_ys && ws.len() == biases.len(), op, || {
        format!(
            "{} matrices for {n_ys} outputs and {} biases",
            ws.len(),
            biases.len()
        )
    })?;
    for (w, bias) in ws.iter().zip(biases) {
        if let Some(bias) = bias {
            ensure(bias.len() == w.rows, op, || {
                format!("a bias of {} for {} rows", bias.len(), w.rows)
            })?;
        }
    }
    Ok(())
}

impl CudaDevice {
    /// `y[t] = W · x[t]` for `n` tokens: `x` is `n × w.cols()`, `y` is `n × w.rows()`.
    /// Activations are converted as ggml converts them (Q8_0 blocks for Q8_0 and MXFP4
    /// weights, [`CudaDevice::quantize_q8_0`]; f16/bf16 for F16/BF16; f32 for F32; the
    /// low-bit types' as [`CudaDevice::quantize_acts`] says, products in the CPU device's
    /// kernel's order for the matrix and batch, see `lowbit.rs`), and the
    /// GEMV kernel sums Q8_0, MXFP4 and F32 products in the CPU device's order (F32: one
    /// token in `vec_dot` order, several in 16 lanes), so those results are the CPU device's
    /// bits. Batches of [`CUBLAS_MIN_TOKENS`] or more with F16/BF16 weights use cuBLAS instead
    /// (activations rounded to the weight's 16-bit type, f32 accumulation in cuBLAS's order).
    pub fn matmul(
        &self,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.matmul_bias(w, None, x, n, y)
    }

    /// [`CudaDevice::matmul`], then `bias` (one per row of `w`, checked by the caller) added as
    /// [`CudaDevice::add_bias`] adds it: by the GEMV kernels (F32/F16/BF16, and Q8_0/MXFP4
    /// below the tiled kernel's batch) to their finished sums, else by `add_bias` after the
    /// product. The same bits either way.
    fn matmul_bias(
        &self,
        w: &DeviceMatrix,
        bias: Option<&CudaSlice<f32>>,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul";
        check_shape(OP, w, x, n, y)?;
        if n == 0 {
            return Ok(());
        }
        let half = matches!(w.ty, GgmlType::F16 | GgmlType::BF16);
        if is_lowbit(w.ty) {
            self.matmul_lowbit(w, x, n, y)?;
            return self.add_bias_opt(y, bias);
        }
        if half && n >= CUBLAS_MIN_TOKENS {
            if let Some(blas) = &self.blas {
                self.matmul_cublas(blas, w, x, n, y)?;
                return self.add_bias_opt(y, bias);
            }
        }
        if takes_q8_0(w) {
            let xq = self.quantize_q8_0(x, n * w.cols)?;
            return self.matmul_q8_0_acts(w, bias, &xq, n, y);
        }
        let name = match w.ty {
            GgmlType::F32 => "matmul_f32",
            GgmlType::F16 => "matmul_f16",
            _ => "matmul_bf16",
        };
        let row_bytes = w.row_bytes as u64;
        let (rows, cols, n_i) = (
            i32_of(OP, "rows", w.rows)?,
            i32_of(OP, "cols", w.cols)?,
            i32_of(OP, "tokens", n)?,
        );
        let cfg = rows_by_tokens(OP, (w.rows, ROW_WARPS), (n, MM_TOKENS), ROW_WARPS * 32)?;
        let mut b = self.builder(name);
        b.arg(&w.data).arg(&row_bytes).arg(x).arg(y);
        match bias {
            Some(bias) => b.arg(bias),
            // A null pointer: no bias.
            None => b.arg(&NO_BIAS),
        };
        b.arg(&rows).arg(&cols).arg(&n_i);
        // SAFETY: argument types match `matmul_f32`/`matmul_f16`/`matmul_bf16` (f32
        // activations; the bias w.rows values or null); sizes checked above and by the caller.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `y += bias` per row when there is a bias ([`CudaDevice::add_bias`]).
    fn add_bias_opt(
        &self,
        y: &mut CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
    ) -> Result<(), CudaError> {
        match bias {
            Some(bias) => self.add_bias(y, bias),
            None => Ok(()),
        }
    }

    /// `ys[i] = ws[i] · x (+ biases[i])` for `n` tokens: [`CudaDevice::matmul`] of each
    /// matrix, then its bias as [`CudaDevice::add_bias`] adds it, with their bits. When every
    /// matrix is Q8_0 or MXFP4 of one width (Q, K and V), `x` is quantized once for all of
    /// them (the quantizer is deterministic, so the products are the same); when they are also
    /// of one type, at most `DP4A_GROUP` and a decode-sized batch, the products and their
    /// biases are one launch of the dp4a kernel.
    pub fn matmul_shared(
        &self,
        ws: &[&DeviceMatrix],
        biases: &[Option<&CudaSlice<f32>>],
        x: &CudaSlice<f32>,
        n: usize,
        ys: &mut [&mut CudaSlice<f32>],
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul_shared";
        check_shared(OP, ws, biases, ys.len())?;
        let cols = ws.first().map_or(0, |w| w.cols);
        if n == 0 || !ws.iter().all(|w| takes_q8_0(w) && w.cols == cols) {
            for ((w, y), bias) in ws.iter().zip(ys.iter_mut()).zip(biases) {
                self.matmul_bias(w, *bias, x, n, y)?;
            }
            return Ok(());
        }
        for (w, y) in ws.iter().zip(ys.iter()) {
            check_shape(OP, w, x, n, y)?;
        }
        let xq = self.quantize_q8_0(x, n * cols)?;
        self.matmul_shared_q8_0_acts(ws, biases, &xq, n, ys)
    }

    /// A norm and the products that read it (`hmoe_backend::Backend::norm_matmul_shared`):
    /// [`CudaDevice::rms_norm`] of `x` into `h`, after `x += pending` where given
    /// ([`CudaDevice::add_rms_norm`]), then [`CudaDevice::matmul_shared`] of `h`, with their
    /// bits. When every matrix takes Q8_0 activations (Q8_0 and MXFP4 weights) and is as wide
    /// as the norm's rows, the norm's kernel also writes `h` as the Q8_0 blocks the products
    /// read (`rms_norm_q8_0_f32`, [`CudaDevice::quantize_q8_0`]'s bytes), so that gpt-oss's
    /// Q, K and V of a decode step with their biases are two launches (the norm, the dp4a
    /// group) instead of three; the other cases run the two ops.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_matmul_shared(
        &self,
        x: &mut CudaSlice<f32>,
        pending: Option<&CudaSlice<f32>>,
        (weight, eps): (&CudaSlice<f32>, f32),
        h: &mut CudaSlice<f32>,
        ws: &[&DeviceMatrix],
        biases: &[Option<&CudaSlice<f32>>],
        n: usize,
        ys: &mut [&mut CudaSlice<f32>],
    ) -> Result<(), CudaError> {
        const OP: &str = "norm_matmul_shared";
        let cols = weight.len();
        let fused = n > 0
            && cols.is_multiple_of(32)
            && x.len() >= n * cols
            && !ws.is_empty()
            && ws.iter().all(|w| takes_q8_0(w) && w.cols == cols);
        if !fused {
            match pending {
                Some(y) => self.add_rms_norm(x, y, weight, eps, h)?,
                None => self.rms_norm(x, weight, eps, h)?,
            }
            return self.matmul_shared(ws, biases, h, n, ys);
        }
        check_shared(OP, ws, biases, ys.len())?;
        for (w, y) in ws.iter().zip(ys.iter()) {
            check_shape(OP, w, h, n, y)?;
        }
        // Scratch: the norm's kernel writes every block of x's rows before the products read
        // them (rows of whole blocks: cols is a multiple of 32).
        let mut xq = self.alloc_scratch::<u8>(x.len() / 32 * 34)?;
        self.rms_norm_q8_0(x, pending, (weight, eps), h, &mut xq)?;
        self.matmul_shared_q8_0_acts(ws, biases, &xq, n, ys)
    }

    /// The products of [`CudaDevice::matmul_shared`] for Q8_0/MXFP4 matrices of one width on
    /// `n` (> 0) tokens of activations already quantized (`xq`), shapes checked by the
    /// callers: when the matrices are of one type, at most `DP4A_GROUP` and the batch is
    /// under the tiled kernel's, one launch of the dp4a kernel with the biases; else each
    /// matrix's [`CudaDevice::matmul_q8_0_acts`].
    fn matmul_shared_q8_0_acts(
        &self,
        ws: &[&DeviceMatrix],
        biases: &[Option<&CudaSlice<f32>>],
        xq: &CudaSlice<u8>,
        n: usize,
        ys: &mut [&mut CudaSlice<f32>],
    ) -> Result<(), CudaError> {
        let first = ws.first().map(|w| (w.ty, w.cols));
        let one_type = ws.iter().all(|w| Some((w.ty, w.cols)) == first);
        if one_type && n < MM_TILED_MIN_TOKENS && ws.len() <= DP4A_GROUP {
            return self.matmul_dp4a(ws, biases, xq, n, ys);
        }
        for ((w, y), bias) in ws.iter().zip(ys.iter_mut()).zip(biases) {
            self.matmul_q8_0_acts(w, *bias, xq, n, y)?;
        }
        Ok(())
    }

    /// [`CudaDevice::matmul_bias`] of Q8_0 or MXFP4 weights on `n` (> 0) tokens of
    /// activations already quantized (`xq`, [`CudaDevice::quantize_q8_0`]): the dp4a GEMV
    /// kernels with the bias, or the tiled kernel from `MM_TILED_MIN_TOKENS` tokens and then
    /// the bias.
    fn matmul_q8_0_acts(
        &self,
        w: &DeviceMatrix,
        bias: Option<&CudaSlice<f32>>,
        xq: &CudaSlice<u8>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if n < MM_TILED_MIN_TOKENS {
            return self.matmul_dp4a(&[w], &[bias], xq, n, &mut [y]);
        }
        self.matmul_tiled(w, xq, n, y)?;
        self.add_bias_opt(y, bias)
    }

    /// `ys[i] = ws[i] · x (+ biases[i])` for fewer than `MM_TILED_MIN_TOKENS` tokens of
    /// 1..=`DP4A_GROUP` Q8_0 or MXFP4 matrices of one type and width (checked by the
    /// callers, as are the shapes): one launch of the dp4a GEMV kernel
    /// (`kernels/gemv_dp4a.cu`), in the CPU device's order, DP4A_TOKENS tokens per block,
    /// each matrix's row blocks after the previous one's, a bias added to each finished sum
    /// (add_bias's one rounding). The Q8_0 kernel loads quant words with 16-bit loads: rows of
    /// whole 34-byte blocks from an aligned allocation keep them even.
    fn matmul_dp4a(
        &self,
        ws: &[&DeviceMatrix],
        biases: &[Option<&CudaSlice<f32>>],
        xq: &CudaSlice<u8>,
        n: usize,
        ys: &mut [&mut CudaSlice<f32>],
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul";
        let w0 = ws[0];
        let (name, rows_per_warp) = match w0.ty {
            GgmlType::MXFP4 => ("matmul_dp4a_mxfp4", DP4A_MXFP4_ROWS),
            _ => ("matmul_dp4a_q8_0", DP4A_Q8_0_ROWS),
        };
        let per_block = (ROW_WARPS * rows_per_warp) as usize;
        // Per member (absent ones: no rows, no blocks): row bytes, rows, end of its blocks.
        let (mut rbs, mut rows, mut ends) =
            ([0u64; DP4A_GROUP], [0i32; DP4A_GROUP], [0i32; DP4A_GROUP]);
        let mut end = 0usize;
        for i in 0..DP4A_GROUP {
            if let Some(w) = ws.get(i) {
                rbs[i] = w.row_bytes as u64;
                rows[i] = i32_of(OP, "rows", w.rows)?;
                end += w.rows.div_ceil(per_block);
            }
            ends[i] = i32_of(OP, "row blocks", end)?;
        }
        let (cols, n_i) = (i32_of(OP, "cols", w0.cols)?, i32_of(OP, "tokens", n)?);
        let gy = n.div_ceil(DP4A_TOKENS as usize);
        ensure(gy <= MAX_GRID_Y, OP, || format!("{n} tokens in one call"))?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "row blocks", end)?, gy as u32, 1),
            block_dim: (ROW_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder(name);
        b.arg(xq).arg(&cols).arg(&n_i);
        let mut ys = ys.iter_mut();
        for i in 0..DP4A_GROUP {
            match ws.get(i) {
                Some(w) => b.arg(&w.data),
                // Never read: the member has no blocks.
                None => b.arg(xq),
            };
            b.arg(&rbs[i]);
            match ys.next() {
                Some(y) => b.arg(&mut **y),
                None => b.arg(&self.dummy),
            };
            // A null pointer for no bias (the kernel adds none).
            match biases.get(i).copied().flatten() {
                Some(bias) => b.arg(bias),
                None => b.arg(&NO_BIAS),
            };
            b.arg(&rows[i]).arg(&ends[i]);
        }
        // SAFETY: argument types match `matmul_dp4a_*` (xq, cols, n, then per member: weights,
        // row bytes, y, bias or null, rows, end of its row blocks); xq holds n rows of cols / 32
        // Q8_0 blocks, each y n rows of its matrix's rows, each bias its rows (checked by the
        // callers); members past `ws` have no blocks, so their pointers are never read.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The first `len` values of `x` (a multiple of 32) as Q8_0 blocks, exactly as
    /// `hmoe_quant::quantize_row(Q8_0, …)` (ggml's x86 quantiser) makes them from finite
    /// values: the activations of Q8_0 and MXFP4 products.
    pub fn quantize_q8_0(
        &self,
        x: &CudaSlice<f32>,
        len: usize,
    ) -> Result<CudaSlice<u8>, CudaError> {
        const OP: &str = "quantize_q8_0";
        ensure(len.is_multiple_of(32) && len <= x.len(), OP, || {
            format!("{len} values of a buffer of {} in blocks of 32", x.len())
        })?;
        let blocks = len / 32;
        // Scratch: every byte is written by the kernel below before it is read.
        let mut out = self.alloc_scratch::<u8>(blocks * 34)?;
        if blocks == 0 {
            return Ok(out);
        }
        let n_blocks = blocks as u64;
        let mut b = self.builder("quantize_q8_0");
        b.arg(x).arg(&mut out).arg(&n_blocks);
        // SAFETY: argument types match `quantize_q8_0`; x holds at least 32 × blocks values
        // and out 34 × blocks bytes.
        unsafe { b.launch(grid_1d(blocks, OP)?) }?;
        Ok(out)
    }

    /// The first `len` values of `x` as Q8_0 blocks ([`CudaDevice::quantize_q8_0`]) when
    /// `quantized` (the activations of Q8_0/MXFP4 weights), else none: the kernel reads `x`.
    fn q8_0_acts(
        &self,
        quantized: bool,
        x: &CudaSlice<f32>,
        len: usize,
    ) -> Result<Option<CudaSlice<u8>>, CudaError> {
        Ok(match quantized {
            true => Some(self.quantize_q8_0(x, len)?),
            false => None,
        })
    }

    /// [`CudaDevice::matmul`] for a batch of Q8_0 or MXFP4 weights (checked there): the tiled
    /// kernel ([`tiled_kernel`]: int8 tensor cores from sm_80, else `__dp4a`), up to
    /// TILE_SLOTS tokens per block, with the GEMV kernel's bits.
    fn matmul_tiled(
        &self,
        w: &DeviceMatrix,
        xq: &CudaSlice<u8>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul";
        let kernel = tiled_kernel(w.ty, false, self.info.compute_capability);
        let (rows, nb, n_i) = (
            i32_of(OP, "rows", w.rows)?,
            i32_of(OP, "blocks per row", w.cols / 32)?,
            i32_of(OP, "tokens", n)?,
        );
        let cfg = rows_by_tokens(
            OP,
            (w.rows, kernel.rows_per_block),
            (n, TILE_SLOTS),
            kernel.threads,
        )?;
        let row_bytes = w.row_bytes as u64;
        let mut b = self.builder(kernel.name);
        b.arg(&w.data)
            .arg(&row_bytes)
            .arg(&rows)
            .arg(&nb)
            .arg(xq)
            .arg(&n_i)
            .arg(y);
        // SAFETY: argument types match `matmul_tiled_*` and `matmul_mma_*`; xq holds n rows of
        // nb Q8_0 blocks and y n rows of w.rows (checked by the caller).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn matmul_cublas(
        &self,
        blas: &CudaBlas,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul (cuBLAS)";
        use blas_sys::cudaDataType_t as Dt;
        // Row-major W [rows × cols] is column-major [cols × rows]: C = Wᵀ·X in cuBLAS terms,
        // with X column-major [cols × n] and Y column-major [rows × n].
        let (m, k, nn) = (
            i32_of(OP, "rows", w.rows)?,
            i32_of(OP, "cols", w.cols)?,
            i32_of(OP, "tokens", n)?,
        );
        // The activations in the weight's 16-bit type (F16 or BF16: `matmul` sends only those).
        let (name, dt) = if w.ty == GgmlType::F16 {
            ("f32_to_f16", Dt::CUDA_R_16F)
        } else {
            ("f32_to_bf16", Dt::CUDA_R_16BF)
        };
        let len = n * w.cols;
        // Scratch: every element is written by the conversion kernel before use.
        let mut converted = self.alloc_scratch::<u16>(len)?;
        let len64 = len as u64;
        let mut b = self.builder(name);
        b.arg(x).arg(&mut converted).arg(&len64);
        // SAFETY: argument types match `f32_to_f16`/`f32_to_bf16`; both hold `len`.
        unsafe { b.launch(grid_1d(len, OP)?) }?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _wg) = w.data.device_ptr(&self.stream);
        let (xp, _xg) = converted.device_ptr(&self.stream);
        let (yp, _yg) = y.device_ptr_mut(&self.stream);
        // SAFETY: the pointers are live device buffers of the sizes checked by `matmul`
        // (W rows × cols of `dt`, X n × cols of `dt`, Y n × rows f32); the guards keep the
        // stream ordering for the duration of the call; the handle is bound to our stream.
        unsafe {
            blas_result::gemm_ex(
                *blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                nn,
                k,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                dt,
                k,
                xp as *const _,
                dt,
                k,
                (&beta) as *const f32 as *const _,
                yp as *mut _,
                Dt::CUDA_R_32F,
                m,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    /// Per-head products (see `hmoe_backend::Backend::matmul_heads`): `out` rows per head;
    /// F32, F16, BF16, Q8_0, MXFP4 and the low-bit weights ([`crate::LOWBIT_TYPES`], in the
    /// CPU device's orders for each head's batch).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_heads(
        &self,
        w: &DeviceMatrix,
        x: &CudaSlice<f32>,
        n: usize,
        n_heads: usize,
        x_stride: usize,
        out: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul_heads";
        if is_lowbit(w.ty) {
            return self.matmul_heads_lowbit(w, x, n, n_heads, x_stride, out, y);
        }
        let quantized = matches!(w.ty, GgmlType::Q8_0 | GgmlType::MXFP4);
        ensure(!quantized || x_stride.is_multiple_of(32), OP, || {
            format!("a stride of {x_stride} is not whole Q8_0 blocks")
        })?;
        let n_rows = n * n_heads;
        if n_rows == 0 || out == 0 {
            return Ok(());
        }
        ensure(n_rows <= MAX_GRID_Y, OP, || {
            format!("{n_rows} head rows in one call")
        })?;
        let name = match w.ty {
            GgmlType::F32 => "matmul_heads_f32",
            GgmlType::F16 => "matmul_heads_f16",
            GgmlType::BF16 => "matmul_heads_bf16",
            GgmlType::Q8_0 => "matmul_heads_q8_0",
            _ => "matmul_heads_mxfp4",
        };
        let row_bytes = w.row_bytes as u64;
        let ints = [
            i32_of(OP, "rows per head", out)?,
            i32_of(OP, "cols", w.cols)?,
            i32_of(OP, "head rows", n_rows)?,
            i32_of(OP, "heads", n_heads)?,
            i32_of(OP, "stride", x_stride)?,
            i32::from(!(x_stride == w.cols && n > 1)),
        ];
        let cfg = LaunchConfig {
            grid_dim: (
                u32_of(OP, "row blocks", out.div_ceil(ROW_WARPS as usize))?,
                n_rows as u32,
                1,
            ),
            block_dim: (ROW_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let xq = self.q8_0_acts(quantized, x, n_rows * x_stride)?;
        let mut b = self.builder(name);
        b.arg(&w.data).arg(&row_bytes);
        push_acts(&mut b, xq.as_ref(), x);
        b.arg(y);
        for v in &ints {
            b.arg(v);
        }
        // SAFETY: argument types match `matmul_heads_*` (x as Q8_0 blocks for Q8_0/MXFP4
        // weights, f32 otherwise); the caller checked x and y against the shape.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
