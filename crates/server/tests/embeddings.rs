//! `--embedding` and `--reranking` end to end on the tiny gpt-oss fixture: the vectors are the
//! model's final hidden states after the output norm (the same bits as the model's own
//! `LogitsWanted::Hidden` pass over the same tokens), pooled as `--pooling` says and
//! normalized as `embd_normalize` says; llama-server's and OpenAI's answer shapes, base64,
//! usage; the rerank routes' shapes and scores; and the 4xx/501 answers to what is refused.

mod common;

use common::*;
use hmoe_model::LogitsWanted;
use hmoe_server::embeddings::{normalize, Pooling};
use serde_json::{json, Value};

const TEXT: &str = "I believe the meaning of life is";

/// The model's hidden states of `tokens` (`n_embd` per token), computed in the test with the
/// server's K/V type and micro-batch, in a cache of the prompt's size.
fn hidden(tokens: &[u32]) -> (Vec<f32>, usize) {
    let g = hmoe_gguf::GgufModel::open(tiny_model(), Default::default()).unwrap();
    let model = hmoe_model::load(g).unwrap();
    let e = tiny_config().engine;
    let mut cache = model.new_cache(e.kv_type, tokens.len(), e.n_ubatch);
    let rows = (model.forward(&mut cache, tokens, LogitsWanted::Hidden)).unwrap();
    (rows, model.n_embd())
}

