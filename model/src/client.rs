//! A client process: its threads, and the one remote token they share.
//!
//! What each step mirrors in the library:
//!
//! - `Proc::lock`: `LockClient::lock` → the local table (`local::table`): the first
//!   thread that wants the key contends, the others queue behind it in the process.
//! - `Proc::attempt`: one round of `engine::contend` — `FAIR_ACQUIRE` (fair: one token
//!   for the whole wait, until a give-back retires it) or `ACQUIRE` (plain: a new token
//!   per attempt). A won attempt's validity counts from its first send (`judge`:
//!   `started + lease − drift`); a lost
//!   one sleeps until the holder's remaining lease or the re-check ceiling, whichever
//!   comes first, or at once if a message came since the attempt was sent (the waiter's
//!   snapshots).
//! - `Proc::hear`: the subscriber's `r` and `g<token>:<nonce>:<fence>:<ms>`. Both wake the
//!   contender; a grant is kept for it (`Waiter::take_grant`). Before its next attempt
//!   (`engine::contest`) the contender takes a grant carrying the nonce of its latest
//!   attempt as the lock, valid until that attempt's `sent + grant lease − drift`, and
//!   has the watchdog renew it a quarter of that later; any other grant is confirmed by the attempt
//!   (`Rules::grants`). Every attempt of a wait carries the next nonce.
//! - `Proc::give_up`: a read timeout. An attempt's is sent again with the same token
//!   and nonce (`Config::acquire_retries`, the node's `Retry::LOST_REPLY`), its validity
//!   still counted from its first send; a won reply with no validity left is given back
//!   before the next attempt (`Rules::late_give_back`), which uses a new token
//!   (`Proc::retire_token`, `Rules::retire_given_back_token`). Once the resends are spent, it
//!   makes `lock` fail (one node does not ride through errors): the thread is told, the
//!   cleanup thread leaves the queue (`FAIR_LEAVE`) or, plain, releases the token it
//!   tried, and looks again (a job, `engine::cleanup`), and the next local waiter
//!   contends. A retry answered `held` is an unknown outcome: its first send may still
//!   land. The fair queue keeps the token (`Contest::unsettled`), the plain lock has the
//!   cleanup give it back and look again; a hold won by a retry, or with the token
//!   unsettled, has its release looked at again (`Rules::look_again_after_release`).
//!   A lease change's leaves the validity at
//!   `min(old, sent_at + new lease − drift)` (`Rules::min_on_unknown`). A release's
//!   leaves the key to expire.
//! - `Proc::renew`: the watchdog (`engine::watchdog::renew_due`): `EXTEND` with the
//!   current lease once a third of it has passed, while the lock is valid; validity
//!   becomes `sent_at + lease − drift` (not the later of the old and the new: the lease
//!   applied is the lease, as `RemoteLock::apply` has it).
//! - `Proc::extend`: `LockGuard::extend` (`engine::release::Engine::extend`): waits for
//!   a renewal in flight (`RemoteLock::begin_extend`), then `EXTEND` with the new lease;
//!   validity becomes `sent_at + lease − drift`.
//! - `Proc::unlock`: `LockGuard::unlock` (`engine::release`, `Table::release`): a
//!   valid lock may go to the next local waiter (token `fence << k | seq`, `seq` + 1),
//!   else `FAIR_RELEASE`/`RELEASE`, with the hold's fence, after any renewal in flight.
//!   The cleanup's give-backs of a token nobody uses carry none.
//!
//! Steps are taken at the start of a tick (`Proc::begin_tick`, then `Proc::act` with
//! what the threads chose) or at once in reaction to a reply or a message (`on_reply`,
//! `hear`). Every lease change of a hold carries the hold's next sequence number
//! (1, 2, …), in the order sent; see `redis::Key::seq`.

use crate::config::{Config, Grants, Mode};
use crate::net::{Job, Request};
use crate::redis::{Answer, Op, Publish, Token};
use crate::world::{Pid, Process};

