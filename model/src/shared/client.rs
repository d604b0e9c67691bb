//! A process waiting for, holding and releasing one shared hold.
//!
//! What each step mirrors in the library (`engine::contest`, the same loop as the lock's):
//!
//! - `Proc::attempt`: one round, `RW_ACQUIRE` or `SEM_ACQUIRE` with the wait's member and
//!   the next nonce. A won attempt's validity counts from when it was sent; a failed one
//!   sleeps until the obstacle's end or the re-check, or goes again at once if a message
//!   came meanwhile. With a deadline (`SharedConfig::deadline`) the sleep ends there, an
//!   attempt sent from then on does not mark its member waiting, and one that fails then
//!   ends the wait (`Proc::leave`: `WAITER_LEAVE` when it may have marked).
//! - `Proc::hear`: `r`, and a wake-up or a grant to its own member. Before its next
//!   attempt the waiter takes a grant carrying its latest attempt's nonce as the hold,
//!   valid until that attempt's `sent + grant lease − drift`, with the first renewal due
//!   a quarter of the way (`Contest::trust`); any other grant is a wake-up that the
//!   attempt confirms (`SharedConfig::grants` names the broken variants).
//! - A read timeout of an attempt sends it again with the same member and nonce
//!   (`SharedConfig::acquire_retries`, the node's `Retry::LOST_REPLY`); a hold it wins
//!   counts from the first send, and a win with no validity left by its reply
//!   (`Vote::Late`) is given back (`Contest::undo`: `SHARED_RELEASE` of the member,
//!   awaited) before the next attempt, which uses a new member (`Contest::retire_token`;
//!   `SharedConfig::reuse_given_back_member` is the broken variant). Once the resends are
//!   spent the wait fails: its `WAITER_LEAVE`, which passes on a hold the lost attempt may
//!   have taken or a grant that raced it, is left to the cleanup thread
//!   (`Contest::leave_later`).
//! - A retry's first send may land after it (`SharedConfig::stalls`). A retry answered
//!   `held` is an unknown outcome: the member is kept, unsettled (`Contest::unsettled`),
//!   and its next call settles it; an upgradable read's is given back by the cleanup and
//!   the wait goes on with a new member. The cleanup thread (`net::Job`, `Proc::clean_up`)
//!   gives back, and looks again at, a member nobody uses any more: after the release of
//!   a hold won by a retry or while its member was unsettled (`RemoteLock::resent`), and
//!   of a hold turned from one won so (`RemoteLock::turned_from`); after the give-back of
//!   a late win won so; and a member left unsettled when its next call will not come
//!   (the wait ends, or a late win retires it). `SharedConfig::rules` names each.
//! - The watchdog renews (`SHARED_EXTEND`) once a third of the lease passed; a renewal's
//!   reply gives `max(old, sent + lease − drift)`, its loss leaves the validity as it was
//!   (a renewal sent later never shortens it), a hold gone ends it.
//! - `Choice::Release`: `SHARED_RELEASE`, after any renewal in flight.
//! - `Choice::Upgrade` (an upgradable read's): `RW_UPGRADE`, once or (`upgrade`) until it
//!   wins, asleep between attempts as a waiter is; sent again once unanswered (as an
//!   attempt is), then the upgradable read is lost and the write hold it may have made is
//!   given back; a retry's answer is not told (`Protocol::acquire`), so nothing of an
//!   upgrade is left to the cleanup thread. Its first send, landing after a refused retry
//!   ended the upgrade, turns the upgradable read the guard keeps into the write hold,
//!   which goes with the guard's `SHARED_RELEASE` of the upgradable read. `Choice::Downgrade` (a
//!   write hold's): `RW_DOWNGRADE`; the thread claims nothing until it returns, and the
//!   read hold counts from its send; unanswered, the write hold is lost too.
//! - Local turns (`SharedConfig::turns`, `engine::turns`): a reading or writing process's
//!   next thread takes its hold over when the holding thread lets go, with no request,
//!   while the hold is not known lost and its validity lasts.

