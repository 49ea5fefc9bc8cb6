//! One layer's routed experts as a file stores them: three stacked matrices and their biases.

use hmoe_quant::GgmlType;

use crate::BackendError;

fn shape(op: &'static str, what: String) -> BackendError {
    BackendError::Shape { op, what }
}

/// Expert `e`'s row of `n` biases, or an empty row when there are no biases.
fn bias_row(b: &[f32], e: usize, n: usize) -> Option<&[f32]> {
    if b.is_empty() {
        Some(b)
    } else {
        b.get(e * n..(e + 1) * n)
    }
}

/// One expert's weights wherever they live: its three matrices' bytes and bias rows (empty
/// rows: no biases).
#[derive(Clone, Copy, Debug)]
pub struct ExpertView<'a> {
    /// Gate matrix, `ff` rows of `d`.
    pub gate: &'a [u8],
    /// Up matrix, `ff` rows of `d`.
    pub up: &'a [u8],
    /// Down matrix, `d` rows of `ff`.
    pub down: &'a [u8],
    /// Gate bias, `ff`.
    pub gate_bias: &'a [f32],
    /// Up bias, `ff`.
    pub up_bias: &'a [f32],
    /// Down bias, `d`.
    pub down_bias: &'a [f32],
}

/// One stacked expert matrix as stored in GGUF: `n_expert` matrices of `n_out` rows of
/// `n_in` elements of type `ty`, expert after expert.
#[derive(Clone, Copy, Debug)]
pub struct ExpertMatrix<'a> {
    /// Weight type.
    pub ty: GgmlType,
    /// Elements per row (the input size).
    pub n_in: usize,
    /// Rows per expert (the output size).
    pub n_out: usize,
    /// Raw bytes of every expert's matrix.
    pub data: &'a [u8],
}

impl<'a> ExpertMatrix<'a> {
    /// Bytes of one expert's matrix (`None` when `n_in` is not whole blocks of `ty`).
    #[inline]
    pub fn expert_bytes(&self) -> Option<usize> {
        let row = self.ty.row_bytes(self.n_in as u64)?;
        usize::try_from(row).ok()?.checked_mul(self.n_out)
    }

    /// Expert `e`'s matrix, if the data holds it.
    #[inline]
    pub fn expert(&self, e: usize) -> Option<&'a [u8]> {
        let size = self.expert_bytes()?;
        let start = e.checked_mul(size)?;
        self.data.get(start..start.checked_add(size)?)
    }
}

/// The routed experts of one layer: three stacked matrices and their biases, as in the file.
#[derive(Clone, Copy, Debug)]
pub struct ExpertTensors<'a> {
    /// Experts in the layer.
    pub n_expert: usize,
    /// `ffn_gate_exps.weight`: `n_embd → n_ff` per expert.
    pub gate: ExpertMatrix<'a>,
    /// `ffn_up_exps.weight`: `n_embd → n_ff` per expert.
    pub up: ExpertMatrix<'a>,
    /// `ffn_down_exps.weight`: `n_ff → n_embd` per expert.
    pub down: ExpertMatrix<'a>,
    /// `ffn_gate_exps.bias`, `n_ff` per expert (empty: none; the three come together).
    pub gate_bias: &'a [f32],
    /// `ffn_up_exps.bias`, `n_ff` per expert (empty: none).
    pub up_bias: &'a [f32],
    /// `ffn_down_exps.bias`, `n_embd` per expert (empty: none).
    pub down_bias: &'a [f32],
}

impl<'a> ExpertTensors<'a> {
    /// Checks that the shapes agree (gate and up `d → ff`, down `ff → d`, data and biases of
    /// `n_expert` experts, or no biases at all) and returns `(d, ff)`.
    pub fn validate(&self) -> Result<(usize, usize), BackendError> {
        let (d, ff) = (self.gate.n_in, self.gate.n_out);
        let dims = |m: &ExpertMatrix<'_>| (m.n_in, m.n_out);
        if dims(&self.up) != (d, ff) || dims(&self.down) != (ff, d) || d == 0 || ff == 0 {
            return Err(shape(
                "expert tensors",
                format!(
                    "gate {:?}, up {:?}, down {:?} (want gate = up = (d, ff), down = (ff, d))",
                    dims(&self.gate),
                    dims(&self.up),
                    dims(&self.down)
                ),
            ));
        }
        for (what, m) in [("gate", &self.gate), ("up", &self.up), ("down", &self.down)] {
            let want = m.expert_bytes().and_then(|b| b.checked_mul(self.n_expert));
            if want != Some(m.data.len()) {
                return Err(shape(
                    "expert matrix",
                    format!(
                        "{what}: {} bytes, want {want:?} for {} experts",
                        m.data.len(),
                        self.n_expert
                    ),
                ));
            }
        }
        for (what, b, n) in [
            ("gate bias", self.gate_bias, ff),
            ("up bias", self.up_bias, ff),
            ("down bias", self.down_bias, d),
        ] {
            let want = if self.has_biases() {
                n.checked_mul(self.n_expert)
            } else {
                Some(0)
            };
            if Some(b.len()) != want {
                return Err(shape(
                    "expert bias",
                    format!("{what}: {} floats, want {n} × {}", b.len(), self.n_expert),
                ));
            }
        }
        Ok((d, ff))
    }

    /// Whether the experts have biases (any of the three bias tensors given).
    pub fn has_biases(&self) -> bool {
        !(self.gate_bias.is_empty() && self.up_bias.is_empty() && self.down_bias.is_empty())
    }

    /// Bytes one expert occupies on a device: its three matrices plus its three f32 bias rows
    /// (if it has biases). Op offload of `m` experts copies `m ×` this many bytes.
    pub fn expert_bytes(&self) -> u64 {
        let mats: usize = [&self.gate, &self.up, &self.down]
            .iter()
            .map(|m| m.expert_bytes().unwrap_or(0))
            .sum();
        let n_ff = self.gate.n_out;
        let n_embd = self.down.n_out;
        let biases = if self.has_biases() {
            4 * (2 * n_ff + n_embd)
        } else {
            0
        };
        (mats + biases) as u64
    }

    /// Bytes of the whole layer (every expert).
    pub fn layer_bytes(&self) -> u64 {
        self.expert_bytes() * self.n_expert as u64
    }

    /// Expert `e`'s weights (`None` when the tensors do not hold it).
    #[inline]
    pub fn view(&self, e: usize) -> Option<ExpertView<'a>> {
        let (d, ff) = (self.down.n_out, self.gate.n_out);
        Some(ExpertView {
            gate: self.gate.expert(e)?,
            up: self.up.expert(e)?,
            down: self.down.expert(e)?,
            gate_bias: bias_row(self.gate_bias, e, ff)?,
            up_bias: bias_row(self.up_bias, e, ff)?,
            down_bias: bias_row(self.down_bias, e, d)?,
        })
    }
}
