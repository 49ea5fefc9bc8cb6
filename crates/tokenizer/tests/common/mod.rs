//! Shared helpers for the fixture tests.

use hmoe_tokenizer::Tokenizer;

pub use hmoe_testdata::fixtures;

/// Loads the tokenizer of a GGUF file under the fixtures folder.
pub fn load(rel: &str) -> Tokenizer {
    let path = fixtures().join(rel);
    let model = hmoe_gguf::GgufModel::open(&path, hmoe_gguf::LoadOptions::default())
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    Tokenizer::from_metadata(model.metadata())
        .unwrap_or_else(|e| panic!("tokenizer of {}: {e}", path.display()))
}
