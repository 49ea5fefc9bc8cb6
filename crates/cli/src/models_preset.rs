//! `hmoe serve --models-preset FILE.ini`: router mode's per-model settings, in llama-server's
//! INI format (llama.cpp d32676d77, `common/preset.cpp`): a `[NAME]` section per model, a
//! `[*]` section for every model, `key = value` lines whose keys are flag names without their
//! dashes (`n-cpu-moe`, `c`, `ctx-size`, `ngl`) or their `LLAMA_ARG_*` variables, `;` and `#`
//! comments, and a `version` key that is skipped. A switch takes a truth value (`no-mmap =
//! true`, `mmap = false`). A section's `model` key gives the file of a model that is not in
//! `--models-dir` (or `hf-repo = OWNER/NAME[:QUANT]` a model of the local Hugging Face cache,
//! see `hmoe serve -hf`), and `alias` its other names.
//!
//! Each model is configured as `hmoe serve` would be with the `[*]` flags, then its section's,
//! then the command line's (which win, as in llama-server): its placement (`n-cpu-moe`,
//! `n-gpu-layers`, `-ot`, `fit`, devices), context, slots, K/V types, load mode and chat
//! template apply when it loads, planned as `hmoe fit` plans. Flags that set the whole server
//! (sampling defaults, limits, the address, API keys, `--models-*`) are not per model: a
//! preset giving one prints a note and it is ignored. An unknown key, a bad value or a
//! malformed line is an error at start naming the file, the section and the key.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::{CommandFactory, Parser};
use hmoe_server::{ModelPreset, ServerConfig};

use crate::llama_flags::{Env, LlamaFlag, Takes, LLAMA_SERVER_FLAGS};
use crate::placement_args::PlacementFlagArgs;
use crate::serve_cmd::ServeArgs;

/// The largest preset file read (a larger one is an error, not a long start).
const MAX_FILE_BYTES: u64 = 1 << 20;

/// The most sections (models) a preset file may have.
const MAX_SECTIONS: usize = 256;

/// The longest section (model) name.
const MAX_NAME: usize = 256;

/// The flags of `hmoe serve` other than the placement flags that a model loads with.
const PER_MODEL: &[&str] = &[
    "--no-mmap",
    "--mlock",
    "--load-mode",
    "--flash-attn",
    "--no-kv-offload",
    "--chat-template",
    "--chat-template-file",
];

/// Set by the router for every model: llama-server drops them from presets, so does hmoe.
const RESERVED: &[&str] = &[
    "--host",
    "--port",
    "--api-key",
    "--api-key-file",
    "--models-dir",
    "--models-max",
    "--models-preset",
    "--models-autoload",
    "--no-models-autoload",
];

/// One `[section]` of the file: its keys and values in order.
#[derive(Debug, Default, PartialEq)]
struct Section {
    name: String,
    entries: Vec<(String, String)>,
}

/// The sections of an INI text (keys before the first section: only `version`).
fn parse_ini(text: &str) -> Result<Vec<Section>, String> {
    let mut sections: Vec<Section> = Vec::new();
    for (no, raw) in text.lines().enumerate() {
        let line = raw.trim_start_matches([' ', '\t']);
        let at = |why: &str| format!("line {}: {why}", no + 1);
        if line.is_empty() || line.starts_with([';', '#']) {
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            let (name, after) = rest
                .split_once(']')
                .ok_or_else(|| at("a section header needs a closing `]`"))?;
            if !is_blank_or_comment(after) {
                return Err(at("nothing but a comment may follow a section header"));
            }
            let name = name.trim_matches([' ', '\t']);
            if name.is_empty() || name.len() > MAX_NAME || name.chars().any(char::is_control) {
                return Err(at(&format!(
                    "a section name has 1 to {MAX_NAME} printable characters"
                )));
            }
            if sections.len() == MAX_SECTIONS {
                return Err(at(&format!("more than {MAX_SECTIONS} sections")));
            }
            sections.push(Section {
                name: name.to_string(),
                entries: Vec::new(),
            });
            continue;
        }
        let (key, value) = key_value(line)
            .ok_or_else(|| at("expected `[section]`, `key = value` or a comment"))?;
        match sections.last_mut() {
            Some(s) => s.entries.push((key.to_string(), value.to_string())),
            None if key == "version" => {}
            None => return Err(at(&format!("`{key}` comes before any [section]"))),
        }
    }
    Ok(sections)
}

