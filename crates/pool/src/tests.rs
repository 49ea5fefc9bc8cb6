use super::*;
use std::sync::atomic::AtomicU32;

fn counts(n: usize) -> Vec<AtomicU32> {
    (0..n).map(|_| AtomicU32::new(0)).collect()
}

#[test]
fn every_chunk_runs_exactly_once() {
    for threads in [1, 2, 3, 5] {
        let pool = ThreadPool::new(threads).unwrap();
        assert_eq!(pool.n_threads(), threads);
        for n in [1, 2, 7, 64, 1000] {
            let hits = counts(n);
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{threads} {n}"
            );
        }
    }
}

#[test]
fn many_small_jobs_in_a_loop() {
    let pool = ThreadPool::new(3).unwrap();
    let mut data = vec![0u64; 37];
    for round in 0..20_000u64 {
        pool.for_each_chunk_mut(&mut data, 4, |c, chunk| {
            for (j, v) in chunk.iter_mut().enumerate() {
                *v += (c * 4 + j) as u64 + round;
            }
        });
    }
    let rounds: u64 = (0..20_000).sum();
    for (i, &v) in data.iter().enumerate() {
        assert_eq!(v, i as u64 * 20_000 + rounds);
    }
}

#[test]
fn zero_chunks_calls_nothing() {
    let pool = ThreadPool::new(2).unwrap();
    pool.run(0, &|_| panic!("no chunk expected"));
    let mut empty: [u8; 0] = [];
    pool.for_each_chunk_mut(&mut empty, 8, |_, _| panic!("no chunk expected"));
}

#[test]
fn uneven_last_chunk() {
    let pool = ThreadPool::new(2).unwrap();
    let mut data = vec![0usize; 10];
    pool.for_each_chunk_mut(&mut data, 4, |c, chunk| {
        assert_eq!(chunk.len(), if c == 2 { 2 } else { 4 });
        chunk.fill(c + 1);
    });
    assert_eq!(data, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]);
}

#[test]
fn nested_jobs_run_inline() {
    let pool = ThreadPool::new(3).unwrap();
    let total = AtomicUsize::new(0);
    pool.run(8, &|_| {
        // Same pool and the global pool: both must run inline, not wait for busy workers.
        pool.run(5, &|j| {
            total.fetch_add(j, Ordering::Relaxed);
        });
        global().run(4, &|j| {
            total.fetch_add(100 * j, Ordering::Relaxed);
        });
    });
    assert_eq!(total.load(Ordering::Relaxed), 8 * (10 + 600));
}

#[test]
fn panic_propagates_and_the_pool_still_works() {
    let pool = ThreadPool::new(3).unwrap();
    for _ in 0..20 {
        let ran = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.run(64, &|i| {
                ran.fetch_add(1, Ordering::Relaxed);
                if i == 5 {
                    panic!("chunk five");
                }
            })
        }));
        let payload = result.expect_err("the panic reaches the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"chunk five"));
        assert!(ran.load(Ordering::Relaxed) >= 1);
        // The nested-job flag is reset after a caught panic.
        assert!(!IN_JOB.with(Cell::get));
        let hits = counts(100);
        pool.run(100, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }
}

#[test]
fn parked_workers_wake_up() {
    let pool = ThreadPool::with_spin(3, Duration::from_micros(100)).unwrap();
    for _ in 0..5 {
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.shared.sleepers.load(Ordering::SeqCst) < 2 {
            assert!(Instant::now() < deadline, "workers park when idle");
            std::thread::sleep(Duration::from_millis(1));
        }
        let seen = Mutex::new(std::collections::HashSet::new());
        // Each chunk waits until a second thread has run one: only a woken worker can.
        pool.run(4, &|_| {
            seen.lock().unwrap().insert(std::thread::current().id());
            let deadline = Instant::now() + Duration::from_secs(10);
            while seen.lock().unwrap().len() < 2 && Instant::now() < deadline {
                std::thread::yield_now();
            }
        });
        assert!(
            seen.lock().unwrap().len() >= 2,
            "a parked worker joined the job"
        );
    }
}

