//! The expert boundary of hybrid execution (DESIGN.md §1): which side holds each layer's
//! routed experts, the [`ExpertDevice`] trait a backend implements to hold and run them, and
//! [`StagingDevice`], a CPU stand-in for a GPU that owns copies of what it is given and counts
//! every transfer.
//!
//! The dense part of a layer (attention, router) runs on the host in this build, so the hidden
//! state lives there. For a layer whose experts live on an [`ExpertDevice`], the forward pass
//! makes exactly one round trip: the normed hidden state with the router's choices and weights
//! go to the device ([`ExpertDevice::run`]), the weighted expert sum comes back. Layers whose
//! experts live on the host run over the mapped file with no copy at all.
//!
//! Op offload (issue #5 item 3): for a micro-batch of at least
//! [`ExpertPlacement::op_offload_min_batch`] tokens, a host layer's experts that the batch
//! routes to are copied to the device ([`ExpertDevice::upload_experts`]) and run there.
//!
//! Every implementation must compute, for each token `t` of the batch,
//! `out[t] = Σ_s w[t,s] · expert_{sel[t,s]}(h[t])`, the slots `s` summed in order (highest
//! router score first) starting from zero, with gpt-oss's expert
//! `down · swiglu_oai(gate·h + bg, up·h + bu) + bd`. [`StagingDevice`] uses the very kernels
//! of the host path, so its results are bit-identical to it.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};

use hmoe_backend::{BackendError, ExpertView};
use hmoe_quant::{DotKernel, GgmlType};

pub use hmoe_backend::{ExpertMatrix, ExpertTensors};

use crate::ops::{add_bias, matmul, QuantizedActs, RowProduct};

/// SwiGLU constants of gpt-oss experts (fixed by the architecture, not stored in GGUF).
pub(crate) const SWIGLU_ALPHA: f32 = 1.702;
pub(crate) const SWIGLU_LIMIT: f32 = 7.0;

/// Smallest micro-batch (tokens) for which op offload happens by default (llama.cpp's
/// `GGML_OP_OFFLOAD_MIN_BATCH`).
pub const OP_OFFLOAD_MIN_BATCH: usize = 32;

/// What can go wrong at the expert boundary.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpertDeviceError {
    /// `run` was called for a layer whose experts were never uploaded.
    #[error("layer {layer}: no experts of this layer are on the device")]
    NotUploaded {
        /// The layer.
        layer: usize,
    },
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
    /// A weight type without a kernel on this device.
    #[error("expert weights of type {0} have no kernel on this device")]
    UnsupportedType(GgmlType),
    /// A placement that cannot be executed.
    #[error("placement: {0}")]
    Placement(String),
    /// A device of the contract failed (out of memory, an unsupported op, its driver).
    #[error(transparent)]
    Device(BackendError),
    /// The device itself failed (an implementation's driver or runtime error).
    #[error("device {device}: {message}")]
    Backend {
        /// The device's name.
        device: String,
        /// What the device reported.
        message: String,
    },
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

/// Which side of the boundary holds one layer's routed experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertHome {
    /// Host memory: the experts run over the mapped file where the dense part runs.
    Host,
    /// The model's [`ExpertDevice`]: uploaded once at load, run there.
    Device,
}

/// Where every layer's routed experts live, and when host layers are offloaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertPlacement {
    /// Home of the experts of each layer (index = layer).
    pub layers: Vec<ExpertHome>,
    /// Op offload: a micro-batch of at least this many tokens runs the routed experts of host
    /// layers on the device (copied there for the batch). `None` disables it.
    pub op_offload_min_batch: Option<usize>,
}

impl ExpertPlacement {
    /// Every layer's experts on `home`, op offload at the default threshold.
    pub fn all(n_layer: usize, home: ExpertHome) -> ExpertPlacement {
        ExpertPlacement {
            layers: vec![home; n_layer],
            op_offload_min_batch: Some(OP_OFFLOAD_MIN_BATCH),
        }
    }

