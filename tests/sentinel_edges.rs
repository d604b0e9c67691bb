//! The Sentinel watcher at the edges of what production brings: which sentinel it listens
//! to for `+switch-master` (one that knows the master, one that still answers), every
//! sentinel down while the master is fine, its subscription killed, a shutdown while it
//! waits on sentinels that answer nothing, sentinels that disagree after a failover (the
//! later configuration wins, and a waiter follows it), a sentinel user allowed only the
//! master's address, a master announced by hostname, and wrong credentials on either
//! side. Each test has a master and sentinels of its own that never fail the master over
//! by themselves; what is checked is where the client is connected and that its calls
//! go on.

use std::time::Instant;

use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{RedisServer, RedisServerBuilder};
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{init_log, lock_client, ms, secs};

const NAME: &str = "edges";

/// A sentinel that names the server at `port` the master of [`NAME`] (quorum 1), and
/// calls it down only after a minute: never within a test. `builder` says how the
/// sentinel is started (a password of its own, hostnames), `more` adds `sentinel`
/// directives.
fn watching(port: u16, builder: RedisServerBuilder, more: &[String]) -> RedisServer {
    watching_at("127.0.0.1", port, builder, more)
}

/// [`watching`] the server at `host` (a name, or an IP address) and `port`.
fn watching_at(host: &str, port: u16, builder: RedisServerBuilder, more: &[String]) -> RedisServer {
    let lines = [
        format!("monitor {NAME} {host} {port} 1"),
        format!("down-after-milliseconds {NAME} 60000"),
    ];
    (lines.iter().chain(more))
        .fold(builder.sentinel(), |b, line| b.config("sentinel", line))
        .start()
}

/// A master of its own, and `n` sentinels ([`watching`]) that name it.
fn watched(n: usize) -> (RedisServer, Vec<RedisServer>) {
    init_log();
    let m = RedisServer::start();
    let sentinels = (0..n)
        .map(|_| watching(m.port(), RedisServer::builder(), &[]))
        .collect();
    (m, sentinels)
}

/// Links (proxies) to `targets`, and a client ([`client_of`]) through them that has
/// locked once.
fn linked(targets: &[std::net::SocketAddr]) -> (Vec<Proxy>, redbaton::LockClient) {
    let links: Vec<Proxy> = targets.iter().map(|t| Proxy::start(*t)).collect();
    let c = client_of(links.iter().map(Proxy::url).collect());
    drop(c.lock("k").expect("lock"));
    (links, c)
}

/// A client through the sentinels at `urls`, with short timeouts.
fn client_of(urls: Vec<String>) -> redbaton::LockClient {
    lock_client!(sentinel(NAME, urls), io_timeouts(ms(500)), fair(false))
}

/// The names of the connections subscribed on `server` (empty for one without a name),
/// asked on a connection of its own: a sentinel promoting a replica closes the harness's
/// connections to it.
fn subscribed(server: &RedisServer) -> Vec<String> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut server.conn())
        .unwrap_or_default();
    let clients = redbaton_testkit::server::parse_client_list(&list);
    (clients.into_iter())
        .filter(|c| c.get("sub").is_some_and(|n| n != "0"))
        .map(|mut c| c.remove("name").unwrap_or_default())
        .collect()
}

/// Whether a client's watcher listens on `server`: a subscription other than a
/// sentinel's own (sentinels subscribe on the servers they watch).
fn listened_to(server: &RedisServer) -> bool {
    subscribed(server)
        .iter()
        .any(|name| !name.starts_with("sentinel-"))
}

/// Whether a client's subscriber, which serves its waiters, is subscribed on `server`.
fn waits_on(server: &RedisServer) -> bool {
    subscribed(server).iter().any(|name| name == "redbaton:sub")
}

#[test]
fn smoke() {
    let (_m, sentinels) = watched(1);
    let c = client_of(vec![sentinels[0].url()]);
    c.lock("k").expect("lock").unlock().expect("unlock");
    wait_for(secs(10), "the watcher subscribed", || {
        listened_to(&sentinels[0])
    });
}

/// A sentinel whose ACL user may ask for the master's address, subscribe and ping, and
/// nothing more (no `SENTINEL MASTER`, whose configuration epoch the client reads when
/// it may): the client builds, locks and listens through it all the same.
#[test]
fn a_sentinel_user_allowed_only_the_address_is_enough() {
    init_log();
    let m = RedisServer::start();
    let rules = "+sentinel|get-master-addr-by-name +subscribe +ping &*";
    let s = watching(
        m.port(),
        RedisServer::builder().acl_user("locker", "locker-pw", rules),
        &[],
    );
    let c = client_of(vec![s.url_as("locker", "locker-pw")]);
    c.lock("k").expect("lock").unlock().expect("unlock");
    wait_for(secs(10), "the watcher subscribed", || listened_to(&s));
}

