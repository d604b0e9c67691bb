//! Lease renewal and the lost-lock signal, against real redis-server processes.
//!
//! Every test owns its server. Timing bounds are liveness bounds only (a 2-core CI box
//! runs these tests in parallel threads): "renewals keep the lock", "the loss is reported
//! within a few renew intervals", never "it was fast". Measured figures are printed with
//! `eprintln!` (see them with `--nocapture`).

use std::collections::HashMap;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Error, LockClient, LostReason, Unlocked};
use redbaton_testkit::child::{field, result_with};
use redbaton_testkit::child_only;
use redbaton_testkit::clock::mono_ns;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::lock_builder;
use redbaton_testkit::monitor::{Monitor, ScriptCall, parse_line, script_calls};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::test_server;
use redbaton_testkit::{child, init_log, ms};
use redbaton_testkit::{exists, pttl};
use redis::Connection;

const PREFIX: &str = "wd:";
const KEYS: Keys = Keys::new(PREFIX);

// --- helpers -----------------------------------------------------------------

/// A client on `url` with `lease` and the test prefix; the rest of the settings default.
fn builder(url: &str, lease: Duration) -> redbaton::Builder {
    lock_builder!(node(url), key_prefix(PREFIX), lease(lease))
}

fn client(url: &str, lease: Duration) -> LockClient {
    build(builder(url, lease))
}

fn build(b: redbaton::Builder) -> LockClient {
    b.build().expect("build client")
}

fn get(conn: &mut Connection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(conn).expect("GET")
}

/// Waits for the lost signal; panics (with what is known) if it does not come in time.
fn expect_lost(guard: &redbaton::LockGuard, within: Duration) -> (LostReason, Duration) {
    let started = Instant::now();
    match guard.lost().recv_timeout(within) {
        Ok(reason) => (reason, started.elapsed()),
        Err(e) => panic!(
            "no lost signal within {within:?} ({e}); is_lost={}, check={:?}",
            guard.is_lost(),
            guard.check()
        ),
    }
}

// --- smoke -------------------------------------------------------------------

#[test]
fn smoke() {
    let srv = test_server();
    let client = client(&srv.url(), Duration::from_secs(2));
    let guard = client.lock("smoke").expect("lock");
    guard.check().expect("held");
    assert!(!guard.is_lost());
    assert!(guard.valid_until() > Instant::now());
    assert!(guard.lost().try_recv().is_err());
    let mut conn = srv.conn();
    let ttl = pttl(&mut conn, KEYS.lock("smoke"));
    assert!(ttl > 0 && ttl <= 2000, "PTTL {ttl}");
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    assert!(!exists(&mut conn, KEYS.lock("smoke")));
}

// --- 1. renewals keep a short lease held against another process --------------

/// Child: tries the lock every 100 ms until it gets it (at most 20 s), then reports how
/// often it failed and when (CLOCK_MONOTONIC ns).
#[test]
fn child_try_loop() {
    child_only!();
    let client = client(&child::env("REDIS_URL"), Duration::from_secs(1));
    let name = child::env("LOCK_NAME");
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut failed, mut first_fail_ns, mut last_fail_ns) = (0u64, 0u64, 0u64);
    let acquired_ns = loop {
        match client.try_lock(&name) {
            Ok(guard) => {
                let at = mono_ns();
                assert_eq!(guard.unlock().expect("child unlock"), Unlocked::Released);
                break at;
            }
            Err(e) if e.is_would_block() => {
                failed += 1;
                last_fail_ns = mono_ns();
                if failed == 1 {
                    first_fail_ns = last_fail_ns;
                    child::print_result(&[("trying", "1".into())]);
                }
            }
            Err(e) => panic!("child try_lock: {e}"),
        }
        assert!(
            Instant::now() < deadline,
            "child never got the lock ({failed} failures)"
        );
        thread::sleep(ms(100));
    };
    child::print_result(&[
        ("failed", failed.to_string()),
        ("first_fail_ns", first_fail_ns.to_string()),
        ("last_fail_ns", last_fail_ns.to_string()),
        ("acquired_ns", acquired_ns.to_string()),
    ]);
}

