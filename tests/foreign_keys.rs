//! The library's keys holding a value of another type or shape: another program's key that
//! collides with a lock's key names, a key an operator edited by hand, a key left by an
//! older layout.
//!
//! Redis does not undo a script's writes when a later command of it fails, so no script
//! may fail after it wrote. What this file pins down:
//!
//! * An attempt that meets such a key fails with the server's `WRONGTYPE` error (an
//!   `Error::Redis`, as `bad_input.rs` has it for the fence counter; `WrongKind` for the
//!   lock key itself) having written nothing, and without waiting.
//! * A release, a leave, an upgrade or a downgrade does what is its own: it treats a
//!   waiters' key of another type (the fair queue `:q`, `:qx`, the marks `:ww`, `:wr`,
//!   the nonces `:qn`) as holding nobody, and wakes whoever waits, whose own attempts
//!   then meet the key. The nonces are hints: a nonce set of another type makes grants
//!   wake-ups, which their waiter's next attempt confirms.
//! * The foreign value is left as it was.
//!
//! Every client is patient (a minute's lease and re-check): a waiter that gets in within
//! the tests' bounds of a few seconds was woken by a release, not by a lease running out.

use std::collections::BTreeMap;
use std::thread;
use std::time::Instant;

use redbaton::{Error, LockClient, Unlocked};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, secs, test_server};

fn client(srv: &RedisServer) -> LockClient {
    lock_client!(node(srv.url()), patient())
}

/// A key of the default prefix: `redbaton:{name}` and `suffix`.
fn key(name: &str, suffix: &str) -> String {
    format!("redbaton:{{{name}}}{suffix}")
}

/// Another program's value at `key`: a string where the library keeps sorted sets, a
/// hash where it keeps strings.
fn foreign(srv: &RedisServer, key: &str) {
    let zset = [":q", ":qx", ":qn", ":ww", ":wr"]
        .iter()
        .any(|s| key.ends_with(s));
    let mut conn = srv.conn();
    let () = redis::cmd("DEL").arg(key).query(&mut conn).expect("DEL");
    let () = if zset {
        redis::cmd("SET").arg(key).arg("not ours").query(&mut conn)
    } else {
        redis::cmd("HSET")
            .arg(key)
            .arg("f")
            .arg("v")
            .query(&mut conn)
    }
    .expect("the foreign value");
}

/// `key` still holds the value [`foreign`] wrote, with no TTL.
fn untouched(srv: &RedisServer, key: &str) {
    let mut conn = srv.conn();
    let ty: String = redis::cmd("TYPE").arg(key).query(&mut conn).expect("TYPE");
    assert!(ty == "string" || ty == "hash", "{key} is now a {ty}");
    assert_eq!(
        redbaton_testkit::pttl(&mut conn, key),
        -1,
        "{key} got a TTL"
    );
}

/// Every key of the server: its type, its serialized value, and whether it has a TTL.
fn snapshot(srv: &RedisServer) -> BTreeMap<String, (String, Vec<u8>, bool)> {
    let mut conn = srv.conn();
    srv.keys("*")
        .into_iter()
        .map(|k| {
            let ty: String = redis::cmd("TYPE").arg(&k).query(&mut conn).expect("TYPE");
            let dump: Vec<u8> = redis::cmd("DUMP").arg(&k).query(&mut conn).expect("DUMP");
            let ttl = redbaton_testkit::pttl(&mut conn, &k) >= 0;
            (String::from_utf8_lossy(&k).into_owned(), (ty, dump, ttl))
        })
        .collect()
}

/// The keys of `name` but its fence counter and `except`.
fn left_of(srv: &RedisServer, name: &str, except: &str) -> Vec<String> {
    let mut left = srv.keys_but_fences(&key(name, "*"));
    left.retain(|k| *k != key(name, except));
    left
}

/// The server's `WRONGTYPE`, as a Redis error (not a connection error).
fn is_wrongtype(e: &Error) -> bool {
    e.redis_error()
        .is_some_and(|r| r.to_string().contains("WRONGTYPE"))
        && !e.is_connection()
}

