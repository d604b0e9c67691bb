//! What one kind of hold does on the wire: which scripts take, give back, leave and renew
//! it, how their calls are built and their replies read, and the answers the contest loop
//! and the release path need. A value chosen once per (route, kind) by the topology
//! ([`Protocols::get`]); the engine asks it and never tests a flag or the route's shape.
//!
//! * [`Protocol::Lock`]: `ACQUIRE`, `RELEASE`, `UNMARK`: a failed attempt leaves a
//!   contention mark, a release deletes the key.
//! * [`Protocol::FairLock`]: `FAIR_ACQUIRE`, `FAIR_RELEASE`, `FAIR_LEAVE`: a failed attempt
//!   queues, a release grants the lock to the head of the queue. Redlock routes never get
//!   it: independent masters cannot agree on one queue.
//! * [`Protocol::Read`], [`Protocol::Write`], [`Protocol::Permit`]: holds among others in a
//!   sorted set (see `rw_scripts`), on routes where one node decides alone.
//! * A multi-lock ([`Kind::Multi`]) holds each of its names as an exclusive lock of the
//!   route's protocol (`Lock` or `FairLock`); the locks of one node and hash slot are
//!   taken together by `MULTI_ACQUIRE` ([`Protocol::acquire_all`], see `multi_scripts`)
//!   and given back together ([`Protocol::release_all`]). Redlock routes refuse it.
//! * [`Protocol::Upgradable`]: the upgradable read hold, one more shared hold; and
//!   [`Protocol::Upgrade`]: turning it into the write hold, contended for like a hold (an
//!   attempt of it fails while other readers hold) whose attempts all use the upgradable
//!   hold's member, and which wins the write hold.
//!
//! An enum rather than a trait object: the set is closed and small, the value is `Copy`
//! (a route and a hold carry it at no cost, a fan-out closure captures it without an
//! `Arc`), and every answer is one `match` in which the compiler checks that each
//! protocol gives one. A new primitive adds a variant, its script file, and its arms here.

use std::time::{Duration, Instant};

use redis::{Cmd, RedisResult, Value};

use crate::config::Config;
use crate::error::{Error, Result};
pub(crate) use crate::proto::attempt::Attempt;
use crate::proto::fair_scripts::{
    FAIR_ACQUIRE, FAIR_LEAVE, FAIR_RELEASE, fair_acquire_call, fair_call,
};
use crate::proto::keys::Keys;
use crate::proto::multi_scripts::{self, Taken};
use crate::proto::node::{Call, Node, ReleaseReply, Retry, millis, new_token};
use crate::proto::renewal::EXTEND;
use crate::proto::rw_scripts::{SHARED_EXTEND, SharedAttempt, Want};
use crate::proto::scripts::{
    ACQUIRE, Lua, RELEASE, Site, UNMARK, acquire_call, acquire_reply, release_call, release_cmd,
    run_pipelined, unmark_call,
};
use crate::stats::Counters;

/// What a caller asks to hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The exclusive lock.
    Lock,
    /// A read hold of a read-write lock.
    Read,
    /// The write hold of a read-write lock.
    Write,
    /// One permit of a semaphore of this many permits.
    Permit(u32),
    /// Several exclusive locks held together (a multi-lock): each is held with the lock's
    /// protocol, on a route where one node decides alone.
    Multi,
    /// The upgradable read hold of a read-write lock.
    Upgradable,
    /// The write hold, into which an upgradable read hold turns.
    Upgrade,
}

/// How one kind of hold is contended for, given back and renewed on a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// First come, first served: a failed attempt of a waiter leaves a contention mark
    /// that lives `mark_ttl` (a waiter re-marks at least this often).
    Lock { mark_ttl: Duration },
    /// Processes take turns in arrival order (see `fair_scripts`).
    FairLock(Fair),
    /// A read hold; a failed attempt that will wait marks a waiting reader for `mark_ttl`.
    Read { mark_ttl: Duration },
    /// The write hold; a failed attempt that will wait marks a waiting writer for
    /// `mark_ttl`, which holds new readers back.
    Write { mark_ttl: Duration },
    /// One permit of a semaphore of `permits` permits; a failed attempt that will wait
    /// marks a waiting permit-seeker for `mark_ttl`, which a freed permit wakes alone.
    Permit { permits: u32, mark_ttl: Duration },
    /// The upgradable read hold; a failed attempt that will wait marks a waiting reader for
    /// `mark_ttl` (it holds nobody back, but wakes at the release of the upgradable hold in
    /// its way).
    Upgradable { mark_ttl: Duration },
    /// Turning an upgradable read hold into the write hold (the token of its attempts is
    /// the upgradable hold's member); a failed attempt that will wait marks it as a waiting
    /// writer for `mark_ttl`, which holds new readers back.
    Upgrade { mark_ttl: Duration },
}

