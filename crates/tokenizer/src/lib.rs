//! hmoe-tokenizer (work in progress).
