//! Expert choice: the top-k + softmax router (`router_topk_softmax`) and grouped routing
//! with softmax or sigmoid gating and an optional selection bias (`route_f32`).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use hmoe_backend::{Gating, Routing};

use super::{i32_of, u32_of, CudaDevice};
use crate::error::{ensure, CudaError};
use crate::kernels::{ROUTE_MAX_EXPERTS, ROUTE_MAX_GROUPS, ROW_WARPS};

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
        ensure(
            n_expert > 0 && logits.len().is_multiple_of(n_expert) && k > 0 && k <= n_expert,
            OP,
            || format!("logits {} / n_expert {n_expert} / k {k}", logits.len()),
        )?;
        let n = logits.len() / n_expert;
        ensure(
            selected.len() >= n * k && weights.len() >= n * k,
            OP,
            || {
                format!(
                    "selected {} / weights {} for {n}×{k}",
                    selected.len(),
                    weights.len()
                )
            },
        )?;
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
