//! The Redis server: the lock key with its TTL, the fence counter and the fair queue, and
//! the scripts as atomic steps on them.
//!
//! The fence counter keeps, next to the last fence, whether that hold was released
//! (`proto::scripts::FENCE_FN`'s forms `<f>`, `-<f>`, `-0<f>`), from which an acquisition
//! learns whether the hold before it ended without a release (`previous_lost`). Beside
//! the real state, Redis keeps a ghost of what that answer should be ([`Truth`]), from
//! the events themselves: a property checks that every answer equals it.
//!
//! Each script runs at one tick, the tick at which the adversary delivers its request.
//! What each step mirrors:
//!
//! | step | Lua script |
//! |---|---|
//! | [`Op::Acquire`], plain | `proto::scripts::ACQUIRE` |
//! | [`Op::Acquire`], fair | `proto::fair_scripts::FAIR_ACQUIRE` (with `grant` of its `COMMON`) |
//! | [`Op::Release`], plain | `proto::scripts::RELEASE` |
//! | [`Op::Release`], fair | `proto::fair_scripts::FAIR_RELEASE` (`pass_on`) |
//! | [`Op::Extend`] | `proto::renewal::EXTEND` (one key and its lease record) |
//! | [`Op::Leave`] | `proto::fair_scripts::FAIR_LEAVE` |
//!
//! Left out: the contention marks (`c<client id>`, the mark key), which only steer the
//! local fairness budget (the model lets a holder hand off or release as it likes), and
//! keyspace notifications (waiters also wake at the holder's remaining lease and at the
//! re-check ceiling, which the model keeps).

use crate::config::{Config, Mode, Rules};

/// A lock token: the process and the number of its wait (fair: one token per wait) or
/// attempt (plain: one per attempt).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token {
    pub proc: u8,
    pub n: u8,
}

/// The lock key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub token: Token,
    /// The tick at which the key expires: present while `now < expires` (`PX`).
    pub expires: u8,
    /// The sequence number of the last lease change applied to this hold (the lease
    /// record `<n>:<token>`): 0 when the key is set (acquisition or grant) or once the
    /// record expired; a lease change numbered `n` applies only if `n >= seq`, and then
    /// stores `n`. The holder numbers its changes 1, 2, … in the order it sends them, so
    /// an older change never overwrites a newer one's TTL.
    pub seq: u8,
    /// When the lease record expires: it is written with the lease of the change it
    /// records (`PX`), so it can end before the key does once an acquisition's refresh
    /// lengthened the key (0 while there is no record).
    pub record_expires: u8,
}

/// An entry of the fair queue (`L:q` for the order, `L:qx` for the expiry).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Entry {
    pub token: Token,
    /// The nonce of the latest attempt that queued or refreshed it (`L:qn`).
    pub nonce: u8,
    /// Dead once `now >= expires` (`ZRANGEBYSCORE qx -inf now`).
    pub expires: u8,
}

/// A script call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// An acquisition attempt that waits if it fails (queues, fair); `nonce`: the
    /// attempt's, stored with the queue entry it queues or refreshes (fair).
    Acquire { token: Token, nonce: u8 },
    /// Compare-and-delete, or in fair mode a pass to the head of the queue. `fence`: the
    /// holder's, whose release marks the counter released; `None`: an attempt nobody used
    /// is given back (the cleanup after a lost reply), which leaves the counter saying
    /// what the hold before it said.
    Release { token: Token, fence: Option<u8> },
    /// A lease change: the watchdog's renewal (`renew`) or the holder's `extend`.
    Extend {
        token: Token,
        lease: u8,
        seq: u8,
        renew: bool,
    },
    /// A waiter that gave up leaves the queue and passes on a grant that raced it.
    Leave { token: Token },
}

impl crate::net::GiveBack for Op {
    fn is_leave(&self) -> bool {
        matches!(self, Op::Leave { .. })
    }
}

impl Op {
    pub fn token(&self) -> Token {
        match *self {
            Op::Acquire { token, .. }
            | Op::Release { token, .. }
            | Op::Extend { token, .. }
            | Op::Leave { token } => token,
        }
    }
}

/// A script's reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Answer {
    /// `{1, fence, after lost}`. `fresh`: the key was set by this call (else it held our
    /// token already: a grant, or a retry after a lost reply). Only the model reads
    /// `fresh`. `previous_lost`: the hold before ended without a release, as the counter
    /// said.
    Won {
        fence: u8,
        fresh: bool,
        previous_lost: bool,
    },
    /// `{0, pttl}`.
    Held { pttl: u8 },
    /// Release: 1 (released) or 2 (passed to the next waiter).
    Released,
    /// Extend: 1.
    Extended,
    /// Extend refused: a newer change of this hold applied already.
    Stale,
    /// 0: the key was gone.
    Gone,
    /// -1: another token holds it.
    Other,
}

