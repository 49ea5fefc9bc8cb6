use hmoe_quant::GgmlType;

/// Everything that can go wrong when building or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file's architecture is not one this build runs.
    #[error("unsupported architecture '{0}'")]
    UnsupportedArch(String),
    /// A required metadata key is missing or has the wrong type.
    #[error("metadata key '{0}' is missing or not a number")]
    MissingKey(String),
    /// A metadata value is outside what the architecture allows.
    #[error("bad hyperparameter {key} = {value}: {why}")]
    BadParam {
        /// The metadata key.
        key: String,
        /// Its value.
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A required tensor is absent.
    #[error("tensor '{0}' is missing")]
    MissingTensor(String),
    /// A tensor's shape differs from what the hyperparameters imply.
    #[error("tensor '{name}' has shape {found:?}, expected {expected:?}")]
    BadShape {
        /// Tensor name.
        name: String,
        /// Shape in the file (ggml order).
        found: Vec<u64>,
        /// Shape the hyperparameters imply.
        expected: Vec<u64>,
    },
    /// A tensor's type has no kernel here.
    #[error("tensor '{name}' has type {ty}, which has no CPU kernel")]
    UnsupportedType {
        /// Tensor name.
        name: String,
        /// Its type.
        ty: GgmlType,
    },
    /// A token id is outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (n_vocab {n_vocab})")]
    BadToken {
        /// The id.
        id: u32,
        /// Vocabulary size.
        n_vocab: usize,
    },
    /// The batch would run past the context.
    #[error("context is full: position {pos} + {n_tokens} tokens exceeds n_ctx {n_ctx}")]
    ContextFull {
        /// First position of the batch.
        pos: usize,
        /// Tokens in the batch.
        n_tokens: usize,
        /// Context size of the cache.
        n_ctx: usize,
    },
    /// A kernel rejected its input.
    #[error(transparent)]
    Quant(#[from] hmoe_quant::QuantError),
    /// The device failed (out of memory, an unsupported op or type, its driver).
    #[error(transparent)]
    Device(#[from] hmoe_backend::BackendError),
    /// A placement of the routed experts that the executor cannot run.
    #[error("placement: {0}")]
    Placement(String),
    /// A cache handle that does not stand for a sequence on the device, or of a type the
    /// device cannot keep.
    #[error("device KV cache: {0}")]
    Cache(String),
}

impl ModelError {
    /// Whether the error is a device that ran out of memory (for this request's K/V or
    /// scratch): a lack of resources that may pass, rather than a fault of the model or input.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            ModelError::Device(hmoe_backend::BackendError::OutOfMemory { .. })
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_errors_say_what_failed() {
        let e = ModelError::Cache("x".into());
        assert!(e.to_string().contains("device KV cache: x"), "{e}");
        let oom = hmoe_backend::BackendError::OutOfMemory {
            device: "REF0".into(),
            what: "alloc",
            requested: 3 << 20,
            free: 1 << 20,
            total: 8 << 20,
        };
        let e = ModelError::from(oom);
        assert!(e.is_out_of_memory());
        assert!(e.to_string().starts_with("REF0: out of memory"), "{e}");
        assert!(e.to_string().contains("2.0 MiB missing"), "{e}");
        assert!(!ModelError::Placement("p".into()).is_out_of_memory());
    }
}
