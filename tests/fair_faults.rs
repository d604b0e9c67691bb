//! The fair queue under faults of its keys, of the server and of its clock: waiters take
//! turns in the order they came even when the clock stepped back since an earlier one
//! queued; entries that lost their expiry (their `:qx` member evicted or deleted) never
//! hold the lock back; a waiter whose ACL refuses the library's channels, so that it cannot
//! hear its grant, still takes its turn; a restart with waiters queued loses none of them;
//! `inspect` sees a live waiter however many dead entries came before it; and the head
//! leaving a free lock lets the next waiter or a multi-lock behind it have it. Real
//! `redis-server`; a server's clock step is simulated by the score it would have written.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

use redbaton::{Cancel, LockClient, LockGuard, Wakeup};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_all, wait_for};
use redbaton_testkit::{lock_client, ms, secs, test_server, test_server_and};

const QUEUE: &str = "redbaton:{k}:q";
const QUEUE_EXPIRY: &str = "redbaton:{k}:qx";

/// Waiters woken only by messages: their re-checks and lease hints come after the tests.
fn client(url: &str) -> LockClient {
    lock_client!(node(url), patient())
}

/// The server's clock, in µs: the unit of a queue entry's arrival.
fn server_now_us(srv: &RedisServer) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query(&mut srv.conn()).expect("TIME");
    s * 1_000_000 + us
}

/// Who held "k", in the order they took it; and whether someone holds it now, so that a
/// waiter taking it while another holds it fails.
#[derive(Default)]
struct Turns {
    order: Mutex<Vec<&'static str>>,
    busy: AtomicBool,
}

impl Turns {
    fn order(&self) -> Vec<&'static str> {
        self.order.lock().unwrap().clone()
    }
}

/// A thread of a client of its own that waits for "k", notes `who` in `turns` once it has
/// it, holds it a moment and lets it go.
fn waiter(url: &str, who: &'static str, turns: &Arc<Turns>) -> thread::JoinHandle<()> {
    let (url, turns) = (url.to_owned(), turns.clone());
    thread::spawn(move || {
        let c = client(&url);
        let g = c.try_lock_for("k", secs(20)).expect("the waiter's turn");
        assert!(
            !turns.busy.swap(true, Ordering::SeqCst),
            "{who}: held by two"
        );
        turns.order.lock().unwrap().push(who);
        thread::sleep(ms(20));
        turns.busy.store(false, Ordering::SeqCst);
        g.unlock().expect("unlock");
    })
}

/// `holder` takes "k" and a [`waiter`] named `who`, of `url`, queues behind it: the guard
/// and the waiter, once it is in the queue.
fn held_with_one_queued(
    (srv, url): (&RedisServer, &str),
    holder: &LockClient,
    who: &'static str,
    turns: &Arc<Turns>,
) -> (LockGuard, thread::JoinHandle<()>) {
    let guard = holder.lock("k").expect("lock");
    let w = waiter(url, who, turns);
    wait_for(secs(20), "the waiter to queue", || srv.zcard(QUEUE) == 1);
    (guard, w)
}

/// A second [`waiter`] named `who` queues behind the first: returned once both are in the
/// queue and asleep.
fn second_queued(
    srv: &RedisServer,
    who: &'static str,
    turns: &Arc<Turns>,
) -> thread::JoinHandle<()> {
    let w = waiter(&srv.url(), who, turns);
    wait_for(secs(20), "the second waiter to queue", || {
        srv.zcard(QUEUE) == 2
    });
    thread::sleep(ms(200)); // both asleep, subscribed
    w
}

/// `guard` is let go with `waiters` queued behind it: they take "k" in the order `expected`.
fn released_in_turns(
    guard: LockGuard,
    waiters: Vec<thread::JoinHandle<()>>,
    turns: &Turns,
    expected: &[&str],
) {
    guard.unlock().expect("unlock: granted to the first queued");
    join_all(waiters, "waiter");
    assert_eq!(turns.order(), expected, "turns in queue order");
}

