//! Random Qwen3-MoE models (`qwen3moe`): grouped-query attention with per-head q/k RMSNorm and
//! no biases, and a softmax router over `n_expert` SwiGLU experts of which `n_expert_used` run.
//! Matrices are Q8_0 (experts: [`Qwen3MoeSpec::expert_type`]), norms and router F32.

use hmoe_gguf::{GgufWriter, MetaValue};
use hmoe_quant::GgmlType;

use crate::add_byte_vocab;
use crate::tensors::{add_planned, check_expert_types, Plan};
use crate::vocab::QWEN3;

/// Dimensions of a synthetic Qwen3-MoE model.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3MoeSpec {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
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
    /// Expert hidden size.
    pub n_ff_exp: usize,
    /// Vocabulary size (≥ 264).
    pub n_vocab: usize,
    /// Storage type of the expert matrices (Q8_0, Q4_0, Q4_K, Q6_K, F32 or an IQ type).
    pub expert_type: GgmlType,
    /// Storage type of the experts' down matrices when not `expert_type` (a Q4_K_M file's
    /// Q6_K down experts).
    pub down_expert_type: Option<GgmlType>,
    /// RNG seed.
    pub seed: u64,
}

impl Qwen3MoeSpec {
    /// A model small enough to generate from in a fraction of a second.
    pub fn tiny() -> Qwen3MoeSpec {
        Qwen3MoeSpec {
            n_layer: 4,
            n_embd: 256,
            n_head: 8,
            n_head_kv: 2,
            head_dim: 32,
            n_expert: 16,
            n_expert_used: 4,
            n_ff_exp: 256,
            n_vocab: 512,
            expert_type: GgmlType::Q8_0,
            down_expert_type: None,
            seed: 42,
        }
    }

    /// Qwen3-30B-A3B's dimensions (48 layers, 128 experts, 8 used).
    pub fn qwen3_30b_a3b() -> Qwen3MoeSpec {
        Qwen3MoeSpec {
            n_layer: 48,
            n_embd: 2048,
            n_head: 32,
            n_head_kv: 4,
            head_dim: 128,
            n_expert: 128,
            n_expert_used: 8,
            n_ff_exp: 768,
            n_vocab: 151936,
            expert_type: GgmlType::Q8_0,
            down_expert_type: None,
            seed: 42,
        }
    }

    /// Qwen3-235B-A22B's dimensions (94 layers, 128 experts, 8 used).
    pub fn qwen3_235b_a22b() -> Qwen3MoeSpec {
        Qwen3MoeSpec {
            n_layer: 94,
            n_embd: 4096,
            n_head: 64,
            n_head_kv: 4,
            n_ff_exp: 1536,
            ..Qwen3MoeSpec::qwen3_30b_a3b()
        }
    }

    /// Checks the head, expert and block-size constraints.
    pub fn validate(&self) -> Result<(), String> {
        if self.n_layer == 0 || self.n_embd == 0 || self.n_ff_exp == 0 || self.n_vocab < 264 {
            return Err("need n_layer, n_embd, n_ff_exp ≥ 1 and n_vocab ≥ 264".into());
        }
        if self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err("n_head must be a positive multiple of n_head_kv".into());
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err("head_dim must be even and nonzero".into());
        }
        if self.n_expert_used == 0 || self.n_expert_used > self.n_expert {
            return Err("n_expert_used must be in 1..=n_expert".into());
        }
        let down = self.down_expert_type.unwrap_or(self.expert_type);
        check_expert_types(&[self.expert_type, down], (self.n_embd, self.n_ff_exp))
    }
}

/// Builds a writer holding a random Qwen3-MoE model (metadata, byte vocabulary, tensors).
pub fn qwen3moe_writer(spec: &Qwen3MoeSpec) -> Result<GgufWriter, String> {
    build(spec, false)
}

/// The same metadata and tensor table with every tensor's data left as a file hole.
pub fn qwen3moe_layout_writer(spec: &Qwen3MoeSpec) -> Result<GgufWriter, String> {
    build(spec, true)
}

