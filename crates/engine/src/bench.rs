//! Speed measurement in the manner of llama-bench: prompt processing (`pp`: one batch of
//! random tokens on an empty cache) and text generation (`tg`: single-token decode steps),
//! optionally after `n_depth` tokens already sit in the cache; plus the two numbers a
//! roofline needs, the machine's memory read bandwidth and the weight bytes one generated
//! token reads.

use std::sync::Barrier;
use std::time::Instant;

use hmoe_model::{KvCache, KvType, LanguageModel, LogitsWanted, ModelError};

/// What can go wrong while benchmarking.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The test or configuration cannot be run as given.
    #[error("invalid benchmark: {0}")]
    Invalid(&'static str),
    /// The model failed while running the test.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// One test: `n_prompt` prompt tokens and/or `n_gen` generated tokens after `n_depth` tokens of
/// context (llama-bench's `pp512`, `tg128`, `pp512 @ d4096`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BenchTest {
    /// Prompt tokens processed in batches of [`BenchConfig::n_batch`] (0 for a tg test).
    pub n_prompt: usize,
    /// Single-token decode steps (0 for a pp test).
    pub n_gen: usize,
    /// Tokens put in the cache before the timed part, untimed.
    pub n_depth: usize,
}

impl BenchTest {
    /// Tokens the timed part processes (the numerator of t/s).
    pub fn n_tokens(&self) -> usize {
        self.n_prompt + self.n_gen
    }

    /// llama-bench's name for the test: `pp512`, `tg128`, `pp512+tg128`, with ` @ d4096`
    /// appended for a depth.
    pub fn name(&self) -> String {
        let mut s = match (self.n_prompt, self.n_gen) {
            (p, 0) => format!("pp{p}"),
            (0, g) => format!("tg{g}"),
            (p, g) => format!("pp{p}+tg{g}"),
        };
        if self.n_depth > 0 {
            s.push_str(&format!(" @ d{}", self.n_depth));
        }
        s
    }
}

/// How tests are run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BenchConfig {
    /// KV cache element type.
    pub kv: KvType,
    /// Tokens per forward call of a prompt (llama-bench's `-b`).
    pub n_batch: usize,
    /// Tokens computed together inside a forward call (`-ub`).
    pub n_ubatch: usize,
    /// Timed runs.
    pub repetitions: usize,
    /// Run the whole test once untimed first, on a cache at the test's depth: the first timed
    /// repetition then finds the thread pool, the scratch buffers, the cache's pages and the
    /// weights it reads as warm as the later ones.
    pub warmup: bool,
    /// Seed of the random token ids.
    pub seed: u64,
}

/// Wall-clock times of the repetitions of one test.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BenchSamples {
    /// Tokens each sample processed.
    pub n_tokens: usize,
    /// Nanoseconds per repetition.
    pub ns: Vec<u64>,
}

impl BenchSamples {
    /// Tokens per second of each repetition.
    pub fn ts(&self) -> Vec<f64> {
        self.ns
            .iter()
            .map(|&ns| {
                if ns == 0 {
                    0.0
                } else {
                    self.n_tokens as f64 * 1e9 / ns as f64
                }
            })
            .collect()
    }
    /// Mean nanoseconds.
    pub fn avg_ns(&self) -> f64 {
        mean(&self.ns.iter().map(|&n| n as f64).collect::<Vec<_>>())
    }
    /// Sample standard deviation of the nanoseconds.
    pub fn stddev_ns(&self) -> f64 {
        stddev(&self.ns.iter().map(|&n| n as f64).collect::<Vec<_>>())
    }
    /// Mean tokens per second (the mean of the per-repetition rates, as llama-bench reports).
    pub fn avg_ts(&self) -> f64 {
        mean(&self.ts())
    }
    /// Sample standard deviation of the per-repetition tokens per second.
    pub fn stddev_ts(&self) -> f64 {
        stddev(&self.ts())
    }
}

