//! `hmoe bench` end to end on the tiny gpt-oss fixture: the llama-bench table, its JSON / JSONL /
//! CSV records, depth, the roofline report and clean errors for bad arguments.

use std::process::{Command, Output};

use serde_json::Value;

fn tiny_model() -> String {
    let dir = hmoe_testdata::fixtures();
    dir.join("gpt-oss/gptoss-tiny.gguf").display().to_string()
}

fn bench(extra: &[&str]) -> Output {
    let model = tiny_model();
    let mut args = vec!["bench", "-m", model.as_str(), "-t", "2"];
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(&args)
        .output()
        .expect("hmoe runs")
}

fn ok_stdout(extra: &[&str]) -> String {
    let out = bench(extra);
    assert!(
        out.status.success(),
        "hmoe bench {extra:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The cells of a markdown table row.
fn cells(line: &str) -> Vec<String> {
    line.trim()
        .trim_matches('|')
        .split('|')
        .map(|c| c.trim().to_string())
        .collect()
}

/// `12.34 ± 0.56` → (12.34, 0.56).
fn mean_sd(cell: &str) -> (f64, f64) {
    let (m, s) = cell.split_once('±').expect("mean ± sd");
    (m.trim().parse().unwrap(), s.trim().parse().unwrap())
}

/// The fields llama-bench writes in each JSON record that this engine fills.
const FIELDS: [&str; 27] = [
    "build_commit",
    "build_number",
    "cpu_info",
    "gpu_info",
    "backends",
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "n_batch",
    "n_ubatch",
    "n_threads",
    "type_k",
    "type_v",
    "n_gpu_layers",
    "n_cpu_moe",
    "no_op_offload",
    "n_prompt",
    "n_gen",
    "n_depth",
    "test_time",
    "avg_ns",
    "stddev_ns",
    "avg_ts",
    "stddev_ts",
    "samples_ns",
    "samples_ts",
];

#[test]
fn markdown_table_has_llama_bench_header_and_rows() {
    let out = ok_stdout(&["-p", "16", "-n", "4", "-r", "2"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        cells(lines[0]),
        ["model", "size", "params", "backend", "threads", "test", "t/s"],
        "{out}"
    );
    assert!(
        lines[1].starts_with("| ---") && lines[1].ends_with(": |"),
        "{out}"
    );
    let rows: Vec<Vec<String>> = lines[2..4].iter().map(|l| cells(l)).collect();
    assert_eq!(rows[0][5], "pp16", "{out}");
    assert_eq!(rows[1][5], "tg4", "{out}");
    for r in &rows {
        assert!(r[0].starts_with("gpt-oss "), "{out}");
        assert!(r[1].ends_with(" MiB") && r[2].ends_with(" M"), "{out}");
        assert_eq!((r[3].as_str(), r[4].as_str()), ("CPU", "2"));
        let (mean, sd) = mean_sd(&r[6]);
        assert!(mean > 0.0 && sd >= 0.0, "{out}");
    }
    assert!(lines.iter().any(|l| l.starts_with("build: ")), "{out}");
}

#[test]
fn json_records_use_llama_bench_field_names() {
    let out = ok_stdout(&["-p", "16", "-n", "4", "-r", "2", "-o", "json"]);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let recs = v.as_array().expect("an array");
    assert_eq!(recs.len(), 2);
    for (rec, (p, g)) in recs.iter().zip([(16, 0), (0, 4)]) {
        for f in FIELDS {
            assert!(rec.get(f).is_some(), "missing {f} in {rec}");
        }
        assert_eq!(rec["n_prompt"], p);
        assert_eq!(rec["n_gen"], g);
        assert_eq!(rec["n_depth"], 0);
        assert_eq!(rec["n_threads"], 2);
        assert_eq!(rec["type_k"], "f16");
        assert!(rec["avg_ts"].as_f64().unwrap() > 0.0, "{rec}");
        assert!(rec["avg_ns"].as_u64().unwrap() > 0, "{rec}");
        assert!(
            rec["model_size"].as_u64().unwrap() > 0 && rec["model_n_params"].as_u64().unwrap() > 0
        );
        let ts = rec["samples_ts"].as_array().unwrap();
        let ns = rec["samples_ns"].as_array().unwrap();
        assert_eq!((ts.len(), ns.len()), (2, 2));
        // t/s of each sample is tokens / its time, and avg_ts is their mean.
        let tokens = (p + g) as f64;
        for (t, n) in ts.iter().zip(ns) {
            let want = tokens * 1e9 / n.as_f64().unwrap();
            assert!((t.as_f64().unwrap() - want).abs() <= 1e-6 * want);
        }
        let mean = ts.iter().map(|t| t.as_f64().unwrap()).sum::<f64>() / 2.0;
        assert!((rec["avg_ts"].as_f64().unwrap() - mean).abs() <= 1e-9 * mean);
    }
}

#[test]
fn jsonl_and_csv_have_one_record_per_test() {
    let out = ok_stdout(&["-p", "16", "-n", "4", "-r", "1", "-o", "jsonl"]);
    let recs: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 2, "{out}");
    assert!(recs.iter().all(|r| r["avg_ts"].as_f64().unwrap() > 0.0));

    let out = ok_stdout(&["-p", "16", "-n", "4", "-r", "1", "-o", "csv"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    let header: Vec<&str> = lines[0].split(',').collect();
    assert!(
        header.contains(&"avg_ts") && header.contains(&"model_filename"),
        "{out}"
    );
    assert!(
        lines[1].starts_with('"') && lines[1].split("\",\"").count() == header.len(),
        "{out}"
    );
}

#[test]
fn depth_and_lists_name_tests_like_llama_bench() {
    // -ub 8 makes the sliding-window ring small, so keeping the depth between repetitions
    // exercises both the truncate and the recompute paths.
    let out = ok_stdout(&["-p", "8,16", "-n", "4", "-d", "0,8", "-r", "2", "-ub", "8"]);
    let tests: Vec<String> = out
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let c = cells(l);
            c[c.len() - 2].clone()
        })
        .collect();
    assert_eq!(
        tests,
        ["pp8", "pp16", "tg4", "pp8 @ d8", "pp16 @ d8", "tg4 @ d8"],
        "{out}"
    );
    assert!(out.lines().next().unwrap().contains("n_ubatch"), "{out}");
}

#[test]
fn roofline_reports_bandwidth_and_fraction() {
    let args = [
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "2",
        "--roofline",
        "--roofline-mib",
        "64",
        "--roofline-runs",
        "2",
    ];
    let out = ok_stdout(&args);
    let bw_line = out
        .lines()
        .find(|l| l.starts_with("roofline: read bandwidth "))
        .unwrap_or_else(|| panic!("no bandwidth line: {out}"));
    let gbs: f64 = bw_line["roofline: read bandwidth ".len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(gbs > 0.0, "{out}");
    assert!(
        out.contains("roofline: weights read per generated token "),
        "{out}"
    );
    let row = out
        .lines()
        .filter(|l| l.starts_with('|'))
        .map(cells)
        .find(|c| c.len() == 5 && c[0] == "tg4")
        .unwrap_or_else(|| panic!("no roofline row: {out}"));
    let bound: f64 = row[3].parse().unwrap();
    let fraction: f64 = row[4].parse().unwrap();
    assert!(bound > 0.0, "{out}");
    assert!(fraction > 0.0 && fraction <= 1.5, "{out}");

    // The same numbers in the JSON records of generation tests only.
    let mut json_args = args.to_vec();
    json_args.extend(["-o", "json"]);
    let v: Value = serde_json::from_str(&ok_stdout(&json_args)).unwrap();
    let recs = v.as_array().unwrap();
    assert!(recs[0].get("roofline_fraction").is_none());
    let f = recs[1]["roofline_fraction"].as_f64().unwrap();
    assert!(f > 0.0 && f <= 1.5);
    assert!(recs[1]["roofline_bytes_per_token"].as_f64().unwrap() > 0.0);

    // At a depth the bound counts the KV cache the tokens read: more bytes, a lower bound.
    json_args.extend(["-d", "0,64"]);
    let v: Value = serde_json::from_str(&ok_stdout(&json_args)).unwrap();
    let recs = v.as_array().unwrap();
    let key = |i: usize, k: &str| recs[i][k].as_f64().unwrap();
    assert_eq!(recs[3]["n_depth"], 64);
    let (kv0, kv64) = (
        key(1, "roofline_kv_bytes_per_token"),
        key(3, "roofline_kv_bytes_per_token"),
    );
    assert!(kv0 > 0.0 && kv64 > kv0, "{kv0} {kv64}");
    assert!(key(3, "roofline_ts") < key(1, "roofline_ts"));
}

#[test]
fn bad_arguments_fail_without_panicking() {
    let cases: [&[&str]; 11] = [
        &["-p", "0", "-n", "0"],
        &["-r", "0"],
        &["-p", "abc"],
        &["-p", "-5"],
        &["-n", "4-2"],
        &["-d", "1,,2"],
        &["-b", "0"],
        &["-ub", "0"],
        &["-ctk", "q9_9"],
        &["-o", "xml"],
        &["--roofline-mib", "0"],
    ];
    for args in cases {
        let out = bench(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert_ne!(out.status.code(), Some(101), "{args:?} panicked: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.trim().is_empty(), "{args:?} gave no message");
    }
    for args in [
        ["bench", "-m", &tiny_model(), "-t", "0"],
        ["bench", "-m", "/nonexistent/model.gguf", "-t", "1"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_hmoe"))
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            !err.contains("panicked") && !err.trim().is_empty(),
            "{args:?}: {err}"
        );
    }
}
