//! The Redis server: the lock key with its TTL, the fence counter and the fair queue, and
//! the scripts as atomic steps on them.
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
    /// Compare-and-delete, or in fair mode a pass to the head of the queue.
    Release { token: Token },
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
            Op::Acquire { token, .. }
            | Op::Release { token }
            | Op::Extend { token, .. }
            | Op::Leave { token } => token,
        }
    }
}

/// A script's reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Answer {
    /// `{1, fence}`. `fresh`: the key was set by this call (else it held our token
    /// already: a grant, or a retry after a lost reply). Only the model reads `fresh`.
    Won { fence: u8, fresh: bool },
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
    /// nonce `nonce` (the grant lease is the configuration's).
    Granted { token: Token, nonce: u8, fence: u8 },
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Redis {
    pub lock: Option<Key>,
    /// The fence counter (`INCR`).
    pub fence: u8,
    /// The fair queue in arrival order.
    pub queue: Vec<Entry>,
}

impl Redis {
    /// Drops what has expired by `now`. Redis expires lazily, and the fair scripts prune
    /// before they read the queue (`prune` of `COMMON`); doing it eagerly at every tick
    /// gives the same results and keeps states canonical.
    pub fn expire(&mut self, now: u8) {
        if self.lock.is_some_and(|k| k.expires <= now) {
            self.lock = None;
        }
        self.queue.retain(|e| e.expires > now);
    }

    /// Runs `op` at `now`: the reply, and what it published.
    pub fn run(&mut self, cfg: &Config, now: u8, op: Op) -> (Answer, Option<Publish>) {
        match (op, cfg.mode) {
            (Op::Acquire { token, .. }, Mode::Plain) => (self.acquire(cfg, now, token), None),
            (Op::Acquire { token, nonce }, Mode::Fair) => self.fair_acquire(cfg, now, token, nonce),
            (Op::Release { token }, Mode::Plain) => self.release(token),
            (Op::Release { token }, Mode::Fair) => self.fair_release(cfg, now, token),
            (
                Op::Extend {
                    token, lease, seq, ..
                },
                _,
            ) => (self.extend(&cfg.rules, now, token, lease, seq), None),
            (Op::Leave { token }, _) => self.leave(cfg, now, token),
        }
    }

    /// Sets the key to `token` and increments the fence.
    fn set(&mut self, token: Token, expires: u8) -> u8 {
        self.lock = Some(Key {
            token,
            expires,
            seq: 0,
        });
        self.fence += 1;
        self.fence
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

    /// `ACQUIRE`: `SET NX PX` and `INCR`; our own token refreshes the lease.
    fn acquire(&mut self, cfg: &Config, now: u8, token: Token) -> Answer {
        match self.lock {
            None => Answer::Won {
                fence: self.set(token, now + cfg.lease),
                fresh: true,
            },
            Some(k) if k.token == token => {
                self.refresh(&cfg.rules, now, cfg.lease);
                Answer::Won {
                    fence: self.fence,
                    fresh: false,
                }
            }
            Some(_) => Answer::Held {
                pttl: self.pttl(now),
            },
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
                return (
                    Answer::Won {
                        fence: self.fence,
                        fresh: false,
                    },
                    None,
                );
            }
            Some(_) => {}
            None => match self.queue.first().copied() {
                None => {
                    let fence = self.set(token, now + cfg.lease);
                    return (Answer::Won { fence, fresh: true }, None);
                }
                Some(head) if head.token == token => {
                    let fence = self.set(token, now + cfg.lease);
                    self.dequeue(token);
                    return (Answer::Won { fence, fresh: true }, None);
                }
                Some(head) => published = Some(self.grant(cfg, now, head)),
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
    /// `g<head>:<nonce>:<fence>:<grant ms>` published with the nonce its entry held.
    fn grant(&mut self, cfg: &Config, now: u8, head: Entry) -> Publish {
        let fence = self.set(head.token, now + cfg.grant_lease);
        self.dequeue(head.token);
        Publish::Granted {
            token: head.token,
            nonce: head.nonce,
            fence,
        }
    }

    fn dequeue(&mut self, token: Token) {
        self.queue.retain(|e| e.token != token);
    }

    /// `pass_on` of `COMMON`: grant to the head, or delete and publish `r`.
    fn pass_on(&mut self, cfg: &Config, now: u8) -> Publish {
        match self.queue.first().copied() {
            Some(head) => self.grant(cfg, now, head),
            None => {
                self.lock = None;
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
    fn release(&mut self, token: Token) -> (Answer, Option<Publish>) {
        match self.compare(token) {
            Ok(()) => {
                self.lock = None;
                (Answer::Released, Some(Publish::Released))
            }
            Err(answer) => (answer, None),
        }
    }

    /// `FAIR_RELEASE`.
    fn fair_release(&mut self, cfg: &Config, now: u8, token: Token) -> (Answer, Option<Publish>) {
        match self.compare(token) {
            Ok(()) => (Answer::Released, Some(self.pass_on(cfg, now))),
            Err(answer) => (answer, None),
        }
    }

    /// `FAIR_LEAVE`.
    fn leave(&mut self, cfg: &Config, now: u8, token: Token) -> (Answer, Option<Publish>) {
        self.dequeue(token);
        match self.compare(token) {
            Ok(()) => (Answer::Released, Some(self.pass_on(cfg, now))),
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
