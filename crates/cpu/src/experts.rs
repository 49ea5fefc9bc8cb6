//! The CPU device's routed-expert kernels, which know no architecture: the batch that crosses
//! the expert boundary ([`ExpertBatch`]: the normed hidden state with the router's choices and
//! weights) and the expert sum over one layer's experts in the file mapping
//! (`expert_sum`), which [`crate::Cpu`]'s `moe` op runs, for the CPU device and for the
//! executor's host-expert layers alike.
//!
//! For each token `t` of the batch the host computes
//! `out[t] = Σ_s w[t,s] · expert_{sel[t,s]}(h[t])`, the slots `s` summed in order (highest
//! router score first) starting from zero, tokens grouped by expert as llama.cpp's CPU backend
//! does.

use std::ops::Range;

use hmoe_backend::{BackendError, ExpertView, GatedAct};
use hmoe_quant::{BatchKind, DotKernel, GemmKernel, GgmlType};

pub use hmoe_backend::{ExpertMatrix, ExpertTensors};

use crate::ops::{add_bias, matmul, matmul_as, matmul_vec_dot, swiglu, QuantizedActs, RowProduct};

/// What can go wrong at the expert boundary.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpertDeviceError {
    /// The batch routes a token to an expert that is not on the device (op offload uploads
    /// only the routed ones).
    #[error("layer {layer}: expert {expert} is not on the device")]
    MissingExpert {
        /// The layer.
        layer: usize,
        /// The expert.
        expert: usize,
    },
    /// An expert id is outside the layer's experts.
    #[error("expert id {expert} is out of range (the layer has {n_expert} experts)")]
    BadExpertId {
        /// The id.
        expert: usize,
        /// Experts in the layer.
        n_expert: usize,
    },
    /// Buffer lengths or shapes that do not agree.
    #[error("bad {what}: {detail}")]
    Shape {
        /// Which buffer or tensor.
        what: &'static str,
        /// What disagrees.
        detail: String,
    },
    /// A device of the contract failed (out of memory, an unsupported op, its driver).
    #[error(transparent)]
    Device(BackendError),
}

impl From<BackendError> for ExpertDeviceError {
    fn from(e: BackendError) -> ExpertDeviceError {
        match e {
            BackendError::Shape { op, what } => ExpertDeviceError::Shape {
                what: op,
                detail: what,
            },
            other => ExpertDeviceError::Device(other),
        }
    }
}

fn shape_err(what: &'static str, detail: String) -> ExpertDeviceError {
    ExpertDeviceError::Shape { what, detail }
}

/// One layer's expert work for a batch: the input of the experts and the router's choices.
#[derive(Clone, Copy, Debug)]
pub struct ExpertBatch<'a> {
    /// Normed hidden state, `n_tokens × n_embd` row-major.
    pub h: &'a [f32],
    /// Chosen experts, `n_tokens × n_used`, each row highest router score first.
    pub selected: &'a [u32],
    /// Their mixing weights (softmax over the chosen scores), same layout as `selected`.
    pub weights: &'a [f32],
    /// Experts used per token.
    pub n_used: usize,
    /// Token ranges that belong to separate sequences (one range covering every token for a
    /// single sequence). A CPU implementation computes F32-weight products per range, because
    /// ggml sums a batch of F32 products in a different order from a single token; quantized
    /// weights and other devices may ignore it.
    pub groups: &'a [Range<usize>],
}

impl ExpertBatch<'_> {
    /// Checks lengths, ids and groups against a layer of `n_expert` experts of width `d`, and
    /// returns the number of tokens.
    pub fn validate(&self, d: usize, n_expert: usize) -> Result<usize, ExpertDeviceError> {
        if d == 0 || !self.h.len().is_multiple_of(d) {
            return Err(shape_err(
                "hidden state",
                format!("{} floats, not rows of {d}", self.h.len()),
            ));
        }
        let n = self.h.len() / d;
        let slots = n.checked_mul(self.n_used);
        if self.n_used == 0
            || slots != Some(self.selected.len())
            || slots != Some(self.weights.len())
        {
            return Err(shape_err(
                "routing",
                format!(
                    "{} ids and {} weights for {n} tokens × {} experts",
                    self.selected.len(),
                    self.weights.len(),
                    self.n_used
                ),
            ));
        }
        if let Some(&e) = self.selected.iter().find(|&&e| e as usize >= n_expert) {
            return Err(ExpertDeviceError::BadExpertId {
                expert: e as usize,
                n_expert,
            });
        }
        let mut next = 0;
        for g in self.groups {
            if g.start != next || g.end < g.start {
                return Err(shape_err(
                    "groups",
                    format!("{:?} do not tile 0..{n}", self.groups),
                ));
            }
            next = g.end;
        }
        if next != n {
            return Err(shape_err(
                "groups",
                format!("{:?} do not tile 0..{n}", self.groups),
            ));
        }
        Ok(n)
    }
}

