//! Tokenizer throughput on wikitext-2 (a benchmark, not a check): run with
//! `cargo test -p hmoe-tokenizer --release --test speed -- --ignored --nocapture`
//! (`HMOE_SPEED_VOCAB=o200k` restricts it to the vocabularies whose file name contains that).

mod common;

use std::time::Instant;

use common::{fixtures, load};

#[test]
#[ignore = "benchmark"]
fn wiki_test_raw_throughput() {
    let text =
        std::fs::read_to_string(fixtures().join("corpus/wiki.test.raw")).expect("wiki.test.raw");
    let mb = text.len() as f64 / 1e6;
    for vocab in [
        "ggml-vocab-o200k-harmony.gguf",
        "ggml-vocab-qwen2.gguf",
        "ggml-vocab-llama-bpe.gguf",
        "ggml-vocab-deepseek-llm.gguf",
        "ggml-vocab-llama-spm.gguf",
    ] {
        if std::env::var("HMOE_SPEED_VOCAB").is_ok_and(|v| !vocab.contains(&v)) {
            continue;
        }
        let t0 = Instant::now();
        let tok = load(&format!("tokenizer/{vocab}"));
        let load_s = t0.elapsed().as_secs_f64();
        let mut best = f64::MAX;
        let mut n = 0;
        let reps = std::env::var("HMOE_SPEED_REPS")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(3);
        for _ in 0..reps {
            let t = Instant::now();
            n = tok.encode(&text, false, false).expect("encode").len();
            best = best.min(t.elapsed().as_secs_f64());
        }
        let t = Instant::now();
        if let Some(words) = tok.pre_tokenize(&text).expect("split") {
            let split_s = t.elapsed().as_secs_f64();
            println!(
                "  pre-tokenizer alone: {} words, {:.1} MB/s",
                words.len(),
                mb / split_s
            );
        }
        let t = Instant::now();
        let with_special = tok.encode(&text, true, true).expect("encode").len();
        let special_s = t.elapsed().as_secs_f64();
        println!(
            "{vocab}: load {load_s:.2} s; {n} tokens; {:.1} MB/s ({best:.3} s for {mb:.2} MB); parse_special: {:.1} MB/s ({with_special} tokens)",
            mb / best,
            mb / special_s
        );
    }
}
