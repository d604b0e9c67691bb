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
//! | [`Op::Extend`] | `proto::scripts::EXTEND` (one key), with the lease-change order |
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
    /// The sequence number of the last lease change applied to this hold: 0 when the key
    /// is set (acquisition or grant); a lease change numbered `n` applies only if
    /// `n >= seq`, and then stores `n`. The holder numbers its changes 1, 2, … in the
    /// order it sends them, so an older change never overwrites a newer one's TTL.
    pub seq: u8,
    /// Ghost: whether the hold counts as one that can be lost: set by an acquisition, or
    /// a grant once its grantee's attempt confirmed it (a grant nobody confirmed is
    /// transparent).
    pub counts: bool,
    /// Ghost: what this hold's holder must be told (`Truth::lost`, when it began).
    pub told: bool,
}

/// An entry of the fair queue (`L:q` for the order, `L:qx` for the expiry).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Entry {
    pub token: Token,
    /// Dead once `now >= expires` (`ZRANGEBYSCORE qx -inf now`).
    pub expires: u8,
}

/// A script call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// An acquisition attempt that waits if it fails (queues, fair).
    Acquire { token: Token },
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

impl Op {
    pub fn token(&self) -> Token {
        match *self {
            Op::Acquire { token }
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
    /// `g<token>:<fence>`: granted to `token`.
    Granted { token: Token, fence: u8 },
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
    /// Whether the last hold that counts (see `Key::counts`) ended without a release: its
    /// key expired. A holder's release clears it; a hold given back without use leaves it.
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
        if let Some(k) = self.lock.filter(|k| k.expires <= now) {
            // The hold ended without a release: news for the next holder, if it counts.
            self.truth.lost |= k.counts;
            self.lock = None;
        }
        self.queue.retain(|e| e.expires > now);
    }

    /// Runs `op` at `now`: the reply, and what it published.
    pub fn run(&mut self, cfg: &Config, now: u8, op: Op) -> (Answer, Option<Publish>) {
        match (op, cfg.mode) {
            (Op::Acquire { token }, Mode::Plain) => (self.acquire(cfg, now, token), None),
            (Op::Acquire { token }, Mode::Fair) => self.fair_acquire(cfg, now, token),
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

    /// Sets the key to `token` and issues the next fence (`next_fence` of `FENCE_FN`): an
    /// acquisition (`grant` is `None`) marks the counter held and learns from it whether
    /// the hold before was left unreleased; a grant says what its grantee is told, and is
    /// issued in the released form unless that is a loss, so that a grant nobody
    /// confirms is no loss when it expires. Returns the fence and what the holder is told.
    fn set(&mut self, rules: &Rules, token: Token, expires: u8, grant: Option<bool>) -> (u8, bool) {
        let told = grant.unwrap_or(self.fence.held);
        let fence = self.fence.fence + 1;
        self.fence = Counter {
            fence,
            held: grant.is_none() || told || !rules.transparent_unused,
            after_lost: told,
        };
        self.lock = Some(Key {
            token,
            expires,
            seq: 0,
            counts: grant.is_none(),
            told: self.truth.lost,
        });
        if told != self.truth.lost {
            self.truth.wrong = true;
        }
        (fence, told)
    }

    /// A holder that finds its own token confirms its hold (`hold_fence` of `FENCE_FN`):
    /// the counter as it is, marked held if a grant left it released. The answer, checked
    /// against what the holder must be told.
    fn confirm(&mut self) -> Answer {
        let told = self.fence.held && self.fence.after_lost;
        self.fence.held = true;
        if let Some(k) = &mut self.lock {
            k.counts = true;
            if told != k.told {
                self.truth.wrong = true;
            }
        }
        Answer::Won {
            fence: self.fence.fence,
            fresh: false,
            previous_lost: told,
        }
    }

    /// The key's hold ended by a release or a give-back (`fence`: `end_fence` of
    /// `END_FENCE_FN`): a holder's release writes its fence back, released; an attempt
    /// nobody used leaves a loss as news for the next holder.
    fn end(&mut self, rules: &Rules, fence: Option<u8>) {
        match fence {
            Some(f) => {
                self.fence.fence = f;
                self.fence.held = false;
                self.truth.lost = false;
            }
            None if !self.fence.after_lost || !rules.transparent_unused => {
                self.fence.held = false;
            }
            None => {}
        }
    }

    /// What a grant made when the key's hold ended this way tells its grantee
    /// (`grant_lost` of `fair_scripts`): nothing after a holder's release, else what the
    /// given-back hold had been told.
    fn grant_told(&mut self, fence: Option<u8>) -> bool {
        match fence {
            Some(_) => {
                self.truth.lost = false;
                false
            }
            None => self.fence.held && self.fence.after_lost,
        }
    }

    /// The `PEXPIRE` of an acquisition that finds its own token: change number 0.
    fn refresh(&mut self, rules: &Rules, now: u8, lease: u8) {
        if let Some(k) = &mut self.lock
            && (!rules.ordered_changes || !rules.ordered_refresh || k.seq == 0)
        {
            k.expires = now + lease;
        }
    }

    fn pttl(&self, now: u8) -> u8 {
        self.lock.map_or(0, |k| k.expires - now)
    }

    /// `ACQUIRE`: `SET NX PX` and the next fence; our own token refreshes the lease.
    fn acquire(&mut self, cfg: &Config, now: u8, token: Token) -> Answer {
        match self.lock {
            None => self.take(&cfg.rules, token, now + cfg.lease),
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
    fn take(&mut self, rules: &Rules, token: Token, expires: u8) -> Answer {
        let (fence, previous_lost) = self.set(rules, token, expires, None);
        Answer::Won {
            fence,
            fresh: true,
            previous_lost,
        }
    }

    /// `FAIR_ACQUIRE`.
    fn fair_acquire(&mut self, cfg: &Config, now: u8, token: Token) -> (Answer, Option<Publish>) {
        let mut published = None;
        match self.lock {
            Some(k) if k.token == token => {
                self.refresh(&cfg.rules, now, cfg.lease);
                self.dequeue(token);
                return (self.confirm(), None);
            }
            Some(_) => {}
            None => match self.queue.first().map(|e| e.token) {
                None => return (self.take(&cfg.rules, token, now + cfg.lease), None),
                Some(head) if head == token => {
                    let won = self.take(&cfg.rules, token, now + cfg.lease);
                    self.dequeue(token);
                    return (won, None);
                }
                // Free with a live head: the hold before ended, as the counter says.
                Some(head) => {
                    let told = self.fence.held;
                    published = Some(self.grant(cfg, now, head, told));
                }
            },
        }
        // Queue us (`ZADD NX` keeps our place, the expiry is refreshed).
        let expires = now + cfg.entry_ttl();
        match self.queue.iter_mut().find(|e| e.token == token) {
            Some(e) => e.expires = expires,
            None => self.queue.push(Entry { token, expires }),
        }
        (
            Answer::Held {
                pttl: self.pttl(now),
            },
            published,
        )
    }

    /// `grant` of `COMMON`: the key to `head` for the grant lease, out of the queue, and
    /// `g<head>:<fence>` published; `told`: what the grantee is told of the hold before.
    fn grant(&mut self, cfg: &Config, now: u8, head: Token, told: bool) -> Publish {
        let (fence, _) = self.set(&cfg.rules, head, now + cfg.grant_lease, Some(told));
        self.dequeue(head);
        Publish::Granted { token: head, fence }
    }

    fn dequeue(&mut self, token: Token) {
        self.queue.retain(|e| e.token != token);
    }

    /// `pass_on` of `COMMON`: grant to the head, or delete and publish `r`; `fence`: the
    /// holder's, or `None` for a hold given back unused.
    fn pass_on(&mut self, cfg: &Config, now: u8, fence: Option<u8>) -> Publish {
        match self.queue.first() {
            Some(head) => {
                let head = head.token;
                let told = self.grant_told(fence);
                self.grant(cfg, now, head, told)
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
        k.seq = k.seq.max(seq);
        Answer::Extended
    }
}