/// What a thread is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Idle,
    /// In `lock()`.
    Waiting,
    /// Returned from `lock()` with a guard, not yet unlocked.
    Holding,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Thread {
    pub role: Role,
    /// Acquisitions still to make.
    pub left: u8,
}

/// A held remote lock (`local::held::RemoteLock`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Hold {
    pub token: Token,
    pub fence: u8,
    /// The lock is surely held while `now < valid_until`.
    pub valid_until: u8,
    /// The lease renewals set (changed by a successful `extend`).
    pub lease: u8,
    /// The sequence number of the last lease change sent.
    pub seq: u8,
    pub renew_at: u8,
    /// Local handoffs so far: the low bits of the fencing token.
    pub handoffs: u8,
    /// Whether the holder already called `extend` (once per hold keeps the model small).
    pub extended: bool,
    /// Whether the hold began with a grant (model bookkeeping, for the vacuity checks).
    pub granted: bool,
    /// Whether it began with a grant message taken as the lock, with no confirming
    /// attempt (model bookkeeping, for the vacuity checks).
    pub trusted: bool,
    /// What the acquisition said of the hold before (`LockGuard::previous_lost`); a
    /// local handoff passes the hold on as no news, and keeps it for the vacuity check.
    pub previous_lost: bool,
    /// Won by a retry after a lost reply, or (fair) while an earlier attempt of its token
    /// was unsettled (`RemoteLock::resent`): that attempt's first send may still land
    /// after the release, so the release is looked at again.
    pub resent: bool,
}

/// The process's remote side: one thing at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Remote {
    Free,
    /// Contending with `token`; between attempts, asleep until `wake` unless `heard`.
    /// `nonce` and `sent` are the latest attempt's (`sent`: its first send, from which
    /// its validity counts), `resent` how many times it was sent again after its reply
    /// did not come; `grant` the nonce and fence of a grant heard for `token` and not yet
    /// judged (one carrying the latest nonce, if any was heard); `unsettled`: a retry with
    /// `token` was answered `held` (fair: the token is kept, `Contest::unsettled`), so its
    /// first send may still land.
    Contend {
        token: Token,
        wake: u8,
        heard: bool,
        nonce: u8,
        sent: u8,
        resent: u8,
        grant: Option<(u8, u8)>,
        unsettled: bool,
    },
    Hold(Hold),
    /// The remote release of `token` was sent; local waiters contend once it is answered.
    /// `again`: the cleanup then gives the token back, and looks at it again (a hold won
    /// by a retry).
    Releasing {
        token: Token,
        again: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Proc {
    pub pid: Pid,
    pub threads: Vec<Thread>,
    pub remote: Remote,
    /// The one request the process awaits a reply to.
    pub pending: Option<Request>,
    /// Tokens used so far.
    pub tokens: u8,
}

/// What a process's threads do at the start of a tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Choice {
    Nothing,
    /// An idle thread calls `lock()` (with `Config::free_arrivals`).
    Lock,
    /// The holder calls `extend(lease)`.
    Extend(u8),
    /// The holder unlocks in Redis.
    Unlock,
    /// The holder unlocks, handing the lock to a local waiter.
    HandOff,
}

/// What a client step does outside its process.
#[derive(Default, Debug)]
pub struct Effects {
    /// Requests sent.
    pub sent: Vec<Request>,
    /// A thread began to hold the lock with this fencing token (fence, local handoffs).
    pub began: Option<(u8, u8)>,
    /// A request went unanswered: a fault, for the starvation count.
    pub timed_out: bool,
    /// A hold began from a grant message to this token alone, told that nothing was
    /// lost before it (a grant with a nonce follows a release): an answer the system
    /// checks against the truth.
    pub trusted: Option<Token>,
    /// Jobs queued for the cleanup thread.
    pub jobs: Vec<Job>,
}