fn is_blank_or_comment(s: &str) -> bool {
    let s = s.trim_start_matches([' ', '\t']);
    s.is_empty() || s.starts_with([';', '#'])
}

/// `key = value ; comment` → (key, value); keys are `[A-Za-z_][A-Za-z0-9_.-]*`.
fn key_value(line: &str) -> Option<(&str, &str)> {
    let (key, rest) = line.split_once('=')?;
    let key = key.trim_end_matches([' ', '\t']);
    let mut chars = key.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c)) {
        return None;
    }
    let rest = rest.trim_start_matches([' ', '\t']);
    // The value ends where a comment starts (after white space, or at its start).
    let mut end = rest.len();
    let bytes = rest.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if (*b == b';' || *b == b'#') && (i == 0 || bytes[i - 1] == b' ' || bytes[i - 1] == b'\t') {
            end = i;
            break;
        }
    }
    Some((key, rest[..end].trim_end_matches([' ', '\t'])))
}

/// What a key names: a llama-server row, or one of hmoe serve's own flags (long spelling,
/// and whether it takes a value).
enum Flag {
    Llama(&'static LlamaFlag),
    Hmoe(String, bool),
}

/// The flag `key` names: a llama-server spelling without dashes, a `LLAMA_ARG_*` variable, or
/// one of `hmoe serve`'s flags (long name, alias or short letter).
fn flag_of(key: &str) -> Option<Flag> {
    let dashed = [format!("--{key}"), format!("-{key}")];
    let llama = LLAMA_SERVER_FLAGS.iter().find(|f| {
        f.env.name() == Some(key) || f.names.iter().any(|n| dashed.iter().any(|d| d == n))
    });
    if let Some(f) = llama {
        return Some(Flag::Llama(f));
    }
    let command = <ServeOnly as CommandFactory>::command();
    let arg = command.get_arguments().find(|a| {
        a.get_long() == Some(key)
            || a.get_all_aliases().is_some_and(|al| al.contains(&key))
            || (key.chars().count() == 1 && a.get_short().map(String::from).as_deref() == Some(key))
    })?;
    let long = format!("--{}", arg.get_long()?);
    Some(Flag::Hmoe(long, arg.get_action().takes_values()))
}

fn truth(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" | "enabled" => Some(true),
        "0" | "false" | "off" | "no" | "disabled" => Some(false),
        _ => None,
    }
}

/// A switch's words for `value`: the switch when true; when false, its negation (the row of
/// the same variable with the other sense: `mmap = false` is `--no-mmap`), else nothing.
fn switch_words(flag: &'static LlamaFlag, on: bool) -> Vec<String> {
    let (var, positive) = match flag.env {
        Env::IfTrue(v) => (v, true),
        Env::IfFalse(v) => (v, false),
        _ => {
            return if on {
                vec![flag.long_name().into()]
            } else {
                vec![]
            }
        }
    };
    if on {
        return vec![flag.long_name().into()];
    }
    let opposite = LLAMA_SERVER_FLAGS.iter().find(|f| match f.env {
        Env::IfTrue(v) => v == var && !positive,
        Env::IfFalse(v) => v == var && positive,
        _ => false,
    });
    opposite.map_or_else(Vec::new, |f| vec![f.long_name().into()])
}

/// A section turned into flags: the words (llama-server's or hmoe's spelling), the model file
/// and aliases it names, and notes for keys it ignores.
#[derive(Debug, Default)]
struct SectionFlags {
    words: Vec<String>,
    model: Option<PathBuf>,
    aliases: Vec<String>,
    notes: Vec<String>,
}