/// Arithmetic mean (0 for an empty slice).
pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Sample standard deviation (divisor n−1; 0 for fewer than two values).
pub fn stddev(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let m = mean(v);
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
}

/// SplitMix64: a small, seedable source of token ids.
struct Ids {
    state: u64,
    n_vocab: u64,
}

impl Ids {
    fn next(&mut self) -> u32 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z % self.n_vocab) as u32
    }
}

/// Runs one test: a warm-up (when configured: one untimed repetition of the whole test), then
/// `repetitions` timed runs, each on a cache holding exactly `n_depth` tokens. The depth is
/// computed once and kept by truncating the cache back to it after each run; where a
/// sliding-window ring cannot go back that far it is recomputed (untimed).
pub fn run_test(
    model: &dyn LanguageModel,
    test: &BenchTest,
    cfg: &BenchConfig,
) -> Result<BenchSamples, BenchError> {
    if test.n_tokens() == 0 {
        return Err(BenchError::Invalid(
            "a test needs prompt or generated tokens",
        ));
    }
    if cfg.repetitions == 0 {
        return Err(BenchError::Invalid("repetitions must be at least 1"));
    }
    if cfg.n_batch == 0 || cfg.n_ubatch == 0 {
        return Err(BenchError::Invalid("batch sizes must be at least 1"));
    }
    let n_vocab = model.n_vocab();
    if n_vocab == 0 {
        return Err(BenchError::Invalid("the model has an empty vocabulary"));
    }
    let mut ids = Ids {
        state: cfg.seed,
        n_vocab: n_vocab as u64,
    };
    let n_ctx = test.n_prompt + test.n_gen + test.n_depth;
    let mut cache = model.new_cache(cfg.kv, n_ctx, cfg.n_ubatch.min(cfg.n_batch));
    let mut depth_ready = false;
    let mut out = BenchSamples {
        n_tokens: test.n_tokens(),
        ns: Vec::with_capacity(cfg.repetitions),
    };
    // llama-bench's warm-up is one prompt batch and one generated token; after a load that
    // left the first timed generation 35% slow (`-n 32`: 15.3 ± 3.6 t/s against
    // 23.4 ± 0.2 for the same test later in the run), so the warm-up here is the test itself.
    for rep in 0..cfg.repetitions + usize::from(cfg.warmup) {
        if !(depth_ready && cache.truncate(test.n_depth)) {
            cache.clear();
            if test.n_depth > 0 {
                prompt(model, &mut cache, test.n_depth, cfg.n_batch, &mut ids)?;
            }
            depth_ready = true;
        }
        let start = Instant::now();
        if test.n_prompt > 0 {
            prompt(model, &mut cache, test.n_prompt, cfg.n_batch, &mut ids)?;
        }
        if test.n_gen > 0 {
            generate(model, &mut cache, test.n_gen, &mut ids)?;
        }
        if rep > 0 || !cfg.warmup {
            out.ns
                .push(u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
    }
    Ok(out)
}

/// `n` random tokens, `n_batch` per forward call, only the last logits of each call wanted.
fn prompt(
    model: &dyn LanguageModel,
    cache: &mut KvCache,
    n: usize,
    n_batch: usize,
    ids: &mut Ids,
) -> Result<(), ModelError> {
    let mut batch = Vec::with_capacity(n_batch.min(n));
    let mut done = 0;
    while done < n {
        let len = n_batch.min(n - done);
        batch.clear();
        batch.extend((0..len).map(|_| ids.next()));
        model.forward(cache, &batch, LogitsWanted::Last)?;
        done += len;
    }
    Ok(())
}

/// `n` decode steps of one random token each.
fn generate(
    model: &dyn LanguageModel,
    cache: &mut KvCache,
    n: usize,
    ids: &mut Ids,
) -> Result<(), ModelError> {
    for _ in 0..n {
        let token = ids.next();
        model.forward(cache, &[token], LogitsWanted::Last)?;
    }
    Ok(())
}

/// Measures the memory read bandwidth in bytes per second: `threads` threads stream-read
/// disjoint parts of a `buffer_bytes` buffer (make it much larger than the caches); the best of
/// `runs` passes counts.
pub fn measure_read_bandwidth(
    threads: usize,
    buffer_bytes: usize,
    runs: usize,
) -> Result<f64, BenchError> {
    let threads = threads.max(1);
    let words = buffer_bytes / 8;
    if words < threads * 64 || runs == 0 {
        return Err(BenchError::Invalid("bandwidth buffer too small or no runs"));
    }
    // Written, not zero-allocated: reading untouched pages would read the shared zero page.
    let buf: Vec<u64> = (0..words as u64).collect();
    let chunk = words.div_ceil(threads);
    let mut best = 0f64;
    for _ in 0..runs {
        let barrier = Barrier::new(threads + 1);
        let secs = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(chunk)
                .map(|part| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        std::hint::black_box(sum_words(part))
                    })
                })
                .collect();
            // Start the clock before releasing the readers: on a busy machine this thread can
            // be descheduled after the barrier while the readers already finish, which made
            // the elapsed time near zero and the bandwidth absurd (seen: 1.9 TB/s).
            let start = Instant::now();
            barrier.wait();
            for h in handles {
                // A reader thread cannot panic (it only adds integers); a join error is ignored.
                let _ = h.join();
            }
            start.elapsed().as_secs_f64()
        });
        if secs > 0.0 {
            best = best.max((words * 8) as f64 / secs);
        }
    }
    Ok(best)
}

