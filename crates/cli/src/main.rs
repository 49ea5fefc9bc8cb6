//! `hmoe`: run, inspect and serve Mixture-of-Experts GGUF models.

mod bench_cmd;
mod chat_cmd;
mod common;
mod demo_cmd;
mod fit_cmd;
mod inspect_cmd;
mod llama_flags;
mod make_model_cmd;
mod models_preset;
mod perplexity_cmd;
mod placement_args;
mod run_cmd;
mod serve_cmd;
mod serve_sampler_flags;
mod tokenize_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "hmoe",
    version,
    about = "Mixture-of-Experts inference engine",
    arg_required_else_help = true,
    propagate_version = true
)]
struct Cli {
    /// Print the GPUs found, with total and free memory, and exit (as llama.cpp's flag).
    #[arg(long = "list-devices", global = true)]
    list_devices: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt.
    Run(run_cmd::RunArgs),
    /// Print a model's metadata and tensor table.
    Inspect(inspect_cmd::InspectArgs),
    /// Write a random-weight model with a real architecture.
    MakeTestModel(make_model_cmd::MakeModelArgs),
    /// Perplexity of a model on a text file (like llama-perplexity).
    Perplexity(perplexity_cmd::PerplexityArgs),
    /// Make a small model and generate from it: a first run on a fresh machine.
    Demo(demo_cmd::DemoArgs),
    /// Chat with a model in the terminal (uses its chat template).
    Chat(chat_cmd::ChatArgs),
    /// Tokenize text with a model's vocabulary.
    Tokenize(tokenize_cmd::TokenizeArgs),
    /// Plan tensor placement and print the memory estimate per device.
    Fit(fit_cmd::FitArgs),
    /// Measure prompt and generation speed as llama-bench does (its table and JSON fields).
    Bench(bench_cmd::BenchArgs),
    /// Serve models over an OpenAI-compatible HTTP API (llama-server's routes and flags).
    ///
    /// Every flag of llama-server (its spellings, short forms and `LLAMA_ARG_*` variables; the
    /// command line wins) is accepted: one listed below is implemented; one that asks for what
    /// hmoe always does (`--jinja`, `--cont-batching`) is taken silently; any other prints one
    /// note at start saying what hmoe does instead. A flag given twice takes its last value
    /// (repeatable ones such as `--api-key` and `-ot` add up).
    #[command(after_help = serve_cmd::LIMITS_HELP, args_override_self = true)]
    Serve(Box<serve_cmd::ServeArgs>),
    /// Print the GPUs found, with total and free memory (same as `hmoe --list-devices`).
    ListDevices,
}

/// The command line for clap: `serve`'s words rewritten from llama-server's flags and the
/// `LLAMA_ARG_*`/`HMOE_ARG_*` variables ([`llama_flags::rewrite_serve`]), with the notes for
/// the flags that do not apply; the other commands' multi-letter short flags rewritten
/// ([`llama_flags::rewrite_short_flags`]).
fn normalise_args(
    args: Vec<String>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<(Vec<String>, Vec<String>), String> {
    let command = args.iter().skip(1).position(|a| !a.starts_with('-'));
    match command.map(|i| i + 1) {
        Some(i) if args[i] == "serve" => {
            let serve = llama_flags::rewrite_serve(&args[i + 1..], env)?;
            let mut out = args[..=i].to_vec();
            out.extend(serve.args);
            Ok((out, serve.notes))
        }
        _ => Ok((
            llama_flags::rewrite_short_flags(args.into_iter()),
            Vec::new(),
        )),
    }
}

/// The log filter: `RUST_LOG` if set, else warnings and the request log; `-v`/`--verbose` make
/// it `debug`, `--log-disable` turns logging off, and `-lv N` (`--log-verbosity`, llama.cpp's
/// levels) sets it: 0–1 errors, 2 warnings, 3 the default, 4–5 debug. Read here because
/// logging starts before the command line is parsed.
fn log_filter(args: &[String]) -> tracing_subscriber::EnvFilter {
    let flag = |names: &[&str]| args.iter().skip(1).any(|a| names.contains(&a.as_str()));
    let mut verbosity = None;
    for (i, a) in args.iter().enumerate().skip(1) {
        if a == "--log-verbosity" {
            verbosity = args.get(i + 1).and_then(|v| v.parse::<i64>().ok());
        } else if let Some(v) = a.strip_prefix("--log-verbosity=") {
            verbosity = v.parse().ok();
        }
    }
    let default = "warn,hmoe_server::request=info";
    let filter = match verbosity {
        _ if flag(&["--log-disable"]) => "off",
        _ if flag(&["-v", "--verbose"]) => "debug",
        Some(n) if n >= 4 => "debug",
        Some(3) => default,
        Some(2) => "warn",
        Some(_) => "error",
        None => {
            return tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default))
        }
    };
    tracing_subscriber::EnvFilter::new(filter)
}