#[test]
fn renewals_hold_a_1s_lease_for_4s_against_another_process() {
    let srv = test_server();
    let client = client(&srv.url(), Duration::from_secs(1));
    let name = "held-4s";
    let guard = client.lock(name).expect("lock");
    let mut c = child::spawn_self(
        "child_try_loop",
        &[("REDIS_URL", srv.url()), ("LOCK_NAME", name.into())],
    );
    child::wait_for_line(&mut c, "trying=1", Duration::from_secs(30));
    let hold_start_ns = mono_ns();
    let hold_start = Instant::now();
    while hold_start.elapsed() < Duration::from_secs(4) {
        guard
            .check()
            .unwrap_or_else(|e| panic!("lost after {:?}: {e}", hold_start.elapsed()));
        thread::sleep(ms(100));
    }
    assert!(!guard.is_lost());
    assert!(guard.lost().try_recv().is_err(), "lost signal while held");
    let renewals = client.stats().renewals_sent;
    let unlock_ns = mono_ns();
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);

    let out = child::wait_ok(c, Duration::from_secs(30));
    let r = result_with(&out, "failed");
    let (failed, last_fail_ns, acquired_ns) = (
        field::<u64>(&r, "failed"),
        field::<u64>(&r, "last_fail_ns"),
        field::<u64>(&r, "acquired_ns"),
    );
    eprintln!(
        "1 s lease held 4 s: {renewals} renewals sent; other process failed {failed} times, \
         last failure {} ms into the hold, acquired {} ms after unlock",
        (last_fail_ns.saturating_sub(hold_start_ns)) / 1_000_000,
        (acquired_ns.saturating_sub(unlock_ns)) / 1_000_000
    );
    assert!(
        acquired_ns > unlock_ns,
        "the other process got the lock before it was released"
    );
    assert!(
        last_fail_ns >= hold_start_ns + 3_000_000_000,
        "the other process stopped failing {} ms into the hold",
        (last_fail_ns.saturating_sub(hold_start_ns)) / 1_000_000
    );
    assert!(failed >= 20, "only {failed} failed attempts in 4 s");
    assert!(
        renewals >= 3,
        "a 1 s lease held 4 s needs renewals: {renewals}"
    );
}

// --- 2. key deleted behind the holder's back -----------------------------------

#[test]
fn deleted_key_fires_lost_and_drop_spares_the_next_holder() {
    let srv = test_server();
    // A 10 s lease renewed every 500 ms: the renewal, not the lease, tells of the loss.
    let a = build(builder(&srv.url(), ms(10_000)).renew_interval(ms(500)));
    let name = "deleted";
    let key = KEYS.lock(name);
    let guard = a.lock(name).expect("lock");
    let mut conn = srv.conn();
    assert_eq!(
        redis::cmd("DEL").arg(&key).query::<i64>(&mut conn).unwrap(),
        1
    );
    let (reason, took) = expect_lost(&guard, Duration::from_secs(5));
    eprintln!("DEL noticed after {took:?}: {reason:?}");
    assert_eq!(reason, LostReason::Deleted);
    // One renew interval (500 ms) plus a generous margin, well before the lease ends.
    assert!(took <= ms(5000), "loss reported after {took:?}");
    assert!(guard.is_lost());
    assert!(matches!(
        guard.check(),
        Err(Error::Lost(LostReason::Deleted))
    ));
    assert!(matches!(
        guard.extend(Duration::from_secs(5)),
        Err(Error::Lost(LostReason::Deleted))
    ));
    let stats = a.stats();
    assert_eq!(stats.locks_lost, 1, "{stats:?}");

    // Someone else takes the key; dropping the stale guard must leave it alone.
    let b = client(&srv.url(), Duration::from_secs(10));
    let b_guard = b
        .try_lock(name)
        .expect("the key is free for another client");
    let b_token = get(&mut conn, &key).expect("b's key");
    let fence_before: String = redis::cmd("GET")
        .arg(format!("{key}:fence"))
        .query(&mut conn)
        .unwrap();
    assert!(b_guard.fencing_token() > guard.fencing_token());
    // Known lost while b holds it: the stale guard promises no validity either.
    let left = guard
        .valid_until()
        .saturating_duration_since(Instant::now());
    assert!(
        left.is_zero(),
        "b holds it; the lost guard is valid for {left:?}"
    );
    drop(guard);
    assert_eq!(get(&mut conn, &key).as_deref(), Some(b_token.as_str()));
    assert!(pttl(&mut conn, &key) > 5000, "b's lease untouched");
    let fence_after: String = redis::cmd("GET")
        .arg(format!("{key}:fence"))
        .query(&mut conn)
        .unwrap();
    assert_eq!(fence_before, fence_after);
    b_guard.check().expect("b still holds it");
    assert_eq!(a.stats().locks_lost, 1, "lost counted once");
    assert_eq!(b_guard.unlock().expect("unlock"), Unlocked::Released);
    assert!(!exists(&mut conn, &key));
}

// --- 3. key overwritten by another token ---------------------------------------

#[test]
fn overwritten_key_is_reported_stolen() {
    let srv = test_server();
    let client = build(builder(&srv.url(), ms(10_000)).renew_interval(ms(500)));
    let name = "stolen";
    let key = KEYS.lock(name);
    let guard = client.lock(name).expect("lock");
    let mut conn = srv.conn();
    let () = redis::cmd("SET")
        .arg(&key)
        .arg("other")
        .arg("PX")
        .arg(30000)
        .query(&mut conn)
        .unwrap();
    let (reason, took) = expect_lost(&guard, Duration::from_secs(5));
    eprintln!("overwrite noticed after {took:?}: {reason:?}");
    assert_eq!(reason, LostReason::Stolen);
    assert!(took <= ms(5000), "loss reported after {took:?}");
    assert!(matches!(
        guard.check(),
        Err(Error::Lost(LostReason::Stolen))
    ));
    assert!(
        guard.valid_until() <= Instant::now(),
        "another token holds it"
    );
    assert_eq!(client.stats().locks_lost, 1);
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::HeldByOther);
    assert_eq!(get(&mut conn, &key).as_deref(), Some("other"));
    assert!(
        pttl(&mut conn, &key) > 25000,
        "the other owner's TTL untouched"
    );
}

