//! Random gpt-oss models with the published files' tensor types: MXFP4 experts, Q8_0
//! attention/embedding/output, F32 norms, biases, sinks and router.

use half::f16;
use hmoe_gguf::{GgufWriter, MetaValue};
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::add_byte_vocab;
use crate::vocab::GPT_OSS;

/// Dimensions of a synthetic gpt-oss model.
#[derive(Clone, Debug, PartialEq)]
pub struct GptOssSpec {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size (multiple of 32).
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Experts per block.
    pub n_expert: usize,
    /// Experts per token.
    pub n_expert_used: usize,
    /// Expert hidden size (multiple of 32).
    pub n_ff_exp: usize,
    /// Vocabulary size (≥ 264).
    pub n_vocab: usize,
    /// Sliding window of even layers.
    pub sliding_window: usize,
    /// RNG seed.
    pub seed: u64,
    /// Routing with locality (`make-test-model --routing-locality F`, `F` in `0..=1`), so
    /// that consecutive tokens tend to choose the same experts; `None`: routers of random
    /// weights, which route nearly uniformly. The hidden size is split in halves, the token
    /// half and the topic half. Token embeddings and the experts' outputs (their down rows
    /// and biases) are zero in the topic half, so only attention writes there; the queries are
    /// zero, so every head averages the values of its window (uniform scores, the sink taking
    /// its share), and the value and output biases are zero: the topic half holds a running
    /// mean over the sequence, which moves a little with each token. The router's weights on
    /// the token half are scaled by `1 − F`, those on the topic half by `F ×` [`TOPIC_GAIN`].
    pub routing_locality: Option<f32>,
}

/// Gain of the router's weights on the topic half under `--routing-locality` (the running
/// mean of a window of random values is small next to a token's own embedding).
pub const TOPIC_GAIN: f32 = 8.0;

impl GptOssSpec {
    /// A model small enough to generate from in a fraction of a second.
    pub fn tiny() -> GptOssSpec {
        GptOssSpec {
            n_layer: 4,
            n_embd: 256,
            n_head: 8,
            n_head_kv: 2,
            head_dim: 64,
            n_expert: 16,
            n_expert_used: 4,
            n_ff_exp: 256,
            n_vocab: 512,
            sliding_window: 128,
            seed: 42,
            routing_locality: None,
        }
    }

    /// gpt-oss-120b's per-layer dimensions with `n_layer` layers and a `n_vocab` vocabulary.
    pub fn gpt_oss_120b_layers(n_layer: usize, n_vocab: usize) -> GptOssSpec {
        GptOssSpec {
            n_layer,
            n_embd: 2880,
            n_head: 64,
            n_head_kv: 8,
            head_dim: 64,
            n_expert: 128,
            n_expert_used: 4,
            n_ff_exp: 2880,
            n_vocab,
            sliding_window: 128,
            seed: 42,
            routing_locality: None,
        }
    }

    /// gpt-oss-120b's full dimensions (36 layers, 128 experts, o200k-sized vocabulary).
    pub fn gpt_oss_120b() -> GptOssSpec {
        GptOssSpec::gpt_oss_120b_layers(36, 201088)
    }

    /// gpt-oss-20b's full dimensions (24 layers, 32 experts).
    pub fn gpt_oss_20b() -> GptOssSpec {
        GptOssSpec {
            n_layer: 24,
            n_expert: 32,
            ..GptOssSpec::gpt_oss_120b()
        }
    }

    /// Checks the block-size and head constraints of the tensor types used.
    pub fn validate(&self) -> Result<(), String> {
        let q = self.n_head * self.head_dim;
        for (name, v) in [
            ("n_embd", self.n_embd),
            ("n_ff_exp", self.n_ff_exp),
            ("n_head*head_dim", q),
        ] {
            if v == 0 || !v.is_multiple_of(32) {
                return Err(format!("{name} = {v} must be a positive multiple of 32"));
            }
        }
        if self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err("n_head must be a multiple of n_head_kv".into());
        }
        if self.n_expert_used == 0 || self.n_expert_used > self.n_expert {
            return Err("n_expert_used must be in 1..=n_expert".into());
        }
        if self.n_layer == 0 || !self.head_dim.is_multiple_of(2) || self.n_vocab < 264 {
            return Err("need n_layer ≥ 1, an even head_dim and n_vocab ≥ 264".into());
        }
        if let Some(f) = self.routing_locality {
            if !(0.0..=1.0).contains(&f) {
                return Err(format!("--routing-locality {f} must be in 0..=1"));
            }
            if !self.n_embd.is_multiple_of(64) {
                return Err(format!(
                    "--routing-locality needs n_embd a multiple of 64 (two halves of whole \
                     blocks), got {}",
                    self.n_embd
                ));
            }
        }
        Ok(())
    }
}

/// A tensor to generate: name, type, ggml shape and the std of its values.
struct Plan {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    std: f32,
    mean: f32,
}

/// Builds a writer holding a random gpt-oss model (metadata, byte vocabulary, tensors).
pub fn gpt_oss_writer(spec: &GptOssSpec) -> Result<GgufWriter, String> {
    build(spec, false)
}

