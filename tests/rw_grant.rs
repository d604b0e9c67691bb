//! The read-write lock's grants, and the waiting writer's mark heard by the processes that
//! read. The release of the last hold grants the write hold to the writer waiting longest,
//! or, when no writer waits, read holds to every reader marked waiting. A grant that
//! carries the nonce of the waiter's latest attempt, heard before that attempt's send plus
//! the grant lease, is the hold with no round trip; any other grant, or one heard after
//! that bound, only wakes the waiter, whose next attempt confirms it. A writer that starts
//! to wait says so on the name's channel, and a process holding a read hold for its own
//! threads gives it back at once instead of at its next budget check.
//!
//! Real `redis-server`, the fault-injecting proxy, and real child processes where a
//! process is stopped; two clients of this process act as two processes (each has its own
//! client id and subscriber). No assertion on how long anything took: each test checks who
//! held what when (fencing tokens in order, a flag set before a release, the clients'
//! counters), with generous liveness bounds only.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use redbaton::{Cancel, LockClient, ReadGuard, RwLock, WriteGuard};
use redbaton_testkit::child_only;
use redbaton_testkit::clock::mono_ns;
use redbaton_testkit::lock_client;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_within, wait_for, wait_until};
use redbaton_testkit::{child, ms, secs};
use redbaton_testkit::{test_server, test_server_and};

const LOCK: &str = "redbaton:{k}";
const WRITERS: &str = "redbaton:{k}:ww";
const READERS: &str = "redbaton:{k}:wr";
const NONCES: &str = "redbaton:{k}:qn";
const CHANNEL: &str = "redbaton:{k}:ev";

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
}

fn keys_left(srv: &RedisServer) -> Vec<String> {
    srv.keys_but_fences("redbaton:*")
}

/// The waiting members and the nonce each one's latest attempt stored.
fn nonces(srv: &RedisServer) -> Vec<(String, u64)> {
    redis::cmd("ZRANGE")
        .arg(NONCES)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut srv.conn())
        .expect("ZRANGE")
}

/// Connections subscribed to a channel: one per client (or process) that waits or reads.
fn subscribed(srv: &RedisServer) -> usize {
    let some = |n: Option<&String>| n.is_some_and(|n| n != "0");
    srv.client_list()
        .iter()
        .filter(|c| some(c.get("sub")) || some(c.get("ssub")))
        .count()
}

/// Waits until `set` marks `n` waiters and the waiter of `c` sleeps: it failed its first
/// attempt and the one after its subscription was confirmed, and the reply to the second
/// was read.
fn asleep(srv: &RedisServer, set: &str, n: usize, c: &LockClient) {
    wait_for(secs(20), "the waiters marked", || srv.zcard(set) >= n);
    wait_for(secs(20), "the waiter's attempt after subscribing", || {
        c.stats().failed_attempts >= 2
    });
    thread::sleep(ms(200));
}

/// A hold of "k", read or write.
enum Held {
    Read(ReadGuard),
    Write(WriteGuard),
}

impl Held {
    /// The write hold of `rw` if `write`, else a read hold, waiting up to `within`.
    fn take(rw: &RwLock, write: bool, within: Duration) -> Held {
        if write {
            Held::Write(rw.try_write_for(within).expect("the write hold"))
        } else {
            Held::Read(rw.try_read_for(within).expect("a read hold"))
        }
    }

    fn token(&self) -> u64 {
        match self {
            Held::Read(g) => g.fencing_token(),
            Held::Write(g) => g.fencing_token(),
        }
    }

    fn valid(&self) -> bool {
        match self {
            Held::Read(g) => g.check().is_ok(),
            Held::Write(g) => g.check().is_ok(),
        }
    }

    fn unlock(self) {
        match self {
            Held::Read(g) => g.unlock().map(drop),
            Held::Write(g) => g.unlock().map(drop),
        }
        .expect("unlock");
    }
}

/// What a waiter got: whether the flag its test sets before letting it in was set when it
/// got the hold, its fencing token, and its guard's check (after what it did with it).
#[derive(Debug)]
struct Got {
    after: bool,
    token: u64,
    valid: bool,
}

/// A thread of `c` waiting (up to 30 s) for the write hold of "k" (a read hold unless
/// `write`); it runs `during` while it holds.
fn waiter(
    c: &LockClient,
    write: bool,
    released: &Arc<AtomicBool>,
    during: impl FnOnce() + Send + 'static,
) -> JoinHandle<Got> {
    let (rw, released) = (c.rwlock("k"), released.clone());
    thread::spawn(move || {
        let held = Held::take(&rw, write, secs(30));
        let after = released.load(SeqCst);
        during();
        let got = Got {
            after,
            token: held.token(),
            valid: held.valid(),
        };
        held.unlock();
        got
    })
}

