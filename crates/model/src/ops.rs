//! CPU building blocks shared by the architectures: RMSNorm, RoPE with YaRN, matmul over
//! quantized weights, softmax, top-k. Numerics follow ggml's CPU backend so that results match
//! llama.cpp's: activations are converted to the weight type's dot format once per row, norms
//! and softmax sums accumulate in f64.

use hmoe_gguf::GgufModel;
use hmoe_quant::{BatchKind, DotKernel, GgmlType};

use crate::weights::{project, Mat};

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

/// Rows per task for the GEMM kernels (enough work to amortise the scheduling).
const GEMM_ROWS: usize = 64;

/// One token's activation row prepared for products with the rows of one weight matrix, in
/// the order [`matmul`] uses for a single token: the block-wise GEMM kernel for MXFP4 (as
/// llama.cpp's repacked kernels), [`DotKernel::dot_rows`] for the other types. Shared by the
/// threads of a job, each computing its own blocks of rows with [`RowProduct::rows`].
pub(crate) struct RowProduct<'a> {
    kernel: DotKernel,
    n_in: usize,
    act: &'a [u8],
    gemm: Option<(hmoe_quant::GemmKernel, hmoe_quant::GemmActs<'a>)>,
}

impl<'a> RowProduct<'a> {
    /// Prepares `act` (one row of `n_in` elements in `kernel`'s activation type).
    pub(crate) fn new(kernel: DotKernel, n_in: usize, act: &'a [u8]) -> RowProduct<'a> {
        let gemm = (kernel.weight_type() == GgmlType::MXFP4).then(|| {
            let g = hmoe_quant::GemmKernel::new(GgmlType::MXFP4, kernel.isa())
                .expect("MXFP4 has GEMM kernels on every ISA");
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
    pub(crate) fn rows_per_task(&self) -> usize {
        if self.gemm.is_some() {
            GEMM_ROWS
        } else {
            ROWS_PER_TASK
        }
    }

    /// `out[i] = W[i] · act` for the `out.len()` whole weight rows in `w_rows`.
    pub(crate) fn rows(&self, w_rows: &[u8], out: &mut [f32]) {
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
    matmul_as(BatchKind::Dense, kernel, w, n_in, n_out, acts, out)
}

/// [`matmul`] as part of a `kind` operation: the order in which llama.cpp sums a batch of
/// K-quant or repacked Q4_K products depends on it ([`DotKernel::dot_tokens`]).
fn matmul_as(
    kind: BatchKind,
    kernel: DotKernel,
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
        let product = RowProduct::new(kernel, n_in, acts.row(0));
        let rows_per_task = product.rows_per_task();
        hmoe_pool::global().for_each_chunk_mut(out, rows_per_task, |chunk, dst| {
            let r0 = chunk * rows_per_task;
            product.rows(&w[r0 * row_bytes..(r0 + dst.len()) * row_bytes], dst);
        });
        debug_assert!(check_first(out[0]), "matmul differs from the reference");
        return;
    }
    // MXFP4 always runs the GEMM kernels (llama.cpp's block-wise order), Q8_0 and F32 batches
    // their tiles (Q8_0 in `vec_dot` order, F32 in tinyBLAS's 16-lane order).
    let gemm = matches!(ty, GgmlType::MXFP4 | GgmlType::Q8_0 | GgmlType::F32).then(|| {
        hmoe_quant::GemmKernel::new(ty, kernel.isa())
            .expect("MXFP4, Q8_0 and F32 have GEMM kernels on every ISA")
    });
    let prep = gemm.map(|g| {
        g.prepare(n_in, &acts.data, n_tokens)
            .expect("activations converted for these weights")
    });
    let rows_per_task = if gemm.is_some() {
        GEMM_ROWS
    } else {
        ROWS_PER_TASK
    };
    // Batch: each task owns a block of weight rows and runs every token through it, so the
    // weights are read once; the result is produced transposed and then laid out per token.
    let mut transposed = vec![0f32; n_out * n_tokens];
    hmoe_pool::global().for_each_chunk_mut(
        &mut transposed,
        rows_per_task * n_tokens,
        |chunk, dst| {
            let r0 = chunk * rows_per_task;
            let rows = dst.len() / n_tokens;
            if let (Some(g), Some(p)) = (&gemm, &prep) {
                let w_rows = &w[r0 * row_bytes..(r0 + rows) * row_bytes];
                g.gemm(w_rows, p, dst).expect("whole rows");
                return;
            }
            for (i, dst_row) in dst.chunks_exact_mut(n_tokens).enumerate() {
                let wrow = &w[(r0 + i) * row_bytes..(r0 + i + 1) * row_bytes];
                // Each token in llama.cpp's order for a batch of this size (tiled K-quants,
                // repacked Q4_K); `vec_dot` for the other types.
                kernel.dot_tokens(kind, n_in, wrow, &acts.data, dst_row);
            }
        },
    );
    debug_assert!(
        check_first(transposed[0]),
        "matmul differs from the reference"
    );
    // Transposed back in blocks of rows, so reads and writes both stay in cache.
    for (rb, block) in transposed.chunks(64 * n_tokens).enumerate() {
        for (t, dst) in out.chunks_exact_mut(n_out).enumerate() {
            for (i, col) in block.chunks_exact(n_tokens).enumerate() {
                dst[rb * 64 + i] = col[t];
            }
        }
    }
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
        return matmul_as(BatchKind::Expert, kernel, w, n_in, n_out, acts, out);
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

/// RoPE in NeoX layout (rotating the two halves of each head) with YaRN context extension,
/// computed the way ggml does (including its floor/ceil of the correction dims).
#[derive(Clone, Debug)]
pub struct Rope {
    n_dims: usize,
    theta_scale: f32,
    freq_scale: f32,
    ext_factor: f32,
    attn_factor: f32,
    corr_dims: [f32; 2],
    /// Per-pair divisors of the base frequencies (llama 3's `rope_freqs.weight`).
    freq_factors: Option<Vec<f32>>,
}

impl Rope {
    /// RoPE over `n_dims` dims with base `freq_base`. `yarn` is `(factor, original_ctx)` when
    /// the model uses YaRN scaling (beta_fast 32, beta_slow 1, as gpt-oss and llama.cpp).
    pub fn new(n_dims: usize, freq_base: f32, yarn: Option<(f32, u32)>) -> Rope {
        let theta_scale = freq_base.powf(-2.0 / n_dims as f32);
        match yarn {
            None => Rope {
                n_dims,
                theta_scale,
                freq_scale: 1.0,
                ext_factor: 0.0,
                attn_factor: 1.0,
                corr_dims: [0.0, 0.0],
                freq_factors: None,
            },
            Some((factor, n_ctx_orig)) => {
                let freq_scale = 1.0 / factor;
                // llama.cpp hands ggml an attention factor that cancels the YaRN magnitude
                // ggml multiplies in below, then ggml applies 1 + 0.1·ln(factor) itself.
                let mscale = 0.1 * factor.ln() + 1.0;
                let attn_factor = mscale * (1.0 / (1.0 + 0.1 * factor.ln()));
                Rope {
                    n_dims,
                    theta_scale,
                    freq_scale,
                    ext_factor: 1.0,
                    attn_factor,
                    corr_dims: yarn_corr_dims(n_dims, n_ctx_orig, freq_base, 32.0, 1.0),
                    freq_factors: None,
                }
            }
        }
    }

    /// The `(cos, sin)` pairs for position `pos`, one per rotated pair.
    pub fn cache(&self, pos: usize, out: &mut Vec<(f32, f32)>) {
        out.clear();
        let mut theta = pos as f32;
        for i0 in (0..self.n_dims).step_by(2) {
            let ff = self.freq_factors.as_ref().map_or(1.0, |f| f[i0 / 2]);
            out.push(self.yarn(theta / ff, i0));
            theta *= self.theta_scale;
        }
    }

    /// These parameters in the form of the device contract's RoPE ops, whose cos/sin are
    /// this cache's bit for bit; `None` with frequency factors, which the contract lacks.
    pub fn device_params(&self) -> Option<hmoe_backend::RopeParams> {
        self.freq_factors
            .is_none()
            .then_some(hmoe_backend::RopeParams {
                n_dims: self.n_dims,
                theta_scale: self.theta_scale,
                freq_scale: self.freq_scale,
                ext_factor: self.ext_factor,
                attn_factor: self.attn_factor,
                corr_dims: self.corr_dims,
            })
    }

    /// The `(cos, sin)` tables of `n` consecutive positions starting at `pos0` (one batch).
    pub fn caches(&self, pos0: usize, n: usize) -> Vec<Vec<(f32, f32)>> {
        (pos0..pos0 + n)
            .map(|pos| {
                let mut cs = Vec::new();
                self.cache(pos, &mut cs);
                cs
            })
            .collect()
    }

    fn yarn(&self, theta_extrap: f32, i0: usize) -> (f32, f32) {
        let theta_interp = self.freq_scale * theta_extrap;
        let mut theta = theta_interp;
        let mut mscale = self.attn_factor;
        if self.ext_factor != 0.0 {
            let ramp_mix = yarn_ramp(self.corr_dims[0], self.corr_dims[1], i0) * self.ext_factor;
            theta = theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix;
            mscale *= 1.0 + 0.1 * (1.0 / self.freq_scale).ln();
        }
        (theta.cos() * mscale, theta.sin() * mscale)
    }

    /// Rotates every `head_dim`-sized head in `x` (NeoX: element i pairs with i + n_dims/2).
    pub fn apply_neox(&self, x: &mut [f32], head_dim: usize, cs: &[(f32, f32)]) {
        let half = self.n_dims / 2;
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let x0 = head[i];
                let x1 = head[i + half];
                // ggml's build contracts these into FMAs; so do we, for identical bits.
                head[i] = x0.mul_add(c, -(x1 * s));
                head[i + half] = x0.mul_add(s, x1 * c);
            }
        }
    }

    /// RoPE over `n_dims` dims with base `freq_base` and the given context scaling, with the
    /// parameters llama.cpp hands to `ggml_rope_ext`.
    pub fn scaled(n_dims: usize, freq_base: f32, scaling: RopeScaling) -> Rope {
        let mut rope = Rope::new(n_dims, freq_base, None);
        match scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => rope.freq_scale = 1.0 / factor,
            RopeScaling::Yarn {
                factor,
                n_ctx_orig,
                attn_factor,
                beta_fast,
                beta_slow,
            } => {
                rope.freq_scale = 1.0 / factor;
                rope.ext_factor = 1.0;
                rope.attn_factor = attn_factor;
                rope.corr_dims =
                    yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow);
            }
        }
        rope
    }

    /// Divides the frequency of rotated pair `i` by `factors[i]` (llama 3's `rope_freqs`);
    /// `factors` must hold `n_dims / 2` values.
    pub fn with_freq_factors(mut self, factors: Vec<f32>) -> Rope {
        debug_assert_eq!(factors.len(), self.n_dims / 2);
        self.freq_factors = Some(factors);
        self
    }

    /// Rotates every `head_dim`-sized head in `x` in the "normal" (GPT-J) layout: element
    /// `2i` pairs with `2i + 1`. Dims past `n_dims` are left as they are.
    pub fn apply_norm(&self, x: &mut [f32], head_dim: usize, cs: &[(f32, f32)]) {
        for head in x.chunks_exact_mut(head_dim) {
            for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(cs) {
                let (x0, x1) = (pair[0], pair[1]);
                // The same FMA contraction as `apply_neox` (what GCC makes of ggml's rope).
                pair[0] = x0.mul_add(c, -(x1 * s));
                pair[1] = x0.mul_add(s, x1 * c);
            }
        }
    }

    /// Rotates with the layout of `mode`.
    pub fn apply(&self, mode: RopeMode, x: &mut [f32], head_dim: usize, cs: &[(f32, f32)]) {
        match mode {
            RopeMode::Norm => self.apply_norm(x, head_dim, cs),
            RopeMode::Neox => self.apply_neox(x, head_dim, cs),
        }
    }
}

/// Which elements of a head RoPE rotates together (llama.cpp's rope type of an architecture).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// Consecutive pairs `(2i, 2i+1)` (llama, deepseek2).
    Norm,
    /// Halves `(i, i + n_dims/2)` (qwen2, qwen3moe, gpt-oss).
    Neox,
}

