//! Weights on the device: a matrix in its file encoding ([`DevMat`]) with whether a batch of
//! several sequences multiplies it per sequence, the uploads of matrices, small f32 tensors
//! and expert sets, and the product over a micro-batch's sequences.

use std::ops::Range;

use hmoe_backend::{Backend, BackendError, ExpertTensors, SharedBytes};
use hmoe_gguf::GgufModel;
use hmoe_quant::GgmlType;

use super::scratch_arena::{span, ScratchArena};
use crate::error::ModelError;
use crate::weights::{expect_tensor, load_f32};

/// A weight matrix on the device, `rows × cols`, and whether a micro-batch of several
/// sequences multiplies it per sequence: weights whose products the executor on the CPU sums in an
/// order that depends on how many tokens it multiplies together ([`batch_order_varies`]).
pub(crate) struct DevMat<B: Backend> {
    pub(crate) m: B::Matrix,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    per_seq: bool,
}

impl<B: Backend> DevMat<B> {
    /// Bytes it occupies on the device.
    pub(crate) fn bytes(&self) -> u64 {
        B::matrix_bytes(&self.m) as u64
    }

    /// `y = W·x` for the rows of `groups` (consecutive, from row 0): one product over every
    /// row, or one per group for weights whose products go per sequence.
    pub(crate) fn mul(
        &self,
        dev: &B,
        arena: &ScratchArena<B>,
        x: &B::Buf<f32>,
        groups: &[Range<usize>],
        y: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let n = groups.last().map_or(0, |g| g.end);
        if !self.per_seq || groups.len() == 1 {
            return Ok(dev.matmul(&self.m, x, n, y)?);
        }
        for g in groups {
            let xs = arena.slice(dev, x, g.start * self.cols..g.end * self.cols)?;
            let mut ys = arena.take::<f32>(dev, g.len() * self.rows)?;
            dev.matmul(&self.m, &xs, g.len(), &mut ys)?;
            dev.copy_rows(&ys, y, &span(0, g.len() * self.rows, g.start * self.rows))?;
        }
        Ok(())
    }

    /// Whether [`DevMat::mul_shared`] multiplies the rows of `groups` by `ws` as one batch:
    /// unless some matrix goes per sequence and there are several.
    pub(crate) fn shared_as_one(ws: &[&DevMat<B>], groups: &[Range<usize>]) -> bool {
        groups.len() <= 1 || !ws.iter().any(|w| w.per_seq)
    }

    /// `ys[i] = ws[i]·x + biases[i]` for the rows of `groups`, matrices that multiply the
    /// same input: one [`Backend::matmul_shared`] (the activations converted once, the
    /// biases added as [`Backend::add_bias`] adds them) unless some matrix goes per sequence
    /// in a batch of several, then [`DevMat::mul`] and [`Backend::add_bias`] each.
    pub(crate) fn mul_shared(
        ws: &[&DevMat<B>],
        biases: &[Option<&B::Buf<f32>>],
        dev: &B,
        arena: &ScratchArena<B>,
        x: &B::Buf<f32>,
        groups: &[Range<usize>],
        ys: &mut [&mut B::Buf<f32>],
    ) -> Result<(), ModelError> {
        if !DevMat::shared_as_one(ws, groups) {
            for ((w, y), bias) in ws.iter().zip(ys.iter_mut()).zip(biases) {
                w.mul(dev, arena, x, groups, y)?;
                if let Some(bias) = bias {
                    dev.add_bias(y, bias)?;
                }
            }
            return Ok(());
        }
        let n = groups.last().map_or(0, |g| g.end);
        let ms: Vec<&B::Matrix> = ws.iter().map(|w| &w.m).collect();
        Ok(dev.matmul_shared(&ms, biases, x, n, ys)?)
    }

    /// One matrix per head ([`Backend::matmul_heads`]) over `groups`: per sequence for
    /// weights whose products go per sequence when every head's input is its whole row
    /// (then the order depends on the rows multiplied together).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mul_heads(
        &self,
        dev: &B,
        arena: &ScratchArena<B>,
        x: &B::Buf<f32>,
        groups: &[Range<usize>],
        n_heads: usize,
        x_stride: usize,
        y: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let n = groups.last().map_or(0, |g| g.end);
        let contiguous = x_stride == self.cols;
        if !(self.per_seq && contiguous) || groups.len() == 1 {
            return Ok(dev.matmul_heads(&self.m, x, n, n_heads, x_stride, y)?);
        }
        for g in groups {
            let rows = g.start * n_heads * x_stride..g.end * n_heads * x_stride;
            let xs = arena.slice(dev, x, rows)?;
            let mut ys = arena.take::<f32>(dev, g.len() * self.rows)?;
            dev.matmul_heads(&self.m, &xs, g.len(), n_heads, x_stride, &mut ys)?;
            dev.copy_rows(&ys, y, &span(0, g.len() * self.rows, g.start * self.rows))?;
        }
        Ok(())
    }
}