/// Wrapping sum with independent accumulators, so the loop is bound by loads, not additions.
fn sum_words(part: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut blocks = part.chunks_exact(8);
    for b in &mut blocks {
        for (a, &x) in acc.iter_mut().zip(b) {
            *a = a.wrapping_add(x);
        }
    }
    let tail = blocks
        .remainder()
        .iter()
        .fold(0u64, |s, &x| s.wrapping_add(x));
    acc.iter().fold(tail, |s, &x| s.wrapping_add(x))
}

/// Bytes of KV cache the generated tokens of a test read on average: a token at position `p`
/// reads every key and value its layers keep visible (`p + 1` cells of a full layer, at most
/// the ring of a sliding-window layer), so `n_gen` tokens after `depth` read on average what
/// the cache of the middle token holds. Counted from an (unfilled) cache of that size.
pub fn kv_bytes_per_token(
    model: &dyn LanguageModel,
    kv: KvType,
    depth: usize,
    n_gen: usize,
) -> f64 {
    let mid = depth + n_gen.saturating_sub(1) / 2;
    model.kv_bytes(&model.new_cache(kv, mid + 1, 1)) as f64
}

/// Bytes of weights one generated token reads, from the model's tensor table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WeightTraffic {
    /// Tensors every token reads whole (attention, norms, router, shared experts), excluding
    /// the output head.
    pub dense_bytes: u64,
    /// All routed-expert tensors (`*_exps*`) together.
    pub expert_bytes_total: u64,
    /// Experts in each MoE layer (0 for a dense model).
    pub n_expert: u64,
    /// Experts each token is routed to.
    pub n_expert_used: u64,
    /// The output head (the token embedding when the head is tied to it).
    pub output_bytes: u64,
    /// One row of the token embedding (read per token when the head is a separate tensor).
    pub embd_row_bytes: u64,
}

