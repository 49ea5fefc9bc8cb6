//! The planner: tensor → device under llama.cpp's flag semantics, the memory estimate per
//! device, and the `--fit` search.
//!
//! The memory model is described in the crate documentation.

use std::collections::HashMap;

use hmoe_backend::attention_scratch::{attention_scratch_bound, ScratchShape};

use crate::device::{DeviceBudget, DeviceId};
use crate::error::PlacementError;
use crate::flags::{
    parse_cache_type, GpuLayers, PlacementFlags, RunTokens, TensorRule, OP_OFFLOAD_MIN_BATCH,
};
use crate::ring::ring_bytes;
use crate::shape::ModelShape;
use crate::tensor::{layer_group, tensor_kind, LayerGroup, TensorDesc, TensorKind};
use crate::tensor_rules::compile_rules;

/// Memory use the plan projects on one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceUsage {
    /// The device.
    pub device: DeviceId,
    /// Bytes of weights.
    pub weights: u64,
    /// Bytes of KV cache.
    pub kv: u64,
    /// Bytes of compute buffers (activations, staging).
    pub compute: u64,
    /// Runtime overhead allowance.
    pub overhead: u64,
    /// Free bytes on the device, when known (always known for GPUs).
    pub free: Option<u64>,
    /// Bytes `--fit` keeps free (0 on the CPU).
    pub margin: u64,
    /// Repeating layers whose attention and KV live here (`-ngl`).
    pub layers: u32,
    /// MoE layers whose routed experts live here (a layer split by `-ot` counts on the device
    /// holding most of its expert bytes).
    pub expert_layers: u32,
    /// Bytes of the op-offload ring, part of `compute`: the device buffers the routed experts
    /// of CPU layers stream through for large micro-batches ([`ring_bytes`]); 0 without op
    /// offload.
    pub ring: u64,
    /// Bytes of the device expert cache (`--moe-cache MiB`), part of `compute`.
    pub moe_cache: u64,
}

impl DeviceUsage {
    /// Projected bytes: weights + kv + compute + overhead.
    pub fn total(&self) -> u64 {
        self.weights + self.kv + self.compute + self.overhead
    }

    /// `free − total` in bytes (negative when over), when free is known.
    pub fn headroom(&self) -> Option<i128> {
        self.free.map(|f| f as i128 - self.total() as i128)
    }

    /// Whether the device keeps its margin (always true when free is unknown).
    pub fn fits(&self) -> bool {
        self.headroom().is_none_or(|h| h >= self.margin as i128)
    }

    /// Bytes the plan leaves free on the device beyond `--fit`'s margin (`free − total −
    /// margin`, at least 0; 0 when free is unknown): the default budget of the device expert
    /// cache (`--moe-cache`), which may fill that room without eating into the margin.
    pub fn room_beyond_margin(&self) -> u64 {
        self.headroom()
            .map_or(0, |h| u64::try_from(h - self.margin as i128).unwrap_or(0))
    }
}

/// The result of planning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Effective context (padded to 256).
    pub n_ctx: u32,
    /// Effective logical batch (`min(-b, n_ctx)`).
    pub n_batch: u32,
    /// Effective ubatch (`min(-ub, n_batch)`).
    pub n_ubatch: u32,
    /// Repeating layers of the model.
    pub n_layer: u32,
    /// Effective `-ngl` (0..=n_layer+1; n_layer+1 = all).
    pub n_gpu_layers: u32,
    /// KV cells of a full-attention layer.
    pub kv_cells_full: u32,
    /// KV cells of a sliding-window layer (0 when the model has none).
    pub kv_cells_swa: u32,
    /// Device of each input tensor, in input order.
    pub tensor_devices: Vec<DeviceId>,
    /// Usage per device: the CPU first, then each GPU.
    pub devices: Vec<DeviceUsage>,
    /// Layers whose experts `--fit` moved to the CPU, ascending.
    pub fit_cpu_expert_layers: Vec<u32>,
    /// What `--fit` did, one line per step.
    pub notes: Vec<String>,
    /// Experts per slice of the op-offload ring (0 when no GPU runs offloaded experts): the
    /// ring holds [`crate::RING_SLOTS`] slices ([`DeviceUsage::ring`] bytes).
    pub ring_slice_experts: u64,
    /// The flags that reproduce this plan: the user's rules first, then fit's, with `-c` and
    /// `-ngl` resolved.
    pub flags: PlacementFlags,
}

