//! What one uncontended lock costs, beside the floor: the cheapest correct lock+unlock a
//! program can do by hand on one connection.
//!
//! ```text
//! cargo bench --bench lock
//! ```
//!
//! All figures come from one run against one local `redis-server` (started here, or
//! `REDIS_URL` when set):
//!
//! * `floor`: `SET key token NX PX 30000`, then a compare-and-delete Lua script by `EVALSHA`
//!   (loaded once with `redis::Script`), on one plain `redis::Connection`;
//! * `fenced`: the least a lock with fencing tokens can send: the `SET NX PX` and an `INCR`
//!   of a counter in one script (a fence only when the `SET` won), then the same
//!   compare-and-delete (no retry safety, no fairness, no news of a lost hold);
//! * `lock_unlock`: `client.lock(name)` + `guard.unlock()`, default settings;
//! * `try_lock_unlock`: `client.try_lock(name)` + `guard.unlock()`;
//! * `extend`: `guard.extend(30 s)` on a held lock;
//! * `fencing_token`: reading the token of a held guard.
//!
//! Criterion does not compute ratios, so at the end a plain timed loop measures `floor`,
//! `fenced` and `lock_unlock` again, interleaved in rotating blocks (so that drift of the
//! machine affects all alike), and prints `ratio = lock_unlock / floor` against the target
//! of 1.05, and beside it `fenced / floor`: what fencing alone, hand-written, costs against
//! that floor on the machine.
//! The client's own counters give the Redis commands per lock+unlock.
//! `cargo bench --bench lock -- ratio` runs that loop alone; another filter skips it.
//!
//! With the `metrics` feature the client also emits through the `metrics` facade: without
//! a recorder that is a no-op the facade decides; `REDBATON_BENCH_RECORDER=noop` installs
//! `metrics::NoopRecorder` first, to measure the emitting calls themselves:
//!
//! ```text
//! cargo bench --bench lock --features metrics -- ratio
//! REDBATON_BENCH_RECORDER=noop cargo bench --bench lock --features metrics -- ratio
//! ```
//!
//! The client turns on keyspace notifications at build (`CONFIG SET`); it is built before
//! anything is measured, so the floor's commands pay the server's notification work too.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group};
use redbaton::{LockClient, Unlocked};
use redbaton_testkit::server;

/// Counts heap allocations, so that the ratio loop can say how many one lock+unlock makes
/// (one relaxed atomic add per allocation: nanoseconds beside a round trip).
struct CountingAlloc;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// The server every benchmark talks to (set once in `main`).
static URL: OnceLock<String> = OnceLock::new();

/// The floor's owner token: as long as the library's (a hyphenated UUID v4).
const FLOOR_TOKEN: &str = "0b7e9d3c-5f1a-4e2b-9c8d-1a2b3c4d5e6f";
/// The floor's key: as long as the library's key for the name `lib` (`redbaton:{lib}`).
const FLOOR_KEY: &str = "redbaton:{flo}";
/// The fenced floor's counter, beside its key.
const FLOOR_FENCE: &str = "redbaton:{flo}:fence";
/// The fenced floor's acquire: a fence only when the `SET` wins.
const FENCED_ACQUIRE: &str = "\
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return 0";
/// Compare-and-delete, the floor's release.
const COMPARE_AND_DELETE: &str = "\
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0";

/// Timed loop of the ratio: operations per side, in blocks of this many.
const RATIO_OPS: usize = 5_000;
const RATIO_BLOCK: usize = 250;
/// In test mode (`cargo test --benches`) the loop only proves it runs.
const RATIO_OPS_TEST: usize = 200;
const TARGET: f64 = 1.05;
/// The commands each side sends (`INFO commandstats` names): the floor's `SET` and its
/// compare-and-delete script; the library's acquire and release scripts (its own counters
/// confirm two commands per op, printed below).
const FLOOR_SENDS: &[&str] = &["set", "evalsha"];
const FENCED_SENDS: &[&str] = &["evalsha"];
const LIB_SENDS: &[&str] = &["evalsha"];

fn url() -> &'static str {
    URL.get().expect("URL set in main")
}

