//! Views of weight tensors in the GGUF mapping, checked against the shapes the
//! hyperparameters imply and against the CPU's kernels.

use hmoe_gguf::{GgufModel, TensorInfo};
use hmoe_quant::DotKernel;

use crate::error::ModelError;

/// A weight matrix (or a stack of expert matrices) stored in the model file.
///
/// Rows are `n_in` elements long in the file's type; the data stays in the mapping and is
/// fetched with [`Mat::bytes`] so that no copy of the weights is ever made. Its type has a
/// CPU kernel (checked at load).
#[derive(Clone, Debug)]
pub(crate) struct Mat {
    pub info: TensorInfo,
    pub n_in: usize,
    pub n_out: usize,
}

impl Mat {
    /// Looks up `name` and checks its shape is `[n_in, n_out, extra…]` in ggml order.
    pub fn load(g: &GgufModel, name: &str, shape: &[u64]) -> Result<Mat, ModelError> {
        let info = expect_tensor(g, name, shape)?;
        // The kernel llama.cpp uses for this matrix (repacked Q4_0/Q4_K when it repacks them).
        DotKernel::for_matrix(info.ty, shape[1] as usize).map_err(|_| {
            ModelError::UnsupportedType {
                name: name.to_string(),
                ty: info.ty,
            }
        })?;
        Ok(Mat {
            n_in: shape[0] as usize,
            n_out: shape[1] as usize,
            info,
        })
    }

    /// The tensor's bytes in the mapping.
    pub fn bytes<'g>(&self, g: &'g GgufModel) -> &'g [u8] {
        g.data_of(&self.info)
    }

    /// The stacked experts this matrix holds, as the device contract takes them.
    pub fn expert_matrix<'g>(&self, g: &'g GgufModel) -> hmoe_backend::ExpertMatrix<'g> {
        hmoe_backend::ExpertMatrix {
            ty: self.info.ty,
            n_in: self.n_in,
            n_out: self.n_out,
            data: self.bytes(g),
        }
    }
}

/// Looks up `name` and checks its shape.
pub(crate) fn expect_tensor(
    g: &GgufModel,
    name: &str,
    shape: &[u64],
) -> Result<TensorInfo, ModelError> {
    let info = g
        .tensor_info(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    if info.dims != shape {
        return Err(ModelError::BadShape {
            name: name.to_string(),
            found: info.dims.clone(),
            expected: shape.to_vec(),
        });
    }
    Ok(info.clone())
}

/// The vocabulary size: the rows of the embedding `token_embd.weight`.
pub(crate) fn n_vocab(g: &GgufModel) -> Result<usize, ModelError> {
    let embd = g
        .tensor_info("token_embd.weight")
        .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
    Ok(embd.dims.get(1).copied().unwrap_or(0) as usize)
}

/// Loads a small tensor (norm, bias, sink) fully dequantized to f32.
pub(crate) fn load_f32(g: &GgufModel, name: &str, shape: &[u64]) -> Result<Vec<f32>, ModelError> {
    let info = expect_tensor(g, name, shape)?;
    let mut out = vec![0f32; info.n_elements as usize];
    hmoe_quant::dequantize_row(info.ty, g.data_of(&info), &mut out)?;
    Ok(out)
}

/// The size of one layer's routed experts and whether the file gives them biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExpertShape {
    /// Inputs (the hidden size).
    pub n_embd: usize,
    /// Hidden values of each expert.
    pub n_ff: usize,
    /// Experts of the layer.
    pub n_expert: usize,
    /// Whether `ffn_{gate,up,down}_exps.bias` come with them (gpt-oss).
    pub biases: bool,
}

/// One layer's routed experts as the file stores them (views of the mapping; biases
/// dequantized): what the executor puts on the device or runs on the host.
pub(crate) struct ExpertWeights {
    n_expert: usize,
    gate: Mat,
    up: Mat,
    down: Mat,
    /// Biases of gate, up and down (empty: none).
    biases: [Vec<f32>; 3],
}

impl ExpertWeights {
    /// Layer `l`'s `ffn_{gate,up,down}_exps` (and their `.bias` tensors when `shape.biases`),
    /// every tensor checked against `shape`.
    pub fn load(g: &GgufModel, l: usize, shape: &ExpertShape) -> Result<Self, ModelError> {
        let n = |s: &str| format!("blk.{l}.ffn_{s}_exps.weight");
        let b = |s: &str| format!("blk.{l}.ffn_{s}_exps.bias");
        let (d, ff, ne) = (
            shape.n_embd as u64,
            shape.n_ff as u64,
            shape.n_expert as u64,
        );
        let biases = match shape.biases {
            true => [
                load_f32(g, &b("gate"), &[ff, ne])?,
                load_f32(g, &b("up"), &[ff, ne])?,
                load_f32(g, &b("down"), &[d, ne])?,
            ],
            false => Default::default(),
        };
        Ok(ExpertWeights {
            n_expert: shape.n_expert,
            gate: Mat::load(g, &n("gate"), &[d, ff, ne])?,
            up: Mat::load(g, &n("up"), &[d, ff, ne])?,
            down: Mat::load(g, &n("down"), &[ff, d, ne])?,
            biases,
        })
    }

    /// The experts as the device contract takes them.
    pub fn tensors<'g>(&'g self, g: &'g GgufModel) -> hmoe_backend::ExpertTensors<'g> {
        let [gate_bias, up_bias, down_bias] = &self.biases;
        hmoe_backend::ExpertTensors {
            n_expert: self.n_expert,
            gate: self.gate.expert_matrix(g),
            up: self.up.expert_matrix(g),
            down: self.down.expert_matrix(g),
            gate_bias,
            up_bias,
            down_bias,
        }
    }
}
