//! Model hyperparameters the planner needs, and reading them from GGUF metadata keys.

use crate::error::PlacementError;

/// The hyperparameters that decide KV cache and compute-buffer sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// GGUF architecture string (`gpt-oss`, `qwen3moe`, `deepseek2`).
    pub arch: String,
    /// Repeating layers (`block_count`).
    pub n_layer: u32,
    /// Hidden size.
    pub n_embd: u64,
    /// Query heads.
    pub n_head: u64,
    /// Key/value heads as stored in the KV cache (1 for DeepSeek's MLA latent cache).
    pub n_head_kv: u64,
    /// Elements per head of a cached key (`attention.key_length`; for MLA files this is
    /// `kv_lora_rank + rope dims`, e.g. 576).
    pub head_dim_k: u64,
    /// Elements per head of a value (`attention.value_length`; for MLA the latent rank).
    pub head_dim_v: u64,
    /// Query head size used by the attention math (`key_length_mla` for MLA, else `head_dim_k`).
    pub head_dim_q: u64,
    /// Multi-head latent attention (DeepSeek files with `key_length_mla` and
    /// `value_length_mla`): llama.cpp then caches K only, V being a view of it.
    pub mla: bool,
    /// Vocabulary size.
    pub n_vocab: u64,
    /// Trained context (`context_length`), what `-c 0` means.
    pub n_ctx_train: u32,
    /// Sliding-window size in tokens, 0 if the model has none.
    pub sliding_window: u32,
    /// Per layer: whether it uses the sliding window (length `n_layer`).
    pub swa_layers: Vec<bool>,
    /// Routed experts per MoE layer (0 for a dense model).
    pub n_expert: u64,
    /// Experts used per token.
    pub n_expert_used: u64,
    /// Hidden size of one routed expert.
    pub n_ff_exp: u64,
    /// Hidden size of a dense FFN (DeepSeek's leading dense layers), 0 if none.
    pub n_ff: u64,
    /// Total hidden size of the shared experts of a layer, 0 if none.
    pub n_ff_shexp: u64,
}

impl ModelShape {
    /// Elements of one token's key in one layer.
    pub fn n_embd_k_gqa(&self) -> u64 {
        self.n_head_kv * self.head_dim_k
    }

    /// Elements of one token's cached value in one layer (0 for MLA: no V cache).
    pub fn n_embd_v_gqa(&self) -> u64 {
        if self.mla {
            0
        } else {
            self.n_head_kv * self.head_dim_v
        }
    }

    /// Whether layer `il` uses the sliding window.
    pub fn is_swa(&self, il: u32) -> bool {
        self.sliding_window > 0 && self.swa_layers.get(il as usize).copied().unwrap_or(false)
    }

    /// Checks the fields are consistent enough to plan with.
    pub fn validate(&self) -> Result<(), PlacementError> {
        let bad = |m: &str| Err(PlacementError::Shape(m.to_string()));
        if self.n_layer == 0 || self.n_embd == 0 || self.n_vocab == 0 {
            return bad("n_layer, n_embd and n_vocab must be positive");
        }
        if self.n_head == 0 || self.n_head_kv == 0 || self.head_dim_k == 0 || self.head_dim_v == 0 {
            return bad("head counts and head sizes must be positive");
        }
        if self.n_ctx_train == 0 {
            return bad("the trained context length is 0");
        }
        if self.swa_layers.len() != self.n_layer as usize {
            return bad("swa_layers must have one entry per layer");
        }
        if self.n_expert_used > self.n_expert {
            return bad("more experts used than exist");
        }
        Ok(())
    }