#[test]
fn drop_joins_the_workers() {
    let pool = ThreadPool::with_spin(4, Duration::from_micros(10)).unwrap();
    pool.run(10, &|_| {});
    let shared = Arc::downgrade(&pool.shared);
    drop(pool);
    assert!(shared.upgrade().is_none(), "every worker exited");
    // Also while spinning (no time to park).
    let pool = ThreadPool::new(4).unwrap();
    pool.run(10, &|_| {});
    let shared = Arc::downgrade(&pool.shared);
    drop(pool);
    assert!(shared.upgrade().is_none());
}

#[test]
fn several_submitting_threads_share_one_pool() {
    let pool = ThreadPool::new(3).unwrap();
    let total = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..500 {
                    pool.run(9, &|i| {
                        total.fetch_add(i, Ordering::Relaxed);
                    });
                }
            });
        }
    });
    assert_eq!(total.load(Ordering::Relaxed), 4 * 500 * 36);
}

#[test]
fn borrows_from_the_callers_stack() {
    let pool = ThreadPool::new(2).unwrap();
    for n in 1..50 {
        let input: Vec<u64> = (0..n).collect();
        let mut out = vec![0u64; n as usize];
        pool.for_each_chunk_mut(&mut out, 3, |c, chunk| {
            for (j, v) in chunk.iter_mut().enumerate() {
                *v = input[c * 3 + j] * 2;
            }
        });
        assert!(out.iter().zip(&input).all(|(&o, &i)| o == 2 * i));
    }
}

#[test]
fn global_pool_and_core_count() {
    assert!(physical_cores() >= 1);
    assert!(current_num_threads() >= 1);
    assert!(matches!(
        init_global(2),
        Err(PoolError::AlreadyInitialized { .. })
    ));
}

#[test]
fn segments_tile_the_chunks_in_order() {
    for (n, t) in [(0, 2), (1, 2), (7, 2), (64, 3), (1000, 5), (3, 5)] {
        let bounds: Vec<(usize, usize)> = (0..t).map(|k| segment(n, t, k)).collect();
        assert_eq!(bounds[0].0, 0);
        assert_eq!(bounds[t - 1].1, n);
        for w in bounds.windows(2) {
            assert_eq!(w[0].1, w[1].0, "{n} {t}");
        }
        let sizes: Vec<usize> = bounds.iter().map(|(a, b)| b - a).collect();
        let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        assert!(hi - lo <= 1, "{n} {t}: {sizes:?}");
    }
}

/// Each thread walks the chunks it claims in ascending order inside each segment, so a
/// kernel's prefetch past the end of its chunk reaches the chunk the same thread runs next.
#[test]
fn each_thread_walks_its_segments_in_ascending_order() {
    let pool = ThreadPool::new(2).unwrap();
    for _ in 0..200 {
        let n = 64;
        let seen = Mutex::new(Vec::new());
        pool.run(n, &|i| {
            let me = std::thread::current().id();
            seen.lock().unwrap().push((me, i));
        });
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), n);
        let mut by_thread: std::collections::HashMap<_, Vec<usize>> = Default::default();
        for (id, i) in seen {
            by_thread.entry(id).or_default().push(i);
        }
        for chunks in by_thread.values() {
            for k in 0..2 {
                let (a, b) = segment(n, 2, k);
                let mine: Vec<usize> = chunks
                    .iter()
                    .copied()
                    .filter(|i| (a..b).contains(i))
                    .collect();
                assert!(mine.windows(2).all(|w| w[0] < w[1]), "{mine:?}");
            }
        }
    }
}

#[test]
fn thread_count_is_bounded() {
    // 100000 threads would be 100000 OS threads; the bound refuses before spawning any.
    match ThreadPool::new(100_000) {
        Err(PoolError::TooManyThreads { n_threads, max }) => {
            assert_eq!((n_threads, max), (100_000, MAX_THREADS))
        }
        other => panic!(
            "expected TooManyThreads, got {:?}",
            other.map(|p| p.n_threads())
        ),
    }
    assert_eq!(
        ThreadPool::new(MAX_THREADS.min(4)).unwrap().n_threads(),
        MAX_THREADS.min(4)
    );
}

