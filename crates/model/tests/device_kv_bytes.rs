//! The device executor's K/V rings take what the memory estimate (`hmoe fit`, the placement
//! plan) says they take: per type, the bytes REF0 holds for one sequence's cache are the
//! plan's `kv` of the device, for f16, q8_0, q4_0 and f32 K/V (a context and micro-batch
//! where llama.cpp's padding of the sliding-window ring to 256 cells changes nothing:
//! 512 cells for the full layers, 8 + 248 = 256 for the sliding ones).

mod common;
use common::fixtures;
use hmoe_backend::Ref0;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::kv_cache::{CacheType, FlashAttn};
use hmoe_model::{DeviceModel, ExpertHome, ExpertPlacement, KvType, LanguageModel, LogitsWanted};
use hmoe_placement::{plan, DeviceBudget, GpuLayers, PlacementFlags, TensorDesc};

const FILE: &str = "gptoss-small.gguf";
const N_CTX: usize = 512;
const UBATCH: usize = 248;

fn open() -> GgufModel {
    GgufModel::open(
        fixtures().join("gpt-oss").join(FILE),
        LoadOptions::default(),
    )
    .unwrap()
}

/// The plan's K/V bytes on the GPU for `-ngl all -c 512 -ub 248` and K/V type `ty`.
fn estimate(ty: CacheType) -> u64 {
    let m = open();
    let shape = hmoe_model::model_shape(&m).unwrap();
    let tensors: Vec<TensorDesc> = m.tensors().iter().map(TensorDesc::from).collect();
    let flags = PlacementFlags {
        n_gpu_layers: GpuLayers::All,
        ctx_size: Some(N_CTX as u32),
        ubatch_size: UBATCH as u32,
        cache_type_k: ty.ggml_type(),
        cache_type_v: ty.ggml_type(),
        fit: false,
        ..PlacementFlags::default()
    };
    let p = plan(
        &tensors,
        &shape,
        &DeviceBudget::with_gpus(&[4 << 30]),
        &flags,
    )
    .unwrap();
    assert_eq!(
        (p.kv_cells_full, p.kv_cells_swa),
        (N_CTX as u32, 256),
        "no padding"
    );
    p.devices[1].kv
}

#[test]
fn device_kv_bytes_are_the_estimates_for_every_device_type() {
    let n_layer = open().metadata().get_u64("gpt-oss.block_count").unwrap() as usize;
    let placement = ExpertPlacement::all(n_layer, ExpertHome::Device);
    let dev = DeviceModel::load(open(), Ref0::new(), &placement).unwrap();
    let mut measured = Vec::new();
    // Each sequence's rings stay on the device while its handle lives (kept here).
    let mut caches = Vec::new();
    for ty in [
        CacheType::F16,
        CacheType::Q8_0,
        CacheType::Q4_0,
        CacheType::F32,
    ] {
        // Device memory less the scratch buffers the executor keeps between steps.
        let held = || dev.device().bytes_held() - dev.scratch_held_bytes();
        let before = held();
        let kv = KvType::new(ty, ty, FlashAttn::On).unwrap();
        let mut cache = dev.new_cache(kv, N_CTX, UBATCH);
        dev.forward(&mut cache, &[1, 2, 3], LogitsWanted::Last)
            .unwrap();
        // What the step added beside its scratch buffers is this cache's rings.
        let bytes = held() - before;
        assert_eq!(bytes, estimate(ty), "{ty}");
        measured.push(bytes);
        caches.push(cache);
    }
    // q8_0 holds 34 bytes per 32 values, q4_0 18, against f16's 64 and f32's 128.
    assert_eq!(measured[0] * 34, measured[1] * 64);
    assert_eq!(measured[0] * 18, measured[2] * 64);
    assert_eq!(measured[0] * 2, measured[3]);
}