/// The fair queue's timings (see `fair_scripts`): how long a waiter's entry lives unless
/// its next attempt refreshes it, and the lease a grant gives until the grantee renews.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fair {
    pub entry_ttl: Duration,
    pub grant_lease: Duration,
}

/// The protocols a route offers, one per [`Kind`]: chosen when the topology builds it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Protocols {
    lock: Protocol,
    mark_ttl: Duration,
    /// Shared holds need one node that decides alone (not Redlock).
    shared: bool,
}

impl Protocols {
    /// The protocols of a route whose one node decides alone, as `cfg` asks.
    pub fn of(cfg: &Config) -> Self {
        let lock = if cfg.fair {
            Protocol::FairLock(Fair {
                entry_ttl: cfg.entry_ttl(),
                grant_lease: cfg.grant_lease(),
            })
        } else {
            Protocol::Lock {
                mark_ttl: cfg.mark_ttl(),
            }
        };
        Protocols {
            lock,
            mark_ttl: cfg.mark_ttl(),
            shared: true,
        }
    }

    /// The protocols of a route where a majority of independent masters decides
    /// (Redlock): the plain lock whatever `cfg` asks (no queue), and no shared holds.
    pub fn majority(cfg: &Config) -> Self {
        Protocols {
            lock: Protocol::Lock {
                mark_ttl: cfg.mark_ttl(),
            },
            mark_ttl: cfg.mark_ttl(),
            shared: false,
        }
    }

    /// The exclusive lock's protocol.
    pub fn lock(self) -> Protocol {
        self.lock
    }

    /// The protocol of `kind`; an error when the route cannot hold it.
    pub fn get(self, kind: Kind) -> Result<Protocol> {
        let mark_ttl = self.mark_ttl;
        let shared = match kind {
            Kind::Lock => return Ok(self.lock),
            Kind::Read => Protocol::Read { mark_ttl },
            Kind::Write => Protocol::Write { mark_ttl },
            Kind::Permit(0) => {
                return Err(Error::InvalidConfig(
                    "a semaphore needs at least one permit".to_owned(),
                ));
            }
            Kind::Permit(permits) => Protocol::Permit { permits, mark_ttl },
            // All or none needs one node that decides alone: Redlock's independent masters
            // cannot take several keys atomically.
            Kind::Multi if self.shared => return Ok(self.lock),
            Kind::Multi => {
                return Err(Error::Unsupported(
                    "multi-locks need a single node, Sentinel or Cluster (not Redlock)",
                ));
            }
            Kind::Upgradable => Protocol::Upgradable { mark_ttl },
            Kind::Upgrade => Protocol::Upgrade { mark_ttl },
        };
        if !self.shared {
            return Err(Error::Unsupported(
                "read-write locks and semaphores need a single node (not Redlock)",
            ));
        }
        Ok(shared)
    }
}

/// One acquire attempt's arguments: for which keys, with which token, for how long, and
/// what it does with contention marks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request<'a> {
    pub keys: &'a Keys,
    pub token: &'a str,
    pub lease: Duration,
    pub marks: Marks,
    /// Fair queue: the attempt's nonce, kept with its queue entry and told by a grant to
    /// it (see `fair_scripts`); unused otherwise.
    pub nonce: u64,
}

/// What an acquire attempt does with contention marks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Marks {
    /// The caller will wait if the lock is held: a failure marks contention.
    pub leave: bool,
    /// The caller marked before: a success deletes its mark.
    pub clear: bool,
}

/// One all-or-nothing attempt at a group of exclusive locks (a multi-lock's names of one
/// node and hash slot): their keys, in the group's order, and the attempt's token, lease
/// and marks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Group<'a> {
    pub keys: &'a [Keys],
    pub token: &'a str,
    pub lease: Duration,
    pub marks: Marks,
    /// The id its contention marks carry (see `multi_scripts`), and how long they live.
    pub mark_id: &'a str,
    pub mark_ttl: Duration,
}

/// Which events wake a waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hears {
    /// A plain lock's: whatever may free the key (keyspace events, the library's `r`).
    Key,
    /// A read-write lock's or a semaphore's: the library's `r` (their holds expire inside
    /// the key, with no keyspace event; the waiter's hint covers that), and a writer or a
    /// permit-seeker its own wake-up (see [`Protocol::awaits_grant`]).
    Releases,
    /// A countdown latch's: the library's `z`, published when its count reached zero (see
    /// `latch_scripts`). A latch is not a hold: its waiters do not contend, they read.
    Zero,
}

/// How a hold's lease is renewed: which script, and whether it orders the changes of
/// one hold by their numbers (see `renewal::EXTEND`).
#[derive(Clone, Copy)]
pub(crate) struct RenewScript {
    pub script: &'static Lua,
    pub ordered: bool,
}

