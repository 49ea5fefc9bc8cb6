//! A thread pool made for per-token work: a handful of operations per layer, each split into
//! chunks, thousands of operations per second.
//!
//! * `n − 1` persistent worker threads plus the calling thread, which takes chunks too.
//! * A job is `(n_chunks, &dyn Fn(chunk))`, published by bumping an epoch counter; nothing is
//!   allocated and no channel is crossed per job. The closure may borrow from the caller's
//!   stack: [`ThreadPool::run`] returns only once no worker can touch it any more.
//! * The chunks are split into one contiguous segment per thread, which each thread walks in
//!   order, claiming with an atomic `fetch_add`; a thread whose segment is used up takes
//!   chunks from the others' segments, so a descheduled thread's share is taken by the others.
//!   Walking a contiguous run keeps a kernel's prefetch of the rows after its chunk useful:
//!   they belong to the chunk the same thread runs next (a memory-bound single-token matmul on
//!   2 threads read 10–20% faster than with chunks dealt out alternately).
//! * Idle workers poll (with the `pause` hint) for a bounded time, then park on a condition
//!   variable; the caller wakes them only when some are parked.
//! * A job submitted from inside a job (on any pool) runs inline on the current thread, so
//!   nested parallelism cannot deadlock. A panic in a chunk is caught, the remaining chunks
//!   are skipped, and the panic is resumed on the calling thread once the job is closed.
//!
//! The protocol (all on [`Shared`]): the epoch is odd while a job is open. A worker that sees a
//! new odd epoch `e` registers in `active`, then re-reads the epoch; only if it is still `e`
//! does it read the job and claim chunks. The caller, once every chunk is done, bumps the epoch
//! to `e + 1` and waits for `active == 0`. Both sides use sequentially consistent operations
//! (store-then-load on one side, increment-then-load on the other), so either the worker sees
//! the closed epoch and touches nothing, or the caller sees the worker and waits for it.
#![warn(missing_docs)]

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The work of one job: called once per chunk index.
type ChunkFn = dyn Fn(usize) + Sync;

/// How long an idle worker polls for the next job before it parks. Per-token work submits
/// jobs microseconds apart, so polling this long catches the next matmul of a layer; parking
/// soon after matters on a machine with more runnable threads than cores, where a thread that
/// keeps polling (or yielding) is treated as a CPU hog by the scheduler and loses its core,
/// while a parked one is woken with priority (measured under load 9 on 2 cores: 50 µs gave
/// about twice the tokens per second of 2 ms with yielding).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The most threads a pool may have (llama.cpp's `-t` bound, `GGML_MAX_N_THREADS`): a larger
/// request is an error rather than thousands of threads.
pub const MAX_THREADS: usize = 512;

/// Errors of the pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// [`init_global`] was called after the global pool already existed.
    #[error("the global thread pool already exists with {n_threads} threads")]
    AlreadyInitialized {
        /// Threads of the existing global pool.
        n_threads: usize,
    },
    /// More threads were asked for than [`MAX_THREADS`].
    #[error("{n_threads} threads asked for; at most {max} are allowed")]
    TooManyThreads {
        /// Threads asked for.
        n_threads: usize,
        /// [`MAX_THREADS`].
        max: usize,
    },
    /// The operating system refused to start a worker thread.
    #[error("starting a worker thread: {0}")]
    Spawn(#[from] std::io::Error),
}

