//! hmoe-quant (work in progress).
