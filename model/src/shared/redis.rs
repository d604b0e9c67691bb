//! Redis for a read-write lock or a semaphore: the holds in one sorted set, the waiting
//! marks and their nonces, the fence counter; and the scripts of `proto::rw_scripts` as
//! atomic steps (`RW_ACQUIRE`, `SEM_ACQUIRE`, `RW_UPGRADE`, `RW_DOWNGRADE`,
//! `SHARED_RELEASE` with `PASS_ON`, `WAITER_LEAVE`, `WAITER_UNMARK`, `SHARED_EXTEND`).
//!
//! `SHARED_RELEASE` of an upgradable read that a late upgrade turned into the write hold
//! of its token gives that write hold back (`SharedRules::release_gives_back_turned`).
//!
//! Scores are ticks. A hold or a mark whose score has passed stays in its set until a
//! script takes it out, as in Redis; its score then reads 0 (`expire`), so that states
//! differing only in how long ago something expired are one state.
//!
//! The key's own TTL: every script keeps it at its longest hold (a hold only lengthens
//! it, the end of a hold fits it to the longest left, `fit`, and a permit's grant fits it
//! to the grant when no other hold lives longer), so the key goes when its last live hold
//! expires. A semaphore's key does so here (`expire`): a permit-seeker that leaves after
//! its granted permit lapsed with the key finds nothing to pass on and wakes the next
//! waiter (`leave`), and a late release of a lapsed permit is a no-op. A read-write
//! lock's key is kept here until a script takes its holds out, on the side of more
//! behaviour (a late release of an expired hold still passes it on). The fence counter's
//! loss forms are left out, also on that side (a write grant after a write hold that
//! expired carries nonce 0 in the library, a wake-up; here it carries the nonce, so it is
//! trusted more often, never less). Marks of equal score are taken in the order of their
//! members, as Redis does; in the library members are random UUIDs, so any order can
//! happen, of which the model checks one.

use crate::shared::config::{SharedConfig, Want};

/// A hold's or a mark's owner: one process's one wait (a process takes one hold), the
/// member it uses now (`r<token>`, `w<token>`, `p<token>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Member {
    pub want: Want,
    pub proc: u8,
    /// Which of the wait's members: the wait takes a new one after it gave a late win
    /// back (`Contest::retire_token`).
    pub token: u8,
}

impl Member {
    /// The member of the same token for a hold of kind `want`: what an upgrade or a
    /// downgrade turns this one into (`Want::member_like`).
    pub fn turned(self, want: Want) -> Member {
        Member { want, ..self }
    }
}

/// Which waiting marks: `…:ww` (writers, permit-seekers, waiting upgrades) or `…:wr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Set {
    Writers,
    Readers,
}

/// A sorted-set member and its score.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Entry {
    pub member: Member,
    /// When it expires (a tick); 0 once it has.
    pub exp: u8,
}

/// A script call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// `RW_ACQUIRE` or `SEM_ACQUIRE`: the attempt numbered `nonce` of a wait, which marks
    /// itself waiting if it fails and `marks` (the caller would wait: `Marks::leave`);
    /// `clear`: an earlier attempt of the wait may have marked it (a hold won takes the
    /// mark and its nonce out).
    Acquire {
        m: Member,
        nonce: u8,
        clear: bool,
        marks: bool,
    },
    /// `SHARED_RELEASE` (an upgradable read's also gives back the write hold a late
    /// upgrade turned it into).
    Release { m: Member },
    /// `WAITER_LEAVE`: the wait ends without the hold.
    Leave { m: Member },
    /// `SHARED_EXTEND`: the watchdog's renewal.
    Extend { m: Member },
    /// `RW_UPGRADE` of the upgradable hold `m`; one that `waits` marks it as a waiting
    /// writer when other holds remain.
    Upgrade { m: Member, waits: bool },
    /// `RW_DOWNGRADE` of the write hold `m`: the read hold of the same token replaces it.
    Downgrade { m: Member },
    /// `WAITER_UNMARK` of a waiting upgrade: its mark among the writers goes, and `r`
    /// tells the readers it held back.
    Unmark { m: Member },
}

impl crate::net::GiveBack for Op {
    fn is_leave(&self) -> bool {
        matches!(self, Op::Leave { .. })
    }
}

impl Op {
    /// The member the call names.
    pub fn member(self) -> Member {
        match self {
            Op::Acquire { m, .. }
            | Op::Release { m }
            | Op::Leave { m }
            | Op::Extend { m }
            | Op::Upgrade { m, .. }
            | Op::Downgrade { m }
            | Op::Unmark { m } => m,
        }
    }

