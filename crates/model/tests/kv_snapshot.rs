//! A sequence's K/V read out of the device and written back ([`LanguageModel::export_kv`],
//! [`LanguageModel::import_kv`]): a sequence restored into a fresh handle continues with
//! exactly the logits of the uninterrupted one, on the CPU and on REF0, across the two
//! (rows in the contract's layout), for f16 and a rotated block type, with the sliding
//! layers' rings wrapped; a snapshot of another geometry or a damaged one is refused and
//! leaves the handle usable.

mod common;

use common::fixtures;
use hmoe_backend::Ref0;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvSnapshot, KvType, LanguageModel, LogitsWanted,
};

const N_CTX: usize = 96;
const UBATCH: usize = 8;

fn open() -> GgufModel {
    let path = fixtures().join("gpt-oss").join("gptoss-small.gguf");
    GgufModel::open(path, LoadOptions::default()).unwrap()
}

fn cpu() -> Box<dyn LanguageModel> {
    hmoe_model::load(open()).unwrap()
}

fn ref0() -> Box<dyn LanguageModel> {
    let n_layer = open().metadata().get_u64("gpt-oss.block_count").unwrap() as usize;
    let placement = ExpertPlacement::all(n_layer, ExpertHome::Device);
    Box::new(DeviceModel::load(open(), Ref0::new(), &placement).unwrap())
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt) % 200 + 1).collect()
}

/// The snapshot of `prefix` run on `from`.
fn saved(from: &dyn LanguageModel, ty: KvType, prefix: &[u32]) -> KvSnapshot {
    let mut c = from.new_cache(ty, N_CTX, UBATCH);
    from.forward(&mut c, prefix, LogitsWanted::Last).unwrap();
    let snap = from.export_kv(&c).unwrap();
    assert_eq!(snap.n_past, prefix.len());
    assert!(snap.bytes() > 0);
    snap
}

/// The logits of `rest` after `prefix`, run uninterrupted on `m`.
fn continued(m: &dyn LanguageModel, ty: KvType, prefix: &[u32], rest: &[u32]) -> Vec<f32> {
    let mut c = m.new_cache(ty, N_CTX, UBATCH);
    m.forward(&mut c, prefix, LogitsWanted::Last).unwrap();
    m.forward(&mut c, rest, LogitsWanted::Last).unwrap()
}

/// The logits of `rest` on `m` after `snap` is restored into a fresh handle.
fn restored(m: &dyn LanguageModel, ty: KvType, snap: &KvSnapshot, rest: &[u32]) -> Vec<f32> {
    let mut c = m.new_cache(ty, N_CTX, UBATCH);
    m.import_kv(&mut c, snap).unwrap();
    assert_eq!(c.n_past(), snap.n_past);
    assert!(m.cache_held(&c));
    m.forward(&mut c, rest, LogitsWanted::Last).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_restored_sequence_continues_bit_for_bit_on_cpu_and_ref0() {
    let (cpu, ref0) = (cpu(), ref0());
    // 70 positions: past the sliding layers' rings (window 8 + micro-batch 8) of gptoss-small;
    // heads of 64: q8_0 rings are rotated.
    let (prefix, rest) = (tokens(70, 3), tokens(5, 11));
    for ty in [KvType::F16, KvType::F32, KvType::parse("q8_0").unwrap()] {
        let snap = saved(cpu.as_ref(), ty, &prefix);
        let want_cpu = continued(cpu.as_ref(), ty, &prefix, &rest);
        let want_ref0 = continued(ref0.as_ref(), ty, &prefix, &rest);
        assert_eq!(
            bits(&restored(cpu.as_ref(), ty, &snap, &rest)),
            bits(&want_cpu)
        );
        // Rows in the contract's layout: a CPU snapshot restores on REF0 as well.
        assert_eq!(
            bits(&restored(ref0.as_ref(), ty, &snap, &rest)),
            bits(&want_ref0)
        );
        let back = saved(ref0.as_ref(), ty, &prefix);
        assert_eq!(back, snap, "{ty:?}: REF0 and the CPU store the same rows");
    }
}

#[test]
fn foreign_or_damaged_snapshots_are_refused_and_the_handle_stays_usable() {
    let m = cpu();
    let ty = KvType::F16;
    let prefix = tokens(20, 5);
    let snap = saved(m.as_ref(), ty, &prefix);
    let check = |snap: &KvSnapshot, n_ctx: usize, what: &str| {
        let mut c = m.new_cache(ty, n_ctx, UBATCH);
        let e = m.import_kv(&mut c, snap).unwrap_err();
        assert!(e.to_string().contains("saved K/V"), "{what}: {e}");
        assert_eq!(c.n_past(), 0, "{what}");
        m.forward(&mut c, &[1, 2], LogitsWanted::Last).unwrap();
    };
    check(&snap, N_CTX / 2, "another context size");
    let mut short = snap.clone();
    short.layers[1].k.data.pop();
    check(&short, N_CTX, "a row cut short");
    let mut fewer = snap.clone();
    fewer.layers.pop();
    check(&fewer, N_CTX, "a layer missing");
    let mut long = snap.clone();
    long.n_past = N_CTX + 1;
    check(&long, N_CTX, "more positions than the context");
    let mut c = m.new_cache(KvType::parse("q8_0").unwrap(), N_CTX, UBATCH);
    assert!(m.import_kv(&mut c, &snap).is_err(), "other K/V types");
    // An empty snapshot empties the handle.
    let mut c = m.new_cache(ty, N_CTX, UBATCH);
    m.forward(&mut c, &prefix, LogitsWanted::Last).unwrap();
    m.import_kv(&mut c, &KvSnapshot::default()).unwrap();
    assert_eq!(c.n_past(), 0);
}