impl Plan {
    /// Usage of `device`.
    pub fn device(&self, device: DeviceId) -> Option<&DeviceUsage> {
        self.devices.iter().find(|d| d.device == device)
    }

    /// Whether every GPU keeps its margin.
    pub fn fits(&self) -> bool {
        self.devices.iter().all(DeviceUsage::fits)
    }

    /// The chosen flags as a command line (`-c … -ngl … [rules] [non-default settings]`).
    pub fn command_line(&self) -> String {
        let f = &self.flags;
        let d = PlacementFlags::default();
        let mut parts = vec![format!("-c {}", self.n_ctx)];
        parts.push(match f.n_gpu_layers {
            GpuLayers::Count(n) => format!("-ngl {n}"),
            GpuLayers::All | GpuLayers::Auto => "-ngl all".to_string(),
        });
        parts.extend(f.rules.iter().map(TensorRule::to_args));
        if f.cache_type_k != d.cache_type_k {
            parts.push(format!("-ctk {}", f.cache_type_k.name().to_lowercase()));
        }
        if f.cache_type_v != d.cache_type_v {
            parts.push(format!("-ctv {}", f.cache_type_v.name().to_lowercase()));
        }
        if f.batch_size != d.batch_size {
            parts.push(format!("-b {}", f.batch_size));
        }
        if f.ubatch_size != d.ubatch_size {
            parts.push(format!("-ub {}", f.ubatch_size));
        }
        if f.n_parallel != d.n_parallel {
            parts.push(format!("-np {}", f.n_parallel));
        }
        if !f.op_offload {
            parts.push("--no-op-offload".to_string());
        }
        if f.moe_cache > 0 {
            parts.push(format!("--moe-cache {}", f.moe_cache >> 20));
        }
        parts.join(" ")
    }
}

/// Plans `tensors` of a model of shape `shape` over `budget` under the user's `flags`.
///
/// Semantics (llama.cpp's): `-ngl N` puts the last N layers on the GPUs, the output head
/// counting as one and the token embedding staying on the CPU; layers are split over several
/// GPUs in proportion to their free memory. Rules (`-ot`, `--cpu-moe`, `--n-cpu-moe`) are tried
/// in command-line order and the first match decides. With `--fit on`, when a GPU would keep
/// less than its margin, what is elastic shrinks first: the op-offload ring (down to one expert
/// per slice), then the expert cache of `--moe-cache MiB` (down to nothing); then the context
/// is reduced (never below `--fit-ctx`, never when `-c` was given), then the experts of the
/// last layers are moved to the CPU one layer at a time, then (only for `-ngl auto`) whole
/// layers from the front; user rules stay in force throughout, and after each step the ring
/// and the cache grow back into what the step left free.
/// If nothing fits, [`PlacementError::DoesNotFit`] says what is missing where. With `--fit off`
/// the plan is returned as asked, fitting or not (see [`Plan::fits`]).
pub fn plan(
    tensors: &[TensorDesc],
    shape: &ModelShape,
    budget: &DeviceBudget,
    flags: &PlacementFlags,
) -> Result<Plan, PlacementError> {
    plan_run(tensors, shape, budget, flags, None)
}

/// [`plan()`] for one generation run whose token counts are known (`hmoe run`): the CPU's KV
/// cache and compute buffers are then what that run touches, not what is allocated (see
/// [`RunTokens`] and the crate docs). `run = None` is [`plan()`].
pub fn plan_run(
    tensors: &[TensorDesc],
    shape: &ModelShape,
    budget: &DeviceBudget,
    flags: &PlacementFlags,
    run: Option<RunTokens>,
) -> Result<Plan, PlacementError> {
    let mut planner = Planner::new(tensors, shape, budget, flags)?;
    planner.run = run;
    planner.search()
}

/// Placement state the fit search varies.
#[derive(Clone, Debug)]
struct State {
    /// Requested context before padding.
    n_ctx: u32,
    /// Effective `-ngl`.
    ngl: u32,
    /// Per layer: experts moved to the CPU by fit.
    fit_cpu: Vec<bool>,
    /// Experts per slice of the op-offload ring.
    slice: u64,
    /// Bytes of the expert cache (`--moe-cache MiB`).
    moe_cache: u64,
}