use crate::config::Grants;
use crate::net::{Job, Request};
use crate::shared::config::{SharedConfig, Want};
use crate::shared::redis::{Answer, Member, Op, Publish};
use crate::world::{Pid, Process};

/// A request of the shared scripts.
pub type SharedRequest = Request<Op>;

/// A hold, while the process has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Hold {
    /// What is held: the wait's kind, or the write hold an upgrade made of it.
    pub kind: Want,
    pub fence: u8,
    /// Surely held while `now < valid_until`.
    pub valid_until: u8,
    pub renew_at: u8,
    /// Taken from a grant message, with no confirming attempt (for the vacuity checks).
    pub trusted: bool,
    /// An upgrade under way (an upgradable read's): its next attempt is due at the first
    /// tick, unless a message came (the second).
    pub upgrade: Option<(u8, bool)>,
    /// A downgrade under way: the thread is blocked in it, its write guard given up, and
    /// claims nothing until it returns with the read guard.
    pub downgrading: bool,
    /// Taken over by a local turn (for the vacuity checks).
    pub turned: bool,
    /// Won by a retry after a lost reply, or while a retry of its member was answered
    /// `held` (`RemoteLock::resent`, `Contest::settled_by`): the first send may still land
    /// after the release, which the cleanup looks at again.
    pub resent: bool,
    /// The member of the hold won so that this one was turned from (an upgradable read
    /// upgraded, a write hold downgraded: `RemoteLock::turned_from`), which the turn
    /// retired: its release looks at that member again.
    pub turned_from: Option<Member>,
}

/// Where the process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// In the wait: asleep until `wake` unless `heard`; `grant`: the nonce and fence of
    /// the latest grant heard for its member, not yet judged.
    Wait {
        wake: u8,
        heard: bool,
        grant: Option<(u8, u8)>,
    },
    Hold(Hold),
    /// Released, or the wait failed.
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Proc {
    pub pid: Pid,
    pub want: Want,
    pub phase: Phase,
    /// The latest attempt's nonce and when it was first sent (an upgrade's, once held).
    pub nonce: u8,
    pub sent: u8,
    /// How many times the latest attempt (or upgrade attempt) was sent again.
    pub resent: u8,
    /// A retry of the wait's member was answered `held` (or failed): its first send may
    /// still land. The member is kept, and its next call settles it (`Contest::unsettled`).
    pub unsettled: bool,
    /// The wait's member now: a new one after a late win was given back.
    pub token: u8,
    /// An attempt of this wait may have marked it waiting.
    pub marked: bool,
    /// Threads of the process still to take a turn on its hold.
    pub turns: u8,
    /// The one request whose reply the process awaits.
    pub pending: Option<SharedRequest>,
}

/// What the process does at the start of a tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Choice {
    Nothing,
    Release,
    /// `try_upgrade` or `upgrade` of an upgradable read.
    Upgrade,
    /// `downgrade` of a write hold.
    Downgrade,
}

/// What a step does outside the process.
#[derive(Default, Debug)]
pub struct Effects {
    pub sent: Vec<SharedRequest>,
    /// Jobs queued for the cleanup thread.
    pub jobs: Vec<Job<Op>>,
    /// A hold of this kind began, with this fence.
    pub began: Option<(Want, u8)>,
}

impl Proc {
    /// A process that begins its wait at tick 0: subscribed, then its first attempt.
    pub fn new(cfg: &SharedConfig, id: u8, want: Want, fx: &mut Effects) -> Proc {
        let mut p = Proc {
            pid: Pid { id, paused: false },
            want,
            phase: Phase::Wait {
                wake: 0,
                heard: false,
                grant: None,
            },
            nonce: 0,
            sent: 0,
            resent: 0,
            unsettled: false,
            token: 0,
            marked: false,
            turns: match want {
                Want::Read | Want::Write => cfg.turns,
                Want::Permit | Want::Upgradable => 0,
            },
            pending: None,
        };
        p.attempt(cfg, 0, fx);
        p
    }

