//! The planner's view of a tensor, and how a tensor's name tells its role.

use hmoe_quant::GgmlType;
use std::sync::OnceLock;

use regex::Regex;

use crate::flags::FFN_EXPS_REGEX;

/// A tensor as the planner sees it: no data, no file offsets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// GGUF name (`blk.0.ffn_up_exps.weight`).
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Shape in ggml `ne` order (`dims[0]` is the row length).
    pub dims: Vec<u64>,
    /// Bytes of data.
    pub n_bytes: u64,
}

impl TensorDesc {
    /// A tensor with its byte size computed from type and shape; `None` when the row length
    /// is not a whole number of blocks, a dim is 0, or the size overflows.
    pub fn new(name: impl Into<String>, ty: GgmlType, dims: &[u64]) -> Option<TensorDesc> {
        let (&d0, rest) = dims.split_first()?;
        if dims.contains(&0) {
            return None;
        }
        let mut bytes = ty.row_bytes(d0)?;
        for &d in rest {
            bytes = bytes.checked_mul(d)?;
        }
        Some(TensorDesc {
            name: name.into(),
            ty,
            dims: dims.to_vec(),
            n_bytes: bytes,
        })
    }
}

impl From<&hmoe_gguf::TensorInfo> for TensorDesc {
    fn from(t: &hmoe_gguf::TensorInfo) -> TensorDesc {
        TensorDesc {
            name: t.name.clone(),
            ty: t.ty,
            dims: t.dims.clone(),
            n_bytes: t.n_bytes,
        }
    }
}

/// Which layer-group a tensor belongs to for `-ngl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerGroup {
    /// The input layer (`token_embd.*` and any unrecognised global tensor): always on the CPU,
    /// as in llama.cpp (rows are looked up on the CPU and copied up).
    Input,
    /// Repeating layer `blk.N.*`.
    Block(u32),
    /// The output layer (`output.*`, `output_norm.*`), which `-ngl` counts as one more layer.
    Output,
}

/// What a tensor does, for the compute-buffer estimate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// Attention projections and their biases, sinks, MLA low-rank parts.
    Attention,
    /// The MoE router `ffn_gate_inp` and its bias.
    Router,
    /// Routed experts: names matching [`FFN_EXPS_REGEX`] (weights and biases).
    Experts,
    /// Shared experts `ffn_*_shexp`.
    SharedExperts,
    /// A dense FFN `ffn_up/gate/down` (DeepSeek's leading dense layers).
    DenseFfn,
    /// The token embedding.
    Embedding,
    /// The output head matrix.
    OutputHead,
    /// Norms and anything else small.
    Other,
}

fn exps_regex() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(FFN_EXPS_REGEX).expect("constant regex compiles"))
}

/// The `-ngl` layer group of a tensor, from its name.
pub fn layer_group(name: &str) -> LayerGroup {
    if let Some(rest) = name.strip_prefix("blk.") {
        if let Some((n, _)) = rest.split_once('.') {
            if let Ok(il) = n.parse::<u32>() {
                return LayerGroup::Block(il);
            }
        }
    }
    if name.starts_with("output.") || name.starts_with("output_norm.") {
        return LayerGroup::Output;
    }
    LayerGroup::Input
}

/// What a tensor does, from its name.
pub fn tensor_kind(name: &str) -> TensorKind {
    if name.starts_with("token_embd.") {
        return TensorKind::Embedding;
    }
    if name.starts_with("output.") {
        return TensorKind::OutputHead;
    }
    if exps_regex().is_match(name) {
        return TensorKind::Experts;
    }
    if name.contains(".ffn_gate_inp") {
        return TensorKind::Router;
    }
    if name.contains("_shexp") {
        return TensorKind::SharedExperts;
    }
    if name.contains("norm") {
        return TensorKind::Other;
    }
    if name.contains(".attn_") {
        return TensorKind::Attention;
    }
    if name.contains(".ffn_up") || name.contains(".ffn_gate") || name.contains(".ffn_down") {
        return TensorKind::DenseFfn;
    }
    TensorKind::Other
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_from_shape() {
        let t = TensorDesc::new("x", GgmlType::MXFP4, &[2880, 2880, 128]).unwrap();
        assert_eq!(t.n_bytes, 90 * 17 * 2880 * 128);
        assert!(TensorDesc::new("x", GgmlType::Q8_0, &[33]).is_none());
        assert!(TensorDesc::new("x", GgmlType::F32, &[]).is_none());
        assert!(TensorDesc::new("x", GgmlType::F32, &[4, 0]).is_none());
        assert!(TensorDesc::new("x", GgmlType::F32, &[u64::MAX, 4]).is_none());
    }

    #[test]
    fn groups_and_kinds() {
        assert_eq!(layer_group("blk.12.attn_q.weight"), LayerGroup::Block(12));
        assert_eq!(layer_group("output.weight"), LayerGroup::Output);
        assert_eq!(layer_group("output_norm.weight"), LayerGroup::Output);
        assert_eq!(layer_group("token_embd.weight"), LayerGroup::Input);
        assert_eq!(layer_group("rope_freqs.weight"), LayerGroup::Input);
        assert_eq!(layer_group("blk.x.attn_q.weight"), LayerGroup::Input);
        for (n, k) in [
            ("blk.0.ffn_up_exps.weight", TensorKind::Experts),
            ("blk.0.ffn_up_exps.bias", TensorKind::Experts),
            ("blk.0.ffn_gate_up_exps.weight", TensorKind::Experts),
            ("blk.0.ffn_down_chexps.weight", TensorKind::Experts),
            ("blk.0.ffn_gate_inp.weight", TensorKind::Router),
            ("blk.0.ffn_gate_inp.bias", TensorKind::Router),
            ("blk.0.ffn_up_shexp.weight", TensorKind::SharedExperts),
            ("blk.0.ffn_down.weight", TensorKind::DenseFfn),
            ("blk.0.attn_q.weight", TensorKind::Attention),
            ("blk.0.attn_sinks.weight", TensorKind::Attention),
            ("blk.0.attn_norm.weight", TensorKind::Other),
            ("blk.0.post_attention_norm.weight", TensorKind::Other),
            ("blk.0.exp_probs_b.bias", TensorKind::Other),
            ("token_embd.weight", TensorKind::Embedding),
            ("output.weight", TensorKind::OutputHead),
            ("output_norm.weight", TensorKind::Other),
        ] {
            assert_eq!(tensor_kind(n), k, "{n}");
        }
    }
}