struct Planner<'a> {
    tensors: &'a [TensorDesc],
    shape: &'a ModelShape,
    budget: &'a DeviceBudget,
    flags: &'a PlacementFlags,
    groups: Vec<LayerGroup>,
    kinds: Vec<TensorKind>,
    /// Device chosen by the first matching user rule.
    pinned: Vec<Option<DeviceId>>,
    /// Cumulative share of layers per GPU.
    splits: Vec<f64>,
    /// Bytes of `token_embd.weight` when there is no `output.weight` (tied head).
    tied_output: Option<u64>,
    /// The run's token counts, when known.
    run: Option<RunTokens>,
}

fn pad256(n: u64) -> u64 {
    n.div_ceil(256) * 256
}

/// Memory page size: a lazily touched buffer is resident in whole pages.
const PAGE: u64 = 4096;

/// `n` bytes rounded up to whole pages.
fn pages(n: u64) -> u64 {
    n.div_ceil(PAGE) * PAGE
}

/// The CPU device's flash-attention kernel: query rows per task tile, positions per block, and
/// positions per chunk of its split over float values.
const FLASH_Q_TILE: u64 = 16;
const FLASH_POS_BLOCK: u64 = 32;
const FLASH_CHUNK: u64 = hmoe_backend::numerics::FLASH_CHUNK as u64;

/// What the CPU device's flash attention (`-fa on`/`auto`) keeps between calls, in buffers
/// that grow to the largest call and stay: the states its tasks hand back, `4·(Dv + 2)` bytes
/// per query row, head and chunk, for a micro-batch of `tokens` and for a decode step that
/// reads `depth` positions (in chunks of [`FLASH_CHUNK`]; DeepSeek's latent ring in one);
/// and a worker's scratch for one task (counted once; every further thread keeps its own): per
/// row of up to [`FLASH_Q_TILE`] queries of every head its span, state and block of scores,
/// the query converted for K (f32/f16 keys: f32 and transposed; block keys: their activation
/// row), and per KV head the block's key offsets and converted keys and values where the
/// kernel does not read them in place (bf16 and quantized values: a block of positions'
/// worth, converted to f32). DeepSeek's latent attention over a float cache runs the
/// row kernel, which keeps only a score row.
fn flash_kept(s: &ModelShape, f: &PlacementFlags, tokens: u64, depth: u64) -> u64 {
    use hmoe_quant::GgmlType::{BF16, F16, F32};
    let float = |ty| matches!(ty, F32 | F16 | BF16);
    let v_type = if s.mla {
        f.cache_type_k
    } else {
        f.cache_type_v
    };
    if s.mla && float(v_type) {
        return 0;
    }
    let (h, hkv, dk, dv) = (s.n_head, s.n_head_kv.max(1), s.head_dim_k, s.head_dim_v);
    // Every K/V cache's values go in chunks but DeepSeek's latent (K-only) ring.
    let chunked = !s.mla;
    let k_in_place = matches!(f.cache_type_k, F32 | F16);
    let chain = chunked && k_in_place;
    let tile_rows = if tokens > FLASH_Q_TILE {
        tokens.div_ceil(FLASH_Q_TILE) * FLASH_Q_TILE
    } else {
        tokens
    };
    let decode_chunks = if chunked {
        depth.saturating_sub(1) / FLASH_CHUNK + 1
    } else {
        1
    };
    let states = 4 * (dv + 2) * h * tile_rows.max(decode_chunks);
    let q = if k_in_place {
        4 * dk * if chain { 2 } else { 1 }
    } else {
        hmoe_quant::vec_dot_type(f.cache_type_k)
            .row_bytes(dk)
            .unwrap_or(0)
    };
    let per_row = 32 + 8 + 4 * dv + 4 * FLASH_POS_BLOCK + q;
    let k_block = if k_in_place && !chain { 4 * dk } else { 0 };
    let v_block = if chain { 0 } else { 4 * dv };
    let per_kv = FLASH_POS_BLOCK * (8 + k_block + v_block);
    let converted_values = if chain && !matches!(v_type, F32 | F16) {
        FLASH_POS_BLOCK * 4 * dv
    } else {
        0
    };
    let scratch = h * tokens.min(FLASH_Q_TILE) * per_row + hkv * per_kv + converted_values;
    states + scratch
}