// --- 4. server restarted (empty) under a holder ----------------------------------

#[test]
fn server_restart_reports_the_lock_lost() {
    let srv = test_server();
    let client = build(builder(&srv.url(), ms(1500)).renew_interval(ms(500)));
    let name = "restart";
    let guard = client.lock(name).expect("lock");
    let before = guard.fencing_token();
    srv.restart();
    let (reason, took) = expect_lost(&guard, Duration::from_secs(15));
    eprintln!("restart noticed {took:?} after the restart returned: {reason:?}");
    assert!(
        matches!(reason, LostReason::Deleted | LostReason::Expired),
        "{reason:?}"
    );
    assert!(guard.is_lost());
    assert!(matches!(guard.check(), Err(Error::Lost(r)) if r == reason));
    drop(guard); // releases best-effort on the new server: must not panic
    // The client works against the new server (empty: the fence counter restarted).
    let again = client
        .try_lock_for(name, Duration::from_secs(10))
        .expect("lock after restart");
    again.check().expect("held");
    eprintln!(
        "fencing token before restart {before}, after {}",
        again.fencing_token()
    );
    assert_eq!(again.unlock().expect("unlock"), Unlocked::Released);
}

// --- 5. a holder process paused past its lease ------------------------------------

/// Child: holds the lock with a 1 s lease, announces it, then checks every 50 ms. The
/// parent SIGSTOPs it; the first check after the pause (noticed as a gap in the loop) and
/// all later ones must fail.
#[test]
fn child_stopped_holder() {
    child_only!();
    let client = client(&child::env("REDIS_URL"), Duration::from_secs(1));
    let guard = client.lock(child::env("LOCK_NAME")).expect("child lock");
    // The parent keeps us stopped for 1.3 s; no mere scheduling hiccup lasts a second.
    let pause = ms(1000);
    let deadline = Instant::now() + Duration::from_secs(15);
    // Taken before the announcement: the parent stops us right after it, possibly
    // before the loop starts, and that pause must count.
    let mut last = Instant::now();
    child::print_result(&[
        ("token", guard.fencing_token().to_string()),
        ("acquired", "1".into()),
    ]);
    let mut resumed = false;
    let mut first_after: Option<String> = None;
    let mut checks_after = 0u32;
    let mut ok_after = 0u32;
    let mut gap = Duration::ZERO;
    while Instant::now() < deadline {
        let before = Instant::now();
        if before - last > pause {
            resumed = true;
            gap = gap.max(before - last);
        }
        let r = guard.check();
        let after = Instant::now();
        if after - before > pause {
            // Stopped inside check(): its answer may predate the pause. Ignore it; the
            // next one is the first surely made after the resume.
            resumed = true;
            gap = gap.max(after - before);
            last = after;
            continue;
        }
        if resumed {
            if first_after.is_none() {
                first_after = Some(format!("{r:?}"));
            }
            checks_after += 1;
            if r.is_ok() {
                ok_after += 1;
            }
            if checks_after >= 10 {
                break;
            }
        }
        last = after;
        thread::sleep(ms(50));
    }
    let lost_signal = guard
        .lost()
        .try_recv()
        .map_or_else(|_| "none".to_string(), |r| format!("{r:?}"));
    let is_lost = guard.is_lost();
    let unlocked = format!("{:?}", guard.unlock());
    child::print_result(&[
        ("resumed", u8::from(resumed).to_string()),
        ("gap_ms", gap.as_millis().to_string()),
        ("first_after", first_after.unwrap_or_else(|| "none".into())),
        ("checks_after", checks_after.to_string()),
        ("ok_after", ok_after.to_string()),
        ("lost_signal", lost_signal),
        ("is_lost", u8::from(is_lost).to_string()),
        ("unlock", unlocked),
    ]);
}

#[test]
fn paused_holder_process_learns_it_lost_and_is_fenced_out() {
    let srv = test_server();
    let name = "paused";
    let key = KEYS.lock(name);
    let mut c = child::spawn_self(
        "child_stopped_holder",
        &[("REDIS_URL", srv.url()), ("LOCK_NAME", name.into())],
    );
    let line = child::wait_for_line(&mut c, "acquired=1", Duration::from_secs(30));
    // Whatever happens below, the child is not left stopped for ever.
    let resume = ResumeOnDrop(c.id());
    child::stop_child(&mut c);
    let child_token = field::<u64>(&child::parse_results(&line)[0], "token");

    // Past the child's 1 s lease, this process takes the lock.
    thread::sleep(ms(1300));
    let parent = client(&srv.url(), Duration::from_secs(30));
    let taken = parent.try_lock_for(name, Duration::from_secs(10));
    let parent_value = get(&mut srv.conn(), &key);
    drop(resume); // SIGCONT
    let guard = taken.expect("the paused holder's lease ran out: the lock must be free");

    let out = child::wait_ok(c, Duration::from_secs(30));
    let r = result_with(&out, "first_after");
    eprintln!(
        "paused holder: token {child_token}, new holder {}; child saw {r:?}",
        guard.fencing_token()
    );
    assert_eq!(
        r["resumed"], "1",
        "the child never noticed its pause: {out}"
    );
    assert!(field::<u64>(&r, "gap_ms") >= 1000, "{r:?}");
    assert!(
        r["first_after"].starts_with("Err(Lost("),
        "first check after the resume: {}",
        r["first_after"]
    );
    assert_eq!(
        field::<u64>(&r, "ok_after"),
        0,
        "a check passed after the resume"
    );
    assert!(field::<u64>(&r, "checks_after") >= 1);
    assert!(r["lost_signal"] != "none", "no lost signal: {r:?}");
    assert_eq!(r["is_lost"], "1");
    assert_eq!(r["unlock"], "Ok(HeldByOther)", "stale holder's unlock");
    assert!(
        guard.fencing_token() > child_token,
        "fencing token of the new holder {} not above the paused one {child_token}",
        guard.fencing_token()
    );
    // The stale holder's unlock and exit left the new holder's key alone.
    assert!(parent_value.is_some());
    assert_eq!(get(&mut srv.conn(), &key), parent_value);
    guard.check().expect("the new holder still holds it");
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
}

