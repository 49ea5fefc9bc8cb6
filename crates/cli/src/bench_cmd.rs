//! `hmoe bench`: prompt-processing and generation speed, printed as llama-bench prints it
//! (the markdown table, or its JSON / JSONL / CSV records with the same field names), and
//! optionally the roofline: the t/s the machine's memory bandwidth allows for generation.

use std::io::Write;

use anyhow::{bail, Context};
use hmoe_engine::{
    kv_bytes_per_token, measure_read_bandwidth, run_test, BenchConfig, BenchSamples, BenchTest,
    WeightTraffic,
};
use hmoe_model::{LanguageModel, MoeCacheStats};
use serde_json::{json, Map, Value};

use crate::common::ModelArgs;

/// Output formats (llama-bench's `-o`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// Markdown table.
    Md,
    /// One JSON array of test records.
    Json,
    /// One JSON record per line.
    Jsonl,
    /// Comma-separated values with a header line.
    Csv,
}

/// Arguments of `hmoe bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths to test: `512`, `128,512`, `64-512*2`, `100-400+100` (0 = no prompt test).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_name = "N[,N...]",
        default_value = "512"
    )]
    pub n_prompt: String,
    /// Generation lengths to test, same syntax (0 = no generation test).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_name = "N[,N...]",
        default_value = "128"
    )]
    pub n_gen: String,
    /// Tokens already in the cache before each test, same syntax.
    #[arg(
        short = 'd',
        long = "n-depth",
        value_name = "N[,N...]",
        default_value = "0"
    )]
    pub n_depth: String,
    /// Timed repetitions of each test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub repetitions: u32,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "md")]
    pub output: OutputFormat,
    /// Skip the untimed warm-up run of each test.
    #[arg(long = "no-warmup")]
    pub no_warmup: bool,
    /// Also measure the memory read bandwidth and report each generation test against the
    /// t/s it allows (weight bytes read per token / bandwidth).
    #[arg(long = "roofline")]
    pub roofline: bool,
    /// Size of the buffer the bandwidth is measured over (much larger than the caches).
    #[arg(long = "roofline-mib", default_value_t = 1024,
          value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub roofline_mib: u64,
    /// Passes over the buffer; the fastest counts.
    #[arg(long = "roofline-runs", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub roofline_runs: u32,
}

/// Parses llama-bench's integer lists: comma-separated items, each `N`, `A-B` (step 1),
/// `A-B+S` or `A-B*M`; negative values are rejected.
fn parse_counts(flag: &str, s: &str) -> anyhow::Result<Vec<usize>> {
    let num = |p: &str| -> anyhow::Result<usize> {
        p.trim()
            .parse::<usize>()
            .with_context(|| format!("{flag}: `{p}` is not a non-negative integer"))
    };
    let mut out = Vec::new();
    for item in s.split(',') {
        let item = item.trim();
        if item.is_empty() {
            bail!("{flag}: empty item in `{s}`");
        }
        let Some((first, rest)) = item.split_once('-') else {
            out.push(num(item)?);
            continue;
        };
        let (first, step) = (num(first)?, rest.find(['+', '*']));
        let (last, next): (usize, Box<dyn Fn(usize) -> Option<usize>>) = match step {
            None => (num(rest)?, Box::new(|v: usize| v.checked_add(1))),
            Some(i) => {
                let (last, by) = (num(&rest[..i])?, num(&rest[i + 1..])?);
                let add = rest.as_bytes()[i] == b'+';
                let advances = if add { by > 0 } else { by > 1 && first > 0 };
                if !advances {
                    bail!("{flag}: `{item}` never advances");
                }
                let f: Box<dyn Fn(usize) -> Option<usize>> = if add {
                    Box::new(move |v: usize| v.checked_add(by))
                } else {
                    Box::new(move |v: usize| v.checked_mul(by))
                };
                (last, f)
            }
        };
        if last < first {
            bail!("{flag}: range `{item}` ends before it starts");
        }
        let mut v = Some(first);
        while let Some(x) = v.filter(|&x| x <= last) {
            out.push(x);
            if out.len() > 10_000 {
                bail!("{flag}: `{item}` has too many values");
            }
            v = next(x);
        }
    }
    Ok(out)
}

