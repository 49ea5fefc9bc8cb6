//! The reference device's memory: the byte budget every allocation is charged to, and the
//! buffers, matrices and expert sets that hold their charge.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hmoe_quant::GgmlType;

/// The device's memory: bytes held now, the most ever held, and the budget.
#[derive(Debug)]
pub(super) struct Memory {
    pub(super) budget: Option<u64>,
    pub(super) held: Mutex<(u64, u64)>,
}

impl Memory {
    pub(super) fn lock(&self) -> MutexGuard<'_, (u64, u64)> {
        // Only counters live behind the lock; a panic elsewhere leaves them consistent.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Bytes of device memory taken by one allocation, given back when it is dropped.
#[derive(Debug)]
pub(super) struct Charge {
    pub(super) mem: Arc<Memory>,
    pub(super) bytes: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut h = self.mem.lock();
        h.0 = h.0.saturating_sub(self.bytes);
    }
}

/// A buffer in the reference device's memory.
#[derive(Debug)]
pub struct RefBuf<T> {
    pub(super) data: Vec<T>,
    pub(super) _charge: Charge,
}

impl<T> std::ops::Deref for RefBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<'a, T> IntoIterator for &'a RefBuf<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.data.iter()
    }
}

impl<T> std::ops::DerefMut for RefBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}

/// A weight matrix in its file encoding: `rows` rows of `row_bytes` bytes (in the device's
/// memory when uploaded on its own; an expert's matrix is charged with its [`RefMoe`]).
pub struct RefMatrix {
    pub(super) ty: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) row_bytes: usize,
    pub(super) data: Vec<u8>,
    /// The CPU device's kernel for a matrix of [`QUANT_KERNEL_TYPES`].
    pub(super) kernel: Option<hmoe_quant::DotKernel>,
    pub(super) _charge: Option<Charge>,
}

impl RefMatrix {
    /// Row `r`'s bytes.
    pub(super) fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
}

/// One layer's experts in their file encoding: gate and up `[E][ff][d]`, down `[E][d][ff]`
/// (each expert's matrix a [`RefMatrix`] of its rows, of its tensor's type), in the device's
/// memory.
pub struct RefMoe {
    pub(super) n_expert: usize,
    pub(super) d: usize,
    pub(super) ff: usize,
    pub(super) bytes: usize,
    pub(super) gate: Vec<RefMatrix>,
    pub(super) up: Vec<RefMatrix>,
    pub(super) down: Vec<RefMatrix>,
    pub(super) gate_bias: Vec<f32>,
    pub(super) up_bias: Vec<f32>,
    pub(super) down_bias: Vec<f32>,
    pub(super) _charge: Option<Charge>,
}