impl Proc {
    pub fn new(id: u8, cfg: &Config) -> Proc {
        Proc {
            pid: Pid { id, paused: false },
            threads: vec![
                Thread {
                    role: Role::Idle,
                    left: cfg.locks_per_thread,
                };
                usize::from(cfg.threads)
            ],
            remote: Remote::Free,
            pending: None,
            tokens: 0,
        }
    }

    /// Threads are interchangeable: keeps them sorted, so that states that differ only
    /// in which thread does what are one state.
    pub fn sort_threads(&mut self) {
        self.threads.sort_unstable();
    }

    fn waiting(&self) -> Option<usize> {
        self.threads.iter().position(|t| t.role == Role::Waiting)
    }

    /// Whether a thread of this process is in `lock()`.
    pub fn has_waiter(&self) -> bool {
        self.waiting().is_some()
    }

    /// The token this process contends with, if it does.
    pub fn contending(&self) -> Option<Token> {
        match self.remote {
            Remote::Contend { token, .. } => Some(token),
            _ => None,
        }
    }

    /// Whether a thread of this process believes it holds the lock now: its guard's
    /// `check()` would say so (`now < valid_until`). A holder blocked in `extend` cannot
    /// call `check()` (a guard is neither `Send` nor `Sync`), so it makes no claim until
    /// the call returns.
    pub fn believes(&self, now: u8) -> bool {
        let extending = matches!(self.pending, Some(r)
            if matches!(r.op, Op::Extend { renew: false, .. }));
        self.hold().is_some_and(|h| now < h.valid_until) && !extending
    }

    /// Whether this process holds `token`, waits with it, or is releasing it.
    pub fn uses(&self, token: Token) -> bool {
        match self.remote {
            Remote::Free => false,
            Remote::Contend { token: t, .. } | Remote::Releasing { token: t, .. } => t == token,
            Remote::Hold(h) => h.token == token,
        }
    }

    /// The hold, while a thread holds a guard.
    pub fn hold(&self) -> Option<&Hold> {
        match &self.remote {
            Remote::Hold(h) => Some(h),
            _ => None,
        }
    }

    fn new_token(&mut self) -> Token {
        self.tokens += 1;
        Token {
            proc: self.pid.id,
            n: self.tokens,
        }
    }

    /// Queues `op`, a give-back of a token nobody uses any more, for the cleanup thread
    /// (`Cleanup::release_later`, `leave_later`): made, and looked at again, while what it
    /// gives back could live (`Job::lives`): a hold a lease, a queue entry its TTL.
    fn clean_up(&self, cfg: &Config, now: u8, op: Op, fx: &mut Effects) {
        let job = Job::new((self.pid.id, now), op, cfg.lease, cfg.entry_ttl());
        fx.jobs.push(job);
    }

    fn send(&mut self, now: u8, op: Op, awaited: bool, fx: &mut Effects) {
        crate::net::send(
            &mut fx.sent,
            &mut self.pending,
            (self.pid.id, now),
            op,
            awaited,
        );
    }

    /// The contender attempts as soon as it is due: at its wake-up time, or once a
    /// message came (the waiter's snapshots), unless an attempt is in flight.
    fn react(&mut self, cfg: &Config, now: u8, fx: &mut Effects) {
        if self.attempt_due(now) {
            self.attempt(cfg, now, fx);
        }
    }

    /// A thread calls `lock()`.
    pub fn lock(&mut self, now: u8, thread: usize, fx: &mut Effects) {
        self.threads[thread].role = Role::Waiting;
        if self.remote == Remote::Free {
            self.contend(now, fx);
        }
    }

    /// The first local waiter contends in Redis, at once.
    fn contend(&mut self, now: u8, fx: &mut Effects) {
        let token = self.new_token();
        self.remote = Remote::Contend {
            token,
            wake: now,
            heard: false,
            nonce: 1,
            sent: now,
            resent: 0,
            grant: None,
            unsettled: false,
        };
        self.send(now, Op::Acquire { token, nonce: 1 }, true, fx);
    }