/// Waits until the waiter of `c` is marked in `set` (its mark, or its queue entry) and
/// asleep: it failed its first attempt and the one after its subscription was confirmed
/// (`c` had failed `before` attempts until then), and the reply to the second was read.
/// Its next attempt is the one a release makes: a key changed now is met by no attempt
/// before the release.
fn asleep(srv: &RedisServer, set: &str, c: &LockClient, before: u64) {
    wait_for(secs(5), &format!("a waiter in {set}"), || {
        srv.zcard(set) >= 1
    });
    wait_for(secs(5), "the waiter's attempt after subscribing", || {
        c.stats().failed_attempts >= before + 2
    });
    thread::sleep(ms(200));
}

/// A hold taken is given back, which must say it was released: whether the hold before it
/// ended without a release.
fn give_back<G>(
    got: Result<G, Error>,
    lost: impl Fn(&G) -> bool,
    unlock: impl Fn(G) -> Result<Unlocked, Error>,
) -> Result<bool, Error> {
    let g = got?;
    let was = lost(&g);
    assert_eq!(unlock(g)?, Unlocked::Released);
    Ok(was)
}

/// Runs `wait` (a waiter of `c` that takes the hold and gives it back, see [`give_back`])
/// in a thread; once it is asleep in `set`, writes another program's value at
/// `overwritten` and runs `release` (the hold in the waiter's way), which must say it
/// released: what the waiter got. The value is left as [`foreign`] wrote it.
fn release_past(
    srv: &RedisServer,
    (set, overwritten): (&str, &str),
    c: &LockClient,
    release: impl FnOnce() -> Result<Unlocked, Error>,
    wait: impl FnOnce() -> Result<bool, Error> + Send,
) -> Result<bool, Error> {
    let before = c.stats().failed_attempts;
    let got = thread::scope(|s| {
        let waiter = s.spawn(wait);
        asleep(srv, set, c, before);
        foreign(srv, overwritten);
        let released = release();
        assert!(
            matches!(released, Ok(Unlocked::Released)),
            "{overwritten}: {released:?}"
        );
        waiter.join().expect("the waiter")
    });
    untouched(srv, overwritten);
    got
}

/// A fair release while a waiter is queued and one of the queue's keys holds another
/// program's value gives the lock back (it used to fail, after it wrote or before it
/// released, and the lock stayed held for its whole lease). Nonces of another type: the
/// waiter is granted the lock (a wake-up, which its attempt confirms). Expiries of another
/// type: its entry, which nobody can refresh, is dropped, and its next attempt takes the
/// free lock. A queue of another type: its next attempt fails at once.
#[test]
fn a_fair_release_gives_the_lock_back_past_foreign_queue_keys() {
    let srv = test_server();
    let (a, b) = (client(&srv), client(&srv));
    for suffix in [":qn", ":qx", ":q"] {
        let name = format!("f{suffix}");
        let held = a.lock(&name).expect("a takes it");
        let sets = (key(&name, ":q"), key(&name, suffix));
        let got = release_past(
            &srv,
            (&sets.0, &sets.1),
            &b,
            || held.unlock(),
            || {
                let got = b.try_lock_for(&name, secs(5));
                give_back(got, |g| g.previous_lost(), |g| g.unlock())
            },
        );
        match suffix {
            ":q" => assert!(got.as_ref().is_err_and(is_wrongtype), "{suffix}: {got:?}"),
            _ => assert!(matches!(got, Ok(false)), "{suffix}: {got:?}"),
        }
        let left = left_of(&srv, &name, suffix);
        assert!(left.is_empty(), "{suffix}: {left:?}");
    }
}

/// Which hold waits behind another in [`freed_past_foreign_marks`].
#[derive(Clone, Copy)]
enum Marked {
    /// A writer behind a read hold of a read-write lock.
    Writer,
    /// A permit-seeker behind the only permit of a semaphore.
    PermitSeeker,
}