/// Sends SIGCONT to a stopped child when dropped (also while unwinding).
struct ResumeOnDrop(u32);

impl Drop for ResumeOnDrop {
    fn drop(&mut self) {
        // SAFETY: a plain signal to our own child, not reaped yet (it is only waited for
        // after this guard is gone).
        unsafe {
            libc::kill(self.0 as libc::pid_t, libc::SIGCONT);
        }
    }
}

// --- 6. a thousand locks, renewed in batches ---------------------------------------

#[test]
fn thousand_locks_are_renewed_in_few_round_trips() {
    init_log();
    const N: usize = 1000;
    let srv = RedisServer::start();
    let client = client(&srv.url(), Duration::from_secs(3));
    let names: Vec<String> = (0..N).map(|i| format!("bulk:{i}")).collect();
    let started = Instant::now();
    let guards: Vec<_> = names
        .iter()
        .map(|n| client.lock(n).expect("lock"))
        .collect();
    let acquiring = started.elapsed();

    // The window: only renewals run in it.
    srv.reset_stats();
    let renewals_before = client.stats().renewals_sent;
    let window = Instant::now();
    thread::sleep(Duration::from_secs(10));
    let evalsha = srv.command_count("evalsha");
    let window = window.elapsed();
    let renewals = client.stats().renewals_sent - renewals_before;

    let lost: Vec<&str> = guards
        .iter()
        .zip(&names)
        .filter(|(g, _)| g.is_lost() || g.lost().try_recv().is_ok())
        .map(|(_, n)| n.as_str())
        .collect();
    let mut conn = srv.conn();
    let mut pipe = redis::pipe();
    for n in &names {
        pipe.cmd("PTTL").arg(KEYS.lock(n));
    }
    let ttls: Vec<i64> = pipe.query(&mut conn).expect("PTTLs");
    let expired = ttls.iter().filter(|&&t| t <= 0).count();
    eprintln!(
        "{N} locks (acquired in {acquiring:?}), held {window:?} with 3 s leases: \
         {evalsha} EVALSHA calls, {renewals} lock renewals ({:.0} keys per call), \
         min PTTL at the end {} ms",
        renewals as f64 / evalsha.max(1) as f64,
        ttls.iter().min().copied().unwrap_or(-3)
    );
    assert!(
        lost.is_empty(),
        "{} locks lost: {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
    assert_eq!(expired, 0, "{expired} keys without a live TTL");
    assert!(
        renewals >= 5 * N as u64,
        "every lock renewed several times in 10 s: {renewals}"
    );
    // Unbatched, this would be ~10,000 calls (1,000 locks, every second, for 10 s).
    assert!(
        (5..=200).contains(&evalsha),
        "{evalsha} EVALSHA calls for {renewals} renewals"
    );
    for g in guards {
        assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    }
    assert!(srv.keys(&format!("{PREFIX}{{bulk:*}}")).is_empty());
}

/// A 1,000-key extend works: once all 1,000 held locks are due in the same watchdog pass
/// they are renewed by ONE script call with 1,000 keys, and every key is extended.
///
/// When that happens depends on the watchdog's schedule: a pass that renews a lock due now
/// takes every lock due within a quarter renew interval (here 1.5 s) with it, so locks
/// acquired within that window are renewed together from the first renewal cycle on (a
/// wider spread stays split for good: the window is sized for a loaded debug build, whose
/// 1,000 acquisitions can take a second). The test watches MONITOR until it sees such a
/// call (normally about 6 s in), never longer than 40 s.
#[test]
fn a_thousand_key_extend_batch_works() {
    init_log();
    const N: usize = 1000;
    let srv = RedisServer::start();
    let client = build(builder(&srv.url(), ms(9000)).renew_interval(ms(6000)));
    let monitor = Monitor::start(&srv);
    let started = Instant::now();
    let guards: Vec<_> = (0..N)
        .map(|i| client.lock(format!("batch:{i}")).expect("lock"))
        .collect();
    let acquiring = started.elapsed();
    let deadline = started + Duration::from_secs(40);
    let mut lines = Vec::new();
    let full_batch = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(line) = monitor.next_line(left) else {
            break false;
        };
        let full = parse_line(&line)
            .and_then(|(_, args)| ScriptCall::parse(&args))
            .filter(|c| !c.argv.is_empty())
            .map(EvalCall::classify)
            .is_some_and(|c| c.kind == Kind::Extend && c.keys.len() == N);
        lines.push(line);
        // NOSCRIPT retries are told apart only by what follows: settle first.
        if full {
            lines.extend(monitor.flush(&srv));
            if eval_calls(&lines)
                .iter()
                .any(|c| c.kind == Kind::Extend && c.keys.len() == N)
            {
                break true;
            }
        }
    };
    let waited = started.elapsed();
    lines.extend(monitor.flush(&srv));
    let sizes: Vec<usize> = eval_calls(&lines)
        .iter()
        .filter(|c| c.kind == Kind::Extend)
        .map(|c| c.keys.len())
        .collect();
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    eprintln!(
        "{N} locks acquired in {acquiring:?}; extend calls until a full batch \
         ({waited:?}), keys per call: {sizes:?}"
    );
    assert_eq!(lost, 0, "locks lost");
    assert!(sizes.iter().all(|&s| s <= N), "batch above {N}: {sizes:?}");
    assert!(
        full_batch,
        "no {N}-key extend in {waited:?} (acquisitions took {acquiring:?}): {sizes:?}"
    );
    // That call extended every key: all TTLs are live.
    let mut conn = srv.conn();
    let mut pipe = redis::pipe();
    for i in 0..N {
        pipe.cmd("PTTL").arg(KEYS.lock(&format!("batch:{i}")));
    }
    let ttls: Vec<i64> = pipe.query(&mut conn).expect("PTTLs");
    let min = ttls.iter().min().copied().unwrap_or(-3);
    assert!(min > 0, "a key is not alive: min PTTL {min}");
    for g in guards {
        assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    }
}