    /// After the remote side is done with a hold or a wait: the next local waiter, if
    /// any, contends.
    fn next_contender(&mut self, now: u8, fx: &mut Effects) {
        self.remote = Remote::Free;
        if self.has_waiter() {
            self.contend(now, fx);
        }
    }

    /// The release was answered or given up: the cleanup gives `again` back and looks
    /// again (`Engine::release` of a hold won by a retry), and the next local waiter
    /// contends.
    fn released(&mut self, cfg: &Config, now: u8, again: Option<Token>, fx: &mut Effects) {
        if let Some(token) = again {
            self.clean_up(
                cfg,
                now,
                give_back(cfg, token, cfg.rules.look_again_leaves),
                fx,
            );
        }
        self.next_contender(now, fx);
    }

    /// Whether the contender attempts now.
    fn attempt_due(&self, now: u8) -> bool {
        matches!(self.remote, Remote::Contend { wake, heard, .. }
            if self.pending.is_none() && (heard || wake <= now))
    }

    /// The contender's next attempt (the first is sent by `lock`).
    fn attempt(&mut self, cfg: &Config, now: u8, fx: &mut Effects) {
        // Plain: a token per attempt; fair: one per wait (until a give-back retires it,
        // see `retire_token`), so that its place in the queue and a grant to it survive.
        let fresh = (cfg.mode == Mode::Plain).then(|| self.new_token());
        if self.take_granted(cfg, now, fx) {
            return;
        }
        let Remote::Contend {
            token,
            heard,
            nonce,
            sent,
            resent,
            ..
        } = &mut self.remote
        else {
            return;
        };
        if let Some(t) = fresh {
            *token = t;
        } else {
            *nonce += 1;
        }
        *sent = now;
        *resent = 0;
        *heard = false;
        let op = Op::Acquire {
            token: *token,
            nonce: *nonce,
        };
        self.send(now, op, true, fx);
    }

    /// After a give-back of a hold the kept token may have taken (`Contest::undo` sets
    /// `spent`): the following attempts use a new token, as a new contender's (fair
    /// queue: a new entry, at the back), and a grant kept for the old one is dropped; a
    /// grant to the old one heard later is not ours (only a wake-up). The old token is
    /// never used again: an entry a late attempt of it leaves expires, or its grant runs
    /// out. The library retires the token at the top of the next pass, after the
    /// give-back returned; nothing is judged in between. Plain: every attempt has a new
    /// token anyway.
    fn retire_token(&mut self, cfg: &Config) {
        if cfg.mode != Mode::Fair || !matches!(self.remote, Remote::Contend { .. }) {
            return;
        }
        let fresh = self.new_token();
        if let Remote::Contend {
            token,
            grant,
            unsettled,
            ..
        } = &mut self.remote
        {
            *token = fresh;
            *grant = None;
            *unsettled = false;
        }
    }

    /// Before an attempt: a grant heard that carries the nonce of the latest attempt
    /// (`Grants::Trusted`) is the lock. Redis ran that attempt before the grant, so after
    /// it was sent: the grant lease ends no earlier than `sent + grant lease`. Whether the
    /// contender took it (its first renewal is then due a quarter of its validity later,
    /// as `Config::first_renewal` has it, and goes out at a later step of the process: in
    /// between, anything may happen).
    fn take_granted(&mut self, cfg: &Config, now: u8, fx: &mut Effects) -> bool {
        let Remote::Contend {
            token,
            nonce,
            sent,
            grant,
            unsettled,
            ..
        } = &mut self.remote
        else {
            return false;
        };
        let Some((of, fence)) = grant.take() else {
            return false;
        };
        let ours = match cfg.rules.grants {
            Grants::Trusted => of == *nonce,
            Grants::AnyNonce => true,
            Grants::Confirmed | Grants::FromHearing => false,
        };
        let valid_until = (*sent + cfg.grant_lease).saturating_sub(cfg.drift);
        if !ours || valid_until <= now {
            return false; // only a wake-up: the attempt confirms
        }
        let (token, resent) = (*token, *unsettled);
        let renew_at = now + cfg.first_renewal(valid_until - now);
        self.begin_granted(cfg, (token, resent), fence, valid_until, renew_at, fx);
        true
    }