/// A message published on the lock's channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Publish {
    /// `r`: released.
    Released,
    /// `g<token>:<nonce>:<fence>:<grant ms>`: granted to `token`, whose entry held the
    /// nonce `nonce`, or 0 after a hold that ended without a release (the grant lease is
    /// the configuration's).
    Granted { token: Token, nonce: u8, fence: u8 },
}

/// The fence counter (`FENCE_FN`): the last fence, and whether its hold is marked held
/// (`-<f>`, `-0<f>`; else released, `<f>`), and if so whether that hold began after a
/// hold that ended without a release (`-0<f>`). The model never loses the counter: with
/// it gone there is nothing to tell, and fences start again at the server's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Counter {
    pub fence: u8,
    pub held: bool,
    pub after_lost: bool,
}

/// Ghost state, not in Redis: what an acquisition must be told, from the events alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Truth {
    /// Whether the last hold ended without a release: its key expired, be it an
    /// acquisition's or a grant's (a grantee may hold the lock from the message alone, so
    /// a grant that expires unconfirmed may have been held). A holder's release clears it;
    /// an attempt given back unused leaves it as the hold before it left it. It changes
    /// only as a hold ends, so while a key lives it is what that hold's holder must be
    /// told.
    pub lost: bool,
    /// An answer differed from the truth.
    pub wrong: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Redis {
    pub lock: Option<Key>,
    /// The fence counter (`SET … GET` of `FENCE_FN`).
    pub fence: Counter,
    /// The fair queue in arrival order.
    pub queue: Vec<Entry>,
    pub truth: Truth,
}

impl Redis {
    /// Drops what has expired by `now`. Redis expires lazily, and the fair scripts prune
    /// before they read the queue (`prune` of `COMMON`); doing it eagerly at every tick
    /// gives the same results and keeps states canonical.
    pub fn expire(&mut self, now: u8) {
        if self.lock.is_some_and(|k| k.expires <= now) {
            // The hold ended without a release: news for the next holder.
            self.truth.lost = true;
            self.lock = None;
        }
        if let Some(k) = &mut self.lock
            && k.seq > 0
            && k.record_expires <= now
        {
            // The lease record is gone: no change of this hold is known applied.
            k.seq = 0;
            k.record_expires = 0;
        }
        self.queue.retain(|e| e.expires > now);
    }

    /// Runs `op` at `now`: the reply, and what it published.
    pub fn run(&mut self, cfg: &Config, now: u8, op: Op) -> (Answer, Option<Publish>) {
        match (op, cfg.mode) {
            (Op::Acquire { token, .. }, Mode::Plain) => (self.acquire(cfg, now, token), None),
            (Op::Acquire { token, nonce }, Mode::Fair) => self.fair_acquire(cfg, now, token, nonce),
            (Op::Release { token, fence }, Mode::Plain) => self.release(&cfg.rules, token, fence),
            (Op::Release { token, fence }, Mode::Fair) => self.fair_release(cfg, now, token, fence),
            (
                Op::Extend {
                    token, lease, seq, ..
                },
                _,
            ) => (self.extend(&cfg.rules, now, token, lease, seq), None),
            (Op::Leave { token }, _) => self.leave(cfg, now, token),
        }
    }

    /// Sets the key to `token` and issues the next fence (`next_fence` of `FENCE_FN`),
    /// the counter written held: an acquisition's hold, and a grant's too, since its
    /// grantee may hold the lock from the message alone. `after_lost`: what the new hold
    /// is told of the hold before; `None` to learn it from the counter (held: that hold
    /// was never released), as an acquisition does. Returns the fence and what the
    /// holder is told.
    fn set(&mut self, token: Token, expires: u8, after_lost: Option<bool>) -> (u8, bool) {
        let told = after_lost.unwrap_or(self.fence.held);
        let fence = self.fence.fence + 1;
        self.fence = Counter {
            fence,
            held: true,
            after_lost: told,
        };
        self.lock = Some(Key {
            token,
            expires,
            seq: 0,
            record_expires: 0,
        });
        (fence, told)
    }

    /// An answer telling a holder `told` of the hold before it: checked against the truth.
    pub fn answer(&mut self, told: bool) {
        if told != self.truth.lost {
            self.truth.wrong = true;
        }
    }