// --- 7. no renewal after release (MONITOR) ------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Acquire,
    Release,
    Extend,
}

/// One EVALSHA seen by MONITOR, classified by its shape: acquire's second key is the
/// fence counter and it has eight ARGV (the fair queue's release names the fence too, with
/// six); extend's ARGV are the lease in ms (a number) then one token per key; release's
/// first ARGV is the token.
#[derive(Debug)]
struct EvalCall {
    kind: Kind,
    sha: String,
    keys: Vec<String>,
    argv: Vec<String>,
}

impl EvalCall {
    fn classify(call: ScriptCall) -> EvalCall {
        let ScriptCall {
            sha,
            mut keys,
            mut argv,
        } = call;
        // A lock's renewal names each lock with its lease record, and sends its token with
        // the change's number: keep the locks and their tokens.
        let records = keys.len() % 2 == 0
            && !keys.is_empty()
            && keys.chunks(2).all(|p| p[1] == format!("{}:lease", p[0]));
        let lease = argv.first().is_some_and(|a| a.parse::<u64>().is_ok());
        if records && lease && argv.len() == keys.len() + 1 {
            keys = keys.into_iter().step_by(2).collect();
            argv = std::iter::once(argv[0].clone())
                .chain(argv[1..].iter().step_by(2).cloned())
                .collect();
        }
        let kind = if keys.get(1).is_some_and(|k| k.ends_with(":fence")) && argv.len() >= 8 {
            Kind::Acquire
        } else if argv.first().is_some_and(|a| a.parse::<u64>().is_ok())
            && argv.len() == keys.len() + 1
        {
            Kind::Extend
        } else {
            Kind::Release
        };
        EvalCall {
            kind,
            sha,
            keys,
            argv,
        }
    }

    /// The token this call carries for `key`.
    fn token_for(&self, key: &str) -> Option<&str> {
        let i = self.keys.iter().position(|k| k == key)?;
        match self.kind {
            Kind::Acquire | Kind::Release => self.argv.first().map(String::as_str),
            Kind::Extend => self.argv.get(i + 1).map(String::as_str),
        }
    }
}

/// The EVALSHA calls that ran, in server order, classified.
fn eval_calls(lines: &[String]) -> Vec<EvalCall> {
    script_calls(lines)
        .into_iter()
        .filter(|c| !c.argv.is_empty())
        .map(EvalCall::classify)
        .collect()
}

/// Everything `monitor` saw up to now, as the EVALSHA calls that ran.
fn finish(monitor: Monitor, srv: &RedisServer) -> Vec<EvalCall> {
    eval_calls(&monitor.flush(srv))
}