    /// The waiting thread holds the lock, granted by a message with `fence` to `token`
    /// (`resent`: while an earlier attempt of it was unsettled); the first renewal is due
    /// at `renew_at`.
    fn begin_granted(
        &mut self,
        cfg: &Config,
        (token, resent): (Token, bool),
        fence: u8,
        valid_until: u8,
        renew_at: u8,
        fx: &mut Effects,
    ) {
        let holder = self.waiting().expect("a contender waits");
        self.threads[holder].role = Role::Holding;
        self.remote = Remote::Hold(Hold {
            token,
            fence,
            valid_until,
            lease: cfg.lease,
            seq: 0,
            renew_at,
            handoffs: 0,
            extended: false,
            granted: true,
            trusted: true,
            previous_lost: false,
            resent,
        });
        fx.began = Some((fence, 0));
        fx.trusted = Some(token);
    }

    /// Whether the watchdog renews now.
    fn renew_due(&self, now: u8) -> bool {
        matches!(self.remote, Remote::Hold(h)
            if self.pending.is_none() && h.renew_at <= now && now < h.valid_until)
    }

    fn renew(&mut self, now: u8, fx: &mut Effects) {
        let Remote::Hold(h) = &mut self.remote else {
            return;
        };
        h.seq += 1;
        let op = Op::Extend {
            token: h.token,
            lease: h.lease,
            seq: h.seq,
            renew: true,
        };
        self.send(now, op, true, fx);
    }

    fn extend(&mut self, now: u8, lease: u8, fx: &mut Effects) {
        let Remote::Hold(h) = &mut self.remote else {
            return;
        };
        h.seq += 1;
        h.extended = true;
        let op = Op::Extend {
            token: h.token,
            lease,
            seq: h.seq,
            renew: false,
        };
        self.send(now, op, true, fx);
    }

    fn unlock(&mut self, cfg: &Config, now: u8, handoff: bool, fx: &mut Effects) {
        let holder = self.threads.iter().position(|t| t.role == Role::Holding);
        let holder = holder.expect("a hold has a holder");
        let next = self.waiting().filter(|_| handoff);
        let Remote::Hold(h) = &mut self.remote else {
            return;
        };
        match next {
            Some(next) => {
                self.threads[next].role = Role::Holding;
                h.handoffs += 1;
                fx.began = Some((h.fence, h.handoffs));
            }
            None => {
                let op = Op::Release {
                    token: h.token,
                    fence: Some(h.fence),
                };
                self.remote = Remote::Releasing {
                    token: h.token,
                    again: h.resent && cfg.rules.look_again_after_release,
                };
                self.send(now, op, true, fx);
            }
        }
        let t = &mut self.threads[holder];
        t.left -= 1;
        t.role = Role::Idle;
        self.again(cfg, holder);
    }

    /// Without free arrivals, a thread with locks left calls `lock()` again at once.
    fn again(&mut self, cfg: &Config, thread: usize) {
        let t = &mut self.threads[thread];
        if !cfg.free_arrivals && t.left > 0 {
            t.role = Role::Waiting;
        }
    }

    /// Whether the pending request's timeout has come.
    fn timeout_due(&self, cfg: &Config, now: u8) -> bool {
        self.pending.is_some_and(|r| r.sent + cfg.timeout <= now)
    }

