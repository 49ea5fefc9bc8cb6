//! Pieces shared by the devices whose buffers live in host memory (REF0 and the CPU device):
//! the expert-boundary staging buffers, and the ops that are the same plain loops on both
//! (strided row copies, row lookups, additions, routing, RoPE). Each checks its shapes as the
//! contract says.

use hmoe_quant::GgmlType;

use crate::{BackendError, Gating, PackedDown, RopeParams, Routing, RowCopy, StagedIo};

/// Host buffers of one expert-boundary round trip: the packed inputs brought down
/// ([`PackedDown`]: the normed hidden state, the weights and the chosen experts in one
/// buffer), the ids read back out of it, and the expert sum to send up.
pub struct HostStaging {
    layout: PackedDown,
    down: Vec<f32>,
    sel: Vec<i32>,
    out: Vec<f32>,
}

impl HostStaging {
    /// Buffers for `n_d` hidden values and `n_k` expert slots.
    pub fn new(n_d: usize, n_k: usize) -> HostStaging {
        let layout = PackedDown { n_d, n_k };
        HostStaging {
            layout,
            down: vec![0.0; layout.words()],
            sel: vec![0; n_k],
            out: vec![0.0; n_d],
        }
    }

    /// An id of these buffers, the same wherever the value moves (REF0's op log).
    pub fn id(&self) -> usize {
        self.down.as_ptr() as usize
    }

    /// Packs the inputs in ([`crate::Backend::stage_down`]); they must have the lengths the
    /// buffers were made for. Returns the bytes of the packed buffer (the one copy down).
    pub fn fill(&mut self, h: &[f32], sel: &[i32], w: &[f32]) -> Result<usize, BackendError> {
        self.layout.pack(&mut self.down, h, sel, w)?;
        Ok(4 * self.down.len())
    }

    /// The staged inputs and the output buffer ([`crate::Backend::staged`]).
    pub fn io(&mut self) -> StagedIo<'_> {
        let l = self.layout;
        l.unpack_sel(&self.down, &mut self.sel);
        StagedIo {
            h: &self.down[l.h()],
            sel: &self.sel,
            w: &self.down[l.w()],
            out: &mut self.out,
        }
    }

    /// Copies the expert sum into the front of `out` ([`crate::Backend::stage_up`]); returns
    /// how many values it copied.
    pub fn send_up(&self, out: &mut [f32]) -> Result<usize, BackendError> {
        crate::error::ensure(out.len() >= self.out.len(), "stage_up", || "lengths".into())?;
        out[..self.out.len()].copy_from_slice(&self.out);
        Ok(self.out.len())
    }
}

/// [`crate::Backend::copy_rows`] over host slices.
pub fn copy_rows(src: &[f32], dst: &mut [f32], c: &RowCopy) -> Result<(), BackendError> {
    c.check(src.len(), dst.len())?;
    for r in 0..c.n_rows {
        let from = &src[r * c.src_stride + c.src_offset..][..c.width];
        dst[r * c.dst_stride + c.dst_offset..][..c.width].copy_from_slice(from);
    }
    Ok(())
}

/// [`crate::Backend::route`] over host slices: each row's gate probabilities, then
/// [`Routing::select`] (the CPU device's routing).
pub fn route(
    logits: &[f32],
    bias: Option<&[f32]>,
    gating: Gating,
    routing: &Routing,
    n_expert: usize,
    selected: &mut [i32],
    weights: &mut [f32],
) -> Result<(), BackendError> {
    let k = routing.k;
    crate::shapes::route(
        routing,
        n_expert,
        logits.len(),
        bias.map(<[f32]>::len),
        selected.len(),
        weights.len(),
    )?;
    let (mut top, mut w) = (Vec::new(), Vec::new());
    let mut probs = Vec::with_capacity(n_expert);
    for (t, row) in logits.chunks_exact(n_expert).enumerate() {
        probs.clear();
        probs.extend_from_slice(row);
        crate::routing::gate_probs(gating, &mut probs);
        routing.select(&probs, bias, &mut top, &mut w);
        for (j, (&e, &wv)) in top.iter().zip(&w).enumerate() {
            selected[t * k + j] = e as i32;
            weights[t * k + j] = wv;
        }
    }
    Ok(())
}

