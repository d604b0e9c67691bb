//! The fair queue: processes take turns in the order they came, a release grants the lock
//! to the next process directly, and nobody stays stuck behind a dead, stopped or
//! departed waiter. Real `redis-server`, real child processes.

use std::process::Child;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{LockClient, Unlocked};
use redbaton_testkit::child_only;
use redbaton_testkit::clock::mono_ns;
use redbaton_testkit::lock_client;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_all, wait_for};
use redbaton_testkit::{child, ms, secs};
use redbaton_testkit::{test_server, test_server_and};

const QUEUE: &str = "redbaton:{k}:q";

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
}

fn queued(srv: &RedisServer) -> usize {
    srv.zcard(QUEUE)
}

fn keys_left(srv: &RedisServer) -> Vec<String> {
    srv.keys_but_fences("redbaton:*")
}

/// Child: waits for "k" (up to `F_WAIT_MS`), prints when it got it, holds it `F_HOLD_MS`,
/// releases. Prints `got=0` if it timed out.
#[test]
fn child_waiter() {
    child_only!();
    let c = client(&child::env("F_URL"));
    let wait = ms(child::env("F_WAIT_MS").parse().expect("wait"));
    let hold = ms(child::env("F_HOLD_MS").parse().expect("hold"));
    match c.try_lock_for("k", wait) {
        Ok(g) => {
            let at = mono_ns();
            thread::sleep(hold);
            let token = g.fencing_token();
            g.unlock().expect("unlock");
            let s = c.stats();
            child::print_result(&[
                ("got", "1".to_owned()),
                ("at", at.to_string()),
                ("token", token.to_string()),
                ("grants", s.grants_received.to_string()),
            ]);
        }
        Err(e) => {
            assert!(e.is_timeout(), "{e:?}");
            child::print_result(&[("got", "0".to_owned())]);
        }
    }
}

fn spawn_waiter(srv: &RedisServer, wait_ms: u64, hold_ms: u64) -> std::process::Child {
    child::spawn_self(
        "child_waiter",
        &[
            ("F_URL", srv.url()),
            ("F_WAIT_MS", wait_ms.to_string()),
            ("F_HOLD_MS", hold_ms.to_string()),
        ],
    )
}

/// Spawns a waiter and returns once it is queued behind the others and sleeps subscribed:
/// its first attempt queues it before it subscribes, so a grant made then is published to
/// nobody (and confirmed by its next attempt); the attempt it makes once subscribed stores
/// a later nonce with its entry.
fn queue_waiter(srv: &RedisServer, wait_ms: u64, hold_ms: u64) -> std::process::Child {
    let before = queued(srv);
    let c = spawn_waiter(srv, wait_ms, hold_ms);
    wait_for(secs(20), "the waiter to queue", || queued(srv) > before);
    wait_for(secs(20), "the waiter's attempt once subscribed", || {
        newest_nonce(srv) >= 2
    });
    c
}

/// The nonce stored with the newest entry of the queue: the number of the latest attempt
/// of its wait (the first is 1).
fn newest_nonce(srv: &RedisServer) -> u64 {
    let mut conn = srv.conn();
    let newest: Vec<String> = redis::cmd("ZRANGE")
        .arg(QUEUE)
        .arg(-1)
        .arg(-1)
        .query(&mut conn)
        .expect("ZRANGE");
    let Some(token) = newest.first() else {
        return 0;
    };
    redis::cmd("ZSCORE")
        .arg(format!("{QUEUE}n"))
        .arg(token)
        .query::<Option<u64>>(&mut conn)
        .expect("ZSCORE")
        .unwrap_or(0)
}