/// A sentinel that announces hostnames names the master `localhost`: the client takes
/// that address, locks there and listens to the sentinel.
#[test]
fn a_master_announced_by_hostname() {
    init_log();
    let m = RedisServer::start();
    let hostnames = RedisServer::builder()
        .config("sentinel", "resolve-hostnames yes")
        .config("sentinel", "announce-hostnames yes");
    let s = watching_at("localhost", m.port(), hostnames, &[]);
    let named: (String, u16) = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(NAME)
        .query(&mut s.conn())
        .expect("the master's address");
    assert_eq!(named, ("localhost".to_owned(), m.port()));
    let c = client_of(vec![s.url()]);
    assert!(lands_on(&c, "k", &m), "the lock is not on the master");
    wait_for(secs(10), "the watcher subscribed", || listened_to(&s));
}

/// The first sentinel listed is down, the second knows nothing of the master (an
/// instance not yet configured, or one that dropped it: it answers `nil` for the name),
/// and the third is no sentinel at all (the master itself, listed by mistake: it answers
/// `SENTINEL` with an error): `build()` asks on to the fourth, and the watcher listens
/// for `+switch-master` there too, not where this master's failover is never announced.
#[test]
fn the_watcher_listens_to_a_sentinel_that_knows_the_master() {
    let (m, good) = watched(1);
    let unaware = RedisServer::builder().sentinel().start();
    let c = client_of(vec![
        redbaton_testkit::dead_url(),
        unaware.url(),
        m.url(),
        good[0].url(),
    ]);
    drop(c.lock("k").expect("lock"));
    wait_for(
        secs(10),
        "the watcher listens to the sentinel that knows the master",
        || listened_to(&good[0]),
    );
    assert!(
        !listened_to(&unaware) && !listened_to(&m),
        "the watcher also listens where the master's failover is never announced"
    );
}

/// The sentinel the watcher listens to stops (SIGSTOP: its connections stay open and
/// nothing is answered, as in a silent partition). The watcher notices within a few
/// seconds and listens to the other sentinel, rather than waiting on the hung one for a
/// failover message that can never come.
#[test]
fn the_watcher_leaves_a_hung_sentinel() {
    let (_m, sentinels) = watched(2);
    let [first, second] = &sentinels[..] else {
        unreachable!()
    };
    let c = client_of(vec![first.url(), second.url()]);
    wait_for(
        secs(10),
        "the watcher listens to the first sentinel",
        || listened_to(first),
    );
    first.pause();
    let moved = redbaton_testkit::wait::wait_until(secs(10), || listened_to(second));
    first.resume();
    assert!(
        moved,
        "10 s after the first sentinel hung, nobody listens to the second"
    );
    drop(c.lock("k").expect("lock"));
}

/// A hung sentinel (stopped: it accepts connections and answers nothing) first in the list
/// holds up no client's build: every sentinel is asked at once, and once one has named the
/// master the others are waited for only a moment, not for their timeouts (4 s here).
#[test]
fn a_hung_sentinel_holds_up_no_build() {
    let (m, sentinels) = watched(2);
    let [hung, good] = &sentinels[..] else {
        unreachable!()
    };
    hung.pause();
    let started = Instant::now();
    let built = lock_client!(
        sentinel(NAME, vec![hung.url(), good.url()]),
        io_timeouts(secs(4))
    );
    let took = started.elapsed();
    hung.resume();
    assert!(took < secs(3), "built in {took:?}");
    drop(built.lock("k").expect("lock on the master"));
    drop(m);
}

/// `CLIENT KILL` of the watcher's subscription: it subscribes again.
#[test]
fn the_watcher_subscribes_again_after_its_connection_is_killed() {
    let (_m, sentinels) = watched(1);
    let s = &sentinels[0];
    let c = client_of(vec![s.url()]);
    let before =
        redbaton_testkit::wait::eventually(secs(10), || s.subscribers().into_iter().next())
            .expect("the watcher subscribed");
    assert_eq!(s.kill_pubsub(), 1);
    wait_for(secs(10), "the watcher subscribed again", || {
        s.subscribers().iter().any(|id| *id != before)
    });
    drop(c.lock("k").expect("lock"));
}

