//! `LanguageModel::forward_multi` is batch-invariant: each sequence of a mixed step (prompt
//! chunks and decode tokens of other sequences beside it) gets bit for bit the logits that
//! `forward` gives it alone, for quantized (Q8_0/MXFP4) and F32 weights and both KV types.

mod common;

use common::fixtures;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{KvType, LanguageModel, LogitsWanted, SeqBatch};

const UBATCH: usize = 16;

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

/// A sequence's feeds (prompt chunks, then greedy decode tokens) and the logits of each, alone.
fn solo(
    model: &dyn LanguageModel,
    kv: KvType,
    prompt: &[u32],
    n_decode: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let mut cache = model.new_cache(kv, 256, UBATCH);
    let mut feeds: Vec<Vec<u32>> = prompt.chunks(UBATCH).map(<[u32]>::to_vec).collect();
    let mut logits = Vec::new();
    for f in &feeds {
        logits.push(model.forward(&mut cache, f, LogitsWanted::Last).unwrap());
    }
    for _ in 0..n_decode {
        let next = argmax(logits.last().unwrap());
        feeds.push(vec![next]);
        logits.push(
            model
                .forward(&mut cache, &[next], LogitsWanted::Last)
                .unwrap(),
        );
    }
    (feeds, logits)
}

fn check(file: &str, kv: KvType) {
    let path = fixtures().join("gpt-oss").join(file);
    let model = hmoe_model::load(GgufModel::open(&path, LoadOptions::default()).unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = vec![
        vec![46],
        vec![46, 77, 344, 510, 261],
        (0..37).map(|i| (i * 37 + 11) % 1000).collect(),
        (0..20).map(|i| (i * 13 + 5) % 1000).collect(),
    ];
    let reference: Vec<_> = prompts
        .iter()
        .map(|p| solo(model.as_ref(), kv, p, 6))
        .collect();
    let mut caches: Vec<_> = prompts
        .iter()
        .map(|_| model.new_cache(kv, 256, UBATCH))
        .collect();
    let mut next = vec![0usize; prompts.len()];
    let mut step = 0;
    while (0..prompts.len()).any(|i| next[i] < reference[i].0.len()) {
        // Vary which sequences share a step.
        let members: Vec<usize> = (0..prompts.len())
            .filter(|&i| next[i] < reference[i].0.len() && (step + i) % 3 != 0)
            .collect();
        let members = if members.is_empty() {
            (0..prompts.len())
                .filter(|&i| next[i] < reference[i].0.len())
                .take(1)
                .collect()
        } else {
            members
        };
        let mut seqs: Vec<SeqBatch<'_, '_>> = Vec::new();
        let mut order = Vec::new();
        for (i, cache) in caches.iter_mut().enumerate() {
            if members.contains(&i) {
                let want = (step + i) % 5 != 1;
                seqs.push(SeqBatch {
                    cache,
                    tokens: &reference[i].0[next[i]],
                    logits: want,
                });
                order.push((i, want));
            }
        }
        let out = model.forward_multi(&mut seqs).unwrap();
        drop(seqs);
        for ((i, want), logits) in order.into_iter().zip(out) {
            if want {
                let expect = &reference[i].1[next[i]];
                assert!(
                    logits.len() == expect.len() && logits.iter().zip(expect).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{file} {kv:?}: sequence {i}, feed {} differs from the sequence alone (step {step}, batch {members:?})",
                    next[i]
                );
            } else {
                assert!(logits.is_empty());
            }
            next[i] += 1;
        }
        step += 1;
    }
    for (c, p) in caches.iter().zip(&prompts) {
        assert_eq!(c.n_past(), p.len() + 6);
    }
}

#[test]
fn quantized_weights_are_batch_invariant() {
    check("gptoss-tiny.gguf", KvType::F16);
    check("gptoss-tiny.gguf", KvType::F32);
}

#[test]
fn flash_attention_and_quantized_caches_are_batch_invariant() {
    use hmoe_model::kv_cache::{CacheType, FlashAttn};
    let fa = |k, v| KvType::new(k, v, FlashAttn::On).unwrap();
    check("gptoss-tiny.gguf", fa(CacheType::F16, CacheType::F16));
    // Block-quantized caches need heads of whole blocks: head size 64 here.
    check("gptoss-small.gguf", fa(CacheType::Q8_0, CacheType::Q4_0));
    check("gptoss-openai.gguf", fa(CacheType::BF16, CacheType::Q8_0));
}

#[test]
fn f32_weights_are_batch_invariant() {
    check("gptoss-openai.gguf", KvType::F32);
    check("gptoss-openai-f32experts.gguf", KvType::F16);
}

#[test]
fn errors_leave_no_sequence_half_run() {
    let path = fixtures().join("gpt-oss/gptoss-tiny.gguf");
    let model = hmoe_model::load(GgufModel::open(&path, LoadOptions::default()).unwrap()).unwrap();
    let mut a = model.new_cache(KvType::F16, 8, UBATCH);
    let mut b = model.new_cache(KvType::F16, 8, UBATCH);
    let bad = [5000u32];
    let mut seqs = [
        SeqBatch {
            cache: &mut a,
            tokens: &[1, 2],
            logits: true,
        },
        SeqBatch {
            cache: &mut b,
            tokens: &bad,
            logits: true,
        },
    ];
    assert!(model.forward_multi(&mut seqs).is_err());
    let long = [1u32; 9];
    let mut seqs = [
        SeqBatch {
            cache: &mut a,
            tokens: &[1, 2],
            logits: true,
        },
        SeqBatch {
            cache: &mut b,
            tokens: &long,
            logits: true,
        },
    ];
    assert!(model.forward_multi(&mut seqs).is_err());
    assert_eq!((a.n_past(), b.n_past()), (0, 0));
    // Heads of 16 are not whole q8_0 blocks: refused as forward refuses it.
    use hmoe_model::kv_cache::{CacheType, FlashAttn};
    let q8 = KvType::new(CacheType::Q8_0, CacheType::Q8_0, FlashAttn::On).unwrap();
    let mut c = model.new_cache(q8, 8, UBATCH);
    let mut d = model.new_cache(q8, 8, UBATCH);
    let mut seqs = [
        SeqBatch {
            cache: &mut c,
            tokens: &[1, 2],
            logits: true,
        },
        SeqBatch {
            cache: &mut d,
            tokens: &[3],
            logits: true,
        },
    ];
    assert!(model.forward_multi(&mut seqs).is_err());
}