/// The dot kernels of one layer's three expert matrices (llama.cpp's choice for their type).
#[derive(Clone, Copy, Debug)]
pub struct ExpertKernels {
    gate: DotKernel,
    up: DotKernel,
    down: DotKernel,
    /// The kernel of the three MXFP4 matrices when their rows are interleaved for it
    /// ([`GemmKernel::interleave_into`]), `None` for the file's layout.
    interleaved: Option<GemmKernel>,
}

impl ExpertKernels {
    /// The kernels llama.cpp's CPU backend chooses for the layer's matrices
    /// ([`DotKernel::for_matrix`] of each expert's rows).
    pub fn for_tensors(t: &ExpertTensors<'_>) -> Result<ExpertKernels, hmoe_quant::QuantError> {
        let k = |m: &ExpertMatrix<'_>| DotKernel::for_matrix(m.ty, m.n_out);
        Ok(ExpertKernels {
            gate: k(&t.gate)?,
            up: k(&t.up)?,
            down: k(&t.down)?,
            interleaved: None,
        })
    }

    /// The kernel that would read these experts' rows interleaved
    /// ([`GemmKernel::interleave_into`]): where all three matrices are MXFP4 of whole groups of
    /// 16 rows (`rows` per expert of each) and the CPU has the kernel.
    pub fn interleavable(&self, rows: [usize; 3]) -> Option<GemmKernel> {
        let ks = [self.gate, self.up, self.down];
        let fits = ks.iter().zip(rows).all(|(k, r)| {
            k.weight_type() == GgmlType::MXFP4 && r.is_multiple_of(16) && k.isa() == ks[0].isa()
        });
        fits.then(|| GemmKernel::interleaved(ks[0].isa())).flatten()
    }

    /// These kernels over rows interleaved for `gemm` (from [`ExpertKernels::interleavable`]).
    pub fn over_interleaved(self, gemm: GemmKernel) -> ExpertKernels {
        ExpertKernels {
            interleaved: Some(gemm),
            ..self
        }
    }

    /// One token's products with rows of `kernel`'s matrix ([`RowProduct`]).
    fn row_product<'a>(&self, kernel: DotKernel, n_in: usize, act: &'a [u8]) -> RowProduct<'a> {
        RowProduct::with_interleaved(kernel, self.interleaved, n_in, act)
    }

    /// [`matmul`] (`vec_dot` false) or [`matmul_vec_dot`] of `kernel`'s matrix `w`, over
    /// interleaved rows where the experts have them (MXFP4, whose products are the same).
    fn matmul(
        &self,
        vec_dot: bool,
        kernel: DotKernel,
        w: &[u8],
        (n_in, n_out): (usize, usize),
        acts: &QuantizedActs,
        out: &mut [f32],
    ) {
        match (self.interleaved, vec_dot) {
            (Some(g), _) => matmul_as(BatchKind::Dense, kernel, Some(g), w, n_in, n_out, acts, out),
            (None, false) => matmul(kernel, w, n_in, n_out, acts, out),
            (None, true) => matmul_vec_dot(kernel, w, n_in, n_out, acts, out),
        }
    }
}

/// Reusable buffers of [`host_experts`].
#[derive(Default)]
pub struct ExpertScratch {
    acts: QuantizedActs,
    routed: QuantizedActs,
    act_q: QuantizedActs,
    per_slot: Vec<f32>,
    /// The single-token path's SwiGLU output in the down projection's activation type, one
    /// row per slot.
    hidden_q: Vec<u8>,
}

/// Most rows one task of the single-token expert jobs computes (its stack buffers).
const ONE_TOKEN_MAX_ROWS: usize = 256;

/// Validates `batch` for hidden size `d` and `n_expert` experts and that `out` holds its
/// `n × d` result; returns the token count `n`.
fn check_batch_io(
    batch: &ExpertBatch<'_>,
    (d, n_expert): (usize, usize),
    out: &[f32],
) -> Result<usize, ExpertDeviceError> {
    let n = batch.validate(d, n_expert)?;
    if out.len() != n * d {
        return Err(shape_err(
            "output",
            format!("{} floats for {n} tokens × {d}", out.len()),
        ));
    }
    Ok(n)
}