/// Bytes of the f32 copy the engine makes at load of a norm, bias or sink (1-D tensors and
/// `*.bias`); 0 for the matrices, which stay in the file mapping.
fn host_copy_bytes(t: &TensorDesc) -> u64 {
    if t.dims.len() == 1 || t.name.ends_with(".bias") {
        4 * t.dims.iter().product::<u64>()
    } else {
        0
    }
}

#[derive(Default, Clone)]
struct Activity {
    attn: bool,
    router: bool,
    experts: bool,
    ffn_width: u64,
    output: bool,
    /// Whether it attends over a full-context cache and over a sliding-window one.
    attn_full: bool,
    attn_swa: bool,
    /// The two largest CPU weights offloaded to this device, routed experts aside.
    staging: [u64; 2],
    /// Offloaded expert bytes per layer: the routed experts of CPU layers this device runs
    /// for large micro-batches, which stream through its op-offload ring.
    expert_staging: HashMap<u32, u64>,
}

impl Activity {
    /// Records that this device runs the phase a tensor of `kind` belongs to.
    fn mark(&mut self, kind: TensorKind, s: &ModelShape) {
        match kind {
            TensorKind::Attention => self.attn = true,
            TensorKind::Router => self.router = true,
            TensorKind::Experts => self.experts = true,
            TensorKind::SharedExperts => self.ffn_width = self.ffn_width.max(s.n_ff_shexp),
            TensorKind::DenseFfn => self.ffn_width = self.ffn_width.max(s.n_ff),
            TensorKind::OutputHead => self.output = true,
            TensorKind::Embedding | TensorKind::Other => {}
        }
    }

    fn stage(&mut self, bytes: u64) {
        if bytes > self.staging[0] {
            self.staging = [bytes, self.staging[0]];
        } else if bytes > self.staging[1] {
            self.staging[1] = bytes;
        }
    }

    /// Bytes of the op-offload ring of `slice` experts per slice over layers of `n_expert`
    /// experts: sized for the largest offloaded layer's experts; 0 when none is offloaded.
    fn ring_bytes(&self, slice: u64, n_expert: u64) -> u64 {
        let layer = self.expert_staging.values().copied().max().unwrap_or(0);
        match n_expert {
            0 => 0,
            n => ring_bytes(slice, n, layer.div_ceil(n)),
        }
    }
}

