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
//!
//! The write and read grants are tested as the fair lock's grants are (`grant.rs`): the
//! bodies of those tests are written once, in `redbaton_testkit::grants`, for all; here is
//! how the write hold and a read hold are taken and waited for ([`Write`], [`Read`]). A
//! read grant that is not the hold must not be believed while a writer holds: the client
//! that takes "k" from its reader takes the write hold.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use redbaton::{Cancel, LockClient, ReadGuard, RwLock, WriteGuard};
use redbaton_testkit::grants::{self, Counts, Got, Hold, Kind, assert_nothing_left};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_within, wait_for, wait_until};
use redbaton_testkit::{grant_counts, lock_client, ms, secs};
use redbaton_testkit::{test_server, test_server_and};

const WRITERS: &str = "redbaton:{k}:ww";
const READERS: &str = "redbaton:{k}:wr";

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
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
}

impl Hold for Held {
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

    fn release(self) {
        match self {
            Held::Read(g) => g.unlock().map(drop),
            Held::Write(g) => g.unlock().map(drop),
        }
        .expect("unlock");
    }
}

/// A thread of `c` waiting (up to 30 s) for the write hold of "k" (a read hold unless
/// `write`); it runs `during` while it holds.
fn waiter(
    c: &LockClient,
    write: bool,
    released: &Arc<AtomicBool>,
    during: impl FnOnce() + Send + 'static,
) -> JoinHandle<Got> {
    let rw = c.rwlock("k");
    grants::waiter(move || Held::take(&rw, write, secs(30)), released, during)
}

/// The write hold of "k", granted on the release of a read hold or of the write hold: the
/// holder takes a read hold or the write hold, the waiter waits for the write hold.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Write {
    AfterRead,
    AfterWrite,
}

impl Kind for Write {
    type Client = LockClient;
    type Held = Held;
    const WAITERS: &str = WRITERS;

    fn hold(self, c: &LockClient) -> Held {
        Held::take(&c.rwlock("k"), self == Write::AfterWrite, secs(5))
    }

    fn wait(self, c: &LockClient, within: Duration, what: &str) -> Held {
        Held::Write(c.rwlock("k").try_write_for(within).expect(what))
    }

    fn asleep(self, srv: &RedisServer, c: &LockClient) {
        asleep(srv, WRITERS, 1, c);
    }

    fn client(url: &str) -> LockClient {
        client(url)
    }

    fn counts(c: &LockClient) -> Counts {
        grant_counts!(c)
    }
}

/// A read hold of "k", granted on the release of the write hold to the reader marked
/// waiting (no writer waits): the holder takes the write hold, the waiter waits for a read
/// hold, and a client that takes "k" while the grant is not the hold takes the write hold.
#[derive(Clone, Copy)]
struct Read;

impl Kind for Read {
    type Client = LockClient;
    type Held = Held;
    const WAITERS: &str = READERS;

    fn hold(self, c: &LockClient) -> Held {
        Held::take(&c.rwlock("k"), true, secs(5))
    }

    fn wait(self, c: &LockClient, within: Duration, what: &str) -> Held {
        Held::Read(c.rwlock("k").try_read_for(within).expect(what))
    }

    fn wait_excluding(self, c: &LockClient, within: Duration, what: &str) -> Held {
        Held::Write(c.rwlock("k").try_write_for(within).expect(what))
    }

    fn asleep(self, srv: &RedisServer, c: &LockClient) {
        asleep(srv, READERS, 1, c);
    }

    fn client(url: &str) -> LockClient {
        client(url)
    }

    fn counts(c: &LockClient) -> Counts {
        grant_counts!(c)
    }
}

#[test]
fn smoke() {
    let srv = test_server();
    let (holder, w) = (client(&srv.url()), client(&srv.url()));
    grants::granted_in_time(Write::AfterRead, &srv, holder, &w, || {});
}

