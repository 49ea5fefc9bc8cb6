//! The reference device `REF0` from the command line: `hmoe --list-devices` lists
//! it, `-dev REF0` puts on it what would go to a GPU (the same placement plan), and on it the
//! teacher-forced top-10 probabilities of `hmoe run` are the CPU's (`-dev none`) bit
//! for bit on every gpt-oss fixture, for `-ngl all`, `-ngl all --cpu-moe`, `--n-cpu-moe 1`
//! and an `-ot` rule for one layer; the transfer counts in `--json` show one round trip per
//! CPU-expert layer per micro-batch and none with everything on REF0. `--gpu-mem` sets its
//! memory: a plan or an upload beyond it is an error naming REF0 and the missing MiB.

mod common;

use common::{assert_ref0_is_the_cpu_device, fixture, hmoe, placements, run, Placement, FIXTURES};
use serde_json::Value;

#[test]
fn list_devices_shows_ref0_as_a_testing_device_last() {
    let out = hmoe(&["--list-devices"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("  REF0: reference device, for testing"),
        "{text}"
    );
    assert_eq!(text.matches("REF0").count(), 1, "{text}");
}

#[test]
fn ref0_top10_probabilities_are_the_cpu_devices_bit_for_bit() {
    for (stem, file) in FIXTURES {
        let f = fixture("gpt-oss", stem, file);
        let cases: Vec<(Vec<&str>, u64)> = placements()
            .into_iter()
            .map(|(flags, host)| (flags, host.unwrap_or(f.n_layer)))
            .collect();
        let cases: Vec<Placement<'_>> = cases.iter().map(|(fl, h)| (&fl[..], *h)).collect();
        let cpu = assert_ref0_is_the_cpu_device(&f, "gpt-oss", &[], &cases);
        assert!(cpu.get("device_stats").is_none(), "{stem}: {cpu}");
    }
}

/// Op offload from 4 tokens: the prompt's CPU-expert layers run on REF0 with the experts they
/// route to uploaded (no round trip) but the last, which multiplies the prompt's last token
/// alone (below 4 tokens: one round trip, as llama.cpp decides per op); the decode steps
/// round-trip; the same bits.
#[test]
fn ref0_op_offload_gives_the_same_bits() {
    let f = fixture("gpt-oss", "gptoss-small", "gptoss-small.gguf");
    let (cpu, _) = run(&f, &["-dev", "none"]);
    let (got, err) = run(
        &f,
        &[
            "-dev",
            "REF0",
            "-ngl",
            "all",
            "--cpu-moe",
            "--op-offload-min-batch",
            "4",
        ],
    );
    assert_eq!(got["top_probs"], cpu["top_probs"], "{err}");
    let s = &got["device_stats"];
    assert_eq!(s["offloaded_layers"], f.n_layer - 1, "{s}");
    assert_eq!(
        s["host_round_trips"],
        f.n_layer * (f.ubatches - 1) + 1,
        "{s}"
    );
    // Through the op-offload ring the plan sized: more than one slice a layer.
    let n = |k: &str| s[k].as_u64().unwrap();
    assert!(n("offload_slices") > n("offloaded_layers"), "{s}");
    assert!(n("ring_peak_bytes") > 0, "{s}");
}

#[test]
fn ref0_over_budget_is_an_error_naming_it_and_the_missing_mib() {
    let f = fixture("gpt-oss", "gptoss-small", "gptoss-small.gguf");
    let model = f.model.as_str();
    let base = [
        "run",
        "-m",
        model,
        "--prompt-tokens",
        "1,2,3",
        "-n",
        "1",
        "-c",
        "256",
    ];
    // The plan (weights, K/V, compute, overhead, the 1024 MiB --fit-target) does not fit.
    let args = [
        &base[..],
        &["-dev", "REF0", "-ngl", "all", "--gpu-mem", "512MiB"],
    ]
    .concat();
    let out = hmoe(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("REF0 is") && err.contains("MiB short"),
        "{err}"
    );
    assert!(!err.contains("CUDA0"), "{err}");
    // Without fit the plan is taken as given and REF0 itself runs out of memory.
    let args = [
        &base[..],
        &[
            "-dev",
            "REF0",
            "-ngl",
            "all",
            "--fit",
            "off",
            "--gpu-mem",
            "1MiB",
        ],
    ]
    .concat();
    let out = hmoe(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("REF0: out of memory") && err.contains("MiB missing"),
        "{err}"
    );
    // With enough memory the same run works.
    let args = [
        &base[..],
        &["-dev", "REF0", "-ngl", "all", "--gpu-mem", "2GiB"],
    ]
    .concat();
    let out = hmoe(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `hmoe fit -dev REF0` names the device REF0 (table, JSON, and the rules of the printed
/// flags) and says its budget comes from `--gpu-mem` (or REF0's default), not the driver.
#[test]
fn fit_on_ref0_names_it_and_its_budget() {
    let f = fixture("gpt-oss", "gptoss-small", "gptoss-small.gguf");
    let base = ["fit", "-m", f.model.as_str(), "-c", "256", "-dev", "REF0"];
    let rule = r"blk\.0\.ffn_up_exps=REF0";
    let out = hmoe(&[&base[..], &["--gpu-mem", "2GiB", "-ot", rule]].concat());
    let (text, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("fit: device budget: REF0 2048 MiB (--gpu-mem)"),
        "{err}"
    );
    assert!(!err.contains("driver"), "{err}");
    assert!(text.lines().any(|l| l.starts_with("REF0 ")), "{text}");
    assert!(text.contains(r"blk\.0\.ffn_up_exps=REF0"), "{text}");
    assert!(!text.contains("CUDA0"), "{text}");
    let out = hmoe(&[&base[..], &["--json"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("REF0 16384 MiB (the reference device's default"),
        "{err}"
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let devs: Vec<&str> = v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["device"].as_str().unwrap())
        .collect();
    assert_eq!(devs, ["CPU", "REF0"], "{v}");
}
