//! Which engine runs a model: the device executor ([`hmoe_model::DeviceModel`], for the
//! architectures of [`hmoe_model::DEVICE_ARCHS`]) on a CUDA GPU or on the reference
//! device `REF0` when the placement plan puts every layer's dense part there, else the
//! executor on the CPU, with the reason.

use hmoe_backend::REF0_NAME;
use hmoe_model::kv_cache::CacheType;
use hmoe_model::{ExpertPlacement, KvType};
use hmoe_placement::DeviceId;
use hmoe_quant::GgmlType;

/// A device the executor can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineDevice {
    /// CUDA device `ordinal`.
    Cuda(usize),
    /// The reference device with `budget` bytes of memory.
    Ref0 {
        /// Its memory (`--gpu-mem`).
        budget: u64,
    },
}

/// The engine chosen for a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    /// The executor on the CPU, and why not a device.
    Cpu {
        /// Why the device executor is not used.
        why: String,
    },
    /// The device executor on `device`, with each layer's experts where the plan puts them.
    Device {
        /// The device.
        device: EngineDevice,
        /// Expert homes and the op offload threshold.
        placement: ExpertPlacement,
    },
}

/// What the choice depends on.
#[derive(Clone, Debug)]
pub struct EngineInputs<'a> {
    /// The devices the run may use (after `--device`), in the plan's order: the plan's
    /// `Gpu(i)` is `devices[i]`.
    pub devices: &'a [EngineDevice],
    /// Why there is no GPU, when `devices` is empty.
    pub why_no_gpu: Option<&'a str>,
    /// `general.architecture`.
    pub arch: Option<&'a str>,
    /// The K/V cache types asked for.
    pub kv: KvType,
    /// Layers of the model.
    pub n_layer: usize,
    /// The plan's device of every tensor (empty when no plan was made).
    pub tensors: &'a [(&'a str, DeviceId)],
    /// The weight types of the tensors the plan puts on a GPU.
    pub gpu_types: &'a [GgmlType],
    /// `--op-offload-min-batch`, or `None` with `--no-op-offload`.
    pub op_offload: Option<usize>,
}

/// The per-pair RoPE frequency divisors of Llama 3 files, which a device applies where its
/// [`Capabilities`](hmoe_backend::Capabilities) say so.
const ROPE_FREQS: &str = "rope_freqs.weight";

/// Whether the architecture has a device executor (the plan is worth making only then).
pub fn gpu_executor_arch(arch: Option<&str>) -> bool {
    hmoe_model::device_arch(arch)
}

/// The layer of an attention output weight (`blk.N.attn_output.weight`, which every
/// architecture has), the dense part's marker.
fn attn_layer(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    (tail == "attn_output.weight").then(|| layer.parse().ok())?
}

