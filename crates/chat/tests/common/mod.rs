//! Shared helpers of the chat tests.

/// The text of fixture chat template `name` (`chat/NAME` among the fixtures).
pub fn template(name: &str) -> String {
    std::fs::read_to_string(hmoe_testdata::fixtures().join("chat").join(name)).expect("template")
}
