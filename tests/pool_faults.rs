//! The pool of command connections under what a thread-pool application brings: many
//! more threads than connections, while the server restarts, is stopped for longer than
//! the read timeout, or has its connections killed.
//!
//! * Every call returns, within its deadline and a margin, with success or a typed error;
//!   once the server is back, every thread locks again (no slot lost for good, no thread
//!   left waiting for a connection), and the server sees no more of the client's command
//!   connections than `pool_size`, plus its subscriber's.
//! * A reply that comes after the read timeout is never read by the next call: the
//!   connection it was late on is not lent again.
//! * Opening a connection keeps the call's deadline step after step (the handshake, the
//!   name, the channel probe), however slow each reply, and a connect to an address that
//!   never answers a `SYN` ends at the deadline, not at the longer connect timeout.
//! * [`Error::PoolExhausted`] comes when every connection stayed busy for the connect
//!   timeout (or what remained of the call's deadline), and not when connections come
//!   back in time.
//! * A connection lent when its Redis Cluster master was demoted is closed when it comes
//!   back, not kept idle to a node that serves nothing.
//!
//! Every server is a real `redis-server`; faults come from the test support's proxy,
//! `SIGSTOP`, restarts, `CLIENT KILL`, a failover, and a listener whose backlog is full.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Error, LockClient};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{RedisServer, parse_client_list};
use redbaton_testkit::wait::wait_until;
use redbaton_testkit::{exists, lock_client, ms, secs, test_server};

const PREFIX: &str = "pf:";
const KEYS: Keys = Keys::new(PREFIX);

/// Resumes a stopped server however the test ends.
struct Resume<'a>(&'a RedisServer);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        self.0.resume();
    }
}

/// The client's connections the server sees, by name: command connections (`redbaton`)
/// and subscriber connections (`redbaton:sub`). Asked on a connection of its own, since
/// `CLIENT KILL TYPE normal` closes the test support's too.
fn library_connections(srv: &RedisServer) -> (usize, usize) {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut srv.conn())
        .expect("CLIENT LIST");
    let names: Vec<String> = parse_client_list(&list)
        .into_iter()
        .filter_map(|mut c| c.remove("name"))
        .collect();
    let count = |n: &str| names.iter().filter(|m| *m == n).count();
    (count("redbaton"), count("redbaton:sub"))
}

/// A client of `url` with a pool of `pool` connections, the connect timeout `connect`, the
/// read and write timeouts `io`, and a lease long enough to outlive every test.
fn pooled(url: &str, pool: usize, connect: Duration, io: Duration) -> Arc<LockClient> {
    Arc::new(lock_client!(
        node(url),
        key_prefix(PREFIX),
        pool_size(pool),
        connect_timeout(connect),
        read_timeout(io),
        write_timeout(io),
        lease(secs(30))
    ))
}

/// What `thread` returned, once it ends within `limit`: a thread still waiting after
/// that (for a connection, say) fails the test instead of hanging it.
fn joined<T>(thread: thread::JoinHandle<T>, limit: Duration) -> T {
    let ended = wait_until(limit, || thread.is_finished());
    assert!(ended, "a thread still running after {limit:?}");
    thread.join().expect("the thread panicked")
}

/// What a call may end with under faults: success, or an error that says what happened.
fn typed(e: &Error) -> bool {
    e.is_connection() || e.is_timeout() || e.is_would_block()
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), pool_size(2));
    let g = c.try_lock("smoke").expect("lock");
    assert!(exists(&mut srv.conn(), KEYS.lock("smoke")));
    assert!(g.unlock().expect("unlock").was_held());
    let (commands, _) = library_connections(&srv);
    assert!(
        (1..=2).contains(&commands),
        "{commands} command connections"
    );
}

// --- many threads, a small pool, a server in trouble --------------------------------------

const THREADS: usize = 64;
const POOL: usize = 4;

