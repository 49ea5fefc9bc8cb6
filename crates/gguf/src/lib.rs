//! hmoe-gguf (work in progress).