/// Every sentinel goes down while the master is fine: calls go on against the master
/// the client knows, the watcher keeps trying without spinning (the sentinels sit behind
/// links that count the connections it opens), and once the sentinels are back it
/// listens again.
#[test]
fn calls_go_on_while_every_sentinel_is_down() {
    let (_m, sentinels) = watched(2);
    let (links, c) = linked(&sentinels.iter().map(RedisServer::addr).collect::<Vec<_>>());
    for s in &sentinels {
        s.kill();
    }
    let accepted = || links.iter().map(Proxy::connections_accepted).sum::<u64>();
    let before = accepted();
    let t0 = Instant::now();
    while t0.elapsed() < secs(3) {
        let g = c
            .try_lock_for("k", secs(2))
            .expect("a lock on the master while no sentinel answers");
        g.unlock().expect("unlock");
        std::thread::sleep(ms(100));
    }
    let tries = accepted() - before;
    // A pause of up to a second between rounds of a few connections each.
    assert!(tries < 100, "{tries} connections to dead sentinels in 3 s");
    for s in &sentinels {
        s.restart();
    }
    wait_for(secs(10), "the watcher listens again", || {
        sentinels.iter().any(listened_to)
    });
    drop(c.lock("k").expect("lock"));
}

/// `shutdown()` while every sentinel accepts connections and answers nothing, with the
/// watcher's subscription just broken: the watcher ends within a few read timeouts.
#[test]
fn shutdown_ends_a_watcher_waiting_on_hung_sentinels() {
    let (_m, sentinels) = watched(1);
    let (links, c) = linked(&[sentinels[0].addr(); 3]);
    for link in &links {
        link.blackhole(true);
        link.kill_all();
    }
    std::thread::sleep(ms(300));
    let t0 = Instant::now();
    let r = c.shutdown(secs(10));
    let took = t0.elapsed();
    assert!(r.is_ok(), "shutdown after {took:?}: {r:?}");
}

/// The password of the data servers in [`disagreeing`]: a sentinel without it learns
/// nothing from them.
const PASSWORD: &str = "edges-pw";
/// The password of the sentinel that knows of the failover: not the data servers'.
const SENTINEL_PASSWORD: &str = "edges-sentinel-pw";

/// Two sentinels that disagree after a failover. `a` is the master (it refuses to be
/// demoted, as if cut off from the sentinels but not from clients) and `b` its replica,
/// both behind [`PASSWORD`]. `good` watches them with the password and fails `a` over to
/// `b` on `SENTINEL FAILOVER`; `stale` has no password, so it never learns of the
/// failover (nor of `b`, nor of `good`): it goes on naming `a`, with the configuration
/// epoch it started with. `good` wants a password of its own, which its URL gives.
struct Disagreeing {
    a: RedisServer,
    b: RedisServer,
    stale: RedisServer,
    good: RedisServer,
}

fn disagreeing() -> Disagreeing {
    init_log();
    let a = RedisServer::builder()
        .password(PASSWORD)
        .config("rename-command", "REPLICAOF \"\"")
        .config("rename-command", "SLAVEOF \"\"")
        .start();
    let b = RedisServer::builder()
        .password(PASSWORD)
        .config("masterauth", PASSWORD)
        .config("replicaof", &format!("127.0.0.1 {}", a.port()))
        .start();
    wait_for(secs(20), "the replica in sync", || {
        b.info("replication").contains("master_link_status:up")
    });
    let stale = watching(a.port(), RedisServer::builder(), &[]);
    let good = watching(
        a.port(),
        RedisServer::builder().password(SENTINEL_PASSWORD),
        &[
            format!("auth-pass {NAME} {PASSWORD}"),
            format!("failover-timeout {NAME} 60000"),
        ],
    );
    Disagreeing { a, b, stale, good }
}

impl Disagreeing {
    /// The sentinels' URLs: `stale`, then `good`.
    fn urls(&self) -> Vec<String> {
        vec![self.stale.url(), self.good.url_with_auth()]
    }

    /// A client through [`urls`](Self::urls), with the data servers' password.
    fn client(&self) -> redbaton::LockClient {
        lock_client!(
            sentinel(NAME, self.urls()),
            sentinel_master_auth(None, PASSWORD),
            io_timeouts(ms(500)),
            fair(false)
        )
    }

