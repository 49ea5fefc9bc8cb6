//! The CPU device's row kernels: RMSNorm, bias, softmax, SwiGLU, and matmul over quantized
//! weights. Numerics follow ggml's CPU backend so that results match llama.cpp's: activations
//! are converted to the weight type's dot format once per row, norms and softmax sums
//! accumulate in f64.

use hmoe_backend::numerics::hsum16;
use hmoe_pool::ColumnBlock;
use hmoe_quant::{BatchKind, DotKernel, GemmKernel, GgmlType};

/// `out = x / sqrt(mean(x²) + eps) * weight`, one row of `weight.len()` elements at a time.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (row, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        // Squares in f32, accumulated in f64, as ggml does.
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((d, &v), &w) in dst.iter_mut().zip(row).zip(weight) {
            *d = v * scale * w;
        }
    }
}

/// Adds `bias` to every row of `x`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// Activations converted to the dot format of one weight type, one row per token.
#[derive(Default)]
pub struct QuantizedActs {
    ty: Option<GgmlType>,
    n: usize,
    row_bytes: usize,
    data: Vec<u8>,
}

impl QuantizedActs {
    /// Converts each `n`-element row of `x` into `ty` (the weights' vec-dot type).
    pub fn quantize(&mut self, ty: GgmlType, x: &[f32], n: usize) {
        let row_bytes = ty
            .row_bytes(n as u64)
            .expect("row length is a whole number of blocks") as usize;
        let rows = x.len() / n;
        self.ty = Some(ty);
        self.n = n;
        self.row_bytes = row_bytes;
        self.data.resize(rows * row_bytes, 0);
        hmoe_pool::global().for_each_chunk_mut(&mut self.data, row_bytes, |r, dst| {
            let src = &x[r * n..(r + 1) * n];
            hmoe_quant::quantize_row(ty, src, dst).expect("sizes checked above");
        });
    }

    /// Number of rows held.
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.row_bytes).unwrap_or(0)
    }

    /// The bytes of row `i`.
    pub fn row(&self, i: usize) -> &[u8] {
        &self.data[i * self.row_bytes..(i + 1) * self.row_bytes]
    }

    /// Copies the selected rows of `src` into `self` (gathering the tokens routed to one expert).
    pub fn gather(&mut self, src: &QuantizedActs, rows: impl Iterator<Item = usize>) {
        self.ty = src.ty;
        self.n = src.n;
        self.row_bytes = src.row_bytes;
        self.data.clear();
        for r in rows {
            self.data.extend_from_slice(src.row(r));
        }
    }
}

/// Rows of output computed per parallel task.
const ROWS_PER_TASK: usize = 16;

/// Rows per task for the GEMM kernels (enough work to amortise the scheduling), and for
/// single-token Q8_0 and Q5_0 products, whose VNNI kernels prepare the activation row once
/// per call (64 rows read about 5% faster from cache than 16).
const GEMM_ROWS: usize = 64;

/// One token's activation row prepared for products with the rows of one weight matrix, in
/// the order [`matmul`] uses for a single token: the block-wise GEMM kernel for MXFP4 (as
/// llama.cpp's repacked kernels), [`DotKernel::dot_rows`] for the other types. Shared by the
/// threads of a job, each computing its own blocks of rows with [`RowProduct::rows`].
pub struct RowProduct<'a> {
    kernel: DotKernel,
    n_in: usize,
    act: &'a [u8],
    gemm: Option<(GemmKernel, hmoe_quant::GemmActs<'a>)>,
}