fn build(s: &Qwen3MoeSpec, sparse: bool) -> Result<GgufWriter, String> {
    s.validate()?;
    let (d, ff, ne, v) = (
        s.n_embd as u64,
        s.n_ff_exp as u64,
        s.n_expert as u64,
        s.n_vocab as u64,
    );
    let (hd, nq, nkv) = (
        s.head_dim as u64,
        (s.n_head * s.head_dim) as u64,
        (s.n_head_kv * s.head_dim) as u64,
    );
    use GgmlType::Q8_0;
    let et = s.expert_type;
    let det = s.down_expert_type.unwrap_or(et);
    let mut plans = vec![
        Plan::matrix(
            "token_embd.weight".into(),
            Q8_0,
            vec![d, v],
            (d as f32).sqrt(),
        ),
        Plan::f32("output_norm.weight".into(), vec![d], 0.1, 1.0),
        Plan::matrix("output.weight".into(), Q8_0, vec![d, v], 3.0),
    ];
    for l in 0..s.n_layer {
        let n = |x: &str| format!("blk.{l}.{x}");
        plans.extend([
            Plan::f32(n("attn_norm.weight"), vec![d], 0.1, 1.0),
            Plan::matrix(n("attn_q.weight"), Q8_0, vec![d, nq], 1.0),
            Plan::matrix(n("attn_k.weight"), Q8_0, vec![d, nkv], 1.0),
            Plan::matrix(n("attn_v.weight"), Q8_0, vec![d, nkv], 1.0),
            Plan::f32(n("attn_q_norm.weight"), vec![hd], 0.1, 1.0),
            Plan::f32(n("attn_k_norm.weight"), vec![hd], 0.1, 1.0),
            Plan::matrix(n("attn_output.weight"), Q8_0, vec![nq, d], 1.0),
            Plan::f32(n("ffn_norm.weight"), vec![d], 0.1, 1.0),
            Plan::f32(
                n("ffn_gate_inp.weight"),
                vec![d, ne],
                2.0 / (d as f32).sqrt(),
                0.0,
            ),
            Plan::matrix(n("ffn_gate_exps.weight"), et, vec![d, ff, ne], 1.5),
            Plan::matrix(n("ffn_up_exps.weight"), et, vec![d, ff, ne], 1.5),
            Plan::matrix(n("ffn_down_exps.weight"), det, vec![ff, d, ne], 0.5),
        ]);
    }
    let mut w = GgufWriter::new();
    let u32m = |w: &mut GgufWriter, k: &str, v: usize| {
        w.add_meta(format!("qwen3moe.{k}"), MetaValue::U32(v as u32))
    };
    w.add_meta("general.architecture", MetaValue::String("qwen3moe".into()));
    w.add_meta(
        "general.name",
        MetaValue::String("hmoe synthetic qwen3moe".into()),
    );
    u32m(&mut w, "block_count", s.n_layer);
    u32m(&mut w, "context_length", 40960);
    u32m(&mut w, "embedding_length", s.n_embd);
    u32m(&mut w, "feed_forward_length", s.n_ff_exp * s.n_expert_used);
    u32m(&mut w, "expert_feed_forward_length", s.n_ff_exp);
    u32m(&mut w, "attention.head_count", s.n_head);
    u32m(&mut w, "attention.head_count_kv", s.n_head_kv);
    u32m(&mut w, "attention.key_length", s.head_dim);
    u32m(&mut w, "attention.value_length", s.head_dim);
    u32m(&mut w, "expert_count", s.n_expert);
    u32m(&mut w, "expert_used_count", s.n_expert_used);
    w.add_meta(
        "qwen3moe.attention.layer_norm_rms_epsilon",
        MetaValue::F32(1e-6),
    );
    w.add_meta("qwen3moe.rope.freq_base", MetaValue::F32(1_000_000.0));
    add_byte_vocab(&mut w, s.n_vocab, &QWEN3);
    add_planned(&mut w, plans, s.seed, sparse)?;
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_bad_specs_are_refused() {
        for s in [
            Qwen3MoeSpec::tiny(),
            Qwen3MoeSpec::qwen3_30b_a3b(),
            Qwen3MoeSpec::qwen3_235b_a22b(),
        ] {
            s.validate().unwrap();
        }
        let bad = |f: fn(&mut Qwen3MoeSpec)| {
            let mut s = Qwen3MoeSpec::tiny();
            f(&mut s);
            s.validate().is_err()
        };
        assert!(bad(|s| s.n_head_kv = 3));
        assert!(bad(|s| s.n_expert_used = 17));
        assert!(bad(|s| s.head_dim = 31));
        assert!(bad(|s| s.expert_type = GgmlType::Q3_K));
        assert!(bad(|s| s.down_expert_type = Some(GgmlType::Q3_K)));
        assert!(bad(|s| {
            (s.expert_type, s.down_expert_type) = (GgmlType::Q4_0, Some(GgmlType::Q6_K));
            s.n_ff_exp = 96;
        }));
        assert!(bad(|s| {
            s.expert_type = GgmlType::Q4_K;
            s.n_ff_exp = 96;
        }));
    }

    #[test]
    fn tiny_has_the_qwen3moe_tensor_table() {
        let spec = Qwen3MoeSpec {
            n_layer: 2,
            ..Qwen3MoeSpec::tiny()
        };
        let g =
            hmoe_gguf::GgufModel::from_bytes(qwen3moe_writer(&spec).unwrap().to_bytes().unwrap())
                .unwrap();
        assert_eq!(g.metadata().architecture(), Some("qwen3moe"));
        assert_eq!(g.tensors().len(), 3 + 2 * 12);
        let t = g.tensor_info("blk.1.ffn_down_exps.weight").unwrap();
        assert_eq!((t.ty, t.dims.clone()), (GgmlType::Q8_0, vec![256, 256, 16]));
        assert_eq!(
            g.tensor_info("blk.0.attn_q_norm.weight").unwrap().dims,
            vec![32]
        );
    }
}