/// The expert sum of a batch over the experts of one layer that `view` finds, tokens grouped by
/// expert (ascending ids) and slots summed in order, as llama.cpp's CPU backend does. Shared by
/// the host path and the CPU device's `moe`, so both give the same bits. `batch` must be valid
/// ([`ExpertBatch::validate`]); `out` is overwritten.
#[allow(clippy::too_many_arguments)]
fn mix_experts<'w>(
    layer: usize,
    k: &ExpertKernels,
    act: GatedAct,
    (d, ff, n_expert): (usize, usize, usize),
    batch: &ExpertBatch<'_>,
    view: impl Fn(usize) -> Option<ExpertView<'w>>,
    scratch: &mut ExpertScratch,
    out: &mut [f32],
) -> Result<(), ExpertDeviceError> {
    let n = check_batch_io(batch, (d, n_expert), out)?;
    if n == 1 && k.gate.act_type() == k.up.act_type() {
        if let Some(rows) = one_token_rows(k, ff) {
            let views = batch
                .selected
                .iter()
                .map(|&e| {
                    let e = e as usize;
                    let v = view(e).ok_or(ExpertDeviceError::MissingExpert { layer, expert: e });
                    v.map(Some)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let one = OneToken {
                h: batch.h,
                views: &views,
                weights: batch.weights,
            };
            mix_one_token(k, act, (d, ff, rows), &one, &mut scratch.hidden_q, out);
            return Ok(());
        }
    }
    let k_used = batch.n_used;
    let ExpertScratch {
        acts,
        routed,
        act_q,
        per_slot,
        ..
    } = scratch;
    acts.quantize(k.gate.act_type(), batch.h, d);
    per_slot.clear();
    per_slot.resize(n * k_used * d, 0.0);
    // F32 products depend on the batch (see `ExpertBatch::groups`); others run all at once.
    let per_group = [k.gate, k.up, k.down]
        .iter()
        .any(|k| k.weight_type() == GgmlType::F32);
    let whole = 0..n;
    let parts = if per_group {
        batch.groups
    } else {
        std::slice::from_ref(&whole)
    };
    let mut slots = Vec::new();
    for e in 0..n_expert {
        for grp in parts {
            slots.clear();
            slots.extend(
                (grp.start * k_used..grp.end * k_used).filter(|&i| batch.selected[i] as usize == e),
            );
            if slots.is_empty() {
                continue;
            }
            let w = view(e).ok_or(ExpertDeviceError::MissingExpert { layer, expert: e })?;
            let m = slots.len();
            routed.gather(acts, slots.iter().map(|&i| i / k_used));
            let mut gate = vec![0f32; m * ff];
            let mut up = vec![0f32; m * ff];
            k.matmul(false, k.gate, w.gate, (d, ff), routed, &mut gate);
            k.matmul(false, k.up, w.up, (d, ff), routed, &mut up);
            add_bias(&mut gate, w.gate_bias);
            add_bias(&mut up, w.up_bias);
            for (gv, &uv) in gate.iter_mut().zip(&up) {
                *gv = act.apply(*gv, uv);
            }
            act_q.quantize(k.down.act_type(), &gate, ff);
            let mut down = vec![0f32; m * d];
            k.matmul(false, k.down, w.down, (ff, d), act_q, &mut down);
            add_bias(&mut down, w.down_bias);
            for (row, &slot) in down.chunks_exact(d).zip(slots.iter()) {
                per_slot[slot * d..(slot + 1) * d].copy_from_slice(row);
            }
        }
    }
    // Weighted sum in slot order (highest router score first), as llama.cpp adds them.
    out.fill(0.0);
    for t in 0..n {
        let dst = &mut out[t * d..(t + 1) * d];
        for s in 0..k_used {
            let w = batch.weights[t * k_used + s];
            let src = &per_slot[(t * k_used + s) * d..(t * k_used + s + 1) * d];
            for (o, &v) in dst.iter_mut().zip(src) {
                *o += v * w;
            }
        }
    }
    Ok(())
}

/// Rows per task of [`mix_one_token`]'s gate/up job: the GEMM-sized block of rows rounded up
/// to whole blocks of the down projection's activation type, so that each task quantizes its
/// own part of the SwiGLU output. `None` when that exceeds [`ONE_TOKEN_MAX_ROWS`] or `ff` is
/// not whole blocks (the general path handles those).
fn one_token_rows(k: &ExpertKernels, ff: usize) -> Option<usize> {
    let blk = k.down.act_type().block_elems();
    let rows = 64usize.div_ceil(blk) * blk;
    (rows <= ONE_TOKEN_MAX_ROWS && ff.is_multiple_of(blk)).then_some(rows)
}

/// One token's routed experts for [`mix_one_token`].
struct OneToken<'a, 'w> {
    /// The normed hidden state, `d` floats.
    h: &'a [f32],
    /// The expert of each slot, `None` where a slot gives nothing.
    views: &'a [Option<ExpertView<'w>>],
    /// The slots' router weights.
    weights: &'a [f32],
}

/// The expert sum of a single token (decode) in two pool jobs instead of three matmuls per
/// expert: the first computes, for every slot, blocks of `rows` rows of gate and up together
/// (the activation quantized once for both), adds the biases where the experts have them,
/// applies `act` ([`GatedAct::apply_row`]) and quantizes the result for the down projection;
/// the second computes blocks of output rows over every slot's down projection, adds its bias
/// and sums the slots in order with their router weights. Each product is the one [`matmul`]
/// computes for a single token, and the sums run in the same order, so the bits are those of
/// the batch paths ([`mix_experts`], [`moe_swiglu_grouped`]). `rows` is a multiple of 16 (the
/// SwiGLU's vector blocks) and of the down projection's activation block.
fn mix_one_token(
    k: &ExpertKernels,
    act: GatedAct,
    (d, ff, rows): (usize, usize, usize),
    one: &OneToken<'_, '_>,
    hidden_q: &mut Vec<u8>,
    out: &mut [f32],
) {
    let views = one.views;
    let pool = hmoe_pool::global();
    let mut acts = QuantizedActs::default();
    acts.quantize(k.gate.act_type(), one.h, d);
    let act_row = acts.row(0);
    let (gate_p, up_p) = (
        k.row_product(k.gate, d, act_row),
        k.row_product(k.up, d, act_row),
    );
    let (gate_rb, up_rb) = (k.gate.weight_row_bytes(d), k.up.weight_row_bytes(d));
    // The activation of slot `s`, quantized: tasks of `rows` rows, whole blocks each; the last
    // task of a slot may hold fewer rows, and the slot's row is padded to whole tasks.
    let hid_ty = k.down.act_type();
    let blk = hid_ty.block_elems();
    let task_bytes = rows / blk * hid_ty.block_bytes();
    let tasks_per_slot = ff.div_ceil(rows);
    let slot_bytes = tasks_per_slot * task_bytes;
    hidden_q.clear();
    hidden_q.resize(views.len() * slot_bytes, 0);
    pool.for_each_chunk_mut(hidden_q, task_bytes, |i, dst| {
        let (s, r0) = (i / tasks_per_slot, i % tasks_per_slot * rows);
        let Some(w) = &views[s] else {
            return;
        };
        let m = rows.min(ff - r0);
        let mut gate = [0f32; ONE_TOKEN_MAX_ROWS];
        let mut up = [0f32; ONE_TOKEN_MAX_ROWS];
        let (gate, up) = (&mut gate[..m], &mut up[..m]);
        gate_p.rows(&w.gate[r0 * gate_rb..(r0 + m) * gate_rb], gate);
        up_p.rows(&w.up[r0 * up_rb..(r0 + m) * up_rb], up);
        if !w.gate_bias.is_empty() {
            add_bias(gate, &w.gate_bias[r0..r0 + m]);
            add_bias(up, &w.up_bias[r0..r0 + m]);
        }
        act.apply_row(gate, up);
        let dst = &mut dst[..m / blk * hid_ty.block_bytes()];
        hmoe_quant::quantize_row(hid_ty, gate, dst).expect("whole blocks");
    });
    let hidden_row = ff / blk * hid_ty.block_bytes();
    let down_p: Vec<RowProduct<'_>> = (0..views.len())
        .map(|s| k.row_product(k.down, ff, &hidden_q[s * slot_bytes..][..hidden_row]))
        .collect();
    let down_rb = k.down.weight_row_bytes(ff);
    // Tasks of at least 64 rows: each reads a run of every slot's down matrix, long enough
    // for the hardware prefetchers (the rows are independent, so the bits do not change).
    let out_rows = down_p[0].rows_per_task().max(64);
    // Weighted sum in slot order (highest router score first), as llama.cpp adds them.
    pool.for_each_chunk_mut(out, out_rows, |i, dst| {
        let (r0, m) = (i * out_rows, dst.len());
        dst.fill(0.0);
        let mut down = [0f32; ONE_TOKEN_MAX_ROWS];
        let down = &mut down[..m];
        for ((w, p), &wt) in views.iter().zip(&down_p).zip(one.weights) {
            let Some(w) = w else {
                continue;
            };
            p.rows(&w.down[r0 * down_rb..(r0 + m) * down_rb], down);
            if w.down_bias.is_empty() {
                for (o, &v) in dst.iter_mut().zip(down.iter()) {
                    *o += v * wt;
                }
            } else {
                let bias = &w.down_bias[r0..r0 + m];
                for ((o, &v), &b) in dst.iter_mut().zip(down.iter()).zip(bias) {
                    *o += (v + b) * wt;
                }
            }
        }
    });
}

/// The expert sum over the experts that `view` finds, as the CPU device computes it for `act`:
/// the elementwise activation of gpt-oss ([`GatedAct::ClampedSwiglu`], biases, the whole batch
/// at once except F32 products, which run per group); SwiGLU ([`GatedAct::Silu`],
/// [`moe_swiglu`]) each group alone.
#[allow(clippy::too_many_arguments)]
pub(crate) fn expert_sum<'w>(
    layer: usize,
    k: &ExpertKernels,
    act: GatedAct,
    (d, ff, n_expert): (usize, usize, usize),
    batch: &ExpertBatch<'_>,
    view: impl Fn(usize) -> Option<ExpertView<'w>>,
    scratch: &mut ExpertScratch,
    out: &mut [f32],
) -> Result<(), ExpertDeviceError> {
    if matches!(act, GatedAct::ClampedSwiglu { .. }) {
        return mix_experts(layer, k, act, (d, ff, n_expert), batch, view, scratch, out);
    }
    check_batch_io(batch, (d, n_expert), out)?;
    let k_used = batch.n_used;
    for r in batch.groups {
        let sel: Vec<usize> = batch.selected[r.start * k_used..r.end * k_used]
            .iter()
            .map(|&e| e as usize)
            .collect();
        let y = moe_swiglu(
            k,
            (d, ff, n_expert),
            &view,
            &batch.h[r.start * d..r.end * d],
            &sel,
            &batch.weights[r.start * k_used..r.end * k_used],
            k_used,
            &mut scratch.acts,
        );
        out[r.start * d..r.end * d].copy_from_slice(&y);
    }
    Ok(())
}

