//! The engine's error: choosing a device, planning the placement and loading the model.

use std::path::PathBuf;

/// Why a model could not be placed or loaded. Each variant's message is the context the CLI
/// printed before the engine moved here; its source is the cause below it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model file could not be opened or parsed.
    #[error("loading {}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: hmoe_gguf::GgufError,
    },
    /// `--device` names a device that is not there.
    #[error("--device: unknown device '{name}'; available: {available} (or `none`)")]
    UnknownDevice {
        /// The name given.
        name: String,
        /// The devices there are.
        available: String,
    },
    /// `--device` names a device twice.
    #[error("--device: '{0}' is listed twice")]
    ListedTwice(String),
    /// The placement plan does not fit: what each device lacks ([`crate::plan_error`]).
    #[error("{0}")]
    DoesNotFit(String),
    /// The planner's error.
    #[error(transparent)]
    Placement(#[from] hmoe_placement::PlacementError),
    /// The CUDA device could not be opened.
    #[error(transparent)]
    Cuda(#[from] hmoe_cuda::CudaError),
    /// The model could not be loaded, on any device, or its expert cache could not be set.
    #[error(transparent)]
    Model(#[from] hmoe_model::ModelError),
    /// Loading on the reference device failed.
    #[error("loading the model on {}", hmoe_backend::REF0_NAME)]
    Ref0(#[source] Box<EngineError>),
    /// The global thread pool could not start.
    #[error("starting the thread pool")]
    ThreadPool(#[source] rayon::ThreadPoolBuildError),
    /// The per-token thread pool could not start.
    #[error("starting the per-token thread pool")]
    TokenPool(#[source] hmoe_pool::PoolError),
}

/// `e` and its causes on one line, `: ` between them (how the CLI prints an error).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_names_every_cause() {
        let e = EngineError::Ref0(Box::new(EngineError::ListedTwice("REF0".into())));
        assert_eq!(
            error_chain(&e),
            "loading the model on REF0: --device: 'REF0' is listed twice"
        );
    }
}
