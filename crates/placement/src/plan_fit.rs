//! The `--fit` search of the planner (see [`super::plan()`]): what is elastic first, then
//! the context, then experts to the CPU, then whole layers; and the plan it ends with.

use super::{pad256, Plan, Planner, State};
use crate::device::DeviceId;
use crate::error::{PlacementError, Shortfall};
use crate::flags::{GpuLayers, TensorRule};
use crate::ring::{largest, ring_max_slice};
use crate::tensor::{LayerGroup, TensorKind};
use crate::tensor_rules::layers_exps_regex;

impl Planner<'_> {
    pub(super) fn search(&self) -> Result<Plan, PlacementError> {
        let f = self.flags;
        let n_layer = self.shape.n_layer;
        let ctx_train = self.shape.n_ctx_train;
        let ctx0 = match f.ctx_size {
            None | Some(0) => ctx_train,
            Some(n) => n,
        };
        let ngl0 = match f.n_gpu_layers {
            GpuLayers::Auto | GpuLayers::All => n_layer + 1,
            GpuLayers::Count(n) => n.min(n_layer + 1),
        };
        let mut st = State {
            n_ctx: ctx0,
            ngl: ngl0,
            fit_cpu: vec![false; n_layer as usize],
            slice: self.max_slice(),
            moe_cache: f.moe_cache,
        };
        let mut notes = Vec::new();
        if !f.fit || self.n_gpus() == 0 || self.fits(&st) {
            return Ok(self.finish(st, notes));
        }

        // 0. What is elastic: the op-offload ring, then the expert cache.
        if self.fit_elastic(&mut st) {
            return Ok(self.finish(st, notes));
        }

        // 1. Context, down to --fit-ctx, unless the user gave -c.
        let min_ctx = pad256(f.fit_ctx as u64) as u32;
        if f.ctx_size.is_none() && pad256(ctx0 as u64) > min_ctx as u64 {
            let at = |n_ctx: u32| State {
                n_ctx,
                ..st.clone()
            };
            if self.fits(&at(min_ctx)) {
                // Largest multiple of 256 in [min_ctx, ctx0] that fits (use grows with ctx).
                let (mut lo, mut hi) = (min_ctx / 256, (pad256(ctx0 as u64) / 256) as u32);
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    if self.fits(&at(mid * 256)) {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
                let n = (lo * 256).min(ctx0);
                notes.push(format!("context reduced from {ctx0} to {n}"));
                st.n_ctx = n;
                self.fit_elastic(&mut st);
                return Ok(self.finish(st, notes));
            }
            notes.push(format!(
                "context reduced from {ctx0} to {min_ctx} (--fit-ctx)"
            ));
            st.n_ctx = min_ctx;
        }

        // 2. Experts of the last layers to the CPU, one layer per over-budget GPU per step.
        let mut moved = Vec::new();
        loop {
            let (assign, usage) = self.evaluate(&st);
            let over: Vec<DeviceId> = usage
                .iter()
                .filter(|u| !u.fits())
                .map(|u| u.device)
                .collect();
            if over.is_empty() {
                break;
            }
            let mut progress = false;
            for dev in over {
                if let Some(il) = self.last_movable_layer(&st, &assign, dev) {
                    st.fit_cpu[il as usize] = true;
                    moved.push(il);
                    progress = true;
                }
            }
            if !progress {
                break;
            }
        }
        if !moved.is_empty() {
            moved.sort_unstable();
            notes.push(format!(
                "experts of {} layer(s) moved to the CPU: {}",
                moved.len(),
                compact_ranges(&moved)
            ));
        }
        if self.fit_elastic(&mut st) {
            return Ok(self.finish(st, notes));
        }

        // 3. Whole layers to the CPU, front first, when -ngl was left to us.
        if f.n_gpu_layers == GpuLayers::Auto {
            let before = st.ngl;
            while st.ngl > 0 && !self.fits(&st) {
                st.ngl -= 1;
            }
            if self.fits(&st) {
                notes.push(format!("-ngl reduced from {before} to {}", st.ngl));
                self.fit_elastic(&mut st);
                return Ok(self.finish(st, notes));
            }
            st.ngl = before;
        }

        let (_, usage) = self.evaluate(&st);
        Err(PlacementError::DoesNotFit(
            usage
                .iter()
                .filter(|u| !u.fits())
                .map(|u| Shortfall {
                    device: u.device,
                    projected: u.total(),
                    free: u.free.unwrap_or(0),
                    margin: u.margin,
                })
                .collect(),
        ))
    }

    /// The most experts per slice the op-offload ring takes ([`ring_max_slice`]).
    fn max_slice(&self) -> u64 {
        ring_max_slice(self.shape.n_expert)
    }

    /// Sizes what is elastic to the largest that fits with the rest of `st`: the op-offload
    /// ring with the expert cache the user asked for, or, when even the smallest ring does
    /// not fit beside it, the smallest ring and the largest cache that fits (in whole MiB; none
    /// when that holds no expert). False, with both at their smallest, when nothing fits.
    fn fit_elastic(&self, st: &mut State) -> bool {
        let cache = self.flags.moe_cache;
        let base = st.clone();
        let at = |slice: u64, moe_cache: u64| State {
            slice,
            moe_cache,
            ..base.clone()
        };
        if let Some(slice) = largest(1, self.max_slice(), |s| self.fits(&at(s, cache))) {
            (st.slice, st.moe_cache) = (slice, cache);
            return true;
        }
        st.slice = 1;
        let mib = largest(0, cache >> 20, |m| self.fits(&at(1, m << 20)));
        st.moe_cache = mib.map_or(0, |m| m << 20);
        if st.moe_cache < self.smallest_cache() {
            st.moe_cache = 0;
        }
        mib.is_some()
    }

    /// Bytes of the smallest expert cache that holds an expert: one expert of every MoE layer
    /// (the cache splits its budget evenly over the CPU layers).
    fn smallest_cache(&self) -> u64 {
        let n = self.shape.n_expert.max(1);
        let layer_bytes = |il: u32| -> u64 {
            (self.tensors.iter().zip(&self.groups).zip(&self.kinds))
                .filter(|((_, g), k)| **g == LayerGroup::Block(il) && **k == TensorKind::Experts)
                .map(|((t, _), _)| t.n_bytes)
                .sum()
        };
        (0..self.shape.n_layer).map(|il| layer_bytes(il) / n).sum()
    }

    /// The highest layer whose experts sit on `dev`, are not pinned there by a user rule, and
    /// were not moved yet.
    fn last_movable_layer(&self, st: &State, assign: &[DeviceId], dev: DeviceId) -> Option<u32> {
        (0..self.tensors.len())
            .filter(|&i| {
                self.kinds[i] == TensorKind::Experts && self.pinned[i].is_none() && assign[i] == dev
            })
            .filter_map(|i| match self.groups[i] {
                LayerGroup::Block(il) if !st.fit_cpu[il as usize] => Some(il),
                _ => None,
            })
            .max()
    }

    fn finish(&self, st: State, notes: Vec<String>) -> Plan {
        let (assign, devices) = self.evaluate(&st);
        let (n_ctx, n_batch, n_ubatch, full, swa) = self.sizes(st.n_ctx);
        let fit_layers: Vec<u32> = (0..self.shape.n_layer)
            .filter(|&il| st.fit_cpu[il as usize])
            .collect();
        let mut flags = self.flags.clone();
        flags.ctx_size = Some(n_ctx as u32);
        let cache_given = self.flags.moe_cache;
        let cpu_experts = devices.first().is_some_and(|d| d.expert_layers > 0);
        // No CPU layer to cache: the cache is neither planned nor made.
        flags.moe_cache = if cpu_experts { st.moe_cache } else { 0 };
        let mut notes = notes;
        let ring = devices.iter().map(|d| d.ring).max().unwrap_or(0);
        let ring_slice_experts = if ring > 0 { st.slice } else { 0 };
        if ring > 0 && st.slice < self.max_slice() {
            notes.push(format!(
                "op-offload ring shrunk from {} to {} experts per slice ({} MiB)",
                self.max_slice(),
                st.slice,
                ring >> 20
            ));
        }
        if cpu_experts && st.moe_cache < cache_given {
            notes.push(match st.moe_cache {
                0 => format!("expert cache (--moe-cache {}) left out", cache_given >> 20),
                m => format!(
                    "expert cache shrunk from {} to {} MiB",
                    cache_given >> 20,
                    m >> 20
                ),
            });
        }
        if !fit_layers.is_empty() {
            flags.rules.push(TensorRule::Override {
                pattern: layers_exps_regex(fit_layers.iter().copied()),
                device: "CPU".to_string(),
            });
        }
        Plan {
            n_ctx: n_ctx as u32,
            n_batch: n_batch as u32,
            n_ubatch: n_ubatch as u32,
            n_layer: self.shape.n_layer,
            n_gpu_layers: st.ngl,
            kv_cells_full: full as u32,
            kv_cells_swa: swa as u32,
            tensor_devices: assign,
            devices,
            fit_cpu_expert_layers: fit_layers,
            notes,
            ring_slice_experts,
            flags,
        }
    }
}

/// `3-5, 7, 9-10` for a sorted list.
fn compact_ranges(v: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}