    /// The placement a plan's tensor table implies: `tensors` yields every tensor's name and
    /// whether the plan put it on a device (not the CPU). A layer's experts are on the device
    /// when its routed-expert tensors (`blk.N.ffn_{gate,up,down}_exps.{weight,bias}`) all are,
    /// on the host when none is; a layer split between both is an error (the expert boundary
    /// is per layer). Op offload at the default threshold.
    pub fn from_tensor_devices<'a>(
        n_layer: usize,
        tensors: impl IntoIterator<Item = (&'a str, bool)>,
    ) -> Result<ExpertPlacement, ExpertDeviceError> {
        // Per layer: (tensors on the device, tensors on the host).
        let mut seen = vec![(0usize, 0usize); n_layer];
        for (name, on_device) in tensors {
            let Some(layer) = routed_expert_layer(name) else {
                continue;
            };
            let slot = seen.get_mut(layer).ok_or_else(|| {
                ExpertDeviceError::Placement(format!(
                    "tensor {name} names layer {layer} of a {n_layer}-layer model"
                ))
            })?;
            if on_device {
                slot.0 += 1;
            } else {
                slot.1 += 1;
            }
        }
        let layers = seen
            .iter()
            .enumerate()
            .map(|(l, &(dev, host))| match (dev, host) {
                (0, _) => Ok(ExpertHome::Host),
                (_, 0) => Ok(ExpertHome::Device),
                _ => Err(ExpertDeviceError::Placement(format!(
                    "layer {l}'s expert tensors are split between host and device \
                     ({dev} on the device, {host} on the host); a layer's experts move as a unit"
                ))),
            })
            .collect::<Result<_, _>>()?;
        Ok(ExpertPlacement {
            layers,
            op_offload_min_batch: Some(OP_OFFLOAD_MIN_BATCH),
        })
    }

    /// The same placement with op offload from `min_batch` tokens (`None` disables it).
    pub fn with_op_offload(mut self, min_batch: Option<usize>) -> ExpertPlacement {
        self.op_offload_min_batch = min_batch;
        self
    }

    /// Number of layers whose experts live on the device.
    pub fn device_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|&&h| h == ExpertHome::Device)
            .count()
    }
}

