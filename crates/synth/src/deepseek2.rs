//! Random DeepSeek-V2/V3 models (`deepseek2`) in the absorbed multi-head latent attention layout
//! llama.cpp's converter writes: a low-rank query (`attn_q_a` → norm → `attn_q_b`, or a plain
//! `attn_q` without q_lora), the joint latent + rope key `attn_kv_a_mqa`, per-head `attn_k_b` /
//! `attn_v_b`, dense leading blocks, then blocks of routed experts with sigmoid gating, the
//! `exp_probs_b` selection bias, group-limited top-k and shared experts.
//! Matrices are Q8_0 (experts: [`Deepseek2Spec::expert_type`]; matrices whose rows are not
//! whole blocks: F32), norms, router and bias F32.

use hmoe_gguf::{GgufWriter, MetaValue};
use hmoe_quant::GgmlType;

use crate::add_byte_vocab;
use crate::tensors::{add_planned, check_expert_types, Plan};
use crate::vocab::DEEPSEEK_V3;

/// Dimensions of a synthetic DeepSeek model.
#[derive(Clone, Debug, PartialEq)]
pub struct Deepseek2Spec {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Leading blocks with a dense FFN instead of experts.
    pub n_layer_dense_lead: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Rank of the query compression (0: a plain `attn_q`, as DeepSeek-V2-Lite).
    pub q_lora_rank: usize,
    /// Rank of the key/value latent.
    pub kv_lora_rank: usize,
    /// Per-head query/key dims without RoPE.
    pub qk_nope_dim: usize,
    /// Per-head query/key dims with RoPE (shared by all heads on the key side).
    pub qk_rope_dim: usize,
    /// Per-head value dims.
    pub v_head_dim: usize,
    /// Hidden size of the dense leading blocks.
    pub n_ff: usize,
    /// Routed experts per MoE block.
    pub n_expert: usize,
    /// Routed experts per token.
    pub n_expert_used: usize,
    /// Shared experts per MoE block.
    pub n_expert_shared: usize,
    /// Expert hidden size.
    pub n_ff_exp: usize,
    /// Expert groups (1: no group limit).
    pub n_group: usize,
    /// Groups a token may route to.
    pub n_group_used: usize,
    /// Factor on the routed experts' weights.
    pub routed_scale: f32,
    /// Vocabulary size (≥ 264).
    pub n_vocab: usize,
    /// Storage type of the routed and shared expert matrices (Q8_0, Q4_0, Q4_K, Q6_K, F32 or an IQ type).
    pub expert_type: GgmlType,
    /// Storage type of the routed and shared experts' down matrices when not `expert_type`
    /// (a Q4_K_M file's Q6_K down experts).
    pub down_expert_type: Option<GgmlType>,
    /// RNG seed.
    pub seed: u64,
}

impl Deepseek2Spec {
    /// A model small enough to generate from in a fraction of a second.
    pub fn tiny() -> Deepseek2Spec {
        Deepseek2Spec {
            n_layer: 4,
            n_layer_dense_lead: 1,
            n_embd: 256,
            n_head: 8,
            q_lora_rank: 128,
            kv_lora_rank: 64,
            qk_nope_dim: 32,
            qk_rope_dim: 16,
            v_head_dim: 32,
            n_ff: 512,
            n_expert: 16,
            n_expert_used: 4,
            n_expert_shared: 1,
            n_ff_exp: 128,
            n_group: 4,
            n_group_used: 2,
            routed_scale: 2.5,
            n_vocab: 512,
            expert_type: GgmlType::Q8_0,
            down_expert_type: None,
            seed: 42,
        }
    }

    /// DeepSeek-V3's per-layer dimensions with `n_layer` layers (the first `n_layer_dense_lead`
    /// dense) and a `n_vocab` vocabulary.
    pub fn deepseek_v3_layers(
        n_layer: usize,
        n_layer_dense_lead: usize,
        n_vocab: usize,
    ) -> Deepseek2Spec {
        Deepseek2Spec {
            n_layer,
            n_layer_dense_lead,
            n_embd: 7168,
            n_head: 128,
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_dim: 128,
            qk_rope_dim: 64,
            v_head_dim: 128,
            n_ff: 18432,
            n_expert: 256,
            n_expert_used: 8,
            n_expert_shared: 1,
            n_ff_exp: 2048,
            n_group: 8,
            n_group_used: 4,
            routed_scale: 2.5,
            n_vocab,
            expert_type: GgmlType::Q8_0,
            down_expert_type: None,
            seed: 42,
        }
    }

    /// DeepSeek-V3/R1's full dimensions (61 layers, the first 3 dense).
    pub fn deepseek_v3() -> Deepseek2Spec {
        Deepseek2Spec::deepseek_v3_layers(61, 3, 129280)
    }