#[test]
fn monitor_line_parsing() {
    let lines: Vec<String> = [
        r#"1.0 [0 127.0.0.1:5000] "EVALSHA" "abc" "1" "wd:{c:1}" "150" "t-1""#,
        r#"1.1 [0 127.0.0.1:5001] "EVALSHA" "def" "1" "k" "t-2" """#,
        r#"1.2 [0 127.0.0.1:5001] "SCRIPT" "LOAD" "local x = 1\nreturn \"a\"""#,
        r#"1.3 [0 127.0.0.1:5001] "EVALSHA" "def" "1" "k" "t-2" """#,
        r#"1.4 [0 lua] "GET" "a\"b\x41""#,
    ]
    .map(String::from)
    .to_vec();
    let calls = eval_calls(&lines);
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0].kind, Kind::Extend);
    assert_eq!(calls[0].keys, ["wd:{c:1}"]);
    assert_eq!(calls[0].token_for("wd:{c:1}"), Some("t-1"));
    assert_eq!(calls[1].kind, Kind::Release);
    assert_eq!(calls[1].argv, ["t-2", ""]);
    let (client, args) = parse_line(&lines[4]).unwrap();
    assert_eq!(client, "lua");
    assert_eq!(args, ["GET", "a\"bA"]);
}

#[test]
fn no_renewal_reaches_redis_after_unlock_returns() {
    init_log();
    const CYCLES: usize = 200;
    let srv = RedisServer::start();
    let client = build(builder(&srv.url(), ms(150)).renew_interval(ms(50)));
    let monitor = Monitor::start(&srv);

    let mut outcomes: HashMap<String, usize> = HashMap::new();
    for i in 0..CYCLES {
        let name = format!("cyc:{i}");
        let guard = client.lock(&name).expect("lock");
        thread::sleep(ms((i as u64 * 37) % 61));
        let outcome = guard.unlock().expect("unlock");
        *outcomes.entry(format!("{outcome:?}")).or_default() += 1;
    }
    let stats = client.stats();
    // Renewals that were going to leak would show up now.
    thread::sleep(ms(300));
    let calls = finish(monitor, &srv);

    // Each script SHA is one kind of call.
    let mut sha_kind: HashMap<&str, Kind> = HashMap::new();
    for c in &calls {
        let k = *sha_kind.entry(&c.sha).or_insert(c.kind);
        assert_eq!(k, c.kind, "SHA {} used for {k:?} and {:?}", c.sha, c.kind);
    }
    let count = |kind| calls.iter().filter(|c| c.kind == kind).count();
    let extends = count(Kind::Extend);
    eprintln!(
        "{CYCLES} lock/unlock cycles (150 ms lease, 50 ms renew, 0-60 ms holds): \
         {} acquires, {extends} extend calls, {} releases, renewals_sent {}, \
         unlock outcomes {outcomes:?}",
        count(Kind::Acquire),
        count(Kind::Release),
        stats.renewals_sent
    );
    assert!(stats.renewals_sent > 0, "no renewal happened: {stats:?}");
    assert!(extends > 0, "no extend call seen by MONITOR");

    let mut violations = Vec::new();
    for i in 0..CYCLES {
        let key = KEYS.lock(&format!("cyc:{i}"));
        let mine: Vec<(usize, &EvalCall)> = calls
            .iter()
            .enumerate()
            .filter(|(_, c)| c.keys.contains(&key))
            .collect();
        let of = |kind| -> Vec<(usize, &EvalCall)> {
            mine.iter()
                .filter(|(_, c)| c.kind == kind)
                .copied()
                .collect()
        };
        let (acquires, releases) = (of(Kind::Acquire), of(Kind::Release));
        assert_eq!(acquires.len(), 1, "{key}: {acquires:?}");
        assert_eq!(releases.len(), 1, "{key}: {releases:?}");
        let (acquired_at, token) = (acquires[0].0, acquires[0].1.token_for(&key).unwrap());
        let released_at = releases[0].0;
        assert_eq!(releases[0].1.token_for(&key), Some(token), "{key}");
        for (at, c) in of(Kind::Extend) {
            assert_eq!(c.token_for(&key), Some(token), "{key}: foreign token");
            assert!(at > acquired_at, "{key}: extend before acquire");
            if at > released_at {
                violations.push(format!(
                    "{key}: extend (call {at}) after its release (call {released_at})"
                ));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "renewals after release: {violations:#?}"
    );
    let left: Vec<_> = srv
        .keys(&format!("{PREFIX}{{cyc:*"))
        .into_iter()
        .filter(|k| !k.ends_with(b":fence"))
        .map(|k| String::from_utf8_lossy(&k).into_owned())
        .collect();
    assert!(left.is_empty(), "lock keys revived after release: {left:?}");
}

// --- renewal details ----------------------------------------------------------------

#[test]
fn valid_until_moves_forward_with_renewals() {
    let srv = test_server();
    let client = client(&srv.url(), ms(1200)); // renewed every 400 ms
    let guard = client.lock("valid").expect("lock");
    let v0 = guard.valid_until();
    let left = v0.saturating_duration_since(Instant::now());
    assert!(left > ms(600) && left <= ms(1200), "{left:?}");
    thread::sleep(ms(1000));
    guard.check().expect("renewed, so still held");
    let v1 = guard.valid_until();
    eprintln!("valid_until moved forward by {:?}", v1 - v0);
    assert!(v1 > v0 + ms(200), "valid_until did not move: {:?}", v1 - v0);
    assert!(v1 > Instant::now(), "validity in the past while held");
    let s = client.stats();
    assert!(s.renewals_sent >= 1, "{s:?}");
    assert_eq!(s.locks_lost, 0, "{s:?}");
    assert!(pttl(&mut srv.conn(), KEYS.lock("valid")) > 0);
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
}

#[test]
fn without_auto_renew_the_lock_expires_after_one_lease() {
    let srv = test_server();
    let client = builder(&srv.url(), ms(500))
        .auto_renew(false)
        .build()
        .expect("build (no watchdog)");
    let key = KEYS.lock("once");
    let guard = client.lock("once").expect("lock");
    guard.check().expect("held at first");
    thread::sleep(ms(900));
    assert!(guard.is_lost());
    assert!(matches!(
        guard.check(),
        Err(Error::Lost(LostReason::Expired))
    ));
    assert_eq!(guard.lost().try_recv(), Ok(LostReason::Expired));
    let mut conn = srv.conn();
    assert!(!exists(&mut conn, &key), "key outlived its lease");
    let s = client.stats();
    assert_eq!(s.renewals_sent, 0, "{s:?}");
    assert_eq!(s.locks_lost, 1, "{s:?}");
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Expired);
    // Free for the next holder.
    client
        .try_lock("once")
        .expect("free again")
        .unlock()
        .unwrap();
}

/// The lost channel receives the reason "when the lock is lost", without the holder asking:
/// also with `auto_renew(false)`. Regression test: with renewals off no watchdog ran, so
/// the channel stayed silent until the holder happened to call `is_lost()`/`check()`, and
/// a loop `select!`ing on `lost()` never woke.
#[test]
fn without_auto_renew_the_lost_channel_still_fires() {
    let srv = test_server();
    let client = builder(&srv.url(), ms(500))
        .auto_renew(false)
        .build()
        .expect("build (no watchdog)");
    let guard = client.lock("silent").expect("lock");
    // No is_lost()/check() before this: only the channel.
    let got = guard.lost().recv_timeout(Duration::from_secs(3));
    assert_eq!(got, Ok(LostReason::Expired));
}

#[test]
fn max_hold_stops_renewals_and_fires_hold_limit() {
    let srv = test_server();
    // A lease longer than the cap (renewed every 500 ms): a loaded machine cannot make
    // the lock expire before the cap is reached.
    let client = build(builder(&srv.url(), ms(1500)).max_hold(Duration::from_secs(1)));
    let key = KEYS.lock("capped");
    let started = Instant::now();
    let guard = client.lock("capped").expect("lock");
    let reason = guard
        .lost()
        .recv_timeout(Duration::from_secs(5))
        .expect("lost signal after the hold cap");
    let took = started.elapsed();
    eprintln!("hold cap 1 s: lost after {took:?} ({reason:?})");
    assert_eq!(reason, LostReason::HoldLimit);
    assert!(took >= Duration::from_secs(1), "cap fired early: {took:?}");
    assert!(took < Duration::from_secs(3), "cap fired late: {took:?}");
    assert!(guard.is_lost());
    assert!(matches!(
        guard.check(),
        Err(Error::Lost(LostReason::HoldLimit))
    ));
    let renewals = client.stats().renewals_sent;
    assert!(renewals >= 1, "renewed before the cap: {renewals}");
    // Renewals stopped: the key runs out within one lease, and nothing more is sent.
    thread::sleep(ms(1800));
    assert_eq!(
        client.stats().renewals_sent,
        renewals,
        "renewed after the cap"
    );
    assert!(
        !exists(&mut srv.conn(), &key),
        "key kept alive past the cap"
    );
    assert_eq!(client.stats().locks_lost, 1);
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Expired);
}