/// `(cos, sin)` of every rotated pair at `pos` into `out`.
fn rope_table(p: &RopeParams, pos: i32, out: &mut Vec<(f32, f32)>) {
    out.clear();
    out.extend((0..p.n_dims / 2).map(|i| p.cos_sin(pos, i)));
}

/// [`crate::Backend::rope_neox`] over host slices, with the CPU device's FMAs (as ggml's
/// build contracts them).
pub fn rope_neox(
    x: &mut [f32],
    positions: &[i32],
    n_heads: usize,
    head_dim: usize,
    p: &RopeParams,
) -> Result<(), BackendError> {
    crate::error::ensure(
        x.len() >= positions.len() * n_heads * head_dim && p.n_dims <= head_dim,
        "rope_neox",
        || "lengths".into(),
    )?;
    let half = p.n_dims / 2;
    let mut cs = Vec::with_capacity(half);
    for (t, &pos) in positions.iter().enumerate() {
        rope_table(p, pos, &mut cs);
        let heads = &mut x[t * n_heads * head_dim..(t + 1) * n_heads * head_dim];
        for head in heads.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (x0, x1) = (head[i], head[i + half]);
                head[i] = x0.mul_add(c, -(x1 * s));
                head[i + half] = x0.mul_add(s, x1 * c);
            }
        }
    }
    Ok(())
}

/// [`crate::Backend::rope_norm`] over host slices (adjacent pairs of dims
/// `first .. first + p.n_dims` of every head), with the CPU device's FMAs.
pub fn rope_norm(
    x: &mut [f32],
    positions: &[i32],
    n_heads: usize,
    head_dim: usize,
    first: usize,
    p: &RopeParams,
) -> Result<(), BackendError> {
    crate::shapes::rope_norm(x.len(), positions.len(), n_heads, head_dim, first, p.n_dims)?;
    let mut cs = Vec::with_capacity(p.n_dims / 2);
    for (t, &pos) in positions.iter().enumerate() {
        rope_table(p, pos, &mut cs);
        for h in 0..n_heads {
            let head = &mut x[(t * n_heads + h) * head_dim + first..][..p.n_dims];
            for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(&cs) {
                let (x0, x1) = (pair[0], pair[1]);
                pair[0] = x0.mul_add(c, -(x1 * s));
                pair[1] = x0.mul_add(s, x1 * c);
            }
        }
    }
    Ok(())
}

/// [`crate::Backend::get_rows`] over host memory: `out[i]` is row `ids[i]` (of `rows` rows of
/// `cols` values of `ty`, row `r`'s bytes `row(r)`) dequantized, or zeros for an id out of
/// range.
pub fn get_rows<'m>(
    (ty, rows, cols): (GgmlType, usize, usize),
    row: impl Fn(usize) -> &'m [u8],
    ids: &[i32],
    out: &mut [f32],
) -> Result<(), BackendError> {
    const OP: &str = "get_rows";
    crate::error::ensure(out.len() >= ids.len() * cols, OP, || {
        format!("out {} for {} rows of {cols}", out.len(), ids.len())
    })?;
    for (i, &id) in ids.iter().enumerate() {
        let dst = &mut out[i * cols..(i + 1) * cols];
        match usize::try_from(id).ok().filter(|&r| r < rows) {
            Some(r) => {
                hmoe_quant::dequantize_row(ty, row(r), dst).map_err(|e| BackendError::Shape {
                    op: OP,
                    what: e.to_string(),
                })?
            }
            None => dst.fill(0.0),
        }
    }
    Ok(())
}

/// [`crate::Backend::add_assign`] over host memory: `x[i] += y[i]`.
pub fn add_assign(x: &mut [f32], y: &[f32]) -> Result<(), BackendError> {
    crate::error::ensure(y.len() >= x.len(), "add_assign", || "lengths".into())?;
    x.iter_mut().zip(y).for_each(|(a, &b)| *a += b);
    Ok(())
}