impl Protocol {
    /// Whether a hold of this protocol is one among others in a sorted set.
    pub fn shared(self) -> bool {
        matches!(
            self,
            Protocol::Read { .. }
                | Protocol::Write { .. }
                | Protocol::Permit { .. }
                | Protocol::Upgradable { .. }
                | Protocol::Upgrade { .. }
        )
    }

    /// A fresh token for a hold of this protocol (a shared hold's member starts with its
    /// tag).
    pub fn new_token(self) -> String {
        match self.want() {
            Some(want) => format!("{}{}", want.tag(), new_token()),
            None => new_token(),
        }
    }

    /// Whether one wait uses one token for all its attempts: the fair queue's token is the
    /// waiter's place in the queue, and a grant is made to it; a shared hold's member lets
    /// a retry after a lost reply find its own hold. Otherwise each attempt has a fresh one.
    pub fn keeps_token_across_attempts(self) -> bool {
        !matches!(self, Protocol::Lock { .. })
    }

    /// Whether a release may hand the hold straight to a waiting process: the fair queue's
    /// lock, or a read-write lock's write hold (see `rw_scripts`). The grant may be taken
    /// as the hold with no round trip (see `Contest::trust`); the releaser of a fair lock
    /// has nobody to yield to, and its next contender queues at once.
    pub fn release_may_grant(self) -> bool {
        matches!(
            self,
            Protocol::FairLock(_)
                | Protocol::Read { .. }
                | Protocol::Write { .. }
                | Protocol::Permit { .. }
        )
    }

    /// Whether a waiter's `leave` also gives back any hold of its token (a grant that raced
    /// its leaving, or a hold a lost attempt took): so do those whose release may grant,
    /// since a grant is a hold of the waiter's token. Otherwise (a plain lock's, an
    /// upgrade's) leaving only takes the mark out.
    pub fn leave_gives_back(self) -> bool {
        self.release_may_grant()
    }

    /// Whether a leave left to the cleanup thread also gives back, besides what
    /// [`leave`](Self::leave) does, what a lost attempt of its token may have taken (and
    /// looks again at it for a while): where the leave does not, for a token that does not
    /// outlive its wait.
    pub fn left_later_gives_back(self) -> bool {
        !self.leave_gives_back() && !self.token_outlives_wait()
    }

    /// Whether the waiter's token outlives its wait: an upgrade's is its guard's, which the
    /// guard's next upgrade uses again (its waiting mark, the write hold it wins). No
    /// leave of it is left to the cleanup thread: run (or looked at again) once that next
    /// upgrade has begun, it would take that upgrade's mark out, or give its write hold
    /// back under its holder. What a failed leave leaves, the mark, goes with its TTL or
    /// the guard; what a lost upgrade attempt took is given back by its wait, which marks
    /// the guard lost (see `Contest::undo`).
    pub fn token_outlives_wait(self) -> bool {
        matches!(self, Protocol::Upgrade { .. })
    }

    /// How long a waiter's mark or queue entry lives after its last attempt, unless the
    /// waiter's next attempt renews it: what a leave takes out is gone by itself then.
    pub fn waiter_ttl(self) -> Duration {
        match self {
            Protocol::Lock { mark_ttl }
            | Protocol::Read { mark_ttl }
            | Protocol::Write { mark_ttl }
            | Protocol::Permit { mark_ttl, .. }
            | Protocol::Upgradable { mark_ttl }
            | Protocol::Upgrade { mark_ttl } => mark_ttl,
            Protocol::FairLock(fair) => fair.entry_ttl,
        }
    }

    /// Whether a waiter waits in a queue, which a waiter giving up departs from (the fair
    /// queue; counted as a departure).
    pub fn queues_waiters(self) -> bool {
        matches!(self, Protocol::FairLock(_))
    }

    /// Whether a waiter listens for a message to its own token: a fair queue's grant, or
    /// the wake-up a read-write lock's last release sends to the writer waiting longest
    /// (or to the upgrade waiting for the last other reader), or a freed permit to the
    /// permit-seeker waiting longest. Either is only a wake-up: the next attempt confirms.
    pub fn awaits_grant(self) -> bool {
        matches!(
            self,
            Protocol::FairLock(_)
                | Protocol::Read { .. }
                | Protocol::Write { .. }
                | Protocol::Upgrade { .. }
                | Protocol::Permit { .. }
        )
    }

    /// Which events wake a waiter.
    pub fn hears(self) -> Hears {
        if self.shared() {
            Hears::Releases
        } else {
            Hears::Key
        }
    }

