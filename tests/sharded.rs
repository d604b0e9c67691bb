//! Sharded pub/sub for the library's channel: on Redis 7 the scripts publish with
//! `SPUBLISH` and the subscriber listens with `SSUBSCRIBE`, on one node and in a Cluster
//! (where the channel shares the lock's slot); a waiter whose slot moves to another master
//! follows it and is woken by the next release there; a server without the command (here:
//! renamed away) gets classic `PUBLISH`/`SUBSCRIBE`, and waiters are woken the same.
//!
//! What travels over which kind is read from the server: `INFO commandstats` (script-
//! internal calls included), `PUBSUB SHARDNUMSUB`/`NUMSUB`, and `CLIENT LIST`.

use std::thread;
use std::time::{Duration, Instant};

use redbaton::{LockClient, Unlocked};
use redbaton_testkit::binaries::ServerVersion;
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::lock_builder;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::test_server;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{init_log, ms, secs};

const KEYS: Keys = Keys::DEFAULT;

/// The library channel of lock `name`.
fn channel(name: &str) -> String {
    format!("{}:ev", KEYS.lock(name))
}

/// The library channel's kind on a server, as a test expects it: a shard channel where
/// the server has sharded pub/sub (Redis 7), else the documented fallback, a classic one.
#[derive(Clone, Copy)]
struct Kind {
    /// How a waiter's subscription shows: `(shard, classic)` subscribers.
    subscribed: (i64, i64),
    /// The command a release publishes with.
    publish: &'static str,
    /// The command it must never use.
    never: &'static str,
}

const SHARDED: Kind = Kind {
    subscribed: (1, 0),
    publish: "spublish",
    never: "publish",
};
const CLASSIC: Kind = Kind {
    subscribed: (0, 1),
    publish: "publish",
    never: "spublish",
};

/// What `srv` supports, said on stderr so that a run shows which path it checked.
fn kind_on(srv: &RedisServer) -> Kind {
    kind_of(srv.version())
}

/// What the servers the tests start support.
fn kind() -> Kind {
    kind_of(&redbaton_testkit::binaries::server_version().expect("server version"))
}

fn kind_of(version: &ServerVersion) -> Kind {
    if version.at_least(7, 0) {
        eprintln!("{version}: checking shard channels");
        SHARDED
    } else {
        eprintln!("{version}: no sharded pub/sub, checking the classic fallback");
        CLASSIC
    }
}

/// Subscribers of `channel` on `srv`: `(sharded, classic)` (no shard channels before
/// Redis 7).
fn subscribers(srv: &RedisServer, channel: &str) -> (i64, i64) {
    let sharded = srv.version().at_least(7, 0);
    let mut conn = srv.conn();
    let mut count = |sub: &str| -> i64 {
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg(sub)
            .arg(channel)
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("PUBSUB {sub}: {e}"));
        n
    };
    let shard = if sharded { count("SHARDNUMSUB") } else { 0 };
    (shard, count("NUMSUB"))
}

/// A thread that waits for `name` (held now) and sends when it got it.
fn waiter(client: &LockClient, name: &str) -> std::sync::mpsc::Receiver<Instant> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (client, name) = (client.clone(), name.to_owned());
    thread::spawn(move || {
        let g = client
            .try_lock_for(&name, secs(30))
            .expect("the waiter's lock");
        let _ = tx.send(Instant::now());
        g.unlock().expect("the waiter's unlock");
    });
    rx
}

/// Where a waiter's subscription to the library's channel shows, as how many (shard,
/// classic) subscribers, and where the release publishes, with which command.
struct Expect<'a> {
    subscribed_on: &'a RedisServer,
    subscribed: (i64, i64),
    released_on: &'a RedisServer,
    publish: &'static str,
}

