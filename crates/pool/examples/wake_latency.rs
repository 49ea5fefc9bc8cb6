//! Wake latency of the pool after an idle gap, as hybrid decode meets it: the caller waits
//! out a device phase of `GAP_US` (polling, as a CUDA stream wait does), then submits one
//! chunk of `WORK_US` per thread (a layer's experts); prints the job's wall time (median and
//! 90th percentile over `ITERS` jobs) with the pool's own poll time and with the hybrid's
//! boost, in alternating rounds.
//!
//! `cargo run --release -p hmoe-pool --example wake_latency -- [threads] [gap_us] [work_us]
//! [iters] [rounds]`

use std::time::{Duration, Instant};

use hmoe_pool::{ThreadPool, DEFAULT_SPIN};

fn busy(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Median and 90th percentile of `iters` jobs' wall time, in microseconds.
fn measure(pool: &ThreadPool, gap: Duration, work: Duration, iters: usize) -> (f64, f64) {
    let n = pool.n_threads();
    let mut t: Vec<f64> = (0..iters)
        .map(|_| {
            busy(gap);
            let t0 = Instant::now();
            pool.run(n, &|_| busy(work));
            t0.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    (t[iters / 2], t[iters * 9 / 10])
}

fn main() {
    let arg = |i: usize, default: u64| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    };
    let threads = arg(1, 2) as usize;
    let gap = Duration::from_micros(arg(2, 300));
    let work = Duration::from_micros(arg(3, 50));
    let (iters, rounds) = (arg(4, 500) as usize, arg(5, 4));
    let pool = ThreadPool::with_spin(threads, DEFAULT_SPIN).expect("pool");
    println!(
        "threads {threads}, gap {gap:?}, work {work:?} per chunk, {iters} jobs per round; \
         wall time per job, µs (median / p90)"
    );
    for r in 0..rounds {
        let plain = measure(&pool, gap, work, iters);
        let boost = pool.boost_spin(Duration::from_millis(2));
        let boosted = measure(&pool, gap, work, iters);
        drop(boost);
        println!(
            "round {r}: poll {DEFAULT_SPIN:?}: {:.1} / {:.1}   boosted 2 ms: {:.1} / {:.1}",
            plain.0, plain.1, boosted.0, boosted.1
        );
    }
}