    /// Moves every watcher listening to `stale` (the first sentinel listed, where they
    /// begin) to `good`, the one that will announce the failover.
    fn listen_to_good(&self, watchers: usize) {
        wait_for(
            secs(10),
            "the watchers listen to the first sentinel",
            || self.stale.subscribers().len() == watchers,
        );
        self.stale.kill_pubsub();
        wait_for(
            secs(10),
            "the watchers listen to the second sentinel",
            || self.good.subscribers().len() == watchers,
        );
    }

    /// `good` fails `a` over to `b` (asked again while it refuses: it may not yet count
    /// `b` as a good replica); waits until it names `b` and `b` is the master.
    fn fail_over(&self) {
        let asked = Instant::now();
        while redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(NAME)
            .query::<()>(&mut self.good.conn())
            .is_err()
        {
            assert!(asked.elapsed() < secs(30), "the failover refused for 30 s");
            std::thread::sleep(ms(100));
        }
        wait_for(
            secs(30),
            "b promoted and named by the good sentinel",
            || {
                self.b.info("replication").contains("role:master")
                    && redis::cmd("SENTINEL")
                        .arg("GET-MASTER-ADDR-BY-NAME")
                        .arg(NAME)
                        .query::<(String, u16)>(&mut self.good.conn())
                        .is_ok_and(|(_, port)| port == self.b.port())
            },
        );
    }
}

impl Disagreeing {
    /// A client built on `a`, listening to `good`, which has followed `good`'s failover to
    /// `b` (the old master still saying it is one).
    fn followed(&self) -> redbaton::LockClient {
        let x = self.client();
        assert!(
            lands_on(&x, "before", &self.a),
            "built on the master both name"
        );
        self.listen_to_good(1);
        self.fail_over();
        assert!(
            self.a.info("replication").contains("role:master"),
            "the old master still says it is one"
        );
        let followed = redbaton_testkit::wait::wait_until(secs(10), || x.stats().failovers >= 1);
        assert!(
            followed,
            "10 s after the switch was announced, the client is still on the old master"
        );
        assert!(
            lands_on(&x, "after", &self.b),
            "the client's lock on the new master"
        );
        x
    }
}

/// Whether the lock `name` taken by `c` is on `server`.
fn lands_on(c: &redbaton::LockClient, name: &str, server: &RedisServer) -> bool {
    let g = c.lock(name).expect("lock");
    let there = redbaton_testkit::exists(
        &mut server.conn(),
        redbaton_testkit::keys::Keys::DEFAULT.lock(name),
    );
    drop(g);
    there
}

/// After a failover one sentinel (listed first) still names the old master, which still
/// says it is one, while the other names the promoted replica. The sentinels' own rule
/// decides: the answer of the later configuration epoch wins, whatever the order of the
/// list. A client listening to the sentinel that announced the switch follows it; a
/// client built then goes to the new master; and the first client, when it looks again
/// (its subscription broken, it now asks the stale sentinel first and listens there),
/// does not go back to the old master.
#[test]
fn the_later_configuration_wins_over_a_stale_sentinel() {
    let d = disagreeing();
    let x = d.followed();
    let y = d.client();
    assert!(
        lands_on(&y, "built-after", &d.b),
        "a client built after the failover goes to the old master"
    );
    // The first client looks again, asking the stale sentinel first.
    d.good.kill_pubsub();
    wait_for(secs(10), "the watcher listens again", || {
        listened_to(&d.stale) || listened_to(&d.good)
    });
    std::thread::sleep(ms(500));
    assert!(
        lands_on(&x, "later", &d.b),
        "the client went back to the old master ({} failovers)",
        x.stats().failovers
    );
}