/// Exits with clap's error, except for an unknown flag: clap suggests any flag that looks a
/// little alike (it told `--numa` to try `--no-mmap`), so hmoe suggests only a near miss
/// ([`near_miss`]) among the command's flags and, for `serve`, llama-server's.
fn parse_error(e: clap::Error, args: &[String]) -> ! {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        e.exit()
    };
    if e.kind() != ErrorKind::UnknownArgument || !arg.starts_with('-') {
        e.exit()
    }
    let top = <Cli as clap::CommandFactory>::command();
    let name = args.iter().skip(1).find(|a| !a.starts_with('-'));
    let command = name.and_then(|n| top.find_subcommand(n)).unwrap_or(&top);
    let mut known: Vec<String> = Vec::new();
    for a in command.get_arguments() {
        known.extend(
            a.get_long_and_visible_aliases()
                .into_iter()
                .flatten()
                .map(|l| format!("--{l}")),
        );
        known.extend(a.get_short().map(|c| format!("-{c}")));
    }
    if command.get_name() == "serve" {
        known.extend(
            llama_flags::LLAMA_SERVER_FLAGS
                .iter()
                .flat_map(|f| f.names)
                .map(|n| n.to_string()),
        );
    }
    let flag = arg.split_once('=').map_or(arg.as_str(), |(f, _)| f);
    eprintln!("error: unexpected argument '{arg}' found");
    if let Some(m) = near_miss(flag, &known) {
        eprintln!("\n  tip: a similar flag exists: '{m}'");
    }
    eprintln!("\nFor more information, try '--help'.");
    std::process::exit(2)
}

/// The flag of `known` nearest to `flag` when it is a near miss: at most two edits (a swap of
/// neighbours is one), and at most one per three letters.
fn near_miss<'a>(flag: &str, known: &'a [String]) -> Option<&'a str> {
    let letters = flag.trim_start_matches('-').chars().count();
    (known.iter())
        .map(|k| (edit_distance(flag, k), k))
        .filter(|&(d, _)| d <= 2 && d * 3 <= letters)
        .min_by_key(|&(d, _)| d)
        .map(|(_, k)| k.as_str())
}

/// Insertions, deletions, substitutions and swaps of neighbours that turn `a` into `b`.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

/// Whether the error is a write to a closed pipe (`hmoe inspect M | head`): the reader has
/// what it wanted, so the command ends quietly.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn main() {
    // Before any large allocation (see the module's docs).
    hmoe_cpu::allocator::fix_allocator_thresholds();
    let (args, notes) = match normalise_args(std::env::args().collect(), |k| std::env::var(k).ok())
    {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(log_filter(&args))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let mut cli = Cli::try_parse_from(&args).unwrap_or_else(|e| parse_error(e, &args));
    if let Some(Command::Serve(serve)) = &mut cli.command {
        serve.llama_notes = notes;
        let command = args.iter().skip(1).position(|a| !a.starts_with('-'));
        serve.argv = command.map_or_else(Vec::new, |i| args[i + 2..].to_vec());
    }
    let result = match cli.command {
        _ if cli.list_devices => list_devices(),
        Some(command) => run(command),
        None => list_devices(),
    };
    if let Err(e) = result {
        if is_broken_pipe(&e) {
            return;
        }
        // The cause chain on one line; no backtrace even when RUST_BACKTRACE is set.
        eprintln!("error: {}", error_text(&e));
        std::process::exit(1);
    }
}

/// The cause chain on one line, as `{:#}` writes it, except that a cause whose text its
/// parent's message already ends with (an error that prints its source, e.g. "cannot open F:
/// No such file or directory (os error 2)") is not written again.
fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.is_empty() {
            if out.ends_with(&text) {
                continue;
            }
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run(args) => run_cmd::run(args),
        Command::Inspect(args) => inspect_cmd::run(args),
        Command::MakeTestModel(args) => make_model_cmd::run(args),
        Command::Perplexity(args) => perplexity_cmd::run(args),
        Command::Demo(args) => demo_cmd::run(args),
        Command::Chat(args) => chat_cmd::run(args),
        Command::Tokenize(args) => tokenize_cmd::run(args),
        Command::Fit(args) => fit_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Serve(args) => serve_cmd::run(*args),
        Command::ListDevices => list_devices(),
    }
}

/// `--list-devices`: llama.cpp's list on stdout, the CUDA GPUs then the reference device
/// `REF0` (marked as a testing device); without CUDA a note on stderr (exit 0).
fn list_devices() -> anyhow::Result<()> {
    let probed = hmoe_engine::Probed::now();
    print!("{}", device_list(&probed));
    if let Some(why) = &probed.why_none {
        eprintln!("note: CUDA not found or no GPU: {why}");
    }
    Ok(())
}