impl<'a> RowProduct<'a> {
    /// Prepares `act` (one row of `n_in` elements in `kernel`'s activation type).
    pub fn new(kernel: DotKernel, n_in: usize, act: &'a [u8]) -> RowProduct<'a> {
        Self::with_interleaved(kernel, None, n_in, act)
    }

    /// [`RowProduct::new`] for weight rows interleaved for `interleaved` (MXFP4 rows in groups
    /// of 16, [`GemmKernel::interleave_into`]) when it is given.
    pub fn with_interleaved(
        kernel: DotKernel,
        interleaved: Option<GemmKernel>,
        n_in: usize,
        act: &'a [u8],
    ) -> RowProduct<'a> {
        let gemm = (kernel.weight_type() == GgmlType::MXFP4).then(|| {
            let g = interleaved.unwrap_or_else(|| {
                GemmKernel::new(GgmlType::MXFP4, kernel.isa())
                    .expect("MXFP4 has GEMM kernels on every ISA")
            });
            let p = g
                .prepare(n_in, act, 1)
                .expect("activations converted for these weights");
            (g, p)
        });
        RowProduct {
            kernel,
            n_in,
            act,
            gemm,
        }
    }

    /// Rows per task that amortise the scheduling for this kernel.
    pub fn rows_per_task(&self) -> usize {
        if self.gemm.is_some()
            || matches!(self.kernel.weight_type(), GgmlType::Q8_0 | GgmlType::Q5_0)
        {
            GEMM_ROWS
        } else {
            ROWS_PER_TASK
        }
    }

    /// `out[i] = W[i] · act` for the `out.len()` whole weight rows in `w_rows`.
    pub fn rows(&self, w_rows: &[u8], out: &mut [f32]) {
        match &self.gemm {
            Some((g, p)) => g.gemm(w_rows, p, out).expect("whole rows"),
            None => self.kernel.dot_rows(self.n_in, w_rows, self.act, out),
        }
    }
}

/// `out[t][r] = W[r] · x[t]` for a weight matrix `w` of `n_out` rows (each `row_bytes` long)
/// and the quantized activations `acts`; `out` is `[tokens][n_out]`.
pub fn matmul(
    kernel: DotKernel,
    w: &[u8],
    n_in: usize,
    n_out: usize,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    matmul_as(BatchKind::Dense, kernel, None, w, n_in, n_out, acts, out)
}