thread_local! {
    /// Whether this thread is executing chunks of a job (of any pool).
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// The job being run: its closure (lifetime erased, see [`ThreadPool::run`]) and chunk count.
#[derive(Clone, Copy)]
struct Job {
    f: Option<*const ChunkFn>,
    n: usize,
}

/// State shared by the submitting thread and the workers.
struct Shared {
    /// Odd while a job is open; bumped once to open a job and once to close it.
    epoch: AtomicU64,
    /// Written only by the submitter, while it holds the submit lock and no worker is active.
    job: UnsafeCell<Job>,
    /// Per thread (the caller is 0), the offset of the next chunk to claim in its segment.
    next: Box<[Claim]>,
    /// Chunks finished (or skipped after a panic).
    done: AtomicUsize,
    /// Workers that registered for the current epoch and may be reading the job.
    active: AtomicUsize,
    /// Set when a chunk panicked: the remaining chunks are skipped.
    panicked: AtomicBool,
    /// The first panic's payload, resumed on the submitting thread.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    /// Guards parking, so a wake-up cannot slip between a worker's last check and its wait.
    sleep_lock: Mutex<()>,
    /// Parked workers wait here.
    wake: Condvar,
    /// Set by `Drop`: workers exit.
    shutdown: AtomicBool,
    /// How long an idle worker polls before it parks.
    spin: Duration,
    /// The longest boosted poll time asked for, in microseconds ([`SpinBoost`]).
    boost_us: AtomicU64,
    /// Live [`SpinBoost`]s: while any, idle workers poll for `boost_us` if longer.
    boosts: AtomicUsize,
}

// SAFETY: every field is `Sync` except `job`, whose raw closure pointer is written only by the
// thread that holds the submit lock while no worker is registered for an open epoch, and read
// only by workers registered for the open epoch (see the module docs); the closure it points to
// is `Sync`, so calling it from several threads at once is allowed.
unsafe impl Sync for Shared {}
// SAFETY: as above; the pointer is only dereferenced under that protocol, on any thread.
unsafe impl Send for Shared {}

/// A segment's claim counter, alone in its cache lines (the threads claim concurrently).
#[repr(align(128))]
struct Claim(AtomicUsize);

impl Shared {
    /// Claims and runs chunks of `f` until none is left: first the segment of thread `me`, then
    /// those of the following threads. Panics are caught and recorded. The chunks this thread
    /// ran are counted done once, when it has no more to claim: `done` is the one counter all
    /// threads write, and adding to it per chunk moved its cache line between the cores
    /// hundreds of times per decode matmul.
    fn work(&self, f: &(dyn Fn(usize) + Sync + '_), n: usize, me: usize) {
        let outer = IN_JOB.with(|c| c.replace(true));
        let t = self.next.len();
        let mut ran = 0;
        for k in (me..t).chain(0..me) {
            let (start, end) = segment(n, t, k);
            loop {
                let i = start + self.next[k].0.fetch_add(1, Ordering::Relaxed);
                if i >= end {
                    break;
                }
                self.run_chunk(f, i);
                ran += 1;
            }
        }
        if ran > 0 {
            self.done.fetch_add(ran, Ordering::Release);
        }
        IN_JOB.with(|c| c.set(outer));
    }

    /// Runs chunk `i` of `f` (skipped after a panic; counted done by the caller, `work`).
    fn run_chunk(&self, f: &(dyn Fn(usize) + Sync + '_), i: usize) {
        if !self.panicked.load(Ordering::Relaxed) {
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                self.panicked.store(true, Ordering::Relaxed);
                let mut slot = self.panic.lock().unwrap_or_else(PoisonError::into_inner);
                slot.get_or_insert(payload);
            }
        }
    }

    /// Waits until the epoch differs from `seen` (spinning, then parking); `None` on shutdown.
    fn wait_for_change(&self, seen: u64) -> Option<u64> {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            let e = self.epoch.load(Ordering::Acquire);
            if e != seen {
                return Some(e);
            }
            if self.shutdown.load(Ordering::Relaxed) {
                return None;
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) && start.elapsed() >= self.poll_time() {
                break;
            }
            std::hint::spin_loop();
        }
        let mut guard = self
            .sleep_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let result = loop {
            // SeqCst pairs with the submitter's epoch store then sleeper load: either this
            // load sees the new epoch, or the submitter sees this sleeper and notifies (it
            // takes `sleep_lock` first, so the notification cannot precede the wait).
            let e = self.epoch.load(Ordering::SeqCst);
            if e != seen {
                break Some(e);
            }
            if self.shutdown.load(Ordering::SeqCst) {
                break None;
            }
            guard = self
                .wake
                .wait(guard)
                .unwrap_or_else(PoisonError::into_inner);
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// A worker thread's life (thread `me` of the pool): join every job it sees until shutdown.
    fn worker(&self, me: usize) {
        let mut seen = 0u64;
        while let Some(e) = self.wait_for_change(seen) {
            seen = e;
            if e.is_multiple_of(2) {
                continue; // a job opened and closed while this worker was away
            }
            self.active.fetch_add(1, Ordering::SeqCst);
            if self.epoch.load(Ordering::SeqCst) == e {
                // SAFETY: registered in `active` while epoch `e` is open, so the submitter has
                // finished writing the job (its epoch store is ordered after the write, and
                // this load synchronises with it) and will not return, nor write the next
                // job, before this worker deregisters.
                let job = unsafe { *self.job.get() };
                if let Some(f) = job.f {
                    // SAFETY: the closure outlives the open epoch (see `ThreadPool::run`).
                    self.work(unsafe { &*f }, job.n, me);
                }
            }
            self.active.fetch_sub(1, Ordering::Release);
        }
    }
}

/// Chunks `start..end` of `n`: segment `k` of `t` near-equal contiguous segments.
fn segment(n: usize, t: usize, k: usize) -> (usize, usize) {
    (n * k / t, n * (k + 1) / t)
}

/// Polls `cond` with the `pause` hint, then yielding the core, until it holds.
fn wait_until(cond: impl Fn() -> bool) {
    let mut polls = 0u32;
    while !cond() {
        polls = polls.saturating_add(1);
        if polls < 1 << 12 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// A pool of `n_threads − 1` persistent workers; the thread calling [`ThreadPool::run`] is
/// the `n_threads`-th. Dropping the pool stops and joins the workers.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time; other submitting threads wait here.
    submit: Mutex<()>,
    /// Whether [`ThreadPool::boost_spin`] may lengthen the poll (not when it was set by hand).
    boostable: bool,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads())
            .field("spin", &self.shared.spin)
            .finish()
    }
}

impl ThreadPool {
    /// A pool of `n_threads` threads in all (at least 1: the caller) whose idle workers poll
    /// for [`DEFAULT_SPIN`] before parking.
    pub fn new(n_threads: usize) -> Result<ThreadPool, PoolError> {
        ThreadPool::with_spin(n_threads, DEFAULT_SPIN)
    }

    /// A pool of `n_threads` threads whose idle workers poll for `spin` before parking.
    pub fn with_spin(n_threads: usize, spin: Duration) -> Result<ThreadPool, PoolError> {
        if n_threads > MAX_THREADS {
            return Err(PoolError::TooManyThreads {
                n_threads,
                max: MAX_THREADS,
            });
        }
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(Job { f: None, n: 0 }),
            next: (0..n_threads.max(1))
                .map(|_| Claim(AtomicUsize::new(0)))
                .collect(),
            done: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            spin,
            boost_us: AtomicU64::new(0),
            boosts: AtomicUsize::new(0),
        });
        let mut pool = ThreadPool {
            shared,
            workers: Vec::new(),
            submit: Mutex::new(()),
            boostable: true,
        };
        for i in 1..n_threads.max(1) {
            let shared = Arc::clone(&pool.shared);
            let handle = std::thread::Builder::new()
                .name(format!("hmoe-pool-{i}"))
                .spawn(move || shared.worker(i))?;
            // On an error above, dropping `pool` joins the workers started so far.
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// Threads that run a job: the workers plus the caller.
    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `f(i)` once for every `i < n_chunks`, spread over the pool's threads (the caller
    /// included), and returns when all calls have returned. Runs inline on the calling thread
    /// when there is one chunk, no worker, or the caller is itself inside a job. If a call
    /// panics, the chunks not yet started are skipped and the first panic is resumed here.
    pub fn run(&self, n_chunks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_chunks == 0 {
            return;
        }
        if n_chunks == 1 || self.workers.is_empty() || IN_JOB.with(Cell::get) {
            (0..n_chunks).for_each(f);
            return;
        }
        let guard = self.submit.lock().unwrap_or_else(PoisonError::into_inner);
        let sh = &*self.shared;
        // SAFETY: only the lifetime is erased. Workers dereference the pointer only while
        // registered for the epoch opened below, and this function closes that epoch and
        // waits until no worker is registered before it returns (it does not unwind in
        // between: chunk panics are caught in `work`), so `f` outlives every use.
        let erased: &'static ChunkFn =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static ChunkFn>(f) };
        // SAFETY: the submit lock is held and the previous job ended with `active == 0`, so no
        // other thread reads or writes the job now.
        unsafe {
            *sh.job.get() = Job {
                f: Some(erased),
                n: n_chunks,
            };
        }
        for c in sh.next.iter() {
            c.0.store(0, Ordering::Relaxed);
        }
        sh.done.store(0, Ordering::Relaxed);
        sh.panicked.store(false, Ordering::Relaxed);
        let open = sh.epoch.load(Ordering::Relaxed) + 1;
        debug_assert!(!open.is_multiple_of(2));
        sh.epoch.store(open, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = sh.sleep_lock.lock().unwrap_or_else(PoisonError::into_inner);
            sh.wake.notify_all();
        }
        sh.work(f, n_chunks, 0);
        wait_until(|| sh.done.load(Ordering::Acquire) >= n_chunks);
        sh.epoch.store(open + 1, Ordering::SeqCst);
        wait_until(|| sh.active.load(Ordering::SeqCst) == 0);
        // SAFETY: closed and no worker registered: nobody else touches the job.
        unsafe { (*sh.job.get()).f = None };
        let panic = sh
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(guard);
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }

    /// Splits `data` into chunks of `chunk_len` elements (the last may be shorter) and calls
    /// `f(chunk_index, chunk)` for each, in parallel as [`ThreadPool::run`].
    pub fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        assert!(chunk_len > 0, "chunk length must be positive");
        let len = data.len();
        let base = SendPtr(data.as_mut_ptr());
        self.run(len.div_ceil(chunk_len), &|i| {
            let start = i * chunk_len;
            let end = (start + chunk_len).min(len);
            // SAFETY: chunk `i` covers `start..end` of `data`, disjoint from every other chunk
            // index and inside the slice, and `run` calls each index once while `data` stays
            // mutably borrowed by this function.
            let chunk =
                unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
            f(i, chunk)
        });
    }

    /// Treats `data` as a matrix of rows of `row_len` elements, splits its columns into blocks
    /// of `block_cols` (the last may be narrower) and calls `f(block_index, block)` for each,
    /// in parallel as [`ThreadPool::run`]; `block` reaches the block's part of every row
    /// ([`ColumnBlock::row`]). For results that tasks produce by column (a matmul's output
    /// rows of each weight row block) written straight into a row-major output.
    pub fn for_each_column_block_mut<T: Send>(
        &self,
        data: &mut [T],
        row_len: usize,
        block_cols: usize,
        f: impl Fn(usize, &mut ColumnBlock<'_, T>) + Sync,
    ) {
        assert!(block_cols > 0, "block width must be positive");
        assert!(
            row_len > 0 && data.len().is_multiple_of(row_len),
            "data must be whole rows of row_len elements"
        );
        let rows = data.len() / row_len;
        let base = SendPtr(data.as_mut_ptr());
        self.run(row_len.div_ceil(block_cols), &|i| {
            let col0 = i * block_cols;
            let mut block = ColumnBlock {
                base: base.get(),
                row_len,
                rows,
                col0,
                cols: block_cols.min(row_len - col0),
                _data: std::marker::PhantomData,
            };
            f(i, &mut block)
        });
    }
}

/// The columns `col0..col0 + cols` of every row of a row-major matrix, one task's share of
/// [`ThreadPool::for_each_column_block_mut`].
pub struct ColumnBlock<'a, T> {
    base: *mut T,
    row_len: usize,
    rows: usize,
    col0: usize,
    cols: usize,
    _data: std::marker::PhantomData<&'a mut [T]>,
}

impl<T> ColumnBlock<'_, T> {
    /// The first column of the block.
    pub fn first_col(&self) -> usize {
        self.col0
    }

    /// The block's width in columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The matrix's row count.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The block's part of row `r` (panics past the last row).
    pub fn row(&mut self, r: usize) -> &mut [T] {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        // SAFETY: row `r`'s columns `col0..col0 + cols` lie inside the matrix (`r < rows`,
        // `col0 + cols <= row_len`, `rows * row_len` elements), no other block reaches these
        // columns, and `&mut self` keeps this the only reference into the block while it lives.
        unsafe {
            std::slice::from_raw_parts_mut(self.base.add(r * self.row_len + self.col0), self.cols)
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            // Taken so that a worker between its last check and its wait cannot miss this.
            let _lock = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.shared.wake.notify_all();
        }
        for handle in self.workers.drain(..) {
            // A worker catches every chunk panic, so a join error cannot carry one; ignore it.
            let _ = handle.join();
        }
    }
}