/// `Available devices:` then `  CUDA0: NAME (TOTAL MiB, FREE MiB free)` per GPU, then
/// `REF0` with its default memory (`--gpu-mem` sets it).
fn device_list(probed: &hmoe_engine::Probed) -> String {
    let mut out = String::from("Available devices:\n");
    for g in &probed.gpus {
        out.push_str(&format!(
            "  {}: {} ({} MiB, {} MiB free)\n",
            g.device_name(),
            g.name,
            g.total_bytes >> 20,
            g.free_bytes >> 20
        ));
    }
    let ref0 = hmoe_engine::REF0_DEFAULT_BYTES >> 20;
    out.push_str(&format!(
        "  {}: reference device, for testing: plain Rust on the CPU, used as a GPU \
         ({ref0} MiB, {ref0} MiB free; --gpu-mem sets it)\n",
        hmoe_backend::REF0_NAME
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_list_is_llama_cpp_shaped() {
        let probed = hmoe_engine::Probed {
            gpus: vec![hmoe_cuda::GpuInfo {
                index: 0,
                name: "NVIDIA H200".into(),
                total_bytes: 143_771 << 20,
                free_bytes: (143_000 << 20) + 5,
                compute_capability: (9, 0),
            }],
            why_none: None,
        };
        let ref0 = "  REF0: reference device, for testing: plain Rust on the CPU, used as a GPU \
                    (16384 MiB, 16384 MiB free; --gpu-mem sets it)\n";
        assert_eq!(
            device_list(&probed),
            format!(
                "Available devices:\n  CUDA0: NVIDIA H200 (143771 MiB, 143000 MiB free)\n{ref0}"
            )
        );
        assert_eq!(
            device_list(&hmoe_engine::Probed::default()),
            format!("Available devices:\n{ref0}")
        );
    }

    #[test]
    fn an_os_error_is_written_once() {
        #[derive(Debug)]
        struct Open(std::io::Error);
        impl std::fmt::Display for Open {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "cannot open m.gguf: {}", self.0)
            }
        }
        impl std::error::Error for Open {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let io = std::io::Error::from_raw_os_error(2);
        let e = anyhow::Error::new(Open(io)).context("loading m.gguf");
        let text = super::error_text(&e);
        assert_eq!(text.matches("os error 2").count(), 1, "{text}");
        assert!(
            text.starts_with("loading m.gguf: cannot open m.gguf: "),
            "{text}"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(super::error_text(&plain), "outer: inner");
    }

    #[test]
    fn suggestions_are_near_misses_only() {
        let known: Vec<String> = ["--no-mmap", "--numa", "--ctx-size", "--top-p", "-ts"]
            .map(String::from)
            .to_vec();
        assert_eq!(near_miss("--nmua", &known), Some("--numa"));
        assert_eq!(near_miss("--ctx-sise", &known), Some("--ctx-size"));
        assert_eq!(near_miss("--nummy", &known), None);
        assert_eq!(
            near_miss("-tz", &known),
            None,
            "one letter in two is no near miss"
        );
        assert_eq!(near_miss("--tensor-split-x", &known), None);
        assert_eq!(edit_distance("abcd", "abdc"), 1);
    }

    #[test]
    fn log_verbosity_sets_the_filter() {
        let filter = |words: &[&str]| {
            let args: Vec<String> = std::iter::once("hmoe")
                .chain(words.iter().copied())
                .map(String::from)
                .collect();
            log_filter(&args).to_string()
        };
        assert_eq!(filter(&["serve", "--log-verbosity", "5"]), "debug");
        assert_eq!(filter(&["serve", "--log-verbosity=1"]), "error");
        assert_eq!(filter(&["serve", "--log-verbosity", "2"]), "warn");
        assert_eq!(filter(&["serve", "--log-verbosity", "2", "-v"]), "debug");
        assert_eq!(
            filter(&["serve", "--log-verbosity", "5", "--log-disable"]),
            "off"
        );
    }

    #[test]
    fn list_devices_flag_and_subcommand_parse() {
        let cli = Cli::try_parse_from(["hmoe", "--list-devices"]).unwrap();
        assert!(cli.list_devices && cli.command.is_none());
        let cli = Cli::try_parse_from(["hmoe", "list-devices"]).unwrap();
        assert!(matches!(cli.command, Some(Command::ListDevices)));
        let argv = normalise_args(
            ["hmoe", "fit", "-m", "x.gguf", "-dev", "none"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            |_| None,
        )
        .unwrap()
        .0;
        let cli = Cli::try_parse_from(argv).unwrap();
        let Some(Command::Fit(fit)) = cli.command else {
            panic!("fit")
        };
        assert_eq!(fit.placement.args.device.as_deref(), Some("none"));
    }
}