    /// Reads the shape from GGUF metadata keys (`general.architecture`, `<arch>.block_count`,
    /// ...). Knows `gpt-oss`, `qwen3moe` and `deepseek2` (MLA cache) and falls back to the
    /// generic keys for other architectures. The vocabulary size comes from
    /// `<arch>.vocab_size` or the length of `tokenizer.ggml.tokens`.
    pub fn from_source(src: &dyn HparamSource) -> Result<ModelShape, PlacementError> {
        let arch = src
            .str_value("general.architecture")
            .ok_or_else(|| PlacementError::Shape("missing general.architecture".into()))?
            .to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let opt = |k: &str| src.u64_value(&key(k));
        let req = |k: &str| {
            opt(k).ok_or_else(|| PlacementError::Shape(format!("missing metadata key {}", key(k))))
        };
        let n_layer = u32::try_from(req("block_count")?)
            .map_err(|_| PlacementError::Shape("block_count too large".into()))?;
        let n_embd = req("embedding_length")?;
        let n_head = req("attention.head_count")?;
        let n_head_kv = opt("attention.head_count_kv").unwrap_or(n_head);
        let head_dim_k = opt("attention.key_length").unwrap_or(n_embd / n_head.max(1));
        let head_dim_v = opt("attention.value_length").unwrap_or(head_dim_k);
        let n_ctx_train = u32::try_from(req("context_length")?)
            .map_err(|_| PlacementError::Shape("context_length too large".into()))?;
        let n_vocab = opt("vocab_size")
            .or_else(|| src.array_len("tokenizer.ggml.tokens").map(|n| n as u64))
            .ok_or_else(|| {
                PlacementError::Shape(format!(
                    "missing {} and tokenizer.ggml.tokens",
                    key("vocab_size")
                ))
            })?;
        let n_expert = opt("expert_count").unwrap_or(0);
        let n_expert_used = opt("expert_used_count").unwrap_or(0);
        let n_ff = opt("feed_forward_length").unwrap_or(0);
        let n_ff_exp = opt("expert_feed_forward_length").unwrap_or(n_ff);

        let mut shape = ModelShape {
            arch: arch.clone(),
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            head_dim_q: head_dim_k,
            mla: false,
            n_vocab,
            n_ctx_train,
            sliding_window: 0,
            swa_layers: vec![false; n_layer as usize],
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_ff: 0,
            n_ff_shexp: 0,
        };
        match arch.as_str() {
            "gpt-oss" => {
                // Period-2 pattern, dense_first = false: even layers use the window.
                let window = opt("attention.sliding_window").unwrap_or(128);
                // llama.cpp: period 0 = every layer, else layer il slides iff il % p < p - 1.
                let period = opt("attention.sliding_window_pattern").unwrap_or(2);
                shape.sliding_window = u32::try_from(window)
                    .map_err(|_| PlacementError::Shape("sliding_window too large".into()))?;
                shape.swa_layers = (0..n_layer as u64)
                    .map(|il| period == 0 || il % period < period - 1)
                    .collect();
                // gpt-oss has no dense FFN: feed_forward_length is the expert width.
            }
            "deepseek2" => {
                let lead = opt("leading_dense_block_count").unwrap_or(0);
                shape.n_ff = if lead > 0 { n_ff } else { 0 };
                let shared = opt("expert_shared_count").unwrap_or(0);
                shape.n_ff_shexp = shared * n_ff_exp;
                // MLA as llama.cpp's is_mla(): both MLA head sizes present. Such files already
                // describe the latent cache in head_count_kv (1) and key_length (576).
                if let (Some(kq), Some(_)) = (
                    opt("attention.key_length_mla"),
                    opt("attention.value_length_mla"),
                ) {
                    shape.mla = true;
                    shape.head_dim_q = kq;
                }
            }
            "qwen3moe" => {
                shape.n_ff_shexp = opt("expert_shared_feed_forward_length").unwrap_or(0);
            }
            _ => {
                if n_expert == 0 {
                    shape.n_ff = n_ff;
                }
            }
        }
        shape.validate()?;
        Ok(shape)
    }
}

impl ModelShape {
    /// Reads the shape from a GGUF file's metadata (see [`ModelShape::from_source`]).
    pub fn from_metadata(meta: &hmoe_gguf::Metadata) -> Result<ModelShape, PlacementError> {
        ModelShape::from_source(meta)
    }
}

impl HparamSource for hmoe_gguf::Metadata {
    fn u64_value(&self, key: &str) -> Option<u64> {
        self.get_u64(key)
    }
    fn str_value(&self, key: &str) -> Option<&str> {
        self.get_str(key)
    }
    fn array_len(&self, key: &str) -> Option<usize> {
        self.get_array(key).map(<[_]>::len)
    }
}

/// A source of metadata values by key: implemented for GGUF metadata and for plain maps in
/// tests.
pub trait HparamSource {
    /// A non-negative integer value.
    fn u64_value(&self, key: &str) -> Option<u64>;
    /// A string value.
    fn str_value(&self, key: &str) -> Option<&str>;
    /// The length of an array value.
    fn array_len(&self, key: &str) -> Option<usize>;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A metadata map for tests: strings, integers and array lengths.
    #[derive(Default)]
    pub(crate) struct MapSource {
        pub(crate) strs: HashMap<String, String>,
        pub(crate) ints: HashMap<String, u64>,
        pub(crate) arrays: HashMap<String, usize>,
    }