/// The common case, after a read hold and after the write hold: the grant is heard in time
/// and taken as the write hold, with no attempt; the watchdog's first renewal gives it the
/// full lease, so it stays valid past the grant lease.
#[test]
fn a_write_grant_heard_in_time_is_the_write_hold() {
    let srv = test_server();
    for kind in [Write::AfterRead, Write::AfterWrite] {
        let url = srv.url();
        let during = move || {
            grants::wait_renewed(&url);
            thread::sleep(ms(1200)); // past the grant lease
        };
        let (holder, w) = (client(&srv.url()), client(&srv.url()));
        grants::granted_in_time(kind, &srv, holder, &w, during);
    }
}

/// With a short lease (300 ms, so the grant lease is 300 ms too), a write hold taken from
/// a grant stays held across many grant leases: its renewals keep it.
#[test]
fn a_granted_write_hold_with_a_short_lease_is_renewed_in_time() {
    let short = |url: &str| lock_client!(node(url), lease(ms(300)));
    let srv = test_server();
    let (holder, w) = (short(&srv.url()), short(&srv.url()));
    // Ten grant leases: a hold whose first renewal came late would be lost by now.
    let during = || thread::sleep(ms(3000));
    grants::granted_in_time(Write::AfterRead, &srv, holder, &w, during);
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
        got.assert_after(first);
        tokens.push(got.token);
        let s = c.stats();
        assert_eq!(s.grants_received, 1, "{s:?}");
        assert_eq!(s.grants_trusted, 1, "the grant was the read hold: {s:?}");
    }
    assert_eq!(tokens[0], tokens[1], "read holds of one read phase");
    assert_nothing_left(&srv);
}

/// A write grant that reaches its writer after its bound (a proxy delays everything the
/// server sends the writer by 1.5 s; the grant lease is 1 s) is not taken as the hold:
/// another client takes the write hold once the grant expired, and the writer gets it only
/// after that holder lets go.
#[test]
fn a_write_grant_delayed_past_its_bound_is_not_the_hold() {
    grants::delayed_past_its_bound(Write::AfterRead);
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
    grants::stale_grant_only_wakes(Write::AfterRead, &srv, &w);
}

/// Child: waits for the write hold of "k", then reports when it got it, whether its
/// guard's check held, and how many grants it took as the hold.
#[test]
fn child_write_grantee() {
    grants::grantee(Write::AfterWrite);
}

/// A writer stopped (SIGSTOP) across its grant: another client gets the write hold once
/// the grant lease ran out; resumed, the writer does not believe it holds, and gets the
/// write hold only after that holder lets go.
#[test]
fn a_write_grantee_stopped_across_its_grant_does_not_believe_it_holds() {
    grants::stopped_grantee(Write::AfterWrite, "child_write_grantee");
}

/// A write grant's message lost entirely (the writer's connections drop it, then are
/// reset): the writer's next attempt, after its subscriber reconnects, gets the write hold.
#[test]
fn a_lost_write_grant_message_is_recovered_by_the_next_attempt() {
    grants::lost_grant_recovered(Write::AfterRead);
}

/// A read grant heard in time is the read hold, with no attempt; the watchdog's first
/// renewal gives it the full lease, so it stays valid past the grant lease.
#[test]
fn a_read_grant_heard_in_time_is_the_read_hold() {
    let srv = test_server();
    let url = srv.url();
    let during = move || {
        grants::wait_renewed(&url);
        thread::sleep(ms(1200)); // past the grant lease
    };
    let (holder, r) = (client(&srv.url()), client(&srv.url()));
    grants::granted_in_time(Read, &srv, holder, &r, during);
}

/// A read grant that reaches its reader after its bound (a proxy delays everything the
/// server sends the reader by 1.5 s; the grant lease is 1 s) is not taken as the hold: a
/// writer takes the write hold once the grant expired, and the reader reads only after
/// that writer lets go.
#[test]
fn a_read_grant_delayed_past_its_bound_is_not_the_hold() {
    grants::delayed_past_its_bound(Read);
}

/// A read grant with the nonce of one of the reader's earlier attempts, heard after a
/// newer attempt, is only a wake-up: the reader's next attempt finds the write hold still
/// there and waits on.
#[test]
fn a_stale_read_grant_heard_after_a_newer_attempt_is_only_a_wake_up() {
    let srv = test_server();
    // Attempts every 300 ms: the reader's nonce moves on.
    let r: LockClient = lock_client!(node(srv.url()), lease(secs(30)), recheck_interval(ms(300)));
    grants::stale_grant_only_wakes(Read, &srv, &r);
}