/// Builds a writer with the real metadata and tensor table but every tensor's data left as a
/// file hole: full-size layouts (gpt-oss-120b is 63 GB) for planning and `inspect`, written
/// in milliseconds and using no disk space.
pub fn gpt_oss_layout_writer(spec: &GptOssSpec) -> Result<GgufWriter, String> {
    build(spec, true)
}

fn build(spec: &GptOssSpec, sparse: bool) -> Result<GgufWriter, String> {
    spec.validate()?;
    let s = spec;
    let (d, ff, ne) = (s.n_embd as u64, s.n_ff_exp as u64, s.n_expert as u64);
    let (nq, nkv) = (
        (s.n_head * s.head_dim) as u64,
        (s.n_head_kv * s.head_dim) as u64,
    );
    let inv = |n: u64| 1.0 / (n as f32).sqrt();
    let t = |name: String, ty, dims: Vec<u64>, std, mean| Plan {
        name,
        ty,
        dims,
        std,
        mean,
    };
    use GgmlType::{F32, MXFP4, Q8_0};
    let mut plans = vec![
        t(
            "token_embd.weight".into(),
            Q8_0,
            vec![d, s.n_vocab as u64],
            1.0,
            0.0,
        ),
        t("output_norm.weight".into(), F32, vec![d], 0.1, 1.0),
        t(
            "output.weight".into(),
            Q8_0,
            vec![d, s.n_vocab as u64],
            3.0 * inv(d),
            0.0,
        ),
    ];
    for l in 0..s.n_layer {
        let n = |x: &str| format!("blk.{l}.{x}");
        plans.extend([
            t(n("attn_norm.weight"), F32, vec![d], 0.1, 1.0),
            t(n("post_attention_norm.weight"), F32, vec![d], 0.1, 1.0),
            t(n("attn_q.weight"), Q8_0, vec![d, nq], inv(d), 0.0),
            t(n("attn_q.bias"), F32, vec![nq], 0.2, 0.0),
            t(n("attn_k.weight"), Q8_0, vec![d, nkv], inv(d), 0.0),
            t(n("attn_k.bias"), F32, vec![nkv], 0.2, 0.0),
            t(n("attn_v.weight"), Q8_0, vec![d, nkv], inv(d), 0.0),
            t(n("attn_v.bias"), F32, vec![nkv], 0.2, 0.0),
            t(n("attn_output.weight"), Q8_0, vec![nq, d], inv(nq), 0.0),
            t(n("attn_output.bias"), F32, vec![d], 0.2, 0.0),
            t(n("attn_sinks.weight"), F32, vec![s.n_head as u64], 1.0, 0.0),
            t(n("ffn_gate_inp.weight"), F32, vec![d, ne], inv(d), 0.0),
            t(n("ffn_gate_inp.bias"), F32, vec![ne], 0.5, 0.0),
            t(
                n("ffn_gate_exps.weight"),
                MXFP4,
                vec![d, ff, ne],
                2.5 * inv(d),
                0.0,
            ),
            t(n("ffn_gate_exps.bias"), F32, vec![ff, ne], 0.2, 0.0),
            t(
                n("ffn_up_exps.weight"),
                MXFP4,
                vec![d, ff, ne],
                2.5 * inv(d),
                0.0,
            ),
            t(n("ffn_up_exps.bias"), F32, vec![ff, ne], 0.2, 0.0),
            t(
                n("ffn_down_exps.weight"),
                MXFP4,
                vec![ff, d, ne],
                0.3 * inv(ff),
                0.0,
            ),
            t(n("ffn_down_exps.bias"), F32, vec![d, ne], 0.2, 0.0),
        ]);
    }
    let data: Vec<Option<Vec<u8>>> = plans
        .par_iter()
        .enumerate()
        .map(|(i, p)| {
            let seed = s.seed.wrapping_mul(1_000_003).wrapping_add(i as u64);
            (!sparse).then(|| {
                let mut bytes = random_tensor(p, seed);
                if let Some(f) = s.routing_locality {
                    shape_for_locality(p, s, f, &mut bytes);
                }
                bytes
            })
        })
        .collect();
    let mut w = GgufWriter::new();
    let meta_u32 = |w: &mut GgufWriter, k: &str, v: usize| {
        w.add_meta(format!("gpt-oss.{k}"), MetaValue::U32(v as u32))
    };
    w.add_meta("general.architecture", MetaValue::String("gpt-oss".into()));
    w.add_meta(
        "general.name",
        MetaValue::String("hmoe synthetic gpt-oss".into()),
    );
    w.add_meta("general.file_type", MetaValue::U32(38));
    meta_u32(&mut w, "block_count", s.n_layer);
    meta_u32(&mut w, "context_length", 131072);
    meta_u32(&mut w, "embedding_length", s.n_embd);
    meta_u32(&mut w, "feed_forward_length", s.n_ff_exp);
    meta_u32(&mut w, "expert_feed_forward_length", s.n_ff_exp);
    meta_u32(&mut w, "attention.head_count", s.n_head);
    meta_u32(&mut w, "attention.head_count_kv", s.n_head_kv);
    meta_u32(&mut w, "attention.key_length", s.head_dim);
    meta_u32(&mut w, "attention.value_length", s.head_dim);
    meta_u32(&mut w, "attention.sliding_window", s.sliding_window);
    meta_u32(&mut w, "expert_count", s.n_expert);
    meta_u32(&mut w, "expert_used_count", s.n_expert_used);
    meta_u32(&mut w, "rope.scaling.original_context_length", 4096);
    w.add_meta(
        "gpt-oss.attention.layer_norm_rms_epsilon",
        MetaValue::F32(1e-5),
    );
    w.add_meta("gpt-oss.rope.freq_base", MetaValue::F32(150000.0));
    w.add_meta(
        "gpt-oss.rope.scaling.type",
        MetaValue::String("yarn".into()),
    );
    w.add_meta("gpt-oss.rope.scaling.factor", MetaValue::F32(32.0));
    add_byte_vocab(&mut w, s.n_vocab, &GPT_OSS);
    for (p, bytes) in plans.into_iter().zip(data) {
        match bytes {
            Some(bytes) => w.add_tensor(p.name, p.ty, &p.dims, bytes),
            None => w.add_tensor_hole(p.name, p.ty, &p.dims),
        }
        .map_err(|e| e.to_string())?;
    }
    Ok(w)
}

