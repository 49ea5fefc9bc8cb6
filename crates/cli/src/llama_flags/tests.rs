//! The table against llama-server's own `--help` (the baselines' build, kept in
//! `tests/data/llama-server-help.txt`), and every flag through `hmoe serve`'s parser.

use std::collections::{BTreeMap, BTreeSet};

use clap::error::ErrorKind;
use clap::Parser;

use super::{Does, LLAMA_SERVER_FLAGS};
use crate::serve_cmd::ServeArgs;
use crate::{normalise_args, Cli, Command};

const HELP: &str = include_str!("../../tests/data/llama-server-help.txt");

/// One entry of the help: its spellings, the value hint after the last one, its variable.
struct HelpEntry {
    names: Vec<String>,
    hint: String,
    env: Option<String>,
}

/// The help's entries: a line that starts with `-` opens one (spellings, then the hint, then
/// two or more spaces before the description); `(env: NAME)` in its lines names its variable.
fn help_entries() -> Vec<HelpEntry> {
    let mut out: Vec<HelpEntry> = Vec::new();
    for line in HELP.lines() {
        if line.starts_with("-----") {
            continue;
        }
        if line.starts_with('-') {
            // `-c,    --ctx-size N`: the spellings are separated by a comma and spaces (a hint's
            // commas have none).
            let mut joined = String::new();
            let mut chars = line.chars().peekable();
            while let Some(c) = chars.next() {
                joined.push(c);
                if c == ',' && chars.peek() == Some(&' ') {
                    while chars.next_if_eq(&' ').is_some() {}
                    joined.push(' ');
                }
            }
            let head = joined.split("  ").next().unwrap_or_default().trim();
            let mut names: Vec<String> = head.split(", ").map(String::from).collect();
            let last = names.pop().unwrap();
            let (name, hint) = last.split_once(' ').unwrap_or((&last, ""));
            names.push(name.to_string());
            out.push(HelpEntry {
                names,
                hint: hint.trim().to_string(),
                env: None,
            });
        } else if let Some(i) = line.find("(env: ") {
            let name = line[i + 6..].trim_end().trim_end_matches(')');
            out.last_mut().unwrap().env = Some(name.to_string());
        }
    }
    out
}

/// A value llama-server accepts for a hint (`N`, `TYPE`, `{none,layer}`, `[on|off]`, ...).
fn sample(hint: &str) -> Vec<String> {
    let first = |s: &str, seps: &[char]| s.split(seps).next().unwrap_or_default().to_string();
    let one = match hint {
        "" => return vec![],
        "START END" => return vec!["1".into(), "2".into()],
        "N" | "SEED" | "SECONDS" => "1".to_string(),
        "PORT" => "8080".into(),
        "SIMILARITY" | "P" => "0.5".into(),
        "INDEX" => "0".into(),
        "FORMAT" => "none".into(),
        "MODE" => "mmap".into(),
        "TYPE" => "f16".into(),
        h if h.starts_with('{') => first(h.trim_matches(['{', '}']), &[',']),
        h if optional(h) => first(h.trim_matches(['[', ']']), &['|']),
        h if h.starts_with("<0") => "0".into(),
        h if h.contains('=') => "exps=CPU".into(),
        _ => "x".into(),
    };
    vec![one]
}

/// Whether a hint is of an optional value: `[on|off|auto]`.
fn optional(hint: &str) -> bool {
    hint.starts_with('[') && hint.ends_with(']') && hint.contains('|')
}

/// `hmoe serve -m m.gguf WORDS` with the variables `env`, as main parses it.
fn serve(words: &[&str], env: &[(&str, &str)]) -> Result<(ServeArgs, Vec<String>), clap::Error> {
    let argv = ["hmoe", "serve"].iter().chain(words).map(|s| s.to_string());
    let lookup = |k: &str| {
        env.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    };
    let (args, notes) = normalise_args(argv.collect(), lookup).expect("variables");
    match Cli::try_parse_from(args)?.command {
        Some(Command::Serve(s)) => Ok((*s, notes)),
        _ => panic!("not serve"),
    }
}

