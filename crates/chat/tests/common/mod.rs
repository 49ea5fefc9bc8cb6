//! Shared helpers of the chat tests.

use std::path::PathBuf;

/// The text of fixture chat template `name` (`$HMOE_FIXTURES/chat/NAME`, else
/// ../shared/fixtures beside the repository).
pub fn template(name: &str) -> String {
    let root = std::env::var("HMOE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../../shared/fixtures"
            ))
        });
    std::fs::read_to_string(root.join("chat").join(name)).expect("template")
}
