//! Causal multi-head attention over the KV cache with grouped KV heads, an optional sliding
//! window and optional per-head sink logits (gpt-oss).
//!
//! Summation orders follow ggml's CPU backend so that results match llama.cpp bit for bit
//! where it matters (a last-bit change can flip a Q8_0 rounding downstream): scores as
//! 16-lane FMA chains (tinyBLAS) — except for f32 keys in multi-token batches, where ggml's
//! `vec_dot_f32` runs —, exponentials with ggml's vectorised `expf`, the softmax sum in chunks
//! of 16 positions, and the value sum as 16-lane FMA chains over positions (for one token with
//! f32/f16 values, `vec_dot`'s four chains taking 16 positions in turn).
//!
//! Caches with block-quantized values (llama.cpp reads a quantized V cache only by flash
//! attention), and with flash attention on ([`hmoe_backend::KvType::flash_attn`]: `-fa on` or
//! `auto`, the default) every cache (but DeepSeek's latent cache, whose values live inside the
//! keys), go through [`flash::flash_attention`] instead: an online softmax over the keys with
//! no score matrix. The keys go in chunks of
//! [`FLASH_CHUNK`](hmoe_backend::numerics::FLASH_CHUNK) positions fixed by position, each its
//! own softmax stepped a block of [`FLASH_BLOCK`](hmoe_backend::numerics::FLASH_BLOCK)
//! positions at a time (one rescale per block, so the value sums run without a branch per
//! key; block-quantized values dequantized to f32 a block at a time), folded in position
//! order: one decode token then spreads over every thread (split-K), and results still depend
//! neither on the thread count nor on the rest of the batch. Its results differ from the row
//! kernel's in the last bits (another summation order, f32 probabilities), and from
//! llama.cpp's flash kernel too (one online softmax over all keys, f16 values summed in f16);
//! the goldens hold within the fixture tolerances (`tests/kv_quant_fixtures.rs`).
//!
//! `-fa off` keeps the row kernel (one query row at a time, so memory is one score row per
//! (query, head) task and never a queries × keys matrix), whose numerics meet the non-flash
//! goldens exactly. [`attention_ext`] over a latent cache (values inside the keys) takes the
//! row kernel for f32/f16/bf16 values whatever `-fa` says.

mod attn_shape;
mod f16_rows;
mod flash;
mod kv_reads;
mod lane_kernels;
mod lanes;
mod latent_rows;
mod q8_0_scores;
mod row_kernel;

use hmoe_backend::numerics::rotate_chunks;

use crate::kv_storage::LayerCache;
pub use attn_shape::{AttnLayout, AttnShape};
use kv_reads::rotate_back;
use latent_rows::attention_ext_rotated;
use row_kernel::attention_rotated;

/// `out[t][h] = Σ_j softmax_j(q[t][h]·k_j · scale ⊕ sink[h]) v_j` over the keys visible from
/// position `pos0 + t`. The cache must already hold the batch's own keys and values.
pub fn attention(
    cache: &LayerCache,
    shape: &AttnShape,
    q: &[f32],
    pos0: usize,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let (rot_q, rot_out) = (cache.k.rotation(), cache.v.rotation());
    if rot_q == 0 && rot_out == 0 {
        return attention_rotated(cache, shape, q, pos0, sinks, out);
    }
    let rotated;
    let q = if rot_q > 0 {
        rotated = rotate_chunks(q, rot_q);
        &rotated[..]
    } else {
        q
    };
    attention_rotated(cache, shape, q, pos0, sinks, out);
    rotate_back(out, rot_out);
}

/// `out[t][h] = Σ_j softmax_j(q[t][h]·k_j · scale) v_j` over the keys visible from position
/// `pos0 + t`, for heads of `k_dim` (query, key) and `v_dim` (value) elements; `out` holds
/// `v_dim` values per head. The cache must already hold the batch's own keys and values.
///
/// Numerics as [`attention`], plus what ggml does when an f16 key head is not a multiple of 16
/// long (tinyBLAS declines it): the scores of a batch then come from `vec_dot_f16` too.
pub fn attention_ext(
    cache: &LayerCache,
    shape: &AttnLayout,
    q: &[f32],
    pos0: usize,
    out: &mut [f32],
) {
    // Values stored inside the keys were rotated with them.
    let rot_q = cache.k.rotation();
    let rot_out = if shape.v_in_k {
        rot_q
    } else {
        cache.v.rotation()
    };
    if rot_q == 0 && rot_out == 0 {
        return attention_ext_rotated(cache, shape, q, pos0, out);
    }
    let rotated;
    let q = if rot_q > 0 {
        rotated = rotate_chunks(q, rot_q);
        &rotated[..]
    } else {
        q
    };
    attention_ext_rotated(cache, shape, q, pos0, out);
    rotate_back(out, rot_out);
}

#[cfg(test)]
#[path = "attention/attention_tests.rs"]
pub(crate) mod tests;

/// Speed of attention on gpt-oss-120b's shapes (64 query heads, 8 KV heads of 64), with the
/// cache warm in L3 and cold (64 MiB written first, as a generating model's weights evict it):
/// `cargo test --release -p hmoe-cpu --lib attention_speed -- --ignored --nocapture` (decode
/// and prefill; `attention_speed_decode` for decode alone).
#[cfg(test)]
#[path = "attention/attention_speed.rs"]
mod speed;