/// Whether the executor on the CPU sums a batch's products by weights of type `ty` in an order that
/// depends on the batch's size: F32 (one token in `vec_dot` order, several in tinyBLAS's
/// lanes), the K-quants (tiled from 8 tokens) and Q4_0 (repacked rows, grouped by 4 tokens).
pub(crate) fn batch_order_varies(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, F32 | Q4_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K)
}

/// Whether the executor on the CPU sums an expert's products by weights of type `ty` in an order that
/// depends on how many rows route to the expert together: F32 (gpt-oss's experts: 16 lanes
/// for several rows) and the K-quants (tiled from 8 rows).
pub(crate) fn expert_order_varies(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, F32 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K)
}

/// Bytes of an f32 buffer on the device.
pub(crate) fn buf_bytes<B: Backend>(b: &B::Buf<f32>) -> u64 {
    4 * B::buf_len(b) as u64
}

/// Uploads every expert of layer `layer` (`t`, read from `g`): without a copy
/// ([`Backend::upload_moe_shared`]) when `t`'s matrices are the file's
/// `blk.N.ffn_{gate,up,down}_exps.weight` tensors in the mapping, else a copy.
pub(crate) fn upload_experts<B: Backend>(
    dev: &B,
    g: &GgufModel,
    layer: usize,
    t: &ExpertTensors<'_>,
) -> Result<B::Moe, BackendError> {
    let shared = |m: &str, data: &[u8]| {
        let info = g.tensor_info(&format!("blk.{layer}.ffn_{m}_exps.weight"))?;
        let s = g
            .shared_data_of(info)
            .and_then(|(o, r)| SharedBytes::new(o, r))?;
        // A device that copies the experts (the CPU's interleaved sets) gives the pages back.
        let s = match g.page_releaser(info) {
            Some(release) => s.with_page_release(release),
            None => s,
        };
        let b = s.bytes();
        (b.as_ptr() == data.as_ptr() && b.len() == data.len()).then_some(s)
    };
    let all = (|| {
        Some([
            shared("gate", t.gate.data)?,
            shared("up", t.up.data)?,
            shared("down", t.down.data)?,
        ])
    })();
    match all {
        Some(data) => dev.upload_moe_shared(t, &data, None),
        None => dev.upload_moe(t, None),
    }
}

/// Uploads the matrix `name` in its file encoding, checking that its shape is `shape`
/// (`[cols, rows…]` in ggml order).
pub(crate) fn upload_matrix<B: Backend>(
    dev: &B,
    g: &GgufModel,
    name: &str,
    shape: &[u64],
) -> Result<DevMat<B>, ModelError> {
    let info = expect_tensor(g, name, shape)?;
    let cols = info.dims.first().copied().unwrap_or(0) as usize;
    let rows = info.dims.iter().skip(1).product::<u64>() as usize;
    let m = match g
        .shared_data_of(&info)
        .and_then(|(o, r)| SharedBytes::new(o, r))
    {
        Some(shared) => dev.upload_matrix_shared(info.ty, rows, cols, &shared)?,
        None => dev.upload_matrix(info.ty, rows, cols, g.data_of(&info))?,
    };
    Ok(DevMat {
        m,
        rows,
        cols,
        per_seq: batch_order_varies(info.ty),
    })
}

/// Uploads the small tensor `name` (norm, bias, sinks) dequantized to f32, checking that its
/// shape is `shape`.
pub(crate) fn upload_f32<B: Backend>(
    dev: &B,
    g: &GgufModel,
    name: &str,
    shape: &[u64],
) -> Result<B::Buf<f32>, ModelError> {
    Ok(dev.upload(&load_f32(g, name, shape)?)?)
}

/// [`upload_f32`] of `name` if the file has it.
pub(crate) fn upload_f32_opt<B: Backend>(
    dev: &B,
    g: &GgufModel,
    name: &str,
    shape: &[u64],
) -> Result<Option<B::Buf<f32>>, ModelError> {
    match g.tensor_info(name) {
        Some(_) => upload_f32(dev, g, name, shape).map(Some),
        None => Ok(None),
    }
}
