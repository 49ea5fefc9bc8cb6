//! hmoe-placement (work in progress).