#[test]
fn the_table_is_llama_servers_help() {
    let help = help_entries();
    assert!(help.len() > 240, "{} entries", help.len());
    let in_help: BTreeSet<&str> = help
        .iter()
        .flat_map(|e| &e.names)
        .map(String::as_str)
        .collect();
    let in_table: BTreeSet<&str> = LLAMA_SERVER_FLAGS
        .iter()
        .flat_map(|f| f.names)
        .copied()
        .collect();
    assert_eq!(
        in_help.difference(&in_table).collect::<Vec<_>>(),
        Vec::<&&str>::new(),
        "flags of llama-server that the table lacks"
    );
    assert_eq!(
        in_table.difference(&in_help).collect::<Vec<_>>(),
        Vec::<&&str>::new(),
        "flags in the table that llama-server does not have"
    );
    let mut spellings = 0;
    for entry in &help {
        let rows: Vec<_> = (LLAMA_SERVER_FLAGS.iter())
            .filter(|f| f.names.iter().any(|n| entry.names.iter().any(|e| e == n)))
            .collect();
        for row in &rows {
            assert_eq!(row.env.name(), entry.env.as_deref(), "{:?}", entry.names);
            spellings += row.names.len();
        }
    }
    assert_eq!(spellings, in_table.len(), "a spelling in two rows");
    // A switch's variable is a truth value; a valued flag's variable is its value.
    for row in LLAMA_SERVER_FLAGS {
        let switch = row.takes == super::Takes::Nothing;
        let value_env = matches!(row.env, super::Env::Value(_));
        assert!(
            row.env == super::Env::No || switch != value_env,
            "{:?}",
            row.names
        );
    }
}

#[test]
fn every_llama_server_flag_parses() {
    let mut counts = BTreeMap::new();
    for entry in help_entries() {
        for name in &entry.names {
            let row = LLAMA_SERVER_FLAGS
                .iter()
                .find(|f| f.names.contains(&name.as_str()))
                .unwrap();
            let mut forms = vec![sample(&entry.hint)];
            if optional(&entry.hint) {
                forms.push(vec![]); // A bare `-fa` means on.
            }
            for values in forms {
                // As in llama-server, a flag given twice takes its last value.
                let mut words = vec![name.as_str()];
                words.extend(values.iter().map(String::as_str));
                words.extend(["-m", "m.gguf", "--port", "0"]);
                let (args, notes) = match serve(&words, &[]) {
                    Ok(parsed) => parsed,
                    Err(e)
                        if matches!(
                            e.kind(),
                            ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
                        ) =>
                    {
                        continue
                    }
                    Err(e) => panic!("{words:?}: {e}"),
                };
                assert_eq!(
                    args.port, 0,
                    "{words:?}: a value was taken from the next flag"
                );
                assert_eq!(args.model.as_deref(), Some("m.gguf".as_ref()), "{words:?}");
                match row.does {
                    Does::Note(_) => {
                        assert_eq!(notes.len(), 1, "{words:?}: {notes:?}");
                        assert!(
                            notes[0].contains("does not apply to hmoe serve"),
                            "{notes:?}"
                        );
                    }
                    Does::Hmoe(_) | Does::Always => {
                        assert!(notes.is_empty(), "{words:?}: {notes:?}")
                    }
                }
            }
        }
        let kind = |d: Does| match d {
            Does::Hmoe(_) => "implemented",
            Does::Always => "hmoe's fixed behaviour",
            Does::Note(_) => "noted",
        };
        for row in LLAMA_SERVER_FLAGS
            .iter()
            .filter(|f| f.names.iter().any(|n| entry.names.iter().any(|e| e == n)))
        {
            *counts.entry(kind(row.does)).or_insert(0) += 1;
        }
    }
    eprintln!("llama-server's flags (rows of the table): {counts:?}");
}