/// Routed SwiGLU experts without biases, the CPU device's Qwen3-MoE and DeepSeek experts:
/// `y_t = Σ_s w[t][s] · expert_{sel[t][s]}(h_t)` with
/// `expert_e(h) = Wd_e · (silu(Wg_e·h) ⊙ Wu_e·h)`, `k_used` slots per token, over the experts
/// `0..n_expert` that `view` finds (a slot naming another gives nothing). Tokens are grouped by
/// expert so each expert's weights are read once per batch; products in `vec_dot` order
/// (ggml's `mul_mat_id`); the weighted outputs are added in slot order, as llama.cpp does.
///
/// A single token runs the fused path of [`mix_one_token`] (gate and up of every slot in one
/// pool job, the down projections and the weighted sum in a second), with the same bits.
#[allow(clippy::too_many_arguments)]
pub fn moe_swiglu<'w>(
    k: &ExpertKernels,
    (d, ff, n_expert): (usize, usize, usize),
    view: impl Fn(usize) -> Option<ExpertView<'w>>,
    h: &[f32],
    selected: &[usize],
    weights: &[f32],
    k_used: usize,
    acts: &mut QuantizedActs,
) -> Vec<f32> {
    let one_token = h.len() == d && k.gate.act_type() == k.up.act_type();
    if let Some(rows) = one_token.then(|| one_token_rows(k, ff)).flatten() {
        // Experts outside `0..n_expert` or not on the device give nothing; SiLU experts have
        // no biases.
        let views: Vec<Option<ExpertView<'w>>> = selected[..k_used]
            .iter()
            .map(|&e| {
                (e < n_expert)
                    .then(|| view(e))
                    .flatten()
                    .map(|v| ExpertView {
                        gate_bias: &[],
                        up_bias: &[],
                        down_bias: &[],
                        ..v
                    })
            })
            .collect();
        let one = OneToken {
            h,
            views: &views,
            weights: &weights[..k_used],
        };
        let mut out = vec![0f32; d];
        mix_one_token(
            k,
            GatedAct::Silu,
            (d, ff, rows),
            &one,
            &mut Vec::new(),
            &mut out,
        );
        return out;
    }
    moe_swiglu_grouped(
        k,
        (d, ff, n_expert),
        view,
        h,
        selected,
        weights,
        k_used,
        acts,
    )
}