    /// The members a call can leave in Redis (a hold or a mark): an attempt's, an
    /// upgrade's upgradable read and the write hold it turns it into.
    pub fn leaves(self) -> [Option<Member>; 2] {
        match self {
            Op::Acquire { m, .. } => [Some(m), None],
            Op::Upgrade { m, .. } => [Some(m), Some(m.turned(Want::Write))],
            _ => [None, None],
        }
    }
}

/// A script's reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Answer {
    /// The hold is the caller's, with the fence counter's value (a write hold's own).
    Won { fence: u8 },
    /// Not now: ticks until the earliest obstacle ends (the re-check when unknown).
    Failed { hint: u8 },
    /// Release, leave, renewal: whether the hold was live.
    Done(bool),
    /// An upgrade found no upgradable hold to turn into the write hold.
    Gone,
}

/// A message on the lock's channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Publish {
    /// `r`: whoever waits may get in.
    Free,
    /// `g<member>:0`: a wake-up for one waiter.
    Wake(Member),
    /// `g<member>:<nonce>:<fence>:<grant ms>`: the hold was granted to `to`, told the
    /// nonce of its latest attempt that Redis ran (0: none).
    Grant { to: Member, nonce: u8, fence: u8 },
}

/// What `…:qn` keeps for a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Noted {
    /// Its latest attempt's nonce (positive).
    Nonce(u8),
    /// The expiry of the mark a wake-up took (`wake_first` with nonces; stored negated in
    /// the library), kept until its next attempt re-marks it there; 0 once it has passed.
    Place(u8),
}

/// The name's keys.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Redis {
    /// The lock key's holds (`r…`, `w…`, `p…` members).
    pub holds: Vec<Entry>,
    /// `…:ww`: waiting writers, or a semaphore's waiting permit-seekers.
    pub writers: Vec<Entry>,
    /// `…:wr`: waiting readers.
    pub readers: Vec<Entry>,
    /// `…:qn`: the nonce of each marked waiter's latest attempt, or the place a woken
    /// permit-seeker's mark had.
    pub nonces: Vec<(Member, Noted)>,
    /// `…:wa`: the members of `…:ww` in the order they came (their wait's first mark,
    /// `ZADD NX`, kept by their re-marks): the order a release grants in. Only the order
    /// is kept: the library's scores are server times, and two arrivals never tie here.
    pub arrivals: Vec<Member>,
    /// The fence counter: the last fence issued (to a write hold).
    pub fence: u8,
}

fn score(set: &[Entry], m: Member) -> Option<u8> {
    set.iter().find(|e| e.member == m).map(|e| e.exp)
}

/// `ZADD`: sets `m`'s score.
fn zadd(set: &mut Vec<Entry>, m: Member, exp: u8) {
    zrem(set, m);
    set.push(Entry { member: m, exp });
    set.sort_unstable();
}

/// `ZREM`: whether `m` was there.
fn zrem(set: &mut Vec<Entry>, m: Member) -> bool {
    let before = set.len();
    set.retain(|e| e.member != m);
    set.len() < before
}

fn live(set: &[Entry], now: u8) -> impl Iterator<Item = &Entry> {
    set.iter().filter(move |e| e.exp > now)
}

/// The live entry that expires first (ties: the lower member, as Redis orders them): the
/// first hold, or the waiter renewed least lately (`first_waiting`).
fn first(set: &[Entry], now: u8) -> Option<Entry> {
    live(set, now).min_by_key(|e| (e.exp, e.member)).copied()
}

impl Redis {
    /// The expiry of the mark a wake-up took from `m`, kept with its nonce.
    fn place(&self, m: Member) -> Option<u8> {
        self.nonces.iter().find_map(|&(x, n)| match n {
            Noted::Place(exp) if x == m => Some(exp),
            _ => None,
        })
    }

    /// `first_arrived`: the live mark of `…:ww` that came first by `…:wa`; the arrivals
    /// whose mark expired or went are dropped on the way, but for a woken permit-seeker's
    /// while the mark it had would live (it keeps its place until its next attempt).
    fn first_arrived(&mut self, now: u8) -> Option<Entry> {
        let mut at = 0;
        while let Some(&a) = self.arrivals.get(at) {
            match score(&self.writers, a) {
                Some(exp) if exp > now => return Some(Entry { member: a, exp }),
                None if self.place(a).is_some_and(|exp| exp > now) => at += 1,
                _ => {
                    self.arrivals.remove(at);
                }
            }
        }
        None
    }

