//! llama.cpp's tokenizer test vectors (`.inp` / `.out`) for every vocabulary in the fixtures, plus
//! the o200k-harmony set whose reference is OpenAI tiktoken.

mod common;

use common::{fixtures, load};

/// The cases of a `.inp` file (read as bytes: no newline translation) and the ids of its `.out`.
fn cases(vocab: &str, out_suffix: &str) -> Vec<(String, Vec<u32>)> {
    let dir = fixtures().join("tokenizer");
    let inp = std::fs::read(dir.join(format!("{vocab}.inp"))).expect("read .inp");
    let out = std::fs::read(dir.join(format!("{vocab}{out_suffix}"))).expect("read .out");
    let inp = String::from_utf8(inp).expect(".inp is UTF-8");
    let out = String::from_utf8(out).expect(".out is UTF-8");
    let mut texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let mut lines: Vec<&str> = out.split('\n').collect();
    // Both files end with a separator / newline.
    assert_eq!(texts.pop(), Some(""));
    assert_eq!(lines.pop(), Some(""));
    assert_eq!(texts.len(), lines.len(), "{vocab}: case count");
    texts
        .into_iter()
        .zip(lines)
        .map(|(t, l)| {
            (
                t.to_string(),
                l.split_whitespace()
                    .map(|x| x.parse().expect("id"))
                    .collect(),
            )
        })
        .collect()
}

/// Runs every case; returns the indices of the failing ones (printing the differences).
fn run(vocab: &str, out_suffix: &str) -> (usize, Vec<usize>) {
    let tok = load(&format!("tokenizer/{vocab}"));
    let cases = cases(vocab, out_suffix);
    let mut failed = Vec::new();
    for (i, (text, want)) in cases.iter().enumerate() {
        let got = tok.encode(text, false, true).expect("encode");
        if &got != want {
            eprintln!("{vocab} case {i} {text:?}\n  want {want:?}\n  got  {got:?}");
            failed.push(i);
        }
        // Detokenization gives the text back (these vocabularies are lossless on these cases).
        if tok.vocab_type() == hmoe_tokenizer::VocabType::Bpe {
            assert_eq!(
                tok.decode(&got),
                text.as_bytes(),
                "{vocab} case {i}: decode"
            );
        }
    }
    eprintln!(
        "{vocab}: {}/{} cases identical",
        cases.len() - failed.len(),
        cases.len()
    );
    (cases.len(), failed)
}

fn check(vocab: &str, n: usize) {
    let (total, failed) = run(vocab, ".out");
    assert_eq!(total, n, "{vocab}: case count");
    assert!(failed.is_empty(), "{vocab}: failing cases {failed:?}");
}

#[test]
fn qwen2() {
    check("ggml-vocab-qwen2.gguf", 46);
}

#[test]
fn llama_bpe() {
    check("ggml-vocab-llama-bpe.gguf", 46);
}

#[test]
fn llama_spm() {
    check("ggml-vocab-llama-spm.gguf", 46);
}

#[test]
fn gpt_2() {
    check("ggml-vocab-gpt-2.gguf", 46);
}

#[test]
fn deepseek_llm() {
    check("ggml-vocab-deepseek-llm.gguf", 46);
}

#[test]
fn deepseek_coder() {
    check("ggml-vocab-deepseek-coder.gguf", 46);
}

#[test]
fn o200k_harmony_matches_tiktoken() {
    check("ggml-vocab-o200k-harmony.gguf", 49);
}

/// Two vocabularies used alternately on one thread: the per-thread word cache must not leak
/// results from one tokenizer into the other.
#[test]
fn interleaved_vocabularies_on_one_thread() {
    let a = load("tokenizer/ggml-vocab-gpt-2.gguf");
    let b = load("tokenizer/ggml-vocab-qwen2.gguf");
    let ca = cases("ggml-vocab-gpt-2.gguf", ".out");
    let cb = cases("ggml-vocab-qwen2.gguf", ".out");
    for _ in 0..2 {
        for ((ta, wa), (tb, wb)) in ca.iter().zip(&cb) {
            assert_eq!(&a.encode(ta, false, true).unwrap(), wa, "gpt-2 {ta:?}");
            assert_eq!(&b.encode(tb, false, true).unwrap(), wb, "qwen2 {tb:?}");
        }
    }
}