/// [`matmul`] as part of a `kind` operation: the order in which llama.cpp sums a batch of
/// K-quant or repacked Q4_K products depends on it ([`DotKernel::dot_tokens`]); over rows
/// interleaved for `interleaved` (MXFP4, [`GemmKernel::interleave_into`]; whole groups of 16
/// rows per task) when it is given, with the same bits.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_as(
    kind: BatchKind,
    kernel: DotKernel,
    interleaved: Option<GemmKernel>,
    w: &[u8],
    n_in: usize,
    n_out: usize,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    debug_assert_eq!(acts.ty, Some(kernel.act_type()));
    debug_assert_eq!(acts.n, n_in);
    let row_bytes = w.len() / n_out;
    let n_tokens = acts.rows();
    debug_assert_eq!(out.len(), n_tokens * n_out);
    if n_tokens == 0 {
        return;
    }
    let ty = kernel.weight_type();
    // Debug builds check the first output against the plain definitions below.
    let check_first = |got: f32| {
        // (Interleaved rows are not rows; the quant tests hold their kernel to these bits.)
        if interleaved.is_some() {
            return true;
        }
        let (w0, a0) = (&w[..row_bytes], acts.row(0));
        let want = match ty {
            GgmlType::MXFP4 => dot_mxfp4_blockwise(w0, a0),
            GgmlType::F32 if n_tokens > 1 => dot_f32_lanes(w0, a0),
            _ if n_tokens > 1 => {
                let mut col = vec![0f32; n_tokens];
                kernel.dot_tokens(kind, n_in, w0, &acts.data, &mut col);
                col[0]
            }
            _ => kernel.dot(n_in, w0, a0),
        };
        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan())
    };
    if n_tokens == 1 {
        let product = RowProduct::with_interleaved(kernel, interleaved, n_in, acts.row(0));
        let rows_per_task = product.rows_per_task();
        hmoe_pool::global().for_each_chunk_mut(out, rows_per_task, |chunk, dst| {
            let r0 = chunk * rows_per_task;
            product.rows(&w[r0 * row_bytes..(r0 + dst.len()) * row_bytes], dst);
        });
        debug_assert!(check_first(out[0]), "matmul differs from the reference");
        return;
    }
    // MXFP4 always runs the GEMM kernels (llama.cpp's block-wise order); Q8_0, Q4_0, Q4_1,
    // Q5_0, Q5_1 and F32 batches their tiles (in `vec_dot` order, F32 in tinyBLAS's 16 lanes),
    // except where the kernel has the repacked order (Q4_0 of whole groups of 8 rows).
    let gemm = (GemmKernel::supports(ty) && !kernel.is_repacked()).then(|| {
        interleaved.unwrap_or_else(|| {
            GemmKernel::new(ty, kernel.isa()).expect("the type has GEMM kernels on every ISA")
        })
    });
    let prep = gemm.map(|g| {
        g.prepare(n_in, &acts.data, n_tokens)
            .expect("activations converted for these weights")
    });
    // K-quant batches decode each weight super-block once for the tokens, like the GEMMs
    // (the tokens rearranged once per matmul, below): twice the rows.
    let rows_per_task = match (gemm.is_some(), ty.is_k_quant()) {
        (_, true) => 2 * GEMM_ROWS,
        (true, false) => GEMM_ROWS,
        (false, false) => ROWS_PER_TASK,
    };
    // The tokens prepared once for every task's rows (tiled K-quants, repacked Q4_K, IQ).
    let tokens = gemm
        .is_none()
        .then(|| kernel.prepare_token_rows(kind, n_in, &acts.data, n_tokens));
    // Batch: each task owns a block of weight rows and runs every token through it, so the
    // weights are read once. The kernels give the block's results as `[row][token]`, in a
    // per-thread scratch that stays in cache while the task writes them into its columns of
    // `out` (no matrix-sized buffer, no pass over the whole result afterwards).
    hmoe_pool::global().for_each_column_block_mut(out, n_out, rows_per_task, |_, cols| {
        let (r0, rows) = (cols.first_col(), cols.cols());
        let w_rows = &w[r0 * row_bytes..(r0 + rows) * row_bytes];
        BLOCK_RESULTS.with_borrow_mut(|res| {
            // Grown, never cleared: the kernels write every result.
            if res.len() < rows * n_tokens {
                res.resize(rows * n_tokens, 0.0);
            }
            let res = &mut res[..rows * n_tokens];
            if let (Some(g), Some(p)) = (&gemm, &prep) {
                g.gemm(w_rows, p, res).expect("whole rows");
            } else {
                // Each token in llama.cpp's order for a batch of this size (tiled K-quants,
                // repacked Q4_K); `vec_dot` for the other types.
                let tokens = tokens
                    .as_ref()
                    .expect("prepared where there is no GEMM kernel");
                kernel.dot_token_rows(tokens, w_rows, res);
            }
            if r0 == 0 {
                debug_assert!(check_first(res[0]), "matmul differs from the reference");
            }
            transpose_into(res, rows, n_tokens, cols);
        });
    });
}

/// Writes `res` (`[row][token]`, `rows` × `n_tokens`) into `cols` (row `t` of `cols` takes
/// token `t`'s results), in tiles of 8 rows × 8 tokens: each tile is 8 reads and 8 writes of
/// 8 consecutive values (a walk down a column strides by `n_tokens` and thrashes L1's sets).
fn transpose_into(res: &[f32], rows: usize, n_tokens: usize, cols: &mut ColumnBlock<'_, f32>) {
    const T: usize = 8;
    for i0 in (0..rows).step_by(T) {
        let ib = (rows - i0).min(T);
        for t0 in (0..n_tokens).step_by(T) {
            let tb = (n_tokens - t0).min(T);
            let mut tile = [[0f32; T]; T];
            for (k, tile) in tile.iter_mut().enumerate().take(ib) {
                let src = &res[(i0 + k) * n_tokens + t0..][..tb];
                tile[..tb].copy_from_slice(src);
            }
            for j in 0..tb {
                let dst = &mut cols.row(t0 + j)[i0..i0 + ib];
                for (d, tile) in dst.iter_mut().zip(&tile) {
                    *d = tile[j];
                }
            }
        }
    }
}