/// [`moe_swiglu`]'s general path: tokens grouped by expert, three matmuls per expert.
#[allow(clippy::too_many_arguments)]
fn moe_swiglu_grouped<'w>(
    k: &ExpertKernels,
    (d, ff, n_expert): (usize, usize, usize),
    view: impl Fn(usize) -> Option<ExpertView<'w>>,
    h: &[f32],
    selected: &[usize],
    weights: &[f32],
    k_used: usize,
    acts: &mut QuantizedActs,
) -> Vec<f32> {
    let n = h.len() / d;
    acts.quantize(k.gate.act_type(), h, d);
    let mut per_slot = vec![0f32; n * k_used * d];
    let mut found = vec![false; n * k_used];
    let (mut routed, mut act_q) = (QuantizedActs::default(), QuantizedActs::default());
    for e in 0..n_expert {
        let slots: Vec<usize> = (0..n * k_used).filter(|&i| selected[i] == e).collect();
        if slots.is_empty() {
            continue;
        }
        let Some(w) = view(e) else {
            continue;
        };
        let m = slots.len();
        routed.gather(acts, slots.iter().map(|&i| i / k_used));
        let mut gate = vec![0f32; m * ff];
        let mut up = vec![0f32; m * ff];
        k.matmul(true, k.gate, w.gate, (d, ff), &routed, &mut gate);
        if k.up.act_type() == k.gate.act_type() {
            k.matmul(true, k.up, w.up, (d, ff), &routed, &mut up);
        } else {
            let rows: Vec<f32> = slots
                .iter()
                .flat_map(|&i| h[(i / k_used) * d..][..d].iter().copied())
                .collect();
            act_q.quantize(k.up.act_type(), &rows, d);
            k.matmul(true, k.up, w.up, (d, ff), &act_q, &mut up);
        }
        swiglu(&mut gate, &up, ff);
        act_q.quantize(k.down.act_type(), &gate, ff);
        let mut down = vec![0f32; m * d];
        k.matmul(true, k.down, w.down, (ff, d), &act_q, &mut down);
        for (row, &slot) in down.chunks_exact(d).zip(&slots) {
            per_slot[slot * d..(slot + 1) * d].copy_from_slice(row);
            found[slot] = true;
        }
    }
    let mut out = vec![0f32; n * d];
    for (t, dst) in out.chunks_exact_mut(d).enumerate() {
        for s in (0..k_used).filter(|&s| found[t * k_used + s]) {
            let w = weights[t * k_used + s];
            let src = &per_slot[(t * k_used + s) * d..][..d];
            for (o, &v) in dst.iter_mut().zip(src) {
                *o += v * w;
            }
        }
    }
    out
}
#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // slices of token ranges, one sequence each
mod tests {
    use super::*;

