//! A call's deadline against nodes that answer late, at the steps a call may take besides
//! its command: the first connection to a node the client never reached before, a script
//! the server lost (`SCRIPT FLUSH`) and that must be loaded again, and a Redlock round's
//! raise of a lagging fence counter.
//!
//! * A Redlock node down when the client was built is met for the first time by a call
//!   with a deadline: learning how the node publishes (its first connection, the channel
//!   probe) waits no longer than the call may; met hung, it is skipped like any node
//!   whose calls hang, without being asked again on the caller's thread.
//! * A script call answered `NOSCRIPT` loads the script and sends the call again: three
//!   replies in a row, which together end by the deadline, not each by a read timeout.
//! * The raise of a lagging fence counter after a Redlock round ends by the deadline of the
//!   call that won the round.
//! * A connection whose reads a deadline shortened goes back to the pool with its usual
//!   read timeout.
//! * A deadline nearer than the least a call is given (50 ms) gives the call that much
//!   from its start, once: the steps of the call share it, not each has it.
//! * A wait whose attempt got no answer returns with it, each kind of wait and a Redlock
//!   round short of a majority: its leave is the cleanup thread's, not one more call on
//!   the caller's thread.
//!
//! Times are generous liveness bounds, never speed claims: each bound lies far from both
//! the deadline and what a step that ignored the deadline would wait (read timeouts of a
//! few seconds). Every server is a real `redis-server`; late replies come from the test
//! support's proxy.

use std::time::Duration;

use redbaton::LockClient;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{self, RedisServer};
use redbaton_testkit::wait::wait_until;
use redbaton_testkit::{exists, init_log, lock_client, ms, secs, test_server, timed};

const PREFIX: &str = "de:";
const KEYS: Keys = Keys::new(PREFIX);
/// The read (and connect, and write) timeout of every client here: what a step that
/// ignored the call's deadline would wait on a node that answers later than that.
const IO: Duration = Duration::from_secs(3);

/// A server, and a proxy in front of it.
fn proxied() -> (RedisServer, Proxy) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    (srv, proxy)
}

/// A client of the single node at `url`, with [`IO`] timeouts.
fn client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX), io_timeouts(IO))
}

/// Empties the script cache of `srv`: the next call of every script is answered `NOSCRIPT`.
fn flush_scripts(srv: &RedisServer) {
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query::<()>(&mut srv.conn())
        .expect("SCRIPT FLUSH");
}

/// How long `c.try_lock_for(name, deadline)` took while `slow` delayed every reply by
/// `delay` (healed after it); what it returned is shown and dropped.
fn try_lock_for_while_slow(
    c: &LockClient,
    (slow, delay): (&Proxy, Duration),
    name: &str,
    deadline: Duration,
) -> Duration {
    slow.set_delay(delay);
    let (got, took) = timed(|| c.try_lock_for(name, deadline));
    slow.heal();
    eprintln!("try_lock_for({name:?}, {deadline:?}), replies {delay:?} late: {took:?}: {got:?}");
    took
}

#[test]
fn smoke() {
    let (srv, proxy) = proxied();
    let c = client(&proxy.url());
    let g = c.try_lock_for("smoke", secs(5)).expect("lock");
    assert!(exists(&mut srv.conn(), KEYS.lock("smoke")));
    flush_scripts(&srv);
    assert!(g.unlock().expect("unlock after a flush").was_held());
}

// --- a node met for the first time --------------------------------------------------------

/// A Redlock node unreachable when the client was built has never told the client how it
/// publishes (sharded or classic channels): the first call that reaches it opens a
/// connection to ask, which takes two replies (the connection's name, the probe). When the
/// node is back but each reply comes 1.5 s late, a `try_lock_for` of 300 ms must not wait
/// for them; the two other nodes decide the round.
#[test]
fn a_node_first_met_late_and_slow_keeps_the_deadline() {
    init_log();
    let servers = server::start_many(3);
    // The third node's address, with nothing behind it while the client is built.
    let port = Proxy::start(servers[2].addr()).port();
    let (c, late) = redlock_with_a_node_met_late(&servers, port, IO);
    let deadline = ms(300);
    let took = try_lock_for_while_slow(&c, (&late, ms(1_500)), "met-late", deadline);
    assert!(
        took < secs(2),
        "a call of {deadline:?} on a node first met slow took {took:?}"
    );
}