    /// Whether an attempt whose outcome is unknown may be left for the same wait's next
    /// call (its next attempt finds the token in the key if the lock is ours, and its
    /// leave passes such a lock on), rather than released in the background now.
    pub fn next_call_settles_unknown(self) -> bool {
        // Those whose leave gives back a hold of the token: the fair lock's, and a shared
        // hold's waiter, whose member (with its waiting mark) stays its own until it leaves.
        self.leave_gives_back()
    }

    /// How a hold's lease is renewed.
    pub fn renewal(self) -> RenewScript {
        if self.shared() {
            RenewScript {
                script: &SHARED_EXTEND,
                ordered: false,
            }
        } else {
            RenewScript {
                script: &EXTEND,
                ordered: true,
            }
        }
    }

    /// A shared hold's request, for its script.
    fn want(self) -> Option<Want> {
        match self {
            Protocol::Read { .. } => Some(Want::Read),
            Protocol::Write { .. } => Some(Want::Write),
            Protocol::Permit { permits, .. } => Some(Want::Permit(permits)),
            Protocol::Upgradable { .. } => Some(Want::Upgradable),
            // Its token is the upgradable hold's: it makes none of its own.
            Protocol::Lock { .. } | Protocol::FairLock(_) | Protocol::Upgrade { .. } => None,
        }
    }

    /// The protocol and token of the hold an attempt of this protocol with `token` wins:
    /// its own, except an upgrade's, which is the write hold with the write member of the
    /// same token.
    pub fn won(self, token: String) -> (Protocol, String) {
        match self {
            Protocol::Upgrade { mark_ttl } => (
                Protocol::Write { mark_ttl },
                Want::Write.member_like(&token),
            ),
            _ => (self, token),
        }
    }