/// A hold of `name` (as `kind` says) is released while a waiter of another client sleeps
/// with its mark in the name's set of waiting marks (`:ww`), which another program
/// overwrote: the release must say it released, and the waiter, woken, must get the hold
/// (and be told of no loss). The server and the first client, for what the test checks
/// next.
fn freed_past_foreign_marks(name: &str, kind: Marked) -> (RedisServer, LockClient) {
    let srv = test_server();
    let (a, b) = (client(&srv), client(&srv));
    let ww = key(name, ":ww");
    let got = match kind {
        Marked::Writer => {
            let read = a.rwlock(name).read().expect("read");
            release_past(
                &srv,
                (&ww, &ww),
                &b,
                || read.unlock(),
                || {
                    let got = b.rwlock(name).try_write_for(secs(5));
                    give_back(got, |w| w.previous_lost(), |w| w.unlock())
                },
            )
        }
        Marked::PermitSeeker => {
            let permit = a.semaphore(name, 1).acquire().expect("permit");
            release_past(
                &srv,
                (&ww, &ww),
                &b,
                || permit.unlock(),
                || {
                    let got = b.semaphore(name, 1).try_acquire_for(secs(5));
                    give_back(got, |_| false, |p| p.unlock())
                },
            )
        }
    };
    assert!(matches!(got, Ok(false)), "{name}: {got:?}");
    (srv, a)
}

/// A read-write lock whose set of waiting writers another program overwrote: the release
/// of the last read hold frees the lock and wakes the writer (it used to fail after taking
/// the read hold out), whose attempt takes the write hold though it cannot take its mark
/// out of that set (it used to fail after taking the hold and marking the fence counter
/// held, which told the next writer of a loss that never was).
#[test]
fn a_writer_whose_mark_was_overwritten_is_woken_and_takes_the_lock() {
    let (srv, a) = freed_past_foreign_marks("rw", Marked::Writer);
    let w = a.rwlock("rw").try_write().expect("free");
    assert!(!w.previous_lost(), "the write hold before was released");
    w.unlock().expect("unlock");
    // The writer's nonce, which it takes out with its mark, which it could not find: it
    // lingers as a stale mark does, until its TTL.
    let left = left_of(&srv, "rw", ":ww");
    let mut conn = srv.conn();
    assert!(
        left.iter()
            .all(|k| k.ends_with(":qn") && redbaton_testkit::pttl(&mut conn, k) > 0),
        "{left:?}"
    );
}

/// The same for a semaphore: its freed permit goes to the permit-seeker whose mark was
/// overwritten (woken, it takes it), and the release says it was done.
#[test]
fn a_permit_freed_past_a_foreign_waiting_set_is_taken() {
    let (srv, _) = freed_past_foreign_marks("s", Marked::PermitSeeker);
    let left = left_of(&srv, "s", ":ww");
    assert!(left.is_empty(), "{left:?}");
}

/// An upgrade and a downgrade with both waiting sets another program's: each converts the
/// hold in one script (they used to fail after converting it: the upgrade's write hold
/// then given back with its counter left held, the downgrade's read hold left to its
/// lease), and the next writer is told of no loss.
#[test]
fn conversions_go_through_foreign_waiting_sets() {
    let srv = test_server();
    let c = client(&srv);
    let rw = c.rwlock("u");
    let up = rw.upgradable_read().expect("upgradable");
    foreign(&srv, &key("u", ":ww"));
    foreign(&srv, &key("u", ":wr"));
    let w = up.upgrade().expect("upgraded");
    assert!(!w.previous_lost());
    let r = w.downgrade().expect("downgraded");
    assert_eq!(r.unlock().expect("unlock"), Unlocked::Released);
    let w = rw.try_write().expect("free");
    assert!(!w.previous_lost(), "every hold before was released");
    w.unlock().expect("unlock");
    untouched(&srv, &key("u", ":ww"));
    untouched(&srv, &key("u", ":wr"));
}