fn floats(v: &Value) -> Vec<f32> {
    (v.as_array().expect("an array of numbers").iter())
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// The error message of an error answer.
fn message(r: &Resp) -> String {
    r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn ids(a: std::net::SocketAddr, text: &str, add_special: bool) -> Vec<u32> {
    let r = post(
        a,
        "/tokenize",
        &json!({"content": text, "add_special": add_special, "parse_special": add_special}),
    );
    (r.json()["tokens"].as_array().unwrap().iter())
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn server(pooling: Option<Pooling>, reranking: bool) -> hmoe_server::RunningServer {
    let mut c = tiny_config();
    c.embeddings = true;
    c.pooling = pooling;
    if reranking {
        c.pooling = Some(Pooling::Rank);
    }
    start(c)
}

#[test]
fn pooling_none_gives_every_tokens_hidden_state() {
    let s = server(None, false);
    let a = s.local_addr();
    let tokens = ids(a, TEXT, true);
    let (want, n_embd) = hidden(&tokens);
    for route in ["/embedding", "/embeddings"] {
        for field in ["content", "input"] {
            let r = post(a, route, &json!({ field: TEXT }));
            assert_eq!(r.status, 200, "{route} {field}: {}", r.body);
            let body = r.json();
            let answers = body.as_array().expect("llama-server's array");
            assert_eq!(answers.len(), 1);
            assert_eq!(answers[0]["index"], 0);
            let rows = answers[0]["embedding"].as_array().unwrap();
            assert_eq!(rows.len(), tokens.len(), "one vector per token");
            let got: Vec<f32> = rows.iter().flat_map(floats).collect();
            assert_eq!(got.len(), tokens.len() * n_embd);
            // Not normalized, and the model's own bits.
            assert!(
                bits(&got) == bits(&want),
                "{route}: not the model's hidden states"
            );
        }
    }
    // `content` on the OpenAI route answers llama-server's way; `input` is refused there
    // with pooling none, as llama-server refuses it.
    let r = post(a, "/v1/embeddings", &json!({"content": TEXT}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json().is_array());
    let r = post(a, "/v1/embeddings", &json!({"input": TEXT}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("not OAI compatible"), "{}", r.body);
    // Two prompts, ids and text: one answer each, in order.
    let r = post(a, "/embeddings", &json!({"input": [tokens, "hello"]}));
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    assert_eq!(body[0]["embedding"].as_array().unwrap().len(), tokens.len());
    assert_eq!(body[1]["index"], 1);
}

#[test]
fn pooled_embeddings_are_normalized_in_openais_shape() {
    let s = server(Some(Pooling::Last), false);
    let a = s.local_addr();
    let tokens = ids(a, TEXT, true);
    let (rows, n_embd) = hidden(&tokens);
    let last = &rows[(tokens.len() - 1) * n_embd..];

    let r = post(a, "/v1/embeddings", &json!({"input": TEXT, "model": "any"}));
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    assert_eq!(body["object"], "list");
    assert_eq!(body["model"], "any");
    assert_eq!(body["data"][0]["object"], "embedding");
    assert_eq!(body["data"][0]["index"], 0);
    let v = floats(&body["data"][0]["embedding"]);
    assert!(
        bits(&v) == bits(&normalize(last, 2)),
        "the last token's, Euclidean"
    );
    let norm: f64 = v.iter().map(|x| (*x as f64).powi(2)).sum();
    assert!((norm - 1.0).abs() < 1e-3, "{norm}");
    assert_eq!(body["usage"]["prompt_tokens"], tokens.len());
    assert_eq!(body["usage"]["total_tokens"], tokens.len());

    // Each embd_normalize as common_embd_normalize, on llama-server's route.
    for p in [-1i64, 0, 1, 2, 3] {
        let r = post(
            a,
            "/embeddings",
            &json!({"input": TEXT, "embd_normalize": p}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let got = floats(&r.json()[0]["embedding"][0]);
        assert!(
            bits(&got) == bits(&normalize(last, p)),
            "embd_normalize {p}"
        );
    }
    assert_eq!(normalize(last, -1), last);

    // Several prompts: in order, the same prompt the same vector, usage summed.
    let r = post(
        a,
        "/v1/embeddings",
        &json!({"input": [TEXT, "hello", TEXT]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert_eq!(data[2]["index"], 2);
    assert_eq!(data[0]["embedding"], data[2]["embedding"]);
    assert_ne!(data[0]["embedding"], data[1]["embedding"]);
    let hello = ids(a, "hello", true).len();
    assert_eq!(body["usage"]["prompt_tokens"], 2 * tokens.len() + hello);

    // base64: the little-endian f32 bytes of the same vector.
    let r = post(
        a,
        "/v1/embeddings",
        &json!({"input": TEXT, "encoding_format": "base64"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    assert_eq!(body["data"][0]["encoding_format"], "base64");
    let bytes = unbase64(body["data"][0]["embedding"].as_str().unwrap());
    let decoded: Vec<f32> = (bytes.chunks_exact(4))
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert!(bits(&decoded) == bits(&v));
}

#[test]
fn mean_and_cls_pool_the_rows() {
    for pooling in [Pooling::Mean, Pooling::Cls] {
        let s = server(Some(pooling), false);
        let a = s.local_addr();
        let tokens = ids(a, TEXT, true);
        let (rows, n_embd) = hidden(&tokens);
        let want: Vec<f32> = match pooling {
            Pooling::Mean => {
                let w = 1.0 / tokens.len() as f32;
                (0..n_embd)
                    .map(|j| (0..tokens.len()).fold(0f32, |acc, t| acc + rows[t * n_embd + j] * w))
                    .collect()
            }
            _ => rows[..n_embd].to_vec(),
        };
        let r = post(
            a,
            "/embeddings",
            &json!({"input": TEXT, "embd_normalize": -1}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let got = floats(&r.json()[0]["embedding"][0]);
        assert!(bits(&got) == bits(&want), "{pooling:?}");
    }
}

#[test]
fn embedding_requests_refused_with_clear_answers() {
    // Without --embedding: llama-server's 501.
    let s = start(tiny_config());
    let r = post(s.local_addr(), "/v1/embeddings", &json!({"input": TEXT}));
    assert_eq!(r.status, 501, "{}", r.body);
    assert!(
        r.body.contains("Start it with `--embeddings`"),
        "{}",
        r.body
    );
    let r = post(
        s.local_addr(),
        "/rerank",
        &json!({"query": "a", "documents": ["b"]}),
    );
    assert_eq!(r.status, 501, "{}", r.body);
    assert!(r.body.contains("Start it with `--reranking`"), "{}", r.body);
    drop(s);

    let s = server(Some(Pooling::Mean), false);
    let a = s.local_addr();
    let n_vocab = tokenizer(&tiny_model()).n_vocab();
    let many: Vec<&str> = vec!["a"; hmoe_server::embeddings::MAX_INPUTS + 1];
    let long: Vec<u32> = vec![5; 1025];
    let cases = [
        (json!({}), "\"input\" or \"content\" must be provided"),
        (json!({"input": []}), "holds no prompt"),
        (json!({"input": many}), "at most"),
        (json!({"input": [1, n_vocab, 2]}), "outside the vocabulary"),
        (
            json!({"input": [[1, 2], [n_vocab + 7]]}),
            "outside the vocabulary",
        ),
        (json!({"input": long}), "too large"),
        (
            json!({"input": TEXT, "encoding_format": "hex"}),
            "float or base64",
        ),
        (
            json!({"input": TEXT, "embd_normalize": -2}),
            "embd_normalize",
        ),
        (
            json!({"input": TEXT, "embd_normalize": "x"}),
            "embd_normalize",
        ),
        (json!({"input": {"a": 1}}), "prompt"),
        (json!({"input": [-1]}), "prompt"),
    ];
    for (body, why) in cases {
        let r = post(a, "/v1/embeddings", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert!(message(&r).contains(why), "{body}: {} (want {why})", r.body);
    }
    // An empty string is no tokens for a model that adds no BOS.
    let r = post(a, "/v1/embeddings", &json!({"input": ""}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body.contains("Input content cannot be empty"),
        "{}",
        r.body
    );
    // The server still answers.
    let r = post(a, "/v1/embeddings", &json!({"input": TEXT}));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn rerank_scores_pairs_as_llama_server() {
    let s = server(None, true);
    let a = s.local_addr();
    let (query, docs) = ("what is a panda?", ["hi", "it's a bear", "The giant panda"]);
    let r = post(
        a,
        "/v1/rerank",
        &json!({"query": query, "documents": docs, "top_n": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    assert_eq!(body["object"], "list");
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "top_n");
    // Each score is the first value of the pair's first hidden state (no classification
    // head): the pair is the query's tokens then the document's (gpt-oss adds no BOS/EOS).
    let mut n_tokens = 0;
    let mut scores = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        let pair: Vec<u32> = [ids(a, query, false), ids(a, doc, false)].concat();
        n_tokens += pair.len();
        let (rows, _) = hidden(&pair);
        scores.push((i, rows[0]));
    }
    scores.sort_by(|x, y| y.1.total_cmp(&x.1));
    for (r, (i, score)) in results.iter().zip(&scores) {
        assert_eq!(r["index"], *i);
        assert_eq!(
            (r["relevance_score"].as_f64().unwrap() as f32).to_bits(),
            score.to_bits()
        );
        assert!(r.get("text").is_none());
    }
    assert_eq!(body["usage"]["prompt_tokens"], n_tokens);
    for route in ["/rerank", "/reranking", "/v1/reranking"] {
        let r = post(a, route, &json!({"query": query, "documents": docs}));
        assert_eq!(r.status, 200, "{route}: {}", r.body);
        assert_eq!(r.json()["results"].as_array().unwrap().len(), 3);
    }
    // TEI's form: an array of {index, score, text}.
    let r = post(
        a,
        "/rerank",
        &json!({"query": query, "texts": docs, "return_text": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    let arr = body.as_array().expect("TEI answers an array");
    assert_eq!(arr.len(), 3);
    for e in arr {
        let i = e["index"].as_u64().unwrap() as usize;
        assert_eq!(e["text"], docs[i]);
        assert!(e["score"].is_number());
    }
    // Refusals.
    for (body, why) in [
        (json!({"documents": docs}), "\"query\" must be provided"),
        (
            json!({"query": 1, "documents": docs}),
            "\"query\" must be a string",
        ),
        (
            json!({"query": query, "documents": []}),
            "non-empty string array",
        ),
        (
            json!({"query": query, "documents": [1, 2]}),
            "non-empty string array",
        ),
        (
            json!({"query": query, "documents": docs, "top_n": -1}),
            "top_n",
        ),
    ] {
        let r = post(a, "/rerank", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert!(message(&r).contains(why), "{body}: {}", r.body);
    }
}

/// Decodes standard base64 (with padding).
fn unbase64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    } as u32;
    let mut out = Vec::new();
    for q in s.as_bytes().chunks(4) {
        let pad = q.iter().filter(|&&c| c == b'=').count();
        let n = (q.iter().take(4 - pad)).fold(0u32, |n, &c| n << 6 | val(c)) << (6 * pad);
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    out
}

/// The official `openai` Python package's `embeddings.create` (base64 by default, decoded by
/// the SDK) against `--embeddings --pooling last` (tests/embeddings_client.py).
#[test]
fn official_openai_client_embeddings() {
    let Some(py) = common::python::python_with(&["openai"]) else {
        return;
    };
    let s = server(Some(Pooling::Last), false);
    let g = hmoe_gguf::GgufModel::open(tiny_model(), Default::default()).unwrap();
    let model = hmoe_model::load(g).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/embeddings_client.py");
    common::python::run_checks(
        std::process::Command::new(py)
            .arg(script)
            .args(["--base-url", &format!("http://{}/v1", s.local_addr())])
            .args(["--model", "gptoss-tiny"])
            .args(["--n-embd", &model.n_embd().to_string()])
            .args(["--n-vocab", &model.n_vocab().to_string()]),
    );
}

/// The tiny fixture with `meta` added, written to a scratch file.
fn fixture_with(name: &str, meta: &[(&str, hmoe_gguf::MetaValue)]) -> std::path::PathBuf {
    let g = hmoe_gguf::GgufModel::open(tiny_model(), Default::default()).unwrap();
    let mut w = hmoe_gguf::GgufWriter::from_model(&g).unwrap();
    for (k, v) in meta {
        w.add_meta(*k, v.clone());
    }
    let path = scratch(name).join("model.gguf");
    w.write(&path).unwrap();
    path
}

/// The first value of the first token's hidden state of `tokens`, on `path`'s model.
fn first_value(path: &std::path::Path, tokens: &[u32]) -> f32 {
    let g = hmoe_gguf::GgufModel::open(path, Default::default()).unwrap();
    let model = hmoe_model::load(g).unwrap();
    let e = tiny_config().engine;
    let mut cache = model.new_cache(e.kv_type, tokens.len(), e.n_ubatch);
    (model.forward(&mut cache, tokens, LogitsWanted::Hidden)).unwrap()[0]
}

/// A rerank server on the model at `path`.
fn rerank_server(path: &std::path::Path) -> hmoe_server::RunningServer {
    let mut c = tiny_config();
    c.models = hmoe_server::ModelSource::File(path.to_path_buf());
    c.embeddings = true;
    c.pooling = Some(Pooling::Rank);
    start(c)
}

#[test]
fn rerank_pairs_follow_the_rerank_template_or_the_special_tokens() {
    use hmoe_gguf::MetaValue;
    let (query, docs) = ("pandas", ["bamboo", "the sea", "a bear"]);
    let tok = tokenizer(&tiny_model());
    let enc = |s: &str, special: bool| tok.encode(s, false, special).unwrap();

    // The model's rerank template: the document first, so each pair starts differently.
    let template = "{document} answers <|start|>{query}";
    let path = fixture_with(
        "rerank-template",
        &[(
            "tokenizer.chat_template.rerank",
            MetaValue::String(template.into()),
        )],
    );
    let s = rerank_server(&path);
    let r = post(
        s.local_addr(),
        "/rerank",
        &json!({"query": query, "documents": docs}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    let mut want = Vec::new();
    let mut n_tokens = 0;
    for (i, d) in docs.iter().enumerate() {
        let text = template.replace("{query}", query).replace("{document}", d);
        let ids = enc(&text, true);
        assert!(
            ids.contains(&tok.token_id("<|start|>").unwrap()),
            "specials parsed"
        );
        n_tokens += ids.len();
        want.push((i, first_value(&path, &ids)));
    }
    want.sort_by(|x, y| y.1.total_cmp(&x.1));
    assert!(
        want[0].1 != want[2].1,
        "the documents score differently here"
    );
    let got: Vec<(u64, u32)> = (body["results"].as_array().unwrap().iter())
        .map(|r| {
            let score = r["relevance_score"].as_f64().unwrap() as f32;
            (r["index"].as_u64().unwrap(), score.to_bits())
        })
        .collect();
    let want: Vec<(u64, u32)> = want.iter().map(|(i, s)| (*i as u64, s.to_bits())).collect();
    assert_eq!(got, want, "best first, each the pair's first value");
    assert_eq!(body["usage"]["prompt_tokens"], n_tokens);
    drop(s);

    // No template: BOS, query, EOS, separator, document, EOS when the vocabulary adds them.
    let (bos, eos, sep) = (enc("x", false)[0], enc("y", false)[0], enc("z", false)[0]);
    let path = fixture_with(
        "rerank-specials",
        &[
            ("tokenizer.ggml.bos_token_id", MetaValue::U32(bos)),
            ("tokenizer.ggml.eos_token_id", MetaValue::U32(eos)),
            ("tokenizer.ggml.seperator_token_id", MetaValue::U32(sep)),
            ("tokenizer.ggml.add_bos_token", MetaValue::Bool(true)),
            ("tokenizer.ggml.add_eos_token", MetaValue::Bool(true)),
            ("tokenizer.ggml.add_sep_token", MetaValue::Bool(true)),
        ],
    );
    let s = rerank_server(&path);
    let r = post(
        s.local_addr(),
        "/rerank",
        &json!({"query": query, "documents": [docs[0]]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    let pair = [
        vec![bos],
        enc(query, false),
        vec![eos, sep],
        enc(docs[0], false),
        vec![eos],
    ]
    .concat();
    assert_eq!(body["usage"]["prompt_tokens"], pair.len());
    let score = body["results"][0]["relevance_score"].as_f64().unwrap() as f32;
    assert_eq!(
        score.to_bits(),
        first_value(&path, &pair).to_bits(),
        "BOS first"
    );
}