#[test]
fn smoke() {
    let (srv, holder) = test_server_and(client);
    let turns = Arc::new(Turns::default());
    let (guard, w) = held_with_one_queued((&srv, &srv.url()), &holder, "w", &turns);
    guard.unlock().expect("unlock");
    join_all(vec![w], "waiter");
    assert_eq!(turns.order(), ["w"]);
    assert_eq!(holder.stats().grants_passed, 1);
}

/// The server's clock stepped back an hour after a waiter queued (its arrival, written
/// then, is an hour ahead of the clock now). A waiter that queues after it still comes
/// after it: arrival order is the order of the queue, not of the clock's readings.
#[test]
fn a_server_clock_stepped_back_does_not_let_a_later_waiter_ahead() {
    let (srv, holder) = test_server_and(client);
    let turns = Arc::new(Turns::default());
    let (guard, first) = held_with_one_queued((&srv, &srv.url()), &holder, "first", &turns);
    let token: Vec<String> = redis::cmd("ZRANGE")
        .arg(QUEUE)
        .arg(0)
        .arg(0)
        .query(&mut srv.conn())
        .expect("ZRANGE");
    let ahead = server_now_us(&srv) + 3_600_000_000;
    let () = redis::cmd("ZADD")
        .arg(QUEUE)
        .arg("XX")
        .arg(ahead)
        .arg(&token[0])
        .query(&mut srv.conn())
        .expect("ZADD");
    let second = second_queued(&srv, "second", &turns);
    released_in_turns(guard, vec![first, second], &turns, &["first", "second"]);
}

/// Entries of the queue whose expiry is gone (their `:qx` member evicted under memory
/// pressure, or deleted) can never be pruned, and are dead: the lock is never granted to
/// them. A client locks the name at once, and the entries are gone after.
#[test]
fn queue_entries_without_an_expiry_do_not_hold_the_lock_back() {
    let (srv, c) = test_server_and(client);
    let mut add = redis::cmd("ZADD");
    add.arg(QUEUE);
    for i in 0..20u64 {
        add.arg(i + 1).arg(format!("ghost-{i:02}"));
    }
    let () = add.query(&mut srv.conn()).expect("ZADD");
    let g = c
        .try_lock_for("k", secs(8))
        .expect("the lock, not granted to entries nobody refreshes");
    g.unlock().expect("unlock");
    assert_eq!(srv.zcard(QUEUE), 0, "the dead entries were dropped");
    assert!(srv.keys_but_fences("redbaton:*").is_empty());
}

/// A live waiter that queued after 1,000 dead entries (crashed waiters not yet pruned) is
/// still seen: the name is waited for, and `locks()` lists it.
#[test]
fn inspect_sees_a_live_waiter_behind_a_thousand_dead_entries() {
    let srv = test_server();
    let c = client(&srv.url());
    let mut p = redis::pipe();
    for i in 0..1000u64 {
        let t = format!("dead-{i:04}");
        p.cmd("ZADD").arg(QUEUE).arg(i + 1).arg(&t).ignore();
        p.cmd("ZADD").arg(QUEUE_EXPIRY).arg(1).arg(&t).ignore();
    }
    p.cmd("ZADD").arg(QUEUE).arg(5000).arg("live").ignore();
    p.cmd("ZADD")
        .arg(QUEUE_EXPIRY)
        .arg(9e15)
        .arg("live")
        .ignore();
    let () = p.query(&mut srv.conn()).expect("pipeline");
    let info = c.inspect("k").expect("inspect");
    let live = info.queue.iter().filter(|e| e.expires_in.is_some()).count();
    assert_eq!(live, 1, "the live entry is listed, of {}", info.queue.len());
    assert!(info.is_waited_for(), "a live waiter is queued");
    let listed: Vec<Vec<u8>> = c.locks("*").map(|i| i.expect("item").name).collect();
    assert_eq!(listed, vec![b"k".to_vec()], "the waited-for name is listed");
}