    /// The member of what it holds now.
    fn held(&self) -> Member {
        Member {
            want: self.hold().map_or(self.want, |h| h.kind),
            proc: self.pid.id,
            token: self.token,
        }
    }

    pub fn member(&self) -> Member {
        Member {
            want: self.want,
            proc: self.pid.id,
            token: self.token,
        }
    }

    /// Subscribed: in the wait.
    pub fn waits(&self) -> bool {
        matches!(self.phase, Phase::Wait { .. })
    }

    pub fn hold(&self) -> Option<&Hold> {
        match &self.phase {
            Phase::Hold(h) => Some(h),
            _ => None,
        }
    }

    /// Whether the process holds `m`, waits with it or will give it back: the member it
    /// waits with; the member of its hold, and the members that go with it (the write
    /// hold a late upgrade made of an upgradable read, `SHARED_RELEASE`; the read hold a
    /// downgrade under way may have made; the member a turn retired, which the release
    /// looks at again).
    pub fn uses(&self, m: Member) -> bool {
        if m.proc != self.pid.id || m.token != self.token {
            return false;
        }
        match &self.phase {
            Phase::Wait { .. } => m.want == self.want,
            Phase::Hold(h) => {
                m.want == h.kind
                    || (h.kind == Want::Upgradable && m.want == Want::Write)
                    || (h.downgrading && m.want == Want::Read)
                    || h.turned_from == Some(m)
            }
            Phase::Done => false,
        }
    }

    /// Whether the process believes it holds now (a paused one's belief counts).
    pub fn believes(&self, now: u8) -> bool {
        self.hold()
            .is_some_and(|h| now < h.valid_until && !h.downgrading)
    }

    /// The thread holding lets go: the next local thread takes the hold over, if one
    /// waits and the hold is neither known lost nor run out (`Turn::next`).
    fn pass_turn(&mut self, now: u8) -> bool {
        let Phase::Hold(h) = &mut self.phase else {
            return false;
        };
        if self.turns == 0 || now >= h.valid_until {
            return false;
        }
        self.turns -= 1;
        h.turned = true;
        true
    }

    /// Queues the cleanup's give-back of `m`, a member nobody uses any more
    /// (`Cleanup::give_back_later`, `leave_later`): made, and looked at again, while what
    /// it gives back could live (a hold a lease, a mark its TTL).
    fn clean_up(&self, cfg: &SharedConfig, now: u8, op: Op, fx: &mut Effects) {
        let job = Job::new((self.pid.id, now), op, cfg.lease, cfg.mark_ttl());
        fx.jobs.push(job);
    }

    /// The hold goes back in Redis (`SHARED_RELEASE`), and the process is done; the
    /// cleanup looks again at its member when it was won by a retry, and at the member it
    /// was turned from (`Engine::look_again_if_resent`).
    fn release(&mut self, cfg: &SharedConfig, now: u8, fx: &mut Effects) {
        let Phase::Hold(h) = self.phase else {
            return;
        };
        self.send(now, Op::Release { m: self.held() }, false, fx);
        self.look_again(cfg, now, &h, fx);
        self.phase = Phase::Done;
    }

    /// After the release of `h`: the cleanup gives back its member when it was won by a
    /// retry (`Engine::look_again_if_resent`), and the member it was turned from
    /// (`look_again_at_turned`), and looks again.
    fn look_again(&self, cfg: &SharedConfig, now: u8, h: &Hold, fx: &mut Effects) {
        if h.resent && cfg.rules.look_again_after_release {
            self.clean_up(cfg, now, give_back(self.held()), fx);
        }
        if let Some(from) = h.turned_from.filter(|_| cfg.rules.look_again_at_turned) {
            self.clean_up(cfg, now, give_back(from), fx);
        }
    }