thread_local! {
    /// A batch task's results, `[row][token]` (see [`matmul_as`]).
    static BLOCK_RESULTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`matmul`] with every product in the order of ggml's `vec_dot` kernels, which is what ggml
/// computes where tinyBLAS is not used for a batch: expert matmuls (`mul_mat_id`) and products
/// with a non-contiguous activation (MLA's permuted `q_nope`). Differs from [`matmul`] only for
/// batches of F32 weights, and of repacked Q4_K (`mul_mat_id` sums every token like one).
pub fn matmul_vec_dot(
    kernel: DotKernel,
    w: &[u8],
    n_in: usize,
    n_out: usize,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    if kernel.weight_type() != GgmlType::F32 || acts.rows() <= 1 {
        return matmul_as(BatchKind::Expert, kernel, None, w, n_in, n_out, acts, out);
    }
    hmoe_pool::global().for_each_chunk_mut(out, n_out, |t, dst| {
        kernel.dot_rows(n_in, w, acts.row(t), dst)
    });
}

/// F32 dot product in the order ggml's tinyBLAS uses for multi-token batches: 16 FMA lanes
/// over the row, then a horizontal sum (single tokens go through `vec_dot_f32` instead, which
/// is what [`DotKernel::dot`] computes). Only small tensors (router, norms) are F32.
fn dot_f32_lanes(w: &[u8], a: &[u8]) -> f32 {
    let read = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut lanes = [0f32; 16];
    for (cw, ca) in w.chunks(64).zip(a.chunks(64)) {
        for (i, (x, y)) in cw.chunks_exact(4).zip(ca.chunks_exact(4)).enumerate() {
            lanes[i] = read(x).mul_add(read(y), lanes[i]);
        }
    }
    hsum16(&lanes)
}

/// MXFP4 × Q8_0 as ggml's repacked CPU kernels sum it: an exact integer dot per block, then
/// one FMA per block into a single accumulator, in block order.
fn dot_mxfp4_blockwise(w: &[u8], a: &[u8]) -> f32 {
    const VALUES: [i32; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
    let mut acc = 0f32;
    for (wb, ab) in w.chunks_exact(17).zip(a.chunks_exact(34)) {
        let e = wb[0] as u32;
        let w_scale = f32::from_bits(if e >= 2 {
            (e - 1) << 23
        } else {
            0x0020_0000 << e
        });
        let a_scale = half::f16::from_le_bytes([ab[0], ab[1]]).to_f32();
        let mut isum = 0i32;
        for j in 0..16 {
            let q = wb[1 + j];
            isum += VALUES[(q & 15) as usize] * ab[2 + j] as i8 as i32;
            isum += VALUES[(q >> 4) as usize] * ab[18 + j] as i8 as i32;
        }
        acc = (isum as f32).mul_add(w_scale * a_scale, acc);
    }
    acc
}

/// In-place softmax of one row; the sum accumulates in f64 like ggml.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// SwiGLU in place, `gate[i] = silu(gate[i]) · up[i]`, row by row (`n` elements a row) as
/// ggml's AVX-512 `ggml_vec_swiglu_f32`: blocks of 16 use `x / (1 + e^−x)` with the vectorised
/// exponential, the remainder of each row libm's `expf`.
pub fn swiglu(gate: &mut [f32], up: &[f32], n: usize) {
    hmoe_pool::global().for_each_chunk_mut(gate, n, |r, g| {
        hmoe_backend::numerics::swiglu_row(g, &up[r * n..(r + 1) * n])
    });
}
