//! The x86-64 kernels, one folder per instruction set (AVX2, AVX-512, the AMX tiles), and the
//! CPU feature checks that decide which of them may run.

pub(crate) mod amx;
pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod features;
