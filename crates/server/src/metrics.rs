//! Counters of one served model and their Prometheus text exposition (llama-server's metric
//! names, so existing dashboards keep working, plus a few of our own).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Counters and gauges of one model, updated by its scheduler and the HTTP handlers.
#[derive(Debug, Default)]
pub struct Stats {
    /// Prompt tokens evaluated (cached prefix tokens excluded).
    pub prompt_tokens: AtomicU64,
    /// Microseconds requests spent on their prompts.
    pub prompt_us: AtomicU64,
    /// Tokens generated.
    pub predicted_tokens: AtomicU64,
    /// Microseconds requests spent generating.
    pub predicted_us: AtomicU64,
    /// Forward passes (batched steps).
    pub n_decode: AtomicU64,
    /// Sum over forward passes of the sequences in each.
    pub n_busy_slots: AtomicU64,
    /// Largest number of tokens in one forward pass.
    pub n_tokens_max: AtomicU64,
    /// Requests accepted into the queue.
    pub requests_total: AtomicU64,
    /// Requests refused because the queue was full.
    pub requests_rejected: AtomicU64,
    /// Requests whose client went away before the end.
    pub requests_cancelled: AtomicU64,
    /// Requests in a slot now.
    pub requests_processing: AtomicU64,
    /// Requests waiting for a slot now.
    pub requests_deferred: AtomicU64,
    /// Positions held in the KV caches of all slots now.
    pub kv_tokens: AtomicU64,
    /// Positions the KV caches of all slots can hold.
    pub kv_capacity: AtomicU64,
}

impl Stats {
    /// Adds `v` to a counter.
    pub fn add(counter: &AtomicU64, v: u64) {
        counter.fetch_add(v, Relaxed);
    }
}

/// `num / den`, 0 when `den` is 0.
fn ratio(num: f64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num / den as f64
    }
}

/// Tokens per second.
fn rate(tokens: u64, us: u64) -> f64 {
    ratio(tokens as f64 * 1e6, us)
}

/// Writes every model's metrics; `label` is `Some(model id)` in router mode.
pub fn render(models: &[(Option<String>, &Stats)]) -> String {
    type Get = fn(&Stats) -> f64;
    let metrics: [(&str, &str, &str, Get); 14] = [
        (
            "llamacpp:prompt_tokens_total",
            "counter",
            "Number of prompt tokens processed.",
            |s| s.prompt_tokens.load(Relaxed) as f64,
        ),
        (
            "llamacpp:prompt_seconds_total",
            "counter",
            "Prompt process time.",
            |s| s.prompt_us.load(Relaxed) as f64 / 1e6,
        ),
        (
            "llamacpp:tokens_predicted_total",
            "counter",
            "Number of generation tokens processed.",
            |s| s.predicted_tokens.load(Relaxed) as f64,
        ),
        (
            "llamacpp:tokens_predicted_seconds_total",
            "counter",
            "Predict process time.",
            |s| s.predicted_us.load(Relaxed) as f64 / 1e6,
        ),
        (
            "llamacpp:n_decode_total",
            "counter",
            "Total number of batched forward passes.",
            |s| s.n_decode.load(Relaxed) as f64,
        ),
        (
            "llamacpp:n_busy_slots_per_decode",
            "gauge",
            "Average number of busy slots per forward pass.",
            |s| {
                ratio(
                    s.n_busy_slots.load(Relaxed) as f64,
                    s.n_decode.load(Relaxed),
                )
            },
        ),
        (
            "llamacpp:n_tokens_max",
            "gauge",
            "Largest number of tokens in one forward pass.",
            |s| s.n_tokens_max.load(Relaxed) as f64,
        ),
        (
            "llamacpp:prompt_tokens_seconds",
            "gauge",
            "Average prompt throughput in tokens/s.",
            |s| rate(s.prompt_tokens.load(Relaxed), s.prompt_us.load(Relaxed)),
        ),
        (
            "llamacpp:predicted_tokens_seconds",
            "gauge",
            "Average generation throughput in tokens/s.",
            |s| {
                rate(
                    s.predicted_tokens.load(Relaxed),
                    s.predicted_us.load(Relaxed),
                )
            },
        ),
        (
            "llamacpp:requests_processing",
            "gauge",
            "Number of requests processing.",
            |s| s.requests_processing.load(Relaxed) as f64,
        ),
        (
            "llamacpp:requests_deferred",
            "gauge",
            "Number of requests waiting for a slot (queue depth).",
            |s| s.requests_deferred.load(Relaxed) as f64,
        ),
        (
            "llamacpp:kv_cache_usage_ratio",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            |s| {
                ratio(
                    s.kv_tokens.load(Relaxed) as f64,
                    s.kv_capacity.load(Relaxed),
                )
            },
        ),
        (
            "llamacpp:kv_cache_tokens",
            "gauge",
            "KV-cache tokens.",
            |s| s.kv_tokens.load(Relaxed) as f64,
        ),
        (
            "hmoe:requests_total",
            "counter",
            "Requests accepted.",
            |s| s.requests_total.load(Relaxed) as f64,
        ),
    ];
    let extra: [(&str, &str, &str, Get); 2] = [
        (
            "hmoe:requests_rejected_total",
            "counter",
            "Requests refused with 503 because the queue was full.",
            |s| s.requests_rejected.load(Relaxed) as f64,
        ),
        (
            "hmoe:requests_cancelled_total",
            "counter",
            "Requests whose client disconnected before the end.",
            |s| s.requests_cancelled.load(Relaxed) as f64,
        ),
    ];
    let mut out = String::new();
    for &(name, ty, help, get) in metrics.iter().chain(extra.iter()) {
        write_family(&mut out, (name, ty, help), models, |s| get(s));
    }
    out
}