#[test]
fn the_issues_command_lines_parse() {
    let (a, notes) = serve(
        &[
            "-m", "m.gguf", "-to", "600", "-cram", "0", "-md", "d.gguf", "-ts", "3,1",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(a.timeout, 600);
    assert_eq!(a.placement.args.ctx_size, None, "-cram is not -c");
    assert_eq!(a.model.as_deref(), Some("m.gguf".as_ref()), "-md is not -m");
    assert_eq!(notes.len(), 3, "{notes:?}");
    assert!(
        notes[0].starts_with("--cache-ram (-cram) does not apply"),
        "{notes:?}"
    );
    assert!(
        notes[1].starts_with("--spec-draft-model (-md) does not apply"),
        "{notes:?}"
    );
    let line = "-m m.gguf --override-kv a=int:1 --no-context-shift --numa distribute \
                --threads-http 4 --log-file x.log -lv 4 --slot-save-path /tmp --grammar-file g \
                --swa-checkpoints 3 --lora a.gguf --mmproj p.gguf --control-vector-layer-range 1 2 \
                --jinja -fit -fa -np -1 -rea --ctx-size=4096 --numa=isolate";
    let words: Vec<&str> = line.split_whitespace().collect();
    let (a, notes) = serve(&words, &[]).unwrap();
    assert_eq!(a.log_verbosity, Some(4));
    assert_eq!(a.slot_save_path.as_deref(), Some("/tmp".as_ref()));
    assert_eq!(
        notes.len(),
        9,
        "one note per flag that does not apply: {notes:?}"
    );
    assert_eq!(
        (a.placement.args.fit.as_str(), a.flash_attn.as_str()),
        ("on", "on")
    );
    // -np -1 is llama-server's "auto": 4 slots.
    assert_eq!((a.reasoning.as_str(), a.n_parallel()), ("on", 4));
    assert_eq!(a.placement.args.ctx_size, Some(4096));
    // A flag given twice takes its last value; repeatable ones add up.
    let words = [
        "-m",
        "a",
        "-m",
        "b",
        "-c",
        "1",
        "-c",
        "2",
        "--api-key",
        "k1",
        "--api-key",
        "k2",
    ];
    let (a, _) = serve(
        &[&words[..], &["-ot", "x=CPU", "-ot", "y=CPU"]].concat(),
        &[],
    )
    .unwrap();
    assert_eq!(a.model.as_deref(), Some("b".as_ref()));
    assert_eq!(a.placement.args.ctx_size, Some(2));
    assert_eq!(
        (a.api_key.len(), a.placement.args.override_tensor.len()),
        (2, 2)
    );
    // llama.cpp's load modes.
    let load = |mode: &str| {
        serve(&["-m", "m", "-lm", mode], &[])
            .unwrap()
            .0
            .load_options()
    };
    assert!(load("mmap").use_mmap && !load("mmap").mlock);
    assert!(!load("none").use_mmap && !load("dio").use_mmap);
    assert!(!load("mlock").use_mmap && load("mlock").mlock);
    assert!(load("mmap+mlock").use_mmap && load("mmap+mlock").mlock);
    // A real mistake is still clap's error.
    assert!(serve(&["-m", "m.gguf", "--no-such-flag"], &[]).is_err());
}

#[test]
fn environment_variables_set_flags_and_the_command_line_wins() {
    let env = [
        ("LLAMA_ARG_CTX_SIZE", "8192"),
        ("LLAMA_ARG_PORT", "9000"),
        ("HMOE_ARG_PORT", "9001"),
        ("LLAMA_ARG_MMAP", "false"),
        ("LLAMA_ARG_CPU_MOE", "1"),
        ("LLAMA_ARG_NUMA", "distribute"),
        ("LLAMA_ARG_MODEL", "env.gguf"),
        ("LLAMA_API_KEY", "k1,k2"),
        ("LLAMA_ARG_FLASH_ATTN", "off"),
        ("LLAMA_ARG_JINJA", "on"),
        ("HF_TOKEN", "secret"),
    ];
    let (a, notes) = serve(&[], &env).unwrap();
    assert_eq!(a.placement.args.ctx_size, Some(8192));
    assert_eq!(a.port, 9001, "HMOE_ARG_ wins over LLAMA_ARG_");
    assert!(a.no_mmap && a.placement.args.cpu_moe);
    assert_eq!(a.model.as_deref(), Some("env.gguf".as_ref()));
    assert_eq!(a.api_key, ["k1", "k2"]);
    assert_eq!(a.flash_attn, "off");
    assert_eq!(notes, ["--numa (from LLAMA_ARG_NUMA) does not apply to hmoe serve (hmoe does not place threads or memory by NUMA node); ignored"]);
    // The command line wins, by any spelling of the flag (and `--mmap` is the default).
    let (a, notes) = serve(
        &[
            "-c", "512", "--port", "1", "--mmap", "-m", "cli.gguf", "--numa", "isolate",
        ],
        &env,
    )
    .unwrap();
    assert_eq!((a.placement.args.ctx_size, a.port), (Some(512), 1));
    assert!(!a.no_mmap);
    assert_eq!(a.model.as_deref(), Some("cli.gguf".as_ref()));
    assert_eq!(notes, ["--numa does not apply to hmoe serve (hmoe does not place threads or memory by NUMA node); ignored"]);
    // A switch's variable set false sets nothing; a word that is no truth value is an error.
    let (a, _) = serve(&["-m", "m"], &[("LLAMA_ARG_CPU_MOE", "0")]).unwrap();
    assert!(!a.placement.args.cpu_moe);
    let argv = ["hmoe", "serve"].map(String::from).to_vec();
    let err =
        normalise_args(argv, |k| (k == "LLAMA_ARG_MMAP").then(|| "maybe".into())).unwrap_err();
    assert!(err.contains("LLAMA_ARG_MMAP=maybe"), "{err}");
}

#[test]
fn other_commands_read_only_the_short_spellings() {
    let argv = [
        "hmoe", "bench", "-m", "x", "-fa", "1", "-ngl", "99", "-ts", "1", "-n", "8",
    ];
    let (args, notes) =
        normalise_args(argv.map(String::from).to_vec(), |_| Some("1".into())).unwrap();
    assert_eq!(
        args,
        [
            "hmoe",
            "bench",
            "-m",
            "x",
            "--flash-attn",
            "1",
            "--n-gpu-layers",
            "99",
            "-ts",
            "1",
            "-n",
            "8"
        ]
    );
    assert!(notes.is_empty());
}

#[test]
fn guide_command_lines_parse() {
    // llama-server command lines as llama.cpp's server README, its gpt-oss guide and Unsloth's
    // DeepSeek and Qwen3 guides give them (model paths shortened).
    let lines = [
        "-m models/7B/ggml-model.gguf -c 2048",
        "-m models/7B/ggml-model.gguf -c 512 --host 0.0.0.0 --port 8080 --n-gpu-layers 99",
        "-m models/7B/ggml-model.gguf -md models/draft.gguf -ngld 99 --draft-max 16",
        "-m gpt-oss-20b.gguf --ctx-size 0 --jinja -ub 2048 -b 2048",
        "-m gpt-oss-20b.gguf --ctx-size 0 --jinja -b 4096 -ub 4096 -ngl 99 -fa -cmoe",
        "-m gpt-oss-20b.gguf --ctx-size 0 --jinja -b 4096 -ub 4096 -ngl 99 -fa -ncmoe 4",
        "-m gpt-oss-120b.gguf -c 0 -fa on --jinja --reasoning-format none -ngl 99 --n-cpu-moe 24 \
         --temp 1.0 --top-p 1.0 --top-k 0 --chat-template-kwargs {\"reasoning_effort\":\"high\"}",
        "--model DeepSeek-V3.1-UD-Q2_K_XL-00001-of-00006.gguf --alias unsloth/DeepSeek-V3.1 \
         --threads -1 --n-gpu-layers 99 -ot .ffn_.*_exps.=CPU --prio 3 --temp 0.6 --top-p 0.95 \
         --min-p 0.01 --ctx-size 16384 --port 8001 --jinja",
        "--model Qwen3-235B-A22B-UD-Q2_K_XL-00001-of-00002.gguf --threads 32 --ctx-size 16384 \
         --n-gpu-layers 99 -ot .ffn_.*_exps.=CPU --seed 3407 --prio 3 --temp 0.6 --min-p 0.0 \
         --top-p 0.95 --top-k 20 --presence-penalty 1.5 --jinja --no-context-shift",
        "--model Qwen3-Coder-30B-A3B-Instruct-Q4_K_M.gguf --threads -1 --ctx-size 32684 \
         --n-gpu-layers 99 -ot .ffn_.*_exps.=CPU --temp 0.7 --min-p 0.0 --top-p 0.8 --top-k 20 \
         --repeat-penalty 1.05 --jinja -np 4 --cache-type-k q8_0 --cache-type-v q8_0 -fa on",
    ];
    for line in lines {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (a, notes) = serve(&words, &[]).unwrap_or_else(|e| panic!("{line}: {e}"));
        assert!(a.model.is_some(), "{line}");
        for n in &notes {
            assert!(n.contains("does not apply to hmoe serve"), "{n}");
        }
        if line.contains("-fa -cmoe") {
            assert_eq!(a.flash_attn, "on", "a bare -fa means on");
            assert!(a.placement.args.cpu_moe, "-cmoe after a bare -fa");
        }
    }
}

/// llama-server's sampler flags set `hmoe serve`'s defaults under each of llama.cpp's
/// spellings, with no note.
#[test]
fn sampler_flags_set_the_servers_defaults() {
    let words = [
        "-m",
        "x.gguf",
        "--typical-p",
        "0.9",
        "--top-nsigma",
        "1.5",
        "--xtc-probability",
        "0.5",
        "--xtc-threshold",
        "0.2",
        "--dry-multiplier",
        "0.8",
        "--dry-base",
        "2",
        "--dry-allowed-length",
        "3",
        "--dry-penalty-last-n",
        "64",
        "--dry-sequence-breaker",
        "\n",
        "--mirostat",
        "2",
        "--mirostat-lr",
        "0.2",
        "--mirostat-ent",
        "4",
        "--sampler-seq",
        "kt",
    ];
    let (a, notes) = serve(&words, &[]).unwrap();
    assert!(notes.is_empty(), "{notes:?}");
    let mut d = hmoe_server::SamplingDefaults::default();
    a.samplers.apply(&mut d).unwrap();
    let p = &d.params;
    assert_eq!((p.typical_p, p.top_n_sigma), (0.9, 1.5));
    assert_eq!((p.xtc_probability, p.xtc_threshold), (0.5, 0.2));
    assert_eq!(
        (p.dry.multiplier, p.dry.base, p.dry.allowed_length),
        (0.8, 2.0, 3)
    );
    assert_eq!(p.dry.penalty_last_n, Some(64));
    assert_eq!(
        (p.mirostat, p.mirostat_eta, p.mirostat_tau),
        (hmoe_engine::Mirostat::V2, 0.2, 4.0)
    );
    assert_eq!(p.order.len(), 2);
    assert_eq!(d.dry_sequence_breakers, vec!["\n".to_string()]);
}

#[test]
fn long_flags_take_underscores_for_dashes() {
    // llama.cpp reads `_` in a long flag as `-` (its server tests pass `--backend_sampling`).
    let (a, notes) = serve(
        &[
            "-m",
            "m",
            "--ctx_size",
            "512",
            "--backend_sampling",
            "--n_gpu_layers=3",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(a.placement.args.ctx_size, Some(512));
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].starts_with("--backend-sampling (--backend_sampling) does not apply"),
        "{notes:?}"
    );
    // Short flags and values keep theirs.
    let (a, _) = serve(&["-m", "my_model.gguf", "-c", "256"], &[]).unwrap();
    assert_eq!(a.model.as_deref(), Some("my_model.gguf".as_ref()));
}