/// Rewrites a random tensor of `p` for routing with locality `f` (see
/// [`GptOssSpec::routing_locality`]); tensors it does not name are left as they are.
fn shape_for_locality(p: &Plan, s: &GptOssSpec, f: f32, bytes: &mut [u8]) {
    let d = s.n_embd;
    let half = d / 2;
    let name = p
        .name
        .rsplit_once("blk.")
        .map_or(p.name.as_str(), |(_, n)| {
            n.split_once('.').map_or(n, |(_, rest)| rest)
        });
    let f32s = |bytes: &mut [u8], each: &mut dyn FnMut(usize, &mut f32)| {
        for (i, c) in bytes.chunks_exact_mut(4).enumerate() {
            let mut v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            each(i, &mut v);
            c.copy_from_slice(&v.to_le_bytes());
        }
    };
    match name {
        // Q8_0 rows of `d`: the topic half's blocks get a zero scale.
        "token_embd.weight" => {
            let blocks = d / 32;
            for (i, block) in bytes.chunks_exact_mut(34).enumerate() {
                if i % blocks >= half / 32 {
                    block[..2].fill(0);
                }
            }
        }
        // Zero queries: uniform attention over the window.
        "attn_q.weight" => {
            for block in bytes.chunks_exact_mut(34) {
                block[..2].fill(0);
            }
        }
        "attn_q.bias" | "attn_v.bias" => bytes.fill(0),
        "attn_output.bias" => f32s(bytes, &mut |i, v| {
            if i >= half {
                *v = 0.0;
            }
        }),
        // MXFP4 rows of `n_ff` per output dim, `d` rows per expert: zero nibbles in the
        // topic half's rows.
        "ffn_down_exps.weight" => {
            let row = s.n_ff_exp / 32 * 17;
            for (r, row_bytes) in bytes.chunks_exact_mut(row).enumerate() {
                if r % d >= half {
                    for block in row_bytes.chunks_exact_mut(17) {
                        block[1..].fill(0);
                    }
                }
            }
        }
        "ffn_down_exps.bias" => f32s(bytes, &mut |i, v| {
            if i % d >= half {
                *v = 0.0;
            }
        }),
        "ffn_gate_inp.weight" => f32s(bytes, &mut |i, v| {
            *v *= if i % d >= half {
                f * TOPIC_GAIN
            } else {
                1.0 - f
            };
        }),
        _ => {}
    }
}

/// Random values of standard deviation `std` around `mean`, generated directly in the
/// tensor's format (quantizing gigabytes of f32 would be needlessly slow).
fn random_tensor(p: &Plan, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n: u64 = p.dims.iter().product();
    let bytes = p.ty.row_bytes(n).expect("dims are whole blocks") as usize;
    let mut out = vec![0u8; bytes];
    match p.ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                // Sum of 4 uniforms: cheap, roughly normal, std 1 after scaling by √3.
                let u: f32 = (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>() * 3f32.sqrt();
                c.copy_from_slice(&(p.mean + p.std * u).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            // int8 uniform in [-127, 127] has std ≈ 73.3.
            let d = f16::from_f32(p.std / 73.3).to_le_bytes();
            for block in out.chunks_exact_mut(34) {
                block[..2].copy_from_slice(&d);
                for q in &mut block[2..] {
                    *q = rng.random_range(-127i8..=127) as u8;
                }
            }
        }
        GgmlType::MXFP4 => {
            // Uniform nibbles give values of rms ≈ 2.93 × 2^(e−127).
            let e = (127.0 + (p.std / 2.93).log2().round()).clamp(1.0, 254.0) as u8;
            for block in out.chunks_exact_mut(17) {
                block[0] = e;
                rng.fill(&mut block[1..]);
            }
        }
        other => unreachable!("synthetic gpt-oss uses no {other} tensors"),
    }
    out
}