/// Whether a flag (hmoe's long spelling) sets how a model loads, rather than the server.
fn is_per_model(long: &str) -> bool {
    PER_MODEL.contains(&long)
        || <PlacementOnly as CommandFactory>::command()
            .get_arguments()
            .any(|a| {
                a.get_long()
                    .is_some_and(|l| long.strip_prefix("--") == Some(l))
            })
}

fn section_flags(s: &Section) -> Result<SectionFlags, String> {
    let mut out = SectionFlags::default();
    for (key, value) in &s.entries {
        if key == "version" {
            continue;
        }
        let bad = |why: String| format!("[{}] {key} = {value}: {why}", s.name);
        let flag = flag_of(key).ok_or_else(|| {
            format!(
                "option '{key}' not recognized in preset '{}' (keys are flag names without \
                 dashes, e.g. n-cpu-moe, ctx-size, n-gpu-layers)",
                s.name
            )
        })?;
        let (long, takes, row) = match flag {
            Flag::Llama(f) => {
                let long = match f.does {
                    crate::llama_flags::Does::Hmoe(l) => l.to_string(),
                    _ => f.long_name().to_string(),
                };
                (long, f.takes, Some(f))
            }
            Flag::Hmoe(long, true) => (long, Takes::Value, None),
            Flag::Hmoe(long, false) => (long, Takes::Nothing, None),
        };
        match long.as_str() {
            "--model" if s.name == "*" => return Err(bad("[*] cannot name a model file".into())),
            "--model" => out.model = Some(PathBuf::from(value)),
            "--hf-repo" if s.name == "*" => {
                return Err(bad("[*] cannot name a model repository".into()))
            }
            "--hf-repo" => {
                let file =
                    crate::serve_cmd::cached_model(value).map_err(|e| bad(format!("{e:#}")))?;
                out.model = Some(file);
            }
            "--alias" => out.aliases.extend(
                (value.split(',').map(str::trim))
                    .filter(|a| !a.is_empty())
                    .map(String::from),
            ),
            l if RESERVED.contains(&l) => out.notes.push(format!(
                "--models-preset [{}] {key}: the router sets it for every model; ignored",
                s.name
            )),
            l if row.is_none_or(|r| matches!(r.does, crate::llama_flags::Does::Hmoe(_)))
                && !is_per_model(l) =>
            {
                out.notes.push(format!(
                    "--models-preset [{}] {key}: it sets the whole server (every model runs \
                     in hmoe's one process), not one model; give it on the command line; \
                     ignored",
                    s.name
                ))
            }
            _ => match takes {
                Takes::Nothing => {
                    let on = truth(value).ok_or_else(|| bad("expected true or false".into()))?;
                    match row {
                        Some(r) => out.words.extend(switch_words(r, on)),
                        None if on => out.words.push(long),
                        None => {}
                    }
                }
                Takes::TwoValues => {
                    out.words.push(long);
                    out.words
                        .extend(value.split_whitespace().take(2).map(String::from));
                }
                Takes::Value | Takes::MaybeValue => {
                    out.words.push(long);
                    out.words.push(value.clone());
                }
            },
        }
    }
    Ok(out)
}

/// `hmoe serve`'s flags alone, parsed as the command line is (a flag given twice takes its
/// last value).
#[derive(Parser)]
#[command(name = "hmoe serve", args_override_self = true)]
struct ServeOnly {
    #[command(flatten)]
    serve: ServeArgs,
}

/// The placement flags alone (which flags apply per model).
#[derive(Parser)]
struct PlacementOnly {
    #[command(flatten)]
    placement: PlacementFlagArgs,
}

