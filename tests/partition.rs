//! A partition where every acquire fails ambiguously (the request may have reached Redis,
//! no reply came back) must not grow the process's threads: the releases that undo such
//! attempts go to one bounded cleanup worker, not to a thread each.
//!
//! Alone in its own test binary: it counts the threads of the process.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redbaton_testkit::lock_client;
use redbaton_testkit::ms;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::test_server;

const PREFIX: &str = "part:";
const WAITERS: usize = 200;
/// The client's own threads: a subscriber, the watchdog, the cleanup worker; one spare.
const MAX_LIBRARY_THREADS: usize = 4;

/// Threads of this process whose name starts with `redbaton-`.
fn library_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|name| name.starts_with("redbaton-"))
        })
        .count()
}

#[test]
fn partition_keeps_library_threads_bounded() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let lease = Duration::from_secs(2);
    let client = lock_client!(
        node(proxy.url()),
        key_prefix(PREFIX),
        lease(lease),
        io_timeouts(ms(300)),
        pool_size(WAITERS + 16)
    );

    let most = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (most, stop) = (most.clone(), stop.clone());
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                most.fetch_max(library_threads(), Ordering::Relaxed);
                thread::sleep(ms(5));
            }
        })
    };

    proxy.blackhole(true);
    let waiters: Vec<_> = (0..WAITERS)
        .map(|i| {
            let c = client.clone();
            thread::spawn(move || c.try_lock_for(format!("k{i}"), ms(1000)).map(drop))
        })
        .collect();
    let mut failed = 0;
    for w in waiters {
        if w.join().unwrap().is_err() {
            failed += 1;
        }
    }
    // Background releases of the failed attempts are under way now (or queued).
    thread::sleep(ms(1000));
    proxy.heal();
    let healed = Instant::now();
    let mut conn = srv.conn();
    let left = |conn: &mut redis::Connection| {
        (0..WAITERS)
            .filter(|i| {
                redis::cmd("EXISTS")
                    .arg(format!("{PREFIX}{{k{i}}}"))
                    .query::<i64>(conn)
                    .unwrap()
                    == 1
            })
            .count()
    };
    while left(&mut conn) > 0 {
        assert!(
            healed.elapsed() < lease + Duration::from_secs(1),
            "keys left a lease after the partition healed"
        );
        thread::sleep(ms(50));
    }
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let most = most.load(Ordering::Relaxed);
    let stats = client.stats();
    eprintln!(
        "{failed} of {WAITERS} attempts failed; at most {most} library threads; {} background releases dropped",
        stats.cleanup_dropped
    );
    assert_eq!(failed, WAITERS, "every attempt failed under the partition");
    assert!(
        most <= MAX_LIBRARY_THREADS,
        "{most} library threads at once (at most {MAX_LIBRARY_THREADS} expected)"
    );
    // The client still works after the partition.
    client
        .try_lock_for("after", Duration::from_secs(5))
        .expect("locks again")
        .unlock()
        .unwrap();
}