/// One metric family: its `# HELP` and `# TYPE` lines, then one sample per model (labelled
/// `model="…"` in router mode).
fn write_family<S, V: std::fmt::Display>(
    out: &mut String,
    (name, ty, help): (&str, &str, &str),
    models: &[(Option<String>, S)],
    get: impl Fn(&S) -> V,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {ty}");
    for (label, stats) in models {
        let v = get(stats);
        match label {
            Some(l) => {
                let _ = writeln!(out, "{name}{{model=\"{}\"}} {v}", escape_label(l));
            }
            None => {
                let _ = writeln!(out, "{name} {v}");
            }
        }
    }
}

/// Writes the device memory of every model that runs on a device (`label`: `Some(model id)`
/// in router mode): in use (weights and K/V caches), of it the K/V caches, and free.
pub fn render_devices(models: &[(Option<String>, hmoe_model::DeviceMemory)]) -> String {
    type Get = fn(&hmoe_model::DeviceMemory) -> Option<u64>;
    let metrics: [(&str, &str, Get); 3] = [
        (
            "hmoe:device_memory_used_bytes",
            "Device memory the model holds: weights and K/V caches.",
            |m| Some(m.weight_bytes + m.kv_bytes),
        ),
        (
            "hmoe:device_kv_cache_bytes",
            "Device memory of the slots' K/V caches.",
            |m| Some(m.kv_bytes),
        ),
        (
            "hmoe:device_memory_free_bytes",
            "Device memory free, as the device reports it.",
            |m| m.free_bytes,
        ),
    ];
    let mut out = String::new();
    if models.is_empty() {
        return out;
    }
    for (name, help, get) in metrics {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for (label, mem) in models {
            let Some(v) = get(mem) else { continue };
            let device = escape_label(&mem.device);
            match label {
                Some(l) => {
                    let model = escape_label(l);
                    let _ = writeln!(out, "{name}{{model=\"{model}\",device=\"{device}\"}} {v}");
                }
                None => {
                    let _ = writeln!(out, "{name}{{device=\"{device}\"}} {v}");
                }
            }
        }
    }
    out
}

/// Writes the device expert cache's counts of every model that has one (`label`: `Some(model
/// id)` in router mode): routed pairs that hit and missed, uploads, evictions, bytes held.
pub fn render_moe_cache(models: &[(Option<String>, hmoe_model::MoeCacheStats)]) -> String {
    type Get = fn(&hmoe_model::MoeCacheStats) -> u64;
    let metrics: [(&str, &str, &str, Get); 5] = [
        (
            "hmoe:moe_cache_hits_total",
            "counter",
            "Routed (token, expert) pairs of CPU-expert layers run by an expert the device cached.",
            |s| s.hits,
        ),
        (
            "hmoe:moe_cache_misses_total",
            "counter",
            "Routed (token, expert) pairs of CPU-expert layers run on the CPU.",
            |s| s.misses,
        ),
        (
            "hmoe:moe_cache_uploads_total",
            "counter",
            "Experts uploaded into the device expert cache.",
            |s| s.uploads,
        ),
        (
            "hmoe:moe_cache_evictions_total",
            "counter",
            "Experts evicted from the device expert cache.",
            |s| s.evictions,
        ),
        (
            "hmoe:moe_cache_bytes",
            "gauge",
            "Device memory the cached experts occupy.",
            |s| s.held_bytes,
        ),
    ];
    let mut out = String::new();
    if models.is_empty() {
        return out;
    }
    for (name, ty, help, get) in metrics {
        write_family(&mut out, (name, ty, help), models, get);
    }
    out
}