/// The engine for `i`: the device executor when there is a device, the model's architecture
/// has a device layer ([`gpu_executor_arch`]), the device applies what the file's RoPE needs
/// and multiplies the weight types the plan gives it, the device keeps the K/V cache's types ([`device_keeps_kv`]), and the plan puts every layer's
/// dense part on one device (each layer's experts where the plan puts them, a layer's experts
/// as a unit); else the executor on the CPU and why.
pub fn choose_engine(i: &EngineInputs<'_>) -> EngineChoice {
    let cpu = |why: String| EngineChoice::Cpu { why };
    if i.devices.is_empty() {
        return cpu(format!(
            "no GPU ({})",
            i.why_no_gpu.unwrap_or("none selected")
        ));
    }
    if !gpu_executor_arch(i.arch) {
        return cpu(format!(
            "the GPU executor runs {} only, this model is {}",
            hmoe_model::DEVICE_ARCHS.join(", "),
            i.arch.unwrap_or("of unknown architecture")
        ));
    }
    if i.tensors.is_empty() {
        return cpu("no placement plan".into());
    }
    let mut dense_on_gpu = vec![None; i.n_layer];
    for &(name, dev) in i.tensors {
        if let Some(slot) = attn_layer(name).and_then(|l| dense_on_gpu.get_mut(l)) {
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
             layer's dense part there (-ngl all; a MoE model's experts can stay on the CPU \
             with --cpu-moe or --n-cpu-moe)",
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
    let Some(&device) = used.first().and_then(|&g| i.devices.get(g)) else {
        return cpu("the plan names a GPU that was not probed".into());
    };
    let caps = device_capabilities(device);
    if !caps.rope_freq_factors && i.tensors.iter().any(|&(name, _)| name == ROPE_FREQS) {
        return cpu(format!(
            "the file has RoPE frequency factors ({ROPE_FREQS}, Llama 3), which {}'s RoPE \
             does not apply",
            backend_name(device)
        ));
    }
    if let Some(&ty) = i.gpu_types.iter().find(|&&ty| !caps.multiplies(ty)) {
        return cpu(format!(
            "{} does not multiply {} weights ({}: {})",
            device_name(device),
            ty.to_string().to_lowercase(),
            backend_name(device),
            type_list(caps.weight_types)
        ));
    }
    let (k, v) = (i.kv.k(), i.kv.v());
    // A K-only (latent) cache has no V: its K type is checked below.
    let k_only = i
        .arch
        .is_some_and(|a| hmoe_model::K_ONLY_ARCHS.contains(&a));
    if !k_only && !device_keeps_kv(device, k, v) {
        return cpu(format!(
            "{} does not keep a -ctk {k} -ctv {v} K/V cache ({}: {})",
            device_name(device),
            backend_name(device),
            type_list(caps.kv_pair_types)
        ));
    }
    let k_only_types = device_k_only_types(device);
    if !hmoe_model::arch_keeps_kv(i.arch, k, k_only_types) {
        let types: Vec<String> = k_only_types
            .iter()
            .map(|t| t.to_string().to_lowercase())
            .collect();
        return cpu(format!(
            "{} keeps {}'s latent K-only cache in {} only (asked: -ctk {k})",
            device_name(device),
            i.arch.unwrap_or("this model"),
            types.join(", ")
        ));
    }
    let tensors = i.tensors.iter().map(|&(n, d)| (n, d.is_gpu()));
    match ExpertPlacement::from_tensor_devices(i.n_layer, tensors) {
        Ok(p) => EngineChoice::Device {
            device,
            placement: p.with_op_offload(i.op_offload),
        },
        Err(e) => cpu(e.to_string()),
    }
}

/// `device`'s name in messages (`CUDA0`, `REF0`).
pub fn device_name(device: EngineDevice) -> String {
    match device {
        EngineDevice::Cuda(o) => format!("CUDA{o}"),
        EngineDevice::Ref0 { .. } => REF0_NAME.into(),
    }
}

/// The backend of `device` (`CUDA`, `REF0`), as llama-bench's `backends` names it.
pub fn backend_name(device: EngineDevice) -> &'static str {
    match device {
        EngineDevice::Cuda(_) => "CUDA",
        EngineDevice::Ref0 { .. } => REF0_NAME,
    }
}

/// `types` in lower case for a message: `f32, f16, q8_0 and q4_0`.
fn type_list(types: &[GgmlType]) -> String {
    let names: Vec<String> = types.iter().map(|t| t.to_string().to_lowercase()).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.concat(),
    }
}

/// What `device` keeps and computes, as its backend crate reports it without opening it.
pub fn device_capabilities(device: EngineDevice) -> hmoe_backend::Capabilities {
    match device {
        EngineDevice::Cuda(_) => hmoe_cuda::CAPABILITIES,
        EngineDevice::Ref0 { .. } => hmoe_backend::REF0_CAPABILITIES,
    }
}

/// The types of K-only (latent) caches `device` attends over ([`device_capabilities`]).
pub fn device_k_only_types(device: EngineDevice) -> &'static [hmoe_quant::GgmlType] {
    device_capabilities(device).k_only_types
}

