//! A process waiting for, holding and releasing one shared hold.
//!
//! What each step mirrors in the library (`engine::contest`, the same loop as the lock's):
//!
//! - `Proc::attempt`: one round, `RW_ACQUIRE` or `SEM_ACQUIRE` with the wait's member and
//!   the next nonce. A won attempt's validity counts from when it was sent; a failed one
//!   sleeps until the obstacle's end or the re-check, or goes again at once if a message
//!   came meanwhile.
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
//!   spent the wait fails: `WAITER_LEAVE` passes on a hold the lost attempt may have
//!   taken, or a grant that raced it.
//! - The watchdog renews (`SHARED_EXTEND`) once a third of the lease passed; a renewal's
//!   reply gives `max(old, sent + lease − drift)`, its loss leaves the validity as it was
//!   (a renewal sent later never shortens it), a hold gone ends it.
//! - `Choice::Release`: `SHARED_RELEASE`, after any renewal in flight.
//! - `Choice::Upgrade` (an upgradable read's): `RW_UPGRADE`, once or (`upgrade`) until it
//!   wins, asleep between attempts as a waiter is; unanswered, the upgradable read is
//!   lost and the write hold it may have made is given back. `Choice::Downgrade` (a
//!   write hold's): `RW_DOWNGRADE`; the thread claims nothing until it returns, and the
//!   read hold counts from its send; unanswered, the write hold is lost too.
//! - Local turns (`SharedConfig::turns`, `engine::turns`): a reading or writing process's
//!   next thread takes its hold over when the holding thread lets go, with no request,
//!   while the hold is not known lost and its validity lasts.

use crate::config::Grants;
use crate::net::Request;
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
    /// The latest attempt's nonce and when it was first sent.
    pub nonce: u8,
    pub sent: u8,
    /// How many times the latest attempt was sent again.
    pub resent: u8,
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
                        waits: cfg.upgrade_waits,
                    };
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
        });
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
                self.send(now, Op::Leave { m: self.member() }, false, fx);
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
                let r = Member {
                    want: Want::Read,
                    ..m
                };
                self.send(now, Op::Release { m: r }, false, fx);
                if !self.pass_turn(now) {
                    self.send(now, Op::Release { m }, false, fx);
                    self.phase = Phase::Done;
                }
            }
            (Phase::Hold(h), Op::Upgrade { m, waits }) => {
                // The upgrade may have run: the write hold it made is given back (the
                // contest's undo), and the upgradable read it converted may be gone. A
                // waiting upgrade takes its mark with it (`WAITER_UNMARK`).
                if !cfg.upgrade_keeps_guard {
                    h.valid_until = h.valid_until.min(now);
                }
                h.upgrade = None;
                let w = Member {
                    want: Want::Write,
                    ..m
                };
                self.send(now, Op::Release { m: w }, false, fx);
                if waits {
                    self.send(now, Op::Unmark { m }, false, fx);
                }
            }
            _ => {}
        }
    }

    fn act(&mut self, cfg: &SharedConfig, now: u8, choice: Choice, fx: &mut Effects) {
        match choice {
            Choice::Release => {
                if !self.pass_turn(now) {
                    self.send(now, Op::Release { m: self.held() }, false, fx);
                    self.phase = Phase::Done;
                }
            }
            Choice::Upgrade => {
                if let Phase::Hold(h) = &mut self.phase {
                    h.upgrade = Some((now, false));
                }
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
                        self.token += 1;
                    }
                    self.send(now, Op::Release { m }, true, fx);
                    return;
                }
                self.begin(fence, valid_until, renew_at, false, fx);
            }
            // A late win's give-back answered: the next attempt goes.
            (Op::Release { .. }, _, Phase::Wait { .. }) => self.react(cfg, now, fx),
            (Op::Acquire { .. }, Answer::Failed { hint }, Phase::Wait { wake, heard, .. }) => {
                self.marked = true;
                *wake = cfg.wake(now, hint, *heard);
                self.react(cfg, now, fx);
            }
            (Op::Extend { .. }, Answer::Done(true), Phase::Hold(h)) => {
                let (valid_until, renew_at) = cfg.lease_from(request.sent);
                h.valid_until = h.valid_until.max(valid_until);
                h.renew_at = renew_at;
                // An upgrade due meanwhile goes now.
                self.react(cfg, now, fx);
            }
            (Op::Extend { .. }, _, Phase::Hold(h)) => h.valid_until = h.valid_until.min(now),
            (Op::Upgrade { .. }, Answer::Won { fence }, Phase::Hold(h)) => {
                let (valid_until, renew_at) = cfg.lease_from(request.sent);
                *h = Hold {
                    kind: Want::Write,
                    fence,
                    valid_until,
                    renew_at,
                    trusted: false,
                    upgrade: None,
                    downgrading: false,
                    turned: false,
                };
                fx.began = Some((Want::Write, fence));
            }
            (Op::Downgrade { .. }, Answer::Done(true), Phase::Hold(h)) => {
                // The read hold counts from the downgrade's send.
                let (valid_until, renew_at) = cfg.lease_from(request.sent);
                *h = Hold {
                    kind: Want::Read,
                    valid_until,
                    renew_at,
                    downgrading: false,
                    ..*h
                };
            }
            (Op::Downgrade { .. }, _, Phase::Hold(_)) => self.phase = Phase::Done,
            (Op::Upgrade { .. }, Answer::Gone, Phase::Hold(h)) => {
                h.valid_until = h.valid_until.min(now);
                h.upgrade = None;
            }
            (Op::Upgrade { .. }, Answer::Failed { hint }, Phase::Hold(h)) => {
                // `try_upgrade` gives up; `upgrade` sleeps until the other holds' end, the
                // re-check, or a message.
                h.upgrade = h
                    .upgrade
                    .filter(|_| cfg.upgrade_waits)
                    .map(|(_, heard)| (cfg.wake(now, hint, heard), false));
                self.react(cfg, now, fx);
            }
            _ => {}
        }
    }
}