    /// The wait is over (its deadline passed, `Next::Over`, or the call does not wait,
    /// `Next::Stop`): the leave takes its mark out (`WAITER_LEAVE`, passing on a grant that
    /// raced it), when an attempt may have marked it; a member left unsettled, whose next
    /// call will not come, is handed to the cleanup thread, which looks again
    /// (`Contest::leave`, `give_back_unsettled`).
    fn leave(&mut self, cfg: &SharedConfig, now: u8, fx: &mut Effects) {
        let m = self.member();
        if self.marked {
            self.send(now, Op::Leave { m }, false, fx);
        }
        if self.unsettled && cfg.rules.unsettled_handed_on {
            self.clean_up(cfg, now, Op::Leave { m }, fx);
        }
        self.phase = Phase::Done;
    }

    /// After a late win was given back: the next attempt goes, or the wait ends at its
    /// deadline.
    fn after_give_back(&mut self, cfg: &SharedConfig, now: u8, fx: &mut Effects) {
        if cfg.waits_at(now) {
            self.react(cfg, now, fx);
        } else {
            self.leave(cfg, now, fx);
        }
    }

    /// An upgrade that may have run, given up (its reply never came) or given back (won
    /// with no validity left): the write hold it made is given back (the contest's undo,
    /// `SHARED_RELEASE` of the write member), and the upgradable read it converted may be
    /// gone, so the guard is lost (`LostReason::Converted`). A waiting upgrade takes its
    /// mark with it (`WAITER_UNMARK`).
    fn undo_upgrade(
        &mut self,
        cfg: &SharedConfig,
        now: u8,
        m: Member,
        waits: bool,
        fx: &mut Effects,
    ) {
        let Phase::Hold(h) = &mut self.phase else {
            return;
        };
        if !cfg.upgrade_keeps_guard {
            h.valid_until = h.valid_until.min(now);
        }
        h.upgrade = None;
        self.send(
            now,
            Op::Release {
                m: m.turned(Want::Write),
            },
            false,
            fx,
        );
        if waits {
            self.send(now, Op::Unmark { m }, false, fx);
        }
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

    /// A waiter between attempts attempts when woken or due.
    fn react(&mut self, cfg: &SharedConfig, now: u8, fx: &mut Effects) {
        if self.pending.is_some() {
            return;
        }
        match &mut self.phase {
            Phase::Wait { wake, heard, .. } if *heard || now >= *wake => {
                self.attempt(cfg, now, fx);
            }
            Phase::Hold(h) => {
                if let Some((wake, heard)) = h.upgrade
                    && (heard || now >= wake)
                {
                    h.upgrade = Some((wake, false));
                    let op = Op::Upgrade {
                        m: self.held(),
                        waits: cfg.upgrade_waits && cfg.waits_at(now),
                    };
                    self.sent = now;
                    self.resent = 0;
                    self.send(now, op, true, fx);
                }
            }
            _ => {}
        }
    }

    fn attempt(&mut self, cfg: &SharedConfig, now: u8, fx: &mut Effects) {
        if self.take_granted(cfg, now, fx) {
            return;
        }
        self.nonce += 1;
        self.sent = now;
        self.resent = 0;
        self.phase = Phase::Wait {
            wake: now,
            heard: false,
            grant: None,
        };
        let op = Op::Acquire {
            m: self.member(),
            nonce: self.nonce,
            clear: self.marked,
            marks: cfg.waits_at(now),
        };
        self.send(now, op, true, fx);
    }

    /// A grant heard that carries the latest attempt's nonce is the hold, until that
    /// attempt's `sent + grant lease − drift` (Redis ran the attempt before the grant).
    fn take_granted(&mut self, cfg: &SharedConfig, now: u8, fx: &mut Effects) -> bool {
        let Phase::Wait {
            grant: Some((nonce, fence)),
            ..
        } = self.phase
        else {
            return false;
        };
        let ours = match cfg.grants {
            Grants::Trusted => nonce == self.nonce,
            Grants::AnyNonce => true,
            Grants::Confirmed | Grants::FromHearing => false,
        };
        let valid_until = cfg.valid_until(self.sent, cfg.grant_lease);
        if !ours || valid_until <= now {
            return false;
        }
        let renew_at = now + cfg.first_renewal(valid_until - now);
        self.begin(fence, valid_until, renew_at, true, fx);
        true
    }

    /// The wait's member is held. Won by a retry, or while an earlier attempt of the
    /// member was unsettled, the hold is looked at again after its release
    /// (`Contest::settled_by`).
    fn begin(&mut self, fence: u8, valid_until: u8, renew_at: u8, trusted: bool, fx: &mut Effects) {
        self.phase = Phase::Hold(Hold {
            kind: self.want,
            upgrade: None,
            downgrading: false,
            turned: false,
            fence,
            valid_until,
            renew_at,
            trusted,
            resent: self.resent > 0 || self.unsettled,
            turned_from: None,
        });
        self.unsettled = false;
        fx.began = Some((self.want, fence));
    }
}

/// The adversary's handle on a process: its steps.
impl Process for Proc {
    type Cfg = SharedConfig;
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
        self.waits() || self.hold().is_some_and(|h| h.upgrade.is_some())
    }