/// The hand-written lock: one connection, two commands.
struct Floor {
    conn: redis::Connection,
    cad: redis::Script,
    fenced: redis::Script,
}

impl Floor {
    fn new(url: &str) -> Floor {
        let mut conn = redis::Client::open(url)
            .and_then(|c| c.get_connection())
            .expect("floor connection");
        let cad = redis::Script::new(COMPARE_AND_DELETE);
        let fenced = redis::Script::new(FENCED_ACQUIRE);
        // Loaded once: no measured call meets NOSCRIPT.
        cad.load(&mut conn).expect("SCRIPT LOAD");
        fenced.load(&mut conn).expect("SCRIPT LOAD");
        Floor { conn, cad, fenced }
    }

    fn lock_unlock(&mut self) {
        let set: redis::Value = redis::cmd("SET")
            .arg(FLOOR_KEY)
            .arg(FLOOR_TOKEN)
            .arg("NX")
            .arg("PX")
            .arg(30_000)
            .query(&mut self.conn)
            .expect("SET NX PX");
        assert!(matches!(set, redis::Value::Okay), "floor key was free");
        self.unlock();
    }

    /// The fenced floor: `SET NX PX` and `INCR` in one script, then compare-and-delete.
    fn fenced_lock_unlock(&mut self) {
        let fence: i64 = self
            .fenced
            .key(FLOOR_KEY)
            .key(FLOOR_FENCE)
            .arg(FLOOR_TOKEN)
            .arg(30_000)
            .invoke(&mut self.conn)
            .expect("fenced SET NX PX");
        assert!(fence > 0, "floor key was free");
        self.unlock();
    }

    fn unlock(&mut self) {
        let deleted: i64 = self
            .cad
            .key(FLOOR_KEY)
            .arg(FLOOR_TOKEN)
            .invoke(&mut self.conn)
            .expect("compare-and-delete");
        assert_eq!(deleted, 1, "floor released its own key");
    }
}

fn client() -> LockClient {
    LockClient::builder()
        .node(url())
        .build()
        .expect("build client")
}

fn lib_lock_unlock(client: &LockClient, name: &str) {
    let guard = client.lock(name).expect("lock");
    let outcome = guard.unlock().expect("unlock");
    assert!(matches!(outcome, Unlocked::Released), "{outcome:?}");
}

fn lib_try_lock_unlock(client: &LockClient, name: &str) {
    let guard = client.try_lock(name).expect("try_lock: uncontended");
    let outcome = guard.unlock().expect("unlock");
    assert!(matches!(outcome, Unlocked::Released), "{outcome:?}");
}

fn bench_lock(c: &mut Criterion) {
    let client = client();
    let mut floor = Floor::new(url());
    let mut g = c.benchmark_group("lock");
    g.bench_function("floor", |b| b.iter(|| floor.lock_unlock()));
    g.bench_function("lock_unlock", |b| {
        b.iter(|| lib_lock_unlock(&client, "lib"))
    });
    g.bench_function("try_lock_unlock", |b| {
        b.iter(|| lib_try_lock_unlock(&client, "lib"))
    });
    {
        let guard = client.lock("held").expect("lock for extend");
        g.bench_function("extend", |b| {
            b.iter(|| guard.extend(Duration::from_secs(30)).expect("extend"))
        });
        g.bench_function("fencing_token", |b| {
            b.iter(|| black_box(&guard).fencing_token())
        });
        guard.unlock().expect("unlock after extend");
    }
    g.finish();
}

criterion_group! {
    name = benches;
    // Sized for a 2-core machine: the whole run takes about a minute. No plots: drawing
    // them takes longer than the measurements (the figures are printed either way).
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30)
        .without_plots();
    targets = bench_lock
}

/// Where the time of a block went.
#[derive(Default, Clone, Copy)]
struct Cost {
    wall: Duration,
    /// CPU time of the calling thread (user + sys: the client's code and its syscalls).
    client_cpu: Duration,
    /// Time Redis spent executing the commands the block sent (`INFO commandstats`,
    /// `usec` of those commands; a script's `usec` includes the commands it calls, which
    /// Redis also counts under their own names, so only the sent ones are summed).
    server_cmd_us: f64,
    /// CPU time of the Redis process (`INFO cpu`): commands plus parsing, replies, I/O.
    server_cpu_s: f64,
    /// Heap allocations (and reallocations) by this process.
    allocs: u64,
}