/// Whether `device` keeps a K/V cache of `k` keys and `v` values ([`device_capabilities`]).
pub fn device_keeps_kv(device: EngineDevice, k: CacheType, v: CacheType) -> bool {
    device_capabilities(device).keeps_kv(k.ggml_type(), v.ggml_type())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_model::kv_cache::FlashAttn;
    use hmoe_model::ExpertHome;

    const G: DeviceId = DeviceId::Gpu(0);
    const C: DeviceId = DeviceId::Cpu;
    const CUDA0: EngineDevice = EngineDevice::Cuda(0);

    /// Tensor names of a 2-layer gpt-oss with `dense[l]` and `experts[l]` devices.
    fn names() -> Vec<String> {
        let mut v = vec!["token_embd.weight".to_string(), "output.weight".into()];
        for l in 0..2 {
            for t in [
                "attn_q.weight",
                "attn_k.weight",
                "attn_output.weight",
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
        gpus: &[EngineDevice],
        arch: &str,
        kv: KvType,
        dense: [DeviceId; 2],
        experts: [DeviceId; 2],
    ) -> EngineChoice {
        let names = names();
        let devs = devices(&names, dense, experts);
        let tensors: Vec<(&str, DeviceId)> = names.iter().map(String::as_str).zip(devs).collect();
        choose_engine(&EngineInputs {
            devices: gpus,
            why_no_gpu: Some("no CUDA driver (libcuda not found)"),
            arch: Some(arch),
            kv,
            n_layer: 2,
            tensors: &tensors,
            gpu_types: &[],
            op_offload: Some(32),
        })
    }

    fn why(c: EngineChoice) -> String {
        match c {
            EngineChoice::Cpu { why } => why,
            other => panic!("expected the CPU, got {other:?}"),
        }
    }

    fn homes(c: EngineChoice) -> (EngineDevice, Vec<ExpertHome>, Option<usize>) {
        match c {
            EngineChoice::Device { device, placement } => {
                (device, placement.layers, placement.op_offload_min_batch)
            }
            other => panic!("expected the GPU executor, got {other:?}"),
        }
    }

    #[test]
    fn gpu_executor_with_the_plans_expert_homes() {
        use ExpertHome::{Device as D, Host as H};
        let f16 = KvType::F16;
        assert_eq!(
            homes(choose(&[CUDA0], "gpt-oss", f16, [G, G], [G, G])),
            (CUDA0, vec![D, D], Some(32)),
            "-ngl all"
        );
        assert_eq!(
            homes(choose(&[CUDA0], "gpt-oss", f16, [G, G], [C, C])),
            (CUDA0, vec![H, H], Some(32)),
            "-ngl all --cpu-moe"
        );
        assert_eq!(
            homes(choose(&[CUDA0], "gpt-oss", f16, [G, G], [C, G])),
            (CUDA0, vec![H, D], Some(32)),
            "--n-cpu-moe 1"
        );
        assert_eq!(
            homes(choose(
                &[EngineDevice::Cuda(3)],
                "gpt-oss",
                f16,
                [G, G],
                [G, G]
            ))
            .0,
            EngineDevice::Cuda(3),
            "the plan's GPU 0 is the first --device"
        );
        let ref0 = EngineDevice::Ref0 { budget: 1 << 30 };
        assert_eq!(
            homes(choose(&[ref0], "gpt-oss", f16, [G, G], [C, G])),
            (ref0, vec![H, D], Some(32)),
            "REF0 takes what a GPU would"
        );
        // Quantized and f32 K/V stay on the device: every type on REF0, f32/q8_0/q4_0 on CUDA.
        let q8k_f16v = KvType::new(CacheType::Q8_0, CacheType::F16, FlashAttn::Off).unwrap();
        let on_cuda = choose(&[CUDA0], "gpt-oss", q8k_f16v, [G, G], [G, G]);
        assert_eq!(homes(on_cuda).0, CUDA0, "block keys with f16 values");
        for kv in ["f32", "q8_0", "q4_0"] {
            let ty = KvType::parse(kv).unwrap();
            assert_eq!(
                homes(choose(&[CUDA0], "gpt-oss", ty, [G, G], [G, G])).0,
                CUDA0
            );
        }
        for kv in ["bf16", "q4_1", "q5_0", "q5_1"] {
            let ty = KvType::parse(kv).unwrap();
            assert_eq!(
                homes(choose(&[ref0], "gpt-oss", ty, [G, G], [G, G])).0,
                ref0
            );
        }
    }

    /// DeepSeek's latent (K-only) cache: REF0 and CUDA keep every `-ctk` type (`-ctv` unused,
    /// whatever pair it would make).
    #[test]
    fn latent_cache_types_by_device() {
        let ref0 = EngineDevice::Ref0 { budget: 1 << 30 };
        for dev in [ref0, CUDA0] {
            for kv in ["f16", "q8_0", "q4_0", "f32", "bf16", "q5_1"] {
                let ty = KvType::parse(kv).unwrap();
                assert_eq!(
                    homes(choose(&[dev], "deepseek2", ty, [G, G], [G, G])).0,
                    dev,
                    "{kv}"
                );
            }
            let q5k_f16v = KvType::new(CacheType::Q5_1, CacheType::F16, FlashAttn::Off).unwrap();
            assert_eq!(
                homes(choose(&[dev], "deepseek2", q5k_f16v, [G, G], [G, G])).0,
                dev
            );
        }
    }

    #[test]
    fn the_cpu_and_why() {
        let f16 = KvType::F16;
        let w = why(choose(&[], "gpt-oss", f16, [G, G], [G, G]));
        assert!(w.contains("no GPU (no CUDA driver"), "{w}");
        let w = why(choose(&[CUDA0], "mamba", f16, [G, G], [G, G]));
        assert!(
            w.contains("gpt-oss") && w.contains("only, this model is mamba"),
            "{w}"
        );
        let bf16 = KvType::parse("bf16").unwrap();
        let w = why(choose(&[CUDA0], "gpt-oss", bf16, [G, G], [G, G]));
        assert!(
            w.contains("CUDA0 does not keep a -ctk bf16 -ctv bf16"),
            "{w}"
        );
        let q8k_q5v = KvType::new(CacheType::Q8_0, CacheType::Q5_0, FlashAttn::On).unwrap();
        let w = why(choose(&[CUDA0], "gpt-oss", q8k_q5v, [G, G], [G, G]));
        assert!(w.contains("-ctk q8_0 -ctv q5_0"), "{w}");
        let w = why(choose(&[CUDA0], "gpt-oss", f16, [C, C], [C, C]));
        assert!(w.contains("no layer on the GPU"), "{w}");
        let w = why(choose(&[CUDA0], "gpt-oss", f16, [C, G], [C, G]));
        assert!(w.contains("1 of 2 layers"), "{w}");
        let w = why(choose(
            &[CUDA0, EngineDevice::Cuda(1)],
            "gpt-oss",
            f16,
            [G, DeviceId::Gpu(1)],
            [G, G],
        ));
        assert!(w.contains("over 2 GPUs"), "{w}");
        let no_plan = choose_engine(&EngineInputs {
            devices: &[CUDA0],
            why_no_gpu: None,
            arch: Some("gpt-oss"),
            kv: f16,
            n_layer: 2,
            tensors: &[],
            gpu_types: &[],
            op_offload: None,
        });
        assert!(why(no_plan).contains("no placement plan"));
        let names = names();
        let mut tensors: Vec<(&str, DeviceId)> = names.iter().map(|n| (n.as_str(), G)).collect();
        tensors.push((ROPE_FREQS, G));
        let llama3 = |device: EngineDevice| {
            choose_engine(&EngineInputs {
                devices: &[device],
                why_no_gpu: None,
                arch: Some("llama"),
                kv: f16,
                n_layer: 2,
                tensors: &tensors,
                gpu_types: &[],
                op_offload: None,
            })
        };
        assert!(why(llama3(CUDA0)).contains("RoPE frequency factors"));
        assert!(
            matches!(
                llama3(EngineDevice::Ref0 { budget: 1 << 30 }),
                EngineChoice::Device { .. }
            ),
            "REF0 applies the factors"
        );
    }

    #[test]
    fn weights_the_device_does_not_multiply_stay_on_the_cpu() {
        let names = names();
        let tensors: Vec<(&str, DeviceId)> = names.iter().map(|n| (n.as_str(), G)).collect();
        let choose = |gpu_types: &[GgmlType]| {
            choose_engine(&EngineInputs {
                devices: &[CUDA0],
                why_no_gpu: None,
                arch: Some("gpt-oss"),
                kv: KvType::F16,
                n_layer: 2,
                tensors: &tensors,
                gpu_types,
                op_offload: None,
            })
        };
        let every = hmoe_cuda::CAPABILITIES.weight_types;
        assert!(matches!(choose(every), EngineChoice::Device { .. }));
        let other = [GgmlType::Q8_0, GgmlType::Q8_1];
        assert!(!hmoe_cuda::CAPABILITIES.multiplies(GgmlType::Q8_1));
        assert!(why(choose(&other)).contains("CUDA0 does not multiply q8_1 weights"));
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
            devices: &[CUDA0],
            why_no_gpu: None,
            arch: Some("gpt-oss"),
            kv: KvType::F16,
            n_layer: 2,
            tensors: &tensors,
            gpu_types: &[],
            op_offload: None,
        });
        assert!(why(c).contains("split between host and device"));
    }

    #[test]
    fn type_lists_read_as_text() {
        use hmoe_quant::GgmlType::{F16, F32, Q4_0};
        assert_eq!(type_list(&[F32, F16, Q4_0]), "f32, f16 and q4_0");
        assert_eq!(type_list(&[F16]), "f16");
        let w = why(choose(
            &[CUDA0],
            "gpt-oss",
            KvType::parse("bf16").unwrap(),
            [G, G],
            [G, G],
        ));
        // The list is the backend's, whatever it holds.
        let cuda = type_list(hmoe_cuda::CAPABILITIES.kv_pair_types);
        assert!(w.ends_with(&format!("(CUDA: {cuda})")), "{w}");
    }

    #[test]
    fn attention_layer_names() {
        assert_eq!(attn_layer("blk.12.attn_output.weight"), Some(12));
        assert_eq!(attn_layer("blk.12.attn_output.bias"), None);
        assert_eq!(attn_layer("blk.x.attn_output.weight"), None);
        assert_eq!(attn_layer("output.weight"), None);
    }
}
