//! Holds on a server that stops answering, refuses the client or loses its replica,
//! against real redis-servers (paused with SIGSTOP where one must stall): the local
//! handoff of a lock, an upgrade and a downgrade, and the renewals of a holder whose
//! password changed.
//!
//! What the file shows: a thread handed the lock by a local holder gets it without
//! waiting on the server (a handoff sends nothing to Redis); an upgrade left unanswered at
//! its deadline says the upgradable read is lost rather than that the wait ran out; a
//! downgrade no replica acknowledged is trusted no longer than the write hold it replaced;
//! and renewals refused at `AUTH` back off instead of logging in again every few
//! milliseconds, while the holder is still told of the loss when its lease ends, and a
//! password put back in time keeps the lock.
//!
//! Times are generous liveness bounds, never speed claims: each is far below the read
//! timeout (10 s) that a call waiting on the stalled server would take.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{LockClient, LostReason, Unlocked};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, secs, test_server};

const PREFIX: &str = "df:";
/// Liveness bound of the waits of the test itself (never a speed claim).
const LIVENESS: Duration = Duration::from_secs(20);

/// A client of `srv` with a read timeout of 10 s: a call that waits for a stalled
/// server's reply waits that long.
fn stall_client(srv: &RedisServer) -> LockClient {
    lock_client!(node(srv.url()), key_prefix(PREFIX), io_timeouts(secs(10)))
}

/// Takes `name` with `c` and hands it to another thread of `c` queued for it, which
/// releases it (this leaves the key's subscription behind for a while).
fn hand_on(c: &LockClient, name: &str) {
    let held = c.lock(name).expect("lock");
    thread::scope(|s| {
        let waiter = s.spawn(|| c.lock(name).expect("handed the lock").unlock());
        // Time to queue: a waiter not queued yet would fail the handoff below.
        thread::sleep(ms(300));
        assert_eq!(held.unlock().expect("unlock"), Unlocked::HandedOff);
        assert!(waiter.join().expect("waiter").expect("unlock").was_held());
    });
}

/// A lock is handed to a queued thread; a write hold is upgraded from an upgradable read.
#[test]
fn smoke() {
    let srv = test_server();
    let c = stall_client(&srv);
    hand_on(&c, "smoke");
    let u = c
        .rwlock("smoke-rw")
        .upgradable_read()
        .expect("upgradable read");
    let w = u.upgrade().expect("upgrade");
    assert!(w.unlock().expect("unlock").was_held());
}

/// A thread queued behind a local holder, on a server that stopped answering, is handed
/// the lock when the holder lets go, not a read timeout later. The key's subscription was
/// confirmed before the holder took the lock (it lingers after an earlier wait): every
/// other process's mark since would have been heard, so the waiter does not read the mark
/// key, a read that would keep it from the lock it is handed meanwhile.
#[test]
fn a_handoff_reaches_a_waiter_whose_subscription_lingered() {
    let srv = test_server();
    let c = stall_client(&srv);
    hand_on(&c, "lingered");
    let held = c.lock("lingered").expect("lock");
    srv.pause();
    let (got_tx, got_rx) = mpsc::channel();
    let (resumed_tx, resumed_rx) = mpsc::channel::<()>();
    let took = thread::scope(|s| {
        let waiter = s.spawn(move || {
            let guard = c.lock("lingered").expect("handed the lock");
            got_tx.send(Instant::now()).expect("send");
            // Released once the server answers again.
            let _ = resumed_rx.recv();
            guard.unlock().expect("unlock")
        });
        // Time to queue and begin its first steps there (a look for other processes'
        // marks); a waiter not queued yet would fail the handoff below.
        thread::sleep(ms(300));
        let handed_at = Instant::now();
        assert_eq!(held.unlock().expect("unlock"), Unlocked::HandedOff);
        let got_at = got_rx.recv_timeout(LIVENESS).expect("the waiter holds it");
        srv.resume();
        drop(resumed_tx);
        waiter.join().expect("waiter");
        got_at.saturating_duration_since(handed_at)
    });
    // The read timeout is 10 s: a waiter that sat it out holds the lock after that.
    assert!(took < secs(5), "handed on, held {took:?} later");
}