/// 64 threads share a pool of 4, each locking and unlocking names of its own, while the
/// server has its connections killed, is stopped for longer than the read timeout, and is
/// restarted. Every call returns within its deadline (plus a margin) with success or a
/// typed error; afterwards every thread locks again, and the server sees at most
/// `pool_size` command connections and one subscriber connection of the client.
#[test]
fn many_threads_on_a_small_pool_outlive_kills_stops_and_restarts() {
    let srv = test_server();
    let c = pooled(&srv.url(), POOL, ms(300), ms(300));
    const DEADLINE: Duration = Duration::from_millis(400);
    // A release has no deadline of its own: its connect, its read, and one retry.
    const RELEASE_BOUND: Duration = Duration::from_secs(4);
    const MARGIN: Duration = Duration::from_secs(2);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (c, stop) = (c.clone(), stop.clone());
            thread::spawn(move || {
                let (mut calls, mut failures) = (0u32, Vec::new());
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let name = format!("storm:{t}:{i}");
                    calls += 1;
                    let started = Instant::now();
                    let got = c.try_lock_for(&name, DEADLINE);
                    let took = started.elapsed();
                    if took > DEADLINE + MARGIN {
                        failures.push(format!("{name}: acquire took {took:?}: {got:?}"));
                    }
                    match got {
                        Ok(g) => {
                            let started = Instant::now();
                            let released = g.unlock();
                            let took = started.elapsed();
                            if took > RELEASE_BOUND + MARGIN {
                                failures.push(format!("{name}: release took {took:?}"));
                            }
                            if let Err(e) = released
                                && !typed(&e)
                                && !e.is_lost()
                            {
                                failures.push(format!("{name}: release: {e:?}"));
                            }
                        }
                        Err(e) if typed(&e) => thread::sleep(ms(5)),
                        Err(e) => failures.push(format!("{name}: acquire: {e:?}")),
                    }
                }
                (calls, failures)
            })
        })
        .collect();
    let kill = || {
        let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .query(&mut srv.conn());
    };
    thread::sleep(ms(300));
    for _ in 0..3 {
        kill();
        thread::sleep(ms(150));
    }
    {
        srv.pause();
        let _resume = Resume(&srv);
        thread::sleep(ms(900));
    }
    thread::sleep(ms(300));
    srv.restart();
    thread::sleep(ms(300));
    kill();
    thread::sleep(ms(300));
    stop.store(true, Ordering::Relaxed);
    let mut calls = 0;
    for w in workers {
        let (n, failures) = joined(w, secs(10));
        calls += n;
        assert!(failures.is_empty(), "{failures:#?}");
    }
    eprintln!("{calls} acquires under the faults");

    // Back to health: every thread locks again, all at once.
    let after: Vec<_> = (0..THREADS)
        .map(|t| {
            let c = c.clone();
            thread::spawn(move || {
                let name = format!("after:{t}");
                c.try_lock_for(&name, secs(10)).map(|g| g.unlock())
            })
        })
        .collect();
    for (t, a) in after.into_iter().enumerate() {
        let got = joined(a, secs(20));
        assert!(
            matches!(got, Ok(Ok(ref u)) if u.was_held()),
            "thread {t} after the faults: {got:?}"
        );
    }
    let mut seen = (0, 0);
    let settled = wait_until(secs(5), || {
        seen = library_connections(&srv);
        seen.0 <= POOL && seen.1 <= 1
    });
    assert!(
        settled,
        "command and subscriber connections after the faults: {seen:?}"
    );
}

// --- a late reply --------------------------------------------------------------------------

/// `call`, tried again while it finds the pool of one busy: the failed call's cleanup (it
/// may have run) borrows that one connection for a moment, which a loaded machine
/// stretches past the 300 ms a call waits for it.
fn lent<T>(call: impl Fn() -> redbaton::Result<T>) -> redbaton::Result<T> {
    let until = Instant::now() + secs(10);
    loop {
        match call() {
            Err(Error::PoolExhausted) if Instant::now() < until => thread::sleep(ms(50)),
            other => return other,
        }
    }
}

/// A reply delayed past the read timeout fails its call; the next call, on the same pool
/// of one, must read its own reply, never the late one of the call before (which would
/// report the name free when it is held, or held when it is free).
#[test]
fn a_reply_later_than_the_read_timeout_is_never_read_by_the_next_call() {
    let srv = test_server();
    let holder = lock_client!(node(srv.url()), key_prefix(PREFIX));
    let _held = holder.try_lock("late:held").expect("holder");
    let proxy = Proxy::start(srv.addr());
    let c = pooled(&proxy.url(), 1, ms(300), ms(300));
    for round in 0..3 {
        proxy.set_delay(ms(700));
        // Held by another: its reply, read late, would say so.
        let late = c.try_lock("late:held");
        assert!(
            late.as_ref().is_err_and(|e| !e.is_would_block()),
            "round {round}: a reply 700 ms late with a read timeout of 300 ms: {late:?}"
        );
        proxy.set_delay(Duration::ZERO);
        let name = format!("late:free:{round}");
        let own = lent(|| c.try_lock(&name));
        assert!(own.is_ok(), "round {round}: the next call: {own:?}");
        // And the late reply has arrived by now.
        thread::sleep(ms(500));
        let again = lent(|| c.try_lock("late:held"));
        assert!(
            again.as_ref().is_err_and(Error::is_would_block),
            "round {round}: {again:?}"
        );
        let own = own.and_then(|g| g.unlock());
        assert!(own.is_ok_and(|u| u.was_held()), "round {round}");
    }
}

