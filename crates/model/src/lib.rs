//! hmoe-model (work in progress).