    /// The read timeout: no reply to the pending request.
    fn give_up(&mut self, cfg: &Config, now: u8, fx: &mut Effects) {
        let Some(request) = self.pending.take() else {
            return;
        };
        fx.timed_out = true;
        match (request.op, &mut self.remote) {
            // The node sends the same call again (`Retry::LOST_REPLY`): same token, same
            // nonce; the attempt's validity still counts from its first send.
            (Op::Acquire { .. }, Remote::Contend { resent, .. })
                if *resent < cfg.acquire_retries =>
            {
                *resent += 1;
                self.send(now, request.op, true, fx);
            }
            (Op::Acquire { token, .. }, Remote::Contend { .. }) => {
                // `lock()` fails for the contender; what the attempt may have left is
                // cleaned up, not waited for.
                if let Some(t) = self.waiting() {
                    self.threads[t].role = Role::Idle;
                    self.again(cfg, t);
                }
                self.clean_up(cfg, now, give_back(cfg, token, true), fx);
                self.next_contender(now, fx);
            }
            (Op::Extend { .. }, Remote::Hold(h)) => unknown_change(h, cfg, now, &request),
            (Op::Release { .. }, &mut Remote::Releasing { token, again }) => {
                self.released(cfg, now, again.then_some(token), fx)
            }
            // The give-back of a late win went unanswered: the next attempt goes now
            // (`react`, after the tick's choices), while the give-back may still run.
            _ => {}
        }
    }
}

/// A lease change whose outcome is unknown (its reply lost or late): the lease may now
/// be the new one, counted from any time after it was sent, so the validity can only
/// shrink to what the new lease gives from `sent_at` (with `Rules::min_on_unknown`).
/// The watchdog tries again shortly.
/// An explicit `extend` sets the lease the watchdog renews with whatever its outcome
/// (`RemoteLock::end_extend`): the change may have been applied, and the next renewal,
/// sent soon, applies it for sure.
fn unknown_change(h: &mut Hold, cfg: &Config, now: u8, request: &Request) {
    let Op::Extend { lease, renew, .. } = request.op else {
        return;
    };
    if cfg.rules.min_on_unknown {
        let bound = (request.sent + lease).saturating_sub(cfg.drift);
        h.valid_until = h.valid_until.min(bound);
    }
    if !renew {
        h.lease = lease;
    }
    h.renew_at = now + cfg.renew_retry;
}

/// The adversary's handle on a process: its steps.
impl Process for Proc {
    type Cfg = Config;
    type Op = Op;
    type Answer = Answer;
    type Publish = Publish;
    type Choice = Choice;
    type Effects = Effects;

    fn pid(&self) -> Pid {
        self.pid
    }

    fn set_paused(&mut self, paused: bool) {
        self.pid.paused = paused;
    }

    fn listens(&self) -> bool {
        self.contending().is_some()
    }

    /// The first send of the attempt in flight, which its retry may overtake.
    fn may_stall(&self, _cfg: &Config, request: &Request) -> bool {
        matches!(self.remote, Remote::Contend { token, nonce, sent, .. }
            if request.op == (Op::Acquire { token, nonce }) && request.sent == sent)
    }

    /// Whether `request` is the one this process awaits.
    fn awaits(&self, request: &Request) -> bool {
        self.pending.as_ref() == Some(request)
    }

    /// What the process's threads may do at the start of a tick (one thing per tick).
    fn choices(&self, cfg: &Config, now: u8) -> Vec<Choice> {
        let mut out = vec![Choice::Nothing];
        if self.pid.paused {
            return out;
        }
        let free = |t: &Thread| t.role == Role::Idle && t.left > 0;
        if cfg.free_arrivals && self.threads.iter().any(free) {
            out.push(Choice::Lock);
        }
        if let Remote::Hold(h) = self.remote
            && self.pending.is_none()
        {
            out.push(Choice::Unlock);
            // A lock known lost is not handed on, and `extend` refuses it.
            if now < h.valid_until {
                if self.has_waiter() {
                    out.push(Choice::HandOff);
                }
                if !h.extended {
                    out.extend(cfg.extends.iter().map(|&e| Choice::Extend(e)));
                }
            }
        }
        out
    }