/// The test list in llama-bench's order: for each depth, the prompt tests then the
/// generation tests (zero lengths skipped).
fn tests(n_prompt: &[usize], n_gen: &[usize], n_depth: &[usize]) -> Vec<BenchTest> {
    let mut out = Vec::new();
    for &d in n_depth {
        for &p in n_prompt.iter().filter(|&&p| p > 0) {
            out.push(BenchTest {
                n_prompt: p,
                n_gen: 0,
                n_depth: d,
            });
        }
        for &g in n_gen.iter().filter(|&&g| g > 0) {
            out.push(BenchTest {
                n_prompt: 0,
                n_gen: g,
                n_depth: d,
            });
        }
    }
    out
}

/// What llama-bench says about the model and the run, once per run.
struct RunInfo {
    filename: String,
    model_type: String,
    size: u64,
    n_params: u64,
    n_batch: usize,
    n_ubatch: usize,
    n_threads: usize,
    type_k: String,
    type_v: String,
    n_cpu_moe: u32,
    no_op_offload: bool,
    cpu_info: String,
    engine: hmoe_engine::EngineUsed,
}

/// Roofline numbers for generation tests.
struct Roofline {
    bandwidth: f64,
    traffic: WeightTraffic,
}

/// Names a GGUF `general.file_type` value as llama.cpp does.
fn ftype_name(ftype: Option<u64>) -> &'static str {
    match ftype {
        Some(0) => "all F32",
        Some(1) => "F16",
        Some(2) => "Q4_0",
        Some(3) => "Q4_1",
        Some(7) => "Q8_0",
        Some(8) => "Q5_0",
        Some(9) => "Q5_1",
        Some(10) => "Q2_K - Medium",
        Some(11) => "Q3_K - Small",
        Some(12) => "Q3_K - Medium",
        Some(13) => "Q3_K - Large",
        Some(14) => "Q4_K - Small",
        Some(15) => "Q4_K - Medium",
        Some(16) => "Q5_K - Small",
        Some(17) => "Q5_K - Medium",
        Some(18) => "Q6_K",
        Some(32) => "BF16",
        Some(38) => "MXFP4 MoE",
        _ => "unknown",
    }
}

/// `1.23 B` / `456.78 M` parameters, llama-bench's units.
fn params_label(n: u64) -> String {
    if n < 1_000_000_000 {
        format!("{:.2} M", n as f64 / 1e6)
    } else {
        format!("{:.2} B", n as f64 / 1e9)
    }
}

/// A rounded parameter count for the model type when the file has no `general.size_label`.
fn count_label(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.0}B", n as f64 / 1e9)
    } else {
        format!("{:.0}M", n as f64 / 1e6)
    }
}

/// `12.34 GiB` / `567.89 MiB`, llama-bench's units.
fn size_label(bytes: u64) -> String {
    if bytes < 1 << 30 {
        format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    }
}

/// Bytes in the largest binary unit that keeps the number at least 1.
fn bytes_label(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", units[u])
}

fn cpu_info() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.split_once(':')
                    .filter(|(k, _)| k.trim() == "model name")
                    .map(|(_, v)| v.trim().to_string())
            })
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Now as RFC 3339 UTC (`2025-01-31T12:34:56Z`).
fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian, 400-year eras).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// One finished test, with everything its record shows.
struct Record<'a> {
    info: &'a RunInfo,
    test: BenchTest,
    time: String,
    samples: BenchSamples,
    roofline: Option<&'a Roofline>,
    /// KV cache bytes each generated token of the test reads on average (roofline only).
    kv_bytes: f64,
    /// Hits and misses of the device expert cache during the test (its warm-up included),
    /// when the model has one.
    moe_cache: Option<(u64, u64)>,
}

/// `hits / (hits + misses)` in percent (0 with no routed pair).
fn hit_percent((hits, misses): (u64, u64)) -> f64 {
    if hits + misses == 0 {
        0.0
    } else {
        100.0 * hits as f64 / (hits + misses) as f64
    }
}

/// The expert cache's line after the table: its budget and capacity, then each test's hits
/// and misses.
fn moe_cache_text(s: &MoeCacheStats, records: &[Record]) -> String {
    let tests: Vec<String> = (records.iter())
        .filter_map(|r| {
            let (h, m) = r.moe_cache?;
            Some(format!(
                "{} {h} hits / {m} misses ({:.1}%)",
                r.test.name(),
                hit_percent((h, m))
            ))
        })
        .collect();
    format!(
        "moe cache: {:.1} MiB, {} experts, {} uploads, {} evictions; {}",
        s.budget_bytes as f64 / (1u64 << 20) as f64,
        s.capacity,
        s.uploads,
        s.evictions,
        tests.join(", ")
    )
}