    /// The expert sum over the layer's tensors in the file mapping.
    fn host_experts(
        layer: usize,
        k: &ExpertKernels,
        act: GatedAct,
        t: &ExpertTensors<'_>,
        batch: &ExpertBatch<'_>,
        scratch: &mut ExpertScratch,
        out: &mut [f32],
    ) -> Result<(), ExpertDeviceError> {
        let (d, ff) = t.validate()?;
        let shape = (d, ff, t.n_expert);
        expert_sum(layer, k, act, shape, batch, |e| t.view(e), scratch, out)
    }

    /// gpt-oss's activation.
    const OAI: GatedAct = GatedAct::ClampedSwiglu {
        alpha: 1.702,
        limit: 7.0,
    };

    /// Two experts of `d = ff = 32` in Q8_0 with distinct weights.
    fn q8_layer() -> (Vec<u8>, Vec<f32>) {
        let (d, n_expert) = (32usize, 2usize);
        let row = GgmlType::Q8_0.row_bytes(d as u64).unwrap() as usize;
        let mut data = vec![0u8; n_expert * d * row];
        for (i, r) in data.chunks_exact_mut(row).enumerate() {
            let vals: Vec<f32> = (0..d)
                .map(|j| ((i * 7 + j * 3) % 11) as f32 * 0.1 - 0.5)
                .collect();
            hmoe_quant::quantize_row(GgmlType::Q8_0, &vals, r).unwrap();
        }
        let bias: Vec<f32> = (0..n_expert * d).map(|i| i as f32 * 0.01).collect();
        (data, bias)
    }

    fn tensors<'a>(data: &'a [u8], bias: &'a [f32]) -> ExpertTensors<'a> {
        let m = ExpertMatrix {
            ty: GgmlType::Q8_0,
            n_in: 32,
            n_out: 32,
            data,
        };
        ExpertTensors {
            n_expert: 2,
            gate: m,
            up: m,
            down: m,
            gate_bias: bias,
            up_bias: bias,
            down_bias: bias,
        }
    }

    /// Random experts, gate, up and down of types `tys` (MXFP4 or types `quantize_row`
    /// makes): `n_expert` experts of `d → ff → d`.
    fn random_layer(tys: [GgmlType; 3], d: usize, ff: usize, n_expert: usize) -> Vec<Vec<u8>> {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ tys[0].id() as u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        [(d, ff), (d, ff), (ff, d)]
            .iter()
            .zip(tys)
            .map(|(&(n_in, n_out), ty)| {
                let rows = n_expert * n_out;
                let row = ty.row_bytes(n_in as u64).unwrap() as usize;
                let mut data = vec![0u8; rows * row];
                for r in data.chunks_exact_mut(row) {
                    if ty == GgmlType::MXFP4 {
                        for b in r.chunks_exact_mut(17) {
                            b[0] = 120 + (next() % 12) as u8;
                            b[1..].iter_mut().for_each(|q| *q = next() as u8);
                        }
                    } else if matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K) {
                        // Random quants and scales, the f16 super-block scales small and
                        // finite (Q6_K's `d` at byte 208, Q4_K's and Q5_K's `d` and `dmin`
                        // first).
                        let at: &[usize] = match ty {
                            GgmlType::Q6_K => &[208],
                            _ => &[0, 2],
                        };
                        for b in r.chunks_exact_mut(ty.block_bytes()) {
                            b.iter_mut().for_each(|q| *q = next() as u8);
                            for &o in at {
                                let v = 0.001 + (next() % 100) as f32 * 1e-5;
                                b[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                            }
                        }
                    } else {
                        let vals: Vec<f32> = (0..n_in)
                            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                            .collect();
                        hmoe_quant::quantize_row(ty, &vals, r).unwrap();
                    }
                }
                data
            })
            .collect()
    }