/// An upgrade whose attempt the server has not answered by the deadline may have run: the
/// upgradable read may be the write hold now, which the library gives back, so the guard
/// is lost. The error says so, rather than a timeout, after which the caller would read
/// on under a guard that no longer holds; once that guard is dropped, a writer gets in.
#[test]
fn an_unanswered_upgrade_says_the_read_is_lost() {
    let srv = test_server();
    let c = stall_client(&srv);
    let u = c
        .rwlock("upgrade")
        .upgradable_read()
        .expect("upgradable read");
    srv.pause();
    let (e, guard) = match u.try_upgrade_for(ms(200)) {
        Ok(_) => panic!("upgraded on a server that does not answer"),
        Err(e) => (e.error().to_string(), e.into_guard()),
    };
    srv.resume();
    let check = guard.check();
    assert!(
        check.is_ok() || e == check.as_ref().unwrap_err().to_string(),
        "the upgrade said \"{e}\" but the guard says {check:?}"
    );
    drop(guard);
    let other = stall_client(&srv);
    let w = other.rwlock("upgrade").try_write_for(secs(5));
    assert!(
        w.is_ok(),
        "a writer after the upgrader left: {:?}",
        w.map(drop)
    );
}

/// The ACL user the holders of the `AUTH` tests log in as.
const USER: &str = "locker";

/// A server with [`USER`] (password `pw-1`), and a client of it logged in as that user
/// whose leases of 3 s are renewed every 500 ms: a renewal that fails is retried every
/// 125 ms, without backing off.
fn logged_in() -> (RedisServer, LockClient) {
    let srv = RedisServer::builder()
        .acl_user(USER, "pw-1", "~* &* +@all")
        .start();
    let c = lock_client!(
        node(srv.url_as(USER, "pw-1")),
        key_prefix(PREFIX),
        lease(secs(3)),
        renew_interval(ms(500))
    );
    (srv, c)
}

/// Sets [`USER`]'s password to `password` and drops the user's connections: the client's
/// next calls log in again.
fn set_password(srv: &RedisServer, password: &str) {
    let mut admin = srv.conn();
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg(USER)
        .arg("resetpass")
        .arg(format!(">{password}"))
        .query::<()>(&mut admin)
        .expect("ACL SETUSER");
    redis::cmd("CLIENT")
        .arg("KILL")
        .arg("USER")
        .arg(USER)
        .query::<i64>(&mut admin)
        .expect("CLIENT KILL USER");
}

/// A holder whose password was changed under it: every renewal is refused at `AUTH`, and
/// no retry can help until an operator puts the password back. The retries back off
/// rather than log in and fail every few milliseconds until the lease ends, and the
/// holder is still told the lock is lost when its validity ends by the local clock.
#[test]
fn renewals_refused_at_auth_back_off_and_the_holder_is_told_on_time() {
    let (srv, c) = logged_in();
    let guard = c.lock("refused").expect("lock");
    set_password(&srv, "pw-2");
    srv.reset_stats();
    let due = guard.valid_until();
    let told = guard.lost().recv_timeout(LIVENESS).expect("told");
    let late = Instant::now().saturating_duration_since(due);
    let auths = srv.command_count("auth");
    eprintln!("{auths} AUTH refused; told {late:?} after the end");
    assert_eq!(told, LostReason::Expired);
    assert!(late < secs(1), "told {late:?} after the hold's end");
    // About 2.5 s of retries: 20 at the renewal's retry interval, 8 backing off.
    assert!(
        auths <= 10,
        "{auths} AUTH refused in the 2.5 s before the lease ended"
    );
}

/// The password is put back while the renewals back off: a retry still comes before the
/// lease ends, and the lock is kept.
#[test]
fn a_password_put_back_before_the_lease_ends_keeps_the_lock() {
    let (srv, c) = logged_in();
    let guard = c.lock("put-back").expect("lock");
    let due = guard.valid_until();
    set_password(&srv, "pw-2");
    thread::sleep(ms(1500));
    set_password(&srv, "pw-1");
    thread::sleep(due.saturating_duration_since(Instant::now()) + ms(300));
    guard.check().expect("renewed once the password was back");
    assert!(guard.valid_until() > due, "never renewed");
    assert!(guard.unlock().expect("unlock").was_held());
}

/// A write hold downgraded to a read hold with `replica_ack` set after the replica went
/// away: the read hold, which replaced the write hold on the master alone, is not trusted
/// for longer than the acknowledged write hold was (a failover would bring back the write
/// hold, which then expires and lets a writer in while the reader reads on).
#[test]
fn a_downgrade_no_replica_acknowledged_is_trusted_no_longer_than_the_write_hold() {
    let master = RedisServer::start();
    let replica = master.start_replica();
    let c = lock_client!(
        node(master.url()),
        key_prefix(PREFIX),
        lease(secs(3)),
        replica_ack(1, ms(100))
    );
    let w = c.rwlock("downgrade").write().expect("acknowledged write");
    replica.kill();
    wait_for(LIVENESS, "the master without its replica", || {
        master.info("replication").contains("connected_slaves:0")
    });
    let acknowledged = w.valid_until();
    let r = w.downgrade().expect("downgrade");
    assert!(
        r.valid_until() <= acknowledged,
        "the read hold is trusted {:?} past the acknowledged write hold",
        r.valid_until().saturating_duration_since(acknowledged)
    );
}
