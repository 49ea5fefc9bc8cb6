//! Constraints over real vocabularies (the 201k-token o200k harmony tokenizer, a 1k test
//! vocabulary): with random logits, i.e. a model that knows nothing, every output is valid.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_grammar::{Frame, Grammar, GrammarError, Tool, ToolFormat, Vocab};
use hmoe_tokenizer::Tokenizer;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use hmoe_testdata::fixtures;

fn tokenizer(rel: &str) -> Arc<Tokenizer> {
    let g = GgufModel::open(fixtures().join(rel), LoadOptions::default()).expect("fixture");
    Arc::new(Tokenizer::from_metadata(g.metadata()).expect("tokenizer"))
}

fn o200k() -> Arc<Tokenizer> {
    tokenizer("tokenizer/ggml-vocab-o200k-harmony.gguf")
}

/// The o200k tokenizer and its vocabulary, built once for the tests that share it.
fn o200k_vocab() -> (Arc<Tokenizer>, Arc<Vocab>) {
    static BUILT: OnceLock<(Arc<Tokenizer>, Arc<Vocab>)> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let tok = o200k();
            let t0 = Instant::now();
            let vocab = Arc::new(Vocab::new(&tok).unwrap());
            eprintln!(
                "o200k trie built in {:.0} ms",
                t0.elapsed().as_secs_f64() * 1e3
            );
            (tok, vocab)
        })
        .clone()
}

/// Generates with random logits under `grammar`; returns the tokens and the mean ms spent in
/// the mask per token.
fn generate(
    vocab: &Vocab,
    tok: &Tokenizer,
    grammar: &Grammar,
    frame: Frame,
    seed: u64,
) -> (Vec<u32>, f64) {
    let mut c = vocab.compile(grammar, frame).expect("compiles");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut mask_s = 0.0;
    let mut logits = vec![0f32; tok.n_vocab()];
    for _ in 0..400 {
        for l in logits.iter_mut() {
            *l = rng.random::<f32>() * 4.0;
        }
        let t0 = Instant::now();
        c.mask(&mut logits).expect("mask");
        mask_s += t0.elapsed().as_secs_f64();
        // Sample among the allowed tokens in proportion to exp(logit) (temperature 1).
        let allowed: Vec<(usize, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, l)| (i, l.exp()))
            .collect();
        let total: f32 = allowed.iter().map(|(_, w)| w).sum();
        let mut r = rng.random::<f32>() * total;
        let mut pick = allowed[allowed.len() - 1].0 as u32;
        for &(i, w) in &allowed {
            if r < w {
                pick = i as u32;
                break;
            }
            r -= w;
        }
        c.accept(pick).expect("accept");
        out.push(pick);
        if tok.is_eog(pick) || c.is_finished() {
            return (out.clone(), mask_s * 1e3 / out.len() as f64);
        }
    }
    panic!("no end after 400 tokens: {:?}", tok.decode_lossy(&out));
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "mood": {"enum": ["happy", "sad"]}
        },
        "required": ["name", "age", "mood"],
        "additionalProperties": false
    })
}

fn check_person(v: &Value) {
    let o = v.as_object().expect("an object");
    assert_eq!(o.len(), 3, "{v}");
    assert!(
        o["name"].as_str().is_some_and(|s| s.chars().count() <= 12),
        "{v}"
    );
    assert!(o["age"].as_u64().is_some_and(|a| a <= 150), "{v}");
    assert!(
        ["happy", "sad"].contains(&o["mood"].as_str().unwrap()),
        "{v}"
    );
}

