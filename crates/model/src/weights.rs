//! Views of weight tensors in the GGUF mapping, with the dot kernel chosen for their type.

use hmoe_gguf::{GgufModel, TensorInfo};
use hmoe_quant::DotKernel;

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