    /// The single-token path (two fused jobs) gives the bits of the batch path, which runs
    /// the experts as separate matmuls: a token alone equals the same token in a batch of two.
    #[test]
    fn single_token_path_matches_batch_path() {
        let (d, ff, n_expert) = (160usize, 96usize, 4usize);
        for ty in [GgmlType::MXFP4, GgmlType::Q8_0] {
            let mats = random_layer([ty; 3], d, ff, n_expert);
            let m = |i: usize, n_in, n_out| ExpertMatrix {
                ty,
                n_in,
                n_out,
                data: &mats[i],
            };
            let gb: Vec<f32> = (0..n_expert * ff).map(|i| (i as f32 * 0.7).sin()).collect();
            let ub: Vec<f32> = (0..n_expert * ff).map(|i| (i as f32 * 0.3).cos()).collect();
            let db: Vec<f32> = (0..n_expert * d).map(|i| (i as f32 * 0.1).sin()).collect();
            let t = ExpertTensors {
                n_expert,
                gate: m(0, d, ff),
                up: m(1, d, ff),
                down: m(2, ff, d),
                gate_bias: &gb,
                up_bias: &ub,
                down_bias: &db,
            };
            let k = ExpertKernels::for_tensors(&t).unwrap();
            let h: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
            // Three slots, so that the order of the weighted sum shows in the bits.
            let (selected, weights) = ([2u32, 0, 3], [0.5f32, 0.3, 0.2]);
            let one = ExpertBatch {
                h: &h,
                selected: &selected,
                weights: &weights,
                n_used: 3,
                groups: &[0..1],
            };
            let mut got = vec![f32::NAN; d];
            host_experts(
                0,
                &k,
                OAI,
                &t,
                &one,
                &mut ExpertScratch::default(),
                &mut got,
            )
            .unwrap();
            let h2 = [h.clone(), h.clone()].concat();
            let (sel2, w2) = ([selected, selected].concat(), [weights, weights].concat());
            let two = ExpertBatch {
                h: &h2,
                selected: &sel2,
                weights: &w2,
                n_used: 3,
                groups: &[0..2],
            };
            let mut want = vec![f32::NAN; 2 * d];
            host_experts(
                0,
                &k,
                OAI,
                &t,
                &two,
                &mut ExpertScratch::default(),
                &mut want,
            )
            .unwrap();
            assert!(got.iter().all(|v| v.is_finite() && *v != 0.0), "{ty}");
            for (i, (a, b)) in got.iter().zip(&want[..d]).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{ty} output {i}: {a} vs {b}");
            }
        }
    }

    /// SiLU experts of one token (decode) take the fused path, whose bits are those of the
    /// grouped path (three matmuls per expert): K-quants with Q8_K activations shared by gate
    /// and up (repacked-order Q4_K gate/up, Q6_K down as in Q4_K_M files), Q5_K, and Q8_0; a
    /// slot naming an expert outside the layer gives nothing on both paths.
    #[test]
    fn fused_silu_token_matches_grouped_path() {
        use GgmlType::*;
        let (d, ff, n_expert) = (512usize, 768usize, 4usize);
        for tys in [[Q4_K, Q4_K, Q6_K], [Q5_K, Q5_K, Q5_K], [Q8_0, Q8_0, Q8_0]] {
            let mats = random_layer(tys, d, ff, n_expert);
            let m = |i: usize, n_in, n_out| ExpertMatrix {
                ty: tys[i],
                n_in,
                n_out,
                data: &mats[i],
            };
            let t = ExpertTensors {
                n_expert,
                gate: m(0, d, ff),
                up: m(1, d, ff),
                down: m(2, ff, d),
                gate_bias: &[],
                up_bias: &[],
                down_bias: &[],
            };
            let k = ExpertKernels::for_tensors(&t).unwrap();
            assert!(one_token_rows(&k, ff).is_some(), "{tys:?} fuses");
            let h: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
            // Four slots, one outside the layer, so that the order of the sum shows in the bits.
            let (selected, weights) = ([2usize, 0, 9, 3], [0.4f32, 0.3, 0.2, 0.1]);
            let shape = (d, ff, n_expert);
            let mut acts = QuantizedActs::default();
            let view = |e| t.view(e);
            let got = moe_swiglu(&k, shape, view, &h, &selected, &weights, 4, &mut acts);
            let want = moe_swiglu_grouped(&k, shape, view, &h, &selected, &weights, 4, &mut acts);
            assert!(got.iter().all(|v| v.is_finite() && *v != 0.0), "{tys:?}");
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{tys:?} output {i}: {a} vs {b}");
            }
        }
    }

    /// SiLU experts of the IQ types (random codes, small scales): a token alone (the fused
    /// single-token path, the single-row kernels) gives the bits of the same token in a batch
    /// of two (the grouped path, the batched IQ kernels).
    #[test]
    fn iq_silu_token_alone_equals_token_in_batch() {
        let (d, ff, n_expert) = (512usize, 256usize, 4usize);
        for ty in hmoe_quant::IQ_TYPES {
            let mut seed = 0x2545_f491_4f6c_dd1du64 ^ ty.id() as u64;
            let mut next = move || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            let mut mat = |n_in: usize, n_out: usize| {
                let row = ty.row_bytes(n_in as u64).unwrap() as usize;
                let mut data: Vec<u8> = (0..n_expert * n_out * row).map(|_| next() as u8).collect();
                for b in data.chunks_exact_mut(ty.block_bytes()) {
                    let v = 0.001 + (next() % 100) as f32 * 1e-5;
                    let bits = half::f16::from_f32(v).to_bits();
                    assert!(hmoe_quant::set_iq_block_scale(ty, b, bits));
                }
                data
            };
            let mats = [mat(d, ff), mat(d, ff), mat(ff, d)];
            let m = |i: usize, n_in, n_out| ExpertMatrix {
                ty,
                n_in,
                n_out,
                data: &mats[i],
            };
            let t = ExpertTensors {
                n_expert,
                gate: m(0, d, ff),
                up: m(1, d, ff),
                down: m(2, ff, d),
                gate_bias: &[],
                up_bias: &[],
                down_bias: &[],
            };
            let k = ExpertKernels::for_tensors(&t).unwrap();
            let h: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
            let (selected, weights) = ([2usize, 0, 3], [0.5f32, 0.3, 0.2]);
            let shape = (d, ff, n_expert);
            let mut acts = QuantizedActs::default();
            let view = |e| t.view(e);
            let alone = moe_swiglu(&k, shape, view, &h, &selected, &weights, 3, &mut acts);
            let h2 = [h.clone(), h.clone()].concat();
            let (sel2, w2) = ([selected, selected].concat(), [weights, weights].concat());
            let two = moe_swiglu(&k, shape, view, &h2, &sel2, &w2, 3, &mut acts);
            assert!(alone.iter().all(|v| v.is_finite()), "{ty}");
            for (i, (a, b)) in alone.iter().zip(&two[..d]).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{ty} output {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn bad_batches_and_tensors_are_errors() {
        let (data, bias) = q8_layer();
        let t = tensors(&data, &bias);
        let k = ExpertKernels::for_tensors(&t).unwrap();
        let h = vec![0.5f32; 64];
        let mut out = vec![0f32; 64];
        let ok_groups = [0..2];
        let bad_groups = [0..1];
        let mut run = |batch: &ExpertBatch<'_>, t: &ExpertTensors<'_>, out_len: usize| {
            let mut scratch = ExpertScratch::default();
            host_experts(0, &k, OAI, t, batch, &mut scratch, &mut out[..out_len])
        };
        for (sel, w, groups, out_len) in [
            (&[0u32, 1][..], &[1.0f32][..], &ok_groups, 64),
            (&[0, 1], &[1.0, 1.0], &bad_groups, 64),
            (&[0, 1], &[1.0, 1.0], &ok_groups, 63),
            (&[0, 7], &[1.0, 1.0], &ok_groups, 64),
        ] {
            let batch = ExpertBatch {
                h: &h,
                selected: sel,
                weights: w,
                n_used: 1,
                groups,
            };
            assert!(run(&batch, &t, out_len).is_err(), "{sel:?} {w:?} {out_len}");
        }
        let good = ExpertBatch {
            h: &h,
            selected: &[0, 1],
            weights: &[1.0, 1.0],
            n_used: 1,
            groups: &ok_groups,
        };
        assert!(run(&good, &t, 64).is_ok());
        let short = tensors(&data[1..], &bias);
        assert!(matches!(
            run(&good, &short, 64),
            Err(ExpertDeviceError::Shape { .. })
        ));
    }
}