/// A Redlock client whose third node, at the address `port` names, was unreachable when
/// it was built; that node then accepts connections again through the returned proxy.
fn redlock_with_a_node_met_late(
    servers: &[RedisServer],
    port: u16,
    io: Duration,
) -> (LockClient, Proxy) {
    let urls = vec![
        servers[0].url(),
        servers[1].url(),
        format!("redis://127.0.0.1:{port}/"),
    ];
    let c: LockClient = lock_client!(nodes(urls), key_prefix(PREFIX), io_timeouts(io));
    (c, Proxy::start_at(port, servers[2].addr()))
}

/// A Redlock node first met hung (it accepts connections, never answers) holds up the
/// first round once, for the read timeout that learning how it publishes waits (a round
/// waits for a hung node about one timeout at most). It is then skipped: the next rounds
/// are decided by the two other nodes at once, and must not wait to learn it again on the
/// caller's thread.
#[test]
fn a_node_first_met_hung_is_skipped_at_once() {
    init_log();
    let servers = server::start_many(3);
    let port = Proxy::start(servers[2].addr()).port();
    let io = secs(2);
    let (c, hung) = redlock_with_a_node_met_late(&servers, port, io);
    hung.blackhole(true);
    let (first, took_first) = timed(|| c.lock("hung:a"));
    eprintln!("the first lock on a node met hung: {took_first:?}: {first:?}");
    drop(first);
    let (next, took) = timed(|| c.lock("hung:b"));
    hung.heal();
    eprintln!("the next lock, the node skipped: {took:?}: {next:?}");
    assert!(
        next.is_ok() && took < io / 2,
        "read timeout {io:?}, the node skipped: {next:?} after {took:?}"
    );
}

// --- a script the server lost -------------------------------------------------------------

/// After `SCRIPT FLUSH`, on a server whose replies come 900 ms late, an acquire with a
/// deadline of 1 s is answered `NOSCRIPT`, loads the script and sends the call again:
/// three replies. The call ends at its deadline, not three late replies after it began.
#[test]
fn a_script_loaded_again_keeps_the_deadline() {
    let (srv, proxy) = proxied();
    let c = client(&proxy.url());
    // An idle pooled connection, so that nothing but the script waits for replies.
    drop(c.try_lock("flushed:warm").expect("warm up"));
    flush_scripts(&srv);
    let deadline = secs(1);
    let took = try_lock_for_while_slow(&c, (&proxy, ms(900)), "flushed", deadline);
    assert!(
        took < deadline + ms(800),
        "a call of {deadline:?} after a flush, replies 900 ms late, took {took:?}"
    );
}

// --- a Redlock round's fence raise --------------------------------------------------------

/// Sets the fence counter of `name` on `srv` to `fence`, released: the next hold there
/// gets `fence + 1`.
fn set_fence(srv: &RedisServer, name: &str, fence: u64) {
    redis::cmd("SET")
        .arg(KEYS.fence(name))
        .arg(fence)
        .query::<()>(&mut srv.conn())
        .expect("SET the fence counter");
}

/// A Redlock round won on every node, one of whose counters lags (its fence is the
/// server's clock, the two others' far ahead): before the guard is returned, that
/// node's counter is raised to the round's fence. The lagging node answers 1.4 s late:
/// its grant comes within the deadline of 1.6 s, and the raise must not wait a second late
/// reply past it (the two others carry the fence: a majority).
#[test]
fn a_fence_raise_on_a_slow_node_keeps_the_deadline() {
    init_log();
    let servers = server::start_many(3);
    let slow = Proxy::start(servers[2].addr());
    let urls = vec![servers[0].url(), servers[1].url(), slow.url()];
    // Timeouts well above the late replies: the node is slow, not stalled.
    let c: LockClient = lock_client!(nodes(urls), key_prefix(PREFIX), io_timeouts(secs(5)));
    let ahead = redbaton_testkit::clock::wall_us() + 1_000_000_000_000;
    for srv in &servers[..2] {
        set_fence(srv, "raised", ahead);
    }
    // Connections used a moment ago: none is checked first for having lain idle.
    drop(c.try_lock("raised:warm").expect("warm up"));
    let deadline = ms(1_600);
    let took = try_lock_for_while_slow(&c, (&slow, ms(1_400)), "raised", deadline);
    assert!(
        took < deadline + ms(600),
        "a call of {deadline:?} whose fence raise met a slow node took {took:?}"
    );
}