    /// The waiting writer or permit-seeker waiting longest: by arrival, else (marks with
    /// no arrival, an older library's) the one whose mark expires first.
    fn longest_waiting(&mut self, now: u8) -> Option<Entry> {
        self.first_arrived(now)
            .or_else(|| first(&self.writers, now))
    }

    /// `m`'s mark of `…:ww` and its arrival go.
    fn unmark_writer(&mut self, m: Member) -> bool {
        self.arrivals.retain(|&x| x != m);
        zrem(&mut self.writers, m)
    }

    /// Time reached `now`: what expired reads score 0.
    pub fn expire(&mut self, now: u8) {
        for set in [&mut self.holds, &mut self.writers, &mut self.readers] {
            for e in set.iter_mut().filter(|e| e.exp <= now) {
                e.exp = 0;
            }
            set.sort_unstable();
        }
        for (_, noted) in &mut self.nonces {
            if let Noted::Place(exp) = noted
                && *exp <= now
            {
                *exp = 0;
            }
        }
        // An arrival whose mark expired, with no place a wake-up keeps for it, is read as
        // none (`first_arrived` and `mark` drop it): dropped now, so that states that
        // differ in it alone are one.
        let arrivals = std::mem::take(&mut self.arrivals);
        self.arrivals = arrivals
            .into_iter()
            .filter(|&a| {
                score(&self.writers, a).is_some_and(|exp| exp > 0)
                    || self.place(a).is_some_and(|exp| exp > 0)
            })
            .collect();
        // A semaphore's key goes with its last live hold (its TTL is its longest hold's):
        // the expired holds go with it.
        if self
            .holds
            .iter()
            .all(|e| e.exp == 0 && e.member.want == Want::Permit)
        {
            self.holds.clear();
        }
    }

    /// Runs `op`'s script at `now`: its reply and what it published.
    pub fn run(&mut self, cfg: &SharedConfig, now: u8, op: Op) -> (Answer, Vec<Publish>) {
        let mut out = Vec::new();
        let answer = match op {
            Op::Acquire {
                m,
                nonce,
                clear,
                marks,
            } => self.acquire(cfg, now, m, (nonce, clear, marks)),
            Op::Release { m } => {
                // The waiting upgrade's mark goes with its upgradable read.
                if m.want == Want::Upgradable
                    && cfg.rules.release_takes_upgrade_mark
                    && self.unmark_writer(m)
                {
                    out.push(Publish::Free);
                }
                self.release(cfg, now, m, &mut out)
            }
            Op::Leave { m } => Answer::Done(self.leave(cfg, now, m, &mut out)),
            Op::Extend { m } => {
                let live =
                    score(&self.holds, m).is_some_and(|exp| exp > now || cfg.renewal_revives);
                if live {
                    zadd(&mut self.holds, m, now + cfg.lease);
                }
                Answer::Done(live)
            }
            Op::Upgrade { m, waits } => self.upgrade(cfg, now, m, waits),
            Op::Downgrade { m } => Answer::Done(self.downgrade(cfg, now, m, &mut out)),
            Op::Unmark { m } => {
                let marked = self.unmark_writer(m);
                if marked {
                    out.push(Publish::Free);
                }
                Answer::Done(marked)
            }
        };
        (answer, out)
    }

    /// `SHARED_RELEASE` of `m`: whether it was live. An upgradable read gone because a
    /// late upgrade of it turned it into the write hold of its token: that write hold,
    /// which nobody uses, goes with it (`SharedRules::release_gives_back_turned`).
    fn release(
        &mut self,
        cfg: &SharedConfig,
        now: u8,
        m: Member,
        out: &mut Vec<Publish>,
    ) -> Answer {
        match score(&self.holds, m) {
            None => {
                let w = m.turned(Want::Write);
                if m.want == Want::Upgradable
                    && cfg.rules.release_gives_back_turned
                    && zrem(&mut self.holds, w)
                {
                    self.pass_on(cfg, now, Want::Write, out);
                }
                Answer::Done(false)
            }
            Some(exp) => {
                zrem(&mut self.holds, m);
                self.pass_on(cfg, now, m.want, out);
                Answer::Done(exp > now)
            }
        }
    }