// --- opening a connection within the deadline ---------------------------------------------

/// Opening a connection takes several replies (the handshake's `SELECT`, the connection's
/// name, the channel probe after the connections were dropped). Each is given what remains
/// of the call's deadline, not what remained when the connect began: a server slow to
/// answer each of them, but never slower than that, would otherwise hold the call for a
/// multiple of its deadline.
#[test]
fn opening_a_connection_step_by_step_keeps_the_deadline() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    // Database 1: the handshake has a `SELECT` to wait for.
    let db1 = format!("{}1", proxy.url());
    let c = pooled(&db1, 4, secs(20), secs(20));
    drop(c.try_lock("slow:warm").expect("warm up"));
    // Drops the pooled connections and has the next one probe the channel again.
    proxy.kill_all();
    proxy.set_delay(ms(700));
    let deadline = ms(800);
    let started = Instant::now();
    let got = c.try_lock_for("slow:a", deadline);
    let took = started.elapsed();
    proxy.heal();
    eprintln!("took {took:?}: {got:?}");
    assert!(
        took < deadline + ms(600),
        "a call of {deadline:?} against replies 700 ms late each took {took:?}: {got:?}"
    );
}

/// A listener on 127.0.0.1:`port` whose accept queue is full: the kernel drops the `SYN`
/// of every further connect, which waits until its own timeout (an address that drops
/// packets). The port is retried while the kernel lets go of its last listener.
fn syn_dropper(port: u16) -> (TcpListener, Vec<TcpStream>) {
    let started = Instant::now();
    let listener = loop {
        match TcpListener::bind(("127.0.0.1", port)) {
            Ok(l) => break l,
            Err(_) if started.elapsed() < secs(5) => thread::sleep(ms(50)),
            Err(e) => panic!("bind 127.0.0.1:{port}: {e}"),
        }
    };
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut queued = Vec::new();
    let full = loop {
        match TcpStream::connect_timeout(&addr, ms(200)) {
            Ok(s) => queued.push(s),
            Err(e) => break e,
        }
        assert!(queued.len() < 4_096, "the accept queue never filled");
    };
    assert_eq!(
        full.kind(),
        std::io::ErrorKind::TimedOut,
        "after {} queued connects: {full}",
        queued.len()
    );
    (listener, queued)
}

/// A call with a deadline far shorter than the connect timeout, to an address that never
/// answers a connect (a full accept queue drops the `SYN`), ends near the deadline with a
/// connection error; a call without a deadline ends after the connect timeout.
#[test]
fn a_connect_to_an_address_that_drops_syns_ends_at_the_deadline() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let port = proxy.port();
    let c = pooled(&proxy.url(), 2, secs(3), ms(500));
    drop(c.try_lock("syn:warm").expect("warm up"));
    drop(proxy);
    // The address the client knows, now on a listener that never accepts.
    let _dropper = syn_dropper(port);
    for round in 0..2 {
        let started = Instant::now();
        let got = c.try_lock_for("syn:a", ms(300));
        let took = started.elapsed();
        assert!(
            got.as_ref()
                .is_err_and(|e| e.is_connection() || e.is_timeout())
                && took < secs(2),
            "round {round}: 300 ms against an address that drops SYNs: {got:?} after {took:?}"
        );
    }
    let started = Instant::now();
    let got = c.try_lock("syn:b");
    let took = started.elapsed();
    assert!(
        got.as_ref().is_err_and(Error::is_connection) && took < secs(3) + secs(3),
        "no deadline, a connect timeout of 3 s: {got:?} after {took:?}"
    );
}

// --- an exhausted pool --------------------------------------------------------------------