// --- a deadline ends with its call --------------------------------------------------------

/// A call with a deadline shortens the reads of its connection, each to what remains of
/// the deadline, then gives the connection back with its usual read timeout: the next
/// call without a deadline, whose script the server lost too, waits for each of its
/// replies as long as the read timeout allows. A read cut short would drop the connection
/// (a new one would be opened) and could fail the call.
#[test]
fn a_deadline_ends_with_its_call() {
    let (srv, proxy) = proxied();
    // One connection, and no subscriber's: every connection the proxy sees is the pool's.
    let c = lock_client!(
        node(proxy.url()),
        key_prefix(PREFIX),
        io_timeouts(IO),
        pool_size(1),
        wakeup(redbaton::Wakeup::Polling(ms(100)))
    );
    drop(c.try_lock("ended:warm").expect("warm up"));
    flush_scripts(&srv);
    proxy.set_delay(ms(100));
    let (held, took) = timed(|| c.try_lock_for("ended:first", ms(500)));
    let held = held.unwrap_or_else(|e| panic!("replies 100 ms late, after {took:?}: {e:?}"));
    assert!(held.unlock().expect("unlock").was_held());
    flush_scripts(&srv);
    let opened = proxy.connections_accepted();
    // Later than anything the first call's deadline allowed, well within the read timeout.
    proxy.set_delay(ms(700));
    let (got, took) = timed(|| c.try_lock("ended:second"));
    proxy.heal();
    eprintln!("try_lock after a call with a deadline: {took:?}: {got:?}");
    assert!(
        got.is_ok() && proxy.connections_accepted() == opened,
        "replies 700 ms late, read timeout {IO:?}: {got:?} after {took:?}, {} connection(s) opened",
        proxy.connections_accepted() - opened
    );
}

// --- the least a call is given -----------------------------------------------------------

/// What a call whose deadline is nearer than that is given from its start, so that it has
/// a chance to succeed (the library's `MIN_ATTEMPT`).
const LEAST_ATTEMPT: Duration = Duration::from_millis(50);
/// Waiters look again now and then rather than listen: nothing but the pool connects.
const POLLING: redbaton::Wakeup = redbaton::Wakeup::Polling(Duration::from_millis(100));

/// A deadline nearer than [`LEAST_ATTEMPT`] gives the call that much from its start, once,
/// not each of its steps. A latch's wait of 20 ms reads the count with a script, one
/// call. Here the pooled connection died, the server lost its scripts, and every reply
/// comes 40 ms late: the call opens a connection (which selects the URL's database), names
/// it, probes its channels again, is answered `NOSCRIPT`, loads the script and sends it
/// again, six replies in a row, each later than the deadline but sooner than
/// [`LEAST_ATTEMPT`]. Given that much each, they would all be waited for, about five
/// times as long as the call may take.
#[test]
fn a_short_deadline_stretches_the_call_not_each_step() {
    let (srv, proxy) = proxied();
    // Database 1: one more reply to wait for while connecting. No subscriber, whose
    // connection the proxy would kill too.
    let url = format!("redis://{}/1", proxy.addr());
    let c = lock_client!(
        node(url),
        key_prefix(PREFIX),
        io_timeouts(IO),
        wakeup(POLLING)
    );
    drop(c.try_lock("least:warm").expect("warm up"));
    flush_scripts(&srv);
    proxy.kill_all();
    let latch = c.latch("least", 1);
    let (deadline, late) = (ms(20), ms(40));
    proxy.set_delay(late);
    let (got, took) = timed(|| latch.wait_for(deadline));
    proxy.heal();
    eprintln!("a latch's wait_for({deadline:?}), replies {late:?} late: {took:?}: {got:?}");
    let bound = LEAST_ATTEMPT + ms(150);
    assert!(
        took < bound,
        "a wait of {deadline:?}, replies {late:?} late, took {took:?} (at most {bound:?})"
    );
}

// --- the end of a wait the server did not answer -------------------------------------------

/// The re-check interval of the clients below: a multi-lock's contention marks, left to
/// expire when the server did not answer, live twice that.
const RECHECK: Duration = Duration::from_millis(400);