    /// Checks the MLA, expert-group and block-size constraints.
    pub fn validate(&self) -> Result<(), String> {
        let s = self;
        if s.n_layer == 0 || s.n_embd == 0 || s.n_head == 0 || s.n_vocab < 264 {
            return Err("need n_layer, n_embd, n_head ≥ 1 and n_vocab ≥ 264".into());
        }
        if s.n_layer_dense_lead > s.n_layer {
            return Err("more dense leading layers than layers".into());
        }
        if s.kv_lora_rank == 0 || s.qk_nope_dim == 0 || s.v_head_dim == 0 {
            return Err("kv_lora_rank, qk_nope_dim and v_head_dim must be nonzero".into());
        }
        if s.qk_rope_dim == 0 || !s.qk_rope_dim.is_multiple_of(2) {
            return Err("qk_rope_dim must be even and nonzero".into());
        }
        if s.n_expert_used == 0 || s.n_expert_used > s.n_expert || s.n_ff == 0 || s.n_ff_exp == 0 {
            return Err("need 1 ≤ n_expert_used ≤ n_expert and nonzero FFN sizes".into());
        }
        if s.n_group == 0
            || !s.n_expert.is_multiple_of(s.n_group)
            || s.n_group_used == 0
            || s.n_group_used > s.n_group
            || s.n_group_used * (s.n_expert / s.n_group) < s.n_expert_used
        {
            return Err(
                "expert groups must split the experts evenly and hold n_expert_used".into(),
            );
        }
        let down = s.down_expert_type.unwrap_or(s.expert_type);
        check_expert_types(&[s.expert_type, down], (s.n_embd, s.n_ff_exp))
    }
}

/// Builds a writer holding a random DeepSeek model (metadata, byte vocabulary, tensors).
pub fn deepseek2_writer(spec: &Deepseek2Spec) -> Result<GgufWriter, String> {
    build(spec, false)
}

/// The same metadata and tensor table with every tensor's data left as a file hole.
pub fn deepseek2_layout_writer(spec: &Deepseek2Spec) -> Result<GgufWriter, String> {
    build(spec, true)
}

