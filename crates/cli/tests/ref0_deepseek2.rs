//! DeepSeek-V3 (`deepseek2`) on the reference device from the command line (issue #15): the
//! teacher-forced top-10 probabilities of `hmoe run -dev REF0` are the CPU engine's
//! (`-dev none`) bit for bit on the deepseek2 fixture with `-ngl all`, `-ngl all --cpu-moe`
//! and `--n-cpu-moe 1`, and the transfer counts in `--json` show one round trip per
//! CPU-expert layer per micro-batch and none with everything on REF0. The fixture's first
//! layer is dense (no experts), so `--cpu-moe` keeps two layers' experts on the CPU and
//! `--n-cpu-moe 1` none (its first layer has no experts to keep).

mod common;

use common::{fixture, run};

#[test]
fn ref0_deepseek2_top10_probabilities_are_the_cpu_engines_bit_for_bit() {
    let f = fixture("deepseek2", "deepseek2-tiny", "deepseek2-tiny.gguf");
    assert_eq!(f.n_layer, 3);
    let (cpu, _) = run(&f, &["-dev", "none"]);
    assert_eq!(cpu["engine"], "CPU");
    let steps = cpu["top_probs"].as_array().unwrap().len() as u64;
    assert_eq!(steps, f.ubatches);
    // (flags, CPU-expert layers)
    let cases: [(&[&str], u64); 3] = [
        (&["-ngl", "all"], 0),
        (&["-ngl", "all", "--cpu-moe"], 2),
        (&["-ngl", "all", "--n-cpu-moe", "2"], 1),
    ];
    for (flags, host) in cases {
        let mut extra = vec!["-dev", "REF0"];
        extra.extend_from_slice(flags);
        let (got, err) = run(&f, &extra);
        let what = format!("{extra:?}");
        assert_eq!(got["engine"], "REF0", "{what}: {err}");
        assert!(err.contains("deepseek2 on REF0"), "{what}: {err}");
        assert_eq!(got["top_probs"], cpu["top_probs"], "{what}");
        assert_eq!(got["generated_tokens"], cpu["generated_tokens"], "{what}");
        let s = &got["device_stats"];
        assert_eq!(s["ubatches"], f.ubatches, "{what}: {s}");
        assert_eq!(s["host_round_trips"], host * f.ubatches, "{what}: {s}");
        // Device → host: the logits of each micro-batch and one staged copy per round trip.
        let t = &s["transfers"];
        assert_eq!(
            t["downloads"].as_u64(),
            Some(f.ubatches + host * f.ubatches),
            "{what}: {s}"
        );
    }
}