    /// The first send of the attempt in flight, which its retry may overtake; and of the
    /// upgrade attempt in flight, with `SharedConfig::stall_upgrades`.
    fn may_stall(&self, cfg: &SharedConfig, request: &SharedRequest) -> bool {
        if request.sent != self.sent {
            return false;
        }
        match (&self.phase, request.op) {
            (Phase::Wait { .. }, Op::Acquire { m, nonce, .. }) => {
                m == self.member() && nonce == self.nonce
            }
            (Phase::Hold(h), Op::Upgrade { m, .. }) => {
                cfg.stall_upgrades && h.upgrade.is_some() && m == self.held()
            }
            _ => false,
        }
    }

    fn awaits(&self, request: &SharedRequest) -> bool {
        self.pending.as_ref() == Some(request)
    }

    fn choices(&self, cfg: &SharedConfig, now: u8) -> Vec<Choice> {
        let mut out = vec![Choice::Nothing];
        if let Some(h) = self.hold()
            && !self.pid.paused
            && self.pending.is_none()
        {
            // A thread in `upgrade` does nothing else; a hold known lost is not upgraded
            // (`Error::Lost`).
            if h.upgrade.is_none() {
                out.push(Choice::Release);
                if h.kind == Want::Upgradable && now < h.valid_until {
                    out.push(Choice::Upgrade);
                }
                if cfg.downgrades && h.kind == Want::Write && now < h.valid_until {
                    out.push(Choice::Downgrade);
                }
            }
        }
        out
    }