    /// The acquire script of an exclusive lock.
    fn acquire_script(self) -> &'static Lua {
        match self {
            Protocol::FairLock(_) => &FAIR_ACQUIRE,
            _ => &ACQUIRE,
        }
    }

    /// One acquire attempt on `node` with `token`, retried with the same token after an
    /// ambiguous failure (the script recognises its own token and returns the first
    /// fence). When the outcome stays unknown, the caller must release with the token: the
    /// key may be ours. `marks`: whether a failure leaves a contention mark (or queues),
    /// and whether a success clears ours.
    pub fn acquire(
        self,
        node: &Node,
        req: Request<'_>,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<Attempt> {
        let mark_ttl = match self {
            Protocol::Read { mark_ttl }
            | Protocol::Write { mark_ttl }
            | Protocol::Upgradable { mark_ttl }
            | Protocol::Upgrade { mark_ttl }
            | Protocol::Permit { mark_ttl, .. }
                if req.marks.leave =>
            {
                Some(mark_ttl)
            }
            _ => None,
        };
        let shared = SharedAttempt {
            keys: req.keys,
            member: req.token,
            lease: req.lease,
            mark_ttl,
            clear: req.marks.clear,
            retry,
            deadline,
            nonce: req.nonce,
        };
        if let Protocol::Upgrade { .. } = self {
            // Whether a retry answered is not told: the guard's member outlives the wait
            // (see `token_outlives_wait`), so nothing may be left to the cleanup thread
            // for it; a first send landing after the wait needs the upgradable read it
            // converts, and the write hold it turns it into goes with the guard's release
            // (see `SHARED_RELEASE`), or is the guard's next upgrade's.
            return node.upgrade_shared(shared).map(|a| a.sent_again(false));
        }
        if let Some(want) = self.want() {
            return node.acquire_shared(want, shared);
        }
        let site = node.site(deadline)?;
        let call = self.lock_call(site, req);
        let took = |reply: &(i64, i64, i64)| reply.0 == 1;
        // A retry after a lost reply, whose first send may have left our contention mark:
        // it clears it if it wins (see `multi_scripts` for the same on a multi-lock).
        let again = || {
            let marks = Marks {
                clear: true,
                ..req.marks
            };
            self.lock_call(site, Request { marks, ..req })
        };
        let marks_left =
            matches!(self, Protocol::Lock { .. }) && req.marks.leave && !req.marks.clear;
        let again = marks_left.then_some(&again as &dyn Fn() -> Cmd);
        let (reply, unacked, resent) =
            node.run_acquire(self.acquire_script(), (&call, again), retry, deadline, took)?;
        match (attempt_of(node, reply)?.sent_again(resent), unacked) {
            (Attempt::Acquired { resent, .. }, Some(acked)) => {
                Ok(Attempt::Unacked { acked, resent })
            }
            (attempt, _) => Ok(attempt),
        }
    }

    /// The `EVALSHA` of one acquire attempt on `node`, for the subscriber to send the
    /// moment the key may be free (see `early`); `None` when this protocol's attempts are
    /// not sent early (shared holds), or before the node's first connection (the
    /// subscriber sends only on an idle one).
    pub fn early_call(self, node: &Node, req: Request<'_>) -> Option<Cmd> {
        let site = node.known_site()?;
        (!self.shared()).then(|| self.lock_call(site, req))
    }

    /// The `EVALSHA` of one exclusive-lock acquire attempt on the node of `site`.
    fn lock_call(self, site: Site<'_>, req: Request<'_>) -> Cmd {
        let Request {
            keys,
            token,
            lease,
            marks,
            nonce,
        } = req;
        let lease_ms = millis(lease);
        match self {
            Protocol::FairLock(fair) => {
                let entry_ms = if marks.leave {
                    millis(fair.entry_ttl)
                } else {
                    0
                };
                let grant_ms = millis(fair.grant_lease);
                fair_acquire_call(site, keys, token, lease_ms, (entry_ms, grant_ms), nonce)
            }
            _ => {
                let mark_ms = match self {
                    Protocol::Lock { mark_ttl } if marks.leave => millis(mark_ttl),
                    _ => 0,
                };
                acquire_call(site, keys, token, lease_ms, mark_ms, marks.clear)
            }
        }
    }

    /// The outcome of an acquire the subscriber thread made early on `node` (see
    /// `early`), from its raw reply; made again the usual way with the same token when
    /// the reply was lost (see [`Node::finish_early`]).
    pub fn finish_acquire(
        self,
        node: &Node,
        reply: RedisResult<Value>,
        call: &Cmd,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<Attempt> {
        let (reply, resent) =
            node.finish_early(reply, self.acquire_script(), call, retry, deadline)?;
        Ok(attempt_of(node, reply)?.sent_again(resent))
    }

    /// Gives back `token`'s hold on `node`: compare-and-delete, (fair queue) a grant to
    /// the head of the queue, or the end of a shared hold. `fence`: the holder's, which
    /// marks the name's fence counter released (`None`: an attempt nobody used is given
    /// back; see `scripts::fence_arg`). `retry` may be non-zero: a repeated release is
    /// harmless, and reports [`ReleaseReply::GoneAfterRetry`] for a key that the first
    /// attempt may have deleted ([`ReleaseReply::OtherAfterRetry`]: passed on, or deleted
    /// and taken since). `resent`: an earlier call of this release (before a failover
    /// ridden through) may have run: every try is sent, and its reply read, as a retry
    /// after a lost reply (a lock's release then reads the fence counter when it finds the
    /// key gone). `deadline`: a give-back on a caller's time keeps the caller's deadline
    /// (a release has none, its retries bound it).
    #[allow(clippy::too_many_arguments)]
    pub fn release(
        self,
        node: &Node,
        keys: &Keys,
        token: &str,
        fence: Option<u64>,
        retry: Retry,
        resent: bool,
        deadline: Option<Instant>,
    ) -> Result<ReleaseReply> {
        // Redis Cluster, the lock's slot half-way through a migration: the server refuses
        // a script whose keys are not all on one side (`TRYAGAIN`). The narrow release names
        // the lock key alone, which the server always serves: on the source while the key
        // is there, else (`ASK`) on the target; its lease record, if any, is left to its
        // TTL (at most the lease), and its fence counter stays held: the next holder is
        // told the hold before it was lost, which errs on the side of caution.
        let site = node.site(None)?;
        let narrow = || release_call(site, keys, token, fence, false);
        // The fair release names the lock, its counter and its queue, and an empty queue
        // has no key: during a migration the narrow release is the fair release of a lock
        // with no one queued; a queue that exists (moved ahead of the lock) gets no grant,
        // and its head takes the lock at its next attempt once the slot has moved.
        let shared = match self.exclusive_release(site, keys, token, fence) {
            Some((script, build)) => {
                let call = build(false);
                // A holder's release sent again after a lost reply asks the fence counter,
                // when it finds the key gone, whether the lost try released it (see
                // `scripts::RELEASE`, "A retry").
                let again = || build(true);
                let again = fence
                    .is_some_and(|f| f != 0)
                    .then_some(&again as &dyn Fn() -> Cmd);
                return node.release_again(
                    script,
                    (&call, again),
                    retry,
                    Some((&RELEASE, &narrow)),
                    deadline,
                    resent,
                );
            }
            // What an upgrade's attempt may have left is the write hold it turns into (the
            // upgradable hold is not the attempt's to give back).
            None if matches!(self, Protocol::Upgrade { .. }) => {
                let (_, member) = self.won(token.to_owned());
                node.release_shared(keys, &member, fence, retry, deadline)
            }
            None => node.release_shared(keys, token, fence, retry, deadline),
        };
        // A shared hold's release has no retry form: after an earlier call that may have
        // run, what it finds gone or another's says only what a retry saw.
        shared.map(|r| if resent { r.as_retried() } else { r })
    }

    /// The script that gives back `token`'s exclusive lock `keys` on `node`, the plain
    /// compare-and-delete or (fair queue) the release that grants the lock to the head of
    /// the queue, and a builder of its call: `true` builds the form sent again after a try
    /// whose reply was lost. `None` for a shared hold. `fence` as for
    /// [`release`](Self::release).
    fn exclusive_release<'a>(
        self,
        site: Site<'a>,
        keys: &'a Keys,
        token: &'a str,
        fence: Option<u64>,
    ) -> Option<(&'static Lua, impl Fn(bool) -> Cmd + 'a)> {
        let script: &'static Lua = match self {
            Protocol::Lock { .. } => &RELEASE,
            Protocol::FairLock(_) => &FAIR_RELEASE,
            Protocol::Read { .. }
            | Protocol::Write { .. }
            | Protocol::Permit { .. }
            | Protocol::Upgradable { .. }
            | Protocol::Upgrade { .. } => return None,
        };
        let build = move |again| match self {
            Protocol::FairLock(fair) => {
                let grant = (millis(fair.grant_lease), fence);
                fair_call(&FAIR_RELEASE, site, keys, token, grant, again)
            }
            _ => release_cmd(site, keys, token, fence, true, again),
        };
        Some((script, build))
    }

    /// One all-or-nothing attempt at the exclusive locks of `group` on `node` (see
    /// `multi_scripts::MULTI_ACQUIRE`), retried with the same token after an ambiguous
    /// failure as `retry` says. When the outcome stays unknown, the caller must release
    /// the token's locks: they may be ours. A shared protocol has no multi-lock.
    pub fn acquire_all(
        self,
        node: &Node,
        group: Group<'_>,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<Taken> {
        if self.shared() {
            return Err(Error::Unsupported("multi-locks of shared holds"));
        }
        let Group {
            keys,
            token,
            lease,
            marks,
            mark_id,
            mark_ttl,
        } = group;
        let mark_ms = if marks.leave { millis(mark_ttl) } else { 0 };
        let site = Site {
            client_id: mark_id,
            ..node.site(deadline)?
        };
        let call =
            multi_scripts::acquire_call(site, keys, token, millis(lease), mark_ms, marks.clear);
        // A retry after a lost reply, whose first send may have left our marks: it clears
        // them if it wins (a winner's marks would tell holders that someone waits).
        let again = || multi_scripts::acquire_call(site, keys, token, millis(lease), mark_ms, true);
        let again = (marks.leave && !marks.clear).then_some(&again as &dyn Fn() -> Cmd);
        node.acquire_all((&call, again), keys.len(), retry, deadline)
    }

    /// Gives back `token`'s locks `keys` on `node` (a multi-lock's group), each as
    /// [`release`](Self::release) does, in one pipelined round trip; one by one when the
    /// server refuses their keys together (a Redis Cluster slot migrating) or there is
    /// one. One reply per lock, in order. `fences` (each lock's) and `resent` as for
    /// [`release`](Self::release): a retry after a lost reply (the pipeline's own, or
    /// `resent`) reads the fence counter of a key it finds gone, as a lock's release does.
    pub fn release_all(
        self,
        node: &Node,
        keys: &[Keys],
        token: &str,
        fences: &[Option<u64>],
        retry: Retry,
        resent: bool,
    ) -> Result<Vec<ReleaseReply>> {
        // The pipeline refused part-way (a slot half moved: the source ran the releases
        // of the keys it still had): what the releases one by one find gone or another's
        // may have been ours until then.
        let mut refused = false;
        if keys.len() > 1 {
            let site = node.site(None)?;
            let releases: Option<Vec<_>> = keys
                .iter()
                .zip(fences)
                .map(|(k, &f)| self.exclusive_release(site, k, token, f).map(|r| (r, f)))
                .collect();
            if let Some(releases) = releases {
                let calls: Vec<Cmd> = releases
                    .iter()
                    .map(|((_, build), _)| build(false))
                    .collect();
                // The retry form of each release, as `release` sends it: only a holder's
                // (an unused attempt given back, fence `None`, has nothing to read).
                let again = || {
                    (releases.iter())
                        .map(|((_, build), f)| build(f.is_some_and(|f| f != 0)))
                        .collect()
                };
                let again = (fences.iter().any(|f| f.is_some_and(|f| f != 0)))
                    .then_some(&again as &dyn Fn() -> Vec<Cmd>);
                let script = releases[0].0.0;
                let sent = node.release_all(script, (&calls, again), retry, resent)?;
                if let Some(replies) = sent {
                    return Ok(replies);
                }
                refused = true;
            }
        }
        keys.iter()
            .zip(fences)
            .map(|(k, &f)| {
                let reply = self.release(node, k, token, f, retry, resent, None)?;
                Ok(if refused { reply.as_retried() } else { reply })
            })
            .collect()
    }

    /// A multi-lock's waiter stops waiting for the locks `keys` on `node` without them:
    /// its contention marks (those holding `mark_id`) go, in one round trip.
    pub fn leave_all(
        self,
        node: &Node,
        keys: &[Keys],
        mark_id: &str,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let site = Site {
            client_id: mark_id,
            ..node.site(deadline)?
        };
        let calls: Vec<Cmd> = keys.iter().map(|k| unmark_call(site, k)).collect();
        let how = Call {
            retry: Retry::ON_RESET,
            deadline,
            narrower: false,
        };
        node.call(how, |c, before| {
            run_pipelined::<i64>(&[&UNMARK], &calls, c, before)
        })?;
        Ok(())
    }

    /// A waiter with `token` stops waiting on `node` without the hold; `marked`: an
    /// attempt of its may have left a mark or a queue entry. Out of the queue (passing
    /// on a grant that raced its leaving), or its mark removed. Whether it passed a grant
    /// on. Within the wait's `deadline`, if any: once it has passed, each read waits a
    /// moment at most and nothing is sent again, so that a wait that ended never waits out
    /// a server that does not answer; what could not be done is left to the caller (the
    /// cleanup job), or to the mark's TTL.
    pub fn leave(
        self,
        node: &Node,
        keys: &Keys,
        token: &str,
        marked: bool,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        if !marked {
            return Ok(false);
        }
        match self {
            Protocol::Lock { .. } => {
                self.unmark(node, keys, deadline)?;
                Ok(false)
            }
            Protocol::FairLock(fair) => {
                let grant = (millis(fair.grant_lease), None);
                let site = node.site(deadline)?;
                let call = fair_call(&FAIR_LEAVE, site, keys, token, grant, false);
                // Redis Cluster, the slot half-way through a migration: refused like the
                // fair release (see `release`), leaving is the plain compare-and-delete of
                // our token, which gives back a grant that raced our leaving; our queue
                // entry expires.
                let narrow = || release_call(site, keys, token, None, false);
                let reply = node.release_with(
                    &FAIR_LEAVE,
                    &call,
                    Retry::ON_RESET,
                    Some((&RELEASE, &narrow)),
                    deadline,
                )?;
                Ok(reply == ReleaseReply::Passed)
            }
            Protocol::Read { .. } | Protocol::Write { .. } | Protocol::Permit { .. } => {
                node.leave_waiter(keys, token, deadline)
            }
            Protocol::Upgradable { .. } => {
                (node.unmark_waiter(keys, token, false, deadline)).map(|()| false)
            }
            Protocol::Upgrade { .. } => {
                (node.unmark_waiter(keys, token, true, deadline)).map(|()| false)
            }
        }
    }

    /// Whether the process may go on passing its hold `token` of a read-write lock among
    /// its threads: the hold is live and nobody else waits for it (see `RW_KEEP`). Other
    /// holds: no. Asked within `deadline`, the asking thread's own.
    pub fn keeps_turns(
        self,
        node: &Node,
        keys: &Keys,
        token: &str,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        match self {
            Protocol::Read { .. } => node.keep_turns(keys, token, false, deadline),
            Protocol::Write { .. } => node.keep_turns(keys, token, true, deadline),
            _ => Ok(false),
        }
    }

    /// Removes our own contention mark on `node` (a waiter of a plain lock gave up),
    /// within the wait's `deadline`, if any.
    pub fn unmark(self, node: &Node, keys: &Keys, deadline: Option<Instant>) -> Result<()> {
        let call = unmark_call(node.site(deadline)?, keys);
        node.run_script::<i64>(&UNMARK, &call, Retry::ON_RESET, deadline)?;
        Ok(())
    }

    /// Whether another client failed to get the lock `keys` on `node` lately: its mark
    /// is alive, or (fair queue) someone is queued. Read within `deadline`: the caller is
    /// a waiter, which must not wait on a stalled server past its own deadline.
    pub fn foreign_mark(self, node: &Node, keys: &Keys, deadline: Option<Instant>) -> Result<bool> {
        if let Protocol::FairLock(_) = self {
            // The queue is the mark: whoever is in it waits (this process's contender is
            // not, while it holds the lock).
            let queued: u64 = node.run_until(Retry::ON_RESET, deadline, |c| {
                redis::cmd("ZCARD").arg(keys.queue()).query(c)
            })?;
            return Ok(queued > 0);
        }
        let mark: Option<Vec<u8>> = node.run_until(Retry::ON_RESET, deadline, |c| {
            redis::cmd("GET").arg(keys.mark()).query(c)
        })?;
        Ok(mark.is_some_and(|m| m != node.client_id().as_bytes()))
    }
}

