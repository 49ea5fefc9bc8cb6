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

/// [`moe_swiglu`]'s general path: tokens grouped by expert, three matmuls per expert. With
/// enough experts routed to, each expert is one task of a pool job (its matmuls run inline on
/// that thread, so no thread waits between an expert's gate, up and down); otherwise the
/// experts run one after another, each matmul spread over the pool. The products and sums are
/// the same either way.
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
    // The slots of each expert, ascending.
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); n_expert];
    for (slot, &e) in selected[..n * k_used].iter().enumerate() {
        if e < n_expert {
            by_expert[e].push(slot);
        }
    }
    let routed: Vec<(ExpertView<'w>, Vec<usize>)> = by_expert
        .into_iter()
        .enumerate()
        .filter(|(_, slots)| !slots.is_empty())
        .filter_map(|(e, slots)| view(e).map(|w| (w, slots)))
        .collect();
    let pool = hmoe_pool::global();
    let as_tasks = routed.len() >= EXPERTS_PER_THREAD * pool.n_threads();
    let downs = expert_outputs(k, (d, ff), &routed, h, k_used, acts, as_tasks);
    // Where each slot's output lies: (expert, row), `None` for a slot that gives nothing.
    let mut source = vec![None; n * k_used];
    for (i, (_, slots)) in routed.iter().enumerate() {
        for (row, &slot) in slots.iter().enumerate() {
            source[slot] = Some((i, row));
        }
    }
    // Weighted sum in slot order (highest router score first), as llama.cpp adds them.
    let mut out = vec![0f32; n * d];
    pool.for_each_chunk_mut(&mut out, d, |t, dst| {
        for s in 0..k_used {
            let Some((i, row)) = source[t * k_used + s] else {
                continue;
            };
            let w = weights[t * k_used + s];
            for (o, &v) in dst.iter_mut().zip(&downs[i][row * d..][..d]) {
                *o += v * w;
            }
        }
    });
    out
}

/// Routed experts per pool thread from which [`moe_swiglu_grouped`] runs each expert as one
/// task (fewer, and the threads share each matmul instead).
const EXPERTS_PER_THREAD: usize = 4;

/// [`expert_ffn`] of each routed expert (its view and slots), each one pool task where
/// `as_tasks`, else one after another with the pool sharing each matmul: the same bits.
fn expert_outputs(
    k: &ExpertKernels,
    (d, ff): (usize, usize),
    routed: &[(ExpertView<'_>, Vec<usize>)],
    h: &[f32],
    k_used: usize,
    acts: &QuantizedActs,
    as_tasks: bool,
) -> Vec<Vec<f32>> {
    let run = |(w, slots): &(ExpertView<'_>, Vec<usize>)| {
        expert_ffn(k, (d, ff), w, h, slots, k_used, acts)
    };
    if !as_tasks {
        return routed.iter().map(run).collect();
    }
    let mut downs: Vec<Vec<f32>> = vec![Vec::new(); routed.len()];
    hmoe_pool::global().for_each_chunk_mut(&mut downs, 1, |i, dst| dst[0] = run(&routed[i]));
    downs
}

/// One expert's SwiGLU FFN over its routed `slots` (`slot / k_used` is the token): gate and up
/// from the tokens' rows of `acts` (the quantized `h`, for gate's activation type), the down
/// projection of `silu(gate) ⊙ up`; the result is `[slot][d]`.
fn expert_ffn(
    k: &ExpertKernels,
    (d, ff): (usize, usize),
    w: &ExpertView<'_>,
    h: &[f32],
    slots: &[usize],
    k_used: usize,
    acts: &QuantizedActs,
) -> Vec<f32> {
    let m = slots.len();
    let (mut routed, mut act_q) = (QuantizedActs::default(), QuantizedActs::default());
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
    down
}

#[cfg(test)]
mod experts_tests;
