//! What the architectures share beside the executor's blocks: RoPE parameters with YaRN as
//! llama.cpp derives them, routing, and the reading of hyperparameters. The row kernels
//! (RMSNorm, matmul over quantized weights, softmax, SwiGLU) live in `hmoe_cpu::ops` and are
//! re-exported here. Numerics follow ggml's CPU backend so that results match llama.cpp's.

pub use hmoe_cpu::ops::{
    add_bias, matmul, matmul_vec_dot, rms_norm, softmax, swiglu, QuantizedActs,
};

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
    /// this cache's bit for bit; `None` with more frequency factors than the contract holds.
    pub fn device_params(&self) -> Option<hmoe_backend::RopeParams> {
        let freq_factors = match &self.freq_factors {
            Some(f) => Some(hmoe_backend::FreqFactors::new(f)?),
            None => None,
        };
        Some(hmoe_backend::RopeParams {
            n_dims: self.n_dims,
            theta_scale: self.theta_scale,
            freq_scale: self.freq_scale,
            ext_factor: self.ext_factor,
            attn_factor: self.attn_factor,
            corr_dims: self.corr_dims,
            freq_factors,
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
