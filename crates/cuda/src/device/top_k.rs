//! The `k` best logits of each row (`top_k_chunks` then `top_k_merge`, kernels/top_k.cu):
//! what a sampler whose chain needs no more brings down in place of the row.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{i32_of, u32_of, CudaDevice, MAX_GRID_Y};
use crate::error::{ensure, CudaError};
use crate::kernels::{TK_CHUNK, TK_THREADS};

impl CudaDevice {
    /// [`hmoe_backend::Backend::top_k`]: the `k` best of each row of `n_vocab` logits
    /// (`hmoe_backend::top_k_key`'s order) into `values` and `ids`, through `scratch` (at
    /// least [`hmoe_backend::top_k_chunked_scratch`] elements: every chunk's `k` best keys,
    /// written before they are read, so no memset).
    pub fn top_k(
        &self,
        logits: &CudaSlice<f32>,
        n_vocab: usize,
        k: usize,
        scratch: &mut CudaSlice<i32>,
        values: &mut CudaSlice<f32>,
        ids: &mut CudaSlice<i32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "top_k";
        let n = hmoe_backend::top_k_shape(logits.len(), n_vocab, k, values.len(), ids.len())
            .map_err(|e| CudaError::Shape {
                op: OP,
                what: e.to_string(),
            })?;
        let need = hmoe_backend::top_k_chunked_scratch(n, n_vocab, k);
        ensure(scratch.len() >= need && n <= MAX_GRID_Y, OP, || {
            format!("{n} rows with scratch {} of {need}", scratch.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let n_chunks = n_vocab.div_ceil(TK_CHUNK);
        let (nv, kk, nc) = (
            i32_of(OP, "n_vocab", n_vocab)?,
            i32_of(OP, "k", k)?,
            i32_of(OP, "chunks", n_chunks)?,
        );
        let rows = u32_of(OP, "rows", n)?;
        let chunks = LaunchConfig {
            grid_dim: (u32_of(OP, "chunks", n_chunks)?, rows, 1),
            block_dim: (TK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("top_k_chunks");
        b.arg(logits).arg(&mut *scratch).arg(&nv).arg(&kk);
        // SAFETY: argument types match `top_k_chunks` (the i32 scratch as u64 keys: two i32
        // each, 256-byte aligned); it reads n × n_vocab logits and writes n × n_chunks × k
        // keys, within the scratch (checked above).
        unsafe { b.launch(chunks) }?;
        let merge = LaunchConfig {
            grid_dim: (rows, 1, 1),
            block_dim: (TK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("top_k_merge");
        b.arg(logits)
            .arg(&*scratch)
            .arg(values)
            .arg(ids)
            .arg(&nv)
            .arg(&nc)
            .arg(&kk);
        // SAFETY: argument types match `top_k_merge`; it reads the keys `top_k_chunks` wrote
        // (queued before it on the same stream) and writes n × k values and ids (checked).
        unsafe { b.launch(merge) }?;
        Ok(())
    }
}
