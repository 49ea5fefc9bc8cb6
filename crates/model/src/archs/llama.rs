//! Dense decoder-only transformers of the Llama family: `llama` (Llama 2/3, SmolLM, Mistral
//! without experts) and `qwen2` (Qwen2/2.5). Their math differs only by flags:
//!
//! ```text
//! x = embed(tokens)
//! for each block l:
//!     h = rmsnorm(x) · attn_norm
//!     q, k, v = Wq·h (+bq), Wk·h (+bk), Wv·h (+bv)       (GQA: n_head q heads, n_head_kv kv heads)
//!     q, k = rope(q, k, pos)          llama: pairs (2i, 2i+1), frequencies ÷ rope_freqs if present
//!                                     qwen2: pairs (i, i + d/2)
//!     x += Wo · attention(q, k, v) (+bo)                   (scale 1/√d, or llama's attention.scale)
//!     h = rmsnorm(x) · ffn_norm
//!     x += Wd · (silu(Wg·h) ⊙ Wu·h)
//! logits = Wout · (rmsnorm(x) · output_norm)               (Wout = embedding when tied)
//! ```
//!
//! Each layer is the executor's shared attention block and dense SwiGLU FFN, run by
//! [`crate::DeviceModel`] on the CPU, a GPU or REF0.

use hmoe_backend::KvType;
use hmoe_backend::{Backend, ExpertTensors};
use hmoe_gguf::GgufModel;
use hmoe_placement::ModelShape;

use super::hparams::{check_heads, ArchMeta, WholeHeads};
use super::rope::{Rope, RopeMode, RopeScaling};
use crate::error::ModelError;
use crate::executor::device_kv::KvWidths;
use crate::executor::device_weights::{buf_bytes, upload_f32};
use crate::executor::layer_blocks::{AttnBlock, AttnSpec, SwiGluFfn};
use crate::executor::step::{AttnShape, DeviceLayers, ModelDims, Residual, Step};
use crate::sequence::KvCache;
use crate::weights::{load_f32, n_vocab};

/// Which member of the family a file is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseArch {
    /// `llama`: normal RoPE, optional biases and `rope_freqs`.
    Llama,
    /// `qwen2`: NeoX RoPE, q/k/v biases.
    Qwen2,
}

impl DenseArch {
    /// The GGUF architecture name.
    pub fn name(self) -> &'static str {
        match self {
            DenseArch::Llama => "llama",
            DenseArch::Qwen2 => "qwen2",
        }
    }

    /// llama.cpp's rope type for the architecture.
    pub fn rope_mode(self) -> RopeMode {
        match self {
            DenseArch::Llama => RopeMode::Norm,
            DenseArch::Qwen2 => RopeMode::Neox,
        }
    }
}

/// Hyperparameters of a dense llama/qwen2 model, read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseParams {
    /// Which architecture.
    pub arch: DenseArch,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Dimension of each head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub n_vocab: usize,
    /// Hidden size of the feed-forward network.
    pub n_ff: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency.
    pub rope_freq_base: f32,
    /// RoPE context scaling.
    pub rope_scaling: RopeScaling,
    /// Attention scale (`1/√head_dim` unless the file sets `attention.scale`).
    pub attn_scale: f32,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
}