impl Record<'_> {
    /// llama-bench's record fields, in its order, as JSON values (the ones this engine has).
    fn fields(&self) -> Map<String, Value> {
        let i = self.info;
        let s = &self.samples;
        let mut m = Map::new();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        put("build_commit", json!(env!("CARGO_PKG_VERSION")));
        put("build_number", json!(0));
        put("cpu_info", json!(i.cpu_info));
        put("gpu_info", json!(i.engine.gpu_info));
        put("backends", json!(i.engine.backend));
        put("model_filename", json!(i.filename));
        put("model_type", json!(i.model_type));
        put("model_size", json!(i.size));
        put("model_n_params", json!(i.n_params));
        put("n_batch", json!(i.n_batch));
        put("n_ubatch", json!(i.n_ubatch));
        put("n_threads", json!(i.n_threads));
        put("type_k", json!(i.type_k));
        put("type_v", json!(i.type_v));
        put("n_gpu_layers", json!(i.engine.n_gpu_layers));
        put("n_cpu_moe", json!(i.n_cpu_moe));
        put("no_op_offload", json!(u8::from(i.no_op_offload)));
        put("n_prompt", json!(self.test.n_prompt));
        put("n_gen", json!(self.test.n_gen));
        put("n_depth", json!(self.test.n_depth));
        put("test_time", json!(self.time));
        put("avg_ns", json!(s.avg_ns().round() as u64));
        put("stddev_ns", json!(s.stddev_ns().round() as u64));
        put("avg_ts", json!(s.avg_ts()));
        put("stddev_ts", json!(s.stddev_ts()));
        m
    }

    /// The fields plus the samples and, for a generation test under `--roofline`, the limit.
    fn json(&self) -> Value {
        let mut m = self.fields();
        m.insert("samples_ns".into(), json!(self.samples.ns));
        m.insert("samples_ts".into(), json!(self.samples.ts()));
        if let Some((hits, misses)) = self.moe_cache {
            m.insert("moe_cache_hits".into(), json!(hits));
            m.insert("moe_cache_misses".into(), json!(misses));
            m.insert(
                "moe_cache_hit_rate".into(),
                json!(hit_percent((hits, misses)) / 100.0),
            );
        }
        if let Some((bound, fraction)) = self.bound() {
            let r = self.roofline.expect("bound implies roofline");
            m.insert("roofline_bandwidth_bytes_per_s".into(), json!(r.bandwidth));
            m.insert(
                "roofline_bytes_per_token".into(),
                json!(r.traffic.bytes_per_token() + self.kv_bytes),
            );
            m.insert("roofline_kv_bytes_per_token".into(), json!(self.kv_bytes));
            m.insert("roofline_ts".into(), json!(bound));
            m.insert("roofline_fraction".into(), json!(fraction));
        }
        Value::Object(m)
    }

    /// For a generation-only test under `--roofline`: the bandwidth-bound t/s (weights plus,
    /// at a depth, the KV cache each token reads) and the achieved fraction of it.
    fn bound(&self) -> Option<(f64, f64)> {
        let r = self.roofline?;
        if self.test.n_prompt > 0 || self.test.n_gen == 0 {
            return None;
        }
        let bytes = r.traffic.bytes_per_token() + self.kv_bytes;
        let bound = if bytes > 0.0 {
            r.bandwidth / bytes
        } else {
            0.0
        };
        (bound > 0.0).then(|| (bound, self.samples.avg_ts() / bound))
    }
}

/// The markdown table's columns: llama-bench's defaults plus the settings changed from theirs.
fn md_columns(info: &RunInfo) -> Vec<(&'static str, i32)> {
    let mut c = vec![
        ("model", -30),
        ("size", 10),
        ("params", 10),
        ("backend", -10),
        ("threads", 7),
    ];
    if info.n_cpu_moe > 0 {
        c.push(("n_cpu_moe", 9));
    }
    if info.n_batch != 2048 {
        c.push(("n_batch", 7));
    }
    if info.n_ubatch != 512 {
        c.push(("n_ubatch", 8));
    }
    if info.type_k != "f16" {
        c.push(("type_k", 6));
    }
    if info.type_v != "f16" {
        c.push(("type_v", 6));
    }
    c.push(("test", 15));
    c.push(("t/s", 20));
    c
}

