//! Expert choice: the top-k + softmax router (`router_topk_softmax`; with the router's
//! product in the same launch for a few tokens, `router_logits_topk_*`) and grouped routing
//! with softmax or sigmoid gating and an optional selection bias (`route_f32`).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use hmoe_backend::{Gating, Routing};
use hmoe_quant::GgmlType;

use super::matmul::{check_shape, check_shared, NO_BIAS};
use super::{i32_of, u32_of, CudaDevice, DeviceMatrix};
use crate::error::{ensure, CudaError};
use crate::kernels::{MM_TOKENS, ROUTE_MAX_EXPERTS, ROUTE_MAX_GROUPS, ROW_WARPS};

/// Tokens up to which [`CudaDevice::router_top_k_logits`] is one launch (decode): the GEMV
/// kernel's token tile, so that the grid is one row of blocks.
pub const ROUTER_FUSED_MAX_TOKENS: usize = MM_TOKENS as usize;

/// The tokens of router `logits` (rows of `n_expert`), or the shape error when they are not
/// whole rows, `k` is not 1 ..= `n_expert`, or `selected` and `weights` do not hold `k` a row.
fn check_router(
    op: &'static str,
    logits: &CudaSlice<f32>,
    (n_expert, k): (usize, usize),
    selected: &CudaSlice<i32>,
    weights: &CudaSlice<f32>,
) -> Result<usize, CudaError> {
    ensure(
        n_expert > 0 && logits.len().is_multiple_of(n_expert) && k > 0 && k <= n_expert,
        op,
        || format!("logits {} / n_expert {n_expert} / k {k}", logits.len()),
    )?;
    let n = logits.len() / n_expert;
    ensure(
        selected.len() >= n * k && weights.len() >= n * k,
        op,
        || {
            format!(
                "selected {} / weights {} for {n}×{k}",
                selected.len(),
                weights.len()
            )
        },
    )?;
    Ok(n)
}

