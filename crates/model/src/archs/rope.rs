//! Rotary position embeddings (RoPE) as llama.cpp derives their parameters: NeoX or normal
//! layout, linear scaling and YaRN context extension ("YaRN: Efficient Context Window
//! Extension of Large Language Models", Peng et al. 2023), llama 3's frequency factors.

use crate::error::ModelError;

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
    ) -> Result<RopeScaling, ModelError> {
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
            Some(other) => Err(ModelError::BadParam {
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

    /// The kernel's cos/sin (computed on the host as the kernel does) are the CPU's, bit for
    /// bit, for gpt-oss's YaRN, for Qwen3's long-context YaRN, for linear scaling, for plain
    /// RoPE and for llama 3's frequency factors.
    #[test]
    fn device_rope_params_match_the_cpu() {
        let yarn_qwen = RopeScaling::Yarn {
            factor: 4.0,
            n_ctx_orig: 32_768,
            attn_factor: 1.0 / (1.0 + 0.1 * 4f32.ln()) * (0.1 * 4f32.ln() + 1.0),
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let ropes = [
            Rope::new(64, 150_000.0, Some((32.0, 4096))),
            Rope::new(64, 150_000.0, None),
            Rope::scaled(128, 1e6, yarn_qwen),
            Rope::scaled(64, 10_000.0, RopeScaling::Linear { factor: 2.0 }),
            Rope::new(64, 500_000.0, None)
                .with_freq_factors((0..32).map(|i| 1.0 + i as f32 * 0.75).collect()),
        ];
        for rope in &ropes {
            let rp = rope.device_params().expect("factors the contract holds");
            let mut cs = Vec::new();
            for pos in [0usize, 1, 2, 17, 127, 128, 4095, 4096, 70_000, 131_071] {
                rope.cache(pos, &mut cs);
                assert_eq!(cs.len(), rp.n_dims / 2);
                for (pair, &(c, s)) in cs.iter().enumerate() {
                    let (gc, gs) = rp.cos_sin(pos as i32, pair);
                    assert_eq!(
                        (gc.to_bits(), gs.to_bits()),
                        (c.to_bits(), s.to_bits()),
                        "{rope:?} pos {pos} pair {pair}: ({gc}, {gs}) vs ({c}, {s})"
                    );
                }
            }
        }
        let too_many = Rope::new(512, 10_000.0, None).with_freq_factors(vec![1.0; 256]);
        assert!(
            too_many.device_params().is_none(),
            "more factors than the contract holds"
        );
    }
}
