//! Full-size tensor tables of published models, built from their shape parameters, so that
//! planning (and `make-test-model --sparse`) can run on the real layout without the weights.

use hmoe_quant::GgmlType;

use crate::shape::ModelShape;
use crate::tensor::TensorDesc;

/// The shape parameters of a gpt-oss model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptOssDims {
    /// Layers (36 for 120B, 24 for 20B).
    pub n_layer: u32,
    /// Hidden size (2880).
    pub n_embd: u64,
    /// Query heads (64).
    pub n_head: u64,
    /// Key/value heads (8).
    pub n_head_kv: u64,
    /// Head size (64).
    pub head_dim: u64,
    /// Experts per layer (128 for 120B, 32 for 20B).
    pub n_expert: u64,
    /// Experts per token (4).
    pub n_expert_used: u64,
    /// Expert hidden size (2880).
    pub n_ff_exp: u64,
    /// Vocabulary (201088).
    pub n_vocab: u64,
    /// Trained context (131072).
    pub n_ctx_train: u32,
    /// Sliding window of the even layers (128).
    pub sliding_window: u32,
}

impl GptOssDims {
    /// gpt-oss-120b.
    pub fn gpt_oss_120b() -> GptOssDims {
        GptOssDims {
            n_layer: 36,
            n_embd: 2880,
            n_head: 64,
            n_head_kv: 8,
            head_dim: 64,
            n_expert: 128,
            n_expert_used: 4,
            n_ff_exp: 2880,
            n_vocab: 201088,
            n_ctx_train: 131072,
            sliding_window: 128,
        }
    }

    /// gpt-oss-20b: 24 layers and 32 experts, otherwise as the 120B.
    pub fn gpt_oss_20b() -> GptOssDims {
        GptOssDims {
            n_layer: 24,
            n_expert: 32,
            ..GptOssDims::gpt_oss_120b()
        }
    }

    /// The planner's hyperparameters for this model (even layers slide).
    pub fn shape(&self) -> ModelShape {
        ModelShape {
            arch: "gpt-oss".to_string(),
            n_layer: self.n_layer,
            n_embd: self.n_embd,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim_k: self.head_dim,
            head_dim_v: self.head_dim,
            head_dim_q: self.head_dim,
            mla: false,
            n_vocab: self.n_vocab,
            n_ctx_train: self.n_ctx_train,
            sliding_window: self.sliding_window,
            swa_layers: (0..self.n_layer).map(|il| il % 2 == 0).collect(),
            n_expert: self.n_expert,
            n_expert_used: self.n_expert_used,
            n_ff_exp: self.n_ff_exp,
            n_ff: 0,
            n_ff_shexp: 0,
        }
    }
}

/// The tensor table of a gpt-oss GGUF with the types of the published MXFP4 files: expert
/// matrices MXFP4; token embedding, output head and attention q/k/v/o Q8_0; norms, sinks,
/// biases and the router F32. Order: `token_embd`, `output_norm`, `output`, then each block.
///
/// `None` when a dimension is not a whole number of blocks of its type (every row length must
/// be a multiple of 32) or a size overflows.
pub fn gpt_oss_tensor_table(d: &GptOssDims) -> Option<Vec<TensorDesc>> {
    use GgmlType::{F32, MXFP4, Q8_0};
    let e = d.n_embd;
    let q = d.n_head * d.head_dim;
    let kv = d.n_head_kv * d.head_dim;
    let (nx, ff) = (d.n_expert, d.n_ff_exp);
    let mut v = vec![
        TensorDesc::new("token_embd.weight", Q8_0, &[e, d.n_vocab])?,
        TensorDesc::new("output_norm.weight", F32, &[e])?,
        TensorDesc::new("output.weight", Q8_0, &[e, d.n_vocab])?,
    ];
    for il in 0..d.n_layer {
        let t = |name: &str, ty: GgmlType, dims: &[u64]| {
            TensorDesc::new(format!("blk.{il}.{name}"), ty, dims)
        };
        v.extend([
            t("attn_norm.weight", F32, &[e])?,
            t("attn_q.weight", Q8_0, &[e, q])?,
            t("attn_q.bias", F32, &[q])?,
            t("attn_k.weight", Q8_0, &[e, kv])?,
            t("attn_k.bias", F32, &[kv])?,
            t("attn_v.weight", Q8_0, &[e, kv])?,
            t("attn_v.bias", F32, &[kv])?,
            t("attn_output.weight", Q8_0, &[q, e])?,
            t("attn_output.bias", F32, &[e])?,
            t("attn_sinks.weight", F32, &[d.n_head])?,
            t("post_attention_norm.weight", F32, &[e])?,
            t("ffn_gate_inp.weight", F32, &[e, nx])?,
            t("ffn_gate_inp.bias", F32, &[nx])?,
            t("ffn_gate_exps.weight", MXFP4, &[e, ff, nx])?,
            t("ffn_gate_exps.bias", F32, &[ff, nx])?,
            t("ffn_up_exps.weight", MXFP4, &[e, ff, nx])?,
            t("ffn_up_exps.bias", F32, &[ff, nx])?,
            t("ffn_down_exps.weight", MXFP4, &[ff, e, nx])?,
            t("ffn_down_exps.bias", F32, &[e, nx])?,
        ]);
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(v: &[TensorDesc], ty: GgmlType) -> usize {
        v.iter().filter(|t| t.ty == ty).count()
    }

    #[test]
    fn gpt_oss_120b_matches_the_published_file() {
        let v = gpt_oss_tensor_table(&GptOssDims::gpt_oss_120b()).unwrap();
        assert_eq!(v.len(), 687);
        assert_eq!(count(&v, GgmlType::F32), 433);
        assert_eq!(count(&v, GgmlType::Q8_0), 146);
        assert_eq!(count(&v, GgmlType::MXFP4), 108);
        let total: u64 = v.iter().map(|t| t.n_bytes).sum();
        // ggml-org/gpt-oss-120b-GGUF (MXFP4): 63.4 GB in three shards.
        assert_eq!(total, 63_374_323_968);
        let experts: u64 = v
            .iter()
            .filter(|t| t.name.contains("_exps"))
            .map(|t| t.n_bytes)
            .sum();
        assert!((60.9e9..61.1e9).contains(&(experts as f64)), "{experts}");
    }

    #[test]
    fn gpt_oss_20b_counts() {
        let v = gpt_oss_tensor_table(&GptOssDims::gpt_oss_20b()).unwrap();
        assert_eq!(v.len(), 459);
        assert_eq!(count(&v, GgmlType::F32), 289);
        assert_eq!(count(&v, GgmlType::Q8_0), 98);
        assert_eq!(count(&v, GgmlType::MXFP4), 72);
        let total: u64 = v.iter().map(|t| t.n_bytes).sum();
        // ggml-org/gpt-oss-20b-GGUF (MXFP4): about 12.1 GB.
        assert!((12.0e9..12.2e9).contains(&(total as f64)), "{total}");
    }

    #[test]
    fn rejects_unaligned_dims() {
        let d = GptOssDims {
            n_embd: 100,
            ..GptOssDims::gpt_oss_20b()
        };
        assert!(gpt_oss_tensor_table(&d).is_none());
    }
}
