//! `scripts/gpu-bench.sh --dry-run`: the hmoe half of the GPU benchmark on
//! the reference device with a tiny model, assembled and validated by
//! `scripts/gpu_bench_json.py`; the result has the schema (every placement × K/V type ×
//! test, the machine, the date) and the expert-cache runs on a random and a locality model;
//! the validator rejects a result that lacks a run or has a bad field. Needs bash and Python 3
//! (`$HMOE_PYTHON` or `python3`); without them `SKIPPED:`.

#[allow(dead_code)]
#[path = "../../server/tests/common/python.rs"]
mod python;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

#[test]
fn dry_run_writes_a_valid_result() {
    let Some(py) = python::python_with(&["json"]) else {
        return;
    };
    let out_dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-gpu-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let out = Command::new("bash")
        .arg(root().join("scripts/gpu-bench.sh"))
        .args(["--dry-run", "--out"])
        .arg(&out_dir)
        .env("HMOE_BIN", env!("CARGO_BIN_EXE_hmoe"))
        .env("HMOE_PYTHON", &py)
        .env("TMPDIR", std::path::Path::new(env!("CARGO_TARGET_TMPDIR")))
        .output()
        .expect("bash runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "gpu-bench.sh --dry-run failed:\n{err}"
    );
    let files: Vec<PathBuf> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.ends_with("-REF0-dry-run.json"), "{name}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
    assert_eq!(doc["machine"]["dry_run"], true, "{doc}");
    assert!(doc["date"].as_str().unwrap().len() == 10);
    let runs = doc["runs"].as_array().unwrap();
    // hmoe only: 3 placements × 2 K/V types × 4 tests.
    assert_eq!(runs.len(), 3 * 2 * 4, "{doc}");
    for config in ["cpu-moe", "ncmoe-half", "all-gpu"] {
        for kv in ["f16", "q8_0"] {
            let mut tests: Vec<&str> = (runs.iter())
                .filter(|r| r["config"] == config && r["kv"] == kv)
                .map(|r| r["test"].as_str().unwrap())
                .collect();
            tests.sort_unstable();
            assert_eq!(tests, ["pp16", "pp32", "tg4", "tg4@d32"], "{config} {kv}");
        }
    }
    for r in runs {
        assert_eq!(r["engine"], "hmoe");
        assert!(r["t_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["vram_mib"].is_null(), "no nvidia-smi in a dry run: {r}");
    }
    let cache = doc["moe_cache_runs"].as_array().unwrap();
    assert_eq!(cache.len(), 4, "{doc}");
    for r in cache {
        let on = r["moe_cache"] == "on";
        assert_eq!(r["hit_rate"].is_number(), on, "{r}");
    }
    // The validator finds a missing run and a bad field.
    let validate = |doc: &Value| {
        let f = out_dir.join("broken.json");
        std::fs::write(&f, doc.to_string()).unwrap();
        let o = Command::new(&py)
            .arg(root().join("scripts/gpu_bench_json.py"))
            .args(["validate", "--tests", "pp16,pp32,tg4,tg4@d32"])
            .arg(&f)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    assert!(validate(&doc).0, "{}", validate(&doc).1);
    let mut missing = doc.clone();
    missing["runs"].as_array_mut().unwrap().remove(0);
    let (ok, why) = validate(&missing);
    assert!(!ok && why.contains("no run of"), "{why}");
    let mut bad = doc.clone();
    bad["runs"][1]["config"] = "half".into();
    let (ok, why) = validate(&bad);
    assert!(!ok && why.contains("config 'half'"), "{why}");
    let _ = std::fs::remove_dir_all(&out_dir);
}