#[test]
fn smoke() {
    let (srv, holder) = test_server_and(client);
    let guard = holder.lock("k").expect("lock");
    let waiter = queue_waiter(&srv, 20_000, 0);
    guard.unlock().expect("unlock: granted to the waiter");
    let out = child::wait_ok(waiter, secs(30));
    let r = child::result_with(&out, "got");
    assert_eq!(r["got"], "1");
    assert_eq!(
        r["grants"], "1",
        "the waiter was granted the lock, no acquire"
    );
    assert_eq!(holder.stats().grants_passed, 1);
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// Processes get their turns in the order they queued.
#[test]
fn turns_follow_the_queue_order() {
    let (srv, holder) = test_server_and(client);
    let guard = holder.lock("k").expect("lock");
    let children: Vec<_> = (0..4).map(|_| queue_waiter(&srv, 30_000, 50)).collect();
    guard.unlock().expect("unlock");
    let ats: Vec<u64> = children
        .into_iter()
        .map(|c| {
            let out = child::wait_ok(c, secs(30));
            let r = child::result_with(&out, "got");
            assert_eq!(r["got"], "1");
            r["at"].parse().expect("at")
        })
        .collect();
    let mut sorted = ats.clone();
    sorted.sort_unstable();
    assert_eq!(ats, sorted, "turns in queue order");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// `holder` holds `k` with two processes queued behind it; `fault` is done to the first
/// before the release grants it the lock. The second gets the lock within the grant lease
/// (1 s) plus the expiry event's delay. Returns the first process.
fn the_second_goes_on(srv: &RedisServer, holder: &LockClient, fault: fn(&mut Child)) -> Child {
    let guard = holder.lock("k").expect("lock");
    let mut first = queue_waiter(srv, 30_000, 0);
    let next = queue_waiter(srv, 30_000, 0);
    fault(&mut first);
    let released = Instant::now();
    guard
        .unlock()
        .expect("unlock: granted to the first queued process");
    let out = child::wait_ok(next, secs(30));
    let took = released.elapsed();
    assert_eq!(child::result_with(&out, "got")["got"], "1");
    assert!(
        took < secs(3),
        "the next waiter got it {took:?} after the release"
    );
    first
}

/// A queued process killed before its turn: the others go on within the grant lease.
#[test]
fn a_killed_queued_process_delays_the_next_by_at_most_the_grant_lease() {
    let (srv, holder) = test_server_and(client);
    let mut dead = the_second_goes_on(&srv, &holder, |dead| child::kill_child(dead, libc::SIGKILL));
    dead.wait().expect("the killed process reaped");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// Without keyspace notifications (a managed server), a grant to a queued process killed
/// before its turn runs out unheard: the others, who heard it was another's, look again
/// when its lease ends, and go on within it as above.
#[test]
fn without_notifications_a_dead_grantee_delays_the_next_by_at_most_the_grant_lease() {
    let srv = RedisServer::without_notifications();
    let holder = client(&srv.url());
    let mut dead = the_second_goes_on(&srv, &holder, |dead| child::kill_child(dead, libc::SIGKILL));
    dead.wait().expect("the killed process reaped");
}

/// A queued process stopped past the bound: the others go on; it resumes and finishes.
#[test]
fn a_stopped_queued_process_delays_the_next_by_at_most_the_grant_lease() {
    let (srv, holder) = test_server_and(client);
    let mut stopped = the_second_goes_on(&srv, &holder, child::stop_child);
    child::kill_child(&mut stopped, libc::SIGCONT);
    let out = child::wait_ok(stopped, secs(40));
    assert_eq!(
        child::result_with(&out, "got")["got"],
        "1",
        "the stopped process gets its turn after it resumes"
    );
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// A waiter whose deadline comes as the lock is granted to it: it either takes the grant
/// or passes it on; the next waiter gets the lock promptly, and nothing is left behind.
#[test]
fn a_waiter_timing_out_as_it_is_granted_passes_the_lock_on() {
    let (srv, holder) = test_server_and(client);
    for offset_ms in [-20i64, -5, 0, 5, 20] {
        let guard = holder.lock("k").expect("lock");
        let wait_ms = 1500u64;
        let started = Instant::now();
        let racer = queue_waiter(&srv, wait_ms, 0);
        let next = queue_waiter(&srv, 30_000, 0);
        let at = Duration::from_millis((wait_ms as i64 + 200 + offset_ms) as u64);
        thread::sleep(at.saturating_sub(started.elapsed()));
        let released = Instant::now();
        guard.unlock().expect("unlock");
        let out = child::wait_ok(next, secs(30));
        let took = released.elapsed();
        let racer_got = child::result_with(&child::wait_ok(racer, secs(30)), "got")["got"].clone();
        eprintln!("offset {offset_ms} ms: racer got={racer_got}, next waited {took:?}");
        assert_eq!(child::result_with(&out, "got")["got"], "1");
        assert!(took < secs(3), "{took:?}");
        assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
    }
}

/// The grantee's subscriber connection is killed as the grant goes out: the grant
/// message is lost, and the grantee's retry finds its own token in the key.
#[test]
fn a_lost_grant_message_is_recovered_by_the_retry() {
    let (srv, holder) = test_server_and(client);
    let guard = holder.lock("k").expect("lock");
    let waiter = queue_waiter(&srv, 30_000, 0);
    wait_for(secs(20), "the waiter's subscription", || {
        srv.client_list()
            .iter()
            .any(|c| c.get("sub").is_some_and(|n| n != "0"))
    });
    // Kill every subscriber connection but the holder's own (it has none: it never waited).
    assert!(srv.kill_pubsub() >= 1);
    let released = Instant::now();
    guard.unlock().expect("unlock");
    let out = child::wait_ok(waiter, secs(30));
    eprintln!("grantee got it {:?} after the release", released.elapsed());
    assert_eq!(child::result_with(&out, "got")["got"], "1");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// Child: `F_THREADS` threads × `F_ITERS` sections on "k", a non-atomic counter
/// increment inside; prints the tokens in order.
#[test]
fn child_counter() {
    child_only!();
    let url = child::env("F_URL");
    let c = client(&url);
    let threads: usize = child::env("F_THREADS").parse().unwrap();
    let iters: usize = child::env("F_ITERS").parse().unwrap();
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            thread::spawn(move || {
                let mut conn = redis::Client::open(url.as_str())
                    .unwrap()
                    .get_connection()
                    .unwrap();
                for _ in 0..iters {
                    let g = c.lock("k").expect("lock");
                    let v: u64 = redis::cmd("GET")
                        .arg("counter")
                        .query::<Option<u64>>(&mut conn)
                        .unwrap()
                        .unwrap_or(0);
                    thread::sleep(ms(1));
                    redis::cmd("SET")
                        .arg("counter")
                        .arg(v + 1)
                        .query::<()>(&mut conn)
                        .unwrap();
                    g.unlock().expect("unlock");
                }
            })
        })
        .collect();
    join_all(workers, "worker");
    child::print_counters(&c.stats(), &[]);
}

#[test]
fn four_processes_four_threads_counter_exact() {
    let srv = test_server();
    let children = child::spawn_many(
        4,
        "child_counter",
        &[
            ("F_URL", srv.url()),
            ("F_THREADS", "4".to_owned()),
            ("F_ITERS", "40".to_owned()),
        ],
    );
    let mut grants = 0u64;
    for c in children {
        let out = child::wait_ok(c, secs(120));
        let r = child::result_with(&out, "grants_received");
        eprintln!("child: {r:?}");
        grants += r["grants_received"].parse::<u64>().unwrap();
    }
    let n: u64 = redis::cmd("GET")
        .arg("counter")
        .query(&mut srv.conn())
        .unwrap();
    assert_eq!(n, 4 * 4 * 40, "lost updates");
    assert!(grants > 0, "processes passed the lock by grants");
    let left: Vec<String> = keys_left(&srv)
        .into_iter()
        .filter(|k| k != "counter")
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Child: waits for "k" (its process is queued) and prints when it got it, by the machine's
/// monotonic clock, and whether it still held it a moment later.
#[test]
fn child_late_grantee() {
    child_only!();
    let c = client(&child::env("F_URL"));
    println!("waiting");
    let g = c.try_lock_for("k", secs(20)).expect("child: lock");
    let got = mono_ns();
    thread::sleep(ms(50));
    child::print_result(&[
        ("got_ns", got.to_string()),
        ("valid", u8::from(g.check().is_ok()).to_string()),
        ("stats", format!("{:?}", c.stats()).replace(' ', "")),
    ]);
}

/// A grant that reaches its grantee after its short lease ran out (here a slow network:
/// a proxy delays everything the server sends the grantee by 1.5 s) is not taken as a
/// lock: the grantee confirms it with a round trip first, finds it gone, and queues again.
/// Meanwhile another client took the expired grant's key; the grantee gets the lock only
/// after that holder lets go.
#[test]
fn a_grant_heard_too_late_is_not_a_lock() {
    let srv = test_server();
    let proxy = redbaton_testkit::proxy::Proxy::start(srv.addr());
    let holder = client(&srv.url());
    let g = holder.lock("k").expect("lock");
    let mut late = child::spawn_self("child_late_grantee", &[("F_URL", proxy.url())]);
    child::wait_for_line(&mut late, "waiting", secs(20));
    wait_for(secs(10), "the child queued", || queued(&srv) == 1);
    thread::sleep(ms(200)); // the child is asleep, subscribed
    proxy.set_delay(ms(1500));
    drop(g); // granted to the child, with a 1 s lease; the message takes 1.5 s
    thread::sleep(ms(1200));
    let other = client(&srv.url());
    let taken = other
        .try_lock_for("k", secs(5))
        .expect("the expired grant's key is free");
    thread::sleep(ms(1000)); // the grant reaches the child meanwhile
    proxy.set_delay(Duration::ZERO);
    let released = mono_ns();
    drop(taken);
    let out = child::wait_ok(late, secs(30));
    let r = child::result_with(&out, "got_ns");
    let got: u64 = child::field(&r, "got_ns");
    assert!(
        got > released,
        "the late grantee took the lock while another held it ({got} <= {released}): {out}"
    );
    assert_eq!(child::field::<u8>(&r, "valid"), 1);
}

const QUEUE_EXPIRY: &str = "redbaton:{k}:qx";

/// Puts `n` entries into the queue of "k" whose expiries passed long ago, as a mass crash
/// (or a partition longer than the entry TTL) leaves them.
fn fill_expired(srv: &RedisServer, n: usize) {
    let mut conn = srv.conn();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let mut q = redis::cmd("ZADD");
        q.arg(QUEUE);
        let mut qx = redis::cmd("ZADD");
        qx.arg(QUEUE_EXPIRY);
        for i in chunk {
            let member = format!("dead-{i:05}");
            q.arg(*i as u64 + 1).arg(&member);
            qx.arg(1).arg(&member);
        }
        q.query::<()>(&mut conn).expect("ZADD q");
        qx.query::<()>(&mut conn).expect("ZADD qx");
    }
}

/// Thousands of expired entries (more than a Lua script can unpack at once) do not lock
/// the name out: a fair client locks and unlocks it, the scripts drain the queue over a
/// few calls, and the queue's keys carry a TTL so that an abandoned queue disappears.
#[test]
fn a_queue_of_thousands_of_expired_entries_does_not_lock_the_name_out() {
    let srv = test_server();
    fill_expired(&srv, 10_000);
    let c = client(&srv.url());
    for round in 0..3 {
        let guard = c
            .try_lock_for("k", secs(10))
            .unwrap_or_else(|e| panic!("round {round}: lock: {e:#?}"));
        assert!(guard.unlock().expect("unlock").was_held());
    }
    // A live waiter behind the dead entries still gets the lock as it is released.
    let guard = c.lock("k").expect("lock");
    let url = srv.url();
    let waiter = thread::spawn(move || {
        let w = client(&url);
        let g = w.try_lock_for("k", secs(20)).expect("the waiter's turn");
        let got = Instant::now();
        g.unlock().expect("unlock");
        got
    });
    wait_for(secs(20), "the waiter to queue", || {
        redis::cmd("ZCOUNT")
            .arg(QUEUE_EXPIRY)
            .arg("(1")
            .arg("+inf")
            .query::<u64>(&mut srv.conn())
            .expect("ZCOUNT")
            == 1
    });
    let released = Instant::now();
    guard.unlock().expect("unlock");
    let took = waiter.join().expect("waiter") - released;
    eprintln!("the waiter got the lock {took:?} after the release");
    assert!(took < secs(3), "{took:?}");
    // Some calls later (each prunes a bounded chunk), the queue is gone.
    for _ in 0..100 {
        if queued(&srv) == 0 {
            break;
        }
        c.try_lock("k").expect("try_lock").unlock().expect("unlock");
    }
    assert_eq!(queued(&srv), 0, "the expired entries were pruned");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// A release that finds only dead entries in the queue deletes the lock with every key of
/// its hold: the lease record an extend wrote goes with it, as when nobody queued.
#[test]
fn a_release_past_dead_entries_leaves_no_key_of_the_hold() {
    let (srv, c) = test_server_and(client);
    let guard = c.lock("k").expect("lock");
    guard.extend(secs(60)).expect("extend");
    assert!(
        redbaton_testkit::exists(&mut srv.conn(), "redbaton:{k}:lease"),
        "{:?}",
        keys_left(&srv)
    );
    fill_expired(&srv, 3);
    assert!(guard.unlock().expect("unlock").was_held());
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// Child: waits for "k" with a re-check interval of `F_RECHECK_MS` (its queue entry lives
/// twice that unless refreshed), until killed.
#[test]
fn child_short_recheck_waiter() {
    child_only!();
    let recheck = ms(child::env("F_RECHECK_MS").parse().expect("recheck"));
    let c = lock_client!(
        node(child::env("F_URL")),
        lease(secs(30)),
        recheck_interval(recheck)
    );
    let _ = c.try_lock_for("k", secs(60));
}

/// A queue whose waiters all died, on a name nobody calls any more, disappears by itself:
/// every enqueue keeps the queue's keys for the entry's TTL plus a margin.
#[test]
fn an_abandoned_queue_expires() {
    let (srv, holder) = test_server_and(client);
    let _guard = holder.lock("k").expect("lock");
    let mut waiter = child::spawn_self(
        "child_short_recheck_waiter",
        &[("F_URL", srv.url()), ("F_RECHECK_MS", "300".to_owned())],
    );
    wait_for(secs(20), "the waiter to queue", || queued(&srv) == 1);
    // The entry lives 600 ms unless refreshed; the queue, that plus a second at most.
    for key in [QUEUE, QUEUE_EXPIRY] {
        let t = redbaton_testkit::pttl(&mut srv.conn(), key);
        assert!(t > 0 && t <= 1600, "{key}: PTTL {t}");
    }
    child::kill_child(&mut waiter, libc::SIGKILL);
    let _ = waiter.wait();
    wait_for(secs(10), "the abandoned queue to expire", || {
        srv.keys("redbaton:{k}:q*").is_empty()
    });
}

/// A script that fails in Redis (here a queue key of the wrong type) reaches the caller
/// as a Redis error carrying the server's own message, not a generic failure.
#[test]
fn a_failing_queue_script_reports_the_servers_message() {
    let srv = test_server();
    let mut conn = srv.conn();
    redis::cmd("ZADD")
        .arg(QUEUE)
        .arg(1)
        .arg("someone")
        .query::<()>(&mut conn)
        .expect("ZADD");
    redis::cmd("SET")
        .arg(QUEUE_EXPIRY)
        .arg("not a sorted set")
        .query::<()>(&mut conn)
        .expect("SET");
    let e = client(&srv.url()).try_lock("k").unwrap_err();
    let server = e.redis_error().expect("a redis error").to_string();
    assert!(server.contains("WRONGTYPE"), "{server}");
    let source = std::error::Error::source(&e)
        .expect("the source")
        .to_string();
    assert!(source.contains("WRONGTYPE"), "{e}: {source}");
}

/// A release whose grant cannot issue the next holder's fence (the counter is a key of
/// another type) must not fail half-way: a script is not undone, and a lock handed to the
/// queue's head with no fence issued (the head still queued, no grant sent, the release
/// reported failed) would let the head hold it under a fence no counter recorded. The
/// lock is released instead (the release writes its fence back, as a plain release does),
/// and the head takes it with a higher fence.
#[test]
fn a_grant_that_cannot_issue_a_fence_releases_the_lock() {
    let srv = test_server();
    let mut conn = srv.conn();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    let held = a.lock("k").expect("a takes it");
    let waiter = thread::spawn(move || b.try_lock_for("k", secs(20)).map(|g| g.fencing_token()));
    wait_for(secs(10), "b queued", || queued(&srv) == 1);
    let () = redis::cmd("DEL")
        .arg("redbaton:{k}:fence")
        .query(&mut conn)
        .expect("DEL");
    let () = redis::cmd("RPUSH")
        .arg("redbaton:{k}:fence")
        .arg("not a counter")
        .query(&mut conn)
        .expect("RPUSH");
    let fence = held.fencing_token();
    assert_eq!(held.unlock().expect("released"), Unlocked::Released);
    let got = join_all(vec![waiter], "b").remove(0).expect("b gets it");
    assert!(got > fence, "b's token {got} after a's {fence}");
}

/// A fair `try_lock` whose replies all come after the read timeout: its script ran and
/// took the lock, but the caller got an error and will never release it. The attempt's
/// token is released in the background, so another client gets the lock well before the
/// lease (30 s) would have freed it.
#[test]
fn a_try_lock_whose_replies_are_lost_leaves_no_orphan_lock() {
    let srv = test_server();
    let proxy = redbaton_testkit::proxy::Proxy::start(srv.addr());
    let fragile = lock_client!(node(proxy.url()), lease(secs(30)), read_timeout(ms(200)));
    // Scripts loaded, the pool connected.
    fragile
        .try_lock("warm-up")
        .expect("warm-up")
        .unlock()
        .expect("unlock");
    proxy.set_delay(ms(700));
    let e = fragile
        .try_lock("k")
        .expect_err("every reply came too late");
    proxy.set_delay(Duration::ZERO);
    assert!(e.is_connection(), "{e:?}");
    let other = client(&srv.url());
    let asked = Instant::now();
    let g = other
        .try_lock_for("k", secs(8))
        .expect("the lost attempt's lock is released, not left for its whole lease");
    eprintln!("the other client got it after {:?}", asked.elapsed());
    g.unlock().expect("unlock");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// The release that granted the lock to the next process lost its reply: the retry finds
/// the grantee's token in the key. The lock was ours until the call and passed on as it
/// should be, so the outcome says so, not "held by another owner". The retry cannot tell
/// the grant from an expiry and another process's acquisition, so `grants_passed` does not
/// count it (as documented; without the fault it does, see `smoke`).
#[test]
fn a_granting_release_whose_reply_is_lost_reports_released() {
    let srv = test_server();
    let proxy = redbaton_testkit::proxy::Proxy::start(srv.addr());
    let holder = client(&proxy.url());
    holder
        .try_lock("warm-up")
        .expect("warm-up")
        .unlock()
        .expect("unlock");
    let guard = holder.lock("k").expect("lock");
    let url = srv.url();
    let next = thread::spawn(move || {
        let c = client(&url);
        let g = c.try_lock_for("k", secs(20)).expect("granted");
        g.unlock().expect("unlock")
    });
    wait_for(secs(20), "the other client to queue", || queued(&srv) == 1);
    proxy.drop_next_reply_matching(b"EVALSHA");
    let outcome = guard.unlock().expect("unlock");
    assert_eq!(proxy.replies_dropped(), 1, "the fault never fired");
    assert!(next.join().expect("the next holder").was_held());
    assert_eq!(outcome, redbaton::Unlocked::Released);
    assert!(outcome.was_held());
    assert_eq!(
        holder.stats().grants_passed,
        0,
        "a grant whose reply was lost"
    );
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}