/// "k" held by a client, and a writer of another waiting behind it, asleep.
struct Behind {
    /// The holder's client, kept as long as its hold.
    _holder: LockClient,
    held: Held,
    /// Set by the test once the writer may get the hold.
    released: Arc<AtomicBool>,
    waiting: JoinHandle<Got>,
}

/// `holder` holds "k" (the write hold if `holder_writes`, else a read hold), and a writer
/// of `w` waits behind it, asleep; it runs `during` once it holds.
fn writer_behind(
    srv: &RedisServer,
    holder: LockClient,
    holder_writes: bool,
    w: &LockClient,
    during: impl FnOnce() + Send + 'static,
) -> Behind {
    let held = Held::take(&holder.rwlock("k"), holder_writes, secs(5));
    let released = Arc::new(AtomicBool::new(false));
    let waiting = waiter(w, true, &released, during);
    asleep(srv, WRITERS, 1, w);
    Behind {
        _holder: holder,
        held,
        released,
        waiting,
    }
}

/// [`writer_behind`] a read hold, with the writer's client connected through a proxy.
fn writer_through_proxy(srv: &RedisServer) -> (Proxy, LockClient, Behind) {
    let proxy = Proxy::start(srv.addr());
    let w = client(&proxy.url());
    let behind = writer_behind(srv, client(&srv.url()), false, &w, || {});
    (proxy, w, behind)
}

impl Behind {
    /// The holder lets go, with `between` run after its release: the writer then holds
    /// the write hold after the holder, validly, with a later fencing token.
    fn hand_over(self, between: impl FnOnce()) {
        self.released.store(true, SeqCst);
        let first = self.held.token();
        self.held.unlock();
        between();
        let got = self.waiting.join().expect("writer");
        assert!(got.after && got.valid, "{got:?}");
        assert!(got.token > first, "{} <= {first}", got.token);
    }
}

/// The grant's lease is 1 s, and the key it makes lives twice that: a key that lives longer
/// shows that the write hold taken from the grant was renewed with the full lease.
fn wait_renewed(url: &str) {
    let mut conn = redbaton_testkit::raw_conn(url);
    wait_for(secs(20), "the first renewal", || {
        redbaton_testkit::pttl(&mut conn, LOCK) > 5_000
    });
}

/// A writer of `w` waits behind `holder` (see [`writer_behind`]) and is handed the write
/// hold by a grant, heard in time and taken as the hold; it runs `during` with it, and
/// loses nothing. Nothing is left behind.
fn granted_in_time(
    srv: &RedisServer,
    holder: LockClient,
    holder_writes: bool,
    w: &LockClient,
    during: impl FnOnce() + Send + 'static,
) {
    writer_behind(srv, holder, holder_writes, w, during).hand_over(|| {});
    let s = w.stats();
    assert_eq!(s.grants_received, 1, "{s:?}");
    assert_eq!(s.grants_trusted, 1, "the grant was the write hold: {s:?}");
    assert_eq!(s.locks_lost, 0, "{s:?}");
    assert!(keys_left(srv).is_empty(), "{:?}", keys_left(srv));
}

#[test]
fn smoke() {
    let srv = test_server();
    granted_in_time(&srv, client(&srv.url()), false, &client(&srv.url()), || {});
}

/// The common case, after a read hold and after the write hold: the grant is heard in time
/// and taken as the write hold, with no attempt; the watchdog's first renewal gives it the
/// full lease, so it stays valid past the grant lease.
#[test]
fn a_write_grant_heard_in_time_is_the_write_hold() {
    let srv = test_server();
    for holder_writes in [false, true] {
        let url = srv.url();
        let during = move || {
            wait_renewed(&url);
            thread::sleep(ms(1200)); // past the grant lease
        };
        granted_in_time(
            &srv,
            client(&srv.url()),
            holder_writes,
            &client(&srv.url()),
            during,
        );
    }
}

/// With a short lease (300 ms, so the grant lease is 300 ms too), a write hold taken from
/// a grant stays held across many grant leases: its renewals keep it.
#[test]
fn a_granted_write_hold_with_a_short_lease_is_renewed_in_time() {
    let short = |url: &str| lock_client!(node(url), lease(ms(300)));
    let srv = test_server();
    // Ten grant leases: a hold whose first renewal came late would be lost by now.
    let during = || thread::sleep(ms(3000));
    granted_in_time(&srv, short(&srv.url()), false, &short(&srv.url()), during);
}

