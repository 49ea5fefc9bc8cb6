//! hmoe-engine (work in progress).