/// How a model stretches RoPE past its training context (GGUF `rope.scaling.*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// The scaling factor.
        factor: f32,
    },
    /// YaRN: interpolation blended with extrapolation between the correction dims.
    Yarn {
        /// The scaling factor.
        factor: f32,
        /// The context the model was pre-trained with.
        n_ctx_orig: u32,
        /// Magnitude handed to ggml, which multiplies it by `1 + 0.1·ln(factor)`.
        attn_factor: f32,
        /// YaRN β_fast (32 by default).
        beta_fast: f32,
        /// YaRN β_slow (1 by default).
        beta_slow: f32,
    },
}

impl RopeScaling {
    /// Reads `ARCH.rope.scaling.*` the way llama.cpp's context does, including its YaRN
    /// attention factor (`get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`
    /// when `rope.scaling.yarn_log_multiplier` is set (deepseek2 files store it ×0.1), with
    /// deepseek2's special case, then
    /// divided by the `1 + 0.1·ln(factor)` ggml applies). `n_ctx_train` is the fallback for
    /// the original context length.
    pub fn from_metadata(
        meta: &hmoe_gguf::Metadata,
        arch: &str,
        n_ctx_train: u32,
    ) -> Result<RopeScaling, crate::ModelError> {
        let key = |k: &str| format!("{arch}.rope.scaling.{k}");
        let factor = meta.get_f32(&key("factor"));
        match meta.get_str(&key("type")) {
            None | Some("none") => Ok(RopeScaling::None),
            Some(_) if factor.is_none_or(|f| f == 0.0 || f == 1.0) => Ok(RopeScaling::None),
            Some("linear") => Ok(RopeScaling::Linear {
                factor: factor.unwrap_or(1.0),
            }),
            Some("yarn") => {
                let factor = factor.unwrap_or(1.0);
                let get_mscale = |scale: f32, mscale: f32| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * mscale * scale.ln() + 1.0
                    }
                };
                let mut log_mul = meta.get_f32(&key("yarn_log_multiplier")).unwrap_or(0.0);
                if arch == "deepseek2" {
                    // The converter stores 0.1·mscale_all_dim; llama.cpp's loader undoes the 0.1.
                    log_mul /= 0.1;
                }
                let mut attn_factor = if log_mul != 0.0 {
                    let mscale = if arch == "deepseek2" && log_mul != 1.0 {
                        log_mul
                    } else {
                        1.0
                    };
                    get_mscale(factor, mscale) / get_mscale(factor, log_mul)
                } else {
                    get_mscale(factor, 1.0)
                };
                attn_factor *= 1.0 / (1.0 + 0.1 * factor.ln());
                Ok(RopeScaling::Yarn {
                    factor,
                    n_ctx_orig: meta
                        .get_u32(&key("original_context_length"))
                        .unwrap_or(n_ctx_train),
                    attn_factor,
                    beta_fast: meta.get_f32(&key("yarn_beta_fast")).unwrap_or(32.0),
                    beta_slow: meta.get_f32(&key("yarn_beta_slow")).unwrap_or(1.0),
                })
            }
            Some(other) => Err(crate::ModelError::BadParam {
                key: key("type"),
                value: other.to_string(),
                why: "only none, linear and yarn are supported",
            }),
        }
    }

    /// The YaRN factor, if this is YaRN scaling.
    pub fn yarn_factor(&self) -> Option<f32> {
        match *self {
            RopeScaling::Yarn { factor, .. } => Some(factor),
            _ => None,
        }
    }
}