    /// A grantee holds the lock from a grant message to `token` alone, told that nothing
    /// was lost: checked while the grant's key lives. (It does whenever a grantee may
    /// trust its grant: the key lasts the grant lease from the grant, which ran after the
    /// attempt whose send bounds the grantee's validity. Only the broken
    /// `Grants::FromHearing` reads a grant after its key is gone, which mutual exclusion
    /// judges.)
    pub fn trusted(&mut self, token: Token) {
        if self.lock.is_some_and(|k| k.token == token) {
            self.answer(false);
        }
    }

    /// A holder that finds its own token confirms its hold (`hold_fence` of `FENCE_FN`):
    /// the counter as it is (marked held if it was not), and what it says of the hold
    /// before.
    fn confirm(&mut self) -> Answer {
        let told = self.fence.held && self.fence.after_lost;
        self.fence.held = true;
        self.answer(told);
        Answer::Won {
            fence: self.fence.fence,
            fresh: false,
            previous_lost: told,
        }
    }

    /// The ghost as the key's hold ends by a call: a holder's release (`fence`) is clean;
    /// an attempt given back unused changes nothing.
    fn ended(&mut self, fence: Option<u8>) {
        if fence.is_some() {
            self.truth.lost = false;
        }
    }

    /// Whether the key's hold, ending by a call, leaves a loss as news for the next
    /// holder: only an attempt given back unused (`fence` `None`) that had been told of
    /// one (`-0<f>`), with `Rules::transparent_give_back`.
    fn loss_left(&self, rules: &Rules, fence: Option<u8>) -> bool {
        fence.is_none() && rules.transparent_give_back && self.fence.held && self.fence.after_lost
    }

    /// The counter as the key's hold ends with nobody to grant it to (`end_fence` of
    /// `END_FENCE_FN`): a holder's release writes its fence back, released; an attempt
    /// nobody used marks it released unless it leaves a loss as news.
    fn end(&mut self, rules: &Rules, fence: Option<u8>) {
        if !self.loss_left(rules, fence) {
            // The library writes the holder's fence back. It can be below the counter:
            // the token was granted again meanwhile (its first send, landing late, queued
            // it while it held). The next fence is still above every fence before, as
            // `next_fence` is at least the server's clock; the model's counter has no
            // clock, and keeps the larger, which orders the next fence the same way.
            self.fence.fence = fence.map_or(self.fence.fence, |f| f.max(self.fence.fence));
            self.fence.held = false;
        }
        self.ended(fence);
    }

    /// The `PEXPIRE` of an acquisition that finds its own token (a retry after a lost
    /// reply, a first send that landed after its retry, a grant's confirmation): only
    /// when it lengthens the lease (`PTTL < lease`), whatever lease changes applied
    /// before, so that an attempt delayed on the way never cuts short a longer lease an
    /// extend set since. It neither reads nor writes the lease record. Without
    /// `Rules::refresh_lengthens`, the lease is set whatever it was (the library before
    /// the lease-change fix).
    fn refresh(&mut self, rules: &Rules, now: u8, lease: u8) {
        if let Some(k) = &mut self.lock {
            if rules.refresh_lengthens {
                k.expires = k.expires.max(now + lease);
            } else {
                k.expires = now + lease;
            }
        }
    }

    fn pttl(&self, now: u8) -> u8 {
        self.lock.map_or(0, |k| k.expires - now)
    }

    /// `ACQUIRE`: `SET NX PX` and the next fence; our own token refreshes the lease.
    fn acquire(&mut self, cfg: &Config, now: u8, token: Token) -> Answer {
        match self.lock {
            None => self.take(token, now + cfg.lease),
            Some(k) if k.token == token => {
                self.refresh(&cfg.rules, now, cfg.lease);
                self.confirm()
            }
            Some(_) => Answer::Held {
                pttl: self.pttl(now),
            },
        }
    }

    /// `take_fenced`: the key is free, and ours.
    fn take(&mut self, token: Token, expires: u8) -> Answer {
        let (fence, previous_lost) = self.set(token, expires, None);
        self.answer(previous_lost);
        Answer::Won {
            fence,
            fresh: true,
            previous_lost,
        }
    }