/// The watchdog looks at a lock at its cap, not only at its next renewal: with a 6 s lease
/// (renewed every 2 s) and a 300 ms cap, the holder is told about when the cap passes.
#[test]
fn the_holder_is_told_when_its_cap_passes() {
    let srv = test_server();
    let client = build(builder(&srv.url(), Duration::from_secs(6)).max_hold(ms(300)));
    let started = Instant::now();
    let guard = client.lock("capped").expect("lock");
    let (reason, _) = expect_lost(&guard, Duration::from_secs(5));
    let took = started.elapsed();
    eprintln!("hold cap 300 ms: lost after {took:?}");
    assert_eq!(reason, LostReason::HoldLimit);
    assert!(took >= ms(300), "cap fired early: {took:?}");
    assert!(took < ms(800), "cap fired late: {took:?}");
}

/// A hold past its cap is lost for its holder at once, before the watchdog looks at it, and
/// so is not handed to a local thread queued behind it as a live hold: with a 6 s lease and
/// a 300 ms cap, the holder unlocks at 700 ms while another thread of its process waits.
#[test]
fn a_hold_past_max_hold_is_not_handed_on_as_live() {
    let srv = test_server();
    let c = build(builder(&srv.url(), Duration::from_secs(6)).max_hold(ms(300)));
    let a = c.lock("k").expect("A locks");
    let acquired = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    let c2 = c.clone();
    let b = thread::spawn(move || {
        let g = c2
            .try_lock_for("k", Duration::from_secs(10))
            .expect("B gets the lock");
        let at = acquired.elapsed();
        let check = g.check().map_err(|e| e.to_string());
        tx.send((at, check)).unwrap();
        let told = g.lost().recv_timeout(Duration::from_secs(5));
        eprintln!(
            "B told {told:?} at {:?} after A's acquisition",
            acquired.elapsed()
        );
    });
    thread::sleep(ms(700));
    let a_check = a.check().map_err(|e| e.to_string());
    let a_at = acquired.elapsed();
    let outcome = a.unlock().expect("unlock");
    let (b_at, b_check) = rx.recv_timeout(Duration::from_secs(10)).expect("B reports");
    eprintln!(
        "A at {a_at:?}: check {a_check:?}, unlock {outcome:?}; B at {b_at:?}: check {b_check:?}"
    );
    b.join().unwrap();
    assert!(
        a_check.is_err(),
        "A holds {a_at:?} into a 300 ms max_hold and is not told (check {a_check:?})"
    );
    assert!(
        !(outcome == Unlocked::HandedOff && b_check.is_ok()),
        "a hold past its cap handed to B as live ({b_at:?} after the acquisition)"
    );
}