impl std::ops::AddAssign for Cost {
    fn add_assign(&mut self, o: Cost) {
        self.wall += o.wall;
        self.client_cpu += o.client_cpu;
        self.server_cmd_us += o.server_cmd_us;
        self.server_cpu_s += o.server_cpu_s;
        self.allocs += o.allocs;
    }
}

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer for a clock every Linux has.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Reads the server's counters on a side connection: (µs spent in the commands named in
/// `sent`, process CPU seconds).
fn server_counters(admin: &mut redis::Connection, sent: &[&str]) -> (f64, f64) {
    let text: String = redis::cmd("INFO")
        .arg("commandstats")
        .arg("cpu")
        .query(admin)
        .expect("INFO");
    let mut cmd_us = 0.0;
    let mut cpu_s = 0.0;
    for line in text.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("cmdstat_") {
            if !sent
                .iter()
                .any(|c| rest.strip_prefix(c).is_some_and(|r| r.starts_with(':')))
            {
                continue;
            }
            let usec = rest
                .split([':', ','])
                .find_map(|f| f.strip_prefix("usec="))
                .and_then(|v| v.parse::<f64>().ok());
            cmd_us += usec.unwrap_or(0.0);
        } else if let Some(v) = line
            .strip_prefix("used_cpu_sys:")
            .or_else(|| line.strip_prefix("used_cpu_user:"))
        {
            cpu_s += v.parse::<f64>().unwrap_or(0.0);
        }
    }
    (cmd_us, cpu_s)
}

/// Runs `n` operations, which send the commands named in `sent`, and says what they cost.
fn measure(admin: &mut redis::Connection, sent: &[&str], n: usize, mut op: impl FnMut()) -> Cost {
    let (cmd0, cpu0) = server_counters(admin, sent);
    let a0 = ALLOCATIONS.load(Relaxed);
    let (t0, c0) = (Instant::now(), thread_cpu());
    for _ in 0..n {
        op();
    }
    let (wall, client_cpu) = (t0.elapsed(), thread_cpu() - c0);
    let allocs = ALLOCATIONS.load(Relaxed) - a0;
    let (cmd1, cpu1) = server_counters(admin, sent);
    Cost {
        wall,
        client_cpu,
        server_cmd_us: cmd1 - cmd0,
        server_cpu_s: cpu1 - cpu0,
        allocs,
    }
}

