//! How a waiting multi-lock looks to the others, against a real `redis-server`: two
//! multi-locks of one client waiting on one name keep its contention mark while either
//! waits, and the one that wins takes it even if its own attempt never marked, a wait is re-checked when the whole group may be free rather than at the
//! soonest lease among its names, and a name whose fair queue has a live waiter is not
//! taken past it, while a grant from the queue never overlaps a multi-lock. Times are
//! liveness bounds, never speed claims.

use std::thread::{self, JoinHandle};
use std::time::Duration;

use redbaton::{LockClient, Unlocked, Wakeup};
use redbaton_testkit::intervals::{Recorder, most_at_once};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::wait::{join_within, wait_for};
use redbaton_testkit::{exists, lock_client, ms, raw_conn, secs, test_server, test_server_and};

const PREFIX: &str = "mw:";
const KEYS: Keys = Keys::new(PREFIX);
/// Generous bounds: liveness, not speed.
const LIVENESS: Duration = Duration::from_secs(10);

/// The contention mark key of `name` (`p{n}:w`, see the design's key table).
fn mark(name: &str) -> String {
    format!("{}:w", KEYS.lock(name))
}

/// The fair queue of `name` (`p{n}:q`).
fn queue(name: &str) -> String {
    format!("{}:q", KEYS.lock(name))
}

fn client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

fn fair_client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX), fair(true))
}

/// A stranger's hold of `name`: its key holding a foreign token for a minute.
fn stranger_holds(conn: &mut redis::Connection, name: &str) {
    redis::cmd("SET")
        .arg(KEYS.lock(name))
        .arg("stranger")
        .arg("PX")
        .arg(60_000)
        .query::<()>(conn)
        .expect("SET");
}

/// A thread of `c` that waits for the lock `name`, then holds it for `hold`, recorded in
/// `rec` as `"fair"`.
fn queued_holder(
    c: LockClient,
    name: &'static str,
    hold: Duration,
    rec: &Recorder,
) -> JoinHandle<()> {
    let rec = rec.clone();
    thread::spawn(move || {
        let g = c.lock(name).expect("queued lock");
        rec.time("fair", || thread::sleep(hold));
        drop(g);
    })
}

#[test]
fn smoke() {
    let (srv, c) = test_server_and(client);
    let g = c.multi_lock(["s1", "s2"]).expect("multi-lock");
    assert!(exists(&mut srv.conn(), KEYS.lock("s1")));
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    assert!(!exists(&mut srv.conn(), KEYS.lock("s2")));
}

/// Two multi-locks of one client wait on one name held by another client; the one that
/// gives up must not take the other's contention mark with it: the holder's process reads
/// the mark to know that someone waits (its fairness budget).
#[test]
fn a_multi_lock_giving_up_keeps_the_mark_of_one_still_waiting() {
    let (srv, holder) = test_server_and(client);
    let waiters = client(&srv.url());
    let held = holder.lock("shared").expect("lock");
    let patient = {
        let w = waiters.clone();
        thread::spawn(move || {
            let g = w.multi_lock(["shared", "own-1"]).expect("multi-lock");
            g.unlock().expect("unlock")
        })
    };
    let mut conn = srv.conn();
    wait_for(LIVENESS, "the patient multi-lock marks", || {
        exists(&mut conn, mark("shared"))
    });
    let gave_up = waiters.try_multi_lock_for(["shared", "own-2"], ms(300));
    assert!(gave_up.is_err_and(|e| e.is_timeout()));
    assert!(
        exists(&mut conn, mark("shared")),
        "a multi-lock of the client still waits for the name, but its mark is gone"
    );
    drop(held);
    let released = join_within(vec![patient], LIVENESS, "the patient multi-lock");
    assert_eq!(released, [Unlocked::Released]);
    wait_for(LIVENESS, "the last waiter takes its mark with it", || {
        !exists(&mut conn, mark("shared"))
    });
}

/// A multi-lock that begins to wait while another of its client's marks a name counts
/// among the mark's waiters before its first attempt: when that attempt, held up on its
/// way, wins the name after the first gave up (leaving the mark to it), the win must take
/// the mark, which would otherwise tell the holder's process, for its TTL, that someone
/// waits.
#[test]
fn a_multi_lock_winning_at_its_first_attempt_takes_the_mark_left_to_it() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let c = lock_client!(
        node(proxy.url()),
        key_prefix(PREFIX),
        patient(),
        io_timeouts(secs(3))
    );
    // Connections opened before the proxy holds bytes up.
    drop(c.try_multi_lock(["warm-1", "warm-2"]).expect("warm-up"));
    let mut conn = srv.conn();
    stranger_holds(&mut conn, "k");
    let first = {
        let c = c.clone();
        thread::spawn(move || c.try_multi_lock_for(["k"], ms(900)).map(drop))
    };
    wait_for(LIVENESS, "the first multi-lock marks", || {
        exists(&mut conn, mark("k"))
    });
    thread::sleep(ms(200));
    proxy.set_delay_both(ms(1000));
    let second = thread::spawn(move || c.multi_lock(["k"]).expect("multi-lock"));
    let [gave_up] = <[_; 1]>::try_from(join_within(vec![first], LIVENESS, "the first"))
        .unwrap_or_else(|_| unreachable!());
    assert!(gave_up.is_err_and(|e| e.is_timeout()));
    redis::cmd("DEL")
        .arg(KEYS.lock("k"))
        .query::<()>(&mut conn)
        .expect("DEL");
    let held = join_within(vec![second], LIVENESS, "the second");
    proxy.set_delay_both(ms(0));
    assert!(
        !exists(&mut conn, mark("k")),
        "the winner left the mark it shared behind"
    );
    drop(held);
}