#[test]
fn extend_sets_the_remaining_lease() {
    let srv = test_server();
    let client = client(&srv.url(), Duration::from_secs(2));
    let key = KEYS.lock("ext");
    let guard = client.lock("ext").expect("lock");
    let mut conn = srv.conn();
    assert!(pttl(&mut conn, &key) <= 2000);
    guard.extend(Duration::from_secs(10)).expect("extend");
    let ttl = pttl(&mut conn, &key);
    assert!(
        (9000..=10_000).contains(&ttl),
        "PTTL after extend(10s): {ttl}"
    );
    let left = guard
        .valid_until()
        .saturating_duration_since(Instant::now());
    assert!(
        left > Duration::from_secs(9) && left <= Duration::from_secs(10),
        "{left:?}"
    );
    assert!(
        guard.extend(Duration::ZERO).unwrap_err().is_invalid_input(),
        "zero lease"
    );
    guard.check().expect("held");
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
}

/// `extend()` to a lease shorter than the watchdog's current plan: the watchdog must
/// renew the new, shorter lease in time (at a third of it), not at its old schedule.
/// Regression test: `Inner::extend` updated the lock's lease and `next_renew` without
/// waking the watchdog, which slept until its old plan (here 1 s after the acquisition),
/// by which time the 300 ms lease had run out.
#[test]
fn extend_to_a_shorter_lease_keeps_the_lock_renewed() {
    let srv = test_server();
    let client = client(&srv.url(), Duration::from_secs(3)); // renewed every 1 s
    let key = KEYS.lock("shorter");
    let guard = client.lock("shorter").expect("lock");
    // Let the watchdog take in the new lock (due in 1 s) and plan its next look for then.
    thread::sleep(ms(50));
    guard.extend(ms(300)).expect("extend");
    assert!(pttl(&mut srv.conn(), &key) <= 300);
    thread::sleep(ms(1500));
    assert!(
        !guard.is_lost(),
        "lost after extend(300ms): {:?}",
        guard.check()
    );
    assert!(exists(&mut srv.conn(), &key), "key expired");
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
}

/// Every client's watchdog thread runs. Regression test: the thread is spawned inside
/// `Arc::new_cyclic` (src/client.rs, `LockClient::connect`), and used to `Weak::upgrade`
/// at once and exit for good when that ran before `new_cyclic` returned; such a client
/// never renewed anything (up to a third of builds on a loaded 2-core machine).
#[test]
fn every_client_starts_a_live_watchdog() {
    init_log();
    const CLIENTS: usize = 60;
    let srv = RedisServer::start();
    let held: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let client = build(
                builder(&srv.url(), ms(600))
                    .renew_interval(ms(100))
                    .pool_size(1),
            );
            let guard = client.lock(format!("live:{i}")).expect("lock");
            (client, guard)
        })
        .collect();
    thread::sleep(ms(700));
    let dead: Vec<usize> = held
        .iter()
        .enumerate()
        .filter(|(_, (c, g))| g.is_lost() || c.stats().renewals_sent == 0)
        .map(|(i, _)| i)
        .collect();
    eprintln!(
        "{} of {CLIENTS} clients never renewed: {dead:?}",
        dead.len()
    );
    assert!(
        dead.is_empty(),
        "clients without a running watchdog: {dead:?}"
    );
}

/// A plain lock and a read hold renew in one pipelined round trip (two scripts); after
/// `SCRIPT FLUSH` (as after a restart) the watchdog loads both and renews again.
#[test]
fn mixed_renewals_survive_a_script_flush() {
    let srv = test_server();
    let c = client(&srv.url(), ms(600));
    let g = c.lock("mixed").expect("lock");
    let r = c.rwlock("mixed-rw").read().expect("read");
    thread::sleep(ms(500));
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query::<()>(&mut srv.conn())
        .expect("SCRIPT FLUSH");
    thread::sleep(ms(1500));
    g.check().expect("renewed after the flush");
    r.check().expect("renewed after the flush");
    let s = c.stats();
    assert_eq!((s.renewals_failed, s.locks_lost), (0, 0), "{s:?}");
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    assert!(r.unlock().unwrap().was_held());
}