impl<'a> Planner<'a> {
    fn new(
        tensors: &'a [TensorDesc],
        shape: &'a ModelShape,
        budget: &'a DeviceBudget,
        flags: &'a PlacementFlags,
    ) -> Result<Planner<'a>, PlacementError> {
        shape.validate()?;
        let invalid = |m: &str| Err(PlacementError::Invalid(m.to_string()));
        if flags.batch_size == 0 || flags.ubatch_size == 0 {
            return invalid("-b and -ub must be at least 1");
        }
        if flags.n_parallel == 0 {
            return invalid("-np must be at least 1");
        }
        if flags.fit_ctx == 0 {
            return invalid("--fit-ctx must be at least 1");
        }
        for ty in [flags.cache_type_k, flags.cache_type_v] {
            parse_cache_type(ty.name())?;
        }
        for (ty, n) in [
            (flags.cache_type_k, shape.n_embd_k_gqa()),
            (flags.cache_type_v, shape.n_embd_v_gqa()),
        ] {
            if ty.row_bytes(n).is_none() {
                return Err(PlacementError::Invalid(format!(
                    "KV cache type {} needs rows that are a multiple of {} elements, but a \
                     cached row has {n}",
                    ty.name().to_lowercase(),
                    ty.block_elems()
                )));
            }
        }
        let n_gpus = budget.gpus.len();
        let rules = compile_rules(&flags.rules, n_gpus)?;
        let groups: Vec<LayerGroup> = tensors.iter().map(|t| layer_group(&t.name)).collect();
        for (t, g) in tensors.iter().zip(&groups) {
            if let LayerGroup::Block(il) = g {
                if *il >= shape.n_layer {
                    return Err(PlacementError::Shape(format!(
                        "tensor {} names layer {il} but the model has {} layers",
                        t.name, shape.n_layer
                    )));
                }
            }
        }
        let kinds = tensors.iter().map(|t| tensor_kind(&t.name)).collect();
        let pinned = tensors
            .iter()
            .map(|t| {
                rules
                    .iter()
                    .find(|(re, _)| re.is_match(&t.name))
                    .map(|(_, d)| *d)
            })
            .collect();
        let total_free: f64 = budget.gpus.iter().map(|g| g.free as f64).sum();
        let mut acc = 0.0;
        let splits = budget
            .gpus
            .iter()
            .map(|g| {
                acc += if total_free > 0.0 {
                    g.free as f64 / total_free
                } else {
                    1.0 / n_gpus as f64
                };
                acc
            })
            .collect();
        let has_output = tensors.iter().any(|t| t.name == "output.weight");
        let tied_output = if has_output {
            None
        } else {
            tensors
                .iter()
                .find(|t| t.name == "token_embd.weight")
                .map(|t| t.n_bytes)
        };
        Ok(Planner {
            tensors,
            shape,
            budget,
            flags,
            groups,
            kinds,
            pinned,
            splits,
            tied_output,
            run: None,
        })
    }

    fn n_gpus(&self) -> usize {
        self.budget.gpus.len()
    }

    /// Device of layer `il` (`n_layer` = the output layer) under `-ngl ngl`.
    fn layer_device(&self, il: u32, ngl: u32) -> DeviceId {
        let n_layer = self.shape.n_layer;
        if self.n_gpus() == 0 {
            return DeviceId::Cpu;
        }
        let start = (n_layer + 1).saturating_sub(ngl);
        if il < start {
            return DeviceId::Cpu;
        }
        let act = ngl.min(n_layer + 1) as f64;
        let x = (il - start) as f64 / act;
        let i = self
            .splits
            .iter()
            .position(|&s| s > x)
            .unwrap_or(self.n_gpus() - 1);
        DeviceId::Gpu(i.min(self.n_gpus() - 1))
    }

    fn group_device(&self, g: LayerGroup, ngl: u32) -> DeviceId {
        match g {
            LayerGroup::Input => DeviceId::Cpu,
            LayerGroup::Block(il) => self.layer_device(il, ngl),
            LayerGroup::Output => self.layer_device(self.shape.n_layer, ngl),
        }
    }

    fn assign(&self, st: &State) -> Vec<DeviceId> {
        (0..self.tensors.len())
            .map(|i| {
                if let Some(d) = self.pinned[i] {
                    return d;
                }
                if self.kinds[i] == TensorKind::Experts {
                    if let LayerGroup::Block(il) = self.groups[i] {
                        if st.fit_cpu[il as usize] {
                            return DeviceId::Cpu;
                        }
                    }
                }
                self.group_device(self.groups[i], st.ngl)
            })
            .collect()
    }

    fn dev_index(&self, d: DeviceId) -> usize {
        match d {
            DeviceId::Cpu => 0,
            DeviceId::Gpu(i) => i + 1,
        }
    }

    /// (n_ctx, n_batch, n_ubatch, full cells, swa cells) for a requested context.
    fn sizes(&self, n_ctx_req: u32) -> (u64, u64, u64, u64, u64) {
        let n_ctx = pad256(n_ctx_req.max(1) as u64);
        let n_batch = n_ctx.min(self.flags.batch_size as u64);
        let n_ubatch = n_batch.min(self.flags.ubatch_size as u64);
        let swa = if self.shape.sliding_window > 0 && self.shape.swa_layers.iter().any(|&b| b) {
            let want = self.shape.sliding_window as u64 * self.flags.n_parallel as u64 + n_ubatch;
            pad256(n_ctx.min(want))
        } else {
            0
        };
        (n_ctx, n_batch, n_ubatch, n_ctx, swa)
    }

    /// Memory each device needs with the tensors placed as `assign` says: the budget's fixed
    /// overhead, then weights, KV cache and compute buffers, added step by step.
    fn usage(&self, st: &State, assign: &[DeviceId]) -> Vec<DeviceUsage> {
        let (n_ctx, _, t, cells_full, cells_swa) = self.sizes(st.n_ctx);
        let mut u = self.empty_usage();
        let mut act = vec![Activity::default(); self.n_gpus() + 1];
        self.add_weights(st, assign, t, &mut u, &mut act);
        self.add_kv(st, t, (cells_full, cells_swa), &mut u, &mut act);
        for (d, a) in act.iter().enumerate() {
            u[d].compute = if d == 0 {
                self.cpu_compute(a, assign, t, n_ctx)
            } else {
                u[d].ring = a.ring_bytes(st.slice, self.shape.n_expert);
                self.gpu_compute(a, t, (cells_full, cells_swa)) + u[d].ring
            };
        }
        // The expert cache lives on the first GPU and caches the CPU layers' experts.
        if u[0].expert_layers > 0 && u.len() > 1 {
            u[1].moe_cache = st.moe_cache;
            u[1].compute += st.moe_cache;
        }
        u
    }

    /// One usage row per device, the CPU first: its free memory, the budget's fixed overhead
    /// and fit margin, nothing placed yet.
    fn empty_usage(&self) -> Vec<DeviceUsage> {
        self.budget
            .ids()
            .iter()
            .map(|&device| {
                let (free, overhead, margin) = match device {
                    DeviceId::Cpu => (self.budget.host_free, 0, 0),
                    DeviceId::Gpu(i) => (
                        Some(self.budget.gpus[i].free),
                        self.budget.gpus[i].overhead,
                        self.flags.fit_target_bytes(i),
                    ),
                };
                DeviceUsage {
                    device,
                    weights: 0,
                    kv: 0,
                    compute: 0,
                    overhead,
                    free,
                    margin,
                    layers: 0,
                    expert_layers: 0,
                    ring: 0,
                    moe_cache: 0,
                }
            })
            .collect()
    }

    /// Weights per device, and which phases each device runs: every tensor's bytes on its
    /// device (with the GPU that runs it when a CPU matrix is op-offloaded for `t`-token
    /// micro-batches), the host's f32 copies, a tied output head, and the device that holds
    /// most of each layer's experts.
    fn add_weights(
        &self,
        st: &State,
        assign: &[DeviceId],
        t: u64,
        u: &mut [DeviceUsage],
        act: &mut [Activity],
    ) {
        let s = self.shape;
        let n_dev = self.n_gpus() + 1;
        let offload =
            self.flags.op_offload && t >= OP_OFFLOAD_MIN_BATCH as u64 && self.n_gpus() > 0;
        let mut expert_bytes = vec![vec![0u64; n_dev]; s.n_layer as usize];
        for (i, tensor) in self.tensors.iter().enumerate() {
            let d = self.dev_index(assign[i]);
            u[d].weights += tensor.n_bytes;
            act[d].mark(self.kinds[i], s);
            if let (TensorKind::Experts, LayerGroup::Block(il)) = (self.kinds[i], self.groups[i]) {
                if tensor.name.ends_with(".weight") {
                    expert_bytes[il as usize][d] += tensor.n_bytes;
                }
            }
            let is_matrix = tensor.dims.len() >= 2;
            let offloadable = !matches!(self.kinds[i], TensorKind::Embedding | TensorKind::Other);
            if offload && assign[i] == DeviceId::Cpu && is_matrix && offloadable {
                self.stage_offloaded(i, st.ngl, act);
            }
        }
        // The engine keeps an f32 copy of every norm, bias and sink in host memory, made at
        // load whatever device the tensor is placed on.
        u[0].weights += self.tensors.iter().map(host_copy_bytes).sum::<u64>();
        let out_dev = self.dev_index(self.layer_device(s.n_layer, st.ngl));
        if let Some(b) = self.tied_output {
            if out_dev != 0 {
                u[out_dev].weights += b;
            }
            act[out_dev].output = true;
        }
        for per_dev in &expert_bytes {
            let (best, &bytes) = per_dev
                .iter()
                .enumerate()
                .max_by_key(|&(i, b)| (*b, std::cmp::Reverse(i)))
                .expect("at least the CPU");
            if bytes > 0 {
                u[best].expert_layers += 1;
            }
        }
    }

    /// Op offload of the CPU matrix `i`: the GPU its layer would run on stages the weight and
    /// runs its phase.
    fn stage_offloaded(&self, i: usize, ngl: u32, act: &mut [Activity]) {
        let tensor = &self.tensors[i];
        let target = match self.group_device(self.groups[i], ngl) {
            DeviceId::Gpu(g) => g,
            DeviceId::Cpu => 0,
        };
        let a = &mut act[target + 1];
        match (self.kinds[i], self.groups[i]) {
            (TensorKind::Experts, LayerGroup::Block(il)) => {
                *a.expert_staging.entry(il).or_default() += tensor.n_bytes;
            }
            _ => a.stage(tensor.n_bytes),
        }
        a.mark(self.kinds[i], self.shape);
    }

    /// KV cache per device: each layer's cells (full or sliding-window) on the device that
    /// runs the layer, which also runs its attention.
    fn add_kv(
        &self,
        st: &State,
        t: u64,
        (cells_full, cells_swa): (u64, u64),
        u: &mut [DeviceUsage],
        act: &mut [Activity],
    ) {
        let s = self.shape;
        let f = self.flags;
        let row = |ty: hmoe_quant::GgmlType, n: u64| ty.row_bytes(n).unwrap_or(0);
        let (row_k, row_v) = (
            row(f.cache_type_k, s.n_embd_k_gqa()),
            row(f.cache_type_v, s.n_embd_v_gqa()),
        );
        for il in 0..s.n_layer {
            let d = self.dev_index(self.layer_device(il, st.ngl));
            u[d].layers += 1;
            let swa = s.is_swa(il);
            let cells = if swa { cells_swa } else { cells_full };
            u[d].kv += match self.run {
                // The CPU cache is allocated untouched: a run holds the pages of the cells it
                // writes. A sliding layer's ring has window + ubatch cells (no padding).
                Some(r) if d == 0 => {
                    let ring = if swa {
                        cells.min(s.sliding_window as u64 * f.n_parallel as u64 + t)
                    } else {
                        cells
                    };
                    let n = (r.total as u64).min(ring);
                    pages(n * row_k) + pages(n * row_v)
                }
                _ => (row_k + row_v) * cells,
            };
            act[d].attn = true;
            if swa {
                act[d].attn_swa = true;
            } else {
                act[d].attn_full = true;
            }
        }
    }

    /// A GPU's compute buffers for `t`-token micro-batches: the largest phase it runs (the
    /// attention phase with the attention's own temporaries, [`attention_scratch_bound`]),
    /// and the op-offload staging of CPU matrices other than the routed experts (those stream
    /// through the ring, counted apart).
    fn gpu_compute(&self, a: &Activity, t: u64, (cells_full, cells_swa): (u64, u64)) -> u64 {
        let s = self.shape;
        let e = s.n_embd;
        let phase_attn = t
            * 4
            * (3 * e
                + s.n_head * s.head_dim_q
                + s.n_head_kv * (s.head_dim_k + s.head_dim_v)
                + s.n_head * s.head_dim_v);
        let phase_router = t * 4 * (2 * e + 2 * s.n_expert + 2 * s.n_expert_used);
        // Offloaded experts run slice by slice on every routed (token, slot) pair apart: the
        // pairs' inputs, one slice's weighted outputs and every pair's, one more `k·E`.
        let pair_rows = if a.expert_staging.is_empty() { 2 } else { 3 };
        let phase_experts =
            t * 4 * (2 * e + 3 * s.n_expert_used * s.n_ff_exp + pair_rows * s.n_expert_used * e);
        let phase_ffn = |w: u64| t * 4 * (2 * e + 3 * w);
        let phase_output = t * 4 * (e + s.n_vocab);
        let scratch = |cells: u64, window: Option<usize>| {
            let shape = ScratchShape {
                n_head: s.n_head as usize,
                head_dim_v: s.head_dim_v as usize,
                cells: cells as usize,
                window,
                k_only: s.mla,
            };
            attention_scratch_bound(&shape, t as usize) as u64
        };
        let mut attn_scratch = 0;
        if a.attn_full {
            attn_scratch = scratch(cells_full, None);
        }
        if a.attn_swa {
            let window = Some(s.sliding_window as usize);
            attn_scratch = attn_scratch.max(scratch(cells_swa, window));
        }
        let mut peak = 0;
        if a.attn {
            peak = peak.max(phase_attn + attn_scratch);
        }
        if a.router {
            peak = peak.max(phase_router);
        }
        if a.experts {
            peak = peak.max(phase_experts);
        }
        if a.ffn_width > 0 {
            peak = peak.max(phase_ffn(a.ffn_width));
        }
        if a.output {
            peak = peak.max(phase_output);
        }
        peak + a.staging[0] + a.staging[1]
    }

    /// The hmoe engine's CPU compute memory (see the crate docs): the largest set of buffers
    /// live at once in a forward pass of `t`-token micro-batches (fewer when the run's prompt
    /// is shorter), the logits the caller holds, and the sampler's scratch.
    fn cpu_compute(&self, a: &Activity, assign: &[DeviceId], t: u64, n_ctx: u64) -> u64 {
        let s = self.shape;
        let f = self.flags;
        let (e, v) = (s.n_embd, s.n_vocab);
        // Bytes of one activation row converted for the CPU matrices of these kinds.
        let act_row = |kinds: &[TensorKind]| {
            self.tensors
                .iter()
                .zip(&self.kinds)
                .zip(assign)
                .filter(|((tn, k), &dev)| {
                    dev == DeviceId::Cpu && tn.dims.len() >= 2 && kinds.contains(k)
                })
                .filter_map(|((tn, _), _)| hmoe_quant::vec_dot_type(tn.ty).row_bytes(tn.dims[0]))
                .max()
                .unwrap_or(0)
        };
        let act_main = act_row(&[
            TensorKind::Attention,
            TensorKind::Router,
            TensorKind::OutputHead,
            TensorKind::DenseFfn,
            TensorKind::SharedExperts,
        ]);
        let act_exp = act_row(&[TensorKind::Experts]);
        let (h, hkv) = (s.n_head, s.n_head_kv);
        let ff = s.n_ff_exp.max(s.n_ff).max(s.n_ff_shexp);
        let k_used = s.n_expert_used;
        // One forward pass of `n` tokens returning `rows` logits rows.
        let forward = |n: u64, rows: u64| {
            // Live through the whole micro-batch: residual and normed state, the RoPE
            // tables, the converted activations of the widest projection.
            let base = n * 4 * 2 * e + n * (s.head_dim_k / 2) * 8 + n * act_main;
            let mut phase = 0;
            if a.attn {
                let qkvo = n * 4 * (h * s.head_dim_q + hkv * (s.head_dim_k + s.head_dim_v))
                    + n * 4 * h * s.head_dim_v;
                // Then the projection and the matmul's transposed result (flash attention
                // works in buffers it keeps, [`flash_kept`]).
                phase = phase.max(qkvo + n * 4 * 2 * e);
            }
            if a.router || a.experts {
                // Router scores, choices and weights, the output, every slot's expert
                // output, the expert activations; then per expert (at most all `n`
                // tokens): routed activations, gate, up, converted hidden, down and the
                // matmul's transposed result.
                let per_batch = n * 4 * (s.n_expert + 2 * k_used + e + k_used * e) + n * act_exp;
                let per_expert = n * (act_exp + 4 * 2 * ff + act_exp + 4 * e + 4 * ff.max(e));
                phase = phase.max(per_batch + if a.experts { per_expert } else { 0 });
            }
            if a.ffn_width > 0 {
                phase = phase.max(n * 4 * (e + 3 * a.ffn_width));
            }
            if a.output {
                let transposed = if rows > 1 { rows * 4 * v } else { 0 };
                phase = phase.max(rows * 4 * (e + v) + transposed);
            }
            base + phase
        };
        // Logits held by the caller, candidates and sort scratch of the sampler.
        let sampling = 4 * v + 8 * v + 8 * v;
        // Attention's kept buffers, from the first attention on.
        let kept = |tokens: u64, depth: u64| {
            if a.attn {
                flash_kept(s, f, tokens, depth)
            } else {
                0
            }
        };
        match self.run {
            Some(r) => {
                let ub = t.min(r.prompt.max(1) as u64);
                let prompt = forward(ub, 1);
                let decode = forward(1, 1) + 4 * v;
                prompt.max(decode).max(sampling) + kept(ub, r.total as u64)
            }
            // Unknown run: full micro-batches, logits for every token (perplexity).
            None => forward(t, t).max(sampling) + kept(t, n_ctx),
        }
    }

    fn evaluate(&self, st: &State) -> (Vec<DeviceId>, Vec<DeviceUsage>) {
        let a = self.assign(st);
        let u = self.usage(st, &a);
        (a, u)
    }

    fn fits(&self, st: &State) -> bool {
        self.evaluate(st).1.iter().all(DeviceUsage::fits)
    }
}

#[path = "plan_fit.rs"]
mod fit;

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "plan_fit_tests.rs"]
mod fit_tests;
