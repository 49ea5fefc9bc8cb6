//! Which engine runs a model: the GPU executor for gpt-oss ([`hmoe_cuda::GpuGptOss`]) when a
//! GPU is there and the placement plan puts every layer's dense part on it, else the CPU
//! engine, with the reason.

use hmoe_model::kv_cache::CacheType;
use hmoe_model::{ExpertPlacement, KvType};
use hmoe_placement::DeviceId;

/// The engine chosen for a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    /// The CPU engine, and why not the GPU.
    Cpu {
        /// Why the GPU executor is not used.
        why: String,
    },
    /// The GPU executor on CUDA device `ordinal`, with each layer's experts where the plan
    /// puts them.
    Gpu {
        /// The CUDA device ordinal.
        ordinal: usize,
        /// Expert homes and the op offload threshold.
        placement: ExpertPlacement,
    },
}

/// What the choice depends on.
#[derive(Clone, Debug)]
pub struct EngineInputs<'a> {
    /// CUDA ordinals of the GPUs the run may use (after `--device`), in the plan's order:
    /// the plan's `Gpu(i)` is `gpus[i]`.
    pub gpus: &'a [usize],
    /// Why there is no GPU, when `gpus` is empty.
    pub why_no_gpu: Option<&'a str>,
    /// `general.architecture`.
    pub arch: Option<&'a str>,
    /// The K/V cache types asked for.
    pub kv: KvType,
    /// Layers of the model.
    pub n_layer: usize,
    /// The plan's device of every tensor (empty when no plan was made).
    pub tensors: &'a [(&'a str, DeviceId)],
    /// `--op-offload-min-batch`, or `None` with `--no-op-offload`.
    pub op_offload: Option<usize>,
}

/// Whether the architecture has a GPU executor (the plan is worth making only then).
pub fn gpu_executor_arch(arch: Option<&str>) -> bool {
    arch == Some("gpt-oss")
}

/// The layer of an attention weight (`blk.N.attn_q.weight`), the dense part's marker.
fn attn_q_layer(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    (tail == "attn_q.weight").then(|| layer.parse().ok())?
}