/// The layer of a routed-expert tensor name (`blk.N.ffn_{gate,up,down}_exps.*`).
fn routed_expert_layer(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    ["ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps."]
        .iter()
        .any(|p| tail.starts_with(p))
        .then_some(layer)
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

    /// The distinct experts the batch routes to, ascending (what op offload copies).
    pub fn routed_experts(&self) -> Vec<usize> {
        let mut ids: Vec<usize> = self.selected.iter().map(|&e| e as usize).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Transfers across the boundary, as a device counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Weight uploads (one per [`ExpertDevice::upload_layer`] or
    /// [`ExpertDevice::upload_experts`] call).
    pub uploads: u64,
    /// Bytes of weights uploaded (see [`ExpertTensors::expert_bytes`]).
    pub upload_bytes: u64,
    /// Host → device transfers of a batch's inputs (one per [`ExpertDevice::run`]).
    pub to_device: u64,
    /// Their bytes: `4·n·d` of hidden state plus `4·n·k` each of ids and weights.
    pub to_device_bytes: u64,
    /// Device → host transfers of the expert sum (one per [`ExpertDevice::run`]).
    pub to_host: u64,
    /// Their bytes: `4·n·d`.
    pub to_host_bytes: u64,
}

/// A device that holds the routed experts of some layers and runs them for a batch.
///
/// Methods take `&self` (a model is shared between threads); an implementation serialises its
/// own work. Layers are identified by their index in the model.
pub trait ExpertDevice: Send + Sync {
    /// A name for messages (`CUDA0`, `staging`).
    fn name(&self) -> &str;

    /// Copies every expert of `layer` to the device, where they stay (called at load for the
    /// layers the placement puts there). Replaces what the layer had.
    fn upload_layer(
        &self,
        layer: usize,
        experts: &ExpertTensors<'_>,
    ) -> Result<(), ExpertDeviceError>;

    /// Op offload: copies experts `ids` (distinct, ascending) of `layer` into the device's
    /// staging area, replacing what it held, so that the next [`ExpertDevice::run`] of that
    /// layer can use them. The staging area holds one layer at a time.
    fn upload_experts(
        &self,
        layer: usize,
        experts: &ExpertTensors<'_>,
        ids: &[usize],
    ) -> Result<(), ExpertDeviceError>;

    /// Computes `out[t] = Σ_s weights[t,s] · expert_{selected[t,s]}(h[t])` with the experts of
    /// `layer` (uploaded with `upload_layer`, else those staged for it). `out` is
    /// `n_tokens × n_embd`. One host → device transfer of the inputs, one device → host
    /// transfer of the result.
    fn run(
        &self,
        layer: usize,
        batch: &ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ExpertDeviceError>;

    /// Op offload of one layer for one batch: copies exactly the experts `batch` routes to
    /// ([`ExpertBatch::routed_experts`]) into the staging area and runs the batch there. An
    /// implementation should overlap the copies with the compute (expert `i + 1` copied while
    /// expert `i` runs); the default does [`ExpertDevice::upload_experts`] then
    /// [`ExpertDevice::run`], one after the other. Counted as one upload and one round trip.
    fn run_offloaded(
        &self,
        layer: usize,
        experts: &ExpertTensors<'_>,
        batch: &ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ExpertDeviceError> {
        self.upload_experts(layer, experts, &batch.routed_experts())?;
        self.run(layer, batch, out)
    }

    /// Transfers counted since the device was created.
    fn stats(&self) -> TransferStats;
}

/// The dot kernels of one layer's three expert matrices (llama.cpp's choice for their type).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExpertKernels {
    gate: DotKernel,
    up: DotKernel,
    down: DotKernel,
}

impl ExpertKernels {
    /// The kernels for the layer's matrices.
    pub(crate) fn for_tensors(t: &ExpertTensors<'_>) -> Result<ExpertKernels, ExpertDeviceError> {
        let k = |m: &ExpertMatrix<'_>| {
            DotKernel::for_matrix(m.ty, m.n_out)
                .map_err(|_| ExpertDeviceError::UnsupportedType(m.ty))
        };
        Ok(ExpertKernels {
            gate: k(&t.gate)?,
            up: k(&t.up)?,
            down: k(&t.down)?,
        })
    }

    /// The kernels a model chose at load.
    pub(crate) fn new(gate: DotKernel, up: DotKernel, down: DotKernel) -> ExpertKernels {
        ExpertKernels { gate, up, down }
    }
}

/// Reusable buffers of [`mix_experts`].
#[derive(Default)]
pub(crate) struct ExpertScratch {
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
/// the host path and [`StagingDevice`], so both give the same bits. `batch` must be valid
/// ([`ExpertBatch::validate`]); `out` is overwritten.
fn mix_experts<'w>(
    layer: usize,
    k: &ExpertKernels,
    (d, ff, n_expert): (usize, usize, usize),
    batch: &ExpertBatch<'_>,
    view: impl Fn(usize) -> Option<ExpertView<'w>>,
    scratch: &mut ExpertScratch,
    out: &mut [f32],
) -> Result<(), ExpertDeviceError> {
    let n = check_batch_io(batch, (d, n_expert), out)?;
    if n == 1 && k.gate.act_type() == k.up.act_type() {
        if let Some(rows) = one_token_rows(k, ff) {
            return mix_one_token(layer, k, (d, ff, rows), batch, view, scratch, out);
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
            matmul(k.gate, w.gate, d, ff, routed, &mut gate);
            matmul(k.up, w.up, d, ff, routed, &mut up);
            add_bias(&mut gate, w.gate_bias);
            add_bias(&mut up, w.up_bias);
            for (gv, &uv) in gate.iter_mut().zip(&up) {
                *gv = swiglu_oai(*gv, uv);
            }
            act_q.quantize(k.down.act_type(), &gate, ff);
            let mut down = vec![0f32; m * d];
            matmul(k.down, w.down, ff, d, act_q, &mut down);
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

/// [`mix_experts`] for a single token (decode), in two pool jobs instead of three matmuls per
/// expert: the first computes, for every slot, blocks of `rows` rows of gate and up together,
/// adds the biases, applies the SwiGLU and quantizes the result for the down projection; the
/// second computes blocks of output rows over every slot's down projection, adds its bias and
/// sums the slots in order with their router weights. Each product is the one [`matmul`]
/// computes for a single token, and the sums run in the same order, so the bits are the same.
fn mix_one_token<'w>(
    layer: usize,
    k: &ExpertKernels,
    (d, ff, rows): (usize, usize, usize),
    batch: &ExpertBatch<'_>,
    view: impl Fn(usize) -> Option<ExpertView<'w>>,
    scratch: &mut ExpertScratch,
    out: &mut [f32],
) -> Result<(), ExpertDeviceError> {
    let views = batch
        .selected
        .iter()
        .map(|&e| {
            let e = e as usize;
            view(e).ok_or(ExpertDeviceError::MissingExpert { layer, expert: e })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let pool = hmoe_pool::global();
    scratch.acts.quantize(k.gate.act_type(), batch.h, d);
    let act = scratch.acts.row(0);
    let (gate_p, up_p) = (
        RowProduct::new(k.gate, d, act),
        RowProduct::new(k.up, d, act),
    );
    let (gate_rb, up_rb) = (k.gate.weight_row_bytes(d), k.up.weight_row_bytes(d));
    // The SwiGLU output of slot `s`, quantized: tasks of `rows` rows, whole blocks each; the
    // last task of a slot may hold fewer rows, and the slot's row is padded to whole tasks.
    let hid_ty = k.down.act_type();
    let blk = hid_ty.block_elems();
    let task_bytes = rows / blk * hid_ty.block_bytes();
    let tasks_per_slot = ff.div_ceil(rows);
    let slot_bytes = tasks_per_slot * task_bytes;
    let hidden_q = &mut scratch.hidden_q;
    hidden_q.clear();
    hidden_q.resize(views.len() * slot_bytes, 0);
    pool.for_each_chunk_mut(hidden_q, task_bytes, |i, dst| {
        let (s, r0) = (i / tasks_per_slot, i % tasks_per_slot * rows);
        let m = rows.min(ff - r0);
        let w = &views[s];
        let mut gate = [0f32; ONE_TOKEN_MAX_ROWS];
        let mut up = [0f32; ONE_TOKEN_MAX_ROWS];
        let (gate, up) = (&mut gate[..m], &mut up[..m]);
        gate_p.rows(&w.gate[r0 * gate_rb..(r0 + m) * gate_rb], gate);
        up_p.rows(&w.up[r0 * up_rb..(r0 + m) * up_rb], up);
        let (gb, ub) = (&w.gate_bias[r0..r0 + m], &w.up_bias[r0..r0 + m]);
        for (((g, &u), &bg), &bu) in gate.iter_mut().zip(up.iter()).zip(gb).zip(ub) {
            *g = swiglu_oai(*g + bg, u + bu);
        }
        let dst = &mut dst[..m / blk * hid_ty.block_bytes()];
        hmoe_quant::quantize_row(hid_ty, gate, dst).expect("whole blocks");
    });
    let hidden_row = ff / blk * hid_ty.block_bytes();
    let down_p: Vec<RowProduct<'_>> = (0..views.len())
        .map(|s| RowProduct::new(k.down, ff, &hidden_q[s * slot_bytes..][..hidden_row]))
        .collect();
    let down_rb = k.down.weight_row_bytes(ff);
    let out_rows = down_p[0].rows_per_task();
    // Weighted sum in slot order (highest router score first), as llama.cpp adds them.
    pool.for_each_chunk_mut(out, out_rows, |i, dst| {
        let (r0, m) = (i * out_rows, dst.len());
        dst.fill(0.0);
        let mut down = [0f32; ONE_TOKEN_MAX_ROWS];
        let down = &mut down[..m];
        for ((w, p), &wt) in views.iter().zip(&down_p).zip(batch.weights) {
            p.rows(&w.down[r0 * down_rb..(r0 + m) * down_rb], down);
            for ((o, &v), &b) in dst
                .iter_mut()
                .zip(down.iter())
                .zip(&w.down_bias[r0..r0 + m])
            {
                *o += (v + b) * wt;
            }
        }
    });
    Ok(())
}

/// The host path: the expert sum over the layer's tensors in the file mapping, no copies.
pub(crate) fn host_experts(
    layer: usize,
    k: &ExpertKernels,
    t: &ExpertTensors<'_>,
    batch: &ExpertBatch<'_>,
    scratch: &mut ExpertScratch,
    out: &mut [f32],
) -> Result<(), ExpertDeviceError> {
    let (d, ff) = t.validate()?;
    mix_experts(
        layer,
        k,
        (d, ff, t.n_expert),
        batch,
        |e| t.view(e),
        scratch,
        out,
    )
}

/// gpt-oss's clamped SwiGLU: `min(g,7)·σ(1.702·min(g,7))·(clamp(u,−7,7)+1)`.
pub(crate) fn swiglu_oai(gate: f32, up: f32) -> f32 {
    let x = gate.min(SWIGLU_LIMIT);
    let y = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT);
    x / (1.0 + (-SWIGLU_ALPHA * x).exp()) * (y + 1.0)
}

/// Alignment of the staging device's weight copies (a GPU allocation is at least this aligned).
const DEVICE_ALIGN: usize = 64;

/// Bytes owned by the device, starting at a [`DEVICE_ALIGN`]-byte boundary when the allocator
/// allows it.
#[derive(Debug)]
struct AlignedBytes {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBytes {
    fn copy_of(src: &[u8]) -> AlignedBytes {
        let mut buf = vec![0u8; src.len() + DEVICE_ALIGN - 1];
        // `align_offset` may decline (usize::MAX); unaligned data is still correct.
        let start = match buf.as_ptr().align_offset(DEVICE_ALIGN) {
            off if off < DEVICE_ALIGN => off,
            _ => 0,
        };
        buf[start..start + src.len()].copy_from_slice(src);
        AlignedBytes {
            buf,
            start,
            len: src.len(),
        }
    }

    fn as_slice(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// One expert's weights in device memory.
#[derive(Debug)]
struct DeviceExpert {
    gate: AlignedBytes,
    up: AlignedBytes,
    down: AlignedBytes,
    gate_bias: Vec<f32>,
    up_bias: Vec<f32>,
    down_bias: Vec<f32>,
}

impl DeviceExpert {
    /// A device copy of one expert (a host → device upload).
    fn copy_of(v: &ExpertView<'_>) -> DeviceExpert {
        DeviceExpert {
            gate: AlignedBytes::copy_of(v.gate),
            up: AlignedBytes::copy_of(v.up),
            down: AlignedBytes::copy_of(v.down),
            gate_bias: v.gate_bias.to_vec(),
            up_bias: v.up_bias.to_vec(),
            down_bias: v.down_bias.to_vec(),
        }
    }

    fn view(&self) -> ExpertView<'_> {
        ExpertView {
            gate: self.gate.as_slice(),
            up: self.up.as_slice(),
            down: self.down.as_slice(),
            gate_bias: &self.gate_bias,
            up_bias: &self.up_bias,
            down_bias: &self.down_bias,
        }
    }
}

/// A layer's experts in device memory (all of them, or the staged ones).
struct DeviceLayer {
    kernels: ExpertKernels,
    d: usize,
    ff: usize,
    experts: Vec<Option<DeviceExpert>>,
}

impl DeviceLayer {
    /// Copies experts `ids` of `t` (all when `None`); returns the layer and the bytes copied.
    fn copy_of(
        t: &ExpertTensors<'_>,
        ids: Option<&[usize]>,
    ) -> Result<(DeviceLayer, u64), ExpertDeviceError> {
        let (d, ff) = t.validate()?;
        let kernels = ExpertKernels::for_tensors(t)?;
        let mut experts: Vec<Option<DeviceExpert>> = (0..t.n_expert).map(|_| None).collect();
        let all: Vec<usize>;
        let ids = match ids {
            Some(ids) => ids,
            None => {
                all = (0..t.n_expert).collect();
                &all
            }
        };
        for &e in ids {
            let v = t.view(e).ok_or(ExpertDeviceError::BadExpertId {
                expert: e,
                n_expert: t.n_expert,
            })?;
            experts[e] = Some(DeviceExpert::copy_of(&v));
        }
        let copied = experts.iter().flatten().count() as u64 * t.expert_bytes();
        Ok((
            DeviceLayer {
                kernels,
                d,
                ff,
                experts,
            },
            copied,
        ))
    }

    fn view(&self, e: usize) -> Option<ExpertView<'_>> {
        Some(self.experts.get(e)?.as_ref()?.view())
    }
}

/// Everything the staging device holds.
#[derive(Default)]
struct Staging {
    /// Layers uploaded at load.
    resident: HashMap<usize, DeviceLayer>,
    /// The op-offload staging area: one layer's routed experts.
    staged: Option<(usize, DeviceLayer)>,
    /// Device-side buffers of a batch.
    io: DeviceIo,
    stats: TransferStats,
}

/// Device-side copies of a batch's inputs and output, and the compute scratch.
#[derive(Default)]
struct DeviceIo {
    h: Vec<f32>,
    selected: Vec<u32>,
    weights: Vec<f32>,
    groups: Vec<Range<usize>>,
    out: Vec<f32>,
    scratch: ExpertScratch,
}

impl DeviceIo {
    /// Inputs in (one host → device transfer), the expert sum over `view`'s experts, the result
    /// out (one device → host transfer).
    #[allow(clippy::too_many_arguments)]
    fn round_trip<'w>(
        &mut self,
        layer: usize,
        kernels: &ExpertKernels,
        (d, ff, n_expert): (usize, usize, usize),
        batch: &ExpertBatch<'_>,
        view: impl Fn(usize) -> Option<ExpertView<'w>>,
        stats: &mut TransferStats,
        out: &mut [f32],
    ) -> Result<(), ExpertDeviceError> {
        let n = check_batch_io(batch, (d, n_expert), out)?;
        let DeviceIo {
            h,
            selected,
            weights,
            groups,
            out: dev_out,
            scratch,
        } = self;
        h.clear();
        h.extend_from_slice(batch.h);
        selected.clear();
        selected.extend_from_slice(batch.selected);
        weights.clear();
        weights.extend_from_slice(batch.weights);
        groups.clear();
        groups.extend_from_slice(batch.groups);
        stats.to_device += 1;
        stats.to_device_bytes += 4 * (h.len() + selected.len() + weights.len()) as u64;
        let dev_batch = ExpertBatch {
            h,
            selected,
            weights,
            n_used: batch.n_used,
            groups,
        };
        dev_out.clear();
        dev_out.resize(n * d, 0.0);
        mix_experts(
            layer,
            kernels,
            (d, ff, n_expert),
            &dev_batch,
            view,
            scratch,
            dev_out,
        )?;
        out.copy_from_slice(dev_out);
        stats.to_host += 1;
        stats.to_host_bytes += 4 * out.len() as u64;
        Ok(())
    }
}

/// A CPU stand-in for a GPU on the far side of the expert boundary: it owns aligned copies of
/// the expert weights uploaded to it (as VRAM would), copies each batch's inputs into its own
/// buffers and the result back out (as host ↔ device transfers), computes with the host's
/// kernels (so results are bit-identical to the host path), and counts every transfer.
///
/// It lets the hybrid executor's placement, upload and transfer logic run for real on machines
/// without a GPU.
pub struct StagingDevice {
    name: String,
    inner: Mutex<Staging>,
}

impl StagingDevice {
    /// An empty device called `name`.
    pub fn new(name: impl Into<String>) -> StagingDevice {
        StagingDevice {
            name: name.into(),
            inner: Mutex::new(Staging::default()),
        }
    }

    /// Bytes of expert weights held (resident layers plus the staging area).
    pub fn bytes_held(&self) -> u64 {
        let s = self.lock();
        let layer_bytes = |l: &DeviceLayer| -> u64 {
            l.experts
                .iter()
                .flatten()
                .map(|x| {
                    (x.gate.len + x.up.len + x.down.len) as u64
                        + 4 * (x.gate_bias.len() + x.up_bias.len() + x.down_bias.len()) as u64
                })
                .sum()
        };
        s.resident.values().map(layer_bytes).sum::<u64>()
            + s.staged.as_ref().map_or(0, |(_, l)| layer_bytes(l))
    }

    fn lock(&self) -> MutexGuard<'_, Staging> {
        // A panic while holding the lock leaves only buffers that every call rewrites.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ExpertDevice for StagingDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn upload_layer(
        &self,
        layer: usize,
        experts: &ExpertTensors<'_>,
    ) -> Result<(), ExpertDeviceError> {
        let (copy, bytes) = DeviceLayer::copy_of(experts, None)?;
        let mut s = self.lock();
        s.resident.insert(layer, copy);
        s.stats.uploads += 1;
        s.stats.upload_bytes += bytes;
        Ok(())
    }

    fn upload_experts(
        &self,
        layer: usize,
        experts: &ExpertTensors<'_>,
        ids: &[usize],
    ) -> Result<(), ExpertDeviceError> {
        if ids.windows(2).any(|w| w[0] >= w[1]) {
            return Err(shape_err(
                "expert ids",
                format!("{ids:?} are not distinct and ascending"),
            ));
        }
        let mut s = self.lock();
        // Free the previous staging area before filling it again.
        s.staged = None;
        let (copy, bytes) = DeviceLayer::copy_of(experts, Some(ids))?;
        s.staged = Some((layer, copy));
        s.stats.uploads += 1;
        s.stats.upload_bytes += bytes;
        Ok(())
    }

    fn run(
        &self,
        layer: usize,
        batch: &ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ExpertDeviceError> {
        let mut guard = self.lock();
        let Staging {
            resident,
            staged,
            io,
            stats,
        } = &mut *guard;
        let dl = match (resident.get(&layer), staged.as_ref()) {
            (Some(dl), _) => dl,
            (None, Some((l, dl))) if *l == layer => dl,
            _ => return Err(ExpertDeviceError::NotUploaded { layer }),
        };
        let dims = (dl.d, dl.ff, dl.experts.len());
        io.round_trip(layer, &dl.kernels, dims, batch, |e| dl.view(e), stats, out)
    }

    /// Copies the routed experts on a second thread, in ascending order, while this thread
    /// computes: expert `e` runs as soon as its copy is complete, so copying the next experts
    /// overlaps computing the previous ones. The result is that of `upload_experts` + `run`.
    fn run_offloaded(
        &self,
        layer: usize,
        experts: &ExpertTensors<'_>,
        batch: &ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ExpertDeviceError> {
        let (d, ff) = experts.validate()?;
        batch.validate(d, experts.n_expert)?;
        let kernels = ExpertKernels::for_tensors(experts)?;
        let ids = batch.routed_experts();
        let views = ids
            .iter()
            .map(|&e| {
                experts.view(e).ok_or(ExpertDeviceError::BadExpertId {
                    expert: e,
                    n_expert: experts.n_expert,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut guard = self.lock();
        let Staging {
            staged, io, stats, ..
        } = &mut *guard;
        // Free the previous staging area before filling it again.
        *staged = None;
        let slots: Vec<OnceLock<DeviceExpert>> =
            (0..experts.n_expert).map(|_| OnceLock::new()).collect();
        let copied = Mutex::new(0usize);
        let arrived = Condvar::new();
        let result = std::thread::scope(|scope| {
            scope.spawn(|| {
                for (&e, v) in ids.iter().zip(&views) {
                    // Each id is set once (ids are distinct).
                    let _ = slots[e].set(DeviceExpert::copy_of(v));
                    *copied.lock().unwrap_or_else(PoisonError::into_inner) += 1;
                    arrived.notify_all();
                }
            });
            // Waits for expert `e`'s copy; `None` for an expert that is not being copied.
            let wait = |e: usize| -> Option<ExpertView<'_>> {
                if ids.binary_search(&e).is_err() {
                    return None;
                }
                let mut n = copied.lock().unwrap_or_else(PoisonError::into_inner);
                while slots[e].get().is_none() {
                    n = arrived.wait(n).unwrap_or_else(PoisonError::into_inner);
                }
                slots[e].get().map(DeviceExpert::view)
            };
            io.round_trip(
                layer,
                &kernels,
                (d, ff, experts.n_expert),
                batch,
                wait,
                stats,
                out,
            )
        });
        stats.uploads += 1;
        stats.upload_bytes += ids.len() as u64 * experts.expert_bytes();
        let experts = slots.into_iter().map(OnceLock::into_inner).collect();
        *staged = Some((
            layer,
            DeviceLayer {
                kernels,
                d,
                ff,
                experts,
            },
        ));
        result
    }

    fn stats(&self) -> TransferStats {
        self.lock().stats
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // slices of token ranges, one sequence each
mod tests {
    use super::*;

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

    #[test]
    fn staging_device_matches_host_and_counts() {
        let (data, bias) = q8_layer();
        let t = tensors(&data, &bias);
        let h: Vec<f32> = (0..3 * 32).map(|i| (i as f32 * 0.37).sin()).collect();
        let selected = [1, 0, 0, 1, 1, 0];
        let weights = [0.75, 0.25, 0.5, 0.5, 0.9, 0.1];
        let groups = [0..3];
        let batch = ExpertBatch {
            h: &h,
            selected: &selected,
            weights: &weights,
            n_used: 2,
            groups: &groups,
        };
        let k = ExpertKernels::for_tensors(&t).unwrap();
        let mut host = vec![0f32; 3 * 32];
        host_experts(0, &k, &t, &batch, &mut ExpertScratch::default(), &mut host).unwrap();
        let dev = StagingDevice::new("test");
        let mut got = vec![f32::NAN; 3 * 32];
        assert_eq!(
            dev.run(5, &batch, &mut got),
            Err(ExpertDeviceError::NotUploaded { layer: 5 })
        );
        dev.upload_layer(5, &t).unwrap();
        dev.run(5, &batch, &mut got).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            host.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let s = dev.stats();
        assert_eq!((s.uploads, s.upload_bytes), (1, t.layer_bytes()));
        assert_eq!((s.to_device, s.to_device_bytes), (1, 4 * (96 + 6 + 6)));
        assert_eq!((s.to_host, s.to_host_bytes), (1, 4 * 96));
        assert_eq!(dev.bytes_held(), t.layer_bytes());
    }

    #[test]
    fn pipelined_offload_matches_host_and_copies_only_routed_experts() {
        let (data, bias) = q8_layer();
        let t = tensors(&data, &bias);
        let h: Vec<f32> = (0..2 * 32).map(|i| (i as f32 * 0.21).cos()).collect();
        let groups = [0..2];
        let batch = ExpertBatch {
            h: &h,
            selected: &[1, 1],
            weights: &[1.0, 1.0],
            n_used: 1,
            groups: &groups,
        };
        let k = ExpertKernels::for_tensors(&t).unwrap();
        let mut host = vec![0f32; 64];
        host_experts(0, &k, &t, &batch, &mut ExpertScratch::default(), &mut host).unwrap();
        let dev = StagingDevice::new("test");
        let mut got = vec![0f32; 64];
        dev.run_offloaded(3, &t, &batch, &mut got).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            host.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let s = dev.stats();
        assert_eq!((s.uploads, s.upload_bytes), (1, t.expert_bytes()));
        assert_eq!((s.to_device, s.to_host), (1, 1));
        assert_eq!(dev.bytes_held(), t.expert_bytes());
        // The staged expert stays usable until the next offload replaces it.
        let mut again = vec![0f32; 64];
        dev.run(3, &batch, &mut again).unwrap();
        assert_eq!(again, got);
    }

    /// Random experts of `ty` (MXFP4 or Q8_0): `n_expert` experts of `d → ff → d`.
    fn random_layer(ty: GgmlType, d: usize, ff: usize, n_expert: usize) -> Vec<Vec<u8>> {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ ty.id() as u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        [(d, ff), (d, ff), (ff, d)]
            .iter()
            .map(|&(n_in, n_out)| {
                let rows = n_expert * n_out;
                let row = ty.row_bytes(n_in as u64).unwrap() as usize;
                let mut data = vec![0u8; rows * row];
                for r in data.chunks_exact_mut(row) {
                    if ty == GgmlType::MXFP4 {
                        for b in r.chunks_exact_mut(17) {
                            b[0] = 120 + (next() % 12) as u8;
                            b[1..].iter_mut().for_each(|q| *q = next() as u8);
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
            let mats = random_layer(ty, d, ff, n_expert);
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
            host_experts(0, &k, &t, &one, &mut ExpertScratch::default(), &mut got).unwrap();
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
            host_experts(0, &k, &t, &two, &mut ExpertScratch::default(), &mut want).unwrap();
            assert!(got.iter().all(|v| v.is_finite() && *v != 0.0), "{ty}");
            for (i, (a, b)) in got.iter().zip(&want[..d]).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{ty} output {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn staged_experts_cover_only_their_ids() {
        let (data, bias) = q8_layer();
        let t = tensors(&data, &bias);
        let dev = StagingDevice::new("test");
        dev.upload_experts(2, &t, &[1]).unwrap();
        assert_eq!(dev.stats().upload_bytes, t.expert_bytes());
        let h = vec![0.5f32; 32];
        let mut out = vec![0f32; 32];
        let groups = [0..1];
        let mk = |sel: &'static [u32]| ExpertBatch {
            h: &h,
            selected: sel,
            weights: &[1.0],
            n_used: 1,
            groups: &groups,
        };
        dev.run(2, &mk(&[1]), &mut out).unwrap();
        assert_eq!(
            dev.run(2, &mk(&[0]), &mut out),
            Err(ExpertDeviceError::MissingExpert {
                layer: 2,
                expert: 0
            })
        );
        assert_eq!(
            dev.run(3, &mk(&[1]), &mut out),
            Err(ExpertDeviceError::NotUploaded { layer: 3 })
        );
        assert!(matches!(
            dev.run(2, &mk(&[7]), &mut out),
            Err(ExpertDeviceError::BadExpertId { expert: 7, .. })
        ));
        assert!(dev.upload_experts(2, &t, &[1, 1]).is_err());
        assert!(dev.upload_experts(2, &t, &[5]).is_err());
    }

    #[test]
    fn bad_batches_and_tensors_are_errors() {
        let (data, bias) = q8_layer();
        let t = tensors(&data, &bias);
        let dev = StagingDevice::new("test");
        dev.upload_layer(0, &t).unwrap();
        let h = vec![0.5f32; 64];
        let mut out = vec![0f32; 64];
        let ok_groups = [0..2];
        let bad_groups = [0..1];
        for (sel, w, groups, out_len) in [
            (&[0u32, 1][..], &[1.0f32][..], &ok_groups, 64),
            (&[0, 1], &[1.0, 1.0], &bad_groups, 64),
            (&[0, 1], &[1.0, 1.0], &ok_groups, 63),
        ] {
            let batch = ExpertBatch {
                h: &h,
                selected: sel,
                weights: w,
                n_used: 1,
                groups,
            };
            assert!(matches!(
                dev.run(0, &batch, &mut out[..out_len]),
                Err(ExpertDeviceError::Shape { .. })
            ));
        }
        let short = tensors(&data[1..], &bias);
        assert!(matches!(
            dev.upload_layer(1, &short),
            Err(ExpertDeviceError::Shape { .. })
        ));
    }

    #[test]
    fn placement_from_tensor_table() {
        let names = |l: usize| {
            ["gate", "up", "down"].into_iter().flat_map(move |m| {
                ["weight", "bias"]
                    .into_iter()
                    .map(move |s| format!("blk.{l}.ffn_{m}_exps.{s}"))
            })
        };
        let mut table: Vec<(String, bool)> = vec![("blk.0.attn_q.weight".into(), true)];
        table.extend(names(0).map(|n| (n, false)));
        table.extend(names(1).map(|n| (n, true)));
        let p =
            ExpertPlacement::from_tensor_devices(2, table.iter().map(|(n, d)| (n.as_str(), *d)))
                .unwrap();
        assert_eq!(p.layers, vec![ExpertHome::Host, ExpertHome::Device]);
        assert_eq!(p.device_layers(), 1);
        assert_eq!(p.op_offload_min_batch, Some(OP_OFFLOAD_MIN_BATCH));
        table[1].1 = true;
        assert!(ExpertPlacement::from_tensor_devices(
            2,
            table.iter().map(|(n, d)| (n.as_str(), *d))
        )
        .is_err());
        assert!(
            ExpertPlacement::from_tensor_devices(1, [("blk.3.ffn_up_exps.weight", true)]).is_err()
        );
    }
}