    /// The start of a tick for a running process, first: the read timeout of a request
    /// unanswered since the last tick.
    fn begin_tick(&mut self, cfg: &Config, now: u8, fx: &mut Effects) {
        if self.timeout_due(cfg, now) {
            self.give_up(cfg, now, fx);
        }
    }

    /// Then what the threads chose, the watchdog's renewal and the contender's attempt,
    /// if due.
    fn act(&mut self, cfg: &Config, now: u8, choice: Choice, fx: &mut Effects) {
        match choice {
            Choice::Nothing => {}
            Choice::Lock => {
                let free = self
                    .threads
                    .iter()
                    .position(|t| t.role == Role::Idle && t.left > 0);
                if let Some(t) = free {
                    self.lock(now, t, fx);
                }
            }
            Choice::Extend(lease) => self.extend(now, lease, fx),
            Choice::Unlock => self.unlock(cfg, now, false, fx),
            Choice::HandOff => self.unlock(cfg, now, true, fx),
        }
        if self.renew_due(now) {
            self.renew(now, fx);
        }
        self.react(cfg, now, fx);
    }

    /// A published message reaches this process.
    fn hear(&mut self, cfg: &Config, now: u8, what: Publish, fx: &mut Effects) {
        let Remote::Contend {
            token,
            heard,
            grant,
            nonce: latest,
            unsettled,
            ..
        } = &mut self.remote
        else {
            return;
        };
        match what {
            Publish::Granted {
                token: to, fence, ..
            } if cfg.rules.grants == Grants::FromHearing && to == *token => {
                // The unsafe variant: the message is taken for the lock, valid for the grant
                // lease from now.
                let token = (*token, *unsettled);
                // An attempt in flight is forgotten.
                self.pending = None;
                let valid_until = (now + cfg.grant_lease).saturating_sub(cfg.drift);
                let renew_at = now + cfg.renew_every(cfg.grant_lease);
                self.begin_granted(cfg, token, fence, valid_until, renew_at, fx);
            }
            Publish::Granted {
                token: to,
                nonce,
                fence,
            } if to == *token => {
                // Kept for the contender, which judges it before its next attempt: the
                // library keeps every grant heard and takes one that carries the latest
                // attempt's nonce (`Contest::trust`), so a later one does not hide it.
                if grant.is_none_or(|(of, _)| of != *latest) {
                    *grant = Some((nonce, fence));
                }
                *heard = true;
                self.react(cfg, now, fx);
            }
            _ => {
                *heard = true;
                self.react(cfg, now, fx);
            }
        }
    }