    /// `RW_DOWNGRADE`: whether the write hold `m` is (now) the read hold of its token; `r`
    /// when readers wait and no writer does.
    fn downgrade(
        &mut self,
        cfg: &SharedConfig,
        now: u8,
        m: Member,
        out: &mut Vec<Publish>,
    ) -> bool {
        let r = m.turned(Want::Read);
        if score(&self.holds, m).is_none_or(|exp| exp <= now) {
            // A retry whose downgrade ran finds the read hold.
            return score(&self.holds, r).is_some_and(|exp| exp > now);
        }
        zrem(&mut self.holds, m);
        zadd(&mut self.holds, r, now + cfg.lease);
        if first(&self.readers, now).is_some() && first(&self.writers, now).is_none() {
            out.push(Publish::Free);
        }
        true
    }

    /// `RW_UPGRADE`: the upgradable hold `m` becomes the write hold of the same token once
    /// it is the only hold (a retry whose upgrade ran finds the write hold).
    fn upgrade(&mut self, cfg: &SharedConfig, now: u8, m: Member, waits: bool) -> Answer {
        self.holds.retain(|e| e.exp > now);
        let w = m.turned(Want::Write);
        let head = first(&self.holds, now);
        if head.is_some_and(|h| h.member == w) {
            zadd(&mut self.holds, w, now + cfg.lease);
            return Answer::Won { fence: self.fence };
        }
        if score(&self.holds, m).is_none() {
            return Answer::Gone;
        }
        let other = live(&self.holds, now).find(|e| e.member != m).copied();
        match other {
            Some(other) => {
                if waits {
                    self.mark(cfg, now, Set::Writers, m, None);
                }
                Answer::Failed {
                    hint: other.exp - now,
                }
            }
            None => {
                self.fence += 1;
                zrem(&mut self.holds, m);
                zadd(&mut self.holds, w, now + cfg.lease);
                self.unmark_writer(m);
                Answer::Won { fence: self.fence }
            }
        }
    }

    fn marks(&mut self, want: Want) -> &mut Vec<Entry> {
        match want {
            Want::Read | Want::Upgradable => &mut self.readers,
            Want::Write | Want::Permit => &mut self.writers,
        }
    }

    /// Takes `m`'s entry out of `…:qn`: the nonce a grant tells (0: none, or a place,
    /// which no attempt's nonce matches).
    fn take_nonce(&mut self, m: Member) -> u8 {
        let n = self.nonces.iter().find(|(x, _)| *x == m).map(|(_, n)| *n);
        self.nonces.retain(|(x, _)| *x != m);
        match n {
            Some(Noted::Nonce(n)) => n,
            _ => 0,
        }
    }

    /// `mark`: drops the marks of `set` that expired (and their nonces), marks `m` waiting
    /// until `now + ttl` and stores `nonce` as its latest attempt's (an upgradable read,
    /// which is never granted, and a waiting upgrade store none).
    fn mark(&mut self, cfg: &SharedConfig, now: u8, set: Set, m: Member, nonce: Option<u8>) {
        self.mark_at(now, set, m, now + cfg.mark_ttl(), nonce);
    }

    /// `mark` with `place`: marks `m` waiting until `exp`; a waiting writer or
    /// permit-seeker's arrival is recorded at its first mark (the marks that expired
    /// leave the arrivals too).
    fn mark_at(&mut self, now: u8, which: Set, m: Member, exp: u8, nonce: Option<u8>) {
        let set = match which {
            Set::Writers => &mut self.writers,
            Set::Readers => &mut self.readers,
        };
        let dead: Vec<Member> = set
            .iter()
            .filter(|e| e.exp <= now)
            .map(|e| e.member)
            .collect();
        set.retain(|e| e.exp > now);
        zadd(set, m, exp);
        self.nonces.retain(|(x, _)| !dead.contains(x) && *x != m);
        if which == Set::Writers {
            self.arrivals.retain(|x| !dead.contains(x));
            if !self.arrivals.contains(&m) {
                self.arrivals.push(m);
            }
        }
        if let Some(nonce) = nonce {
            self.nonces.push((m, Noted::Nonce(nonce)));
            self.nonces.sort_unstable();
        }
    }

    /// A hold won takes its mark (and nonce) out, when an earlier attempt may have made it.
    fn unmark(&mut self, m: Member, clear: bool) {
        if clear && zrem(self.marks(m.want), m) {
            self.take_nonce(m);
            self.arrivals.retain(|&x| x != m);
        }
    }

