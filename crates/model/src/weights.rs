//! Views of weight tensors in the GGUF mapping, with the dot kernel chosen for their type.

use hmoe_gguf::{GgufModel, TensorInfo};
use hmoe_quant::DotKernel;

use crate::ops::{matmul, QuantizedActs};

use crate::ModelError;

/// A weight matrix (or a stack of expert matrices) stored in the model file.
///
/// Rows are `n_in` elements long in the file's type; the data stays in the mapping and is
/// fetched with [`Mat::bytes`] so that no copy of the weights is ever made.
#[derive(Clone, Debug)]
pub(crate) struct Mat {
    pub info: TensorInfo,
    pub n_in: usize,
    pub n_out: usize,
    pub row_bytes: usize,
    pub kernel: DotKernel,
}

impl Mat {
    /// Looks up `name` and checks its shape is `[n_in, n_out, extra…]` in ggml order.
    pub fn load(g: &GgufModel, name: &str, shape: &[u64]) -> Result<Mat, ModelError> {
        let info = expect_tensor(g, name, shape)?;
        // The kernel llama.cpp uses for this matrix (repacked Q4_0/Q4_K when it repacks them).
        let kernel = DotKernel::for_matrix(info.ty, shape[1] as usize).map_err(|_| {
            ModelError::UnsupportedType {
                name: name.to_string(),
                ty: info.ty,
            }
        })?;
        Ok(Mat {
            n_in: shape[0] as usize,
            n_out: shape[1] as usize,
            row_bytes: info.row_bytes() as usize,
            kernel,
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

    /// Bias-less stacked experts `[gate, up, down]` of `n_expert` experts (SwiGLU experts of
    /// Qwen3-MoE and DeepSeek) as the device contract takes them.
    pub fn expert_tensors<'g>(
        g: &'g GgufModel,
        n_expert: usize,
        [gate, up, down]: [&Mat; 3],
    ) -> hmoe_backend::ExpertTensors<'g> {
        hmoe_backend::ExpertTensors {
            n_expert,
            gate: gate.expert_matrix(g),
            up: up.expert_matrix(g),
            down: down.expert_matrix(g),
            gate_bias: &[],
            up_bias: &[],
            down_bias: &[],
        }
    }

    /// Bytes of one matrix of a stacked `[n_in, n_out, n]` tensor.
    pub fn slice<'g>(&self, g: &'g GgufModel, index: usize) -> &'g [u8] {
        let size = self.n_out * self.row_bytes;
        &self.bytes(g)[index * size..(index + 1) * size]
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

/// Loads a small tensor (norm, bias, sink) fully dequantized to f32.
pub(crate) fn load_f32(g: &GgufModel, name: &str, shape: &[u64]) -> Result<Vec<f32>, ModelError> {
    let info = expect_tensor(g, name, shape)?;
    let mut out = vec![0f32; info.n_elements as usize];
    hmoe_quant::dequantize_row(info.ty, g.data_of(&info), &mut out)?;
    Ok(out)
}

/// `W · x` for every row of `x`, converting `x` to the weight's dot format first.
pub(crate) fn project(g: &GgufModel, w: &Mat, x: &[f32], acts: &mut QuantizedActs) -> Vec<f32> {
    let n = x.len() / w.n_in;
    acts.quantize(w.kernel.act_type(), x, w.n_in);
    let mut out = vec![0f32; n * w.n_out];
    matmul(w.kernel, w.bytes(g), w.n_in, w.n_out, acts, &mut out);
    out
}