impl CudaDevice {
    /// Router: for each of the `logits.len() / n_expert` tokens, the `k` largest logits
    /// (ties: lower expert first) into `selected` and the softmax over those `k` into
    /// `weights` (both `n × k`).
    pub fn router_top_k(
        &self,
        logits: &CudaSlice<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "router_top_k";
        let n = check_router(OP, logits, (n_expert, k), selected, weights)?;
        if n == 0 {
            return Ok(());
        }
        let (n_i, ne, k_i) = (
            i32_of(OP, "tokens", n)?,
            i32_of(OP, "experts", n_expert)?,
            i32_of(OP, "k", k)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "tokens", n.div_ceil(ROW_WARPS as usize))?, 1, 1),
            block_dim: (ROW_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("router_topk_softmax");
        b.arg(logits)
            .arg(selected)
            .arg(weights)
            .arg(&n_i)
            .arg(&ne)
            .arg(&k_i);
        // SAFETY: argument types match `router_topk_softmax`; sizes checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The router's logits `logits = w · x (+ bias)` for `n` tokens and their top-k + softmax
    /// (see `hmoe_backend::Backend::router_top_k_logits`), with the bits of
    /// [`CudaDevice::matmul_shared`] then [`CudaDevice::router_top_k`]. F32, F16 and BF16
    /// routers of 1 ..= [`ROUTER_FUSED_MAX_TOKENS`] tokens are one launch of
    /// `router_logits_topk_*` (kernels/router.cu): the GEMV kernel's blocks write the logits
    /// (matmul_f32/f16/bf16's device code), and the block that finishes last, told by the
    /// device's `router_done` counter, which it leaves at 0, takes every token's top-k. Other
    /// types and larger batches run the two ops.
    #[allow(clippy::too_many_arguments)]
    pub fn router_top_k_logits(
        &self,
        w: &DeviceMatrix,
        bias: Option<&CudaSlice<f32>>,
        x: &CudaSlice<f32>,
        n: usize,
        (n_expert, k): (usize, usize),
        logits: &mut CudaSlice<f32>,
        selected: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "router_top_k_logits";
        let name = match w.ty {
            GgmlType::F32 => "router_logits_topk_f32",
            GgmlType::F16 => "router_logits_topk_f16",
            GgmlType::BF16 => "router_logits_topk_bf16",
            _ => "",
        };
        // The two ops take the top-k of every row of `logits`: one launch where those are
        // the product's n rows.
        let one_launch = !name.is_empty()
            && (1..=ROUTER_FUSED_MAX_TOKENS).contains(&n)
            && w.rows == n_expert
            && logits.len() == n * n_expert;
        if !one_launch {
            self.matmul_shared(&[w], &[bias], x, n, &mut [&mut *logits])?;
            return self.router_top_k(logits, n_expert, k, selected, weights);
        }
        check_shape(OP, w, x, n, logits)?;
        check_shared(OP, &[w], &[bias], 1)?;
        check_router(OP, logits, (n_expert, k), selected, weights)?;
        let row_bytes = w.row_bytes as u64;
        let (rows, cols, n_i, k_i) = (
            i32_of(OP, "rows", w.rows)?,
            i32_of(OP, "cols", w.cols)?,
            i32_of(OP, "tokens", n)?,
            i32_of(OP, "k", k)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (
                u32_of(OP, "row blocks", w.rows.div_ceil(ROW_WARPS as usize))?,
                1,
                1,
            ),
            block_dim: (ROW_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder(name);
        b.arg(&w.data).arg(&row_bytes).arg(x).arg(logits);
        match bias {
            Some(bias) => b.arg(bias),
            // A null pointer: no bias.
            None => b.arg(&NO_BIAS),
        };
        b.arg(&rows)
            .arg(&cols)
            .arg(&n_i)
            .arg(selected)
            .arg(weights)
            .arg(&k_i)
            .arg(&self.router_done);
        // SAFETY: argument types match `router_logits_topk_*` (f32 activations; the bias
        // w.rows values or null; the counter one u32, at 0 between launches, which every
        // launch leaves at 0, and used only by launches on this stream, one at a time); x,
        // logits, selected and weights hold n tokens' values (checked above).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Expert choice of each row of router logits (see `hmoe_backend::Backend::route`).
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &self,
        logits: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        gating: Gating,
        routing: &Routing,
        n_expert: usize,
        selected: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "route";
        let (n_groups, n_used) = routing.groups.unwrap_or((1, 1));
        ensure(
            n_expert <= ROUTE_MAX_EXPERTS && n_groups <= ROUTE_MAX_GROUPS,
            OP,
            || {
                format!("{n_expert} experts in {n_groups} groups (at most {ROUTE_MAX_EXPERTS} in {ROUTE_MAX_GROUPS})")
            },
        )?;
        let n = logits.len() / n_expert.max(1);
        if n == 0 {
            return Ok(());
        }
        // Scratch (no memset): `route_f32` writes every row's probabilities and scores
        // before it reads them.
        let probs = self.alloc_scratch::<f32>(n * n_expert)?;
        let scores = self.alloc_scratch::<f32>(n * n_expert)?;
        let has_bias = i32::from(bias.is_some());
        let bias = bias.unwrap_or(&self.dummy);
        let gating_i: i32 = match gating {
            Gating::Softmax => 0,
            Gating::Sigmoid => 1,
        };
        let ints = [
            i32_of(OP, "rows", n)?,
            i32_of(OP, "experts", n_expert)?,
            i32_of(OP, "k", routing.k)?,
            i32_of(OP, "groups", n_groups)?,
            i32_of(OP, "used groups", n_used)?,
            i32::from(routing.norm),
        ];
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "rows / 64", n.div_ceil(64))?, 1, 1),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder("route_f32");
        b.arg(logits)
            .arg(bias)
            .arg(&has_bias)
            .arg(&gating_i)
            .arg(selected)
            .arg(weights)
            .arg(&probs)
            .arg(&scores);
        for v in &ints {
            b.arg(v);
        }
        b.arg(&routing.scale);
        // SAFETY: argument types match `route_f32`; the caller checked logits, bias, selected
        // and weights against the shape; probs and scores hold n × n_expert values.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