fn build(s: &Deepseek2Spec, sparse: bool) -> Result<GgufWriter, String> {
    s.validate()?;
    let u = |x: usize| x as u64;
    let (d, nh, v) = (u(s.n_embd), u(s.n_head), u(s.n_vocab));
    let (kvl, rope, nope, vd) = (
        u(s.kv_lora_rank),
        u(s.qk_rope_dim),
        u(s.qk_nope_dim),
        u(s.v_head_dim),
    );
    let q_width = nh * (nope + rope);
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
        plans.push(Plan::f32(n("attn_norm.weight"), vec![d], 0.1, 1.0));
        if s.q_lora_rank > 0 {
            let r = u(s.q_lora_rank);
            plans.extend([
                Plan::matrix(n("attn_q_a.weight"), Q8_0, vec![d, r], 1.0),
                Plan::f32(n("attn_q_a_norm.weight"), vec![r], 0.1, 1.0),
                Plan::matrix(n("attn_q_b.weight"), Q8_0, vec![r, q_width], 1.0),
            ]);
        } else {
            plans.push(Plan::matrix(
                n("attn_q.weight"),
                Q8_0,
                vec![d, q_width],
                1.0,
            ));
        }
        plans.extend([
            Plan::matrix(n("attn_kv_a_mqa.weight"), Q8_0, vec![d, kvl + rope], 1.0),
            Plan::f32(n("attn_kv_a_norm.weight"), vec![kvl], 0.1, 1.0),
            Plan::matrix(n("attn_k_b.weight"), Q8_0, vec![nope, kvl, nh], 1.0),
            Plan::matrix(n("attn_v_b.weight"), Q8_0, vec![kvl, vd, nh], 1.0),
            Plan::matrix(n("attn_output.weight"), Q8_0, vec![nh * vd, d], 1.0),
            Plan::f32(n("ffn_norm.weight"), vec![d], 0.1, 1.0),
        ]);
        if l < s.n_layer_dense_lead {
            let ff = u(s.n_ff);
            plans.extend([
                Plan::matrix(n("ffn_gate.weight"), Q8_0, vec![d, ff], 1.5),
                Plan::matrix(n("ffn_up.weight"), Q8_0, vec![d, ff], 1.5),
                Plan::matrix(n("ffn_down.weight"), Q8_0, vec![ff, d], 0.5),
            ]);
            continue;
        }
        let (ff, ne) = (u(s.n_ff_exp), u(s.n_expert));
        plans.extend([
            Plan::f32(
                n("ffn_gate_inp.weight"),
                vec![d, ne],
                2.0 / (d as f32).sqrt(),
                0.0,
            ),
            Plan::f32(n("exp_probs_b.bias"), vec![ne], 0.05, 0.0),
            Plan::matrix(n("ffn_gate_exps.weight"), et, vec![d, ff, ne], 1.5),
            Plan::matrix(n("ffn_up_exps.weight"), et, vec![d, ff, ne], 1.5),
            Plan::matrix(n("ffn_down_exps.weight"), det, vec![ff, d, ne], 0.5),
        ]);
        if s.n_expert_shared > 0 {
            let fs = ff * u(s.n_expert_shared);
            plans.extend([
                Plan::matrix(n("ffn_gate_shexp.weight"), et, vec![d, fs], 1.5),
                Plan::matrix(n("ffn_up_shexp.weight"), et, vec![d, fs], 1.5),
                Plan::matrix(n("ffn_down_shexp.weight"), det, vec![fs, d], 0.5),
            ]);
        }
    }
    let mut w = GgufWriter::new();
    let u32m = |w: &mut GgufWriter, k: &str, v: usize| {
        w.add_meta(format!("deepseek2.{k}"), MetaValue::U32(v as u32))
    };
    w.add_meta(
        "general.architecture",
        MetaValue::String("deepseek2".into()),
    );
    w.add_meta(
        "general.name",
        MetaValue::String("hmoe synthetic deepseek2".into()),
    );
    u32m(&mut w, "block_count", s.n_layer);
    u32m(&mut w, "context_length", 163840);
    u32m(&mut w, "embedding_length", s.n_embd);
    u32m(&mut w, "feed_forward_length", s.n_ff);
    u32m(&mut w, "attention.head_count", s.n_head);
    // The latent cache: one "head" of kv_lora + rope keys and kv_lora values.
    u32m(&mut w, "attention.head_count_kv", 1);
    u32m(
        &mut w,
        "attention.key_length",
        s.kv_lora_rank + s.qk_rope_dim,
    );
    u32m(&mut w, "attention.value_length", s.kv_lora_rank);
    u32m(
        &mut w,
        "attention.key_length_mla",
        s.qk_nope_dim + s.qk_rope_dim,
    );
    u32m(&mut w, "attention.value_length_mla", s.v_head_dim);
    if s.q_lora_rank > 0 {
        u32m(&mut w, "attention.q_lora_rank", s.q_lora_rank);
    }
    u32m(&mut w, "attention.kv_lora_rank", s.kv_lora_rank);
    u32m(&mut w, "rope.dimension_count", s.qk_rope_dim);
    u32m(&mut w, "leading_dense_block_count", s.n_layer_dense_lead);
    u32m(&mut w, "expert_count", s.n_expert);
    u32m(&mut w, "expert_used_count", s.n_expert_used);
    u32m(&mut w, "expert_shared_count", s.n_expert_shared);
    u32m(&mut w, "expert_feed_forward_length", s.n_ff_exp);
    u32m(&mut w, "expert_group_count", s.n_group);
    u32m(&mut w, "expert_group_used_count", s.n_group_used);
    u32m(&mut w, "expert_gating_func", 2);
    w.add_meta(
        "deepseek2.expert_weights_scale",
        MetaValue::F32(s.routed_scale),
    );
    w.add_meta("deepseek2.expert_weights_norm", MetaValue::Bool(true));
    w.add_meta(
        "deepseek2.attention.layer_norm_rms_epsilon",
        MetaValue::F32(1e-6),
    );
    w.add_meta("deepseek2.rope.freq_base", MetaValue::F32(10000.0));
    add_byte_vocab(&mut w, s.n_vocab, &DEEPSEEK_V3);
    add_planned(&mut w, plans, s.seed, sparse)?;
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_bad_specs_are_refused() {
        Deepseek2Spec::tiny().validate().unwrap();
        Deepseek2Spec::deepseek_v3().validate().unwrap();
        let bad = |f: fn(&mut Deepseek2Spec)| {
            let mut s = Deepseek2Spec::tiny();
            f(&mut s);
            s.validate().is_err()
        };
        assert!(bad(|s| s.n_group = 3));
        assert!(bad(|s| s.n_group_used = 0));
        assert!(bad(|s| {
            s.n_group_used = 1;
            s.n_expert_used = 5;
        }));
        assert!(bad(|s| s.qk_rope_dim = 7));
        assert!(bad(|s| s.n_layer_dense_lead = 5));
        assert!(bad(|s| s.expert_type = GgmlType::Q3_K));
    }

    #[test]
    fn tiny_has_the_deepseek2_tensor_table() {
        let g = hmoe_gguf::GgufModel::from_bytes(
            deepseek2_writer(&Deepseek2Spec::tiny())
                .unwrap()
                .to_bytes()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(g.metadata().architecture(), Some("deepseek2"));
        // 3 global + dense block (10 attention/norm + 3 FFN) + 3 MoE blocks (10 + 5 + 3).
        assert_eq!(g.tensors().len(), 3 + 13 + 3 * 18);
        assert_eq!(
            g.tensor_info("blk.0.attn_k_b.weight").unwrap().dims,
            vec![32, 64, 8]
        );
        assert_eq!(
            g.tensor_info("blk.2.ffn_down_shexp.weight").unwrap().dims,
            vec![128, 256]
        );
        assert!(g.tensor_info("blk.0.ffn_gate_exps.weight").is_none());
    }
}