/// Writes the device executor's step counts of every model that runs on a device (`label`:
/// `Some(model id)` in router mode): micro-batches, round trips to the CPU's experts, and the
/// steps of several slots run as two micro-batches in flight (`HMOE_MICRO_BATCHES`).
pub fn render_device_steps(models: &[(Option<String>, hmoe_model::ExecStats)]) -> String {
    type Get = fn(&hmoe_model::ExecStats) -> u64;
    let metrics: [(&str, &str, Get); 3] = [
        (
            "hmoe:device_ubatches_total",
            "Micro-batches the device executor ran.",
            |s| s.ubatches,
        ),
        (
            "hmoe:device_host_round_trips_total",
            "Round trips to the CPU's experts (one per CPU-expert layer per micro-batch).",
            |s| s.host_round_trips,
        ),
        (
            "hmoe:device_split_steps_total",
            "Steps of several slots run as two micro-batches in flight.",
            |s| s.split_steps,
        ),
    ];
    let mut out = String::new();
    if models.is_empty() {
        return out;
    }
    for (name, help, get) in metrics {
        write_family(&mut out, (name, "counter", help), models, get);
    }
    out
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let s = Stats::default();
        Stats::add(&s.prompt_tokens, 10);
        Stats::add(&s.prompt_us, 2_000_000);
        let text = render(&[(None, &s)]);
        assert!(text.contains(
            "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 10\n"
        ));
        assert!(text.contains("llamacpp:prompt_tokens_seconds 5\n"));
        let text = render(&[(Some("a\"b".into()), &s)]);
        assert!(text.contains("llamacpp:prompt_tokens_total{model=\"a\\\"b\"} 10\n"));
    }

    #[test]
    fn renders_the_expert_cache() {
        assert_eq!(render_moe_cache(&[]), "");
        let s = hmoe_model::MoeCacheStats {
            hits: 81,
            misses: 19,
            held_bytes: 4096,
            ..hmoe_model::MoeCacheStats::default()
        };
        let text = render_moe_cache(&[(None, s)]);
        assert!(text.contains("# TYPE hmoe:moe_cache_hits_total counter\n"));
        assert!(text.contains("hmoe:moe_cache_hits_total 81\n"), "{text}");
        assert!(text.contains("hmoe:moe_cache_misses_total 19\n"), "{text}");
        assert!(text.contains("hmoe:moe_cache_bytes 4096\n"), "{text}");
        let text = render_moe_cache(&[(Some("m".into()), s)]);
        assert!(
            text.contains("hmoe:moe_cache_hits_total{model=\"m\"} 81\n"),
            "{text}"
        );
    }

    #[test]
    fn renders_the_device_steps() {
        assert_eq!(render_device_steps(&[]), "");
        let s = hmoe_model::ExecStats {
            ubatches: 12,
            host_round_trips: 48,
            split_steps: 5,
            ..hmoe_model::ExecStats::default()
        };
        let text = render_device_steps(&[(None, s)]);
        assert!(text.contains(
            "# TYPE hmoe:device_split_steps_total counter
"
        ));
        assert!(
            text.contains(
                "hmoe:device_ubatches_total 12
"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "hmoe:device_host_round_trips_total 48
"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "hmoe:device_split_steps_total 5
"
            ),
            "{text}"
        );
    }

    #[test]
    fn renders_device_memory() {
        assert_eq!(render_devices(&[]), "");
        let m = hmoe_model::DeviceMemory {
            device: "REF0".into(),
            weight_bytes: 1000,
            kv_bytes: 24,
            free_bytes: None,
        };
        let text = render_devices(&[(None, m.clone())]);
        assert!(text.contains("hmoe:device_memory_used_bytes{device=\"REF0\"} 1024\n"));
        assert!(text.contains("hmoe:device_kv_cache_bytes{device=\"REF0\"} 24\n"));
        assert!(!text.contains("hmoe:device_memory_free_bytes{"), "{text}");
        let m = hmoe_model::DeviceMemory {
            free_bytes: Some(7),
            ..m
        };
        let text = render_devices(&[(Some("a".into()), m)]);
        assert!(text.contains("hmoe:device_memory_free_bytes{model=\"a\",device=\"REF0\"} 7\n"));
    }
}