    /// The reply to the pending request arrives.
    fn on_reply(
        &mut self,
        cfg: &Config,
        now: u8,
        request: Request,
        answer: Answer,
        fx: &mut Effects,
    ) {
        self.pending = None;
        match (request.op, answer, &mut self.remote) {
            (
                Op::Acquire { token, .. },
                Answer::Won {
                    fence,
                    fresh,
                    previous_lost,
                },
                Remote::Contend {
                    wake,
                    heard,
                    sent,
                    resent,
                    unsettled,
                    ..
                },
            ) => {
                // From the attempt's first send (`judge`: `started + lease − drift`).
                let valid_until = (*sent + cfg.lease).saturating_sub(cfg.drift);
                // Won by a retry, or while a retry of the token was answered `held`: a
                // first send may still land (`RemoteLock::resent`, `Contest::settled_by`).
                let was_unsettled = *unsettled;
                let resent = *resent > 0 || was_unsettled;
                if valid_until <= now {
                    // No validity left (`Round::Late`): a guard is never born dead. The
                    // hold is given back as an attempt nobody used (`Contest::undo`,
                    // waited for), and the next attempt, with a new token in the fair
                    // queue, goes once that is answered or given up.
                    *wake = now;
                    *heard = false;
                    if cfg.rules.late_give_back {
                        let op = Op::Release { token, fence: None };
                        self.send(now, op, true, fx);
                        // A late win won so is looked at again after its give-back; what
                        // the old token's next call was to settle is left to the cleanup
                        // (`Contest::settle_token`). Both are for a token retired.
                        let retired = cfg.rules.retire_given_back_token;
                        let look = resent && cfg.rules.look_again_after_release;
                        if retired && (look || (was_unsettled && cfg.mode == Mode::Fair)) {
                            self.clean_up(
                                cfg,
                                now,
                                give_back(cfg, token, cfg.rules.look_again_leaves),
                                fx,
                            );
                        }
                        // The give-back may run late: the token it carries is spent.
                        if cfg.rules.retire_given_back_token {
                            self.retire_token(cfg);
                        }
                    } else {
                        // Kept for the next attempt with the token to confirm: a first
                        // send of this one may still land.
                        if let Remote::Contend { unsettled, .. } = &mut self.remote {
                            *unsettled |= resent;
                        }
                        self.react(cfg, now, fx);
                    }
                    return;
                }
                let holder = self.waiting().expect("a contender waits");
                self.threads[holder].role = Role::Holding;
                self.remote = Remote::Hold(Hold {
                    token,
                    fence,
                    valid_until,
                    lease: cfg.lease,
                    seq: 0,
                    renew_at: request.sent + cfg.renew_every(cfg.lease),
                    handoffs: 0,
                    extended: false,
                    granted: !fresh,
                    trusted: false,
                    previous_lost,
                    resent,
                });
                fx.began = Some((fence, 0));
            }
            (
                Op::Acquire { token, .. },
                Answer::Held { pttl },
                Remote::Contend {
                    wake,
                    heard,
                    resent,
                    unsettled,
                    ..
                },
            ) => {
                // A retry answered `held`: an unknown outcome, its first send may still
                // land. The fair queue keeps the token, and its next call (an attempt, or
                // the leave) settles it; the plain lock retires it (its next attempt has a
                // new token anyway), and the cleanup gives it back and looks again.
                if *resent > 0 {
                    match cfg.mode {
                        Mode::Fair => *unsettled = true,
                        Mode::Plain => {
                            fx.jobs.push(Job {
                                until: now + cfg.lease,
                                from: self.pid.id,
                                op: Op::Release { token, fence: None },
                            });
                        }
                    }
                }
                *wake = if *heard {
                    now
                } else {
                    now + pttl.min(cfg.recheck)
                };
                self.react(cfg, now, fx);
            }
            (Op::Extend { lease, renew, .. }, answer, Remote::Hold(h)) => match answer {
                Answer::Extended => {
                    // Not the later of the old and the new (`RemoteLock::apply`): the
                    // lease applied is the lease.
                    h.valid_until = (request.sent + lease).saturating_sub(cfg.drift);
                    if !renew {
                        h.lease = lease;
                    }
                    h.renew_at = request.sent + cfg.renew_every(h.lease);
                }
                Answer::Gone | Answer::Other => h.valid_until = h.valid_until.min(now),
                // Refused as older than a change applied already: as if unknown. (Never
                // awaited: the holder has one change in flight at a time.)
                _ => unknown_change(h, cfg, now, &request),
            },
            (Op::Release { .. }, _, &mut Remote::Releasing { token, again }) => {
                self.released(cfg, now, again.then_some(token), fx)
            }
            // The give-back of a late win answered: the next attempt goes now.
            (Op::Release { .. }, _, Remote::Contend { .. }) => self.react(cfg, now, fx),
            _ => {}
        }
    }
}

/// The cleanup's give-back of a token nobody uses any more, and its looks again
/// (`Cleanup::give_back_later`, `leave_later`): fair, a leave, which takes a queue entry out as well as
/// a hold (an attempt of the token that lands while the key is held queues it), unless
/// `leaves` says otherwise (`Rules::look_again_leaves`); plain, a release of a hold
/// nobody used.
fn give_back(cfg: &Config, token: Token, leaves: bool) -> Op {
    match cfg.mode {
        Mode::Fair if leaves => Op::Leave { token },
        _ => Op::Release { token, fence: None },
    }
}
