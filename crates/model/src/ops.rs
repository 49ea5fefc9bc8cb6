//! CPU building blocks shared by the architectures: RMSNorm, RoPE with YaRN, matmul over
//! quantized weights, softmax, top-k. Numerics follow ggml's CPU backend so that results match
//! llama.cpp's: activations are converted to the weight type's dot format once per row, norms
//! and softmax sums accumulate in f64.

use hmoe_quant::{DotKernel, GgmlType};
use rayon::prelude::*;

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
        let row_bytes = ty.row_bytes(n as u64).expect("row length is a whole number of blocks")
            as usize;
        let rows = x.len() / n;
        self.ty = Some(ty);
        self.n = n;
        self.row_bytes = row_bytes;
        self.data.resize(rows * row_bytes, 0);
        self.data
            .par_chunks_mut(row_bytes)
            .zip(x.par_chunks(n))
            .for_each(|(dst, src)| {
                hmoe_quant::quantize_row(ty, src, dst).expect("sizes checked above");
            });
    }

    /// Number of rows held.
    pub fn rows(&self) -> usize {
        if self.row_bytes == 0 {
            0
        } else {
            self.data.len() / self.row_bytes
        }
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
    debug_assert_eq!(acts.ty, Some(kernel.act_type()));
    debug_assert_eq!(acts.n, n_in);
    let row_bytes = w.len() / n_out;
    let n_tokens = acts.rows();
    debug_assert_eq!(out.len(), n_tokens * n_out);
    if n_tokens == 1 {
        let act = acts.row(0);
        out.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(chunk, dst)| {
                let r0 = chunk * ROWS_PER_TASK;
                let rows = &w[r0 * row_bytes..(r0 + dst.len()) * row_bytes];
                kernel.dot_rows(n_in, rows, act, dst);
            });
        return;
    }
    // Batch: each task owns a block of weight rows and runs every token through it, so the
    // weights are read once; the result is produced transposed and then laid out per token.
    let mut transposed = vec![0f32; n_out * n_tokens];
    transposed
        .par_chunks_mut(ROWS_PER_TASK * n_tokens)
        .enumerate()
        .for_each(|(chunk, dst)| {
            let r0 = chunk * ROWS_PER_TASK;
            for (i, dst_row) in dst.chunks_exact_mut(n_tokens).enumerate() {
                let wrow = &w[(r0 + i) * row_bytes..(r0 + i + 1) * row_bytes];
                for (t, d) in dst_row.iter_mut().enumerate() {
                    *d = kernel.dot(n_in, wrow, acts.row(t));
                }
            }
        });
    for (r, col) in transposed.chunks_exact(n_tokens).enumerate() {
        for (t, &v) in col.iter().enumerate() {
            out[t * n_out + r] = v;
        }
    }
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
                }
            }
        }
    }

    /// The `(cos, sin)` pairs for position `pos`, one per rotated pair.
    pub fn cache(&self, pos: usize, out: &mut Vec<(f32, f32)>) {
        out.clear();
        let mut theta = pos as f32;
        for i0 in (0..self.n_dims).step_by(2) {
            out.push(self.yarn(theta, i0));
            theta *= self.theta_scale;
        }
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
                head[i] = x0 * c - x1 * s;
                head[i + half] = x0 * s + x1 * c;
            }
        }
    }
}

fn yarn_corr_dim(n_dims: usize, n_ctx_orig: u32, n_rot: f32, base: f32) -> f32 {
    n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
        / (2.0 * base.ln())
}

/// The dims between which YaRN blends interpolation and extrapolation, floored/ceiled as
/// ggml does (OpenAI's reference keeps them fractional).
fn yarn_corr_dims(n_dims: usize, n_ctx_orig: u32, base: f32, beta_fast: f32, beta_slow: f32) -> [f32; 2] {
    let start = yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, base).floor();
    let end = yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, base).ceil();
    [start.max(0.0), end.min(n_dims as f32 - 1.0)]
}

fn yarn_ramp(low: f32, high: f32, i0: usize) -> f32 {
    let y = ((i0 / 2) as f32 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

/// Horizontal sum of 16 lanes in the order of an AVX-512 `reduce_add` (halves, then
/// quarters, then pairs), so that sums match ggml's SIMD code bit for bit.
pub fn reduce16(lanes: &[f32; 16]) -> f32 {
    let mut t8 = [0f32; 8];
    for i in 0..8 {
        t8[i] = lanes[i] + lanes[i + 8];
    }
    let t4 = [t8[0] + t8[4], t8[1] + t8[5], t8[2] + t8[6], t8[3] + t8[7]];
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// e^x as computed by ggml's vectorised exponential (a polynomial after range reduction,
/// ≤ 1.5 ulp from the true value). Softmax in attention uses it, so we do too.
pub fn expf_ggml(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 1.5 · 2^23: rounds to an integer when added
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // x · log2(e) + r
    let n = z - r;
    let b = (-n).mul_add(f32::from_bits(0x3f31_7200), x); // x − n·ln2_hi
    let b = (-n).mul_add(f32::from_bits(0x35bf_be8e), b); // … − n·ln2_lo
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let p45 = f32::from_bits(0x3c07_2010).mul_add(b, f32::from_bits(0x3d2b_9f17));
    let p23 = f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3efffedb));
    let p01 = f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0);
    let j = p45.mul_add(u, p23).mul_add(u, p01);
    scale_by_pow2(j, n as i32)
}

/// `x · 2^n` without intermediate overflow (like `vscalefps`).
fn scale_by_pow2(x: f32, n: i32) -> f32 {
    let mut x = x;
    let mut n = n;
    while n > 127 {
        x *= f32::from_bits(0x7f00_0000);
        n -= 127;
    }
    while n < -126 {
        x *= f32::from_bits(0x0080_0000);
        n += 126;
    }
    x * f32::from_bits(((n + 127) as u32) << 23)
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

/// Indices of the `k` largest values, largest first (ties: lower index first).
pub fn top_k(x: &[f32], k: usize, out: &mut Vec<usize>) {
    out.clear();
    out.extend(0..x.len());
    out.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    out.truncate(k);
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
        assert_eq!(reduce16(&[1.0; 16]), 16.0);
    }

    #[test]
    fn top_k_orders_and_breaks_ties_by_index() {
        let mut idx = Vec::new();
        top_k(&[1.0, 3.0, 3.0, -1.0, 2.0], 3, &mut idx);
        assert_eq!(idx, vec![1, 2, 4]);
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