/// Child: waits for a read hold of "k", then reports when it got it, whether its guard's
/// check held, and how many grants it took as the hold.
#[test]
fn child_read_grantee() {
    grants::grantee(Read);
}

/// A reader stopped (SIGSTOP) across its grant: a writer gets the write hold once the
/// grant lease ran out; resumed, the reader does not believe it holds, and reads only after
/// that writer lets go.
#[test]
fn a_read_grantee_stopped_across_its_grant_does_not_believe_it_holds() {
    grants::stopped_grantee(Read, "child_read_grantee");
}

/// A read grant's message lost entirely (the reader's connections drop it, then are
/// reset): the reader's next attempt, after its subscriber reconnects, gets the read hold.
#[test]
fn a_lost_read_grant_message_is_recovered_by_the_next_attempt() {
    grants::lost_grant_recovered(Read);
}

/// A waiter of "k" (for the write hold, or a read hold) whose wait the test cancels after
/// a release granted it the hold, before it heard of it: what the server sends it comes
/// through a proxy, which the test makes slow.
struct Leaver {
    proxy: Proxy,
    client: LockClient,
    cancel: Cancel,
    leaving: JoinHandle<redbaton::Result<u64>>,
}

impl Leaver {
    /// Starts its wait behind the holder of "k", and returns once it is marked and asleep.
    fn start(srv: &RedisServer, write: bool) -> Leaver {
        // A waiter that gives up at once loads the script of a leaving waiter on the
        // server: the leave is then one round trip, not three, each delayed by the proxy.
        let warm = client(&srv.url()).rwlock("k");
        let warmed = if write {
            warm.try_write_for(ms(50)).map(drop)
        } else {
            warm.try_read_for(ms(50)).map(drop)
        };
        assert!(warmed.is_err_and(|e| e.is_timeout()));
        let proxy = Proxy::start(srv.addr());
        // Replies come late through the proxy: the calls wait for them.
        let client = lock_client!(node(proxy.url()), lease(secs(30)), io_timeouts(secs(10)));
        let cancel = Cancel::new();
        let leaving = {
            let (rw, cancel) = (client.rwlock("k"), cancel.clone());
            thread::spawn(move || {
                if write {
                    rw.write_cancellable(&cancel).map(|g| g.fencing_token())
                } else {
                    rw.read_cancellable(&cancel).map(|g| g.fencing_token())
                }
            })
        };
        asleep(srv, if write { WRITERS } else { READERS }, 1, &client);
        Leaver {
            proxy,
            client,
            cancel,
            leaving,
        }
    }

    /// Holds back what the server sends it for 1.5 s (the grant lease is 1 s).
    fn deafen(&self) {
        self.proxy.set_delay(ms(1500));
    }

    /// Cancels its wait, once a release granted it the hold unheard, and checks that its
    /// leaving passed the grant on to `next`, whose `waiting` thread got the hold by that
    /// grant, after `first`. Nothing is stranded.
    fn passes_on(self, srv: &RedisServer, next: &LockClient, waiting: JoinHandle<Got>, first: u64) {
        self.cancel.cancel();
        let left = self.leaving.join().expect("leaver");
        assert!(left.as_ref().is_err_and(|e| e.is_cancelled()), "{left:?}");
        let s = self.client.stats();
        assert_eq!(s.grants_passed, 1, "the grant was passed on: {s:?}");
        let got = waiting.join().expect("next");
        got.assert_after(first);
        let s = next.stats();
        assert_eq!(s.grants_received, 1, "granted by the leaver: {s:?}");
        self.proxy.set_delay(Duration::ZERO);
        assert_nothing_left(srv);
    }
}

