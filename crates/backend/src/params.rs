//! Parameters of the RoPE and attention ops.

/// RoPE parameters in the form the kernel (and the CPU device's `Rope`) uses them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    /// Rotated dims per head (the first `n_dims` of each head).
    pub n_dims: usize,
    /// `freq_base^(-2 / n_dims)`.
    pub theta_scale: f32,
    /// `1 / factor` for linear or YaRN scaling, else 1.
    pub freq_scale: f32,
    /// 1 for YaRN, 0 otherwise.
    pub ext_factor: f32,
    /// Magnitude multiplied into cos and sin (YaRN: also × `1 + 0.1 ln(1/freq_scale)`).
    pub attn_factor: f32,
    /// YaRN correction dims `[low, high]` (floored/ceiled, as ggml).
    pub corr_dims: [f32; 2],
    /// Per-pair divisors of the frequencies (llama 3's `rope_freqs.weight`), if any.
    pub freq_factors: Option<FreqFactors>,
}

/// Most rotated pairs [`FreqFactors`] holds: heads of up to 256 dims, the contract's limit.
pub const MAX_ROPE_PAIRS: usize = 128;

/// Divisors of the rotation frequency of each rotated pair (llama 3's `rope_freqs.weight`),
/// kept inline so that [`RopeParams`] stays a plain value.
#[derive(Clone, Copy, PartialEq)]
pub struct FreqFactors {
    len: usize,
    factors: [f32; MAX_ROPE_PAIRS],
}

impl FreqFactors {
    /// The factors of pairs `0..f.len()`; `None` past [`MAX_ROPE_PAIRS`].
    pub fn new(f: &[f32]) -> Option<FreqFactors> {
        let mut factors = [1.0; MAX_ROPE_PAIRS];
        factors.get_mut(..f.len())?.copy_from_slice(f);
        Some(FreqFactors {
            len: f.len(),
            factors,
        })
    }

    /// The factors, one per rotated pair.
    pub fn as_slice(&self) -> &[f32] {
        &self.factors[..self.len]
    }
}

impl std::fmt::Debug for FreqFactors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl RopeParams {
    /// Plain RoPE over `n_dims` dims with base `freq_base`.
    pub fn plain(n_dims: usize, freq_base: f32) -> RopeParams {
        RopeParams {
            n_dims,
            theta_scale: freq_base.powf(-2.0 / n_dims as f32),
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: 1.0,
            corr_dims: [0.0, 0.0],
            freq_factors: None,
        }
    }

    /// YaRN as llama.cpp hands it to ggml (the CPU device's `Rope::scaled` with
    /// `RopeScaling::Yarn`): `attn_factor` is the value after llama.cpp's division by
    /// `1 + 0.1 ln(factor)`; for gpt-oss (factor 32 over 4096, no log multiplier) that is
    /// exactly 1, and the kernel's own `1 + 0.1 ln(32)` gives the magnitude 1.3466.
    pub fn yarn(
        n_dims: usize,
        freq_base: f32,
        factor: f32,
        n_ctx_orig: u32,
        attn_factor: f32,
        beta_fast: f32,
        beta_slow: f32,
    ) -> RopeParams {
        let corr_dim = |n_rot: f32| {
            n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * freq_base.ln())
        };
        let low = corr_dim(beta_fast).floor().max(0.0);
        let high = corr_dim(beta_slow).ceil().min(n_dims as f32 - 1.0);
        RopeParams {
            freq_scale: 1.0 / factor,
            ext_factor: 1.0,
            attn_factor,
            corr_dims: [low, high],
            ..RopeParams::plain(n_dims, freq_base)
        }
    }

    /// `(cos, sin)` of rotated pair `pair` at position `pos`, computed on the host exactly as
    /// the kernel does (the reference for the RoPE test).
    pub fn cos_sin(&self, pos: i32, pair: usize) -> (f32, f32) {
        let mut theta_extrap = pos as f32;
        for _ in 0..pair {
            theta_extrap *= self.theta_scale;
        }
        if let Some(f) = &self.freq_factors {
            theta_extrap /= f.as_slice().get(pair).copied().unwrap_or(1.0);
        }
        let theta_interp = self.freq_scale * theta_extrap;
        let mut theta = theta_interp;
        let mut mscale = self.attn_factor;
        if self.ext_factor != 0.0 {
            let [low, high] = self.corr_dims;
            let y = (pair as f32 - low) / (high - low).max(0.001);
            let ramp = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
            theta = theta_interp * (1.0 - ramp) + theta_extrap * ramp;
            mscale *= 1.0 + 0.1 * (1.0 / self.freq_scale).ln();
        }
        (theta.cos() * mscale, theta.sin() * mscale)
    }
}