/// Reads an acquire script's reply on `node`, counting a failed attempt.
fn attempt_of(node: &Node, reply: (i64, i64, i64)) -> Result<Attempt> {
    let attempt = acquire_reply(reply)?;
    if let Attempt::Held { .. } = attempt {
        Counters::inc(&node.counters().failed_attempts);
    }
    Ok(attempt)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answers the engine acts on, for each protocol.
    #[test]
    fn each_protocol_answers_for_itself() {
        let one = Protocols::of(&Config::default());
        let fair = one.get(Kind::Lock).expect("lock");
        assert!(matches!(fair, Protocol::FairLock(_)), "fair by default");
        assert!(fair.keeps_token_across_attempts());
        assert!(fair.release_may_grant());
        assert!(fair.awaits_grant());
        assert!(fair.next_call_settles_unknown());
        assert_eq!(fair.hears(), Hears::Key);
        assert!(fair.renewal().ordered);

        let off = Config {
            fair: false,
            ..Config::default()
        };
        for plain in [
            Protocols::of(&off).lock(),
            Protocols::majority(&Config::default()).lock(),
        ] {
            assert!(matches!(plain, Protocol::Lock { .. }), "{plain:?}");
            assert!(!plain.keeps_token_across_attempts());
            assert!(!plain.release_may_grant());
            assert!(!plain.awaits_grant());
            assert!(!plain.next_call_settles_unknown());
            assert_eq!(plain.hears(), Hears::Key);
        }

        for (kind, tag) in [
            (Kind::Read, 'r'),
            (Kind::Write, 'w'),
            (Kind::Permit(3), 'p'),
        ] {
            let shared = one.get(kind).expect("shared");
            assert!(shared.shared() && shared.keeps_token_across_attempts());
            // A release grants read-write holds and permits; a waiter keeps its member
            // (and its mark) until it leaves, and its leave gives back what it holds.
            assert!(shared.release_may_grant());
            assert!(shared.next_call_settles_unknown());
            assert!(!shared.token_outlives_wait());
            assert!(shared.awaits_grant());
            assert_eq!(shared.hears(), Hears::Releases);
            assert!(!shared.renewal().ordered);
            assert!(shared.new_token().starts_with(tag));
        }
    }

    /// Redlock offers no shared holds and no multi-locks, and a semaphore needs a permit:
    /// typed errors.
    /// An upgradable read is one more shared hold; an upgrade is contended for like a
    /// write, with the upgradable hold's member, and wins the write hold.
    #[test]
    fn an_upgrade_wins_the_write_hold() {
        let one = Protocols::of(&Config::default());
        let upgradable = one.get(Kind::Upgradable).expect("upgradable");
        assert!(upgradable.shared() && !upgradable.awaits_grant());
        assert!(upgradable.new_token().starts_with('u'));
        let upgrade = one.get(Kind::Upgrade).expect("upgrade");
        assert!(upgrade.shared() && upgrade.keeps_token_across_attempts());
        assert!(
            upgrade.awaits_grant(),
            "the last other reader's release wakes it"
        );
        assert_eq!(upgrade.hears(), Hears::Releases);
        // Its member is its guard's: nothing of it is left to the cleanup thread.
        assert!(upgrade.token_outlives_wait() && !upgrade.left_later_gives_back());
        assert!(!upgradable.token_outlives_wait() && upgradable.left_later_gives_back());
        let (won, member) = upgrade.won("uabc".to_owned());
        assert_eq!(won, one.get(Kind::Write).unwrap());
        assert_eq!(member, "wabc");
        assert_eq!(upgradable.won("uabc".to_owned()).1, "uabc");
        let redlock = Protocols::majority(&Config::default());
        for kind in [Kind::Upgradable, Kind::Upgrade] {
            assert!(matches!(redlock.get(kind), Err(Error::Unsupported(_))));
        }
    }

    /// Redlock offers no shared holds, and a semaphore needs a permit: typed errors.
    #[test]
    fn a_route_refuses_what_it_cannot_hold() {
        let redlock = Protocols::majority(&Config::default());
        assert!(matches!(
            redlock.get(Kind::Read),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            redlock.get(Kind::Permit(2)),
            Err(Error::Unsupported(_))
        ));
        let one = Protocols::of(&Config::default());
        assert!(matches!(
            one.get(Kind::Permit(0)),
            Err(Error::InvalidConfig(_))
        ));
        // A multi-lock holds its names with the route's lock protocol, not on Redlock.
        assert!(matches!(
            redlock.get(Kind::Multi),
            Err(Error::Unsupported(_))
        ));
        assert_eq!(one.get(Kind::Multi).expect("multi"), one.lock());
    }
}