impl WeightTraffic {
    /// Reads the tensor table and `{arch}.expert_count` / `{arch}.expert_used_count`: routed
    /// experts count at `n_expert_used / n_expert` of their size, the token embedding at one
    /// row (or whole when it doubles as the output head), everything else whole.
    pub fn of(model: &dyn LanguageModel) -> WeightTraffic {
        let g = model.gguf();
        let meta = g.metadata();
        let arch = meta.architecture().unwrap_or_default();
        let key = |k: &str| meta.get_u64(&format!("{arch}.{k}")).unwrap_or(0);
        let mut w = WeightTraffic {
            n_expert: key("expert_count"),
            n_expert_used: key("expert_used_count"),
            ..WeightTraffic::default()
        };
        let tied = g.tensor_info("output.weight").is_none();
        for t in g.tensors() {
            let name = t.name.as_str();
            if name == "token_embd.weight" {
                if tied {
                    w.output_bytes += t.n_bytes;
                } else {
                    w.embd_row_bytes = t.row_bytes();
                }
            } else if name == "output.weight" {
                w.output_bytes += t.n_bytes;
            } else if w.n_expert > 0 && name.contains("_exps") {
                w.expert_bytes_total += t.n_bytes;
            } else {
                w.dense_bytes += t.n_bytes;
            }
        }
        w
    }

    /// Expert bytes one token reads: `n_expert_used / n_expert` of all expert tensors.
    pub fn expert_bytes_per_token(&self) -> f64 {
        if self.n_expert == 0 {
            0.0
        } else {
            self.expert_bytes_total as f64 * self.n_expert_used.min(self.n_expert) as f64
                / self.n_expert as f64
        }
    }

    /// Total bytes one generated token reads.
    pub fn bytes_per_token(&self) -> f64 {
        (self.dense_bytes + self.output_bytes + self.embd_row_bytes) as f64
            + self.expert_bytes_per_token()
    }

    /// Tokens per second the bandwidth allows (`bandwidth` in bytes per second).
    pub fn bound_ts(&self, bandwidth: f64) -> f64 {
        let b = self.bytes_per_token();
        if b > 0.0 {
            bandwidth / b
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_llama_bench() {
        let t = |p, g, d| {
            BenchTest {
                n_prompt: p,
                n_gen: g,
                n_depth: d,
            }
            .name()
        };
        assert_eq!(t(512, 0, 0), "pp512");
        assert_eq!(t(0, 128, 0), "tg128");
        assert_eq!(t(512, 0, 4096), "pp512 @ d4096");
        assert_eq!(t(16, 4, 0), "pp16+tg4");
    }

    #[test]
    fn statistics_match_hand_values() {
        let s = BenchSamples {
            n_tokens: 10,
            ns: vec![1_000_000_000, 2_000_000_000],
        };
        assert_eq!(s.ts(), vec![10.0, 5.0]);
        assert_eq!(s.avg_ts(), 7.5);
        assert!((s.stddev_ts() - 12.5f64.sqrt()).abs() < 1e-12);
        assert_eq!(s.avg_ns(), 1.5e9);
        assert_eq!(stddev(&[3.0]), 0.0);
        assert_eq!(mean(&[]), 0.0);
    }

    #[test]
    fn ids_stay_in_the_vocabulary() {
        let mut ids = Ids {
            state: 7,
            n_vocab: 13,
        };
        let v: Vec<u32> = (0..1000).map(|_| ids.next()).collect();
        assert!(v.iter().all(|&i| i < 13));
        assert!((0..13).all(|i| v.contains(&i)));
    }

    #[test]
    fn bandwidth_is_positive_and_sum_is_exact() {
        assert_eq!(
            sum_words(&(0..1003u64).collect::<Vec<_>>()),
            1002 * 1003 / 2
        );
        let bw = measure_read_bandwidth(2, 16 << 20, 2).unwrap();
        assert!(bw > 1e8, "{bw}");
        assert!(measure_read_bandwidth(1, 8, 1).is_err());
        assert!(measure_read_bandwidth(1, 1 << 20, 0).is_err());
    }

    #[test]
    fn traffic_arithmetic() {
        let w = WeightTraffic {
            dense_bytes: 100,
            expert_bytes_total: 1280,
            n_expert: 128,
            n_expert_used: 4,
            output_bytes: 50,
            embd_row_bytes: 10,
        };
        assert_eq!(w.expert_bytes_per_token(), 40.0);
        assert_eq!(w.bytes_per_token(), 200.0);
        assert_eq!(w.bound_ts(2000.0), 10.0);
    }
}