/// Shape of one attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    /// Query heads.
    pub n_head: usize,
    /// K/V heads (`n_head` must be a multiple).
    pub n_head_kv: usize,
    /// Dims per head: a multiple of 16, at most 256.
    pub head_dim: usize,
    /// Cells in the (ring) KV cache: token at position p lives in cell `p % cells`.
    pub cells: usize,
    /// Sliding window: a query at `p` sees keys `p - window + 1 ..= p`; `None`: all of `0..=p`.
    pub window: Option<usize>,
    /// Score scale, usually `1/sqrt(head_dim)`.
    pub scale: f32,
    /// Accumulator chains of the value sum of one query token over f32/f16 values (the row
    /// kernel), 1 or [`crate::numerics::VEC_DOT_CHAINS`]: with 4, position `p` adds into lane
    /// `p % 16` of chain `(p / 16) % 4` and the chains fold as `(c0 + c2) + (c1 + c3)` before
    /// the lanes are summed, as ggml's `vec_dot_f32`/`vec_dot_f16` sum (the CPU device's
    /// attention of Llama-style blocks, Qwen3-MoE's); with 1 every position adds into one
    /// 16-lane chain (its gpt-oss attention). A batch of several tokens, and bf16 or
    /// block-quantized values, always sum in one chain.
    pub value_chains: usize,
    /// Flash attention (`-fa on`/`auto`): over f32/f16/bf16 values, the chunked online softmax of
    /// the CPU device ([`crate::numerics::FLASH_CHUNK`]) instead of the row kernel.
    /// Block-quantized values always take the chunked flash kernel, whatever this says.
    pub flash: bool,
}

impl AttnParams {
    /// The keys a batch of `n_tokens` queries from position `pos0` sees, all of which the ring
    /// must still hold once the batch's own keys are stored: the window plus the batch, at
    /// most the whole sequence (`cells` must be at least this).
    pub fn keys_seen(&self, n_tokens: usize, pos0: usize) -> usize {
        self.window
            .map_or(usize::MAX, |w| w + n_tokens.saturating_sub(1))
            .min(pos0 + n_tokens)
    }
}

/// Shape of one attention call over a K-only cache ([`crate::Backend::attention_k_only`]): one
/// key head shared by every query head (MQA), each cached key `k_dim` values long, and the
/// values the first `v_dim` elements of each key (multi-head latent attention in its absorbed
/// form, whose cache holds `[latent, rope]` per position).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KOnlyAttnParams {
    /// Query heads.
    pub n_head: usize,
    /// Elements of each query head and of each cached key.
    pub k_dim: usize,
    /// Leading elements of each key that are its value (`≤ k_dim`).
    pub v_dim: usize,
    /// Cells in the ring: the key of position p lives in cell `p % cells`.
    pub cells: usize,
    /// Score scale.
    pub scale: f32,
}

/// A strided copy of rows ([`crate::Backend::copy_rows`]): `n_rows` rows of `width` values,
/// row `r` read from element `r · src_stride + src_offset` and written to element
/// `r · dst_stride + dst_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowCopy {
    /// Rows copied.
    pub n_rows: usize,
    /// Values per row.
    pub width: usize,
    /// Elements between row starts in the source.
    pub src_stride: usize,
    /// Where row 0 starts in the source.
    pub src_offset: usize,
    /// Elements between row starts in the destination.
    pub dst_stride: usize,
    /// Where row 0 starts in the destination.
    pub dst_offset: usize,
}

impl RowCopy {
    /// Checks the copy against buffers of `src_len` and `dst_len` elements: the shape error of
    /// a copy that reads or writes past one of them.
    pub fn check(&self, src_len: usize, dst_len: usize) -> Result<(), crate::BackendError> {
        let end = |stride: usize, offset: usize| -> Option<usize> {
            if self.n_rows == 0 {
                return Some(0);
            }
            (self.n_rows - 1)
                .checked_mul(stride)?
                .checked_add(offset)?
                .checked_add(self.width)
        };
        let fits = |stride, offset, len| end(stride, offset).is_some_and(|e| e <= len);
        if fits(self.src_stride, self.src_offset, src_len)
            && fits(self.dst_stride, self.dst_offset, dst_len)
        {
            Ok(())
        } else {
            Err(crate::BackendError::Shape {
                op: "copy_rows",
                what: format!("{self:?} from {src_len} into {dst_len} values"),
            })
        }
    }
}