/// A writer that gives up (here: its wait is cancelled) after the release granted it the
/// write hold, before it heard of it, passes the hold on as it leaves: to the next waiting
/// writer, or, with none, to the waiting reader.
fn a_leaving_writer_passes_its_grant_on(next_writes: bool) {
    let (srv, holder) = test_server_and(client);
    let r = holder.rwlock("k").read().expect("read");
    let first = r.fencing_token();
    let leaver = Leaver::start(&srv, true);
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
    leaver.deafen();
    released.store(true, SeqCst);
    r.unlock().expect("unlock"); // granted to the writer waiting longest: the leaver
    leaver.passes_on(&srv, &next, waiting, first);
}

#[test]
fn a_leaving_writer_passes_its_grant_to_the_next_writer() {
    a_leaving_writer_passes_its_grant_on(true);
}

#[test]
fn a_leaving_writer_passes_its_grant_to_the_waiting_reader() {
    a_leaving_writer_passes_its_grant_on(false);
}

/// A reader that gives up (here: its wait is cancelled) after the release of the write
/// hold granted it a read hold, before it heard of it, gives the hold back as it leaves:
/// the writer that began to wait behind that read hold gets the write hold by a grant from
/// the leaving, not at the end of the grant lease.
#[test]
fn a_leaving_reader_passes_its_grant_to_the_waiting_writer() {
    let (srv, holder) = test_server_and(client);
    let w = holder.rwlock("k").write().expect("write");
    let first = w.fencing_token();
    let leaver = Leaver::start(&srv, false);
    leaver.deafen();
    w.unlock().expect("unlock"); // no writer waits: a read hold granted to the leaver
    assert_eq!(srv.zcard(READERS), 0, "the grant took the reader's mark");
    let next = client(&srv.url());
    let released = Arc::new(AtomicBool::new(true));
    let waiting = waiter(&next, true, &released, || {});
    // Asleep, not only marked: a writer whose attempt after subscribing came after the
    // leaving would take the hold by that attempt, not by the leaver's grant.
    asleep(&srv, WRITERS, 1, &next);
    leaver.passes_on(&srv, &next, waiting, first);
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
        // The next writer holds by the grant, heard; or by an attempt that crossed it: woken
        // by the racer's leave (a writer that leaves says `r`), its attempt reached Redis
        // just after the release had granted it the hold, and found its own member held.
        // Either way nothing was stranded: it woke on a message, not at a lease's end or a
        // re-check.
        let s = next.stats();
        let crossed = s.wakeups_event >= 1 && s.wakeups_lease == 0 && s.wakeups_recheck == 0;
        assert!(s.grants_received == 1 || crossed, "{s:?}");
        assert_nothing_left(&srv);
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
    assert_nothing_left(&srv);
}

/// What the release that grants the write hold sends to Redis, after a read hold and after
/// the write hold: one clock read for the whole script, one write of the fence counter
/// (the grant's fence, not the released hold's first), and no delete of the key that the
/// grant holds again. The waiting writer is a mark with no client behind it, so that the
/// counters see the release alone; its grant's fence follows the released hold's.
#[test]
fn a_write_grant_reads_the_clock_once_and_writes_the_counter_once() {
    let (srv, holder) = test_server_and(client);
    let rw = holder.rwlock("k");
    for write in [false, true] {
        let held = Held::take(&rw, write, secs(5));
        // The counter's part of the token (the low 12 bits number local handoffs).
        let fence_before = held.token() >> 12;
        let member = format!("wmarked-{write}");
        let mut conn = srv.conn();
        // Marked until far in the future, with the nonce of its latest attempt.
        let () = redis::pipe()
            .cmd("ZADD")
            .arg(WRITERS)
            .arg(i64::MAX / 2)
            .arg(&member)
            .ignore()
            .cmd("ZADD")
            .arg("redbaton:{k}:qn")
            .arg(7)
            .arg(&member)
            .ignore()
            .query(&mut conn)
            .expect("mark a waiting writer");
        srv.reset_stats();
        held.release();
        let counts =
            [("time", 1), ("set", 1), ("del", 0)].map(|(c, n)| (c, srv.command_count(c), n));
        for (command, sent, expected) in counts {
            assert_eq!(
                sent, expected,
                "{command}, the write hold released: {write}: {counts:?}"
            );
        }
        let granted: Option<f64> = redis::cmd("ZSCORE")
            .arg("redbaton:{k}")
            .arg(&member)
            .query(&mut conn)
            .expect("ZSCORE");
        assert!(granted.is_some(), "the marked writer holds the write hold");
        let counter: String = redis::cmd("GET")
            .arg("redbaton:{k}:fence")
            .query(&mut conn)
            .expect("the fence counter");
        let fence: u64 = counter
            .strip_prefix('-')
            .and_then(|f| f.parse().ok())
            .unwrap_or_else(|| panic!("held by the grant: {counter}"));
        assert!(
            fence > fence_before,
            "the grant's fence {fence} <= {fence_before}"
        );
        // The grant's holder never comes: take its hold out for the next round.
        let () = redis::cmd("DEL")
            .arg("redbaton:{k}")
            .query(&mut conn)
            .expect("DEL");
    }
}