/// `holder` takes `name`; a thread of `other` waits for it until `expect` shows its
/// subscription and it has failed twice (its first attempt fails before it subscribes, the
/// second once subscribed: only then does it sleep on events, with its contention mark
/// published); `meanwhile` runs;
/// the release must then publish as `expect` says and wake the waiter by that event, not
/// by its lease or re-check timers. Returns how long after the release it got the lock.
fn release_wakes_the_waiter(
    holder: &LockClient,
    other: &LockClient,
    name: &str,
    expect: Expect<'_>,
    meanwhile: impl FnOnce(),
) -> Duration {
    let g = holder.lock(name).expect("lock");
    let got = waiter(other, name);
    wait_for(secs(10), "the waiter's subscription and attempt", || {
        subscribers(expect.subscribed_on, &channel(name)) == expect.subscribed
            && other.stats().failed_attempts >= 2
    });
    meanwhile();
    let published = expect.released_on.command_count(expect.publish);
    assert!(!g.is_lost(), "{name}: still held");
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    let released = Instant::now();
    let at = got.recv_timeout(secs(10)).expect("the waiter is woken");
    let after = at.duration_since(released);
    let s = other.stats();
    eprintln!("{name}: woken {after:?} after the release; waiter stats {s:?}");
    assert!(
        expect.released_on.command_count(expect.publish) > published,
        "{name}: the release's message went by {}",
        expect.publish
    );
    assert!(s.wakeups_event >= 1, "{name}: {s:?}");
    assert_eq!(s.wakeups_lease + s.wakeups_recheck, 0, "{name}: {s:?}");
    after
}

/// On one server, what a waiter's subscription shows and its release publishes with.
fn on(srv: &RedisServer, kind: Kind) -> Expect<'_> {
    Expect {
        subscribed_on: srv,
        subscribed: kind.subscribed,
        released_on: srv,
        publish: kind.publish,
    }
}

/// A client from `b` without keyspace events (the library's channel is what wakes
/// waiters) and with its timers far off.
fn build(b: redbaton::Builder, fair: bool) -> LockClient {
    b.configure_notifications(false)
        .recheck_interval(secs(60))
        .lease(secs(30))
        .fair(fair)
        .build()
        .expect("build")
}

fn node_client(url: &str, fair: bool) -> LockClient {
    build(lock_builder!(node(url)), fair)
}

/// One node: the waiter subscribes to the shard channel, and the release's message (the
/// fair queue's grant) arrives over it; nothing is published the classic way.
#[test]
fn smoke() {
    let srv = test_server();
    let kind = kind_on(&srv);
    let (holder, other) = (node_client(&srv.url(), true), node_client(&srv.url(), true));
    release_wakes_the_waiter(&holder, &other, "s", on(&srv, kind), || {});
    assert_eq!(other.stats().grants_received, 1);
    assert_eq!(srv.command_count(kind.never), 0);
}

/// The same without `SPUBLISH` on the server (renamed away, as an operator might, or as
/// on Redis 6): the scripts publish with `PUBLISH`, the subscriber uses `SUBSCRIBE`, and
/// the waiter is woken the same way.
#[test]
fn without_spublish_the_channel_is_classic() {
    init_log();
    // Redis 6.2 has no SPUBLISH to rename: the fallback is its natural path there.
    let mut b = RedisServer::builder();
    if kind().publish == "spublish" {
        b = b.config("rename-command", "SPUBLISH \"\"");
    }
    let srv = b.start();
    let (holder, other) = (
        node_client(&srv.url(), false),
        node_client(&srv.url(), false),
    );
    release_wakes_the_waiter(&holder, &other, "c", on(&srv, CLASSIC), || {});
    assert_eq!(srv.command_count("spublish"), 0);
}

/// A user of Redis 7 with the shard-channel commands and none of the classic ones:
/// locks, marks and wake-ups all work over shard channels. (Redis 6.2 has no shard
/// channels: there the same user gets the classic commands, the fallback's.)
#[test]
fn an_acl_user_with_shard_channels_only() {
    init_log();
    let kind = kind();
    let channel_commands = if kind.publish == "spublish" {
        "+spublish +ssubscribe +sunsubscribe"
    } else {
        "+publish +subscribe +unsubscribe"
    };
    let rules = format!(
        "resetkeys ~redbaton:* resetchannels &redbaton:* -@all \
         +evalsha +script|load +get +set +del +pexpire +pttl +incr \
         +exists +time +zadd +zrem +zrange +zrangebyscore +zcard +zscore \
         {channel_commands} +ping +client|setname"
    );
    let srv = RedisServer::builder()
        .acl_user("locker", "lockerpw", &rules)
        .start();
    let url = srv.url_as("locker", "lockerpw");
    let (holder, other) = (node_client(&url, true), node_client(&url, true));
    release_wakes_the_waiter(&holder, &other, "acl", on(&srv, kind), || {});
}