    /// The start of a tick: the read timeout of a request unanswered.
    fn begin_tick(&mut self, cfg: &SharedConfig, now: u8, fx: &mut Effects) {
        let Some(request) = self.pending else {
            return;
        };
        if now < request.sent + cfg.timeout {
            return;
        }
        self.pending = None;
        match (&mut self.phase, request.op) {
            // The node sends the same call again (`Retry::LOST_REPLY`): same member, same
            // nonce; a hold it wins still counts from the first send.
            (Phase::Wait { .. }, Op::Acquire { .. }) if self.resent < cfg.acquire_retries => {
                self.resent += 1;
                self.send(now, request.op, true, fx);
            }
            (Phase::Wait { .. }, Op::Acquire { .. }) => {
                // The wait fails on a server that did not answer: its leave (`WAITER_LEAVE`)
                // is left to the cleanup thread, which looks again (`Contest::leave_later`),
                // since the unanswered attempt, or an unsettled one, may land after it.
                self.clean_up(cfg, now, Op::Leave { m: self.member() }, fx);
                self.phase = Phase::Done;
            }
            (Phase::Hold(h), Op::Extend { .. }) => {
                h.valid_until = h.valid_until.min(cfg.lease_from(request.sent).0);
                h.renew_at = now + cfg.renew_retry;
            }
            (Phase::Hold(h), Op::Downgrade { m }) => {
                // The read hold the step may have made is released in the background, and
                // the write guard given back as by a drop; the step may have converted the
                // write hold, so it is lost and no local turn takes it over.
                h.downgrading = false;
                if !cfg.downgrade_keeps_turns {
                    h.valid_until = h.valid_until.min(now);
                }
                self.send(
                    now,
                    Op::Release {
                        m: m.turned(Want::Read),
                    },
                    false,
                    fx,
                );
                if !self.pass_turn(now) {
                    self.release(cfg, now, fx);
                }
            }
            // The node sends the upgrade again too (`Retry::LOST_REPLY`), with the same
            // member; the write hold it wins counts from the first send.
            (Phase::Hold(_), Op::Upgrade { .. }) if self.resent < cfg.acquire_retries => {
                self.resent += 1;
                self.send(now, request.op, true, fx);
            }
            (Phase::Hold(_), Op::Upgrade { m, waits }) => self.undo_upgrade(cfg, now, m, waits, fx),
            // A late win's give-back unanswered: the next attempt goes at the threads'
            // turn, or the wait ends at its deadline.
            (Phase::Wait { .. }, Op::Release { .. }) if !cfg.waits_at(now) => {
                self.leave(cfg, now, fx)
            }
            _ => {}
        }
    }

    fn act(&mut self, cfg: &SharedConfig, now: u8, choice: Choice, fx: &mut Effects) {
        match choice {
            Choice::Release => {
                if !self.pass_turn(now) {
                    self.release(cfg, now, fx);
                }
            }
            Choice::Upgrade => {
                if let Phase::Hold(h) = &mut self.phase {
                    h.upgrade = Some((now, false));
                }
                // The upgrade's own wait: no attempt of it has marked yet.
                self.marked = false;
            }
            Choice::Downgrade => {
                if let Phase::Hold(h) = &mut self.phase {
                    h.downgrading = true;
                }
                self.send(now, Op::Downgrade { m: self.held() }, true, fx);
            }
            Choice::Nothing => {}
        }
        if let Phase::Hold(h) = self.phase
            && self.pending.is_none()
            && now >= h.renew_at
            && now < h.valid_until
        {
            self.send(now, Op::Extend { m: self.held() }, true, fx);
        }
        self.react(cfg, now, fx);
    }

    /// A message reaches the process (a waiter listens, and a holder in `upgrade`).
    fn hear(&mut self, cfg: &SharedConfig, now: u8, what: Publish, fx: &mut Effects) {
        let me = self.member();
        if let Phase::Hold(h) = &mut self.phase {
            // A waiting upgrade wakes on `r` and on the wake-up of its upgradable member.
            if let Some((_, heard)) = &mut h.upgrade
                && (what == Publish::Free || what == Publish::Wake(me))
            {
                *heard = true;
                self.react(cfg, now, fx);
            }
            return;
        }
        let Phase::Wait { heard, grant, .. } = &mut self.phase else {
            return;
        };
        match what {
            Publish::Grant { to, fence, .. } if to == me && cfg.grants == Grants::FromHearing => {
                // The unsafe variant: the message is the hold, for the grant lease from now.
                self.pending = None;
                let valid_until = cfg.valid_until(now, cfg.grant_lease);
                self.begin(fence, valid_until, now + cfg.renew_every(), true, fx);
            }
            Publish::Grant { to, nonce, fence } if to == me => {
                *grant = Some((nonce, fence));
                *heard = true;
                self.react(cfg, now, fx);
            }
            Publish::Wake(to) if to == me => {
                *heard = true;
                self.react(cfg, now, fx);
            }
            // To a member the wait gave up (a late win given back): only a wake-up.
            Publish::Grant { to, .. } | Publish::Wake(to) if to.proc == me.proc => {
                *heard = true;
                self.react(cfg, now, fx);
            }
            Publish::Free => {
                *heard = true;
                self.react(cfg, now, fx);
            }
            _ => {}
        }
    }

