//! Shared helpers for the fixture tests.

use std::path::PathBuf;

use hmoe_tokenizer::Tokenizer;

/// The shared fixtures folder.
pub fn fixtures() -> PathBuf {
    match std::env::var("HMOE_FIXTURES") {
        Ok(p) => PathBuf::from(p),
        Err(_) => PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/fixtures"
        )),
    }
}

/// Loads the tokenizer of a GGUF file under the fixtures folder.
pub fn load(rel: &str) -> Tokenizer {
    let path = fixtures().join(rel);
    let model = hmoe_gguf::GgufModel::open(&path, hmoe_gguf::LoadOptions::default())
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    Tokenizer::from_metadata(model.metadata())
        .unwrap_or_else(|e| panic!("tokenizer of {}: {e}", path.display()))
}
