//! The device executor's caches as a server's slots use them
//! ([`LanguageModel::retain_caches`], [`LanguageModel::cache_held`],
//! [`LanguageModel::device_memory`]) on the reference device: a busy sequence's cache is never
//! freed to make room, an idle one's is (and then reads as not held), caches of handles outside
//! the lists are freed at once, and a new sequence with no room left is an out-of-memory error
//! naming the device.

mod common;

use common::fixtures;
use hmoe_backend::Ref0;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{
    DeviceModel, ExpertHome, ExpertPlacement, KvCache, KvType, LanguageModel, LogitsWanted,
};

const UBATCH: usize = 16;
const N_CTX: usize = 64;

fn open() -> GgufModel {
    let path = fixtures().join("gpt-oss").join("gptoss-tiny.gguf");
    GgufModel::open(path, LoadOptions::default()).unwrap()
}

#[test]
fn busy_caches_stay_idle_ones_make_room() {
    let n_layer = open().metadata().get_u64("gpt-oss.block_count").unwrap() as usize;
    let placement = ExpertPlacement::all(n_layer, ExpertHome::Device);
    // The weights and one sequence's cache, measured on an unlimited device.
    let probe = DeviceModel::load(open(), Ref0::new(), &placement).unwrap();
    let weights = probe.device().bytes_held();
    let mut c = probe.new_cache(KvType::F16, N_CTX, UBATCH);
    probe.forward(&mut c, &[1], LogitsWanted::Last).unwrap();
    // Beside them the device holds the step's scratch buffers, kept for the next step.
    let kv = probe.device().bytes_held() - weights - probe.scratch_held_bytes();
    assert_eq!(kv, probe.kv_bytes(&c));
    // Room for two caches, a micro-batch's scratch, and half a cache more.
    let budget = weights + 2 * kv + probe.scratch_bytes(UBATCH) + kv / 2;
    let dev = DeviceModel::load(open(), Ref0::with_budget(budget), &placement).unwrap();
    let m: &dyn LanguageModel = &dev;
    assert_eq!(m.device_memory().unwrap().kv_bytes, 0);
    let mut caches: Vec<KvCache> = (0..3)
        .map(|_| m.new_cache(KvType::F16, N_CTX, UBATCH))
        .collect();
    for (i, c) in caches.iter_mut().take(2).enumerate() {
        m.forward(c, &[3 + i as u32, 9, 27], LogitsWanted::Last)
            .unwrap();
    }
    let [a, b, c] = &mut caches[..] else {
        unreachable!()
    };
    m.retain_caches(&[a], &[b, c]);
    let mem = m.device_memory().unwrap();
    assert_eq!(mem.device, "REF0");
    assert_eq!(
        (mem.weight_bytes, mem.kv_bytes),
        (dev.weight_bytes(), 2 * kv)
    );
    assert_eq!(mem.free_bytes, Some(budget - dev.device().bytes_held()));
    assert!(m.cache_held(a) && m.cache_held(b));

    // `a` was used least recently, but it is busy: `b`'s cache makes room for `c`.
    m.forward(c, &[5], LogitsWanted::Last).unwrap();
    assert!(m.cache_held(a) && !m.cache_held(b) && m.cache_held(c));
    m.forward(a, &[5], LogitsWanted::Last).unwrap();
    let e = m.forward(b, &[5], LogitsWanted::Last).unwrap_err();
    assert!(e.to_string().contains("starts at 0"), "{e}");
    b.clear();
    assert!(m.cache_held(b), "a cleared handle can start");

    // Handles outside the lists lose their caches at once.
    m.retain_caches(&[a], &[]);
    assert_eq!(m.device_memory().unwrap().kv_bytes, kv);
    assert!(!m.cache_held(c));

    // Busy sequences only: each new one takes room until there is none, and none of them is
    // freed for the next.
    let mut busy: Vec<KvCache> = Vec::new();
    let oom = loop {
        let mut next = m.new_cache(KvType::F16, N_CTX, UBATCH);
        let mut live: Vec<&KvCache> = vec![a];
        live.extend(busy.iter());
        live.push(&next);
        m.retain_caches(&live, &[]);
        drop(live);
        match m.forward(&mut next, &[7], LogitsWanted::Last) {
            Ok(_) => busy.push(next),
            Err(e) => break e.to_string(),
        }
        assert!(busy.len() < 1000, "the device never ran out");
    };
    assert!(oom.contains("REF0: out of memory"), "{oom}");
    assert!(!busy.is_empty() && busy.iter().all(|b| m.cache_held(b)));
    assert!(m.cache_held(a));
}