    fn acquire(
        &mut self,
        cfg: &SharedConfig,
        now: u8,
        m: Member,
        (nonce, clear, marks): (u8, bool, bool),
    ) -> Answer {
        // `load`: the expired holds go (all of them, once the first has expired).
        self.holds.retain(|e| e.exp > now);
        let head = first(&self.holds, now);
        let mine = score(&self.holds, m).is_some();
        let hint = |exp: Option<u8>| Answer::Failed {
            hint: exp.map_or(cfg.recheck, |exp| exp - now),
        };
        match m.want {
            Want::Write => {
                if head.is_some_and(|f| f.member == m) {
                    zadd(&mut self.holds, m, now + cfg.lease);
                    return Answer::Won { fence: self.fence };
                }
                if head.is_none() {
                    self.fence += 1;
                    zadd(&mut self.holds, m, now + cfg.lease);
                    self.unmark(m, clear);
                    return Answer::Won { fence: self.fence };
                }
                if marks {
                    self.mark(cfg, now, Set::Writers, m, Some(nonce));
                }
                hint(head.map(|f| f.exp))
            }
            Want::Read | Want::Upgradable => {
                let writer = first(&self.writers, now);
                let free = head.is_none_or(|f| f.member.want != Want::Write) && writer.is_none();
                // One upgradable hold at a time.
                let other_u = live(&self.holds, now)
                    .find(|e| e.member.want == Want::Upgradable && e.member != m)
                    .filter(|_| m.want == Want::Upgradable && free)
                    .copied();
                let free = free && other_u.is_none();
                if free || mine {
                    zadd(&mut self.holds, m, now + cfg.lease);
                    self.unmark(m, clear);
                    return Answer::Won { fence: self.fence };
                }
                let nonce = Some(nonce).filter(|_| m.want == Want::Read);
                if marks {
                    self.mark(cfg, now, Set::Readers, m, nonce);
                }
                let head = other_u.or(head);
                let until = [head.map(|f| f.exp), writer.map(|w| w.exp)];
                hint(until.into_iter().flatten().min())
            }
            Want::Permit => {
                let n = live(&self.holds, now).count();
                if n < usize::from(cfg.permits) || mine {
                    zadd(&mut self.holds, m, now + cfg.lease);
                    // Its mark, and its nonce or place and arrival, which outlive the
                    // mark a wake-up took.
                    self.unmark_writer(m);
                    self.take_nonce(m);
                    return Answer::Won { fence: 0 };
                }
                // Woken with no permit to take (its mark taken, its place and arrival
                // kept): marked again with the expiry it had while that outlives its next
                // attempt (half a mark's TTL, its re-check), else a mark's TTL ahead.
                let exp = self
                    .place(m)
                    .filter(|&exp| exp > now + cfg.mark_ttl() / 2)
                    .unwrap_or(now + cfg.mark_ttl());
                if marks {
                    self.mark_at(now, Set::Writers, m, exp, Some(nonce));
                }
                hint(head.map(|f| f.exp))
            }
        }
    }

    /// `WAITER_LEAVE`: whether a hold granted to `m` was passed on.
    fn leave(&mut self, cfg: &SharedConfig, now: u8, m: Member, out: &mut Vec<Publish>) -> bool {
        let noted = self.nonces.iter().any(|(x, _)| *x == m);
        self.take_nonce(m);
        self.arrivals.retain(|&x| x != m);
        if score(&self.holds, m).is_some_and(|exp| exp > now) {
            zrem(&mut self.holds, m);
            self.pass_on(cfg, now, m.want, out);
            return true;
        }
        // A permit granted to it (or taken by an attempt whose reply was lost) that lapsed
        // unused goes on, as a release's would: nobody else was told it is free.
        if m.want == Want::Permit && zrem(&mut self.holds, m) {
            self.pass_on(cfg, now, m.want, out);
            return true;
        }
        let was_marked = zrem(self.marks(m.want), m);
        match m.want {
            // A mark a release took to wake it (its nonce, or place, still here): the
            // wake-up goes on. No nonce: it never marked, or this leave ran before, or a
            // permit granted to it lapsed (gone with the key, or dropped by another
            // attempt): when a permit is free, nobody was told, and the next waiter is
            // woken.
            Want::Permit
                if !was_marked
                    && (noted
                        || (live(&self.holds, now).count() < usize::from(cfg.permits)
                            && first(&self.writers, now).is_some())) =>
            {
                self.wake_first(now, out)
            }
            Want::Permit => {}
            _ if was_marked => out.push(Publish::Free),
            _ => {}
        }
        false
    }