    fn on_reply(
        &mut self,
        cfg: &SharedConfig,
        now: u8,
        request: SharedRequest,
        answer: Answer,
        fx: &mut Effects,
    ) {
        self.pending = None;
        match (request.op, answer, &mut self.phase) {
            (
                Op::Acquire { m, .. },
                Answer::Won { fence },
                Phase::Wait {
                    wake, heard, grant, ..
                },
            ) => {
                // From the attempt's first send (`judge`).
                let (valid_until, renew_at) = cfg.lease_from(self.sent);
                if valid_until <= now {
                    // No validity left (`Vote::Late`): the hold is given back
                    // (`Contest::undo`, `SHARED_RELEASE` of the member, awaited), and the
                    // next attempt goes once that is answered or given up. The give-back
                    // may run late: the member it carries is spent, and the following
                    // attempts use a new one (`Contest::retire_token`); a grant kept for
                    // the old one is dropped.
                    *wake = now;
                    *heard = false;
                    if !cfg.reuse_given_back_member {
                        *grant = None;
                        // Won by a retry, the give-back is looked at again; what the
                        // member's next call was to settle is left to the cleanup
                        // (`Contest::settle_token`). Both are for a member retired.
                        let look = self.resent > 0 && cfg.rules.look_again_after_release;
                        if look || (self.unsettled && cfg.rules.unsettled_handed_on) {
                            self.clean_up(cfg, now, give_back(m), fx);
                        }
                        self.token += 1;
                        self.unsettled = false;
                    }
                    self.send(now, Op::Release { m }, true, fx);
                    return;
                }
                self.begin(fence, valid_until, renew_at, false, fx);
            }
            // A late win's give-back answered: the next attempt goes.
            (Op::Release { .. }, _, Phase::Wait { .. }) => self.after_give_back(cfg, now, fx),
            (
                Op::Acquire { m, marks, .. },
                Answer::Failed { hint },
                Phase::Wait { wake, heard, grant },
            ) => {
                self.marked |= marks;
                // The sleep ends at the deadline at the latest (then one more attempt).
                *wake = cfg
                    .wake(now, hint, *heard)
                    .min(cfg.deadline.unwrap_or(u8::MAX).max(now));
                let granted = grant.is_some();
                // A retry answered `held`: an unknown outcome, its first send may still
                // land. The member is kept, and its next call settles it
                // (`Contest::unsettled`), but an upgradable read's, whose leave gives back
                // no hold: that one is given back by the cleanup, and the wait goes on
                // with a new member (`Contest::undo`, `retire_token`).
                if self.resent > 0 {
                    if m.want == Want::Upgradable {
                        self.clean_up(cfg, now, give_back(m), fx);
                        self.token += 1;
                    } else {
                        self.unsettled = true;
                    }
                }
                // Past the deadline the wait ends, unless a grant was heard: taken, or
                // one more attempt confirms it.
                if cfg.waits_at(now) || granted {
                    self.react(cfg, now, fx);
                } else {
                    self.leave(cfg, now, fx);
                }
            }
            (Op::Extend { .. }, Answer::Done(true), Phase::Hold(h)) => {
                let (valid_until, renew_at) = cfg.lease_from(request.sent);
                h.valid_until = h.valid_until.max(valid_until);
                h.renew_at = renew_at;
                // An upgrade due meanwhile goes now.
                self.react(cfg, now, fx);
            }
            (Op::Extend { .. }, _, Phase::Hold(h)) => h.valid_until = h.valid_until.min(now),
            (Op::Upgrade { m, waits }, Answer::Won { fence }, Phase::Hold(h)) => {
                // From the upgrade's first send (`judge`); with no validity left, the
                // conversion is given back and the guard is lost (`Round::Late`).
                let (valid_until, renew_at) = cfg.lease_from(self.sent);
                if valid_until <= now {
                    return self.undo_upgrade(cfg, now, m, waits, fx);
                }
                // The write hold is not looked at again after its release (an upgrade's
                // retry is not told, `Protocol::acquire`), but the upgradable read it was
                // turned from is, when that was won by a retry (`set_turned_from`).
                *h = Hold {
                    kind: Want::Write,
                    fence,
                    valid_until,
                    renew_at,
                    trusted: false,
                    upgrade: None,
                    downgrading: false,
                    turned: false,
                    resent: false,
                    turned_from: turned_from(h, m),
                };
                fx.began = Some((Want::Write, fence));
            }
            (Op::Downgrade { m }, Answer::Done(true), Phase::Hold(h)) => {
                // The read hold counts from the downgrade's send.
                let (valid_until, renew_at) = cfg.lease_from(request.sent);
                *h = Hold {
                    kind: Want::Read,
                    valid_until,
                    renew_at,
                    downgrading: false,
                    resent: false,
                    turned_from: turned_from(h, m),
                    ..*h
                };
            }
            // The write hold was gone: lost, and its guard dropped with no hold to release
            // (the release finds none), whose cleanup still looks again.
            (Op::Downgrade { .. }, _, Phase::Hold(h)) => {
                let h = *h;
                self.look_again(cfg, now, &h, fx);
                self.phase = Phase::Done;
            }
            // The upgradable read is gone (`Error::Lost`): the upgrade ends, and a waiting
            // one takes the mark an earlier attempt made with it (`Contest::leave`,
            // `WAITER_UNMARK`).
            (Op::Upgrade { m, waits }, Answer::Gone, Phase::Hold(h)) => {
                h.valid_until = h.valid_until.min(now);
                h.upgrade = None;
                if waits {
                    self.send(now, Op::Unmark { m }, false, fx);
                }
            }
            (Op::Upgrade { m, waits }, Answer::Failed { hint }, Phase::Hold(h)) => {
                // `try_upgrade` gives up; `upgrade` sleeps until the other holds' end, the
                // re-check, a message or its deadline; past the deadline it ends, and takes
                // the mark its attempts made with it (`Contest::leave`, `WAITER_UNMARK`).
                // The guard keeps its upgradable read.
                self.marked |= waits;
                let deadline = cfg.deadline.unwrap_or(u8::MAX).max(now);
                h.upgrade = h
                    .upgrade
                    .filter(|_| cfg.upgrade_waits && cfg.waits_at(now))
                    .map(|(_, heard)| (cfg.wake(now, hint, heard).min(deadline), false));
                if h.upgrade.is_none() && cfg.upgrade_waits && self.marked {
                    self.send(now, Op::Unmark { m }, false, fx);
                }
                self.react(cfg, now, fx);
            }
            _ => {}
        }
    }
}

/// The member a turn of `h` (from `m`) retires, for its release to look at again: `m` when
/// `h` was won by a retry, else what `h` was turned from, if anything
/// (`RemoteLock::set_turned_from`).
fn turned_from(h: &Hold, m: Member) -> Option<Member> {
    if h.resent { Some(m) } else { h.turned_from }
}

/// The cleanup's give-back of `m`, a member nobody uses any more (`Undo::give_back`):
/// `WAITER_LEAVE`, which takes out a hold of it (a grant to it too) or its waiting mark;
/// an upgradable read's leave takes out no hold, so it is `SHARED_RELEASE` of it, which
/// also gives back a write hold a late upgrade made of it.
fn give_back(m: Member) -> Op {
    match m.want {
        Want::Upgradable => Op::Release { m },
        _ => Op::Leave { m },
    }
}