/// The engine for `i`: the GPU executor when there is a GPU, the model is gpt-oss, the K/V
/// cache is f16, and the plan puts every layer's dense part on one GPU (each layer's experts
/// where the plan puts them, a layer's experts as a unit); else the CPU engine and why.
pub fn choose_engine(i: &EngineInputs<'_>) -> EngineChoice {
    let cpu = |why: String| EngineChoice::Cpu { why };
    if i.gpus.is_empty() {
        return cpu(format!(
            "no GPU ({})",
            i.why_no_gpu.unwrap_or("none selected")
        ));
    }
    if !gpu_executor_arch(i.arch) {
        return cpu(format!(
            "the GPU executor runs gpt-oss only, this model is {}",
            i.arch.unwrap_or("of unknown architecture")
        ));
    }
    if i.kv.k() != CacheType::F16 || i.kv.v() != CacheType::F16 {
        return cpu(format!(
            "the GPU executor keeps an f16 K/V cache (asked: -ctk {} -ctv {})",
            i.kv.k().name(),
            i.kv.v().name()
        ));
    }
    if i.tensors.is_empty() {
        return cpu("no placement plan".into());
    }
    let mut dense_on_gpu = vec![None; i.n_layer];
    for &(name, dev) in i.tensors {
        if let Some(slot) = attn_q_layer(name).and_then(|l| dense_on_gpu.get_mut(l)) {
            *slot = Some(dev);
        }
    }
    let on_gpu = dense_on_gpu
        .iter()
        .filter(|d| d.is_some_and(DeviceId::is_gpu))
        .count();
    if on_gpu == 0 {
        return cpu("the plan puts no layer on the GPU (-ngl 0)".into());
    }
    if on_gpu < i.n_layer {
        return cpu(format!(
            "the plan puts {on_gpu} of {} layers on the GPU; the GPU executor needs every \
             layer's dense part there (-ngl all; keep experts on the CPU with --cpu-moe or \
             --n-cpu-moe)",
            i.n_layer
        ));
    }
    let mut used: Vec<usize> = i
        .tensors
        .iter()
        .filter_map(|&(_, d)| match d {
            DeviceId::Gpu(g) => Some(g),
            DeviceId::Cpu => None,
        })
        .collect();
    used.sort_unstable();
    used.dedup();
    if used.len() > 1 {
        return cpu(format!(
            "the plan splits the model over {} GPUs; the GPU executor runs on one (-dev CUDA0)",
            used.len()
        ));
    }
    let Some(&ordinal) = used.first().and_then(|&g| i.gpus.get(g)) else {
        return cpu("the plan names a GPU that was not probed".into());
    };
    let tensors = i.tensors.iter().map(|&(n, d)| (n, d.is_gpu()));
    match ExpertPlacement::from_tensor_devices(i.n_layer, tensors) {
        Ok(p) => EngineChoice::Gpu {
            ordinal,
            placement: p.with_op_offload(i.op_offload),
        },
        Err(e) => cpu(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_model::ExpertHome;

    const G: DeviceId = DeviceId::Gpu(0);
    const C: DeviceId = DeviceId::Cpu;

    /// Tensor names of a 2-layer gpt-oss with `dense[l]` and `experts[l]` devices.
    fn names() -> Vec<String> {
        let mut v = vec!["token_embd.weight".to_string(), "output.weight".into()];
        for l in 0..2 {
            for t in [
                "attn_q.weight",
                "attn_k.weight",
                "ffn_gate_inp.weight",
                "ffn_gate_exps.weight",
                "ffn_up_exps.weight",
                "ffn_down_exps.weight",
                "ffn_down_exps.bias",
            ] {
                v.push(format!("blk.{l}.{t}"));
            }
        }
        v
    }

    fn devices(names: &[String], dense: [DeviceId; 2], experts: [DeviceId; 2]) -> Vec<DeviceId> {
        names
            .iter()
            .map(|n| {
                let l = n
                    .strip_prefix("blk.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|l| l.parse::<usize>().ok());
                match l {
                    None => G,
                    Some(l) if n.contains("_exps") => experts[l],
                    Some(l) => dense[l],
                }
            })
            .collect()
    }

    fn choose(
        gpus: &[usize],
        arch: &str,
        kv: KvType,
        dense: [DeviceId; 2],
        experts: [DeviceId; 2],
    ) -> EngineChoice {
        let names = names();
        let devs = devices(&names, dense, experts);
        let tensors: Vec<(&str, DeviceId)> = names.iter().map(String::as_str).zip(devs).collect();
        choose_engine(&EngineInputs {
            gpus,
            why_no_gpu: Some("no CUDA driver (libcuda not found)"),
            arch: Some(arch),
            kv,
            n_layer: 2,
            tensors: &tensors,
            op_offload: Some(32),
        })
    }

    fn why(c: EngineChoice) -> String {
        match c {
            EngineChoice::Cpu { why } => why,
            other => panic!("expected the CPU engine, got {other:?}"),
        }
    }

    fn homes(c: EngineChoice) -> (usize, Vec<ExpertHome>, Option<usize>) {
        match c {
            EngineChoice::Gpu { ordinal, placement } => {
                (ordinal, placement.layers, placement.op_offload_min_batch)
            }
            other => panic!("expected the GPU executor, got {other:?}"),
        }
    }

    #[test]
    fn gpu_executor_with_the_plans_expert_homes() {
        use ExpertHome::{Device as D, Host as H};
        let f16 = KvType::F16;
        assert_eq!(
            homes(choose(&[0], "gpt-oss", f16, [G, G], [G, G])),
            (0, vec![D, D], Some(32)),
            "-ngl all"
        );
        assert_eq!(
            homes(choose(&[0], "gpt-oss", f16, [G, G], [C, C])),
            (0, vec![H, H], Some(32)),
            "-ngl all --cpu-moe"
        );
        assert_eq!(
            homes(choose(&[0], "gpt-oss", f16, [G, G], [C, G])),
            (0, vec![H, D], Some(32)),
            "--n-cpu-moe 1"
        );
        assert_eq!(
            homes(choose(&[3], "gpt-oss", f16, [G, G], [G, G])).0,
            3,
            "the plan's GPU 0 is the first --device"
        );
    }

    #[test]
    fn cpu_engine_and_why() {
        let f16 = KvType::F16;
        let w = why(choose(&[], "gpt-oss", f16, [G, G], [G, G]));
        assert!(w.contains("no GPU (no CUDA driver"), "{w}");
        let w = why(choose(&[0], "qwen3moe", f16, [G, G], [G, G]));
        assert!(w.contains("gpt-oss only") && w.contains("qwen3moe"), "{w}");
        let w = why(choose(&[0], "gpt-oss", KvType::F32, [G, G], [G, G]));
        assert!(w.contains("f16 K/V"), "{w}");
        let w = why(choose(&[0], "gpt-oss", f16, [C, C], [C, C]));
        assert!(w.contains("no layer on the GPU"), "{w}");
        let w = why(choose(&[0], "gpt-oss", f16, [C, G], [C, G]));
        assert!(w.contains("1 of 2 layers"), "{w}");
        let w = why(choose(
            &[0, 1],
            "gpt-oss",
            f16,
            [G, DeviceId::Gpu(1)],
            [G, G],
        ));
        assert!(w.contains("over 2 GPUs"), "{w}");
        let no_plan = choose_engine(&EngineInputs {
            gpus: &[0],
            why_no_gpu: None,
            arch: Some("gpt-oss"),
            kv: f16,
            n_layer: 2,
            tensors: &[],
            op_offload: None,
        });
        assert!(why(no_plan).contains("no placement plan"));
    }

    #[test]
    fn split_expert_layers_stay_on_the_cpu() {
        let names = names();
        let mut devs = devices(&names, [G, G], [G, G]);
        let i = names
            .iter()
            .position(|n| n == "blk.1.ffn_down_exps.bias")
            .unwrap();
        devs[i] = C;
        let tensors: Vec<(&str, DeviceId)> = names.iter().map(String::as_str).zip(devs).collect();
        let c = choose_engine(&EngineInputs {
            gpus: &[0],
            why_no_gpu: None,
            arch: Some("gpt-oss"),
            kv: KvType::F16,
            n_layer: 2,
            tensors: &tensors,
            op_offload: None,
        });
        assert!(why(c).contains("split between host and device"));
    }

    #[test]
    fn attention_layer_names() {
        assert_eq!(attn_q_layer("blk.12.attn_q.weight"), Some(12));
        assert_eq!(attn_q_layer("blk.12.attn_q.bias"), None);
        assert_eq!(attn_q_layer("blk.x.attn_q.weight"), None);
        assert_eq!(attn_q_layer("output.weight"), None);
    }
}