/// A group whose names are held with a short lease and a long one cannot be free before
/// the long one ends (or is released, which is heard): waking at the short lease's end
/// (renewed meanwhile) only costs attempts.
#[test]
fn a_group_is_rechecked_when_all_of_it_may_be_free() {
    let srv = test_server();
    let short = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(ms(200)));
    let waiter = client(&srv.url());
    let _short = short.lock("short").expect("lock");
    stranger_holds(&mut srv.conn(), "long");
    // The attempts of a wait of this length for a group that only the long lease blocks.
    let attempts = |names: [&str; 2]| {
        let before = waiter.stats().failed_attempts;
        let waited = waiter.try_multi_lock_for(names, ms(1_500));
        assert!(waited.is_err_and(|e| e.is_timeout()));
        waiter.stats().failed_attempts - before
    };
    let alone = attempts(["free", "long"]);
    let with_short = attempts(["short", "long"]);
    assert!(
        with_short <= alone,
        "{with_short} attempts while the long lease could not end, {alone} with it alone"
    );
}

/// A multi-lock never holds a name while the fair queue's grantee does, and the queued
/// waiter goes first.
#[test]
fn a_fair_grant_and_a_multi_lock_never_overlap() {
    let (srv, holder) = test_server_and(fair_client);
    let (queued, multi) = (fair_client(&srv.url()), fair_client(&srv.url()));
    let held = holder.lock("fq").expect("lock");
    let rec = Recorder::new();
    let fair = queued_holder(queued, "fq", ms(200), &rec);
    let mut conn = srv.conn();
    wait_for(LIVENESS, "the fair waiter queues", || {
        srv.zcard(&queue("fq")) == 1
    });
    let many = {
        let rec = rec.clone();
        thread::spawn(move || {
            let g = multi.multi_lock(["fq", "other"]).expect("multi-lock");
            rec.time("multi", || thread::sleep(ms(50)));
            g.unlock().expect("unlock")
        })
    };
    wait_for(LIVENESS, "the multi-lock waits", || {
        exists(&mut conn, mark("fq"))
    });
    drop(held);
    join_within(vec![fair], LIVENESS, "the fair waiter");
    assert_eq!(
        join_within(vec![many], LIVENESS, "the multi-lock"),
        [Unlocked::Released]
    );
    let intervals = rec.intervals();
    assert_eq!(most_at_once(&intervals), 1, "{intervals:?}");
    let tags: Vec<&str> = intervals.iter().map(|i| i.tag.as_str()).collect();
    assert_eq!(tags, ["fair", "multi"], "the queued waiter first");
}

/// A free name with a live waiter in its fair queue (here one that polls, so it takes the
/// name only at its next attempt) is that waiter's: a multi-lock that took it would pass
/// over a waiter that queued first, again and again.
#[test]
fn a_multi_lock_does_not_pass_a_queued_waiter() {
    let srv = test_server();
    let url = srv.url();
    let poller = lock_client!(
        node(url.clone()),
        key_prefix(PREFIX),
        fair(true),
        wakeup(Wakeup::Polling(ms(700)))
    );
    let multi = client(&url);
    let mut conn = raw_conn(&url);
    stranger_holds(&mut conn, "pq");
    let rec = Recorder::new();
    let queued = queued_holder(poller, "pq", ms(100), &rec);
    wait_for(LIVENESS, "the poller queues", || {
        srv.zcard(&queue("pq")) == 1
    });
    redis::cmd("DEL")
        .arg(KEYS.lock("pq"))
        .query::<()>(&mut conn)
        .expect("DEL");
    let passed = multi.try_multi_lock(["pq", "free"]);
    assert!(
        passed.as_ref().is_err_and(|e| e.is_would_block()),
        "a multi-lock took a name past its queued waiter: {:?}",
        passed.map(|g| g.fencing_tokens().len())
    );
    let g = rec.time("multi-wait", || {
        multi.try_multi_lock_for(["pq", "free"], secs(5))
    });
    let g = g.expect("the multi-lock after the queued waiter");
    join_within(vec![queued], LIVENESS, "the queued waiter");
    let intervals = rec.intervals();
    let fair = intervals.iter().find(|i| i.tag == "fair").expect("fair");
    let waited = intervals
        .iter()
        .find(|i| i.tag == "multi-wait")
        .expect("wait");
    assert!(fair.start < waited.end, "{intervals:?}");
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
}