/// `floor`, `fenced` and `lock_unlock` timed in rotating blocks (each block starts with
/// another side, so none always runs first after a switch), the ratio of their totals, and
/// where the time went.
fn ratio(ops: usize) {
    let client = client();
    let mut floor = Floor::new(url());
    let mut admin = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .expect("admin connection");
    let block = RATIO_BLOCK.min(ops);
    // Warm both paths: connections, script cache, allocator, branch predictors.
    for _ in 0..block {
        floor.lock_unlock();
        floor.fenced_lock_unlock();
        lib_lock_unlock(&client, "lib");
    }
    let before = client.stats();
    // Floor, fenced floor, library.
    let mut costs = [Cost::default(); 3];
    let mut block_ratios = Vec::new();
    for i in 0..ops.div_ceil(block) {
        let n = block.min(ops - i * block);
        let mut block_costs = [Cost::default(); 3];
        for k in 0..3 {
            let side = (i + k) % 3;
            block_costs[side] = match side {
                0 => measure(&mut admin, FLOOR_SENDS, n, || floor.lock_unlock()),
                1 => measure(&mut admin, FENCED_SENDS, n, || floor.fenced_lock_unlock()),
                _ => measure(&mut admin, LIB_SENDS, n, || lib_lock_unlock(&client, "lib")),
            };
        }
        for (total, c) in costs.iter_mut().zip(block_costs) {
            *total += c;
        }
        block_ratios.push(block_costs[2].wall.as_secs_f64() / block_costs[0].wall.as_secs_f64());
    }
    let [c_floor, c_fenced, c_lib] = costs;
    let after = client.stats();
    block_ratios.sort_by(f64::total_cmp);
    let us = |t: Duration| t.as_secs_f64() * 1e6 / ops as f64;
    let row = |name: &str, c: &Cost| {
        let wall = us(c.wall);
        let client = us(c.client_cpu);
        let cmd = c.server_cmd_us / ops as f64;
        let server = c.server_cpu_s * 1e6 / ops as f64;
        println!(
            "  {name:<12} {wall:8.2} {client:10.2} {cmd:10.2} {server:10.2} {:10.2} {:7.1}",
            wall - client - server,
            c.allocs as f64 / ops as f64
        );
    };
    let ratio = c_lib.wall.as_secs_f64() / c_floor.wall.as_secs_f64();
    let fenced = c_fenced.wall.as_secs_f64() / c_floor.wall.as_secs_f64();
    let commands = (after.commands - before.commands) as f64 / ops as f64;
    println!();
    println!(
        "ratio loop: {ops} lock+unlock per side, {} interleaved blocks of {block}",
        block_ratios.len()
    );
    println!("  floor       = SET NX PX + EVALSHA compare-and-delete on one connection");
    println!("  fenced      = EVALSHA (SET NX PX, then INCR) + the same compare-and-delete");
    println!(
        "  lock_unlock = client.lock + guard.unlock, default settings ({commands:.2} Redis commands per op)"
    );
    println!("  per op (us):    wall client-cpu  redis-cmd  redis-cpu  rest(wait)  allocs");
    row("floor", &c_floor);
    row("fenced", &c_fenced);
    row("lock_unlock", &c_lib);
    println!(
        "  block ratios: min {:.2}  median {:.2}  max {:.2}",
        block_ratios[0],
        block_ratios[block_ratios.len() / 2],
        block_ratios[block_ratios.len() - 1]
    );
    println!(
        "ratio = {ratio:.2} (target <= {TARGET:.2}){}",
        if ratio <= TARGET { "" } else { "  NOT MET" }
    );
    println!(
        "fenced / floor = {fenced:.2}: a hand-written lock with fencing tokens, on this machine"
    );
}

/// The positional FILTER criterion was given, if any (skipping the values of options).
fn filter(args: &[String]) -> Option<&str> {
    const WITH_VALUE: &[&str] = &[
        "-c",
        "--color",
        "--colour",
        "-s",
        "--save-baseline",
        "-b",
        "--baseline",
        "--baseline-lenient",
        "--load-baseline",
        "--profile-time",
        "--format",
        "--sample-size",
        "--warm-up-time",
        "--measurement-time",
        "--nresamples",
        "--noise-threshold",
        "--confidence-level",
        "--significance-level",
        "--plotting-backend",
        "--output-format",
    ];
    let mut rest = args.iter().skip(1);
    while let Some(a) = rest.next() {
        if WITH_VALUE.contains(&a.as_str()) {
            rest.next();
        } else if !a.starts_with('-') {
            return Some(a);
        }
    }
    None
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let benchmarking = has("--bench") && !has("--test");
    // `cargo bench --bench lock -- ratio` runs the ratio loop alone (no criterion benchmark
    // has that name); any other filter runs the matching benchmarks without it.
    let run_ratio = !has("--list") && filter(&args).is_none_or(|f| f == "ratio");
    match std::env::var("REDBATON_BENCH_RECORDER").as_deref() {
        Ok("noop") => {
            metrics::set_global_recorder(metrics::NoopRecorder).expect("the only recorder");
            println!("metrics: no-op recorder installed");
        }
        Ok(other) => panic!("REDBATON_BENCH_RECORDER={other}: only `noop` is known"),
        Err(_) => {}
    }

    // The server lives until the end of main (statics are never dropped).
    let (url, _server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let server = server::RedisServer::start();
            (server.url(), Some(server))
        }
    };
    URL.set(url).expect("URL set once");

    benches();
    Criterion::default().configure_from_args().final_summary();
    if run_ratio {
        if !benchmarking {
            println!(
                "\n(test mode: a short loop that only proves it runs; its figures mean nothing)"
            );
        }
        ratio(if benchmarking {
            RATIO_OPS
        } else {
            RATIO_OPS_TEST
        });
    }
}