/// A waiter whose ACL user may subscribe to keyspace channels but not to the library's
/// cannot hear the grant made to it. It still takes its turn: the grant's `set` of the key
/// wakes it, and its attempt finds its own token before the grant's short lease ends; the
/// waiter that queued after it does not go first.
#[test]
fn a_waiter_that_cannot_hear_its_grant_still_takes_its_turn() {
    let srv = RedisServer::builder()
        .acl_user("deaf", "pw", "~* +@all resetchannels &__keyspace@*")
        .start();
    let holder = client(&srv.url());
    let turns = Arc::new(Turns::default());
    let deaf_url = srv.url_as("deaf", "pw");
    let (guard, deaf) = held_with_one_queued((&srv, &deaf_url), &holder, "deaf", &turns);
    let other = second_queued(&srv, "other", &turns);
    released_in_turns(guard, vec![deaf, other], &turns, &["deaf", "other"]);
}

/// The server restarts, empty, with two waiters queued behind a holder: the lock and its
/// queue are gone. Each waiter, woken by its subscriber's reconnect, tries again; one takes
/// the lock, the other queues anew and is granted it at its release: nobody is lost, and
/// they hold it one at a time.
#[test]
fn a_server_restart_mid_queue_loses_no_waiter() {
    let (srv, holder) = test_server_and(client);
    let turns = Arc::new(Turns::default());
    let (guard, first) = held_with_one_queued((&srv, &srv.url()), &holder, "first", &turns);
    let second = second_queued(&srv, "second", &turns);
    srv.restart();
    join_all(vec![first, second], "waiter");
    let mut order = turns.order();
    order.sort_unstable();
    assert_eq!(order, ["first", "second"]);
    drop(guard);
    assert!(srv.keys_but_fences("redbaton:*").is_empty());
}

/// The head of the queue, cut off from its wake-ups, is cancelled while the lock is free
/// (its holder's key was deleted: no release), with `wait` (a lock's or a multi-lock's
/// wait, of `url`, with a deadline of half a minute) behind it: `wait` gets the name
/// soon after.
fn the_head_leaves_a_free_lock<W>(wait: impl FnOnce(&str) -> W)
where
    W: FnOnce() -> redbaton::Result<()> + Send,
{
    let srv = test_server();
    let url = srv.url();
    let holder = client(&url);
    // The head polls once a minute: it sleeps through the key's deletion, and is
    // cancelled before it looks again.
    let head = lock_client!(node(url.clone()), wakeup(Wakeup::Polling(secs(60))));
    let guard = holder.lock("k").expect("lock");
    let cancel = Cancel::new();
    let behind = wait(&url);
    thread::scope(|s| {
        let first = s.spawn(|| head.lock_cancellable("k", &cancel).map(drop));
        wait_for(secs(20), "the head to queue", || srv.zcard(QUEUE) == 1);
        let second = s.spawn(behind);
        wait_for(secs(20), "the one behind to wait", || {
            srv.zcard(QUEUE) == 2 || !srv.keys("redbaton:{k}:w").is_empty()
        });
        // Free, with the head queued: the one behind tries and fails (the head is first).
        redis::cmd("DEL")
            .arg("redbaton:{k}")
            .exec(&mut srv.conn())
            .expect("DEL");
        thread::sleep(ms(300));
        cancel.cancel();
        let e = first.join().expect("head").expect_err("the head gives up");
        assert!(e.is_cancelled(), "{e:?}");
        // Long before the waits' deadlines (and their last attempts) or re-checks.
        wait_for(secs(8), "the one behind to take the name", || {
            second.is_finished()
        });
        second
            .join()
            .expect("behind")
            .expect("the turn of the one behind");
    });
    drop(guard);
}

/// A fair waiter behind the head: its attempt grants the free lock to the head on the
/// spot, and the head's leaving passes that grant on to it.
#[test]
fn the_head_leaving_a_free_lock_passes_it_to_the_next_waiter() {
    the_head_leaves_a_free_lock(|url| {
        let next = client(url);
        move || next.try_lock_for("k", secs(30)).map(drop)
    });
}

/// A multi-lock behind the head waits for it (it does not pass the queue) and grants
/// nothing: the head's leaving of a free lock wakes it, not its re-check a minute later.
#[test]
fn the_head_leaving_a_free_lock_wakes_a_multi_lock_behind_it() {
    the_head_leaves_a_free_lock(|url| {
        let multi = client(url);
        move || multi.try_multi_lock_for(["k", "other"], secs(30)).map(drop)
    });
}
