//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use hmoe_gguf::{GgufModel, TensorInfo};

#[allow(unused_imports)] // each test binary uses one or both
pub use hmoe_testdata::{fixture, fixtures};

/// A fresh, empty scratch folder for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("gguf-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// Asserts that two models hold the same tensors (names, types, shapes, data), in order.
pub fn assert_same_tensors(a: &GgufModel, b: &GgufModel) {
    assert_eq!(a.tensors().len(), b.tensors().len(), "tensor counts differ");
    for (x, y) in a.tensors().iter().zip(b.tensors()) {
        assert_same_info(x, y);
        assert!(a.data_of(x) == b.data_of(y), "data of {} differs", x.name);
        assert_eq!(a.data_of(x).len() as u64, x.n_bytes);
    }
    assert_eq!(a.total_tensor_bytes(), b.total_tensor_bytes());
}

/// Asserts that two infos describe the same tensor (not necessarily at the same place).
pub fn assert_same_info(x: &TensorInfo, y: &TensorInfo) {
    assert_eq!(x.name, y.name);
    assert_eq!(x.ty, y.ty, "{}", x.name);
    assert_eq!(x.dims, y.dims, "{}", x.name);
    assert_eq!(x.n_elements, y.n_elements, "{}", x.name);
    assert_eq!(x.n_bytes, y.n_bytes, "{}", x.name);
}