/// The only connection is busy on a stopped server: a call with a deadline shorter than
/// the connect timeout waits for it until that deadline, a call without one for the
/// connect timeout; both fail with `PoolExhausted` (the server is not what failed them).
/// Once the server is back, the pool lends again.
#[test]
fn a_pool_busy_past_the_wait_is_exhausted_then_recovers() {
    let srv = test_server();
    let c = pooled(&srv.url(), 1, secs(2), secs(5));
    drop(c.try_lock("ex:warm").expect("warm up"));
    srv.pause();
    let resume = Resume(&srv);
    let busy = {
        let c = c.clone();
        thread::spawn(move || c.try_lock("ex:busy").map(drop))
    };
    thread::sleep(ms(200));
    let started = Instant::now();
    let got = c.try_lock_for("ex:short", ms(200));
    let took = started.elapsed();
    assert!(
        matches!(got, Err(Error::PoolExhausted)) && took < ms(1500),
        "200 ms for the only connection, a connect timeout of 2 s: {got:?} after {took:?}"
    );
    let started = Instant::now();
    let got = c.try_lock("ex:waits");
    let took = started.elapsed();
    assert!(
        matches!(got, Err(Error::PoolExhausted)) && took >= ms(1500) && took < secs(4),
        "no deadline, a connect timeout of 2 s: {got:?} after {took:?}"
    );
    drop(resume);
    let _ = joined(busy, secs(10));
    let after = c.try_lock("ex:after");
    assert!(after.is_ok(), "after the server is back: {after:?}");
}

/// Connections that come back in time are lent to the threads waiting for them: 64
/// threads on 4 connections, each call short, never see `PoolExhausted`.
#[test]
fn connections_given_back_in_time_leave_no_thread_exhausted() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let c = pooled(&proxy.url(), POOL, secs(5), secs(5));
    proxy.set_delay(ms(10));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let c = c.clone();
            thread::spawn(move || {
                (0..3)
                    .map(|i| {
                        let name = format!("busy:{t}:{i}");
                        c.try_lock(&name).and_then(|g| g.unlock()).map(|_| ())
                    })
                    .find(Result::is_err)
            })
        })
        .collect();
    for (t, w) in workers.into_iter().enumerate() {
        let failed = joined(w, secs(20));
        assert!(failed.is_none(), "thread {t}: {failed:?}");
    }
    let (commands, _) = library_connections(&srv);
    // As many as were needed at once, kept open while idle.
    assert_eq!(commands, POOL, "command connections after the calls");
}

// --- a password changed under many threads ------------------------------------------------

/// Sets the password of the ACL user `locker` on `admin`.
fn set_password(admin: &mut redis::Connection, password: &str) {
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("locker")
        .arg("resetpass")
        .arg(format!(">{password}"))
        .query::<()>(admin)
        .expect("ACL SETUSER");
}

/// The user's password changes on the server and the client's connections are killed:
/// each of 64 threads on a pool of 4 is told so (an authentication error, not an exhausted
/// pool, not a wait to its deadline), every slot a refused connect took is given back, and
/// with the old password back every thread locks again.
#[test]
fn a_password_changed_under_many_threads_is_an_auth_error_for_each_then_heals() {
    redbaton_testkit::init_log();
    let srv = RedisServer::builder()
        .acl_user("locker", "first-pw", "~* &* +@all")
        .start();
    let c = pooled(&srv.url_as("locker", "first-pw"), POOL, secs(1), secs(2));
    drop(c.try_lock("pw:warm").expect("warm up"));
    let mut admin = srv.conn();
    set_password(&mut admin, "second-pw");
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query(&mut admin)
        .expect("CLIENT KILL");
    let all = |round: &'static str| -> Vec<redbaton::Result<()>> {
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let c = c.clone();
                thread::spawn(move || {
                    let name = format!("pw:{round}:{t}");
                    c.try_lock_for(&name, secs(5))
                        .and_then(|g| g.unlock().map(drop))
                })
            })
            .collect();
        (threads.into_iter()).map(|t| joined(t, secs(10))).collect()
    };
    let started = Instant::now();
    let refused = all("refused");
    let took = started.elapsed();
    let odd: Vec<_> = refused
        .iter()
        .filter(|r| !r.as_ref().is_err_and(Error::is_auth))
        .collect();
    assert!(odd.is_empty() && took < secs(4), "after {took:?}: {odd:?}");
    set_password(&mut admin, "first-pw");
    let back = all("back");
    let odd: Vec<_> = back.iter().filter(|r| r.is_err()).collect();
    assert!(odd.is_empty(), "with the password back: {odd:?}");
}

// --- a Redis Cluster master demoted while its connection is lent --------------------------