/// A wait whose attempt got no answer ends there: what it may have left in Redis (its
/// queue entry or contention mark, or a hold the unanswered attempt took) is given back by
/// the client's cleanup thread (a multi-lock's marks expire), not by one more call of the
/// caller's that the same silent server would hold up for the least a call is given.
/// Given back all the same: once the node answers again (and the requests it held land,
/// late), nothing of the wait is left. Each kind of wait, with a deadline of 20 ms.
#[test]
fn a_wait_the_server_did_not_answer_ends_with_its_attempt() {
    init_log();
    let (srv, hung) = proxied();
    let with = |fair: bool| {
        lock_client!(
            node(hung.url()),
            key_prefix(PREFIX),
            io_timeouts(IO),
            recheck_interval(RECHECK),
            fair(fair)
        )
    };
    let (fair, unfair) = (with(true), with(false));
    drop(fair.try_lock("unanswered:warm").expect("warm up"));
    drop(unfair.try_lock("unanswered:warm").expect("warm up"));
    let d = ms(20);
    let waits: [(&str, &dyn Fn() -> redbaton::Result<()>); 6] = [
        ("fair lock", &|| {
            fair.try_lock_for("unanswered:f", d).map(drop)
        }),
        ("lock", &|| unfair.try_lock_for("unanswered:u", d).map(drop)),
        ("write", &|| {
            fair.rwlock("unanswered:w").try_write_for(d).map(drop)
        }),
        ("read", &|| {
            fair.rwlock("unanswered:r").try_read_for(d).map(drop)
        }),
        ("permit", &|| {
            fair.semaphore("unanswered:p", 2)
                .try_acquire_for(d)
                .map(drop)
        }),
        ("multi-lock", &|| {
            let names = ["unanswered:m1", "unanswered:m2"];
            fair.try_multi_lock_for(names, d).map(drop)
        }),
    ];
    let pattern = format!("{PREFIX}*");
    for (kind, wait) in waits {
        hung.stall(true);
        let (got, took) = timed(wait);
        hung.heal();
        eprintln!("{kind}: a wait of {d:?}, no answer: {took:?}: {got:?}");
        assert!(
            got.as_ref()
                .is_err_and(|e| e.is_timeout() || e.is_connection())
        );
        let bound = LEAST_ATTEMPT + ms(30);
        assert!(
            took < bound,
            "{kind}: a wait of {d:?} on a node that answered nothing took {took:?} \
             (at most {bound:?})"
        );
        let gone = wait_until(secs(5), || srv.keys_but_fences(&pattern).is_empty());
        assert!(
            gone,
            "{kind}: left in Redis: {:?}",
            srv.keys_but_fences(&pattern)
        );
    }
}

/// The same on Redlock: a round that two of three nodes did not answer falls short of a
/// majority and ends with its attempt; the give-back of the hold the third granted, and
/// the leave on all three, are the cleanup thread's. Nothing is left once they answer.
#[test]
fn a_redlock_wait_short_of_a_majority_ends_with_its_attempt() {
    init_log();
    let servers = server::start_many(3);
    let proxies: Vec<Proxy> = servers.iter().map(|s| Proxy::start(s.addr())).collect();
    let urls: Vec<String> = proxies.iter().map(Proxy::url).collect();
    let c = lock_client!(nodes(urls), key_prefix(PREFIX), io_timeouts(IO));
    drop(c.try_lock("unanswered:warm").expect("warm up"));
    let d = ms(20);
    for p in &proxies[..2] {
        p.stall(true);
    }
    let (got, took) = timed(|| c.try_lock_for("unanswered:redlock", d).map(drop));
    proxies.iter().for_each(Proxy::heal);
    eprintln!("Redlock, two of three nodes silent: a wait of {d:?}: {took:?}: {got:?}");
    assert!(got.as_ref().is_err_and(|e| e.is_timeout()), "{got:?}");
    let bound = LEAST_ATTEMPT + ms(30);
    assert!(
        took < bound,
        "a wait of {d:?} with two of three nodes silent took {took:?} (at most {bound:?})"
    );
    let pattern = format!("{PREFIX}*");
    for srv in &servers {
        let gone = wait_until(secs(5), || srv.keys_but_fences(&pattern).is_empty());
        assert!(gone, "left in Redis: {:?}", srv.keys_but_fences(&pattern));
    }
}