    /// `PASS_ON`, after a hold of kind `ended` was taken out.
    fn pass_on(&mut self, cfg: &SharedConfig, now: u8, ended: Want, out: &mut Vec<Publish>) {
        let left = live(&self.holds, now).count();
        if ended == Want::Permit {
            if !self.grant_permit(cfg, now, left, out) && left == 0 {
                self.holds.clear();
            }
            return;
        }
        if left == 0 {
            if !self.grant_first(cfg, now, out) {
                self.holds.clear();
            }
            return;
        }
        let mut holds = live(&self.holds, now);
        match (holds.next(), holds.next()) {
            // An upgradable hold left alone, waiting to upgrade, is woken.
            (Some(u), None)
                if u.member.want == Want::Upgradable
                    && score(&self.writers, u.member).is_some_and(|exp| exp > now) =>
            {
                out.push(Publish::Wake(u.member));
            }
            // The end of an upgradable hold tells the readers it held back.
            _ if ended == Want::Upgradable && first(&self.readers, now).is_some() => {
                out.push(Publish::Free);
            }
            _ => {}
        }
    }

    /// `grant_first`: the write hold to the writer waiting longest, else read holds to
    /// every reader marked waiting, else `r`. Whether it wrote holds.
    fn grant_first(&mut self, cfg: &SharedConfig, now: u8, out: &mut Vec<Publish>) -> bool {
        // An upgrade waiting whose upgradable hold is gone (no hold is live here): woken,
        // its mark taken out, and the grant goes on to the next waiting.
        while let Some(w) = self
            .longest_waiting(now)
            .filter(|w| w.member.want == Want::Upgradable)
        {
            self.unmark_writer(w.member);
            out.push(Publish::Wake(w.member));
        }
        if let Some(w) = self.longest_waiting(now) {
            self.fence += 1;
            self.grant(cfg, now, w.member, self.fence, out);
            return true;
        }
        // Readers marked waiting get read holds; an upgradable read, or nobody marked, is
        // told `r`.
        let marked: Vec<Member> = live(&self.readers, now).map(|e| e.member).collect();
        let readers: Vec<Member> = marked
            .iter()
            .copied()
            .filter(|m| m.want == Want::Read)
            .collect();
        for &r in &readers {
            self.grant(cfg, now, r, self.fence, out);
        }
        if readers.len() < marked.len() || marked.is_empty() {
            out.push(Publish::Free);
        }
        !readers.is_empty()
    }

    /// `m`, marked waiting, is held for the grant lease; its mark and nonce go, and the
    /// message tells it that nonce and `fence`.
    fn grant(&mut self, cfg: &SharedConfig, now: u8, m: Member, fence: u8, out: &mut Vec<Publish>) {
        zadd(&mut self.holds, m, now + cfg.grant_lease);
        zrem(self.marks(m.want), m);
        self.arrivals.retain(|&x| x != m);
        let nonce = self.take_nonce(m);
        out.push(Publish::Grant {
            to: m,
            nonce,
            fence,
        });
    }

    /// `grant_permit`: a free permit to the permit-seeker waiting longest, or the
    /// wake-up of old. Whether it granted.
    fn grant_permit(
        &mut self,
        cfg: &SharedConfig,
        now: u8,
        left: usize,
        out: &mut Vec<Publish>,
    ) -> bool {
        match self.longest_waiting(now) {
            Some(w) if left < usize::from(cfg.permits) => {
                // The key's TTL is fitted to its longest live hold (`fit`), the grant's
                // when none lives longer: should the grantee never take it, the key goes
                // with it (`expire`), not with the released permit's lease.
                self.grant(cfg, now, w.member, 0, out);
                true
            }
            _ => {
                self.wake_first(now, out);
                false
            }
        }
    }

    /// `wake_first` (taking the mark, with the nonces): `g<member>:0` to the one waiting
    /// longest, whose mark's expiry takes its nonce's place, and whose arrival stays; or
    /// `r`.
    fn wake_first(&mut self, now: u8, out: &mut Vec<Publish>) {
        match self.longest_waiting(now) {
            Some(w) => {
                zrem(&mut self.writers, w.member);
                for (x, noted) in &mut self.nonces {
                    if *x == w.member {
                        *noted = Noted::Place(w.exp);
                    }
                }
                out.push(Publish::Wake(w.member));
            }
            None => out.push(Publish::Free),
        }
    }
}