/// Writes records as they finish, in one format.
struct Printer {
    format: OutputFormat,
    columns: Vec<(&'static str, i32)>,
    n_printed: usize,
}

impl Printer {
    fn header(&mut self, out: &mut impl Write, info: &RunInfo) -> std::io::Result<()> {
        match self.format {
            OutputFormat::Md => {
                self.columns = md_columns(info);
                let mut head = String::from("|");
                let mut rule = String::from("|");
                for &(name, w) in &self.columns {
                    let width = w.unsigned_abs() as usize;
                    if w < 0 {
                        head.push_str(&format!(" {name:<width$} |"));
                        rule.push_str(&format!(" {} |", "-".repeat(width)));
                    } else {
                        head.push_str(&format!(" {name:>width$} |"));
                        rule.push_str(&format!(" {}: |", "-".repeat(width - 1)));
                    }
                }
                writeln!(out, "{head}\n{rule}")
            }
            OutputFormat::Json => writeln!(out, "["),
            OutputFormat::Jsonl => Ok(()),
            OutputFormat::Csv => Ok(()),
        }
    }

    fn record(&mut self, out: &mut impl Write, r: &Record) -> std::io::Result<()> {
        let first = self.n_printed == 0;
        self.n_printed += 1;
        match self.format {
            OutputFormat::Md => {
                let i = r.info;
                let mut line = String::from("|");
                for &(name, w) in &self.columns {
                    let v = match name {
                        "model" => i.model_type.clone(),
                        "size" => size_label(i.size),
                        "params" => params_label(i.n_params),
                        "backend" => i.engine.backend.to_string(),
                        "threads" => i.n_threads.to_string(),
                        "n_cpu_moe" => i.n_cpu_moe.to_string(),
                        "n_batch" => i.n_batch.to_string(),
                        "n_ubatch" => i.n_ubatch.to_string(),
                        "type_k" => i.type_k.clone(),
                        "type_v" => i.type_v.clone(),
                        "test" => r.test.name(),
                        _ => format!("{:.2} ± {:.2}", r.samples.avg_ts(), r.samples.stddev_ts()),
                    };
                    let width = w.unsigned_abs() as usize;
                    if w < 0 {
                        line.push_str(&format!(" {v:<width$} |"));
                    } else {
                        line.push_str(&format!(" {v:>width$} |"));
                    }
                }
                writeln!(out, "{line}")
            }
            OutputFormat::Json => {
                let body =
                    serde_json::to_string_pretty(&r.json()).map_err(std::io::Error::other)?;
                let indented: Vec<String> = body.lines().map(|l| format!("  {l}")).collect();
                if !first {
                    writeln!(out, ",")?;
                }
                write!(out, "{}", indented.join("\n"))
            }
            OutputFormat::Jsonl => writeln!(out, "{}", r.json()),
            OutputFormat::Csv => {
                let fields = r.fields();
                if first {
                    let names: Vec<&str> = fields.keys().map(String::as_str).collect();
                    writeln!(out, "{}", names.join(","))?;
                }
                let cells: Vec<String> = fields
                    .values()
                    .map(|v| {
                        let s = match v {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        format!("\"{}\"", s.replace('"', "\"\""))
                    })
                    .collect();
                writeln!(out, "{}", cells.join(","))
            }
        }
    }

    fn footer(&mut self, out: &mut impl Write) -> std::io::Result<()> {
        match self.format {
            OutputFormat::Json => {
                if self.n_printed > 0 {
                    writeln!(out)?;
                }
                writeln!(out, "]")
            }
            _ => Ok(()),
        }
    }
}

/// The roofline report: the measured bandwidth, the bytes per token and where they come from,
/// and a table of the generation tests against the bound.
fn roofline_text(r: &Roofline, threads: usize, args: &BenchArgs, records: &[Record]) -> String {
    let t = &r.traffic;
    let mut s = format!(
        "roofline: read bandwidth {:.2} GB/s ({threads} threads, best of {} passes over {} MiB)\n",
        r.bandwidth / 1e9,
        args.roofline_runs,
        args.roofline_mib
    );
    s.push_str(&format!(
        "roofline: weights read per generated token {} = dense {} + experts {}/{} of {} ({}) + output head {} + embedding row {}\n",
        bytes_label(t.bytes_per_token()),
        bytes_label(t.dense_bytes as f64),
        t.n_expert_used,
        t.n_expert,
        bytes_label(t.expert_bytes_total as f64),
        bytes_label(t.expert_bytes_per_token()),
        bytes_label(t.output_bytes as f64),
        bytes_label(t.embd_row_bytes as f64),
    ));
    s.push_str("roofline: each test's bound adds the KV cache its tokens read (its depth)\n");
    let rows: Vec<String> = records
        .iter()
        .filter_map(|rec| {
            let (bound, fraction) = rec.bound()?;
            Some(format!(
                "| {:>15} | {:>20} | {:>12} | {:>10.2} | {:>8.3} |",
                rec.test.name(),
                format!(
                    "{:.2} ± {:.2}",
                    rec.samples.avg_ts(),
                    rec.samples.stddev_ts()
                ),
                bytes_label(rec.kv_bytes),
                bound,
                fraction
            ))
        })
        .collect();
    if rows.is_empty() {
        s.push_str("roofline: no generation test to compare (give -n N)\n");
    } else {
        s.push_str(&format!(
            "\n| {:>15} | {:>20} | {:>12} | {:>10} | {:>8} |\n| {}: | {}: | {}: | {}: | {}: |\n",
            "test",
            "t/s",
            "KV per token",
            "bound t/s",
            "fraction",
            "-".repeat(14),
            "-".repeat(19),
            "-".repeat(11),
            "-".repeat(9),
            "-".repeat(7)
        ));
        for row in rows {
            s.push_str(&row);
            s.push('\n');
        }
    }
    s
}

/// Runs `hmoe bench`.
pub fn run(mut args: BenchArgs) -> anyhow::Result<()> {
    let n_prompt = parse_counts("-p", &args.n_prompt)?;
    let n_gen = parse_counts("-n", &args.n_gen)?;
    let n_depth = parse_counts("-d", &args.n_depth)?;
    let tests = tests(&n_prompt, &n_gen, &n_depth);
    if tests.is_empty() {
        bail!(
            "nothing to measure: give a prompt length (-p N) or a generation length (-n N) above 0"
        );
    }
    if args.model.threads == Some(0) {
        bail!("-t must be at least 1");
    }
    let pa = &args.model.placement.args;
    if pa.batch_size == 0 || pa.ubatch_size == 0 {
        bail!("-b and -ub must be at least 1");
    }
    if pa.ctx_size.is_some() {
        tracing::warn!(
            "-c is ignored: each test's context is its depth plus its tokens, as in llama-bench"
        );
    }
    let kv = args.model.kv_type()?;
    args.model.check_placement()?;
    // As llama.cpp maps models: every page in before the first test, so that the first test
    // does not pay the page faults of first touching each expert.
    args.model.populate = true;
    // Decided before the load, so that the tile probe forks a small process.
    let mut kernels = hmoe_quant::kernel_summary();
    if hmoe_quant::GemmKernel::interleaved(hmoe_quant::Isa::best()).is_some() {
        kernels.push_str(match args.model.interleaves_experts() {
            true => ", MXFP4 experts interleaved in groups of 16 where memory allows",
            false => ", MXFP4 experts in the file's layout",
        });
    }
    let model = args.model.load()?;
    let n_threads = rayon::current_num_threads();
    let info = run_info(&args, model.as_ref(), n_threads);
    let cfg = BenchConfig {
        kv,
        n_batch: pa.batch_size as usize,
        n_ubatch: args.model.n_ubatch(),
        repetitions: args.repetitions as usize,
        warmup: !args.no_warmup,
        seed: 0x5EED,
    };
    let roofline = if args.roofline {
        let bytes = usize::try_from(args.roofline_mib << 20).context("--roofline-mib too large")?;
        let bandwidth = measure_read_bandwidth(n_threads, bytes, args.roofline_runs as usize)?;
        Some(Roofline {
            bandwidth,
            traffic: WeightTraffic::of(model.as_ref()),
        })
    } else {
        None
    };
    let mut out = std::io::stdout().lock();
    let mut printer = Printer {
        format: args.output,
        columns: Vec::new(),
        n_printed: 0,
    };
    printer.header(&mut out, &info)?;
    out.flush()?;
    let mut records = Vec::new();
    for test in tests {
        let time = now_rfc3339();
        let before = model.moe_cache_stats();
        let samples = run_test(model.as_ref(), &test, &cfg)
            .with_context(|| format!("test {}", test.name()))?;
        let moe_cache = before
            .zip(model.moe_cache_stats())
            .map(|(b, a)| (a.hits - b.hits, a.misses - b.misses));
        let kv_bytes = match (&roofline, test.n_prompt, test.n_gen) {
            (Some(_), 0, g) if g > 0 => kv_bytes_per_token(model.as_ref(), kv, test.n_depth, g),
            _ => 0.0,
        };
        let rec = Record {
            info: &info,
            test,
            time,
            samples,
            roofline: roofline.as_ref(),
            kv_bytes,
            moe_cache,
        };
        printer.record(&mut out, &rec)?;
        out.flush()?;
        records.push(rec);
    }
    printer.footer(&mut out)?;
    let roof = roofline
        .as_ref()
        .map(|r| roofline_text(r, n_threads, &args, &records));
    let cache = (model.moe_cache_stats()).map(|s| moe_cache_text(&s, &records));
    if args.output == OutputFormat::Md {
        if let Some(text) = &roof {
            writeln!(out, "\n{}", text.trim_end())?;
        }
        if let Some(text) = &cache {
            writeln!(out, "\n{text}")?;
        }
        writeln!(out, "\ncpu kernels: {kernels}")?;
        writeln!(out, "build: hmoe {} ({})", env!("CARGO_PKG_VERSION"), 0)?;
    } else {
        if let Some(text) = &roof {
            eprint!("{text}");
        }
        if let Some(text) = &cache {
            eprintln!("{text}");
        }
        eprintln!("cpu kernels: {kernels}");
    }
    out.flush()?;
    Ok(())
}

fn run_info(args: &BenchArgs, model: &dyn LanguageModel, n_threads: usize) -> RunInfo {
    let g = model.gguf();
    let meta = g.metadata();
    let size = g.total_tensor_bytes();
    let n_params = g
        .tensors()
        .iter()
        .fold(0u64, |a, t| a.saturating_add(t.n_elements));
    let arch = meta.architecture().unwrap_or("unknown");
    let label = meta
        .get_str("general.size_label")
        .map_or_else(|| count_label(n_params), str::to_string);
    let pa = &args.model.placement.args;
    RunInfo {
        filename: args.model.model.display().to_string(),
        model_type: format!(
            "{arch} {label} {}",
            ftype_name(meta.get_u64("general.file_type"))
        ),
        size,
        n_params,
        n_batch: pa.batch_size as usize,
        n_ubatch: args.model.n_ubatch(),
        n_threads,
        type_k: pa.cache_type_k.to_ascii_lowercase(),
        type_v: pa.cache_type_v.to_ascii_lowercase(),
        n_cpu_moe: pa.n_cpu_moe.unwrap_or(0),
        no_op_offload: pa.no_op_offload,
        cpu_info: cpu_info(),
        engine: args.model.engine.get().cloned().unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_parse_like_llama_bench() {
        assert_eq!(parse_counts("-p", "512").unwrap(), vec![512]);
        assert_eq!(parse_counts("-p", "0,16, 32").unwrap(), vec![0, 16, 32]);
        assert_eq!(
            parse_counts("-p", "64-512*2").unwrap(),
            vec![64, 128, 256, 512]
        );
        assert_eq!(
            parse_counts("-p", "100-350+100").unwrap(),
            vec![100, 200, 300]
        );
        assert_eq!(parse_counts("-p", "3-5").unwrap(), vec![3, 4, 5]);
        for bad in [
            "", "x", "-5", "1,,2", "5-3", "1-9+0", "1-9*1", "0-9*2", "1.5",
        ] {
            assert!(parse_counts("-p", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tests_follow_llama_bench_order() {
        let t = tests(&[0, 16], &[4, 0], &[0, 8]);
        let names: Vec<String> = t.iter().map(BenchTest::name).collect();
        assert_eq!(names, ["pp16", "tg4", "pp16 @ d8", "tg4 @ d8"]);
        assert!(tests(&[0], &[0], &[0]).is_empty());
    }

    #[test]
    fn labels_use_llama_bench_units() {
        assert_eq!(size_label(12 << 20), "12.00 MiB");
        assert_eq!(size_label(3 << 30), "3.00 GiB");
        assert_eq!(params_label(1_500_000), "1.50 M");
        assert_eq!(params_label(116_830_000_000), "116.83 B");
        assert_eq!(bytes_label(1536.0), "1.50 KiB");
        assert_eq!(ftype_name(Some(38)), "MXFP4 MoE");
    }

    #[test]
    fn rfc3339_has_the_right_shape() {
        let t = now_rfc3339();
        assert_eq!(t.len(), 20, "{t}");
        assert!(
            t.starts_with("20") && t.ends_with('Z') && &t[10..11] == "T",
            "{t}"
        );
    }
}