/// A raw pointer that may cross threads (the chunks it is split into are disjoint).
struct SendPtr<T>(*mut T);

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the `Sync` wrapper, not the raw field).
    fn get(&self) -> *mut T {
        self.0
    }
}

// SAFETY: used only by `for_each_chunk_mut` and `for_each_column_block_mut`, whose chunks
// never overlap; `T: Send` there.
unsafe impl<T: Send> Sync for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for SendPtr<T> {}

static GLOBAL: OnceLock<ThreadPool> = OnceLock::new();

/// Creates the global pool with `n_threads` threads (0 = [`physical_cores`]). Errors if it
/// already exists (created by an earlier call or by [`global`]).
pub fn init_global(n_threads: usize) -> Result<&'static ThreadPool, PoolError> {
    let n = if n_threads == 0 {
        physical_cores()
    } else {
        n_threads
    };
    let mut created = false;
    let mut spawn_error = None;
    let pool = GLOBAL.get_or_init(|| {
        created = true;
        with_env_spin(n).unwrap_or_else(|e| {
            spawn_error = Some(e);
            ThreadPool::new(1).expect("a one-thread pool starts no thread")
        })
    });
    match (created, spawn_error) {
        (true, None) => Ok(pool),
        (true, Some(e)) => Err(e),
        (false, _) => Err(PoolError::AlreadyInitialized {
            n_threads: pool.n_threads(),
        }),
    }
}