fn cluster_client(cluster: &Cluster, fair: bool) -> LockClient {
    let b = lock_builder!(cluster(cluster.seed_urls()), io_timeouts(ms(1000)));
    build(b, fair)
}

/// Calls of `cmd` on every node of the cluster.
fn calls(cluster: &Cluster, cmd: &str) -> u64 {
    cluster
        .servers
        .iter()
        .filter(|s| s.is_running())
        .map(|s| s.command_count(cmd))
        .sum()
}

/// In a Cluster the library's channel is in the lock's slot, and the script that runs on
/// the slot's master publishes on it with `SPUBLISH` (allowed in a script: the channel
/// hashes to the slot of the script's keys). A waiter is woken by the fair queue's grant,
/// and without the queue by the release's `r`; no classic `PUBLISH` anywhere.
#[test]
fn cluster_waiters_are_woken_over_shard_channels() {
    init_log();
    let cluster = Cluster::start();
    for (fair, name) in [(true, "grant"), (false, "release")] {
        let key = KEYS.lock_bytes(name.as_bytes());
        assert_eq!(
            cluster.keyslot(channel(name).as_bytes()),
            cluster.keyslot(&key),
            "{name}: the channel shares the lock's slot"
        );
        let master = cluster.master_of(&key);
        let kind = kind_on(master);
        let (holder, other) = (
            cluster_client(&cluster, fair),
            cluster_client(&cluster, fair),
        );
        release_wakes_the_waiter(&holder, &other, name, on(master, kind), || {});
        assert_eq!(other.stats().grants_received, u64::from(fair), "{name}");
        assert_eq!(calls(&cluster, kind.never), 0, "{name}: no {}", kind.never);
    }
}

/// A thread waits for a lock whose slot then moves to another master (`SETSLOT …
/// MIGRATING/IMPORTING`, `MIGRATE`, `SETSLOT … NODE`). The old master drops the waiter's
/// shard subscription; the waiter follows the slot, subscribes on the new master, and is
/// woken by the next release there: not by its lease or re-check timers (30 s, 60 s).
#[test]
fn cluster_waiter_follows_a_moved_slot() {
    init_log();
    let cluster = Cluster::start();
    for (fair, name) in [(true, "moving-fair"), (false, "moving")] {
        let slot = cluster.keyslot(&KEYS.lock_bytes(name.as_bytes()));
        let from = cluster.owner(slot);
        let to = cluster.other_master(from);
        let kind = kind_on(cluster.server(from));
        let sharded = kind.publish == "spublish";
        let (holder, other) = (
            cluster_client(&cluster, fair),
            cluster_client(&cluster, fair),
        );
        let expect = Expect {
            subscribed_on: cluster.server(from),
            subscribed: kind.subscribed,
            released_on: cluster.server(to),
            publish: kind.publish,
        };
        let after = release_wakes_the_waiter(&holder, &other, name, expect, || {
            let attempts = other.stats().failed_attempts;
            cluster.move_slot(slot, to);
            eprintln!("{name}: slot {slot} {from} -> {to}");
            if !sharded {
                // A classic message is broadcast to every node: the subscription on the
                // old master still hears the release on the new one.
                thread::sleep(ms(200));
                return;
            }
            wait_for(
                secs(10),
                "the waiter's subscription and attempt there",
                || {
                    subscribers(cluster.server(to), &channel(name)) == (1, 0)
                        && other.stats().failed_attempts > attempts
                },
            );
            assert_eq!(subscribers(cluster.server(from), &channel(name)), (0, 0));
            // Its next attempt there, if the map had to learn the move first, follows at
            // once: let its contention mark go out before the release is counted.
            thread::sleep(ms(200));
        });
        assert!(after < secs(5), "{name}: {after:?}");
        if sharded {
            assert!(other.stats().wakeups_moved >= 1, "{name}");
        }
        assert_eq!(calls(&cluster, kind.never), 0, "{name}: no {}", kind.never);
    }
}