#[test]
fn json_schema_output_is_valid_at_the_o200k_vocabulary() {
    let (tok, vocab) = o200k_vocab();
    let grammar = Grammar::JsonSchema(person_schema());
    let mut ms = Vec::new();
    for seed in 0..4 {
        let (ids, per_token) = generate(&vocab, &tok, &grammar, Frame::Raw, seed);
        let end = ids.len() - usize::from(ids.last().is_some_and(|&t| tok.is_eog(t)));
        let body = tok.decode_lossy(&ids[..end]);
        check_person(&serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")));
        ms.push(per_token);
    }
    eprintln!(
        "json_schema mask at n_vocab {}: {ms:.3?} ms per token",
        tok.n_vocab()
    );
}

#[test]
fn harmony_tool_calls_and_final_messages_have_the_parser_s_shape() {
    let (tok, vocab) = o200k_vocab();
    assert_eq!(ToolFormat::detect(&tok), Some(ToolFormat::Harmony));
    let tools = vec![
        Tool {
            name: "get_weather".into(),
            parameters: Some(
                json!({"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": false}),
            ),
        },
        Tool {
            name: "get_time".into(),
            parameters: Some(
                json!({"type": "object", "properties": {}, "additionalProperties": false}),
            ),
        },
    ];
    let grammar = Grammar::ToolCall {
        format: ToolFormat::Harmony,
        tools,
    };
    for seed in 0..3 {
        let (ids, _) = generate(&vocab, &tok, &grammar, Frame::Raw, seed);
        let text = tok.decode_lossy(&ids);
        let rest = text
            .strip_prefix("<|channel|>commentary to=functions.")
            .unwrap_or_else(|| panic!("{text}"));
        let (name, rest) = rest
            .split_once(" <|constrain|>json<|message|>")
            .unwrap_or_else(|| panic!("{text}"));
        let args = rest
            .strip_suffix("<|call|>")
            .unwrap_or_else(|| panic!("{text}"));
        let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {text}"));
        match name {
            "get_weather" => assert!(
                ["Paris", "Oslo"].contains(&v["city"].as_str().unwrap()),
                "{text}"
            ),
            "get_time" => assert_eq!(v, json!({}), "{text}"),
            other => panic!("unknown tool {other}: {text}"),
        }
        // The markup is the markup tokens, not text spelling them.
        assert_eq!(ids[0], tok.token_id("<|channel|>").unwrap(), "{text}");
    }
    let (ids, _) = generate(
        &vocab,
        &tok,
        &Grammar::JsonSchema(person_schema()),
        Frame::HarmonyFinal,
        7,
    );
    let text = tok.decode_lossy(&ids);
    let body = text
        .strip_prefix("<|channel|>final<|message|>")
        .and_then(|t| t.strip_suffix("<|return|>"))
        .unwrap_or_else(|| panic!("{text}"));
    check_person(&serde_json::from_str(body).unwrap());
}

#[test]
fn a_framed_grammar_that_allows_nothing_is_refused_at_compile() {
    let (_, vocab) = o200k_vocab();
    let e = vocab
        .compile(
            &Grammar::JsonSchema(json!({"$ref": "#"})),
            Frame::HarmonyFinal,
        )
        .unwrap_err();
    assert!(e.to_string().contains("allows no output"), "{e}");
}

#[test]
fn gbnf_grammars_constrain_and_bad_ones_are_refused_with_the_parser_s_message() {
    let tok = tokenizer("tokenizer/vocab-1k.gguf");
    let vocab = Vocab::new(&tok).unwrap();
    let g = Grammar::Gbnf("root ::= (\"yes\" | \"no\") \"!\" [0-9]{1,2}\n".into());
    for seed in 0..5 {
        let (ids, _) = generate(&vocab, &tok, &g, Frame::Raw, seed);
        let text = tok.decode_lossy(&ids);
        let text = text.trim_end_matches(|c: char| !c.is_ascii_digit());
        let (word, digits) = text.split_once('!').unwrap_or_else(|| panic!("{text:?}"));
        assert!(word == "yes" || word == "no", "{text:?}");
        assert!(
            (1..=2).contains(&digits.len()) && digits.chars().all(|c| c.is_ascii_digit()),
            "{text:?}"
        );
    }
    let err = vocab
        .compile(&Grammar::Gbnf("root ::= (".into()), Frame::Raw)
        .unwrap_err();
    assert!(matches!(err, GrammarError::Gbnf(_)), "{err}");
    assert!(err.to_string().contains("expecting ')'"), "{err}");
    let err = vocab
        .compile(&Grammar::JsonSchema(json!({"type": 12})), Frame::Raw)
        .unwrap_err();
    assert!(matches!(err, GrammarError::Invalid(_)), "{err}");
    let err = vocab
        .compile(&Grammar::Lark("start: nothing_here".into()), Frame::Raw)
        .unwrap_err();
    assert!(matches!(err, GrammarError::Invalid(_)), "{err}");
    assert!(vocab.compile(&Grammar::JsonObject, Frame::Raw).is_ok());
}