/// The server configuration of `words` (llama-server spellings rewritten), with the
/// preset-free command line `argv` after them; its notes are added to `notes`.
fn configure(
    words: &[String],
    argv: &[String],
    notes: &mut Vec<String>,
) -> Result<ServerConfig, String> {
    let rewritten = crate::llama_flags::rewrite_serve(words, |_| None)?;
    notes.extend(rewritten.notes);
    let line = std::iter::once("hmoe serve".to_string())
        .chain(rewritten.args)
        .chain(argv.iter().cloned());
    let mut parsed = ServeOnly::try_parse_from(line).map_err(|e| {
        let text = e.render().to_string();
        let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        first.trim_start_matches("error: ").to_string()
    })?;
    parsed.serve.models_preset = None;
    parsed.serve.config().map_err(|e| format!("{e:#}"))
}

/// The words of `flags` as shown in `/models` (hmoe's spelling).
fn shown_args(words: &[String]) -> Vec<String> {
    crate::llama_flags::rewrite_serve(words, |_| None).map_or_else(|_| words.to_vec(), |r| r.args)
}

/// Reads `file` and sets `config`'s presets: each section a model, `[*]` the settings of
/// every model without a section. `argv` is the command line after `serve`. Notes for
/// ignored keys are printed. The server reads the file again the same way for
/// `GET /models?reload=1` ([`ServerConfig::preset_reader`]).
pub fn apply(file: &Path, argv: &[String], config: &mut ServerConfig) -> anyhow::Result<()> {
    let (presets, default) = read(file, argv)?;
    config.presets = presets;
    config.preset_default = default;
    let (file, argv) = (file.to_path_buf(), argv.to_vec());
    config.preset_reader = Some(Arc::new(move || {
        read(&file, &argv).map_err(|e| format!("{e:#}"))
    }));
    Ok(())
}

/// The presets of `file` by model name, and its `[*]` section's; notes are printed.
fn read(
    file: &Path,
    argv: &[String],
) -> anyhow::Result<(BTreeMap<String, ModelPreset>, Option<ModelPreset>)> {
    let text = read_limited(file)?;
    let ctx = || format!("--models-preset {}", file.display());
    let sections = parse_ini(&text)
        .map_err(anyhow::Error::msg)
        .with_context(ctx)?;
    // Sections of one name merge, later keys winning (as llama-server's map does).
    let mut merged: BTreeMap<String, Section> = BTreeMap::new();
    for s in sections {
        let e = merged.entry(s.name.clone()).or_default();
        e.name = s.name;
        e.entries.extend(s.entries);
    }
    let global = match merged.remove("*") {
        Some(s) => section_flags(&s)
            .map_err(anyhow::Error::msg)
            .with_context(ctx)?,
        None => SectionFlags::default(),
    };
    let mut notes = global.notes.clone();
    let mut presets = BTreeMap::new();
    for (name, s) in &merged {
        let flags = section_flags(s)
            .map_err(anyhow::Error::msg)
            .with_context(ctx)?;
        notes.extend(flags.notes.iter().cloned());
        let words = [global.words.clone(), flags.words].concat();
        let c = configure(&words, argv, &mut notes)
            .map_err(|e| anyhow::anyhow!("[{name}]: {e}"))
            .with_context(ctx)?;
        presets.insert(
            name.clone(),
            ModelPreset {
                path: flags.model,
                aliases: flags.aliases,
                args: shown_args(&words),
                engine: c.engine,
                chat: c.chat,
                loader: c.loader,
            },
        );
    }
    let mut default = None;
    if !global.words.is_empty() {
        let c = configure(&global.words, argv, &mut notes)
            .map_err(|e| anyhow::anyhow!("[*]: {e}"))
            .with_context(ctx)?;
        default = Some(ModelPreset {
            path: None,
            aliases: Vec::new(),
            args: shown_args(&global.words),
            engine: c.engine,
            chat: c.chat,
            loader: c.loader,
        });
    }
    notes.dedup();
    for note in notes {
        eprintln!("note: {note}");
    }
    Ok((presets, default))
}