impl DenseParams {
    /// Reads the hyperparameters of `arch`; `n_vocab` comes from the embedding tensor.
    pub fn from_metadata(
        meta: &hmoe_gguf::Metadata,
        arch: DenseArch,
        n_vocab: usize,
    ) -> Result<DenseParams, ModelError> {
        let m = ArchMeta {
            meta,
            arch: arch.name(),
        };
        let WholeHeads {
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
        } = m.whole_heads()?;
        if m.usize_or("expert_count", 0) > 0 {
            return Err(m.bad(
                "expert_count",
                m.usize_or("expert_count", 0),
                "llama-architecture MoE (Mixtral) is not supported",
            ));
        }
        let n_ctx_train = m.usize("context_length")?;
        let attn_scale = match m.f32_or("attention.scale", 0.0) {
            s if s != 0.0 => s,
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        let p = DenseParams {
            arch,
            n_layer: m.usize("block_count")?,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_vocab,
            n_ff: m.usize("feed_forward_length")?,
            rms_eps: m.f32("attention.layer_norm_rms_epsilon")?,
            rope_freq_base: m.f32_or("rope.freq_base", 10000.0),
            rope_scaling: RopeScaling::from_metadata(meta, arch.name(), n_ctx_train as u32)?,
            attn_scale,
            n_ctx_train,
        };
        check_heads(&m, p.n_layer, p.n_head, p.n_head_kv, p.head_dim)?;
        Ok(p)
    }

    /// The placement planner's shape of the model: GQA heads of `head_dim` for keys and
    /// values, a dense FFN in every layer, no experts and no sliding window.
    pub fn shape(&self) -> ModelShape {
        let heads = WholeHeads {
            n_embd: self.n_embd,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
        };
        ModelShape {
            n_ff: self.n_ff as u64,
            ..heads.shape(
                self.arch.name(),
                self.n_layer,
                self.n_vocab,
                self.n_ctx_train,
            )
        }
    }
}

/// A dense layer on a device: attention, then the SwiGLU FFN.
struct DenseLayer<B: Backend> {
    attn: AttnBlock<B>,
    ffn_norm: B::Buf<f32>,
    ffn: SwiGluFfn<B>,
}

/// A dense llama/qwen2 model's layers on a device ([`crate::DeviceModel`]).
pub(crate) struct Dense<B: Backend> {
    params: DenseParams,
    gguf: GgufModel,
    layers: Vec<DenseLayer<B>>,
}

impl<B: Backend> Dense<B> {
    /// Checks every tensor of `gguf` (a file of `arch`) against the hyperparameters and
    /// uploads every layer to `dev`.
    pub(crate) fn load(gguf: GgufModel, arch: DenseArch, dev: &B) -> Result<Dense<B>, ModelError> {
        let p = DenseParams::from_metadata(gguf.metadata(), arch, n_vocab(&gguf)?)?;
        let g = &gguf;
        let mut rope = Rope::scaled(p.head_dim, p.rope_freq_base, p.rope_scaling);
        if arch == DenseArch::Llama && g.tensor_info("rope_freqs.weight").is_some() {
            let pairs = p.head_dim as u64 / 2;
            rope = rope.with_freq_factors(load_f32(g, "rope_freqs.weight", &[pairs])?);
        }
        let rope = rope.device_params().ok_or_else(|| {
            ModelError::Placement(format!(
                "rope_freqs.weight for heads of {}: the device's RoPE takes at most {} pairs",
                p.head_dim,
                hmoe_backend::MAX_ROPE_PAIRS
            ))
        })?;
        let spec = AttnSpec {
            n_embd: p.n_embd,
            shape: AttnShape {
                n_head: p.n_head,
                n_head_kv: p.n_head_kv,
                head_dim: p.head_dim,
                window: None,
                scale: p.attn_scale,
                value_chains: hmoe_backend::numerics::VEC_DOT_CHAINS,
            },
            rope,
            rms_eps: p.rms_eps,
        };
        let layers = (0..p.n_layer)
            .map(|l| {
                let n = |s: &str| format!("blk.{l}.{s}");
                for b in ["ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"] {
                    if g.tensor_info(&n(b)).is_some() {
                        return Err(ModelError::BadParam {
                            key: n(b),
                            value: "present".into(),
                            why: "feed-forward biases are not supported",
                        });
                    }
                }
                Ok(DenseLayer {
                    attn: AttnBlock::load(dev, g, l, spec)?.with_rope_mode(p.arch.rope_mode()),
                    ffn_norm: upload_f32(dev, g, &n("ffn_norm.weight"), &[p.n_embd as u64])?,
                    ffn: SwiGluFfn::load(dev, g, l, "", p.n_embd, p.n_ff)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Dense {
            params: p,
            gguf,
            layers,
        })
    }
}

impl<B: Backend> DeviceLayers<B> for Dense<B> {
    fn dims(&self) -> ModelDims {
        let p = &self.params;
        let attn = self
            .layers
            .first()
            .map_or(0, |l| l.attn.scratch_per_token(p.n_embd));
        let ffn = self
            .layers
            .first()
            .map_or(0, |l| 2 * p.n_embd + l.ffn.scratch_per_token());
        ModelDims {
            n_layer: p.n_layer,
            n_embd: p.n_embd,
            n_vocab: p.n_vocab,
            n_ctx_train: p.n_ctx_train,
            rms_eps: p.rms_eps,
            scratch_per_token: attn.max(ffn),
            kv_head_dim: p.head_dim,
        }
    }
    fn gguf(&self) -> &GgufModel {
        &self.gguf
    }
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        KvCache::new(ty, n_ctx, n_ubatch, &vec![None; self.params.n_layer])
    }
    fn kv_widths(&self, layer: usize) -> KvWidths {
        self.layers
            .get(layer)
            .map_or(KvWidths::default(), |l| l.attn.kv_widths())
    }
    fn layer<'s>(
        &self,
        cx: &mut Step<'s, B>,
        l: usize,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
    ) -> Result<Option<Residual<'s, B>>, ModelError> {
        let p = &self.params;
        let layer = &self.layers[l];
        let attn_out = layer.attn.forward(cx, l, x, pending)?;
        let last = l + 1 == self.layers.len();
        cx.feed_forward(last, x, attn_out, |cx, x, attn_out| {
            let mut out = cx.alloc(p.n_embd)?;
            let norm = (&layer.ffn_norm, p.rms_eps);
            layer.ffn.forward_normed(cx, x, attn_out, norm, &mut out)?;
            Ok(Residual(out))
        })
    }
    fn layer_experts(&self, _layer: usize) -> Option<ExpertTensors<'_>> {
        None
    }
    fn weight_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.attn.bytes() + buf_bytes::<B>(&l.ffn_norm) + l.ffn.bytes())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LanguageModel, LogitsWanted};
    use hmoe_gguf::{GgufWriter, MetaValue};
    use hmoe_quant::GgmlType;

    const D: usize = 32;
    const N_HEAD: usize = 4;
    const N_HEAD_KV: usize = 2;
    // Heads of 16 values: the contract's attention takes multiples of 16.
    const HD: usize = 16;
    const FF: usize = 48;
    const VOCAB: usize = 40;
    const LAYERS: usize = 2;
    const EPS: f32 = 1e-5;
    const BASE: f32 = 10000.0;

    /// Deterministic uniform numbers in (−1, 1).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
            (0..n).map(|_| self.next() * scale).collect()
        }
    }

    /// Every tensor of the synthetic model as f32, by GGUF name.
    type Tensors = Vec<(String, Vec<u64>, Vec<f32>)>;

    fn synthetic(arch: DenseArch, seed: u64) -> Tensors {
        let mut r = Rng(seed);
        let mut t: Tensors = Vec::new();
        let mut add = |name: String, dims: Vec<u64>, r: &mut Rng, scale: f32, offset: f32| {
            let n = dims.iter().product::<u64>() as usize;
            let v = r.vec(n, scale).into_iter().map(|x| x + offset).collect();
            t.push((name, dims, v));
        };
        let (d, q, kv, ff) = (
            D as u64,
            (N_HEAD * HD) as u64,
            (N_HEAD_KV * HD) as u64,
            FF as u64,
        );
        add(
            "token_embd.weight".into(),
            vec![d, VOCAB as u64],
            &mut r,
            1.0,
            0.0,
        );
        add("output_norm.weight".into(), vec![d], &mut r, 0.1, 1.0);
        if arch == DenseArch::Llama {
            add(
                "output.weight".into(),
                vec![d, VOCAB as u64],
                &mut r,
                0.3,
                0.0,
            );
        }
        for l in 0..LAYERS {
            let n = |s: &str| format!("blk.{l}.{s}");
            add(n("attn_norm.weight"), vec![d], &mut r, 0.1, 1.0);
            add(n("attn_q.weight"), vec![d, q], &mut r, 0.4, 0.0);
            add(n("attn_k.weight"), vec![d, kv], &mut r, 0.4, 0.0);
            add(n("attn_v.weight"), vec![d, kv], &mut r, 0.4, 0.0);
            add(n("attn_output.weight"), vec![q, d], &mut r, 0.3, 0.0);
            if arch == DenseArch::Qwen2 {
                add(n("attn_q.bias"), vec![q], &mut r, 0.5, 0.0);
                add(n("attn_k.bias"), vec![kv], &mut r, 0.5, 0.0);
                add(n("attn_v.bias"), vec![kv], &mut r, 0.5, 0.0);
            }
            add(n("ffn_norm.weight"), vec![d], &mut r, 0.1, 1.0);
            add(n("ffn_gate.weight"), vec![d, ff], &mut r, 0.4, 0.0);
            add(n("ffn_up.weight"), vec![d, ff], &mut r, 0.4, 0.0);
            add(n("ffn_down.weight"), vec![ff, d], &mut r, 0.3, 0.0);
        }
        if arch == DenseArch::Llama {
            // llama 3's per-pair frequency divisors.
            let factors = (0..HD / 2).map(|i| 1.0 + 1.5 * i as f32).collect();
            t.push(("rope_freqs.weight".into(), vec![(HD / 2) as u64], factors));
        }
        t
    }

    fn write(arch: DenseArch, tensors: &Tensors) -> GgufModel {
        let mut w = GgufWriter::new();
        let a = arch.name();
        w.add_meta("general.architecture", MetaValue::String(a.into()));
        for (k, v) in [
            ("block_count", LAYERS),
            ("context_length", 256),
            ("embedding_length", D),
            ("feed_forward_length", FF),
            ("attention.head_count", N_HEAD),
            ("attention.head_count_kv", N_HEAD_KV),
            ("attention.key_length", HD),
            ("attention.value_length", HD),
        ] {
            w.add_meta(format!("{a}.{k}"), MetaValue::U32(v as u32));
        }
        w.add_meta(
            format!("{a}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(EPS),
        );
        w.add_meta(format!("{a}.rope.freq_base"), MetaValue::F32(BASE));
        for (name, dims, v) in tensors {
            let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            w.add_tensor(name.clone(), GgmlType::F32, dims, bytes)
                .unwrap();
        }
        GgufModel::from_bytes(w.to_bytes().unwrap()).unwrap()
    }

    /// Straightforward f64 forward pass of the module docs' math, all positions at once.
    /// The documented math in f64: every token's logits, and its hidden state after the
    /// output norm (what [`LogitsWanted::Hidden`] returns).
    fn reference(arch: DenseArch, tensors: &Tensors, tokens: &[u32]) -> (Vec<f64>, Vec<f64>) {
        let get = |name: &str| -> Vec<f64> {
            let t = tensors.iter().find(|t| t.0 == name);
            t.map_or(Vec::new(), |t| t.2.iter().map(|&x| x as f64).collect())
        };
        // W stored as [n_out][n_in] rows.
        let mv = |w: &[f64], x: &[f64]| -> Vec<f64> {
            w.chunks(x.len())
                .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
                .collect()
        };
        let norm = |x: &[f64], w: &[f64]| -> Vec<f64> {
            let s = (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + EPS as f64).sqrt();
            x.iter().zip(w).map(|(v, w)| v / s * w).collect()
        };
        let factors = get("rope_freqs.weight");
        let rope = |x: &mut [f64], pos: usize| {
            for head in x.chunks_mut(HD) {
                for i in 0..HD / 2 {
                    let theta = pos as f64 * (BASE as f64).powf(-2.0 * i as f64 / HD as f64)
                        / factors.get(i).copied().unwrap_or(1.0);
                    let (a, b) = match arch {
                        DenseArch::Llama => (2 * i, 2 * i + 1),
                        DenseArch::Qwen2 => (i, i + HD / 2),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * theta.cos() - x1 * theta.sin();
                    head[b] = x0 * theta.sin() + x1 * theta.cos();
                }
            }
        };
        let add = |x: &mut Vec<f64>, b: Vec<f64>| {
            if !b.is_empty() {
                x.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        };
        let embd = get("token_embd.weight");
        let mut xs: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| embd[t as usize * D..][..D].to_vec())
            .collect();
        for l in 0..LAYERS {
            let w = |s: &str| get(&format!("blk.{l}.{s}"));
            let (mut ks, mut vs, mut qs) = (Vec::new(), Vec::new(), Vec::new());
            for (pos, x) in xs.iter().enumerate() {
                let h = norm(x, &w("attn_norm.weight"));
                let (mut q, mut k, mut v) = (
                    mv(&w("attn_q.weight"), &h),
                    mv(&w("attn_k.weight"), &h),
                    mv(&w("attn_v.weight"), &h),
                );
                add(&mut q, w("attn_q.bias"));
                add(&mut k, w("attn_k.bias"));
                add(&mut v, w("attn_v.bias"));
                rope(&mut q, pos);
                rope(&mut k, pos);
                qs.push(q);
                ks.push(k);
                vs.push(v);
            }
            for (pos, x) in xs.iter_mut().enumerate() {
                let mut out = vec![0f64; N_HEAD * HD];
                for hh in 0..N_HEAD {
                    let kvh = hh / (N_HEAD / N_HEAD_KV);
                    let q = &qs[pos][hh * HD..][..HD];
                    let s: Vec<f64> = (0..=pos)
                        .map(|j| {
                            q.iter()
                                .zip(&ks[j][kvh * HD..][..HD])
                                .map(|(a, b)| a * b)
                                .sum::<f64>()
                                / (HD as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (j, ej) in e.iter().enumerate() {
                        for i in 0..HD {
                            out[hh * HD + i] += ej / z * vs[j][kvh * HD + i];
                        }
                    }
                }
                add(x, mv(&w("attn_output.weight"), &out));
                let h = norm(x, &w("ffn_norm.weight"));
                let g = mv(&w("ffn_gate.weight"), &h);
                let u = mv(&w("ffn_up.weight"), &h);
                let act: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                add(x, mv(&w("ffn_down.weight"), &act));
            }
        }
        let out_w = match arch {
            DenseArch::Llama => get("output.weight"),
            DenseArch::Qwen2 => embd,
        };
        let normed: Vec<Vec<f64>> = (xs.iter())
            .map(|x| norm(x, &get("output_norm.weight")))
            .collect();
        let logits = normed.iter().flat_map(|h| mv(&out_w, h)).collect();
        (logits, normed.concat())
    }

    const TOKENS: [u32; 12] = [3, 17, 0, 39, 17, 8, 22, 5, 5, 31, 12, 1];

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    fn check_arch(arch: DenseArch) {
        let tensors = synthetic(arch, 0x5eed + arch as u64);
        let model = crate::load(write(arch, &tensors)).unwrap();
        assert_eq!(model.n_vocab(), VOCAB);
        let mut cache = model.new_cache(KvType::F32, 64, 64);
        let batch = model
            .forward(&mut cache, &TOKENS, LogitsWanted::All)
            .unwrap();
        // Against the f64 reference of the documented math.
        let (want, want_hidden) = reference(arch, &tensors, &TOKENS);
        let worst = batch
            .iter()
            .zip(&want)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0, f64::max);
        let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
        assert!(
            worst < 1e-4 * scale.max(1.0),
            "{arch:?}: max |Δ| {worst} vs f64 reference (max |logit| {scale})"
        );
        // The hidden states after the output norm, in micro-batches of 5 (the head not run).
        let mut cache = model.new_cache(KvType::F32, 64, 5);
        let hidden = (model.forward(&mut cache, &TOKENS, LogitsWanted::Hidden)).unwrap();
        assert_eq!(hidden.len(), TOKENS.len() * model.n_embd());
        let worst = (hidden.iter().zip(&want_hidden))
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-4, "{arch:?}: hidden max |Δ| {worst}");
        // Token by token, and in micro-batches of 5, gives the same logits as one batch.
        let mut cache = model.new_cache(KvType::F32, 64, 64);
        let mut single = Vec::new();
        for &t in &TOKENS {
            single.extend(model.forward(&mut cache, &[t], LogitsWanted::Last).unwrap());
        }
        assert!(
            max_diff(&batch, &single) < 1e-4,
            "{arch:?}: batch vs token by token {}",
            max_diff(&batch, &single)
        );
        let mut cache = model.new_cache(KvType::F32, 64, 5);
        let chunked = model
            .forward(&mut cache, &TOKENS, LogitsWanted::All)
            .unwrap();
        assert!(max_diff(&batch, &chunked) < 1e-4);
        let mut cache = model.new_cache(KvType::F32, 64, 5);
        let last = model
            .forward(&mut cache, &TOKENS, LogitsWanted::Last)
            .unwrap();
        assert_eq!(last.len(), VOCAB);
        assert!(max_diff(&last, &batch[(TOKENS.len() - 1) * VOCAB..]) < 1e-4);
        // An f16 cache stays close.
        let mut cache = model.new_cache(KvType::F16, 64, 64);
        let f16 = model
            .forward(&mut cache, &TOKENS, LogitsWanted::All)
            .unwrap();
        assert!(
            max_diff(&batch, &f16) < 2e-2,
            "{arch:?}: f16 KV {}",
            max_diff(&batch, &f16)
        );
        // Errors instead of panics on bad input.
        let mut cache = model.new_cache(KvType::F32, 8, 8);
        assert!(matches!(
            model.forward(&mut cache, &[VOCAB as u32], LogitsWanted::Last),
            Err(ModelError::BadToken { .. })
        ));
        assert!(matches!(
            model.forward(&mut cache, &TOKENS, LogitsWanted::Last),
            Err(ModelError::ContextFull { .. })
        ));
    }

    #[test]
    fn llama_matches_reference_and_is_batch_invariant() {
        check_arch(DenseArch::Llama);
    }

    #[test]
    fn qwen2_matches_reference_and_is_batch_invariant() {
        check_arch(DenseArch::Qwen2);
    }

    #[test]
    fn missing_tensor_and_bad_heads_are_errors() {
        let mut tensors = synthetic(DenseArch::Llama, 1);
        tensors.retain(|t| t.0 != "blk.1.ffn_up.weight");
        assert!(matches!(
            crate::load(write(DenseArch::Llama, &tensors)).map(|_| ()),
            Err(ModelError::MissingTensor(_))
        ));
        let mut w =
            GgufWriter::from_model(&write(DenseArch::Llama, &synthetic(DenseArch::Llama, 1)))
                .unwrap();
        w.add_meta("llama.attention.head_count_kv", MetaValue::U32(3));
        let g = GgufModel::from_bytes(w.to_bytes().unwrap()).unwrap();
        assert!(matches!(
            crate::load(g).map(|_| ()),
            Err(ModelError::BadParam { .. })
        ));
    }

    /// The device layers on REF0 give the CPU's logits bit for bit on the synthetic F32
    /// models (normal RoPE with an untied head; NeoX RoPE, q/k/v biases and the tied head),
    /// over micro-batches of 5 and then one token at a time past 16 positions, with f32 and
    /// f16 K/V; two sequences in one `forward_multi` get what each gets alone (F32 products
    /// per sequence). No model file needed, unlike tests/device_dense.rs.
    #[test]
    fn device_layers_on_ref0_are_the_cpus_bit_for_bit() {
        use crate::{DeviceModel, ExpertHome, ExpertPlacement, SeqBatch};
        use hmoe_backend::Ref0;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for arch in [DenseArch::Llama, DenseArch::Qwen2] {
            let tensors = synthetic(arch, 0xd0 + arch as u64);
            let cpu = crate::load(write(arch, &tensors)).unwrap();
            let placement = ExpertPlacement {
                layers: vec![ExpertHome::Host; LAYERS],
                op_offload_min_batch: None,
            };
            let dev = DeviceModel::load(write(arch, &tensors), Ref0::new(), &placement).unwrap();
            let run = |m: &dyn LanguageModel, kv: KvType| {
                let mut cache = m.new_cache(kv, 64, 5);
                let mut out = vec![m.forward(&mut cache, &TOKENS, LogitsWanted::All).unwrap()];
                for t in 0..12 {
                    let tok = [(t * 7 + 2) % VOCAB as u32];
                    out.push(m.forward(&mut cache, &tok, LogitsWanted::Last).unwrap());
                }
                out
            };
            for kv in [KvType::F32, KvType::F16] {
                let (want, got) = (run(cpu.as_ref(), kv), run(&dev, kv));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(bits(g) == bits(w), "{arch:?} {kv:?}: feed {i}");
                }
            }
            let prompts: [&[u32]; 2] = [&TOKENS[..3], &TOKENS[2..]];
            let alone: Vec<Vec<f32>> = prompts
                .iter()
                .map(|p| {
                    let mut c = cpu.new_cache(KvType::F32, 64, 16);
                    cpu.forward(&mut c, p, LogitsWanted::Last).unwrap()
                })
                .collect();
            let mut caches: Vec<_> = (0..2).map(|_| dev.new_cache(KvType::F32, 64, 16)).collect();
            let mut seqs: Vec<SeqBatch<'_, '_>> = caches
                .iter_mut()
                .zip(prompts)
                .map(|(cache, tokens)| SeqBatch {
                    cache,
                    tokens,
                    logits: true,
                })
                .collect();
            let together = dev.forward_multi(&mut seqs).unwrap();
            for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
                assert!(
                    bits(t) == bits(a),
                    "{arch:?}: sequence {i} batched vs alone"
                );
            }
            assert_eq!(dev.stats().host_round_trips, 0);
        }
    }
}