/// A Redis Cluster master is replaced (its replica takes over) while a call waits for its
/// reply on one of the master's connections. The client reads the new slot map meanwhile
/// and stops serving anything from the old master; the connection that comes back after
/// that is closed, not kept idle: a server closes no idle connection by default, and no
/// route leads there any more.
#[test]
fn a_connection_lent_when_its_master_is_demoted_is_not_kept() {
    redbaton_testkit::init_log();
    let cluster = Cluster::start();
    let c = Arc::new(lock_client!(
        cluster(cluster.seed_urls()),
        key_prefix(PREFIX),
        connect_timeout(secs(5)),
        read_timeout(secs(8)),
        write_timeout(secs(8)),
        lease(secs(30))
    ));
    let name = "demoted";
    let slot = cluster.keyslot(&KEYS.lock_bytes(name.as_bytes()));
    let old = cluster.owner(slot);
    let beside = cluster.name_beside(&KEYS, "beside", slot);
    let replica = cluster.replica_of(old);
    let master = cluster.server(old);
    drop(c.try_lock(name).expect("warm up"));
    master.pause();
    let resume = Resume(master);
    let lent = {
        let c = c.clone();
        thread::spawn(move || c.try_lock(name).map(drop))
    };
    thread::sleep(ms(300));
    redis::cmd("CLUSTER")
        .arg("FAILOVER")
        .arg("TAKEOVER")
        .query::<()>(&mut replica.conn())
        .expect("CLUSTER FAILOVER TAKEOVER");
    let promoted = wait_until(secs(10), || {
        replica.info("replication").contains("role:master")
    });
    assert!(promoted, "the replica never took over");
    // The client finds the new master of the slots: calls there succeed.
    let moved = wait_until(secs(10), || c.try_lock_for(&beside, ms(300)).is_ok());
    assert!(moved, "the client never locked on the new master");
    drop(resume);
    let _ = joined(lent, secs(10));
    let mut left = 0;
    let closed = wait_until(secs(3), || {
        left = library_connections(master).0;
        left == 0
    });
    assert!(
        closed,
        "{left} command connection(s) kept to the demoted master"
    );
}

/// An exhausted pool is the client's load, not the node's fault: on Redis Cluster it must
/// not send the client to read the slot map again (a `CLUSTER SLOTS` on a caller's path,
/// every 100 ms while the load lasts). One connection per master and locks that wait for a
/// replica's acknowledgement while that replica is paused: one caller allowed 2 s holds the
/// connection for each whole `WAIT` (300 ms, on a master that answers at once), while
/// callers allowed 100 ms find it busy. (A `WAIT` ends by its caller's deadline, so callers
/// allowed 100 ms alone would mostly hand the connection on in time.)
#[test]
fn an_exhausted_pool_on_a_cluster_reads_no_slot_map() {
    let cluster = Cluster::start();
    let c = lock_client!(
        cluster(cluster.seed_urls()),
        key_prefix(PREFIX),
        pool_size(1),
        replica_ack(1, ms(300))
    );
    let slot = cluster.keyslot(&KEYS.lock_bytes(b"{busy}warm"));
    // The replica acknowledges once it has caught up with its master.
    cluster.wait_replicated(cluster.owner(slot));
    redbaton_testkit::wait::wait_for(secs(10), "a lock the replica acknowledges", || {
        c.try_lock("{busy}warm").is_ok()
    });
    let before = c.stats().slot_refreshes;
    let replica = cluster.replica_of(cluster.owner(slot));
    replica.pause();
    let exhausted = std::sync::atomic::AtomicUsize::new(0);
    let holding = std::sync::atomic::AtomicBool::new(true);
    let count = |got: Result<redbaton::LockGuard, Error>| {
        if matches!(got, Err(Error::PoolExhausted)) {
            exhausted.fetch_add(1, Ordering::Relaxed);
        }
    };
    thread::scope(|s| {
        s.spawn(|| {
            for i in 0..3 {
                count(c.try_lock_for(format!("{{busy}}long:{i}"), secs(2)));
            }
            holding.store(false, Ordering::Relaxed);
        });
        for t in 0..3 {
            let (c, count, holding) = (&c, &count, &holding);
            s.spawn(move || {
                let mut i = 0;
                while holding.load(Ordering::Relaxed) {
                    count(c.try_lock_for(format!("{{busy}}{t}:{i}"), ms(100)));
                    i += 1;
                }
            });
        }
    });
    replica.resume();
    let exhausted = exhausted.load(Ordering::Relaxed);
    assert!(
        exhausted > 0,
        "no call found the pool busy: the test shows nothing"
    );
    let refreshes = c.stats().slot_refreshes - before;
    assert_eq!(refreshes, 0, "{exhausted} calls found the pool busy");
}