fn yarn_corr_dim(n_dims: usize, n_ctx_orig: u32, n_rot: f32, base: f32) -> f32 {
    n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
        / (2.0 * base.ln())
}

/// The dims between which YaRN blends interpolation and extrapolation, floored/ceiled as
/// ggml does (OpenAI's reference keeps them fractional).
fn yarn_corr_dims(
    n_dims: usize,
    n_ctx_orig: u32,
    base: f32,
    beta_fast: f32,
    beta_slow: f32,
) -> [f32; 2] {
    let start = yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, base).floor();
    let end = yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, base).ceil();
    [start.max(0.0), end.min(n_dims as f32 - 1.0)]
}

fn yarn_ramp(low: f32, high: f32, i0: usize) -> f32 {
    let y = ((i0 / 2) as f32 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

/// e^x as computed by ggml's vectorised exponential (shared with the reference device).
pub use hmoe_backend::numerics::{expf_ggml, hsum16};

/// Expert routing, shared with the reference device.
pub use hmoe_backend::routing::{gate_probs, sigmoid, softmax_ggml, top_k, Gating, Routing};

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

/// The embedding rows of `tokens` (ids already checked against the vocabulary), dequantized.
pub(crate) fn embed(g: &GgufModel, tok_embd: &Mat, tokens: &[u32]) -> Vec<f32> {
    let d = tok_embd.n_in;
    let mut x = vec![0f32; tokens.len() * d];
    for (dst, &id) in x.chunks_exact_mut(d).zip(tokens) {
        let row = &tok_embd.bytes(g)[id as usize * tok_embd.row_bytes..][..tok_embd.row_bytes];
        hmoe_quant::dequantize_row(tok_embd.info.ty, row, dst)
            .expect("embedding row size checked at load");
    }
    x
}

/// Dense SwiGLU feed-forward: `Wd · (silu(Wg·h) ⊙ Wu·h)` for every row of `h`.
pub(crate) fn ffn_swiglu(
    g: &GgufModel,
    gate: &Mat,
    up: &Mat,
    down: &Mat,
    h: &[f32],
    acts: &mut QuantizedActs,
) -> Vec<f32> {
    let u = project(g, up, h, acts);
    let mut gt = project(g, gate, h, acts);
    swiglu(&mut gt, &u, gate.n_out);
    project(g, down, &gt, acts)
}

/// Routed SwiGLU experts: `y_t = Σ_s w[t][s] · expert_{sel[t][s]}(h_t)` with
/// `expert_e(h) = Wd_e · (silu(Wg_e·h) ⊙ Wu_e·h)`, `k_used` slots per token. Tokens are grouped
/// by expert so each expert's weights are read once per batch; products in `vec_dot` order
/// (ggml's `mul_mat_id`); the weighted outputs are added in slot order, as llama.cpp does.
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_swiglu(
    g: &GgufModel,
    gate_exps: &Mat,
    up_exps: &Mat,
    down_exps: &Mat,
    h: &[f32],
    selected: &[usize],
    weights: &[f32],
    k_used: usize,
    acts: &mut QuantizedActs,
) -> Vec<f32> {
    let (d, ff) = (gate_exps.n_in, gate_exps.n_out);
    let n = h.len() / d;
    acts.quantize(gate_exps.kernel.act_type(), h, d);
    let mut per_slot = vec![0f32; n * k_used * d];
    let (mut routed, mut act_q) = (QuantizedActs::default(), QuantizedActs::default());
    let n_expert = gate_exps.info.dims.get(2).copied().unwrap_or(1) as usize;
    for e in 0..n_expert {
        let slots: Vec<usize> = (0..n * k_used).filter(|&i| selected[i] == e).collect();
        if slots.is_empty() {
            continue;
        }
        let m = slots.len();
        routed.gather(acts, slots.iter().map(|&i| i / k_used));
        let mut gate = vec![0f32; m * ff];
        let mut up = vec![0f32; m * ff];
        matmul_vec_dot(
            gate_exps.kernel,
            gate_exps.slice(g, e),
            d,
            ff,
            &routed,
            &mut gate,
        );
        if up_exps.kernel.act_type() == gate_exps.kernel.act_type() {
            matmul_vec_dot(up_exps.kernel, up_exps.slice(g, e), d, ff, &routed, &mut up);
        } else {
            let rows: Vec<f32> = slots
                .iter()
                .flat_map(|&i| h[(i / k_used) * d..][..d].iter().copied())
                .collect();
            act_q.quantize(up_exps.kernel.act_type(), &rows, d);
            matmul_vec_dot(up_exps.kernel, up_exps.slice(g, e), d, ff, &act_q, &mut up);
        }
        swiglu(&mut gate, &up, ff);
        act_q.quantize(down_exps.kernel.act_type(), &gate, ff);
        let mut down = vec![0f32; m * d];
        matmul_vec_dot(
            down_exps.kernel,
            down_exps.slice(g, e),
            ff,
            d,
            &act_q,
            &mut down,
        );
        for (row, &slot) in down.chunks_exact(d).zip(&slots) {
            per_slot[slot * d..(slot + 1) * d].copy_from_slice(row);
        }
    }
    let mut out = vec![0f32; n * d];
    for (t, dst) in out.chunks_exact_mut(d).enumerate() {
        for s in 0..k_used {
            let w = weights[t * k_used + s];
            let src = &per_slot[(t * k_used + s) * d..][..d];
            for (o, &v) in dst.iter_mut().zip(src) {
                *o += v * w;
            }
        }
    }
    out
}

/// Bias-less routed SwiGLU experts of a device layer run on the host ([`moe_swiglu`] over the
/// stacked `[gate, up, down]` experts): each sequence of `batch` (its `groups`) alone, as the
/// CPU engine's forward pass runs it, into `out` (`n_tokens × n_embd`).
pub(crate) fn moe_swiglu_per_seq(
    g: &GgufModel,
    [gate_exps, up_exps, down_exps]: [&Mat; 3],
    batch: &crate::hybrid::ExpertBatch<'_>,
    out: &mut [f32],
) {
    let (d, k) = (gate_exps.n_in, batch.n_used);
    let mut acts = QuantizedActs::default();
    for r in batch.groups {
        let sel: Vec<usize> = batch.selected[r.start * k..r.end * k]
            .iter()
            .map(|&e| e as usize)
            .collect();
        let y = moe_swiglu(
            g,
            gate_exps,
            up_exps,
            down_exps,
            &batch.h[r.start * d..r.end * d],
            &sel,
            &batch.weights[r.start * k..r.end * k],
            k,
            &mut acts,
        );
        out[r.start * d..r.end * d].copy_from_slice(&y);
    }
}

/// Reads `ARCH.*` hyperparameters from GGUF metadata.
pub(crate) struct ArchMeta<'a> {
    pub meta: &'a hmoe_gguf::Metadata,
    pub arch: &'a str,
}

impl ArchMeta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    /// A required non-negative integer.
    pub fn usize(&self, k: &str) -> Result<usize, crate::ModelError> {
        let key = self.key(k);
        self.meta
            .get_u64(&key)
            .map(|v| v as usize)
            .ok_or(crate::ModelError::MissingKey(key))
    }

    /// An optional non-negative integer.
    pub fn usize_or(&self, k: &str, default: usize) -> usize {
        self.meta
            .get_u64(&self.key(k))
            .map_or(default, |v| v as usize)
    }

    /// A required number.
    pub fn f32(&self, k: &str) -> Result<f32, crate::ModelError> {
        let key = self.key(k);
        self.meta
            .get_f32(&key)
            .ok_or(crate::ModelError::MissingKey(key))
    }

    /// An optional number.
    pub fn f32_or(&self, k: &str, default: f32) -> f32 {
        self.meta.get_f32(&self.key(k)).unwrap_or(default)
    }

    /// A `BadParam` error for key `k`.
    pub fn bad(&self, k: &str, value: impl ToString, why: &'static str) -> crate::ModelError {
        crate::ModelError::BadParam {
            key: self.key(k),
            value: value.to_string(),
            why,
        }
    }
}