/// After a failover the new master stops answering this client (a pause here; a
/// partition between it and the client alike): the older configuration's answer, the old
/// master that still says it is one, is not taken instead, neither by a client built then
/// nor by one that looks again. A lock taken there would overlap those that the clients
/// which reach the new master take.
#[test]
fn an_older_answer_is_not_taken_while_the_latest_master_does_not_answer() {
    let d = disagreeing();
    let x = d.followed();
    let failovers = x.stats().failovers;
    d.b.pause();
    let built = redbaton_testkit::lock_builder!(
        sentinel(NAME, d.urls()),
        sentinel_master_auth(None, PASSWORD),
        io_timeouts(ms(500)),
        fair(false)
    )
    .build();
    let on_old = built.as_ref().ok().map(|y| {
        let g = y.try_lock_for("built-then", ms(500));
        let key = redbaton_testkit::keys::Keys::DEFAULT.lock("built-then");
        (g.is_ok(), redbaton_testkit::exists(&mut d.a.conn(), key))
    });
    // The first client looks again, asking the stale sentinel first.
    d.good.kill_pubsub();
    wait_for(secs(10), "the watcher listens again", || {
        listened_to(&d.stale) || listened_to(&d.good)
    });
    std::thread::sleep(secs(2));
    let later = x.try_lock_for("later", ms(500));
    let key = redbaton_testkit::keys::Keys::DEFAULT.lock("later");
    let later_on_old = redbaton_testkit::exists(&mut d.a.conn(), key);
    let moved = x.stats().failovers - failovers;
    d.b.resume();
    assert!(
        on_old.is_none_or(|(_, there)| !there),
        "a client built while the new master was paused took a lock on the old one: {on_old:?}"
    );
    assert!(
        !later_on_old && moved == 0,
        "the client went back to the old master ({moved} failovers; locked: {})",
        later.is_ok()
    );
}

/// A lock is held (acknowledged by the replica) and another client waits for it when
/// the master is failed over; the old master is never demoted, so nothing fails on it:
/// the announced switch alone moves both clients. The waiter's subscription moves to the
/// new master and the release there wakes it, long before its re-check or the holder's
/// lease could.
#[test]
fn a_waiter_wakes_on_the_new_master_after_an_announced_switch() {
    let d = disagreeing();
    // The new master has no replica (the old one refuses to become it): only the
    // holder, on the old master, asks for an acknowledgement.
    let patient = |acked: bool| {
        let b = redbaton_testkit::lock_builder!(
            sentinel(NAME, d.urls()),
            sentinel_master_auth(None, PASSWORD),
            io_timeouts(ms(500)),
            fair(false),
            lease(secs(60)),
            recheck_interval(secs(60))
        );
        let b = if acked { b.replica_ack(1, ms(200)) } else { b };
        b.build().expect("build")
    };
    let (holder, waiter) = (patient(true), patient(false));
    let g = holder
        .try_lock_for("w", secs(10))
        .expect("an acknowledged lock");
    d.listen_to_good(2);
    std::thread::scope(|scope| {
        let waiting = scope.spawn(|| {
            let got = waiter.try_lock_for("w", secs(20));
            let key = redbaton_testkit::keys::Keys::DEFAULT.lock("w");
            got.map(|g| {
                (
                    g.fencing_token(),
                    redbaton_testkit::exists(&mut d.b.conn(), key),
                )
            })
        });
        wait_for(secs(10), "the waiter subscribed on the old master", || {
            waits_on(&d.a)
        });
        d.fail_over();
        wait_for(
            secs(10),
            "the waiter's subscription on the new master",
            || waits_on(&d.b),
        );
        let token = g.fencing_token();
        assert!(g.unlock().expect("unlock on the new master").was_held());
        let got = waiting.join().expect("waiter");
        let (next, on_new) = got.expect("the waiter takes the lock");
        assert!(on_new, "the waiter's lock is not on the new master");
        assert!(next > token, "tokens {token} then {next}");
    });
}

/// Credentials that are wrong are `is_auth()` at `build()`, whichever side they are for:
/// the sentinel's (its URL gives none), also when another sentinel listed before it is
/// down (the refusal of the one that answered says what to fix, the dead one's refused
/// connection does not), and the master's (`sentinel_master_auth`); the sentinel's own
/// password is never tried on the master, nor the master's on it.
#[test]
fn wrong_credentials_are_auth_errors_at_build() {
    init_log();
    let m = RedisServer::builder().password(PASSWORD).start();
    let s = watching(
        m.port(),
        RedisServer::builder().password(SENTINEL_PASSWORD),
        &[format!("auth-pass {NAME} {PASSWORD}")],
    );
    let build = |url: String, master_password: &str| {
        redbaton_testkit::lock_builder!(
            sentinel(NAME, [redbaton_testkit::dead_url(), url]),
            sentinel_master_auth(None, master_password),
            io_timeouts(ms(500))
        )
        .build()
    };
    let e = build(s.url(), PASSWORD).expect_err("no password for the sentinel");
    assert!(e.is_auth(), "the sentinel's: {e:?}");
    let e = build(s.url_with_auth(), SENTINEL_PASSWORD).expect_err("the master's is wrong");
    assert!(e.is_auth(), "the master's: {e:?}");
    let c = build(s.url_with_auth(), PASSWORD).expect("both right");
    assert!(lands_on(&c, "k", &m), "the lock is not on the master");
}