/// Renewals (`EXTEND`), an explicit extend and the release of a plain lock whose mark and
/// lease record hold other values: the hold is kept and released as any other (its lease
/// record, its own key, is written over and goes with it).
#[test]
fn a_plain_lock_is_renewed_and_released_past_foreign_side_keys() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), fair(false), lease(ms(600)));
    foreign(&srv, &key("p", ":w"));
    foreign(&srv, &key("p", ":lease"));
    let g = c.lock("p").expect("lock");
    // Renewed every third of the lease: past two leases, only renewals kept it.
    thread::sleep(ms(1300));
    g.check().expect("renewed");
    g.extend(secs(2)).expect("extended");
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    let left = left_of(&srv, "p", ":w");
    assert!(left.is_empty(), "{left:?}");
}

/// Attempts that meet a key of another type before they write fail at once with the
/// server's error (or `WrongKind` for a latch's key), and leave Redis exactly as it was,
/// the waiters among them included (their mark or queue entry is the key they met).
#[test]
fn attempts_that_meet_a_foreign_key_fail_having_written_nothing() {
    type Attempt<'a> = Box<dyn Fn() -> Result<(), Error> + 'a>;
    let srv = test_server();
    let (holder, c) = (client(&srv), client(&srv));
    let _lock = holder.lock("held").expect("lock");
    let _read = holder.rwlock("read").read().expect("read");
    let _write = holder.rwlock("write").write().expect("write");
    let _permit = holder.semaphore("full", 1).acquire().expect("permit");
    holder.lock("m1").expect("m1").unlock().expect("unlock");
    let wait = ms(300);
    let cases: Vec<(String, Attempt<'_>)> = vec![
        // The fair queue is read before anything is written, even by a free lock's attempt.
        (key("free", ":q"), Box::new(|| c.try_lock("free").map(drop))),
        (
            key("held", ":qx"),
            Box::new(|| c.try_lock_for("held", wait).map(drop)),
        ),
        // A waiter's mark is its first write.
        (
            key("read", ":ww"),
            Box::new(|| c.rwlock("read").try_write_for(wait).map(drop)),
        ),
        (
            key("write", ":wr"),
            Box::new(|| c.rwlock("write").try_read_for(wait).map(drop)),
        ),
        (
            key("full", ":ww"),
            Box::new(|| c.semaphore("full", 1).try_acquire_for(wait).map(drop)),
        ),
        // Waiting writers are read before a read hold is taken.
        (
            key("r", ":ww"),
            Box::new(|| c.rwlock("r").try_read().map(drop)),
        ),
        // A multi-lock whose second counter cannot issue a fence takes neither lock, and
        // leaves the first one's counter as it was: none, or the one of an earlier hold.
        (
            key("m2", ":fence"),
            Box::new(|| c.try_multi_lock(["m0", "m2"]).map(drop)),
        ),
        (
            key("m2", ":fence"),
            Box::new(|| c.try_multi_lock(["m1", "m2"]).map(drop)),
        ),
        (
            key("l", ":latch"),
            Box::new(|| c.latch("l", 2).count_down().map(drop)),
        ),
    ];
    for (key, attempt) in cases {
        let key = key.as_str();
        foreign(&srv, key);
        let before = snapshot(&srv);
        let started = Instant::now();
        let e = attempt().expect_err(key);
        assert!(
            started.elapsed() < secs(3),
            "{key}: took {:?}",
            started.elapsed()
        );
        if key.ends_with(":latch") {
            assert!(e.is_wrong_kind(), "{key}: {e:?}");
        } else {
            assert!(is_wrongtype(&e), "{key}: {e:?}");
        }
        let after = snapshot(&srv);
        let changed: Vec<&String> = before
            .keys()
            .chain(after.keys())
            .filter(|k| before.get(*k) != after.get(*k))
            .collect();
        assert!(changed.is_empty(), "{key}: written {changed:?}");
    }
}