    /// `FAIR_ACQUIRE`.
    fn fair_acquire(
        &mut self,
        cfg: &Config,
        now: u8,
        token: Token,
        nonce: u8,
    ) -> (Answer, Option<Publish>) {
        let mut published = None;
        match self.lock {
            Some(k) if k.token == token => {
                self.refresh(&cfg.rules, now, cfg.lease);
                self.dequeue(token);
                return (self.confirm(), None);
            }
            Some(_) => {}
            None => match self.queue.first().copied() {
                None => return (self.take(token, now + cfg.lease), None),
                Some(head) if head.token == token => {
                    let won = self.take(token, now + cfg.lease);
                    self.dequeue(token);
                    return (won, None);
                }
                // Free with a live head: the hold before ended, as the counter says.
                Some(head) => published = Some(self.grant(cfg, now, head, None)),
            },
        }
        // Queue us (`ZADD NX` keeps our place, the expiry and the nonce are refreshed).
        let expires = now + cfg.entry_ttl();
        match self.queue.iter_mut().find(|e| e.token == token) {
            Some(e) => {
                e.expires = expires;
                e.nonce = nonce;
            }
            None => self.queue.push(Entry {
                token,
                nonce,
                expires,
            }),
        }
        (
            Answer::Held {
                pttl: self.pttl(now),
            },
            published,
        )
    }

    /// `grant` of `COMMON`: the key to `head` for the grant lease, out of the queue, and
    /// `g<head>:<nonce>:<fence>:<grant ms>` published with the nonce its entry held;
    /// `after_lost` as for [`Redis::set`]. A grant after a loss carries nonce 0
    /// (`Rules::confirm_after_loss`): its grantee never trusts it, and the reply to the
    /// attempt that confirms it tells it of the loss.
    fn grant(&mut self, cfg: &Config, now: u8, head: Entry, after_lost: Option<bool>) -> Publish {
        let (fence, told) = self.set(head.token, now + cfg.grant_lease, after_lost);
        self.dequeue(head.token);
        let nonce = if told && cfg.rules.confirm_after_loss {
            0
        } else {
            head.nonce
        };
        Publish::Granted {
            token: head.token,
            nonce,
            fence,
        }
    }

    fn dequeue(&mut self, token: Token) {
        self.queue.retain(|e| e.token != token);
    }

    /// `pass_on` of `COMMON`: grant to the head, or delete and publish `r`; `fence`: the
    /// holder's, or `None` for a hold given back unused. A grant tells its grantee nothing
    /// was lost after a holder's release, else what the given-back hold had been told
    /// (`grant_lost`).
    fn pass_on(&mut self, cfg: &Config, now: u8, fence: Option<u8>) -> Publish {
        match self.queue.first().copied() {
            Some(head) => {
                let told = self.loss_left(&cfg.rules, fence);
                self.ended(fence);
                self.grant(cfg, now, head, Some(told))
            }
            None => {
                self.lock = None;
                self.end(&cfg.rules, fence);
                Publish::Released
            }
        }
    }

    /// Whether `token` holds the key: the compare of every compare-and-… script.
    fn compare(&self, token: Token) -> Result<(), Answer> {
        match self.lock {
            None => Err(Answer::Gone),
            Some(k) if k.token == token => Ok(()),
            Some(_) => Err(Answer::Other),
        }
    }

    /// `RELEASE`.
    fn release(
        &mut self,
        rules: &Rules,
        token: Token,
        fence: Option<u8>,
    ) -> (Answer, Option<Publish>) {
        match self.compare(token) {
            Ok(()) => {
                self.lock = None;
                self.end(rules, fence);
                (Answer::Released, Some(Publish::Released))
            }
            Err(answer) => (answer, None),
        }
    }

    /// `FAIR_RELEASE`.
    fn fair_release(
        &mut self,
        cfg: &Config,
        now: u8,
        token: Token,
        fence: Option<u8>,
    ) -> (Answer, Option<Publish>) {
        match self.compare(token) {
            Ok(()) => (Answer::Released, Some(self.pass_on(cfg, now, fence))),
            Err(answer) => (answer, None),
        }
    }

    /// `FAIR_LEAVE`: a grant that raced the leaving is given back unused.
    fn leave(&mut self, cfg: &Config, now: u8, token: Token) -> (Answer, Option<Publish>) {
        self.dequeue(token);
        match self.compare(token) {
            Ok(()) => (Answer::Released, Some(self.pass_on(cfg, now, None))),
            Err(_) => (Answer::Gone, None),
        }
    }

    /// `EXTEND` of one key, ordered by the change's sequence number.
    fn extend(&mut self, rules: &Rules, now: u8, token: Token, lease: u8, seq: u8) -> Answer {
        if let Err(answer) = self.compare(token) {
            return answer;
        }
        let Some(k) = &mut self.lock else {
            return Answer::Gone;
        };
        if rules.ordered_changes && seq < k.seq {
            return Answer::Stale;
        }
        k.expires = now + lease;
        if rules.ordered_changes {
            // `SET record <n>:<token> PX lease`.
            k.seq = seq;
            k.record_expires = now + lease;
        }
        Answer::Extended
    }
}