/// Router mode's start-up lines: autoload off, and each preset's flags.
pub fn summary(config: &ServerConfig) -> Vec<String> {
    let mut out = Vec::new();
    if !config.models_autoload {
        out.push("--no-models-autoload: a model serves once POST /models/load loads it".into());
    }
    let presets = config.preset_default.iter().map(|p| ("*", p));
    for (name, p) in presets.chain(config.presets.iter().map(|(n, p)| (n.as_str(), p))) {
        let file = p.path.as_ref().map(|f| format!(" ({})", f.display()));
        out.push(format!(
            "preset [{name}]{}: {}",
            file.unwrap_or_default(),
            p.args.join(" ")
        ));
    }
    out
}

/// The file's text, if it is a regular file of at most [`MAX_FILE_BYTES`] in UTF-8.
fn read_limited(file: &Path) -> anyhow::Result<String> {
    let ctx = || format!("--models-preset {}", file.display());
    let meta = std::fs::metadata(file).with_context(ctx)?;
    if !meta.is_file() {
        bail!("{}: not a regular file", ctx());
    }
    let mut bytes = Vec::new();
    std::fs::File::open(file)
        .with_context(ctx)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(ctx)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        bail!(
            "{}: larger than {} KiB; a preset file holds a few lines per model",
            ctx(),
            MAX_FILE_BYTES >> 10
        );
    }
    String::from_utf8(bytes).map_err(|_| anyhow::anyhow!("{}: not UTF-8 text", ctx()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ini_lines() {
        let s = parse_ini(
            "version = 1\n; comment\n[*]\nc = 512 ; trailing\n\n[ alpha ]  # c\n\
             n-cpu-moe=2\r\nalias = a, b\n  chat-template = a#b\n",
        )
        .unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].name, "*");
        assert_eq!(s[0].entries, vec![("c".into(), "512".into())]);
        assert_eq!(s[1].name, "alpha");
        assert_eq!(s[1].entries[0], ("n-cpu-moe".into(), "2".into()));
        assert_eq!(s[1].entries[1], ("alias".into(), "a, b".into()));
        assert_eq!(s[1].entries[2], ("chat-template".into(), "a#b".into()));
        for bad in [
            "c = 1\n",
            "[x\n",
            "[]\n",
            "[x]\n--c = 1\n",
            "[x] y\n",
            "[x]\nc\n",
        ] {
            assert!(parse_ini(bad).is_err(), "{bad:?}");
        }
        let many: String = (0..=MAX_SECTIONS).map(|i| format!("[m{i}]\n")).collect();
        assert!(parse_ini(&many).unwrap_err().contains("sections"));
    }

    #[test]
    fn keys_become_flags() {
        let s = Section {
            name: "m".into(),
            entries: [
                ("n-cpu-moe", "3"),
                ("c", "4096"),
                ("LLAMA_ARG_N_GPU_LAYERS", "99"),
                ("mmap", "false"),
                ("fit", "off"),
                ("gpu-mem", "8GiB"),
                ("alias", "x,y"),
                ("temp", "0.5"),
                ("port", "1"),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        };
        let f = section_flags(&s).unwrap();
        assert_eq!(
            f.words,
            [
                "--n-cpu-moe",
                "3",
                "--ctx-size",
                "4096",
                "--n-gpu-layers",
                "99",
                "--no-mmap",
                "--fit",
                "off",
                "--gpu-mem",
                "8GiB"
            ]
        );
        assert_eq!(f.aliases, ["x", "y"]);
        assert_eq!(f.notes.len(), 2, "{:?}", f.notes);
        let unknown = Section {
            name: "m".into(),
            entries: vec![("bogus-key".into(), "1".into())],
        };
        let err = section_flags(&unknown).unwrap_err();
        assert!(err.contains("'bogus-key'") && err.contains("'m'"), "{err}");
        let bad_switch = Section {
            name: "m".into(),
            entries: vec![("no-mmap".into(), "maybe".into())],
        };
        assert!(section_flags(&bad_switch).is_err());
    }
}