/// Waits up to 10 s for `n` parked workers.
fn wait_for_sleepers(pool: &ThreadPool, n: usize) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.shared.sleepers.load(Ordering::SeqCst) != n {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

#[test]
fn boosted_workers_poll_instead_of_parking() {
    let pool = ThreadPool::with_spin(3, Duration::from_micros(100)).unwrap();
    assert!(wait_for_sleepers(&pool, 2), "workers park when idle");
    let boost = pool.boost_spin(Duration::from_secs(30));
    // The job wakes them; from then on they poll.
    pool.run(8, &|_| {});
    assert!(wait_for_sleepers(&pool, 0), "the job woke the workers");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        pool.shared.sleepers.load(Ordering::SeqCst),
        0,
        "no worker parked while boosted"
    );
    drop(boost);
    // Polling workers see the boost end and park.
    assert!(
        wait_for_sleepers(&pool, 2),
        "workers park once the boost ends"
    );
}

#[test]
fn boosts_nest_and_a_hand_set_poll_time_wins() {
    let mut pool = ThreadPool::with_spin(2, Duration::from_micros(50)).unwrap();
    assert_eq!(pool.poll_time(), Duration::from_micros(50));
    let a = pool.boost_spin(Duration::from_micros(2000));
    let b = pool.boost_spin(Duration::from_micros(500));
    assert_eq!(pool.poll_time(), Duration::from_micros(2000));
    drop(a);
    assert_eq!(
        pool.poll_time(),
        Duration::from_micros(2000),
        "b still lives"
    );
    drop(b);
    assert_eq!(pool.poll_time(), Duration::from_micros(50));
    // The longest time asked for so far, never shorter than the pool's own.
    let short = pool.boost_spin(Duration::from_micros(10));
    assert_eq!(pool.poll_time(), Duration::from_micros(2000));
    drop(short);
    pool.boostable = false;
    let c = pool.boost_spin(Duration::from_secs(1));
    assert_eq!(pool.poll_time(), Duration::from_micros(50));
    drop(c);
}

#[test]
fn column_blocks_cover_every_column_of_every_row_once() {
    let pool = ThreadPool::new(3).unwrap();
    // 5 rows of 11 columns in blocks of 4: widths 4, 4, 3.
    let (rows, row_len) = (5, 11);
    let mut data = vec![0u32; rows * row_len];
    let seen = counts(3);
    pool.for_each_column_block_mut(&mut data, row_len, 4, |b, block| {
        seen[b].fetch_add(1, Ordering::SeqCst);
        assert_eq!(block.first_col(), 4 * b);
        assert_eq!(block.cols(), if b == 2 { 3 } else { 4 });
        assert_eq!(block.rows(), rows);
        for r in 0..rows {
            let c0 = block.first_col();
            for (i, v) in block.row(r).iter_mut().enumerate() {
                *v += (100 * r + c0 + i) as u32 + 1;
            }
        }
    });
    assert!(seen.iter().all(|c| c.load(Ordering::SeqCst) == 1));
    let want: Vec<u32> = (0..rows * row_len)
        .map(|i| (100 * (i / row_len) + i % row_len) as u32 + 1)
        .collect();
    assert_eq!(data, want);
}

#[test]
#[should_panic(expected = "whole rows")]
fn column_blocks_need_whole_rows() {
    let pool = ThreadPool::new(1).unwrap();
    pool.for_each_column_block_mut(&mut [0u8; 7], 3, 2, |_, _| {});
}

#[test]
#[should_panic(expected = "row 2 of 2")]
fn column_block_rows_are_bounded() {
    let pool = ThreadPool::new(1).unwrap();
    pool.for_each_column_block_mut(&mut [0u8; 6], 3, 2, |_, block| {
        block.row(2);
    });
}
