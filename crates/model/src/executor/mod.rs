//! The executor: a model with the dense part of every layer on a
//! device of the contract ([`hmoe_backend::Backend`]: the CPU, a CUDA GPU, or the reference
//! device `REF0`) and each layer's routed experts where the placement puts them, for every
//! architecture. On the CPU ([`hmoe_cpu::Cpu`], `load`) every layer's experts are
//! the device's and nothing crosses a bus.
//!
//! This module is the architecture-neutral part, one file per concern: [`DeviceModel`]
//! (`device_model.rs`: loading, forward, micro-batching, the logits; built by
//! [`DeviceModel::load`] from the table of architectures in `archs`), the
//! per-sequence device K/V caches (`device_kv.rs`), the weights on the device
//! (`device_weights.rs`), the contract with the architectures and the micro-batch in flight
//! (`step.rs`), the expert boundary (`expert_boundary.rs`), op offload through the ring
//! (`offload_ring.rs`), the host's experts
//! and the round trip's staging (`host_experts.rs`), the device expert cache
//! (`moe_cache.rs`), the steps' scratch buffers (`scratch_arena.rs`: reused from op to op
//! and step to step, so that a decode step allocates nothing on the device after the first),
//! the recorded segments of decode steps (`segments.rs`: CUDA graphs, REF0's replay mode). Each architecture writes its layer in its own file of `archs`
//! over the contract's ops and the shared blocks of `layer_blocks.rs` (the attention block,
//! the routed-MoE block, the dense SwiGLU FFN), and hands it to the executor as a
//! `DeviceLayers` (the dense `llama`/`qwen2` files have no experts: every layer runs on the
//! device and nothing crosses the bus between the ids and the logits). The devices know no
//! architecture.
//!
//! Per micro-batch the token ids and positions go up (two small copies), the embedding rows
//! are gathered on the device, then every layer runs (`DeviceLayers::layer`); a layer's
//! routed experts run (`Step::experts`):
//!
//! - [`crate::ExpertHome::Device`]: the `moe` op over the layer's experts, uploaded at load;
//! - [`crate::ExpertHome::Host`]: one round trip. The normed hidden state, the chosen experts and
//!   their weights come down into the device's staging buffers (pinned on CUDA), the host runs
//!   the layer's experts over the file mapping with the CPU device's `moe` op, and the
//!   weighted sum goes back up.
//!
//! The last layer runs its feed-forward block over the rows whose logits (or hidden states)
//! the members want alone, as llama.cpp does (`inp_out_ids`; `Step::feed_forward`), so that
//! the products whose order depends on the rows multiplied together (F32 routers) see the
//! same rows as llama.cpp's. After the last layer: output norm and head on the device, and
//! the logits come down. With
//! every layer's experts on the device nothing crosses the bus between the ids and the logits.
//!
//! Numerics: the CPU's. Products convert activations as ggml does (Q8_0 blocks for
//! Q8_0/MXFP4 weights, f16/bf16 for F16/BF16) and sum Q8_0, MXFP4 and F32 products in the CPU's
//! order (REF0 multiplies the other types with the CPU's own kernels);
//! attention rounds the query and the probabilities to f16 and sums in the
//! CPU's orders with ggml's `expf` (one token's values in one 16-lane chain as its gpt-oss
//! attention, or in `vec_dot`'s four as its Qwen3/Llama-style attention: each architecture's
//! `AttnShape::value_chains`). On [`hmoe_backend::Ref0`] the logits are the CPU's
//! bit for bit on the fixtures. On a GPU what still differs is cuBLAS's order for batches of
//! F16/BF16 weights, the GPU's `cosf`/`sinf` in RoPE, the f64-rounded `expf` where the CPU
//! calls libm's, and F16/BF16 summation orders; on models whose routing is that sensitive
//! (the synthetic Q8_0/MXFP4 fixtures) a last bit can still flip an expert choice. With
//! flash attention (`-fa on`, and `auto`, the default), and over block-quantized values
//! whatever `-fa` says, the CPU and REF0 run the chunked flash kernel
//! ([`hmoe_backend::AttnParams::flash`]), and so does the CUDA device over its f32/f16/Q8_0/Q4_0
//! rings (`attn_chunked`: the CPU's bits in the host emulation, not yet checked on a GPU).
//!
//! Several sequences at once ([`crate::LanguageModel::forward_multi`], continuous batching): each
//! sequence has its own K/V cache on the device, and one micro-batch carries every sequence's
//! tokens, so a host-expert layer still makes one round trip per micro-batch; where the model
//! has host-expert layers the step runs as two micro-batches in flight instead, so that the
//! device runs one group's attention while the CPU runs the other's experts
//! (`micro_batches.rs`, `HMOE_MICRO_BATCHES=0` turns it off). The result is
//! batch-invariant, as the CPU's: row-wise ops (embedding, norms, biases, RoPE with each
//! token's position, routing, Q8_0/MXFP4/F16/BF16 products) run over the whole micro-batch,
//! attention runs per sequence over its cache (`Step::attend`), and the products the CPU
//! sums in another order for a batch than for one token (F32 weights, Q4_0 and K-quant
//! weights, whose order depends on the batch's size: `batch_order_varies`, and the experts
//! of a layer with F32 or K-quant experts, which the `moe` op sums by how many tokens route to
//! each: `expert_order_varies`) run
//! on exactly the rows the executor on the CPU gives them together (`Step::matmul`,
//! `ExpertSplit`). On [`hmoe_backend::Ref0`] every sequence's logits are then the CPU's
//! bit for bit.
//!
//! Device caches: the [`crate::KvCache`] that [`crate::LanguageModel::new_cache`] hands out holds positions
//! and the ring geometry of the architecture's cache, no keys or values
//! (`DeviceLayers::new_cache`); the executor keeps one device cache per handle, told apart
//! by the handle's [`crate::KvCache::id`], with the handle's cells per layer. A handle at position 0
//! starts a new sequence (its device cache is reallocated when its size differs); one that
//! went back ([`crate::KvCache::truncate`]) continues from there; one ahead of what the device holds
//! is an error. The cache of a dropped handle is freed at the next step
//! ([`crate::KvCache::watch`]). Beyond that, caches are freed by need: before a new sequence's cache
//! is allocated, the least recently used caches of sequences outside the step are freed until
//! the device has room for it and a micro-batch's scratch buffers
//! ([`DeviceModel::scratch_bytes`]), and again if the allocation still runs out of memory. A
//! handle whose cache was freed can only start again from position 0
//! ([`crate::LanguageModel::cache_held`] tells). An owner of every live handle (the server's slots)
//! names them with [`crate::LanguageModel::retain_caches`]: the caches of other handles are freed
//! then, and those of busy sequences are never freed to make room for another.
//!
//! Limits of this executor:
//! - **K/V types the device keeps** ([`hmoe_backend::Backend::supports_kv`]; REF0 every `-ctk`/`-ctv` pair),
//!   stored and read as the CPU's cache does ([`device_kv_layouts`]); a K-only cache
//!   (DeepSeek's latent cache) is f16. A cache of another type is an error (the CLI runs it on
//!   the CPU then).
//! - **Op offload overlaps large batches only**: a micro-batch of at least the placement's
//!   `op_offload_min_batch` tokens (counted in the last layer as the rows its feed-forward
//!   block multiplies, as llama.cpp decides per op) runs a host layer on the device with the experts it routes
//!   to uploaded from the file mapping for that batch (on CUDA through pinned buffers that the
//!   CPU pool fills while the copy engine drains them, on the device's copy stream), slice by
//!   slice through a ring of two device buffers whose size the placement plans
//!   ([`DeviceModel::set_op_offload_ring`], `offload_ring.rs`): one slice's products run while
//!   the next slice goes up, with the same bits as the whole layer at once. When the batch
//!   routes to nearly every expert ([`PREFETCH_ROUTES_PER_EXPERT`]) every expert is uploaded,
//!   and the next host layer's first slice goes up as soon as this layer's last slice is
//!   queued. Smaller batches wait for the routing and upload the chosen experts only.

pub(crate) mod device_kv;
mod device_model;
pub(crate) mod device_weights;
mod expert_boundary;
mod host_experts;
pub(crate) mod layer_blocks;
mod layer_experts;
mod micro_batches;
mod moe_cache;
mod offload_ring;
pub(crate) mod routing;
mod scratch_arena;
mod segments;
mod state;
pub(crate) mod step;

pub use device_kv::{device_kv_layouts, KvWidths};
pub use device_model::DeviceModel;
pub use expert_boundary::PREFETCH_ROUTES_PER_EXPERT;
pub use micro_batches::MICRO_BATCHES_ENV;
