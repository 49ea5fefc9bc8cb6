//! Placement planning for hmoe: which device holds each tensor, and how much memory each
//! device needs (weights, KV cache, compute buffers), with llama.cpp's flag semantics
//! (`-ngl`, `--cpu-moe`, `--n-cpu-moe`, `-ot`, `-c`, `-ctk/-ctv`, `-b/-ub`, `-np`, `--fit`).
//!
//! Everything here is a pure function of (tensor table, hyperparameters, device budgets,
//! flags): no file I/O, no GPU. [`plan()`] is the entry point and its docs give the placement
//! rules; `TensorDesc::from(&TensorInfo)` adapts a GGUF file's tensor table, and the model
//! crate reads its [`ModelShape`] (`hmoe_model::model_shape`, the hyperparameters as the
//! forward pass reads them); [`gpt_oss_tensor_table`] builds the real gpt-oss tables without
//! weights.
//!
//! # Memory model
//!
//! Per device, `total = weights + kv + compute + overhead`.
//!
//! * **weights**: the bytes of every tensor placed there (plus a copy of `token_embd` on the
//!   output device when the model ties its output head to the embedding and that device is a
//!   GPU). The CPU also holds the f32 copies the engine makes at load of every norm, bias and
//!   sink (1-D tensors and `*.bias`, `4 × elements` each), wherever those tensors are placed;
//!   the matrices stay in the file mapping and are resident once read.
//! * **kv**: per layer, on the device of the layer (`-ngl`), `cells × (row(type_k, n_head_kv ×
//!   head_dim_k) + row(type_v, n_head_kv × head_dim_v))`, rows sized with the ggml block size
//!   of the cache type (MLA models cache K only). `n_ctx` is padded up to a multiple of 256.
//!   Full-attention layers have `n_ctx` cells; sliding-window layers (gpt-oss's even layers)
//!   have `pad256(min(n_ctx, window × n_parallel + n_ubatch))` cells (llama.cpp's unified
//!   iSWA cache). Given the run's token counts ([`RunTokens`], [`plan_run`]), the CPU counts
//!   only what the run writes, since the engine allocates its cache untouched: per layer
//!   `min(total, cells)` cells (a sliding layer's ring being `window × n_parallel + n_ubatch`
//!   cells), K and V each rounded up to whole 4 KiB pages.
//! * **compute** on a GPU (activations for one ubatch of `T = n_ubatch` tokens, f32 = 4
//!   bytes, E = n_embd, H/Hkv heads, Dq/Dk/Dv head sizes, X experts, k used, F expert width,
//!   V vocab): the device keeps the largest phase it runs live at a time (buffers are reused
//!   between phases, as ggml's graph allocator does), plus inputs that live through the whole
//!   graph, plus the staging buffers of op offload:
//!   - attention phase: `T·4·(3E + H·Dq + Hkv·(Dk+Dv) + H·Dv)` (residual, normed input, q,
//!     k, v, attention output, projection; the attention itself is flash-style, so no
//!     `T × n_kv` score matrix and no mask), plus the attention's own temporaries: the chunk
//!     states or latent scores a device keeps when it splits a call over positions, at most
//!     what `hmoe_backend::attention_scratch` bounds them to for the cache kinds the device
//!     attends over (gpt-oss-120b at its whole context: 8.7 MB a decoded token, at most 64
//!     MiB; DeepSeek-V3's decode scores: 84 MB);
//!   - router phase: `T·4·(2E + 2X + 2k)` (input, normed, logits, probabilities, ids, weights);
//!   - expert phase: `T·4·(2E + 3kF + 2kE)` (input, gate, up, activation per used expert,
//!     per-expert output, weighted output, sum);
//!   - dense FFN / shared experts of width W: `T·4·(2E + 3W)`;
//!   - output phase: `T·4·(E + V)` (normed state and logits for every token of the ubatch,
//!     the worst case that perplexity and speculative verification need);
//!   - op offload staging: when op offload is on and `T ≥ 32`, matmuls whose weights are on
//!     the CPU run on the GPU of their layer (else CUDA0) for that ubatch, and the GPU runs
//!     the expert phase; it holds the two largest such weights other than routed experts (one
//!     in use, one being copied, as ggml's scheduler does), and the op-offload ring the
//!     routed experts of CPU layers stream through (hmoe's GPU executor): [`RING_SLOTS`]
//!     slices of `s` experts of the largest offloaded layer, never more than a layer
//!     ([`ring_bytes`]; `s` at most [`ring_max_slice`], and `--fit` shrinks it down to 1,
//!     [`DeviceUsage::ring`]); the expert phase then holds one more `T·4·kE` (every routed
//!     pair's input, output and one slice's output);
//!   - the expert cache of `--moe-cache MiB` on the first GPU when some layer's experts are on
//!     the CPU ([`DeviceUsage::moe_cache`]; `--fit` may shrink it).
//! * **compute** on the CPU: the buffers the hmoe engine's forward pass allocates (they are
//!   freed between phases, so the largest phase counts), for `T` tokens (`n_ubatch`, or the
//!   run's prompt when shorter) and `R` logits rows (1 for a generation run, else `T`):
//!   - always live: residual and normed state `2·T·4·E`, RoPE tables `T·(Dk/2)·8`, and the
//!     activations converted for the widest CPU projection (`T ×` a row of the weights'
//!     vec-dot type);
//!   - attention phase: q, k, v and the attention output `T·4·(H·Dq + Hkv·(Dk+Dv) + H·Dv)`,
//!     plus the output projection with its transposed matmul result `2·T·4·E`;
//!   - MoE phase: router scores, choices and weights, the output, every slot's expert output
//!     and the converted input `T·4·(X + 2k + E + kE) + T·act(E)`, plus one expert's work on
//!     at most all `T` tokens (routed activations, gate, up, converted hidden, down and the
//!     transposed matmul result);
//!   - output phase: `R·4·(E + V)`, plus the transposed result `R·4·V` when `R > 1`;
//!   - a generation run also holds the previous token's logits `4V` during each decode
//!     step, and the sampler's candidates and sort scratch (`20V` with the logits) between
//!     steps; the largest of prompt step, decode step and sampling counts;
//!   - plus, from the first attention on, the buffers flash attention (`-fa on`/`auto`) keeps
//!     between calls: the states its tasks hand back, `4·(Dv + 2)` bytes per head and query
//!     row of a micro-batch (in tiles of 16) or, for a decode step over f32/f16/bf16 values,
//!     per head and chunk of 256 positions read; and one worker thread's scratch for a task
//!     of up to 16 query rows of every head (each further thread keeps its own; `-fa off`
//!     and DeepSeek's latent attention over a float cache keep a score row instead).
//! * **overhead**: the runtime's own allowance per GPU ([`crate::DEFAULT_GPU_OVERHEAD`] unless
//!   the caller says otherwise); 0 on the CPU.
//!
//! A GPU fits when `free − total ≥ margin` (`--fit-target`). The host is never a constraint.
//! `--fit` shrinks what is elastic (the ring, then the cache) before anything else; see
//! [`plan()`].
//!
//! Without [`RunTokens`] these are allocation sizes. A process's resident memory reaches
//! them only once every page was touched: memory-mapped weights as they are read (a run
//! reads the embedding rows of its tokens and the experts its tokens are routed to), KV pages
//! as the context fills. Not counted: the parsed metadata and tokenizer, and the program's
//! own code pages and thread stacks.
#![warn(missing_docs)]

mod device;
mod error;
mod flags;
mod plan;
mod plan_table;
mod presets;
mod ring;
mod shape;
mod tensor;
mod tensor_rules;

pub use device::{DeviceBudget, DeviceId, GpuBudget, DEFAULT_GPU_OVERHEAD};
pub use error::{PlacementError, Shortfall};
pub use flags::{
    parse_cache_type, parse_override_list, parse_size, shell_quote, GpuLayers, PlacementFlags,
    RunTokens, TensorRule, FFN_EXPS_REGEX, OP_OFFLOAD_MIN_BATCH,
};
pub use plan::{plan, plan_run, DeviceUsage, Plan};
pub use presets::{gpt_oss_tensor_table, GptOssDims};
pub use ring::{ring_bytes, ring_max_slice, ring_slice_for, RING_MAX_SLICE_EXPERTS, RING_SLOTS};
pub use shape::ModelShape;
pub use tensor::{layer_group, tensor_kind, LayerGroup, TensorDesc, TensorKind};