/// The LM head: `output.weight`, or the token embedding when the file ties them.
pub(crate) fn output_head(
    g: &GgufModel,
    n_embd: usize,
    n_vocab: usize,
) -> Result<Mat, crate::ModelError> {
    let name = if g.tensor_info("output.weight").is_some() {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    Mat::load(g, name, &[n_embd as u64, n_vocab as u64])
}

/// `Wout · (rmsnorm(x) · output_norm)` for the rows `want` asks for (none, the last, all).
pub(crate) fn final_logits(
    g: &GgufModel,
    x: &[f32],
    want: Option<crate::LogitsWanted>,
    output_norm: &[f32],
    eps: f32,
    output: &Mat,
    acts: &mut QuantizedActs,
) -> Vec<f32> {
    let d = output_norm.len();
    let rows = match want {
        None => return Vec::new(),
        Some(crate::LogitsWanted::All) => x,
        Some(crate::LogitsWanted::Last) => &x[x.len() - d..],
    };
    let mut normed = vec![0f32; rows.len()];
    rms_norm(rows, output_norm, eps, &mut normed);
    project(g, output, &normed, acts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yarn_corr_dims_are_rounded_like_ggml() {
        // gpt-oss: 64 dims, 4096 original context, base 150000.
        let d = yarn_corr_dims(64, 4096, 150000.0, 32.0, 1.0);
        let raw_lo = yarn_corr_dim(64, 4096, 32.0, 150000.0);
        let raw_hi = yarn_corr_dim(64, 4096, 1.0, 150000.0);
        assert_eq!(d, [raw_lo.floor(), raw_hi.ceil()]);
        assert!(raw_lo.fract() != 0.0 && raw_hi.fract() != 0.0);
    }

    #[test]
    fn rope_without_scaling_is_a_rotation() {
        let rope = Rope::new(4, 10000.0, None);
        let mut cs = Vec::new();
        rope.cache(3, &mut cs);
        let mut x = [1.0, 0.0, 0.0, 0.0];
        rope.apply_neox(&mut x, 4, &cs);
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[2] - 3f32.sin()).abs() < 1e-6);
        let norm: f32 = x.iter().map(|v| v * v).sum();
        assert!((norm - 1.0).abs() < 1e-6);
    }

    #[test]
    fn expf_ggml_is_within_two_ulp_of_expf() {
        for i in -2000..2000 {
            let x = i as f32 * 0.0437;
            let (a, b) = (expf_ggml(x), x.exp());
            let ulps = (a.to_bits() as i64 - b.to_bits() as i64).abs();
            assert!(ulps <= 2, "x {x}: {a} vs {b}");
        }
        assert_eq!(expf_ggml(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf_ggml(0.0), 1.0);
        assert_eq!(hsum16(&[1.0; 16]), 16.0);
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let w = [1.0f32, 0.5, 2.0, 1.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &w, 1e-5, &mut out);
        let rms = ((1.0 + 4.0 + 9.0 + 16.0) / 4.0 + 1e-5f32).sqrt();
        for i in 0..4 {
            assert!((out[i] - x[i] / rms * w[i]).abs() < 1e-6);
        }
    }
}