/// The global pool, created with [`physical_cores`] threads on first use unless
/// [`init_global`] came first (a single-thread pool if no worker could be started).
pub fn global() -> &'static ThreadPool {
    GLOBAL.get_or_init(|| {
        with_env_spin(physical_cores())
            .unwrap_or_else(|_| ThreadPool::new(1).expect("a one-thread pool starts no thread"))
    })
}

/// The global pool: idle workers poll for `HMOE_POOL_SPIN_US` microseconds if set (a tuning
/// knob: longer polling can pay on a machine with idle cores; it also overrides every
/// [`ThreadPool::boost_spin`]), else for [`DEFAULT_SPIN`].
fn with_env_spin(n_threads: usize) -> Result<ThreadPool, PoolError> {
    let set = std::env::var("HMOE_POOL_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map(Duration::from_micros);
    let mut pool = ThreadPool::with_spin(n_threads, set.unwrap_or(DEFAULT_SPIN))?;
    pool.boostable = set.is_none();
    Ok(pool)
}

/// Threads of the global pool (creating it if needed).
pub fn current_num_threads() -> usize {
    global().n_threads()
}

/// Physical CPU cores (hyper-threads share execution units, so per-token work, which is
/// memory-bound, gains nothing from them): distinct `(physical id, core id)` pairs of
/// `/proc/cpuinfo`, at most the logical CPUs available; the logical count where that file
/// is missing or lacks the fields.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return logical;
    };
    let mut cores = std::collections::HashSet::new();
    let mut package = "";
    for line in info.lines() {
        if let Some((key, value)) = line.split_once(':') {
            match key.trim() {
                "physical id" => package = value.trim(),
                "core id" => {
                    cores.insert((package.to_string(), value.trim().to_string()));
                }
                _ => {}
            }
        }
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}

mod spin_boost;
pub use spin_boost::SpinBoost;

#[cfg(test)]
mod tests;