/// No writer waits: the release of the write hold grants a read hold to each reader
/// marked waiting (two processes), each taken from its grant, and both read at once.
#[test]
fn read_grants_go_to_every_marked_reader() {
    let (srv, holder) = test_server_and(client);
    let g = holder.rwlock("k").write().expect("write");
    let first = g.fencing_token();
    let released = Arc::new(AtomicBool::new(false));
    let holding = Arc::new(AtomicUsize::new(0));
    let readers: Vec<(LockClient, JoinHandle<Got>)> = (1..=2)
        .map(|n| {
            let c = client(&srv.url());
            let holding = holding.clone();
            let reading = waiter(&c, false, &released, move || {
                holding.fetch_add(1, SeqCst);
                wait_for(secs(20), "both readers holding at once", || {
                    holding.load(SeqCst) == 2
                });
            });
            asleep(&srv, READERS, n, &c);
            (c, reading)
        })
        .collect();
    released.store(true, SeqCst);
    g.unlock().expect("unlock");
    let mut tokens = Vec::new();
    for (c, reading) in readers {
        let got = reading.join().expect("reader");
        assert!(got.after && got.valid, "{got:?}");
        assert!(got.token > first, "{} <= {first}", got.token);
        tokens.push(got.token);
        let s = c.stats();
        assert_eq!(s.grants_received, 1, "{s:?}");
        assert_eq!(s.grants_trusted, 1, "the grant was the read hold: {s:?}");
    }
    assert_eq!(tokens[0], tokens[1], "read holds of one read phase");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// A write grant that reaches its writer after its bound (a proxy delays everything the
/// server sends the writer by 1.5 s; the grant lease is 1 s) is not taken as the hold:
/// another client takes the write hold once the grant expired, and the writer gets it only
/// after that holder lets go.
#[test]
fn a_write_grant_delayed_past_its_bound_is_not_the_hold() {
    let srv = test_server();
    let (proxy, w, behind) = writer_through_proxy(&srv);
    proxy.set_delay(ms(1500));
    behind.held.unlock(); // granted to the writer, with a 1 s lease
    thread::sleep(ms(1200));
    let other = client(&srv.url());
    let taken = other
        .rwlock("k")
        .try_write_for(secs(5))
        .expect("the expired grant's hold is free");
    thread::sleep(ms(1000)); // the grant reaches the writer meanwhile
    proxy.set_delay(Duration::ZERO);
    behind.released.store(true, SeqCst);
    let token = taken.fencing_token();
    taken.unlock().expect("unlock");
    let got = behind.waiting.join().expect("writer");
    assert!(
        got.after,
        "the late grantee took the write hold while another held it"
    );
    assert!(got.token > token, "{} <= {token}", got.token);
    assert!(got.valid);
    assert!(w.stats().grants_received >= 1, "{:?}", w.stats());
}

/// A grant with the nonce of one of the writer's earlier attempts, heard after a newer
/// attempt, is only a wake-up: the writer's next attempt finds the read hold still there
/// and waits on. (The message is published here as a grant that came late would be: to
/// the writer's member, with an older nonce of its own.)
#[test]
fn a_stale_write_grant_heard_after_a_newer_attempt_is_only_a_wake_up() {
    let srv = test_server();
    // Attempts every 300 ms: the writer's nonce moves on.
    let w: LockClient = lock_client!(node(srv.url()), lease(secs(30)), recheck_interval(ms(300)));
    let behind = writer_behind(&srv, client(&srv.url()), false, &w, || {});
    let waiting = nonces(&srv);
    let [(member, old)] = &waiting[..] else {
        panic!("one waiting nonce: {waiting:?}");
    };
    let old = *old;
    wait_for(secs(20), "a newer attempt", || {
        nonces(&srv).first().is_some_and(|(_, n)| *n > old)
    });
    let stale = format!("g{member}:{old}:999:1000");
    let mut conn = srv.conn();
    for publish in ["SPUBLISH", "PUBLISH"] {
        let _: redis::RedisResult<u64> = redis::cmd(publish)
            .arg(CHANNEL)
            .arg(&stale)
            .query(&mut conn);
    }
    wait_for(secs(20), "the stale grant heard", || {
        w.stats().grants_received == 1
    });
    thread::sleep(ms(300)); // its confirming attempt is answered
    assert!(behind.held.valid(), "the reader still holds");
    assert!(
        !behind.waiting.is_finished(),
        "a stale grant was taken as the write hold"
    );
    assert_eq!(w.stats().grants_trusted, 0, "{:?}", w.stats());
    behind.hand_over(|| {});
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// Child: waits for the write hold of "k", then reports when it got it, whether its
/// guard's check held, and how many grants it took as the hold.
#[test]
fn child_write_grantee() {
    child_only!();
    let c = client(&child::env("G_URL"));
    println!("waiting");
    let g = c.rwlock("k").try_write_for(secs(30)).expect("child: write");
    let got = mono_ns();
    let s = c.stats();
    child::print_result(&[
        ("got_ns", got.to_string()),
        ("valid", u8::from(g.check().is_ok()).to_string()),
        ("received", s.grants_received.to_string()),
        ("trusted", s.grants_trusted.to_string()),
    ]);
    g.unlock().expect("child: unlock");
}

/// A writer stopped (SIGSTOP) across its grant: another client gets the write hold once
/// the grant lease ran out; resumed, the writer does not believe it holds, and gets the
/// write hold only after that holder lets go.
#[test]
fn a_write_grantee_stopped_across_its_grant_does_not_believe_it_holds() {
    let (srv, holder) = test_server_and(client);
    let w = holder.rwlock("k").write().expect("write");
    let before = subscribed(&srv);
    let mut grantee = child::spawn_self("child_write_grantee", &[("G_URL", srv.url())]);
    child::wait_for_line(&mut grantee, "waiting", secs(20));
    wait_for(secs(20), "the writer marked", || srv.zcard(WRITERS) == 1);
    wait_for(secs(20), "the writer's subscription", || {
        subscribed(&srv) > before
    });
    thread::sleep(ms(200)); // its attempt after subscribing is answered: it sleeps
    child::stopped_across_grant(
        grantee,
        || {
            w.unlock().expect("unlock"); // granted to the stopped writer
        },
        || {
            let taken = client(&srv.url())
                .rwlock("k")
                .try_write_for(secs(20))
                .expect("the others get the write hold after the grant lease");
            Box::new(move || {
                assert!(taken.check().is_ok());
                taken.unlock().expect("unlock");
            })
        },
    );
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// A write grant's message lost entirely (the writer's connections drop it, then are
/// reset): the writer's next attempt, after its subscriber reconnects, gets the write hold.
#[test]
fn a_lost_write_grant_message_is_recovered_by_the_next_attempt() {
    let srv = test_server();
    let (proxy, w, behind) = writer_through_proxy(&srv);
    proxy.blackhole(true);
    // The grant message is dropped on its way.
    behind.hand_over(|| {
        proxy.blackhole(false);
        proxy.kill_all();
    });
    let s = w.stats();
    assert_eq!(s.grants_received, 0, "the grant message was lost: {s:?}");
    assert_eq!(s.grants_trusted, 0, "{s:?}");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// A writer that gives up (here: its wait is cancelled) after the release granted it the
/// write hold, before it heard of it (a proxy delays what the server sends it), passes the
/// hold on as it leaves: to the next waiting writer, or, with none, to the waiting reader.
/// Nothing is stranded.
fn a_leaving_writer_passes_its_grant_on(next_writes: bool) {
    let (srv, holder) = test_server_and(client);
    let r = holder.rwlock("k").read().expect("read");
    let first = r.fencing_token();
    // A writer that gives up at once loads the script of a leaving waiter on the server:
    // the leaver's leave is then one round trip, not three, each delayed by the proxy.
    let warm = client(&srv.url()).rwlock("k").try_write_for(ms(50));
    assert!(warm.is_err_and(|e| e.is_timeout()));
    let proxy = Proxy::start(srv.addr());
    // Replies come late through the proxy: the calls wait for them.
    let leaver = lock_client!(node(proxy.url()), lease(secs(30)), io_timeouts(secs(10)));
    let cancel = Cancel::new();
    let leaving = {
        let (rw, cancel) = (leaver.rwlock("k"), cancel.clone());
        thread::spawn(move || rw.write_cancellable(&cancel).map(|g| g.fencing_token()))
    };
    asleep(&srv, WRITERS, 1, &leaver);
    let next = client(&srv.url());
    let released = Arc::new(AtomicBool::new(false));
    let waiting = waiter(&next, next_writes, &released, || {});
    // A reader waits too: the leaver's mark holds new read holds back.
    let (set, marks) = if next_writes {
        (WRITERS, 2)
    } else {
        (READERS, 1)
    };
    asleep(&srv, set, marks, &next);
    proxy.set_delay(ms(1500));
    released.store(true, SeqCst);
    r.unlock().expect("unlock"); // granted to the writer waiting longest: the leaver
    cancel.cancel();
    let left = leaving.join().expect("leaver");
    assert!(left.as_ref().is_err_and(|e| e.is_cancelled()), "{left:?}");
    let s = leaver.stats();
    assert_eq!(s.grants_passed, 1, "the grant was passed on: {s:?}");
    let got = waiting.join().expect("next");
    assert!(got.after && got.valid, "{got:?}");
    assert!(got.token > first, "{} <= {first}", got.token);
    let s = next.stats();
    assert_eq!(s.grants_received, 1, "granted by the leaver: {s:?}");
    proxy.set_delay(Duration::ZERO);
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

#[test]
fn a_leaving_writer_passes_its_grant_to_the_next_writer() {
    a_leaving_writer_passes_its_grant_on(true);
}

#[test]
fn a_leaving_writer_passes_its_grant_to_the_waiting_reader() {
    a_leaving_writer_passes_its_grant_on(false);
}

/// A writer whose deadline comes as the write hold is granted to it: it either takes the
/// grant or passes it on; the next waiting writer gets the write hold by a grant either
/// way, and nothing is left behind.
#[test]
fn a_writer_timing_out_as_it_is_granted_passes_the_hold_on() {
    let (srv, holder) = test_server_and(client);
    for offset_ms in [-20i64, -5, 0, 5, 20] {
        let r = holder.rwlock("k").read().expect("read");
        let racer = client(&srv.url());
        let deadline = Instant::now() + ms(1500);
        let racing = {
            let rw = racer.rwlock("k");
            thread::spawn(move || rw.try_write_until(deadline).map(|g| g.fencing_token()))
        };
        asleep(&srv, WRITERS, 1, &racer);
        let next = client(&srv.url());
        let released = Arc::new(AtomicBool::new(false));
        let waiting = waiter(&next, true, &released, || {});
        asleep(&srv, WRITERS, 2, &next);
        let at = if offset_ms < 0 {
            deadline - ms(offset_ms.unsigned_abs())
        } else {
            deadline + ms(offset_ms.unsigned_abs())
        };
        thread::sleep(at.saturating_duration_since(Instant::now()));
        released.store(true, SeqCst);
        r.unlock().expect("unlock");
        let raced = racing.join().expect("racer");
        let got = waiting.join().expect("next");
        eprintln!(
            "offset {offset_ms} ms: racer {raced:?}, passed {}",
            racer.stats().grants_passed
        );
        match raced {
            Ok(token) => assert!(got.token > token, "{} <= {token}", got.token),
            Err(e) => assert!(e.is_timeout(), "{e:?}"),
        }
        assert!(got.after && got.valid, "{got:?}");
        let s = next.stats();
        assert_eq!(s.grants_received, 1, "{s:?}");
        assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
    }
}

/// A process whose threads keep its read hold busy (a minute's budget: no budget check
/// would end it before) gives it back as soon as it hears that another process's writer
/// waits: the writer gets the write hold long before the minute is over, and the process's
/// readers wait while it writes.
#[test]
fn a_read_holding_process_gives_its_hold_back_when_a_writer_starts_to_wait() {
    let srv = test_server();
    let a = lock_client!(node(srv.url()), lease(secs(30)), handoff_slice(secs(60)));
    let reads = Arc::new(AtomicU64::new(0));
    let writing = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let rw = a.rwlock("k");
            let (reads, writing, stop) = (reads.clone(), writing.clone(), stop.clone());
            thread::spawn(move || {
                while !stop.load(SeqCst) {
                    let g = rw.read().expect("read");
                    assert!(!writing.load(SeqCst), "a read while the writer wrote");
                    let n = reads.fetch_add(1, SeqCst) + 1;
                    thread::sleep(ms(2));
                    // Held until a newer read began, so that the process's hold is never
                    // idle (an idle hold goes back at once); at most 50 ms, for when no
                    // newer read may begin.
                    wait_until(ms(50), || reads.load(SeqCst) > n);
                    assert!(g.check().is_ok());
                    drop(g);
                }
            })
        })
        .collect();
    wait_for(secs(20), "the readers reading", || reads.load(SeqCst) > 100);
    let b = client(&srv.url());
    let w = b
        .rwlock("k")
        .try_write_for(secs(20))
        .expect("the write hold, long before the readers' budget ends");
    writing.store(true, SeqCst);
    let during = reads.load(SeqCst);
    thread::sleep(ms(300));
    assert_eq!(reads.load(SeqCst), during, "the readers waited");
    assert!(w.check().is_ok());
    writing.store(false, SeqCst);
    w.unlock().expect("unlock");
    wait_for(secs(20), "the readers reading again", || {
        reads.load(SeqCst) > during
    });
    stop.store(true, SeqCst);
    join_within(readers, secs(30), "readers");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}