    impl HparamSource for MapSource {
        fn u64_value(&self, key: &str) -> Option<u64> {
            self.ints.get(key).copied()
        }
        fn str_value(&self, key: &str) -> Option<&str> {
            self.strs.get(key).map(String::as_str)
        }
        fn array_len(&self, key: &str) -> Option<usize> {
            self.arrays.get(key).copied()
        }
    }

    pub(crate) fn gpt_oss_120b_source() -> MapSource {
        let mut m = MapSource::default();
        m.strs
            .insert("general.architecture".into(), "gpt-oss".into());
        for (k, v) in [
            ("block_count", 36),
            ("embedding_length", 2880),
            ("feed_forward_length", 2880),
            ("expert_feed_forward_length", 2880),
            ("attention.head_count", 64),
            ("attention.head_count_kv", 8),
            ("attention.key_length", 64),
            ("attention.value_length", 64),
            ("attention.sliding_window", 128),
            ("context_length", 131072),
            ("expert_count", 128),
            ("expert_used_count", 4),
        ] {
            m.ints.insert(format!("gpt-oss.{k}"), v);
        }
        m.arrays.insert("tokenizer.ggml.tokens".into(), 201088);
        m
    }

    #[test]
    fn reads_gpt_oss_keys() {
        let s = ModelShape::from_source(&gpt_oss_120b_source()).unwrap();
        assert_eq!(s, crate::presets::GptOssDims::gpt_oss_120b().shape());
        assert!(s.is_swa(0) && !s.is_swa(1) && s.is_swa(34) && !s.is_swa(35));
    }

    #[test]
    fn missing_keys_are_errors() {
        let mut m = gpt_oss_120b_source();
        m.ints.remove("gpt-oss.block_count");
        let e = ModelShape::from_source(&m).unwrap_err();
        assert!(e.to_string().contains("gpt-oss.block_count"), "{e}");
        let mut m = gpt_oss_120b_source();
        m.arrays.clear();
        assert!(ModelShape::from_source(&m).is_err());
        let m = MapSource::default();
        assert!(ModelShape::from_source(&m).is_err());
    }

    #[test]
    fn reads_deepseek_mla_and_qwen3moe() {
        let mut m = MapSource::default();
        m.strs
            .insert("general.architecture".into(), "deepseek2".into());
        for (k, v) in [
            ("block_count", 61),
            ("embedding_length", 7168),
            ("feed_forward_length", 18432),
            ("expert_feed_forward_length", 2048),
            ("attention.head_count", 128),
            ("attention.head_count_kv", 1),
            ("attention.key_length", 576),
            ("attention.value_length", 512),
            ("attention.key_length_mla", 192),
            ("attention.value_length_mla", 128),
            ("attention.kv_lora_rank", 512),
            ("rope.dimension_count", 64),
            ("context_length", 163840),
            ("expert_count", 256),
            ("expert_used_count", 8),
            ("expert_shared_count", 1),
            ("leading_dense_block_count", 3),
        ] {
            m.ints.insert(format!("deepseek2.{k}"), v);
        }
        m.arrays.insert("tokenizer.ggml.tokens".into(), 129280);
        let s = ModelShape::from_source(&m).unwrap();
        assert!(s.mla);
        assert_eq!(
            (s.n_embd_k_gqa(), s.n_embd_v_gqa(), s.head_dim_q),
            (576, 0, 192)
        );
        assert_eq!((s.n_ff, s.n_ff_shexp), (18432, 2048));
        assert!(!s.is_swa(0));

        let mut m = MapSource::default();
        m.strs
            .insert("general.architecture".into(), "qwen3moe".into());
        for (k, v) in [
            ("block_count", 48),
            ("embedding_length", 2048),
            ("expert_feed_forward_length", 768),
            ("attention.head_count", 32),
            ("attention.head_count_kv", 4),
            ("attention.key_length", 128),
            ("attention.value_length", 128),
            ("context_length", 40960),
            ("expert_count", 128),
            ("expert_used_count", 8),
            ("vocab_size", 151936),
        ] {
            m.ints.insert(format!("qwen3moe.{k}"), v);
        }
        let s = ModelShape::from_source(&m).unwrap();
        assert_eq!(
            (s.n_embd_k_gqa(), s.n_vocab, s.n_ff_exp),
            (512, 151936, 768)
        );
        assert_eq!(s.sliding_window, 0);
    }
}