/// A writer granted the write hold on a clean release of the write hold is told nothing
/// was lost, and holds a fence above the released one.
#[test]
fn a_write_grant_after_a_released_write_hold_tells_of_no_loss() {
    let (srv, holder) = test_server_and(client);
    let g = holder.rwlock("k").write().expect("write");
    let token = g.fencing_token();
    let c = client(&srv.url());
    let rw = c.rwlock("k");
    let writer = thread::spawn(move || {
        let w = rw.try_write_for(secs(30)).expect("granted");
        (w.fencing_token(), w.previous_lost())
    });
    asleep(&srv, WRITERS, 1, &c);
    g.unlock().expect("unlock");
    let (fence, lost) = join_within(vec![writer], secs(30), "the writer").remove(0);
    assert!(fence > token, "{fence} <= {token}");
    assert!(!lost, "the write hold before was released");
    let s = c.stats();
    assert_eq!(s.grants_trusted, 1, "taken from the grant: {s:?}");
}

/// A write hold taken by an attempt nobody used (its reply lost and its retry refused, so
/// the library gives it back in the background) after a write hold that ended without a
/// release: the writer granted the lock by that give-back is told of the loss, as the
/// unused attempt was (the hold given back changed nothing).
#[test]
fn a_write_grant_on_the_give_back_of_an_unused_attempt_tells_of_the_loss_before_it() {
    let (srv, holder) = test_server_and(client);
    let gone = holder.rwlock("k").write().expect("write");
    let () = redis::cmd("DEL")
        .arg("redbaton:{k}")
        .query(&mut srv.conn())
        .expect("the write hold ends without a release");
    let proxy = Proxy::start(srv.addr());
    let port = proxy.port();
    let late = Arc::new(lock_client!(
        node(proxy.url()),
        lease(secs(30)),
        pool_size(1),
        io_timeouts(secs(5))
    ));
    // Scripts loaded and a pooled connection idle, so that the attempt below is sent at once.
    drop(late.rwlock("warm").write().expect("warm-up"));
    // Replies held back: the attempt takes the write hold, its reply waits in the proxy.
    proxy.set_delay(secs(60));
    let taker = {
        let late = Arc::clone(&late);
        thread::spawn(move || late.rwlock("k").try_write().map(drop))
    };
    wait_for(secs(10), "the attempt runs in redis", || {
        srv.zcard("redbaton:{k}") > 0
    });
    let c = client(&srv.url());
    let rw = c.rwlock("k");
    let writer = thread::spawn(move || {
        let w = rw.try_write_for(secs(30)).expect("granted");
        w.previous_lost()
    });
    asleep(&srv, WRITERS, 1, &c);
    // The listener goes first, then the connections: the reply is lost, and the retry's
    // connection is refused; once the address answers again the hold is given back.
    drop(proxy);
    let e = taker
        .join()
        .expect("taker")
        .expect_err("the reply was lost");
    let _back = Proxy::start_at(port, srv.addr());
    let lost = join_within(vec![writer], secs(30), "the writer").remove(0);
    assert!(
        lost,
        "granted on the give-back of {e:?}: told nothing was lost before"
    );
    drop(gone);
}
